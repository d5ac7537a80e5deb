//! kvtier-core: block identity, KV layout and the crate-wide error type.
//!
//! This crate does no I/O. It defines what a block *is* (its [`BlockKey`], made by the chained
//! [`PrefixHasher`] under a [`Namespace`]) and how its bytes are laid out ([`KvLayout`]).
//! Every other kvtier crate depends on it; it depends on no other kvtier crate.

mod error;
pub mod key;
pub mod key_map;
pub mod layout;
pub mod protocol;
pub mod rng;
pub mod slot_table;

pub use error::CoreError;
pub use key::{BlockKey, HashScheme, HashSecret, Namespace, NamespaceBuilder, PrefixHasher};
pub use key_map::KeyMap;
pub use layout::{Dtype, KvKind, KvLayout, KvTensor};
pub use rng::SplitMix64;

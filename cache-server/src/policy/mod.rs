//! Policies: small named types, each testable alone. The store consults them; they do no I/O
//! and hold no locks of their own.

pub mod admission;
pub mod demotion;
pub mod eviction;

pub use admission::{Admission, AdmissionPolicy};
pub use demotion::{DemotionPolicy, PromotionPolicy};
pub use eviction::{
    ChainAwareTuning, EvictionKind, EvictionPolicy, Horizon, InsertContext, LookupContext,
};

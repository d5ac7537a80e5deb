//! kvtier-server: the tiered block store and the sidecar daemon around it.
//!
//! * [`tier`]: fixed-slot block devices: the DRAM arena and the NVMe slot files the store runs
//!   on, and an HBM tier behind the `cuda` feature that the store does not use yet.
//! * [`policy`]: eviction, demotion, promotion and admission, each a small type.
//! * [`store`]: the index and the [`TieredStore`] over a DRAM tier and an optional NVMe tier;
//!   [`config`] builds it, [`stats`] counts per tier, [`clock`] is its time, [`io_pool`] runs
//!   its NVMe I/O.
//! * [`server`]: the sidecar daemon: Unix socket (with the zero-copy path through the mapped
//!   DRAM arena), TCP and QUIC listeners, the block event stream, metrics and the HTTP admin
//!   port, and its configuration.
//! * [`replay`]: a block-hash trace replayed through a store, for eviction policy hit rates.
//!
//! The `kvtier-server` binary runs the daemon; its demonstration (a worker playing against it
//! through the client SDK) is `kvtier-bench server-demo`, so this crate does not depend on the
//! SDK.

pub mod clock;
pub mod config;
mod error;
pub mod io_pool;
mod keyhash;
pub mod policy;
pub mod replay;
pub mod server;
pub mod stats;
pub mod store;
pub mod tier;

pub use config::{NvmeSettings, StoreConfig};
pub use error::StoreError;
pub use stats::{StoreStats, TierStats};
pub use store::{
    EventSink, GetOutcome, Lease, MissReason, OpenReport, PinnedBlock, PinnedRead, PutOutcome,
    Reservation, SnapshotEntry, StoreEvent, StoreEventKind, TieredStore,
};
pub use tier::TierKind;

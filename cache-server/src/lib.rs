//! kvtier-server: the tiered block store and (next) the sidecar daemon around it.
//!
//! * [`tier`]: fixed-slot block devices (DRAM arena, NVMe files, HBM behind `cuda`).
//! * [`policy`]: eviction, demotion, promotion and admission, each a small type.
//! * [`store`]: the index and the [`TieredStore`] that ties them together.

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

pub use config::{DeviceMemory, HbmSettings, NvmeSettings, StoreConfig};
pub use error::StoreError;
pub use stats::{StoreStats, TierStats};
pub use store::{
    EventSink, GetOutcome, Lease, MissReason, OpenReport, PinnedBlock, PinnedRead, PutOutcome,
    Reservation, SnapshotEntry, StoreEvent, StoreEventKind, TieredStore,
};
pub use tier::TierKind;

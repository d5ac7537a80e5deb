//! kvtier-server: the tiered block store and the sidecar daemon around it.
//!
//! * [`tier`]: fixed-slot block devices: the DRAM arena, the NVMe slot files, and an HBM tier
//!   (device memory) behind the `cuda` feature.
//! * [`policy`]: eviction, demotion, promotion and admission, each a small type.
//! * [`store`]: the index and the [`TieredStore`] over an ordered list of tiers, fastest first
//!   (HBM where configured and present, DRAM, NVMe where configured; the HBM position has run
//!   only against a test double of device memory, not yet on a GPU); [`config`] builds it,
//!   [`stats`] counts per tier, [`clock`] is its time, [`io_pool`] runs its NVMe I/O.
//! * [`server`]: the sidecar daemon: Unix socket (with the zero-copy path through the mapped
//!   DRAM arena), TCP and QUIC listeners, the block event stream, metrics and the HTTP admin
//!   port, and its configuration.
//! * [`cluster`]: membership of a cluster of servers on etcd (the driver behind the `cluster`
//!   feature), the membership view and placement by weighted rendezvous hashing. The data
//!   path between members (peer lookup and fetch, replication of puts) is not built yet.
//! * [`replay`]: a block-hash trace replayed through a store, for eviction policy hit rates.
//!
//! The `kvtier-server` binary runs the daemon; its demonstration (a worker playing against it
//! through the client SDK) is `kvtier-bench server-demo`, so this crate does not depend on the
//! SDK.

pub mod clock;
pub mod cluster;
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
pub use stats::{RetainStats, StoreStats, TierStats};
pub use store::{
    Announcement, EventSink, GetOutcome, Lease, LookupHold, MissReason, OpenReport, PinnedBlock,
    PinnedRead, PutOutcome, Reservation, RetainOutcome, RetainRequest, SnapshotEntry, StoreEvent,
    StoreEventKind, TieredStore,
};
pub use tier::TierKind;

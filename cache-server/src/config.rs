//! Configuration of the tiered store. Each field's doc ends with its default.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::KvLayout;

use crate::clock::{Clock, SystemClock};
use crate::policy::{AdmissionPolicy, DemotionPolicy, EvictionKind, PromotionPolicy};

/// Builds a [`crate::store::TieredStore`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Layout of every block; its size sets the slot size. Required.
    pub layout: KvLayout,
    /// DRAM arena ceiling in bytes. Required (the server sizes it from available memory).
    pub dram_capacity_bytes: u64,
    /// Reserve the DRAM arena's memory at start. Default: true.
    pub dram_prefault: bool,
    /// NVMe tier, if any. Default: none.
    pub nvme: Option<NvmeSettings>,
    /// DRAM tier eviction. Default: [`EvictionKind::ChainAware`].
    pub eviction: EvictionKind,
    /// NVMe tier eviction. Default: [`EvictionKind::LeafLru`] (about 25 bytes a slot; at
    /// NVMe capacities the default policy's protection is off and it behaves the same).
    pub nvme_eviction: EvictionKind,
    /// Default: write-through.
    pub demotion: DemotionPolicy,
    /// Default: promote on hit.
    pub promotion: PromotionPolicy,
    /// Default: refuse new blocks past 1,024 queued background jobs.
    pub admission: AdmissionPolicy,
    /// Threads doing tier I/O. Default: 4.
    pub io_threads: usize,
    /// Index shards (rounded up to a power of two). Default: 64.
    pub shards: usize,
    /// Longest lease a pin may ask for. Default: 30 s.
    pub max_lease: Duration,
    /// Time as the policies see it. Default: the system's monotonic clock.
    pub clock: Arc<dyn Clock>,
}

/// Where and how large the NVMe tier is.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NvmeSettings {
    /// Directory of the slot files. Default (server): `./kvtier-data`.
    pub dir: PathBuf,
    /// Bytes of slot files, headers included.
    pub capacity_bytes: u64,
    /// Use O_DIRECT where the file system allows it. Default: true.
    pub direct_io: bool,
    /// Largest slot file. Default: 1 GiB.
    pub file_bytes: u64,
}

impl NvmeSettings {
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            direct_io: true,
            file_bytes: 1 << 30,
        }
    }
}

impl StoreConfig {
    pub fn new(layout: KvLayout, dram_capacity_bytes: u64) -> Self {
        Self {
            layout,
            dram_capacity_bytes,
            dram_prefault: true,
            nvme: None,
            eviction: EvictionKind::default(),
            nvme_eviction: EvictionKind::LeafLru,
            demotion: DemotionPolicy::default(),
            promotion: PromotionPolicy::default(),
            admission: AdmissionPolicy::default(),
            io_threads: 4,
            shards: 64,
            max_lease: Duration::from_secs(30),
            clock: Arc::new(SystemClock::default()),
        }
    }

    pub fn with_nvme(mut self, nvme: NvmeSettings) -> Self {
        self.nvme = Some(nvme);
        self
    }
}

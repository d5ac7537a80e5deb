//! Configuration of the tiered store. Each field's doc ends with its default.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::KvLayout;

use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::policy::{
    AdmissionPolicy, ChainAwareTuning, DemotionPolicy, EvictionKind, PromotionPolicy,
};
use crate::tier::{Tier, TierError, TierKind};

/// Builds a [`crate::store::TieredStore`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Layout of every block; its size sets the slot size. Required.
    pub layout: KvLayout,
    /// The tiers, fastest first, each at most once; DRAM is required (it serves puts and the
    /// local zero-copy path). Empty means: HBM when [`StoreConfig::hbm`] is set, DRAM, and
    /// NVMe when [`StoreConfig::nvme`] is set. Default: empty.
    pub tiers: Vec<TierKind>,
    /// HBM tier, if any. Default: none.
    pub hbm: Option<HbmSettings>,
    /// DRAM arena ceiling in bytes. Required (the server sizes it from available memory).
    pub dram_capacity_bytes: u64,
    /// Reserve the DRAM arena's memory at start. Default: true.
    pub dram_prefault: bool,
    /// Let local clients answer a lookup of blocks in DRAM from the published slot table,
    /// with no round trip (they send the lookup one way; `docs/protocol.md`, "Local lookups
    /// without a round trip"). Only where no tier is above DRAM. Default: true.
    pub local_lookups: bool,
    /// With `local_lookups`, DRAM the only tier and this store in no cluster: a key the
    /// published table does not name is not cached here (but for puts in flight), so a local
    /// client may answer a partly cached lookup too. The server clears it when it is a
    /// cluster member (another member may hold the rest). Default: true.
    pub local_lookups_exact: bool,
    /// NVMe tier, if any. Default: none.
    pub nvme: Option<NvmeSettings>,
    /// DRAM (and HBM) tier eviction. Default: [`EvictionKind::ChainAware`].
    pub eviction: EvictionKind,
    /// NVMe tier eviction. Default: [`EvictionKind::LeafLru`] (about 25 bytes a slot; at
    /// NVMe capacities the default policy's protection is off and it behaves the same).
    pub nvme_eviction: EvictionKind,
    /// The parameters of [`EvictionKind::ChainAware`], wherever it is used. Not a server
    /// setting: the policy simulator varies them for parameter studies (`kvtier-bench policy
    /// --horizon-slots --protect-margin`). Default: the horizon chosen online, no margin.
    pub chain_tuning: ChainAwareTuning,
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
    /// Time as the policies see it. Default: the system's monotonic clock. (The default
    /// eviction policy keeps its own logical clock and does not read it.)
    pub clock: Arc<dyn Clock>,
    /// How long a held lookup ([`crate::TieredStore::lookup_held`]) keeps its DRAM prefix
    /// pinned when the client does not release it first; zero turns holds off. Default: 1 s.
    pub lookup_hold: Duration,
    /// Most DRAM blocks all held lookups may pin together; a lookup that would pass it holds
    /// nothing and is counted. Zero means a quarter of the DRAM tier's slots. Default: 0.
    pub lookup_hold_max_blocks: u64,
    /// Store a block whose parent is not cached here (by default refused as an orphan, since
    /// no local lookup can reach it). A cluster member sets it: the parent may be held by its
    /// owner, or have been a guest copy evicted first, and the block is then reachable
    /// through the cluster. Default: false.
    pub admit_orphans: bool,
    /// Share of the DRAM tier's slots retention hints may protect together; 0 turns hints
    /// off. Default: 0.5 (chosen among 0.25, 0.5 and 0.75 on replays with hints,
    /// `docs/benchmarks.md`, "The hint budget").
    pub retain_max_fraction: f64,
    /// Share of the DRAM tier's slots one namespace's hints may protect; 0 means an equal
    /// part of `retain_max_fraction` per namespace (all of it with one namespace).
    /// Default: 0.
    pub retain_namespace_max_fraction: f64,
    /// Longest a hint protects its prefix; a hint expected back later is refused.
    /// Default: 300 s.
    pub retain_max: Duration,
    /// A hint protects its prefix for its expected return times this (the session may be
    /// late), at most `retain_max`. Default: 1.5.
    pub retain_slack: f64,
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

/// Opens the memory behind the HBM position of the list in place of a CUDA device: given the
/// capacity in bytes and the slot size, a tier of kind [`TierKind::Hbm`] (an engine's own
/// pool registered with kvtier, or a test double of device memory).
pub type DeviceMemory = Arc<dyn Fn(u64, usize) -> Result<Box<dyn Tier>, TierError> + Send + Sync>;

/// How large the HBM tier is and where its memory comes from.
#[derive(Clone)]
#[non_exhaustive]
pub struct HbmSettings {
    /// Bytes of device memory for slots. Required.
    pub capacity_bytes: u64,
    /// CUDA device ordinal. Default: 0.
    pub device: usize,
    /// Memory to use instead of the CUDA device (which needs the `cuda` feature and a GPU).
    /// Default: none.
    pub device_memory: Option<DeviceMemory>,
}

impl HbmSettings {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity_bytes,
            device: 0,
            device_memory: None,
        }
    }
}

impl std::fmt::Debug for HbmSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HbmSettings")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("device", &self.device)
            .field(
                "device_memory",
                &self.device_memory.as_ref().map(|_| "custom"),
            )
            .finish()
    }
}

fn tiers_err(reason: impl Into<String>) -> StoreError {
    StoreError::Config {
        setting: "tiers",
        reason: reason.into(),
    }
}

impl StoreConfig {
    pub fn new(layout: KvLayout, dram_capacity_bytes: u64) -> Self {
        Self {
            layout,
            tiers: Vec::new(),
            hbm: None,
            dram_capacity_bytes,
            dram_prefault: true,
            local_lookups: true,
            local_lookups_exact: true,
            nvme: None,
            eviction: EvictionKind::default(),
            nvme_eviction: EvictionKind::LeafLru,
            chain_tuning: ChainAwareTuning::default(),
            demotion: DemotionPolicy::default(),
            promotion: PromotionPolicy::default(),
            admission: AdmissionPolicy::default(),
            io_threads: 4,
            shards: 64,
            max_lease: Duration::from_secs(30),
            clock: Arc::new(SystemClock::default()),
            lookup_hold: Duration::from_secs(1),
            lookup_hold_max_blocks: 0,
            admit_orphans: false,
            retain_max_fraction: 0.5,
            retain_namespace_max_fraction: 0.0,
            retain_max: Duration::from_secs(300),
            retain_slack: 1.5,
        }
    }

    pub fn with_nvme(mut self, nvme: NvmeSettings) -> Self {
        self.nvme = Some(nvme);
        self
    }

    pub fn with_hbm(mut self, hbm: HbmSettings) -> Self {
        self.hbm = Some(hbm);
        self
    }

    /// The list of tiers the store opens, fastest first: [`StoreConfig::tiers`], or the one
    /// its settings imply when that is empty. Refuses a list out of order, with a duplicate,
    /// without DRAM, or naming a tier whose settings are missing (or leaving out one whose
    /// settings are given).
    pub fn tier_list(&self) -> Result<Vec<TierKind>, StoreError> {
        if self.tiers.is_empty() {
            let mut l = Vec::new();
            if self.hbm.is_some() {
                l.push(TierKind::Hbm);
            }
            l.push(TierKind::Dram);
            if self.nvme.is_some() {
                l.push(TierKind::Nvme);
            }
            return Ok(l);
        }
        let l = self.tiers.clone();
        if !l.windows(2).all(|w| w[0] < w[1]) {
            return Err(tiers_err(format!(
                "{l:?}: each tier at most once, fastest first (hbm, dram, nvme)"
            )));
        }
        if !l.contains(&TierKind::Dram) {
            return Err(tiers_err(
                "dram is required (it holds new blocks and the local zero-copy path)",
            ));
        }
        for (kind, set) in [
            (TierKind::Hbm, self.hbm.is_some()),
            (TierKind::Nvme, self.nvme.is_some()),
        ] {
            match (l.contains(&kind), set) {
                (true, false) => {
                    return Err(tiers_err(format!("{kind} is listed but not configured")));
                }
                (false, true) => {
                    return Err(tiers_err(format!("{kind} is configured but not listed")));
                }
                _ => {}
            }
        }
        Ok(l)
    }
}

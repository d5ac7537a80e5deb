//! The tiered store: a sharded index over an ordered list of tiers, fastest first (HBM when
//! configured, DRAM, NVMe when configured), with the policies deciding what lives where.
//! DRAM is the host tier: new blocks land there and pins are served from it; blocks move
//! between neighbouring tiers of the list.
//!
//! Locking: an index shard lock (key -> locations) and one lock per tier (free list, slot ->
//! key, eviction policy). The only nesting is tier -> shard (eviction); no lock is held across
//! I/O. Each slot has an atomic pin count: a slot is never reused while pinned, so a reader
//! holding a pin reads its block without any lock. Pins are taken only under the shard lock
//! of the key that references the slot, which is what lets eviction decide under that lock.
//!
//! **Invariant:** a slot is in exactly one of: the free list, a tier's policy (referenced by
//! the index or being filled by its pinned writer), or retired (referenced by nobody, freed by
//! the last unpin).
//!
//! One idea per file: `index.rs` (the sharded index), `slots.rs` (slots and pin words per
//! tier), `evict.rs` (allocation and eviction), `movement.rs` (demotion, promotion, prefetch),
//! `read.rs` and `write.rs` (the data paths), `lease.rs` (leases and the reaper), `handles.rs`
//! (`PinnedRead`, `Reservation`), `pending.rs` (blocks being stored), `events.rs` (events, snapshot), `check.rs` (the consistency
//! check). This file holds the public API and the open path (recovery included).

mod check;
mod events;
mod evict;
mod handles;
mod index;
mod lease;
mod movement;
mod pending;
mod read;
mod retain;
mod slots;
mod warn;
mod write;

pub use events::{EventSink, SnapshotEntry, StoreEvent, StoreEventKind};
pub use handles::{PinnedRead, Reservation};
pub use lease::{LEASE_REAP_INTERVAL, Lease, LookupHold, PinnedBlock};
pub use pending::Announcement;
pub use retain::{RETAIN_TIP_PROBES, RetainOutcome, RetainRequest};

use self::index::Shard;
use self::index::{Entry, MAX_TIERS};
use self::lease::{Holds, LeaseRecord};
use self::slots::NONE;
use self::slots::Slots;
use self::slots::slots_for;
use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::io_pool::IoPool;
use crate::keyhash::KeyHashing;
use crate::policy::InsertContext;
use crate::policy::admission::RejectReason;
use crate::stats::StoreStats;
use crate::tier::DramTier;
use crate::tier::DramTierConfig;
use crate::tier::NvmeOpenReport;
use crate::tier::NvmeTier;
use crate::tier::NvmeTierConfig;
use crate::tier::Tier;
use crate::tier::TierKind;
use crate::tier::nvme::FileWrapper;
use crate::tier::nvme::file::BufferPool;
use kvtier_core::BlockKey;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::MutexGuard;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use std::time::Instant;

/// Where a get was served from, or why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetOutcome {
    Hit(TierKind),
    Miss(MissReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissReason {
    NotCached,
    /// The stored copy failed its checks; it was dropped and counted.
    Corrupt,
    /// The tier returned an I/O error; the copy was dropped and counted.
    IoError,
    /// No I/O thread could take the read.
    Busy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    Stored(TierKind),
    AlreadyPresent,
    /// Dropped under pressure (counted); the caller carries on.
    Rejected(RejectReason),
}

struct Inner {
    block_bytes: usize,
    hashing: KeyHashing,
    shard_mask: u64,
    shards: Box<[Mutex<Shard>]>,
    /// The tiers, fastest first. A tier is named by its position in this list.
    tiers: Box<[Slots]>,
    /// Position of the DRAM tier: new blocks land there, and pins (the local zero-copy path)
    /// are served from it.
    host: usize,
    /// The tier at `host`, with its arena (for local clients and in-place access).
    dram: Arc<DramTier>,
    /// The NVMe tier, if listed (its open report and format live on the concrete type).
    nvme: Option<Arc<NvmeTier>>,
    pool: IoPool,
    bounce: BufferPool,
    /// NVMe (and other tier) write and erase errors: logged at most every 10 s.
    write_errors_log: warn::WarnEvery,
    /// Failed and corrupt reads: logged at most every 10 s (a failing disk fails every block).
    read_errors_log: warn::WarnEvery,
    leases: Mutex<HashMap<u64, LeaseRecord>>,
    next_lease: AtomicU64,
    /// The budget and counts of held lookups (leases taken by a lookup).
    holds: Holds,
    /// Keys being stored (announced or reserved, not yet committed).
    pending: pending::Pending,
    /// Retention hints: host-tier blocks eviction skips for a while.
    retain: retain::Retention,
    events: std::sync::OnceLock<EventSink>,
    /// Whether a block was ever marked a guest here (a cluster member's store): until then
    /// a write-through copy need not look at the guest flags.
    guests_marked: std::sync::atomic::AtomicBool,
    config: StoreConfig,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What opening the store found.
#[derive(Clone, Debug, Default)]
pub struct OpenReport {
    pub nvme: Option<NvmeOpenReport>,
    /// Recovered NVMe blocks whose size did not match the layout (dropped).
    pub wrong_size_dropped: usize,
}

/// The tiered block store. Cheap to share behind an `Arc`; every method takes `&self`.
///
/// Calls may block briefly on tier I/O (NVMe reads run on the store's I/O threads while the
/// caller waits): call them from ordinary threads or an async runtime's blocking pool.
pub struct TieredStore {
    inner: Arc<Inner>,
    reaper: Option<(crossbeam::channel::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl TieredStore {
    pub fn open(config: StoreConfig) -> Result<(Self, OpenReport), StoreError> {
        Self::open_with(config, &|f, _| Arc::new(f))
    }

    /// Opens the store with each NVMe slot file wrapped by `wrap` (fault injection in tests,
    /// or instrumented I/O).
    pub fn open_with(
        config: StoreConfig,
        wrap: &FileWrapper,
    ) -> Result<(Self, OpenReport), StoreError> {
        let block_bytes =
            usize::try_from(config.layout.block_bytes()).map_err(|_| StoreError::Config {
                setting: "layout",
                reason: "block larger than the address space".into(),
            })?;
        let kinds = config.tier_list()?;
        if kinds.len() > MAX_TIERS {
            return Err(StoreError::Config {
                setting: "tiers",
                reason: format!("at most {MAX_TIERS} tiers"),
            });
        }
        let dram = Arc::new(
            DramTierConfig::new(config.dram_capacity_bytes, block_bytes)
                .prefault(config.dram_prefault)
                .open()?,
        );
        let slot_bytes = dram.slot_bytes();
        let mut report = OpenReport::default();
        let mut nvme = None;
        let mut tiers: Vec<Slots> = Vec::with_capacity(kinds.len());
        for &kind in &kinds {
            let (tier, eviction): (Arc<dyn Tier>, _) = match kind {
                TierKind::Dram => (dram.clone(), config.eviction),
                TierKind::Nvme => {
                    let Some(n) = &config.nvme else {
                        return Err(StoreError::Config {
                            setting: "nvme",
                            reason: "listed in tiers but not configured".into(),
                        });
                    };
                    let t = NvmeTierConfig::new(
                        &n.dir,
                        n.capacity_bytes,
                        slot_bytes as u64,
                        config.layout.fingerprint(),
                    )
                    .direct_io(n.direct_io)
                    .file_bytes(n.file_bytes);
                    let (t, r) = NvmeTier::open_with(&t, wrap)?;
                    report.nvme = Some(r);
                    let t = Arc::new(t);
                    nvme = Some(t.clone());
                    (t, config.nvme_eviction)
                }
                TierKind::Hbm => (open_hbm(&config, slot_bytes)?, config.eviction),
            };
            tiers.push(slots_for(tier, eviction, config.chain_tuning));
        }
        let host = kinds
            .iter()
            .position(|&k| k == TierKind::Dram)
            .ok_or_else(|| StoreError::Config {
                setting: "tiers",
                reason: "dram is required".into(),
            })?;
        // With no tier above DRAM, a block the published table names is in the fastest tier
        // that holds it: local clients may answer a lookup of such blocks from the table
        // (the server's lookup handler takes their one-way lookups).
        if host == 0 && config.local_lookups {
            let exact = config.local_lookups_exact && kinds.len() == 1;
            dram.published().allow_lookups(exact);
        }
        if config.io_threads == 0 {
            return Err(StoreError::Config {
                setting: "io_threads",
                reason: "must be at least 1".into(),
            });
        }
        let shards = config.shards.clamp(1, 1 << 16).next_power_of_two();
        let pool = IoPool::new(config.io_threads, "kvtier-io").map_err(StoreError::Threads)?;
        let hashing = KeyHashing::new();
        // Sized for every slot up front, so the index does not allocate as it fills.
        let per_shard = tiers
            .iter()
            .map(|t| u64::from(t.tier.slot_count()))
            .sum::<u64>()
            .div_ceil(shards as u64) as usize;
        let host_slots = u64::from(tiers[host].tier.slot_count());
        {
            let mut st = lock(&tiers[host].state);
            st.held = vec![0; host_slots as usize].into();
            st.guests = slots::Guests::new(host_slots as usize);
        }
        let inner = Arc::new(Inner {
            block_bytes,
            shard_mask: shards as u64 - 1,
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::with_capacity_and_hasher(per_shard, hashing.clone())))
                .collect(),
            pending: pending::Pending::new(hashing.clone(), dram.clone()),
            retain: retain::Retention::new(
                host_slots,
                config.retain_max_fraction,
                config.retain_namespace_max_fraction,
                config.retain_max,
                config.retain_slack,
                hashing.clone(),
            ),
            hashing,
            tiers: tiers.into(),
            host,
            dram,
            nvme,
            pool,
            guests_marked: std::sync::atomic::AtomicBool::new(false),
            bounce: BufferPool::new(slot_bytes, config.io_threads),
            write_errors_log: warn::WarnEvery::new(warn::IO_ERROR_LOG_INTERVAL),
            read_errors_log: warn::WarnEvery::new(warn::IO_ERROR_LOG_INTERVAL),
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            holds: Holds::new(match config.lookup_hold_max_blocks {
                0 => (host_slots / 4).max(1),
                n => n,
            }),
            events: std::sync::OnceLock::new(),
            config,
        });
        report.wrong_size_dropped = inner.recover();
        let (stop, rx) = crossbeam::channel::bounded::<()>(1);
        let weak = Arc::downgrade(&inner);
        let reaper = std::thread::Builder::new()
            .name("kvtier-reaper".into())
            .spawn(move || {
                while let Err(crossbeam::channel::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(LEASE_REAP_INTERVAL)
                {
                    let Some(inner) = weak.upgrade() else { break };
                    inner.reap_leases(Instant::now());
                    inner.retain.expire(inner.now());
                }
            })
            .map_err(StoreError::Threads)?;
        Ok((
            Self {
                inner,
                reaper: Some((stop, reaper)),
            },
            report,
        ))
    }

    /// Size of every block, in bytes.
    pub fn block_bytes(&self) -> usize {
        self.inner.block_bytes
    }

    /// How many distinct blocks the store keeps without its own eviction dropping any: the
    /// largest of the host tier and the tiers below it under write-through (every block is
    /// copied below as it is stored); the host tier alone otherwise: under selective
    /// write-through a block can leave DRAM without a copy below, and under write-back too
    /// (an eviction that finds its write-backs backed up evicts without one, which a test of
    /// this very bound found). Under write-back the host tier also keeps a reserve of free
    /// slots (1/64 of them, at least one) that its blocks never fill, so the reserve is not
    /// counted either. Moves between tiers do not count: a block pushed from DRAM to NVMe is
    /// still kept. (Tenants' shares divide this.)
    pub fn kept_blocks(&self) -> u64 {
        let i = &self.inner;
        let slots = |t: &Slots| u64::from(t.tier.slot_count());
        let host = slots(&i.tiers[i.host]);
        if i.config.demotion.on_put() {
            i.tiers[i.host..].iter().map(slots).max().unwrap_or(host)
        } else if i.writeback_mode(i.host) {
            // A one-slot tier cannot keep its reserve (its one block is pinned while stored).
            let reserve = evict::writeback_reserve(host as usize) as u64;
            host.saturating_sub(reserve).max(host.min(1))
        } else {
            host
        }
    }

    /// The DRAM tier (its arena can be handed to a local client).
    pub fn dram(&self) -> &DramTier {
        &self.inner.dram
    }

    /// The kinds of the store's tiers, fastest first.
    pub fn tiers(&self) -> Vec<TierKind> {
        self.inner.tiers.iter().map(|t| t.kind).collect()
    }

    /// The NVMe tier, if configured.
    pub fn nvme(&self) -> Option<&NvmeTier> {
        self.inner.nvme.as_deref()
    }

    /// Stores `data` as block `key`, whose chain parent is `parent` (None for a first block).
    pub fn put(
        &self,
        key: BlockKey,
        parent: Option<BlockKey>,
        data: &[u8],
    ) -> Result<PutOutcome, StoreError> {
        self.inner.put(key, parent, data)
    }

    /// Copies block `key` into `buf` (exactly one block long).
    pub fn get(&self, key: &BlockKey, buf: &mut [u8]) -> Result<GetOutcome, StoreError> {
        self.inner.get(*key, buf)
    }

    /// The longest cached prefix of `keys`: the tier of each leading cached block (the
    /// fastest tier holding it), stopping at the first miss.
    /// A lookup is a request announcing itself: the policies count the prefix as used (use
    /// [`TieredStore::contains`] to ask without that effect).
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<TierKind> {
        self.inner.lookup(keys, false).0
    }

    /// [`TieredStore::lookup`] that also pins the prefix's leading run of DRAM blocks until
    /// the request loads it: until [`TieredStore::release`] of the hold's lease id, or for
    /// at most [`StoreConfig::lookup_hold`]. Other requests' puts cannot evict a held block.
    /// Holds share a budget ([`StoreConfig::lookup_hold_max_blocks`]); past it the lookup
    /// holds nothing and says so ([`LookupHold::OverBudget`], counted in the stats).
    pub fn lookup_held(&self, keys: &[BlockKey]) -> (Vec<TierKind>, LookupHold) {
        self.inner.lookup(keys, true)
    }

    /// Whether `key` is cached in any tier.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.locate(*key).is_some()
    }

    /// Pins the longest cached prefix of `keys` in DRAM (copying blocks held only in other
    /// tiers into it) for at most
    /// `lease` (capped by the configured maximum). Release with [`TieredStore::release`];
    /// pins that outlive their deadline are released by the store.
    pub fn pin(&self, keys: &[BlockKey], lease: Duration) -> Lease {
        self.inner
            .pin(keys, lease, true)
            .expect("a pin that may block always completes")
    }

    /// [`TieredStore::pin`] that never waits for I/O: `None` when a block of the prefix is
    /// outside DRAM only (call `pin` from a thread that may block instead).
    pub fn try_pin(&self, keys: &[BlockKey], lease: Duration) -> Option<Lease> {
        self.inner.pin(keys, lease, false)
    }

    /// Pins the longest cached prefix of `keys` in DRAM (copying blocks held only in other
    /// tiers into it) for as long
    /// as the returned guard lives, with no deadline: for a server task that streams the bytes
    /// out itself (bound the time it holds the guard).
    pub fn pin_read(&self, keys: &[BlockKey]) -> PinnedRead {
        let (blocks, miss) = self
            .inner
            .pin_prefix(keys, true)
            .expect("a pin that may block always completes");
        PinnedRead {
            inner: self.inner.clone(),
            blocks,
            miss,
        }
    }

    /// [`TieredStore::pin_read`] that never waits for I/O: `None` when a block of the prefix
    /// is outside DRAM only.
    pub fn try_pin_read(&self, keys: &[BlockKey]) -> Option<PinnedRead> {
        let (blocks, miss) = self.inner.pin_prefix(keys, false)?;
        Some(PinnedRead {
            inner: self.inner.clone(),
            blocks,
            miss,
        })
    }

    /// Reserves a DRAM slot for block `key` (child of `parent`), to be filled in place
    /// (through [`Reservation::bytes_mut`], or by a local client through the arena at
    /// [`Reservation::offset`]) and then committed. Dropping the reservation frees the slot.
    /// `Err` says why no slot was reserved (already present, or refused by admission).
    pub fn reserve(
        &self,
        key: BlockKey,
        parent: Option<BlockKey>,
    ) -> Result<Reservation, PutOutcome> {
        self.inner.reserve(key, parent, None, true)
    }

    /// Like [`TieredStore::reserve`] for a block whose parent is reserved earlier in the same
    /// batch (not yet committed): the parent is not required to be cached now. The eviction
    /// policy sees the child linked to the parent's slot, exactly as if the parent had been
    /// committed first. Commit the batch in order; a child whose parent was not committed is
    /// refused at its commit.
    pub fn reserve_after(
        &self,
        key: BlockKey,
        parent: &Reservation,
    ) -> Result<Reservation, PutOutcome> {
        self.inner
            .reserve(key, Some(parent.key), Some(parent.slot), true)
    }

    /// One try of [`TieredStore::reserve`] (or of [`TieredStore::reserve_after`] `after`),
    /// for a caller that may try again: a refusal for want of an unpinned DRAM slot is
    /// counted only when `last_try`. Slots pinned by background copies (write-through to
    /// NVMe) free themselves as [`TieredStore::background_jobs`] drains, so a caller that
    /// can wait (bounded) tries again while that is non-zero.
    pub fn reserve_try(
        &self,
        key: BlockKey,
        parent: Option<BlockKey>,
        after: Option<&Reservation>,
        last_try: bool,
    ) -> Result<Reservation, PutOutcome> {
        match after {
            Some(p) => self.inner.reserve(key, Some(p.key), Some(p.slot), last_try),
            None => self.inner.reserve(key, parent, None, last_try),
        }
    }

    /// Announces that blocks `keys` are about to be stored (a put whose bytes are on their
    /// way): until each is withdrawn ([`Announcement::done`], or dropping the announcement),
    /// [`TieredStore::is_pending`] says so, and a reader may wait for it rather than miss.
    pub fn announce(&self, keys: &[BlockKey]) -> Announcement {
        self.inner.pending.add(keys.iter().copied());
        Announcement {
            inner: self.inner.clone(),
            keys: keys.iter().copied().map(Some).collect(),
        }
    }

    /// Whether `key` is being stored: announced by a put in flight or reserved and not yet
    /// committed. Such a block is not served until committed; a reader may wait for it.
    pub fn is_pending(&self, key: &BlockKey) -> bool {
        self.inner.pending.contains(key)
    }

    /// The index of the first of `keys` that is being stored now, if any.
    pub fn first_pending(&self, keys: &[BlockKey]) -> Option<usize> {
        self.inner.pending.first_of(keys)
    }

    /// How many distinct keys are being stored now.
    pub fn pending_blocks(&self) -> usize {
        self.inner.pending.len()
    }

    /// Background jobs (copies between tiers) queued or running.
    pub fn background_jobs(&self) -> usize {
        self.inner.pool.backlog()
    }

    /// Every cached block and the tiers holding it. O(blocks); for resyncing subscribers.
    pub fn snapshot(&self) -> Vec<SnapshotEntry> {
        self.inner.snapshot()
    }

    /// Sends every later [`StoreEvent`] to `sink`. Set once; false if a sink was set before.
    pub fn set_event_sink(&self, sink: EventSink) -> bool {
        self.inner.events.set(sink).is_ok()
    }

    /// A retention hint: protects the DRAM blocks of `req.keys` from eviction until the
    /// session comes back (a lookup whose served prefix reaches the last of the keys), or
    /// for `min(expected_return x retain_slack, retain_max)` on the store's clock, within
    /// the budgets ([`StoreConfig::retain_max_fraction`],
    /// [`StoreConfig::retain_namespace_max_fraction`]). Never waits; a refusal is counted.
    pub fn retain(&self, req: RetainRequest<'_>) -> RetainOutcome {
        self.inner.retain(req)
    }

    /// How many namespaces share the store (1 unless told): without a configured
    /// namespace share, each namespace's hints may hold an equal part of the global budget.
    pub fn set_retain_namespaces(&self, n: usize) {
        self.inner.retain.set_namespaces(n);
    }

    /// Forgets retention hints whose hold has ended on the store's clock; returns how many.
    /// The store also does this on its own every [`LEASE_REAP_INTERVAL`].
    pub fn expire_retained(&self) -> usize {
        self.inner.retain.expire(self.inner.now())
    }

    /// Marks the DRAM copies of `keys` as guests: blocks another cluster member owns (fetched
    /// from it, or put here and now held by it). The DRAM tier evicts guests before the
    /// blocks its policy ranks, oldest mark first (pinned and held ones are passed over), and
    /// never writes a guest back to a tier below. A guest stays one until it is evicted or
    /// removed. Keys not in DRAM are ignored. Returns how many were newly marked.
    pub fn mark_guests(&self, keys: &[BlockKey]) -> usize {
        self.inner.mark_guests(keys)
    }

    /// No block is a guest any more (a cluster member that changed which of its copies
    /// are guests, `cluster.routing`); they are evicted by the DRAM policy from now on.
    /// Returns how many were guests.
    pub fn clear_guests(&self) -> usize {
        self.inner.clear_guests()
    }

    /// Releases a lease; false if it was unknown or already expired.
    pub fn release(&self, lease_id: u64) -> bool {
        self.inner.release_lease(lease_id)
    }

    /// Releases every lease whose deadline is before `now`; returns how many. The store also
    /// does this on its own every [`LEASE_REAP_INTERVAL`].
    pub fn reap_expired(&self, now: Instant) -> usize {
        self.inner.reap_leases(now)
    }

    /// Queues promotion of blocks among `keys` held only below DRAM one tier up (NVMe to
    /// DRAM); returns how many were queued (the rest were cached in DRAM or above already,
    /// missing, or refused by a full queue).
    pub fn prefetch(&self, keys: &[BlockKey]) -> usize {
        self.inner.prefetch(keys)
    }

    /// Forgets `key` in every tier; false if it was not cached.
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.inner.remove(*key)
    }

    /// Removes `key` unless a copy of it is pinned (a reader's pin, a held lookup, a copy in
    /// flight): what a removal chosen by policy (a tenant's quota or share) uses, so it never
    /// takes a block a request is about to load. `false`: pinned, or not here.
    pub fn remove_unpinned(&self, key: &BlockKey) -> bool {
        self.inner.remove_if(*key, true)
    }

    /// Forgets every block in every tier (NVMe included, across restarts).
    pub fn clear(&self) -> Result<(), StoreError> {
        self.inner.clear()
    }

    /// Waits until background copies (demotions, prefetches) queued so far have finished.
    pub fn flush(&self) {
        self.inner.pool.drain();
    }

    pub fn stats(&self) -> StoreStats {
        self.inner.stats()
    }

    /// Checks the slot invariants of a quiescent store (no call in flight, background work
    /// flushed, leases released): every slot is either free or referenced by exactly one key,
    /// never both, its slot table records that key, and nothing is pinned; in a debug build,
    /// also that no eviction-policy call broke the policy contract
    /// ([`crate::policy::eviction::Checked`]). For tests and debugging; O(slots).
    pub fn check_consistency(&self) -> Result<(), String> {
        self.flush();
        self.inner.check_consistency()
    }
}

impl Drop for TieredStore {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.reaper.take() {
            let _ = stop.send(());
            let _ = handle.join();
        }
        // Background jobs hold the inner state; let them finish so it drops here.
        self.inner.pool.drain();
    }
}

impl Inner {
    /// Indexes the blocks the persistent tiers found when they opened; returns how many were
    /// dropped for a size that does not match the layout.
    pub(super) fn recover(&self) -> usize {
        let mut dropped = 0;
        for (t, tier) in self.tiers.iter().enumerate() {
            if !tier.tier.is_persistent() {
                continue;
            }
            let mut st = lock(&tier.state);
            let mut used = vec![false; tier.tier.slot_count() as usize];
            let mut found = tier.tier.recover();
            // Oldest write first, so the policy's recency follows the order blocks were
            // written and a parent (written before its children) is filed before them.
            found.sort_by_key(|r| r.generation);
            let mut slot_of: HashMap<BlockKey, u32, KeyHashing> =
                HashMap::with_capacity_and_hasher(found.len(), self.hashing.clone());
            for r in found {
                if r.len as usize != self.block_bytes {
                    dropped += 1;
                    continue;
                }
                used[r.slot.index()] = true;
                st.keys[r.slot.index()] = r.key;
                let parent = r.parent.and_then(|p| slot_of.get(&p).copied());
                st.policy.on_insert(r.slot.0, r.key, self.ctx(parent));
                slot_of.insert(r.key, r.slot.0);
                self.shard(&r.key)
                    .get_or_insert(r.key, Entry::at(t, NONE))
                    .loc[t] = r.slot.0;
            }
            st.free.retain(|s| !used[*s as usize]);
        }
        dropped
    }

    pub(super) fn now(&self) -> u64 {
        self.config.clock.now_ms()
    }

    pub(super) fn ctx(&self, parent: Option<u32>) -> InsertContext {
        InsertContext {
            parent,
            now_ms: self.now(),
        }
    }
}

/// Opens the HBM position of the list: the configured device memory, else the CUDA device.
fn open_hbm(config: &StoreConfig, slot_bytes: usize) -> Result<Arc<dyn Tier>, StoreError> {
    let Some(h) = &config.hbm else {
        return Err(StoreError::Config {
            setting: "hbm",
            reason: "listed in tiers but not configured".into(),
        });
    };
    if let Some(open) = &h.device_memory {
        let t: Arc<dyn Tier> = Arc::from(open(h.capacity_bytes, slot_bytes)?);
        if t.kind() != TierKind::Hbm || t.slot_bytes() < slot_bytes {
            return Err(StoreError::Config {
                setting: "hbm.device_memory",
                reason: format!(
                    "opened a {} tier of {}-byte slots, not hbm of {slot_bytes}",
                    t.kind(),
                    t.slot_bytes()
                ),
            });
        }
        return Ok(t);
    }
    #[cfg(feature = "cuda")]
    {
        let t = crate::tier::HbmTierConfig::new(h.capacity_bytes, slot_bytes)
            .device(h.device)
            .open()?;
        Ok(Arc::new(t))
    }
    #[cfg(not(feature = "cuda"))]
    Err(StoreError::Config {
        setting: "tiers",
        reason: "hbm needs a build with the `cuda` feature".into(),
    })
}

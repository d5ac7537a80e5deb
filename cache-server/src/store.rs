//! The tiered store: a sharded index over a DRAM tier and an optional NVMe tier, with the
//! policies deciding what lives where.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtier_core::BlockKey;

use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::io_pool::IoPool;
use crate::keyhash::KeyHashing;
use crate::policy::admission::RejectReason;
use crate::policy::{Admission, EvictionPolicy, InsertContext, LookupContext, PromotionPolicy};
use crate::stats::{StoreStats, TierCounters, TierStats};
use crate::tier::nvme::FileWrapper;
use crate::tier::nvme::file::BufferPool;
use crate::tier::{
    DramTier, DramTierConfig, NvmeOpenReport, NvmeTier, NvmeTierConfig, SlotId, Tier, TierError,
    TierKind,
};

const NONE: u32 = u32::MAX;
/// Pin-word bits: the low bits count pins; RETIRED means "free me at zero"; ERASE means
/// "erase my on-disk header before freeing".
const RETIRED: u32 = 1 << 31;
const ERASE: u32 = 1 << 30;
const COUNT: u32 = ERASE - 1;
/// How often expired leases are reaped.
pub const LEASE_REAP_INTERVAL: Duration = Duration::from_millis(100);
/// Write-backs a single allocation may start before it evicts without one.
const MAX_WRITEBACKS_PER_ALLOC: usize = 4;
/// Victims an allocation may try before it gives up.
const MAX_EVICT_ATTEMPTS: usize = 16;
/// Under write-back, DRAM keeps about 1/this of its slots free (at least one).
const WRITEBACK_RESERVE_DIVISOR: usize = 64;

enum Evicted {
    /// The slot is free for the caller.
    Freed(u32),
    /// A write-back started; the slot frees itself when the copy is done.
    WritingBack,
    /// The victim could not be taken; ask again.
    Retry,
}

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

/// Blocks pinned in the DRAM arena for a reader, until released or the deadline passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub deadline: Instant,
    /// The longest cached prefix of the keys asked for, each pinned in DRAM.
    pub blocks: Vec<PinnedBlock>,
    /// Why the prefix stopped, when it is shorter than the keys asked for.
    pub miss: Option<MissReason>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedBlock {
    pub key: BlockKey,
    pub slot: SlotId,
    /// Byte offset in the DRAM arena (see [`TieredStore::dram`]).
    pub offset: u64,
    pub len: u64,
    /// Where the block was found (an NVMe block was promoted into DRAM to be pinned).
    pub found_in: TierKind,
}

/// A change in where a block lives, for subscribers (KV-aware routers). Emitted after the
/// index changed; a sink sees them in the order they happened for any one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreEvent {
    pub kind: StoreEventKind,
    /// The tier gained or lost (DRAM for `Cleared`).
    pub tier: TierKind,
    pub key: BlockKey,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreEventKind {
    /// The block is now held by the tier.
    Stored,
    /// The block left the tier (evicted, removed, or dropped as corrupt).
    Removed,
    /// Every block left every tier (the key is zero).
    Cleared,
}

/// Receives [`StoreEvent`]s. Called with store locks held: it must be quick and must never
/// block or call back into the store.
pub type EventSink = Arc<dyn Fn(StoreEvent) + Send + Sync>;

/// A cached block in a [`TieredStore::snapshot`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub key: BlockKey,
    pub in_dram: bool,
    pub in_nvme: bool,
}

#[derive(Clone, Copy)]
struct Entry {
    dram: u32,
    nvme: u32,
    hits: u32,
}

impl Entry {
    fn loc(&self, t: TierKind) -> u32 {
        match t {
            TierKind::Nvme => self.nvme,
            _ => self.dram,
        }
    }
    fn set(&mut self, t: TierKind, v: u32) {
        match t {
            TierKind::Nvme => self.nvme = v,
            _ => self.dram = v,
        }
    }
    fn is_empty(&self) -> bool {
        self.dram == NONE && self.nvme == NONE
    }
}

type Shard = HashMap<BlockKey, Entry, KeyHashing>;

struct TierState {
    free: Vec<u32>,
    keys: Box<[BlockKey]>,
    policy: Box<dyn EvictionPolicy>,
}

struct Slots<T> {
    tier: T,
    state: Mutex<TierState>,
    pins: Box<[AtomicU32]>,
    counters: TierCounters,
}

struct LeaseRecord {
    deadline: Instant,
    slots: Vec<u32>,
}

struct Inner {
    block_bytes: usize,
    hashing: KeyHashing,
    shard_mask: u64,
    shards: Box<[Mutex<Shard>]>,
    dram: Slots<DramTier>,
    nvme: Option<Slots<NvmeTier>>,
    pool: IoPool,
    bounce: BufferPool,
    leases: Mutex<HashMap<u64, LeaseRecord>>,
    next_lease: AtomicU64,
    writebacks_inflight: std::sync::atomic::AtomicUsize,
    events: std::sync::OnceLock<EventSink>,
    config: StoreConfig,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn slots_for<T: Tier>(tier: T, eviction: crate::policy::EvictionKind) -> Slots<T> {
    let n = tier.slot_count();
    Slots {
        state: Mutex::new(TierState {
            free: (0..n).rev().collect(),
            keys: vec![BlockKey::default(); n as usize].into(),
            policy: eviction.build(n),
        }),
        pins: (0..n).map(|_| AtomicU32::new(0)).collect(),
        counters: TierCounters::default(),
        tier,
    }
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
        let dram = DramTierConfig::new(config.dram_capacity_bytes, block_bytes)
            .prefault(config.dram_prefault)
            .open()?;
        let slot_bytes = dram.slot_bytes();
        let mut report = OpenReport::default();
        let nvme = match &config.nvme {
            None => None,
            Some(n) => {
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
                Some(t)
            }
        };
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
        let per_shard = (u64::from(dram.slot_count())
            + nvme.as_ref().map_or(0, |t| u64::from(t.slot_count())))
        .div_ceil(shards as u64) as usize;
        let inner = Arc::new(Inner {
            block_bytes,
            shard_mask: shards as u64 - 1,
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::with_capacity_and_hasher(per_shard, hashing.clone())))
                .collect(),
            hashing,
            dram: slots_for(dram, config.eviction),
            nvme: nvme.map(|t| slots_for(t, config.nvme_eviction)),
            pool,
            bounce: BufferPool::new(slot_bytes, config.io_threads),
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            writebacks_inflight: std::sync::atomic::AtomicUsize::new(0),
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

    /// The DRAM tier (its arena can be handed to a local client).
    pub fn dram(&self) -> &DramTier {
        &self.inner.dram.tier
    }

    /// The NVMe tier, if configured.
    pub fn nvme(&self) -> Option<&NvmeTier> {
        self.inner.nvme.as_ref().map(|s| &s.tier)
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
        self.inner.lookup(keys)
    }

    /// Whether `key` is cached in any tier.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.locate(*key).is_some()
    }

    /// Pins the longest cached prefix of `keys` in DRAM (promoting NVMe blocks) for at most
    /// `lease` (capped by the configured maximum). Release with [`TieredStore::release`];
    /// pins that outlive their deadline are released by the store.
    pub fn pin(&self, keys: &[BlockKey], lease: Duration) -> Lease {
        self.inner
            .pin(keys, lease, true)
            .expect("a pin that may block always completes")
    }

    /// [`TieredStore::pin`] that never waits for I/O: `None` when a block of the prefix is
    /// on NVMe only (call `pin` from a thread that may block instead).
    pub fn try_pin(&self, keys: &[BlockKey], lease: Duration) -> Option<Lease> {
        self.inner.pin(keys, lease, false)
    }

    /// Pins the longest cached prefix of `keys` in DRAM (promoting NVMe blocks) for as long
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
    /// is on NVMe only.
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
        self.inner.reserve(key, parent, None)
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
        self.inner.reserve(key, Some(parent.key), Some(parent.slot))
    }

    /// Every cached block and the tiers holding it. O(blocks); for resyncing subscribers.
    pub fn snapshot(&self) -> Vec<SnapshotEntry> {
        self.inner.snapshot()
    }

    /// Sends every later [`StoreEvent`] to `sink`. Set once; false if a sink was set before.
    pub fn set_event_sink(&self, sink: EventSink) -> bool {
        self.inner.events.set(sink).is_ok()
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

    /// Queues promotion of NVMe-only blocks among `keys` into DRAM; returns how many were
    /// queued (the rest were cached in DRAM already, missing, or refused by a full queue).
    pub fn prefetch(&self, keys: &[BlockKey]) -> usize {
        self.inner.prefetch(keys)
    }

    /// Forgets `key` in every tier; false if it was not cached.
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.inner.remove(*key)
    }

    /// Forgets every block (NVMe included, across restarts).
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
    /// never both, and nothing is pinned. For tests and debugging; O(slots).
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
    fn shard_index(&self, key: &BlockKey) -> usize {
        ((self.hashing.hash(key) >> 40) & self.shard_mask) as usize
    }

    fn shard(&self, key: &BlockKey) -> MutexGuard<'_, Shard> {
        // The high bits pick the shard; the map's buckets use the low ones.
        lock(&self.shards[self.shard_index(key)])
    }

    fn counters(&self, t: TierKind) -> &TierCounters {
        match t {
            TierKind::Nvme => {
                &self
                    .nvme
                    .as_ref()
                    .expect("nvme slot without an nvme tier")
                    .counters
            }
            _ => &self.dram.counters,
        }
    }

    /// (state, pins) of tier `t`. Only DRAM and NVMe hold slots in the store.
    fn parts(&self, t: TierKind) -> (&Mutex<TierState>, &[AtomicU32]) {
        match t {
            TierKind::Nvme => {
                let s = self.nvme.as_ref().expect("nvme slot without an nvme tier");
                (&s.state, &s.pins)
            }
            _ => (&self.dram.state, &self.dram.pins),
        }
    }

    fn recover(&self) -> usize {
        let Some(nvme) = &self.nvme else { return 0 };
        let mut dropped = 0;
        let mut st = lock(&nvme.state);
        let mut used = vec![false; nvme.tier.slot_count() as usize];
        let mut found = nvme.tier.recover();
        // Oldest write first, so the policy's recency follows the order blocks were written
        // and a parent (written before its children) is filed before them.
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
            self.shard(&r.key).insert(
                r.key,
                Entry {
                    dram: NONE,
                    nvme: r.slot.0,
                    hits: 0,
                },
            );
        }
        st.free.retain(|s| !used[*s as usize]);
        dropped
    }

    fn locate(&self, key: BlockKey) -> Option<TierKind> {
        let shard = self.shard(&key);
        let e = shard.get(&key)?;
        if e.dram != NONE {
            Some(TierKind::Dram)
        } else if e.nvme != NONE {
            Some(TierKind::Nvme)
        } else {
            None
        }
    }

    fn unpin(self: &Arc<Self>, t: TierKind, slot: u32) {
        let (_, pins) = self.parts(t);
        let prev = pins[slot as usize].fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT != 0, "unpin of an unpinned slot");
        if prev & COUNT == 1 && prev & RETIRED != 0 {
            self.free(t, slot, prev & ERASE != 0);
        }
    }

    /// Takes `slot` out of tier `t`'s policy and frees it once no pin holds it.
    fn retire(self: &Arc<Self>, t: TierKind, slot: u32, erase: bool) {
        let (state, pins) = self.parts(t);
        lock(state).policy.on_remove(slot, self.now());
        let bits = RETIRED | if erase { ERASE } else { 0 };
        let prev = pins[slot as usize].fetch_or(bits, Ordering::AcqRel);
        if prev & COUNT == 0 {
            self.free(t, slot, erase);
        }
    }

    fn free(self: &Arc<Self>, t: TierKind, slot: u32, erase: bool) {
        if erase && t == TierKind::Nvme {
            // The header goes before the slot can be reused, so a restart cannot bring the
            // removed block back. On a full queue, erase here: removal is rare.
            let me = self.clone();
            let job = move || me.erase_then_free(slot);
            if self.pool.try_spawn(job).is_err() {
                self.erase_then_free(slot);
            }
            return;
        }
        let (state, pins) = self.parts(t);
        let mut st = lock(state);
        pins[slot as usize].store(0, Ordering::Release);
        st.free.push(slot);
    }

    fn erase_then_free(self: &Arc<Self>, slot: u32) {
        if let Some(n) = &self.nvme
            && n.tier.erase(SlotId(slot)).is_err()
        {
            TierCounters::inc(&n.counters.io_errors);
        }
        self.free(TierKind::Nvme, slot, false);
    }

    /// A slot of tier `t` for `key`, pinned once (the caller's writer pin) and tracked by the
    /// policy. Evicts to make room; under write-back, dirty DRAM victims are copied down in
    /// the background first and a small reserve of free slots is kept so puts rarely wait on
    /// (or are refused because of) a copy in flight.
    fn alloc(
        self: &Arc<Self>,
        t: TierKind,
        key: BlockKey,
        mut ctx: InsertContext,
        parent_key: Option<BlockKey>,
    ) -> Option<u32> {
        let (state, pins) = self.parts(t);
        let mut st = lock(state);
        // The parent's slot was read without a pin: believe it only if it still holds it.
        ctx.parent = ctx
            .parent
            .filter(|&p| parent_key.is_some_and(|k| st.keys[p as usize] == k));
        let writeback = self.writeback_mode(t);
        let slot = match st.free.pop() {
            Some(s) => s,
            None => {
                let mut started = 0;
                let mut found = None;
                for _ in 0..MAX_EVICT_ATTEMPTS {
                    let allow_writeback = writeback && started < MAX_WRITEBACKS_PER_ALLOC;
                    match self.evict_one(t, &mut st, pins, allow_writeback)? {
                        Evicted::Freed(v) => {
                            found = Some(v);
                            break;
                        }
                        Evicted::WritingBack => started += 1,
                        Evicted::Retry => {}
                    }
                }
                found?
            }
        };
        pins[slot as usize].store(1, Ordering::Release);
        st.keys[slot as usize] = key;
        st.policy.on_insert(slot, key, ctx);
        if writeback {
            let reserve = (st.keys.len() / WRITEBACK_RESERVE_DIVISOR).max(1);
            let mut budget = MAX_WRITEBACKS_PER_ALLOC;
            while budget > 0
                && st.free.len() + self.writebacks_inflight.load(Ordering::Acquire) < reserve
            {
                budget -= 1;
                match self.evict_one(t, &mut st, pins, true) {
                    Some(Evicted::Freed(v)) => st.free.push(v),
                    Some(Evicted::WritingBack | Evicted::Retry) => {}
                    None => break,
                }
            }
        }
        Some(slot)
    }

    fn writeback_mode(&self, t: TierKind) -> bool {
        t == TierKind::Dram && self.nvme.is_some() && self.config.demotion.on_evict()
    }

    /// Handles the policy's next victim. `None`: no evictable slot at all.
    fn evict_one(
        self: &Arc<Self>,
        t: TierKind,
        st: &mut TierState,
        pins: &[AtomicU32],
        allow_writeback: bool,
    ) -> Option<Evicted> {
        let v = st
            .policy
            .victim(&mut |s| pins[s as usize].load(Ordering::Acquire) == 0)?;
        let vkey = st.keys[v as usize];
        let mut shard = self.shard(&vkey);
        let Some(e) = shard.get_mut(&vkey).filter(|e| e.loc(t) == v) else {
            // No key references it: it is being removed (its remover holds a pin and frees
            // it) or being filled by a pinned writer. Either way not ours; stop tracking it.
            drop(shard);
            st.policy.on_remove(v, self.now());
            return Some(Evicted::Retry);
        };
        if pins[v as usize].load(Ordering::Acquire) != 0 {
            return Some(Evicted::Retry); // pinned after the policy looked
        }
        if allow_writeback && e.nvme == NONE {
            // Stays referenced and readable in DRAM while it is copied down; the copy job
            // removes the reference and retires it (only a remover retires a slot).
            pins[v as usize].store(1, Ordering::Release);
            drop(shard);
            st.policy.on_remove(v, self.now());
            self.writebacks_inflight.fetch_add(1, Ordering::AcqRel);
            let me = self.clone();
            if self
                .pool
                .try_spawn(move || me.demote(vkey, None, v, true))
                .is_ok()
            {
                return Some(Evicted::WritingBack);
            }
            // No room to copy: evict it without a copy.
            self.writebacks_inflight.fetch_sub(1, Ordering::AcqRel);
            TierCounters::inc(&self.dram.counters.demotions_dropped);
            let mut shard = self.shard(&vkey);
            let ours = match shard.get_mut(&vkey).filter(|e| e.dram == v) {
                Some(e) => {
                    e.dram = NONE;
                    self.emit(StoreEventKind::Removed, TierKind::Dram, vkey);
                    if e.is_empty() {
                        shard.remove(&vkey);
                    }
                    true
                }
                None => false, // removed meanwhile: its remover frees it
            };
            drop(shard);
            if !ours {
                pins[v as usize].fetch_sub(1, Ordering::AcqRel);
                return Some(Evicted::Retry);
            }
            TierCounters::inc(&self.dram.counters.evictions);
            // Retire while still holding our pin, then drop the pin: if a reader pinned it
            // meanwhile, its last unpin frees it (after we release the tier lock).
            pins[v as usize].fetch_or(RETIRED, Ordering::AcqRel);
            let prev = pins[v as usize].fetch_sub(1, Ordering::AcqRel);
            if prev & COUNT == 1 {
                pins[v as usize].store(0, Ordering::Release);
                return Some(Evicted::Freed(v));
            }
            return Some(Evicted::Retry);
        }
        e.set(t, NONE);
        self.emit(StoreEventKind::Removed, t, vkey);
        if e.is_empty() {
            shard.remove(&vkey);
        }
        drop(shard);
        st.policy.on_remove(v, self.now());
        TierCounters::inc(&self.counters(t).evictions);
        Some(Evicted::Freed(v))
    }

    fn put(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        data: &[u8],
    ) -> Result<PutOutcome, StoreError> {
        if data.len() != self.block_bytes {
            return Err(StoreError::WrongSize {
                what: "put payload",
                got: data.len(),
                expected: self.block_bytes,
            });
        }
        match self.reserve(key, parent, None) {
            Ok(mut r) => {
                r.bytes_mut().copy_from_slice(data);
                r.commit()
            }
            Err(outcome) => Ok(outcome),
        }
    }

    fn reserve(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        pending_parent_slot: Option<u32>,
    ) -> Result<Reservation, PutOutcome> {
        if self.shard(&key).contains_key(&key) {
            return Err(PutOutcome::AlreadyPresent);
        }
        let c = &self.dram.counters;
        let parent_slot = match parent {
            Some(p) => match self.shard(&p).get(&p) {
                Some(e) => (e.dram != NONE).then_some(e.dram),
                None if pending_parent_slot.is_some() => pending_parent_slot,
                None => {
                    TierCounters::inc(&c.admissions_refused);
                    return Err(PutOutcome::Rejected(RejectReason::OrphanBlock));
                }
            },
            None => None,
        };
        if let Admission::Reject(why) = self.config.admission.admit(self.pool.backlog()) {
            TierCounters::inc(&c.admissions_refused);
            return Err(PutOutcome::Rejected(why));
        }
        let ctx = self.ctx(parent_slot);
        let Some(slot) = self.alloc(TierKind::Dram, key, ctx, parent) else {
            TierCounters::inc(&c.admissions_refused);
            return Err(PutOutcome::Rejected(RejectReason::NoEvictableSlot));
        };
        Ok(Reservation {
            inner: self.clone(),
            key,
            parent,
            slot,
            open: true,
        })
    }

    /// Makes a filled reservation's block readable. The slot is pinned by the reservation.
    fn commit(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        slot: u32,
    ) -> Result<PutOutcome, StoreError> {
        let c = &self.dram.counters;
        // Records key and length for readers; the bytes are in place already.
        let filled = self
            .dram
            .tier
            .write_with(SlotId(slot), key, self.block_bytes, |_| {
                Ok::<(), std::convert::Infallible>(())
            });
        if let Err(e) = filled {
            self.retire(TierKind::Dram, slot, false);
            self.unpin(TierKind::Dram, slot);
            return Err(e.into());
        }
        // Making room may have evicted the parent: then this block is unreachable.
        let orphaned = parent.is_some_and(|p| !self.shard(&p).contains_key(&p));
        {
            let mut shard = self.shard(&key);
            let present = shard.contains_key(&key);
            if present || orphaned {
                drop(shard);
                self.retire(TierKind::Dram, slot, false);
                self.unpin(TierKind::Dram, slot);
                if present {
                    return Ok(PutOutcome::AlreadyPresent);
                }
                TierCounters::inc(&c.admissions_refused);
                return Ok(PutOutcome::Rejected(RejectReason::OrphanBlock));
            }
            shard.insert(
                key,
                Entry {
                    dram: slot,
                    nvme: NONE,
                    hits: 0,
                },
            );
            self.emit(StoreEventKind::Stored, TierKind::Dram, key);
        }
        TierCounters::add(&c.bytes_in, self.block_bytes as u64);
        if self.nvme.is_some() && self.config.demotion.on_put() {
            self.spawn_demotion(key, parent, slot);
        }
        self.unpin(TierKind::Dram, slot);
        Ok(PutOutcome::Stored(TierKind::Dram))
    }

    fn emit(&self, kind: StoreEventKind, tier: TierKind, key: BlockKey) {
        if let Some(sink) = self.events.get() {
            sink(StoreEvent { kind, tier, key });
        }
    }

    fn snapshot(&self) -> Vec<SnapshotEntry> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let g = lock(shard);
            out.extend(g.iter().map(|(k, e)| SnapshotEntry {
                key: *k,
                in_dram: e.dram != NONE,
                in_nvme: e.nvme != NONE,
            }));
        }
        out
    }

    /// Copies DRAM slot `slot` (pinned by the caller, who keeps its own pin) to NVMe in the
    /// background; a full queue drops the copy and counts it.
    fn spawn_demotion(self: &Arc<Self>, key: BlockKey, parent: Option<BlockKey>, slot: u32) {
        self.dram.pins[slot as usize].fetch_add(1, Ordering::AcqRel);
        let me = self.clone();
        if self
            .pool
            .try_spawn(move || me.demote(key, parent, slot, false))
            .is_err()
        {
            TierCounters::inc(&self.dram.counters.demotions_dropped);
            self.unpin(TierKind::Dram, slot);
        }
    }

    /// Runs on the I/O pool. Copies DRAM slot `ds` (pinned for this job) to a new NVMe slot.
    /// With `evicting`, the DRAM copy is dropped afterwards (write-back); its slot was retired
    /// by the evictor and is freed by the final unpin.
    ///
    /// `parent`, when known, links the copy to its parent's NVMe copy (leaf-first eviction).
    fn demote(self: &Arc<Self>, key: BlockKey, parent: Option<BlockKey>, ds: u32, evicting: bool) {
        let Some(nvme) = &self.nvme else {
            // Unreachable (demotions need an NVMe tier), but never leak the caller's pin.
            self.unpin(TierKind::Dram, ds);
            return;
        };
        let dc = &self.dram.counters;
        let parent_slot = parent.and_then(|p| {
            let shard = self.shard(&p);
            shard.get(&p).map(|e| e.nvme).filter(|&s| s != NONE)
        });
        let stored = match self.alloc(TierKind::Nvme, key, self.ctx(parent_slot), parent) {
            None => {
                TierCounters::inc(&dc.demotions_dropped);
                None
            }
            Some(ns) => {
                let r = self
                    .dram
                    .tier
                    .read_with(SlotId(ds), key, self.block_bytes, |bytes| {
                        nvme.tier.write_linked(SlotId(ns), key, parent, bytes)
                    });
                match r {
                    Ok(Ok(())) => Some(ns),
                    Ok(Err(e)) | Err(e) => {
                        tracing::debug!(%key, "demotion failed: {e}");
                        TierCounters::inc(&nvme.counters.io_errors);
                        // The slot may still hold an older block's valid header: erase it.
                        self.retire(TierKind::Nvme, ns, true);
                        self.unpin(TierKind::Nvme, ns);
                        None
                    }
                }
            }
        };
        let mut orphan_nvme = None;
        let mut dropped_dram = false;
        {
            let mut shard = self.shard(&key);
            match shard.get_mut(&key) {
                Some(e) => {
                    if let Some(ns) = stored {
                        if e.nvme == NONE {
                            e.nvme = ns;
                            self.emit(StoreEventKind::Stored, TierKind::Nvme, key);
                        } else {
                            orphan_nvme = Some(ns);
                        }
                    }
                    if evicting && e.dram == ds {
                        e.dram = NONE;
                        dropped_dram = true;
                        self.emit(StoreEventKind::Removed, TierKind::Dram, key);
                        if e.is_empty() {
                            shard.remove(&key);
                        }
                    }
                }
                None => orphan_nvme = stored,
            }
        }
        if let Some(ns) = stored {
            TierCounters::inc(&dc.demotions);
            TierCounters::add(&nvme.counters.bytes_in, self.block_bytes as u64);
            if orphan_nvme.is_some() {
                // Removed or cleared while copying: erase, or a restart would bring it back.
                self.retire(TierKind::Nvme, ns, true);
            }
            self.unpin(TierKind::Nvme, ns);
        }
        if evicting {
            TierCounters::inc(&dc.evictions);
            self.writebacks_inflight.fetch_sub(1, Ordering::AcqRel);
            if dropped_dram {
                self.retire(TierKind::Dram, ds, false);
            }
        }
        self.unpin(TierKind::Dram, ds);
    }

    /// Pins the location of `key`: DRAM if present there, else NVMe. Counts the hit.
    fn pin_location(&self, key: BlockKey) -> Option<(TierKind, u32, u32)> {
        let mut shard = self.shard(&key);
        let e = shard.get_mut(&key)?;
        // Hits count toward selective write-through only while there is no NVMe copy.
        if e.nvme == NONE {
            e.hits = e.hits.saturating_add(1);
        } else {
            e.hits = 0;
        }
        let (t, s) = if e.dram != NONE {
            (TierKind::Dram, e.dram)
        } else {
            (TierKind::Nvme, e.nvme)
        };
        self.parts(t).1[s as usize].fetch_add(1, Ordering::AcqRel);
        Some((t, s, e.hits))
    }

    fn touch(&self, t: TierKind, slot: u32) {
        let now = self.now();
        lock(self.parts(t).0).policy.on_hit(slot, now);
    }

    fn now(&self) -> u64 {
        self.config.clock.now_ms()
    }

    fn ctx(&self, parent: Option<u32>) -> InsertContext {
        InsertContext {
            parent,
            now_ms: self.now(),
        }
    }

    /// The longest cached prefix of `keys`, with each tier's policy told about the request.
    fn lookup(&self, keys: &[BlockKey]) -> Vec<TierKind> {
        let mut out = Vec::new();
        let mut dram = Vec::new();
        let mut nvme = Vec::new();
        let (mut dram_run, mut nvme_run) = (true, true);
        for k in keys {
            let shard = self.shard(k);
            let Some(e) = shard.get(k).filter(|e| !e.is_empty()) else {
                break;
            };
            dram_run &= e.dram != NONE;
            nvme_run &= e.nvme != NONE;
            if dram_run {
                dram.push(e.dram);
            }
            if nvme_run {
                nvme.push(e.nvme);
            }
            out.push(if e.dram != NONE {
                TierKind::Dram
            } else {
                TierKind::Nvme
            });
        }
        let now = self.now();
        let tell = |state: &Mutex<TierState>, hits: &mut Vec<u32>| {
            let mut st = lock(state);
            // A slot may have been reused since it was read under the shard lock: keep only
            // the prefix whose slots still hold these keys.
            let valid = hits
                .iter()
                .zip(keys)
                .take_while(|(s, k)| st.keys[**s as usize] == **k)
                .count();
            hits.truncate(valid);
            st.policy.on_lookup(LookupContext {
                hits,
                rest: &keys[hits.len()..],
                now_ms: now,
            });
        };
        tell(&self.dram.state, &mut dram);
        if let Some(n) = &self.nvme {
            tell(&n.state, &mut nvme);
        }
        out
    }

    fn get(self: &Arc<Self>, key: BlockKey, buf: &mut [u8]) -> Result<GetOutcome, StoreError> {
        if buf.len() != self.block_bytes {
            return Err(StoreError::WrongSize {
                what: "get buffer",
                got: buf.len(),
                expected: self.block_bytes,
            });
        }
        let dc = &self.dram.counters;
        let Some((t, slot, hits)) = self.pin_location(key) else {
            TierCounters::inc(&dc.misses);
            return Ok(GetOutcome::Miss(MissReason::NotCached));
        };
        if t == TierKind::Dram {
            let r = self.dram.tier.read(SlotId(slot), key, buf);
            self.touch(t, slot);
            if r.is_ok() && self.nvme.is_some() && self.config.demotion.on_hit(hits) {
                self.spawn_demotion(key, None, slot);
            }
            self.unpin(t, slot);
            return Ok(match r {
                Ok(()) => {
                    TierCounters::inc(&dc.hits);
                    TierCounters::add(&dc.bytes_out, buf.len() as u64);
                    GetOutcome::Hit(TierKind::Dram)
                }
                // A DRAM slot referenced by the index always holds its key; a failure here is
                // a bug, reported as a miss rather than wrong bytes.
                Err(e) => {
                    tracing::error!(%key, "DRAM read failed: {e}");
                    TierCounters::inc(&dc.misses);
                    GetOutcome::Miss(MissReason::Busy)
                }
            });
        }
        TierCounters::inc(&dc.misses);
        match self.promote_pinned(key, slot, false, None) {
            Ok(Some(ds)) => {
                let r = self.dram.tier.read(SlotId(ds), key, buf);
                self.unpin(TierKind::Dram, ds);
                Ok(match r {
                    Ok(()) => GetOutcome::Hit(TierKind::Nvme),
                    Err(_) => GetOutcome::Miss(MissReason::Busy),
                })
            }
            Ok(None) => {
                // No DRAM slot (or promotion off): read through a bounce buffer.
                let me = self.clone();
                let r = self.pool.run(move || {
                    let (mut b, _) = me.bounce.take();
                    let n = me.block_bytes;
                    let r = me
                        .nvme
                        .as_ref()
                        .map(|n| n.tier.read(SlotId(slot), key, &mut b[..me.block_bytes]));
                    let r = r.unwrap_or(Err(TierError::Unavailable {
                        reason: "no NVMe tier".into(),
                    }));
                    (r, b, n)
                });
                let outcome = match r {
                    Ok((Ok(()), b, n)) => {
                        buf.copy_from_slice(&b[..n]);
                        self.bounce.give(b);
                        self.nvme_hit(slot);
                        GetOutcome::Hit(TierKind::Nvme)
                    }
                    Ok((Err(e), b, _)) => {
                        self.bounce.give(b);
                        GetOutcome::Miss(self.nvme_failed(key, slot, &e))
                    }
                    Err(_) => GetOutcome::Miss(MissReason::Busy),
                };
                self.unpin(TierKind::Nvme, slot);
                Ok(outcome)
            }
            Err(reason) => Ok(GetOutcome::Miss(reason)),
        }
    }

    fn nvme_hit(&self, slot: u32) {
        if let Some(n) = &self.nvme {
            TierCounters::inc(&n.counters.hits);
            TierCounters::add(&n.counters.bytes_out, self.block_bytes as u64);
            self.touch(TierKind::Nvme, slot);
        }
    }

    /// Drops the NVMe copy of `key` in `slot` after a failed read, counting why.
    fn nvme_failed(self: &Arc<Self>, key: BlockKey, slot: u32, e: &TierError) -> MissReason {
        let Some(n) = &self.nvme else {
            return MissReason::IoError;
        };
        let reason = match e {
            TierError::Corrupt { .. } => {
                TierCounters::inc(&n.counters.corrupt_dropped);
                tracing::warn!(%key, slot, "dropping corrupt NVMe block: {e}");
                MissReason::Corrupt
            }
            TierError::Mismatch { .. } => {
                // Stale header (cleared or overwritten on disk): not damage, but not ours.
                TierCounters::inc(&n.counters.misses);
                MissReason::NotCached
            }
            _ => {
                TierCounters::inc(&n.counters.io_errors);
                tracing::warn!(%key, slot, "NVMe read failed: {e}");
                MissReason::IoError
            }
        };
        let mut shard = self.shard(&key);
        if let Some(ent) = shard.get_mut(&key).filter(|ent| ent.nvme == slot) {
            ent.nvme = NONE;
            self.emit(StoreEventKind::Removed, TierKind::Nvme, key);
            if ent.is_empty() {
                shard.remove(&key);
            }
            drop(shard);
            // Erase the bad header so a restart does not index it again.
            self.retire(TierKind::Nvme, slot, true);
        }
        reason
    }

    /// Promotes NVMe slot `ns` (pinned by the caller) into a new DRAM slot. `Ok(Some(ds))`:
    /// promoted, `ds` returned pinned and `ns` unpinned. `Ok(None)`: not promoted (policy, or
    /// no DRAM slot), `ns` still pinned for the caller's fallback. `Err`: the NVMe copy was bad
    /// and is dropped, `ns` unpinned. `inline` is for callers already on the I/O pool.
    fn promote_pinned(
        self: &Arc<Self>,
        key: BlockKey,
        ns: u32,
        inline: bool,
        parent: Option<(BlockKey, u32)>,
    ) -> Result<Option<u32>, MissReason> {
        if self.config.promotion == PromotionPolicy::Never {
            return Ok(None);
        }
        let ctx = self.ctx(parent.map(|(_, s)| s));
        let Some(ds) = self.alloc(TierKind::Dram, key, ctx, parent.map(|(k, _)| k)) else {
            return Ok(None);
        };
        let r = if inline {
            self.promote_io(key, ns, ds)
        } else {
            let me = self.clone();
            self.pool
                .run(move || me.promote_io(key, ns, ds))
                .unwrap_or_else(|_| {
                    Err(TierError::Unavailable {
                        reason: "I/O pool stopped".into(),
                    })
                })
        };
        let out = match r {
            Ok(()) => {
                let adopted = {
                    let mut shard = self.shard(&key);
                    match shard.get_mut(&key) {
                        Some(e) if e.dram == NONE => {
                            e.dram = ds;
                            self.emit(StoreEventKind::Stored, TierKind::Dram, key);
                            true
                        }
                        _ => false,
                    }
                };
                if !adopted {
                    // Promoted twice at once, or removed meanwhile: this copy is spare. It
                    // stays readable under our pin and is freed when it is unpinned.
                    self.retire(TierKind::Dram, ds, false);
                }
                TierCounters::inc(&self.dram.counters.promotions);
                self.nvme_hit(ns);
                Ok(Some(ds))
            }
            Err(e) => {
                self.retire(TierKind::Dram, ds, false);
                self.unpin(TierKind::Dram, ds);
                if matches!(e, TierError::Unavailable { .. }) {
                    // The pool is stopping: the NVMe copy is fine, just not readable now.
                    Err(MissReason::Busy)
                } else {
                    Err(self.nvme_failed(key, ns, &e))
                }
            }
        };
        self.unpin(TierKind::Nvme, ns);
        out
    }

    /// Reads NVMe slot `ns` straight into DRAM slot `ds` (both pinned by the caller).
    fn promote_io(&self, key: BlockKey, ns: u32, ds: u32) -> Result<(), TierError> {
        let Some(n) = &self.nvme else {
            return Err(TierError::Unavailable {
                reason: "no NVMe tier".into(),
            });
        };
        self.dram
            .tier
            .write_with(SlotId(ds), key, self.block_bytes, |b| {
                n.tier.read(SlotId(ns), key, b)
            })
            .and_then(|r| r)
    }

    /// Pins the longest cached prefix of `keys` in DRAM, promoting NVMe blocks; returns the
    /// pinned blocks and why the prefix stopped early (if it did).
    ///
    /// With `may_block` false it never waits for I/O: at the first block that would need a
    /// promotion from NVMe it unpins everything and returns `None`.
    fn pin_prefix(
        self: &Arc<Self>,
        keys: &[BlockKey],
        may_block: bool,
    ) -> Option<(Vec<PinnedBlock>, Option<MissReason>)> {
        let mut blocks: Vec<PinnedBlock> = Vec::new();
        let mut miss = None;
        for (i, &key) in keys.iter().enumerate() {
            // The previous key's DRAM slot links a promoted block to its parent.
            let parent = i
                .checked_sub(1)
                .and_then(|p| Some((keys[p], blocks.get(p)?.slot.0)));
            let Some((t, slot, _)) = self.pin_location(key) else {
                miss = Some(MissReason::NotCached);
                break;
            };
            if t != TierKind::Dram && !may_block {
                self.unpin(t, slot);
                for b in &blocks {
                    self.unpin(TierKind::Dram, b.slot.0);
                }
                return None;
            }
            let ds = if t == TierKind::Dram {
                self.touch(t, slot);
                TierCounters::inc(&self.dram.counters.hits);
                slot
            } else {
                TierCounters::inc(&self.dram.counters.misses);
                match self.promote_pinned(key, slot, false, parent) {
                    Ok(Some(ds)) => ds,
                    Ok(None) => {
                        self.unpin(TierKind::Nvme, slot);
                        miss = Some(MissReason::Busy);
                        break;
                    }
                    Err(reason) => {
                        miss = Some(reason);
                        break;
                    }
                }
            };
            TierCounters::add(&self.dram.counters.bytes_out, self.block_bytes as u64);
            blocks.push(PinnedBlock {
                key,
                slot: SlotId(ds),
                offset: self.dram.tier.slot_offset(SlotId(ds)),
                len: self.block_bytes as u64,
                found_in: t,
            });
        }
        Some((blocks, miss))
    }

    fn pin(self: &Arc<Self>, keys: &[BlockKey], lease: Duration, may_block: bool) -> Option<Lease> {
        let deadline = Instant::now() + lease.min(self.config.max_lease);
        let (blocks, miss) = self.pin_prefix(keys, may_block)?;
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        if !blocks.is_empty() {
            let slots = blocks.iter().map(|b| b.slot.0).collect();
            lock(&self.leases).insert(id, LeaseRecord { deadline, slots });
        }
        Some(Lease {
            id,
            deadline,
            blocks,
            miss,
        })
    }

    fn release_lease(self: &Arc<Self>, id: u64) -> bool {
        let Some(rec) = lock(&self.leases).remove(&id) else {
            return false;
        };
        for s in rec.slots {
            self.unpin(TierKind::Dram, s);
        }
        true
    }

    fn reap_leases(self: &Arc<Self>, now: Instant) -> usize {
        let expired: Vec<LeaseRecord> = {
            let mut leases = lock(&self.leases);
            let ids: Vec<u64> = leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| leases.remove(id)).collect()
        };
        for rec in &expired {
            for &s in &rec.slots {
                self.unpin(TierKind::Dram, s);
            }
        }
        expired.len()
    }

    fn prefetch(self: &Arc<Self>, keys: &[BlockKey]) -> usize {
        if self.nvme.is_none() {
            return 0;
        }
        let mut queued = 0;
        for &key in keys {
            let ns = {
                let shard = self.shard(&key);
                match shard.get(&key) {
                    Some(e) if e.dram == NONE && e.nvme != NONE => {
                        self.parts(TierKind::Nvme).1[e.nvme as usize]
                            .fetch_add(1, Ordering::AcqRel);
                        e.nvme
                    }
                    _ => continue,
                }
            };
            let me = self.clone();
            let job = move || match me.promote_pinned(key, ns, true, None) {
                Ok(Some(ds)) => me.unpin(TierKind::Dram, ds),
                Ok(None) => me.unpin(TierKind::Nvme, ns),
                Err(_) => {}
            };
            if self.pool.try_spawn(job).is_ok() {
                queued += 1;
            } else {
                self.unpin(TierKind::Nvme, ns);
            }
        }
        queued
    }

    /// Takes `key` out of the index, pinning its slots under the shard lock so nothing can
    /// reuse them before they are retired (the remover is the only one who retires them).
    fn take_entry(&self, shard: &mut Shard, key: &BlockKey) -> Option<Entry> {
        let e = shard.remove(key)?;
        if e.dram != NONE {
            self.dram.pins[e.dram as usize].fetch_add(1, Ordering::AcqRel);
        }
        if let (Some(n), true) = (&self.nvme, e.nvme != NONE) {
            n.pins[e.nvme as usize].fetch_add(1, Ordering::AcqRel);
        }
        Some(e)
    }

    fn retire_entry(self: &Arc<Self>, e: Entry, erase_nvme: bool) {
        if e.dram != NONE {
            self.retire(TierKind::Dram, e.dram, false);
            self.unpin(TierKind::Dram, e.dram);
        }
        if e.nvme != NONE {
            self.retire(TierKind::Nvme, e.nvme, erase_nvme);
            self.unpin(TierKind::Nvme, e.nvme);
        }
    }

    fn remove(self: &Arc<Self>, key: BlockKey) -> bool {
        let e = {
            let mut shard = self.shard(&key);
            let Some(e) = self.take_entry(&mut shard, &key) else {
                return false;
            };
            for (t, slot) in [(TierKind::Dram, e.dram), (TierKind::Nvme, e.nvme)] {
                if slot != NONE {
                    self.emit(StoreEventKind::Removed, t, key);
                }
            }
            e
        };
        self.retire_entry(e, true);
        true
    }

    fn clear(self: &Arc<Self>) -> Result<(), StoreError> {
        // Bump the NVMe epoch first: every header written before it is dead from here on,
        // including copies still in flight.
        if let Some(n) = &self.nvme {
            n.tier.clear_all()?;
        }
        for shard in self.shards.iter() {
            let entries: Vec<Entry> = {
                let mut g = lock(shard);
                let keys: Vec<BlockKey> = g.keys().copied().collect();
                keys.iter()
                    .filter_map(|k| self.take_entry(&mut g, k))
                    .collect()
            };
            for e in entries {
                self.retire_entry(e, false);
            }
        }
        // A copy that was in flight during the drain may carry the first new epoch and have
        // been linked before its shard was drained: retire that epoch too.
        if let Some(n) = &self.nvme {
            n.tier.clear_all()?;
        }
        self.emit(StoreEventKind::Cleared, TierKind::Dram, BlockKey::default());
        Ok(())
    }

    fn check_consistency(&self) -> Result<(), String> {
        let mut refs: HashMap<(TierKind, u32), BlockKey> = HashMap::new();
        for shard in self.shards.iter() {
            for (k, e) in lock(shard).iter() {
                if e.is_empty() {
                    return Err(format!("{k}: an index entry with no location"));
                }
                for (t, s) in [(TierKind::Dram, e.dram), (TierKind::Nvme, e.nvme)] {
                    if s != NONE
                        && let Some(other) = refs.insert((t, s), *k)
                    {
                        return Err(format!("{t} slot {s} referenced by {k} and {other}"));
                    }
                }
            }
        }
        let check = |t: TierKind, state: &Mutex<TierState>, pins: &[AtomicU32]| {
            let st = lock(state);
            let mut free = vec![false; pins.len()];
            for &s in &st.free {
                if std::mem::replace(&mut free[s as usize], true) {
                    return Err(format!("{t} slot {s} is on the free list twice"));
                }
                if refs.contains_key(&(t, s)) {
                    return Err(format!("{t} slot {s} is free and referenced"));
                }
            }
            for (s, p) in pins.iter().enumerate() {
                let p = p.load(Ordering::Acquire);
                if p != 0 {
                    return Err(format!("{t} slot {s} has pin word {p:#x} while quiescent"));
                }
                if !free[s] && !refs.contains_key(&(t, s as u32)) {
                    return Err(format!("{t} slot {s} leaked: neither free nor referenced"));
                }
            }
            Ok(())
        };
        check(TierKind::Dram, &self.dram.state, &self.dram.pins)?;
        if let Some(n) = &self.nvme {
            check(TierKind::Nvme, &n.state, &n.pins)?;
        }
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        let mut tiers = vec![tier_stats(TierKind::Dram, &self.dram)];
        if let Some(n) = &self.nvme {
            tiers.push(tier_stats(TierKind::Nvme, n));
        }
        let entry_bytes = std::mem::size_of::<(BlockKey, Entry)>() + 1;
        let index_bytes: usize = self
            .shards
            .iter()
            .map(|s| lock(s).capacity() * entry_bytes)
            .sum();
        let slots: u64 = tiers.iter().map(|t| t.capacity_slots).sum();
        let tier_bytes: u64 = tiers
            .iter()
            .map(|t| t.capacity_slots * t.metadata_bytes_per_slot)
            .sum();
        StoreStats {
            metadata_bytes_per_block: (tier_bytes + index_bytes as u64) / slots.max(1),
            tiers,
            blocks: self.shards.iter().map(|s| lock(s).len() as u64).sum(),
            leases_outstanding: lock(&self.leases).len() as u64,
            io_backlog: self.pool.backlog() as u64,
        }
    }
}

fn tier_stats<T: Tier>(kind: TierKind, slots: &Slots<T>) -> TierStats {
    let mut s = TierStats::from_counters(kind, &slots.counters);
    s.capacity_slots = u64::from(slots.tier.slot_count());
    s.slot_bytes = slots.tier.slot_bytes() as u64;
    let st = lock(&slots.state);
    s.used_slots = s.capacity_slots.saturating_sub(st.free.len() as u64);
    // Slot key, pin word and free-list entry, the policy's arrays, and the tier's own
    // per-slot table (key/length/lock for memory tiers, a lock for NVMe).
    let tier_table = match kind {
        TierKind::Nvme => 4,
        _ => 32,
    };
    s.metadata_bytes_per_slot = (16 + 4 + 4 + st.policy.bytes_per_slot() + tier_table) as u64;
    drop(st);
    s.pins_outstanding = slots
        .pins
        .iter()
        .filter(|p| p.load(Ordering::Relaxed) & COUNT != 0)
        .count() as u64;
    s
}

/// Blocks pinned in DRAM for as long as this guard lives (see [`TieredStore::pin_read`]).
pub struct PinnedRead {
    inner: Arc<Inner>,
    blocks: Vec<PinnedBlock>,
    miss: Option<MissReason>,
}

impl PinnedRead {
    pub fn blocks(&self) -> &[PinnedBlock] {
        &self.blocks
    }

    /// Why the prefix stopped, when it is shorter than the keys asked for.
    pub fn miss(&self) -> Option<MissReason> {
        self.miss
    }

    /// The bytes of the `i`-th pinned block, read in place.
    pub fn bytes(&self, i: usize) -> &[u8] {
        let b = &self.blocks[i];
        // SAFETY: the slot is pinned by this guard and was referenced by the index when it was
        // pinned, so it holds `b.key`'s committed bytes: a pinned slot is never reallocated,
        // and only the allocator of an unreferenced slot writes into it. The range is the
        // slot's own (checked by `slot_bytes`), inside the arena that `inner` keeps mapped.
        unsafe {
            self.inner
                .dram
                .tier
                .slot_bytes_in_place(b.slot, b.len as usize)
        }
    }
}

impl Drop for PinnedRead {
    fn drop(&mut self) {
        for b in &self.blocks {
            self.inner.unpin(TierKind::Dram, b.slot.0);
        }
    }
}

impl std::fmt::Debug for PinnedRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRead")
            .field("blocks", &self.blocks)
            .field("miss", &self.miss)
            .finish()
    }
}

/// A DRAM slot reserved for one block (see [`TieredStore::reserve`]). Fill it, then
/// [`Reservation::commit`]; dropping it uncommitted frees the slot.
pub struct Reservation {
    inner: Arc<Inner>,
    key: BlockKey,
    parent: Option<BlockKey>,
    slot: u32,
    open: bool,
}

impl Reservation {
    pub fn key(&self) -> BlockKey {
        self.key
    }

    /// Byte offset of the reserved slot in the DRAM arena.
    pub fn offset(&self) -> u64 {
        self.inner.dram.tier.slot_offset(SlotId(self.slot))
    }

    /// The reserved slot's memory (one block long), to fill in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the slot was allocated to this reservation (pinned, referenced by no key),
        // so no reader or other writer in this process touches it until commit or drop, and
        // `&mut self` makes this the only live slice. The range is the slot's own.
        unsafe {
            self.inner
                .dram
                .tier
                .slot_bytes_in_place_mut(SlotId(self.slot), self.inner.block_bytes)
        }
    }

    /// Publishes the block. `AlreadyPresent` if someone stored the key meanwhile, `Rejected`
    /// if its parent was evicted meanwhile; the slot is freed in both cases.
    pub fn commit(mut self) -> Result<PutOutcome, StoreError> {
        self.open = false;
        self.inner.commit(self.key, self.parent, self.slot)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.open {
            self.inner.retire(TierKind::Dram, self.slot, false);
            self.inner.unpin(TierKind::Dram, self.slot);
        }
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("key", &self.key)
            .field("slot", &self.slot)
            .finish()
    }
}

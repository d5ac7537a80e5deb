//! Slots and pin words per tier: the free list, slot -> key, the eviction policy's state,
//! and the atomic pin word of every slot; pinning, retiring and freeing slots; per-tier stats.
//!
//! Tiers are named by their position in the store's list (fastest first), not by kind.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvtier_core::BlockKey;

use crate::policy::{ChainAwareTuning, EvictionKind, EvictionPolicy};
use crate::stats::{StoreStats, TierCounters, TierStats};
use crate::tier::published::Parent;
use crate::tier::{SlotId, Tier, TierKind};

use super::index::Entry;
use super::{Inner, lock};

pub(super) const NONE: u32 = u32::MAX;
/// Pin-word bits: the low bits count pins; RETIRED means "free me at zero"; ERASE means
/// "erase my on-disk header before freeing".
pub(super) const RETIRED: u32 = 1 << 31;
pub(super) const ERASE: u32 = 1 << 30;
pub(super) const COUNT: u32 = ERASE - 1;

pub(super) struct TierState {
    pub(super) free: Vec<u32>,
    pub(super) keys: Box<[BlockKey]>,
    pub(super) policy: Box<dyn EvictionPolicy>,
    /// Held lookups holding each slot (host tier only; empty elsewhere): eviction skips a
    /// held slot. Counted under this lock, which the lookup's policy update takes anyway.
    pub(super) held: Box<[u32]>,
    /// Guest copies (host tier only; empty elsewhere): evicted before the blocks the
    /// policy ranks.
    pub(super) guests: Guests,
}

/// Guest slots a victim search looks at (and passes over, when pinned or held) at most.
const GUEST_SCAN: usize = 64;
/// Stale queue entries a victim search drops at most (a bound on the time it holds the
/// tier's lock; what is left is dropped by the searches after it, or by compaction).
const GUEST_STALE_DROP: usize = 4096;

/// The guest copies of a tier: blocks another cluster member owns (fetched from it, or put
/// here and handed to it), which this tier evicts first, so that when room is short the
/// cluster keeps one copy of a block, its owner's. A slot's flag is set by
/// [`super::TieredStore::mark_guests`] and cleared when the slot is given a new block.
#[derive(Default)]
pub(super) struct Guests {
    flag: Box<[bool]>,
    /// Slots marked, oldest first; an entry whose flag was cleared since is stale and
    /// skipped. A slot cleared and marked again before its old entry was popped has two
    /// entries, and the older one counts (its place is early, never lost); compaction drops
    /// such repeats.
    queue: VecDeque<u32>,
    live: usize,
}

impl Guests {
    pub(super) fn new(slots: usize) -> Self {
        Self {
            flag: vec![false; slots].into(),
            queue: VecDeque::new(),
            live: 0,
        }
    }

    /// The oldest guest slot that `evictable` accepts, unmarked; guests passed over (pinned,
    /// held) go to the back, and at most [`GUEST_SCAN`] are passed over. Stale entries are
    /// dropped on the way, up to [`GUEST_STALE_DROP`], and not counted against the scan:
    /// each is popped once, so they cost little over time, whereas counting them let a run
    /// of them hide every guest (the policy then chose the victim, possibly a block just
    /// stored for the request in progress). `None`: no guest to evict, ask the policy.
    pub(super) fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let (mut passed, mut dropped) = (0, 0);
        while passed < GUEST_SCAN.min(self.live) && dropped < GUEST_STALE_DROP {
            let s = self.queue.pop_front()?;
            if !self.flag.get(s as usize).copied().unwrap_or(false) {
                dropped += 1; // stale: the slot was given another block since
                continue;
            }
            if evictable(s) {
                self.clear(s);
                return Some(s);
            }
            self.queue.push_back(s);
            passed += 1;
        }
        None
    }

    /// Marks slot `s` as a guest (queued once). Returns whether it was not one before.
    pub(super) fn mark(&mut self, s: u32) -> bool {
        match self.flag.get_mut(s as usize) {
            Some(g) if !*g => {
                *g = true;
                self.live += 1;
                self.queue.push_back(s);
                if self.queue.len() > 2 * self.flag.len() {
                    self.compact();
                }
                true
            }
            _ => false,
        }
    }

    /// Whether slot `s` is a guest now.
    pub(super) fn is(&self, s: u32) -> bool {
        self.flag.get(s as usize).copied().unwrap_or(false)
    }

    /// Slot `s` is not a guest (given a new block, or chosen as a victim).
    pub(super) fn clear(&mut self, s: u32) {
        if let Some(g) = self.flag.get_mut(s as usize)
            && *g
        {
            *g = false;
            self.live -= 1;
        }
    }

    /// Drops stale and repeated entries, keeping the queue's order: after it the queue holds
    /// one entry per marked slot, and it runs again before the queue passes twice the slots.
    fn compact(&mut self) {
        let mut seen = vec![false; self.flag.len()];
        self.queue.retain(|&s| {
            let keep = self.flag[s as usize] && !seen[s as usize];
            seen[s as usize] = true;
            keep
        });
    }

    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// No slot is a guest any more; returns how many were.
    pub(super) fn clear_all(&mut self) -> usize {
        let was = self.live;
        self.flag.fill(false);
        self.queue.clear();
        self.live = 0;
        was
    }
}

/// One tier of the store's list and the store's bookkeeping of its slots.
pub(super) struct Slots {
    pub(super) kind: TierKind,
    pub(super) tier: Arc<dyn Tier>,
    pub(super) state: Mutex<TierState>,
    pub(super) pins: Box<[AtomicU32]>,
    pub(super) counters: TierCounters,
    /// Write-backs of this tier's victims still copying down.
    pub(super) writebacks_inflight: AtomicUsize,
}

pub(super) fn slots_for(
    tier: Arc<dyn Tier>,
    eviction: EvictionKind,
    tuning: ChainAwareTuning,
) -> Slots {
    let n = tier.slot_count();
    Slots {
        kind: tier.kind(),
        state: Mutex::new(TierState {
            free: (0..n).rev().collect(),
            keys: vec![BlockKey::default(); n as usize].into(),
            policy: eviction.build(n, tuning),
            held: Box::default(),
            guests: Guests::default(),
        }),
        pins: (0..n).map(|_| AtomicU32::new(0)).collect(),
        counters: TierCounters::default(),
        writebacks_inflight: AtomicUsize::new(0),
        tier,
    }
}

pub(super) fn tier_stats(slots: &Slots) -> TierStats {
    let mut s = TierStats::from_counters(slots.kind, &slots.counters);
    s.capacity_slots = u64::from(slots.tier.slot_count());
    s.slot_bytes = slots.tier.slot_bytes() as u64;
    let st = lock(&slots.state);
    s.used_slots = s.capacity_slots.saturating_sub(st.free.len() as u64);
    // Slot key, pin word and free-list entry, the hold count (host tier), the policy's
    // arrays, and the tier's own
    // per-slot table (key/length/lock for memory tiers, a lock for NVMe).
    let tier_table = match slots.kind {
        TierKind::Nvme => 4,
        _ => 32,
    };
    // The host tier's hold count (4), guest flag and queue entry (1 + 4), and the
    // published table's chain link (24).
    let host_only = 33 * st.held.len().min(1);
    s.metadata_bytes_per_slot =
        (16 + 4 + 4 + host_only + st.policy.bytes_per_slot() + tier_table) as u64;
    s.guest_slots = st.guests.live() as u64;
    drop(st);
    s.pins_outstanding = slots
        .pins
        .iter()
        .filter(|p| p.load(Ordering::Relaxed) & COUNT != 0)
        .count() as u64;
    s
}

impl Inner {
    /// Adds a pin to slot `slot` of tier `t`. Only under the shard lock of the key that
    /// references the slot (or by the holder of another pin on it).
    pub(super) fn pin_slot(&self, t: usize, slot: u32) {
        self.tiers[t].pins[slot as usize].fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn unpin(self: &Arc<Self>, t: usize, slot: u32) {
        let pins = &self.tiers[t].pins;
        let prev = pins[slot as usize].fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT != 0, "unpin of an unpinned slot");
        if prev & COUNT == 1 && prev & RETIRED != 0 {
            self.free(t, slot, prev & ERASE != 0);
        }
    }

    /// Takes `slot` out of tier `t`'s policy and frees it once no pin holds it. `erase`
    /// matters only for a persistent tier (its header goes before the slot is reused).
    pub(super) fn retire(self: &Arc<Self>, t: usize, slot: u32, erase: bool) {
        let s = &self.tiers[t];
        // Local clients stop reading it in place before it can be reused.
        self.unplaced(t, slot);
        lock(&s.state).policy.on_remove(slot, self.now());
        let bits = RETIRED | if erase { ERASE } else { 0 };
        let prev = s.pins[slot as usize].fetch_or(bits, Ordering::AcqRel);
        if prev & COUNT == 0 {
            self.free(t, slot, erase);
        }
    }

    pub(super) fn free(self: &Arc<Self>, t: usize, slot: u32, erase: bool) {
        let s = &self.tiers[t];
        if erase && s.tier.is_persistent() {
            // The header goes before the slot can be reused, so a restart cannot bring the
            // removed block back. On a full queue, erase here: removal is rare.
            let me = self.clone();
            let job = move || me.erase_then_free(t, slot);
            if self.pool.try_spawn(job).is_err() {
                self.erase_then_free(t, slot);
            }
            return;
        }
        let mut st = lock(&s.state);
        s.pins[slot as usize].store(0, Ordering::Release);
        st.free.push(slot);
    }

    pub(super) fn erase_then_free(self: &Arc<Self>, t: usize, slot: u32) {
        let s = &self.tiers[t];
        if let Err(e) = s.tier.erase(SlotId(slot)) {
            TierCounters::inc(&s.counters.io_errors);
            self.write_failed(t, &e);
        }
        self.free(t, slot, false);
    }

    /// The index now names `slot` of tier `t` for `key` (its bytes are in place): local
    /// clients may read it without a message. `parent`: the one its put named, for the
    /// table's chain marks. Call under the key's shard lock.
    pub(super) fn placed(&self, t: usize, slot: u32, key: BlockKey, parent: Parent) {
        if t == self.host {
            self.dram.published().publish(SlotId(slot), key, parent);
        }
    }

    /// The index no longer names `slot` of tier `t` (evicted, removed, retired): local
    /// clients stop reading it in place, before anything can write it again.
    pub(super) fn unplaced(&self, t: usize, slot: u32) {
        if t == self.host {
            self.dram.published().unpublish(SlotId(slot));
        }
    }

    pub(super) fn touch(&self, t: usize, slot: u32) {
        let now = self.now();
        lock(&self.tiers[t].state).policy.on_hit(slot, now);
    }

    pub(super) fn stats(&self) -> StoreStats {
        let tiers: Vec<TierStats> = self.tiers.iter().map(tier_stats).collect();
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
            lookup_holds: self.holds.taken.load(Ordering::Relaxed),
            lookup_holds_refused: self.holds.refused.load(Ordering::Relaxed),
            held_blocks: self.holds.blocks.load(Ordering::Relaxed),
            io_backlog: self.pool.backlog() as u64,
            retain: self.retain.stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long run of stale entries (slots marked, then given new blocks) does not hide the
    /// live guest behind it.
    #[test]
    fn stale_entries_do_not_hide_a_guest() {
        let mut g = Guests::new(1000);
        for s in 0..500 {
            assert!(g.mark(s));
            g.clear(s); // the slot took another block
        }
        assert!(g.mark(700));
        assert_eq!(g.live(), 1);
        assert_eq!(g.victim(&mut |_| true), Some(700));
        assert_eq!(g.live(), 0);
        assert_eq!(g.victim(&mut |_| true), None);
        // Unevictable guests are passed over, at most GUEST_SCAN of them, and stay queued.
        for s in 0..100 {
            g.mark(s);
        }
        let mut looked = 0;
        assert_eq!(
            g.victim(&mut |_| {
                looked += 1;
                false
            }),
            None
        );
        assert_eq!(looked, GUEST_SCAN);
        assert_eq!(g.victim(&mut |s| s == 99), Some(99));
        assert_eq!(g.live(), 99);
    }

    /// Clearing every guest leaves none to evict; slots can be marked again after it.
    #[test]
    fn clearing_all_guests_leaves_none() {
        let mut g = Guests::new(64);
        for s in [3, 9, 40] {
            assert!(g.mark(s));
        }
        assert_eq!(g.clear_all(), 3);
        assert_eq!(g.live(), 0);
        assert!(!g.is(9));
        assert_eq!(g.victim(&mut |_| true), None);
        assert!(g.mark(9));
        assert_eq!(g.victim(&mut |_| true), Some(9));
        assert_eq!(g.clear_all(), 0);
    }

    /// One search drops at most GUEST_STALE_DROP stale entries (a bound on its time under
    /// the lock); the next one goes on from there.
    #[test]
    fn a_search_drops_a_bounded_number_of_stale_entries() {
        let n = GUEST_STALE_DROP as u32 + 10;
        let mut g = Guests::new(n as usize + 1);
        for s in 0..n {
            g.mark(s);
            g.clear(s);
        }
        g.mark(n);
        assert_eq!(g.victim(&mut |_| true), None, "still behind stale entries");
        assert_eq!(g.victim(&mut |_| true), Some(n));
    }
}

//! Slots and pin words per tier: the free list, slot -> key, the eviction policy's state,
//! and the atomic pin word of every slot; pinning, retiring and freeing slots; per-tier stats.

use crate::policy::EvictionPolicy;
use crate::stats::StoreStats;
use crate::stats::TierCounters;
use crate::stats::TierStats;
use crate::tier::SlotId;
use crate::tier::Tier;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;

use super::Inner;
use super::index::Entry;
use super::lock;

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
}

pub(super) struct Slots<T> {
    pub(super) tier: T,
    pub(super) state: Mutex<TierState>,
    pub(super) pins: Box<[AtomicU32]>,
    pub(super) counters: TierCounters,
}

pub(super) fn slots_for<T: Tier>(tier: T, eviction: crate::policy::EvictionKind) -> Slots<T> {
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

pub(super) fn tier_stats<T: Tier>(kind: TierKind, slots: &Slots<T>) -> TierStats {
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

impl Inner {
    pub(super) fn counters(&self, t: TierKind) -> &TierCounters {
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
    pub(super) fn parts(&self, t: TierKind) -> (&Mutex<TierState>, &[AtomicU32]) {
        match t {
            TierKind::Nvme => {
                let s = self.nvme.as_ref().expect("nvme slot without an nvme tier");
                (&s.state, &s.pins)
            }
            _ => (&self.dram.state, &self.dram.pins),
        }
    }

    pub(super) fn unpin(self: &Arc<Self>, t: TierKind, slot: u32) {
        let (_, pins) = self.parts(t);
        let prev = pins[slot as usize].fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT != 0, "unpin of an unpinned slot");
        if prev & COUNT == 1 && prev & RETIRED != 0 {
            self.free(t, slot, prev & ERASE != 0);
        }
    }

    /// Takes `slot` out of tier `t`'s policy and frees it once no pin holds it.
    pub(super) fn retire(self: &Arc<Self>, t: TierKind, slot: u32, erase: bool) {
        let (state, pins) = self.parts(t);
        lock(state).policy.on_remove(slot, self.now());
        let bits = RETIRED | if erase { ERASE } else { 0 };
        let prev = pins[slot as usize].fetch_or(bits, Ordering::AcqRel);
        if prev & COUNT == 0 {
            self.free(t, slot, erase);
        }
    }

    pub(super) fn free(self: &Arc<Self>, t: TierKind, slot: u32, erase: bool) {
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

    pub(super) fn erase_then_free(self: &Arc<Self>, slot: u32) {
        if let Some(n) = &self.nvme
            && n.tier.erase(SlotId(slot)).is_err()
        {
            TierCounters::inc(&n.counters.io_errors);
        }
        self.free(TierKind::Nvme, slot, false);
    }

    pub(super) fn touch(&self, t: TierKind, slot: u32) {
        let now = self.now();
        lock(self.parts(t).0).policy.on_hit(slot, now);
    }

    pub(super) fn stats(&self) -> StoreStats {
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

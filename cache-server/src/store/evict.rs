//! Allocation and eviction: a slot for a new block, evicting (or writing back) a victim
//! when the tier is full. A victim of tier `t` is written back to tier `t + 1` (its neighbour
//! below) when the demotion policy says so and no slower tier holds a copy.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::BlockKey;

use crate::policy::InsertContext;
use crate::stats::TierCounters;

use super::events::StoreEventKind;
use super::index::MAX_TIERS;
use super::slots::{COUNT, NONE, RETIRED, TierState};
use super::{Inner, lock};

/// Write-backs a single allocation may start before it evicts without one.
pub(super) const MAX_WRITEBACKS_PER_ALLOC: usize = 4;
/// Victims an allocation may try before it gives up.
pub(super) const MAX_EVICT_ATTEMPTS: usize = 16;
/// Under write-back, a tier keeps about 1/this of its slots free (at least one).
const WRITEBACK_RESERVE_DIVISOR: usize = 64;

/// The free slots a tier of `slots` slots keeps under write-back.
pub(super) fn writeback_reserve(slots: usize) -> usize {
    (slots / WRITEBACK_RESERVE_DIVISOR).max(1)
}

pub(super) enum Evicted {
    /// The slot is free for the caller.
    Freed(u32),
    /// A write-back started; the slot frees itself when the copy is done.
    WritingBack,
    /// The victim could not be taken; ask again.
    Retry,
}

impl Inner {
    /// A slot of tier `t` for `key`, pinned once (the caller's writer pin) and tracked by the
    /// policy. Evicts to make room; under write-back, victims without a copy below are copied
    /// down in the background first and a small reserve of free slots is kept so puts rarely
    /// wait on (or are refused because of) a copy in flight.
    pub(super) fn alloc(
        self: &Arc<Self>,
        t: usize,
        key: BlockKey,
        mut ctx: InsertContext,
        parent_key: Option<BlockKey>,
    ) -> Option<u32> {
        let tier = &self.tiers[t];
        let mut st = lock(&tier.state);
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
                    match self.evict_one(t, &mut st, allow_writeback)? {
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
        tier.pins[slot as usize].store(1, Ordering::Release);
        st.keys[slot as usize] = key;
        st.guests.clear(slot);
        st.policy.on_insert(slot, key, ctx);
        if writeback {
            let reserve = writeback_reserve(st.keys.len());
            let mut budget = MAX_WRITEBACKS_PER_ALLOC;
            while budget > 0
                && st.free.len() + tier.writebacks_inflight.load(Ordering::Acquire) < reserve
            {
                budget -= 1;
                match self.evict_one(t, &mut st, true) {
                    Some(Evicted::Freed(v)) => st.free.push(v),
                    Some(Evicted::WritingBack | Evicted::Retry) => {}
                    None => break,
                }
            }
        }
        Some(slot)
    }

    /// See [`super::TieredStore::mark_guests`].
    pub(super) fn mark_guests(self: &Arc<Self>, keys: &[BlockKey]) -> usize {
        let h = self.host;
        // The slots under the shard locks, then the tier lock (eviction takes the tier lock
        // first, then a shard's: never both here). A slot given to another block meanwhile
        // is told apart by its key.
        let slots: Vec<(u32, BlockKey)> = keys
            .iter()
            .filter_map(|k| {
                let s = self.shard(k).get(k).map(|e| e.loc[h])?;
                (s != NONE).then_some((s, *k))
            })
            .collect();
        if slots.is_empty() {
            return 0;
        }
        let marked: Vec<(u32, BlockKey)> = {
            let mut st = lock(&self.tiers[h].state);
            let st = &mut *st;
            slots
                .into_iter()
                .filter(|&(s, k)| st.keys[s as usize] == k && st.guests.mark(s))
                .collect()
        };
        if !marked.is_empty() {
            self.guests_marked.store(true, Ordering::Release);
        }
        // A guest keeps no copy below (written through before it was known to be one): the
        // slower tiers' room is for the blocks this member owns. The copy goes only while
        // the block's host copy is still that guest.
        if h + 1 < self.tiers.len() {
            for &(hs, key) in &marked {
                self.drop_copies_below(h, hs, key);
            }
        }
        marked.len()
    }

    /// See [`super::TieredStore::clear_guests`].
    pub(super) fn clear_guests(&self) -> usize {
        lock(&self.tiers[self.host].state).guests.clear_all()
    }

    /// Whether host slot `hs` is a guest now (false without a lock on a store that never
    /// marked one).
    pub(super) fn is_guest(&self, hs: u32) -> bool {
        self.guests_marked.load(Ordering::Acquire)
            && lock(&self.tiers[self.host].state).guests.is(hs)
    }

    /// Drops `key`'s copies in the tiers below the host tier `h` while its host copy is slot
    /// `hs` (the copies are then retired, not erased: a restart that finds one indexes a
    /// valid copy again).
    pub(super) fn drop_copies_below(self: &Arc<Self>, h: usize, hs: u32, key: BlockKey) {
        // Taken out under the shard lock, retired after it (retiring takes a tier's lock,
        // which eviction takes before a shard's).
        let (gone, n) = {
            let mut shard = self.shard(&key);
            let Some(ent) = shard.get_mut(&key).filter(|e| e.loc[h] == hs) else {
                return;
            };
            let (mut gone, mut n) = ([(0, NONE); MAX_TIERS], 0);
            for t in h + 1..self.tiers.len() {
                let s = std::mem::replace(&mut ent.loc[t], NONE);
                if s != NONE {
                    self.emit(StoreEventKind::Removed, t, key);
                    gone[n] = (t, s);
                    n += 1;
                }
            }
            (gone, n)
        };
        for &(t, s) in &gone[..n] {
            self.retire(t, s, false);
        }
    }

    /// Whether tier `t`'s victims are written back to the tier below it.
    pub(super) fn writeback_mode(&self, t: usize) -> bool {
        t + 1 < self.tiers.len() && self.config.demotion.on_evict()
    }

    /// Handles the policy's next victim in tier `t`. `None`: no evictable slot at all.
    pub(super) fn evict_one(
        self: &Arc<Self>,
        t: usize,
        st: &mut TierState,
        allow_writeback: bool,
    ) -> Option<Evicted> {
        let tier = &self.tiers[t];
        let pins = &tier.pins;
        // Retention hints protect host-tier blocks only.
        let retained = (t == self.host && self.retain.any()).then(|| self.retain.protected());
        let (keys, held) = (&st.keys, &st.held);
        let mut evictable = |s: u32| {
            pins[s as usize].load(Ordering::Acquire) == 0
                && held.get(s as usize).is_none_or(|&n| n == 0)
                && retained
                    .as_ref()
                    .is_none_or(|r| !r.contains(&keys[s as usize]))
        };
        // Guest copies (blocks another cluster member owns) go first: when room is short the
        // cluster keeps one copy of a block, its owner's.
        let guest = st.guests.victim(&mut evictable);
        let v = guest.or_else(|| st.policy.victim(&mut evictable));
        // Hints and held lookups can put more unevictable blocks first than a search looks
        // at (a tenant's many one-block hints, say): then look further rather than refuse
        // the put.
        let v = v.or_else(|| {
            (retained.is_some() || self.holds.blocks.load(Ordering::Relaxed) > 0)
                .then(|| st.policy.victim_unbounded(&mut evictable))
                .flatten()
        });
        drop(retained);
        let v = v?;
        let vkey = st.keys[v as usize];
        let mut shard = self.shard(&vkey);
        let Some(e) = shard.get_mut(&vkey).filter(|e| e.loc[t] == v) else {
            // No key references it: it is being removed (its remover holds a pin and frees
            // it) or being filled by a pinned writer. Either way not ours; stop tracking it.
            drop(shard);
            st.policy.on_remove(v, self.now());
            return Some(Evicted::Retry);
        };
        if pins[v as usize].load(Ordering::Acquire) != 0 {
            if guest.is_some() {
                st.guests.mark(v); // still a guest: back in the queue
            }
            return Some(Evicted::Retry); // pinned after the policy looked
        }
        let copy_below = e.loc[t + 1..].iter().any(|&s| s != NONE);
        // A guest is not written back: its owner holds the cluster's copy.
        if allow_writeback && !copy_below && guest.is_none() {
            // Stays referenced and readable here while it is copied down; the copy job
            // removes the reference and retires it (only a remover retires a slot).
            pins[v as usize].store(1, Ordering::Release);
            drop(shard);
            st.policy.on_remove(v, self.now());
            tier.writebacks_inflight.fetch_add(1, Ordering::AcqRel);
            let me = self.clone();
            if self
                .pool
                .try_spawn(move || me.demote(vkey, None, t, v, true))
                .is_ok()
            {
                return Some(Evicted::WritingBack);
            }
            // No room to copy: evict it without a copy.
            tier.writebacks_inflight.fetch_sub(1, Ordering::AcqRel);
            TierCounters::inc(&tier.counters.demotions_dropped);
            let mut shard = self.shard(&vkey);
            let ours = match shard.get_mut(&vkey).filter(|e| e.loc[t] == v) {
                Some(e) => {
                    e.loc[t] = NONE;
                    self.unplaced(t, v);
                    self.emit(StoreEventKind::Removed, t, vkey);
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
            TierCounters::inc(&tier.counters.evictions);
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
        e.loc[t] = NONE;
        self.unplaced(t, v);
        self.emit(StoreEventKind::Removed, t, vkey);
        if e.is_empty() {
            shard.remove(&vkey);
        }
        drop(shard);
        st.policy.on_remove(v, self.now());
        TierCounters::inc(&tier.counters.evictions);
        if guest.is_some() {
            TierCounters::inc(&tier.counters.guest_evictions);
        }
        Some(Evicted::Freed(v))
    }
}

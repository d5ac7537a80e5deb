//! The write path: `put`, reserving and committing a slot, removing and clearing blocks.

use crate::error::StoreError;
use crate::policy::Admission;
use crate::policy::admission::RejectReason;
use crate::stats::TierCounters;
use crate::tier::SlotId;
use crate::tier::published::Parent;
use kvtier_core::BlockKey;
use std::sync::Arc;

use super::Inner;
use super::PutOutcome;
use super::events::StoreEventKind;
use super::handles::Reservation;
use super::index::Entry;
use super::lock;
use super::slots::NONE;

impl Inner {
    pub(super) fn put(
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
        match self.reserve(key, parent, None, true) {
            Ok(mut r) => {
                r.bytes_mut().copy_from_slice(data);
                r.commit()
            }
            Err(outcome) => Ok(outcome),
        }
    }

    pub(super) fn reserve(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        pending_parent_slot: Option<u32>,
        count_no_slot: bool,
    ) -> Result<Reservation, PutOutcome> {
        if self.shard(&key).contains_key(&key) {
            return Err(PutOutcome::AlreadyPresent);
        }
        let h = self.host;
        let c = &self.tiers[h].counters;
        let parent_slot = match parent {
            Some(p) => match self.shard(&p).get(&p) {
                Some(e) => (e.loc[h] != NONE).then_some(e.loc[h]),
                None if pending_parent_slot.is_some() => pending_parent_slot,
                None if self.config.admit_orphans => None,
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
        let Some(slot) = self.alloc(h, key, ctx, parent) else {
            if count_no_slot {
                TierCounters::inc(&c.admissions_refused);
            }
            return Err(PutOutcome::Rejected(RejectReason::NoEvictableSlot));
        };
        self.pending.add([key]);
        Ok(Reservation {
            inner: self.clone(),
            key,
            parent,
            slot,
            open: true,
        })
    }

    /// Makes a filled reservation's block readable. The slot is pinned by the reservation.
    pub(super) fn commit(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        slot: u32,
    ) -> Result<PutOutcome, StoreError> {
        let h = self.host;
        let c = &self.tiers[h].counters;
        // Records key and length for readers; the bytes are in place already.
        let filled = self
            .dram
            .write_with(SlotId(slot), key, self.block_bytes, |_| {
                Ok::<(), std::convert::Infallible>(())
            });
        if let Err(e) = filled {
            self.retire(h, slot, false);
            self.unpin(h, slot);
            return Err(e.into());
        }
        // Making room may have evicted the parent: then this block is unreachable.
        let orphaned =
            !self.config.admit_orphans && parent.is_some_and(|p| !self.shard(&p).contains_key(&p));
        {
            let mut shard = self.shard(&key);
            let present = shard.contains_key(&key);
            if present || orphaned {
                drop(shard);
                self.retire(h, slot, false);
                self.unpin(h, slot);
                if present {
                    return Ok(PutOutcome::AlreadyPresent);
                }
                TierCounters::inc(&c.admissions_refused);
                return Ok(PutOutcome::Rejected(RejectReason::OrphanBlock));
            }
            shard.insert(key, Entry::at(h, slot));
            self.placed(h, slot, key, parent.map_or(Parent::Root, Parent::Key));
            self.emit(StoreEventKind::Stored, h, key);
        }
        TierCounters::add(&c.bytes_in, self.block_bytes as u64);
        if h + 1 < self.tiers.len() && self.config.demotion.on_put() {
            self.spawn_demotion(key, parent, h, slot);
        }
        self.unpin(h, slot);
        Ok(PutOutcome::Stored(self.tiers[h].kind))
    }

    /// Retires every slot of an entry taken out of the index (and pinned by
    /// [`Inner::take_entry`]). `erase`: persistent tiers erase the headers first.
    pub(super) fn retire_entry(self: &Arc<Self>, e: Entry, erase: bool) {
        for (t, s) in e.held() {
            self.retire(t, s, erase);
            self.unpin(t, s);
        }
    }

    pub(super) fn remove(self: &Arc<Self>, key: BlockKey) -> bool {
        self.remove_if(key, false)
    }

    /// [`Self::remove`]; with `unpinned_only`, not when a copy is pinned or held by a lookup
    /// (pins are taken under the shard lock held here, holds under the host tier's lock,
    /// taken first as eviction does, so the check cannot race either).
    pub(super) fn remove_if(self: &Arc<Self>, key: BlockKey, unpinned_only: bool) -> bool {
        let e = {
            let host = unpinned_only.then(|| lock(&self.tiers[self.host].state));
            let mut shard = self.shard(&key);
            if let Some(host) = &host
                && shard.get(&key).is_some_and(|e| {
                    e.held().any(|(t, s)| {
                        self.tiers[t].pins[s as usize].load(std::sync::atomic::Ordering::Acquire)
                            != 0
                            || (t == self.host && host.held[s as usize] != 0)
                    })
                })
            {
                return false;
            }
            let Some(e) = self.take_entry(&mut shard, &key) else {
                return false;
            };
            for (t, _) in e.held() {
                self.emit(StoreEventKind::Removed, t, key);
            }
            e
        };
        self.retire_entry(e, true);
        true
    }

    pub(super) fn clear(self: &Arc<Self>) -> Result<(), StoreError> {
        // Bump each persistent tier's epoch first: every header written before it is dead
        // from here on, including copies still in flight. (A volatile tier's slots are
        // retired below; clearing them now would fail readers that hold pins.)
        self.clear_persistent()?;
        self.retain.clear();
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
        self.clear_persistent()?;
        self.emit_kind(
            StoreEventKind::Cleared,
            self.tiers[self.host].kind,
            BlockKey::default(),
        );
        Ok(())
    }

    fn clear_persistent(&self) -> Result<(), StoreError> {
        for s in self.tiers.iter().filter(|s| s.tier.is_persistent()) {
            s.tier.clear_all()?;
        }
        Ok(())
    }
}

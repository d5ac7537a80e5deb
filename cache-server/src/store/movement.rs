//! Movement between tiers: demotion (write-through and write-back copies down to NVMe),
//! promotion (an NVMe hit copied up into DRAM), prefetch, and dropping a copy that failed
//! its read.

use crate::policy::PromotionPolicy;
use crate::stats::TierCounters;
use crate::tier::SlotId;
use crate::tier::Tier;
use crate::tier::TierError;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Inner;
use super::MissReason;
use super::events::StoreEventKind;
use super::slots::NONE;

impl Inner {
    /// Copies DRAM slot `slot` (pinned by the caller, who keeps its own pin) to NVMe in the
    /// background; a full queue drops the copy and counts it.
    pub(super) fn spawn_demotion(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        slot: u32,
    ) {
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
    pub(super) fn demote(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        ds: u32,
        evicting: bool,
    ) {
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

    pub(super) fn nvme_hit(&self, slot: u32) {
        if let Some(n) = &self.nvme {
            TierCounters::inc(&n.counters.hits);
            TierCounters::add(&n.counters.bytes_out, self.block_bytes as u64);
            self.touch(TierKind::Nvme, slot);
        }
    }

    /// Drops the NVMe copy of `key` in `slot` after a failed read, counting why.
    pub(super) fn nvme_failed(
        self: &Arc<Self>,
        key: BlockKey,
        slot: u32,
        e: &TierError,
    ) -> MissReason {
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
    pub(super) fn promote_pinned(
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
    pub(super) fn promote_io(&self, key: BlockKey, ns: u32, ds: u32) -> Result<(), TierError> {
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

    pub(super) fn prefetch(self: &Arc<Self>, keys: &[BlockKey]) -> usize {
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
}

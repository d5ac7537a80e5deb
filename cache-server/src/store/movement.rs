//! Movement between neighbouring tiers of the list: demotion (write-through and write-back
//! copies from tier `t` to `t + 1`), promotion (a hit in tier `t` copied up to `t - 1`, or
//! into the host tier for a pin), prefetch, and dropping a copy that failed its read.
//!
//! A copy goes through in-place memory where one side has it ([`crate::tier::InPlaceTier`],
//! DRAM), and through a bounce buffer between two tiers reached only by copies (HBM, NVMe).

use std::sync::Arc;

use kvtier_core::BlockKey;

use crate::policy::PromotionPolicy;
use crate::stats::TierCounters;
use crate::tier::published::Parent;
use crate::tier::{SlotId, TierError};

use super::events::StoreEventKind;
use super::slots::NONE;
use super::{Inner, MissReason};

/// Who asks for a copy between tiers ([`Inner::promote_pinned`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyFor {
    /// A caller serving a read: the copy runs on the I/O pool while it waits, and counts as
    /// the hit in the tier copied from.
    Read,
    /// A prefetch job on the I/O pool: the copy runs inline and counts as a hit.
    Prefetch,
    /// A background promotion of a block whose hit was counted when it was served: inline,
    /// no hit counted.
    Background,
}

impl Inner {
    /// Copies slot `slot` of tier `from` (pinned by the caller, who keeps its own pin) to the
    /// tier below in the background; a full queue drops the copy and counts it.
    pub(super) fn spawn_demotion(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        from: usize,
        slot: u32,
    ) {
        self.pin_slot(from, slot);
        let me = self.clone();
        if self
            .pool
            .try_spawn(move || me.demote(key, parent, from, slot, false))
            .is_err()
        {
            TierCounters::inc(&self.tiers[from].counters.demotions_dropped);
            self.unpin(from, slot);
        }
    }

    /// Promotes slot `slot` of tier `from` (pinned by the caller, who keeps its own pin) one
    /// tier up in the background; a full queue skips it.
    pub(super) fn spawn_promotion(self: &Arc<Self>, key: BlockKey, from: usize, slot: u32) {
        self.pin_slot(from, slot);
        let me = self.clone();
        let job =
            move || match me.promote_pinned(key, from, slot, from - 1, CopyFor::Background, None) {
                Ok(Some(up)) => me.unpin(from - 1, up),
                Ok(None) => me.unpin(from, slot),
                Err(_) => {}
            };
        if self.pool.try_spawn(job).is_err() {
            self.unpin(from, slot);
        }
    }

    /// Runs on the I/O pool. Copies slot `fs` of tier `from` (pinned for this job) to a new
    /// slot of tier `from + 1`. With `evicting`, the copy in `from` is dropped afterwards
    /// (write-back); its slot was retired by the evictor and is freed by the final unpin.
    ///
    /// `parent`, when known, links the copy to its parent's copy below (leaf-first eviction).
    pub(super) fn demote(
        self: &Arc<Self>,
        key: BlockKey,
        parent: Option<BlockKey>,
        from: usize,
        fs: u32,
        evicting: bool,
    ) {
        let to = from + 1;
        if to >= self.tiers.len() {
            // Unreachable (demotions need a tier below), but never leak the caller's pin.
            self.unpin(from, fs);
            return;
        }
        // A write-through copy of a guest (a block another cluster member owns, marked since
        // the copy was queued) is not made: the tier below keeps room for this member's own.
        if !evicting && from == self.host && self.is_guest(fs) {
            self.unpin(from, fs);
            return;
        }
        let fc = &self.tiers[from].counters;
        let tc = &self.tiers[to].counters;
        let parent_slot = parent.and_then(|p| {
            let shard = self.shard(&p);
            shard.get(&p).map(|e| e.loc[to]).filter(|&s| s != NONE)
        });
        let stored = match self.alloc(to, key, self.ctx(parent_slot), parent) {
            None => {
                TierCounters::inc(&fc.demotions_dropped);
                None
            }
            Some(ts) => match self.copy_slot(key, parent, from, fs, to, ts) {
                Ok(()) => Some(ts),
                Err(e) => {
                    TierCounters::inc(&tc.io_errors);
                    self.write_failed(to, &e);
                    // The slot may still hold an older block's valid header: erase it.
                    self.retire(to, ts, true);
                    self.unpin(to, ts);
                    None
                }
            },
        };
        let mut orphan = None;
        let mut dropped_from = false;
        {
            let mut shard = self.shard(&key);
            match shard.get_mut(&key) {
                Some(e) => {
                    if let Some(ts) = stored {
                        if e.loc[to] == NONE {
                            e.loc[to] = ts;
                            self.placed(to, ts, key, parent.map_or(Parent::Unknown, Parent::Key));
                            self.emit(StoreEventKind::Stored, to, key);
                        } else {
                            orphan = Some(ts);
                        }
                    }
                    if evicting && e.loc[from] == fs {
                        e.loc[from] = NONE;
                        self.unplaced(from, fs);
                        dropped_from = true;
                        self.emit(StoreEventKind::Removed, from, key);
                        if e.is_empty() {
                            shard.remove(&key);
                        }
                    }
                }
                None => orphan = stored,
            }
        }
        if let Some(ts) = stored {
            TierCounters::inc(&fc.demotions);
            TierCounters::add(&tc.bytes_in, self.block_bytes as u64);
            if orphan.is_some() {
                // Removed or cleared while copying: erase, or a restart would bring it back.
                self.retire(to, ts, true);
            }
            self.unpin(to, ts);
            // Marked a guest while copying: its marking found no copy to drop, or drops this
            // one itself (it looks after setting the flag, and this after placing the copy).
            if !evicting && orphan.is_none() && from == self.host && self.is_guest(fs) {
                self.drop_copies_below(from, fs, key);
            }
        }
        if evicting {
            TierCounters::inc(&fc.evictions);
            self.tiers[from]
                .writebacks_inflight
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            if dropped_from {
                self.retire(from, fs, false);
            }
        }
        self.unpin(from, fs);
    }

    /// Copies block `key` from slot `fs` of tier `from` into slot `ts` of tier `to` (both
    /// pinned by the caller): in place where either side is host memory, else through a
    /// bounce buffer.
    pub(super) fn copy_slot(
        &self,
        key: BlockKey,
        parent: Option<BlockKey>,
        from: usize,
        fs: u32,
        to: usize,
        ts: u32,
    ) -> Result<(), TierError> {
        let (src, dst) = (&self.tiers[from].tier, &self.tiers[to].tier);
        let (fs, ts, n) = (SlotId(fs), SlotId(ts), self.block_bytes);
        if let Some(src) = src.in_place() {
            src.read_in_place(fs, key, n, &mut |b| dst.write_linked(ts, key, parent, b))
        } else if let Some(dst) = dst.in_place() {
            dst.fill_in_place(ts, key, n, &mut |b| src.read(fs, key, b))
        } else {
            let (mut b, _) = self.bounce.take();
            let r = src
                .read(fs, key, &mut b[..n])
                .and_then(|()| dst.write_linked(ts, key, parent, &b[..n]));
            self.bounce.give(b);
            r
        }
    }

    /// Logs a failed write or erase in tier `t` (already counted in `io_errors`), at most
    /// once per `IO_ERROR_LOG_INTERVAL` (10 s) with the count since the last line.
    pub(super) fn write_failed(&self, t: usize, e: &TierError) {
        if let Some(n) = self.write_errors_log.note(std::time::Instant::now()) {
            tracing::warn!(
                tier = %self.tiers[t].kind,
                errors_since_last_warning = n,
                "tier write failed: {e} (see kvtier_tier_io_errors_total)"
            );
        }
    }

    /// Counts a hit served by slot `slot` of tier `t`.
    pub(super) fn hit(&self, t: usize, slot: u32) {
        let c = &self.tiers[t].counters;
        TierCounters::inc(&c.hits);
        TierCounters::add(&c.bytes_out, self.block_bytes as u64);
        self.touch(t, slot);
    }

    /// Drops the copy of `key` in slot `slot` of tier `t` after a failed read, counting why.
    pub(super) fn read_failed(
        self: &Arc<Self>,
        key: BlockKey,
        t: usize,
        slot: u32,
        e: &TierError,
    ) -> MissReason {
        let tier = &self.tiers[t];
        let c = &tier.counters;
        let reason = match e {
            TierError::Corrupt { .. } => {
                TierCounters::inc(&c.corrupt_dropped);
                if let Some(n) = self.read_errors_log.note(std::time::Instant::now()) {
                    tracing::warn!(
                        %key, slot, tier = %tier.kind, errors_since_last_warning = n,
                        "dropping corrupt block: {e} (see kvtier_tier_corrupt_dropped_total)"
                    );
                }
                MissReason::Corrupt
            }
            TierError::Mismatch { .. } => {
                // Stale header (cleared or overwritten on disk): not damage, but not ours.
                TierCounters::inc(&c.misses);
                MissReason::NotCached
            }
            _ => {
                TierCounters::inc(&c.io_errors);
                if let Some(n) = self.read_errors_log.note(std::time::Instant::now()) {
                    tracing::warn!(
                        %key, slot, tier = %tier.kind, errors_since_last_warning = n,
                        "tier read failed: {e} (see kvtier_tier_io_errors_total)"
                    );
                }
                MissReason::IoError
            }
        };
        let mut shard = self.shard(&key);
        if let Some(ent) = shard.get_mut(&key).filter(|ent| ent.loc[t] == slot) {
            ent.loc[t] = NONE;
            self.unplaced(t, slot);
            self.emit(StoreEventKind::Removed, t, key);
            if ent.is_empty() {
                shard.remove(&key);
            }
            drop(shard);
            // Erase the bad header so a restart does not index it again.
            self.retire(t, slot, true);
        }
        reason
    }

    /// After a corrupt read in tier `t`, drops the copies in `t` of the rest of the chain
    /// (`rest`, the keys after the corrupt block) that have no faster copy: damage rarely
    /// stops at one slot, and a lookup must not report blocks a load may fail on one per
    /// turn. A put of the chain then stores them all again. Blocks with a copy above `t`
    /// are kept (reads are served from that copy).
    pub(super) fn drop_rest_of_chain(self: &Arc<Self>, t: usize, rest: &[BlockKey]) {
        let mut dropped = 0u64;
        for key in rest {
            let mut shard = self.shard(key);
            let Some(ent) = shard.get_mut(key) else {
                continue;
            };
            let Some((ft, slot)) = ent.fastest().filter(|(ft, _)| *ft == t) else {
                continue;
            };
            ent.loc[ft] = NONE;
            self.unplaced(ft, slot);
            self.emit(StoreEventKind::Removed, t, *key);
            if ent.is_empty() {
                shard.remove(key);
            }
            drop(shard);
            // Erased like a corrupt block, so a restart does not index it again.
            self.retire(t, slot, true);
            dropped += 1;
        }
        if dropped > 0 {
            let tier = &self.tiers[t];
            tracing::warn!(
                tier = %tier.kind,
                dropped,
                "dropped the rest of a chain after a corrupt block"
            );
        }
    }

    /// Copies slot `fs` of tier `from` (pinned by the caller) into a new slot of tier `to`:
    /// a promotion when `to` is faster, or a copy down into the host tier for a pin.
    /// `Ok(Some(ts))`: copied, `ts` returned pinned and `fs` unpinned. `Ok(None)`: not copied
    /// (promotion policy, or no slot in `to`), `fs` still pinned for the caller's fallback.
    /// `Err`: the copy in `from` was bad and is dropped, `fs` unpinned.
    pub(super) fn promote_pinned(
        self: &Arc<Self>,
        key: BlockKey,
        from: usize,
        fs: u32,
        to: usize,
        why: CopyFor,
        parent: Option<(BlockKey, u32)>,
    ) -> Result<Option<u32>, MissReason> {
        if to < from && self.config.promotion == PromotionPolicy::Never {
            return Ok(None);
        }
        let ctx = self.ctx(parent.map(|(_, s)| s));
        let Some(ts) = self.alloc(to, key, ctx, parent.map(|(k, _)| k)) else {
            return Ok(None);
        };
        let r = if why != CopyFor::Read {
            self.copy_slot(key, None, from, fs, to, ts)
        } else {
            let me = self.clone();
            self.pool
                .run(move || me.copy_slot(key, None, from, fs, to, ts))
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
                        Some(e) if e.loc[to] == NONE => {
                            e.loc[to] = ts;
                            let parent = parent.map_or(Parent::Unknown, |(k, _)| Parent::Key(k));
                            self.placed(to, ts, key, parent);
                            self.emit(StoreEventKind::Stored, to, key);
                            true
                        }
                        _ => false,
                    }
                };
                if !adopted {
                    // Copied twice at once, or removed meanwhile: this copy is spare. It
                    // stays readable under our pin and is freed when it is unpinned.
                    self.retire(to, ts, false);
                }
                if to < from {
                    TierCounters::inc(&self.tiers[to].counters.promotions);
                } else {
                    TierCounters::inc(&self.tiers[from].counters.demotions);
                }
                if why != CopyFor::Background {
                    self.hit(from, fs);
                }
                Ok(Some(ts))
            }
            Err(e) => {
                self.retire(to, ts, false);
                self.unpin(to, ts);
                if matches!(e, TierError::Unavailable { .. }) {
                    // The pool is stopping: the copy is fine, just not readable now.
                    Err(MissReason::Busy)
                } else {
                    Err(self.read_failed(key, from, fs, &e))
                }
            }
        };
        self.unpin(from, fs);
        out
    }

    /// Queues promotion of blocks held only below the host tier among `keys`, each one tier
    /// up; returns how many were queued.
    pub(super) fn prefetch(self: &Arc<Self>, keys: &[BlockKey]) -> usize {
        let mut queued = 0;
        for &key in keys {
            let (from, fs) = {
                let shard = self.shard(&key);
                match shard.get(&key).and_then(|e| e.fastest()) {
                    Some((t, s)) if t > self.host => {
                        self.pin_slot(t, s);
                        (t, s)
                    }
                    _ => continue,
                }
            };
            let me = self.clone();
            let job =
                move || match me.promote_pinned(key, from, fs, from - 1, CopyFor::Prefetch, None) {
                    Ok(Some(up)) => me.unpin(from - 1, up),
                    Ok(None) => me.unpin(from, fs),
                    Err(_) => {}
                };
            if self.pool.try_spawn(job).is_ok() {
                queued += 1;
            } else {
                self.unpin(from, fs);
            }
        }
        queued
    }
}

//! The read path: locating and pinning a block, `get`, `lookup`, and pinning a prefix.

use crate::error::StoreError;
use crate::policy::LookupContext;
use crate::stats::TierCounters;
use crate::tier::SlotId;
use crate::tier::Tier;
use crate::tier::TierError;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use super::GetOutcome;
use super::Inner;
use super::MissReason;
use super::lease::PinnedBlock;
use super::lock;
use super::slots::NONE;
use super::slots::TierState;

impl Inner {
    /// Pins the location of `key`: DRAM if present there, else NVMe. Counts the hit.
    pub(super) fn pin_location(&self, key: BlockKey) -> Option<(TierKind, u32, u32)> {
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

    /// The longest cached prefix of `keys`, with each tier's policy told about the request.
    pub(super) fn lookup(&self, keys: &[BlockKey]) -> Vec<TierKind> {
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

    pub(super) fn get(
        self: &Arc<Self>,
        key: BlockKey,
        buf: &mut [u8],
    ) -> Result<GetOutcome, StoreError> {
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

    /// Pins the longest cached prefix of `keys` in DRAM, promoting NVMe blocks; returns the
    /// pinned blocks and why the prefix stopped early (if it did).
    ///
    /// With `may_block` false it never waits for I/O: at the first block that would need a
    /// promotion from NVMe it unpins everything and returns `None`.
    pub(super) fn pin_prefix(
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
}

//! The read path: locating and pinning a block, `get`, `lookup`, and pinning a prefix in the
//! host tier.

use std::sync::Arc;

use kvtier_core::BlockKey;

use crate::error::StoreError;
use crate::policy::{LookupContext, PromotionPolicy};
use crate::stats::TierCounters;
use crate::tier::{SlotId, TierKind};

use super::index::{Entry, MAX_TIERS};
use super::lease::{LookupHold, PinnedBlock};
use super::movement::CopyFor;
use super::slots::NONE;
use super::{GetOutcome, Inner, MissReason, lock};

/// Keys a lookup probes in its first round (see [`Inner::probe_prefix`]).
const LOOKUP_FIRST_ROUND: usize = 256;
/// Most keys a lookup probes in one round (at most `u16::MAX`: positions in a round are u16).
const LOOKUP_MAX_ROUND: usize = 4096;

impl Inner {
    /// Pins the fastest copy of `key` (the host tier's, when `prefer_host` and it holds
    /// one): (tier position, slot, hits). Counts the hit toward selective write-through.
    pub(super) fn pin_location(
        &self,
        key: BlockKey,
        prefer_host: bool,
    ) -> Option<(usize, u32, u32)> {
        let mut shard = self.shard(&key);
        let e = shard.get_mut(&key)?;
        // Hits count toward selective write-through only while there is no copy below the
        // host tier.
        let below = e.loc[self.host + 1..].iter().any(|&s| s != NONE);
        if below {
            e.hits = 0;
        } else {
            e.hits = e.hits.saturating_add(1);
        }
        let h = self.host;
        let (t, s) = match e.loc[h] {
            s if prefer_host && s != NONE => (h, s),
            _ => e.fastest()?,
        };
        self.pin_slot(t, s);
        Some((t, s, e.hits))
    }

    /// Counts a miss in every tier faster than `t` (the tiers a read looked in first).
    fn missed_above(&self, t: usize) {
        for tier in &self.tiers[..t] {
            TierCounters::inc(&tier.counters.misses);
        }
    }

    /// Selective write-through: copies the host tier's copy of `key` one tier down, after a
    /// hit served from slot `slot` of tier `t` (the host tier, or a tier above it).
    fn demote_on_hit(self: &Arc<Self>, key: BlockKey, t: usize, slot: u32) {
        let h = self.host;
        if t == h {
            self.spawn_demotion(key, None, h, slot);
            return;
        }
        // Served from above: the copy goes from the host tier, if it still holds the block.
        let hs = {
            let shard = self.shard(&key);
            let hs = shard.get(&key).map(|e| e.loc[h]).filter(|&s| s != NONE);
            if let Some(hs) = hs {
                self.pin_slot(h, hs);
            }
            hs
        };
        if let Some(hs) = hs {
            self.spawn_demotion(key, None, h, hs);
            self.unpin(h, hs);
        }
    }

    /// The index entries of the longest cached prefix of `keys`. Keys are probed in rounds
    /// ([`LOOKUP_FIRST_ROUND`] keys, then four times as many each round up to
    /// [`LOOKUP_MAX_ROUND`]), grouped by shard so each shard's lock is taken once a round
    /// rather than once a key (an uncontended lock and unlock cost more than the probe
    /// itself); a prefix that ends stops after the round it ends in, so a short prefix costs
    /// a short round. Entries are copies: a slot read here may be reused before the caller
    /// looks at it, so callers check slots under the tier's lock.
    pub(super) fn probe_prefix(&self, keys: &[BlockKey]) -> Vec<Entry> {
        let shards = self.shards.len();
        let missing = Entry {
            loc: [NONE; MAX_TIERS],
            hits: 0,
        };
        let mut out: Vec<Entry> = Vec::new();
        // Per round: each key's hash (it picks the shard and the bucket), the keys' positions
        // sorted by shard, and where each shard's run of positions starts (a counting sort).
        let mut hashes: Vec<u64> = Vec::new();
        let mut order: Vec<u16> = Vec::new();
        let mut starts = vec![0u32; shards + 1];
        let mut next = vec![0u32; shards + 1];
        let mut rest = keys;
        let mut round_len = LOOKUP_FIRST_ROUND;
        while !rest.is_empty() {
            let (round, after) = rest.split_at(round_len.min(rest.len()));
            rest = after;
            round_len = (round_len * 4).min(LOOKUP_MAX_ROUND);
            starts.fill(0);
            hashes.clear();
            for k in round {
                let h = self.hashing.hash(k);
                hashes.push(h);
                starts[self.shard_of_hash(h) + 1] += 1;
            }
            for s in 0..shards {
                starts[s + 1] += starts[s];
            }
            next.copy_from_slice(&starts);
            order.clear();
            order.resize(round.len(), 0);
            for (i, &h) in hashes.iter().enumerate() {
                let s = self.shard_of_hash(h);
                order[next[s] as usize] = i as u16;
                next[s] += 1;
            }
            let base = out.len();
            out.resize(base + round.len(), missing);
            let found = &mut out[base..];
            for s in 0..shards {
                let (a, b) = (starts[s] as usize, starts[s + 1] as usize);
                if a == b {
                    continue;
                }
                let shard = lock(&self.shards[s]);
                for &i in &order[a..b] {
                    let i = usize::from(i);
                    if let Some(e) = shard.get_hashed(hashes[i], &round[i]) {
                        found[i] = *e;
                    }
                }
            }
            let run = found.iter().take_while(|e| !e.is_empty()).count();
            out.truncate(base + run);
            if run < round.len() {
                break;
            }
        }
        out
    }

    /// The longest cached prefix of `keys`, with each tier's policy told about the request;
    /// with `hold`, the leading run of it in the host tier is held (see
    /// [`super::TieredStore::lookup_held`]).
    ///
    /// A hold is a count per host slot, kept under the tier's lock that the policy update
    /// takes anyway, which eviction honours: no atomic per block. It is taken on the run
    /// whose slots still hold these keys under that lock, so it protects exactly what the
    /// reply reports from the host tier.
    pub(super) fn lookup(
        self: &Arc<Self>,
        keys: &[BlockKey],
        hold: bool,
    ) -> (Vec<TierKind>, LookupHold) {
        let h = self.host;
        let hold = hold && !self.config.lookup_hold.is_zero();
        let entries = self.probe_prefix(keys);
        let mut out: Vec<TierKind> = entries
            .iter()
            .map(|e| {
                let (fastest, _) = e.fastest().expect("probe_prefix keeps non-empty entries");
                self.tiers[fastest].kind
            })
            .collect();
        // The session of a retention hint is back: its prefix needs no more protection.
        self.retain.returned(&keys[..out.len()]);
        let now = self.now();
        let mut held = LookupHold::Nothing;
        // The prefix the reply reports: cut where a host-tier slot was reused since the
        // probe, so the hold covers every DRAM block the reply names.
        let mut reported = out.len();
        let mut hits: Vec<u32> = Vec::with_capacity(entries.len());
        for (t, tier) in self.tiers.iter().enumerate() {
            // The slots of the leading run of keys this tier holds.
            hits.clear();
            hits.extend(entries.iter().map(|e| e.loc[t]).take_while(|&s| s != NONE));
            let mut st = lock(&tier.state);
            // A slot may have been reused since it was read under the shard lock: keep only
            // the prefix whose slots still hold these keys.
            let valid = hits
                .iter()
                .zip(keys)
                .take_while(|(s, k)| st.keys[**s as usize] == **k)
                .count();
            if t == h && valid < hits.len() {
                reported = reported.min(valid);
            }
            hits.truncate(valid);
            if hold && t == h && !hits.is_empty() {
                held = if self.holds.try_take(hits.len() as u64) {
                    for &s in &hits {
                        st.held[s as usize] += 1;
                    }
                    LookupHold::Held {
                        lease_id: 0,
                        blocks: hits.len(),
                    }
                } else {
                    LookupHold::OverBudget
                };
            }
            st.policy.on_lookup(LookupContext {
                hits: &hits,
                rest: &keys[hits.len()..],
                now_ms: now,
            });
            drop(st);
            if t == h {
                // Chain marks the epoch voided come back for this run (local clients
                // binary-search on them); O(log n) where they are current.
                self.dram.published().renew(&hits, keys);
                if matches!(held, LookupHold::Held { .. }) {
                    held = self.file_hold(hits.clone());
                }
            }
        }
        out.truncate(reported);
        (out, held)
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
        let h = self.host;
        let Some((t, slot, hits)) = self.pin_location(key, false) else {
            self.missed_above(h + 1);
            return Ok(GetOutcome::Miss(MissReason::NotCached));
        };
        let kind = self.tiers[t].kind;
        self.missed_above(t);
        if t <= h {
            // A memory tier: read on this thread.
            let outcome = match self.tiers[t].tier.read(SlotId(slot), key, buf) {
                Ok(()) => {
                    self.hit(t, slot);
                    if h + 1 < self.tiers.len() && self.config.demotion.on_hit(hits) {
                        self.demote_on_hit(key, t, slot);
                    }
                    if t > 0 && self.config.promotion == PromotionPolicy::OnHit {
                        self.spawn_promotion(key, t, slot);
                    }
                    GetOutcome::Hit(kind)
                }
                // A host slot referenced by the index always holds its key; a failure there
                // is a bug, reported as a miss rather than wrong bytes.
                Err(e) if t == h => {
                    tracing::error!(%key, "DRAM read failed: {e}");
                    TierCounters::inc(&self.tiers[t].counters.misses);
                    GetOutcome::Miss(MissReason::Busy)
                }
                Err(e) => GetOutcome::Miss(self.read_failed(key, t, slot, &e)),
            };
            self.unpin(t, slot);
            return Ok(outcome);
        }
        match self.promote_pinned(key, t, slot, t - 1, CopyFor::Read, None) {
            Ok(Some(up)) => {
                let r = self.tiers[t - 1].tier.read(SlotId(up), key, buf);
                self.unpin(t - 1, up);
                Ok(match r {
                    Ok(()) => GetOutcome::Hit(kind),
                    Err(_) => GetOutcome::Miss(MissReason::Busy),
                })
            }
            Ok(None) => {
                // No slot above (or promotion off): read through a bounce buffer.
                let me = self.clone();
                let r = self.pool.run(move || {
                    let (mut b, _) = me.bounce.take();
                    let n = me.block_bytes;
                    let r = me.tiers[t].tier.read(SlotId(slot), key, &mut b[..n]);
                    (r, b, n)
                });
                let outcome = match r {
                    Ok((Ok(()), b, n)) => {
                        buf.copy_from_slice(&b[..n]);
                        self.bounce.give(b);
                        self.hit(t, slot);
                        GetOutcome::Hit(kind)
                    }
                    Ok((Err(e), b, _)) => {
                        self.bounce.give(b);
                        GetOutcome::Miss(self.read_failed(key, t, slot, &e))
                    }
                    Err(_) => GetOutcome::Miss(MissReason::Busy),
                };
                self.unpin(t, slot);
                Ok(outcome)
            }
            Err(reason) => Ok(GetOutcome::Miss(reason)),
        }
    }

    /// Pins the longest cached prefix of `keys` in the host tier, copying blocks held only in
    /// other tiers into it; returns the pinned blocks and why the prefix stopped early (if it
    /// did).
    ///
    /// With `may_block` false it never waits for a copy: at the first block not in the host
    /// tier it unpins everything and returns `None`.
    pub(super) fn pin_prefix(
        self: &Arc<Self>,
        keys: &[BlockKey],
        may_block: bool,
    ) -> Option<(Vec<PinnedBlock>, Option<MissReason>)> {
        let h = self.host;
        let mut blocks: Vec<PinnedBlock> = Vec::new();
        let mut miss = None;
        for (i, &key) in keys.iter().enumerate() {
            // The previous key's host slot links a copied block to its parent.
            let parent = i
                .checked_sub(1)
                .and_then(|p| Some((keys[p], blocks.get(p)?.slot.0)));
            let Some((t, slot, _)) = self.pin_location(key, true) else {
                miss = Some(MissReason::NotCached);
                break;
            };
            if t != h && !may_block {
                self.unpin(t, slot);
                for b in &blocks {
                    self.unpin(h, b.slot.0);
                }
                return None;
            }
            let hs = if t == h {
                self.touch(t, slot);
                TierCounters::inc(&self.tiers[h].counters.hits);
                slot
            } else {
                TierCounters::inc(&self.tiers[h].counters.misses);
                match self.promote_pinned(key, t, slot, h, CopyFor::Read, parent) {
                    Ok(Some(hs)) => hs,
                    Ok(None) => {
                        self.unpin(t, slot);
                        miss = Some(MissReason::Busy);
                        break;
                    }
                    Err(reason) => {
                        if reason == MissReason::Corrupt {
                            self.drop_rest_of_chain(t, &keys[i + 1..]);
                        }
                        miss = Some(reason);
                        break;
                    }
                }
            };
            TierCounters::add(&self.tiers[h].counters.bytes_out, self.block_bytes as u64);
            blocks.push(PinnedBlock {
                key,
                slot: SlotId(hs),
                offset: self.dram.slot_offset(SlotId(hs)),
                len: self.block_bytes as u64,
                found_in: self.tiers[t].kind,
            });
        }
        Some((blocks, miss))
    }
}

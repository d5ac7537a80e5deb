//! The prefix index: for each kvtier server, the block keys it holds and in which tiers, kept
//! from the server's block events. Free of I/O (the subscriber task in [`crate::events`] feeds
//! it), so gaps, resyncs and the memory cap are tested on constructed event sequences.
//!
//! **Memory.** One entry per tracked block: its 16-byte key and a 1-byte tier mask in a
//! `HashMap<BlockKey, u8>` (hashbrown: 17 bytes per bucket plus 1 control byte, at most 7/8 of
//! the buckets full, power-of-two growth), about 21-41 bytes per block. The map never holds
//! more than `max_blocks` entries; at the cap a `Stored` event for a key it does not hold is
//! dropped and counted, so the index under-reports that server (the router then sends it less
//! than it could, never more than it holds); a later resync rebuilds what fits.
//!
//! **Invariant:** a key is in the map only with a non-zero tier mask.

use std::collections::HashMap;

use kvtier_core::BlockKey;
use kvtier_core::protocol::{BlockEvent, EventKind, TierCode};

/// Approximate bytes one tracked block costs at most (see the module docs).
pub const MAX_BYTES_PER_BLOCK: usize = 41;

/// Tiers in the order a load prefers them (fastest first).
pub const TIERS: [TierCode; 3] = TierCode::STORED;

/// What applying one event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Changed,
    /// Nothing to do (a removal of a key or tier not held, a repeat).
    Unchanged,
    /// A new key at the cap: not tracked.
    DroppedAtCap,
    /// An event whose kind or tier this router does not know.
    Unknown,
}

/// The blocks of one kvtier server.
#[derive(Debug)]
pub struct ServerIndex {
    blocks: HashMap<BlockKey, u8>,
    max_blocks: usize,
}

impl ServerIndex {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            max_blocks,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Forgets every block (a resync starts over from a snapshot).
    pub fn clear(&mut self) {
        self.blocks = HashMap::new();
    }

    pub fn apply(&mut self, ev: &BlockEvent) -> Applied {
        let Some(kind) = EventKind::from_u8(ev.kind) else {
            return Applied::Unknown;
        };
        if kind == EventKind::Cleared {
            let changed = !self.blocks.is_empty();
            self.clear();
            return if changed {
                Applied::Changed
            } else {
                Applied::Unchanged
            };
        }
        // A stored block's tier: "remote" is a lookup's answer, never an event's.
        let Some(tier) = TierCode::stored_from_u8(ev.tier) else {
            return Applied::Unknown;
        };
        let bit = 1u8 << (tier as u8);
        let full = self.blocks.len() >= self.max_blocks;
        match kind {
            EventKind::Stored => match self.blocks.get_mut(&ev.key) {
                Some(m) if *m & bit != 0 => Applied::Unchanged,
                Some(m) => {
                    *m |= bit;
                    Applied::Changed
                }
                None if full => Applied::DroppedAtCap,
                None => {
                    self.blocks.insert(ev.key, bit);
                    Applied::Changed
                }
            },
            EventKind::Removed => match self.blocks.get_mut(&ev.key) {
                Some(m) if *m & bit != 0 => {
                    *m &= !bit;
                    if *m == 0 {
                        self.blocks.remove(&ev.key);
                    }
                    Applied::Changed
                }
                _ => Applied::Unchanged,
            },
            EventKind::Cleared => unreachable!("handled above"),
        }
    }

    /// The fastest tier holding `key`, if any.
    pub fn tier(&self, key: &BlockKey) -> Option<TierCode> {
        let m = *self.blocks.get(key)?;
        TIERS.into_iter().find(|t| m & (1 << (*t as u8)) != 0)
    }

    /// The fastest tier of each block of the longest prefix of `keys` this server holds (a
    /// worker's lookup stops at the first block missing, as the server's does).
    pub fn prefix(&self, keys: &[BlockKey]) -> Vec<TierCode> {
        keys.iter().map_while(|k| self.tier(k)).collect()
    }
}

/// Follows the sequence numbers of one subscription: snapshot events (sequence 0) are applied
/// as they come; live events must be numbered without a hole from the subscription's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqTracker {
    next: u64,
}

/// What to do with one item of a subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Apply,
    /// Already applied (a replayed sequence number).
    Skip,
    /// Events were lost (`from..to`): forget this server's blocks and subscribe again with
    /// a snapshot.
    Resync {
        from: u64,
        to: u64,
    },
}

impl SeqTracker {
    /// `start_seq`: the server's next sequence number when the subscription began.
    pub fn new(start_seq: u64) -> Self {
        Self { next: start_seq }
    }

    /// The step for an event numbered `seq`.
    pub fn event(&mut self, seq: u64) -> Step {
        if seq == 0 {
            return Step::Apply;
        }
        if seq < self.next {
            return Step::Skip;
        }
        if seq > self.next {
            return Step::Resync {
                from: self.next,
                to: seq,
            };
        }
        self.next += 1;
        Step::Apply
    }

    /// The server said events `from..to` were lost.
    pub fn gap(&mut self, from: u64, to: u64) -> Step {
        Step::Resync { from, to }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey::from_bytes([i; 16])
    }

    fn ev(seq: u64, kind: EventKind, tier: TierCode, k: u8) -> BlockEvent {
        BlockEvent {
            seq,
            kind: kind as u8,
            tier: tier as u8,
            key: key(k),
        }
    }

    #[test]
    fn events_build_the_tiers_of_each_block() {
        use EventKind::*;
        use TierCode::*;
        let mut ix = ServerIndex::new(100);
        let check = |ix: &mut ServerIndex, e: BlockEvent, applied: Applied, tiers: &[u8]| {
            assert_eq!(ix.apply(&e), applied, "{e:?}");
            let got: Vec<_> = ix.prefix(&[key(1), key(2), key(3)]);
            let want: Vec<_> = tiers
                .iter()
                .map(|t| TierCode::from_u8(*t).unwrap())
                .collect();
            assert_eq!(got, want, "after {e:?}");
        };
        check(&mut ix, ev(1, Stored, Dram, 1), Applied::Changed, &[1]);
        check(&mut ix, ev(2, Stored, Dram, 1), Applied::Unchanged, &[1]);
        check(&mut ix, ev(3, Stored, Nvme, 3), Applied::Changed, &[1]);
        check(
            &mut ix,
            ev(4, Stored, Nvme, 2),
            Applied::Changed,
            &[1, 2, 2],
        );
        // Copied to NVMe, then evicted from DRAM: still held, now from NVMe.
        check(
            &mut ix,
            ev(5, Stored, Nvme, 1),
            Applied::Changed,
            &[1, 2, 2],
        );
        check(
            &mut ix,
            ev(6, Removed, Dram, 1),
            Applied::Changed,
            &[2, 2, 2],
        );
        check(
            &mut ix,
            ev(7, Removed, Dram, 1),
            Applied::Unchanged,
            &[2, 2, 2],
        );
        // The middle block gone: the prefix stops there.
        check(&mut ix, ev(8, Removed, Nvme, 2), Applied::Changed, &[2]);
        assert_eq!(ix.len(), 2);
        check(&mut ix, ev(9, Stored, Hbm, 1), Applied::Changed, &[0]);
        let unknown = BlockEvent {
            kind: 9,
            ..ev(10, Stored, Dram, 2)
        };
        check(&mut ix, unknown, Applied::Unknown, &[0]);
        let bad_tier = BlockEvent {
            tier: 7,
            ..ev(10, Stored, Dram, 2)
        };
        check(&mut ix, bad_tier, Applied::Unknown, &[0]);
        // A lookup's tier, which no stored block has: refused, not a fourth tier bit.
        check(&mut ix, ev(10, Stored, Remote, 2), Applied::Unknown, &[0]);
        check(&mut ix, ev(11, Cleared, Hbm, 0), Applied::Changed, &[]);
        assert!(ix.is_empty());
    }

    #[test]
    fn the_cap_drops_new_keys_and_keeps_updating_known_ones() {
        use EventKind::*;
        use TierCode::*;
        let mut ix = ServerIndex::new(2);
        assert_eq!(ix.apply(&ev(1, Stored, Dram, 1)), Applied::Changed);
        assert_eq!(ix.apply(&ev(2, Stored, Dram, 2)), Applied::Changed);
        assert_eq!(ix.apply(&ev(3, Stored, Dram, 3)), Applied::DroppedAtCap);
        assert_eq!(ix.len(), 2);
        assert_eq!(ix.apply(&ev(4, Stored, Nvme, 2)), Applied::Changed);
        assert_eq!(ix.apply(&ev(5, Removed, Dram, 1)), Applied::Changed);
        assert_eq!(ix.apply(&ev(6, Stored, Dram, 3)), Applied::Changed);
        assert_eq!(ix.prefix(&[key(3)]), vec![Dram]);
    }

    #[test]
    fn sequence_numbers_with_a_hole_or_a_gap_notice_resync() {
        let mut t = SeqTracker::new(10);
        // Snapshot first (sequence 0), then the live stream from 10.
        assert_eq!(t.event(0), Step::Apply);
        assert_eq!(t.event(0), Step::Apply);
        assert_eq!(t.event(10), Step::Apply);
        assert_eq!(t.event(11), Step::Apply);
        assert_eq!(t.event(11), Step::Skip);
        assert_eq!(t.event(5), Step::Skip);
        assert_eq!(t.event(13), Step::Resync { from: 12, to: 13 });
        let mut t = SeqTracker::new(3);
        assert_eq!(t.gap(3, 90), Step::Resync { from: 3, to: 90 });
    }
}

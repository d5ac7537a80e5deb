//! The data path's pure parts: which owner to ask for which run of a chain, how the owners'
//! answers combine into one prefix, how fetched blocks are verified, and where a put block
//! sits in its chain. No I/O, no clock.
//!
//! **Invariant:** a remote prefix extends only through blocks every earlier block of which
//! is present (locally or at its owner): [`combine`] walks the runs in chain order and stops
//! at the first gap, and [`matched`] stops at the first block that does not check out.

use std::collections::HashMap;

use kvtier_core::BlockKey;

use super::placement::{ChainCut, Runs, Splits};

/// One run of a chain to ask for: positions `start..start + len`, asked of owner `owner`
/// (an index into the caller's list of owners), at `offset` in the key list sent to that
/// owner. `owner` is `None` when no peer can be asked (this node is the run's only owner,
/// or there is no live member).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAsk {
    pub start: usize,
    pub len: usize,
    pub owner: Option<usize>,
    pub offset: usize,
}

/// The runs (cut by `cut`) of a `chain_len`-block chain from position `from` (inclusive) on,
/// each with the owner to ask: `owner_of(anchor position)` returns the index of the peer to ask for the
/// run anchored there, or `None`. A run is cut at `from` when `from` falls inside it. Each
/// owner's key list is its runs' keys in chain order; `offset` is a run's place in it.
pub fn plan(
    chain_len: usize,
    from: usize,
    cut: &ChainCut,
    mut owner_of: impl FnMut(usize) -> Option<usize>,
) -> Vec<RunAsk> {
    let mut out = Vec::new();
    let mut next_offset: HashMap<usize, usize> = HashMap::new();
    let mut start = from;
    while start < chain_len {
        let anchor = cut.anchor_of(start);
        let end = cut.run_end(anchor).min(chain_len);
        let owner = owner_of(anchor);
        let offset = match owner {
            Some(o) => {
                let off = next_offset.entry(o).or_insert(0);
                let at = *off;
                *off += end - start;
                at
            }
            None => 0,
        };
        out.push(RunAsk {
            start,
            len: end - start,
            owner,
            offset,
        });
        start = end;
    }
    out
}

/// Where a lookup looks for a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask<'a> {
    /// In this node's own store.
    Here,
    /// Of this owner.
    Peer(&'a str),
}

/// Where a lookup on node `me` looks for a run of `owners` (placement rank, best first;
/// `None`: no owners). A member that joined within the warm-up (just started, or
/// restarted empty) holds only what was offered to it since; the owners that were there
/// before it hold the run from before, so they are asked first: an owner is *settled*
/// once past the warm-up.
///
/// * `me` among the owners and settled: here (the run is here or nowhere).
/// * `me` among the owners but new: the best other owner that is settled and `usable` (the
///   peer pool has not seen it fail lately); none: here.
/// * Otherwise the best owner that is usable and settled; else the best usable one (with
///   replicas, a dead or hung owner's runs go to the next); all suspect: the best.
pub fn owner_to_ask<'a>(
    owners: &[&'a str],
    me: &str,
    usable: impl Fn(&str) -> bool,
    settled: impl Fn(&str) -> bool,
) -> Option<Ask<'a>> {
    if owners.contains(&me) {
        if settled(me) {
            return Some(Ask::Here);
        }
        return Some(
            owners
                .iter()
                .find(|o| **o != me && usable(o) && settled(o))
                .map_or(Ask::Here, |o| Ask::Peer(o)),
        );
    }
    owners
        .iter()
        .find(|o| usable(o) && settled(o))
        .or_else(|| owners.iter().find(|o| usable(o)))
        .or(owners.first())
        .map(|o| Ask::Peer(o))
}

/// How many blocks from the first run's start are present, in chain order, given each
/// owner's answer: `present[o]` is the length of the cached prefix of the key list sent to
/// owner `o` (`None`: it did not answer in time, or failed: nothing). The prefix extends
/// through runs that are whole, into the first run that is not (as far as its blocks are
/// present), and stops there.
pub fn combine(runs: &[RunAsk], present: &[Option<usize>]) -> usize {
    let mut total = 0;
    for r in runs {
        let have = match r.owner.and_then(|o| present.get(o).copied().flatten()) {
            Some(p) => p.saturating_sub(r.offset).min(r.len),
            None => 0,
        };
        total += have;
        if have < r.len {
            break;
        }
    }
    total
}

/// How many leading blocks of a fetch reply check out: block `i`'s sum over the key asked
/// for it and the bytes that arrived (`arrived`, computed by the SDK as they were read, over
/// exactly a block's length) is the one its owner states (`stated`). Stops at the first that
/// does not (a wrong block is never stored, and nothing after it either).
pub fn matched(stated: &[u64], arrived: &[u64]) -> usize {
    stated
        .iter()
        .zip(arrived)
        .take_while(|(s, a)| s == a)
        .count()
}

/// Where a block sits in its chain: its position, where its runs are counted from (after
/// the last split its chain passed, or 0), and its run's anchor (the key placing it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainPlace {
    pub position: u64,
    pub from: u64,
    pub anchor: BlockKey,
}

/// Positions of recently put blocks, so that a put's blocks (which name their parent, not
/// their position) can be placed: a block with no parent is at position 0; one whose parent
/// is known is one past it. Bounded: two generations of at most `capacity` entries each;
/// when the newer fills, the older is dropped (a block whose parent was forgotten is not
/// placed, and so not offered).
#[derive(Debug)]
pub struct ChainIndex {
    capacity: usize,
    rule: Runs,
    new: HashMap<BlockKey, ChainPlace>,
    old: HashMap<BlockKey, ChainPlace>,
}

impl ChainIndex {
    pub fn new(capacity: usize, rule: Runs) -> Self {
        Self {
            capacity: capacity.max(1),
            rule,
            new: HashMap::new(),
            old: HashMap::new(),
        }
    }

    pub fn get(&self, key: &BlockKey) -> Option<ChainPlace> {
        self.new.get(key).or_else(|| self.old.get(key)).copied()
    }

    /// Records `key` put after `parent`, under the cluster's `splits`; returns its place,
    /// or `None` when the parent's place is not known. (A parent recorded under an older
    /// set of splits passes its place on as it was: a block placed so is offered to the
    /// owner the old set named, and lookups under the new one miss it there; counted as
    /// nothing special, it is the cost of the set changing.)
    pub fn record(
        &mut self,
        key: BlockKey,
        parent: Option<BlockKey>,
        splits: &Splits,
    ) -> Option<ChainPlace> {
        let place = match parent {
            None => ChainPlace {
                position: 0,
                from: 0,
                anchor: key,
            },
            Some(p) => {
                let pp = self.get(&p)?;
                let split = splits.contains(pp.position as usize, &p);
                let (from, starts) = self
                    .rule
                    .after(pp.position as usize, pp.from as usize, split);
                ChainPlace {
                    position: pp.position + 1,
                    from: from as u64,
                    anchor: if starts { key } else { pp.anchor },
                }
            }
        };
        self.insert(key, place);
        Some(place)
    }

    /// Records `chain[position]`, `chain` being a whole chain from its first block (a
    /// lookup's keys) and `cut` its cut: its place is known from its position alone.
    pub fn record_at(&mut self, chain: &[BlockKey], cut: &ChainCut, position: usize) -> ChainPlace {
        let place = ChainPlace {
            position: position as u64,
            from: cut.from_of(position) as u64,
            anchor: cut.anchor(chain, position),
        };
        self.insert(chain[position], place);
        place
    }

    fn insert(&mut self, key: BlockKey, place: ChainPlace) {
        if self.new.len() >= self.capacity {
            self.old = std::mem::take(&mut self.new);
        }
        self.new.insert(key, place);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::protocol::block_sum;

    fn k(n: u128) -> BlockKey {
        BlockKey::from_u128(n)
    }

    #[test]
    fn a_run_is_asked_of_the_best_usable_settled_owner() {
        let ask = |owners: &[&'static str], usable: &[&str], settled: &[&str]| {
            owner_to_ask(
                owners,
                "me",
                |o| usable.contains(&o),
                |o| settled.contains(&o),
            )
        };
        let (ab, all) = (["a", "b"], ["a", "b", "me"]);
        assert_eq!(ask(&ab, &all, &all), Some(Ask::Peer("a")));
        // The best owner restarted a moment ago: the next, which was there before.
        assert_eq!(ask(&ab, &all, &["b"]), Some(Ask::Peer("b")));
        // ... unless that one is suspect: then the new one, still usable.
        assert_eq!(ask(&ab, &["a"], &["b"]), Some(Ask::Peer("a")));
        // Everyone new (a cluster that just started): by rank.
        assert_eq!(ask(&ab, &all, &[]), Some(Ask::Peer("a")));
        // Everyone suspect: the best.
        assert_eq!(ask(&ab, &[], &all), Some(Ask::Peer("a")));
        assert_eq!(ask(&[], &all, &all), None);
        // This node owns the run: here, unless it is new itself and another owner was
        // there before it (and answers).
        assert_eq!(ask(&["b", "me"], &all, &all), Some(Ask::Here));
        assert_eq!(ask(&["me", "b"], &all, &["a", "b"]), Some(Ask::Peer("b")));
        assert_eq!(ask(&["me", "b"], &["me"], &["b"]), Some(Ask::Here));
        assert_eq!(ask(&["me", "b"], &all, &[]), Some(Ask::Here));
        assert_eq!(ask(&["me"], &all, &["a"]), Some(Ask::Here));
    }

    /// Runs of `run` blocks from position 0 (no head, no split).
    fn runs_of(run: usize) -> ChainCut {
        Runs::new(0, run).plain()
    }

    fn none() -> Splits {
        Splits::default()
    }

    /// Owners by anchor position for a 10-block chain in runs of 3 (anchors 0, 3, 6, 9):
    /// anchor 0 -> peer 0, 3 -> peer 1, 6 -> peer 0, 9 -> nobody asked.
    fn owners(anchor: usize) -> Option<usize> {
        match anchor {
            0 | 6 => Some(0),
            3 => Some(1),
            _ => None,
        }
    }

    #[test]
    fn plan_cuts_runs_and_gives_each_owner_its_offsets() {
        let p = plan(10, 2, &runs_of(3), owners);
        let got: Vec<(usize, usize, Option<usize>, usize)> = p
            .iter()
            .map(|r| (r.start, r.len, r.owner, r.offset))
            .collect();
        assert_eq!(
            got,
            vec![
                (2, 1, Some(0), 0),
                (3, 3, Some(1), 0),
                (6, 3, Some(0), 1),
                (9, 1, None, 0)
            ]
        );
        assert!(plan(10, 10, &runs_of(3), owners).is_empty());
        // run_blocks 0 is runs of 1.
        assert_eq!(plan(2, 0, &runs_of(0), |_| Some(0)).len(), 2);
        // A head of 2: positions 0 and 1 alone, then runs of 3 from 2 (anchors 2, 5, 8).
        let starts: Vec<(usize, usize)> = plan(10, 1, &Runs::new(2, 3).plain(), Some)
            .iter()
            .map(|r| (r.start, r.len))
            .collect();
        assert_eq!(starts, vec![(1, 1), (2, 3), (5, 3), (8, 2)]);
    }

    /// Table: the owners' answers (leading keys present in the list each was sent) -> the
    /// blocks the prefix extends by, for the plan above (peer 0 was sent positions 2, 6, 7,
    /// 8; peer 1 positions 3, 4, 5).
    #[test]
    fn combine_in_chain_order() {
        let runs = plan(10, 2, &runs_of(3), owners);
        let check = |present: &[Option<usize>], want: usize| {
            assert_eq!(combine(&runs, present), want, "{present:?}");
        };
        check(&[Some(4), Some(3)], 7); // all asked present; stops at the unowned run
        check(&[Some(0), Some(3)], 0); // the first run missing: nothing, whatever follows
        check(&[Some(1), Some(2)], 3); // the second run cut after 2 of 3
        check(&[Some(1), Some(3)], 4); // peer 0 has position 2 only: run 3 is empty
        check(&[Some(2), Some(3)], 5); // peer 0 has 2 and 6: 7 missing
        check(&[Some(9), Some(9)], 7); // more than asked is clamped
        check(&[None, Some(3)], 0); // peer 0 timed out
        check(&[Some(4), None], 1); // peer 1 failed
        check(&[], 0);
        let whole = plan(6, 0, &runs_of(3), |a| Some(a / 3));
        assert_eq!(combine(&whole, &[Some(3), Some(3)]), 6);
        assert_eq!(combine(&whole, &[Some(3), Some(0)]), 3);
    }

    #[test]
    fn matched_stops_at_the_first_bad_block() {
        let keys = [k(1), k(2), k(3)];
        let blocks: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8; 8]).collect();
        let sums = |blocks: &[Vec<u8>]| -> Vec<u64> {
            keys.iter()
                .zip(blocks)
                .map(|(k, b)| {
                    // As the SDK sums a block arriving in pieces.
                    let mut s = kvtier_core::protocol::BlockSum::new(k);
                    b.chunks(3).for_each(|p| s.update(p));
                    s.digest()
                })
                .collect()
        };
        let good: Vec<u64> = keys
            .iter()
            .zip(&blocks)
            .map(|(k, b)| block_sum(k, b))
            .collect();
        assert_eq!(sums(&blocks), good, "in pieces, the same sum");
        assert_eq!(matched(&good, &sums(&blocks)), 3);
        let mut bad = good.clone();
        bad[1] ^= 1;
        assert_eq!(matched(&bad, &sums(&blocks)), 1, "a wrong sum");
        let mut swapped = blocks.clone();
        swapped.swap(0, 1);
        assert_eq!(matched(&good, &sums(&swapped)), 0, "bytes of another key");
        let mut changed = blocks.clone();
        changed[2][7] ^= 0x10;
        assert_eq!(matched(&good, &sums(&changed)), 2, "a flipped bit");
        assert_eq!(matched(&good, &sums(&blocks[..1])), 1, "fewer blocks");
    }

    #[test]
    fn chain_index_places_children_and_forgets_old_generations() {
        let mut ix = ChainIndex::new(4, Runs::new(0, 3));
        let a0 = ix.record(k(10), None, &none()).unwrap();
        assert_eq!((a0.position, a0.anchor), (0, k(10)));
        let mut prev = k(10);
        for i in 1..6u128 {
            let p = ix.record(k(10 + i), Some(prev), &none()).unwrap();
            let want_anchor = if i < 3 { k(10) } else { k(13) };
            assert_eq!((p.position, p.anchor), (i as u64, want_anchor), "{i}");
            prev = k(10 + i);
        }
        assert_eq!(
            ix.record(k(99), Some(k(98)), &none()),
            None,
            "unknown parent"
        );
        // Capacity 4 per generation: after 8 more, the first entries are gone.
        for i in 0..8u128 {
            ix.record(k(1000 + i), None, &none());
        }
        assert_eq!(ix.get(&k(10)), None);
        assert!(ix.get(&k(1007)).is_some());
    }

    #[test]
    fn a_lookup_places_the_end_of_its_prefix_so_the_next_put_is_placed() {
        let mut ix = ChainIndex::new(16, Runs::new(0, 3));
        let chain: Vec<BlockKey> = (0..8u128).map(|i| k(50 + i)).collect();
        // Nothing of the chain was put here: its continuation cannot be placed...
        assert_eq!(ix.record(k(58), Some(k(57)), &none()), None);
        // ... until a lookup found its first 8 blocks (positions 0-7, anchors 0, 3, 6).
        let p = ix.record_at(&chain, &runs_of(3), 7);
        assert_eq!((p.position, p.anchor), (7, k(56)));
        let next = ix.record(k(58), Some(k(57)), &none()).unwrap();
        assert_eq!((next.position, next.anchor), (8, k(56)));
        let after = ix.record(k(59), Some(k(58)), &none()).unwrap();
        assert_eq!(
            (after.position, after.anchor),
            (9, k(59)),
            "a new run starts at 9"
        );
        assert_eq!(ix.record_at(&chain, &runs_of(3), 0).anchor, k(50));
    }

    /// With a head of 2, the first two puts anchor themselves and runs start at 2, 5, ...
    #[test]
    fn chain_index_places_the_head_per_block() {
        let mut ix = ChainIndex::new(16, Runs::new(2, 3));
        let mut parent = None;
        let mut anchors = Vec::new();
        for i in 0..7u128 {
            anchors.push(ix.record(k(70 + i), parent, &none()).unwrap().anchor);
            parent = Some(k(70 + i));
        }
        let want: Vec<BlockKey> = [70, 71, 72, 72, 72, 75, 75].map(k).to_vec();
        assert_eq!(anchors, want);
        let chain: Vec<BlockKey> = (0..7u128).map(|i| k(70 + i)).collect();
        for (i, a) in want.iter().enumerate() {
            assert_eq!(
                ix.record_at(&chain, &Runs::new(2, 3).plain(), i).anchor,
                *a,
                "{i}"
            );
        }
    }

    /// A split at position 0 (a shared first block): the blocks after it start runs of
    /// their own, from put to put as from the lookup's whole chain.
    #[test]
    fn chain_index_starts_a_run_after_a_split() {
        let splits = Splits::new([(0, k(1))]);
        let rule = Runs::new(0, 3);
        let mut ix = ChainIndex::new(16, rule);
        let mut parent = None;
        let mut anchors = Vec::new();
        let chain: Vec<BlockKey> = [1, 80, 81, 82, 83].map(k).to_vec();
        for key in &chain {
            anchors.push(ix.record(*key, parent, &splits).unwrap().anchor);
            parent = Some(*key);
        }
        let want: Vec<BlockKey> = [1, 80, 80, 80, 83].map(k).to_vec();
        assert_eq!(anchors, want);
        let cut = rule.cut(&chain, &splits);
        for (i, a) in want.iter().enumerate() {
            assert_eq!(ix.record_at(&chain, &cut, i).anchor, *a, "{i}");
        }
        // Without the split, the shared block anchors the whole first run.
        let mut plain = ChainIndex::new(16, rule);
        plain.record(k(1), None, &none());
        assert_eq!(
            plain.record(k(90), Some(k(1)), &none()).unwrap().anchor,
            k(1)
        );
    }
}

//! Placement: which members own a block. Weighted rendezvous (highest-random-weight)
//! hashing over the live members, with a replication factor, and the rule that spreads a
//! prefix chain over the cluster in runs of blocks. Pure functions of the member list: no
//! I/O, no clock.
//!
//! For a key `k` and a member `m` with weight `w_m` (its capacity), the score is
//! `-w_m / ln(u)`, `u = unit(xxh3_64_with_seed(k, seed_m))` uniform in (0, 1), `seed_m` the
//! XXH3-64 of the member's id: the logarithmic weighted HRW, under which a member's share
//! of the keys is `w_m / sum(w)`. The `r` highest scores own the key, best first. Adding or
//! removing a member changes a key's owners only where that member enters or leaves its
//! top `r`, so only the blocks of the member that came or went move (a property test checks
//! it).
//!
//! **Chains in runs** ([`Runs`]). The first `head_blocks` blocks of a prefix chain (none by
//! default) are placed each by its own key; after them, the block at position `i` is placed
//! by the key that starts its run of `run_blocks` (counted from `head_blocks`): its run's
//! *anchor*. A run lives on the same owners. Two chains that share a prefix share its
//! anchors, so they agree on owners. A lookup of an `n`-block prefix asks at most `min(n,
//! head_blocks) + ceil((n - head_blocks) / run_blocks)` owners (one parallel round), and a
//! get still pulls from several nodes at once. A chain that passes a *split* ([`Splits`]: a
//! block after which many chains diverge, such as the last block of a shared system prompt,
//! found by the members themselves) starts a new run after it, so the chains that diverge
//! there spread over the members instead of all following the shared block's owner for the
//! rest of its run. The head does the same by configuration, for the first `head_blocks`
//! positions. Why these defaults: `docs/cluster.md`, "How a chain is spread" and "Shared
//! prefixes".

use kvtier_core::BlockKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Blocks per run of a chain, by default (`cluster.run_blocks`).
pub const DEFAULT_RUN_BLOCKS: usize = 64;

/// Blocks at the head of a chain placed each by its own key, by default
/// (`cluster.head_blocks`): none, runs from the first block.
pub const DEFAULT_HEAD_BLOCKS: usize = 0;

/// How chains are cut for placement: positions below `head` are each their own run; from
/// `head` on, runs of `run` blocks, restarted after every split a chain passes through
/// ([`Splits`]). Every member must use the same rule; [`Runs::cut`] applies it to one chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Runs {
    head: usize,
    run: usize,
}

impl Runs {
    /// `run_blocks` 0 is treated as 1 (every block placed by its own key).
    pub fn new(head_blocks: usize, run_blocks: usize) -> Self {
        Self {
            head: head_blocks,
            run: run_blocks.max(1),
        }
    }

    /// The cut of `chain` (from its first block): where it passes a split, a run ends and
    /// the next starts after it.
    pub fn cut(&self, chain: &[BlockKey], splits: &Splits) -> ChainCut {
        let bounds = splits
            .0
            .iter()
            .filter(|(p, k)| *p + 1 < chain.len() && chain[*p] == *k)
            .map(|(p, _)| p + 1)
            .collect();
        ChainCut {
            rule: *self,
            bounds,
        }
    }

    /// The cut of a chain that passes no split.
    pub fn plain(&self) -> ChainCut {
        ChainCut {
            rule: *self,
            bounds: Vec::new(),
        }
    }

    /// Where the runs of a block's chain are counted from, given the place its parent (at
    /// `parent_position`, counted from `parent_from`) and whether the parent is a split;
    /// and whether the block at `parent_position + 1` starts a run. What [`ChainCut`] gives
    /// for that position, computed from the parent alone (a put names its parent, not its
    /// chain).
    pub fn after(&self, parent_position: usize, parent_from: usize, split: bool) -> (usize, bool) {
        let position = parent_position + 1;
        let from = if split { position } else { parent_from };
        (from, self.starts_run_at(position, from))
    }

    fn anchor_at(&self, position: usize, from: usize) -> usize {
        if position < self.head {
            position
        } else {
            let base = from.max(self.head);
            position - (position - base) % self.run
        }
    }

    fn starts_run_at(&self, position: usize, from: usize) -> bool {
        self.anchor_at(position, from) == position
    }
}

/// Blocks after which many chains go separate ways, each with its position in its chain:
/// the last block of a system prompt most requests share. A chain that passes one starts
/// a run after it, so the chains that diverge there do not all follow the shared block's
/// owner for the rest of its run (`docs/cluster.md`, "Shared prefixes"). The members
/// detect them and publish them in their records; the view's set is the union. Sorted,
/// without duplicates, at most [`Splits::MAX`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Splits(Vec<(usize, BlockKey)>);

impl Splits {
    /// At most this many (the first by position and key): bounds the work per lookup.
    pub const MAX: usize = 256;

    pub fn new(splits: impl IntoIterator<Item = (usize, BlockKey)>) -> Self {
        let mut v: Vec<(usize, BlockKey)> = splits.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        v.truncate(Self::MAX);
        Self(v)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &(usize, BlockKey)> {
        self.0.iter()
    }

    /// Whether `key` at `position` is a split.
    pub fn contains(&self, position: usize, key: &BlockKey) -> bool {
        self.0.binary_search(&(position, *key)).is_ok()
    }
}

/// One chain's cut: its runs under a [`Runs`] rule and the splits it passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainCut {
    rule: Runs,
    /// Positions right after the splits the chain passes, ascending.
    bounds: Vec<usize>,
}

impl ChainCut {
    /// Where the runs holding `position` are counted from: the last bound at or before it
    /// (0 if none).
    pub fn from_of(&self, position: usize) -> usize {
        let i = self.bounds.partition_point(|&b| b <= position);
        i.checked_sub(1).map_or(0, |i| self.bounds[i])
    }

    /// The position of the key that places the block at `position`: its run's anchor.
    pub fn anchor_of(&self, position: usize) -> usize {
        self.rule.anchor_at(position, self.from_of(position))
    }

    /// How many leading blocks of the chain are shared with many other chains: those up to
    /// the last split it passes (0 if none).
    pub fn shared_len(&self) -> usize {
        self.bounds.last().copied().unwrap_or(0)
    }

    /// Whether the block at `position` starts a run (is its own anchor).
    pub fn starts_run(&self, position: usize) -> bool {
        self.anchor_of(position) == position
    }

    /// One past the last position of the run that `anchor` starts.
    pub fn run_end(&self, anchor: usize) -> usize {
        if anchor < self.rule.head {
            return anchor + 1;
        }
        let end = anchor + self.rule.run;
        let next = self.bounds.partition_point(|&b| b <= anchor);
        self.bounds.get(next).map_or(end, |&b| end.min(b))
    }

    /// The key that places the block at position `index` of `chain`.
    ///
    /// Panics if `index` is out of `chain`'s bounds (a caller's bug, not input).
    pub fn anchor(&self, chain: &[BlockKey], index: usize) -> BlockKey {
        chain[self.anchor_of(index)]
    }

    /// The runs of `chain`: `(first position, anchor key)` per run.
    pub fn runs<'a>(
        &'a self,
        chain: &'a [BlockKey],
    ) -> impl Iterator<Item = (usize, BlockKey)> + 'a {
        let mut at = 0;
        std::iter::from_fn(move || {
            let here = at;
            let key = *chain.get(here)?;
            at = self.run_end(here);
            Some((here, key))
        })
    }
}

/// A member as placement sees it: its id and weight (capacity; only ratios matter).
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub id: String,
    pub weight: f64,
    seed: u64,
}

impl Candidate {
    /// A member of weight `weight` (its capacity in any unit; <= 0 or NaN: owns nothing).
    pub fn new(id: impl Into<String>, weight: f64) -> Self {
        let id = id.into();
        let seed = xxh3_64(id.as_bytes());
        Self { id, weight, seed }
    }

    fn eligible(&self) -> bool {
        self.weight.is_finite() && self.weight > 0.0
    }

    /// This member's rendezvous score for `key` (higher wins).
    pub fn score(&self, key: &BlockKey) -> f64 {
        let h = xxh3_64_with_seed(key.as_bytes(), self.seed);
        // 53 random bits, centred in their interval: u in (0, 1), never 0 or 1, so ln(u) < 0.
        let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
        -self.weight / u.ln()
    }
}

/// The owners of keys over one member list (a snapshot of the membership view).
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// Eligible members (weight > 0), sorted by id so ties break the same way everywhere.
    members: Vec<Candidate>,
    replicas: usize,
}

impl Placement {
    /// Placement over `members` with `replicas` owners per key (at least 1; fewer where
    /// there are fewer members). Members of weight <= 0 own nothing.
    pub fn new(members: impl IntoIterator<Item = Candidate>, replicas: usize) -> Self {
        let mut members: Vec<Candidate> = members.into_iter().filter(|c| c.eligible()).collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        Self {
            members,
            replicas: replicas.max(1),
        }
    }

    pub fn members(&self) -> &[Candidate] {
        &self.members
    }

    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The owners of `key`, best first, as indices into [`Placement::members`], written into
    /// `out` (cleared first): `min(replicas, members)` of them. O(members) per key.
    pub fn owners_into(&self, key: &BlockKey, out: &mut Vec<usize>) {
        out.clear();
        let r = self.replicas.min(self.members.len());
        if r == 0 {
            return;
        }
        // The r best (score, index), best first; r is small (1-3), so insertion is cheapest.
        let mut best: Vec<(f64, usize)> = Vec::with_capacity(r + 1);
        for (i, m) in self.members.iter().enumerate() {
            let s = m.score(key);
            if best.len() == r && s <= best[r - 1].0 {
                continue;
            }
            let at = best.iter().position(|(b, _)| s > *b).unwrap_or(best.len());
            best.insert(at, (s, i));
            best.truncate(r);
        }
        out.extend(best.into_iter().map(|(_, i)| i));
    }

    /// The ids of `key`'s owners, best first.
    pub fn owners(&self, key: &BlockKey) -> Vec<&str> {
        let mut idx = Vec::new();
        self.owners_into(key, &mut idx);
        idx.into_iter()
            .map(|i| self.members[i].id.as_str())
            .collect()
    }

    /// The first owner of `key`, if there is any member.
    pub fn primary(&self, key: &BlockKey) -> Option<&str> {
        self.members
            .iter()
            .map(|m| (m.score(key), m))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, m)| m.id.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(n: u64) -> BlockKey {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&n.to_le_bytes());
        b[8..].copy_from_slice(&(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes());
        BlockKey::from_bytes(b)
    }

    fn nodes(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate::new(format!("node-{i}"), 1.0 + (i % 3) as f64))
            .collect()
    }

    fn ids(p: &Placement, k: &BlockKey) -> Vec<String> {
        p.owners(k).into_iter().map(String::from).collect()
    }

    #[test]
    fn owners_are_distinct_best_first_and_capped_by_members() {
        for (n, r, expect) in [(0, 1, 0), (1, 1, 1), (1, 3, 1), (5, 2, 2), (5, 3, 3)] {
            let p = Placement::new(nodes(n), r);
            for i in 0..200 {
                let k = key(i);
                let o = p.owners(&k);
                assert_eq!(o.len(), expect, "n={n} r={r}");
                let mut d = o.clone();
                d.sort();
                d.dedup();
                assert_eq!(d.len(), o.len(), "owners repeat");
                let scores: Vec<f64> = o
                    .iter()
                    .map(|id| p.members().iter().find(|m| m.id == *id).unwrap().score(&k))
                    .collect();
                assert!(scores.windows(2).all(|w| w[0] >= w[1]), "not best first");
                assert_eq!(p.primary(&k), o.first().copied());
            }
        }
    }

    #[test]
    fn order_of_members_does_not_matter_and_zero_weight_owns_nothing() {
        let mut a = nodes(7);
        a.push(Candidate::new("empty", 0.0));
        let mut b = a.clone();
        b.reverse();
        let (pa, pb) = (Placement::new(a, 2), Placement::new(b, 2));
        for i in 0..500 {
            assert_eq!(pa.owners(&key(i)), pb.owners(&key(i)));
            assert!(!pa.owners(&key(i)).contains(&"empty"));
        }
    }

    /// Shares follow weights: members of weight 1, 2 and 5 own 1/8, 2/8 and 5/8 of 200k
    /// keys, within 1 percentage point.
    #[test]
    fn shares_follow_weights() {
        let p = Placement::new(
            [
                Candidate::new("a", 1.0),
                Candidate::new("b", 2.0),
                Candidate::new("c", 5.0),
            ],
            1,
        );
        let n = 200_000u64;
        let mut count = [0u64; 3];
        for i in 0..n {
            match p.primary(&key(i)) {
                Some("a") => count[0] += 1,
                Some("b") => count[1] += 1,
                Some("c") => count[2] += 1,
                o => panic!("unexpected owner {o:?}"),
            }
        }
        for (c, w) in count.iter().zip([1.0, 2.0, 5.0]) {
            let share = *c as f64 / n as f64;
            assert!(
                (share - w / 8.0).abs() < 0.01,
                "share {share} for weight {w}"
            );
        }
    }

    #[test]
    fn runs_and_anchors() {
        let chain: Vec<BlockKey> = (0..10).map(key).collect();
        let plain = Runs::new(0, 4).plain();
        let r: Vec<usize> = plain.runs(&chain).map(|(i, _)| i).collect();
        assert_eq!(r, vec![0, 4, 8]);
        for (i, expect) in [(0, 0), (3, 0), (4, 4), (7, 4), (9, 8)] {
            assert_eq!(plain.anchor(&chain, i), chain[expect]);
        }
        assert_eq!(Runs::new(0, 0).plain().anchor(&chain, 5), chain[5]);
        assert_eq!(Runs::new(0, 1).plain().runs(&chain).count(), 10);
        assert!(Runs::new(0, 4).plain().runs(&[]).next().is_none());
    }

    /// A head of 3 blocks, then runs of 4 counted from position 3: anchors 0, 1, 2, 3, 7.
    #[test]
    fn the_head_is_placed_per_block() {
        let chain: Vec<BlockKey> = (0..10).map(key).collect();
        let cut = Runs::new(3, 4).plain();
        let r: Vec<usize> = cut.runs(&chain).map(|(i, _)| i).collect();
        assert_eq!(r, vec![0, 1, 2, 3, 7]);
        for (i, expect) in [(0, 0), (1, 1), (2, 2), (3, 3), (6, 3), (7, 7), (9, 7)] {
            assert_eq!(cut.anchor_of(i), expect, "{i}");
            assert_eq!(cut.anchor(&chain, i), chain[expect]);
            assert_eq!(cut.starts_run(i), i == expect);
        }
        assert_eq!((cut.run_end(2), cut.run_end(3), cut.run_end(7)), (3, 7, 11));
        // A head longer than the chain: every block its own run.
        assert_eq!(Runs::new(64, 64).plain().runs(&chain).count(), 10);
    }

    /// A chain that passes a split starts a run after it; a split the chain does not pass
    /// (another key at that position, or past its end) changes nothing.
    #[test]
    fn a_split_ends_a_run_and_the_next_starts_after_it() {
        let chain: Vec<BlockKey> = (0..12).map(key).collect();
        let rule = Runs::new(0, 4);
        let splits = Splits::new([(1, key(1)), (5, key(99)), (11, key(11)), (6, key(6))]);
        let cut = rule.cut(&chain, &splits);
        let r: Vec<usize> = cut.runs(&chain).map(|(i, _)| i).collect();
        // Bounds after positions 1 and 6 (position 5 holds another key; 11 is the last).
        assert_eq!(r, vec![0, 2, 6, 7, 11]);
        assert_eq!((cut.run_end(0), cut.run_end(2), cut.run_end(6)), (2, 6, 7));
        assert_eq!((cut.from_of(1), cut.from_of(2), cut.from_of(9)), (0, 2, 7));
        assert_eq!(cut.shared_len(), 7);
        assert_eq!(rule.plain().shared_len(), 0);
        // The conversation trace's case: every chain starts with the same block, a split.
        let shared = Splits::new([(0, key(0))]);
        let a: Vec<BlockKey> = [0, 10, 11, 12].map(key).to_vec();
        let b: Vec<BlockKey> = [0, 20, 21].map(key).to_vec();
        assert_eq!(rule.cut(&a, &shared).anchor(&a, 3), key(10));
        assert_eq!(rule.cut(&b, &shared).anchor(&b, 2), key(20));
        assert_eq!(
            rule.plain().anchor(&a, 3),
            key(0),
            "without it: the shared block"
        );
        // With a head, a split inside it changes nothing there.
        let headed = Runs::new(3, 4).cut(&chain, &splits);
        let r: Vec<usize> = headed.runs(&chain).map(|(i, _)| i).collect();
        assert_eq!(r, vec![0, 1, 2, 3, 7, 11]);
        assert!(Splits::new([(1, key(1)); 3]).len() == 1);
        assert!(Splits::new((0..1000).map(|i| (i, key(i as u64)))).len() == Splits::MAX);
    }

    proptest! {
        /// The runs cut a chain into consecutive pieces, each placed by its first key, and
        /// every position's anchor is the start of the run holding it; placing each block
        /// from its parent alone (as puts are) agrees with the whole chain's cut.
        #[test]
        fn runs_partition_the_chain(head in 0usize..40, run in 0usize..20, len in 0usize..200,
                                    split_at in prop::collection::vec(0usize..200, 0..6),
                                    foreign in prop::collection::vec(0usize..200, 0..3)) {
            let chain: Vec<BlockKey> = (0..len as u64).map(key).collect();
            let rule = Runs::new(head, run);
            let splits = Splits::new(
                split_at.iter().map(|&p| (p, key(p as u64)))
                    .chain(foreign.iter().map(|&p| (p, key(1_000 + p as u64)))));
            let cut = rule.cut(&chain, &splits);
            let starts: Vec<usize> = cut.runs(&chain).map(|(i, _)| i).collect();
            let mut next = 0;
            for (n, &s) in starts.iter().enumerate() {
                prop_assert_eq!(s, next);
                prop_assert!(cut.starts_run(s));
                let end = cut.run_end(s).min(len);
                for p in s..end {
                    prop_assert_eq!(cut.anchor_of(p), s);
                }
                prop_assert!(end > s, "run {} is empty", n);
                next = end;
            }
            prop_assert_eq!(next, len);
            let mut from = 0;
            for p in 1..len {
                let (f, starts) = rule.after(p - 1, from, splits.contains(p - 1, &chain[p - 1]));
                prop_assert_eq!(f, cut.from_of(p));
                prop_assert_eq!(starts, cut.starts_run(p), "position {}", p);
                from = f;
            }
        }

        /// A member joining takes keys only for itself: every key's new owners are its old
        /// owners with at most one replaced by the newcomer.
        #[test]
        fn a_join_moves_only_keys_to_the_newcomer(n in 1usize..20, r in 1usize..4,
                                                  w in 0.1f64..10.0, salt in any::<u64>()) {
            let before = Placement::new(nodes(n), r);
            let mut grown = nodes(n);
            grown.push(Candidate::new(format!("new-{salt}"), w));
            let after = Placement::new(grown, r);
            let newcomer = format!("new-{salt}");
            for i in 0..300u64 {
                let k = key(i ^ salt);
                let (old, new) = (ids(&before, &k), ids(&after, &k));
                let gone: Vec<&String> = old.iter().filter(|o| !new.contains(o)).collect();
                let came: Vec<&String> = new.iter().filter(|o| !old.contains(o)).collect();
                prop_assert!(came.iter().all(|c| **c == newcomer), "{old:?} -> {new:?}");
                prop_assert!(gone.len() <= 1 && gone.len() == came.len()
                    || old.len() < r && gone.is_empty(), "{old:?} -> {new:?}");
            }
        }

        /// A member leaving moves only its own keys: a key it did not own keeps its owners
        /// (in order); a key it owned keeps the others and gains at most one.
        #[test]
        fn a_leave_moves_only_the_leavers_keys(n in 2usize..20, r in 1usize..4,
                                               leaver in any::<prop::sample::Index>(),
                                               salt in any::<u64>()) {
            let all = nodes(n);
            let gone = leaver.index(n);
            let before = Placement::new(all.clone(), r);
            let after = Placement::new(
                all.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, c)| c.clone()), r);
            let gone_id = all[gone].id.clone();
            for i in 0..300u64 {
                let k = key(i.wrapping_mul(31) ^ salt);
                let (old, new) = (ids(&before, &k), ids(&after, &k));
                if !old.contains(&gone_id) {
                    prop_assert_eq!(&old, &new);
                } else {
                    let kept: Vec<&String> = old.iter().filter(|o| **o != gone_id).collect();
                    prop_assert!(kept.iter().all(|o| new.contains(o)), "{old:?} -> {new:?}");
                    prop_assert!(new.len() <= kept.len() + 1);
                }
            }
        }
    }
}

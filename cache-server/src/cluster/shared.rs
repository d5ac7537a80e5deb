//! Finding the blocks after which many chains diverge (a shared system prompt's last block):
//! the splits this member publishes (`docs/cluster.md`, "Shared prefixes"). Pure: fed
//! sampled lookups' chains, aged by the caller's clock.
//!
//! The detector keeps a bounded prefix tree of the sampled chains: one node per key seen
//! (keys are chained, so a key stands for its whole prefix), each with how many sampled
//! chains passed through it and how many distinct continuations it has. A chain walks the
//! nodes it shares with earlier ones, counting, and adds at most [`NEW_PER_CHAIN`] new ones
//! where it leaves them, so a long shared prefix is learned a few blocks per sample and a
//! chain never costs more than [`WALK`] steps. A node is a split when at least
//! [`MIN_FANOUT`] distinct continuations leave it and at least [`MIN_SHARE`] of the sampled
//! chains (and [`MIN_COUNT`]) passed through it: a prompt most requests share, not one
//! session's growing prefix (whose turns extend one another: one or two continuations at
//! each block). [`SplitDetector::age`] halves every count, so what stops being shared is
//! forgotten, and a split stays published while it holds a quarter of the share that made
//! it one (no flapping at the threshold).

use std::collections::HashMap;

use kvtier_core::BlockKey;

/// Positions of a sampled chain looked at, at most (a shared prefix longer than this is
/// split at its first `WALK` blocks at best).
pub const WALK: usize = 1024;
/// New nodes a sampled chain adds, at most.
pub const NEW_PER_CHAIN: usize = 8;
/// Distinct continuations a split needs.
pub const MIN_FANOUT: u32 = 8;
/// The share of sampled chains (aged) a split needs.
pub const MIN_SHARE: f64 = 0.05;
/// Sampled chains (aged) a split needs.
pub const MIN_COUNT: u64 = 16;
/// Splits one member publishes, at most.
pub const MAX_PUBLISHED: usize = 16;
/// Nodes kept, at most (about 80 bytes each): past it, chains only count what is known.
pub const MAX_NODES: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
struct Node {
    position: usize,
    parent: Option<BlockKey>,
    count: u64,
    children: u32,
}

/// The prefix tree of sampled chains.
#[derive(Debug, Default)]
pub struct SplitDetector {
    nodes: HashMap<BlockKey, Node>,
    /// Sampled chains, aged like the counts.
    total: u64,
}

impl SplitDetector {
    pub fn new() -> Self {
        Self::default()
    }

    /// Nodes held now.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Counts one sampled chain (a lookup's keys, from its first block).
    pub fn observe(&mut self, chain: &[BlockKey]) {
        if chain.is_empty() {
            return;
        }
        self.total += 1;
        let mut parent: Option<BlockKey> = None;
        let mut added = 0;
        for (position, key) in chain.iter().take(WALK).enumerate() {
            if let Some(n) = self.nodes.get_mut(key) {
                n.count += 1;
            } else {
                if added == NEW_PER_CHAIN || self.nodes.len() >= MAX_NODES {
                    break;
                }
                self.nodes.insert(
                    *key,
                    Node {
                        position,
                        parent,
                        count: 1,
                        children: 0,
                    },
                );
                if let Some(n) = parent.and_then(|p| self.nodes.get_mut(&p)) {
                    n.children += 1;
                }
                added += 1;
            }
            parent = Some(*key);
        }
    }

    /// Halves every count (one period of the caller's clock) and forgets the nodes that
    /// reach 0. A node's count is at most its parent's, so a parent never goes before its
    /// children.
    pub fn age(&mut self) {
        self.total /= 2;
        let mut gone = Vec::new();
        self.nodes.retain(|_, n| {
            n.count /= 2;
            if n.count == 0 {
                gone.push(n.parent);
                false
            } else {
                true
            }
        });
        for p in gone.into_iter().flatten() {
            if let Some(n) = self.nodes.get_mut(&p) {
                n.children = n.children.saturating_sub(1);
            }
        }
    }

    /// The splits to publish, `(position, key)` sorted: the nodes that qualify now, and
    /// those of `kept` (published before) still holding a quarter of the share; at most
    /// [`MAX_PUBLISHED`], the most used first.
    pub fn splits(&self, kept: &[(usize, BlockKey)]) -> Vec<(usize, BlockKey)> {
        let share = MIN_SHARE * self.total as f64;
        let mut out: Vec<(u64, usize, BlockKey)> = self
            .nodes
            .iter()
            .filter(|(key, n)| {
                let qualifies =
                    n.children >= MIN_FANOUT && n.count >= MIN_COUNT && n.count as f64 >= share;
                let stays = n.count as f64 >= share / 4.0
                    && kept.iter().any(|(p, k)| *p == n.position && k == *key);
                qualifies || stays
            })
            .map(|(key, n)| (n.count, n.position, *key))
            .collect();
        out.sort_unstable_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        out.truncate(MAX_PUBLISHED);
        let mut splits: Vec<(usize, BlockKey)> = out.into_iter().map(|(_, p, k)| (p, k)).collect();
        splits.sort_unstable();
        splits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u128) -> BlockKey {
        BlockKey::from_u128(n)
    }

    /// A chain: `shared` blocks every chain has, then `own` blocks of chain `id`.
    fn chain(shared: &[u128], id: u128, own: usize) -> Vec<BlockKey> {
        shared
            .iter()
            .copied()
            .chain((0..own as u128).map(|i| (id << 32) | (i + 1)))
            .map(k)
            .collect()
    }

    #[test]
    fn a_shared_first_block_is_a_split() {
        let mut d = SplitDetector::new();
        for id in 1..=40 {
            d.observe(&chain(&[7], id, 20));
        }
        assert_eq!(d.splits(&[]), vec![(0, k(7))]);
    }

    /// A 30-block shared prompt is learned a few blocks per chain, and split at its end.
    #[test]
    fn a_long_shared_prompt_is_split_at_its_last_block() {
        let shared: Vec<u128> = (100..130).collect();
        let mut d = SplitDetector::new();
        for id in 1..=40 {
            d.observe(&chain(&shared, id, 10));
        }
        assert_eq!(d.splits(&[]), vec![(29, k(129))]);
    }

    /// One session's turns extend one another: counted, never a split.
    #[test]
    fn a_growing_session_is_not_a_split() {
        let mut d = SplitDetector::new();
        let session: Vec<BlockKey> = (1..=400).map(k).collect();
        for turn in 1..=40 {
            d.observe(&session[..turn * 10]);
        }
        assert!(d.splits(&[]).is_empty());
        assert!(d.len() <= 40 * NEW_PER_CHAIN);
    }

    /// Fan-out without the share (a block 3 % of the chains pass) or the share without the
    /// fan-out is no split.
    #[test]
    fn a_split_needs_both_fanout_and_share() {
        let mut d = SplitDetector::new();
        for id in 1..=20 {
            d.observe(&chain(&[5], id, 4));
        }
        for id in 1..=600 {
            d.observe(&chain(&[], 1_000 + id, 4));
        }
        assert!(d.splits(&[]).is_empty(), "20 of 620 chains");
        let mut d = SplitDetector::new();
        for i in 0..100u128 {
            d.observe(&chain(&[9], 1 + i % 4, 4));
        }
        assert!(d.splits(&[]).is_empty(), "4 continuations");
    }

    /// Aging forgets what is no longer seen; a published split stays while it holds a
    /// quarter of the share.
    #[test]
    fn aging_forgets_and_published_splits_stay_above_a_quarter() {
        let mut d = SplitDetector::new();
        for id in 1..=40 {
            d.observe(&chain(&[7], id, 4));
        }
        let published = d.splits(&[]);
        assert_eq!(published, vec![(0, k(7))]);
        d.age();
        // Then 1 chain of 201 passes it: under the share, its aged count over a quarter of
        // it.
        for id in 1..=200 {
            d.observe(&chain(&[], 5_000 + id, 2));
        }
        d.observe(&chain(&[7], 99, 2));
        assert!(d.splits(&[]).is_empty());
        assert_eq!(d.splits(&published), published);
        for _ in 0..10 {
            d.age();
        }
        assert!(d.is_empty(), "{} nodes left", d.len());
        assert!(d.splits(&published).is_empty());
    }

    /// A system prompt, then one of two tool sets: the chains diverge after the tool sets
    /// (the system prompt has two continuations only). At most MAX_PUBLISHED, the most
    /// used.
    #[test]
    fn nested_and_bounded() {
        let mut d = SplitDetector::new();
        for id in 1..=200u128 {
            let tools = 50 + id % 2;
            d.observe(&chain(&[7, tools], id, 3));
        }
        assert_eq!(d.splits(&[]), vec![(1, k(50)), (1, k(51))]);
        let mut d = SplitDetector::new();
        for id in 1..=4_000u128 {
            // 40 prompts of 100 chains each: 2.5 % each, under the share...
            d.observe(&chain(&[10_000 + id % 40], id, 2));
        }
        assert!(d.splits(&[]).is_empty());
        // ... and kept ones are bounded too.
        let kept: Vec<(usize, BlockKey)> = (0..40).map(|i| (0, k(10_000 + i))).collect();
        assert_eq!(d.splits(&kept).len(), MAX_PUBLISHED);
    }
}

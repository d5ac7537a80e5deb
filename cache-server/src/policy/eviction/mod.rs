//! Eviction: which block a full tier gives up. Policies track slots (dense `u32` indices of
//! one tier) in arrays sized at construction, so nothing is allocated per block.
//!
//! Every policy:
//! * never returns a slot the caller's `evictable` check refuses (pinned blocks);
//! * returns each tracked slot at most once per insertion (the store calls `on_remove` next).

use kvtier_core::BlockKey;

/// What the store knows about a block when it is inserted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsertContext {
    /// The slot, in the same tier, of the block's parent (the previous block of its chain),
    /// when the parent is cached there.
    pub parent: Option<u32>,
    /// The store's clock, in milliseconds.
    pub now_ms: u64,
}

/// A request's lookup, as one tier sees it.
#[derive(Clone, Copy, Debug)]
pub struct LookupContext<'a> {
    /// Slots of the longest prefix of the request's keys cached in this tier, in chain order.
    pub hits: &'a [u32],
    /// The request's keys after that prefix (the ones it will compute and put next).
    pub rest: &'a [BlockKey],
    pub now_ms: u64,
}

/// The eviction policy of one tier. Not thread safe; the store serialises calls per tier.
/// Calls naming a slot the policy does not track are ignored.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &'static str;
    /// A request looked up its prefix (the blocks are about to be read).
    fn on_lookup(&mut self, ctx: LookupContext<'_>);
    /// Block `key` was stored in `slot`.
    fn on_insert(&mut self, slot: u32, key: BlockKey, ctx: InsertContext);
    /// The block in `slot` was read.
    fn on_hit(&mut self, slot: u32, now_ms: u64);
    /// The block in `slot` left the tier (evicted or removed).
    fn on_remove(&mut self, slot: u32, now_ms: u64);
    /// A slot to evict among those `evictable` accepts, or `None` when none is found within
    /// the policy's scan bound.
    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
    /// [`Self::victim`] without the scan bound: it may look at every tracked slot. The store
    /// asks it only when the bounded search found nothing while retention hints or held
    /// lookups keep blocks from eviction: those may put more unevictable candidates first
    /// than the bound, where the tier still has blocks to give up. The default is the
    /// bounded search.
    fn victim_unbounded(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.victim(evictable)
    }
    /// Memory the policy keeps per slot, in bytes (allocated up front), for capacity planning.
    fn bytes_per_slot(&self) -> usize;
}

/// Which eviction policy a tier runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionKind {
    /// Plain least-recently-used (the baseline).
    Lru,
    /// LRU that evicts only leaves (chain ends); small, for very large tiers.
    LeafLru,
    /// The default: leaf-first with conversation-turn protection; see [`ChainAware`].
    #[default]
    ChainAware,
}

impl EvictionKind {
    pub const ALL: [EvictionKind; 3] = [
        EvictionKind::Lru,
        EvictionKind::LeafLru,
        EvictionKind::ChainAware,
    ];

    /// The policy over `slots` slots; in debug builds wrapped in [`Checked`], so every
    /// store test also checks the policy's contract.
    pub fn build(self, slots: u32, tuning: ChainAwareTuning) -> Box<dyn EvictionPolicy> {
        let p = self.build_unchecked(slots, tuning);
        if cfg!(debug_assertions) {
            Box::new(Checked::for_store(p, slots))
        } else {
            p
        }
    }

    /// The policy over `slots` slots, never wrapped.
    /// `tuning` applies to [`EvictionKind::ChainAware`] only.
    pub fn build_unchecked(self, slots: u32, tuning: ChainAwareTuning) -> Box<dyn EvictionPolicy> {
        match self {
            EvictionKind::Lru => Box::new(Lru::new(slots)),
            EvictionKind::LeafLru => Box::new(LeafLru::new(slots)),
            EvictionKind::ChainAware => Box::new(ChainAware::tuned(slots, tuning)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EvictionKind::Lru => "lru",
            EvictionKind::LeafLru => "leaf-lru",
            EvictionKind::ChainAware => "chain-aware",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// How many candidates a victim search looks at before giving up (all pinned, say).
pub const MAX_VICTIM_SCAN: usize = 512;

const NIL: u32 = u32::MAX;

/// Intrusive doubly-linked lists over slot indices; a slot is in at most one list.
pub(crate) struct SlotLists {
    prev: Box<[u32]>,
    next: Box<[u32]>,
    list_of: Box<[u8]>,
    heads: Vec<(u32, u32)>,
    lens: Vec<usize>,
}

const NO_LIST: u8 = u8::MAX;

impl SlotLists {
    pub(crate) fn new(slots: u32, lists: usize) -> Self {
        let n = slots as usize;
        Self {
            prev: vec![NIL; n].into(),
            next: vec![NIL; n].into(),
            list_of: vec![NO_LIST; n].into(),
            heads: vec![(NIL, NIL); lists],
            lens: vec![0; lists],
        }
    }

    pub(crate) fn list_of(&self, slot: u32) -> Option<usize> {
        let l = self.list_of[slot as usize];
        (l != NO_LIST).then_some(l as usize)
    }

    /// Pushes `slot` at the most-recent end of `list` (removing it from any list first).
    pub(crate) fn push_front(&mut self, list: usize, slot: u32) {
        self.unlink(slot);
        let (head, tail) = self.heads[list];
        self.prev[slot as usize] = NIL;
        self.next[slot as usize] = head;
        if head != NIL {
            self.prev[head as usize] = slot;
        }
        self.heads[list] = (slot, if tail == NIL { slot } else { tail });
        self.list_of[slot as usize] = list as u8;
        self.lens[list] += 1;
    }

    pub(crate) fn unlink(&mut self, slot: u32) {
        let Some(list) = self.list_of(slot) else {
            return;
        };
        let (p, n) = (self.prev[slot as usize], self.next[slot as usize]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.heads[list].0 = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.heads[list].1 = p;
        }
        self.list_of[slot as usize] = NO_LIST;
        self.lens[list] -= 1;
    }

    /// Slots of `list` from the least-recent end, at most `limit` of them.
    pub(crate) fn oldest(&self, list: usize, limit: usize) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.heads[list].1;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let s = cur;
                cur = self.prev[s as usize];
                s
            })
        })
        .take(limit)
    }
}

/// Plain LRU: evicts the least recently inserted or hit block.
pub struct Lru {
    lists: SlotLists,
}

impl Lru {
    pub fn new(slots: u32) -> Self {
        Self {
            lists: SlotLists::new(slots, 1),
        }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    /// Touches the prefix deepest-first, so its first block ends up most recent.
    fn on_lookup(&mut self, ctx: LookupContext<'_>) {
        for &s in ctx.hits.iter().rev() {
            self.on_hit(s, ctx.now_ms);
        }
    }
    fn on_insert(&mut self, slot: u32, _key: BlockKey, _ctx: InsertContext) {
        self.lists.push_front(0, slot);
    }
    fn on_hit(&mut self, slot: u32, _now_ms: u64) {
        if self.lists.list_of(slot).is_some() {
            self.lists.push_front(0, slot);
        }
    }
    fn on_remove(&mut self, slot: u32, _now_ms: u64) {
        self.lists.unlink(slot);
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.lists
            .oldest(0, MAX_VICTIM_SCAN)
            .find(|&s| evictable(s))
    }

    fn victim_unbounded(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.lists.oldest(0, usize::MAX).find(|&s| evictable(s))
    }

    fn bytes_per_slot(&self) -> usize {
        4 + 4 + 1
    }
}

pub use chain::{ChainAware, ChainAwareTuning, HORIZON_SLOTS, Horizon, LADDER};
pub use duel::PROTECT_MARGIN;
pub use leaf_lru::LeafLru;
pub use sanity::{Checked, store_violations};

mod chain;
/// The conformance suite every policy passes (run by this module's tests).
#[cfg(test)]
mod conformance;
mod duel;
mod leaf_lru;
mod sanity;

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a policy through inserts and hits, then lists its eviction order.
    pub(crate) fn eviction_order(p: &mut dyn EvictionPolicy, slots: u32) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(v) = p.victim(&mut |_| true) {
            p.on_remove(v, 0);
            out.push(v);
            assert!(
                out.len() <= slots as usize,
                "victim returned a removed slot"
            );
        }
        out
    }

    #[test]
    fn lru_evicts_least_recent_first_and_skips_pinned() {
        let mut p = Lru::new(4);
        for s in 0..4 {
            p.on_insert(s, BlockKey::default(), InsertContext::default());
        }
        p.on_hit(0, 0);
        assert_eq!(p.victim(&mut |s| s != 1), Some(2));
        assert_eq!(eviction_order(&mut p, 4), vec![1, 2, 3, 0]);
        assert_eq!(p.victim(&mut |_| true), None);
    }

    /// The conformance suite, against every policy.
    #[test]
    fn every_policy_passes_the_conformance_suite() {
        for kind in EvictionKind::ALL {
            eprintln!("eviction conformance: {}", kind.name());
            conformance::run(&|n| kind.build_unchecked(n, ChainAwareTuning::default()));
        }
    }

    /// A policy that breaks the contract (returns removed slots, ignores `evictable`).
    struct Forgetful {
        slots: u32,
    }

    impl EvictionPolicy for Forgetful {
        fn name(&self) -> &'static str {
            "forgetful"
        }
        fn on_lookup(&mut self, _: LookupContext<'_>) {}
        fn on_insert(&mut self, _: u32, _: BlockKey, _: InsertContext) {}
        fn on_hit(&mut self, _: u32, _: u64) {}
        fn on_remove(&mut self, _: u32, _: u64) {}
        fn victim(&mut self, _: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
            Some(self.slots - 1)
        }
        fn bytes_per_slot(&self) -> usize {
            0
        }
    }

    fn violation(f: impl FnOnce(&mut Checked) + std::panic::UnwindSafe, want: &str) {
        let r = std::panic::catch_unwind(move || {
            let mut p = Checked::new(Box::new(Forgetful { slots: 4 }), 4);
            f(&mut p);
        });
        let msg = r.expect_err("the wrapper let a violation through");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains(want), "{msg:?} (want {want:?})");
    }

    #[test]
    fn the_wrapper_catches_contract_violations() {
        let ctx = InsertContext::default();
        violation(
            |p| {
                let _ = p.victim(&mut |_| true);
            },
            "not tracked",
        );
        violation(
            |p| {
                p.on_insert(3, BlockKey::default(), ctx);
                p.on_remove(3, 0);
                let _ = p.victim(&mut |_| true);
            },
            "not tracked",
        );
        violation(
            |p| {
                p.on_insert(3, BlockKey::default(), ctx);
                let _ = p.victim(&mut |_| false);
            },
            "not accepted",
        );
        violation(
            |p| {
                p.on_insert(1, BlockKey::default(), ctx);
                p.on_insert(1, BlockKey::default(), ctx);
            },
            "inserted twice",
        );
        violation(
            |p| p.on_insert(9, BlockKey::default(), ctx),
            "past the 4 slots",
        );
        // And the suite fails it.
        let r = std::panic::catch_unwind(|| {
            conformance::run(&|n| Box::new(Forgetful { slots: n }));
        });
        assert!(r.is_err(), "the suite passed a broken policy");
    }

    #[test]
    fn lists_stay_consistent() {
        let mut l = SlotLists::new(5, 2);
        l.push_front(0, 1);
        l.push_front(0, 2);
        l.push_front(1, 3);
        l.push_front(1, 1);
        assert_eq!((l.lens[0], l.lens[1]), (1, 2));
        assert_eq!(l.oldest(1, 10).collect::<Vec<_>>(), vec![3, 1]);
        l.unlink(3);
        l.unlink(3);
        assert_eq!(l.oldest(1, 10).collect::<Vec<_>>(), vec![1]);
        assert_eq!(l.oldest(0, 10).collect::<Vec<_>>(), vec![2]);
    }
}

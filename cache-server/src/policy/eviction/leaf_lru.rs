//! Leaf-first LRU: plain recency, but a block whose chain continues in the tier (it has a
//! cached child) is passed over while a leaf can go, so chains shrink from their ends and no
//! orphan is left behind. About 25 bytes a slot, so it suits very large tiers (NVMe), where
//! the default policy's protection switches itself off anyway (see [`super::ChainAware`]).

use kvtier_core::BlockKey;

use super::{EvictionPolicy, InsertContext, LookupContext, MAX_VICTIM_SCAN, NIL, SlotLists};

pub struct LeafLru {
    lists: SlotLists,
    parent: Box<[u32]>,
    parent_gen: Box<[u32]>,
    insert_gen: Box<[u32]>,
    children: Box<[u32]>,
}

impl LeafLru {
    pub fn new(slots: u32) -> Self {
        let n = slots as usize;
        Self {
            lists: SlotLists::new(slots, 1),
            parent: vec![NIL; n].into(),
            parent_gen: vec![0; n].into(),
            insert_gen: vec![0; n].into(),
            children: vec![0; n].into(),
        }
    }

    /// The oldest leaf `evictable` accepts among the `bound` oldest blocks, else the oldest
    /// block it accepts there.
    fn search(&mut self, evictable: &mut dyn FnMut(u32) -> bool, bound: usize) -> Option<u32> {
        let mut fallback = None;
        for s in self.lists.oldest(0, bound) {
            if !evictable(s) {
                continue;
            }
            if self.children[s as usize] == 0 {
                return Some(s);
            }
            fallback.get_or_insert(s);
        }
        fallback
    }
}

impl EvictionPolicy for LeafLru {
    fn name(&self) -> &'static str {
        "leaf-lru"
    }

    fn on_lookup(&mut self, ctx: LookupContext<'_>) {
        for &s in ctx.hits.iter().rev() {
            self.on_hit(s, ctx.now_ms);
        }
    }

    fn on_insert(&mut self, slot: u32, _key: BlockKey, ctx: InsertContext) {
        let s = slot as usize;
        self.insert_gen[s] = self.insert_gen[s].wrapping_add(1);
        self.children[s] = 0;
        match ctx
            .parent
            .filter(|&p| p != slot && self.lists.list_of(p).is_some())
        {
            Some(p) => {
                self.parent[s] = p;
                self.parent_gen[s] = self.insert_gen[p as usize];
                self.children[p as usize] += 1;
            }
            None => self.parent[s] = NIL,
        }
        self.lists.push_front(0, slot);
    }

    fn on_hit(&mut self, slot: u32, _now_ms: u64) {
        if self.lists.list_of(slot).is_some() {
            self.lists.push_front(0, slot);
        }
    }

    fn on_remove(&mut self, slot: u32, _now_ms: u64) {
        let s = slot as usize;
        if self.lists.list_of(slot).is_none() {
            return;
        }
        let p = self.parent[s];
        if p != NIL
            && self.lists.list_of(p).is_some()
            && self.insert_gen[p as usize] == self.parent_gen[s]
        {
            self.children[p as usize] = self.children[p as usize].saturating_sub(1);
        }
        self.parent[s] = NIL;
        self.lists.unlink(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.search(evictable, MAX_VICTIM_SCAN)
    }

    fn victim_unbounded(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.search(evictable, usize::MAX)
    }

    fn bytes_per_slot(&self) -> usize {
        // prev, next, list id, parent, parent_gen, insert_gen, children
        4 + 4 + 1 + 4 * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_go_first_in_lru_order() {
        let mut p = LeafLru::new(8);
        let ins = |p: &mut LeafLru, s: u32, parent: Option<u32>| {
            p.on_insert(s, BlockKey::default(), InsertContext { parent, now_ms: 0 })
        };
        ins(&mut p, 0, None);
        ins(&mut p, 1, Some(0));
        ins(&mut p, 2, Some(1));
        ins(&mut p, 3, None);
        // Oldest is 0, but it has a child: the oldest leaf (2) goes first, then up the chain.
        let mut order = Vec::new();
        while let Some(v) = p.victim(&mut |_| true) {
            p.on_remove(v, 0);
            order.push(v);
        }
        assert_eq!(order, vec![2, 1, 0, 3]);
    }
}

//! The default eviction policy. (Filled in below.)

use super::{EvictionPolicy, InsertContext, MAX_VICTIM_SCAN, NIL, SlotLists};

/// Leaf-first LRU: among the least recent blocks, a block whose chain continues in the tier
/// (it has cached children) is kept while a leaf can go, so suffixes leave before prefixes.
pub struct ChainAware {
    lists: SlotLists,
    parent: Box<[u32]>,
    parent_gen: Box<[u32]>,
    insert_gen: Box<[u32]>,
    children: Box<[u32]>,
}

impl ChainAware {
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
}

impl EvictionPolicy for ChainAware {
    fn name(&self) -> &'static str {
        "chain-aware"
    }

    fn on_insert(&mut self, slot: u32, ctx: InsertContext) {
        let s = slot as usize;
        self.insert_gen[s] = self.insert_gen[s].wrapping_add(1);
        self.children[s] = 0;
        match ctx.parent {
            Some(p) if p != slot && self.lists.list_of(p).is_some() => {
                self.parent[s] = p;
                self.parent_gen[s] = self.insert_gen[p as usize];
                self.children[p as usize] += 1;
            }
            _ => self.parent[s] = NIL,
        }
        self.lists.push_front(0, slot);
    }

    fn on_hit(&mut self, slot: u32) {
        if self.lists.list_of(slot).is_some() {
            self.lists.push_front(0, slot);
        }
    }

    fn on_remove(&mut self, slot: u32) {
        let s = slot as usize;
        let p = self.parent[s];
        if p != NIL && self.insert_gen[p as usize] == self.parent_gen[s] {
            self.children[p as usize] = self.children[p as usize].saturating_sub(1);
        }
        self.parent[s] = NIL;
        self.lists.unlink(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let mut fallback = None;
        for s in self.lists.oldest(0, MAX_VICTIM_SCAN) {
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

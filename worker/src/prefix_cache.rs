//! The worker's own prefix cache over its KV pool, as vLLM's automatic prefix caching: the
//! full blocks a sequence computed stay in the pool, indexed by their block key, after the
//! sequence ends, so a request that follows (an agent's next turn, the same prompt again)
//! uses them in place with no sidecar round trip. They are given up, least recently used
//! first, only when a new request needs their pages.
//!
//! A cached block is shared: every sequence that uses it holds a reference, and it is never
//! written while cached. **Invariant:** a sequence writes only positions past its cached
//! leading blocks: the scheduler takes at most `(prompt_len - 1) / block_tokens` leading
//! blocks from here, so the prompt's last token (always recomputed, its logits are needed)
//! and every generated token land in blocks of the sequence's own; and a block is entered
//! here only once every position in it has been computed (or loaded from kvtier).
//!
//! Unreferenced ("idle") cached blocks are the eviction candidates, in least-recently-released
//! order; a sequence's blocks are released last block first, so a chain's tail goes before
//! its head (a child is useless without its parent, and a lookup stops at the first miss).

use std::collections::{BTreeMap, HashMap};

use kvtier_core::{BlockKey, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};

use crate::error::Result;
use crate::kv_cache::{BlockId, BlockTable, PagedKvCache};

/// Makes the block keys of prompts: kvtier's chained keyed hash under a namespace of the model
/// id, the [`KvLayout`] fingerprint and the request's `cache_salt`. The sidecar and the local
/// prefix cache use the same keys.
#[derive(Clone, Debug)]
pub struct BlockKeys {
    secret: HashSecret,
    model_id: String,
    layout: KvLayout,
}

impl BlockKeys {
    pub fn new(secret: HashSecret, model_id: String, layout: KvLayout) -> Self {
        Self {
            secret,
            model_id,
            layout,
        }
    }

    /// The keys of `tokens`' full blocks under `cache_salt`.
    pub fn keys(&self, tokens: &[u32], cache_salt: Option<&[u8]>) -> Result<Vec<BlockKey>> {
        let mut ns = NamespaceBuilder::new(self.model_id.clone(), self.layout.fingerprint());
        if let Some(s) = cache_salt {
            ns = ns.cache_salt(s);
        }
        let ns = ns.build(&self.secret)?;
        let mut h = PrefixHasher::new(self.secret.clone(), ns, self.layout.block_tokens())?;
        let mut keys = Vec::new();
        h.prompt_keys(tokens, &mut keys);
        Ok(keys)
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    block: BlockId,
    /// Sequences using the block now.
    refs: u32,
    /// Position in `idle` while `refs == 0`.
    idle_since: u64,
}

/// The index of cached blocks in one pool. It does not own the pool: every call that frees
/// pages takes it.
#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: HashMap<BlockKey, Entry>,
    key_of: HashMap<BlockId, BlockKey>,
    /// Unreferenced entries, oldest first.
    idle: BTreeMap<u64, BlockKey>,
    tick: u64,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks indexed now (in use or idle).
    pub fn cached_blocks(&self) -> usize {
        self.entries.len()
    }

    /// Cached blocks no sequence uses (given up first when pages are needed).
    pub fn idle_blocks(&self) -> usize {
        self.idle.len()
    }

    /// How many leading `keys` are cached.
    pub fn hits(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.entries.contains_key(k))
            .count()
    }

    /// Pages a request could get after taking the cached blocks of `hit` (leading cached
    /// keys): the pool's free pages and the idle cached blocks other than those.
    pub fn available(&self, pool: &PagedKvCache, hit: &[BlockKey]) -> usize {
        let idle_hits = hit
            .iter()
            .filter(|k| self.entries.get(k).is_some_and(|e| e.refs == 0))
            .count();
        pool.free_blocks() + self.idle.len() - idle_hits
    }

    /// A table over the cached blocks of `keys` (each must be cached: see
    /// [`hits`](Self::hits)), each now referenced once more.
    pub fn acquire(&mut self, keys: &[BlockKey]) -> BlockTable {
        let mut blocks = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(e) = self.entries.get_mut(k) else {
                break;
            };
            if e.refs == 0 {
                self.idle.remove(&e.idle_since);
            }
            e.refs += 1;
            blocks.push(e.block);
        }
        BlockTable::from_blocks(blocks)
    }

    /// Frees idle cached blocks, least recently released first, until the pool has `pages`
    /// free pages or nothing idle is left. Returns the number freed.
    pub fn make_room(&mut self, pool: &mut PagedKvCache, pages: usize) -> Result<usize> {
        let mut freed = 0;
        while pool.free_blocks() < pages {
            let Some((_, key)) = self.idle.pop_first() else {
                break;
            };
            // Every idle key has an entry (they are added and removed together).
            if let Some(e) = self.entries.remove(&key) {
                self.key_of.remove(&e.block);
                pool.release(e.block)?;
                freed += 1;
            }
        }
        Ok(freed)
    }

    /// Enters `blocks[i]` (held by a sequence, every position computed) under `keys[i]`,
    /// referenced by that sequence. A key already cached (another sequence computed the same
    /// block) keeps its block; the sequence's copy stays its own. Returns how many were
    /// entered.
    pub fn insert(&mut self, keys: &[BlockKey], blocks: &[BlockId]) -> usize {
        let mut added = 0;
        for (k, &b) in keys.iter().zip(blocks) {
            if self.entries.contains_key(k) || self.key_of.contains_key(&b) {
                continue;
            }
            self.entries.insert(
                *k,
                Entry {
                    block: b,
                    refs: 1,
                    idle_since: 0,
                },
            );
            self.key_of.insert(b, *k);
            added += 1;
        }
        added
    }

    /// Gives back a sequence's blocks: a cached one loses a reference (idle at none: the
    /// table's last block becomes the first to be given up), any other returns to the pool.
    /// The table is emptied.
    pub fn release_table(&mut self, pool: &mut PagedKvCache, table: &mut BlockTable) -> Result<()> {
        let blocks = std::mem::take(table);
        let mut first_err = None;
        for &b in blocks.blocks().iter().rev() {
            match self.key_of.get(&b).and_then(|k| self.entries.get_mut(k)) {
                Some(e) => {
                    e.refs = e.refs.saturating_sub(1);
                    if e.refs == 0 {
                        self.tick += 1;
                        e.idle_since = self.tick;
                        self.idle.insert(self.tick, self.key_of[&b]);
                    }
                }
                None => {
                    if let Err(e) = pool.release(b) {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    fn key(i: u8) -> BlockKey {
        BlockKey::from_bytes([i; 16])
    }

    fn pool(n: usize) -> PagedKvCache {
        PagedKvCache::new(ModelConfig::default().kv_layout().unwrap(), n).unwrap()
    }

    /// A sequence's table of `n` fresh blocks.
    fn fresh(p: &mut PagedKvCache, n: usize) -> BlockTable {
        let mut t = BlockTable::new();
        p.reserve(&mut t, n * p.block_tokens()).unwrap();
        t
    }

    #[test]
    fn finished_blocks_stay_until_their_pages_are_needed() {
        let mut p = pool(6);
        let mut c = PrefixCache::new();
        let keys = [key(1), key(2), key(3)];
        let mut t = fresh(&mut p, 4);
        // Three full blocks entered, the fourth (partial) stays the sequence's own.
        assert_eq!(c.insert(&keys, &t.blocks()[..3]), 3);
        let ids = t.blocks()[..3].to_vec();
        c.release_table(&mut p, &mut t).unwrap();
        assert!(t.is_empty());
        assert_eq!(
            (c.cached_blocks(), c.idle_blocks(), p.free_blocks()),
            (3, 3, 3)
        );

        // The same prompt again: its blocks, in place.
        assert_eq!(c.hits(&keys), 3);
        assert_eq!(c.hits(&[key(1), key(9), key(3)]), 1);
        assert_eq!(c.available(&p, &keys[..2]), 3 + 1);
        let mut t = c.acquire(&keys[..2]);
        assert_eq!(t.blocks(), &ids[..2]);
        assert_eq!(c.idle_blocks(), 1);
        // Pressure: 5 free pages wanted, only block 3 (idle) can go; the used ones cannot.
        assert_eq!(c.make_room(&mut p, 5).unwrap(), 1);
        assert_eq!((p.free_blocks(), c.cached_blocks()), (4, 2));
        assert_eq!(c.hits(&keys), 2);
        c.release_table(&mut p, &mut t).unwrap();
        assert_eq!(c.make_room(&mut p, 6).unwrap(), 2);
        assert_eq!((p.free_blocks(), c.cached_blocks()), (6, 0));
    }

    #[test]
    fn the_tail_of_a_chain_and_the_oldest_chain_go_first() {
        let mut p = pool(8);
        let mut c = PrefixCache::new();
        let mut a = fresh(&mut p, 3);
        c.insert(&[key(1), key(2), key(3)], a.blocks());
        let mut b = fresh(&mut p, 2);
        c.insert(&[key(7), key(8)], b.blocks());
        c.release_table(&mut p, &mut a).unwrap();
        c.release_table(&mut p, &mut b).unwrap();
        assert_eq!(p.free_blocks(), 3);
        // One page more: the tail of the older chain.
        c.make_room(&mut p, 4).unwrap();
        assert_eq!(c.hits(&[key(1), key(2), key(3)]), 2);
        assert_eq!(c.hits(&[key(7), key(8)]), 2);
        // Using a chain makes it the most recent.
        let mut a = c.acquire(&[key(1), key(2)]);
        c.release_table(&mut p, &mut a).unwrap();
        c.make_room(&mut p, 6).unwrap();
        assert_eq!(c.hits(&[key(7), key(8)]), 0);
        assert_eq!(c.hits(&[key(1), key(2)]), 2);
    }

    #[test]
    fn a_key_computed_twice_keeps_one_block_and_frees_the_other() {
        let mut p = pool(4);
        let mut c = PrefixCache::new();
        let mut a = fresh(&mut p, 1);
        let mut b = fresh(&mut p, 1);
        assert_eq!(c.insert(&[key(1)], a.blocks()), 1);
        assert_eq!(c.insert(&[key(1)], b.blocks()), 0);
        // A shared block is referenced by both users.
        let mut a2 = c.acquire(&[key(1)]);
        c.release_table(&mut p, &mut a).unwrap();
        assert_eq!(c.idle_blocks(), 0);
        c.release_table(&mut p, &mut b).unwrap();
        assert_eq!(p.free_blocks(), 3, "the duplicate went back to the pool");
        c.release_table(&mut p, &mut a2).unwrap();
        assert_eq!((c.idle_blocks(), c.make_room(&mut p, 4).unwrap()), (1, 1));
    }
}

//! The sharded index: key -> [`Entry`] (the block's slot in each tier of the list), and
//! taking entries out of it.

use std::sync::MutexGuard;

use kvtier_core::BlockKey;

use crate::keyhash::KeyHashing;
use crate::tier::TierKind;

use super::slots::NONE;
use super::{Inner, lock};

/// The most tiers a store holds (HBM, DRAM, NVMe, and room for a remote tier). Sets the size
/// of every index entry: 16 key bytes + 4 per tier + 4 hit bytes.
pub(super) const MAX_TIERS: usize = 4;

/// Where one block lives: its slot in each tier position (`NONE` where absent).
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) loc: [u32; MAX_TIERS],
    /// Hits while there is no copy below the host tier (selective write-through).
    pub(super) hits: u32,
}

impl Entry {
    /// An entry holding only slot `slot` of tier `t`.
    pub(super) fn at(t: usize, slot: u32) -> Self {
        let mut loc = [NONE; MAX_TIERS];
        loc[t] = slot;
        Self { loc, hits: 0 }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.loc.iter().all(|&s| s == NONE)
    }

    /// The fastest tier holding the block, and its slot there.
    pub(super) fn fastest(&self) -> Option<(usize, u32)> {
        self.loc
            .iter()
            .enumerate()
            .find(|(_, s)| **s != NONE)
            .map(|(t, s)| (t, *s))
    }

    /// The (tier, slot) pairs holding the block, fastest first.
    pub(super) fn held(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.loc
            .iter()
            .enumerate()
            .filter(|(_, s)| **s != NONE)
            .map(|(t, s)| (t, *s))
    }
}

/// One shard of the index: key -> [`Entry`], hashed with the store's [`KeyHashing`]. A
/// hashbrown table rather than a `HashMap`, so a caller that has a key's hash already (the
/// lookup computes it to pick the shard) probes with it instead of hashing the key again.
pub(super) struct Shard {
    table: hashbrown::HashTable<(BlockKey, Entry)>,
    hashing: KeyHashing,
}

impl Shard {
    pub(super) fn with_capacity_and_hasher(capacity: usize, hashing: KeyHashing) -> Self {
        Self {
            table: hashbrown::HashTable::with_capacity(capacity),
            hashing,
        }
    }

    /// `key`'s entry, given `hash` = `KeyHashing::hash(key)`.
    pub(super) fn get_hashed(&self, hash: u64, key: &BlockKey) -> Option<&Entry> {
        self.table.find(hash, |(k, _)| k == key).map(|(_, e)| e)
    }

    pub(super) fn get(&self, key: &BlockKey) -> Option<&Entry> {
        self.get_hashed(self.hashing.hash(key), key)
    }

    pub(super) fn get_mut(&mut self, key: &BlockKey) -> Option<&mut Entry> {
        let hash = self.hashing.hash(key);
        self.table.find_mut(hash, |(k, _)| k == key).map(|(_, e)| e)
    }

    pub(super) fn contains_key(&self, key: &BlockKey) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key`'s entry; the one it replaces, if any.
    pub(super) fn insert(&mut self, key: BlockKey, entry: Entry) -> Option<Entry> {
        let hashing = &self.hashing;
        let hash = hashing.hash(&key);
        match self
            .table
            .entry(hash, |(k, _)| *k == key, |(k, _)| hashing.hash(k))
        {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                Some(std::mem::replace(&mut o.get_mut().1, entry))
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert((key, entry));
                None
            }
        }
    }

    /// `key`'s entry, inserting `entry` first if it has none.
    pub(super) fn get_or_insert(&mut self, key: BlockKey, entry: Entry) -> &mut Entry {
        let hashing = &self.hashing;
        let hash = hashing.hash(&key);
        &mut self
            .table
            .entry(hash, |(k, _)| *k == key, |(k, _)| hashing.hash(k))
            .or_insert((key, entry))
            .into_mut()
            .1
    }

    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let hash = self.hashing.hash(key);
        let found = self.table.find_entry(hash, |(k, _)| k == key).ok()?;
        Some(found.remove().0.1)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&BlockKey, &Entry)> {
        self.table.iter().map(|(k, e)| (k, e))
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.table.iter().map(|(k, _)| k)
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn capacity(&self) -> usize {
        self.table.capacity()
    }
}

impl Inner {
    pub(super) fn shard_index(&self, key: &BlockKey) -> usize {
        self.shard_of_hash(self.hashing.hash(key))
    }

    /// The shard of a key whose [`KeyHashing::hash`] is `hash`.
    pub(super) fn shard_of_hash(&self, hash: u64) -> usize {
        ((hash >> 40) & self.shard_mask) as usize
    }

    pub(super) fn shard(&self, key: &BlockKey) -> MutexGuard<'_, Shard> {
        // The high bits pick the shard; the map's buckets use the low ones.
        lock(&self.shards[self.shard_index(key)])
    }

    /// The fastest tier holding `key`.
    pub(super) fn locate(&self, key: BlockKey) -> Option<TierKind> {
        let shard = self.shard(&key);
        let (t, _) = shard.get(&key)?.fastest()?;
        Some(self.tiers[t].kind)
    }

    /// Takes `key` out of the index, pinning its slots under the shard lock so nothing can
    /// reuse them before they are retired (the remover is the only one who retires them).
    pub(super) fn take_entry(&self, shard: &mut Shard, key: &BlockKey) -> Option<Entry> {
        let e = shard.remove(key)?;
        for (t, s) in e.held() {
            self.pin_slot(t, s);
        }
        Some(e)
    }
}

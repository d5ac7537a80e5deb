//! The sharded index: key -> [`Entry`] (the block's slot in each tier of the list), and
//! taking entries out of it.

use std::collections::HashMap;
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

pub(super) type Shard = HashMap<BlockKey, Entry, KeyHashing>;

impl Inner {
    pub(super) fn shard_index(&self, key: &BlockKey) -> usize {
        ((self.hashing.hash(key) >> 40) & self.shard_mask) as usize
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

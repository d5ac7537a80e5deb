//! The sharded index: key -> [`Entry`] (the block's slot in each tier), and taking entries
//! out of it.

use crate::keyhash::KeyHashing;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::collections::HashMap;
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use super::Inner;
use super::lock;
use super::slots::NONE;

#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) dram: u32,
    pub(super) nvme: u32,
    pub(super) hits: u32,
}

impl Entry {
    pub(super) fn loc(&self, t: TierKind) -> u32 {
        match t {
            TierKind::Nvme => self.nvme,
            _ => self.dram,
        }
    }
    pub(super) fn set(&mut self, t: TierKind, v: u32) {
        match t {
            TierKind::Nvme => self.nvme = v,
            _ => self.dram = v,
        }
    }
    pub(super) fn is_empty(&self) -> bool {
        self.dram == NONE && self.nvme == NONE
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

    pub(super) fn locate(&self, key: BlockKey) -> Option<TierKind> {
        let shard = self.shard(&key);
        let e = shard.get(&key)?;
        if e.dram != NONE {
            Some(TierKind::Dram)
        } else if e.nvme != NONE {
            Some(TierKind::Nvme)
        } else {
            None
        }
    }

    /// Takes `key` out of the index, pinning its slots under the shard lock so nothing can
    /// reuse them before they are retired (the remover is the only one who retires them).
    pub(super) fn take_entry(&self, shard: &mut Shard, key: &BlockKey) -> Option<Entry> {
        let e = shard.remove(key)?;
        if e.dram != NONE {
            self.dram.pins[e.dram as usize].fetch_add(1, Ordering::AcqRel);
        }
        if let (Some(n), true) = (&self.nvme, e.nvme != NONE) {
            n.pins[e.nvme as usize].fetch_add(1, Ordering::AcqRel);
        }
        Some(e)
    }
}

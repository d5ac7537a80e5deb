//! Store events for subscribers (KV-aware routers) and the snapshot that resyncs them.

use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;

use super::Inner;
use super::lock;
use super::slots::NONE;

/// A change in where a block lives, for subscribers (KV-aware routers). Emitted after the
/// index changed; a sink sees them in the order they happened for any one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreEvent {
    pub kind: StoreEventKind,
    /// The tier gained or lost (DRAM for `Cleared`).
    pub tier: TierKind,
    pub key: BlockKey,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreEventKind {
    /// The block is now held by the tier.
    Stored,
    /// The block left the tier (evicted, removed, or dropped as corrupt).
    Removed,
    /// Every block left every tier (the key is zero).
    Cleared,
}

/// Receives [`StoreEvent`]s. Called with store locks held: it must be quick and must never
/// block or call back into the store.
pub type EventSink = Arc<dyn Fn(StoreEvent) + Send + Sync>;

/// A cached block in a [`super::TieredStore::snapshot`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub key: BlockKey,
    pub in_dram: bool,
    pub in_nvme: bool,
}

impl Inner {
    pub(super) fn emit(&self, kind: StoreEventKind, tier: TierKind, key: BlockKey) {
        if let Some(sink) = self.events.get() {
            sink(StoreEvent { kind, tier, key });
        }
    }

    pub(super) fn snapshot(&self) -> Vec<SnapshotEntry> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let g = lock(shard);
            out.extend(g.iter().map(|(k, e)| SnapshotEntry {
                key: *k,
                in_dram: e.dram != NONE,
                in_nvme: e.nvme != NONE,
            }));
        }
        out
    }
}

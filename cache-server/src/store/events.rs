//! Store events for subscribers (KV-aware routers) and the snapshot that resyncs them.

use std::sync::Arc;

use kvtier_core::BlockKey;

use crate::tier::TierKind;

use super::{Inner, lock};

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
    pub in_hbm: bool,
    pub in_dram: bool,
    pub in_nvme: bool,
}

impl SnapshotEntry {
    /// The tiers holding the block, fastest first.
    pub fn tiers(&self) -> impl Iterator<Item = TierKind> + use<> {
        [
            (self.in_hbm, TierKind::Hbm),
            (self.in_dram, TierKind::Dram),
            (self.in_nvme, TierKind::Nvme),
        ]
        .into_iter()
        .filter_map(|(has, t)| has.then_some(t))
    }
}

impl Inner {
    /// Tells the sink that `key` was stored in or removed from tier position `t`.
    pub(super) fn emit(&self, kind: StoreEventKind, t: usize, key: BlockKey) {
        self.emit_kind(kind, self.tiers[t].kind, key);
    }

    pub(super) fn emit_kind(&self, kind: StoreEventKind, tier: TierKind, key: BlockKey) {
        if let Some(sink) = self.events.get() {
            sink(StoreEvent { kind, tier, key });
        }
    }

    pub(super) fn snapshot(&self) -> Vec<SnapshotEntry> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let g = lock(shard);
            out.extend(g.iter().map(|(k, e)| {
                let mut s = SnapshotEntry {
                    key: *k,
                    in_hbm: false,
                    in_dram: false,
                    in_nvme: false,
                };
                for (t, _) in e.held() {
                    match self.tiers[t].kind {
                        TierKind::Hbm => s.in_hbm = true,
                        TierKind::Dram => s.in_dram = true,
                        TierKind::Nvme => s.in_nvme = true,
                    }
                }
                s
            }));
        }
        out
    }
}

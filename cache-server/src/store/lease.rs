//! Leases: pins with a deadline for local readers, and the reaper that releases expired
//! ones.

use crate::tier::SlotId;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use super::Inner;
use super::MissReason;
use super::lock;

/// How often expired leases are reaped.
pub const LEASE_REAP_INTERVAL: Duration = Duration::from_millis(100);

/// Blocks pinned in the DRAM arena for a reader, until released or the deadline passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub deadline: Instant,
    /// The longest cached prefix of the keys asked for, each pinned in DRAM.
    pub blocks: Vec<PinnedBlock>,
    /// Why the prefix stopped, when it is shorter than the keys asked for.
    pub miss: Option<MissReason>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedBlock {
    pub key: BlockKey,
    pub slot: SlotId,
    /// Byte offset in the DRAM arena (see [`super::TieredStore::dram`]).
    pub offset: u64,
    pub len: u64,
    /// Where the block was found (an NVMe block was promoted into DRAM to be pinned).
    pub found_in: TierKind,
}

pub(super) struct LeaseRecord {
    pub(super) deadline: Instant,
    pub(super) slots: Vec<u32>,
}

impl Inner {
    pub(super) fn pin(
        self: &Arc<Self>,
        keys: &[BlockKey],
        lease: Duration,
        may_block: bool,
    ) -> Option<Lease> {
        let deadline = Instant::now() + lease.min(self.config.max_lease);
        let (blocks, miss) = self.pin_prefix(keys, may_block)?;
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        if !blocks.is_empty() {
            let slots = blocks.iter().map(|b| b.slot.0).collect();
            lock(&self.leases).insert(id, LeaseRecord { deadline, slots });
        }
        Some(Lease {
            id,
            deadline,
            blocks,
            miss,
        })
    }

    pub(super) fn release_lease(self: &Arc<Self>, id: u64) -> bool {
        let Some(rec) = lock(&self.leases).remove(&id) else {
            return false;
        };
        for s in rec.slots {
            self.unpin(self.host, s);
        }
        true
    }

    pub(super) fn reap_leases(self: &Arc<Self>, now: Instant) -> usize {
        let expired: Vec<LeaseRecord> = {
            let mut leases = lock(&self.leases);
            let ids: Vec<u64> = leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| leases.remove(id)).collect()
        };
        for rec in &expired {
            for &s in &rec.slots {
                self.unpin(self.host, s);
            }
        }
        expired.len()
    }
}

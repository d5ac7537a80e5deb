//! Leases: pins with a deadline for local readers, and the reaper that releases expired
//! ones.

use crate::tier::SlotId;
use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Taken by a held lookup: its slots are held (counted in the tier's `held`, not
    /// pinned) and count against the hold budget.
    pub(super) hold: bool,
}

/// What a held lookup pinned ([`super::TieredStore::lookup_held`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupHold {
    /// The leading run of the prefix held in DRAM is pinned: `blocks` of them, until
    /// [`super::TieredStore::release`] of `lease_id` or the hold's deadline.
    Held { lease_id: u64, blocks: usize },
    /// Nothing to hold: no leading block in DRAM, or holds are off.
    Nothing,
    /// Holding would pass the hold budget: nothing is pinned (counted).
    OverBudget,
}

/// The hold budget (DRAM blocks all held lookups may pin together) and its counters.
pub(super) struct Holds {
    pub(super) max_blocks: u64,
    pub(super) blocks: AtomicU64,
    pub(super) taken: AtomicU64,
    pub(super) refused: AtomicU64,
}

impl Holds {
    pub(super) fn new(max_blocks: u64) -> Self {
        Self {
            max_blocks,
            blocks: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Counts `n` more held blocks; false (and nothing counted) past the budget.
    pub(super) fn try_take(&self, n: u64) -> bool {
        let prev = self.blocks.fetch_add(n, Ordering::AcqRel);
        if prev + n > self.max_blocks {
            self.blocks.fetch_sub(n, Ordering::AcqRel);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.taken.fetch_add(1, Ordering::Relaxed);
        true
    }
}

impl Inner {
    pub(super) fn pin(
        self: &Arc<Self>,
        keys: &[BlockKey],
        lease: Duration,
        may_block: bool,
    ) -> Option<Lease> {
        let (blocks, miss) = self.pin_prefix(keys, may_block)?;
        Some(self.file_lease(blocks, miss, lease))
    }

    /// Files `blocks` (pinned by the caller) as a lease of up to `lease` (capped by the
    /// configured maximum): from here the lease's release or deadline unpins them.
    pub(super) fn file_lease(
        self: &Arc<Self>,
        blocks: Vec<PinnedBlock>,
        miss: Option<MissReason>,
        lease: Duration,
    ) -> Lease {
        let deadline = Instant::now() + lease.min(self.config.max_lease);
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        if !blocks.is_empty() {
            let slots = blocks.iter().map(|b| b.slot.0).collect();
            lock(&self.leases).insert(
                id,
                LeaseRecord {
                    deadline,
                    slots,
                    hold: false,
                },
            );
        }
        Lease {
            id,
            deadline,
            blocks,
            miss,
        }
    }

    /// Files a held lookup's hold on `slots` of the host tier as a lease. The lookup has
    /// taken the budget and counted the hold on each slot already.
    pub(super) fn file_hold(self: &Arc<Self>, slots: Vec<u32>) -> LookupHold {
        let blocks = slots.len();
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + self.config.lookup_hold;
        lock(&self.leases).insert(
            id,
            LeaseRecord {
                deadline,
                slots,
                hold: true,
            },
        );
        LookupHold::Held {
            lease_id: id,
            blocks,
        }
    }

    fn unpin_lease(self: &Arc<Self>, rec: &LeaseRecord) {
        if rec.hold {
            // A hold counts on the slots under the tier's lock, and gives its budget back.
            let mut st = lock(&self.tiers[self.host].state);
            for &s in &rec.slots {
                st.held[s as usize] -= 1;
            }
            drop(st);
            self.holds
                .blocks
                .fetch_sub(rec.slots.len() as u64, Ordering::AcqRel);
            return;
        }
        for &s in &rec.slots {
            self.unpin(self.host, s);
        }
    }

    pub(super) fn release_lease(self: &Arc<Self>, id: u64) -> bool {
        let Some(rec) = lock(&self.leases).remove(&id) else {
            return false;
        };
        self.unpin_lease(&rec);
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
            self.unpin_lease(rec);
        }
        expired.len()
    }
}

//! The handles a caller holds: [`PinnedRead`] (blocks pinned while it lives) and
//! [`Reservation`] (a slot reserved for a block being filled in place).

use crate::error::StoreError;
use crate::tier::SlotId;
use kvtier_core::BlockKey;
use kvtier_core::protocol::block_sum;
use std::sync::Arc;

use super::Inner;
use super::MissReason;
use super::PutOutcome;
use super::lease::PinnedBlock;

/// Blocks pinned in DRAM for as long as this guard lives (see [`super::TieredStore::pin_read`]).
pub struct PinnedRead {
    pub(super) inner: Arc<Inner>,
    pub(super) blocks: Vec<PinnedBlock>,
    pub(super) miss: Option<MissReason>,
}

impl PinnedRead {
    pub fn blocks(&self) -> &[PinnedBlock] {
        &self.blocks
    }

    /// Why the prefix stopped, when it is shorter than the keys asked for.
    pub fn miss(&self) -> Option<MissReason> {
        self.miss
    }

    /// Each pinned block's sum over its key and bytes (`block_sum`, what a cluster peer's
    /// fetch is told), reusing the one the DRAM tier kept since the slot was last written and
    /// keeping the ones it computes; with how many it computed.
    pub fn sums(&self) -> (Vec<u64>, usize) {
        let dram = &self.inner.dram;
        let mut hashed = 0;
        let sums = (0..self.blocks.len())
            .map(|i| {
                let b = &self.blocks[i];
                dram.kept_sum(b.slot).unwrap_or_else(|| {
                    let s = block_sum(&b.key, self.bytes(i));
                    dram.keep_sum(b.slot, s);
                    hashed += 1;
                    s
                })
            })
            .collect();
        (sums, hashed)
    }

    /// [`PinnedRead::sums`] when every one was kept (nothing to hash), else `None`.
    pub fn kept_sums(&self) -> Option<Vec<u64>> {
        let dram = &self.inner.dram;
        self.blocks.iter().map(|b| dram.kept_sum(b.slot)).collect()
    }

    /// Hands the pins over to a lease of up to `lease` (as [`super::TieredStore::pin`]
    /// takes): released with [`super::TieredStore::release`] of its id or at its deadline,
    /// no longer when this guard goes.
    pub fn into_lease(mut self, lease: std::time::Duration) -> super::Lease {
        let blocks = std::mem::take(&mut self.blocks);
        self.inner.file_lease(blocks, self.miss, lease)
    }

    /// The bytes of the `i`-th pinned block, read in place.
    pub fn bytes(&self, i: usize) -> &[u8] {
        let b = &self.blocks[i];
        // SAFETY: the slot is pinned by this guard and was referenced by the index when it was
        // pinned, so it holds `b.key`'s committed bytes: a pinned slot is never reallocated,
        // and only the allocator of an unreferenced slot writes into it. The range is the
        // slot's own (checked by `slot_bytes`), inside the arena that `inner` keeps mapped.
        unsafe { self.inner.dram.slot_bytes_in_place(b.slot, b.len as usize) }
    }
}

impl Drop for PinnedRead {
    fn drop(&mut self) {
        for b in &self.blocks {
            self.inner.unpin(self.inner.host, b.slot.0);
        }
    }
}

impl std::fmt::Debug for PinnedRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRead")
            .field("blocks", &self.blocks)
            .field("miss", &self.miss)
            .finish()
    }
}

/// A DRAM slot reserved for one block (see [`super::TieredStore::reserve`]). Fill it, then
/// [`Reservation::commit`]; dropping it uncommitted frees the slot.
pub struct Reservation {
    pub(super) inner: Arc<Inner>,
    pub(super) key: BlockKey,
    pub(super) parent: Option<BlockKey>,
    pub(super) slot: u32,
    pub(super) open: bool,
}

impl Reservation {
    pub fn key(&self) -> BlockKey {
        self.key
    }

    /// Byte offset of the reserved slot in the DRAM arena.
    pub fn offset(&self) -> u64 {
        self.inner.dram.slot_offset(SlotId(self.slot))
    }

    /// The reserved slot's memory (one block long), to fill in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the slot was allocated to this reservation (pinned, referenced by no key),
        // so no reader or other writer in this process touches it until commit or drop, and
        // `&mut self` makes this the only live slice. The range is the slot's own.
        unsafe {
            self.inner
                .dram
                .slot_bytes_in_place_mut(SlotId(self.slot), self.inner.block_bytes)
        }
    }

    /// Publishes the block. `AlreadyPresent` if someone stored the key meanwhile, `Rejected`
    /// if its parent was evicted meanwhile; the slot is freed in both cases.
    pub fn commit(mut self) -> Result<PutOutcome, StoreError> {
        self.open = false;
        // Indexed (or refused) first, then no longer pending: a waiting reader never sees
        // the key neither cached nor pending while it is being committed.
        let r = self.inner.commit(self.key, self.parent, self.slot);
        self.inner.pending.remove(&self.key);
        r
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.open {
            self.inner.pending.remove(&self.key);
            self.inner.retire(self.inner.host, self.slot, false);
            self.inner.unpin(self.inner.host, self.slot);
        }
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("key", &self.key)
            .field("slot", &self.slot)
            .finish()
    }
}

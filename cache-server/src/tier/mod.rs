//! Tiers: fixed-slot block devices. A tier stores at most one block per slot and knows nothing
//! of policy; the store ([`crate::store::TieredStore`]) decides which key goes into which slot.
//!
//! Every implementation passes the same conformance suite (`kvtier_testkit::tier`, run by
//! cache-server/tests/tiers.rs).

use std::fmt;
use std::path::PathBuf;

use kvtier_core::BlockKey;
use thiserror::Error;

pub mod dram;
#[cfg(feature = "cuda")]
pub mod hbm;
pub mod nvme;
pub mod published;
mod slot_lock;

pub use dram::{DramTier, DramTierConfig};
#[cfg(feature = "cuda")]
pub use hbm::{HbmTier, HbmTierConfig};
pub use nvme::{NvmeOpenReport, NvmeTier, NvmeTierConfig};

/// Which tier a block lives in, fastest first.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    Hbm,
    Dram,
    Nvme,
}

impl TierKind {
    pub const ALL: [TierKind; 3] = [TierKind::Hbm, TierKind::Dram, TierKind::Nvme];

    pub fn name(self) -> &'static str {
        match self {
            TierKind::Hbm => "hbm",
            TierKind::Dram => "dram",
            TierKind::Nvme => "nvme",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Index of a slot inside one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

impl SlotId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A block found in a persistent tier when it was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecoveredSlot {
    pub slot: SlotId,
    pub key: BlockKey,
    pub len: u32,
    /// Write order within the tier (higher is newer), for rebuilding recency.
    pub generation: u64,
    /// The block's parent, when it was written with one.
    pub parent: Option<BlockKey>,
}

/// Errors of one tier operation. `Mismatch` and `Corrupt` are misses to the caller; only
/// `Corrupt` means the stored data was damaged.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("slot {slot} is out of range: the tier has {slots} slots")]
    SlotOutOfRange { slot: SlotId, slots: u32 },
    #[error("a {len}-byte block does not fit a {slot_bytes}-byte slot")]
    TooLarge { len: usize, slot_bytes: usize },
    #[error("slot {slot} does not hold the requested block ({reason})")]
    Mismatch { slot: SlotId, reason: &'static str },
    #[error("slot {slot} is corrupt ({reason})")]
    Corrupt { slot: SlotId, reason: &'static str },
    #[error("slot {slot} is in use by another operation")]
    Busy { slot: SlotId },
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid tier configuration: {setting}: {reason}")]
    Config {
        setting: &'static str,
        reason: String,
    },
    #[error("tier unavailable: {reason}")]
    Unavailable { reason: String },
}

impl TierError {
    /// True for errors that mean "the block is not (validly) there": the caller reports a miss.
    pub fn is_miss(&self) -> bool {
        matches!(self, TierError::Mismatch { .. } | TierError::Corrupt { .. })
    }
}

/// A tier: `slot_count` slots of `slot_bytes` each.
///
/// Thread safety: all methods take `&self` and may be called from many threads. Operations on
/// different slots run in parallel; conflicting operations on one slot are refused with
/// [`TierError::Busy`] (never torn), so callers that own a slot (the store does) never see it.
pub trait Tier: Send + Sync {
    fn kind(&self) -> TierKind;

    /// Payload capacity of one slot, in bytes.
    fn slot_bytes(&self) -> usize;

    fn slot_count(&self) -> u32;

    /// Whether blocks survive a restart (see [`Tier::recover`]).
    fn is_persistent(&self) -> bool;

    /// Stores `data` as block `key` in `slot`, replacing what was there.
    fn write(&self, slot: SlotId, key: BlockKey, data: &[u8]) -> Result<(), TierError>;

    /// Reads block `key` from `slot` into `buf`, whose length must be the block's length.
    /// A slot holding another key or length is a `Mismatch`; damaged data is `Corrupt`.
    /// On error `buf` may have been overwritten but must not be used.
    fn read(&self, slot: SlotId, key: BlockKey, buf: &mut [u8]) -> Result<(), TierError>;

    /// Forgets the block in `slot` (a persistent tier makes sure it is not recovered).
    fn erase(&self, slot: SlotId) -> Result<(), TierError>;

    /// Forgets every block at once (a persistent tier also forgets them across restarts).
    fn clear_all(&self) -> Result<(), TierError>;

    /// The valid blocks found when the tier was opened (empty for volatile tiers). When a key
    /// was found in several slots only the newest is returned; the others are erased lazily.
    fn recover(&self) -> Vec<RecoveredSlot>;

    /// [`Tier::write`] recording the block's chain parent, where the tier keeps one (NVMe
    /// headers do, so leaf-first eviction survives a restart). Default: [`Tier::write`].
    fn write_linked(
        &self,
        slot: SlotId,
        key: BlockKey,
        parent: Option<BlockKey>,
        data: &[u8],
    ) -> Result<(), TierError> {
        let _ = parent;
        self.write(slot, key, data)
    }

    /// In-place access, for a tier whose slots are host memory ([`InPlaceTier`]); `None`
    /// for a tier reached only through copies (NVMe files, HBM device memory). Default: None.
    fn in_place(&self) -> Option<&dyn InPlaceTier> {
        None
    }

    /// Checks `slot` and `len` against the tier's geometry.
    fn check(&self, slot: SlotId, len: usize) -> Result<(), TierError> {
        if slot.0 >= self.slot_count() {
            return Err(TierError::SlotOutOfRange {
                slot,
                slots: self.slot_count(),
            });
        }
        if len > self.slot_bytes() {
            return Err(TierError::TooLarge {
                len,
                slot_bytes: self.slot_bytes(),
            });
        }
        Ok(())
    }
}

/// A tier whose slots are host memory, filled and read in place without a bounce buffer
/// (DRAM). The store copies between tiers through it when one side offers it, and serves the
/// local zero-copy path from the one tier of its list that is DRAM.
pub trait InPlaceTier: Tier {
    /// Fills `slot` in place: `fill` gets the slot's first `len` bytes, and the block becomes
    /// readable as `key` only if it returns `Ok` (its error is returned as is).
    fn fill_in_place(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<(), TierError>,
    ) -> Result<(), TierError>;

    /// Lends the `len` bytes of block `key` in `slot` to `f` without copying them; a slot
    /// holding another key or length is a `Mismatch`.
    fn read_in_place(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        f: &mut dyn FnMut(&[u8]) -> Result<(), TierError>,
    ) -> Result<(), TierError>;

    /// Byte offset of `slot` in the tier's memory (as a local client maps it).
    fn slot_offset(&self, slot: SlotId) -> u64;
}

//! A test double of device memory for the HBM position of the store's tier list: slots on the
//! heap reached only by copy-in and copy-out (no in-place access), like the real HBM tier.
//! Test code only; the store takes it through `HbmSettings::device_memory`.

use std::sync::{Arc, Mutex, TryLockError};

use kvtier_core::BlockKey;
use kvtier_server::tier::{RecoveredSlot, SlotId, Tier, TierError, TierKind};
use kvtier_server::{DeviceMemory, HbmSettings};

/// What one slot holds: the block's key and bytes.
type Held = Option<(BlockKey, Vec<u8>)>;

pub struct HeapDevice {
    slot_bytes: usize,
    slots: Box<[Mutex<Held>]>,
}

impl HeapDevice {
    pub fn new(capacity_bytes: u64, slot_bytes: usize) -> Result<Self, TierError> {
        let n = capacity_bytes / slot_bytes.max(1) as u64;
        if slot_bytes == 0 || n == 0 || n > u64::from(u32::MAX) {
            return Err(TierError::Config {
                setting: "hbm.capacity_bytes",
                reason: format!("{capacity_bytes} bytes in {slot_bytes}-byte slots"),
            });
        }
        Ok(Self {
            slot_bytes,
            slots: (0..n).map(|_| Mutex::new(None)).collect(),
        })
    }

    fn slot(&self, slot: SlotId) -> Result<std::sync::MutexGuard<'_, Held>, TierError> {
        match self.slots[slot.index()].try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(TierError::Busy { slot }),
        }
    }
}

impl Tier for HeapDevice {
    fn kind(&self) -> TierKind {
        TierKind::Hbm
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slots.len() as u32
    }

    fn is_persistent(&self) -> bool {
        false
    }

    fn write(&self, slot: SlotId, key: BlockKey, data: &[u8]) -> Result<(), TierError> {
        self.check(slot, data.len())?;
        *self.slot(slot)? = Some((key, data.to_vec()));
        Ok(())
    }

    fn read(&self, slot: SlotId, key: BlockKey, buf: &mut [u8]) -> Result<(), TierError> {
        self.check(slot, buf.len())?;
        let g = self.slot(slot)?;
        match &*g {
            Some((k, d)) if *k == key && d.len() == buf.len() => {
                buf.copy_from_slice(d);
                Ok(())
            }
            Some((k, _)) if *k == key => Err(TierError::Mismatch {
                slot,
                reason: "length",
            }),
            Some(_) => Err(TierError::Mismatch {
                slot,
                reason: "key",
            }),
            None => Err(TierError::Mismatch {
                slot,
                reason: "empty",
            }),
        }
    }

    fn erase(&self, slot: SlotId) -> Result<(), TierError> {
        self.check(slot, 0)?;
        *self.slot(slot)? = None;
        Ok(())
    }

    fn clear_all(&self) -> Result<(), TierError> {
        (0..self.slot_count()).try_for_each(|s| self.erase(SlotId(s)))
    }

    fn recover(&self) -> Vec<RecoveredSlot> {
        Vec::new()
    }
}

/// Whether the HBM position uses the real CUDA tier: built with `cuda` and a device present.
pub fn real_gpu() -> bool {
    #[cfg(feature = "cuda")]
    {
        kvtier_server::tier::hbm::probe().is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// HBM settings of `blocks` blocks: the real device where there is one (see [`real_gpu`]),
/// else [`HeapDevice`].
pub fn hbm(blocks: u64) -> HbmSettings {
    let mut h = HbmSettings::new(blocks * super::BLOCK as u64);
    if !real_gpu() {
        let open: DeviceMemory = Arc::new(|bytes, slot_bytes| {
            Ok(Box::new(HeapDevice::new(bytes, slot_bytes)?) as Box<dyn Tier>)
        });
        h.device_memory = Some(open);
    }
    h
}

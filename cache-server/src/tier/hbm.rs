//! The HBM tier: one device allocation cut into fixed slots, filled and read with synchronous
//! host<->device copies through the CUDA driver API (cudarc, dynamically loaded, so the crate
//! builds and runs on machines without CUDA; there the tier reports itself unavailable).
//!
//! Verification status: compiled and linted in CI; the conformance test runs only where a GPU
//! is present (see `docs/architecture.md` for where it last ran).

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};
use kvtier_core::BlockKey;

use super::slot_lock::SlotTable;
use super::{RecoveredSlot, SlotId, Tier, TierError, TierKind};

/// Builds an [`HbmTier`].
#[derive(Clone, Debug)]
pub struct HbmTierConfig {
    device: usize,
    capacity_bytes: u64,
    slot_bytes: usize,
}

impl HbmTierConfig {
    /// `capacity_bytes` of device memory on GPU `device` (default 0), in `slot_bytes` slots.
    pub fn new(capacity_bytes: u64, slot_bytes: usize) -> Self {
        Self {
            device: 0,
            capacity_bytes,
            slot_bytes,
        }
    }

    /// CUDA device ordinal. Default: 0.
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = ordinal;
        self
    }

    pub fn open(&self) -> Result<HbmTier, TierError> {
        HbmTier::open(self)
    }
}

/// See the module documentation.
pub struct HbmTier {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    slot_bytes: usize,
    slots: u32,
    meta: SlotTable,
}

fn unavailable(reason: impl Into<String>) -> TierError {
    TierError::Unavailable {
        reason: reason.into(),
    }
}

/// Whether a CUDA driver and at least one device are present; the reason when not.
pub fn probe() -> Result<usize, TierError> {
    // SAFETY: only checks whether the driver library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("no CUDA driver (libcuda) on this machine"));
    }
    result::init().map_err(|e| unavailable(format!("CUDA driver init failed: {e}")))?;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(unavailable("no CUDA device")),
        Err(e) => Err(unavailable(format!("cannot count CUDA devices: {e}"))),
    }
}

impl HbmTier {
    pub fn open(config: &HbmTierConfig) -> Result<Self, TierError> {
        if config.slot_bytes == 0 {
            return Err(TierError::Config {
                setting: "hbm slot_bytes",
                reason: "must be above zero".into(),
            });
        }
        let slots = config.capacity_bytes / config.slot_bytes as u64;
        let slots = u32::try_from(slots)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| TierError::Config {
                setting: "hbm.capacity_bytes",
                reason: format!(
                    "{} bytes must hold between 1 and 2^32 slots of {} bytes",
                    config.capacity_bytes, config.slot_bytes
                ),
            })?;
        let devices = probe()?;
        if config.device >= devices {
            return Err(TierError::Config {
                setting: "hbm.device",
                reason: format!("device {} requested, {devices} present", config.device),
            });
        }
        let ctx = CudaContext::new(config.device)
            .map_err(|e| unavailable(format!("cannot create a CUDA context: {e}")))?;
        let bytes = slots as usize * config.slot_bytes;
        // SAFETY: the context is current on this thread (CudaContext::new binds it); the
        // allocation is freed exactly once, in Drop.
        let base = unsafe { result::malloc_sync(bytes) }.map_err(|e| TierError::Config {
            setting: "hbm.capacity_bytes",
            reason: format!("cannot allocate {bytes} bytes of device memory: {e}"),
        })?;
        Ok(Self {
            ctx,
            base,
            slot_bytes: config.slot_bytes,
            slots,
            meta: SlotTable::new(slots),
        })
    }

    fn addr(&self, slot: SlotId) -> sys::CUdeviceptr {
        self.base + (slot.index() * self.slot_bytes) as sys::CUdeviceptr
    }

    fn bind(&self) -> Result<(), TierError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| unavailable(format!("cannot bind the CUDA context: {e}")))
    }
}

impl Drop for HbmTier {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: `base` came from malloc_sync in this context and is freed only here.
            let _ = unsafe { result::free_sync(self.base) };
        }
    }
}

// SAFETY: the device pointer is plain data; all access goes through the driver API with the
// per-slot locks of `meta` excluding conflicting copies.
unsafe impl Send for HbmTier {}
// SAFETY: as above.
unsafe impl Sync for HbmTier {}

impl Tier for HbmTier {
    fn kind(&self) -> TierKind {
        TierKind::Hbm
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slots
    }

    fn is_persistent(&self) -> bool {
        false
    }

    fn write(&self, slot: SlotId, key: BlockKey, data: &[u8]) -> Result<(), TierError> {
        self.check(slot, data.len())?;
        let w = self.meta.write(slot)?;
        self.bind()?;
        // SAFETY: [addr, addr + len) lies inside our allocation (checked above), and the slot's
        // write lock excludes every other copy into or out of it.
        unsafe { result::memcpy_htod_sync(self.addr(slot), data) }
            .map_err(|e| unavailable(format!("host-to-device copy failed: {e}")))?;
        w.commit(key, data.len());
        Ok(())
    }

    fn read(&self, slot: SlotId, key: BlockKey, buf: &mut [u8]) -> Result<(), TierError> {
        self.check(slot, buf.len())?;
        let _r = self.meta.read(slot, key, buf.len())?;
        self.bind()?;
        // SAFETY: in bounds as in `write`; the read lock excludes writers of this slot.
        unsafe { result::memcpy_dtoh_sync(buf, self.addr(slot)) }
            .map_err(|e| unavailable(format!("device-to-host copy failed: {e}")))
    }

    fn erase(&self, slot: SlotId) -> Result<(), TierError> {
        self.check(slot, 0)?;
        self.meta.erase(slot)
    }

    fn clear_all(&self) -> Result<(), TierError> {
        (0..self.slots).try_for_each(|s| self.erase(SlotId(s)))
    }

    fn recover(&self) -> Vec<RecoveredSlot> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store with this tier at the head of its list ([hbm, dram]): a DRAM hit is promoted
    /// into device memory and then served from it with its bytes, and a block held only there
    /// is copied down into DRAM for a pin. Without a GPU: opening is refused with the reason.
    #[test]
    fn store_with_hbm_on_a_gpu_or_a_clear_refusal() {
        use crate::{GetOutcome, HbmSettings, StoreConfig, TieredStore};
        use kvtier_core::{Dtype, KvLayout};
        let layout = KvLayout::new(1, 4, 16, Dtype::F16, 16).unwrap();
        let n = layout.block_bytes() as usize;
        let mut c = StoreConfig::new(layout, 2 * n as u64).with_hbm(HbmSettings::new(4 * n as u64));
        c.dram_prefault = false;
        c.io_threads = 2;
        let opened = TieredStore::open(c);
        let Ok(_) = probe() else {
            assert!(
                std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
                "KVTIER_REQUIRE_GPU is set but there is no usable GPU"
            );
            let e = opened.err().expect("hbm opened without a GPU");
            eprintln!("store with HBM NOT run: {e}");
            assert!(e.to_string().contains("CUDA"), "{e}");
            return;
        };
        let (s, _) = opened.unwrap();
        let key = |i: u128| BlockKey::from_u128(i * 0x9E37_79B9 + 1);
        let bytes = |k: BlockKey| kvtier_testkit::block::block_bytes(k, n);
        let mut buf = vec![0u8; n];
        s.put(key(1), None, &bytes(key(1))).unwrap();
        assert_eq!(
            s.get(&key(1), &mut buf).unwrap(),
            GetOutcome::Hit(TierKind::Dram)
        );
        s.flush();
        buf.fill(0);
        assert_eq!(
            s.get(&key(1), &mut buf).unwrap(),
            GetOutcome::Hit(TierKind::Hbm)
        );
        assert!(buf == bytes(key(1)), "wrong bytes from HBM");
        // Push it out of DRAM; a pin copies it back down from device memory.
        for i in 2..5 {
            s.put(key(i), None, &bytes(key(i))).unwrap();
        }
        s.flush();
        let r = s.pin_read(&[key(1)]);
        assert_eq!(r.blocks()[0].found_in, TierKind::Hbm);
        assert!(
            r.bytes(0) == bytes(key(1)).as_slice(),
            "wrong bytes copied down"
        );
        drop(r);
        s.check_consistency().unwrap();
    }

    #[test]
    fn bad_geometry_is_a_config_error_before_touching_the_driver() {
        let e = HbmTierConfig::new(100, 4096).open().err().unwrap();
        assert!(e.to_string().contains("hbm.capacity_bytes"), "{e}");
        let e = HbmTierConfig::new(100, 0).open().err().unwrap();
        assert!(e.to_string().contains("hbm slot_bytes"), "{e}");
    }
}

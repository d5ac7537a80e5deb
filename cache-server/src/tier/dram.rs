//! The DRAM tier: one pre-allocated arena of fixed-size slots in a memfd.
//!
//! The arena is a memfd so the server can hand its file descriptor to a local client, which
//! maps it and reads or writes slots in place (the zero-copy local path). Slot `i` lives at
//! byte offset `i * slot_bytes`; `slot_bytes` is a multiple of the page size, so every slot is
//! page aligned (and so usable as an O_DIRECT buffer). Nothing is allocated per block.

use kvtier_core::BlockKey;
use memmap2::MmapRaw;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};

use super::slot_lock::SlotTable;
use super::{InPlaceTier, RecoveredSlot, SlotId, Tier, TierError, TierKind};

/// Slot sizes are rounded to this; it is also the alignment O_DIRECT needs.
pub const PAGE_BYTES: usize = 4096;

/// Builds a [`DramTier`].
#[derive(Clone, Debug)]
pub struct DramTierConfig {
    capacity_bytes: u64,
    slot_bytes: usize,
    prefault: bool,
}

impl DramTierConfig {
    /// `capacity_bytes` is a hard ceiling: the arena holds `capacity_bytes / slot_bytes` slots.
    /// `slot_bytes` is rounded up to a multiple of 4,096.
    pub fn new(capacity_bytes: u64, slot_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            slot_bytes,
            prefault: true,
        }
    }

    /// Reserve the arena's memory when the tier opens, so a machine that cannot hold it fails
    /// at start and not under load. Default: true.
    pub fn prefault(mut self, on: bool) -> Self {
        self.prefault = on;
        self
    }

    pub fn open(&self) -> Result<DramTier, TierError> {
        DramTier::open(self)
    }
}

/// See the module documentation.
pub struct DramTier {
    file: File,
    map: MmapRaw,
    slot_bytes: usize,
    slots: u32,
    meta: SlotTable,
}

fn config_err(setting: &'static str, reason: impl Into<String>) -> TierError {
    TierError::Config {
        setting,
        reason: reason.into(),
    }
}

impl DramTier {
    pub fn open(config: &DramTierConfig) -> Result<Self, TierError> {
        if config.slot_bytes == 0 {
            return Err(config_err("dram slot_bytes", "must be above zero"));
        }
        let slot_bytes = config.slot_bytes.next_multiple_of(PAGE_BYTES);
        if config.capacity_bytes == 0 {
            return Err(config_err("dram.capacity_bytes", "must be above zero"));
        }
        let slots = config.capacity_bytes / slot_bytes as u64;
        if slots == 0 {
            return Err(config_err(
                "dram.capacity_bytes",
                format!(
                    "{} bytes cannot hold one {slot_bytes}-byte slot",
                    config.capacity_bytes
                ),
            ));
        }
        let slots = u32::try_from(slots)
            .map_err(|_| config_err("dram.capacity_bytes", "more than 2^32 slots"))?;
        let arena_bytes = u64::from(slots) * slot_bytes as u64;
        let io = |source| TierError::Io {
            path: "memfd:kvtier-dram".into(),
            source,
        };
        // Sealing allowed: the transfer library seals the arena's size when it registers it
        // for shared-memory peers (a peer's mapping can then never be truncated under it).
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"kvtier-dram".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(arena_bytes).map_err(io)?;
        if config.prefault {
            let len = libc::off_t::try_from(arena_bytes)
                .map_err(|_| config_err("dram.capacity_bytes", "too large"))?;
            // SAFETY: plain syscall on a descriptor we own.
            let rc = unsafe { libc::fallocate(fd, 0, 0, len) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                return Err(config_err(
                    "dram.capacity_bytes",
                    format!("cannot reserve {arena_bytes} bytes of shared memory: {e}"),
                ));
            }
        }
        let map = MmapRaw::map_raw(&file).map_err(io)?;
        let meta = SlotTable::new(slots);
        Ok(Self {
            file,
            map,
            slot_bytes,
            slots,
            meta,
        })
    }

    /// The arena's file descriptor, for a local client to map.
    pub fn arena_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Size of the arena, always at most the configured capacity.
    pub fn arena_bytes(&self) -> u64 {
        u64::from(self.slots) * self.slot_bytes as u64
    }

    /// Byte offset of `slot` inside the arena.
    pub fn slot_offset(&self, slot: SlotId) -> u64 {
        u64::from(slot.0) * self.slot_bytes as u64
    }

    /// Fills `slot` in place: `fill` gets the slot's first `len` bytes (page aligned) and the
    /// block becomes readable as `key` only if it returns `Ok`.
    pub fn write_with<E>(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, TierError> {
        self.check(slot, len)?;
        let w = self.meta.write(slot)?;
        // SAFETY: the slot's range [offset, offset + len) lies inside the mapping (checked
        // above: slot < slots and len <= slot_bytes), and the write guard makes this the only
        // reference into that range in this process until it is dropped.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_mut_ptr().add(self.slot_offset(slot) as usize),
                len,
            )
        };
        let r = fill(buf);
        if r.is_ok() {
            w.commit(key, len);
        }
        Ok(r)
    }

    /// The first `len` bytes of `slot`, in place, with no slot lock.
    ///
    /// # Safety
    /// The caller guarantees that nobody writes the slot while the slice lives (the store
    /// holds a pin on a committed slot, which it never reallocates).
    ///
    /// # Panics
    /// If `slot` or `len` is out of range.
    pub(crate) unsafe fn slot_bytes_in_place(&self, slot: SlotId, len: usize) -> &[u8] {
        assert!(slot.0 < self.slots && len <= self.slot_bytes, "slot range");
        // SAFETY: in bounds (asserted); the caller excludes writers.
        unsafe {
            std::slice::from_raw_parts(
                self.map.as_mut_ptr().add(self.slot_offset(slot) as usize),
                len,
            )
        }
    }

    /// The first `len` bytes of `slot`, in place and writable, with no slot lock.
    ///
    /// # Safety
    /// The caller guarantees exclusive access to the slot while the slice lives (the store
    /// allocated it to one reservation and no key references it).
    ///
    /// # Panics
    /// If `slot` or `len` is out of range.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slot_bytes_in_place_mut(&self, slot: SlotId, len: usize) -> &mut [u8] {
        assert!(slot.0 < self.slots && len <= self.slot_bytes, "slot range");
        // SAFETY: in bounds (asserted); the caller guarantees exclusivity.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_mut_ptr().add(self.slot_offset(slot) as usize),
                len,
            )
        }
    }

    /// Lends the bytes of block `key` in `slot` to `f` without copying them.
    pub fn read_with<R>(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TierError> {
        self.check(slot, len)?;
        let _r = self.meta.read(slot, key, len)?;
        // SAFETY: in bounds as in `write_with`; the read guard excludes writers of this slot in
        // this process, so the bytes are not mutated while the shared slice lives.
        let buf = unsafe {
            std::slice::from_raw_parts(
                self.map.as_mut_ptr().add(self.slot_offset(slot) as usize),
                len,
            )
        };
        Ok(f(buf))
    }
}

impl Tier for DramTier {
    fn in_place(&self) -> Option<&dyn InPlaceTier> {
        Some(self)
    }

    fn kind(&self) -> TierKind {
        TierKind::Dram
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
        self.write_with(slot, key, data.len(), |buf| {
            buf.copy_from_slice(data);
            Ok::<(), std::convert::Infallible>(())
        })
        .map(|_| ())
    }

    fn read(&self, slot: SlotId, key: BlockKey, buf: &mut [u8]) -> Result<(), TierError> {
        self.read_with(slot, key, buf.len(), |src| buf.copy_from_slice(src))
    }

    fn erase(&self, slot: SlotId) -> Result<(), TierError> {
        self.check(slot, 0)?;
        self.meta.erase(slot)
    }

    fn clear_all(&self) -> Result<(), TierError> {
        for slot in 0..self.slots {
            self.erase(SlotId(slot))?;
        }
        Ok(())
    }

    fn recover(&self) -> Vec<RecoveredSlot> {
        Vec::new()
    }
}

impl InPlaceTier for DramTier {
    fn fill_in_place(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<(), TierError>,
    ) -> Result<(), TierError> {
        self.write_with(slot, key, len, fill)?
    }

    fn read_in_place(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
        f: &mut dyn FnMut(&[u8]) -> Result<(), TierError>,
    ) -> Result<(), TierError> {
        self.read_with(slot, key, len, f)?
    }

    fn slot_offset(&self, slot: SlotId) -> u64 {
        DramTier::slot_offset(self, slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn never_more_than_capacity_and_slots_page_aligned() {
        let t = DramTierConfig::new(100_000, 5000).open().unwrap();
        assert_eq!(t.slot_bytes(), 8192);
        assert_eq!(t.slot_count(), 12);
        assert!(t.arena_bytes() <= 100_000);
        let fd_len = std::fs::File::from(t.arena_fd().try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .len();
        assert_eq!(fd_len, t.arena_bytes());
        // Sealable (for the transfer library's shared-memory registration).
        // SAFETY: fcntl F_GET_SEALS on a descriptor we own; it only reads.
        let seals = unsafe { libc::fcntl(t.arena_fd().as_raw_fd(), libc::F_GET_SEALS) };
        assert!(
            seals >= 0 && seals & libc::F_SEAL_SEAL == 0,
            "seals {seals:#x}"
        );
        assert_eq!(t.slot_offset(SlotId(3)), 3 * 8192);
    }

    #[test]
    fn bad_config_names_the_setting() {
        for (cap, slot, setting) in [
            (0, 4096, "dram.capacity_bytes"),
            (1000, 4096, "dram.capacity_bytes"),
            (4096, 0, "dram slot_bytes"),
        ] {
            let e = DramTierConfig::new(cap, slot).open().err().unwrap();
            assert!(e.to_string().contains(setting), "{e}");
        }
    }

    #[test]
    fn in_place_fill_that_fails_leaves_no_block() {
        let t = DramTierConfig::new(4 * 4096, 4096).open().unwrap();
        let k = BlockKey::from_u128(9);
        let r = t.write_with(SlotId(1), k, 10, |b| {
            b.fill(1);
            Err("disk said no")
        });
        assert_eq!(r.unwrap(), Err("disk said no"));
        assert!(t.read(SlotId(1), k, &mut [0u8; 10]).unwrap_err().is_miss());
    }
}

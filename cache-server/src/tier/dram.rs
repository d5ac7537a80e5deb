//! The DRAM tier: one pre-allocated arena of fixed-size slots in a memfd.
//!
//! The arena is a memfd so the server can hand a file descriptor of it to a local client,
//! which maps it and reads slots in place (the zero-copy local path). Slot `i` lives at
//! byte offset `i * slot_bytes`; `slot_bytes` is a multiple of the page size, so every slot is
//! page aligned (and so usable as an O_DIRECT buffer). Nothing is allocated per block.
//!
//! **Invariant:** only this process writes the arena. Once the tier has mapped it, the memfd
//! is sealed with `F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`: the
//! tier's own mapping keeps writing, but no `write`, writable shared `mmap` or hole punch can
//! reach it again through any descriptor (even one reopened read-write through `/proc`), and
//! its size can never change, so no mapping of it ever faults (SIGBUS). Clients get
//! [`DramTier::client_fd`], opened read-only on top of that.

use kvtier_core::BlockKey;
use memmap2::MmapRaw;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::published::Published;
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
    /// The same memfd opened read-only: what clients are given.
    read_only: File,
    map: MmapRaw,
    slot_bytes: usize,
    slots: u32,
    meta: SlotTable,
    /// The slot table local clients read blocks through without a message.
    published: Published,
    /// Each slot's block sum (XXH3-64 over key and bytes, what a cluster peer's fetch is
    /// told), kept once computed and forgotten at the start of every write into the slot and
    /// at its erase: see [`DramTier::kept_sum`].
    sums: Box<[AtomicU64]>,
    sum_kept: Box<[AtomicBool]>,
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
        // Sealing allowed: sealed below, once mapped, so that clients cannot write or resize it.
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
        seal_read_only(&file).map_err(|e| {
            config_err(
                "dram.capacity_bytes",
                format!("cannot seal the arena memfd (F_SEAL_FUTURE_WRITE needs Linux 5.1): {e}"),
            )
        })?;
        // A new open file description of the same memfd, read-only (not a `dup`, which would
        // share the read-write mode).
        let read_only = File::open(format!("/proc/self/fd/{fd}")).map_err(|e| TierError::Io {
            path: format!("/proc/self/fd/{fd} (the arena, reopened read-only)").into(),
            source: e,
        })?;
        let meta = SlotTable::new(slots);
        let published = Published::create(slots, config.slot_bytes as u64, slot_bytes as u64)
            .map_err(|e| TierError::Io {
                path: "memfd:kvtier-slots".into(),
                source: e,
            })?;
        Ok(Self {
            published,
            sums: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            sum_kept: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            file,
            read_only,
            map,
            slot_bytes,
            slots,
            meta,
        })
    }

    /// The arena's read-write file descriptor (sealed: it can no longer be used to write,
    /// map writable or resize; only the tier's own mapping writes).
    pub fn arena_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// A read-only file descriptor of the arena, for a local client to map (shared,
    /// `PROT_READ`): it cannot be mapped writable, written, truncated or hole-punched.
    pub fn client_fd(&self) -> BorrowedFd<'_> {
        self.read_only.as_fd()
    }

    /// The published slot table (see [`Published`]).
    pub fn published(&self) -> &Published {
        &self.published
    }

    /// Size of the arena, always at most the configured capacity.
    pub fn arena_bytes(&self) -> u64 {
        u64::from(self.slots) * self.slot_bytes as u64
    }

    /// The arena's first byte in this process (the tier's own, writable mapping; mapped as
    /// long as the tier lives). Its bytes follow the tier's rules: a slot is written only by
    /// its allocator, a pinned or referenced slot never.
    pub(crate) fn arena_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Byte offset of `slot` inside the arena.
    pub fn slot_offset(&self, slot: SlotId) -> u64 {
        u64::from(slot.0) * self.slot_bytes as u64
    }

    /// The sum kept for the block in `slot`, if one was kept since the slot was last written.
    /// The caller holds a pin on the committed slot, so no write starts meanwhile: a sum kept
    /// under an earlier pin of the same committed block is this block's.
    pub(crate) fn kept_sum(&self, slot: SlotId) -> Option<u64> {
        let i = slot.0 as usize;
        self.sum_kept[i]
            .load(Ordering::Acquire)
            .then(|| self.sums[i].load(Ordering::Relaxed))
    }

    /// Keeps `sum` for the block in `slot`, which the caller computed from the slot's bytes
    /// while holding a pin on it (so before any later write forgets it).
    pub(crate) fn keep_sum(&self, slot: SlotId, sum: u64) {
        let i = slot.0 as usize;
        self.sums[i].store(sum, Ordering::Relaxed);
        self.sum_kept[i].store(true, Ordering::Release);
    }

    fn forget_sum(&self, slot: SlotId) {
        if let Some(k) = self.sum_kept.get(slot.0 as usize) {
            k.store(false, Ordering::Release);
        }
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
        // A slot being written is never readable in place, and its kept sum is stale.
        self.published.unpublish(slot);
        self.forget_sum(slot);
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
        self.published.unpublish(slot);
        self.forget_sum(slot);
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

/// Seals `file` (a memfd created with `MFD_ALLOW_SEALING`) against writes through any new
/// descriptor or mapping, resizing, and further seals. Mappings made before keep writing.
pub(super) fn seal_read_only(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let seals =
        libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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
        self.published.unpublish(slot);
        self.forget_sum(slot);
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
        // Sealed for good: no writes through new descriptors or mappings, no resizing.
        // SAFETY: fcntl F_GET_SEALS on a descriptor we own; it only reads.
        let seals = unsafe { libc::fcntl(t.arena_fd().as_raw_fd(), libc::F_GET_SEALS) };
        let want =
            libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        assert_eq!(seals & want, want, "seals {seals:#x}");
        assert_eq!(t.slot_offset(SlotId(3)), 3 * 8192);
    }

    /// What a hostile local client could try with the descriptor it is given (and with the
    /// same memfd reopened read-write through /proc): every attempt is refused, and the
    /// tier's own mapping still writes, and reads back, its blocks.
    #[test]
    fn clients_cannot_write_punch_or_resize_the_arena() {
        let t = DramTierConfig::new(4 * 4096, 4096).open().unwrap();
        let k = BlockKey::from_u128(5);
        t.write(SlotId(0), k, &[7u8; 4096]).unwrap();
        let ro = File::from(t.client_fd().try_clone_to_owned().unwrap());
        let reopened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", t.client_fd().as_raw_fd()))
            .unwrap();
        for (what, f) in [("read-only fd", &ro), ("reopened read-write", &reopened)] {
            assert!(
                memmap2::MmapOptions::new().len(4096).map_raw(f).is_err(),
                "{what}: a writable shared mapping"
            );
            assert!(f.set_len(0).is_err(), "{what}: ftruncate to 0");
            assert!(f.set_len(1 << 20).is_err(), "{what}: growing");
            assert!(
                std::os::unix::fs::FileExt::write_at(f, &[1], 0).is_err(),
                "{what}: write"
            );
            // SAFETY: fallocate on a descriptor we own; it is expected to fail.
            let punch = unsafe {
                libc::fallocate(
                    f.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    4096,
                )
            };
            assert_ne!(punch, 0, "{what}: punching a hole");
            // SAFETY: fcntl with an integer argument; expected to fail (F_SEAL_SEAL).
            let unseal =
                unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
            assert!(unseal < 0, "{what}: adding a seal");
        }
        // A read-only shared mapping works and sees the tier's bytes.
        let map = memmap2::MmapOptions::new()
            .len(4096)
            .map_raw_read_only(&ro)
            .unwrap();
        let mut got = [0u8; 4096];
        // SAFETY: the mapping is 4096 bytes long and nothing writes slot 0 during the copy.
        unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), got.as_mut_ptr(), 4096) };
        assert_eq!(got, [7u8; 4096]);
        // The tier still writes through its own mapping.
        t.write(SlotId(0), k, &[9u8; 4096]).unwrap();
        let mut back = [0u8; 4096];
        t.read(SlotId(0), k, &mut back).unwrap();
        assert_eq!(back, [9u8; 4096]);
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

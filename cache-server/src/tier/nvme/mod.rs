//! The NVMe tier: files cut into fixed slots, each a 4 KiB header sector followed by the
//! payload, written and read with direct I/O from aligned buffers.
//!
//! * Slot `i` lives in file `i / slots_per_file` at offset `(i % slots_per_file) * stride`,
//!   where `stride = 4096 + slot_bytes`.
//! * Header and payload go down in one vectored write; the header carries the payload's
//!   checksum, so a torn write (a crash mid-write) reads back as corrupt, never as a block.
//! * At open the index is rebuilt from the headers, so a restart keeps the cache warm; a
//!   manifest records the format version, layout fingerprint and geometry, and any mismatch
//!   starts the tier cold and says why. `clear_all` bumps the manifest's epoch, which retires
//!   every header written before it in O(1).
//! * The tier is synchronous; the store runs it on its bounded I/O pool, never on an async
//!   runtime's threads. Byte tables: `docs/nvme-format.md`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_core::BlockKey;

pub mod file;
pub mod format;

use file::{ALIGN, AlignedBuf, BufferPool, SlotFile, is_aligned, read_all_at, write_all_at};
use format::{FORMAT_VERSION, HEADER_BYTES, HeaderError, Manifest, SlotHeader, payload_checksum};

use super::slot_lock::SlotLock;
use super::{RecoveredSlot, SlotId, Tier, TierError, TierKind};

const MANIFEST_FILE: &str = "manifest";
const LOCK_FILE: &str = "lock";
/// Aligned bounce buffers kept for unaligned callers; more are allocated (and freed) on demand.
const BOUNCE_BUFFERS: usize = 4;
const HEADER_BUFFERS: usize = 32;

/// Builds an [`NvmeTier`].
#[derive(Clone, Debug)]
pub struct NvmeTierConfig {
    dir: PathBuf,
    capacity_bytes: u64,
    slot_bytes: u64,
    layout_fingerprint: u64,
    file_bytes: u64,
    direct_io: bool,
}

/// What opening the tier found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvmeOpenReport {
    /// Valid blocks found in the slot headers.
    pub recovered: usize,
    /// Why existing data was discarded, when it was.
    pub cold_start: Option<String>,
    /// Whether O_DIRECT is in use (false after a fallback).
    pub direct_io: bool,
    /// Headers that were damaged or of another epoch or layout (their slots are free).
    pub invalid_headers: usize,
    /// Older copies of a key found in a second slot, erased.
    pub duplicates_erased: usize,
}

impl NvmeTierConfig {
    /// A tier under `dir` holding at most `capacity_bytes` of slot files (headers included),
    /// with `slot_bytes` of payload per slot (a multiple of 4,096), for blocks of the layout
    /// whose fingerprint is `layout_fingerprint`.
    pub fn new(
        dir: impl Into<PathBuf>,
        capacity_bytes: u64,
        slot_bytes: u64,
        layout_fingerprint: u64,
    ) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            slot_bytes,
            layout_fingerprint,
            file_bytes: 1 << 30,
            direct_io: true,
        }
    }

    /// Largest slot file; the tier uses as many as it needs. Default: 1 GiB.
    pub fn file_bytes(mut self, bytes: u64) -> Self {
        self.file_bytes = bytes;
        self
    }

    /// Open files with O_DIRECT (falling back, with a warning, where the file system refuses
    /// it). Default: true.
    pub fn direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn open(&self) -> Result<(NvmeTier, NvmeOpenReport), TierError> {
        NvmeTier::open_with(self, &|f, _| Arc::new(f))
    }
}

/// Wraps each opened slot file; the identity for production, a fault injector in tests.
pub type FileWrapper = dyn Fn(File, &Path) -> Arc<dyn SlotFile>;

struct Slots {
    file: Arc<dyn SlotFile>,
    path: PathBuf,
}

/// See the module documentation.
pub struct NvmeTier {
    dir: PathBuf,
    files: Vec<Slots>,
    slot_bytes: usize,
    stride: u64,
    slots: u32,
    slots_per_file: u64,
    layout_fingerprint: u64,
    direct: bool,
    generation: AtomicU64,
    epoch: AtomicU64,
    manifest: std::sync::Mutex<Manifest>,
    locks: Box<[SlotLock]>,
    headers: BufferPool,
    bounce: BufferPool,
    zero_header: AlignedBuf,
    recovered: Vec<RecoveredSlot>,
    _lock_file: File,
}

fn config_err(setting: &'static str, reason: impl Into<String>) -> TierError {
    TierError::Config {
        setting,
        reason: reason.into(),
    }
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> TierError + '_ {
    move |source| TierError::Io {
        path: path.to_owned(),
        source,
    }
}

fn slot_file_name(i: u64) -> String {
    format!("slots-{i:05}.kvt")
}

impl NvmeTier {
    /// Opens (creating or recovering) the tier, wrapping each slot file with `wrap`.
    pub fn open_with(
        config: &NvmeTierConfig,
        wrap: &FileWrapper,
    ) -> Result<(Self, NvmeOpenReport), TierError> {
        if config.slot_bytes == 0 || !config.slot_bytes.is_multiple_of(ALIGN as u64) {
            return Err(config_err(
                "nvme.slot_bytes",
                format!("{} is not a non-zero multiple of 4096", config.slot_bytes),
            ));
        }
        let stride = HEADER_BYTES as u64 + config.slot_bytes;
        if config.capacity_bytes == 0 {
            return Err(config_err("nvme.capacity_bytes", "must be above zero"));
        }
        let slots = config.capacity_bytes / stride;
        if slots == 0 {
            return Err(config_err(
                "nvme.capacity_bytes",
                format!(
                    "{} bytes cannot hold one slot of {stride} bytes (4 KiB header + payload)",
                    config.capacity_bytes
                ),
            ));
        }
        let slots = u32::try_from(slots)
            .map_err(|_| config_err("nvme.capacity_bytes", "more than 2^32 slots"))?;
        let slot_bytes = usize::try_from(config.slot_bytes)
            .map_err(|_| config_err("nvme.slot_bytes", "too large"))?;
        let dir = config.dir.clone();
        fs::create_dir_all(&dir)
            .map_err(|e| config_err("nvme.dir", format!("cannot create {}: {e}", dir.display())))?;
        make_private(&dir)?;
        let lock_file = lock_dir(&dir)?;

        let mut report = NvmeOpenReport::default();
        let slots_per_file = (config.file_bytes / stride).max(1);
        let old = read_manifest(&dir);
        let on_disk = old.as_ref().ok().cloned().flatten();
        let mut epoch = 1;
        match old {
            Ok(None) => {}
            Ok(Some(m)) => {
                epoch = m.epoch.saturating_add(1).max(1);
                let mismatch = if m.format_version != FORMAT_VERSION {
                    Some(format!(
                        "format_version {} on disk, this build writes {FORMAT_VERSION}",
                        m.format_version
                    ))
                } else if m.layout_fingerprint != config.layout_fingerprint {
                    Some(format!(
                        "layout_fingerprint {:#x} on disk differs from the configured layout's {:#x}",
                        m.layout_fingerprint, config.layout_fingerprint
                    ))
                } else if m.slot_bytes != config.slot_bytes {
                    Some(format!(
                        "slot_bytes {} on disk differs from the configured {}",
                        m.slot_bytes, config.slot_bytes
                    ))
                } else if m.slots_per_file != slots_per_file {
                    Some(format!(
                        "slots_per_file {} on disk differs from {slots_per_file} (file_bytes changed)",
                        m.slots_per_file
                    ))
                } else {
                    epoch = m.epoch;
                    None
                };
                report.cold_start = mismatch;
            }
            Err(why) => report.cold_start = Some(format!("manifest unreadable: {why}")),
        }
        if let Some(why) = &report.cold_start {
            tracing::warn!(dir = %dir.display(), "NVMe tier starts cold: {why}");
        }

        // Slot files: the ones needed, sized; stale ones (cold start or capacity shrink) removed.
        let nfiles = u64::from(slots).div_ceil(slots_per_file);
        let mut targets = Vec::new();
        let mut extra_bytes = 0u64;
        for i in 0..nfiles {
            let in_file = slots_per_file.min(u64::from(slots) - i * slots_per_file);
            let path = dir.join(slot_file_name(i));
            let have = match (&report.cold_start, fs::metadata(&path)) {
                (None, Ok(m)) => m.len(),
                _ => 0,
            };
            extra_bytes += (in_file * stride).saturating_sub(have);
            targets.push((path, in_file * stride));
        }
        remove_stale_files(
            &dir,
            if report.cold_start.is_some() {
                0
            } else {
                nfiles
            },
        )?;
        let avail = available_bytes(&dir)?;
        if extra_bytes > avail {
            return Err(config_err(
                "nvme.capacity_bytes",
                format!(
                    "{} needs {extra_bytes} more bytes but the file system has {avail} free",
                    dir.display()
                ),
            ));
        }

        let mut direct = config.direct_io;
        let mut files = Vec::with_capacity(targets.len());
        for (path, len) in &targets {
            let (f, d) = open_slot_file(path, direct)?;
            direct = d;
            allocate(&f, *len, path)?;
            files.push(Slots {
                file: wrap(f, path),
                path: path.clone(),
            });
        }
        if config.direct_io && !direct {
            tracing::warn!(
                dir = %dir.display(),
                "the file system refuses O_DIRECT; the NVMe tier uses buffered I/O (page cache)"
            );
        }
        report.direct_io = direct;

        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            layout_fingerprint: config.layout_fingerprint,
            slot_bytes: config.slot_bytes,
            slots_per_file,
            epoch,
        };
        // Unchanged (a warm restart): not rewritten, so a restart on a full disk still
        // serves what is there.
        if on_disk.as_ref() != Some(&manifest) {
            write_manifest(&dir, &manifest)?;
        }

        let mut tier = Self {
            dir,
            files,
            slot_bytes,
            stride,
            slots,
            slots_per_file,
            layout_fingerprint: config.layout_fingerprint,
            direct,
            generation: AtomicU64::new(1),
            epoch: AtomicU64::new(epoch),
            manifest: std::sync::Mutex::new(manifest),
            locks: (0..slots).map(|_| SlotLock::default()).collect(),
            headers: BufferPool::new(HEADER_BYTES, HEADER_BUFFERS),
            bounce: BufferPool::new(stride as usize, BOUNCE_BUFFERS),
            zero_header: AlignedBuf::new(HEADER_BYTES),
            recovered: Vec::new(),
            _lock_file: lock_file,
        };
        if report.cold_start.is_none() {
            tier.scan(&mut report);
        }
        Ok((tier, report))
    }

    /// The directory holding the slot files and manifest.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether O_DIRECT is in use.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    fn locate(&self, slot: SlotId) -> (&Slots, u64) {
        let s = u64::from(slot.0);
        let f = &self.files[(s / self.slots_per_file) as usize];
        (f, (s % self.slots_per_file) * self.stride)
    }

    /// Rebuilds the recovered list from the headers: valid, current-epoch, same-layout headers
    /// only; the newest copy of a key wins and older ones are erased.
    fn scan(&mut self, report: &mut NvmeOpenReport) {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut best: std::collections::HashMap<BlockKey, (u64, RecoveredSlot)> =
            std::collections::HashMap::new();
        let mut losers = Vec::new();
        let mut hb = AlignedBuf::new(HEADER_BYTES);
        let mut max_gen = 0;
        for i in 0..self.slots {
            let slot = SlotId(i);
            let (f, off) = self.locate(slot);
            if read_all_at(&*f.file, &mut [IoSliceMut::new(&mut hb)], off).is_err() {
                report.invalid_headers += 1;
                continue;
            }
            let h = match SlotHeader::decode(&hb) {
                Ok(h) => h,
                Err(HeaderError::Empty) => continue,
                Err(_) => {
                    report.invalid_headers += 1;
                    continue;
                }
            };
            if h.epoch != epoch
                || h.layout_fingerprint != self.layout_fingerprint
                || h.payload_len > self.slot_bytes as u64
            {
                report.invalid_headers += 1;
                continue;
            }
            max_gen = max_gen.max(h.generation);
            // payload_len <= slot_bytes, which fits a u32-addressed slot (checked above).
            let r = RecoveredSlot {
                slot,
                key: h.key,
                len: h.payload_len as u32,
                generation: h.generation,
                parent: h.parent,
            };
            match best.get(&h.key) {
                Some((g, _)) if *g >= h.generation => losers.push(slot),
                Some((_, old)) => {
                    losers.push(old.slot);
                    best.insert(h.key, (h.generation, r));
                }
                None => {
                    best.insert(h.key, (h.generation, r));
                }
            }
        }
        for slot in losers {
            if self.erase(slot).is_ok() {
                report.duplicates_erased += 1;
            }
        }
        self.generation
            .store(max_gen.saturating_add(1), Ordering::Relaxed);
        let mut found: Vec<RecoveredSlot> = best.into_values().map(|(_, r)| r).collect();
        found.sort_by_key(|r| r.slot);
        report.recovered = found.len();
        self.recovered = found;
    }

    fn header_for(&self, key: BlockKey, parent: Option<BlockKey>, data: &[u8]) -> SlotHeader {
        SlotHeader {
            parent,
            key,
            payload_len: data.len() as u64,
            payload_checksum: payload_checksum(data),
            generation: self.generation.fetch_add(1, Ordering::Relaxed),
            epoch: self.epoch.load(Ordering::Acquire),
            layout_fingerprint: self.layout_fingerprint,
        }
    }

    /// Checks a header read back from `slot` against what the caller expects.
    fn verify(
        &self,
        slot: SlotId,
        key: BlockKey,
        hb: &[u8],
        payload: &[u8],
    ) -> Result<(), TierError> {
        let h = match SlotHeader::decode(hb) {
            Ok(h) => h,
            Err(HeaderError::Empty) => {
                return Err(TierError::Mismatch {
                    slot,
                    reason: "empty slot",
                });
            }
            Err(HeaderError::OtherVersion) => {
                return Err(TierError::Corrupt {
                    slot,
                    reason: "header of another format version",
                });
            }
            Err(_) => {
                return Err(TierError::Corrupt {
                    slot,
                    reason: "header damaged",
                });
            }
        };
        if h.key != key {
            return Err(TierError::Mismatch {
                slot,
                reason: "another key",
            });
        }
        if h.epoch != self.epoch.load(Ordering::Acquire) {
            return Err(TierError::Mismatch {
                slot,
                reason: "cleared",
            });
        }
        if h.payload_len != payload.len() as u64 {
            return Err(TierError::Mismatch {
                slot,
                reason: "another length",
            });
        }
        if h.layout_fingerprint != self.layout_fingerprint {
            return Err(TierError::Corrupt {
                slot,
                reason: "another layout",
            });
        }
        if payload_checksum(payload) != h.payload_checksum {
            return Err(TierError::Corrupt {
                slot,
                reason: "payload checksum mismatch",
            });
        }
        Ok(())
    }

    /// [`Tier::write`], also recording the block's parent in its header so the chain link
    /// survives a restart ([`RecoveredSlot::parent`]).
    pub fn write_linked(
        &self,
        slot: SlotId,
        key: BlockKey,
        parent: Option<BlockKey>,
        data: &[u8],
    ) -> Result<(), TierError> {
        self.check(slot, data.len())?;
        let _w = self.locks[slot.index()]
            .write()
            .ok_or(TierError::Busy { slot })?;
        let header = self.header_for(key, parent, data);
        let (f, off) = self.locate(slot);
        let r = if !self.direct || is_aligned(data) {
            let (mut hb, _) = self.headers.take();
            header.encode(&mut hb);
            let r = write_all_at(&*f.file, &mut [IoSlice::new(&hb), IoSlice::new(data)], off);
            self.headers.give(hb);
            r
        } else {
            let (mut bb, _) = self.bounce.take();
            let end = HEADER_BYTES + data.len().next_multiple_of(ALIGN);
            bb[..HEADER_BYTES].fill(0);
            header.encode(&mut bb);
            bb[HEADER_BYTES..HEADER_BYTES + data.len()].copy_from_slice(data);
            bb[HEADER_BYTES + data.len()..end].fill(0);
            let r = write_all_at(&*f.file, &mut [IoSlice::new(&bb[..end])], off);
            self.bounce.give(bb);
            r
        };
        r.map_err(|e| {
            // Best effort: a half-written header must not look valid at the next start (the
            // payload checksum would catch it anyway).
            let _ = write_all_at(&*f.file, &mut [IoSlice::new(&self.zero_header)], off);
            io_err(&f.path)(e)
        })
    }

    fn read_err(&self, slot: SlotId, path: &Path, e: io::Error) -> TierError {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            TierError::Corrupt {
                slot,
                reason: "slot file truncated",
            }
        } else {
            io_err(path)(e)
        }
    }
}

impl Tier for NvmeTier {
    fn kind(&self) -> TierKind {
        TierKind::Nvme
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> u32 {
        self.slots
    }

    fn is_persistent(&self) -> bool {
        true
    }

    fn write(&self, slot: SlotId, key: BlockKey, data: &[u8]) -> Result<(), TierError> {
        self.write_linked(slot, key, None, data)
    }

    fn write_linked(
        &self,
        slot: SlotId,
        key: BlockKey,
        parent: Option<BlockKey>,
        data: &[u8],
    ) -> Result<(), TierError> {
        NvmeTier::write_linked(self, slot, key, parent, data)
    }

    fn read(&self, slot: SlotId, key: BlockKey, buf: &mut [u8]) -> Result<(), TierError> {
        self.check(slot, buf.len())?;
        let _r = self.locks[slot.index()]
            .read()
            .ok_or(TierError::Busy { slot })?;
        let (f, off) = self.locate(slot);
        if !self.direct || is_aligned(buf) {
            let (mut hb, _) = self.headers.take();
            let r = read_all_at(
                &*f.file,
                &mut [IoSliceMut::new(&mut hb), IoSliceMut::new(buf)],
                off,
            )
            .map_err(|e| self.read_err(slot, &f.path, e))
            .and_then(|()| self.verify(slot, key, &hb, buf));
            self.headers.give(hb);
            r
        } else {
            let (mut bb, _) = self.bounce.take();
            let end = HEADER_BYTES + buf.len().next_multiple_of(ALIGN);
            let r = read_all_at(&*f.file, &mut [IoSliceMut::new(&mut bb[..end])], off)
                .map_err(|e| self.read_err(slot, &f.path, e))
                .and_then(|()| {
                    let (hb, payload) = bb.split_at(HEADER_BYTES);
                    self.verify(slot, key, hb, &payload[..buf.len()])
                });
            if r.is_ok() {
                buf.copy_from_slice(&bb[HEADER_BYTES..HEADER_BYTES + buf.len()]);
            }
            self.bounce.give(bb);
            r
        }
    }

    fn erase(&self, slot: SlotId) -> Result<(), TierError> {
        self.check(slot, 0)?;
        let _w = self.locks[slot.index()]
            .write()
            .ok_or(TierError::Busy { slot })?;
        let (f, off) = self.locate(slot);
        write_all_at(&*f.file, &mut [IoSlice::new(&self.zero_header)], off).map_err(io_err(&f.path))
    }

    fn clear_all(&self) -> Result<(), TierError> {
        let mut m = self.manifest.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = m.clone();
        next.epoch = next.epoch.saturating_add(1);
        write_manifest(&self.dir, &next)?;
        *m = next;
        self.epoch.store(m.epoch, Ordering::Release);
        Ok(())
    }

    fn recover(&self) -> Vec<RecoveredSlot> {
        self.recovered.clone()
    }
}

/// Mode of the tier's files (slot files, manifest, lock file): the server's user only.
const PRIVATE_FILE_MODE: u32 = 0o600;
/// Mode of the tier's directory.
const PRIVATE_DIR_MODE: u32 = 0o700;

/// Makes `dir` and the files in it private to the server's user (0700 and 0600), tightening
/// (with a log line) what an older version or another tool left readable by others. Files
/// created later are created 0600.
fn make_private(dir: &Path) -> Result<(), TierError> {
    let tighten = |path: &Path, want: u32| -> Result<(), TierError> {
        let meta = fs::symlink_metadata(path).map_err(io_err(path))?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            fs::set_permissions(path, fs::Permissions::from_mode(want)).map_err(io_err(path))?;
            tracing::warn!(
                path = %path.display(),
                "tightened mode {mode:o} to {want:o}: NVMe data is private to the server's user"
            );
        }
        Ok(())
    };
    tighten(dir, PRIVATE_DIR_MODE)?;
    for e in fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
        let name = e.file_name();
        let ours = slot_file_index(&name).is_some()
            || [MANIFEST_FILE, LOCK_FILE].iter().any(|n| {
                name.to_str()
                    .is_some_and(|s| s == *n || s == format!("{n}.tmp"))
            });
        if ours && e.file_type().is_ok_and(|t| t.is_file()) {
            tighten(&e.path(), PRIVATE_FILE_MODE)?;
        }
    }
    Ok(())
}

fn lock_dir(dir: &Path) -> Result<File, TierError> {
    let path = dir.join(LOCK_FILE);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(PRIVATE_FILE_MODE)
        .open(&path)
        .map_err(|e| {
            config_err(
                "nvme.dir",
                format!("{} is not writable: {e}", dir.display()),
            )
        })?;
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(config_err(
            "nvme.dir",
            format!("{} is in use by another kvtier process", dir.display()),
        ));
    }
    Ok(f)
}

fn read_manifest(dir: &Path) -> Result<Option<Manifest>, String> {
    match fs::read(dir.join(MANIFEST_FILE)) {
        Ok(bytes) => {
            let text = String::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
            Manifest::decode(&text).map(Some)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Writes the manifest atomically: a temporary file, fsync, rename, fsync of the directory.
fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), TierError> {
    let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
    let run = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(PRIVATE_FILE_MODE)
            .open(&tmp)?;
        // An existing temporary file keeps its mode at open: set it.
        f.set_permissions(fs::Permissions::from_mode(PRIVATE_FILE_MODE))?;
        f.write_all(m.encode().as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, dir.join(MANIFEST_FILE))?;
        File::open(dir)?.sync_all()
    };
    run().map_err(io_err(&tmp))
}

/// The index of a slot file named as [`slot_file_name`] makes them.
fn slot_file_index(name: &std::ffi::OsStr) -> Option<u64> {
    name.to_str()
        .and_then(|n| n.strip_prefix("slots-"))
        .and_then(|n| n.strip_suffix(".kvt"))
        .and_then(|n| n.parse::<u64>().ok())
}

/// Disk space the tier's slot files in `dir` hold now (0 if there are none or `dir` is
/// unreadable). Sizing the tier from the file system's free space must count these as free:
/// otherwise every restart would see the tier's own files as used and shrink it.
pub fn slot_files_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| slot_file_index(&e.file_name()).is_some())
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        // Allocated bytes, not the length: a sparse file holds no more than it has written.
        .map(|m| m.blocks().saturating_mul(512))
        .sum()
}

fn remove_stale_files(dir: &Path, keep: u64) -> Result<(), TierError> {
    let entries = fs::read_dir(dir).map_err(io_err(dir))?;
    for e in entries.flatten() {
        let Some(index) = slot_file_index(&e.file_name()) else {
            continue;
        };
        if index >= keep {
            fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
        }
    }
    Ok(())
}

/// Bytes an unprivileged writer may still allocate on the file system holding `dir`.
pub fn available_bytes(dir: &Path) -> Result<u64, TierError> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| config_err("nvme.dir", "path contains a NUL byte"))?;
    // SAFETY: statvfs fills the zeroed struct we pass; `c` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err(dir)(io::Error::last_os_error()));
    }
    #[allow(clippy::useless_conversion)] // f_bavail is u32 on some targets
    Ok(u64::from(st.f_bavail).saturating_mul(st.f_frsize))
}

/// Opens a slot file, with O_DIRECT when asked and possible. Returns whether it is direct.
fn open_slot_file(path: &Path, direct: bool) -> Result<(File, bool), TierError> {
    let open = |flags| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(PRIVATE_FILE_MODE)
            .custom_flags(flags)
            .open(path)
    };
    if direct {
        match open(libc::O_DIRECT) {
            Ok(f) if probe_direct(&f) => return Ok((f, true)),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(open_err(path, e)),
        }
    }
    open(0).map(|f| (f, false)).map_err(|e| open_err(path, e))
}

fn open_err(path: &Path, e: io::Error) -> TierError {
    config_err("nvme.dir", format!("cannot open {}: {e}", path.display()))
}

/// Some file systems accept O_DIRECT at open and refuse it at the first I/O.
fn probe_direct(f: &File) -> bool {
    let mut b = AlignedBuf::new(ALIGN);
    !matches!(
        f.read_vectored_at(&mut [IoSliceMut::new(&mut b)], 0),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL)
    )
}

fn allocate(f: &File, len: u64, path: &Path) -> Result<(), TierError> {
    let have = f.metadata().map_err(io_err(path))?.len();
    if have > len {
        f.set_len(len).map_err(io_err(path))?;
        return Ok(());
    }
    let l =
        libc::off_t::try_from(len).map_err(|_| config_err("nvme.capacity_bytes", "too large"))?;
    // SAFETY: plain syscall on a descriptor we own.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, l) };
    match rc {
        0 => Ok(()),
        libc::ENOSPC => Err(config_err(
            "nvme.capacity_bytes",
            format!(
                "the file system cannot hold {len} bytes for {}",
                path.display()
            ),
        )),
        // File systems without fallocate: size the file sparsely instead.
        libc::EOPNOTSUPP | libc::EINVAL => f.set_len(len).map_err(io_err(path)),
        e => Err(io_err(path)(io::Error::from_raw_os_error(e))),
    }
}

#[cfg(test)]
mod tests;

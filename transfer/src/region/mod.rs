//! Registered memory regions.
//!
//! A region is a contiguous range of memory an agent lets peers read and write: DRAM the agent
//! allocates (always memfd-backed, so a same-host peer can map it), an existing memfd (for
//! example a server's arena), a file mapped shared, GPU memory (feature `cuda`), or foreign
//! memory registered with [`Agent::register_raw`](crate::Agent::register_raw).
//!
//! **Invariant:** a region's memory stays mapped while anything refers to it: the registry,
//! the caller's [`RegionHandle`], and every in-flight transfer chunk hold an `Arc` to it.
//! Deregistration (dropping the handle) removes it from the registry at once, so new
//! descriptors naming it fail with `RegionNotFound`, and transfers in flight that touch it
//! fail with `RegionNotFound` at their next chunk; chunks already handed to a transport finish
//! against the still-mapped memory, which is unmapped when the last of them lets go.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::error::{Result, TransferError};

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

/// Checks `offset..offset+len` against a region of `region_len` bytes. `index` names the
/// descriptor (in the caller's list) for the error.
pub(crate) fn check_range(
    index: usize,
    side: &str,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    if len == 0 {
        return Err(TransferError::InvalidDescriptor {
            index,
            reason: "zero length".into(),
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransferError::InvalidDescriptor {
            index,
            reason: format!("{side} range {offset}+{len} exceeds the region's {region_len} bytes"),
        }),
    }
}

/// A region's identifier, unique within its agent and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a region's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemKind {
    /// Host memory (anonymous memfd, an existing memfd, or foreign memory).
    Dram,
    /// A file mapped shared.
    File,
    /// GPU device memory (feature `cuda`).
    Gpu,
}

impl MemKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            MemKind::Dram => 0,
            MemKind::File => 1,
            MemKind::Gpu => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(MemKind::Dram),
            1 => Some(MemKind::File),
            2 => Some(MemKind::Gpu),
            _ => None,
        }
    }

    /// Whether the CPU can address this memory directly.
    pub fn is_host(self) -> bool {
        !matches!(self, MemKind::Gpu)
    }
}

pub(crate) enum Backing {
    /// A memfd or a file, mapped shared; the file stays open so a same-host peer can open it
    /// through `/proc/<pid>/fd/<fd>`.
    Mapped { _map: memmap2::MmapRaw, file: File },
    /// Memory the caller owns ([`Agent::register_raw`](crate::Agent::register_raw)), with
    /// what keeps it valid when the caller handed that over
    /// ([`Agent::register_raw_owned`](crate::Agent::register_raw_owned)).
    Foreign(#[allow(dead_code)] Option<Box<dyn std::any::Any + Send + Sync>>),
    /// Device memory owned by the CUDA backend (held only to be freed with the region).
    #[cfg(feature = "cuda")]
    Gpu(#[allow(dead_code)] cuda::DeviceBuffer),
    /// Page-locked host memory from the CUDA driver (held only to be freed with the region).
    #[cfg(feature = "cuda")]
    Pinned(#[allow(dead_code)] cuda::PinnedBuffer),
}

/// A backend's registration of a region's memory (UCX: its memory mapping): the packed remote
/// key a peer needs to reach it, and the backend's handle, which undoes the registration when
/// dropped. The region keeps it without knowing the backend.
#[cfg(feature = "ucx")]
pub(crate) struct Registration {
    pub(crate) rkey: Vec<u8>,
    _handle: Box<dyn Send + Sync>,
}

#[cfg(feature = "ucx")]
impl Registration {
    pub(crate) fn new(rkey: Vec<u8>, handle: Box<dyn Send + Sync>) -> Self {
        Self {
            rkey,
            _handle: handle,
        }
    }
}

/// The memory of one region. Shared (`Arc`) by the registry, the handle and in-flight chunks.
pub(crate) struct RegionMem {
    pub(crate) id: RegionId,
    pub(crate) kind: MemKind,
    ptr: *mut u8,
    len: u64,
    /// Per-backend registration state (UCX memory handle). Declared before `backing` so it
    /// is released before the memory is unmapped (fields drop in order).
    #[cfg(feature = "ucx")]
    pub(crate) ucx: std::sync::OnceLock<Registration>,
    pub(crate) backing: Backing,
    /// Slot in the agent's shared-memory region table, when a same-host peer can reach it.
    pub(crate) shm_slot: Option<u32>,
    /// False once deregistered: transfers in flight that touch the region then fail with
    /// `RegionNotFound` at their next chunk (the memory itself stays mapped until they let go).
    live: std::sync::atomic::AtomicBool,
    /// False once [`RegionHandle::refuse_remote_writes`]: peers' WRITEs into it are refused.
    remote_writes: std::sync::atomic::AtomicBool,
    /// The owning agent's name (for errors).
    agent: Arc<str>,
}

// SAFETY: `ptr` points into memory owned by `backing` (or, for foreign memory, memory the
// caller promised in `register_raw` to keep valid until the region is dropped); the pointer is
// only an address, and every access through it goes through `slice`/`slice_mut`/`copy_*`,
// whose contract (documented on `RegionHandle`) puts overlapping concurrent access on the
// caller, as with any shared memory.
unsafe impl Send for RegionMem {}
// SAFETY: as above; `RegionMem` has no interior state besides the memory it describes.
unsafe impl Sync for RegionMem {}

impl RegionMem {
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// `RegionNotFound` if the region has been deregistered.
    pub(crate) fn check_live(&self) -> Result<()> {
        if self.live.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(TransferError::RegionNotFound {
                agent: self.agent.to_string(),
                region: self.id.0,
            })
        }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Whether peers may WRITE into the region.
    pub(crate) fn remote_writes(&self) -> bool {
        self.remote_writes.load(Ordering::Acquire)
    }

    /// The region's bytes `offset..offset+len` as a shared slice.
    ///
    /// # Safety
    /// The range must be in bounds (checked by the caller against `len()`), the region must be
    /// host memory, and no transfer may write these bytes while the slice lives (the transfer
    /// contract on [`RegionHandle`]).
    pub(crate) unsafe fn slice(&self, offset: u64, len: usize) -> &[u8] {
        debug_assert!(self.kind.is_host());
        debug_assert!(offset + len as u64 <= self.len);
        // SAFETY: forwarded to the caller (see above); `ptr..ptr+self.len` is mapped.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset as usize), len) }
    }

    /// The region's bytes `offset..offset+len` as a mutable slice.
    ///
    /// # Safety
    /// As for [`slice`](Self::slice), and nothing else may read or write these bytes while the
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, offset: u64, len: usize) -> &mut [u8] {
        debug_assert!(self.kind.is_host());
        debug_assert!(offset + len as u64 <= self.len);
        // SAFETY: forwarded to the caller (see above); `ptr..ptr+self.len` is mapped.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset as usize), len) }
    }

    /// The fd of a mapped region (memfd or file), for same-host sharing.
    pub(crate) fn shareable_fd(&self) -> Option<i32> {
        match &self.backing {
            Backing::Mapped { file, .. } => Some(file.as_raw_fd()),
            _ => None,
        }
    }

    fn check_host(&self, offset: u64, len: usize) -> Result<()> {
        if !self.kind.is_host() {
            return Err(TransferError::BackendUnavailable {
                backend: "host copy",
                reason: format!("region {} is GPU memory", self.id),
            });
        }
        check_range(0, "region", offset, len as u64, self.len)
    }
}

/// A registered region. Dropping it deregisters the region (see the module's invariant).
///
/// # Memory contract
/// Peers read and write a region's bytes at any time through one-sided transfers; the library
/// does not lock bytes. The caller must not read bytes a transfer is writing before that
/// transfer completes, must not change bytes a transfer is reading before it completes, and
/// must not post concurrent transfers that write the same bytes (the outcome of such races is
/// unspecified contents, as with any shared memory). After a transfer fails or is cancelled,
/// its destination bytes are unspecified.
pub struct RegionHandle {
    pub(crate) mem: Arc<RegionMem>,
    registry: Weak<Registry>,
}

impl std::fmt::Debug for RegionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionHandle")
            .field("id", &self.mem.id)
            .field("kind", &self.mem.kind)
            .field("len", &self.mem.len)
            .finish()
    }
}

impl RegionHandle {
    /// The region's id (what descriptors name).
    pub fn id(&self) -> RegionId {
        self.mem.id
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.mem.len
    }

    /// Whether the region is empty (never: registration refuses zero lengths).
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemKind {
        self.mem.kind
    }

    /// The region's base address (a device pointer for GPU regions).
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr
    }

    /// Copies `src` into the region at `offset` (host memory only). See the memory contract.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.mem.check_host(offset, src.len())?;
        // SAFETY: the range is in bounds of the mapped host region (checked above); the
        // memory contract on this type rules out overlapping concurrent transfers.
        let dst = unsafe { self.mem.slice_mut(offset, src.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    /// Copies the region's bytes at `offset` into `dst` (host memory only).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.mem.check_host(offset, dst.len())?;
        // SAFETY: as in `write_at`.
        let src = unsafe { self.mem.slice(offset, dst.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    /// Refuses peers' WRITEs into this region from now on (a peer's write fails with
    /// `InvalidDescriptor`, "read-only to peers"); this agent's own transfers still fill
    /// it (a READ it posts lands here). Enforced by the TCP and QUIC targets. **Not** over
    /// shared memory or UCX, where the peer maps or registers the memory itself: a region
    /// that must stay read-only is registered as foreign memory ([`crate::Agent::register_raw`],
    /// which same-host peers cannot map) on an agent without UCX.
    pub fn refuse_remote_writes(&self) {
        self.mem.remote_writes.store(false, Ordering::Release);
    }

    /// `/proc/<pid>/fd/<n>` of the region's memfd or file, through which a same-host process
    /// can map it; `None` for foreign and GPU memory.
    pub fn shm_path(&self) -> Option<String> {
        self.mem
            .shareable_fd()
            .map(|fd| format!("/proc/{}/fd/{fd}", std::process::id()))
    }
}

impl Drop for RegionHandle {
    fn drop(&mut self) {
        if let Some(registry) = self.registry.upgrade() {
            registry.remove(self.mem.id);
        }
    }
}

/// Hooks a backend runs when regions come and go (the shared-memory region table).
pub(crate) trait RegistryHook: Send + Sync {
    /// Publishes a new region; returns its shared-memory slot if it got one.
    fn added(&self, id: RegionId, shareable: bool) -> Option<u32>;
    /// Withdraws a region.
    fn removed(&self, id: RegionId, slot: Option<u32>);
}

/// An agent's registered regions.
pub(crate) struct Registry {
    pub(crate) agent: String,
    agent_name: Arc<str>,
    regions: RwLock<HashMap<u64, Arc<RegionMem>>>,
    next_id: AtomicU64,
    hook: Option<Arc<dyn RegistryHook>>,
}

impl Registry {
    pub(crate) fn new(agent: String, hook: Option<Arc<dyn RegistryHook>>) -> Self {
        Self {
            agent_name: Arc::from(agent.as_str()),
            agent,
            regions: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            hook,
        }
    }

    /// Looks a region up by id.
    pub(crate) fn get(&self, id: RegionId) -> Result<Arc<RegionMem>> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        map.get(&id.0)
            .cloned()
            .ok_or_else(|| TransferError::RegionNotFound {
                agent: self.agent.clone(),
                region: id.0,
            })
    }

    /// Every registered region (for the metadata blob).
    pub(crate) fn snapshot(&self) -> Vec<Arc<RegionMem>> {
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = map.values().cloned().collect();
        v.sort_by_key(|r| r.id);
        v
    }

    fn remove(&self, id: RegionId) {
        let removed = {
            let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
            map.remove(&id.0)
        };
        if let Some(region) = &removed {
            region.live.store(false, Ordering::Release);
        }
        if let (Some(region), Some(hook)) = (removed, &self.hook) {
            hook.removed(id, region.shm_slot);
        }
    }

    fn insert(
        self: &Arc<Self>,
        kind: MemKind,
        ptr: *mut u8,
        len: u64,
        backing: Backing,
    ) -> Result<RegionHandle> {
        if len == 0 {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: "cannot register a zero-length region".into(),
            });
        }
        let id = RegionId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let shareable = matches!(backing, Backing::Mapped { .. });
        let shm_slot = self.hook.as_ref().and_then(|h| h.added(id, shareable));
        let mem = Arc::new(RegionMem {
            id,
            kind,
            ptr,
            len,
            #[cfg(feature = "ucx")]
            ucx: std::sync::OnceLock::new(),
            backing,
            shm_slot,
            live: std::sync::atomic::AtomicBool::new(true),
            remote_writes: std::sync::atomic::AtomicBool::new(true),
            agent: Arc::clone(&self.agent_name),
        });
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.0, Arc::clone(&mem));
        Ok(RegionHandle {
            mem,
            registry: Arc::downgrade(self),
        })
    }

    /// Maps `file` (a memfd or a regular file of at least `len` bytes) shared and registers it.
    pub(crate) fn register_mapped(
        self: &Arc<Self>,
        file: File,
        len: u64,
        kind: MemKind,
    ) -> Result<RegionHandle> {
        if len == 0 {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: "cannot register a zero-length region".into(),
            });
        }
        let have = file
            .metadata()
            .map_err(|e| TransferError::io("stat of the region's file", e))?
            .len();
        if have < len {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: format!("the file holds {have} bytes, fewer than the {len} registered"),
            });
        }
        let map_len = usize::try_from(len).map_err(|_| TransferError::InvalidDescriptor {
            index: 0,
            reason: format!("{len} bytes do not fit the address space"),
        })?;
        let map = memmap2::MmapOptions::new()
            .len(map_len)
            .map_raw(&file)
            .map_err(|e| TransferError::io("mmap of a region", e))?;
        let ptr = map.as_mut_ptr();
        self.insert(kind, ptr, len, Backing::Mapped { _map: map, file })
    }

    /// Registers foreign memory.
    ///
    /// # Safety
    /// See [`Agent::register_raw`](crate::Agent::register_raw).
    pub(crate) unsafe fn register_foreign(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: u64,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<RegionHandle> {
        if ptr.is_null() {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: "null pointer".into(),
            });
        }
        self.insert(MemKind::Dram, ptr, len, Backing::Foreign(owner))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn register_gpu(self: &Arc<Self>, buf: cuda::DeviceBuffer) -> Result<RegionHandle> {
        let ptr = buf.device_ptr() as *mut u8;
        let len = buf.len();
        self.insert(MemKind::Gpu, ptr, len, Backing::Gpu(buf))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn register_pinned(
        self: &Arc<Self>,
        buf: cuda::PinnedBuffer,
        len: u64,
    ) -> Result<RegionHandle> {
        let ptr = buf.ptr();
        self.insert(MemKind::Dram, ptr, len, Backing::Pinned(buf))
    }
}

/// Creates an anonymous memfd of `len` bytes.
pub(crate) fn memfd(len: u64, name: &str) -> Result<File> {
    let cname = std::ffi::CString::new(name).map_err(|_| TransferError::Config {
        reason: format!("memfd name {name:?} holds a NUL byte"),
    })?;
    // SAFETY: `cname` is a valid NUL-terminated string; memfd_create has no other inputs.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(TransferError::io(
            "memfd_create",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len)
        .map_err(|e| TransferError::io(format!("sizing a memfd to {len} bytes"), e))?;
    seal_size(&file).map_err(|e| TransferError::io("sealing a memfd's size", e))?;
    Ok(file)
}

/// Seals a memfd's size (no shrinking, no growing, no further seals), so a process that maps
/// it can never fault on pages cut off under it. Shared-memory peers refuse memfds without
/// the shrink seal.
pub(crate) fn seal_size(file: &File) -> std::io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on an fd we own, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

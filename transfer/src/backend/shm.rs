//! Same-host shared memory.
//!
//! **Target side.** Every region an agent allocates (`alloc_dram`, `register_memfd`,
//! `register_file`) is a memfd or file mapped shared; the metadata blob lists it with the path
//! `/proc/<pid>/fd/<n>` through which a process of the same user opens and maps the very same
//! pages. A *region table* (a small memfd, also shared by path) holds one 8-byte slot per
//! shareable region with its id (0 = free) and a header word that says whether the agent is
//! alive. An abstract Unix socket carries the control channel: authentication, notifications,
//! and liveness (the socket closes when the agent or its process goes away).
//!
//! **Initiator side.** `connect` maps the table and every listed region, and opens the control
//! channel. A transfer is a `memcpy` between the local region and the mapping, done inside the
//! transfer's own future (no task hop, no allocation besides the future), in slices of
//! `shm_chunk_bytes`; before each slice it checks cancellation, the peer's liveness word and
//! the control channel, and that the region's table slot still holds its id (so a deregistered
//! region gives `RegionNotFound`). Between slices the future yields. The notification, if any,
//! follows over the control channel once all bytes are copied.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::stream::Lane;
use super::{BoxFuture, Job, PeerBackend};
use crate::descriptor::Op;
use crate::error::{Result, TransferError};
use crate::metadata::{AgentMetadata, ShmEndpoint};
use crate::region::{RegionId, RegistryHook};

const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"KVTXSHMT");
const TABLE_HEADER_WORDS: usize = 8;
/// Region-table slots (shareable regions an agent can expose at once).
pub const SHM_TABLE_SLOTS: u32 = 4096;

/// A shared table of live region ids plus an alive word.
pub(crate) struct RegionTable {
    file: File,
    map: memmap2::MmapRaw,
    slots: u32,
    free: Mutex<Vec<u32>>,
}

impl RegionTable {
    fn words(slots: u32) -> usize {
        TABLE_HEADER_WORDS + slots as usize
    }

    pub(crate) fn create(slots: u32) -> Result<Self> {
        let bytes = (Self::words(slots) * 8) as u64;
        let file = crate::region::memfd(bytes, "kvtier-region-table")?;
        let map = memmap2::MmapOptions::new()
            .len(bytes as usize)
            .map_raw(&file)
            .map_err(|e| TransferError::io("mmap of the region table", e))?;
        let t = Self {
            file,
            map,
            slots,
            free: Mutex::new((0..slots).rev().collect()),
        };
        t.word(0).store(TABLE_MAGIC, Ordering::Relaxed);
        t.word(2).store(u64::from(slots), Ordering::Relaxed);
        t.word(1).store(1, Ordering::Release);
        Ok(t)
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        word(&self.map, i)
    }

    pub(crate) fn path(&self) -> String {
        use std::os::fd::AsRawFd;
        format!("/proc/{}/fd/{}", std::process::id(), self.file.as_raw_fd())
    }

    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// Marks the agent gone (peers see `Disconnected` from their next slice on).
    pub(crate) fn close(&self) {
        self.word(1).store(0, Ordering::Release);
    }
}

/// Word `i` of a mapped table. Callers pass header words or `TABLE_HEADER_WORDS + slot` with
/// `slot` below the table's slot count (checked when the blob was decoded, and the mapping was
/// sized from that count), so the assertion below guards an invariant, not peer input.
fn word(map: &memmap2::MmapRaw, i: usize) -> &AtomicU64 {
    assert!((i + 1) * 8 <= map.len(), "table word {i} out of bounds");
    // SAFETY: the mapping is page aligned, so `8 * i` is 8-byte aligned; the bound is
    // checked above; the memory lives as long as `map` (the returned borrow); all access to
    // table words, in every process, is atomic.
    unsafe { &*(map.as_mut_ptr().add(i * 8) as *const AtomicU64) }
}

impl RegistryHook for RegionTable {
    fn added(&self, id: RegionId, shareable: bool) -> Option<u32> {
        if !shareable {
            return None;
        }
        let slot = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        self.word(TABLE_HEADER_WORDS + slot as usize)
            .store(id.0, Ordering::Release);
        Some(slot)
    }

    fn removed(&self, _id: RegionId, slot: Option<u32>) {
        if let Some(slot) = slot {
            self.word(TABLE_HEADER_WORDS + slot as usize)
                .store(0, Ordering::Release);
            self.free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
        }
    }
}

/// A fresh abstract socket name for an agent's control channel.
pub(crate) fn control_name() -> Vec<u8> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "kvtier-transfer-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
    .into_bytes()
}

/// Binds the control listener on an abstract Unix socket.
pub(crate) fn bind_control(name: &[u8]) -> Result<tokio::net::UnixListener> {
    let addr = UnixAddr::from_abstract_name(name)
        .map_err(|e| TransferError::io("abstract socket name", e))?;
    let l = std::os::unix::net::UnixListener::bind_addr(&addr)
        .map_err(|e| TransferError::io("binding the shared-memory control socket", e))?;
    l.set_nonblocking(true)
        .map_err(|e| TransferError::io("control socket", e))?;
    tokio::net::UnixListener::from_std(l).map_err(|e| TransferError::io("control socket", e))
}

struct RemoteMap {
    map: memmap2::MmapRaw,
    slot: u32,
}

/// A same-host peer: its table and regions mapped here, plus the control lane.
pub(crate) struct ShmPeer {
    peer: String,
    table: memmap2::MmapRaw,
    /// Each listed region's mapping, or why it cannot be mapped (reported when a transfer
    /// names it).
    regions: HashMap<u64, std::result::Result<RemoteMap, String>>,
    control: Arc<Lane>,
    chunk_bytes: u64,
}

fn open_map(path: &str, len: u64, peer: &str) -> Result<memmap2::MmapRaw> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| TransferError::BackendUnavailable {
            backend: "shm",
            reason: format!("cannot open {path} of {peer} (another host, or no permission?): {e}"),
        })?;
    // A memfd must be sealed against shrinking, or its owner could cut pages off under our
    // mapping (a fault on our side). Regular files cannot be sealed: mapping one trusts its
    // owner not to truncate it (documented).
    // SAFETY: fcntl on an fd we own, no pointer argument.
    let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK == 0 {
        return Err(TransferError::BackendUnavailable {
            backend: "shm",
            reason: format!("{path} of {peer} is a memfd not sealed against shrinking"),
        });
    }
    let have = file
        .metadata()
        .map_err(|e| TransferError::io(format!("stat of {path}"), e))?
        .len();
    if have < len {
        return Err(TransferError::Metadata {
            reason: format!("{path} holds {have} bytes, the blob says {len}"),
        });
    }
    let map_len = usize::try_from(len).map_err(|_| TransferError::Metadata {
        reason: format!("{len} bytes do not fit the address space"),
    })?;
    memmap2::MmapOptions::new()
        .len(map_len)
        .map_raw(&file)
        .map_err(|e| TransferError::io(format!("mmap of {path}"), e))
}

pub(crate) async fn connect(
    my_name: &str,
    meta: &AgentMetadata,
    chunk_bytes: u64,
) -> Result<Arc<ShmPeer>> {
    let ShmEndpoint {
        control,
        table_path,
        table_slots,
    } = meta
        .shm
        .as_ref()
        .ok_or_else(|| TransferError::BackendUnavailable {
            backend: "shm",
            reason: format!("agent {} does not offer shared memory", meta.name),
        })?;
    let table_bytes = (RegionTable::words(*table_slots) * 8) as u64;
    let table = open_map(table_path, table_bytes, &meta.name)?;
    if word(&table, 0).load(Ordering::Acquire) != TABLE_MAGIC
        || word(&table, 2).load(Ordering::Acquire) != u64::from(*table_slots)
    {
        return Err(TransferError::Metadata {
            reason: format!("{table_path} is not {}'s region table", meta.name),
        });
    }
    let mut regions = HashMap::new();
    for r in &meta.regions {
        if let Some(s) = &r.shm {
            let entry = open_map(&s.path, r.len, &meta.name)
                .map(|map| RemoteMap { map, slot: s.slot })
                .map_err(|e| e.to_string());
            regions.insert(r.id, entry);
        }
    }
    let addr = UnixAddr::from_abstract_name(control)
        .map_err(|e| TransferError::io("abstract socket name", e))?;
    let stream = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| {
        TransferError::disconnected(&meta.name, format!("control socket connect: {e}"))
    })?;
    stream
        .set_nonblocking(true)
        .map_err(|e| TransferError::io("control socket", e))?;
    let stream = tokio::net::UnixStream::from_std(stream)
        .map_err(|e| TransferError::io("control socket", e))?;
    let (r, w) = stream.into_split();
    let control = Lane::start(&meta.name, my_name, &meta.token, r, w).await?;
    Ok(Arc::new(ShmPeer {
        peer: meta.name.clone(),
        table,
        regions,
        control,
        chunk_bytes,
    }))
}

impl ShmPeer {
    fn check_alive(&self) -> Result<()> {
        if word(&self.table, 1).load(Ordering::Acquire) != 1 {
            return Err(TransferError::disconnected(
                &self.peer,
                "the agent shut down",
            ));
        }
        if let Some(reason) = self.control.dead_reason() {
            return Err(TransferError::disconnected(&self.peer, reason));
        }
        Ok(())
    }

    async fn run(&self, job: Job) -> Result<()> {
        let ctl = &job.ctl;
        let total: u64 = job.segments.iter().map(|s| s.len).sum();
        let mut copied = 0u64;
        let mut since_yield = 0u64;
        for seg in &job.segments {
            if !seg.local.kind.is_host() {
                return Err(TransferError::BackendUnavailable {
                    backend: "shm",
                    reason: format!("local region {} is not host memory", seg.local.id),
                });
            }
            let remote = match self.regions.get(&seg.remote) {
                Some(Ok(m)) => m,
                Some(Err(reason)) => {
                    return Err(TransferError::BackendUnavailable {
                        backend: "shm",
                        reason: format!("region {} of {}: {reason}", seg.remote, self.peer),
                    });
                }
                None => {
                    return Err(TransferError::BackendUnavailable {
                        backend: "shm",
                        reason: format!(
                            "region {} of {} is not shareable (foreign or GPU memory, or the table was full)",
                            seg.remote, self.peer
                        ),
                    });
                }
            };
            let slot_word = word(&self.table, TABLE_HEADER_WORDS + remote.slot as usize);
            let mut done = 0u64;
            while done < seg.len {
                ctl.check()?;
                self.check_alive()?;
                seg.local.check_live()?;
                if slot_word.load(Ordering::Acquire) != seg.remote {
                    return Err(TransferError::RegionNotFound {
                        agent: self.peer.clone(),
                        region: seg.remote,
                    });
                }
                let n = (seg.len - done).min(self.chunk_bytes);
                let local_off = (seg.local_offset + done) as usize;
                let remote_off = (seg.remote_offset + done) as usize;
                // SAFETY: both ranges were validated at post time against the regions'
                // lengths (local: the registry; remote: the metadata, whose length was checked
                // against the mapped file in `connect`, so the mapping covers it). Both
                // mappings stay alive: the local one through the Arc in the segment, the
                // remote one through `self`. The two are distinct mappings, so a same-memory
                // overlap would only arise from a transfer between a region and itself, which
                // the memory contract treats like any overlapping concurrent access.
                unsafe {
                    let local = seg.local.ptr().add(local_off);
                    let remote_ptr = remote.map.as_mut_ptr().add(remote_off);
                    match job.op {
                        Op::Write => std::ptr::copy(local, remote_ptr, n as usize),
                        Op::Read => std::ptr::copy(remote_ptr, local, n as usize),
                    }
                }
                done += n;
                copied += n;
                since_yield += n;
                if since_yield >= self.chunk_bytes && copied < total {
                    since_yield = 0;
                    tokio::task::yield_now().await;
                }
            }
        }
        std::sync::atomic::fence(Ordering::Release);
        self.check_alive()?;
        super::check_local_live(&job.segments)?;
        if let Some(message) = job.notification {
            self.control.notify(ctl, message).await?;
        }
        Ok(())
    }
}

impl PeerBackend for ShmPeer {
    fn execute(self: Arc<Self>, job: Job) -> BoxFuture {
        Box::pin(async move { self.run(job).await })
    }
}

//! The agent: owns registered regions, serves them to peers (the target side of every enabled
//! backend runs as tasks of the agent), exports its metadata blob, connects to peers and posts
//! one-sided transfers.
//!
//! # Thread-safety contract
//! `Agent`, `Peer`, `RegionHandle` and `CancelHandle` are `Send + Sync`. Any number of tasks
//! may post transfers on the same `Peer` (or on clones of it) at once; each transfer is
//! independent, completes on its own future and is cancelled on its own. No call takes a
//! process-wide lock: posting takes the registry's read lock for the descriptor check (writers
//! are only register/deregister), TCP/QUIC lanes take their own short pending-table mutex, and
//! no lock is held across an `.await`. Registering and deregistering are safe concurrently
//! with transfers (see the region invariant in `region.rs`). The only ordering guarantee
//! between transfers is none: two concurrent transfers to overlapping bytes race (the memory
//! contract on [`RegionHandle`]). All async calls need a Tokio runtime (multi-threaded or
//! current-thread).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::backend::frame::MAX_NOTIFICATION_BYTES;
use crate::backend::shm::{RegionTable, SHM_TABLE_SLOTS};
use crate::backend::{
    self, BackendKind, Job, Notification, PeerBackend, Segment, TargetCtx, TransferCtl,
};
use crate::descriptor::{Descriptor, Op, merge_adjacent};
use crate::error::{Result, TransferError};
use crate::metadata::{
    AgentMetadata, QuicEndpoint, RegionMeta, ShmEndpoint, ShmRegion, TOKEN_BYTES,
};
use crate::region::{MemKind, RegionHandle, RegionId, Registry, RegistryHook, check_range};
use crate::transfer::Transfer;

/// How an agent is built. Every field's doc ends with its default.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Address the TCP and QUIC listeners bind and advertise in the metadata blob (so not
    /// 0.0.0.0 / ::). Default: 127.0.0.1.
    pub listen_ip: IpAddr,
    /// Port the TCP listener and the QUIC endpoint (UDP) bind; 0 is a free one each. Default:
    /// 0.
    pub listen_port: u16,
    /// Serve regions to same-host peers over shared memory. Default: true.
    pub shm: bool,
    /// Serve regions over TCP. Default: true.
    pub tcp: bool,
    /// Serve regions over QUIC. Default: true.
    pub quic: bool,
    /// Start a UCX worker (feature `ucx`). Default: true when built with `ucx`.
    pub ucx: bool,
    /// TCP connections per peer. Default: 4.
    pub tcp_streams: usize,
    /// QUIC streams per peer. Default: 1.
    pub quic_streams: usize,
    /// Largest piece of a transfer sent as one frame on TCP/QUIC (striping unit). Default:
    /// 1 MiB.
    pub chunk_bytes: u64,
    /// Bytes a shared-memory transfer copies between cancellation/liveness checks (and
    /// yields to the runtime). Default: 4 MiB.
    pub shm_chunk_bytes: u64,
    /// Deadline for connecting to a peer (handshakes included). Default: 5 s.
    pub connect_timeout: Duration,
    /// Token peers must present; travels in the metadata blob. Default: 32 random bytes.
    pub token: Option<[u8; TOKEN_BYTES]>,
    /// Notifications queued before senders wait. Default: 1024.
    pub notification_queue: usize,
    /// UCX transports (UCX's `TLS` setting, e.g. `"tcp"` or `"sm,self"`); ignored without
    /// feature `ucx`. Default: `None` (UCX's own choice, or the `UCX_TLS` environment).
    pub ucx_transports: Option<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            listen_ip: IpAddr::from([127, 0, 0, 1]),
            listen_port: 0,
            shm: true,
            tcp: true,
            quic: true,
            ucx: cfg!(feature = "ucx"),
            tcp_streams: 4,
            quic_streams: 1,
            chunk_bytes: 1 << 20,
            shm_chunk_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(5),
            token: None,
            notification_queue: 1024,
            ucx_transports: None,
        }
    }
}

impl AgentConfig {
    fn validate(&self) -> Result<()> {
        let bad = |reason: &str| {
            Err(TransferError::Config {
                reason: reason.to_owned(),
            })
        };
        if self.listen_ip.is_unspecified() {
            return bad(
                "listen_ip must be a concrete address (it is advertised in the metadata blob)",
            );
        }
        if self.tcp_streams == 0 || self.tcp_streams > 64 {
            return bad("tcp_streams must be 1..=64");
        }
        if self.quic_streams == 0 || self.quic_streams > 64 {
            return bad("quic_streams must be 1..=64");
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes > u64::from(backend::frame::MAX_CHUNK_BYTES)
        {
            return bad("chunk_bytes must be 4 KiB..=64 MiB");
        }
        if self.shm_chunk_bytes < 4096 {
            return bad("shm_chunk_bytes must be at least 4 KiB");
        }
        if self.notification_queue == 0 {
            return bad("notification_queue must be above zero");
        }
        Ok(())
    }
}

pub(crate) struct AgentCore {
    pub(crate) config: AgentConfig,
    pub(crate) ctx: Arc<TargetCtx>,
    notifications: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    shm: Option<(Arc<RegionTable>, Vec<u8>)>,
    tcp_addr: Option<std::net::SocketAddr>,
    quic: Option<(quinn::Endpoint, std::net::SocketAddr, Vec<u8>)>,
    #[cfg(feature = "ucx")]
    pub(crate) ucx: Option<Arc<backend::ucx::UcxContext>>,
    tasks: Mutex<Vec<AbortHandle>>,
    next_transfer: AtomicU64,
}

impl AgentCore {
    fn shutdown(&self) {
        self.ctx.closed.store(true, Ordering::Release);
        if let Some((table, _)) = &self.shm {
            table.close();
        }
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        if let Some((endpoint, _, _)) = &self.quic {
            endpoint.close(quinn::VarInt::from_u32(0), b"agent shut down");
        }
        #[cfg(feature = "ucx")]
        if let Some(u) = &self.ucx {
            u.shutdown();
        }
        #[cfg(feature = "cuda")]
        backend::cuda::withdraw(&self.ctx);
    }
}

/// An agent. Dropping it shuts its serving side down: peers connected to it see
/// `Disconnected` for transfers in flight and later.
pub struct Agent {
    core: Arc<AgentCore>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.core.ctx.name)
            .finish()
    }
}

fn random_token() -> Result<[u8; TOKEN_BYTES]> {
    let mut t = [0u8; TOKEN_BYTES];
    let mut filled = 0;
    while filled < t.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `t`.
        let n = unsafe { libc::getrandom(t[filled..].as_mut_ptr().cast(), t.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(TransferError::io("getrandom", e));
        }
        filled += n as usize;
    }
    Ok(t)
}

impl Agent {
    /// Starts an agent named `name` with the enabled backends' target sides running as tasks
    /// on the current Tokio runtime.
    pub async fn new(name: &str, config: AgentConfig) -> Result<Agent> {
        config.validate()?;
        if name.is_empty() || name.len() > backend::frame::MAX_NAME_BYTES {
            return Err(TransferError::Config {
                reason: format!("agent name of {} bytes (1..=256)", name.len()),
            });
        }
        let token = match config.token {
            Some(t) => t,
            None => random_token()?,
        };
        let table = if config.shm {
            Some(Arc::new(RegionTable::create(SHM_TABLE_SLOTS)?))
        } else {
            None
        };
        let hook = table.clone().map(|t| t as Arc<dyn RegistryHook>);
        let registry = Arc::new(Registry::new(name.to_owned(), hook));
        let (tx, rx) = mpsc::channel(config.notification_queue);
        let ctx = Arc::new(TargetCtx {
            name: name.to_owned(),
            token,
            registry,
            notifications: tx,
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        let mut tasks = Vec::new();
        let shm = match table {
            Some(table) => {
                let cname = backend::shm::control_name();
                let listener = backend::shm::bind_control(&cname)?;
                let c = Arc::clone(&ctx);
                tasks.push(tokio::spawn(unix_accept_loop(c, listener)).abort_handle());
                Some((table, cname))
            }
            None => None,
        };
        let tcp_addr = if config.tcp {
            let at = std::net::SocketAddr::new(config.listen_ip, config.listen_port);
            let (l, addr) = backend::tcp::bind(at).await?;
            tasks.push(tokio::spawn(backend::tcp::accept_loop(Arc::clone(&ctx), l)).abort_handle());
            Some(addr)
        } else {
            None
        };
        let quic = if config.quic {
            let at = std::net::SocketAddr::new(config.listen_ip, config.listen_port);
            let (endpoint, addr, cert) = backend::quic::bind(at)?;
            tasks.push(
                tokio::spawn(backend::quic::accept_loop(
                    Arc::clone(&ctx),
                    endpoint.clone(),
                ))
                .abort_handle(),
            );
            Some((endpoint, addr, cert))
        } else {
            None
        };
        #[cfg(feature = "cuda")]
        backend::cuda::announce(&ctx);
        #[cfg(feature = "ucx")]
        let ucx = if config.ucx {
            Some(backend::ucx::UcxContext::start(
                Arc::clone(&ctx),
                config.ucx_transports.as_deref(),
            )?)
        } else {
            None
        };
        Ok(Agent {
            core: Arc::new(AgentCore {
                config,
                ctx,
                notifications: tokio::sync::Mutex::new(rx),
                shm,
                tcp_addr,
                quic,
                #[cfg(feature = "ucx")]
                ucx,
                tasks: Mutex::new(tasks),
                next_transfer: AtomicU64::new(1),
            }),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.core.ctx.name
    }

    /// The address the agent's TCP or QUIC listener is bound to (`None`: that backend is
    /// off, or `backend` has no listener).
    pub fn listen_addr(&self, backend: BackendKind) -> Option<std::net::SocketAddr> {
        match backend {
            BackendKind::Tcp => self.core.tcp_addr,
            BackendKind::Quic => self.core.quic.as_ref().map(|(_, addr, _)| *addr),
            _ => None,
        }
    }

    /// Allocates `len` bytes of zeroed DRAM (a memfd, so same-host peers can map it) and
    /// registers it.
    pub fn alloc_dram(&self, len: u64) -> Result<RegionHandle> {
        let file = crate::region::memfd(len, "kvtier-region")?;
        self.finish_register(
            self.core
                .ctx
                .registry
                .register_mapped(file, len, MemKind::Dram)?,
        )
    }

    /// Registers the first `len` bytes of an existing memfd (for example a server's DRAM
    /// arena), mapping it shared. The fd is kept open until the region is dropped. The memfd's
    /// size is sealed here (shrink, grow, seal) when the memfd allows sealing
    /// (`MFD_ALLOW_SEALING`); shared-memory peers only map memfds sealed against shrinking,
    /// so an unsealable memfd is reachable over TCP, QUIC and UCX but not over `Shm`.
    pub fn register_memfd(&self, fd: std::os::fd::OwnedFd, len: u64) -> Result<RegionHandle> {
        let file = std::fs::File::from(fd);
        if let Err(e) = crate::region::seal_size(&file) {
            tracing::debug!(agent = %self.name(), "memfd not sealed ({e}): not reachable over shm");
        }
        self.finish_register(
            self.core
                .ctx
                .registry
                .register_mapped(file, len, MemKind::Dram)?,
        )
    }

    /// Registers the first `len` bytes of the file at `path` (created, or grown to `len` if
    /// shorter), mapped shared.
    pub fn register_file(&self, path: &std::path::Path, len: u64) -> Result<RegionHandle> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| TransferError::io(format!("opening {}", path.display()), e))?;
        let have = file
            .metadata()
            .map_err(|e| TransferError::io(format!("stat of {}", path.display()), e))?
            .len();
        if have < len {
            file.set_len(len)
                .map_err(|e| TransferError::io(format!("growing {}", path.display()), e))?;
        }
        self.finish_register(
            self.core
                .ctx
                .registry
                .register_mapped(file, len, MemKind::File)?,
        )
    }

    /// Registers `len` bytes of memory the caller owns. Such a region is reachable over TCP,
    /// QUIC and UCX, but not by same-host peers over shared memory (no fd to share).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid host memory, readable and writable, that stays valid (not
    /// freed, unmapped or moved) until the returned handle is dropped **and** every transfer
    /// posted against it has completed, failed or been dropped; and the caller accesses it
    /// only under the memory contract on [`RegionHandle`].
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: u64) -> Result<RegionHandle> {
        // SAFETY: forwarded to our caller (see above).
        let handle = unsafe { self.core.ctx.registry.register_foreign(ptr, len, None)? };
        self.finish_register(handle)
    }

    /// [`Agent::register_raw`] of memory that `owner` keeps valid (for example an `Arc` of
    /// the structure that maps it): the region holds `owner` until the handle is dropped
    /// and every transfer chunk touching the region has let go, so the memory outlives
    /// every access through the region without the caller having to track transfers.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid host memory, readable and writable, for as long as
    /// `owner` lives, and the caller accesses it only under the memory contract on
    /// [`RegionHandle`].
    pub unsafe fn register_raw_owned<T: Send + Sync + 'static>(
        &self,
        ptr: *mut u8,
        len: u64,
        owner: T,
    ) -> Result<RegionHandle> {
        // SAFETY: forwarded to our caller; the region keeps `owner`, and so the memory, alive.
        let handle = unsafe {
            self.core
                .ctx
                .registry
                .register_foreign(ptr, len, Some(Box::new(owner)))?
        };
        self.finish_register(handle)
    }

    /// Allocates `len` bytes of GPU memory on `device` and registers it (feature `cuda`).
    #[cfg(feature = "cuda")]
    pub fn alloc_gpu(&self, device: usize, len: u64) -> Result<RegionHandle> {
        let buf = crate::region::cuda::DeviceBuffer::alloc(device, len)?;
        self.finish_register(self.core.ctx.registry.register_gpu(buf)?)
    }

    /// Allocates `len` bytes of pinned (page-locked) host memory and registers it (feature
    /// `cuda`): the fast source/destination of host<->device copies. Not shareable over
    /// shared memory (no fd); reachable over TCP, QUIC, UCX and CUDA.
    #[cfg(feature = "cuda")]
    pub fn alloc_pinned(&self, len: u64) -> Result<RegionHandle> {
        let buf = crate::region::cuda::PinnedBuffer::alloc(len)?;
        self.finish_register(self.core.ctx.registry.register_pinned(buf, len)?)
    }

    #[allow(clippy::unnecessary_wraps)]
    fn finish_register(&self, handle: RegionHandle) -> Result<RegionHandle> {
        #[cfg(feature = "ucx")]
        if let Some(u) = &self.core.ucx {
            u.register(&handle.mem)?;
        }
        Ok(handle)
    }

    /// The metadata blob a peer loads (with [`connect`](Self::connect)) to reach this agent's
    /// regions registered so far. It carries the auth token: hand it only to trusted peers.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.metadata_with(true)
    }

    /// [`Agent::metadata`] without the auth token (zeros in its place) and, on an agent
    /// without UCX (the only backend that needs them), without the regions' addresses: a
    /// blob to publish where others than the trusted peers can read it (a registry such as
    /// etcd). Peers that hold the token by other means (derived from a shared secret)
    /// connect with [`Agent::connect_with_token`].
    pub fn metadata_without_token(&self) -> Result<Vec<u8>> {
        self.metadata_with(false)
    }

    fn metadata_with(&self, token: bool) -> Result<Vec<u8>> {
        let core = &self.core;
        let pid = std::process::id();
        // Only UCX puts to a region's address; a published blob of an agent without it
        // carries none (no process address for anyone who reads the registry).
        #[cfg(feature = "ucx")]
        let addresses = token || core.ucx.is_some();
        #[cfg(not(feature = "ucx"))]
        let addresses = token;
        let regions = core
            .ctx
            .registry
            .snapshot()
            .into_iter()
            .map(|r| RegionMeta {
                id: r.id.0,
                kind: r.kind.code(),
                len: r.len(),
                addr: if addresses { r.ptr() as u64 } else { 0 },
                shm: match (r.shm_slot, r.shareable_fd()) {
                    (Some(slot), Some(fd)) => Some(ShmRegion {
                        path: format!("/proc/{pid}/fd/{fd}"),
                        slot,
                    }),
                    _ => None,
                },
                #[cfg(feature = "ucx")]
                ucx_rkey: r.ucx.get().map(|u| u.rkey.clone()),
                #[cfg(not(feature = "ucx"))]
                ucx_rkey: None,
            })
            .collect();
        let meta = AgentMetadata {
            name: core.ctx.name.clone(),
            pid,
            token: if token {
                core.ctx.token.to_vec()
            } else {
                vec![0; TOKEN_BYTES]
            },
            tcp: core.tcp_addr.map(|a| a.to_string()),
            quic: core.quic.as_ref().map(|(_, addr, cert)| QuicEndpoint {
                addr: addr.to_string(),
                cert_der: cert.clone(),
            }),
            shm: core.shm.as_ref().map(|(table, cname)| ShmEndpoint {
                control: cname.clone(),
                table_path: table.path(),
                table_slots: table.slots(),
            }),
            #[cfg(feature = "ucx")]
            ucx: core.ucx.as_ref().map(|u| u.worker_address().to_vec()),
            #[cfg(not(feature = "ucx"))]
            ucx: None,
            regions,
        };
        meta.encode()
    }

    /// Loads a peer's metadata blob and connects to it over `backend`.
    pub async fn connect(&self, blob: &[u8], backend: BackendKind) -> Result<Peer> {
        self.connect_meta(AgentMetadata::decode(blob)?, backend)
            .await
    }

    /// [`Agent::connect`] to a blob published without its token
    /// ([`Agent::metadata_without_token`]), presenting `token` instead.
    pub async fn connect_with_token(
        &self,
        blob: &[u8],
        backend: BackendKind,
        token: [u8; TOKEN_BYTES],
    ) -> Result<Peer> {
        let mut meta = AgentMetadata::decode(blob)?;
        meta.token = token.to_vec();
        self.connect_meta(meta, backend).await
    }

    async fn connect_meta(&self, meta: AgentMetadata, backend: BackendKind) -> Result<Peer> {
        let core = &self.core;
        let me = &core.ctx.name;
        let cfg = &core.config;
        let connecting = async {
            let b: Arc<dyn PeerBackend> = match backend {
                BackendKind::Shm => backend::shm::connect(me, &meta, cfg.shm_chunk_bytes).await?,
                BackendKind::Tcp => {
                    backend::tcp::connect(me, &meta, cfg.tcp_streams, cfg.chunk_bytes).await?
                }
                BackendKind::Quic => {
                    backend::quic::connect(
                        me,
                        &meta,
                        cfg.listen_ip,
                        cfg.quic_streams,
                        cfg.chunk_bytes,
                    )
                    .await?
                }
                #[cfg(feature = "ucx")]
                BackendKind::Ucx => match &core.ucx {
                    Some(u) => u.connect(&meta, cfg.chunk_bytes).await?,
                    None => {
                        return Err(TransferError::BackendUnavailable {
                            backend: "ucx",
                            reason: "this agent was configured without UCX".into(),
                        });
                    }
                },
                #[cfg(feature = "cuda")]
                BackendKind::Cuda => backend::cuda::connect(me, &meta)?,
                #[allow(unreachable_patterns)]
                other => {
                    return Err(TransferError::BackendUnavailable {
                        backend: other.name(),
                        reason: format!("built without feature {}", other.name()),
                    });
                }
            };
            Ok(b)
        };
        let b = tokio::time::timeout(cfg.connect_timeout, connecting)
            .await
            .map_err(|_| TransferError::TimedOut {
                operation: "connect",
                peer: meta.name.clone(),
                after: cfg.connect_timeout,
            })??;
        let regions = meta
            .regions
            .iter()
            .filter_map(|r| Some((r.id, (MemKind::from_code(r.kind)?, r.len))))
            .collect();
        Ok(Peer {
            inner: Arc::new(PeerInner {
                name: meta.name,
                backend_kind: backend,
                local: Arc::clone(core),
                regions,
                backend: b,
            }),
        })
    }

    /// Waits for the next notification a peer attached to a transfer into this agent.
    /// `None` only if the agent is shutting down.
    pub async fn recv_notification(&self) -> Option<Notification> {
        self.core.notifications.lock().await.recv().await
    }

    /// The next notification if one is queued.
    pub fn try_recv_notification(&self) -> Option<Notification> {
        self.core.notifications.try_lock().ok()?.try_recv().ok()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.core.shutdown();
    }
}

async fn unix_accept_loop(ctx: Arc<TargetCtx>, listener: tokio::net::UnixListener) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => {
                    let (r, w) = sock.into_split();
                    conns.spawn(backend::stream::serve(Arc::clone(&ctx), r, w));
                }
                Err(e) => {
                    tracing::warn!(agent = %ctx.name, "control socket accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

struct PeerInner {
    /// Declared first so it drops first: a backend may still reference memory the local agent
    /// owns (fields drop in declaration order).
    backend: Arc<dyn PeerBackend>,
    name: String,
    backend_kind: BackendKind,
    local: Arc<AgentCore>,
    /// The peer's regions as its blob listed them: kind and length.
    regions: HashMap<u64, (MemKind, u64)>,
}

/// A connection to one peer over one backend. Cheap to clone; share it between tasks.
#[derive(Clone)]
pub struct Peer {
    inner: Arc<PeerInner>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("name", &self.inner.name)
            .field("backend", &self.inner.backend_kind)
            .finish()
    }
}

impl Peer {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The backend this connection uses.
    pub fn backend(&self) -> BackendKind {
        self.inner.backend_kind
    }

    /// Posts a READ of `descs` (remote -> local). See [`post`](Self::post).
    pub fn read(&self, descs: &[Descriptor]) -> Result<Transfer> {
        self.post(Op::Read, descs, None)
    }

    /// Posts a WRITE of `descs` (local -> remote). See [`post`](Self::post).
    pub fn write(&self, descs: &[Descriptor]) -> Result<Transfer> {
        self.post(Op::Write, descs, None)
    }

    /// Validates `descs` against the local registry and the peer's regions, merges adjacent
    /// descriptors, and returns the transfer's future. Nothing moves until the future is
    /// polled. `notification`, if given (at most 64 KiB), is delivered to the peer's
    /// [`Agent::recv_notification`] after all the data has landed, and never for a transfer
    /// that ends cancelled or failed.
    pub fn post(
        &self,
        op: Op,
        descs: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<Transfer> {
        let t0 = Instant::now();
        let inner = &self.inner;
        if descs.is_empty() {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: "empty descriptor list".into(),
            });
        }
        if let Some(n) = &notification
            && n.len() > MAX_NOTIFICATION_BYTES
        {
            return Err(TransferError::Config {
                reason: format!(
                    "a notification of {} bytes, over the {MAX_NOTIFICATION_BYTES}-byte limit",
                    n.len()
                ),
            });
        }
        let registry = &inner.local.ctx.registry;
        let merged = merge_adjacent(descs);
        let mut segments = Vec::with_capacity(merged.len());
        let mut bytes = 0u64;
        // Validate the caller's list (so errors name the caller's index), then build segments
        // from the merged list; merging only joins ranges already checked.
        let mut last_local: Option<Arc<crate::region::RegionMem>> = None;
        for (i, d) in descs.iter().enumerate() {
            let local = match &last_local {
                Some(r) if r.id == d.local => Arc::clone(r),
                _ => registry.get(d.local)?,
            };
            check_range(i, "local", d.local_offset, d.len, local.len())?;
            let (_, remote_len) =
                inner
                    .regions
                    .get(&d.remote.0)
                    .ok_or_else(|| TransferError::RegionNotFound {
                        agent: inner.name.clone(),
                        region: d.remote.0,
                    })?;
            check_range(i, "remote", d.remote_offset, d.len, *remote_len)?;
            bytes += d.len;
            last_local = Some(local);
        }
        for d in &merged {
            let local = match &last_local {
                Some(r) if r.id == d.local => Arc::clone(r),
                _ => registry.get(d.local)?,
            };
            segments.push(Segment {
                local: Arc::clone(&local),
                local_offset: d.local_offset,
                remote: d.remote.0,
                remote_offset: d.remote_offset,
                len: d.len,
            });
            last_local = Some(local);
        }
        let id = inner.local.next_transfer.fetch_add(1, Ordering::Relaxed);
        let ctl = Arc::new(TransferCtl::new(id));
        let descriptors = segments.len();
        let fut = Arc::clone(&inner.backend).execute(Job {
            op,
            segments,
            notification,
            ctl: Arc::clone(&ctl),
        });
        Ok(Transfer::new(ctl, fut, op, bytes, descriptors, t0)
            .settling(self.inner.backend.tracks_pieces()))
    }

    /// Closes the connections to this peer: every transfer in flight on them fails with
    /// `Disconnected`, and so does every later post (connect again for a new `Peer`). For a
    /// peer that stopped answering: transfers waiting on it then settle
    /// ([`Transfer::settle_handle`]). Shared by every clone of this `Peer`.
    pub fn close(&self) {
        self.inner.backend.close();
    }

    /// The peer's host-memory regions as the blob this connection was made from lists them
    /// (id and length), by id.
    pub fn host_regions(&self) -> Vec<(RegionId, u64)> {
        let mut r: Vec<(RegionId, u64)> = self
            .inner
            .regions
            .iter()
            .filter(|(_, (kind, _))| kind.is_host())
            .map(|(id, (_, len))| (RegionId(*id), *len))
            .collect();
        r.sort_unstable();
        r
    }

    /// Whether the peer lists region `id` in the blob this connection was made from.
    pub fn has_region(&self, id: RegionId) -> bool {
        self.inner.regions.contains_key(&id.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    const DEADLINE: Duration = Duration::from_secs(30);

    fn blob_with(f: impl FnOnce(&mut AgentMetadata)) -> Vec<u8> {
        let mut meta = AgentMetadata {
            name: "other".into(),
            pid: 1,
            token: vec![0; TOKEN_BYTES],
            tcp: None,
            quic: None,
            shm: None,
            ucx: None,
            regions: Vec::new(),
        };
        f(&mut meta);
        meta.encode().unwrap()
    }

    #[tokio::test]
    async fn connect_errors_keep_their_kind() {
        tokio::time::timeout(DEADLINE, async {
            let config = AgentConfig {
                connect_timeout: Duration::from_millis(200),
                ..AgentConfig::default()
            };
            let a = Agent::new("a", config.clone()).await.unwrap();
            // A listener that takes the connection (kernel backlog) but never answers HELLO.
            let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = silent.local_addr().unwrap().to_string();
            let blob = blob_with(|m| m.tcp = Some(addr));
            let e = a.connect(&blob, BackendKind::Tcp).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
            // The blob offers no QUIC and no shared memory.
            for kind in [BackendKind::Quic, BackendKind::Shm] {
                let e = a.connect(&blob, kind).await.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::BackendUnavailable, "{e}");
            }
            // Garbage.
            let e = a.connect(b"junk", BackendKind::Tcp).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Metadata, "{e}");
            // A real agent, but a wrong token in its blob: refused on every backend.
            let b = Agent::new("b", config).await.unwrap();
            let mut meta = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
            meta.token = vec![9; TOKEN_BYTES];
            let forged = meta.encode().unwrap();
            for kind in [BackendKind::Tcp, BackendKind::Quic, BackendKind::Shm] {
                let e = a.connect(&forged, kind).await.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Auth, "{kind}: {e}");
            }
            // A wrong certificate: the QUIC handshake fails.
            let mut meta = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
            if let Some(q) = meta.quic.as_mut() {
                q.cert_der = crate::backend::quic::server_identity().unwrap().1;
            }
            let e = a
                .connect(&meta.encode().unwrap(), BackendKind::Quic)
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
            drop(silent);
        })
        .await
        .expect("the test ran past its deadline");
    }

    #[tokio::test]
    async fn config_and_registration_errors() {
        for bad in [
            AgentConfig {
                tcp_streams: 0,
                ..AgentConfig::default()
            },
            AgentConfig {
                chunk_bytes: 1,
                ..AgentConfig::default()
            },
            AgentConfig {
                listen_ip: std::net::IpAddr::from([0, 0, 0, 0]),
                ..AgentConfig::default()
            },
        ] {
            assert_eq!(
                Agent::new("a", bad).await.unwrap_err().kind(),
                ErrorKind::Config
            );
        }
        assert_eq!(
            Agent::new("", AgentConfig::default())
                .await
                .unwrap_err()
                .kind(),
            ErrorKind::Config
        );
        let a = Agent::new("a", AgentConfig::default()).await.unwrap();
        assert!(a.alloc_dram(0).is_err());
        // SAFETY: a null pointer is refused before anything touches it.
        assert!(unsafe { a.register_raw(std::ptr::null_mut(), 8) }.is_err());
        // Foreign memory: registered, readable and writable through the handle, and listed
        // without a shared-memory path.
        let mut backing = vec![0u8; 4096];
        // SAFETY: `backing` outlives the handle (dropped first, below) and is only accessed
        // through it meanwhile.
        let h = unsafe { a.register_raw(backing.as_mut_ptr(), 4096) }.unwrap();
        h.write_at(10, b"abc").unwrap();
        let mut out = [0u8; 3];
        h.read_at(10, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        assert!(h.shm_path().is_none());
        assert!(h.write_at(4095, b"ab").is_err());
        let meta = AgentMetadata::decode(&a.metadata().unwrap()).unwrap();
        assert!(
            meta.regions
                .iter()
                .any(|r| r.id == h.id().0 && r.shm.is_none())
        );
        drop(h);
        assert_eq!(backing[10..13], *b"abc");
    }
}

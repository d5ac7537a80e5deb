//! UCX (feature `ucx`): one-sided RMA (`ucp_put_nbx` / `ucp_get_nbx`, then `ucp_ep_flush_nbx`)
//! over whatever transports UCX selects (here: tcp, sysv/posix shared memory, cma; RDMA where
//! present), with a TCP control lane of the stream protocol for what RMA cannot do: the
//! region-liveness check after the data and the notification.
//!
//! * Each agent owns a UCP context and one worker, driven by a progress thread. All calls on
//!   the worker happen under one mutex (worker thread mode SERIALIZED). Completion callbacks
//!   run inside `ucp_worker_progress` on the progress thread; they only record (request id,
//!   status) in a thread-local list, which the progress thread then resolves against the
//!   pending table (each entry keeps the local region's memory alive until UCX is done).
//! * Registration maps every host region with `ucp_mem_map` and packs its remote key into the
//!   metadata blob. **Because a remote put cannot be fenced one-sidedly, a region registered
//!   while UCX is on stays mapped (parked) until the agent's UCX worker is destroyed** (the agent
//!   and every peer it created are gone), even after its handle
//!   is dropped: a late put from a peer lands in memory that is still ours, never in freed
//!   memory. Deregistration still takes effect for transfers: after the data, the initiator
//!   asks the target (CHECK over the control lane) whether every remote region it touched is
//!   still registered, and reports `RegionNotFound` if not (region ids are never reused, so
//!   "registered after the data landed" means "registered while it landed").
//! * Peer death: the endpoint's error handler (error mode PEER), failed requests, and the
//!   control lane's EOF all give `Disconnected`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvtier_ucx_sys as sys;

use super::TargetCtx;
use super::stream::Lane;
use super::{BoxFuture, Job, PeerBackend, TransferCtl};
use crate::descriptor::Op;
use crate::error::{Result, TransferError};
use crate::metadata::AgentMetadata;
use crate::region::{RegionMem, Registration};

fn status_text(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static NUL-terminated string for any status.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}

fn unavailable(what: &str, status: sys::ucs_status_t) -> TransferError {
    TransferError::BackendUnavailable {
        backend: "ucx",
        reason: format!("{what}: {}", status_text(status)),
    }
}

fn ok(status: sys::ucs_status_t) -> bool {
    status == sys::UCS_OK as sys::ucs_status_t
}

/// The UCP context; cleaned up when the last worker and region mapping are gone.
struct Shared {
    context: sys::ucp_context_h,
}

// SAFETY: a UCP context created with `mt_workers_shared` may be used from any thread; we
// only call ucp_mem_map/unmap/rkey_pack on it (thread-safe in that mode) and ucp_cleanup once.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: every worker and memory mapping holds an Arc<Shared>, so none is left.
        unsafe { sys::ucp_cleanup(self.context) };
    }
}

/// A region's UCX mapping, unmapped on drop (the region keeps it in its `Registration`).
struct UcxRegion {
    memh: sys::ucp_mem_h,
    shared: Arc<Shared>,
}

// SAFETY: the memory handle is only passed back to ucp_mem_unmap, once, in Drop.
unsafe impl Send for UcxRegion {}
// SAFETY: as above.
unsafe impl Sync for UcxRegion {}

impl Drop for UcxRegion {
    fn drop(&mut self) {
        // SAFETY: `memh` came from ucp_mem_map on this context, which `shared` keeps alive.
        unsafe { sys::ucp_mem_unmap(self.shared.context, self.memh) };
    }
}

struct PendingOp {
    /// `None` once the transfer was told (failed at shutdown) while UCX still holds the request.
    ctl: Option<Arc<TransferCtl>>,
    peer: String,
    /// Keeps the local memory mapped until UCX has finished with it.
    _keep: Option<Arc<RegionMem>>,
}

struct WorkerState {
    handle: sys::ucp_worker_h,
    running: bool,
    next_id: usize,
    pending: HashMap<usize, PendingOp>,
    /// Regions registered with this agent's UCX (parked, see the module docs). Dropped only
    /// after the worker is destroyed (the state outlives `Drop::drop` of the worker).
    retired: Vec<Arc<RegionMem>>,
    /// An endpoint's close did not complete (its peer vanished on a transport without failure
    /// detection): destroying the worker could make UCX touch freed state, so it is leaked.
    stuck: bool,
}

/// One UCP worker, shared by the agent's progress thread and its peers.
struct Worker {
    state: Mutex<WorkerState>,
    /// UCX's event fd for this worker (owned by UCX), when wakeup is supported.
    efd: Option<i32>,
    /// Our eventfd: posts write it so a sleeping progress thread wakes up.
    kick: std::os::fd::OwnedFd,
    _shared: Arc<Shared>,
}

// SAFETY: the worker handle is only used under `state`'s mutex (thread mode SERIALIZED).
unsafe impl Send for Worker {}
// SAFETY: as above.
unsafe impl Sync for Worker {}

impl Drop for Worker {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // Let in-flight protocol traffic (wireup replies to peers that connected to us)
        // settle first: UCX asserts when a worker is destroyed with some of it still queued.
        let start = std::time::Instant::now();
        let mut quiet = 0;
        while quiet < WORKER_DRAIN_QUIET_ROUNDS && start.elapsed() < WORKER_DRAIN_DEADLINE {
            if progress_once(st) == 0 {
                quiet += 1;
                std::thread::yield_now();
            } else {
                quiet = 0;
            }
        }
        // Then flush the whole worker: UCX may still hold requests of its own in transport
        // pending queues (e.g. puts of a cancelled transfer), which a destroy would purge, and
        // purging crashed UCX 1.13 here. A flush that does not finish in time means leaking.
        if !st.stuck && st.pending.is_empty() && !flush_worker(st) {
            st.stuck = true;
        }
        if st.stuck || !st.pending.is_empty() {
            // UCX still holds requests it can no longer finish (their peer vanished on a
            // transport without failure detection): destroying the worker would purge them
            // and, in UCX 1.13, crash. Leak the worker, the memory those requests use and the
            // context instead (a bounded leak in an abnormal path).
            tracing::warn!(
                requests = st.pending.len(),
                "UCX worker has unfinished requests at teardown; leaking it"
            );
            std::mem::forget(std::mem::take(&mut st.pending));
            std::mem::forget(std::mem::take(&mut st.retired));
            std::mem::forget(Arc::clone(&self._shared));
            return;
        }
        // SAFETY: the last user of the worker is gone (peers hold Arcs and close their
        // endpoints first) and no request is outstanding; the parked regions drop after this.
        unsafe { sys::ucp_worker_destroy(st.handle) };
    }
}

thread_local! {
    static COMPLETIONS: RefCell<Vec<(usize, sys::ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    COMPLETIONS.with(|c| c.borrow_mut().push((user_data as usize, status)));
    // SAFETY: `request` is the request this callback completes; freeing it here is allowed.
    unsafe { sys::ucp_request_free(request) };
}

/// One `ucp_worker_progress` call, then the completions its callbacks recorded resolved
/// against the pending table. The caller holds the worker's mutex.
fn progress_once(st: &mut WorkerState) -> u32 {
    // SAFETY: the worker handle is live for as long as the state exists, and the caller
    // holds the mutex (thread mode SERIALIZED).
    let n = unsafe { sys::ucp_worker_progress(st.handle) };
    let done = COMPLETIONS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    for (id, status) in done {
        if let Some(PendingOp {
            ctl: Some(ctl),
            peer,
            ..
        }) = st.pending.remove(&id)
        {
            if ok(status) {
                ctl.complete_one();
            } else {
                ctl.fail(TransferError::disconnected(
                    &peer,
                    format!("UCX operation failed: {}", status_text(status)),
                ));
            }
        }
    }
    n
}

/// Progress rounds without events that end a worker's drain before it is destroyed.
const WORKER_DRAIN_QUIET_ROUNDS: u32 = 200;
/// Longest drain of a worker before it is destroyed.
const WORKER_DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a progress thread keeps polling after its last event before it sleeps.
const PROGRESS_SPIN: std::time::Duration = std::time::Duration::from_millis(2);

/// Longest sleep of an idle progress thread between checks of its stop flag.
const PROGRESS_SLEEP_MS: i32 = 100;

/// Deadline for driving an endpoint's close to completion.
const EP_CLOSE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

impl Worker {
    fn progress_loop(self: Arc<Self>, stop: Arc<AtomicBool>) {
        let mut idle = 0u32;
        let mut last_activity = std::time::Instant::now();
        while !stop.load(Ordering::Acquire) {
            let (n, armed) = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if !st.running {
                    break;
                }
                let n = progress_once(&mut st);
                // Busy-poll for a short window after the last activity (bursts of transfers
                // see no wake-up latency); then arm the worker's event fd and sleep on it
                // (UCS_OK: safe to sleep; BUSY: events are pending, progress again).
                let armed = n == 0
                    && last_activity.elapsed() >= PROGRESS_SPIN
                    && self.efd.is_some()
                    // SAFETY: the worker is live and locked.
                    && ok(unsafe { sys::ucp_worker_arm(st.handle) });
                (n, armed)
            };
            if n > 0 {
                idle = 0;
                last_activity = std::time::Instant::now();
                continue;
            }
            if armed {
                if self.sleep_on_events() {
                    last_activity = std::time::Instant::now();
                }
                continue;
            }
            idle += 1;
            if idle < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Sleeps until UCX's event fd or our kick fd is readable (or a bounded timeout); returns
    /// whether one was.
    fn sleep_on_events(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(efd) = self.efd else {
            return false;
        };
        let mut fds = [
            libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.kick.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd structs for the call's duration.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, PROGRESS_SLEEP_MS) };
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `buf` from our non-blocking eventfd.
        unsafe { libc::read(self.kick.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        ready > 0
    }

    /// Wakes the progress thread if it sleeps (after a post, or to stop it).
    fn kick(&self) {
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from `one` to our non-blocking eventfd; a full counter
        // (EAGAIN) already means "wake up".
        unsafe { libc::write(self.kick.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Resolves a status pointer returned by a non-blocking call: immediate completion,
    /// immediate error, or a request tracked as pending for `ctl`.
    fn track(
        st: &mut WorkerState,
        id: usize,
        ptr: sys::ucs_status_ptr_t,
        ctl: &Arc<TransferCtl>,
        peer: &str,
        keep: Option<Arc<RegionMem>>,
    ) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        if sys::ucs_ptr_is_err(ptr) {
            return Err(TransferError::disconnected(
                peer,
                format!("UCX: {}", status_text(sys::ucs_ptr_status(ptr))),
            ));
        }
        ctl.add_outstanding(1);
        st.pending.insert(
            id,
            PendingOp {
                ctl: Some(Arc::clone(ctl)),
                peer: peer.to_owned(),
                _keep: keep,
            },
        );
        Ok(())
    }
}

/// An agent's UCX side.
pub(crate) struct UcxContext {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
    address: Vec<u8>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    me: String,
    /// Set once an endpoint could not be created with peer-failure detection (shared-memory
    /// transports), so later endpoints skip the attempt (and UCX's error message).
    no_peer_failure_mode: AtomicBool,
}

impl UcxContext {
    /// Creates the context and worker (restricted to `transports`, UCX's `TLS` setting, when
    /// given) and starts the progress thread.
    pub(crate) fn start(ctx: Arc<TargetCtx>, transports: Option<&str>) -> Result<Arc<Self>> {
        // SAFETY: plain UCP initialisation per ucp.h; every out-pointer is a local, every
        // handle is released on the error paths or owned by the returned value.
        unsafe {
            let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
            let s = sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config);
            if !ok(s) {
                return Err(unavailable("ucp_config_read", s));
            }
            if let Some(tls) = transports {
                let name = CString::from(c"TLS");
                let value = CString::new(tls).map_err(|_| TransferError::Config {
                    reason: "UCX transports hold a NUL byte".into(),
                })?;
                let s = sys::ucp_config_modify(config, name.as_ptr(), value.as_ptr());
                if !ok(s) {
                    sys::ucp_config_release(config);
                    return Err(unavailable("ucp_config_modify TLS", s));
                }
            }
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask =
                (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
            params.mt_workers_shared = 1;
            let mut context: sys::ucp_context_h = std::ptr::null_mut();
            // Ask for wakeup support (the progress thread then sleeps on UCX's event fd);
            // without it, the thread polls.
            params.features = (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP) as u64;
            let mut s = sys::ucp_init(&params, config, &mut context);
            if !ok(s) {
                params.features = sys::UCP_FEATURE_RMA as u64;
                s = sys::ucp_init(&params, config, &mut context);
            }
            sys::ucp_config_release(config);
            if !ok(s) {
                return Err(unavailable("ucp_init", s));
            }
            let shared = Arc::new(Shared { context });
            let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wp.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
            let mut handle: sys::ucp_worker_h = std::ptr::null_mut();
            let s = sys::ucp_worker_create(context, &wp, &mut handle);
            if !ok(s) {
                return Err(unavailable("ucp_worker_create", s));
            }
            let mut efd: std::os::raw::c_int = -1;
            let efd = if ok(sys::ucp_worker_get_efd(handle, &mut efd)) && efd >= 0 {
                Some(efd)
            } else {
                None
            };
            let kick = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
            if kick < 0 {
                sys::ucp_worker_destroy(handle);
                return Err(TransferError::io(
                    "eventfd for the UCX progress thread",
                    std::io::Error::last_os_error(),
                ));
            }
            let kick = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(kick);
            let worker = Arc::new(Worker {
                state: Mutex::new(WorkerState {
                    handle,
                    running: true,
                    next_id: 1,
                    pending: HashMap::new(),
                    retired: Vec::new(),
                    stuck: false,
                }),
                efd,
                kick,
                _shared: Arc::clone(&shared),
            });
            let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
            let mut len = 0usize;
            let s = sys::ucp_worker_get_address(handle, &mut addr, &mut len);
            if !ok(s) {
                return Err(unavailable("ucp_worker_get_address", s));
            }
            let address = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            sys::ucp_worker_release_address(handle, addr);
            let stop = Arc::new(AtomicBool::new(false));
            let (w, st) = (Arc::clone(&worker), Arc::clone(&stop));
            let thread = std::thread::Builder::new()
                .name(format!("kvtier-ucx-{}", ctx.name))
                .spawn(move || w.progress_loop(st))
                .map_err(|e| TransferError::io("spawning the UCX progress thread", e))?;
            Ok(Arc::new(Self {
                shared,
                worker,
                address,
                stop,
                thread: Mutex::new(Some(thread)),
                me: ctx.name.clone(),
                no_peer_failure_mode: AtomicBool::new(false),
            }))
        }
    }

    pub(crate) fn worker_address(&self) -> &[u8] {
        &self.address
    }

    /// Maps a host region with UCX and packs its remote key; the region is parked (see the
    /// module docs).
    pub(crate) fn register(&self, region: &Arc<RegionMem>) -> Result<()> {
        if !region.kind.is_host() {
            return Ok(());
        }
        // SAFETY: the region's memory is mapped for `len` bytes and stays so while the
        // mapping exists (the mapping lives inside the region, and the region is parked).
        unsafe {
            let mut mp: sys::ucp_mem_map_params_t = std::mem::zeroed();
            mp.field_mask =
                (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            mp.address = region.ptr().cast();
            mp.length = region.len() as usize;
            let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
            let s = sys::ucp_mem_map(self.shared.context, &mp, &mut memh);
            if !ok(s) {
                return Err(unavailable("ucp_mem_map", s));
            }
            let mut buf: *mut c_void = std::ptr::null_mut();
            let mut size = 0usize;
            let s = sys::ucp_rkey_pack(self.shared.context, memh, &mut buf, &mut size);
            if !ok(s) {
                sys::ucp_mem_unmap(self.shared.context, memh);
                return Err(unavailable("ucp_rkey_pack", s));
            }
            let rkey = std::slice::from_raw_parts(buf as *const u8, size).to_vec();
            sys::ucp_rkey_buffer_release(buf);
            let handle = UcxRegion {
                memh,
                shared: Arc::clone(&self.shared),
            };
            let _ = region.ucx.set(Registration::new(rkey, Box::new(handle)));
        }
        self.worker
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retired
            .push(Arc::clone(region));
        Ok(())
    }

    /// Stops the progress thread and fails every pending operation.
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.worker.kick();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        let drained: Vec<(Arc<TransferCtl>, String)> = {
            let mut st = self.worker.state.lock().unwrap_or_else(|p| p.into_inner());
            st.running = false;
            // UCX still owns these requests: the entries (and the memory they keep mapped)
            // stay until UCX completes them or the worker goes; only their waiters are told.
            st.pending
                .values_mut()
                .filter_map(|op| op.ctl.take().map(|c| (c, op.peer.clone())))
                .collect()
        };
        for (ctl, peer) in drained {
            ctl.fail(TransferError::disconnected(
                &peer,
                "the local agent shut down",
            ));
        }
        // Parked regions are released with the worker, once the peers are gone too.
    }

    /// Connects to a peer: an endpoint to its worker, its remote keys unpacked, and a TCP
    /// control lane.
    pub(crate) async fn connect(
        &self,
        meta: &AgentMetadata,
        chunk_bytes: u64,
    ) -> Result<Arc<UcxPeer>> {
        let address = meta
            .ucx
            .as_ref()
            .ok_or_else(|| TransferError::BackendUnavailable {
                backend: "ucx",
                reason: format!("agent {} does not offer UCX", meta.name),
            })?;
        let tcp = meta
            .tcp
            .as_deref()
            .ok_or_else(|| TransferError::BackendUnavailable {
                backend: "ucx",
                reason: format!("agent {} offers no TCP control channel", meta.name),
            })?;
        let tcp = crate::metadata::parse_addr("tcp", tcp)?;
        let sock = tokio::net::TcpStream::connect(tcp).await.map_err(|e| {
            TransferError::disconnected(&meta.name, format!("control connect to {tcp}: {e}"))
        })?;
        sock.set_nodelay(true)
            .map_err(|e| TransferError::io("TCP_NODELAY", e))?;
        let (r, w) = sock.into_split();
        let control = Lane::start(&meta.name, &self.me, &meta.token, r, w).await?;
        let dead = Arc::new(AtomicBool::new(false));
        let (ep, rkeys) = {
            let mut st = self.worker.state.lock().unwrap_or_else(|p| p.into_inner());
            if !st.running {
                return Err(TransferError::disconnected(
                    &meta.name,
                    "the local agent shut down",
                ));
            }
            // SAFETY: the worker is live and used under the mutex; `address` is the peer's
            // worker address as UCX packed it (UCX validates it); the error-handler argument
            // is a leaked Arc reclaimed in UcxPeer's Drop after the endpoint is closed.
            unsafe {
                let err_arg = Arc::into_raw(Arc::clone(&dead)) as *mut c_void;
                let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
                // Peer-failure detection where the transports support it; UCX's shared-memory
                // transports do not, and there the control lane's EOF reports a dead peer.
                let mut s = sys::UCS_ERR_UNREACHABLE as sys::ucs_status_t;
                let skip_handler = self.no_peer_failure_mode.load(Ordering::Relaxed);
                let mut peer_failure = false;
                for with_handler in [true, false] {
                    if with_handler && skip_handler {
                        continue;
                    }
                    let mut ep_params: sys::ucp_ep_params_t = std::mem::zeroed();
                    ep_params.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                    ep_params.address = address.as_ptr().cast();
                    if with_handler {
                        ep_params.field_mask |= (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER)
                            as u64;
                        ep_params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
                        ep_params.err_handler.cb = Some(ep_error);
                        ep_params.err_handler.arg = err_arg;
                    }
                    s = sys::ucp_ep_create(st.handle, &ep_params, &mut ep);
                    if ok(s) {
                        peer_failure = with_handler;
                        break;
                    }
                    if with_handler {
                        self.no_peer_failure_mode.store(true, Ordering::Relaxed);
                    }
                }
                if !ok(s) {
                    drop(Arc::from_raw(err_arg as *const AtomicBool));
                    return Err(TransferError::disconnected(
                        &meta.name,
                        format!("ucp_ep_create: {}", status_text(s)),
                    ));
                }
                let mut rkeys = HashMap::new();
                for r in &meta.regions {
                    if let Some(k) = &r.ucx_rkey {
                        let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
                        let s = sys::ucp_ep_rkey_unpack(ep, k.as_ptr().cast(), &mut rkey);
                        if !ok(s) {
                            for (_, (rk, _)) in rkeys.drain() {
                                sys::ucp_rkey_destroy(rk);
                            }
                            close_ep(&mut st, ep, peer_failure);
                            drop(Arc::from_raw(err_arg as *const AtomicBool));
                            return Err(TransferError::Metadata {
                                reason: format!(
                                    "region {}: bad UCX remote key: {}",
                                    r.id,
                                    status_text(s)
                                ),
                            });
                        }
                        rkeys.insert(r.id, (rkey, r.addr));
                    }
                }
                (
                    Ep {
                        ep,
                        err_arg,
                        peer_failure,
                    },
                    rkeys,
                )
            }
        };
        let peer = Arc::new(UcxPeer {
            peer: meta.name.clone(),
            worker: Arc::clone(&self.worker),
            ep,
            rkeys,
            dead,
            control,
            chunk_bytes,
        });
        // Finish the endpoint's wireup now (a flush completes once the connection is up), so
        // no wireup message is still queued when either side is torn down: UCX asserts when a
        // worker is destroyed with one pending. Bounded by the agent's connect timeout.
        let ctl = Arc::new(TransferCtl::new(0));
        peer.flush(&ctl)?;
        tokio::select! {
            r = ctl.wait_outstanding(false) => r?,
            e = peer.control.dead() => return Err(e),
        }
        Ok(peer)
    }
}

impl Drop for UcxContext {
    fn drop(&mut self) {
        self.shutdown();
    }
}

unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, _status: sys::ucs_status_t) {
    // SAFETY: `arg` is the Arc<AtomicBool> leaked in `connect`, alive until the peer drops
    // (after its endpoint is closed, so no callback runs later).
    let dead = unsafe { &*(arg as *const AtomicBool) };
    dead.store(true, Ordering::Release);
}

/// Flushes every endpoint of the worker and drives it until the flush completes, bounded by
/// [`EP_CLOSE_DEADLINE`]; false when it did not complete (or could not start).
fn flush_worker(st: &mut WorkerState) -> bool {
    // SAFETY: the worker is live and `st` is its state, held exclusively (worker teardown).
    unsafe {
        let p: sys::ucp_request_param_t = std::mem::zeroed();
        let req = sys::ucp_worker_flush_nbx(st.handle, &p);
        !sys::ucs_ptr_is_err(req) && drive_request(st, req)
    }
}

/// Drives the worker until the request `req` (as returned by a `_nbx` call that did not fail)
/// completes, bounded by [`EP_CLOSE_DEADLINE`]; frees it when it did. False when it is still
/// in progress (and so must not be freed: the worker is then leaked, see `WorkerState::stuck`).
///
/// # Safety
/// `st`'s worker must be live and held exclusively; `req` is not used by the caller afterwards.
unsafe fn drive_request(st: &mut WorkerState, req: *mut c_void) -> bool {
    if !sys::ucs_ptr_is_ptr(req) {
        return true; // completed at once
    }
    // SAFETY: per the function contract, `req` is a live request of this worker.
    unsafe {
        let in_progress =
            || sys::ucp_request_check_status(req) == sys::UCS_INPROGRESS as sys::ucs_status_t;
        let start = std::time::Instant::now();
        while in_progress() && start.elapsed() < EP_CLOSE_DEADLINE {
            progress_once(st);
        }
        if in_progress() {
            return false;
        }
        sys::ucp_request_free(req);
    }
    true
}

/// Closes an endpoint (in force mode where it has peer-failure handling: outstanding requests
/// complete as cancelled; otherwise by flushing) and drives the worker until the close
/// completes, bounded by [`EP_CLOSE_DEADLINE`]; a close that does not complete marks the
/// worker stuck (see `WorkerState::stuck`).
///
/// # Safety
/// `st`'s worker must be live and its mutex held by the caller; `ep` an endpoint of it, not
/// used again.
unsafe fn close_ep(st: &mut WorkerState, ep: sys::ucp_ep_h, force: bool) {
    // SAFETY: per the function contract.
    unsafe {
        let mut p: sys::ucp_request_param_t = std::mem::zeroed();
        if force {
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        let req = sys::ucp_ep_close_nbx(ep, &p);
        if !sys::ucs_ptr_is_err(req) && !drive_request(st, req) {
            st.stuck = true;
        }
        progress_once(st);
    }
}

struct Ep {
    ep: sys::ucp_ep_h,
    err_arg: *mut c_void,
    /// Created with peer-failure handling (so it may be closed in force mode).
    peer_failure: bool,
}

/// A peer reached by UCX RMA.
pub(crate) struct UcxPeer {
    peer: String,
    worker: Arc<Worker>,
    ep: Ep,
    /// Region id -> (unpacked remote key, remote base address).
    rkeys: HashMap<u64, (sys::ucp_rkey_h, u64)>,
    dead: Arc<AtomicBool>,
    control: Arc<Lane>,
    chunk_bytes: u64,
}

// SAFETY: the endpoint and remote keys are only used under the worker's mutex.
unsafe impl Send for UcxPeer {}
// SAFETY: as above.
unsafe impl Sync for UcxPeer {}

impl Drop for UcxPeer {
    fn drop(&mut self) {
        let mut st = self.worker.state.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the keys and endpoint belong to this worker (alive: we hold an Arc) and are
        // not used again; the error-handler Arc is reclaimed after the endpoint is closed.
        unsafe {
            for (_, (rk, _)) in self.rkeys.drain() {
                sys::ucp_rkey_destroy(rk);
            }
            close_ep(&mut st, self.ep.ep, self.ep.peer_failure);
            drop(Arc::from_raw(self.ep.err_arg as *const AtomicBool));
        }
    }
}

impl UcxPeer {
    fn check_alive(&self) -> Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return Err(TransferError::disconnected(
                &self.peer,
                "UCX endpoint failed",
            ));
        }
        if let Some(reason) = self.control.dead_reason() {
            return Err(TransferError::disconnected(&self.peer, reason));
        }
        Ok(())
    }

    /// Posts one RMA chunk (the arguments are the chunk's two sides, kept flat on purpose).
    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        op: Op,
        ctl: &Arc<TransferCtl>,
        local: &Arc<RegionMem>,
        local_off: u64,
        rkey: sys::ucp_rkey_h,
        remote_addr: u64,
        len: u64,
    ) -> Result<()> {
        let mut st = self.worker.state.lock().unwrap_or_else(|p| p.into_inner());
        if !st.running {
            return Err(TransferError::disconnected(
                &self.peer,
                "the local agent shut down",
            ));
        }
        let id = st.next_id;
        st.next_id += 1;
        // SAFETY: the worker is live and locked; the local range was validated against the
        // region (kept alive by the pending entry until UCX completes); the remote address
        // and key come from the peer's blob and were validated against its region lengths.
        let ptr = unsafe {
            let mut p: sys::ucp_request_param_t = std::mem::zeroed();
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
            p.cb.send = Some(send_cb);
            p.user_data = id as *mut c_void;
            let buf = local.ptr().add(local_off as usize);
            match op {
                Op::Write => {
                    sys::ucp_put_nbx(self.ep.ep, buf.cast(), len as usize, remote_addr, rkey, &p)
                }
                Op::Read => {
                    sys::ucp_get_nbx(self.ep.ep, buf.cast(), len as usize, remote_addr, rkey, &p)
                }
            }
        };
        let r = Worker::track(&mut st, id, ptr, ctl, &self.peer, Some(Arc::clone(local)));
        drop(st);
        self.worker.kick();
        r
    }

    fn flush(&self, ctl: &Arc<TransferCtl>) -> Result<()> {
        let mut st = self.worker.state.lock().unwrap_or_else(|p| p.into_inner());
        if !st.running {
            return Err(TransferError::disconnected(
                &self.peer,
                "the local agent shut down",
            ));
        }
        let id = st.next_id;
        st.next_id += 1;
        // SAFETY: the worker is live and locked; the endpoint is ours.
        let ptr = unsafe {
            let mut p: sys::ucp_request_param_t = std::mem::zeroed();
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
            p.cb.send = Some(send_cb);
            p.user_data = id as *mut c_void;
            sys::ucp_ep_flush_nbx(self.ep.ep, &p)
        };
        let r = Worker::track(&mut st, id, ptr, ctl, &self.peer, None);
        drop(st);
        self.worker.kick();
        r
    }

    async fn run(&self, job: Job) -> Result<()> {
        let ctl = &job.ctl;
        let control = &self.control;
        let mut regions: Vec<u64> = Vec::new();
        for seg in &job.segments {
            if !seg.local.kind.is_host() {
                return Err(TransferError::BackendUnavailable {
                    backend: "ucx",
                    reason: format!("local region {} is not host memory", seg.local.id),
                });
            }
            let (rkey, base) =
                *self
                    .rkeys
                    .get(&seg.remote)
                    .ok_or_else(|| TransferError::BackendUnavailable {
                        backend: "ucx",
                        reason: format!("region {} of {} has no UCX key", seg.remote, self.peer),
                    })?;
            if !regions.contains(&seg.remote) {
                regions.push(seg.remote);
            }
            let mut done = 0u64;
            while done < seg.len {
                ctl.check()?;
                self.check_alive()?;
                seg.local.check_live()?;
                let n = (seg.len - done).min(self.chunk_bytes);
                self.post(
                    job.op,
                    ctl,
                    &seg.local,
                    seg.local_offset + done,
                    rkey,
                    base + seg.remote_offset + done,
                    n,
                )?;
                done += n;
            }
        }
        self.flush(ctl)?;
        // Transports without peer-failure detection (shared memory) may never complete a
        // request to a dead peer: the control lane's death ends the wait.
        tokio::select! {
            r = ctl.wait_outstanding(true) => r?,
            e = control.dead() => return Err(e),
        }
        self.check_alive()?;
        super::check_local_live(&job.segments)?;
        for region in regions {
            control.check_region(ctl, region).await?;
        }
        if let Some(message) = job.notification {
            control.notify(ctl, message).await?;
        }
        Ok(())
    }
}

impl PeerBackend for UcxPeer {
    fn execute(self: Arc<Self>, job: Job) -> BoxFuture {
        Box::pin(async move { self.run(job).await })
    }
}

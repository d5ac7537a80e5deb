//! One client connection: a reader loop that decodes frames and dispatches requests (puts
//! inline, straight from the socket into reserved slots; everything else on its own task, so
//! requests pipeline), and a writer task that sends responses, streaming get payloads from
//! pinned DRAM slots without copying them.
//!
//! **Invariant:** every pin and reservation a connection takes is released when it ends,
//! whatever way it ends (EOF, error, timeout, shutdown, a killed client): they live in the
//! connection's [`ConnState`], which releases them on drop.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::BlockKey;
use kvtier_core::protocol::{
    BlockSource, ErrorCode, ErrorReply, Events, FetchReply, FrameError, HEADER_BYTES,
    HEADER_VERSION, Header, Hello, HelloReply, LocateReply, MIN_VERSION, MissCode, Opcode,
    PinReply, PinnedSlot, PutEntry, PutReply, PutStatus, Request, ReserveReply, ReservedSlot,
    Response, RetainReply, RetainStatus, TierCode, VERSION, flags,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::brakes::{AuthGate, PreHelloSlot, token_matches};
use super::events::tier_code;
use super::metrics::{Metrics, Transport};
use super::shares::{Charge, Share, ShareKind};
use super::staging::Staging;
use super::tenants::{Admit, Identity, Registration};
use crate::policy::admission::RejectReason;
use crate::{
    LookupHold, MissReason, PinnedRead, PutOutcome, Reservation, RetainOutcome, RetainRequest,
    StoreError, TierKind,
};

/// Responses queued for the writer of one connection.
const OUT_QUEUE: usize = 256;
/// Event subscriptions one connection may hold.
const MAX_SUBSCRIPTIONS: usize = 4;
/// Events sent in one frame at most.
const EVENT_BATCH: usize = 1024;
/// How often a connection drops its expired reservations.
const RESERVATION_REAP: Duration = Duration::from_millis(100);
/// A commit copying more than this many bytes out of the staging region runs on the
/// blocking pool, not on a runtime worker.
const COPY_INLINE_BYTES: u64 = 4 << 20;
/// A peer's fetch of at most this many block bytes has its sums hashed on the runtime
/// worker (XXH3: tens of µs), not on the blocking pool, whose hand-off costs as much.
pub(super) const INLINE_SUM_BYTES: usize = 512 << 10;
/// How long a put (or a reservation) waits, at most, for a DRAM slot while every slot is
/// pinned and background copies (write-through to NVMe, which pin their DRAM slot until
/// written) are running: those copies free slots as they finish, so a chain longer than
/// DRAM is paced by the NVMe writes instead of refused.
const SLOT_WAIT: Duration = Duration::from_secs(2);
/// How often a waiting put tries again for a slot.
const SLOT_POLL: Duration = Duration::from_millis(1);
/// A lookup, get or pin that meets a block still being stored (announced by a put in
/// flight, or reserved and not yet committed) waits for its commit at most this long without
/// progress...
const PENDING_STALL: Duration = Duration::from_millis(50);
/// ...and at most this long in all.
const PENDING_WAIT: Duration = Duration::from_millis(500);
/// How often a waiting read looks again.
const PENDING_POLL: Duration = Duration::from_millis(1);
/// Global in-flight byte budget is counted in units of this many bytes.
pub(crate) const BUDGET_UNIT: u64 = 4096;
/// Metadata bytes a frame may carry before its connection has said hello (a hello needs
/// about 1.3 KiB): an unauthenticated peer cannot make the server allocate more.
pub(crate) const PRE_HELLO_META_BYTES: u32 = 4096;

/// A response on its way to the writer.
pub(crate) struct Out {
    head: [u8; HEADER_BYTES],
    meta: Vec<u8>,
    /// Get payload: written straight from the pinned slots, which stay pinned until sent.
    pinned: Option<PinnedRead>,
    /// The DRAM arena (read-only) and the staging region, passed with this frame over the
    /// Unix socket.
    fds: Vec<OwnedFd>,
    /// In-flight byte budget held until the payload is written.
    _budget: Option<OwnedSemaphorePermit>,
    /// Its namespace's part of that budget, held as long.
    _budget_share: Option<Charge>,
    /// This connection's queued-bytes budget, held until the frame is written.
    _queued: Option<OwnedSemaphorePermit>,
}

impl Out {
    fn new(id: u64, op: u8, r: &Response, payload_len: u64) -> Self {
        let (fl, meta) = r.encode_meta();
        let h = Header {
            version: HEADER_VERSION,
            opcode: op,
            flags: fl,
            request_id: id,
            meta_len: meta.len() as u32,
            payload_len,
        };
        Self {
            head: h.encode(),
            meta,
            pinned: None,
            fds: Vec::new(),
            _budget: None,
            _budget_share: None,
            _queued: None,
        }
    }

    fn error(id: u64, op: u8, code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(
            id,
            op,
            &Response::Error(ErrorReply {
                code: code as u16,
                message: message.into(),
            }),
            0,
        )
    }
}

/// Where a connection's responses go: the writer's queue, bounded in count
/// ([`OUT_QUEUE`]) and in bytes (`limits.max_queued_bytes_per_connection`, counted in
/// [`BUDGET_UNIT`]s).
#[derive(Clone)]
struct Outbox {
    tx: mpsc::Sender<Out>,
    queued: Arc<Semaphore>,
    /// The whole queued-bytes budget, in units (a frame larger than it takes all of it).
    cap_units: u32,
    /// Cancelled when the writer gave up (write error or timeout): the connection ends.
    closing: CancellationToken,
}

impl Outbox {
    fn units(&self, bytes: u64) -> u32 {
        (bytes.div_ceil(BUDGET_UNIT).min(u64::from(self.cap_units)) as u32).max(1)
    }

    /// Queues `o`, waiting for queue room; false when the connection is closing.
    async fn send(&self, mut o: Out) -> bool {
        if o._queued.is_none() {
            let units = self.units((HEADER_BYTES + o.meta.len()) as u64);
            let p = tokio::select! {
                _ = self.closing.cancelled() => return false,
                p = self.queued.clone().acquire_many_owned(units) => p,
            };
            match p {
                Ok(p) => o._queued = Some(p),
                Err(_) => return false,
            }
        }
        tokio::select! {
            _ = self.closing.cancelled() => false,
            r = self.tx.send(o) => r.is_ok(),
        }
    }

    /// Room for a frame of `bytes` (a get's payload and metadata) now, or `None`.
    fn try_reserve(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        self.queued
            .clone()
            .try_acquire_many_owned(self.units(bytes))
            .ok()
    }
}

/// How a connection arrived.
pub(crate) struct Peer {
    pub transport: Transport,
    /// The peer's address (TCP, QUIC): failed hellos are charged to it.
    pub ip: Option<IpAddr>,
    /// Its place among network connections before hello, given back at hello.
    pub pre_hello: Option<PreHelloSlot>,
    /// The peer's uid (Unix socket, `SO_PEERCRED`): it names the tenant with `[tenants]`.
    pub uid: Option<u32>,
    /// The SHA-256 of the client certificate it presented (TLS, QUIC), if any.
    pub cert_sha256: Option<[u8; 32]>,
}

/// A reserved DRAM slot and the staging place its client writes the block into.
struct Staged {
    slot: Reservation,
    place: u32,
}

/// A reservation of a local client: its slots are freed and its staging places given back
/// when it drops (committed, aborted, expired or its connection gone). The client never
/// wrote the slots (the arena is read-only to it), so they are reused at once.
struct ReservationRecord {
    staging: Arc<Staging>,
    slots: Vec<Option<Staged>>,
    statuses: Vec<u8>,
    deadline: Instant,
    /// The reserved keys' places in their namespace, held until the record drops.
    _names: Vec<Registration>,
    /// Every entry's internal key and parent, for the cluster's offers at commit (empty
    /// without a cluster data path: nothing to offer).
    chain: Vec<(BlockKey, Option<BlockKey>)>,
}

impl Drop for ReservationRecord {
    fn drop(&mut self) {
        for s in self.slots.drain(..).flatten() {
            self.staging.give_back(s.place);
        }
    }
}

/// A pin lease of a connection: its deadline, and the DRAM blocks it holds charged to the
/// connection's share and its namespace's (given back when the lease is forgotten).
struct HeldLease {
    deadline: Instant,
    _charges: (Charge, Charge),
}

/// Pins and reservations held by one connection; all released on drop.
struct ConnState {
    shared: Arc<Shared>,
    leases: HashMap<u64, HeldLease>,
    /// DRAM blocks the leases hold (`limits.max_pinned_blocks_per_connection`).
    pins: Arc<Share>,
    /// Its place among its namespace's connections (`limits.max_connections_per_tenant`).
    place: Option<Charge>,
    /// Held lookups not yet loaded: (lease id, blocks held, last held key), oldest first.
    holds: std::collections::VecDeque<(u64, usize, BlockKey)>,
    reservations: HashMap<u64, ReservationRecord>,
    next_reservation: u64,
    /// The staging region passed at hello (local connections with the arena).
    staging: Option<Arc<Staging>>,
}

/// Held lookups one connection may keep unloaded; a newer one releases the oldest.
const MAX_HOLDS_PER_CONNECTION: usize = 64;

impl ConnState {
    /// Remembers a held lookup of this connection until its load.
    fn remember_hold(&mut self, hold: LookupHold, keys: &[BlockKey]) {
        if let LookupHold::Held { lease_id, blocks } = hold {
            if self.holds.len() >= MAX_HOLDS_PER_CONNECTION
                && let Some((old, _, _)) = self.holds.pop_front()
            {
                self.shared.store.release(old);
            }
            self.holds.push_back((lease_id, blocks, keys[blocks - 1]));
        }
    }

    /// A load of `keys` has pinned what it reads: releases the hold of a lookup of the same
    /// prefix, if this connection has one.
    fn loaded(&mut self, keys: &[BlockKey]) {
        let i = self
            .holds
            .iter()
            .position(|&(_, n, last)| keys.get(n.wrapping_sub(1)) == Some(&last));
        if let Some((id, _, _)) = i.and_then(|i| self.holds.remove(i)) {
            self.shared.store.release(id);
        }
    }

    /// A put continues a chain after `parent`: the request that held a lookup ending there
    /// has read its prefix (a zero-copy reader reads the arena without asking the server),
    /// so its hold is released.
    fn continued(&mut self, parent: BlockKey) {
        let i = self.holds.iter().position(|&(_, _, last)| last == parent);
        if let Some((id, _, _)) = i.and_then(|i| self.holds.remove(i)) {
            self.shared.store.release(id);
        }
    }

    fn reap(&mut self, now: Instant) {
        let before = self.reservations.len();
        let expired: Vec<u64> = self
            .reservations
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.reservations.remove(&id);
        }
        let gone = before - self.reservations.len();
        self.shared.metrics.reservations_open.sub(gone as i64);
        // The store releases expired leases on its own; forget ours.
        let before = self.leases.len();
        self.leases.retain(|_, l| l.deadline > now);
        let gone = before - self.leases.len();
        self.shared.metrics.leases_open.sub(gone as i64);
    }
}

impl Drop for ConnState {
    fn drop(&mut self) {
        for id in self.leases.keys() {
            self.shared.store.release(*id);
        }
        for (id, _, _) in &self.holds {
            self.shared.store.release(*id);
        }
        let m = &self.shared.metrics;
        m.leases_open.sub(self.leases.len() as i64);
        m.reservations_open.sub(self.reservations.len() as i64);
        // Reservations free their slots as they drop.
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Conn {
    shared: Arc<Shared>,
    transport: Transport,
    ip: Option<IpAddr>,
    uid: Option<u32>,
    cert_sha256: Option<[u8; 32]>,
    pre_hello: Option<PreHelloSlot>,
    /// The hello must arrive whole by then.
    hello_by: tokio::time::Instant,
    out: Outbox,
    state: Arc<Mutex<ConnState>>,
    inflight: Arc<Semaphore>,
    /// Ends this connection's subscriptions and reaper.
    done: CancellationToken,
    local_arena: bool,
    subscriptions: usize,
    /// Who the connection is (from its hello's credential).
    who: Identity,
    /// A cluster peer (its hello carried the peer token): internal keys, local-only
    /// requests (`server/remote.rs` is never entered for it), no admin.
    peer: bool,
    /// The protocol version its hello agreed on (what the replies' metadata follows).
    version: u16,
}

/// What a cluster peer may ask: the data path's own operations.
fn peer_may(req: &Request) -> bool {
    matches!(
        req,
        Request::Ping
            | Request::Lookup(_)
            | Request::Fetch(_)
            | Request::Locate { .. }
            | Request::Release { .. }
            | Request::Put(_)
    )
}

enum ReadEnd {
    /// Clean end: EOF, shutdown, or idle.
    Closed,
    /// Closed after an error the peer was told about (or could not be told).
    Dropped,
}

/// Serves one connection until it ends. `sock` is the Unix socket's fd (for passing the
/// arena); `None` on other transports.
pub(crate) async fn serve<R, W>(shared: Arc<Shared>, peer: Peer, rd: R, wr: W, sock: Option<RawFd>)
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let hello_by = tokio::time::Instant::now() + shared.config.hello_timeout();
    serve_until(shared, peer, rd, wr, sock, hello_by).await;
}

/// [`serve`], with the hello due by `hello_by` (a TLS connection's handshake spends part
/// of the time).
pub(crate) async fn serve_until<R, W>(
    shared: Arc<Shared>,
    peer: Peer,
    mut rd: R,
    wr: W,
    sock: Option<RawFd>,
    hello_by: tokio::time::Instant,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let transport = peer.transport;
    shared.metrics.connection_opened(transport);
    let (tx, rx) = mpsc::channel(OUT_QUEUE);
    let cap_units = match shared.config.limits.max_queued_bytes_per_connection {
        super::Size::Bytes(b) => b.div_ceil(BUDGET_UNIT),
        super::Size::Auto => 1 << 14,
    }
    .clamp(1, u64::from(u32::MAX)) as u32;
    let out = Outbox {
        tx,
        queued: Arc::new(Semaphore::new(cap_units as usize)),
        cap_units,
        closing: shared.shutdown.child_token(),
    };
    let writer = tokio::spawn(write_loop(
        wr,
        rx,
        sock,
        shared.config.write_timeout(),
        shared.clone(),
        out.closing.clone(),
    ));
    let state = Arc::new(Mutex::new(ConnState {
        shared: shared.clone(),
        leases: HashMap::new(),
        pins: Share::new(shared.shares.pins_per_connection),
        place: None,
        holds: std::collections::VecDeque::new(),
        reservations: HashMap::new(),
        next_reservation: 1,
        staging: None,
    }));
    let depth = shared.config.limits.max_inflight_per_connection;
    let mut c = Conn {
        shared: shared.clone(),
        transport,
        ip: peer.ip,
        uid: peer.uid,
        cert_sha256: peer.cert_sha256,
        pre_hello: peer.pre_hello,
        hello_by,
        out,
        state: state.clone(),
        inflight: Arc::new(Semaphore::new(depth)),
        done: shared.shutdown.child_token(),
        local_arena: false,
        subscriptions: 0,
        who: Identity::SINGLE,
        peer: false,
        version: MIN_VERSION,
    };
    let reaper = {
        let (state, done) = (state.clone(), c.done.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RESERVATION_REAP);
            loop {
                tokio::select! {
                    _ = done.cancelled() => break,
                    _ = tick.tick() => lock(&state).reap(Instant::now()),
                }
            }
        })
    };
    let _ = c.read_loop(&mut rd).await;
    // Let requests in flight finish (bounded), then stop the writer and the helpers.
    let drain = shared.config.drain_timeout();
    let _ = tokio::time::timeout(drain, c.inflight.acquire_many(depth as u32)).await;
    c.done.cancel();
    let _ = reaper.await;
    drop(c);
    let _ = writer.await;
    drop(state);
    shared.metrics.connection_closed(transport);
}

impl Conn {
    async fn send(&self, o: Out) {
        // A closed writer means the connection is going away; nothing to do.
        let _ = self.out.send(o).await;
    }

    async fn read_loop<R: AsyncRead + Unpin>(&mut self, rd: &mut R) -> ReadEnd {
        let shared = self.shared.clone();
        let cfg = &shared.config;
        let limits = shared.limits;
        let mut authed = false;
        let mut meta = Vec::new();
        let hello_deadline = self.hello_by;
        loop {
            let mut head = [0u8; HEADER_BYTES];
            // A connection holding a subscription is not idle (the server writes events to
            // it; a subscriber has nothing to say): no idle timeout, so a router's stream of a
            // quiet server is not cut every `idle_timeout` (a peer that went away is found by
            // the next event's write, or at once over a Unix socket).
            let wait = if !authed {
                Some(hello_deadline)
            } else if self.subscriptions > 0 {
                None
            } else {
                Some(tokio::time::Instant::now() + cfg.idle_timeout())
            };
            let first = {
                let read = async {
                    match wait {
                        Some(w) => tokio::time::timeout_at(w, rd.read(&mut head[..1])).await,
                        None => Ok(rd.read(&mut head[..1]).await),
                    }
                };
                tokio::select! {
                    biased;
                    _ = self.shared.shutdown.cancelled() => return ReadEnd::Closed,
                    _ = self.out.closing.cancelled() => return ReadEnd::Dropped,
                    r = read => r,
                }
            };
            match first {
                Ok(Ok(1)) => {}
                Ok(_) => return ReadEnd::Closed, // EOF or reset
                Err(_) => {
                    Metrics::inc(&self.shared.metrics.timeouts);
                    return ReadEnd::Closed;
                }
            }
            let mut deadline = tokio::time::Instant::now() + cfg.frame_timeout();
            if !authed {
                deadline = deadline.min(hello_deadline);
            }
            if !self.within(deadline, rd.read_exact(&mut head[1..])).await {
                return ReadEnd::Dropped;
            }
            let h = match Header::decode(&head, &limits) {
                Ok(h) => h,
                Err(e) => {
                    // Framing is lost: answer once (with the id as sent) and close.
                    let id = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
                    self.refuse(id, head[6], &e).await;
                    return ReadEnd::Dropped;
                }
            };
            if !authed && h.meta_len > PRE_HELLO_META_BYTES {
                // Nothing large is allocated for a peer that has not authenticated.
                let e = FrameError::TooLong {
                    what: "metadata before hello",
                    got: u64::from(h.meta_len),
                    limit: u64::from(PRE_HELLO_META_BYTES),
                };
                self.refuse(h.request_id, h.opcode, &e).await;
                return ReadEnd::Dropped;
            }
            meta.clear();
            meta.resize(h.meta_len as usize, 0);
            if !self.within(deadline, rd.read_exact(&mut meta)).await {
                return ReadEnd::Dropped;
            }
            let started = Instant::now();
            if h.is(flags::RESPONSE) || h.is(flags::EVENT) || h.is(flags::ERROR) {
                let e = FrameError::BadMeta {
                    what: "request",
                    reason: "a client sent a response frame".into(),
                };
                if !self.skip(rd, h.payload_len, deadline).await {
                    return ReadEnd::Dropped;
                }
                self.refuse(h.request_id, h.opcode, &e).await;
                if !authed {
                    return ReadEnd::Dropped; // any error before hello ends the connection
                }
                continue;
            }
            let req = match h
                .opcode()
                .ok_or(FrameError::UnknownOpcode(h.opcode))
                .and_then(|op| Request::decode(op, &meta, h.payload_len, &limits))
            {
                Ok(r) => r,
                Err(e) => {
                    // Delimited: skip its payload and carry on with the next frame.
                    if !self.skip(rd, h.payload_len, deadline).await {
                        return ReadEnd::Dropped;
                    }
                    self.refuse(h.request_id, h.opcode, &e).await;
                    if !authed {
                        return ReadEnd::Dropped;
                    }
                    continue;
                }
            };
            if !authed {
                match req {
                    Request::Hello(hello) => {
                        if !self.hello(h.request_id, hello).await {
                            return ReadEnd::Dropped;
                        }
                        authed = true;
                        // No longer counted among the connections before hello.
                        self.pre_hello = None;
                        self.shared
                            .metrics
                            .request_done(Opcode::Hello, started.elapsed());
                        continue;
                    }
                    _ => {
                        Metrics::inc(&self.shared.metrics.auth_failures);
                        self.send(Out::error(
                            h.request_id,
                            h.opcode,
                            ErrorCode::Unauthorized,
                            "send hello first",
                        ))
                        .await;
                        return ReadEnd::Dropped;
                    }
                }
            }
            if self.peer && !peer_may(&req) {
                if !self.skip(rd, h.payload_len, deadline).await {
                    return ReadEnd::Dropped;
                }
                Metrics::inc(&self.shared.metrics.errors);
                self.send(Out::error(
                    h.request_id,
                    h.opcode,
                    ErrorCode::Forbidden,
                    "a cluster peer may only ping, look up, fetch and put",
                ))
                .await;
                continue;
            }
            match req {
                Request::Put(entries) => {
                    if !self.put(rd, &h, entries, deadline).await {
                        return ReadEnd::Dropped;
                    }
                    self.shared
                        .metrics
                        .request_done(Opcode::Put, started.elapsed());
                }
                Request::Hello(_) => {
                    self.send(Out::error(
                        h.request_id,
                        h.opcode,
                        ErrorCode::BadRequest,
                        "hello was already done on this connection",
                    ))
                    .await;
                }
                Request::Subscribe { from_seq, snapshot } => {
                    if self.subscriptions >= MAX_SUBSCRIPTIONS {
                        Metrics::inc(&self.shared.metrics.busy);
                        self.send(Out::error(
                            h.request_id,
                            h.opcode,
                            ErrorCode::Busy,
                            format!("at most {MAX_SUBSCRIPTIONS} subscriptions a connection"),
                        ))
                        .await;
                        continue;
                    }
                    self.subscriptions += 1;
                    self.subscribe(h.request_id, from_seq, snapshot).await;
                }
                req @ (Request::Lookup(_) | Request::Ping)
                    if self.shared.store.pending_blocks() == 0
                        && (self.peer || self.shared.remote.get().is_none()) =>
                {
                    // CPU only and bounded by max_keys: answered here, saving a task hop.
                    // (With blocks being stored, a lookup may wait for them: a task.)
                    let job = self.job(&h);
                    let op = req.opcode();
                    if let Some(o) = job.run(req).await {
                        self.send(o).await;
                    }
                    self.shared.metrics.request_done(op, started.elapsed());
                }
                req => {
                    let Ok(permit) = self.inflight.clone().try_acquire_owned() else {
                        Metrics::inc(&self.shared.metrics.busy);
                        self.send(Out::error(
                            h.request_id,
                            h.opcode,
                            ErrorCode::Busy,
                            "too many requests in flight on this connection",
                        ))
                        .await;
                        continue;
                    };
                    let job = self.job(&h);
                    tokio::spawn(async move {
                        let _permit = permit;
                        let op = req.opcode();
                        let out = job.run(req).await;
                        job.shared.metrics.request_done(op, started.elapsed());
                        if let Some(o) = out {
                            let _ = job.out.send(o).await;
                        }
                    });
                }
            }
        }
    }

    fn job(&self, h: &Header) -> Job {
        Job {
            shared: self.shared.clone(),
            state: self.state.clone(),
            out: self.out.clone(),
            local_arena: self.local_arena,
            transport: self.transport,
            who: self.who,
            peer: self.peer,
            version: self.version,
            id: h.request_id,
            op: h.opcode,
            no_reply: h.is(flags::NO_REPLY),
        }
    }

    /// Runs a read with the frame's deadline; false (and counted) when it timed out or failed.
    async fn within<F, T>(&self, deadline: tokio::time::Instant, f: F) -> bool
    where
        F: std::future::Future<Output = std::io::Result<T>>,
    {
        let r = tokio::select! {
            _ = self.out.closing.cancelled() => return false,
            r = tokio::time::timeout_at(deadline, f) => r,
        };
        match r {
            Ok(Ok(_)) => true,
            Ok(Err(_)) => false,
            Err(_) => {
                Metrics::inc(&self.shared.metrics.timeouts);
                false
            }
        }
    }

    /// Reads and discards `len` payload bytes.
    async fn skip<R: AsyncRead + Unpin>(
        &self,
        rd: &mut R,
        len: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        let mut sink = tokio::io::sink();
        self.within(deadline, tokio::io::copy(&mut rd.take(len), &mut sink))
            .await
    }

    async fn refuse(&self, id: u64, op: u8, e: &FrameError) {
        Metrics::inc(&self.shared.metrics.bad_frames);
        Metrics::inc(&self.shared.metrics.errors);
        self.send(Out::error(id, op, e.code(), e.to_string())).await;
    }

    /// Checks a hello; answers it (with the arena's fd when asked on the Unix socket by a
    /// client trusted with it).
    async fn hello(&mut self, id: u64, h: Hello) -> bool {
        let op = Opcode::Hello as u8;
        let s = &self.shared;
        let fail = |code, msg: String| Out::error(id, op, code, msg);
        if h.max_version < MIN_VERSION || h.min_version > VERSION || h.min_version > h.max_version {
            self.send(fail(
                ErrorCode::VersionMismatch,
                format!(
                    "client speaks {}..={}, server {MIN_VERSION}..={VERSION}",
                    h.min_version, h.max_version
                ),
            ))
            .await;
            return false;
        }
        if self.transport != Transport::Unix {
            // The Unix socket is the server user's own (mode 0600): no token there.
            let now = Instant::now();
            let ip = self
                .ip
                .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
            if let AuthGate::Throttled(wait) = s.auth.gate(ip, now) {
                Metrics::inc(&s.metrics.auth_throttled);
                self.log_auth_refusal(ip, "throttled");
                self.send(fail(
                    ErrorCode::Unauthorized,
                    format!(
                        "too many failed hellos from this address; retry in {} s",
                        wait.as_secs().max(1)
                    ),
                ))
                .await;
                return false;
            }
            // A cluster peer: the token derived from the cluster secret (compared in constant
            // time, as tenants' tokens are). Not an admin; its keys are internal ones.
            let peer = s
                .peer_token_digest
                .get()
                .is_some_and(|d| token_matches(h.token.as_bytes(), d));
            let who = if peer {
                self.peer = true;
                tracing::debug!(
                    transport = self.transport.name(),
                    "hello from a cluster peer"
                );
                Ok(Identity {
                    admin: false,
                    ns: 0,
                    local_arena: false,
                })
            } else {
                self.network_identity(&h.token)
            };
            match who {
                Ok(who) => self.who = who,
                Err(why) => {
                    Metrics::inc(&s.metrics.auth_failures);
                    s.auth.failed(ip, now);
                    self.log_auth_refusal(ip, &why);
                    self.send(fail(ErrorCode::Unauthorized, why)).await;
                    return false;
                }
            }
        }
        if self.transport == Transport::Unix {
            match s.tenants.unix_identity(self.uid) {
                Some(who) => self.who = who,
                None => {
                    Metrics::inc(&s.metrics.auth_failures);
                    let who = self.uid.map_or("unknown".into(), |u| u.to_string());
                    if let Some(n) = s.logs.auth.tick(Instant::now()) {
                        tracing::warn!(
                            uid = %who,
                            "refused a Unix socket hello: its uid is mapped to no tenant ({n} \
                             refused since the last warning; see kvtier_auth_failures_total)"
                        );
                    }
                    self.send(fail(
                        ErrorCode::Unauthorized,
                        format!(
                            "uid {who} is mapped to no tenant: list it in a tenant's unix_uids \
                             (tenants.NAME.unix_uids)"
                        ),
                    ))
                    .await;
                    return false;
                }
            }
        }
        if h.block_bytes != 0 && h.block_bytes != s.block_bytes as u64 {
            self.send(fail(
                ErrorCode::LayoutMismatch,
                format!(
                    "client blocks are {} bytes, this server's are {} (layout fingerprint {:#x})",
                    h.block_bytes, s.block_bytes, s.layout_fingerprint
                ),
            ))
            .await;
            return false;
        }
        // With tenants, one namespace's connections hold at most their share of the places.
        if s.tenants.enforced() && !self.peer {
            match s.shares.conns(self.who.ns).try_take(1) {
                Some(c) => lock(&self.state).place = Some(c),
                None => {
                    s.metrics.share_refused(ShareKind::ConnectionsTenant);
                    self.send(fail(
                        ErrorCode::Busy,
                        "this tenant holds as many connections as it may \
                         (limits.max_connections_per_tenant): close one, or retry later"
                            .into(),
                    ))
                    .await;
                    return false;
                }
            }
        }
        // The arena holds every namespace's blocks: only for a tenant trusted with it.
        let local = if h.want_arena && self.transport == Transport::Unix && self.who.local_arena {
            match local_fds(s) {
                Ok(l) => Some(l),
                Err(e) => {
                    // Out of descriptors or memory, most likely: the client falls back to the
                    // socket.
                    if let Some(n) = s.logs.arena_fd.tick(Instant::now()) {
                        tracing::warn!(
                            "cannot pass the arena to a local client: {e} ({n} since the last \
                             warning); the client gets no arena"
                        );
                    }
                    None
                }
            }
        } else {
            None
        };
        self.local_arena = local.is_some();
        let staging_bytes = local.as_ref().map_or(0, |l| l.staging.bytes());
        self.version = h.max_version.min(VERSION);
        let reply = Response::Hello(HelloReply {
            version: self.version,
            server: s.config.server.name.clone(),
            block_bytes: s.block_bytes as u64,
            layout_fingerprint: s.layout_fingerprint,
            arena_bytes: if local.is_some() {
                s.store.dram().arena_bytes()
            } else {
                0
            },
            staging_bytes,
            slot_table_bytes: if local.is_some() {
                s.store.dram().published().bytes()
            } else {
                0
            },
            max_keys: s.limits.max_keys,
            max_meta_bytes: s.limits.max_meta_bytes,
            max_payload_bytes: s.limits.max_payload_bytes,
            max_lease_ms: s.config.limits.max_lease_ms,
            event_seq: s.tenants.bus(self.who.ns).next_seq(),
            // With tenants the table holds internal keys: the client gets its own namespace's
            // key to map its keys for the table (and nothing that maps another's).
            namespace_key: local
                .as_ref()
                .and(s.tenants.key_map(self.who.ns))
                .map(|m| *m.bytes()),
        });
        let mut out = Out::new(id, op, &reply, 0);
        if let Some(l) = local {
            out.fds = vec![l.arena, l.staging_fd, l.table];
            lock(&self.state).staging = Some(l.staging);
        }
        self.send(out).await;
        true
    }

    /// Who a network client is: named by its token, or by its client certificate (TLS,
    /// QUIC; pinned by a tenant), or by both when they agree. The error says why not.
    fn network_identity(&self, token: &str) -> Result<Identity, String> {
        let s = &self.shared;
        let by_token = s.tenants.by_token(token.as_bytes());
        let Some(by_token) = by_token else {
            // No tenants: the one token, every client an admin (certificates are not asked).
            return token_matches(token.as_bytes(), &s.token_digest)
                .then_some(Identity::SINGLE)
                .ok_or_else(|| "wrong or missing token".to_string());
        };
        let cert = self
            .cert_sha256
            .and_then(|d| s.tenants.by_cert(&d).map(|found| (d, found)));
        let (who, name) = match (cert, by_token) {
            (None, Some(t)) => t,
            (None, None) => return Err("wrong or missing token".into()),
            (Some((d, None)), _) => {
                let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
                return Err(format!(
                    "the client certificate (SHA-256 {hex}) is pinned by no tenant \
                     (tenants.NAME.client_cert_sha256)"
                ));
            }
            (Some((_, Some(c))), _) if token.is_empty() => c,
            (Some((_, Some(c))), Some(t)) if t.1 == c.1 => c,
            (Some((_, Some(c))), _) => {
                return Err(format!(
                    "the client certificate names tenant {:?}, the token another (or none): \
                     present one tenant's credentials",
                    c.1
                ));
            }
        };
        tracing::debug!(tenant = name, transport = self.transport.name(), "hello");
        Ok(who)
    }

    /// Logs a refused hello, at most once per interval (with the count since the last).
    fn log_auth_refusal(&self, ip: IpAddr, why: &str) {
        if let Some(n) = self.shared.logs.auth.tick(Instant::now()) {
            tracing::warn!(
                peer = %ip,
                transport = self.transport.name(),
                "refused a hello: {why} ({n} refused since the last warning; see \
                 kvtier_auth_failures_total, kvtier_auth_throttled_total)"
            );
        }
    }

    /// A put: each block is read from the socket straight into its reserved DRAM slot.
    async fn put<R: AsyncRead + Unpin>(
        &self,
        rd: &mut R,
        h: &Header,
        entries: Vec<PutEntry>,
        deadline: tokio::time::Instant,
    ) -> bool {
        let s = &self.shared;
        let block = s.block_bytes as u64;
        let want = entries.len() as u64 * block;
        if h.payload_len != want {
            if !self.skip(rd, h.payload_len, deadline).await {
                return false;
            }
            Metrics::inc(&s.metrics.errors);
            self.send(Out::error(
                h.request_id,
                h.opcode,
                ErrorCode::BadRequest,
                format!(
                    "a put of {} blocks carries {want} payload bytes ({} a block), not {}",
                    entries.len(),
                    block,
                    h.payload_len
                ),
            ))
            .await;
            return true;
        }
        if self.peer && !s.tenants.keys_as_sent() {
            // A peer's keys are internal ones, of no namespace: not taken with tenants.
            if !self.skip(rd, h.payload_len, deadline).await {
                return false;
            }
            Metrics::inc(&s.metrics.errors);
            self.send(Out::error(
                h.request_id,
                h.opcode,
                ErrorCode::Forbidden,
                "this server has [tenants]: it takes no offers from cluster peers",
            ))
            .await;
            return true;
        }
        // A client's put is offered to the blocks' owners; a peer's never is (no loops).
        let remote = if self.peer {
            None
        } else {
            s.remote.get().cloned()
        };
        let ns = self.who.ns;
        if let Some(p) = entries.first().and_then(|e| e.parent) {
            lock(&self.state).continued(s.tenants.key(ns, p));
        }
        let keys: Vec<_> = entries.iter().map(|e| s.tenants.key(ns, e.key)).collect();
        // Readers that meet these keys wait for them (bounded) instead of missing.
        let mut announced = s.store.announce(&keys);
        let mut statuses = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let until = deadline.into_std().min(Instant::now() + SLOT_WAIT);
            let parent = e.parent.map(|p| s.tenants.key(ns, p));
            let reserved = match admit(s, ns, keys[i], e.key) {
                Some(name) => reserve_waiting(s, keys[i], parent, None, until)
                    .await
                    .map(|r| (r, name)),
                None => Err(PutOutcome::Rejected(RejectReason::NoEvictableSlot)),
            };
            match reserved {
                Ok((mut r, _name)) => {
                    if !self.within(deadline, rd.read_exact(r.bytes_mut())).await {
                        return false; // the reservation frees its slot
                    }
                    let status = commit_status(r.commit());
                    announced.done(i);
                    count_refusal(s, self.transport, status);
                    statuses.push(status);
                    if let Some(rm) = &remote
                        && held(status)
                    {
                        let parent = e.parent.map(|p| s.tenants.key(ns, p));
                        rm.offered(s, keys[i], parent, status == PutStatus::Stored as u8);
                    }
                }
                Err(outcome) => {
                    announced.done(i);
                    if !self.skip(rd, block, deadline).await {
                        return false;
                    }
                    let status = put_status(outcome);
                    count_refusal(s, self.transport, status);
                    statuses.push(status);
                }
            }
        }
        if let Some(rm) = s.remote.get() {
            let done = keys.iter().zip(&statuses);
            if !self.peer {
                rm.client_puts(done.filter(|&(_, &st)| held(st)).map(|(k, _)| k));
            } else if rm.offers_are_guests() {
                // An offer: with sticky routing, this owner's new copies are its guests.
                let stored: Vec<_> = done
                    .filter(|&(_, &st)| st == PutStatus::Stored as u8)
                    .map(|(k, _)| *k)
                    .collect();
                s.store.mark_guests(&stored);
            }
        }
        s.metrics.bytes_received.inc_by(want);
        let r = Response::Put(PutReply { statuses });
        self.send(Out::new(h.request_id, h.opcode, &r, 0)).await;
        true
    }

    async fn subscribe(&self, id: u64, from_seq: Option<u64>, snapshot: bool) {
        let s = self.shared.clone();
        let ns = self.who.ns;
        let sub = s.tenants.bus(ns).subscribe(from_seq);
        let op = Opcode::Subscribe as u8;
        self.send(Out::new(
            id,
            op,
            &Response::Subscribed {
                next_seq: sub.next_seq,
            },
            0,
        ))
        .await;
        let tx = self.out.clone();
        let done = self.done.clone();
        tokio::spawn(async move {
            let send = |events: Events| {
                let tx = tx.clone();
                async move {
                    tx.send(Out::new(id, op, &Response::Events(events), 0))
                        .await
                }
            };
            if snapshot {
                let store = s.store.clone();
                let tenants = s.tenants.clone();
                let snap = tokio::task::spawn_blocking(move || {
                    // Only the namespace's blocks, in the client's keys.
                    let snap = store.snapshot();
                    let internal: Vec<_> = snap.iter().map(|e| e.key).collect();
                    let keys = tenants.client_keys(ns, &internal);
                    snap.into_iter()
                        .zip(keys)
                        .filter_map(|(e, k)| Some(crate::SnapshotEntry { key: k?, ..e }))
                        .collect::<Vec<_>>()
                })
                .await
                .unwrap_or_default();
                let mut evs = Vec::new();
                for e in snap {
                    for t in e.tiers() {
                        evs.push(kvtier_core::protocol::BlockEvent {
                            seq: 0,
                            kind: kvtier_core::protocol::EventKind::Stored as u8,
                            tier: tier_code(t) as u8,
                            key: e.key,
                        });
                    }
                }
                for chunk in evs.chunks(EVENT_BATCH) {
                    let batch = Events {
                        gap: None,
                        events: chunk.to_vec(),
                    };
                    if !send(batch).await {
                        return;
                    }
                }
            }
            let mut rx = sub.rx;
            let mut gap = sub.gap;
            for chunk in sub.backlog.chunks(EVENT_BATCH) {
                let batch = Events {
                    gap: gap.take(),
                    events: chunk.to_vec(),
                };
                if !send(batch).await {
                    return;
                }
            }
            let mut last = sub.next_seq.saturating_sub(1);
            loop {
                let first = tokio::select! {
                    _ = done.cancelled() => return,
                    r = rx.recv() => r,
                };
                let mut events = Vec::new();
                let mut handle =
                    |r: Result<_, _>, events: &mut Vec<_>, gap: &mut Option<(u64, u64)>| {
                        use tokio::sync::broadcast::error::RecvError;
                        match r {
                            Ok(ev) => {
                                let ev: kvtier_core::protocol::BlockEvent = ev;
                                if ev.seq <= last {
                                    return true; // already sent from the backlog
                                }
                                last = ev.seq;
                                events.push(ev);
                                true
                            }
                            Err(RecvError::Lagged(n)) => {
                                s.metrics.events_dropped.inc_by(n);
                                *gap = Some((last + 1, last + 1 + n));
                                last += n;
                                true
                            }
                            Err(RecvError::Closed) => false,
                        }
                    };
                if !handle(first, &mut events, &mut gap) {
                    return;
                }
                while events.len() < EVENT_BATCH {
                    match rx.try_recv() {
                        Ok(ev) => {
                            handle(Ok(ev), &mut events, &mut gap);
                        }
                        Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) => {
                            handle(
                                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)),
                                &mut events,
                                &mut gap,
                            );
                        }
                        Err(_) => break,
                    }
                }
                if events.is_empty() && gap.is_none() {
                    continue;
                }
                if !send(Events {
                    gap: gap.take(),
                    events,
                })
                .await
                {
                    return;
                }
            }
        });
    }
}

/// A request served on its own task.
struct Job {
    shared: Arc<Shared>,
    state: Arc<Mutex<ConnState>>,
    out: Outbox,
    local_arena: bool,
    transport: Transport,
    who: Identity,
    /// See [`Conn::peer`].
    peer: bool,
    /// See [`Conn::version`].
    version: u16,
    id: u64,
    op: u8,
    no_reply: bool,
}

fn miss_code(m: Option<MissReason>) -> u8 {
    (match m {
        None => MissCode::None,
        Some(MissReason::NotCached) => MissCode::NotCached,
        Some(MissReason::Corrupt) => MissCode::Corrupt,
        Some(MissReason::IoError) => MissCode::IoError,
        Some(MissReason::Busy) => MissCode::Busy,
    }) as u8
}

/// Whether a put's status leaves the block here (stored now, or already present).
fn held(st: u8) -> bool {
    st == PutStatus::Stored as u8 || st == PutStatus::AlreadyPresent as u8
}

fn put_status(o: PutOutcome) -> u8 {
    (match o {
        PutOutcome::Stored(_) => PutStatus::Stored,
        PutOutcome::AlreadyPresent => PutStatus::AlreadyPresent,
        PutOutcome::Rejected(RejectReason::Backlog) => PutStatus::RejectedBacklog,
        PutOutcome::Rejected(RejectReason::NoEvictableSlot) => PutStatus::RejectedNoSlot,
        PutOutcome::Rejected(RejectReason::OrphanBlock) => PutStatus::RejectedOrphan,
    }) as u8
}

fn commit_status(r: Result<PutOutcome, StoreError>) -> u8 {
    match r {
        Ok(o) => put_status(o),
        Err(e) => {
            tracing::warn!("commit failed: {e}");
            PutStatus::Failed as u8
        }
    }
}

impl Job {
    fn reply(&self, r: Response) -> Option<Out> {
        Some(Out::new(self.id, self.op, &r, 0))
    }

    /// A lookup's reply in this connection's version: from version 4 the blocks fetched from
    /// other members (`sources`: positions and the member) are of tier remote and named;
    /// before it they are reported where they are now (DRAM).
    fn lookup_reply(
        &self,
        tiers: &[TierKind],
        miss: Option<MissReason>,
        sources: &[(std::ops::Range<usize>, String)],
    ) -> Response {
        let mut codes: Vec<u8> = tiers.iter().map(|t| tier_code(*t) as u8).collect();
        let n = codes.len();
        let sources = (self.version >= 4).then(|| {
            sources
                .iter()
                // A block evicted since it came ends the prefix: its run ends there too.
                .filter_map(|(r, node)| {
                    let r = r.start..r.end.min(n);
                    (!r.is_empty()).then_some((r, node))
                })
                .map(|(r, node)| {
                    codes[r.clone()].fill(TierCode::Remote as u8);
                    BlockSource {
                        start: r.start as u32,
                        len: r.len() as u32,
                        node: node.clone(),
                    }
                })
                .collect()
        });
        Response::Lookup {
            tiers: codes,
            miss: miss_code(miss),
            sources,
        }
    }

    fn error(&self, code: ErrorCode, msg: impl Into<String>) -> Option<Out> {
        Metrics::inc(&self.shared.metrics.errors);
        if code == ErrorCode::Busy {
            Metrics::inc(&self.shared.metrics.busy);
        }
        Some(Out::error(self.id, self.op, code, msg))
    }

    fn lease(&self, lease_ms: u64) -> Duration {
        Duration::from_millis(lease_ms.clamp(1, self.shared.config.limits.max_lease_ms))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Option<Out>> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|_| self.error(ErrorCode::Internal, "the request's worker failed"))
    }

    /// Pins the longest cached prefix of `keys` for a read: right here when it is all in
    /// DRAM, on the blocking pool when NVMe blocks must be promoted first.
    async fn pin_read(&self, keys: &[BlockKey]) -> Result<PinnedRead, Option<Out>> {
        if let Some(p) = self.shared.store.try_pin_read(keys) {
            return Ok(p);
        }
        let store = self.shared.store.clone();
        let keys = keys.to_vec();
        self.blocking(move || store.pin_read(&keys)).await
    }

    /// Each of `pinned`'s blocks' sums over its key and bytes (what a peer verifies on
    /// arrival), kept per DRAM slot once computed. What is not kept yet is hashed here when
    /// small (tens of µs); a larger set on the blocking pool, since it may be hundreds of
    /// MiB. Counted in `kvtier_cluster_fetch_sums_total`.
    async fn block_sums(&self, pinned: PinnedRead) -> Result<(PinnedRead, Vec<u64>), Option<Out>> {
        let bytes = pinned.blocks().len() * self.shared.block_bytes;
        let (pinned, (sums, hashed)) = match pinned.kept_sums() {
            Some(sums) => (pinned, (sums, 0)),
            None if bytes <= INLINE_SUM_BYTES => {
                let sums = pinned.sums();
                (pinned, sums)
            }
            None => {
                self.blocking(move || {
                    let sums = pinned.sums();
                    (pinned, sums)
                })
                .await?
            }
        };
        if let Some(c) = self.shared.cluster.get() {
            let m = &c.metrics.fetch_sums;
            m.with_label_values(&["hashed"]).inc_by(hashed as u64);
            m.with_label_values(&["kept"])
                .inc_by((sums.len() - hashed) as u64);
        }
        Ok((pinned, sums))
    }

    async fn run(&self, req: Request) -> Option<Out> {
        let s = self.shared.clone();
        let store = s.store.clone();
        // Every key names a block of the caller's namespace only (a peer's keys are internal).
        let ns = self.who.ns;
        // The client's own keys of a lookup, for the blocks a remote lookup stores here.
        let client_keys = match &req {
            Request::Lookup(k)
                if !self.peer && s.tenants.enforced() && s.remote.get().is_some() =>
            {
                Some(k.keys.clone())
            }
            _ => None,
        };
        let req = if self.peer {
            req
        } else {
            match req {
                Request::Lookup(k) => Request::Lookup(internal(&s, ns, k)),
                Request::Get(k) => Request::Get(internal(&s, ns, k)),
                Request::Prefetch(k) => Request::Prefetch(internal(&s, ns, k)),
                Request::Remove(k) => Request::Remove(internal(&s, ns, k)),
                Request::Pin { keys, lease_ms } if s.tenants.enforced() => Request::Pin {
                    keys: s.tenants.keys(ns, &keys),
                    lease_ms,
                },
                Request::Retain(mut h) if s.tenants.enforced() => {
                    h.keys = s.tenants.keys(ns, &h.keys);
                    Request::Retain(h)
                }
                r => r,
            }
        };
        match req {
            Request::Ping => self.reply(Response::Pong),
            Request::Lookup(k) if self.peer => {
                // A peer's lookup: local-only, and it holds nothing (the asking node's fetch
                // follows at once, and a fetch pins what it sends).
                await_pending(&s, &k.keys).await;
                let tiers = store.lookup(&k.keys);
                let miss = (tiers.len() < k.keys.len()).then_some(MissReason::NotCached);
                self.reply(self.lookup_reply(&tiers, miss, &[]))
            }
            Request::Lookup(k) => {
                await_pending(&s, &k.keys).await;
                // The prefix stays pinned until this connection loads it (or briefly).
                let (mut tiers, mut hold) = store.lookup_held(&k.keys);
                // Blocks fetched from other members, by position, with the member.
                let mut sources = Vec::new();
                // Not all here: the cluster's owners may hold the rest.
                if tiers.len() < k.keys.len()
                    && let Some(rm) = s.remote.get()
                {
                    let client = client_keys.as_deref().unwrap_or(&k.keys);
                    let ext = rm.extend_lookup(&s, ns, client, &k.keys, tiers.len()).await;
                    sources = ext.sources;
                    if ext.fetched > 0 {
                        // The local prefix stayed held meanwhile (its blocks are the
                        // fetched ones' parents); the new hold covers it, so let it go.
                        let first = hold;
                        (tiers, hold) = store.lookup_held(&k.keys);
                        if let LookupHold::Held { lease_id, .. } = first {
                            store.release(lease_id);
                        }
                        // Their owners keep the cluster's copies: evicted first here, once
                        // this request has loaded them (the hold protects them until then).
                        rm.guests(&s, &ext.guests);
                    }
                }
                if let Some(rm) = s.remote.get() {
                    // The client's next put continues this prefix: where it is in its chain
                    // is known now, whichever member stored its blocks.
                    rm.looked_up(&s, &k.keys, tiers.len());
                }
                lock(&self.state).remember_hold(hold, &k.keys);
                if self.no_reply {
                    // A local client answered this lookup from the published slot table
                    // (`slot_table::flags::LOOKUPS`): the policy and the hold above were what
                    // it asked for.
                    return None;
                }
                let miss = (tiers.len() < k.keys.len()).then_some(MissReason::NotCached);
                self.reply(self.lookup_reply(&tiers, miss, &sources))
            }
            Request::Fetch(_) if !self.peer => self.error(
                ErrorCode::Forbidden,
                "fetch is for cluster peers (a hello with the cluster's peer token); use get",
            ),
            Request::Get(k) | Request::Fetch(k) => {
                let fetch = self.op == Opcode::Fetch as u8;
                // Before taking any of the send budget: a wait holds nothing.
                await_pending(&s, &k.keys).await;
                let n = k.keys.len() as u64;
                let bytes = n * s.block_bytes as u64;
                if bytes > s.limits.max_payload_bytes {
                    return self.error(
                        ErrorCode::TooLarge,
                        format!(
                            "a get returns at most {} blocks (max_payload_bytes)",
                            s.limits.max_payload_bytes / s.block_bytes as u64
                        ),
                    );
                }
                // This connection's share first: a client that does not read its gets runs
                // into its own bound, not the server's.
                let Some(queued) = self.out.try_reserve(bytes + (HEADER_BYTES as u64) + n + 16)
                else {
                    return self.error(
                        ErrorCode::Busy,
                        "this connection has too many response bytes unsent \
                         (limits.max_queued_bytes_per_connection): read them, then retry",
                    );
                };
                // The server's budget is charged what the connection's share was (a get
                // larger than the share takes all of it, no more): a few connections that do
                // not read cannot hold it all. With tenants, a namespace holds at most its
                // part of it (`limits.max_inflight_bytes_per_tenant`); a cluster peer's
                // fetches are charged to none.
                let units = self.out.units(bytes);
                let share = if self.peer {
                    None
                } else {
                    let Some(c) = s.shares.send(ns).try_take(u64::from(units)) else {
                        s.metrics.share_refused(ShareKind::SendTenant);
                        return self.error(
                            ErrorCode::Busy,
                            "this tenant's share of the send budget is spent \
                             (limits.max_inflight_bytes_per_tenant); retry",
                        );
                    };
                    Some(c)
                };
                let Ok(budget) = s.inflight_bytes.clone().try_acquire_many_owned(units) else {
                    return self.error(ErrorCode::Busy, "server send budget is spent; retry");
                };
                // DRAM-resident prefixes are pinned right here; NVMe promotions block.
                let pinned = match self.pin_read(&k.keys).await {
                    Ok(p) => p,
                    Err(o) => return o,
                };
                let tiers = pinned
                    .blocks()
                    .iter()
                    .map(|b| tier_code(b.found_in) as u8)
                    .collect();
                let miss = miss_code(pinned.miss());
                let (pinned, r) = if fetch {
                    let (pinned, sums) = match self.block_sums(pinned).await {
                        Ok(x) => x,
                        Err(o) => return o,
                    };
                    (pinned, Response::Fetch(FetchReply { tiers, miss, sums }))
                } else {
                    (pinned, Response::Get { tiers, miss })
                };
                lock(&self.state).loaded(&k.keys);
                let len = pinned.blocks().len() as u64 * s.block_bytes as u64;
                s.metrics.bytes_sent.inc_by(len);
                let mut o = Out::new(self.id, self.op, &r, len);
                o.pinned = Some(pinned);
                o._budget = Some(budget);
                o._budget_share = share;
                o._queued = Some(queued);
                Some(o)
            }
            Request::Locate { .. } if !self.peer => self.error(
                ErrorCode::Forbidden,
                "locate is for cluster peers (a hello with the cluster's peer token); use pin",
            ),
            Request::Pin { keys, lease_ms } | Request::Locate { keys, lease_ms } => {
                let locate = self.op == Opcode::Locate as u8;
                let lease = self.lease(lease_ms);
                await_pending(&s, &keys).await;
                // What this connection's and its namespace's shares of pinned DRAM blocks
                // leave: a pin past either stops there with miss "busy", as one longer than
                // DRAM does, so no client can pin the slots others' puts need. A Unix client
                // passed the arena (the local engine, trusted with every block) is bounded by
                // DRAM alone: the SDK pins up to the arena's blocks at once for it.
                let want = keys.len() as u64;
                let (conn_pins, ns_pins) = if self.local_arena {
                    (s.shares.unbounded().clone(), s.shares.unbounded().clone())
                } else {
                    (lock(&self.state).pins.clone(), s.shares.pins(ns).clone())
                };
                let mut mine = conn_pins.take_up_to(want);
                let mut ours = ns_pins.take_up_to(mine.amount());
                let short = if ours.amount() < mine.amount() {
                    Some(ShareKind::PinsTenant)
                } else {
                    (mine.amount() < want).then_some(ShareKind::PinsConnection)
                };
                let allowed = ours.amount() as usize;
                let mut sums = Vec::new();
                let mut l = if allowed == 0 {
                    crate::Lease {
                        id: 0,
                        deadline: Instant::now(),
                        blocks: Vec::new(),
                        miss: None,
                    }
                } else if locate {
                    // Pinned first, summed while pinned, then handed to the lease: the sums
                    // are of the bytes the peer will read.
                    let pinned = match self.pin_read(&keys[..allowed]).await {
                        Ok(p) => p,
                        Err(o) => return o,
                    };
                    let pinned = match self.block_sums(pinned).await {
                        Ok((pinned, s)) => {
                            sums = s;
                            pinned
                        }
                        Err(o) => return o,
                    };
                    pinned.into_lease(lease)
                } else {
                    match store.try_pin(&keys[..allowed], lease) {
                        Some(l) => l,
                        None => match self
                            .blocking({
                                let keys = keys[..allowed].to_vec();
                                move || store.pin(&keys, lease)
                            })
                            .await
                        {
                            Ok(l) => l,
                            Err(o) => return o,
                        },
                    }
                };
                mine.shrink(l.blocks.len() as u64);
                ours.shrink(l.blocks.len() as u64);
                if let Some(kind) = short
                    && l.miss.is_none()
                {
                    s.metrics.share_refused(kind);
                    l.miss = Some(MissReason::Busy);
                }
                {
                    let mut st = lock(&self.state);
                    st.loaded(&keys);
                    if !l.blocks.is_empty() {
                        st.leases.insert(
                            l.id,
                            HeldLease {
                                deadline: l.deadline,
                                _charges: (mine, ours),
                            },
                        );
                        s.metrics.leases_open.inc();
                    }
                }
                let pin = PinReply {
                    lease_id: if l.blocks.is_empty() { 0 } else { l.id },
                    lease_ms: lease.as_millis() as u64,
                    blocks: l
                        .blocks
                        .iter()
                        .map(|b| PinnedSlot {
                            offset: b.offset,
                            tier: tier_code(b.found_in) as u8,
                        })
                        .collect(),
                    miss: miss_code(l.miss),
                };
                self.reply(if locate {
                    Response::Locate(LocateReply { pin, sums })
                } else {
                    Response::Pin(pin)
                })
            }
            Request::Release { lease_id } => {
                let mine = lock(&self.state).leases.remove(&lease_id).is_some();
                if !mine {
                    return self.error(ErrorCode::NotFound, format!("no lease {lease_id} here"));
                }
                s.metrics.leases_open.dec();
                store.release(lease_id);
                if self.no_reply {
                    None
                } else {
                    self.reply(Response::Done)
                }
            }
            Request::Reserve { entries, lease_ms } => {
                if !self.local_arena {
                    return self.error(
                        ErrorCode::LocalOnly,
                        "reserve needs the arena: a Unix socket hello with want_arena",
                    );
                }
                let Some(staging) = lock(&self.state).staging.clone() else {
                    return self.error(ErrorCode::Internal, "no staging region");
                };
                if let Some(p) = entries.first().and_then(|e| e.parent) {
                    lock(&self.state).continued(s.tenants.key(ns, p));
                }
                if entries.len() > staging.places() as usize {
                    return self.error(
                        ErrorCode::TooLarge,
                        format!(
                            "a reserve takes at most {} blocks (staging_bytes / block_bytes)",
                            staging.places()
                        ),
                    );
                }
                // Places for every entry up front (those refused are given back below).
                let Some(places) = staging.take(entries.len()) else {
                    return self.error(
                        ErrorCode::Busy,
                        "the staging region is lent to earlier reservations: commit or abort \
                         them first",
                    );
                };
                let lease = self.lease(lease_ms);
                let (slots, statuses, names) =
                    reserve_batch(&s, ns, &entries, Instant::now() + SLOT_WAIT).await;
                for st in &statuses {
                    count_refusal(&s, self.transport, *st);
                }
                let mut reply_slots = Vec::with_capacity(slots.len());
                let mut staged = Vec::with_capacity(slots.len());
                for ((r, st), place) in slots.into_iter().zip(&statuses).zip(places) {
                    reply_slots.push(ReservedSlot {
                        status: *st,
                        offset: if r.is_some() {
                            staging.offset(place)
                        } else {
                            0
                        },
                    });
                    match r {
                        Some(slot) => staged.push(Some(Staged { slot, place })),
                        None => {
                            staging.give_back(place);
                            staged.push(None);
                        }
                    }
                }
                let any = staged.iter().any(Option::is_some);
                let id = if any {
                    let mut st = lock(&self.state);
                    let id = st.next_reservation;
                    st.next_reservation += 1;
                    st.reservations.insert(
                        id,
                        ReservationRecord {
                            staging,
                            slots: staged,
                            statuses,
                            deadline: Instant::now() + lease,
                            _names: names,
                            // Only a cluster member with a data path offers what it stores.
                            chain: if s.remote.get().is_some() {
                                entries
                                    .iter()
                                    .map(|e| {
                                        let parent = e.parent.map(|p| s.tenants.key(ns, p));
                                        (s.tenants.key(ns, e.key), parent)
                                    })
                                    .collect()
                            } else {
                                Vec::new()
                            },
                        },
                    );
                    s.metrics.reservations_open.inc();
                    id
                } else {
                    0
                };
                self.reply(Response::Reserve(ReserveReply {
                    reservation_id: id,
                    lease_ms: lease.as_millis() as u64,
                    slots: reply_slots,
                }))
            }
            Request::Commit { reservation_id } => {
                let rec = {
                    let mut st = lock(&self.state);
                    match st.reservations.remove(&reservation_id) {
                        // Expired but not yet reaped: refused like a reaped one (its client
                        // was told the deadline and may have written after it).
                        Some(rec) if rec.deadline <= Instant::now() => {
                            st.shared.metrics.reservations_open.dec();
                            None
                        }
                        r => r,
                    }
                };
                let Some(mut rec) = rec else {
                    return self.error(
                        ErrorCode::NotFound,
                        format!("no reservation {reservation_id} here (expired or committed)"),
                    );
                };
                s.metrics.reservations_open.dec();
                let copied = rec.slots.iter().flatten().count() as u64 * s.block_bytes as u64;
                let chain = std::mem::take(&mut rec.chain);
                let statuses = if copied > COPY_INLINE_BYTES {
                    match self.blocking(move || commit_staged(rec)).await {
                        Ok(st) => st,
                        Err(o) => return o,
                    }
                } else {
                    commit_staged(rec)
                };
                for st in &statuses {
                    count_refusal(&s, self.transport, *st);
                }
                // Offered to their owners as a put over the network is (a peer never reserves).
                if let Some(rm) = s.remote.get().filter(|_| !self.peer) {
                    for ((key, parent), &st) in chain.iter().zip(&statuses) {
                        if held(st) {
                            rm.offered(&s, *key, *parent, st == PutStatus::Stored as u8);
                        }
                    }
                    let done = chain.iter().zip(&statuses);
                    rm.client_puts(done.filter(|&(_, &st)| held(st)).map(|((k, _), _)| k));
                }
                let stored = statuses
                    .iter()
                    .filter(|s| **s == PutStatus::Stored as u8)
                    .count() as u64;
                s.metrics
                    .bytes_received
                    .inc_by(stored * s.block_bytes as u64);
                self.reply(Response::Commit(PutReply { statuses }))
            }
            Request::Abort { reservation_id } => {
                let gone = lock(&self.state).reservations.remove(&reservation_id);
                if gone.is_none() {
                    return self.error(
                        ErrorCode::NotFound,
                        format!("no reservation {reservation_id} here"),
                    );
                }
                s.metrics.reservations_open.dec();
                drop(gone);
                if self.no_reply {
                    None
                } else {
                    self.reply(Response::Done)
                }
            }
            Request::Prefetch(k) => {
                let n = store.prefetch(&k.keys) as u64;
                self.reply(Response::Prefetch { queued: n })
            }
            Request::Remove(k) => {
                let n = match self
                    .blocking(move || k.keys.iter().filter(|key| store.remove(key)).count())
                    .await
                {
                    Ok(n) => n,
                    Err(o) => return o,
                };
                self.reply(Response::Remove { removed: n as u64 })
            }
            Request::Clear if !self.who.admin => self.error(
                ErrorCode::Forbidden,
                "clear needs the admin role (this connection's tenant is not an admin)",
            ),
            Request::Clear => match self.blocking(move || store.clear()).await {
                Ok(Ok(())) => self.reply(Response::Done),
                Ok(Err(e)) => self.error(ErrorCode::Internal, format!("clear failed: {e}")),
                Err(o) => o,
            },
            Request::Stats => {
                let only = (!self.who.admin).then_some(ns);
                self.reply(Response::Stats(s.stats_json(only)))
            }
            Request::Retain(h) => {
                // CPU only: a walk of the index over at most max_keys keys, no I/O.
                let outcome = store.retain(RetainRequest {
                    namespace: ns,
                    session: h.session,
                    keys: &h.keys,
                    expected_return: Duration::from_millis(h.return_ms),
                    priority: h.priority,
                });
                let (status, blocks, hold) = match outcome {
                    RetainOutcome::Accepted { blocks, hold } => {
                        (RetainStatus::Accepted, blocks as u64, hold)
                    }
                    RetainOutcome::NothingCached => {
                        (RetainStatus::NothingCached, 0, Duration::ZERO)
                    }
                    RetainOutcome::OverNamespaceBudget => {
                        (RetainStatus::OverNamespaceBudget, 0, Duration::ZERO)
                    }
                    RetainOutcome::OverGlobalBudget => {
                        (RetainStatus::OverGlobalBudget, 0, Duration::ZERO)
                    }
                    RetainOutcome::TooFar => (RetainStatus::TooFar, 0, Duration::ZERO),
                    RetainOutcome::Off => (RetainStatus::Off, 0, Duration::ZERO),
                };
                self.reply(Response::Retain(RetainReply {
                    status: status as u8,
                    blocks,
                    hold_ms: hold.as_millis() as u64,
                }))
            }
            // Handled by the reader.
            Request::Hello(_) | Request::Put(_) | Request::Subscribe { .. } => {
                self.error(ErrorCode::Internal, "misrouted request")
            }
        }
    }
}

/// What a local client is passed at hello: the arena and the published slot table read-only,
/// and its own staging region. With tenants, the hello reply adds the client's namespace key
/// (the table holds internal keys).
struct LocalFds {
    arena: OwnedFd,
    staging_fd: OwnedFd,
    staging: Arc<Staging>,
    table: OwnedFd,
}

fn local_fds(s: &Shared) -> std::io::Result<LocalFds> {
    let dram = s.store.dram();
    let arena = dram.client_fd().try_clone_to_owned()?;
    let places = Staging::places_for(
        u64::from(crate::tier::Tier::slot_count(dram)),
        s.block_bytes,
    );
    let staging = Arc::new(Staging::create(places, s.block_bytes)?);
    let staging_fd = staging.fd().try_clone_to_owned()?;
    let table = dram.published().client_fd().try_clone_to_owned()?;
    Ok(LocalFds {
        arena,
        staging_fd,
        staging,
        table,
    })
}

/// Commits a local reservation: each block is copied from its staging place into its
/// reserved DRAM slot, then committed. Returns the statuses of every entry.
fn commit_staged(mut rec: ReservationRecord) -> Vec<u8> {
    let mut statuses = std::mem::take(&mut rec.statuses);
    for (i, staged) in rec.slots.iter_mut().enumerate() {
        if let Some(Staged { mut slot, place }) = staged.take() {
            rec.staging.copy_out(place, slot.bytes_mut());
            rec.staging.give_back(place);
            statuses[i] = commit_status(slot.commit());
        }
    }
    statuses
}

/// Waits while the leading run of `keys` reaches a block that is being stored, until it is
/// committed (then on to the next) or withdrawn, or the wait makes no progress for
/// [`PENDING_STALL`], or [`PENDING_WAIT`] has passed. Serves nothing itself: the caller then
/// reads the index, which holds committed blocks only.
async fn await_pending(s: &Shared, keys: &[kvtier_core::BlockKey]) {
    let store = &s.store;
    // One lock over the pending set, not a walk of the index, when none of these keys is being
    // stored (the common case, also while other clients' puts are in flight).
    if store.first_pending(keys).is_none() {
        return;
    }
    let start = Instant::now();
    let mut progress = start;
    let mut waited = false;
    let mut i = 0;
    while i < keys.len() {
        if store.contains(&keys[i]) {
            i += 1;
            progress = Instant::now();
            continue;
        }
        if !store.is_pending(&keys[i]) {
            return; // not cached and not coming: a miss
        }
        let now = Instant::now();
        if now >= progress + PENDING_STALL || now >= start + PENDING_WAIT {
            Metrics::inc(&s.metrics.pending_wait_expired);
            return;
        }
        if !waited {
            waited = true;
            Metrics::inc(&s.metrics.pending_waits);
        }
        tokio::time::sleep(PENDING_POLL).await;
    }
}

/// Counts (and logs, rate-limited) a put status that is a refusal.
fn count_refusal(s: &Shared, transport: Transport, status: u8) {
    let why = match PutStatus::from_u8(status) {
        Some(PutStatus::RejectedBacklog) => RejectReason::Backlog,
        Some(PutStatus::RejectedNoSlot) => RejectReason::NoEvictableSlot,
        Some(PutStatus::RejectedOrphan) => RejectReason::OrphanBlock,
        _ => return,
    };
    s.metrics.put_refused(why, transport);
}

/// Reserves a DRAM slot for `key`, waiting (until `until`, at most) while every slot is
/// pinned and background copies that will unpin some are running. `after`: the entry's
/// parent, reserved earlier in the same batch.
pub(super) async fn reserve_waiting(
    s: &Shared,
    key: kvtier_core::BlockKey,
    parent: Option<kvtier_core::BlockKey>,
    after: Option<&Reservation>,
    until: Instant,
) -> Result<Reservation, PutOutcome> {
    loop {
        let may_wait = Instant::now() < until && s.store.background_jobs() > 0;
        match s.store.reserve_try(key, parent, after, !may_wait) {
            Err(PutOutcome::Rejected(RejectReason::NoEvictableSlot)) if may_wait => {
                tokio::time::sleep(SLOT_POLL).await;
            }
            r => return r,
        }
    }
}

/// Reserves slots for a batch of entries, in order; a child of an entry reserved earlier
/// in the batch may be reserved before its parent is committed. Waits for slots (until
/// `until`) as [`reserve_waiting`] does.
async fn reserve_batch(
    s: &Shared,
    ns: super::tenants::Ns,
    entries: &[PutEntry],
    until: Instant,
) -> (Vec<Option<Reservation>>, Vec<u8>, Vec<Registration>) {
    let mut slots: Vec<Option<Reservation>> = Vec::with_capacity(entries.len());
    let mut statuses = Vec::with_capacity(entries.len());
    let mut names = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let pending_parent = match (e.parent, slots.last()) {
            (Some(p), Some(Some(prev))) if i > 0 && entries[i - 1].key == p => Some(prev),
            _ => None,
        };
        let key = s.tenants.key(ns, e.key);
        let parent = e.parent.map(|p| s.tenants.key(ns, p));
        let r = match admit(s, ns, key, e.key) {
            Some(name) => {
                let r = reserve_waiting(s, key, parent, pending_parent, until).await;
                if r.is_ok() {
                    names.push(name);
                }
                r
            }
            None => Err(PutOutcome::Rejected(RejectReason::NoEvictableSlot)),
        };
        match r {
            Ok(r) => {
                slots.push(Some(r));
                statuses.push(PutStatus::Stored as u8);
            }
            Err(o) => {
                slots.push(None);
                statuses.push(put_status(o));
            }
        }
    }
    (slots, statuses, names)
}

/// A key list in the caller's namespace.
fn internal(
    s: &Shared,
    ns: super::tenants::Ns,
    k: kvtier_core::protocol::KeyList,
) -> kvtier_core::protocol::KeyList {
    if !s.tenants.enforced() {
        return k;
    }
    kvtier_core::protocol::KeyList {
        keys: s.tenants.keys(ns, &k.keys),
    }
}

/// Makes room for one more block of namespace `ns` within its quota and, in a full store,
/// its share ([`super::tenants::Tenants::admit`]), and registers the put. A block chosen to
/// make room that is pinned (a request is loading it) is not removed but sent to the back of
/// the order. `None`: over quota with nothing of its own to remove.
pub(super) fn admit(
    s: &Shared,
    ns: super::tenants::Ns,
    internal: kvtier_core::BlockKey,
    key: kvtier_core::BlockKey,
) -> Option<Registration> {
    // Each round removes one block of the namespace; a bound keeps a stale order finite.
    for _ in 0..64 {
        match s.tenants.admit(ns, internal, key) {
            Ok(name) => return Some(name),
            Err(Admit::Evict(victim)) => {
                if !s.store.remove_unpinned(&victim) {
                    s.tenants.requeue(victim);
                }
            }
            Err(Admit::Refuse) => return None,
        }
    }
    None
}

async fn write_loop<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<Out>,
    sock: Option<RawFd>,
    timeout: Duration,
    shared: Arc<Shared>,
    closing: CancellationToken,
) {
    let mut w = BufWriter::with_capacity(64 << 10, wr);
    let mut failed = false;
    while let Some(o) = rx.recv().await {
        let r = tokio::time::timeout(timeout, async {
            match (o.fds.is_empty(), sock) {
                (false, Some(sock)) => {
                    w.flush().await?;
                    let mut frame = o.head.to_vec();
                    frame.extend_from_slice(&o.meta);
                    let fds: Vec<RawFd> = o.fds.iter().map(|f| f.as_raw_fd()).collect();
                    let sent = send_with_fds(sock, &frame, &fds).await?;
                    w.write_all(&frame[sent..]).await?;
                }
                _ => {
                    w.write_all(&o.head).await?;
                    w.write_all(&o.meta).await?;
                }
            }
            if let Some(p) = &o.pinned {
                for i in 0..p.blocks().len() {
                    w.write_all(p.bytes(i)).await?;
                }
            }
            if rx.is_empty() {
                w.flush().await?;
            }
            Ok::<(), std::io::Error>(())
        })
        .await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                failed = true;
                break;
            }
            Err(_) => {
                Metrics::inc(&shared.metrics.timeouts);
                failed = true;
                break;
            }
        }
    }
    if failed {
        // The peer does not take what it is sent (or is gone): end the whole connection now,
        // without waiting on a flush it will not take either. Queued responses are dropped,
        // and with them the pins and budget they held.
        closing.cancel();
        drop(rx);
        return;
    }
    let _ = tokio::time::timeout(timeout, w.shutdown()).await;
}

/// Sends `bytes` with `fds` attached (SCM_RIGHTS) on the Unix socket `sock`; returns how
/// many bytes went (at least one: the fds ride with the first byte).
async fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    loop {
        match super::fdpass::send_fds(sock, bytes, fds) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            r => return r,
        }
    }
}

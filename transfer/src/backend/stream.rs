//! The stream protocol engine shared by TCP and QUIC (and by the shared-memory control
//! channel): the initiator's lanes and the target's per-connection server.
//!
//! A *lane* is one byte stream to the peer. Its writer task writes whole frames (header, then
//! payload straight from region memory), so a transfer dropped mid-way never leaves a torn
//! frame; its reader task matches replies to pending requests by id and reads READ payloads
//! straight into region memory. When either side of a lane fails, every request pending on it
//! fails with `Disconnected`, and so does every later post.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::frame::{FrameOp, HEADER_BYTES, Header, MAX_NAME_BYTES, Status};
use super::{BoxFuture, Job, PeerBackend, Piece, TransferCtl};
use super::{Notification, TargetCtx};
use crate::descriptor::Op;
use crate::error::{Result, TransferError};
use crate::metadata::TOKEN_BYTES;
use crate::region::RegionMem;

/// Frames a lane's writer task may have queued (back-pressure on posting).
const LANE_QUEUE_FRAMES: usize = 64;
/// Read buffer of the target's connection reader.
const TARGET_READ_BUFFER_BYTES: usize = 64 << 10;
/// Write buffer of a lane writer and of the target's replies (small frames are coalesced).
const WRITE_BUFFER_BYTES: usize = 64 << 10;

enum Payload {
    None,
    Region(Arc<RegionMem>, u64),
    Bytes(Vec<u8>),
}

struct Outgoing {
    header: Header,
    payload: Payload,
    ctl: Arc<TransferCtl>,
    _piece: Piece,
}

struct Pending {
    ctl: Arc<TransferCtl>,
    _piece: Piece,
    reply: FrameOp,
    len: u32,
    /// Where a READ's data lands.
    dest: Option<(Arc<RegionMem>, u64)>,
}

struct PendingTable {
    map: HashMap<u64, Pending>,
    dead: Option<String>,
}

/// The initiator's end of one stream to a peer.
pub(crate) struct Lane {
    peer: String,
    tx: mpsc::Sender<Outgoing>,
    table: Mutex<PendingTable>,
    next_id: AtomicU64,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Woken when the lane fails.
    died: tokio::sync::Notify,
}

impl Lane {
    /// Authenticates on a fresh stream (HELLO with our token copy and name) and starts the
    /// lane's writer and reader tasks.
    pub(crate) async fn start<R, W>(
        peer: &str,
        my_name: &str,
        token: &[u8],
        reader: R,
        mut writer: W,
    ) -> Result<Arc<Lane>>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let io_err =
            |e: std::io::Error| TransferError::disconnected(peer, format!("handshake: {e}"));
        let name = &my_name.as_bytes()[..my_name.len().min(MAX_NAME_BYTES)];
        let hello = Header::new(FrameOp::Hello, 0, 0, 0, (token.len() + name.len()) as u32);
        writer.write_all(&hello.encode()).await.map_err(io_err)?;
        writer.write_all(token).await.map_err(io_err)?;
        writer.write_all(name).await.map_err(io_err)?;
        writer.flush().await.map_err(io_err)?;
        let mut reader = BufReader::with_capacity(TARGET_READ_BUFFER_BYTES, reader);
        let mut hb = [0u8; HEADER_BYTES];
        reader.read_exact(&mut hb).await.map_err(io_err)?;
        let ack = Header::decode(&hb).map_err(|e| TransferError::protocol(peer, e))?;
        if ack.op != FrameOp::HelloAck {
            return Err(TransferError::protocol(
                peer,
                format!("expected HELLO_ACK, got {:?}", ack.op),
            ));
        }
        if ack.status == Status::AuthFailed {
            return Err(TransferError::Auth {
                peer: peer.to_owned(),
                reason: "the peer refused our token".into(),
            });
        }
        if ack.status != Status::Ok {
            return Err(TransferError::protocol(
                peer,
                format!("HELLO_ACK with status {:?}", ack.status),
            ));
        }
        let (tx, rx) = mpsc::channel(LANE_QUEUE_FRAMES);
        let lane = Arc::new(Lane {
            peer: peer.to_owned(),
            tx,
            table: Mutex::new(PendingTable {
                map: HashMap::new(),
                dead: None,
            }),
            next_id: AtomicU64::new(1),
            tasks: Mutex::new(Vec::new()),
            died: tokio::sync::Notify::new(),
        });
        // The tasks hold the lane weakly: when the last peer handle drops the lane, its Drop
        // aborts them (a strong reference here would keep the lane alive forever).
        let w = tokio::spawn(write_loop(Arc::downgrade(&lane), rx, writer));
        let r = tokio::spawn(read_loop(Arc::downgrade(&lane), reader));
        lane.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([w.abort_handle(), r.abort_handle()]);
        Ok(lane)
    }

    /// Whether the lane failed (the reason), or `None` while it works.
    pub(crate) fn dead_reason(&self) -> Option<String> {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .dead
            .clone()
    }

    /// Fails the lane: every pending request and every later post gets `err`.
    fn kill(&self, err: TransferError) {
        let drained: Vec<Pending> = {
            let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
            if t.dead.is_none() {
                t.dead = Some(err.to_string());
            }
            t.map.drain().map(|(_, p)| p).collect()
        };
        for p in drained {
            p.ctl.fail(err.duplicate());
        }
        self.died.notify_waiters();
    }

    /// Fails the lane and stops its writer and reader (the reader may be waiting inside a
    /// reply's payload from a peer that hangs): their queued and pending pieces are dropped
    /// once the tasks are.
    fn close(&self) {
        self.kill(TransferError::disconnected(
            &self.peer,
            "closed by this side",
        ));
        self.abort_tasks();
    }

    /// Stops the lane's writer and reader tasks.
    fn abort_tasks(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }

    /// Resolves when the lane has failed, with the reason.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) async fn dead(&self) -> TransferError {
        loop {
            let notified = self.died.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.dead_reason() {
                return TransferError::disconnected(&self.peer, reason);
            }
            notified.await;
        }
    }

    /// Requests waiting for a reply (tests check that nothing leaks).
    #[cfg(test)]
    fn pending_len(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .len()
    }

    fn take_pending(&self, id: u64) -> Option<Pending> {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .remove(&id)
    }

    /// Queues one request; its completion (or failure) is reported to `ctl`.
    async fn post(
        &self,
        ctl: &Arc<TransferCtl>,
        mut header: Header,
        payload: Payload,
        reply: FrameOp,
        dest: Option<(Arc<RegionMem>, u64)>,
    ) -> Result<()> {
        header.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(reason) = &t.dead {
                return Err(TransferError::disconnected(&self.peer, reason.clone()));
            }
            ctl.add_outstanding(1);
            t.map.insert(
                header.id,
                Pending {
                    ctl: Arc::clone(ctl),
                    _piece: Piece::new(ctl),
                    reply,
                    len: header.len,
                    dest,
                },
            );
        }
        let out = Outgoing {
            header,
            payload,
            ctl: Arc::clone(ctl),
            _piece: Piece::new(ctl),
        };
        // If the transfer is dropped while waiting for room in the queue, the request never
        // reaches the writer: the guard takes its pending entry back out.
        let mut guard = UnsentGuard {
            lane: self,
            id: header.id,
            armed: true,
        };
        let sent = self.tx.send(out).await;
        guard.armed = false;
        if sent.is_err() {
            // The writer task is gone; failing the lane reports this request too.
            self.kill(TransferError::disconnected(
                &self.peer,
                "lane writer stopped",
            ));
        }
        Ok(())
    }

    /// Sends a notification and waits for the peer's acknowledgement. Cancellation is
    /// honoured until the frame is written; once written, the notification is delivered.
    pub(crate) async fn notify(&self, ctl: &Arc<TransferCtl>, message: Vec<u8>) -> Result<()> {
        ctl.check()?;
        let header = Header::new(FrameOp::Notify, 0, 0, 0, message.len() as u32);
        self.post(
            ctl,
            header,
            Payload::Bytes(message),
            FrameOp::NotifyAck,
            None,
        )
        .await?;
        ctl.wait_outstanding(false).await
    }
}

/// Removes a request's pending entry unless disarmed (see `Lane::post`).
struct UnsentGuard<'a> {
    lane: &'a Lane,
    id: u64,
    armed: bool,
}

impl Drop for UnsentGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.lane.take_pending(self.id);
        }
    }
}

impl Lane {
    /// Asks the peer whether `region` is still registered (`RegionNotFound` if not).
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) async fn check_region(&self, ctl: &Arc<TransferCtl>, region: u64) -> Result<()> {
        ctl.check()?;
        let header = Header::new(FrameOp::Check, 0, region, 0, 0);
        self.post(ctl, header, Payload::None, FrameOp::CheckAck, None)
            .await?;
        ctl.wait_outstanding(true).await
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.abort_tasks();
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    lane: std::sync::Weak<Lane>,
    mut rx: mpsc::Receiver<Outgoing>,
    w: W,
) {
    // The channel's sender lives in the lane: when the lane drops, `recv` ends the loop (and
    // the lane's Drop aborts this task anyway). Frames are buffered and flushed whenever the
    // queue runs empty, so a burst of small frames costs few syscalls; payloads larger than
    // the buffer go straight from region memory to the socket.
    let mut w = tokio::io::BufWriter::with_capacity(WRITE_BUFFER_BYTES, w);
    while let Some(out) = rx.recv().await {
        let Some(lane) = lane.upgrade() else {
            return;
        };
        if out.ctl.is_cancelled() {
            if let Some(p) = lane.take_pending(out.header.id) {
                p.ctl.fail(p.ctl.cancelled_error());
            }
            if rx.is_empty()
                && let Err(e) = w.flush().await
            {
                lane.kill(TransferError::disconnected(
                    &lane.peer,
                    format!("write failed: {e}"),
                ));
                return;
            }
            continue;
        }
        let res = async {
            w.write_all(&out.header.encode()).await?;
            match &out.payload {
                Payload::None => {}
                Payload::Region(region, offset) => {
                    // SAFETY: the range was validated against the region at post time, the
                    // region's memory is kept alive by the Arc in `out`, it is host memory
                    // (checked before posting), and the memory contract on `RegionHandle`
                    // forbids writers to these bytes while a transfer reads them.
                    let src = unsafe { region.slice(*offset, out.header.len as usize) };
                    w.write_all(src).await?;
                }
                Payload::Bytes(b) => w.write_all(b).await?,
            }
            if rx.is_empty() {
                w.flush().await?;
            }
            Ok::<_, std::io::Error>(())
        }
        .await;
        if let Err(e) = res {
            lane.kill(TransferError::disconnected(
                &lane.peer,
                format!("write failed: {e}"),
            ));
            return;
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(weak: std::sync::Weak<Lane>, mut r: BufReader<R>) {
    loop {
        let mut hb = [0u8; HEADER_BYTES];
        let res = r.read_exact(&mut hb).await;
        // Hold the lane only while handling a reply, never while waiting for one.
        let Some(lane) = weak.upgrade() else {
            return;
        };
        let outcome = match res {
            Ok(_) => handle_reply(&lane, &hb, &mut r).await,
            Err(e) => Err(TransferError::disconnected(
                &lane.peer,
                format!("connection lost: {e}"),
            )),
        };
        if let Err(err) = outcome {
            lane.kill(err);
            return;
        }
    }
}

/// Handles one reply whose header is `hb`; an error fails the lane.
async fn handle_reply<R: AsyncRead + Unpin>(
    lane: &Lane,
    hb: &[u8; HEADER_BYTES],
    r: &mut BufReader<R>,
) -> Result<()> {
    let h = Header::decode(hb).map_err(|e| TransferError::protocol(&lane.peer, e))?;
    let Some(p) = lane.take_pending(h.id) else {
        return Err(TransferError::protocol(
            &lane.peer,
            format!("reply {:?} to unknown request {}", h.op, h.id),
        ));
    };
    let fail = |e: TransferError| {
        p.ctl.fail(e.duplicate());
        Err(e)
    };
    if h.op != p.reply {
        return fail(TransferError::protocol(
            &lane.peer,
            format!(
                "expected {:?} for request {}, got {:?}",
                p.reply, h.id, h.op
            ),
        ));
    }
    if h.status != Status::Ok {
        if h.len != 0 {
            return fail(TransferError::protocol(
                &lane.peer,
                "error reply with a payload",
            ));
        }
        p.ctl.fail(status_error(&lane.peer, &h));
        return Ok(());
    }
    if h.op == FrameOp::ReadData {
        let Some((region, offset)) = &p.dest else {
            return fail(TransferError::protocol(
                &lane.peer,
                "data for a request without one",
            ));
        };
        if h.len != p.len {
            return fail(TransferError::protocol(
                &lane.peer,
                format!("asked for {} bytes, got {}", p.len, h.len),
            ));
        }
        // SAFETY: the destination range was validated against the local region when the
        // transfer was posted; the Arc in `p` keeps the memory mapped; it is host memory;
        // the memory contract on `RegionHandle` forbids other access to these bytes while
        // the transfer runs.
        let dst = unsafe { region.slice_mut(*offset, h.len as usize) };
        if let Err(e) = r.read_exact(dst).await {
            return fail(TransferError::disconnected(
                &lane.peer,
                format!("connection lost: {e}"),
            ));
        }
    } else if h.len != 0 {
        return fail(TransferError::protocol(
            &lane.peer,
            format!("{:?} with a payload", h.op),
        ));
    }
    p.ctl.complete_one();
    Ok(())
}

fn status_error(peer: &str, h: &Header) -> TransferError {
    match h.status {
        Status::RegionNotFound => TransferError::RegionNotFound {
            agent: peer.to_owned(),
            region: h.region,
        },
        Status::OutOfBounds => TransferError::InvalidDescriptor {
            index: 0,
            reason: format!(
                "the peer rejected range {}+{} of its region {} (the first failing chunk)",
                h.offset, h.len, h.region
            ),
        },
        Status::UnsupportedMemory => TransferError::BackendUnavailable {
            backend: "stream",
            reason: format!("peer region {} is not host memory", h.region),
        },
        Status::ReadOnly => TransferError::InvalidDescriptor {
            index: 0,
            reason: format!("the peer's region {} is read-only to peers", h.region),
        },
        Status::AuthFailed => TransferError::Auth {
            peer: peer.to_owned(),
            reason: "refused".into(),
        },
        Status::Ok => TransferError::protocol(peer, "status ok reported as an error"),
    }
}

/// A peer reached over stream lanes (TCP connections or QUIC streams).
pub(crate) struct StreamPeer {
    pub lanes: Vec<Arc<Lane>>,
    pub chunk_bytes: u64,
    next_lane: AtomicUsize,
    /// Keeps transport state (a QUIC connection) alive as long as the peer.
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl StreamPeer {
    pub(crate) fn new(
        lanes: Vec<Arc<Lane>>,
        chunk_bytes: u64,
        keep: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Self {
        Self {
            lanes,
            chunk_bytes,
            next_lane: AtomicUsize::new(0),
            _keep: keep,
        }
    }

    async fn run(&self, job: Job) -> Result<()> {
        let ctl = &job.ctl;
        let n = self.lanes.len();
        let mut lane_i = self.next_lane.fetch_add(1, Ordering::Relaxed);
        for seg in &job.segments {
            if !seg.local.kind.is_host() {
                return Err(TransferError::BackendUnavailable {
                    backend: "stream",
                    reason: format!("local region {} is not host memory", seg.local.id),
                });
            }
            let mut done = 0u64;
            while done < seg.len {
                ctl.check()?;
                seg.local.check_live()?;
                let len = (seg.len - done).min(self.chunk_bytes) as u32;
                let lane = &self.lanes[lane_i % n];
                lane_i = lane_i.wrapping_add(1);
                let header = Header::new(
                    if job.op == Op::Write {
                        FrameOp::Write
                    } else {
                        FrameOp::Read
                    },
                    0,
                    seg.remote,
                    seg.remote_offset + done,
                    len,
                );
                let local = (Arc::clone(&seg.local), seg.local_offset + done);
                match job.op {
                    Op::Write => {
                        lane.post(
                            ctl,
                            header,
                            Payload::Region(local.0, local.1),
                            FrameOp::WriteAck,
                            None,
                        )
                        .await?
                    }
                    Op::Read => {
                        lane.post(ctl, header, Payload::None, FrameOp::ReadData, Some(local))
                            .await?
                    }
                }
                done += u64::from(len);
            }
        }
        ctl.wait_outstanding(true).await?;
        super::check_local_live(&job.segments)?;
        if let Some(message) = job.notification {
            self.lanes[0].notify(ctl, message).await?;
        }
        Ok(())
    }
}

impl PeerBackend for StreamPeer {
    fn execute(self: Arc<Self>, job: Job) -> BoxFuture {
        Box::pin(async move { self.run(job).await })
    }

    fn tracks_pieces(&self) -> bool {
        true
    }

    fn close(&self) {
        for lane in &self.lanes {
            lane.close();
        }
    }
}

/// Serves one stream as a target: authenticates the initiator, then applies WRITE frames to,
/// and answers READ frames from, the agent's registered regions, and delivers notifications.
/// Returns when the stream ends or breaks the protocol (the connection is then dropped).
pub(crate) async fn serve<R, W>(ctx: Arc<TargetCtx>, reader: R, mut w: W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut r = BufReader::with_capacity(TARGET_READ_BUFFER_BYTES, reader);
    let mut w = tokio::io::BufWriter::with_capacity(WRITE_BUFFER_BYTES, &mut w);
    if let Err(e) = serve_inner(&ctx, &mut r, &mut w).await {
        tracing::debug!(agent = %ctx.name, "stream closed: {e}");
    }
}

async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<Header>> {
    let mut hb = [0u8; HEADER_BYTES];
    match r.read_exact(&mut hb).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    Header::decode(&hb)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

fn invalid(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

async fn serve_inner<R, W>(ctx: &TargetCtx, r: &mut BufReader<R>, w: &mut W) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Some(hello) = read_header(r).await? else {
        return Ok(());
    };
    if hello.op != FrameOp::Hello || (hello.len as usize) < TOKEN_BYTES {
        return Err(invalid(format!("expected HELLO, got {:?}", hello.op)));
    }
    let mut buf = vec![0u8; hello.len as usize];
    r.read_exact(&mut buf).await?;
    let (token, name) = buf.split_at(TOKEN_BYTES);
    let peer_name = String::from_utf8_lossy(name).into_owned();
    let mut ack = Header::new(FrameOp::HelloAck, hello.id, 0, 0, 0);
    if !constant_time_eq(token, &ctx.token) {
        ack.status = Status::AuthFailed;
        w.write_all(&ack.encode()).await?;
        w.flush().await?;
        return Err(invalid(format!("{peer_name:?} presented a wrong token")));
    }
    w.write_all(&ack.encode()).await?;
    w.flush().await?;
    while let Some(h) = read_header(r).await? {
        match h.op {
            FrameOp::Write => {
                let (status, region) = match check_region(ctx, &h) {
                    (Status::Ok, Some(r)) if !r.remote_writes() => (Status::ReadOnly, None),
                    checked => checked,
                };
                let mut ack = Header::new(FrameOp::WriteAck, h.id, h.region, h.offset, 0);
                match region {
                    Some(region) => {
                        // SAFETY: `check_region` validated the range against this host
                        // region, the Arc keeps it mapped, and the memory contract on
                        // `RegionHandle` rules out other access to these bytes meanwhile.
                        let dst = unsafe { region.slice_mut(h.offset, h.len as usize) };
                        r.read_exact(dst).await?;
                    }
                    None => {
                        ack.status = status;
                        let copied = tokio::io::copy(
                            &mut (&mut *r).take(u64::from(h.len)),
                            &mut tokio::io::sink(),
                        )
                        .await?;
                        if copied != u64::from(h.len) {
                            return Err(invalid("stream ended inside a WRITE payload"));
                        }
                    }
                }
                w.write_all(&ack.encode()).await?;
                flush_if_idle(r, w).await?;
            }
            FrameOp::Read => {
                let (status, region) = check_region(ctx, &h);
                match region {
                    Some(region) => {
                        let reply = Header::new(FrameOp::ReadData, h.id, h.region, h.offset, h.len);
                        w.write_all(&reply.encode()).await?;
                        // SAFETY: as for WRITE above (read-only access).
                        let src = unsafe { region.slice(h.offset, h.len as usize) };
                        w.write_all(src).await?;
                    }
                    None => {
                        let mut reply = Header::new(FrameOp::ReadData, h.id, h.region, h.offset, 0);
                        reply.status = status;
                        w.write_all(&reply.encode()).await?;
                    }
                }
                flush_if_idle(r, w).await?;
            }
            FrameOp::Notify => {
                let mut message = vec![0u8; h.len as usize];
                r.read_exact(&mut message).await?;
                let n = Notification {
                    from: peer_name.clone(),
                    message,
                };
                // Back-pressure: a full notification queue stalls this stream only (its
                // earlier replies go out first).
                w.flush().await?;
                if ctx.notifications.send(n).await.is_err() {
                    return Ok(());
                }
                let ack = Header::new(FrameOp::NotifyAck, h.id, 0, 0, 0);
                w.write_all(&ack.encode()).await?;
                flush_if_idle(r, w).await?;
            }
            FrameOp::Check => {
                let mut ack = Header::new(FrameOp::CheckAck, h.id, h.region, 0, 0);
                if ctx.registry.get(crate::region::RegionId(h.region)).is_err() {
                    ack.status = Status::RegionNotFound;
                }
                w.write_all(&ack.encode()).await?;
                flush_if_idle(r, w).await?;
            }
            other => return Err(invalid(format!("unexpected {other:?} from an initiator"))),
        }
    }
    Ok(())
}

/// Flushes buffered replies unless more requests are already buffered (they will be answered
/// first, and the replies flushed together before the next read can block).
async fn flush_if_idle<R, W>(r: &BufReader<R>, w: &mut W) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if r.buffer().is_empty() {
        w.flush().await?;
    }
    Ok(())
}

fn check_region(ctx: &TargetCtx, h: &Header) -> (Status, Option<Arc<RegionMem>>) {
    let Ok(region) = ctx.registry.get(crate::region::RegionId(h.region)) else {
        return (Status::RegionNotFound, None);
    };
    if !region.kind.is_host() {
        return (Status::UnsupportedMemory, None);
    }
    if crate::region::check_range(0, "remote", h.offset, u64::from(h.len), region.len()).is_err() {
        return (Status::OutOfBounds, None);
    }
    (Status::Ok, Some(region))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::frame::MAX_CHUNK_BYTES;
    use crate::error::ErrorKind;
    use crate::region::Registry;
    use std::future::Future;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    const DEADLINE: Duration = Duration::from_secs(10);
    const TOKEN: [u8; TOKEN_BYTES] = [7; TOKEN_BYTES];

    fn target() -> (
        Arc<TargetCtx>,
        mpsc::Receiver<Notification>,
        crate::region::RegionHandle,
    ) {
        let registry = Arc::new(Registry::new("t".into(), None));
        let file = crate::region::memfd(4096, "test").unwrap();
        let region = registry
            .register_mapped(file, 4096, crate::region::MemKind::Dram)
            .unwrap();
        let (tx, rx) = mpsc::channel(4);
        let ctx = Arc::new(TargetCtx {
            name: "t".into(),
            token: TOKEN,
            registry,
            notifications: tx,
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        (ctx, rx, region)
    }

    fn hello(token: &[u8]) -> Vec<u8> {
        let mut v = Header::new(FrameOp::Hello, 0, 0, 0, (token.len() + 1) as u32)
            .encode()
            .to_vec();
        v.extend_from_slice(token);
        v.push(b'i');
        v
    }

    /// Feeds `input` to a target stream, closes it, and returns every reply header the target
    /// wrote before it closed. The target must end on its own (no hang, no panic).
    async fn run_target(input: Vec<u8>) -> Vec<Header> {
        let (ctx, _rx, _region) = target();
        let (client, server) = duplex(1 << 20);
        let (sr, sw) = tokio::io::split(server);
        let task = tokio::spawn(serve(ctx, sr, sw));
        let (mut cr, mut cw) = tokio::io::split(client);
        cw.write_all(&input).await.unwrap();
        cw.shutdown().await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(DEADLINE, cr.read_to_end(&mut out))
            .await
            .expect("target hung")
            .unwrap();
        tokio::time::timeout(DEADLINE, task)
            .await
            .expect("target hung")
            .unwrap();
        let mut headers = Vec::new();
        let mut rest = &out[..];
        while rest.len() >= HEADER_BYTES {
            let mut hb = [0u8; HEADER_BYTES];
            hb.copy_from_slice(&rest[..HEADER_BYTES]);
            let h = Header::decode(&hb).unwrap();
            rest = &rest[HEADER_BYTES
                + if h.op == FrameOp::ReadData {
                    h.len as usize
                } else {
                    0
                }..];
            headers.push(h);
        }
        headers
    }

    fn check(replies: &[Header], expected: &[(FrameOp, Status)]) {
        let got: Vec<_> = replies.iter().map(|h| (h.op, h.status)).collect();
        assert_eq!(got, expected);
    }

    #[tokio::test]
    async fn target_answers_or_closes_on_every_malformed_input() {
        use FrameOp::*;
        let ok_hello = hello(&TOKEN);
        let with = |frames: &[Vec<u8>]| {
            let mut v = ok_hello.clone();
            for f in frames {
                v.extend_from_slice(f);
            }
            v
        };
        let h = |op, region, offset, len| Header::new(op, 1, region, offset, len).encode().to_vec();
        // Wrong token: refused, closed.
        check(
            &run_target(hello(&[0; TOKEN_BYTES])).await,
            &[(HelloAck, Status::AuthFailed)],
        );
        // Garbage instead of a HELLO, a HELLO too short for a token, an empty stream.
        check(&run_target(vec![0xAB; 100]).await, &[]);
        check(&run_target(h(Hello, 0, 0, 3)).await, &[]);
        check(&run_target(Vec::new()).await, &[]);
        // After a good HELLO: a bad magic, an unknown op, an oversized WRITE, a reply op.
        let mut bad_magic = h(Read, 1, 0, 8);
        bad_magic[0] ^= 1;
        check(
            &run_target(with(&[bad_magic])).await,
            &[(HelloAck, Status::Ok)],
        );
        let mut unknown_op = h(Read, 1, 0, 8);
        unknown_op[5] = 200;
        check(
            &run_target(with(&[unknown_op])).await,
            &[(HelloAck, Status::Ok)],
        );
        check(
            &run_target(with(&[h(Write, 1, 0, MAX_CHUNK_BYTES + 1)])).await,
            &[(HelloAck, Status::Ok)],
        );
        check(
            &run_target(with(&[h(WriteAck, 1, 0, 0)])).await,
            &[(HelloAck, Status::Ok)],
        );
        // A truncated WRITE payload and a truncated header: the target just ends.
        let mut trunc = h(Write, 1, 0, 100);
        trunc.extend_from_slice(&[1; 10]);
        check(&run_target(with(&[trunc])).await, &[(HelloAck, Status::Ok)]);
        check(
            &run_target(with(&[vec![1, 2, 3]])).await,
            &[(HelloAck, Status::Ok)],
        );
        // Errors that keep the stream usable: unknown region, out of bounds (payload drained),
        // then a valid READ and CHECKs.
        let mut w_missing = h(Write, 99, 0, 10);
        w_missing.extend_from_slice(&[5; 10]);
        let mut w_oob = h(Write, 1, 4090, 10);
        w_oob.extend_from_slice(&[5; 10]);
        let replies = run_target(with(&[
            w_missing,
            w_oob,
            h(Read, 1, u64::MAX, 2),
            h(Read, 1, 0, 16),
            h(Check, 1, 0, 0),
            h(Check, 42, 0, 0),
        ]))
        .await;
        check(
            &replies,
            &[
                (HelloAck, Status::Ok),
                (WriteAck, Status::RegionNotFound),
                (WriteAck, Status::OutOfBounds),
                (ReadData, Status::OutOfBounds),
                (ReadData, Status::Ok),
                (CheckAck, Status::Ok),
                (CheckAck, Status::RegionNotFound),
            ],
        );
    }

    /// A fake target's side of the handshake: reads the HELLO (and its token and name),
    /// acknowledges it.
    async fn accept_hello<R, W>(r: &mut R, w: &mut W)
    where
        R: tokio::io::AsyncRead + Unpin,
        W: tokio::io::AsyncWrite + Unpin,
    {
        let mut hb = [0u8; HEADER_BYTES];
        r.read_exact(&mut hb).await.unwrap();
        let hello = Header::decode(&hb).unwrap();
        let mut skip = vec![0u8; hello.len as usize];
        r.read_exact(&mut skip).await.unwrap();
        w.write_all(&Header::new(FrameOp::HelloAck, 0, 0, 0, 0).encode())
            .await
            .unwrap();
    }

    /// A fake target that acknowledges the HELLO, then answers the first request with
    /// `reply` (or closes, for an empty reply).
    async fn lane_against(reply: Vec<u8>) -> TransferError {
        let (client, server) = duplex(1 << 20);
        let (cr, cw) = tokio::io::split(client);
        let fake = tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            let mut hb = [0u8; HEADER_BYTES];
            accept_hello(&mut r, &mut w).await;
            r.read_exact(&mut hb).await.unwrap();
            w.write_all(&reply).await.unwrap();
            // Keep the stream open until the lane gives up on it.
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest).await;
        });
        let lane = Lane::start("fake", "me", &TOKEN, cr, cw).await.unwrap();
        let ctl = Arc::new(TransferCtl::new(1));
        let err = tokio::time::timeout(DEADLINE, lane.notify(&ctl, b"n".to_vec()))
            .await
            .expect("lane hung")
            .unwrap_err();
        drop(lane);
        let _ = tokio::time::timeout(DEADLINE, fake).await;
        err
    }

    #[tokio::test]
    async fn initiator_fails_cleanly_on_malformed_replies() {
        // Garbage, a reply to an unknown request, the wrong reply op, an error with a payload.
        let e = lane_against(vec![0xFF; HEADER_BYTES]).await;
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        let e = lane_against(
            Header::new(FrameOp::NotifyAck, 999, 0, 0, 0)
                .encode()
                .to_vec(),
        )
        .await;
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        let e = lane_against(Header::new(FrameOp::WriteAck, 1, 0, 0, 0).encode().to_vec()).await;
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        let mut h = Header::new(FrameOp::NotifyAck, 1, 0, 0, 0);
        h.status = Status::RegionNotFound;
        let mut bytes = h.encode();
        bytes[32] = 4; // a payload length on an error reply
        let e = lane_against(bytes.to_vec()).await;
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        // The peer closing mid-request.
        let (client, server) = duplex(1 << 16);
        let (cr, cw) = tokio::io::split(client);
        let fake = tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            let mut hb = [0u8; HEADER_BYTES];
            accept_hello(&mut r, &mut w).await;
            r.read_exact(&mut hb).await.unwrap();
        });
        let lane = Lane::start("fake", "me", &TOKEN, cr, cw).await.unwrap();
        let ctl = Arc::new(TransferCtl::new(1));
        let e = tokio::time::timeout(DEADLINE, lane.notify(&ctl, b"n".to_vec()))
            .await
            .expect("lane hung")
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Disconnected, "{e}");
        fake.await.unwrap();
        // A refused token.
        let (client, server) = duplex(1 << 16);
        let (cr, cw) = tokio::io::split(client);
        tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            let mut hb = [0u8; HEADER_BYTES];
            let _ = r.read_exact(&mut hb).await;
            let mut ack = Header::new(FrameOp::HelloAck, 0, 0, 0, 0);
            ack.status = Status::AuthFailed;
            let _ = w.write_all(&ack.encode()).await;
        });
        let Err(e) = Lane::start("fake", "me", &TOKEN, cr, cw).await else {
            panic!("a refused token was accepted");
        };
        assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    }

    /// A READ whose reply stops inside its payload (a peer that hangs) keeps the transfer
    /// unsettled: its reader may still write the destination. Closing the lane settles it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_stuck_inside_its_payload_settles_only_once_the_lane_is_closed() {
        let (client, server) = duplex(1 << 20);
        let (cr, cw) = tokio::io::split(client);
        let fake = tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            let mut hb = [0u8; HEADER_BYTES];
            accept_hello(&mut r, &mut w).await;
            r.read_exact(&mut hb).await.unwrap();
            let read = Header::decode(&hb).unwrap();
            let data = Header::new(FrameOp::ReadData, read.id, read.region, 0, read.len);
            w.write_all(&data.encode()).await.unwrap();
            w.write_all(&vec![1u8; read.len as usize / 2])
                .await
                .unwrap();
            w.flush().await.unwrap();
            // Hang: neither the rest nor a close.
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest).await;
        });
        let (_ctx, _rx, region) = target();
        let lane = Lane::start("fake", "me", &TOKEN, cr, cw).await.unwrap();
        let ctl = Arc::new(TransferCtl::new(1));
        lane.post(
            &ctl,
            Header::new(FrameOp::Read, 0, 1, 0, 4096),
            Payload::None,
            FrameOp::ReadData,
            Some((Arc::clone(&region.mem), 0)),
        )
        .await
        .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(200), ctl.settled())
                .await
                .is_err(),
            "settled while its reply was still being read"
        );
        lane.close();
        tokio::time::timeout(DEADLINE, ctl.settled())
            .await
            .expect("a closed lane settles its transfers");
        drop(lane);
        fake.abort();
    }

    #[tokio::test]
    async fn a_post_dropped_while_the_queue_is_full_leaves_no_pending_entry() {
        let (client, server) = duplex(4096);
        let (cr, cw) = tokio::io::split(client);
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let fake = tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            accept_hello(&mut r, &mut w).await;
            // Stop reading: the lane's queue fills up.
            let _ = release_rx.await;
        });
        let lane = Lane::start("fake", "me", &TOKEN, cr, cw).await.unwrap();
        let ctl = Arc::new(TransferCtl::new(1));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut sent = 0usize;
        loop {
            let header = Header::new(FrameOp::Notify, 0, 0, 0, 16);
            let mut fut = Box::pin(lane.post(
                &ctl,
                header,
                Payload::Bytes(vec![0; 16]),
                FrameOp::NotifyAck,
                None,
            ));
            match fut.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(r) => {
                    r.unwrap();
                    sent += 1;
                }
                std::task::Poll::Pending => break,
            }
            assert!(sent <= LANE_QUEUE_FRAMES, "the queue never filled");
        }
        // The last post was dropped while waiting for room: its entry is gone.
        assert_eq!(lane.pending_len(), sent);
        let _ = release_tx.send(());
        drop(lane);
        let _ = tokio::time::timeout(DEADLINE, fake).await;
    }
}

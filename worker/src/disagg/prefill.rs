//! The prefill role: `POST /kvtier/prefill` computes a prompt's KV and writes it, layer by
//! layer, into the requesting decode worker's blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvtier_core::KvLayout;
use kvtier_transfer::{Agent, BackendKind, Descriptor, Op, Peer, RegionId, TransferStats};
use tokio::task::JoinHandle;

use super::wire::{
    ErrorBody, MAX_REQUEST_BYTES, PREFILL_PATH, PrefillRequest, PrefillResponse,
    encode_notification, hex_decode, layer_runs,
};
use super::{lock, parse_backend};
use crate::engine::Engine;
use crate::error::{Result, WorkerError};
use crate::kv_cache::{BlockTable, PagedKvCache};
use crate::model::LayerHook;

/// Connections to decode agents kept open (keyed by their metadata blob and backend); over
/// this many, the cache is emptied and refilled on demand.
pub const MAX_PEERS: usize = 64;

/// How the prefill role behaves. Every field's doc ends with its default.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// Longest wait, after the forward, for the layer writes to complete; past it they are
    /// cancelled and the request fails. Default: 30 s.
    pub transfer_timeout: Duration,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            transfer_timeout: Duration::from_secs(30),
        }
    }
}

/// Counters of the prefill role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillStats {
    /// Requests whose every layer was written.
    pub served: u64,
    /// Requests refused as malformed (answered 400).
    pub rejected: u64,
    /// Requests that failed after validation (answered 5xx).
    pub failed: u64,
    /// Bytes written to decode workers.
    pub bytes: u64,
}

/// A failed request: the HTTP status and why.
#[derive(Debug)]
struct Failure {
    status: StatusCode,
    reason: String,
}

fn bad(reason: impl Into<String>) -> Failure {
    Failure {
        status: StatusCode::BAD_REQUEST,
        reason: reason.into(),
    }
}

fn upstream(reason: impl Into<String>) -> Failure {
    Failure {
        status: StatusCode::BAD_GATEWAY,
        reason: reason.into(),
    }
}

/// The prefill role: an engine whose pool is registered with `agent` (the source of the
/// writes), and connections to decode agents.
pub struct PrefillServer {
    engine: Arc<Mutex<Engine>>,
    agent: Arc<Agent>,
    layout: KvLayout,
    region: RegionId,
    block_bytes: u64,
    vocab_size: usize,
    max_context_tokens: usize,
    peers: Mutex<HashMap<(BackendKind, Vec<u8>), Peer>>,
    /// Source blocks whose writes are over, waiting for the engine to be free.
    to_release: Arc<Mutex<Vec<BlockTable>>>,
    cfg: PrefillConfig,
    served: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
}

impl std::fmt::Debug for PrefillServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillServer")
            .field("agent", &self.agent.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl PrefillServer {
    /// The prefill role over `engine`, whose pool must live in a region of `agent`
    /// ([`super::engine_in_agent`]).
    pub fn new(
        engine: Arc<Mutex<Engine>>,
        agent: Arc<Agent>,
        cfg: PrefillConfig,
    ) -> Result<Arc<Self>> {
        let (layout, region, block_bytes, vocab_size, max_context_tokens) = {
            let e = lock(&engine);
            let cache = e.cache();
            let region = cache.region().ok_or_else(|| WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: "the prefill role needs its pool in a registered region".to_owned(),
            })?;
            let m = e.model().config();
            (
                *cache.layout(),
                region.id(),
                cache.block_size_bytes() as u64,
                m.vocab_size,
                m.max_context_tokens,
            )
        };
        Ok(Arc::new(Self {
            engine,
            agent,
            layout,
            region,
            block_bytes,
            vocab_size,
            max_context_tokens,
            peers: Mutex::new(HashMap::new()),
            to_release: Arc::new(Mutex::new(Vec::new())),
            cfg,
            served: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }))
    }

    pub fn stats(&self) -> PrefillStats {
        PrefillStats {
            served: self.served.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Serves one request: validates it, connects to the decode agent (or reuses the
    /// connection), runs the forward shipping each layer as it is computed, and waits for
    /// every write to complete before answering. On any failure no write of this request is
    /// still posted when the answer goes out.
    async fn serve(&self, req: PrefillRequest) -> std::result::Result<PrefillResponse, Failure> {
        let bt = self.layout.block_tokens() as usize;
        let n = req.tokens.len();
        if n == 0 {
            return Err(bad("no tokens to prefill"));
        }
        if req.layout_fingerprint != self.layout.fingerprint() {
            return Err(bad(format!(
                "KV layout fingerprint {:#x} is not this worker's {:#x} (another model or block size)",
                req.layout_fingerprint,
                self.layout.fingerprint()
            )));
        }
        if req.blocks.len() != n.div_ceil(bt) {
            return Err(bad(format!(
                "{} tokens need {} destination blocks of {bt} tokens, the request names {}",
                n,
                n.div_ceil(bt),
                req.blocks.len()
            )));
        }
        let backend = parse_backend(&req.backend).map_err(|e| bad(e.to_string()))?;
        let blob =
            hex_decode(&req.agent_blob).map_err(|e| bad(format!("agent_blob is not hex: {e}")))?;
        if let Some(&id) = req.tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(bad(format!(
                "token id {id} is outside the vocabulary of {}",
                self.vocab_size
            )));
        }
        if n > self.max_context_tokens {
            return Err(bad(format!(
                "{n} tokens exceed the model's context of {}",
                self.max_context_tokens
            )));
        }
        let peer = self.peer(&blob, backend).await?;
        if !peer.has_region(RegionId(req.region)) {
            return Err(bad(format!(
                "the decode agent's metadata lists no region {}",
                req.region
            )));
        }
        let result = self.run(req, peer).await;
        if let Err(f) = &result
            && f.status != StatusCode::BAD_REQUEST
        {
            // The connection may be what failed: connect afresh next time.
            self.peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(backend, blob));
        }
        result
    }

    /// Frees a request's source blocks now if the engine is free, else hands them to the next
    /// forward (which frees them before reserving its own): the answer never waits behind
    /// another request's forward.
    fn release(&self, table: BlockTable) {
        self.to_release
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(table);
        let engine = match self.engine.try_lock() {
            Ok(e) => e,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        let mut engine = engine;
        release_deferred(&mut engine, &self.to_release);
    }

    async fn peer(&self, blob: &[u8], backend: BackendKind) -> std::result::Result<Peer, Failure> {
        let key = (backend, blob.to_vec());
        if let Some(p) = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(p.clone());
        }
        let peer = self.agent.connect(blob, backend).await.map_err(|e| {
            let reason = format!("connecting to the decode agent over {backend}: {e}");
            match e.kind() {
                kvtier_transfer::ErrorKind::Metadata => bad(reason),
                _ => upstream(reason),
            }
        })?;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.len() >= MAX_PEERS {
            peers.clear();
        }
        peers.insert(key, peer.clone());
        Ok(peer)
    }

    async fn run(
        &self,
        req: PrefillRequest,
        peer: Peer,
    ) -> std::result::Result<PrefillResponse, Failure> {
        let engine = Arc::clone(&self.engine);
        let to_release = Arc::clone(&self.to_release);
        let layout = self.layout;
        let (src_region, block_bytes) = (self.region, self.block_bytes);
        let rt = tokio::runtime::Handle::current();
        let request_id = req.request_id;
        let n = req.tokens.len();
        let computed = tokio::task::spawn_blocking(move || {
            let mut e = lock(&engine);
            release_deferred(&mut e, &to_release);
            let mut table = BlockTable::new();
            if let Err(err) = e.cache_mut().reserve(&mut table, n) {
                return (table, Vec::new(), Err(err), Duration::ZERO);
            }
            let mut hook = ShipLayers {
                peer,
                rt,
                layout,
                request_id,
                tokens: n,
                src_region,
                dst_region: RegionId(req.region),
                src_blocks: table.blocks().iter().map(|b| b.0).collect(),
                dst_blocks: req.blocks,
                block_bytes,
                posted: Vec::new(),
            };
            let t0 = Instant::now();
            let r = e
                .prefill_hooked(&req.tokens, 0, &mut table, &mut hook)
                .map(|_| ());
            (table, hook.posted, r, t0.elapsed())
        })
        .await;
        let (table, posted, forward, compute) = match computed {
            Ok(c) => c,
            Err(e) => {
                return Err(Failure {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    reason: format!("prefill task failed: {e}"),
                });
            }
        };
        let t_tail = Instant::now();
        let layers = posted.len() as u32;
        let outcome = match forward {
            Err(e) => {
                cancel_all(posted).await;
                Err(e)
            }
            Ok(()) => self.await_writes(posted).await,
        };
        // Every write has completed or been cancelled and dropped: the source blocks may go.
        self.release(table);
        match outcome {
            Ok(bytes) => {
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
                Ok(PrefillResponse {
                    request_id,
                    layers,
                    bytes,
                    compute_us: compute.as_micros() as u64,
                    transfer_tail_us: t_tail.elapsed().as_micros() as u64,
                })
            }
            Err(e) => Err(match e {
                WorkerError::Transfer(t)
                    if t.kind() == kvtier_transfer::ErrorKind::InvalidDescriptor =>
                {
                    bad(format!("destination blocks outside the decode region: {t}"))
                }
                WorkerError::Transfer(t) => upstream(format!("layer write failed: {t}")),
                WorkerError::CacheFull { .. } => Failure {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    reason: e.to_string(),
                },
                other => Failure {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    reason: other.to_string(),
                },
            }),
        }
    }

    /// Waits for every layer's write; past the timeout, or at the first failure, cancels the
    /// rest. Returns the bytes written.
    async fn await_writes(
        &self,
        posted: Vec<JoinHandle<kvtier_transfer::Result<TransferStats>>>,
    ) -> Result<u64> {
        let deadline = tokio::time::Instant::now() + self.cfg.transfer_timeout;
        let mut bytes = 0;
        let mut first_err = None;
        let mut handles = posted.into_iter();
        for h in handles.by_ref() {
            let abort = h.abort_handle();
            match tokio::time::timeout_at(deadline, h).await {
                Ok(Ok(Ok(stats))) => bytes += stats.bytes,
                Ok(Ok(Err(e))) => {
                    first_err = Some(WorkerError::Transfer(e));
                    break;
                }
                Ok(Err(join)) => {
                    first_err = Some(WorkerError::Disagg {
                        reason: format!("layer write task failed: {join}"),
                    });
                    break;
                }
                Err(_) => {
                    abort.abort();
                    first_err = Some(WorkerError::Disagg {
                        reason: format!(
                            "layer writes not complete after {:?}",
                            self.cfg.transfer_timeout
                        ),
                    });
                    break;
                }
            }
        }
        match first_err {
            None => Ok(bytes),
            Some(e) => {
                cancel_all(handles.collect()).await;
                Err(e)
            }
        }
    }
}

/// Frees the tables queued in `to_release` (their writes are over).
fn release_deferred(engine: &mut Engine, to_release: &Mutex<Vec<BlockTable>>) {
    let tables = std::mem::take(&mut *to_release.lock().unwrap_or_else(|p| p.into_inner()));
    for mut t in tables {
        // Only tables this server reserved are queued, once each: release cannot fail.
        let _ = engine.cache_mut().release_table(&mut t);
    }
}

/// Cancels posted writes (dropping a transfer cancels it) and waits until their tasks are gone.
async fn cancel_all(handles: Vec<JoinHandle<kvtier_transfer::Result<TransferStats>>>) {
    for h in &handles {
        h.abort();
    }
    for h in handles {
        let _ = h.await;
    }
}

/// Posts one write per layer, right after the layer's K/V is in the cache.
struct ShipLayers {
    peer: Peer,
    rt: tokio::runtime::Handle,
    layout: KvLayout,
    request_id: u64,
    tokens: usize,
    src_region: RegionId,
    dst_region: RegionId,
    src_blocks: Vec<u32>,
    dst_blocks: Vec<u32>,
    block_bytes: u64,
    posted: Vec<JoinHandle<kvtier_transfer::Result<TransferStats>>>,
}

impl LayerHook for ShipLayers {
    fn after_kv_write(&mut self, layer: usize, _cache: &PagedKvCache) -> Result<()> {
        let bt = self.layout.block_tokens() as usize;
        let mut descs = Vec::with_capacity(self.src_blocks.len() * 2);
        for (i, (&src, &dst)) in self.src_blocks.iter().zip(&self.dst_blocks).enumerate() {
            let filled = (self.tokens - i * bt).min(bt) as u32;
            for (off, len) in layer_runs(&self.layout, layer as u32, filled) {
                descs.push(Descriptor::new(
                    self.src_region,
                    u64::from(src) * self.block_bytes + off,
                    self.dst_region,
                    u64::from(dst) * self.block_bytes + off,
                    len,
                ));
            }
        }
        let note = encode_notification(self.request_id, layer as u32);
        let transfer = self.peer.post(Op::Write, &descs, Some(note))?;
        self.posted.push(self.rt.spawn(transfer));
        Ok(())
    }
}

/// The prefill role's routes: `POST /kvtier/prefill` (JSON [`PrefillRequest`] in,
/// [`PrefillResponse`] out; errors as `{"error": ...}` with 400 for a malformed request, 502
/// when the decode agent cannot be reached or written, 503 when the pool is full). Merge it
/// into the worker's HTTP router.
pub fn prefill_router(server: Arc<PrefillServer>) -> Router {
    Router::new()
        .route(PREFILL_PATH, post(handle))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(server)
}

async fn handle(State(server): State<Arc<PrefillServer>>, body: axum::body::Bytes) -> Response {
    // The work runs as its own task: a client that hangs up (a decode worker past its
    // deadline) drops this future, and must not cut the request short between its forward
    // and the release of its source blocks.
    let work = tokio::spawn(async move {
        let answer = match serde_json::from_slice::<PrefillRequest>(&body) {
            Err(e) => Err(bad(format!("malformed prefill request: {e}"))),
            Ok(req) => server.serve(req).await,
        };
        let counter = match &answer {
            Ok(_) => &server.served,
            Err(f) if f.status == StatusCode::BAD_REQUEST => &server.rejected,
            Err(_) => &server.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        answer
    });
    match work.await {
        Ok(Ok(r)) => axum::Json(r).into_response(),
        Ok(Err(f)) => (f.status, axum::Json(ErrorBody { error: f.reason })).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(ErrorBody {
                error: format!("prefill task failed: {e}"),
            }),
        )
            .into_response(),
    }
}

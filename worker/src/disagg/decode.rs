//! The decode role: takes the client's request, has a prefill worker compute the prompt's KV
//! straight into its own blocks, runs the last prompt token layer by layer as the layers land,
//! and decodes. Falls back to a local prefill on any failure of the remote path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier_transfer::{Agent, BackendKind, RegionId};
use tokio::task::{AbortHandle, JoinHandle};

use super::client::{ControlError, authority, post_json};
use super::wire::{
    ErrorBody, PREFILL_PATH, PrefillRequest, PrefillResponse, decode_notification, hex_encode,
};
use super::{joined, lock};
use crate::engine::{Engine, Generation, Sampling};
use crate::error::{Result, WorkerError};
use crate::kv_cache::{BlockTable, PagedKvCache};
use crate::model::LayerHook;

/// After a failed remote prefill whose request may have reached the prefill worker, its
/// blocks stay out of the pool until the control call has ended and this much longer (writes
/// already on the wire when the prefill worker cancelled may still land), or until
/// [`DecodeConfig::quarantine`] has passed.
pub const QUARANTINE_GRACE: Duration = Duration::from_secs(1);

/// How long a fallback waits for the failed control call to finish before deciding whether
/// the blocks can be reused.
const CONTROL_SETTLE: Duration = Duration::from_millis(100);

/// How the decode role reaches its prefill worker. Every field's doc ends with its default.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// The prefill worker's base URL, `http://host:port`. No default.
    pub prefill_url: String,
    /// Backend the prefill worker writes over (`Shm` on one host). No default.
    pub backend: BackendKind,
    /// Deadline of the whole remote prefill, from the request until the last layer has
    /// landed; past it the decode worker prefills locally. Default: 30 s.
    pub request_timeout: Duration,
    /// Deadline for opening the control connection. Default: 1 s.
    pub connect_timeout: Duration,
    /// Longest a failed request's blocks are kept out of the pool. Default: 60 s.
    pub quarantine: Duration,
    /// Prompts shorter than this are prefilled locally (the round trip would cost more than
    /// the compute it saves). At least 2: the last token is always run locally. Default: 2.
    pub min_remote_tokens: usize,
    /// Start the decode worker's last-token step when layer 0 has landed and run each layer
    /// as its KV lands (layer streaming). When false, the step waits for every layer before
    /// taking the engine, so a request waiting on a long remote prefill never holds the engine
    /// (the choice for a batching scheduler that shares it). Default: true.
    pub stream_layers: bool,
}

impl DecodeConfig {
    pub fn new(prefill_url: impl Into<String>, backend: BackendKind) -> Self {
        Self {
            prefill_url: prefill_url.into(),
            backend,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(1),
            quarantine: Duration::from_secs(60),
            min_remote_tokens: 2,
            stream_layers: true,
        }
    }
}

/// How a prompt was prefilled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillPath {
    /// By the prefill worker; the decode worker ran the last token.
    Remote,
    /// Locally, because the remote path failed (`reason`): a fallback.
    Fallback { reason: String },
    /// Locally, because the prompt is shorter than [`DecodeConfig::min_remote_tokens`].
    Short,
}

/// Timing of a remote prefill, from the call to [`DisaggDecoder::prefill`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteTimings {
    /// Layer 0's KV landed.
    pub first_layer_landed: Duration,
    /// The last layer's KV landed.
    pub last_layer_landed: Duration,
    /// The decode worker's own step (the last prompt token) started its layer 0.
    pub step_started: Duration,
    /// From the last layer landing to the first logits: what layer streaming leaves exposed.
    pub first_logits_after_last_layer: Duration,
}

impl RemoteTimings {
    /// Whether the decode step was already running when the last layer landed.
    pub fn step_started_before_last_layer(&self) -> bool {
        self.step_started < self.last_layer_landed
    }
}

/// What [`DisaggDecoder::prefill_remote`] got.
#[derive(Debug)]
pub enum Remote {
    /// The prompt's KV, from the prefill worker.
    Done(Prefilled),
    /// Prefill the prompt locally (why: short, or the remote path failed).
    Local(PrefillPath),
}

/// The remote attempt's outcome inside [`DisaggDecoder`].
enum Attempt {
    Done(Prefilled),
    Local {
        prompt: Vec<u32>,
        table: BlockTable,
        path: PrefillPath,
        t0: Instant,
    },
}

/// A prefilled prompt, ready to decode: `table` (owned by the caller, who frees it with
/// [`PagedKvCache::release_table`]) holds the prompt's KV, `logits` are those of its last
/// position.
#[derive(Debug)]
pub struct Prefilled {
    pub table: BlockTable,
    pub logits: Vec<f32>,
    pub path: PrefillPath,
    /// From the call to the logits (the first token is one sample away).
    pub ttft: Duration,
    /// Set on the remote path.
    pub remote: Option<RemoteTimings>,
}

/// The result of [`DisaggDecoder::generate`].
#[derive(Clone, Debug)]
pub struct DisaggGeneration {
    /// As from [`Engine::generate`]; `prefill_time` is the TTFT below.
    pub generation: Generation,
    pub path: PrefillPath,
    pub ttft: Duration,
    pub remote: Option<RemoteTimings>,
}

/// Counters of the decode role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Prompts prefilled remotely.
    pub remote: u64,
    /// Prompts prefilled locally after the remote path failed.
    pub fallbacks: u64,
    /// Prompts too short for the remote path.
    pub short: u64,
    /// Blocks put in quarantine after failures (each returns to the pool later).
    pub quarantined_blocks: u64,
    /// Fallbacks that waited for a failed request's writes to be over and reused its blocks,
    /// because the pool had no room for fresh ones.
    pub fence_waits: u64,
    /// Notifications for no request in flight (late writes of a failed request) or not ours.
    pub stray_notifications: u64,
}

#[derive(Default)]
struct Counters {
    remote: AtomicU64,
    fallbacks: AtomicU64,
    short: AtomicU64,
    quarantined_blocks: AtomicU64,
    fence_waits: AtomicU64,
    stray_notifications: AtomicU64,
}

/// Per request: which layers have landed, or why the remote path failed.
struct LayerGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

struct GateState {
    landed: Vec<Option<Instant>>,
    failed: Option<String>,
}

impl LayerGate {
    fn new(layers: usize) -> Self {
        Self {
            state: Mutex::new(GateState {
                landed: vec![None; layers],
                failed: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Layer `layer` has landed; `false` if no such layer.
    fn land(&self, layer: u32) -> bool {
        let mut s = self.state();
        let Some(slot) = s.landed.get_mut(layer as usize) else {
            return false;
        };
        slot.get_or_insert_with(Instant::now);
        drop(s);
        self.changed.notify_all();
        true
    }

    fn fail(&self, reason: String) {
        self.state().failed.get_or_insert(reason);
        self.changed.notify_all();
    }

    /// Blocks until `layer` has landed, the request failed, or `deadline`.
    fn wait(&self, layer: usize, deadline: Instant) -> Result<()> {
        let mut s = self.state();
        loop {
            if s.landed.get(layer).is_some_and(Option::is_some) {
                return Ok(());
            }
            if let Some(r) = &s.failed {
                return Err(WorkerError::Disagg { reason: r.clone() });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WorkerError::Disagg {
                    reason: format!("layer {layer} had not landed by the request deadline"),
                });
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn last_landed(&self) -> Option<Instant> {
        let s = self.state();
        s.landed
            .iter()
            .copied()
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    }

    fn first_landed(&self) -> Option<Instant> {
        self.state().landed.first().copied().flatten()
    }
}

/// The decode step's hook: layer `l` runs once its KV has landed.
struct AwaitLayers {
    gate: Arc<LayerGate>,
    deadline: Instant,
    step_started: Option<Instant>,
}

impl LayerHook for AwaitLayers {
    fn before_layer(&mut self, layer: usize, _cache: &PagedKvCache) -> Result<()> {
        self.gate.wait(layer, self.deadline)?;
        self.step_started.get_or_insert_with(Instant::now);
        Ok(())
    }
}

struct Inner {
    engine: Arc<Mutex<Engine>>,
    cfg: DecodeConfig,
    region: RegionId,
    blob_hex: String,
    layout_fingerprint: u64,
    num_layers: usize,
    block_tokens: usize,
    vocab_size: usize,
    max_context_tokens: usize,
    gates: Mutex<HashMap<u64, Arc<LayerGate>>>,
    next_id: AtomicU64,
    counters: Counters,
}

/// The decode role. Owns its agent's notification queue: nothing else may call
/// `recv_notification` on that agent.
pub struct DisaggDecoder {
    inner: Arc<Inner>,
    demux: AbortHandle,
    _agent: Arc<Agent>,
}

impl std::fmt::Debug for DisaggDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DisaggDecoder")
            .field("prefill_url", &self.inner.cfg.prefill_url)
            .field("backend", &self.inner.cfg.backend)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for DisaggDecoder {
    fn drop(&mut self) {
        self.demux.abort();
    }
}

impl DisaggDecoder {
    /// The decode role over `engine`, whose pool must live in a region of `agent`
    /// ([`super::engine_in_agent`]). Needs a Tokio runtime (it starts the task that routes
    /// layer notifications).
    pub fn new(engine: Arc<Mutex<Engine>>, agent: Arc<Agent>, cfg: DecodeConfig) -> Result<Self> {
        authority(&cfg.prefill_url).map_err(|reason| WorkerError::Config {
            field: "prefill_url".to_owned(),
            reason,
        })?;
        if cfg.min_remote_tokens < 2 {
            return Err(WorkerError::Config {
                field: "min_remote_tokens".to_owned(),
                reason: "must be at least 2 (the last token always runs locally)".to_owned(),
            });
        }
        let (region, layout_fingerprint, num_layers, block_tokens, vocab_size, max_context_tokens) = {
            let e = lock(&engine);
            let region = e.cache().region().ok_or_else(|| WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: "the decode role needs its pool in a registered region".to_owned(),
            })?;
            let m = e.model().config();
            (
                region.id(),
                e.cache().layout().fingerprint(),
                m.num_layers,
                e.cache().block_tokens(),
                m.vocab_size,
                m.max_context_tokens,
            )
        };
        let inner = Arc::new(Inner {
            engine,
            cfg,
            region,
            blob_hex: hex_encode(&agent.metadata()?),
            layout_fingerprint,
            num_layers,
            block_tokens,
            vocab_size,
            max_context_tokens,
            gates: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            counters: Counters::default(),
        });
        let demux = tokio::spawn(route_notifications(
            Arc::clone(&agent),
            Arc::downgrade(&inner),
        ))
        .abort_handle();
        Ok(Self {
            inner,
            demux,
            _agent: agent,
        })
    }

    pub fn stats(&self) -> DecodeStats {
        let c = &self.inner.counters;
        DecodeStats {
            remote: c.remote.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            short: c.short.load(Ordering::Relaxed),
            quarantined_blocks: c.quarantined_blocks.load(Ordering::Relaxed),
            fence_waits: c.fence_waits.load(Ordering::Relaxed),
            stray_notifications: c.stray_notifications.load(Ordering::Relaxed),
        }
    }

    /// The engine this role decodes with.
    pub fn engine(&self) -> &Arc<Mutex<Engine>> {
        &self.inner.engine
    }

    /// Prefills `prompt`, remotely when possible, and returns its blocks and last logits.
    /// Errors are those a local prefill would give (an invalid prompt, a full pool); a
    /// failure of the remote path is never returned, it falls back to a local prefill.
    pub async fn prefill(&self, prompt: Vec<u32>) -> Result<Prefilled> {
        match self.attempt(prompt).await? {
            Attempt::Done(p) => Ok(p),
            Attempt::Local {
                prompt,
                table,
                path,
                t0,
            } => self.prefill_locally(prompt, table, path, t0).await,
        }
    }

    /// [`prefill`](Self::prefill) without the local fallback: the prompt's KV from the
    /// prefill worker, or [`Remote::Local`] when the prompt is short or the remote path
    /// failed (counted as a fallback; the blocks it held are released, or quarantined while a
    /// late write could still land). The caller then prefills the prompt itself: `serve`
    /// hands it to the scheduler, which runs it in chunks between the other sequences' steps
    /// instead of holding the engine for the whole prompt.
    pub async fn prefill_remote(&self, prompt: Vec<u32>) -> Result<Remote> {
        match self.attempt(prompt).await? {
            Attempt::Done(p) => Ok(Remote::Done(p)),
            Attempt::Local { table, path, .. } => {
                if !table.is_empty() {
                    let engine = Arc::clone(&self.inner.engine);
                    let released = joined(
                        tokio::task::spawn_blocking(move || {
                            let mut table = table;
                            lock(&engine).cache_mut().release_table(&mut table)
                        })
                        .await,
                    )?;
                    released?;
                }
                Ok(Remote::Local(path))
            }
        }
    }

    /// The remote path of [`prefill`](Self::prefill), or what to prefill locally.
    async fn attempt(&self, prompt: Vec<u32>) -> Result<Attempt> {
        let t0 = Instant::now();
        let inner = &self.inner;
        let n = prompt.len();
        if n == 0 {
            return Err(WorkerError::EmptyPrompt);
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= inner.vocab_size) {
            return Err(WorkerError::TokenOutOfVocab {
                id,
                vocab_size: inner.vocab_size,
            });
        }
        if n > inner.max_context_tokens {
            return Err(WorkerError::ContextFull {
                tokens: n,
                max_context_tokens: inner.max_context_tokens,
            });
        }
        if n < inner.cfg.min_remote_tokens {
            inner.counters.short.fetch_add(1, Ordering::Relaxed);
            return Ok(Attempt::Local {
                prompt,
                table: BlockTable::new(),
                path: PrefillPath::Short,
                t0,
            });
        }

        // Reserve the blocks the prefill worker fills (all but the last token's position).
        let engine = Arc::clone(&inner.engine);
        let table = joined(
            tokio::task::spawn_blocking(move || {
                let mut t = BlockTable::new();
                lock(&engine).cache_mut().reserve(&mut t, n - 1).map(|()| t)
            })
            .await,
        )??;
        let request_id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let gate = Arc::new(LayerGate::new(inner.num_layers));
        inner
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(request_id, Arc::clone(&gate));
        let req = PrefillRequest {
            request_id,
            tokens: prompt[..n - 1].to_vec(),
            layout_fingerprint: inner.layout_fingerprint,
            agent_blob: inner.blob_hex.clone(),
            backend: inner.cfg.backend.name().to_owned(),
            region: inner.region.0,
            blocks: table.blocks().iter().map(|b| b.0).collect(),
        };
        let control = tokio::spawn(call_prefill(inner.cfg.clone(), req, Arc::clone(&gate)));

        // The last token, each layer as soon as its KV has landed. Layer 0 (every layer
        // without streaming) is awaited before taking the engine so other requests run
        // meanwhile.
        let deadline = t0 + inner.cfg.request_timeout;
        let before_lock = if inner.cfg.stream_layers {
            1
        } else {
            inner.num_layers
        };
        let engine = Arc::clone(&inner.engine);
        let step_gate = Arc::clone(&gate);
        let stepped = joined(
            tokio::task::spawn_blocking(move || {
                let mut table = table;
                let mut hook = AwaitLayers {
                    gate: step_gate,
                    deadline,
                    step_started: None,
                };
                let r = (0..before_lock)
                    .try_for_each(|l| hook.gate.wait(l, deadline))
                    .and_then(|()| {
                        lock(&engine).prefill_hooked(&prompt, n - 1, &mut table, &mut hook)
                    });
                (prompt, table, r, hook.step_started, Instant::now())
            })
            .await,
        )?;
        let (prompt, table, result, step_started, logits_at) = stepped;
        inner
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&request_id);
        match result {
            Ok(logits) => {
                inner.counters.remote.fetch_add(1, Ordering::Relaxed);
                // Every layer landed; the answer may still be in flight: let it finish alone.
                drop(control);
                let since = |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t - t0);
                let last = gate.last_landed();
                Ok(Attempt::Done(Prefilled {
                    table,
                    logits,
                    path: PrefillPath::Remote,
                    ttft: logits_at - t0,
                    remote: Some(RemoteTimings {
                        first_layer_landed: since(gate.first_landed()),
                        last_layer_landed: since(last),
                        step_started: since(step_started),
                        first_logits_after_last_layer: last
                            .map_or(Duration::ZERO, |l| logits_at.saturating_duration_since(l)),
                    }),
                }))
            }
            Err(e) => {
                inner.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
                let reason = e.to_string();
                let table = self.fence(table, control, prompt.len()).await;
                Ok(Attempt::Local {
                    prompt,
                    table,
                    path: PrefillPath::Fallback { reason },
                    t0,
                })
            }
        }
    }

    /// After a failed remote prefill: the blocks to prefill `prompt_tokens` into locally. The
    /// same ones when the request never reached the prefill worker or all its writes are
    /// done; otherwise fresh ones, the old ones kept out of the pool until no write of the
    /// failed request can still land, or, when the pool has no room for fresh ones, the same
    /// ones after waiting that long (slower, but the request does not fail).
    async fn fence(
        &self,
        table: BlockTable,
        mut control: JoinHandle<std::result::Result<PrefillResponse, ControlError>>,
        prompt_tokens: usize,
    ) -> BlockTable {
        // A failed call marks the gate just before it returns: give it a moment to finish.
        let pending = match tokio::time::timeout(CONTROL_SETTLE, &mut control).await {
            // Never sent, or every write completed: nothing more can land.
            Ok(Ok(Err(ControlError::NotSent(_)) | Ok(_))) => return table,
            // Ended otherwise: the prefill worker cancelled its writes before answering;
            // the grace period covers those already on the wire.
            Ok(_) => None,
            Err(_) => Some(control),
        };
        let quarantine = self.inner.cfg.quarantine;
        let engine = Arc::clone(&self.inner.engine);
        let free = tokio::task::spawn_blocking(move || lock(&engine).cache().free_blocks())
            .await
            .unwrap_or(0);
        if free < prompt_tokens.div_ceil(self.inner.block_tokens) {
            self.inner
                .counters
                .fence_waits
                .fetch_add(1, Ordering::Relaxed);
            if let Some(control) = pending {
                let _ = tokio::time::timeout(quarantine, control).await;
            }
            tokio::time::sleep(QUARANTINE_GRACE).await;
            return table;
        }
        self.inner
            .counters
            .quarantined_blocks
            .fetch_add(table.len() as u64, Ordering::Relaxed);
        let engine = Arc::clone(&self.inner.engine);
        tokio::spawn(async move {
            if let Some(control) = pending {
                let _ = tokio::time::timeout(quarantine, control).await;
            }
            tokio::time::sleep(QUARANTINE_GRACE).await;
            let mut table = table;
            let _ = tokio::task::spawn_blocking(move || {
                lock(&engine).cache_mut().release_table(&mut table)
            })
            .await;
        });
        BlockTable::new()
    }

    async fn prefill_locally(
        &self,
        prompt: Vec<u32>,
        table: BlockTable,
        path: PrefillPath,
        t0: Instant,
    ) -> Result<Prefilled> {
        let engine = Arc::clone(&self.inner.engine);
        let (table, r) = joined(
            tokio::task::spawn_blocking(move || {
                let mut table = table;
                let mut e = lock(&engine);
                let r = e.prefill(&prompt, 0, &mut table);
                if r.is_err() {
                    // Nothing to hand back: free what the request held.
                    let _ = e.cache_mut().release_table(&mut table);
                }
                (table, r)
            })
            .await,
        )?;
        Ok(Prefilled {
            table,
            logits: r?,
            path,
            ttft: t0.elapsed(),
            remote: None,
        })
    }

    /// Prefills `prompt` ([`prefill`](Self::prefill)), decodes up to `max_tokens` tokens and
    /// frees the blocks: [`Engine::generate`] with the prefill possibly done remotely. With
    /// the same model and sampling, the tokens are those of a single worker.
    pub async fn generate(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: Sampling,
    ) -> Result<DisaggGeneration> {
        let prompt_tokens = prompt.len();
        let p = self.prefill(prompt).await?;
        let engine = Arc::clone(&self.inner.engine);
        let (path, ttft, remote) = (p.path, p.ttft, p.remote);
        let (mut table, logits) = (p.table, p.logits);
        let decoded = joined(
            tokio::task::spawn_blocking(move || {
                let t1 = Instant::now();
                let mut e = lock(&engine);
                let r = e.decode(&mut table, prompt_tokens, logits, max_tokens, sampling);
                let released = e.cache_mut().release_table(&mut table);
                (r, released, t1.elapsed())
            })
            .await,
        )?;
        let (r, released, decode_time) = decoded;
        let (tokens, finish) = r?;
        released?;
        Ok(DisaggGeneration {
            generation: Generation {
                tokens,
                finish,
                prompt_tokens,
                prefill_time: ttft,
                decode_time,
            },
            path,
            ttft,
            remote,
        })
    }
}

/// The control call of one request; a failure marks the request's gate failed so the decode
/// step stops waiting.
async fn call_prefill(
    cfg: DecodeConfig,
    req: PrefillRequest,
    gate: Arc<LayerGate>,
) -> std::result::Result<PrefillResponse, ControlError> {
    let r = async {
        let body = serde_json::to_vec(&req)
            .map_err(|e| ControlError::NotSent(format!("encoding the request: {e}")))?;
        let (status, body) = post_json(
            &cfg.prefill_url,
            PREFILL_PATH,
            &body,
            cfg.connect_timeout,
            cfg.request_timeout,
        )
        .await?;
        if status != 200 {
            let why = serde_json::from_slice::<ErrorBody>(&body)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            return Err(ControlError::Failed(format!(
                "prefill worker answered {status}: {why}"
            )));
        }
        let resp: PrefillResponse = serde_json::from_slice(&body)
            .map_err(|e| ControlError::Failed(format!("malformed prefill answer: {e}")))?;
        if resp.request_id != req.request_id {
            return Err(ControlError::Failed(format!(
                "answer for request {} to request {}",
                resp.request_id, req.request_id
            )));
        }
        Ok(resp)
    }
    .await;
    if let Err(e) = &r {
        gate.fail(e.to_string());
    }
    r
}

/// Routes the agent's notifications to the requests in flight, until the decoder goes.
async fn route_notifications(agent: Arc<Agent>, inner: std::sync::Weak<Inner>) {
    while let Some(n) = agent.recv_notification().await {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let routed = decode_notification(&n.message).is_some_and(|(id, layer)| {
            let gate = inner
                .gates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&id)
                .cloned();
            gate.is_some_and(|g| g.land(layer))
        });
        if !routed {
            inner
                .counters
                .stray_notifications
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

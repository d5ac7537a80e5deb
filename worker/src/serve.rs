//! The serving worker: an OpenAI-compatible HTTP API (axum) in front of the continuous-batching
//! [`Scheduler`], with prefix reuse through the kvtier [`Sidecar`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvtier_worker::WorkerError> {
//! use kvtier_worker::serve::{ServeConfig, WorkerServer};
//! let server = WorkerServer::start(ServeConfig {
//!     listen: "127.0.0.1:0".into(),
//!     sidecar: Some("unix:///run/user/1000/kvtier/kvtier.sock".into()),
//!     ..ServeConfig::default()
//! })
//! .await?;
//! println!("POST http://{}/v1/completions", server.addr());
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Request path, per request: parse and validate ([`crate::api`]) -> bring the cached prefix
//! ([`Sidecar::prepare`]: lookup, cost model, pin or get) -> queue for the scheduler, which
//! copies the prefix into pool blocks, prefills the rest in chunks, stores the new blocks off
//! the critical path and decodes, interleaved with the other running requests -> tokens back
//! through a channel, as one JSON body or as server-sent events.
//!
//! Disaggregated serving ([`Role`]): a worker of role prefill also serves
//! `POST /kvtier/prefill` ([`crate::disagg::prefill_router`]); a worker of role decode takes
//! the client's request, has its prefill worker compute the prompt's KV into its own pool
//! ([`DisaggDecoder::prefill_remote`]) and hands the prefilled blocks to the scheduler, which
//! decodes; when the prompt is short or the remote path fails, the scheduler prefills it
//! locally in chunks, like any request. Both keep their pool in memory
//! registered with one transfer [`Agent`] per process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use kvtier_core::HashSecret;
use kvtier_transfer::{Agent, AgentConfig, BackendKind};
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiError, Endpoint, Limits, ParsedRequest};
use crate::config::ModelConfig;
use crate::disagg::{
    DecodeConfig, DisaggDecoder, PrefillConfig, PrefillPath, PrefillServer, Remote,
    engine_in_agent, prefill_router,
};
use crate::engine::Engine;
use crate::error::{Result, WorkerError};
use crate::metrics::{DisaggMetrics, Metrics};
use crate::model::{DeviceSpec, Model};
use crate::prefix_cache::BlockKeys;
use crate::scheduler::{GenRequest, PrefilledKv, Scheduler, SeqEvent, SubmitError, Usage};
use crate::sidecar::{Prefix, Sidecar, SidecarSettings};
use crate::tokenizer::{TextStream, Tokenizer};

/// Time in-flight requests get to finish after a shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Time queued stores get to reach the sidecar at shutdown.
pub const STORE_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What this worker does in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Prefill and decode, alone.
    Both,
    /// Also serves `POST /kvtier/prefill`: computes prompts' KV into decode workers' pools.
    Prefill,
    /// Has a prefill worker ([`ServeConfig::prefill_url`]) prefill each prompt, then decodes.
    Decode,
}

impl Role {
    pub fn parse(s: &str) -> Result<Role> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(WorkerError::Serve {
                setting: "role".into(),
                reason: format!("unknown role {other:?} (expected both, prefill or decode)"),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Everything [`WorkerServer::start`] needs. Each field's doc ends with its default.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// HTTP listen address (port 0 picks one). Default: "127.0.0.1:8000".
    pub listen: String,
    /// kvtier sidecar URL (`unix:///path`, `tcp://host:port`, `tls://host:port`,
    /// `quic://host:port`); None =
    /// no prefix reuse. Default: None.
    pub sidecar: Option<String>,
    /// Token for a tcp/quic sidecar. Default: None (`KVTIER_TOKEN` from the environment).
    pub sidecar_token: Option<String>,
    /// The sidecar's QUIC certificate (DER). Default: None.
    pub sidecar_quic_cert_der: Option<Vec<u8>>,
    /// Block-key secret; None = the public development secret (with a warning). Default: None.
    pub hash_secret: Option<HashSecret>,
    /// Hugging Face Llama directory (config.json, *.safetensors, and tokenizer.json when
    /// present, else the byte tokenizer); None = seeded random weights. Default: None.
    pub model_dir: Option<PathBuf>,
    /// Shape of the random-weight model (ignored with `model_dir`, except `block_tokens`).
    /// Default: [`ModelConfig::default`].
    pub model_config: ModelConfig,
    /// Served model name (requests naming another get 404). Default: "kvtier-tiny".
    pub model_name: String,
    /// Seed of the random weights. Default: 0.
    pub seed: u64,
    /// Where the forward and the KV pool run ([`DeviceSpec::Cuda`] needs the `cuda` feature
    /// and role both). Default: [`DeviceSpec::Cpu`].
    pub device: DeviceSpec,
    /// A GPU opened by the caller (for example the emulator, `Gpu::emulated`), used instead
    /// of `device`. Default: None.
    #[cfg(feature = "cuda")]
    pub gpu: Option<std::sync::Arc<crate::gpu::Gpu>>,
    /// KV pool size in blocks. Default: 2048 (64 MiB for the default model).
    pub pool_blocks: usize,
    /// Sequences running at once. Default: 8.
    pub max_batch: usize,
    /// Default: [`Role::Both`].
    pub role: Role,
    /// The prefill worker (role decode), `http://host:port`. Default: None.
    pub prefill_url: Option<String>,
    /// Backend the prefill worker writes KV over (roles prefill and decode; give both workers
    /// the same). The transfer agent listens on the IP of [`listen`](Self::listen).
    /// Default: [`BackendKind::Shm`] (one host).
    pub transfer_backend: BackendKind,
    /// Keep a prefix cache in the KV pool ([`crate::prefix_cache`]): finished sequences'
    /// full blocks stay there until their pages are needed, so a request that repeats a
    /// prefix (an agent's next turn) uses them in place, with or without a sidecar. Role
    /// both only (roles prefill and decode share the pool with the transfer path and keep
    /// none). Default: true.
    pub prefix_cache: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".into(),
            sidecar: None,
            sidecar_token: None,
            sidecar_quic_cert_der: None,
            hash_secret: None,
            model_dir: None,
            model_config: ModelConfig::default(),
            model_name: "kvtier-tiny".into(),
            seed: 0,
            device: DeviceSpec::Cpu,
            #[cfg(feature = "cuda")]
            gpu: None,
            pool_blocks: 2048,
            max_batch: 8,
            role: Role::Both,
            prefill_url: None,
            transfer_backend: BackendKind::Shm,
            prefix_cache: true,
        }
    }
}

struct AppInner {
    sched: Scheduler,
    sidecar: Option<Arc<Sidecar>>,
    /// Without a sidecar, the keys of the local prefix cache (when it is on).
    local_keys: Option<BlockKeys>,
    metrics: Arc<Metrics>,
    role: Role,
    disagg: Option<Disagg>,
    model_name: String,
    vocab_size: usize,
    tokenizer: Tokenizer,
    next_id: AtomicU64,
    /// The GPU the model runs on (its faults make `/health` fail).
    #[cfg(feature = "cuda")]
    gpu: Option<Arc<crate::gpu::Gpu>>,
}

type App = Arc<AppInner>;

/// The disaggregation side of a prefill or decode worker.
struct Disagg {
    engine: Arc<Mutex<Engine>>,
    decoder: Option<Arc<DisaggDecoder>>,
    prefill: Option<Arc<PrefillServer>>,
    /// Pool blocks promised to decode-role requests, taken (worst case) before the remote
    /// prefill reserves any: everything the requests in flight can hold fits in the pool.
    budget: Arc<Semaphore>,
    metrics: DisaggMetrics,
    /// KV bytes of one token, all layers.
    token_bytes: u64,
}

/// The transfer agent's listen IP: the host of `listen`, which must be an address.
fn transfer_ip(listen: &str) -> Result<std::net::IpAddr> {
    let bad = |reason: String| WorkerError::Serve {
        setting: "listen".into(),
        reason,
    };
    let ip = match listen.parse::<SocketAddr>() {
        Ok(a) => a.ip(),
        Err(_) => match listen.rsplit_once(':') {
            Some(("localhost", _)) => std::net::Ipv4Addr::LOCALHOST.into(),
            _ => {
                return Err(bad(format!(
                    "roles prefill and decode need an IP address in --listen ({listen:?} is not \
                     IP:PORT): the transfer agent listens on that IP"
                )));
            }
        },
    };
    if ip.is_unspecified() {
        return Err(bad(format!(
            "roles prefill and decode need a concrete IP in --listen, not {ip}: the transfer \
             agent advertises it to its peers"
        )));
    }
    Ok(ip)
}

/// Refuses role settings that do not go together.
fn check_role(config: &ServeConfig) -> Result<()> {
    let bad = |setting: &str, reason: String| {
        Err(WorkerError::Serve {
            setting: setting.into(),
            reason,
        })
    };
    #[cfg(feature = "cuda")]
    let on_gpu = config.device != DeviceSpec::Cpu || config.gpu.is_some();
    #[cfg(not(feature = "cuda"))]
    let on_gpu = config.device != DeviceSpec::Cpu;
    if on_gpu && config.role != Role::Both {
        return bad(
            "device",
            format!(
                "role {} needs the KV pool in host memory (the transfer backends write host \
                 memory); --device {} runs with role both only",
                config.role.name(),
                config.device
            ),
        );
    }
    match (config.role, &config.prefill_url) {
        (Role::Decode, None) => bad(
            "prefill_url",
            "role decode needs --prefill-url, the prefill worker's http://host:port".into(),
        ),
        (Role::Both | Role::Prefill, Some(url)) => bad(
            "prefill_url",
            format!(
                "--prefill-url {url} is for role decode only (this worker's role is {})",
                config.role.name()
            ),
        ),
        (Role::Prefill | Role::Decode, _)
            if !matches!(
                config.transfer_backend,
                BackendKind::Shm | BackendKind::Tcp | BackendKind::Quic
            ) =>
        {
            bad(
                "transfer_backend",
                format!(
                    "--transfer-backend {} is not supported by serve (shm, tcp or quic)",
                    config.transfer_backend.name()
                ),
            )
        }
        (Role::Decode, Some(url)) => match url.strip_prefix("http://") {
            Some(rest) if rest.split('/').next().is_some_and(|a| a.contains(':')) => Ok(()),
            _ => bad(
                "prefill_url",
                format!("--prefill-url {url:?} is not http://host:port"),
            ),
        },
        _ => Ok(()),
    }
}

/// A running worker. Stop it with [`WorkerServer::shutdown`].
pub struct WorkerServer {
    addr: SocketAddr,
    cancel: CancellationToken,
    http: tokio::task::JoinHandle<()>,
    scheduler: std::thread::JoinHandle<()>,
    sidecar: Option<Arc<Sidecar>>,
    metrics: Arc<Metrics>,
}

impl WorkerServer {
    /// Builds the model, connects the sidecar (an unreachable one is retried later; one with
    /// another block size is an error), starts the scheduler and the HTTP listener.
    pub async fn start(config: ServeConfig) -> Result<WorkerServer> {
        check_role(&config)?;
        let cfg = config.clone();
        let (model, tokenizer) = tokio::task::spawn_blocking(move || {
            let (model, tokenizer) = match &cfg.model_dir {
                Some(dir) => crate::model::load_pretrained(dir, cfg.model_config.block_tokens)?,
                None => (
                    Model::random(cfg.model_config.clone(), cfg.seed)?,
                    Tokenizer::Byte,
                ),
            };
            #[cfg(feature = "cuda")]
            if let Some(gpu) = &cfg.gpu {
                return Ok((model.to_gpu(gpu)?, tokenizer));
            }
            Ok::<_, WorkerError>((model.to_device(cfg.device)?, tokenizer))
        })
        .await
        .map_err(|e| WorkerError::Serve {
            setting: "model".into(),
            reason: e.to_string(),
        })??;
        let layout = model.config().kv_layout()?;
        let vocab_size = model.config().vocab_size;
        let device = model.device_label();
        #[cfg(feature = "cuda")]
        let gpu = model.gpu().cloned();
        let metrics = Arc::new(Metrics::default());
        let sidecar = match &config.sidecar {
            None => None,
            Some(url) => {
                let secret = match &config.hash_secret {
                    Some(s) => s.clone(),
                    None => {
                        tracing::warn!(
                            "no --hash-secret-file: block keys use the public development secret; \
                             any client could compute them (fine for one tenant, not for many)"
                        );
                        HashSecret::development()
                    }
                };
                Some(
                    Sidecar::connect(
                        SidecarSettings {
                            url: url.clone(),
                            token: config.sidecar_token.clone(),
                            quic_cert_der: config.sidecar_quic_cert_der.clone(),
                            secret,
                            model_id: config.model_name.clone(),
                        },
                        layout,
                        metrics.clone(),
                    )
                    .await?,
                )
            }
        };
        let (engine, disagg) = match config.role {
            Role::Both => (
                Arc::new(Mutex::new(Engine::new(model, config.pool_blocks)?)),
                None,
            ),
            Role::Prefill | Role::Decode => {
                let (engine, disagg) = start_disagg(&config, model, &metrics).await?;
                (engine, Some(disagg))
            }
        };
        crate::scheduler::lock(&engine).set_eos(tokenizer.eos());
        // The local prefix cache keys blocks as the sidecar does (same secret and namespace).
        let block_keys =
            (config.prefix_cache && config.role == Role::Both).then(|| match &sidecar {
                Some(s) => s.block_keys().clone(),
                None => BlockKeys::new(
                    config
                        .hash_secret
                        .clone()
                        .unwrap_or_else(HashSecret::development),
                    config.model_name.clone(),
                    layout,
                ),
            });
        let (sched, scheduler) = Scheduler::start(
            engine,
            config.max_batch,
            sidecar.clone(),
            metrics.clone(),
            tokio::runtime::Handle::current(),
            block_keys.clone(),
        )?;
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|e| WorkerError::Serve {
                setting: "listen".into(),
                reason: format!("cannot bind {}: {e}", config.listen),
            })?;
        let addr = listener.local_addr().map_err(|e| WorkerError::Serve {
            setting: "listen".into(),
            reason: e.to_string(),
        })?;
        let app: App = Arc::new(AppInner {
            sched,
            local_keys: block_keys.filter(|_| sidecar.is_none()),
            sidecar: sidecar.clone(),
            metrics: metrics.clone(),
            role: config.role,
            #[cfg(feature = "cuda")]
            gpu,
            disagg,
            model_name: config.model_name.clone(),
            vocab_size,
            tokenizer,
            next_id: AtomicU64::new(1),
        });
        let router = router(app);
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let http = tokio::spawn(serve_streaming(listener, router, stop));
        tracing::info!(%addr, model = %config.model_name, pool_blocks = config.pool_blocks,
            max_batch = config.max_batch, sidecar = ?config.sidecar, role = config.role.name(),
            device = %device,
            prefill_url = ?config.prefill_url, "kvtier-worker serving");
        Ok(WorkerServer {
            addr,
            cancel,
            http,
            scheduler,
            sidecar,
            metrics,
        })
    }

    /// The HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The sidecar link (None with `sidecar: None`).
    pub fn sidecar(&self) -> Option<&Arc<Sidecar>> {
        self.sidecar.as_ref()
    }

    /// Stops accepting, lets requests in flight finish (up to [`DRAIN_TIMEOUT`]), stops the
    /// scheduler and flushes queued stores (up to [`STORE_DRAIN_TIMEOUT`]).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let mut http = self.http;
        if tokio::time::timeout(DRAIN_TIMEOUT, &mut http)
            .await
            .is_err()
        {
            tracing::warn!("requests still running after the drain timeout; cutting them");
            http.abort();
            let _ = http.await;
        }
        // Every scheduler handle lived in the router; with it gone the thread ends once its
        // sequences do (cut connections cancel theirs).
        let join = self.scheduler;
        let _ = tokio::task::spawn_blocking(move || join.join()).await;
        if let Some(s) = &self.sidecar {
            s.close(STORE_DRAIN_TIMEOUT).await;
        }
    }
}

/// The transfer agent, the engine in its memory and the role's disaggregation object.
async fn start_disagg(
    config: &ServeConfig,
    model: Model,
    metrics: &Metrics,
) -> Result<(Arc<Mutex<Engine>>, Disagg)> {
    let agent = Agent::new(
        &format!("kvtier-worker-{}", config.role.name()),
        AgentConfig {
            listen_ip: transfer_ip(&config.listen)?,
            quic: config.transfer_backend == BackendKind::Quic,
            ..AgentConfig::default()
        },
    )
    .await
    .map_err(|e| WorkerError::Serve {
        setting: "transfer agent".into(),
        reason: e.to_string(),
    })?;
    let agent = Arc::new(agent);
    let engine = Arc::new(Mutex::new(engine_in_agent(
        model,
        config.pool_blocks,
        &agent,
    )?));
    let token_bytes = crate::scheduler::lock(&engine)
        .cache()
        .layout()
        .bytes_per_token();
    let mut disagg = Disagg {
        engine: Arc::clone(&engine),
        decoder: None,
        prefill: None,
        budget: Arc::new(Semaphore::new(config.pool_blocks)),
        metrics: DisaggMetrics::new(
            metrics.registry(),
            config.role == Role::Decode,
            config.role == Role::Prefill,
        ),
        token_bytes,
    };
    match (config.role, &config.prefill_url) {
        (Role::Decode, Some(url)) => {
            let mut c = DecodeConfig::new(url.clone(), config.transfer_backend);
            // The scheduler shares the engine: wait for every layer before taking it.
            c.stream_layers = false;
            disagg.decoder = Some(Arc::new(DisaggDecoder::new(Arc::clone(&engine), agent, c)?));
        }
        _ => {
            disagg.prefill = Some(PrefillServer::new(
                Arc::clone(&engine),
                agent,
                PrefillConfig::default(),
            )?);
        }
    }
    Ok((engine, disagg))
}

fn router(app: App) -> Router {
    let prefill = app
        .disagg
        .as_ref()
        .and_then(|d| d.prefill.clone())
        .map(prefill_router);
    let main = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(app);
    match prefill {
        Some(p) => main.merge(p),
        None => main,
    }
}

async fn not_found() -> Response {
    ApiError::invalid("no such endpoint", None)
        .with_status(StatusCode::NOT_FOUND)
        .into_response()
}

async fn health(State(app): State<App>) -> Response {
    let sidecar = match &app.sidecar {
        None => "off",
        Some(s) if s.is_connected() => "connected",
        Some(_) => "unreachable",
    };
    // A faulted GPU cannot serve again: unhealthy, so an orchestrator restarts the worker.
    #[cfg(feature = "cuda")]
    if let Some(fault) = app.gpu.as_ref().and_then(|g| g.fault()) {
        let body = json!({"status": "gpu_faulted", "error": fault, "role": app.role.name()});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    axum::Json(json!({"status": "ok", "sidecar": sidecar, "role": app.role.name()})).into_response()
}

async fn models(State(app): State<App>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": app.model_name, "object": "model", "created": 0, "owned_by": "kvtier",
        "max_model_len": app.sched.max_context_tokens(),
    }]}))
    .into_response()
}

async fn metrics(State(app): State<App>) -> Response {
    if let Some(d) = &app.disagg {
        d.metrics.set(
            d.decoder.as_ref().map(|x| x.stats()),
            d.prefill.as_ref().map(|x| x.stats()),
        );
    }
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        app.metrics.render(),
    )
        .into_response()
}

async fn completions(State(app): State<App>, body: Body) -> Response {
    handle(app, body, Endpoint::Completions).await
}

async fn chat_completions(State(app): State<App>, body: Body) -> Response {
    handle(app, body, Endpoint::Chat).await
}

async fn handle(app: App, body: Body, endpoint: Endpoint) -> Response {
    let arrived = Instant::now();
    match handle_inner(&app, body, endpoint, arrived).await {
        Ok(r) => r,
        Err(e) => {
            app.metrics.requests.inc(e.status_label());
            e.into_response()
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn handle_inner(
    app: &App,
    body: Body,
    endpoint: Endpoint,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let bytes = axum::body::to_bytes(body, api::MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            ApiError::invalid(
                format!(
                    "cannot read the request body (at most {} bytes): {e}",
                    api::MAX_BODY_BYTES
                ),
                None,
            )
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
        })?;
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let lim = Limits {
        model_name: &app.model_name,
        max_context_tokens: app.sched.max_context_tokens(),
        vocab_size: app.vocab_size,
        tokenizer: &app.tokenizer,
        fallback_seed: n ^ now_secs(),
    };
    let req = api::parse(&bytes, endpoint, &lim)?;
    let need = app.sched.blocks_needed(req.tokens.len(), req.max_tokens);
    if need > app.sched.pool_blocks() {
        return Err(ApiError::invalid(
            format!(
                "the request needs {need} KV blocks (prompt + max_tokens) but the pool holds {}; \
                 lower max_tokens or shorten the prompt",
                app.sched.pool_blocks()
            ),
            Some("max_tokens"),
        )
        .with_code("kv_pool_too_small"));
    }
    // Role decode: the request's worst case comes out of the block budget first (held until
    // it ends), so whatever the requests in flight hold fits in the pool.
    let budget = match &app.disagg {
        Some(d) if d.decoder.is_some() => Some(take_budget(d, need).await?),
        _ => None,
    };
    let salt = req.cache_salt.as_deref().map(str::as_bytes);
    let prefix = match (&app.sidecar, &app.local_keys) {
        // Blocks the local prefix cache holds are not fetched again.
        (Some(s), _) => {
            s.prepare_after(&req.tokens, salt, |keys| {
                app.sched.local_hits(req.tokens.len(), keys)
            })
            .await
        }
        (None, Some(k)) => match k.keys(&req.tokens, salt) {
            Ok(keys) => Prefix::local(keys, salt),
            Err(e) => {
                tracing::warn!(error = %e, "cannot hash the prompt; not using the prefix cache");
                Prefix::none()
            }
        },
        (None, None) => Prefix::none(),
    };
    let prefix = Prefix {
        retain: req.retain,
        ..prefix
    };
    // Role decode: a cached prefix the cost model chose to load is used here (the rest is
    // computed locally); otherwise the prefill worker computes the prompt.
    let (prefilled, budget) = match (&app.disagg, budget) {
        (Some(d), Some(budget)) if prefix.source.blocks() == 0 => {
            let (kv, budget) = remote_prefill(d, &req.tokens, budget).await?;
            (kv, Some(budget))
        }
        (_, budget) => (None, budget),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    app.sched
        .submit(GenRequest {
            tokens: req.tokens.clone(),
            max_tokens: req.max_tokens,
            sampling: req.sampling,
            prefix,
            events: tx,
            arrived,
            prefilled,
            budget,
        })
        .map_err(|e| match e {
            SubmitError::Busy => ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the worker's admission queue is full; retry later",
                "overloaded",
            ),
            SubmitError::Stopped => ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the worker is shutting down",
                "shutting_down",
            ),
        })?;
    let id = match endpoint {
        Endpoint::Completions => format!("cmpl-{n}"),
        Endpoint::Chat => format!("chatcmpl-{n}"),
    };
    if req.stream {
        Ok(stream_response(req, id, rx, app.tokenizer.stream()))
    } else {
        collect_response(req, id, rx, &app.tokenizer).await
    }
}

/// The decode role: `need` blocks of the pool promised to a request until it ends (first come,
/// first served).
async fn take_budget(d: &Disagg, need: usize) -> Result<OwnedSemaphorePermit, ApiError> {
    let permits = u32::try_from(need).map_err(|_| {
        ApiError::invalid(
            format!("the request needs {need} KV blocks"),
            Some("max_tokens"),
        )
    })?;
    Arc::clone(&d.budget)
        .acquire_many_owned(permits)
        .await
        .map_err(|_| {
            ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the worker is shutting down",
                "shutting_down",
            )
        })
}

/// The decode role: the prompt's KV in pool blocks from the prefill worker, or `None` when
/// the prompt is short or the remote path failed: the scheduler then prefills it in chunks
/// like any request, so a failing prefill worker does not stall the other sequences. `budget`
/// comes back with it; if the request is dropped meanwhile, both go once the prefill is over,
/// the blocks first.
async fn remote_prefill(
    d: &Disagg,
    tokens: &[u32],
    budget: OwnedSemaphorePermit,
) -> Result<(Option<PrefilledKv>, OwnedSemaphorePermit), ApiError> {
    let decoder = d.decoder.clone().ok_or_else(|| {
        ApiError::server(
            StatusCode::INTERNAL_SERVER_ERROR,
            "this worker has no decode role",
            "prefill_failed",
        )
    })?;
    let engine = Arc::clone(&d.engine);
    let prompt = tokens.to_vec();
    // Its own task: a client that hangs up drops this future, and the prefilled blocks must
    // still reach `PrefilledKv` (whose drop frees them).
    let task = tokio::spawn(async move {
        Ok::<_, WorkerError>(match decoder.prefill_remote(prompt).await? {
            Remote::Done(p) => (
                Some(PrefilledKv {
                    table: p.table,
                    logits: p.logits,
                    engine,
                }),
                budget,
                p.path,
                p.ttft,
            ),
            Remote::Local(path) => (None, budget, path, std::time::Duration::ZERO),
        })
    });
    let (kv, budget, path, ttft) = match task.await {
        Ok(Ok(r)) => r,
        Ok(Err(e @ WorkerError::CacheFull { .. })) => {
            return Err(ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no room in the KV pool for the prompt: {e}; retry later"),
                "overloaded",
            ));
        }
        Ok(Err(e)) => {
            return Err(ApiError::server(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("prefill failed: {e}"),
                "prefill_failed",
            ));
        }
        Err(e) => {
            return Err(ApiError::server(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("prefill task failed: {e}"),
                "prefill_failed",
            ));
        }
    };
    let n = tokens.len();
    match path {
        PrefillPath::Remote => {
            // The prefill worker wrote every layer's K/V of all but the last token.
            d.metrics
                .observe_remote(ttft, n - 1, (n as u64 - 1) * d.token_bytes);
        }
        PrefillPath::Fallback { .. } | PrefillPath::Short => d.metrics.observe_local(n),
    }
    Ok((kv, budget))
}

async fn collect_response(
    req: ParsedRequest,
    id: String,
    mut rx: mpsc::UnboundedReceiver<SeqEvent>,
    tokenizer: &Tokenizer,
) -> Result<Response, ApiError> {
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(SeqEvent::Token(t)) => tokens.push(t),
            Some(SeqEvent::Done(u)) => {
                let text = tokenizer.decode(&tokens).unwrap_or_default();
                let body = api::full_response(&req, &id, now_secs(), &text, &u);
                return Ok(axum::Json(body).into_response());
            }
            Some(SeqEvent::Failed(m)) => {
                return Err(ApiError::server(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    m,
                    "generation_failed",
                ));
            }
            None => {
                return Err(ApiError::server(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the worker stopped before the request finished",
                    "shutting_down",
                ));
            }
        }
    }
}

struct StreamState {
    req: ParsedRequest,
    id: String,
    created: u64,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    text: TextStream,
    first: bool,
    done: bool,
}

fn sse(v: &serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

impl StreamState {
    fn finish(&mut self, u: &Usage) -> String {
        let rest = self.text.finish();
        let mut out = sse(&api::stream_chunk(
            &self.req,
            &self.id,
            self.created,
            &rest,
            self.first,
            Some(u.finish),
        ));
        if self.req.include_usage {
            out.push_str(&sse(&api::usage_chunk(
                &self.req,
                &self.id,
                self.created,
                u,
            )));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }
}

fn stream_response(
    req: ParsedRequest,
    id: String,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    text: TextStream,
) -> Response {
    let state = StreamState {
        req,
        id,
        created: now_secs(),
        rx,
        text,
        first: true,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            let out = match st.rx.recv().await {
                Some(SeqEvent::Token(t)) => {
                    let text = st.text.push(t);
                    if text.is_empty() {
                        continue;
                    }
                    let chunk =
                        api::stream_chunk(&st.req, &st.id, st.created, &text, st.first, None);
                    st.first = false;
                    sse(&chunk)
                }
                Some(SeqEvent::Done(u)) => {
                    st.done = true;
                    st.finish(&u)
                }
                Some(SeqEvent::Failed(m)) => {
                    st.done = true;
                    let e =
                        ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, m, "generation_failed");
                    format!("{}data: [DONE]\n\n", sse(&e.body()))
                }
                None => {
                    st.done = true;
                    let e = ApiError::server(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the worker stopped before the request finished",
                        "shutting_down",
                    );
                    format!("{}data: [DONE]\n\n", sse(&e.body()))
                }
            };
            return Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(out)), st));
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Serves `routes` on `listener` until `stop` is cancelled (graceful shutdown), with
/// TCP_NODELAY on every accepted connection: answers stream as small SSE chunks, and without
/// it Nagle's algorithm holds a chunk back while an earlier one is unacknowledged (about 40 ms
/// on loopback with delayed ACKs), which shows up as TTFT and inter-token latency on a
/// kept-alive connection. The worker's HTTP front and kvtier-router's.
pub async fn serve_streaming(
    listener: tokio::net::TcpListener,
    routes: axum::Router,
    stop: CancellationToken,
) {
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
    });
    if let Err(e) = axum::serve(listener, routes)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::error!(error = %e, "HTTP server failed");
    }
}

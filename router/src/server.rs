//! The HTTP front: OpenAI-compatible endpoints, the routing decision for each request, and
//! forwarding to the chosen worker with the workspace's HTTP client (`kvtier_client::http`),
//! the answer passed through piece by piece as it arrives, byte for byte.
//!
//! **Failure.** A worker that cannot be reached, drops the connection, or answers 5xx before
//! the first byte of its body is passed over for the next in the ranking; one that could not be
//! reached or dropped the connection also leaves the candidates until its `/health` answers
//! 200 again (polled every `health_interval_ms`). Unhealthy workers are still tried, last, so a
//! request fails only when no worker could answer it. Once a byte has been passed on, a failure
//! ends the client's response (the bytes cannot be taken back).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest, HttpStream};
use kvtier_client::{ClientConfig, ClientError};
use kvtier_worker::api::{self, ApiError, Endpoint};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::config::{Engine, RouterConfig};
use crate::error::RouterError;
use crate::events::{self, ServerView};
use crate::load::Measured;
use crate::metrics::Metrics;
use crate::mismatch::{self, Streak, Verdict};
use crate::prompt::{Analysed, KeySpace, PromptModel};
use crate::recent::RecentRoutes;
use crate::score::{self, Candidate, Home, Placement, Policy, Score};
use crate::sessions::SessionHomes;
use crate::usage::{self, Report};
use kvtier_core::BlockKey;
use kvtier_core::protocol::TierCode;

/// Bytes of the end of an answer kept to read its `cached_tokens` (the usage object comes last
/// in the worker's JSON and in its last SSE chunk).
const USAGE_TAIL_BYTES: usize = 8 << 10;

/// Response header naming the worker that answered.
pub const WORKER_HEADER: &str = "x-kvtier-worker";
/// Request header naming the request's session (overrides the body's `user`).
pub const SESSION_HEADER: &str = "x-session-id";

/// One worker as the router sees it.
pub struct WorkerState {
    pub url: String,
    pub view: Option<Arc<ServerView>>,
    pub prefill_tokens_per_s: Option<f64>,
    pub healthy: AtomicBool,
    /// A candidate at all: always for a configured worker; for one taken from the cluster's
    /// membership, while its member is in the membership (`members.rs`).
    pub present: AtomicBool,
    /// The cluster member that advertised it (None: configured).
    pub member: Option<String>,
    /// Stops its server's event subscription (a membership worker's, when its member leaves).
    #[cfg(feature = "cluster")]
    pub(crate) follow: Mutex<Option<CancellationToken>>,
    pub outstanding_requests: AtomicU64,
    pub outstanding_prefill_tokens: AtomicU64,
    /// Of the outstanding requests, those whose answer has started.
    pub decoding: AtomicU64,
    /// Its prefill rate, decode step and load bandwidths, measured from its answers.
    measured: Mutex<Measured>,
    streak: Mutex<Streak>,
    /// Blocks recently routed here, held until the server's events show them.
    recent: Mutex<RecentRoutes>,
}

/// The workers, in a list that only grows: a worker's index is its identity (decisions,
/// session homes), so one whose member left stays in place, not present, and comes back in
/// place. Configured workers first, then those the cluster's membership added.
#[derive(Default)]
pub(crate) struct Workers(std::sync::RwLock<Arc<Vec<Arc<WorkerState>>>>);

impl Workers {
    /// The list as it is now (a request decides on one such snapshot).
    pub(crate) fn all(&self) -> Arc<Vec<Arc<WorkerState>>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn get(&self, i: usize) -> Arc<WorkerState> {
        self.all()[i].clone()
    }

    /// Appends `w`; its index.
    pub(crate) fn push(&self, w: Arc<WorkerState>) -> usize {
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        let mut next = Vec::clone(&g);
        next.push(w);
        *g = Arc::new(next);
        g.len() - 1
    }
}

pub(crate) struct AppInner {
    pub(crate) config: RouterConfig,
    prompt: PromptModel,
    pub(crate) workers: Workers,
    http: HttpClient,
    /// The client of the workers' `/health` polls (for workers the membership adds).
    #[cfg(feature = "cluster")]
    pub(crate) health: HttpClient,
    pub(crate) metrics: Arc<Metrics>,
    /// Stops every task the router started (and those the membership starts).
    #[cfg(feature = "cluster")]
    pub(crate) cancel: CancellationToken,
    /// The cluster's membership, when workers come from it.
    #[cfg(feature = "cluster")]
    pub(crate) members: Option<Arc<crate::members::Members>>,
    rotation: AtomicUsize,
    /// Each session's home (`kv` policy).
    sessions: Mutex<SessionHomes>,
    /// Seeds the random policy's draws (one per router process).
    random_seed: u64,
}

pub(crate) type App = Arc<AppInner>;

/// A running router. Stop it with [`Router::shutdown`].
pub struct Router {
    addr: SocketAddr,
    cancel: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Router {
    /// Loads the model's prompt side, subscribes to every kvtier server, starts the health
    /// checks and the HTTP listener.
    pub async fn start(config: RouterConfig) -> Result<Router, RouterError> {
        config.check()?;
        let (model_config, tokenizer) = {
            let dir = config.model_dir.clone();
            let bt = config.block_tokens;
            tokio::task::spawn_blocking(move || {
                kvtier_worker::prompt_side::model_and_tokenizer(dir.as_deref(), bt)
            })
            .await
            .map_err(|e| RouterError::Config {
                field: "model_dir".into(),
                reason: e.to_string(),
            })??
        };
        let secret = match &config.hash_secret_file {
            Some(p) => kvtier_worker::prompt_side::read_hash_secret(p)?,
            None => {
                tracing::warn!(
                    "no hash_secret_file: block keys use the public development secret (the \
                     workers must too, or the router predicts nothing)"
                );
                kvtier_core::HashSecret::development()
            }
        };
        let space = KeySpace {
            engine: config.engine,
            model_id: config.kv_model_id().to_owned(),
            dtype: config.kv_dtype()?,
            tensor_parallel_size: config.tensor_parallel_size,
        };
        let prompt = PromptModel::new(
            model_config,
            tokenizer,
            config.model_name.clone(),
            secret,
            space,
        )?;
        let metrics = Arc::new(Metrics::new()?);
        let cancel = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut views: Vec<Arc<ServerView>> = Vec::new();
        let workers = Workers::default();
        for w in &config.workers {
            // Workers sharing a server share its view and subscription.
            let view = w
                .kvtier
                .as_ref()
                .map(|url| match views.iter().find(|v| &v.url == url) {
                    Some(v) => v.clone(),
                    None => {
                        let mut cc = ClientConfig::default().zero_copy(false);
                        cc.token = w
                            .kvtier_token
                            .clone()
                            .or_else(|| config.kvtier_token.clone());
                        let (v, task) =
                            subscribe(url, cc, &config, metrics.clone(), cancel.clone());
                        tasks.push(task);
                        views.push(v.clone());
                        v
                    }
                });
            workers.push(WorkerState::new(
                &w.url,
                view,
                w.prefill_tokens_per_s,
                None,
                &config,
                &metrics,
            ));
        }
        let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
        let http = HttpClient::new(HttpConfig {
            connect_timeout,
            timeout: Duration::from_secs(config.request_timeout_s),
            // The router streams answers through; this bounds only what it reads whole (a 5xx
            // body's first bytes).
            max_body_bytes: usize::MAX,
            keep_alive: true,
        });
        let health = HttpClient::new(HttpConfig {
            connect_timeout,
            timeout: config.health_interval().max(Duration::from_secs(1)),
            max_body_bytes: 64 << 10,
            keep_alive: true,
        });
        for w in workers.all().iter() {
            tasks.push(tokio::spawn(health_loop(
                w.clone(),
                health.clone(),
                config.health_interval(),
                metrics.clone(),
                cancel.clone(),
            )));
        }
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|source| RouterError::Listen {
                addr: config.listen.clone(),
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| RouterError::Listen {
                addr: config.listen.clone(),
                source,
            })?;
        tracing::info!(%addr, workers = workers.all().len(), servers = views.len(),
            model = %config.model_name, block_tokens = config.block_tokens,
            policy = ?config.policy, "kvtier-router serving");
        let sessions = Mutex::new(
            SessionHomes::new(
                Duration::from_millis(config.session_ttl_ms),
                config.max_sessions,
            )
            .with_active(Duration::from_millis(config.session_active_ms)),
        );
        #[cfg(feature = "cluster")]
        let members = crate::members::Members::from_config(&config)?.map(Arc::new);
        let app: App = Arc::new(AppInner {
            config,
            prompt,
            workers,
            http,
            #[cfg(feature = "cluster")]
            health: health.clone(),
            metrics,
            #[cfg(feature = "cluster")]
            cancel: cancel.clone(),
            #[cfg(feature = "cluster")]
            members: members.clone(),
            rotation: AtomicUsize::new(0),
            sessions,
            random_seed: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
        });
        #[cfg(feature = "cluster")]
        if let Some(m) = members {
            tasks.push(tokio::spawn(crate::members::follow(app.clone(), m)));
        }
        let routes = axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/health", get(health_answer))
            .route("/metrics", get(metrics_answer))
            .route("/debug/route", post(debug_route))
            .fallback(not_found)
            .with_state(app);
        let stop = cancel.clone();
        tasks.push(tokio::spawn(kvtier_worker::serve::serve_streaming(
            listener, routes, stop,
        )));
        Ok(Router {
            addr,
            cancel,
            tasks,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets answers in flight finish (up to 30 s), stops the subscriptions.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        for t in self.tasks {
            if tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .is_err()
            {
                tracing::warn!("a router task did not stop within 30 s");
            }
        }
    }
}

impl WorkerState {
    /// A worker, healthy and present until its checks say otherwise; its metrics' series set.
    pub(crate) fn new(
        url: &str,
        view: Option<Arc<ServerView>>,
        prefill_tokens_per_s: Option<f64>,
        member: Option<String>,
        config: &RouterConfig,
        metrics: &Metrics,
    ) -> Arc<Self> {
        let url = url.trim_end_matches('/').to_string();
        metrics.worker_healthy.with_label_values(&[&url]).set(1);
        Arc::new(WorkerState {
            url,
            view,
            prefill_tokens_per_s,
            healthy: AtomicBool::new(true),
            present: AtomicBool::new(true),
            member,
            #[cfg(feature = "cluster")]
            follow: Mutex::new(None),
            outstanding_requests: AtomicU64::new(0),
            outstanding_prefill_tokens: AtomicU64::new(0),
            decoding: AtomicU64::new(0),
            measured: Mutex::new(Measured::default()),
            streak: Mutex::new(Streak::default()),
            recent: Mutex::new(RecentRoutes::new(
                Duration::from_millis(config.recent_route_ttl_ms),
                config.max_recent_blocks_per_worker,
            )),
        })
    }

    /// A candidate: present (its member in the membership) and healthy.
    fn candidate(&self) -> bool {
        self.present.load(Ordering::Relaxed) && self.healthy.load(Ordering::Relaxed)
    }
}

/// The view of the kvtier server at `url` and its event subscription, stopped by `cancel`.
pub(crate) fn subscribe(
    url: &str,
    mut cc: ClientConfig,
    config: &RouterConfig,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> (Arc<ServerView>, tokio::task::JoinHandle<()>) {
    let v = Arc::new(ServerView::new(
        url.to_string(),
        config.max_blocks_per_server,
    ));
    cc.name = "kvtier-router".into();
    let task = tokio::spawn(events::follow(v.clone(), cc, metrics, cancel));
    (v, task)
}

pub(crate) async fn health_loop(
    w: Arc<WorkerState>,
    http: HttpClient,
    every: Duration,
    m: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let url = format!("{}/health", w.url);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        // A worker whose member left the cluster is not polled (its address may be gone).
        if !w.present.load(Ordering::Relaxed) {
            continue;
        }
        let ok = matches!(http.get(&url).await, Ok(r) if r.status == 200);
        set_health(&w, ok, &m, "health check");
    }
}

pub(crate) fn set_health(w: &WorkerState, ok: bool, m: &Metrics, why: &str) {
    let was = w.healthy.swap(ok, Ordering::Relaxed);
    if was != ok {
        m.worker_healthy.with_label_values(&[&w.url]).set(ok as i64);
        if ok {
            tracing::info!(worker = %w.url, "worker healthy again: back among the candidates");
        } else {
            tracing::warn!(worker = %w.url, reason = why, "worker unhealthy: out of the candidates until /health passes");
        }
    }
}

/// A routing decision: every worker's score and the order to try them in.
struct Decision {
    /// The workers as they were when it was made (indices into it: `scores`, `order`).
    workers: Arc<Vec<Arc<WorkerState>>>,
    analysed: Analysed,
    scores: Vec<Score>,
    order: Vec<usize>,
    /// Under `kv`: the session's home and why the first worker is first.
    home: Home,
    placement: Option<Placement>,
}

fn decide(app: &AppInner, analysed: Analysed, rotation: usize) -> Decision {
    let costs = &app.config.costs;
    let bt = app.prompt.block_tokens();
    let now = Instant::now();
    let workers = app.workers.all();
    let cluster = cluster_prefix(app, &workers, &analysed.keys, now);
    let scores: Vec<Score> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let index = w.view.as_ref().map(|v| v.read());
            let recent = w.recent.lock().unwrap_or_else(|e| e.into_inner());
            let mut routed_blocks = 0;
            // The server's blocks, then (for `kv`) blocks the router just sent this worker.
            let cached: Vec<TierCode> = analysed
                .keys
                .iter()
                .map_while(|k| {
                    index.as_ref().and_then(|ix| ix.tier(k)).or_else(|| {
                        (app.config.policy == Policy::Kv && recent.holds(k, now)).then(|| {
                            routed_blocks += 1;
                            TierCode::Dram
                        })
                    })
                })
                .collect();
            drop((index, recent));
            let block_bytes = match w
                .view
                .as_ref()
                .map(|v| v.block_bytes.load(Ordering::Relaxed))
            {
                Some(b) if b > 0 => b,
                _ => app.prompt.block_bytes(),
            };
            let measured = *w.measured.lock().unwrap_or_else(|e| e.into_inner());
            let use_measured = costs.measured;
            let c = Candidate {
                worker: i,
                healthy: w.candidate(),
                cluster_blocks: cluster.saturating_sub(cached.len()),
                cached,
                routed_blocks,
                block_bytes,
                outstanding_requests: w.outstanding_requests.load(Ordering::Relaxed),
                outstanding_prefill_tokens: w.outstanding_prefill_tokens.load(Ordering::Relaxed),
                decoding_requests: w.decoding.load(Ordering::Relaxed),
                prefill_tokens_per_s: measured
                    .prefill_tokens_per_s
                    .get()
                    .filter(|_| use_measured)
                    .or(w.prefill_tokens_per_s),
                decode_step_s: measured.decode_step_s.get().filter(|_| use_measured),
                load_bytes_per_s: TierCode::STORED.map(|t| {
                    measured.load_bytes_per_s[t as usize]
                        .get()
                        .filter(|_| use_measured)
                }),
                cluster_bytes_per_s: measured.load_bytes_per_s[TierCode::Remote as usize]
                    .get()
                    .filter(|_| use_measured),
            };
            score::score(analysed.prompt_tokens, bt, &c, costs)
        })
        .collect();
    let affinity = app.config.session_ttl_ms > 0 && app.config.max_sessions > 0;
    let (home, homed) = match (&analysed.session, app.config.policy) {
        (Some(id), Policy::Kv) if affinity => {
            let mut s = app.sessions.lock().unwrap_or_else(|e| e.into_inner());
            match s.get(id, now) {
                Some(w) => (Home::At(w), Vec::new()),
                None => (Home::New, s.homed(now).to_vec()),
            }
        }
        _ => (Home::None, Vec::new()),
    };
    let turn = score::Turn {
        rotation,
        random: score::mix64(app.random_seed ^ rotation as u64),
        session: analysed.session.as_deref(),
        home,
        homed: &homed,
    };
    let (mut order, placement) = if app.config.policy == Policy::Kv {
        let (o, p) = score::kv_order(&scores, costs, turn);
        (o, Some(p))
    } else {
        (score::order(app.config.policy, &scores, costs, turn), None)
    };
    // A worker whose member left the cluster is no candidate at all (not even a last resort).
    order.retain(|&i| workers[i].present.load(Ordering::Relaxed));
    Decision {
        workers,
        analysed,
        scores,
        order,
        home,
        placement,
    }
}

/// With `cluster`, the longest prefix of `keys` the cluster holds: each block held by some
/// worker's server (or, under `kv`, just routed to some worker). 0 without a cluster.
fn cluster_prefix(
    app: &AppInner,
    workers: &[Arc<WorkerState>],
    keys: &[BlockKey],
    now: Instant,
) -> usize {
    if !app.config.cluster {
        return 0;
    }
    let present = || workers.iter().filter(|w| w.present.load(Ordering::Relaxed));
    let indexes: Vec<_> = present()
        .filter_map(|w| w.view.as_ref().map(|v| v.read()))
        .collect();
    let recents: Vec<_> = if app.config.policy == Policy::Kv {
        present()
            .map(|w| w.recent.lock().unwrap_or_else(|e| e.into_inner()))
            .collect()
    } else {
        Vec::new()
    };
    keys.iter()
        .take_while(|k| {
            indexes.iter().any(|ix| ix.tier(k).is_some()) || recents.iter().any(|r| r.holds(k, now))
        })
        .count()
}

/// The decision as JSON (for `/debug/route` and the debug log).
fn explain(app: &AppInner, d: &Decision) -> Value {
    let workers: Vec<Value> = d
        .scores
        .iter()
        .map(|s| {
            let w = &d.workers[s.worker];
            let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
            if let Value::Object(o) = &mut v {
                o.insert("url".into(), json!(w.url));
                let m = *w.measured.lock().unwrap_or_else(|e| e.into_inner());
                let costs = &app.config.costs;
                let configured = [
                    costs.hbm_bytes_per_s,
                    costs.dram_bytes_per_s,
                    costs.nvme_bytes_per_s,
                ];
                let mut load = serde_json::Map::new();
                for t in [TierCode::Hbm, TierCode::Dram, TierCode::Nvme] {
                    let e = m.load_bytes_per_s[t as usize];
                    load.insert(
                        t.name().into(),
                        json!({
                            "measured": e.get(),
                            "configured": configured[t as usize],
                            "samples": e.samples,
                        }),
                    );
                }
                let e = m.load_bytes_per_s[TierCode::Remote as usize];
                load.insert(
                    "cluster".into(),
                    json!({
                        "measured": e.get(),
                        "configured": costs.cluster_bytes_per_s,
                        "samples": e.samples,
                    }),
                );
                o.insert(
                    "measured".into(),
                    json!({
                        "prefill_tokens_per_s": m.prefill_tokens_per_s.get(),
                        "prefill_samples": m.prefill_tokens_per_s.samples,
                        "decode_step_s": m.decode_step_s.get(),
                        "decode_samples": m.decode_step_s.samples,
                        "load_bytes_per_s": load,
                    }),
                );
                o.insert(
                    "kvtier".into(),
                    match &w.view {
                        None => Value::Null,
                        Some(view) => json!({
                            "url": view.url,
                            "synced": view.synced.load(Ordering::Relaxed),
                            "blocks": view.read().len(),
                        }),
                    },
                );
            }
            v
        })
        .collect();
    json!({
        "engine": app.prompt.engine().as_str(),
        "prompt_tokens": d.analysed.prompt_tokens,
        "block_tokens": app.prompt.block_tokens(),
        "prompt_blocks": d.analysed.keys.len(),
        "policy": format!("{:?}", app.config.policy),
        "session": d.analysed.session,
        "home": match d.home {
            Home::None => Value::Null,
            Home::New => json!("new"),
            Home::At(i) => json!(d.workers.get(i).map(|w| &w.url)),
        },
        "placement": d.placement,
        "order": d.order.iter().map(|&i| d.workers[i].url.clone()).collect::<Vec<_>>(),
        "workers": workers,
    })
}

fn short(d: &Decision) -> String {
    d.order
        .iter()
        .map(|&i| {
            let s = &d.scores[i];
            format!(
                "{}[{}cached={} prefill={:.4}s load={:.4}s queue={:.4}s total={:.4}s]",
                d.workers[i].url,
                if s.healthy { "" } else { "UNHEALTHY " },
                s.cached_tokens,
                s.prefill_s,
                s.load_s,
                s.queue_s,
                s.total_s
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, api::MAX_BODY_BYTES)
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
        })
}

async fn completions(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    handle(
        app,
        &headers,
        body,
        Endpoint::Completions,
        "/v1/completions",
    )
    .await
}

async fn chat(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    handle(app, &headers, body, Endpoint::Chat, "/v1/chat/completions").await
}

/// The session named by the `x-session-id` header, when it is present and text.
fn session_header(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(SESSION_HEADER)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

fn endpoint_label(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Completions => "completions",
        Endpoint::Chat => "chat",
    }
}

async fn handle(
    app: App,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
    path: &'static str,
) -> Response {
    let label = endpoint_label(endpoint);
    let outcome = |o: &str| app.metrics.requests.with_label_values(&[label, o]).inc();
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(e) => {
            outcome("client_error");
            return e.into_response();
        }
    };
    let t = Instant::now();
    let mut analysed = match analyse(&app, &bytes, endpoint) {
        Ok(a) => a,
        Err(e) => {
            outcome("client_error");
            return e.into_response();
        }
    };
    if let Some(id) = session_header(headers) {
        analysed.session = Some(id);
    }
    let rotation = app.rotation.fetch_add(1, Ordering::Relaxed);
    let d = decide(&app, analysed, rotation);
    app.metrics
        .decision_seconds
        .observe(t.elapsed().as_secs_f64());
    if let Some(p) = d.placement {
        app.metrics
            .placements
            .with_label_values(&[p.as_str()])
            .inc();
    }
    tracing::debug!(prompt_tokens = d.analysed.prompt_tokens, blocks = d.analysed.keys.len(),
        placement = ?d.placement, ranking = %short(&d), "route");
    let (resp, o) = forward(&app, &d, bytes, path).await;
    outcome(o);
    resp
}

/// The request as the workers see it. A request kvtier-worker would refuse is refused here
/// with its 4xx; one the router cannot analyse for vLLM (another validation, other limits) is
/// forwarded without keys, routed by load, and vLLM answers it.
fn analyse(app: &App, bytes: &[u8], endpoint: Endpoint) -> Result<Analysed, ApiError> {
    match app.prompt.analyse(bytes, endpoint) {
        Ok(a) => Ok(a),
        Err(e) if app.prompt.engine() == Engine::Vllm => {
            app.metrics.unanalysed.inc();
            tracing::debug!(error = %e.message, "not analysed: forwarded, routed by load");
            Ok(PromptModel::unanalysed(bytes))
        }
        Err(e) => Err(e),
    }
}

/// What the router has sent a worker and not seen answered: incremented when a request is
/// sent, the prefill tokens released (and the request counted as decoding) at the answer's
/// first byte, the request at its end.
struct Outstanding {
    worker: Arc<WorkerState>,
    metrics: Arc<Metrics>,
    prefill: u64,
    decoding: bool,
}

impl Outstanding {
    fn new(worker: Arc<WorkerState>, metrics: Arc<Metrics>, prefill: u64) -> Self {
        worker.outstanding_requests.fetch_add(1, Ordering::Relaxed);
        worker
            .outstanding_prefill_tokens
            .fetch_add(prefill, Ordering::Relaxed);
        let o = Self {
            worker,
            metrics,
            prefill,
            decoding: false,
        };
        o.publish();
        o
    }

    /// The answer started; returns the requests now decoding there, this one included.
    fn started(&mut self) -> u64 {
        self.worker
            .outstanding_prefill_tokens
            .fetch_sub(self.prefill, Ordering::Relaxed);
        self.prefill = 0;
        self.decoding = true;
        let n = self.worker.decoding.fetch_add(1, Ordering::Relaxed) + 1;
        self.publish();
        n
    }

    fn publish(&self) {
        let w = &self.worker;
        self.metrics
            .outstanding_requests
            .with_label_values(&[&w.url])
            .set(w.outstanding_requests.load(Ordering::Relaxed) as i64);
        self.metrics
            .outstanding_prefill_tokens
            .with_label_values(&[&w.url])
            .set(w.outstanding_prefill_tokens.load(Ordering::Relaxed) as i64);
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.worker
            .outstanding_prefill_tokens
            .fetch_sub(self.prefill, Ordering::Relaxed);
        self.worker
            .outstanding_requests
            .fetch_sub(1, Ordering::Relaxed);
        if self.decoding {
            self.worker.decoding.fetch_sub(1, Ordering::Relaxed);
        }
        self.publish();
    }
}

/// Watches an answer go through; when it has ended whole, compares the cached tokens the
/// worker reported with the router's prediction.
struct Observer {
    app: App,
    _outstanding: Outstanding,
    worker: usize,
    /// Cached tokens predicted from the worker's own server's events...
    predicted: u64,
    /// ... and with those other members of its cluster hold (as `predicted` without one).
    predicted_high: u64,
    /// The prediction came from a synced index (else it says nothing).
    evidence: bool,
    tail: Vec<u8>,
    complete: bool,
    /// For the worker's measured rates (`load.rs`): the request's prompt tokens, when it was
    /// sent and when its first byte came, whether no other prompt was in prefill there when
    /// it was sent, the requests decoding there at its first byte, and whether the answer is a
    /// 200 stream (a whole JSON answer's first byte is its end).
    prompt_tokens: u64,
    sent: Instant,
    first_byte: Instant,
    alone_in_prefill: bool,
    decoding_at_start: u64,
    ok_stream: bool,
    /// The answer is a 200 (its load report is about this request's prompt).
    ok: bool,
}

impl Observer {
    fn see(&mut self, b: &[u8]) {
        self.tail.extend_from_slice(b);
        if self.tail.len() > 2 * USAGE_TAIL_BYTES {
            self.tail.drain(..self.tail.len() - USAGE_TAIL_BYTES);
        }
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        if !self.complete || !self.ok {
            return;
        }
        let w = &self.app.workers.get(self.worker);
        let m = &self.app.metrics;
        // The worker's load report (kvtier-worker's `usage.kvtier`): a load-bandwidth sample,
        // and the part of the wait for the first byte that was not prefill.
        let load = match usage::load_report(&self.tail) {
            Report::Absent => {
                m.load_reports.with_label_values(&[&w.url, "absent"]).inc();
                None
            }
            Report::Malformed => {
                m.load_reports
                    .with_label_values(&[&w.url, "malformed"])
                    .inc();
                None
            }
            Report::Load(r) => {
                let o = w
                    .measured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .load_sample(&r);
                m.load_reports.with_label_values(&[&w.url, o.label()]).inc();
                Some(r)
            }
        };
        let Some(reported) = usage::cached_tokens(&self.tail) else {
            return;
        };
        if self.ok_stream {
            let mut measured = w.measured.lock().unwrap_or_else(|e| e.into_inner());
            if self.alone_in_prefill {
                measured.prefill_sample(
                    self.prompt_tokens.saturating_sub(reported),
                    self.first_byte - self.sent,
                    load.as_ref(),
                );
            }
            if let Some(tokens) = usage::completion_tokens(&self.tail) {
                measured.decode_sample(self.first_byte.elapsed(), tokens, self.decoding_at_start);
            }
        }
        m.reported_cached_tokens
            .with_label_values(&[&w.url])
            .inc_by(reported);
        if !self.evidence {
            return;
        }
        let cfg = &self.app.config;
        let v = mismatch::verdict_range(
            self.predicted,
            self.predicted_high,
            reported,
            cfg.mismatch_min_tokens,
        );
        if matches!(v, Verdict::Lower | Verdict::Higher) {
            m.cache_mismatch
                .with_label_values(&[&w.url, v.label()])
                .inc();
            tracing::debug!(worker = %w.url, predicted = self.predicted, reported,
                direction = v.label(), "cached tokens disagree with the prediction");
        }
        let mut streak = w.streak.lock().unwrap_or_else(|p| p.into_inner());
        if streak.record(v, cfg.mismatch_streak) {
            tracing::error!(worker = %w.url, predicted = self.predicted, reported,
                in_a_row = cfg.mismatch_streak, direction = v.label(),
                "KEY MISMATCH SUSPECTED: the worker's reported cached tokens keep disagreeing \
                 with the router's prediction from its kvtier events. Check that the router and \
                 the worker use the same model directory (tokenizer, chat template), \
                 --model-name, block_tokens, hash secret file and cache_salt handling");
        }
        m.key_mismatch_suspected
            .with_label_values(&[&w.url])
            .set(streak.suspected(cfg.mismatch_streak) as i64);
    }
}

fn fail(status: StatusCode, message: String, code: &'static str) -> Response {
    ApiError::server(status, message, code).into_response()
}

/// Sends the request to the workers in the decision's order until one answers; the response
/// and the outcome label.
async fn forward(app: &App, d: &Decision, body: Bytes, path: &str) -> (Response, &'static str) {
    let mut failures = Vec::new();
    for &i in &d.order {
        let w = &d.workers[i];
        let s = &d.scores[i];
        let alone_in_prefill = w.outstanding_prefill_tokens.load(Ordering::Relaxed) == 0;
        let sent = Instant::now();
        let mut outstanding =
            Outstanding::new(w.clone(), app.metrics.clone(), s.uncached_tokens as u64);
        let retry = |reason: &str| {
            app.metrics
                .retries
                .with_label_values(&[&w.url, reason])
                .inc()
        };
        let req = HttpRequest::post_json(format!("{}{path}", w.url), body.clone());
        let mut stream = match app.http.stream(req).await {
            Ok(st) => st,
            Err(ClientError::Timeout) => {
                retry("timeout");
                return (
                    fail(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!(
                            "worker {} did not answer within the request deadline",
                            w.url
                        ),
                        "worker_timeout",
                    ),
                    "worker_error",
                );
            }
            Err(e) => {
                retry(if matches!(e, ClientError::Connect(_)) {
                    "connect"
                } else {
                    "http"
                });
                set_health(w, false, &app.metrics, "request failed");
                failures.push(format!("{}: {e}", w.url));
                continue;
            }
        };
        if stream.status >= 500 {
            let text = stream.prefix(512).await.unwrap_or_default();
            retry("status_5xx");
            failures.push(format!(
                "{}: {} {}",
                w.url,
                stream.status,
                String::from_utf8_lossy(&text)
            ));
            continue;
        }
        // The answer counts as started at its first byte: a worker dying before it is passed
        // over like one that could not be reached.
        let first = match stream.chunk().await {
            Ok(c) => c,
            Err(e) => {
                retry("http");
                set_health(w, false, &app.metrics, "answer cut short");
                failures.push(format!("{}: {e}", w.url));
                continue;
            }
        };
        let first_byte = Instant::now();
        let decoding_at_start = outstanding.started();
        // Only the kv policy reads them.
        if stream.status == 200 && app.config.policy == Policy::Kv {
            w.recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(&d.analysed.keys, first_byte);
            if let Some(id) = &d.analysed.session {
                app.sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .set(id, i, first_byte);
            }
        }
        let m = &app.metrics;
        m.routed.with_label_values(&[&w.url]).inc();
        m.prompt_tokens
            .with_label_values(&[&w.url])
            .inc_by(d.analysed.prompt_tokens as u64);
        m.predicted_cached_tokens
            .with_label_values(&[&w.url])
            .inc_by(s.cached_tokens as u64);
        let evidence = w
            .view
            .as_ref()
            .is_some_and(|v| v.synced.load(Ordering::Relaxed));
        let mut obs = Observer {
            app: app.clone(),
            _outstanding: outstanding,
            worker: i,
            // Only what the servers' events showed is evidence about the keys: the worker's
            // own server's at least, the cluster's at most.
            predicted: ((s.cached_blocks - s.routed_blocks - s.cluster_blocks)
                * app.prompt.block_tokens()) as u64,
            predicted_high: ((s.cached_blocks - s.routed_blocks) * app.prompt.block_tokens())
                as u64,
            evidence: evidence && stream.status == 200,
            tail: Vec::new(),
            complete: false,
            prompt_tokens: d.analysed.prompt_tokens as u64,
            sent,
            first_byte,
            alone_in_prefill,
            decoding_at_start,
            ok: stream.status == 200,
            ok_stream: stream.status == 200
                && stream
                    .content_type
                    .as_deref()
                    .is_some_and(|c| c.starts_with("text/event-stream")),
        };
        let status = StatusCode::from_u16(stream.status).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = stream.content_type.clone();
        if let Some(b) = &first {
            obs.see(b);
        } else {
            obs.complete = true;
        }
        let body = Body::from_stream(passthrough(first, stream, obs));
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        if let Some(ct) = content_type.and_then(|c| header::HeaderValue::from_str(&c).ok()) {
            resp.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        // Which worker answered, for operators and tests.
        if let Ok(v) = header::HeaderValue::from_str(&w.url) {
            resp.headers_mut().insert(WORKER_HEADER, v);
        }
        let outcome = if status.is_success() {
            "ok"
        } else if status.is_client_error() {
            "client_error"
        } else {
            "worker_error"
        };
        return (resp, outcome);
    }
    if failures.is_empty() {
        return (
            fail(
                StatusCode::SERVICE_UNAVAILABLE,
                "no worker configured".into(),
                "no_worker",
            ),
            "no_worker",
        );
    }
    tracing::warn!(failures = ?failures, "no worker could answer");
    (
        fail(
            StatusCode::BAD_GATEWAY,
            format!("no worker could answer: {}", failures.join("; ")),
            "no_worker",
        ),
        "no_worker",
    )
}

/// The answer's pieces as they arrive: the first (already read), then the rest.
fn passthrough(
    first: Option<Bytes>,
    stream: HttpStream,
    obs: Observer,
) -> impl futures_util::Stream<Item = Result<Bytes, ClientError>> + Send + 'static {
    futures_util::stream::unfold(Some((first, stream, obs)), |state| async move {
        let (first, mut stream, mut obs) = state?;
        if obs.complete {
            return None;
        }
        if let Some(b) = first {
            return Some((Ok(b), Some((None, stream, obs))));
        }
        match stream.chunk().await {
            Ok(Some(b)) => {
                obs.see(&b);
                Some((Ok(b), Some((None, stream, obs))))
            }
            Ok(None) => {
                obs.complete = true;
                None
            }
            Err(e) => {
                tracing::warn!(worker = %obs.app.workers.get(obs.worker).url, error = %e,
                        "the worker's answer broke off after it started");
                Some((Err(e), None))
            }
        }
    })
}

async fn debug_route(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    // A body with `messages` is a chat request.
    let endpoint = match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) if v.get("messages").is_some() => Endpoint::Chat,
        _ => Endpoint::Completions,
    };
    let mut analysed = match analyse(&app, &bytes, endpoint) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    if let Some(id) = session_header(&headers) {
        analysed.session = Some(id);
    }
    let d = decide(&app, analysed, app.rotation.load(Ordering::Relaxed));
    let mut v = explain(&app, &d);
    v["endpoint"] = json!(endpoint_label(endpoint));
    axum::Json(v).into_response()
}

async fn models(State(app): State<App>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": app.prompt.model_name(), "object": "model", "owned_by": "kvtier"}],
    }))
    .into_response()
}

async fn health_answer(State(app): State<App>) -> Response {
    let all = app.workers.all();
    let workers: Vec<Value> = all
        .iter()
        .map(|w| {
            json!({
                "url": w.url,
                "healthy": w.healthy.load(Ordering::Relaxed),
                "present": w.present.load(Ordering::Relaxed),
                "member": w.member,
                "outstanding_requests": w.outstanding_requests.load(Ordering::Relaxed),
                "kvtier_synced": w.view.as_ref().map(|v| v.synced.load(Ordering::Relaxed)),
            })
        })
        .collect();
    let healthy = all.iter().filter(|w| w.candidate()).count();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    #[allow(unused_mut)]
    let mut v = json!({
        "status": if healthy > 0 { "ok" } else { "no_healthy_worker" },
        "healthy_workers": healthy,
        "workers": workers,
    });
    #[cfg(feature = "cluster")]
    if let Some(m) = &app.members {
        v["cluster"] = m.health();
    }
    (status, axum::Json(v)).into_response()
}

async fn metrics_answer(State(app): State<App>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    ApiError::invalid("no such endpoint", None)
        .with_status(StatusCode::NOT_FOUND)
        .into_response()
}

//! The sidecar daemon: listeners (Unix socket, TCP, TLS over TCP, QUIC), the connection
//! handler (the only module that knows the wire format), the block event stream, metrics and
//! the HTTP admin port. See `docs/protocol.md` and `docs/operations.md`.

mod admin;
mod brakes;
pub mod config;
mod conn;
pub mod events;
mod fdpass;
mod key_secret;
mod membership;
pub mod metrics;
mod places;
mod reads;
mod remote;
mod shares;
mod staging;
mod tenants;
mod tls;
mod vllm_events;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::protocol::{ErrorCode, Limits};
use tokio::io::AsyncWriteExt;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

pub use brakes::raise_nofile_limit;
pub use config::{ConfigError, ConfigLoader, ServerConfig, Size, parse_size};
use metrics::{Metrics, Transport};
/// A secret file as the server reads one (private to its owner, trailing newline dropped, at
/// least 16 bytes); kvtier-router reads the cluster secret with it.
pub use places::read_secret_file;
use tenants::Tenants;

use crate::{StoreError, TieredStore};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("opening the store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(String),
    /// A directory or secret file that another user could change or read.
    #[error("{setting} {}: unsafe: it {problem}. Fix: {fix}", path.display())]
    UnsafePlace {
        setting: String,
        path: PathBuf,
        problem: String,
        fix: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServerError {
    let what = what.into();
    move |source| ServerError::Io { what, source }
}

/// State shared by every connection.
pub(crate) struct Shared {
    pub store: Arc<TieredStore>,
    pub config: ServerConfig,
    pub limits: Limits,
    pub metrics: Metrics,
    /// Tenants, their namespaces and each namespace's event stream.
    pub tenants: Arc<Tenants>,
    /// The token's SHA-256 (see [`brakes::token_matches`]).
    pub token_digest: [u8; 32],
    /// Failed hellos per peer address.
    pub auth: brakes::AuthThrottle,
    /// Network connections before their hello.
    pub pre_hello: Arc<brakes::PreHello>,
    /// Rate-limited warnings.
    pub logs: Logs,
    /// Block bytes being sent, in [`conn::BUDGET_UNIT`]s.
    pub inflight_bytes: Arc<Semaphore>,
    /// Each namespace's shares of pinned DRAM blocks, of the send budget and of connections.
    pub shares: shares::NamespaceShares,
    /// Unix socket connections per uid (`server.unix_group`).
    pub unix_uids: shares::UidShares,
    pub shutdown: CancellationToken,
    pub block_bytes: usize,
    pub layout_fingerprint: u64,
    pub ready: AtomicBool,
    /// This node's cluster state, set at start when `[cluster]` is on.
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::ClusterNode>>,
    /// The cluster data path, set at start when `[cluster]` has a secret.
    pub remote: std::sync::OnceLock<Arc<remote::Remote>>,
    /// SHA-256 of the cluster's peer token (see [`brakes::token_matches`]), with a secret.
    pub peer_token_digest: std::sync::OnceLock<[u8; 32]>,
    open: AtomicUsize,
    closed: Notify,
    started: Instant,
}

impl Shared {
    /// `/stats` and the `stats` request: every namespace for the admin port and admins
    /// (`only: None`); a tenant's client sees only its own namespace (`Some(ns)`), never
    /// another tenant's name, blocks or event sequence.
    pub fn stats_json(&self, only: Option<tenants::Ns>) -> String {
        let m = &self.metrics;
        serde_json::json!({
            "server": self.config.server.name,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "ready": self.ready.load(Ordering::Relaxed),
            "block_bytes": self.block_bytes,
            "connections": m.open_connections(),
            "busy": m.busy.get(),
            "bad_frames": m.bad_frames.get(),
            "auth_failures": m.auth_failures.get(),
            "auth_throttled": m.auth_throttled.get(),
            "connections_pre_hello": self.pre_hello.open(),
            "connections_refused": m.connections_refused.get(),
            "leases_open": m.leases_open.get(),
            "reservations_open": m.reservations_open.get(),
            "bytes_sent": m.bytes_sent.get(),
            "bytes_received": m.bytes_received.get(),
            "event_seq": self.tenants.bus(only.unwrap_or(0)).next_seq(),
            "store": self.store.stats(),
            "namespaces": self.tenants.stats(only),
        })
        .to_string()
    }
}

/// The server's rate-limited warnings, one per kind.
#[derive(Default)]
pub(crate) struct Logs {
    pub auth: brakes::RateLimitedLog,
    pub no_fds: brakes::RateLimitedLog,
    pub accept: brakes::RateLimitedLog,
    pub refused: brakes::RateLimitedLog,
    pub arena_fd: brakes::RateLimitedLog,
    pub tls_handshake: brakes::RateLimitedLog,
}

/// Where a started server listens, and what a client needs to reach it.
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub unix: Option<PathBuf>,
    pub tcp: Option<SocketAddr>,
    /// TLS over TCP (`server.tls`).
    pub tls: Option<SocketAddr>,
    pub quic: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    /// The token TCP, TLS and QUIC clients present.
    pub token: String,
    /// Where the token was written (when generated).
    pub token_file: Option<PathBuf>,
    /// The certificate QUIC and TLS present (DER), for clients to pin; empty when both are
    /// off. (Named for QUIC, which had it first.)
    pub quic_cert_der: Vec<u8>,
    /// Where that certificate was written (when generated).
    pub quic_cert_file: Option<PathBuf>,
    /// The ZMQ PUB endpoint of `events.zmq` (vLLM's KV-events format), as bound.
    pub zmq: Option<String>,
}

/// A running server. Stop it with [`Server::shutdown`].
pub struct Server {
    shared: Arc<Shared>,
    endpoints: Endpoints,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    quic: Option<quinn::Endpoint>,
    /// The etcd driver (`[cluster]`), awaited at shutdown so it can revoke its lease.
    cluster_task: Option<tokio::task::JoinHandle<()>>,
}

/// What a shutdown did.
#[derive(Debug, Clone)]
pub struct ShutdownReport {
    /// Connections still open when the drain timeout ran out (closed anyway).
    pub connections_cut: usize,
}

impl Server {
    /// Opens the store and starts every configured listener.
    pub async fn start(config: ServerConfig) -> Result<Server, ServerError> {
        config.validate()?;
        let runtime = config.runtime_dir();
        check_places(&config, &runtime)?;
        let store_config = config.store_config()?;
        let layout = store_config.layout;
        let store = tokio::task::spawn_blocking(move || TieredStore::open(store_config))
            .await
            .map_err(|e| ServerError::Tls(format!("store open task failed: {e}")))??
            .0;
        let store = Arc::new(store);
        let (token, token_file) = if config.tenants.is_empty() {
            resolve_token(&config, &runtime)?
        } else {
            // Each tenant presents its own token; there is no server-wide one.
            (String::new(), None)
        };
        let kept_blocks = store.kept_blocks();
        let secret = if config.tenants.is_empty() {
            [0; key_secret::KEY_SECRET_BYTES]
        } else {
            let (secret, source) = key_secret::key_secret(&config)?;
            tracing::info!(
                tenants = config.tenants.len(),
                key_secret = ?source,
                "tenants enforced: each credential names a tenant and its namespace"
            );
            if source == key_secret::KeySecretSource::PerStart {
                tracing::warn!(
                    "tenants: no server.tenant_key_secret_file, cluster.secret_file or NVMe \
                     tier: the key secret is new at each start, so tenants' blocks do not \
                     outlive a restart"
                );
            }
            secret
        };
        let tenants = Arc::new(Tenants::new(
            &config,
            &secret,
            store.block_bytes() as u64,
            kept_blocks,
        )?);
        // Without a configured tenant share, each namespace's hints get an equal part.
        store.set_retain_namespaces(tenants.namespaces());
        let limits = config.limits()?;
        let budget_units = match config.limits.max_inflight_bytes {
            Size::Bytes(b) => b.div_ceil(conn::BUDGET_UNIT),
            Size::Auto => 1 << 18,
        }
        .min(Semaphore::MAX_PERMITS as u64) as usize;
        let shares = namespace_shares(&config, &tenants, &store, budget_units as u64);
        let unix_uids = shares::UidShares::new(
            (!config.server.unix_group.is_empty()).then(|| {
                match config.limits.max_unix_connections_per_uid {
                    0 => (config.limits.unix_reserved_connections as u64 / 2).max(1),
                    n => n as u64,
                }
            }),
            places::euid(),
        );
        let shared = Arc::new(Shared {
            block_bytes: store.block_bytes(),
            layout_fingerprint: layout.fingerprint(),
            store: store.clone(),
            limits,
            metrics: Metrics::default(),
            tenants: tenants.clone(),
            token_digest: brakes::token_digest(token.as_bytes()),
            auth: brakes::AuthThrottle::new(
                config.limits.auth_failures_burst,
                config.limits.auth_failures_per_minute,
            ),
            pre_hello: brakes::PreHello::new(config.limits.max_pre_hello_connections),
            logs: Logs::default(),
            inflight_bytes: Arc::new(Semaphore::new(budget_units)),
            shares,
            unix_uids,
            shutdown: CancellationToken::new(),
            ready: AtomicBool::new(false),
            cluster: std::sync::OnceLock::new(),
            remote: std::sync::OnceLock::new(),
            peer_token_digest: std::sync::OnceLock::new(),
            open: AtomicUsize::new(0),
            closed: Notify::new(),
            started: Instant::now(),
            config,
        });
        // The sink holds the tenants (names, event streams) only: the store must not keep the
        // server state alive.
        store.set_event_sink(Arc::new(move |e| tenants.observe(e)));
        let mut endpoints = Endpoints {
            unix: None,
            tcp: None,
            tls: None,
            quic: None,
            admin: None,
            token,
            token_file,
            quic_cert_der: Vec::new(),
            quic_cert_file: None,
            zmq: None,
        };
        let mut tasks = Vec::new();
        let c = &shared.config;
        if let Some(ep) = c.zmq_endpoint()? {
            let (sock, at) = vllm_events::bind(&ep)
                .await
                .map_err(|e| ServerError::Bind {
                    what: "events.zmq",
                    addr: ep.clone(),
                    source: std::io::Error::other(e),
                })?;
            endpoints.zmq = Some(at);
            let p = vllm_events::Publisher {
                topic: bytes::Bytes::from(c.events.zmq_topic.clone().into_bytes()),
                block_tokens: layout.block_tokens(),
                batch: Duration::from_millis(c.events.zmq_batch_ms),
                batch_events: c.events.zmq_batch_events,
            };
            let inner = tokio::spawn(p.run(sock, shared.clone()));
            // zeromq 0.4 panics (todo!) on a send error it does not expect: that ends the
            // publisher, never the server; say so.
            tasks.push(tokio::spawn(async move {
                if let Err(e) = inner.await
                    && e.is_panic()
                {
                    tracing::error!("events.zmq: the publisher stopped (panic): {e}");
                }
            }));
        }
        if let Some(path) = c.unix_path() {
            let group = if c.server.unix_group.is_empty() {
                None
            } else {
                Some(places::group_id("server.unix_group", &c.server.unix_group)?)
            };
            let l = bind_unix(&path, group)?;
            if let Some(gid) = group {
                warn_if_group_cannot_reach(&path, gid);
            }
            endpoints.unix = Some(path);
            tasks.push(tokio::spawn(accept_unix(shared.clone(), l)));
        }
        if let Some(addr) = c.tcp_addr()? {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind {
                    what: "tcp",
                    addr: addr.to_string(),
                    source,
                })?;
            endpoints.tcp = Some(l.local_addr().map_err(io_err("tcp local_addr"))?);
            tasks.push(tokio::spawn(accept_tcp(shared.clone(), l)));
        }
        // One certificate for QUIC and TLS (generated once, when not configured).
        let identity = if c.quic_addr()?.is_some() || c.tls_addr()?.is_some() {
            let id = tls::identity(c, &runtime)?;
            endpoints.quic_cert_der = id.cert_der();
            endpoints.quic_cert_file = id.file.clone();
            Some(id)
        } else {
            None
        };
        let client_auth = if !shared.tenants.pins_client_certs() {
            tls::ClientAuth::None
        } else if c.server.tls_client_auth == "required" {
            tls::ClientAuth::Required
        } else {
            tls::ClientAuth::Optional
        };
        if let (Some(addr), Some(id)) = (c.tls_addr()?, &identity) {
            let acceptor = tls::tcp_acceptor(id, client_auth)?;
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind {
                    what: "tls",
                    addr: addr.to_string(),
                    source,
                })?;
            endpoints.tls = Some(l.local_addr().map_err(io_err("tls local_addr"))?);
            tasks.push(tokio::spawn(accept_tls(shared.clone(), l, acceptor)));
        }
        let mut quic = None;
        if let (Some(addr), Some(id)) = (c.quic_addr()?, &identity) {
            let server_config = tls::quic_config(id, client_auth)?;
            let ep = quinn::Endpoint::server(server_config, addr).map_err(|source| {
                ServerError::Bind {
                    what: "quic",
                    addr: addr.to_string(),
                    source,
                }
            })?;
            endpoints.quic = Some(ep.local_addr().map_err(io_err("quic local_addr"))?);
            tasks.push(tokio::spawn(accept_quic(shared.clone(), ep.clone())));
            quic = Some(ep);
        }
        if let Some(addr) = c.admin_addr()? {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind {
                    what: "admin",
                    addr: addr.to_string(),
                    source,
                })?;
            endpoints.admin = Some(l.local_addr().map_err(io_err("admin local_addr"))?);
            tasks.push(tokio::spawn(admin::serve(shared.clone(), l)));
        }
        let reads = start_reads(&shared.config, &endpoints, &store).await?;
        let ad = reads.as_ref().map(|r| membership::TransferAd {
            endpoint: format!("{}://{}", r.backend_name(), r.listen_addr()),
            meta_hex: r.meta_hex().to_string(),
        });
        let node = membership::node(
            &shared.config,
            &endpoints,
            &store.stats(),
            shared.metrics.cluster.clone(),
            ad.as_ref(),
        )?;
        // Without the `cluster` feature `node` is None: the config check refused `[cluster]`.
        #[cfg(feature = "cluster")]
        let cluster_task = node.as_ref().map(|n| n.spawn(shared.shutdown.clone()));
        #[cfg(not(feature = "cluster"))]
        let cluster_task = None;
        if let Some(n) = node {
            if let Some(t) = &n.peer_token {
                let _ = shared
                    .peer_token_digest
                    .set(brakes::token_digest(t.as_bytes()));
            }
            if let Some(r) = remote::Remote::start(&shared, n.clone(), reads) {
                let _ = shared.remote.set(r);
            }
            let _ = shared.cluster.set(n);
        }
        shared.ready.store(true, Ordering::Release);
        tracing::info!(?endpoints.unix, ?endpoints.tcp, ?endpoints.tls, ?endpoints.quic, ?endpoints.admin, "kvtier-server ready");
        Ok(Server {
            shared,
            endpoints,
            tasks,
            quic,
            cluster_task,
        })
    }

    pub fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    pub fn store(&self) -> &Arc<TieredStore> {
        &self.shared.store
    }

    /// Cancelled when shutdown begins.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shared.shutdown.clone()
    }

    /// Stops accepting, lets requests in flight finish (up to the drain timeout), closes
    /// every connection, waits for background copies and returns.
    pub async fn shutdown(self) -> ShutdownReport {
        let s = &self.shared;
        s.ready.store(false, Ordering::Release);
        s.shutdown.cancel();
        let deadline =
            tokio::time::Instant::now() + s.config.drain_timeout() + Duration::from_secs(1);
        loop {
            let notified = s.closed.notified();
            if s.open.load(Ordering::Acquire) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        let cut = s.open.load(Ordering::Acquire);
        if let Some(t) = self.cluster_task {
            // It revokes its lease (bounded by cluster.etcd_timeout_ms) and returns.
            let limit = s.config.cluster.etcd_timeout_ms + 500;
            let _ = tokio::time::timeout(Duration::from_millis(limit), t).await;
        }
        if let Some(q) = &self.quic {
            q.close(0u32.into(), b"shutting down");
        }
        for t in self.tasks {
            t.abort();
        }
        if let Some(p) = &self.endpoints.unix {
            let _ = std::fs::remove_file(p);
        }
        let store = s.store.clone();
        let _ = tokio::task::spawn_blocking({
            let store = store.clone();
            move || store.flush()
        })
        .await;
        // Wait (bounded) for the last tasks to let go, so the store closes here and a new
        // server can open the same NVMe directory at once.
        let shared = self.shared;
        let until = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&shared) > 1 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(shared);
        while Arc::strong_count(&store) > 1 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = tokio::task::spawn_blocking(move || drop(store)).await;
        ShutdownReport {
            connections_cut: cut,
        }
    }
}

/// The shares of `limits.max_pinned_blocks_per_connection`, `max_pinned_blocks_per_tenant`,
/// `max_inflight_bytes_per_tenant` (of a send budget of `budget_units`) and
/// `max_connections_per_tenant`; without tenants the one namespace is the whole server,
/// unbounded but for the server's own budgets.
/// This node's agent for one-sided reads (`server/reads.rs`), when the cluster's data path
/// is on (a cluster secret) and `cluster.fetch` is `tcp` or `quic` (or `auto` with a plain
/// TCP data endpoint). With neither
/// `cluster.advertise_transfer` nor an IP address in the advertised data endpoint there is
/// no address to offer peers: blocks then come over the protocol, said in a warning.
async fn start_reads(
    c: &ServerConfig,
    endpoints: &Endpoints,
    store: &Arc<TieredStore>,
) -> Result<Option<reads::Reads>, ServerError> {
    if !c.cluster_enabled()? {
        return Ok(None);
    }
    let Some(backend) = fetch_backend(&c.cluster.fetch, &membership::data_endpoint(c, endpoints))
    else {
        return Ok(None);
    };
    let Some(secret) = membership::cluster_secret(c)? else {
        return Ok(None);
    };
    let Some(ip) = membership::transfer_ip(c, endpoints) else {
        tracing::warn!(
            "cluster: no address for one-sided reads (set cluster.advertise_transfer, or \
             advertise an IP address as the data endpoint): peers fetch this node's blocks \
             over the protocol"
        );
        return Ok(None);
    };
    let token = crate::cluster::record::transfer_token(&secret, &c.cluster.name);
    let name = if c.cluster.node_id.is_empty() {
        "kvtier-server"
    } else {
        &c.cluster.node_id
    };
    let at = std::net::SocketAddr::new(ip, c.cluster.transfer_port);
    let r = reads::Reads::start(store, at, backend, token, name)
        .await
        .map_err(|e| ServerError::Bind {
            what: "cluster transfer agent",
            addr: at.to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
    Ok(Some(r))
}

/// The backend of one-sided reads that `cluster.fetch` picks for a member advertising
/// `data_endpoint`; `None`: the protocol.
fn fetch_backend(fetch: &str, data_endpoint: &str) -> Option<kvtier_transfer::BackendKind> {
    match fetch {
        "tcp" => Some(kvtier_transfer::BackendKind::Tcp),
        "quic" => Some(kvtier_transfer::BackendKind::Quic),
        // Plain TCP between peers anyway: read one-sided over TCP. Over TLS the protocol
        // keeps the blocks encrypted (`quic` reads one-sided, encrypted).
        "auto" if data_endpoint.starts_with("tcp://") => Some(kvtier_transfer::BackendKind::Tcp),
        _ => None,
    }
}

fn namespace_shares(
    c: &ServerConfig,
    tenants: &Tenants,
    store: &TieredStore,
    budget_units: u64,
) -> shares::NamespaceShares {
    use crate::tier::Tier;
    let l = &c.limits;
    let dram_slots = u64::from(store.dram().slot_count()).max(1);
    let or = |n: u64, auto: u64| if n == 0 { auto.max(1) } else { n };
    let (pins, send, conns) = if tenants.enforced() {
        let send = match l.max_inflight_bytes_per_tenant {
            Size::Bytes(b) => b.div_ceil(conn::BUDGET_UNIT),
            Size::Auto => budget_units / 2,
        };
        (
            or(l.max_pinned_blocks_per_tenant, dram_slots / 2),
            send.max(1),
            or(
                l.max_connections_per_tenant as u64,
                l.max_connections as u64 / 2,
            ),
        )
    } else {
        (u64::MAX, u64::MAX, u64::MAX)
    };
    shares::NamespaceShares::new(
        tenants.namespaces(),
        or(l.max_pinned_blocks_per_connection, dram_slots / 4),
        pins,
        send,
        conns,
    )
}

/// Refuses to start where another user could replace the socket, the token or the data
/// (see [`places`]); creates missing directories 0700.
fn check_places(c: &ServerConfig, runtime: &Path) -> Result<(), ServerError> {
    places::ensure_private_dir("server.runtime_dir", runtime)?;
    if let Some(dir) = c.unix_path().as_deref().and_then(Path::parent)
        && dir != runtime
    {
        places::ensure_private_dir("server.unix (its directory)", dir)?;
    }
    if !c.store.nvme_dir.is_empty() && c.tiers()?.contains(&crate::tier::TierKind::Nvme) {
        places::ensure_private_dir("store.nvme_dir", Path::new(&c.store.nvme_dir))?;
    }
    if c.server.token.is_empty() && !c.server.token_file.is_empty() {
        places::check_secret_file("server.token_file", Path::new(&c.server.token_file))?;
    }
    if !c.server.tls_key.is_empty() {
        places::check_secret_file("server.tls_key", Path::new(&c.server.tls_key))?;
    }
    if !c.tenants.is_empty() && !c.server.tenant_key_secret_file.is_empty() {
        places::check_secret_file(
            "server.tenant_key_secret_file",
            Path::new(&c.server.tenant_key_secret_file),
        )?;
    }
    for (name, t) in &c.tenants {
        if t.token.is_empty() && !t.token_file.is_empty() {
            places::check_secret_file(
                &format!("tenants.{name}.token_file"),
                Path::new(&t.token_file),
            )?;
        }
    }
    Ok(())
}

/// Runs `serve` as a tracked connection (counted for max_connections and the drain).
fn spawn_conn<F>(shared: &Arc<Shared>, f: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    shared.open.fetch_add(1, Ordering::AcqRel);
    let s = shared.clone();
    tokio::spawn(async move {
        f.await;
        s.open.fetch_sub(1, Ordering::AcqRel);
        s.closed.notify_waiters();
    });
}

/// Why a connection was refused at accept (the `reason` label of
/// `kvtier_connection_refusals_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `limits.max_connections` (less the Unix reserve, for the network).
    MaxConnections,
    /// `limits.max_pre_hello_connections`.
    PreHello,
    /// The process is out of file descriptors.
    NoFds,
    /// `limits.admin_max_connections`.
    Admin,
}

impl Refusal {
    pub const ALL: [Refusal; 4] = [
        Refusal::MaxConnections,
        Refusal::PreHello,
        Refusal::NoFds,
        Refusal::Admin,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Refusal::MaxConnections => "max_connections",
            Refusal::PreHello => "pre_hello",
            Refusal::NoFds => "no_fds",
            Refusal::Admin => "admin",
        }
    }
}

/// Counts (and logs, rate-limited) a connection refused at accept.
pub(crate) fn refused(shared: &Shared, why: Refusal) {
    shared.metrics.connection_refused(why);
    if let Some(n) = shared.logs.refused.tick(Instant::now()) {
        tracing::warn!(
            reason = why.name(),
            "refusing connections ({n} since the last warning); see \
             kvtier_connection_refusals_total"
        );
    }
}

/// Whether one more connection over `transport` fits: the Unix socket up to
/// `max_connections`, the network up to that less the Unix reserve, and then only while
/// fewer than `max_pre_hello_connections` network connections wait for their hello (the
/// place it takes there comes back). Counts a refusal.
fn admit(shared: &Shared, transport: Transport) -> Result<Option<brakes::PreHelloSlot>, Refusal> {
    let open = shared.open.load(Ordering::Acquire);
    let r = if transport == Transport::Unix {
        if open >= shared.config.limits.max_connections {
            Err(Refusal::MaxConnections)
        } else {
            Ok(None)
        }
    } else if open >= shared.config.max_network_connections() {
        Err(Refusal::MaxConnections)
    } else {
        shared.pre_hello.admit().map(Some).ok_or(Refusal::PreHello)
    };
    if let Err(why) = r {
        refused(shared, why);
    }
    r
}

/// A spare file descriptor: when accept fails for want of descriptors (EMFILE, ENFILE), it
/// is closed to take the waiting connection and refuse it with "busy" (instead of leaving
/// the client hanging in the backlog), then opened again.
struct FdReserve(Option<std::fs::File>);

/// How long accept pauses after running out of file descriptors.
const NO_FDS_BACKOFF: Duration = Duration::from_millis(100);

impl FdReserve {
    fn new() -> Self {
        Self(std::fs::File::open("/dev/null").ok())
    }

    /// Handles an accept error: refuses one waiting connection cleanly when descriptors ran
    /// out, logs (rate-limited) and pauses.
    async fn accept_failed<S, F, Fut>(
        &mut self,
        shared: &Shared,
        what: &str,
        e: std::io::Error,
        accept: F,
    ) where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = std::io::Result<S>>,
        S: tokio::io::AsyncWrite + Unpin,
    {
        let no_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
        if !no_fds {
            if let Some(n) = shared.logs.accept.tick(Instant::now()) {
                tracing::warn!("{what} accept: {e} ({n} errors since the last warning)");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            return;
        }
        refused(shared, Refusal::NoFds);
        if let Some(n) = shared.logs.no_fds.tick(Instant::now()) {
            tracing::warn!(
                "{what} accept: out of file descriptors ({e}): refusing new connections \
                 ({n} since the last warning); raise the limit (ulimit -n, LimitNOFILE) or \
                 lower limits.max_connections"
            );
        }
        if self.0.take().is_some()
            && let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_millis(10), accept()).await
        {
            refuse_busy(stream, "out of file descriptors").await;
        }
        tokio::time::sleep(NO_FDS_BACKOFF).await;
        *self = Self::new();
    }
}

async fn refuse_busy<W: tokio::io::AsyncWrite + Unpin>(w: W, why: &str) {
    refuse_with(w, ErrorCode::Busy, why).await;
}

/// Writes one error frame (request id 0) and closes.
async fn refuse_with<W: tokio::io::AsyncWrite + Unpin>(mut w: W, code: ErrorCode, why: &str) {
    use kvtier_core::protocol::{ErrorReply, HEADER_VERSION, Header, Response};
    let (fl, meta) = Response::Error(ErrorReply {
        code: code as u16,
        message: why.into(),
    })
    .encode_meta();
    let h = Header {
        version: HEADER_VERSION,
        opcode: 0,
        flags: fl,
        request_id: 0,
        meta_len: meta.len() as u32,
        payload_len: 0,
    };
    // A fresh socket takes these few bytes at once; a peer that does not read is not waited
    // for long (the accept loop waits on it).
    let _ = tokio::time::timeout(Duration::from_millis(100), async {
        w.write_all(&h.encode()).await?;
        w.write_all(&meta).await?;
        w.shutdown().await
    })
    .await;
}

/// Says so when the socket's directory does not let `gid`'s members through (they could not
/// connect): the server keeps its directories 0700 unless told otherwise.
fn warn_if_group_cannot_reach(socket: &Path, gid: u32) {
    use std::os::unix::fs::MetadataExt;
    let Some(dir) = socket.parent() else { return };
    let Ok(m) = std::fs::metadata(dir) else {
        return;
    };
    let through = (m.gid() == gid && m.mode() & 0o010 != 0) || m.mode() & 0o001 != 0;
    if !through {
        tracing::warn!(
            dir = %dir.display(),
            "server.unix_group: the socket's directory (mode {:04o}, gid {}) does not let group \
             {gid} through, so its members cannot connect: `chgrp {gid} {d} && chmod 0710 {d}`",
            m.mode() & 0o7777,
            m.gid(),
            d = dir.display()
        );
    }
}

/// Binds the Unix socket atomically: under a temporary name in its (private) directory,
/// made 0600, then renamed over `path`, so the path never holds another process's socket or
/// one that others may connect to.
///
/// With `group` (`server.unix_group`), the socket is given that group and made 0660 before
/// the rename, so the group's members may connect (their uid then names their tenant).
fn bind_unix(path: &Path, group: Option<u32>) -> Result<tokio::net::UnixListener, ServerError> {
    use std::os::unix::fs::PermissionsExt;
    let bind_err = |source| ServerError::Bind {
        what: "unix",
        addr: path.display().to_string(),
        source,
    };
    // A socket file left by a dead server is replaced; a live one is not stolen.
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(bind_err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "another server is listening there",
        )));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    // Short, so that a path that fits the 108-byte limit mostly fits with it too.
    let tmp = dir.join(format!(".{:x}.t", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let l = tokio::net::UnixListener::bind(&tmp).map_err(bind_err)?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let done = std::os::unix::fs::chown(&tmp, None, group)
        .map_err(io_err(format!("chgrp {group:?} {}", tmp.display())))
        .and_then(|()| {
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
                .map_err(io_err(format!("chmod {mode:o} {}", tmp.display())))
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(io_err(format!(
                "renaming {} to {}",
                tmp.display(),
                path.display()
            )))
        });
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(l)
}

async fn accept_unix(shared: Arc<Shared>, l: tokio::net::UnixListener) {
    use std::os::fd::AsRawFd;
    let mut reserve = FdReserve::new();
    loop {
        let r = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = l.accept() => r,
        };
        let stream = match r {
            Ok((s, _)) => s,
            Err(e) => {
                reserve
                    .accept_failed(&shared, "unix", e, || async {
                        l.accept().await.map(|(s, _)| s)
                    })
                    .await;
                continue;
            }
        };
        let pre_hello = match admit(&shared, Transport::Unix) {
            Ok(p) => p,
            Err(_) => {
                tokio::spawn(refuse_busy(stream, "too many connections"));
                continue;
            }
        };
        let fd = stream.as_raw_fd();
        // SO_PEERCRED: the uid the peer had when it connected (the kernel's word for it).
        let uid = stream.peer_cred().ok().map(|c| c.uid());
        // A group member (`server.unix_group`) holds at most its share of the places.
        let place = match shared.unix_uids.admit(uid) {
            Ok(p) => p,
            Err(()) => {
                shared
                    .metrics
                    .share_refused(shares::ShareKind::ConnectionsUid);
                tokio::spawn(refuse_busy(
                    stream,
                    "too many connections from this uid \
                     (limits.max_unix_connections_per_uid)",
                ));
                continue;
            }
        };
        let (r, w) = stream.into_split();
        let s = shared.clone();
        let peer = conn::Peer {
            transport: Transport::Unix,
            ip: None,
            pre_hello,
            uid,
            cert_sha256: None,
        };
        spawn_conn(&shared, async move {
            let _place = place;
            conn::serve(s, peer, r, w, Some(fd)).await;
        });
    }
}

/// The accept loop of a TCP listener, plain or TLS: accepts until shutdown, rides out
/// accept errors (file descriptors exhausted: [`FdReserve`]), admits each connection as
/// `transport` before its hello, sets `TCP_NODELAY`, and hands it to `serve`; a connection
/// admission refuses goes to `refuse`.
async fn accept_stream_loop(
    shared: Arc<Shared>,
    l: tokio::net::TcpListener,
    transport: Transport,
    refuse: impl Fn(tokio::net::TcpStream, Refusal),
    serve: impl Fn(&Arc<Shared>, tokio::net::TcpStream, SocketAddr, Option<brakes::PreHelloSlot>),
) {
    let what = if transport == Transport::Tls {
        "tls"
    } else {
        "tcp"
    };
    let mut reserve = FdReserve::new();
    loop {
        let r = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = l.accept() => r,
        };
        let (stream, addr) = match r {
            Ok(s) => s,
            Err(e) => {
                reserve
                    .accept_failed(&shared, what, e, || async {
                        l.accept().await.map(|(s, _)| s)
                    })
                    .await;
                continue;
            }
        };
        match admit(&shared, transport) {
            Ok(pre_hello) => {
                let _ = stream.set_nodelay(true);
                serve(&shared, stream, addr, pre_hello);
            }
            Err(why) => refuse(stream, why),
        }
    }
}

async fn accept_tcp(shared: Arc<Shared>, l: tokio::net::TcpListener) {
    let refuse = |stream, why| {
        let msg = match why {
            Refusal::PreHello => "too many connections waiting for their hello",
            _ => "too many connections",
        };
        tokio::spawn(refuse_busy(stream, msg));
    };
    let serve =
        |shared: &Arc<Shared>, stream: tokio::net::TcpStream, addr: SocketAddr, pre_hello| {
            let (r, w) = stream.into_split();
            let peer = conn::Peer {
                transport: Transport::Tcp,
                ip: Some(addr.ip()),
                pre_hello,
                uid: None,
                cert_sha256: None,
            };
            spawn_conn(shared, conn::serve(shared.clone(), peer, r, w, None));
        };
    accept_stream_loop(shared, l, Transport::Tcp, refuse, serve).await;
}

/// The TLS port: each connection is admitted as a network connection before hello (the
/// handshake counts against `limits.max_pre_hello_connections` and must finish, with the
/// hello after it, within `limits.hello_timeout_ms`), then served by the same handler as
/// plain TCP, over the TLS stream.
async fn accept_tls(
    shared: Arc<Shared>,
    l: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    // No TLS session to answer a refusal in: close at once.
    let refuse = |_stream, _why| {};
    let serve =
        |shared: &Arc<Shared>, stream: tokio::net::TcpStream, addr: SocketAddr, pre_hello| {
            let s = shared.clone();
            let acceptor = acceptor.clone();
            spawn_conn(shared, async move {
                let hello_by = tokio::time::Instant::now() + s.config.hello_timeout();
                let tls = tokio::select! {
                    _ = s.shutdown.cancelled() => return,
                    r = tokio::time::timeout_at(hello_by, tls_handshake(acceptor, stream)) => r,
                };
                let tls = match tls {
                    Ok(Ok(t)) => t,
                    Ok(Err(why)) => return tls_failed(&s, addr, &why),
                    Err(_) => {
                        return tls_failed(&s, addr, "no handshake within limits.hello_timeout_ms");
                    }
                };
                let cert_sha256 = tls::peer_cert_sha256(tls.get_ref().1.peer_certificates());
                let (r, w) = tokio::io::split(tls);
                let peer = conn::Peer {
                    transport: Transport::Tls,
                    ip: Some(addr.ip()),
                    pre_hello,
                    uid: None,
                    cert_sha256,
                };
                conn::serve_until(s, peer, r, w, None, hello_by).await;
            });
        };
    accept_stream_loop(shared, l, Transport::Tls, refuse, serve).await;
}

/// The handshake of one TLS connection. A peer that speaks kvtier's plaintext frames to the
/// TLS port is told so in a plaintext error frame (it has sent its hello, token included, in
/// clear already; the answer at least says why it fails), then closed.
async fn tls_handshake(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: tokio::net::TcpStream,
) -> Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, String> {
    let mut first = [0u8; 4];
    // Peek until the first 4 bytes are in, or they cannot be a kvtier frame's magic.
    loop {
        let n = stream.peek(&mut first).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed before the handshake".into());
        }
        let magic = kvtier_core::protocol::MAGIC.to_le_bytes();
        if first[..n] != magic[..n] {
            break;
        }
        if n == magic.len() {
            refuse_plaintext(stream).await;
            return Err("a plaintext kvtier client (this port speaks TLS: use tls://)".into());
        }
        // Part of a magic so far: wait for more (bounded by the caller's timeout).
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    acceptor.accept(stream).await.map_err(|e| e.to_string())
}

/// Counts and logs (rate-limited) a failed TLS handshake; the connection is closed.
fn tls_failed(shared: &Shared, peer: SocketAddr, why: &str) {
    Metrics::inc(&shared.metrics.tls_handshake_failures);
    if let Some(n) = shared.logs.tls_handshake.tick(Instant::now()) {
        tracing::warn!(
            %peer,
            "TLS handshake failed: {why} ({n} since the last warning; see \
             kvtier_tls_handshake_failures_total)"
        );
    }
}

/// Answers a plaintext kvtier frame on the TLS port with an error frame saying so.
async fn refuse_plaintext<W: tokio::io::AsyncWrite + Unpin>(w: W) {
    refuse_with(
        w,
        ErrorCode::Unauthorized,
        "this port speaks TLS: connect with tls://host:port (plain TCP is the server.tcp port)",
    )
    .await;
}

async fn accept_quic(shared: Arc<Shared>, ep: quinn::Endpoint) {
    loop {
        let incoming = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            i = ep.accept() => match i { Some(i) => i, None => return },
        };
        // A connection is before its hello from its first packet: its handshake and its
        // first stream take a place of max_pre_hello_connections and its deadline.
        match admit(&shared, Transport::Quic) {
            Ok(pre_hello) => {
                tokio::spawn(serve_quic(shared.clone(), incoming, pre_hello));
            }
            Err(_) => incoming.refuse(),
        }
    }
}

/// Serves one QUIC connection, each bidirectional stream a client connection of its own.
/// While it has no stream (from its accept, its handshake included, and again whenever its
/// streams have all ended) it counts as a connection before hello: it holds a place of
/// `limits.max_pre_hello_connections`, and a stream must arrive and say hello within
/// `limits.hello_timeout_ms`, else the connection is closed (counted in `timeouts`).
async fn serve_quic(
    s: Arc<Shared>,
    incoming: quinn::Incoming,
    mut pre_hello: Option<brakes::PreHelloSlot>,
) {
    let mut hello_by = tokio::time::Instant::now() + s.config.hello_timeout();
    let handshake = std::future::IntoFuture::into_future(incoming);
    let conn = tokio::select! {
        _ = s.shutdown.cancelled() => return,
        r = tokio::time::timeout_at(hello_by, handshake) => match r {
            Ok(Ok(c)) => c,
            Ok(Err(_)) => return,
            // Dropping the handshake closes the connection.
            Err(_) => return Metrics::inc(&s.metrics.timeouts),
        },
    };
    let ip = conn.remote_address().ip();
    let cert_sha256 = conn
        .peer_identity()
        .and_then(|id| {
            id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .and_then(|chain| tls::peer_cert_sha256(Some(&chain)));
    // Each stream's task holds a clone and says when it ends.
    let live = Arc::new(());
    let ended = Arc::new(Notify::new());
    loop {
        let idle = Arc::strong_count(&live) == 1;
        if idle && pre_hello.is_none() {
            // Its streams have all ended: it waits as a connection before hello again.
            match admit(&s, Transport::Quic) {
                Ok(p) => pre_hello = p,
                Err(_) => {
                    conn.close(1u32.into(), b"too many connections");
                    return;
                }
            }
            hello_by = tokio::time::Instant::now() + s.config.hello_timeout();
        }
        let (send, recv) = tokio::select! {
            _ = s.shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(hello_by), if idle => {
                Metrics::inc(&s.metrics.timeouts);
                conn.close(2u32.into(), b"no hello within limits.hello_timeout_ms");
                return;
            }
            _ = ended.notified(), if !idle => continue,
            r = conn.accept_bi() => match r { Ok(b) => b, Err(_) => return },
        };
        // The connection's place and deadline pass to its first stream; a stream opened
        // beside a live one takes a place of its own.
        let (pre, by) = match pre_hello.take() {
            Some(p) => (Some(p), hello_by),
            None => match admit(&s, Transport::Quic) {
                Ok(p) => (p, tokio::time::Instant::now() + s.config.hello_timeout()),
                Err(_) => {
                    conn.close(1u32.into(), b"too many connections");
                    return;
                }
            },
        };
        let peer = conn::Peer {
            transport: Transport::Quic,
            ip: Some(ip),
            pre_hello: pre,
            uid: None,
            cert_sha256,
        };
        let (s2, held, ended) = (s.clone(), live.clone(), ended.clone());
        spawn_conn(&s, async move {
            conn::serve_until(s2, peer, recv, send, None, by).await;
            drop(held);
            ended.notify_one();
        });
    }
}

/// The token remote clients must present: configured, read from a file, or generated and
/// written to `<runtime>/token` (0600).
fn resolve_token(
    c: &ServerConfig,
    runtime: &Path,
) -> Result<(String, Option<PathBuf>), ServerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if !c.server.token.is_empty() {
        return Ok((c.server.token.clone(), None));
    }
    if !c.server.token_file.is_empty() {
        let t = std::fs::read_to_string(&c.server.token_file)
            .map_err(io_err(format!("server.token_file {}", c.server.token_file)))?;
        let t = t.lines().next().unwrap_or("").trim().to_string();
        if t.is_empty() {
            return Err(ConfigError {
                setting: "server.token_file".into(),
                reason: "the file's first line is empty".into(),
            }
            .into());
        }
        return Ok((t, None));
    }
    let mut raw = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut raw))
        .map_err(io_err("reading /dev/urandom"))?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let path = runtime.join("token");
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err(format!("writing {}", path.display())))?;
    writeln!(f, "{token}").map_err(io_err(format!("writing {}", path.display())))?;
    Ok((token, Some(path)))
}

#[cfg(test)]
mod tests {
    use super::fetch_backend;
    use kvtier_transfer::BackendKind;

    /// `auto` reads one-sided over TCP only where peers talk plain TCP anyway: a member that
    /// talks TLS keeps its blocks encrypted over the protocol.
    #[test]
    fn auto_fetch_never_trades_tls_for_clear_reads() {
        let tcp = "tcp://10.0.0.1:7000";
        let tls = "tls://10.0.0.1:7001";
        assert_eq!(fetch_backend("auto", tcp), Some(BackendKind::Tcp));
        assert_eq!(fetch_backend("auto", tls), None);
        assert_eq!(fetch_backend("auto", ""), None);
        assert_eq!(fetch_backend("tcp", tls), Some(BackendKind::Tcp));
        assert_eq!(fetch_backend("quic", tls), Some(BackendKind::Quic));
        assert_eq!(fetch_backend("protocol", tcp), None);
    }
}

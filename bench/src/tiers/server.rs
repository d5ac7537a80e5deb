//! The server part of `kvtier-bench tiers` (also `kvtier-bench server`, which runs only this
//! part): the sidecar over its transports against references measured in the same run:
//!
//! * unix (local, zero-copy out of the mapped arena): single-thread memcpy of the same
//!   blocks over the same working set; Redis GET/SET over its Unix socket;
//! * tcp: raw loopback TCP streams, one per client, moving the same bytes per request (a
//!   1-byte request answered by the blocks, or the blocks answered by a 1-byte ack); Redis
//!   GET/SET over TCP;
//! * quic: raw quinn streams the same way, with the client's transport settings;
//!
//! and, with the NVMe tier (`--server-tiers nvme`: a DRAM tier of a few blocks over a
//! write-through NVMe tier holding a working set at least 4x larger, in the bench directory),
//! O_DIRECT pread / pwrite of the same block size in the same directory, one thread per
//! client; the share of blocks actually served from NVMe is reported;
//!
//! plus the lookup latency of a long prefix over the Unix socket, and the server's peak RSS.
//! Gets cycle through a working set of `--blocks` distinct blocks (all in DRAM); puts store
//! fresh keys (eviction is part of their cost). All gets run before all puts, so puts do not
//! evict the get working set.
//!
//! The server runs as a child process (this binary's hidden `serve-child` command), so its
//! RSS is its own and clients and server do not share a runtime. Redis values are one block;
//! kvtier requests carry `--batch` blocks.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use indicatif::ProgressBar;
use kvtier_client::{Client, ClientConfig};
use kvtier_core::protocol::{PutStatus, TierCode};
use kvtier_core::{BlockKey, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::case::{
    self, CONNECT_TIMEOUT, Comparison, OP_TIMEOUT, Op, Part, Row, ServerTier, Settings, Transport,
    layout_for,
};
use super::redis::{REDIS_KEYS, Redis, Stream, resp};
use crate::report::Table;
use crate::util::{self, Budget, Bytes, Figure, Latency, fmt_f, sub_seed};

const TOKEN: &str = "kvtier-bench-token";

#[derive(Debug, Serialize)]
pub struct ServerInfo {
    pub sizes: Vec<ServerSize>,
    pub lookup: Option<LookupLatency>,
}

#[derive(Debug, Serialize)]
pub struct ServerSize {
    pub tier: ServerTier,
    pub block_bytes: u64,
    pub working_set_blocks: usize,
    pub server_dram_bytes: u64,
    pub server_peak_rss_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct LookupLatency {
    pub blocks: usize,
    /// The DRAM tier the prefix was in, in 4 KiB blocks, all of them in use.
    pub dram_blocks: usize,
    /// The lookups were a tenant's (keys mapped by the client and the server).
    pub tenants: bool,
    /// In process, on a store configured as the server child's, then over its Unix socket
    /// with 1 and with 4 clients at once, then the same request and reply bytes over a bare
    /// Unix socket pair (1 and 4 at once: the floor on this machine).
    pub cases: Vec<LookupCase>,
    /// Round trip of a ping over the same socket (the floor under any request).
    pub ping_us_p50: f64,
}

#[derive(Debug, Serialize)]
pub struct LookupCase {
    pub path: String,
    pub clients: usize,
    /// Lookups a second each client starts (one every `1 / rate`, none in flight when the
    /// next is due unless it is late); `None`: closed loop, the next as soon as one returns.
    pub rate_per_client: Option<u32>,
    pub lookups: u64,
    /// Of them, answered by the client from the published slot table (no round trip).
    pub in_place: u64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
}

impl ServerInfo {
    pub fn tables(&self) -> Vec<Table> {
        let mut t = Table::new(
            "server child",
            &[
                "tier",
                "block",
                "working set",
                "DRAM tier",
                "peak RSS",
                "RSS / DRAM",
            ],
        );
        for s in &self.sizes {
            t.row([
                s.tier.name().to_string(),
                Bytes(s.block_bytes).to_string(),
                format!("{} blocks", s.working_set_blocks),
                Bytes(s.server_dram_bytes).to_string(),
                Bytes(s.server_peak_rss_bytes).to_string(),
                format!(
                    "{:.2}",
                    s.server_peak_rss_bytes as f64 / s.server_dram_bytes.max(1) as f64
                ),
            ]);
        }
        let mut out = vec![t];
        if let Some(l) = &self.lookup {
            let mut t = Table::new(
                format!(
                    "held lookup of a cached {}-block prefix in a full DRAM tier of {} blocks{} (target over the Unix socket: p99 <= 100 us, also with 4 clients; ping p50 {} us)",
                    l.blocks,
                    l.dram_blocks,
                    if l.tenants { ", a tenant's" } else { "" },
                    fmt_f(l.ping_us_p50, 1)
                ),
                &[
                    "path", "clients", "pace", "lookups", "in place", "p50 us", "p99 us", "target",
                ],
            );
            for c in &l.cases {
                let target = if c.path == UNIX_LOOKUP {
                    let met = if c.latency_us_p99 <= 100.0 {
                        "met"
                    } else {
                        "missed"
                    };
                    format!("p99 <= 100 us: {met}")
                } else {
                    String::new()
                };
                t.row([
                    c.path.clone(),
                    c.clients.to_string(),
                    c.rate_per_client
                        .map_or("closed loop".into(), |r| format!("{r}/s a client")),
                    c.lookups.to_string(),
                    c.in_place.to_string(),
                    fmt_f(c.latency_us_p50, 1),
                    fmt_f(c.latency_us_p99, 1),
                    target,
                ]);
            }
            out.push(t);
        }
        out
    }
}

/// What the server part measured.
pub struct ServerPart {
    pub rows: Vec<Row>,
    pub comparisons: Vec<Comparison>,
    pub info: ServerInfo,
    pub notes: Vec<String>,
}

/// A server in a child process (stopped on drop).
/// `--pin-gets`: local clients read with pins, not the published slot table.
static PIN_GETS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

struct ServerChild {
    child: Child,
    unix: PathBuf,
    tcp: SocketAddr,
    quic: SocketAddr,
    dir: tempfile::TempDir,
}

impl ServerChild {
    /// A server with a DRAM tier of `dram_bytes` and, with `nvme = Some((dir, bytes))`, an
    /// NVMe tier (write-through) in `dir`.
    fn start(
        layout: &KvLayout,
        dram_bytes: u64,
        nvme: Option<(&Path, u64)>,
    ) -> Result<ServerChild> {
        Self::start_with(layout, dram_bytes, nvme, &[])
    }

    /// [`ServerChild::start`] with more `--set` lines.
    fn start_with(
        layout: &KvLayout,
        dram_bytes: u64,
        nvme: Option<(&Path, u64)>,
        extra: &[String],
    ) -> Result<ServerChild> {
        let dir = tempfile::tempdir()?;
        let nvme_sets = match nvme {
            None => vec!["store.nvme_dir=\"\"".to_string()],
            Some((d, b)) => vec![
                format!("store.nvme_dir={:?}", d.display().to_string()),
                format!("store.nvme_bytes={b}"),
                "store.demotion=\"write-through\"".to_string(),
            ],
        };
        let sets = [
            format!(
                "server.runtime_dir={:?}",
                dir.path().join("run").display().to_string()
            ),
            "server.tcp=\"127.0.0.1:0\"".into(),
            "server.quic=\"127.0.0.1:0\"".into(),
            "server.tls=\"off\"".into(),
            "server.admin=off".into(),
            format!("server.token={TOKEN:?}"),
            format!("store.dram_bytes={dram_bytes}"),
            format!("layout.layers={}", layout.num_layers()),
            format!("layout.kv_heads={}", layout.num_kv_heads()),
            format!("layout.head_dim={}", layout.head_dim()),
            format!("layout.dtype={:?}", layout.dtype().name()),
            format!("layout.block_tokens={}", layout.block_tokens()),
        ];
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("serve-child");
        for s in sets.iter().chain(&nvme_sets).chain(extra) {
            cmd.arg("--set").arg(s);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the server child")?;
        let out = child.stdout.take().context("child stdout")?;
        // Read the "listening" line on a thread, so a child that hangs cannot hang us.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(None);
                        return;
                    }
                    Ok(_) if line.starts_with("listening ") => {
                        let _ = tx.send(Some(line.clone()));
                        break;
                    }
                    Ok(_) => {}
                }
            }
            for _ in r.lines() {}
        });
        let line = match rx.recv_timeout(CONNECT_TIMEOUT) {
            Ok(Some(l)) => l,
            Ok(None) => {
                let _ = child.wait();
                bail!("the server child exited before listening");
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the server child did not listen within {CONNECT_TIMEOUT:?}");
            }
        };
        let field = |n: &str| -> Result<String> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{n}=")))
                .map(str::to_string)
                .with_context(|| format!("no {n}= in the server child's {line:?}"))
        };
        let (unix, tcp, quic) = (field("unix"), field("tcp"), field("quic"));
        let mut s = ServerChild {
            unix: PathBuf::new(),
            tcp: SocketAddr::from(([127, 0, 0, 1], 0)),
            quic: SocketAddr::from(([127, 0, 0, 1], 0)),
            child,
            dir,
        };
        // From here on, an error drops `s`, which stops the child.
        s.unix = PathBuf::from(unix?);
        s.tcp = tcp?.parse().context("the server child's tcp address")?;
        s.quic = quic?.parse().context("the server child's quic address")?;
        Ok(s)
    }

    fn peak_rss(&self) -> u64 {
        util::peak_rss_bytes(&self.child.id().to_string()).unwrap_or(0)
    }

    async fn client(&self, transport: Transport) -> Result<Client> {
        self.client_with(transport, |c| c).await
    }

    /// [`Self::client`] with its configuration changed by `tweak`.
    async fn client_with(
        &self,
        transport: Transport,
        tweak: impl FnOnce(ClientConfig) -> ClientConfig,
    ) -> Result<Client> {
        let (url, cfg) = match transport {
            Transport::Unix => (
                format!("unix://{}", self.unix.display()),
                ClientConfig::default()
                    .fast_local_gets(!PIN_GETS.load(std::sync::atomic::Ordering::Relaxed)),
            ),
            Transport::Tcp => (
                format!("tcp://{}", self.tcp),
                ClientConfig::default().token(TOKEN),
            ),
            Transport::Quic => (
                format!("quic://{}", self.quic),
                ClientConfig::default()
                    .token(TOKEN)
                    .quic_cert_der(std::fs::read(self.dir.path().join("run/quic-cert.der"))?),
            ),
        };
        let cfg = tweak(cfg.timeout(OP_TIMEOUT));
        tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(&url, cfg))
            .await
            .map_err(|_| anyhow!("connecting to {url} timed out"))?
            .with_context(|| format!("connecting to {url}"))
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which we have not waited for yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The hidden `serve-child` command: a plain server on the given settings.
pub fn serve_child(sets: &[String]) -> Result<()> {
    let mut l = kvtier_server::server::ConfigLoader::new();
    for s in sets {
        l = l.set(s)?;
    }
    let config = l.build()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let server = kvtier_server::server::Server::start(config).await?;
        let e = server.endpoints().clone();
        let show = |a: Option<SocketAddr>| a.map_or("off".into(), |a| a.to_string());
        println!(
            "listening unix={} tcp={} quic={}",
            e.unix
                .as_ref()
                .map_or("off".into(), |p| p.display().to_string()),
            show(e.tcp),
            show(e.quic)
        );
        term.recv().await;
        server.shutdown().await;
        Ok(())
    })
}

/// `n` chained keys of a seeded random prompt.
fn keys(n: usize, layout: &KvLayout, seed: u64) -> Result<Vec<BlockKey>> {
    let secret = HashSecret::development();
    let ns = NamespaceBuilder::new("bench", layout.fingerprint()).build(&secret)?;
    let mut h = PrefixHasher::new(secret, ns, layout.block_tokens())?;
    let mut rng = kvtier_core::SplitMix64::new(seed);
    let tokens: Vec<u32> = (0..n * layout.block_tokens() as usize)
        .map(|_| (rng.next_u64() % 131_072) as u32)
        .collect();
    let mut k = Vec::new();
    h.prompt_keys(&tokens, &mut k);
    Ok(k)
}

/// What [`drive`] measured.
struct Driven {
    ops: u64,
    bad: u64,
    wall: Duration,
    latency: Latency,
}

impl Driven {
    fn figure(&self, bytes_per_op: u64) -> Figure {
        Figure::new(self.ops - self.bad, bytes_per_op, self.wall, &self.latency)
    }
}

/// Runs `clients` concurrent loops of `op(client, n)`: a warm-up of a quarter of `dur` (at
/// most 0.5 s), then `dur` measured. `op` returns false for an operation that did not do its
/// work. Each operation must finish within [`OP_TIMEOUT`].
async fn drive<F, Fut>(clients: usize, dur: Duration, op: F) -> Result<Driven>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<bool>> + Send,
{
    let op = Arc::new(op);
    let warm = (dur / 4).min(Duration::from_millis(500));
    let start = Instant::now();
    let (measure_from, end) = (start + warm, start + warm + dur);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let (mut n, mut ops, mut bad, mut last) = (0u64, 0u64, 0u64, start);
            let mut lat = Latency::new();
            loop {
                let t = Instant::now();
                if t >= end {
                    break;
                }
                let ok = tokio::time::timeout(OP_TIMEOUT, op(c, n))
                    .await
                    .map_err(|_| anyhow!("an operation took over {OP_TIMEOUT:?}"))??;
                n += 1;
                if t >= measure_from {
                    last = Instant::now();
                    lat.record(last - t);
                    ops += 1;
                    bad += u64::from(!ok);
                }
            }
            Ok::<_, anyhow::Error>((ops, bad, last, lat))
        }));
    }
    let mut d = Driven {
        ops: 0,
        bad: 0,
        wall: Duration::ZERO,
        latency: Latency::new(),
    };
    let mut last = measure_from;
    for t in tasks {
        let (ops, bad, l, lat) = t.await??;
        d.ops += ops;
        d.bad += bad;
        last = last.max(l);
        d.latency.add(&lat);
    }
    d.wall = last.saturating_duration_since(measure_from);
    Ok(d)
}

/// The reference servers' payload: a working set of distinct blocks, answered `batch` at a
/// time in turn (the same bytes, and as cold in cache, as the gets').
struct WorkingSet {
    blocks: Vec<Vec<u8>>,
    batch: usize,
}

impl WorkingSet {
    fn new(block: usize, blocks: usize, batch: usize, seed: u64) -> Arc<Self> {
        Arc::new(Self {
            blocks: (0..blocks.max(batch))
                .map(|i| util::random_buf(block, sub_seed(seed, 7000 + i as u64)).to_vec())
                .collect(),
            batch,
        })
    }
    fn response(&self, n: usize) -> impl Iterator<Item = &[u8]> {
        let start = (n * self.batch) % (self.blocks.len() - self.batch + 1);
        self.blocks[start..start + self.batch]
            .iter()
            .map(|b| b.as_slice())
    }
    fn response_bytes(&self) -> usize {
        self.batch * self.blocks[0].len()
    }
}

/// One request of the raw references: `g` asks for the next response; `p` is followed by a
/// response's worth of bytes and answered with one byte.
async fn serve_raw<R, W>(mut r: R, mut w: W, ws: Arc<WorkingSet>)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut b = [0u8; 1];
    let mut sink = vec![0u8; ws.response_bytes()];
    let mut n = 0;
    'serve: while r.read_exact(&mut b).await.is_ok() {
        if b[0] == b'p' {
            if r.read_exact(&mut sink).await.is_err() || w.write_all(b"k").await.is_err() {
                break;
            }
            continue;
        }
        for part in ws.response(n) {
            if w.write_all(part).await.is_err() {
                break 'serve;
            }
        }
        n += 1;
    }
}

/// The client side of one raw request.
async fn raw_request<R, W>(r: &mut R, w: &mut W, op: Op, buf: &mut [u8]) -> Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    match op {
        Op::Get => {
            w.write_all(b"g").await?;
            r.read_exact(buf).await?;
        }
        Op::Put => {
            w.write_all(b"p").await?;
            w.write_all(buf).await?;
            let mut k = [0u8; 1];
            r.read_exact(&mut k).await?;
        }
    }
    Ok(())
}

/// Raw loopback TCP: one stream per client, the request protocol of [`serve_raw`].
async fn raw_tcp(clients: usize, ws: Arc<WorkingSet>, op: Op, dur: Duration) -> Result<Driven> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let bytes = ws.response_bytes();
    let srv = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            let (r, w) = s.into_split();
            tokio::spawn(serve_raw(r, w, ws.clone()));
        }
    });
    let mut streams = Vec::new();
    for _ in 0..clients {
        let s = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("raw TCP connect timed out"))??;
        s.set_nodelay(true)?;
        streams.push(Arc::new(tokio::sync::Mutex::new((s, vec![7u8; bytes]))));
    }
    let r = drive(clients, dur, move |c, _| {
        let s = streams[c].clone();
        async move {
            let mut g = s.lock().await;
            let (s, buf) = &mut *g;
            let (mut r, mut w) = s.split();
            raw_request(&mut r, &mut w, op, buf).await?;
            Ok(true)
        }
    })
    .await;
    srv.abort();
    r
}

/// Raw quinn: one connection and one stream per client, the client's transport settings,
/// the request protocol of [`serve_raw`].
async fn raw_quinn(clients: usize, ws: Arc<WorkingSet>, op: Op, dur: Duration) -> Result<Driven> {
    let bytes = ws.response_bytes();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    let der = ck.cert.der().to_vec();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
        ck.signing_key.serialize_der(),
    ));
    let mut sc = quinn::ServerConfig::with_single_cert(
        vec![rustls::pki_types::CertificateDer::from(der.clone())],
        key,
    )?;
    sc.transport_config(kvtier_client::quic_transport());
    let ep = quinn::Endpoint::server(sc, "127.0.0.1:0".parse()?)?;
    let addr = ep.local_addr()?;
    let srv_ep = ep.clone();
    let srv = tokio::spawn(async move {
        while let Some(inc) = srv_ep.accept().await {
            let ws = ws.clone();
            tokio::spawn(async move {
                let Ok(conn) = inc.await else { return };
                while let Ok((send, recv)) = conn.accept_bi().await {
                    tokio::spawn(serve_raw(recv, send, ws.clone()));
                }
            });
        }
    });
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(der))?;
    let mut cc = quinn::ClientConfig::with_root_certificates(Arc::new(roots))?;
    cc.transport_config(kvtier_client::quic_transport());
    let mut streams = Vec::new();
    for _ in 0..clients {
        let mut cep = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        cep.set_default_client_config(cc.clone());
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, cep.connect(addr, "localhost")?)
            .await
            .map_err(|_| anyhow!("raw quinn connect timed out"))??;
        let (send, recv) = conn.open_bi().await?;
        streams.push(Arc::new(tokio::sync::Mutex::new((
            send,
            recv,
            vec![7u8; bytes],
            cep,
            conn,
        ))));
    }
    let r = drive(clients, dur, move |c, _| {
        let s = streams[c].clone();
        async move {
            let mut g = s.lock().await;
            let (send, recv, buf, _, _) = &mut *g;
            raw_request(recv, send, op, buf).await?;
            Ok(true)
        }
    })
    .await;
    srv.abort();
    ep.close(0u32.into(), b"done");
    r
}

/// Redis GET (or SET) of `block`-byte values, `clients` connections, over its Unix socket or
/// TCP. GETs cycle through [`REDIS_KEYS`] keys set beforehand.
async fn redis_case(
    r: &Redis,
    unix: bool,
    clients: usize,
    block: usize,
    op: Op,
    dur: Duration,
    seed: u64,
) -> Result<Driven> {
    type Conn = Arc<tokio::sync::Mutex<(Box<dyn Stream>, Vec<u8>)>>;
    let mut conns: Vec<Conn> = Vec::new();
    for _ in 0..clients {
        let s = r.connect(unix).await?;
        let v = util::random_buf(block, sub_seed(seed, 9000)).to_vec();
        conns.push(Arc::new(tokio::sync::Mutex::new((s, v))));
    }
    {
        let mut g = conns[0].lock().await;
        let (s, v) = &mut *g;
        for i in 0..REDIS_KEYS {
            let k = format!("{}{i}", r.prefix);
            tokio::time::timeout(
                OP_TIMEOUT,
                resp(s.as_mut(), &[b"SET", k.as_bytes(), v], &mut []),
            )
            .await
            .map_err(|_| anyhow!("redis SET timed out"))??;
        }
    }
    let prefix = r.prefix.clone();
    drive(clients, dur, move |c, n| {
        let s = conns[c].clone();
        let key = format!("{prefix}{}", (n + c as u64) % REDIS_KEYS);
        async move {
            let mut g = s.lock().await;
            let (s, buf) = &mut *g;
            match op {
                Op::Get => resp(s.as_mut(), &[b"GET", key.as_bytes()], buf).await?,
                Op::Put => resp(s.as_mut(), &[b"SET", key.as_bytes(), buf], &mut []).await?,
            }
            Ok(true)
        }
    })
    .await
}

/// Timed steps of the server part (for the progress bar).
pub fn steps(s: &Settings, redis: Option<&Redis>) -> u64 {
    let redis_unix = redis.is_some_and(|r| r.unix.is_some());
    let redis_tcp = redis.is_some_and(|r| r.tcp.is_some());
    let per_clients: u64 = s
        .transports
        .iter()
        .map(|t| match t {
            Transport::Unix => 1 + u64::from(redis_unix),
            Transport::Tcp => 2 + u64::from(redis_tcp),
            Transport::Quic => 2,
        })
        .sum();
    let clients = s.clients.len() as u64;
    let mut per_size = 0;
    if s.server_tiers.contains(&ServerTier::Dram) {
        per_size += 1 + 2 + 2 * per_clients * clients;
    }
    if s.server_tiers.contains(&ServerTier::Nvme) {
        // Fill; per client count the O_DIRECT references (3 steps); per transport, get and put.
        per_size += 1 + clients * (3 + 2 * s.transports.len() as u64);
    }
    per_size * s.sizes.len() as u64 + u64::from(s.lookup_blocks > 0)
}

/// Runs the server part for every block size.
pub fn measure(s: &Settings, redis: Option<&Redis>, bar: &ProgressBar) -> Result<ServerPart> {
    PIN_GETS.store(s.pin_gets, std::sync::atomic::Ordering::Relaxed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut part = ServerPart {
        rows: Vec::new(),
        comparisons: Vec::new(),
        info: ServerInfo {
            sizes: Vec::new(),
            lookup: None,
        },
        notes: Vec::new(),
    };
    if redis.is_some_and(|r| r.unix.is_none()) && s.transports.contains(&Transport::Unix) {
        part.notes.push(
            "redis has no Unix socket here (--redis tcp://...): unix has no Redis reference".into(),
        );
    }
    if redis.is_some_and(|r| r.tcp.is_none()) && s.transports.contains(&Transport::Tcp) {
        part.notes.push(
            "redis has no TCP endpoint here (--redis unix://...): tcp has no Redis reference"
                .into(),
        );
    }
    for &block in &s.sizes {
        for &tier in &s.server_tiers {
            let size = match tier {
                ServerTier::Dram => measure_size(s, &rt, redis, bar, block, &mut part),
                ServerTier::Nvme => measure_nvme(s, &rt, bar, block, &mut part),
            }
            .with_context(|| {
                format!("server part, {} tier, {} blocks", tier.name(), Bytes(block))
            })?;
            part.info.sizes.push(size);
        }
    }
    if s.lookup_blocks > 0 {
        bar.set_message(format!("lookup of {} blocks over unix", s.lookup_blocks));
        part.info.lookup =
            Some(lookup_latency(s, &rt).context("lookup latency over the Unix socket")?);
        bar.inc(1);
    }
    Ok(part)
}

fn measure_size(
    s: &Settings,
    rt: &tokio::runtime::Runtime,
    redis: Option<&Redis>,
    bar: &ProgressBar,
    block_bytes: u64,
    part: &mut ServerPart,
) -> Result<ServerSize> {
    let layout = layout_for(block_bytes)?;
    let block = usize::try_from(block_bytes)?;
    let blocks = s.blocks_for(block_bytes);
    let batch = s.batch;
    let dur = s.case_time();
    let seed = s.seed;
    let sz = Bytes(block_bytes);
    // Room for the working set, every client's puts in flight, and some slack.
    let max_clients = s.clients.iter().copied().max().unwrap_or(1);
    let dram = (blocks + max_clients * batch + 16) as u64 * block_bytes;
    let srv = ServerChild::start(&layout, dram, None)?;
    let keys = Arc::new(keys(blocks, &layout, sub_seed(seed, 1))?);
    let ws = WorkingSet::new(block, blocks, batch, seed);

    bar.set_message(format!("{sz}: filling the server"));
    fill(rt, &srv, &keys, &ws, 16)?;
    bar.inc(1);

    // memcpy of the same blocks over the same working set, one thread, both directions.
    let memcpy = |op: Op| -> Result<Figure> {
        let b = Budget::Time {
            warm: (dur / 4).min(Duration::from_millis(500)),
            run: dur,
        };
        let p = util::phase(
            1,
            &b,
            |_| {
                // Puts copy into a region as large as the working set (the set itself is
                // shared with the reference servers).
                let region: Vec<Vec<u8>> = match op {
                    Op::Get => Vec::new(),
                    Op::Put => (0..ws.blocks.len()).map(|_| vec![1u8; block]).collect(),
                };
                let bufs = vec![util::random_buf(block, sub_seed(seed, 8000)).to_vec(); batch];
                Ok((region, bufs))
            },
            |(region, bufs), _, i| {
                for (k, b) in bufs.iter_mut().enumerate() {
                    let j = (i as usize * batch + k) % ws.blocks.len();
                    match op {
                        Op::Get => {
                            b.copy_from_slice(&ws.blocks[j]);
                            std::hint::black_box(b.as_ptr());
                        }
                        Op::Put => {
                            region[j].copy_from_slice(b);
                            std::hint::black_box(region[j].as_ptr());
                        }
                    }
                }
                Ok(true)
            },
        )?;
        Ok(p.figure((block * batch) as u64))
    };
    bar.set_message(format!("{sz}: memcpy (server working set)"));
    let memcpy_get = memcpy(Op::Get)?;
    bar.inc(1);
    let memcpy_put = memcpy(Op::Put)?;
    bar.inc(1);
    let memcpy_name = format!("memcpy ({blocks}-block working set)");

    for op in [Op::Get, Op::Put] {
        for &t in &s.transports {
            for &clients in &s.clients {
                bar.set_message(format!(
                    "{sz}: kvtier {} {} x{clients}",
                    t.name(),
                    op.name()
                ));
                let (d, _) =
                    rt.block_on(kvtier_case(&srv, t, clients, op, &keys, &ws, dur, seed))?;
                bar.inc(1);
                let path = kvtier_path(ServerTier::Dram, t);
                let kv = Row::new(Part::Server, &path, true, op, block_bytes, clients)
                    .with(d.figure((block * batch) as u64), d.bad);
                if d.bad > 0 {
                    part.notes.push(format!(
                        "{path} {} x{clients}, {sz}: {} of {} requests did not complete (not counted)",
                        op.name(),
                        d.bad,
                        d.ops
                    ));
                }
                // (reference row, target ratio) pairs.
                let mut refs: Vec<(Row, Option<f64>)> = Vec::new();
                let bytes = (block * batch) as u64;
                match t {
                    Transport::Unix => {
                        let f = if op == Op::Get {
                            &memcpy_get
                        } else {
                            &memcpy_put
                        };
                        let target = (op == Op::Get).then_some(0.8);
                        refs.push((
                            Row::new(Part::Server, &memcpy_name, false, op, block_bytes, 1)
                                .with(f.clone(), 0),
                            target,
                        ));
                    }
                    Transport::Tcp => {
                        bar.set_message(format!("{sz}: raw loopback TCP {} x{clients}", op.name()));
                        let d = rt.block_on(raw_tcp(clients, ws.clone(), op, dur))?;
                        bar.inc(1);
                        refs.push((
                            Row::new(
                                Part::Server,
                                "raw loopback TCP",
                                false,
                                op,
                                block_bytes,
                                clients,
                            )
                            .with(d.figure(bytes), 0),
                            (op == Op::Get).then_some(0.8),
                        ));
                    }
                    Transport::Quic => {
                        bar.set_message(format!("{sz}: raw quinn {} x{clients}", op.name()));
                        let d = rt.block_on(raw_quinn(clients, ws.clone(), op, dur))?;
                        bar.inc(1);
                        refs.push((
                            Row::new(Part::Server, "raw quinn", false, op, block_bytes, clients)
                                .with(d.figure(bytes), 0),
                            (op == Op::Get).then_some(0.8),
                        ));
                    }
                }
                let over_unix = t == Transport::Unix;
                let has = |r: &&Redis| {
                    if over_unix {
                        r.unix.is_some()
                    } else {
                        r.tcp.is_some()
                    }
                };
                if let (Some(r), true) = (redis.filter(has), t != Transport::Quic) {
                    let name = if over_unix {
                        "redis (unix socket)"
                    } else {
                        "redis (tcp)"
                    };
                    bar.set_message(format!("{sz}: {name} {} x{clients}", op.name()));
                    let d = rt.block_on(redis_case(r, over_unix, clients, block, op, dur, seed))?;
                    bar.inc(1);
                    let target = match (op, t) {
                        (Op::Get, Transport::Unix) => Some(1.8),
                        (Op::Get, Transport::Tcp) => Some(1.0),
                        _ => None,
                    };
                    refs.push((
                        Row::new(Part::Server, name, false, op, block_bytes, clients)
                            .with(d.figure(block_bytes), 0),
                        target,
                    ));
                }
                for (r, target) in refs {
                    part.comparisons.push(Comparison::of(&kv, &r, target));
                    // memcpy appears once per size and op, not once per transport x clients.
                    if !part.rows.iter().any(|x| {
                        x.path == r.path
                            && x.op == r.op
                            && x.block_bytes == r.block_bytes
                            && x.threads == r.threads
                    }) {
                        part.rows.push(r);
                    }
                }
                part.rows.push(kv);
            }
        }
    }
    let rss = srv.peak_rss();
    drop(srv);
    Ok(ServerSize {
        tier: ServerTier::Dram,
        block_bytes,
        working_set_blocks: blocks,
        server_dram_bytes: dram,
        server_peak_rss_bytes: rss,
    })
}

/// Stores the working set through the local path, `chunk` blocks a request. A chunk the
/// server could not take whole (no free DRAM slot while earlier blocks are still being
/// written through to NVMe) is retried from its first missing block for up to
/// [`OP_TIMEOUT`].
fn fill(
    rt: &tokio::runtime::Runtime,
    srv: &ServerChild,
    keys: &[BlockKey],
    ws: &WorkingSet,
    chunk: usize,
) -> Result<()> {
    let chunk = chunk.max(1);
    rt.block_on(async {
        let c = srv.client(Transport::Unix).await?;
        let mut at = 0;
        let mut since = Instant::now();
        while at < keys.len() {
            let end = (at + chunk).min(keys.len());
            let refs: Vec<&[u8]> = (at..end)
                .map(|i| ws.blocks[i % ws.blocks.len()].as_slice())
                .collect();
            let parent = at.checked_sub(1).map(|p| keys[p]);
            let st = tokio::time::timeout(OP_TIMEOUT, c.put_chain(&keys[at..end], parent, &refs))
                .await
                .map_err(|_| anyhow!("a put took over {OP_TIMEOUT:?}"))?;
            let done = st
                .statuses
                .iter()
                .take_while(|s| matches!(s, PutStatus::Stored | PutStatus::AlreadyPresent))
                .count();
            if done > 0 {
                at += done;
                since = Instant::now();
            } else if since.elapsed() > OP_TIMEOUT {
                bail!("the server refused blocks while filling for {OP_TIMEOUT:?}: {st:?}");
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Ok::<_, anyhow::Error>(())
    })
}

fn kvtier_path(tier: ServerTier, t: Transport) -> String {
    let how = match t {
        Transport::Unix => "unix zero-copy",
        Transport::Tcp => "tcp",
        Transport::Quic => "quic",
    };
    format!("kvtier {}, {how}", tier.name())
}

/// The NVMe tier through the sidecar: a DRAM tier of a few blocks over an NVMe tier (in the
/// bench directory, write-through) holding the working set, so gets read NVMe (and promote)
/// and puts write through to NVMe. Reference: O_DIRECT pread / pwrite of the same block size
/// in the same directory, one thread per client.
fn measure_nvme(
    s: &Settings,
    rt: &tokio::runtime::Runtime,
    bar: &ProgressBar,
    block_bytes: u64,
    part: &mut ServerPart,
) -> Result<ServerSize> {
    let layout = layout_for(block_bytes)?;
    let block = usize::try_from(block_bytes)?;
    let batch = s.batch;
    let dur = s.case_time();
    let seed = s.seed;
    let sz = Bytes(block_bytes);
    let max_clients = s.clients.iter().copied().max().unwrap_or(1);
    // DRAM: room for every client's blocks in flight (pins, reservations), little more.
    let dram_slots = 4 * max_clients * batch + 8;
    let dram = dram_slots as u64 * block_bytes;
    // A working set at least 4x the DRAM tier, so gets cycling through it miss DRAM.
    let blocks = s.blocks_for(block_bytes).max(4 * dram_slots);
    // NVMe: the working set, the puts of a run, slack; each slot has a 4 KiB header.
    let nvme = (2 * blocks + 64) as u64 * (block_bytes + 4096);
    let base = case::base_dir(s.dir.as_deref())?;
    let work = tempfile::Builder::new()
        .prefix("kvtier-bench-server-")
        .tempdir_in(&base)
        .with_context(|| format!("{} is not writable", base.display()))?;
    let free = util::free_bytes(work.path())?;
    if nvme + blocks as u64 * block_bytes > free / 10 * 9 {
        bail!(
            "the NVMe server case needs {} in {} ({} free); lower --blocks or use --server-tiers dram",
            Bytes(nvme + blocks as u64 * block_bytes),
            base.display(),
            Bytes(free)
        );
    }
    let srv = ServerChild::start(&layout, dram, Some((work.path(), nvme)))?;
    let keys = Arc::new(keys(blocks, &layout, sub_seed(seed, 3))?);
    let ws = WorkingSet::new(block, blocks, batch, sub_seed(seed, 4));
    bar.set_message(format!("{sz}: filling the server's NVMe tier"));
    fill(rt, &srv, &keys, &ws, max_clients * batch)?;
    bar.inc(1);
    let budget = Budget::Time {
        warm: (dur / 4).min(Duration::from_millis(500)),
        run: dur,
    };
    // The references first, per client count (pread for gets, pwrite for puts).
    let mut references: Vec<(usize, Row, Row)> = Vec::new();
    for &clients in &s.clients {
        let per = (blocks as u64 / clients as u64).max(1);
        let (w, r, direct) = case::direct_io_reference(
            work.path(),
            block_bytes,
            clients,
            per,
            &budget,
            sub_seed(seed, 5),
            bar,
        )?;
        let io = if direct { "O_DIRECT" } else { "buffered" };
        let row = |op: Op, name: String, p: &util::Phase| {
            Row::new(Part::Server, &name, false, op, block_bytes, clients)
                .with(p.figure(block_bytes), 0)
        };
        references.push((
            clients,
            row(Op::Get, format!("{io} pread"), &r),
            row(Op::Put, format!("{io} pwrite"), &w),
        ));
    }
    // All gets before all puts: the puts' fresh keys evict working-set blocks from NVMe.
    for op in [Op::Get, Op::Put] {
        for (clients, get_ref, put_ref) in &references {
            let clients = *clients;
            let reference = if op == Op::Get { get_ref } else { put_ref };
            for &t in &s.transports {
                let path = kvtier_path(ServerTier::Nvme, t);
                bar.set_message(format!("{sz}: {path} {} x{clients}", op.name()));
                let (d, from_nvme) =
                    rt.block_on(kvtier_case(&srv, t, clients, op, &keys, &ws, dur, seed))?;
                bar.inc(1);
                let kv = Row::new(Part::Server, &path, true, op, block_bytes, clients)
                    .with(d.figure((block * batch) as u64), d.bad);
                if op == Op::Get {
                    part.notes.push(format!(
                        "{path} get x{clients}, {sz}: {:.0} % of the blocks came from NVMe",
                        100.0 * from_nvme
                    ));
                }
                if d.bad > 0 {
                    part.notes.push(format!(
                        "{path} {} x{clients}, {sz}: {} of {} requests did not complete (not counted)",
                        op.name(),
                        d.bad,
                        d.ops
                    ));
                }
                let target = (t == Transport::Unix).then_some(0.8);
                part.comparisons
                    .push(Comparison::of(&kv, reference, target));
                part.rows.push(kv);
            }
            part.rows.push(reference.clone());
        }
    }
    let rss = srv.peak_rss();
    drop(srv);
    let shown = work.path().display().to_string();
    work.close().with_context(|| format!("removing {shown}"))?;
    Ok(ServerSize {
        tier: ServerTier::Nvme,
        block_bytes,
        working_set_blocks: blocks,
        server_dram_bytes: dram,
        server_peak_rss_bytes: rss,
    })
}

/// kvtier gets (of the working set, `batch` keys a request) or puts (of fresh keys) through
/// `clients` connections over `t`; also returns the fraction of the blocks got that came
/// from NVMe.
#[allow(clippy::too_many_arguments)]
async fn kvtier_case(
    srv: &ServerChild,
    t: Transport,
    clients: usize,
    op: Op,
    keys: &Arc<Vec<BlockKey>>,
    ws: &Arc<WorkingSet>,
    dur: Duration,
    seed: u64,
) -> Result<(Driven, f64)> {
    let batch = ws.batch;
    // Blocks got (warm-up included), and how many of them came from NVMe.
    let from_nvme = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let counter = from_nvme.clone();
    let block = ws.blocks[0].len();
    let mut conns = Vec::new();
    for _ in 0..clients {
        conns.push(Arc::new(tokio::sync::Mutex::new((
            srv.client(t).await?,
            vec![vec![0u8; block]; batch],
        ))));
    }
    let (k, ws) = (keys.clone(), ws.clone());
    // Fresh put keys: a stream of the seed per transport and op, numbered by client and op.
    let put_base = u128::from(sub_seed(seed, 0x7075_7400 + t as u64)) << 64;
    let d = drive(clients, dur, move |c, n| {
        let conn = conns[c].clone();
        let (k, ws) = (k.clone(), ws.clone());
        let counter = counter.clone();
        async move {
            let mut g = conn.lock().await;
            let (client, bufs) = &mut *g;
            match op {
                Op::Get => {
                    let start = (n as usize * batch + c * 7) % (k.len() - batch + 1).max(1);
                    let want = &k[start..start + batch.min(k.len())];
                    let mut dst: Vec<&mut [u8]> =
                        bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                    let f = client.get_into(want, &mut dst).await;
                    if f.blocks != want.len() {
                        bail!(
                            "get returned {} of {} blocks: {:?}",
                            f.blocks,
                            want.len(),
                            f.miss
                        );
                    }
                    let nvme = f.tiers.iter().filter(|t| **t == TierCode::Nvme).count();
                    counter[0].fetch_add(f.blocks as u64, Ordering::Relaxed);
                    counter[1].fetch_add(nvme as u64, Ordering::Relaxed);
                    Ok(true)
                }
                Op::Put => {
                    let fresh: Vec<BlockKey> = (0..batch as u128)
                        .map(|i| {
                            BlockKey::from_u128(
                                put_base
                                    | ((c as u128) << 48)
                                    | (u128::from(n) * batch as u128 + i),
                            )
                        })
                        .collect();
                    let refs: Vec<&[u8]> = ws.response(n as usize).collect();
                    let st = client.put_chain(&fresh, None, &refs).await;
                    if let Some(m) = &st.failure {
                        bail!("put failed: {m:?}");
                    }
                    Ok(st.cached() == fresh.len())
                }
            }
        }
    })
    .await?;
    let (got, nvme) = (
        from_nvme[0].load(Ordering::Relaxed),
        from_nvme[1].load(Ordering::Relaxed),
    );
    Ok((d, nvme as f64 / got.max(1) as f64))
}

/// The row name of the Unix-socket lookups (the ones the target is for), as a client makes
/// them by default: a prefix the published slot table names in DRAM is answered from it,
/// and the lookup goes to the server one way (`ClientConfig::fast_local_lookups`).
const UNIX_LOOKUP: &str = "unix socket";
/// The same with `fast_local_lookups` off: a round trip each, the server's answer.
const UNIX_LOOKUP_ROUND_TRIP: &str = "unix socket, a round trip each";
/// The row name of the bare-socket reference (the same bytes, no server).
const RAW_UNIX: &str = "raw unix socket, same bytes";

/// Hold budget of the lookup cases: room for every hold the clients' connections keep (up to
/// 64 each), as on a server whose DRAM is large against one prompt; with the default (a
/// quarter of this small DRAM tier) a 4,096-block lookup would be refused its hold and hold
/// nothing, the cheaper path.
const LOOKUP_HOLD_BUDGET: u64 = 1 << 22;

/// Concurrent clients of the second Unix-socket case.
const LOOKUP_CLIENTS: usize = 4;

/// Lookups a second a client in the paced cases: far more than an engine's scheduler makes
/// (one per new request), and below what the server's lookup work allows (about 10,000 a
/// second of 4,096 keys here), so that the figure is the latency, not a queue. A closed
/// loop of one-way lookups measures the queue: each client sends them as fast as it
/// answers them, faster than the server takes them.
const LOOKUP_PACE: u32 = 1000;

/// Bytes of a block in the lookup case: a lookup's cost does not depend on it, and small
/// blocks let a DRAM tier with as many slots as a server's fit this machine.
const LOOKUP_BLOCK_BYTES: u64 = 4096;

/// Blocks the DRAM tier of the lookup case holds besides the filler and the prefix.
const LOOKUP_SPARE_BLOCKS: usize = 64;

/// Lookup latency of a cached prefix of `lookup_blocks` blocks in a DRAM tier of
/// `lookup_dram_blocks`, the rest of it filled first (as a server's DRAM is in use): in
/// process (a held lookup and its release, on a store configured as the server child),
/// then over the Unix socket with 1 and with [`LOOKUP_CLIENTS`] clients at once.
fn lookup_latency(s: &Settings, rt: &tokio::runtime::Runtime) -> Result<LookupLatency> {
    let small = layout_for(LOOKUP_BLOCK_BYTES)?;
    let dram = s.lookup_dram_blocks as u64 * LOOKUP_BLOCK_BYTES;
    let k = keys(s.lookup_blocks, &small, sub_seed(s.seed, 2))?;
    // Distinct chains of 256 blocks, as many as fill DRAM but for the prefix and a margin.
    let fill_blocks = s
        .lookup_dram_blocks
        .saturating_sub(s.lookup_blocks + LOOKUP_SPARE_BLOCKS);
    let filler: Vec<Vec<BlockKey>> = (0..fill_blocks.div_ceil(256))
        .map(|i| {
            let n = (fill_blocks - i * 256).min(256);
            keys(n, &small, sub_seed(s.seed, 1000 + i as u64))
        })
        .collect::<Result<_>>()?;
    let mut cases = vec![lookup_in_process(s, &small, dram, &filler, &k)?];
    let mut sets = vec![format!("store.lookup_hold_max_blocks={LOOKUP_HOLD_BUDGET}")];
    if s.lookup_tenants {
        sets.extend([
            "server.token=\"\"".into(),
            "tenants.engine={ unix = true, local_arena = true }".into(),
        ]);
    }
    let srv = ServerChild::start_with(&small, dram, None, &sets)?;
    rt.block_on(async {
        let c = srv.client(Transport::Unix).await?;
        let zero = vec![0u8; LOOKUP_BLOCK_BYTES as usize];
        for chain in filler.iter().chain([&k]) {
            for (n, chunk) in chain.chunks(256).enumerate() {
                let refs: Vec<&[u8]> = chunk.iter().map(|_| zero.as_slice()).collect();
                let parent = (n * 256).checked_sub(1).map(|p| chain[p]);
                let st = tokio::time::timeout(OP_TIMEOUT, c.put_chain(chunk, parent, &refs))
                    .await
                    .map_err(|_| anyhow!("a put took over {OP_TIMEOUT:?}"))?;
                if st.cached() != chunk.len() {
                    bail!(
                        "the lookup case's DRAM took {} of {} blocks",
                        st.cached(),
                        chunk.len()
                    );
                }
            }
        }
        if c.lookup(&k).await.tiers.len() != k.len() {
            bail!("the lookup prefix is not fully cached");
        }
        let k = Arc::new(k);
        let paths = [(UNIX_LOOKUP, true), (UNIX_LOOKUP_ROUND_TRIP, false)];
        let paces = [None, Some(LOOKUP_PACE)];
        for ((path, in_place), (clients, rate)) in paths
            .into_iter()
            .flat_map(|p| paces.into_iter().map(move |r| (p, r)))
            .flat_map(|(p, r)| [1, LOOKUP_CLIENTS].map(|c| (p, (c, r))))
        {
            {
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..clients {
                    let c = srv
                        .client_with(Transport::Unix, |c| c.fast_local_lookups(in_place))
                        .await?;
                    let (k, time) = (k.clone(), s.case_time());
                    tasks.spawn(async move {
                        let lat = timed_lookups(&c, &k, time, rate).await?;
                        // In place where the switch is on and the server is not behind
                        // (the client's flow control); never with it off.
                        let fast = c.fast_lookups();
                        if !in_place && fast > 0 {
                            bail!("{fast} lookups answered in place with the switch off");
                        }
                        anyhow::Ok((lat, fast))
                    });
                }
                let (mut lat, mut fast) = (Latency::new(), 0);
                while let Some(r) = tasks.join_next().await {
                    let (l, f) = r.context("a lookup client panicked")??;
                    lat.add(&l);
                    fast += f;
                }
                if in_place && fast == 0 {
                    bail!("no lookup was answered in place");
                }
                cases.push(LookupCase {
                    path: path.into(),
                    clients,
                    rate_per_client: rate,
                    lookups: lat.count(),
                    in_place: fast,
                    latency_us_p50: lat.quantile_us(0.5),
                    latency_us_p99: lat.quantile_us(0.99),
                });
            }
        }
        let mut pings = Latency::new();
        for _ in 0..2000 {
            pings.record(c.ping().await?);
        }
        // The physical reference: the same request and reply bytes over a bare socket.
        let (req, reply) = lookup_frame_bytes(&k);
        for clients in [1, LOOKUP_CLIENTS] {
            let lat = raw_unix_round_trips(req, reply, clients, s.case_time())?;
            cases.push(LookupCase {
                path: RAW_UNIX.into(),
                clients,
                rate_per_client: None,
                lookups: lat.count(),
                in_place: 0,
                latency_us_p50: lat.quantile_us(0.5),
                latency_us_p99: lat.quantile_us(0.99),
            });
        }
        Ok(LookupLatency {
            blocks: s.lookup_blocks,
            dram_blocks: s.lookup_dram_blocks,
            tenants: s.lookup_tenants,
            cases,
            ping_us_p50: pings.quantile_us(0.5),
        })
    })
}

/// Bytes of a lookup of `keys` on the wire (header and metadata) and of its reply when all
/// are cached (one tier byte a key).
fn lookup_frame_bytes(keys: &[BlockKey]) -> (usize, usize) {
    use kvtier_core::protocol::{HEADER_BYTES, KeyList, Request, Response};
    let req = Request::Lookup(KeyList {
        keys: keys.to_vec(),
    })
    .encode_meta()
    .len();
    // Version 4's form, as a current client gets it (no sources: all local).
    let reply = Response::Lookup {
        tiers: vec![TierCode::Dram as u8; keys.len()],
        miss: 0,
        sources: Some(vec![]),
    }
    .encode_meta()
    .1
    .len();
    (HEADER_BYTES + req, HEADER_BYTES + reply)
}

/// Round trips of `req` bytes out and `reply` bytes back over a bare Unix stream socket
/// pair, `clients` pairs at once, each end a thread blocking in read and write (no runtime,
/// no frame parsing, no lookup): the floor under a lookup over the Unix socket on this
/// machine. Threads of one process, which the kernel's socket path treats as it treats two
/// processes.
fn raw_unix_round_trips(
    req: usize,
    reply: usize,
    clients: usize,
    time: Duration,
) -> Result<Latency> {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let mut ends = Vec::new();
    for _ in 0..clients {
        let (c, srv) = UnixStream::pair().context("a Unix socket pair")?;
        for s in [&c, &srv] {
            s.set_read_timeout(Some(OP_TIMEOUT))?;
            s.set_write_timeout(Some(OP_TIMEOUT))?;
        }
        // The echoing end: reads a request, writes a reply, until the client end closes.
        let echo = std::thread::spawn(move || -> std::io::Result<()> {
            let mut srv = srv;
            let (mut inb, out) = (vec![0u8; req], vec![1u8; reply]);
            loop {
                match srv.read_exact(&mut inb) {
                    Ok(()) => srv.write_all(&out)?,
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
        });
        ends.push((c, echo));
    }
    let mut lat = Latency::new();
    let clients: Vec<_> = ends
        .into_iter()
        .map(|(c, echo)| {
            let client = std::thread::spawn(move || -> std::io::Result<Latency> {
                let mut c = c;
                let (out, mut inb) = (vec![2u8; req], vec![0u8; reply]);
                let mut lat = Latency::new();
                let t0 = Instant::now();
                while t0.elapsed() < time || lat.count() < 10 {
                    let t = Instant::now();
                    c.write_all(&out)?;
                    c.read_exact(&mut inb)?;
                    lat.record(t.elapsed());
                }
                Ok(lat)
            });
            (client, echo)
        })
        .collect();
    for (client, echo) in clients {
        let l = client
            .join()
            .map_err(|_| anyhow!("a raw socket client panicked"))?
            .context("a raw socket round trip")?;
        lat.add(&l);
        echo.join()
            .map_err(|_| anyhow!("a raw socket echo panicked"))?
            .context("a raw socket echo")?;
    }
    Ok(lat)
}

/// Lookups of all of `keys` on one connection for `time` (and at least 10).
async fn timed_lookups(
    c: &Client,
    keys: &[BlockKey],
    time: Duration,
    rate: Option<u32>,
) -> Result<Latency> {
    let mut lat = Latency::new();
    let mut tick = rate.map(|r| {
        let mut i = tokio::time::interval(Duration::from_secs(1) / r);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let t0 = Instant::now();
    while t0.elapsed() < time || lat.count() < 10 {
        if let Some(i) = tick.as_mut() {
            i.tick().await;
        }
        // From the lookup's own start: the tick's lateness (the timer's 1 ms grain) is not
        // the lookup's.
        let t = Instant::now();
        let l = tokio::time::timeout(OP_TIMEOUT, c.lookup(keys))
            .await
            .map_err(|_| anyhow!("a lookup took over {OP_TIMEOUT:?}"))?;
        lat.record(t.elapsed());
        if l.tiers.len() != keys.len() {
            bail!("lookup lost blocks: {:?}", l.miss);
        }
    }
    Ok(lat)
}

/// The in-process figure: a held lookup of `keys` and its release, on a store with the
/// server child's layout, DRAM and hold budget (the server's lookup minus the socket).
fn lookup_in_process(
    s: &Settings,
    layout: &KvLayout,
    dram: u64,
    filler: &[Vec<BlockKey>],
    keys: &[BlockKey],
) -> Result<LookupCase> {
    let mut config = kvtier_server::StoreConfig::new(*layout, dram);
    config.dram_prefault = false;
    config.lookup_hold_max_blocks = LOOKUP_HOLD_BUDGET;
    let (store, _) = kvtier_server::TieredStore::open(config)?;
    let payload = vec![0u8; store.block_bytes()];
    for chain in filler.iter().map(Vec::as_slice).chain([keys]) {
        for (i, k) in chain.iter().enumerate() {
            store.put(*k, i.checked_sub(1).map(|p| chain[p]), &payload)?;
        }
    }
    let mut lat = Latency::new();
    let t0 = Instant::now();
    while t0.elapsed() < s.case_time() || lat.count() < 10 {
        let t = Instant::now();
        let (tiers, hold) = store.lookup_held(keys);
        if let kvtier_server::LookupHold::Held { lease_id, .. } = hold {
            store.release(lease_id);
        } else {
            bail!("the in-process lookup held nothing: {hold:?}");
        }
        lat.record(t.elapsed());
        if tiers.len() != keys.len() {
            bail!("the in-process prefix is not fully cached");
        }
    }
    Ok(LookupCase {
        path: "in process".into(),
        clients: 1,
        rate_per_client: None,
        in_place: 0,
        lookups: lat.count(),
        latency_us_p50: lat.quantile_us(0.5),
        latency_us_p99: lat.quantile_us(0.99),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_set_cycles_through_distinct_blocks() {
        let ws = WorkingSet::new(4096, 4, 2, 1);
        assert_eq!(ws.response_bytes(), 8192);
        let first: Vec<&[u8]> = ws.response(0).collect();
        let second: Vec<&[u8]> = ws.response(1).collect();
        assert_ne!(first[0], second[0]);
        assert_ne!(first[0], first[1]);
    }

    /// The raw references' protocol, both directions, over an in-memory pipe.
    #[test]
    fn raw_protocol_round_trips() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ws = WorkingSet::new(4096, 2, 1, 3);
            let (a, b) = tokio::io::duplex(1 << 16);
            let (sr, sw) = tokio::io::split(b);
            let srv = tokio::spawn(serve_raw(sr, sw, ws.clone()));
            let (mut r, mut w) = tokio::io::split(a);
            let mut buf = vec![0u8; 4096];
            raw_request(&mut r, &mut w, Op::Get, &mut buf)
                .await
                .unwrap();
            assert_eq!(buf, ws.blocks[0]);
            raw_request(&mut r, &mut w, Op::Put, &mut buf)
                .await
                .unwrap();
            raw_request(&mut r, &mut w, Op::Get, &mut buf)
                .await
                .unwrap();
            assert_eq!(buf, ws.blocks[1]);
            drop((r, w));
            tokio::time::timeout(Duration::from_secs(5), srv)
                .await
                .unwrap()
                .unwrap();
        });
    }

    #[test]
    fn drive_counts_and_times_operations() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let d = rt
            .block_on(drive(3, Duration::from_millis(40), |c, n| async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Ok(c != 0 || n % 2 == 0)
            }))
            .unwrap();
        assert!(d.ops >= 3, "{}", d.ops);
        assert_eq!(d.latency.count(), d.ops);
        assert!(d.bad > 0 && d.bad < d.ops);
        assert!(d.wall >= Duration::from_millis(30), "{:?}", d.wall);
        assert!(d.latency.quantile_us(0.5) >= 1000.0);
        // A long window: the failing op returns at once, so this ends at the first op, which
        // runs even when the machine is too loaded to start the task within a short window.
        let e = rt.block_on(drive(1, Duration::from_secs(30), |_, _| async {
            bail!("boom")
        }));
        assert!(e.is_err());
    }
}

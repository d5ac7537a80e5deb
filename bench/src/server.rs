//! `kvtier-bench server`: the sidecar over its transports against the references measured in
//! the same run: memcpy (local zero-copy path), raw loopback TCP streams, Redis (over its
//! Unix socket and TCP, when `redis-server` is installed), a raw quinn stream (QUIC); lookup
//! latency of a long prefix over the Unix socket; the server's peak RSS.
//!
//! The server runs as a child process (this binary's hidden `serve-child` command), so its
//! RSS is its own and clients and server do not share a runtime.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_client::{Client, ClientConfig};
use kvtier_core::{BlockKey, Dtype, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::util::{Bytes, parse_size};

#[derive(Args, Debug)]
pub struct ServerArgs {
    /// Block (and Redis value) size: a multiple of 64 KiB.
    #[arg(long, default_value = "2m", value_parser = parse_size)]
    pub block_size: u64,
    /// Client counts to run every transport at (comma separated).
    #[arg(long, default_value = "1,4", value_delimiter = ',')]
    pub clients: Vec<usize>,
    /// Blocks per get request.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Distinct blocks the clients cycle through (the working set, all in DRAM).
    #[arg(long, default_value_t = 128)]
    pub blocks: usize,
    /// Seconds per case.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Blocks in the prefix whose lookup latency is measured over the Unix socket.
    #[arg(long, default_value_t = 4096)]
    pub lookup_blocks: usize,
    /// Skip Redis even when installed.
    #[arg(long)]
    pub no_redis: bool,
    /// Transports to measure.
    #[arg(long, default_value = "unix,tcp,quic", value_delimiter = ',')]
    pub transports: Vec<String>,
}

#[derive(Serialize, Clone)]
pub struct Case {
    pub path: String,
    pub clients: usize,
    pub gb_s: f64,
    pub reference: String,
    pub reference_gb_s: f64,
    pub ratio: f64,
}

#[derive(Serialize)]
pub struct ServerReport {
    pub block_bytes: u64,
    pub batch: usize,
    pub cases: Vec<Case>,
    pub memcpy_gb_s: f64,
    pub lookup_blocks: usize,
    pub lookup_us_p50: f64,
    pub lookup_us_p99: f64,
    /// Round trip of a ping over the same socket (the floor under any request).
    pub ping_us_p50: f64,
    pub server_peak_rss_bytes: u64,
    pub server_dram_bytes: u64,
    pub redis: Option<String>,
}

/// A server in a child process.
struct Child_ {
    child: Child,
    unix: PathBuf,
    tcp: SocketAddr,
    quic: SocketAddr,
    dir: tempfile::TempDir,
}

const TOKEN: &str = "kvtier-bench-token";

fn layout_for(block: u64) -> Result<KvLayout> {
    if block == 0 || !block.is_multiple_of(64 << 10) {
        bail!("--block-size must be a multiple of 64 KiB");
    }
    // 8 kv heads x 128 dims x bf16 x 16 tokens x (K+V) = 64 KiB a layer.
    Ok(KvLayout::new(
        (block >> 16) as u32,
        8,
        128,
        Dtype::Bf16,
        16,
    )?)
}

impl Child_ {
    fn start(layout: &KvLayout, dram_bytes: u64) -> Result<Child_> {
        let dir = tempfile::tempdir()?;
        let sets = [
            format!(
                "server.runtime_dir={:?}",
                dir.path().join("run").display().to_string()
            ),
            "server.tcp=\"127.0.0.1:0\"".into(),
            "server.quic=\"127.0.0.1:0\"".into(),
            "server.admin=off".into(),
            format!("server.token={TOKEN:?}"),
            format!("store.dram_bytes={dram_bytes}"),
            "store.nvme_dir=\"\"".into(),
            format!("layout.layers={}", layout.num_layers()),
            format!("layout.kv_heads={}", layout.num_kv_heads()),
            format!("layout.head_dim={}", layout.head_dim()),
            format!("layout.dtype={:?}", layout.dtype().name()),
            format!("layout.block_tokens={}", layout.block_tokens()),
        ];
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("serve-child");
        for s in &sets {
            cmd.arg("--set").arg(s);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the server child")?;
        let out = child.stdout.take().context("child stdout")?;
        let mut line = String::new();
        let mut r = BufReader::new(out);
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                bail!("the server child exited before listening");
            }
            if line.starts_with("listening ") {
                break;
            }
        }
        std::thread::spawn(move || for _ in r.lines() {});
        let field = |n: &str| -> Result<String> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{n}=")))
                .map(str::to_string)
                .with_context(|| format!("no {n}= in {line:?}"))
        };
        Ok(Child_ {
            unix: PathBuf::from(field("unix")?),
            tcp: field("tcp")?.parse()?,
            quic: field("quic")?.parse()?,
            child,
            dir,
        })
    }

    fn peak_rss(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kb| kb * 1024)
    }

    async fn client(&self, transport: &str) -> Result<Client> {
        let (url, cfg) = match transport {
            "unix" => (
                format!("unix://{}", self.unix.display()),
                ClientConfig::default(),
            ),
            "tcp" => (
                format!("tcp://{}", self.tcp),
                ClientConfig::default().token(TOKEN),
            ),
            "quic" => (
                format!("quic://{}", self.quic),
                ClientConfig::default()
                    .token(TOKEN)
                    .quic_cert_der(std::fs::read(self.dir.path().join("run/quic-cert.der"))?),
            ),
            t => bail!("unknown transport {t:?} (unix, tcp, quic)"),
        };
        let cfg = cfg.timeout(Duration::from_secs(30));
        Ok(Client::connect(&url, cfg).await?)
    }
}

impl Drop for Child_ {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
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

fn keys(n: usize, layout: &KvLayout, seed: u32) -> Result<Vec<BlockKey>> {
    let secret = HashSecret::development();
    let ns = NamespaceBuilder::new("bench", layout.fingerprint()).build(&secret)?;
    let mut h = PrefixHasher::new(secret, ns, layout.block_tokens())?;
    let tokens: Vec<u32> = (0..(n * layout.block_tokens() as usize) as u32)
        .map(|t| t ^ seed)
        .collect();
    let mut k = Vec::new();
    h.prompt_keys(&tokens, &mut k);
    Ok(k)
}

/// Runs `clients` loops of `op` for `secs`; returns bytes moved per second.
async fn drive<F, Fut>(clients: usize, secs: f64, bytes_per_op: u64, op: F) -> Result<f64>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let op = Arc::new(op);
    let dur = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while start.elapsed() < dur {
                op(c, n).await?;
                n += 1;
            }
            Ok::<u64, anyhow::Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 * bytes_per_op as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// Single-thread memcpy of `block`-byte blocks out of a working set of `blocks` distinct
/// blocks (the same bytes the gets move: out of cache when the gets' are).
fn memcpy_gb_s(block: usize, blocks: usize, batch: usize, secs: f64) -> f64 {
    let src: Vec<Vec<u8>> = (0..blocks).map(|i| vec![i as u8; block]).collect();
    // As many destination buffers as a get fills.
    let mut dst = vec![vec![0u8; block]; batch];
    let dur = Duration::from_secs_f64(secs);
    let t = Instant::now();
    let mut n = 0;
    while t.elapsed() < dur {
        let d = &mut dst[n % batch];
        d.copy_from_slice(&src[n % src.len()]);
        std::hint::black_box(&d);
        n += 1;
    }
    n as f64 * block as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// A raw loopback TCP reference: a server answering a 1-byte request with the next `batch`
/// blocks of its working set, `clients` streams at once (what a get is, without kvtier).
async fn raw_tcp(clients: usize, ws: Arc<WorkingSet>, secs: f64) -> Result<f64> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let bytes = ws.response_bytes();
    let srv = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let ws = ws.clone();
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let mut b = [0u8; 1];
                let mut n = 0;
                'serve: while s.read_exact(&mut b).await.is_ok() {
                    for part in ws.response(n) {
                        if s.write_all(part).await.is_err() {
                            break 'serve;
                        }
                    }
                    n += 1;
                }
            });
        }
    });
    let mut streams = Vec::new();
    for _ in 0..clients {
        let s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        streams.push(Arc::new(tokio::sync::Mutex::new((s, vec![0u8; bytes]))));
    }
    let r = drive(clients, secs, bytes as u64, move |c, _| {
        let s = streams[c].clone();
        async move {
            let mut g = s.lock().await;
            let (s, buf) = &mut *g;
            s.write_all(&[1]).await?;
            s.read_exact(buf).await?;
            Ok(())
        }
    })
    .await;
    srv.abort();
    r
}

/// A raw quinn reference: one connection per client, one stream each, 1-byte request,
/// `block` bytes back.
async fn raw_quinn(clients: usize, ws: Arc<WorkingSet>, secs: f64) -> Result<f64> {
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
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let ws = ws.clone();
                    tokio::spawn(async move {
                        let mut b = [0u8; 1];
                        let mut n = 0;
                        'serve: while AsyncReadExt::read_exact(&mut recv, &mut b).await.is_ok() {
                            for part in ws.response(n) {
                                if AsyncWriteExt::write_all(&mut send, part).await.is_err() {
                                    break 'serve;
                                }
                            }
                            n += 1;
                        }
                    });
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
        let conn = cep.connect(addr, "localhost")?.await?;
        let (send, recv) = conn.open_bi().await?;
        streams.push(Arc::new(tokio::sync::Mutex::new((
            send,
            recv,
            vec![0u8; bytes],
            cep,
            conn,
        ))));
    }
    let r = drive(clients, secs, bytes as u64, move |c, _| {
        let s = streams[c].clone();
        async move {
            let mut g = s.lock().await;
            let (send, recv, buf, _, _) = &mut *g;
            AsyncWriteExt::write_all(send, &[1]).await?;
            AsyncReadExt::read_exact(recv, buf).await?;
            Ok(())
        }
    })
    .await;
    srv.abort();
    ep.close(0u32.into(), b"done");
    r
}

/// The reference servers' payload: a working set of distinct blocks, answered `batch` at a
/// time in turn (the same bytes, and as cold in cache, as the gets').
struct WorkingSet {
    blocks: Vec<Vec<u8>>,
    batch: usize,
}

impl WorkingSet {
    fn new(block: usize, blocks: usize, batch: usize) -> Arc<Self> {
        Arc::new(Self {
            blocks: (0..blocks.max(batch))
                .map(|i| vec![i as u8; block])
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

/// Redis started for the run (stopped on drop).
struct Redis {
    child: Child,
    port: u16,
    unix: PathBuf,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Result<Option<Redis>> {
        let Some(bin) = which("redis-server") else {
            return Ok(None);
        };
        let dir = tempfile::tempdir()?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let unix = dir.path().join("redis.sock");
        let child = Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--unixsocket",
                &unix.display().to_string(),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--proto-max-bulk-len",
                "1gb",
            ])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let r = Redis {
            child,
            port,
            unix,
            _dir: dir,
        };
        let until = Instant::now() + Duration::from_secs(10);
        while !r.unix.exists() {
            if Instant::now() > until {
                bail!("redis-server did not start");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Some(r))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// A connection and its buffer, shared with the driving task.
type Shared<T> = Arc<tokio::sync::Mutex<T>>;
/// A Redis connection and the buffer its replies land in.
type RedisConn = (Box<dyn Stream>, Vec<u8>);

trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// One RESP command; reads a bulk-string reply into `buf` (or "+OK").
async fn resp(s: &mut dyn Stream, args: &[&[u8]], buf: &mut [u8]) -> Result<()> {
    let mut cmd = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        cmd.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        cmd.extend_from_slice(a);
        cmd.extend_from_slice(b"\r\n");
    }
    s.write_all(&cmd).await?;
    let mut head = Vec::with_capacity(32);
    loop {
        let b = s.read_u8().await?;
        head.push(b);
        if head.ends_with(b"\r\n") {
            break;
        }
    }
    match head[0] {
        b'+' => Ok(()),
        b'$' => {
            let n: usize = std::str::from_utf8(&head[1..head.len() - 2])?.parse()?;
            if n != buf.len() {
                bail!("redis returned {n} bytes, expected {}", buf.len());
            }
            s.read_exact(buf).await?;
            let mut crlf = [0u8; 2];
            s.read_exact(&mut crlf).await?;
            Ok(())
        }
        _ => bail!("redis said {:?}", String::from_utf8_lossy(&head)),
    }
}

async fn redis_get(r: &Redis, unix: bool, clients: usize, block: usize, secs: f64) -> Result<f64> {
    let mut conns: Vec<Shared<RedisConn>> = Vec::new();
    for _ in 0..clients {
        let s: Box<dyn Stream> = if unix {
            Box::new(tokio::net::UnixStream::connect(&r.unix).await?)
        } else {
            let s = tokio::net::TcpStream::connect(("127.0.0.1", r.port)).await?;
            s.set_nodelay(true)?;
            Box::new(s)
        };
        conns.push(Arc::new(tokio::sync::Mutex::new((s, vec![0u8; block]))));
    }
    {
        let mut g = conns[0].lock().await;
        let (s, _) = &mut *g;
        let v = vec![3u8; block];
        for i in 0..16 {
            resp(
                s.as_mut(),
                &[b"SET", format!("k{i}").as_bytes(), &v],
                &mut [],
            )
            .await?;
        }
    }
    drive(clients, secs, block as u64, move |c, n| {
        let s = conns[c].clone();
        async move {
            let mut g = s.lock().await;
            let (s, buf) = &mut *g;
            let key = format!("k{}", n % 16);
            resp(s.as_mut(), &[b"GET", key.as_bytes()], buf).await
        }
    })
    .await
}

pub fn run(args: &ServerArgs) -> Result<ServerReport> {
    if args.seconds <= 0.0 || args.blocks == 0 || args.batch == 0 || args.clients.is_empty() {
        bail!("--seconds, --blocks, --batch and --clients must be above zero");
    }
    if args.clients.contains(&0) {
        bail!("--clients must be above zero");
    }
    let layout = layout_for(args.block_size)?;
    let block = args.block_size as usize;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let dram = (args.blocks as u64 + 16) * args.block_size;
    let srv = Child_::start(&layout, dram)?;
    let memcpy = memcpy_gb_s(block, args.blocks, args.batch, args.seconds.min(1.0));
    let redis = if args.no_redis { None } else { Redis::start()? };
    let mut cases = Vec::new();
    let keys = keys(args.blocks, &layout, 1)?;
    let ws = WorkingSet::new(block, args.blocks, args.batch);
    rt.block_on(async {
        // Fill the working set through the local path.
        let c = srv.client("unix").await?;
        for chunk in keys.chunks(16) {
            let bufs: Vec<Vec<u8>> = chunk.iter().map(|_| vec![5u8; block]).collect();
            let refs: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
            let first = keys.iter().position(|k| *k == chunk[0]).unwrap_or(0);
            let s = c
                .put_chain(chunk, first.checked_sub(1).map(|p| keys[p]), &refs)
                .await;
            if s.cached() != chunk.len() {
                bail!("the server refused blocks while filling: {:?}", s);
            }
        }
        let keys = Arc::new(keys);
        for t in &args.transports {
            for &clients in &args.clients {
                eprintln!("server bench: {t}, {clients} client(s)...");
                let mut conns = Vec::new();
                for _ in 0..clients {
                    conns.push(Arc::new(tokio::sync::Mutex::new((
                        srv.client(t).await?,
                        vec![vec![0u8; block]; args.batch],
                    ))));
                }
                let (k, batch) = (keys.clone(), args.batch);
                let gb = drive(
                    clients,
                    args.seconds,
                    (block * batch) as u64,
                    move |c, n| {
                        let conn = conns[c].clone();
                        let k = k.clone();
                        async move {
                            let mut g = conn.lock().await;
                            let (client, bufs) = &mut *g;
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
                            Ok(())
                        }
                    },
                )
                .await?;
                let mut refs: Vec<(String, f64)> = Vec::new();
                match t.as_str() {
                    "unix" => refs.push(("memcpy (1 thread)".into(), memcpy)),
                    "tcp" => refs.push((
                        format!("raw loopback TCP, {clients} stream(s)"),
                        raw_tcp(clients, ws.clone(), args.seconds).await?,
                    )),
                    _ => refs.push((
                        format!("raw quinn, {clients} stream(s)"),
                        raw_quinn(clients, ws.clone(), args.seconds).await?,
                    )),
                }
                if let (Some(r), true) = (&redis, t != "quic") {
                    let over_unix = t == "unix";
                    refs.push((
                        format!(
                            "redis GET over {}",
                            if over_unix { "unix socket" } else { "TCP" }
                        ),
                        redis_get(r, over_unix, clients, block, args.seconds).await?,
                    ));
                }
                for (name, r) in refs {
                    cases.push(Case {
                        path: format!("{t} get"),
                        clients,
                        gb_s: gb,
                        reference: name,
                        reference_gb_s: r,
                        ratio: gb / r.max(1e-9),
                    });
                }
            }
        }
        Ok::<(), anyhow::Error>(())
    })?;
    let rss = srv.peak_rss();
    drop(srv);
    // Lookup latency: a long prefix of small blocks.
    let small = layout_for(64 << 10)?;
    let lsrv = Child_::start(&small, (args.lookup_blocks as u64 + 64) * (64 << 10))?;
    let (p50, p99, ping) = rt.block_on(async {
        let c = lsrv.client("unix").await?;
        let k = self::keys(args.lookup_blocks, &small, 2)?;
        let zero = vec![0u8; 64 << 10];
        for chunk in k.chunks(256) {
            let refs: Vec<&[u8]> = chunk.iter().map(|_| zero.as_slice()).collect();
            let first = k.iter().position(|x| *x == chunk[0]).unwrap_or(0);
            c.put_chain(chunk, first.checked_sub(1).map(|p| k[p]), &refs)
                .await;
        }
        if c.lookup(&k).await.tiers.len() != k.len() {
            bail!("the lookup prefix is not fully cached");
        }
        let mut times = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs_f64(args.seconds) {
            let t = Instant::now();
            let l = c.lookup(&k).await;
            times.push(t.elapsed().as_secs_f64() * 1e6);
            if l.tiers.len() != k.len() {
                bail!("lookup lost blocks");
            }
        }
        times.sort_by(f64::total_cmp);
        let q = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
        let mut pings = Vec::new();
        for _ in 0..2000 {
            pings.push(c.ping().await?.as_secs_f64() * 1e6);
        }
        pings.sort_by(f64::total_cmp);
        Ok::<_, anyhow::Error>((q(0.5), q(0.99), pings[pings.len() / 2]))
    })?;
    Ok(ServerReport {
        block_bytes: args.block_size,
        batch: args.batch,
        cases,
        memcpy_gb_s: memcpy,
        lookup_blocks: args.lookup_blocks,
        lookup_us_p50: p50,
        lookup_us_p99: p99,
        ping_us_p50: ping,
        server_peak_rss_bytes: rss,
        server_dram_bytes: dram,
        redis: redis
            .as_ref()
            .map(|_| "redis-server (started for this run)".to_string()),
    })
}

pub fn print(r: &ServerReport) {
    println!(
        "kvtier-server gets of {} blocks, {} block(s) a request",
        Bytes(r.block_bytes),
        r.batch
    );
    println!(
        "{:<10} {:>7} {:>9}  {:<32} {:>9} {:>7}",
        "path", "clients", "GB/s", "reference", "ref GB/s", "ratio"
    );
    for c in &r.cases {
        println!(
            "{:<10} {:>7} {:>9.2}  {:<32} {:>9.2} {:>6.2}x",
            c.path, c.clients, c.gb_s, c.reference, c.reference_gb_s, c.ratio
        );
    }
    if r.redis.is_none() {
        println!("(redis-server not installed: no Redis reference; bench/redis.sh installs it)");
    }
    println!(
        "lookup of a {}-block prefix over the Unix socket: p50 {:.1} us, p99 {:.1} us (ping p50 {:.1} us)",
        r.lookup_blocks, r.lookup_us_p50, r.lookup_us_p99, r.ping_us_p50
    );
    println!(
        "server peak RSS {} with a {} DRAM tier ({:.2}x)",
        Bytes(r.server_peak_rss_bytes),
        Bytes(r.server_dram_bytes),
        r.server_peak_rss_bytes as f64 / r.server_dram_bytes.max(1) as f64
    );
}

//! `kvtier-bench transfer`: the transfer library in the style of nixlbench. Sweeps block size x
//! batch size (descriptors per transfer) x backend x READ/WRITE between two agents in this
//! process, `--inflight` transfers in flight at a time (default 1), and reports GB/s, latency p50/p99 and the time
//! spent in `post`. A separate case measures the fixed cost: one 64-byte descriptor.
//!
//! References, measured in the same run on the same machine:
//! * shm: single-threaded memcpy of the same blocks between two buffers;
//! * tcp: raw loopback TCP streams, as many as the backend uses, moving the case's bytes: the
//!   writers cycle through a source buffer of block x batch bytes (split between the streams)
//!   in writes of min(block, chunk) bytes (the backend's frame size), the readers into a
//!   destination buffer of the same size: same working set, same write size, no protocol;
//! * quic: raw quinn streams, the same way (same stream count, transport settings and TLS);
//! * ucx (kvtier-bench built with `--features kvtier-transfer/ucx`): UCX's own `ucx_perftest`
//!   (`ucp_put_bw`, messages of min(block, chunk) bytes as the backend puts, 8 outstanding,
//!   same `UCX_TLS`) between two processes on loopback, when installed (Debian `ucx-utils`);
//!   its MB/s are MiB/s. (Single large puts over UCX's tcp transport run at tens of MB/s
//!   here, so a block-sized reference would flatter the backend.)
//!
//! Each transfer's remote descriptors are laid out in reverse order, so a batch never merges
//! into one descriptor. Payload bytes come from `--seed`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use indicatif::ProgressBar;
use kvtier_transfer::{Agent, AgentConfig, BackendKind, Descriptor, Op, Peer, RegionHandle};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::report::{Plot, PlotKind, Report, Series, Table};
use crate::util::{Bytes, fmt_f, fmt_ratio, parse_size, ratio, sub_seed};

/// Bytes of the fixed-cost case.
const FIXED_COST_BYTES: u64 = 64;

/// The backends `--backends` names, by name.
const BACKENDS: [(&str, BackendKind); 4] = [
    ("shm", BackendKind::Shm),
    ("tcp", BackendKind::Tcp),
    ("quic", BackendKind::Quic),
    ("ucx", BackendKind::Ucx),
];

/// The operations `--ops` names, by name.
const OPS: [(&str, Op); 2] = [("write", Op::Write), ("read", Op::Read)];

/// A parser of one name of `table` (clap lists the names in its help and its errors).
fn one_of<T: Copy + Send + Sync + 'static>(
    table: &'static [(&'static str, T)],
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(table.iter().map(|(n, _)| *n)).map(move |name| {
        // The possible-values parser let through only the table's names.
        table
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .expect("a name from the table")
    })
}

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// Backends to measure (shm, tcp, quic, ucx; ucx needs kvtier-bench built with
    /// `--features kvtier-transfer/ucx`).
    #[arg(long, value_delimiter = ',', default_value = "shm,tcp,quic", value_parser = one_of(&BACKENDS))]
    pub backends: Vec<BackendKind>,
    /// Block sizes (one descriptor each).
    #[arg(long, value_delimiter = ',', default_value = "4k,64k,1m,4m,16m,64m", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Batch sizes (descriptors per transfer).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,16",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub batches: Vec<usize>,
    /// Operations (write, read).
    #[arg(long, value_delimiter = ',', default_value = "write,read", value_parser = one_of(&OPS))]
    pub ops: Vec<Op>,
    /// Measured time of each case.
    #[arg(long, default_value_t = 1.0)]
    pub seconds_per_case: f64,
    /// Cases whose block x batch exceeds this are skipped (each side allocates it).
    #[arg(long, default_value = "256m", value_parser = parse_size)]
    pub max_case_bytes: u64,
    /// TCP connections per peer (the raw TCP reference uses as many).
    #[arg(long, default_value_t = 4)]
    pub tcp_streams: usize,
    /// QUIC streams per peer (the raw quinn reference uses as many).
    #[arg(long, default_value_t = 1)]
    pub quic_streams: usize,
    /// Transfers kept in flight at once (each on its own slice of the regions, posted from
    /// its own task).
    #[arg(long, default_value_t = 1)]
    pub inflight: usize,
    /// UCX transports for the ucx backend and its ucx_perftest reference (UCX_TLS).
    #[arg(long, default_value = "tcp")]
    pub ucx_tls: String,
    /// Striping chunk of the TCP/QUIC backends.
    #[arg(long, default_value = "1m", value_parser = parse_size)]
    pub chunk_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct TransferReport {
    pub seed: u64,
    pub seconds_per_case: f64,
    pub inflight: usize,
    pub tcp_streams: usize,
    pub quic_streams: usize,
    pub chunk_bytes: u64,
    pub fixed_cost: Vec<FixedCost>,
    pub cases: Vec<Case>,
    /// Cases skipped and references missing, and why.
    pub notes: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct FixedCost {
    pub backend: String,
    pub op: String,
    pub bytes: u64,
    pub transfers: u64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
    pub post_us_p50: f64,
}

#[derive(Debug, Serialize)]
pub struct Case {
    pub backend: String,
    pub op: String,
    pub block_bytes: u64,
    pub batch: usize,
    pub transfers: u64,
    pub gb_per_s: f64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
    pub post_us_p50: f64,
    pub reference: String,
    pub reference_gb_per_s: f64,
    /// GB/s over the reference's (absent when the reference was not measured).
    pub ratio: Option<f64>,
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "WRITE",
        Op::Read => "READ",
    }
}

pub fn run(args: &TransferArgs, seed: u64) -> Result<TransferReport> {
    let (backends, ops, batches) = (&args.backends, &args.ops, &args.batches);
    if !(args.seconds_per_case.is_finite() && args.seconds_per_case > 0.0) || args.inflight == 0 {
        bail!("--inflight and --seconds-per-case must be above zero");
    }
    if args.tcp_streams == 0 || args.quic_streams == 0 || args.chunk_bytes == 0 {
        bail!("--tcp-streams, --quic-streams and --chunk-bytes must be above zero");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let steps = backends.len() as u64
        * (ops.len() as u64 + (args.sizes.len() * batches.len()) as u64 * (1 + ops.len() as u64));
    let bar = crate::report::bar(steps, "transfer");
    let r = rt.block_on(run_async(args, backends, ops, batches, seed, &bar));
    bar.finish_and_clear();
    r
}

struct Times(Vec<Duration>);

impl Times {
    fn pct_us(&mut self, p: f64) -> f64 {
        self.0.sort_unstable();
        let i = ((self.0.len() - 1) as f64 * p).round() as usize;
        self.0[i].as_secs_f64() * 1e6
    }
}

struct Measured {
    transfers: u64,
    elapsed: Duration,
    latency: Times,
    post: Times,
}

/// Runs one `measure` loop per descriptor list concurrently (one task each) and pools them.
async fn measure_inflight(
    peer: &Peer,
    op: Op,
    lists: Vec<Vec<Descriptor>>,
    dur: Duration,
) -> Result<Measured> {
    if lists.len() == 1 {
        return measure(peer, op, &lists[0], dur).await;
    }
    let mut tasks = Vec::new();
    let wall = Instant::now();
    for list in lists {
        let peer = peer.clone();
        tasks.push(tokio::spawn(
            async move { measure(&peer, op, &list, dur).await },
        ));
    }
    let mut all = Measured {
        transfers: 0,
        elapsed: Duration::ZERO,
        latency: Times(Vec::new()),
        post: Times(Vec::new()),
    };
    for t in tasks {
        let m = t.await??;
        all.transfers += m.transfers;
        all.latency.0.extend(m.latency.0);
        all.post.0.extend(m.post.0);
    }
    // Wall time over all loops (a loop whose transfers never wait, as small shared-memory
    // copies, runs to its end before the next loop starts).
    all.elapsed = wall.elapsed();
    Ok(all)
}

async fn measure(peer: &Peer, op: Op, descs: &[Descriptor], dur: Duration) -> Result<Measured> {
    // Warm-up: a few transfers (faults pages in, opens windows).
    for _ in 0..3 {
        peer.post(op, descs, None)?.await?;
    }
    let mut latency = Vec::new();
    let mut post = Vec::new();
    let start = Instant::now();
    while start.elapsed() < dur || latency.len() < 3 {
        let t = Instant::now();
        let stats = peer.post(op, descs, None)?.await?;
        latency.push(t.elapsed());
        post.push(stats.post_time);
    }
    Ok(Measured {
        transfers: latency.len() as u64,
        elapsed: start.elapsed(),
        latency: Times(latency),
        post: Times(post),
    })
}

fn config(args: &TransferArgs) -> AgentConfig {
    AgentConfig {
        tcp_streams: args.tcp_streams,
        quic_streams: args.quic_streams,
        chunk_bytes: args.chunk_bytes,
        ucx_transports: Some(args.ucx_tls.clone()),
        ..AgentConfig::default()
    }
}

fn fill(region: &RegionHandle, seed: u64) -> Result<()> {
    let piece = crate::util::random_buf(1 << 20, seed);
    let mut off = 0u64;
    while off < region.len() {
        let n = (region.len() - off).min(piece.len() as u64) as usize;
        region.write_at(off, &piece[..n])?;
        off += n as u64;
    }
    Ok(())
}

async fn run_async(
    args: &TransferArgs,
    backends: &[BackendKind],
    ops: &[Op],
    batches: &[usize],
    seed: u64,
    bar: &ProgressBar,
) -> Result<TransferReport> {
    let dur = Duration::from_secs_f64(args.seconds_per_case);
    let mut report = TransferReport {
        seed,
        seconds_per_case: args.seconds_per_case,
        inflight: args.inflight,
        tcp_streams: args.tcp_streams,
        quic_streams: args.quic_streams,
        chunk_bytes: args.chunk_bytes,
        fixed_cost: Vec::new(),
        cases: Vec::new(),
        notes: Vec::new(),
    };
    // UCX's reference depends on the message size only; cached by it.
    let mut reference_cache: Vec<(BackendKind, u64, f64)> = Vec::new();
    for &backend in backends {
        let target = Agent::new("bench-target", config(args)).await?;
        let initiator = Agent::new("bench-initiator", config(args)).await?;
        // Fixed cost: one small descriptor.
        {
            let src = initiator.alloc_dram(4096)?;
            let dst = target.alloc_dram(4096)?;
            let peer = initiator.connect(&target.metadata()?, backend).await?;
            let d = [Descriptor::new(src.id(), 0, dst.id(), 0, FIXED_COST_BYTES)];
            for &op in ops {
                bar.set_message(format!("{backend} {} fixed cost", op_name(op)));
                let mut m = measure(&peer, op, &d, dur).await?;
                bar.inc(1);
                report.fixed_cost.push(FixedCost {
                    backend: backend.to_string(),
                    op: op_name(op).into(),
                    bytes: FIXED_COST_BYTES,
                    transfers: m.transfers,
                    latency_us_p50: m.latency.pct_us(0.5),
                    latency_us_p99: m.latency.pct_us(0.99),
                    post_us_p50: m.post.pct_us(0.5),
                });
            }
        }
        for &block in &args.sizes {
            for &batch in batches {
                let total = block * batch as u64;
                let inflight = args.inflight as u64;
                if total * inflight > args.max_case_bytes {
                    report.notes.push(format!(
                        "skipped {backend} {} x {batch}: over --max-case-bytes {}",
                        Bytes(block),
                        Bytes(args.max_case_bytes)
                    ));
                    bar.inc(1 + ops.len() as u64);
                    continue;
                }
                let message = block.min(args.chunk_bytes);
                let reference = match reference_cache
                    .iter()
                    .find(|(b, s, _)| *b == backend && *s == message)
                {
                    Some((_, _, gbps)) if backend == BackendKind::Ucx => *gbps,
                    _ => {
                        bar.set_message(format!("reference for {backend} {}", Bytes(block)));
                        let gbps = reference_gbps(args, backend, block, batch, dur, seed).await?;
                        if gbps.is_nan() {
                            let n = format!(
                                "no reference for {backend}: {}",
                                reference_name(backend, args)
                            );
                            if !report.notes.contains(&n) {
                                report.notes.push(n);
                            }
                        }
                        reference_cache.push((backend, message, gbps));
                        gbps
                    }
                };
                bar.inc(1);
                let src = initiator.alloc_dram(total * inflight)?;
                let dst = target.alloc_dram(total * inflight)?;
                fill(&src, sub_seed(seed, 1))?;
                fill(&dst, sub_seed(seed, 2))?;
                let peer = initiator.connect(&target.metadata()?, backend).await?;
                let lists: Vec<Vec<Descriptor>> = (0..inflight)
                    .map(|k| {
                        let base = k * total;
                        (0..batch as u64)
                            .map(|i| {
                                Descriptor::new(
                                    src.id(),
                                    base + i * block,
                                    dst.id(),
                                    base + (batch as u64 - 1 - i) * block,
                                    block,
                                )
                            })
                            .collect()
                    })
                    .collect();
                for &op in ops {
                    bar.set_message(format!(
                        "{backend} {} {} x {batch}",
                        op_name(op),
                        Bytes(block)
                    ));
                    let mut m = measure_inflight(&peer, op, lists.clone(), dur).await?;
                    bar.inc(1);
                    let gbps = (m.transfers * total) as f64 / m.elapsed.as_secs_f64() / 1e9;
                    report.cases.push(Case {
                        backend: backend.to_string(),
                        op: op_name(op).into(),
                        block_bytes: block,
                        batch,
                        transfers: m.transfers,
                        gb_per_s: gbps,
                        latency_us_p50: m.latency.pct_us(0.5),
                        latency_us_p99: m.latency.pct_us(0.99),
                        post_us_p50: m.post.pct_us(0.5),
                        reference: reference_name(backend, args),
                        reference_gb_per_s: reference,
                        ratio: ratio(gbps, reference),
                    });
                }
            }
        }
    }
    Ok(report)
}

fn reference_name(backend: BackendKind, args: &TransferArgs) -> String {
    match backend {
        BackendKind::Shm => "memcpy (1 thread)".into(),
        BackendKind::Tcp => format!("raw loopback TCP x{}", args.tcp_streams),
        BackendKind::Quic => format!("raw quinn stream x{}", args.quic_streams),
        BackendKind::Ucx => format!("ucx_perftest ucp_put_bw -O 8 UCX_TLS={}", args.ucx_tls),
        other => other.to_string(),
    }
}

async fn reference_gbps(
    args: &TransferArgs,
    backend: BackendKind,
    block: u64,
    batch: usize,
    dur: Duration,
    seed: u64,
) -> Result<f64> {
    match backend {
        BackendKind::Shm => Ok(memcpy_gbps(block as usize, batch, dur, seed)),
        BackendKind::Tcp => {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = l.local_addr()?;
            let mut pairs = Vec::new();
            for _ in 0..args.tcp_streams {
                let c = tokio::net::TcpStream::connect(addr).await?;
                let (s, _) = l.accept().await?;
                c.set_nodelay(true)?;
                s.set_nodelay(true)?;
                let (_, w) = c.into_split();
                let (r, _) = s.into_split();
                pairs.push((w, r));
            }
            raw_streams(
                pairs,
                block as usize,
                batch,
                args.chunk_bytes as usize,
                dur,
                seed,
            )
            .await
        }
        BackendKind::Quic => {
            use kvtier_transfer::backend::quic;
            let (sc, cert) = quic::server_identity()?;
            let server = quinn::Endpoint::server(sc, "127.0.0.1:0".parse()?)?;
            let addr = server.local_addr()?;
            let accept = tokio::spawn(async move {
                let conn = server
                    .accept()
                    .await
                    .ok_or_else(|| anyhow!("endpoint closed"))?
                    .await?;
                Ok::<_, anyhow::Error>((server, conn))
            });
            let (_client_ep, conn) =
                quic::connect_raw("127.0.0.1".parse()?, addr, &cert, "reference").await?;
            let (_server_ep, server_conn) = accept.await??;
            let mut pairs = Vec::new();
            for _ in 0..args.quic_streams {
                let (mut send, _recv) = conn.open_bi().await?;
                // A stream becomes visible to the peer with its first bytes.
                send.write_all(&[0u8]).await?;
                let (_s, mut recv) = server_conn.accept_bi().await?;
                let mut one = [0u8; 1];
                recv.read_exact(&mut one).await?;
                pairs.push((send, recv));
            }
            raw_streams(
                pairs,
                block as usize,
                batch,
                args.chunk_bytes as usize,
                dur,
                seed,
            )
            .await
        }
        BackendKind::Ucx => ucx_perftest_gbps(&args.ucx_tls, block.min(args.chunk_bytes), dur),
        other => bail!("no reference for {other}"),
    }
}

/// Runs `ucx_perftest` as a server and a client (`ucp_put_bw`) on loopback and returns the
/// client's overall bandwidth; NaN (reported as a missing reference) when not installed.
fn ucx_perftest_gbps(tls: &str, block: u64, dur: Duration) -> Result<f64> {
    use std::process::{Command, Stdio};
    if Command::new("ucx_perftest")
        .arg("-h")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        // Reported as a missing reference (a note and no ratio).
        return Ok(f64::NAN);
    }
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port().to_string()
    };
    // Aim at the case's duration assuming about 1 GB/s, within sane bounds.
    let iters = ((dur.as_secs_f64() * 1e9 / block as f64) as u64).clamp(20, 100_000);
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .env("UCX_TLS", tls)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the ucx_perftest server")?;
    let mut result = Err(anyhow!("ucx_perftest client never connected"));
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let out = Command::new("ucx_perftest")
            .args(["127.0.0.1", "-p", &port, "-t", "ucp_put_bw", "-O", "8"])
            .args(["-s", &block.to_string(), "-n", &iters.to_string()])
            .env("UCX_TLS", tls)
            .output()
            .context("running the ucx_perftest client")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(line) = text.lines().find(|l| l.starts_with("Final:")) {
            // Final: iterations, overhead p50, avg, overall, MB/s avg, MB/s overall, ...
            let mb_overall: f64 = line
                .split_whitespace()
                .nth(6)
                .ok_or_else(|| anyhow!("unexpected ucx_perftest line {line:?}"))?
                .parse()?;
            result = Ok(mb_overall * 1_048_576.0 / 1e9);
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    result
}

fn memcpy_gbps(block: usize, batch: usize, dur: Duration, seed: u64) -> f64 {
    let total = block * batch;
    let src = crate::util::random_buf(total, sub_seed(seed, 3));
    let mut dst = vec![0u8; total];
    dst.copy_from_slice(&src[..total]);
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed() < dur {
        for i in 0..batch {
            let j = batch - 1 - i;
            dst[j * block..(j + 1) * block].copy_from_slice(&src[i * block..(i + 1) * block]);
        }
        std::hint::black_box(&mut dst);
        bytes += total as u64;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Bulk throughput of `pairs` (writer, reader) run concurrently for `dur`: the writers cycle
/// through `block x batch` source bytes (split between the pairs) in writes of
/// min(block, chunk) bytes; the readers land them in a buffer of the same size.
async fn raw_streams<W, R>(
    pairs: Vec<(W, R)>,
    block: usize,
    batch: usize,
    chunk: usize,
    dur: Duration,
    seed: u64,
) -> Result<f64>
where
    W: AsyncWrite + Unpin + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
{
    let write_len = block.min(chunk);
    let share = (block * batch / pairs.len()).max(write_len);
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let start = Instant::now();
    for (mut w, mut r) in pairs {
        let stop_w = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let src = crate::util::random_buf(share, sub_seed(seed, 4));
            let mut off = 0;
            while !stop_w.load(Ordering::Relaxed) {
                let n = write_len.min(share - off);
                w.write_all(&src[off..off + n]).await?;
                off = if off + n >= share { 0 } else { off + n };
            }
            w.shutdown().await?;
            Ok::<_, anyhow::Error>(())
        }));
        let received = Arc::clone(&received);
        tasks.push(tokio::spawn(async move {
            let mut dst = vec![0u8; share];
            let mut off = 0;
            loop {
                let want = write_len.min(share - off);
                let n = r.read(&mut dst[off..off + want]).await?;
                if n == 0 {
                    break;
                }
                off = if off + n >= share { 0 } else { off + n };
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    tokio::time::sleep(dur).await;
    let bytes_at_stop = received.load(Ordering::Relaxed);
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(bytes_at_stop as f64 / elapsed.as_secs_f64() / 1e9)
}

impl Report for TransferReport {
    fn tables(&self) -> Vec<Table> {
        let mut run = Table::new("run", &["setting", "value"]);
        run.row(["transfers in flight".to_string(), self.inflight.to_string()]);
        run.row([
            "streams".to_string(),
            format!("tcp {}, quic {}", self.tcp_streams, self.quic_streams),
        ]);
        run.row(["chunk".to_string(), Bytes(self.chunk_bytes).to_string()]);
        run.row([
            "seconds per case".to_string(),
            self.seconds_per_case.to_string(),
        ]);
        for n in &self.notes {
            run.row(["note".to_string(), n.clone()]);
        }
        let mut f = Table::new(
            format!(
                "fixed cost: one {FIXED_COST_BYTES}-byte descriptor (target <= 20 us over shm)"
            ),
            &[
                "backend",
                "op",
                "transfers",
                "p50 us",
                "p99 us",
                "post p50 us",
            ],
        );
        for x in &self.fixed_cost {
            f.row([
                x.backend.clone(),
                x.op.clone(),
                x.transfers.to_string(),
                fmt_f(x.latency_us_p50, 2),
                fmt_f(x.latency_us_p99, 2),
                fmt_f(x.post_us_p50, 2),
            ]);
        }
        let mut c = Table::new(
            "sweep: GB/s and latency per transfer against the reference (target >= 0.8x for shm and tcp)",
            &[
                "backend",
                "op",
                "block",
                "batch",
                "GB/s",
                "p50 us",
                "p99 us",
                "post us",
                "ref GB/s",
                "ratio",
                "reference",
            ],
        );
        for x in &self.cases {
            c.row([
                x.backend.clone(),
                x.op.clone(),
                Bytes(x.block_bytes).to_string(),
                x.batch.to_string(),
                fmt_f(x.gb_per_s, 2),
                fmt_f(x.latency_us_p50, 1),
                fmt_f(x.latency_us_p99, 1),
                fmt_f(x.post_us_p50, 2),
                fmt_f(x.reference_gb_per_s, 2),
                fmt_ratio(x.ratio),
                x.reference.clone(),
            ]);
        }
        vec![run, f, c]
    }

    fn plots(&self) -> Vec<Plot> {
        let mut plots = Vec::new();
        let mut backends: Vec<&str> = self.cases.iter().map(|c| c.backend.as_str()).collect();
        backends.dedup();
        for b in backends {
            let mut series: Vec<Series> = Vec::new();
            let mut push = |name: String, point: (f64, f64)| match series
                .iter_mut()
                .find(|s| s.name == name)
            {
                Some(s) => {
                    if !s.points.contains(&point) {
                        s.points.push(point);
                    }
                }
                None => series.push(Series {
                    name,
                    points: vec![point],
                }),
            };
            for c in self.cases.iter().filter(|c| c.backend == b) {
                let x = c.block_bytes as f64;
                push(format!("{} x{}", c.op, c.batch), (x, c.gb_per_s));
                if c.reference_gb_per_s.is_finite() {
                    push(format!("reference x{}", c.batch), (x, c.reference_gb_per_s));
                }
            }
            for s in &mut series {
                s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            plots.push(Plot {
                file: format!("transfer-{b}-gbps"),
                title: format!("transfer library, {b}: GB/s by block size (batch = descriptors)"),
                x_label: "block size".into(),
                y_label: "GB/s".into(),
                kind: PlotKind::Lines {
                    series,
                    log_x: true,
                },
            });
        }
        plots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: TransferArgs,
    }

    fn parse(args: &[&str]) -> Result<TransferArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("transfer").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn parses_lists() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            a.backends,
            vec![BackendKind::Shm, BackendKind::Tcp, BackendKind::Quic]
        );
        assert_eq!(a.ops, vec![Op::Write, Op::Read]);
        assert_eq!(a.batches, vec![1, 16]);
        assert_eq!(a.sizes[..3], [4 << 10, 64 << 10, 1 << 20]);
        let a = parse(&[
            "--backends",
            "shm,ucx",
            "--ops",
            "read",
            "--sizes",
            "2m",
            "--batches",
            "4",
        ])
        .unwrap();
        assert_eq!(a.backends, vec![BackendKind::Shm, BackendKind::Ucx]);
        assert_eq!(
            (a.ops, a.sizes, a.batches),
            (vec![Op::Read], vec![2 << 20], vec![4])
        );
        for (args, needle) in [
            (
                &["--backends", "shm,rdma"][..],
                "invalid value 'rdma' for '--backends",
            ),
            (
                &["--ops", "write,copy"][..],
                "invalid value 'copy' for '--ops",
            ),
            (
                &["--batches", "1,0"][..],
                "invalid value '0' for '--batches",
            ),
            (&["--sizes", "64k,,2m"][..], "--sizes"),
        ] {
            let e = parse(args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn report_has_tables_and_a_plot_per_backend() {
        let case = |backend: &str, block: u64, gb: f64, reference: f64| Case {
            backend: backend.into(),
            op: "WRITE".into(),
            block_bytes: block,
            batch: 1,
            transfers: 10,
            gb_per_s: gb,
            latency_us_p50: 1.0,
            latency_us_p99: 2.0,
            post_us_p50: 0.5,
            reference: "memcpy".into(),
            reference_gb_per_s: reference,
            ratio: ratio(gb, reference),
        };
        let r = TransferReport {
            seed: 1,
            seconds_per_case: 0.1,
            inflight: 1,
            tcp_streams: 4,
            quic_streams: 1,
            chunk_bytes: 1 << 20,
            fixed_cost: vec![],
            cases: vec![
                case("shm", 4096, 1.0, 2.0),
                case("shm", 65536, 3.0, 4.0),
                case("ucx", 65536, 1.0, f64::NAN),
            ],
            notes: vec!["no reference for ucx".into()],
        };
        let text: String = r.tables().iter().map(Table::render).collect();
        assert!(text.contains("0.50x") && text.contains("0.75x"), "{text}");
        assert!(text.contains("no reference for ucx"));
        let plots = r.plots();
        assert_eq!(plots.len(), 2);
        assert_eq!(plots[0].file, "transfer-shm-gbps");
    }
}

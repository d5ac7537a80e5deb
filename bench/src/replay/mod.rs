//! `kvtier-bench replay`: replays a block-hash trace (Mooncake JSONL or Claude Code sessions)
//! against a kvtier server, started in this process or reached at an address, keeping the
//! trace's timing and dependency order (see [`schedule`]). Every block stored carries a
//! checksum and its key ([`payload`]); every hit is verified.
//!
//! Reports the hit rate per tier, bytes moved per tier, the server's evictions and corrupt
//! drops, the corrupt blocks the replay saw (must be 0), and, on the same sequence of requests
//! at the same capacity in blocks, the store's default policy simulated, plain LRU, the
//! offline optimum (Belady) and an unlimited cache. With a worker profile it reports the TTFT
//! saved against recomputing.

pub mod backend;
pub mod payload;
pub mod schedule;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvtier_core::{Dtype, KvLayout};
use kvtier_server::policy::EvictionKind;
use kvtier_server::replay::{TraceRequest, replay};
use serde::Serialize;

use crate::policy::{optimum, token_count, unlimited};
use crate::report::{Plot, PlotKind, Report, Series, Table};
use crate::trace::{self, MooncakeTrace, ReadOptions, Session, Skipped};
use backend::{ClientBackend, Embedded, EmbeddedConfig, Fleet, TierCounters};
use schedule::{Record, ScheduleConfig, WorkerProfile};

/// Prefill rate of the model time when no worker profile is given (tokens/s).
const DEFAULT_PREFILL_TOK_S: f64 = 10_000.0;
/// Points of the hit-rate-over-time plot.
const TIMELINE_POINTS: usize = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// By extension: `.jsonl` is Mooncake; `.json` files and directories are Claude Code.
    Auto,
    Mooncake,
    ClaudeCode,
}

/// Model shapes that size the block payloads (bytes per token = layers x 2 x kv heads x head
/// dim x dtype bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelPreset {
    /// 1 layer, 1 KV head, head dim 4, bf16: 16 B a token (8 KiB Mooncake blocks), small
    /// enough to replay whole traces at tens of millions of tokens on a laptop.
    Tiny,
    /// Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB a token.
    Llama3_8b,
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Trace to replay: a Mooncake JSONL file, or Claude Code session files / directories of
    /// them (repeat the flag for several).
    #[arg(long = "trace", required = true)]
    pub traces: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "auto")]
    pub format: Format,
    /// Use the server at this address (unix://PATH, tcp://HOST:PORT, quic://HOST:PORT)
    /// instead of starting one in this process. Its tier sizes are its own. Repeat the flag
    /// for a fleet: each request goes to one of the servers by `--route`, and capacities and
    /// counters are the fleet's sums (separate servers, or members of one cluster).
    #[arg(long = "server", value_name = "URL")]
    pub servers: Vec<String>,
    /// How a request picks its server when there are several: `round-robin`, or `session`
    /// (a hash of the prompt's first two blocks: the session in the Claude Code samples, the
    /// conversation after the shared system prompt in Mooncake's), as a router would.
    #[arg(long, value_enum, default_value = "round-robin")]
    pub route: backend::Route,
    /// Token for a tcp:// or quic:// server. Default: $KVTIER_TOKEN.
    #[arg(long)]
    pub token: Option<String>,
    /// The quic:// server's certificate (DER) to trust.
    #[arg(long, value_name = "FILE")]
    pub quic_cert: Option<PathBuf>,
    /// DRAM tier of the embedded server, in tokens (decimal: 3m = 3,000,000).
    #[arg(long, default_value = "3m", value_parser = token_count)]
    pub dram_tokens: u64,
    /// NVMe tier of the embedded server, in tokens; 0 = none.
    #[arg(long, default_value = "0", value_parser = token_count)]
    pub nvme_tokens: u64,
    /// Where the embedded NVMe tier's temporary directory goes (a disk, not tmpfs).
    /// Default: ./kvtier-data/bench, else $TMPDIR.
    #[arg(long, value_name = "DIR")]
    pub nvme_dir: Option<PathBuf>,
    /// The embedded server's demotion policy (write-through, write-back, selective:N).
    #[arg(long, default_value = "write-through")]
    pub demotion: String,
    /// Further embedded server settings (`section.key=value`, as kvtier-server --set).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Model shape that sizes the blocks; --layers, --kv-heads, --head-dim, --dtype override
    /// its fields. Block tokens come from the trace.
    #[arg(long, value_enum, default_value = "tiny")]
    pub model: ModelPreset,
    #[arg(long)]
    pub layers: Option<u32>,
    #[arg(long)]
    pub kv_heads: Option<u32>,
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// bf16, f16, f32, fp8.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Trace time is divided by this; "max" = no waits (order and dependencies kept).
    #[arg(long, default_value = "max", value_parser = parse_speedup)]
    pub speedup: Speedup,
    /// Requests served at once (all sessions together).
    #[arg(long, default_value_t = 16)]
    pub max_inflight: usize,
    /// Claude Code sessions running at once.
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    /// Replay the Claude Code sessions this many times, each copy with its own id scope.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// Replay only the first N requests of a Mooncake trace.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Skip and count malformed trace lines and entries instead of stopping.
    #[arg(long)]
    pub skip_bad: bool,
    /// Mooncake: do not store a prompt's partial last block.
    #[arg(long)]
    pub full_blocks_only: bool,
    /// Worker prefill rate in tokens/s: sets the model time of calls and turns on the TTFT
    /// saved report. Default for the model time: 10,000.
    #[arg(long)]
    pub prefill_tok_s: Option<f64>,
    /// On a unix:// server, send bytes over the socket instead of through the mapped arena.
    #[arg(long)]
    pub copy: bool,
    /// Count hits from the lookup alone and load nothing (no verification): the request
    /// pattern of the store's simulator, to tell the policy's figure from the load's effect.
    #[arg(long)]
    pub lookup_only: bool,
    /// Worker decode rate in tokens/s (model time of calls).
    #[arg(long, default_value_t = 50.0)]
    pub decode_tok_s: f64,
    /// Also write the requests in the order they were served, as Mooncake JSONL (ids made
    /// global by scope, every block stored), for `kvtier-bench policy --trace FILE`.
    #[arg(long, value_name = "FILE")]
    pub order_out: Option<PathBuf>,
    /// Retention hints after each call: none, oracle (the trace's time before the chain's
    /// next call) or predict (the longest of the chain's last three gaps). Claude Code: per
    /// session chain, the think times; Mooncake: per conversation recovered from the prompts
    /// (a request continues the latest one whose full blocks it extends), the gaps between
    /// turns, over the request's full blocks. Scaled by the speedup (at `max` a hint covers
    /// nothing).
    #[arg(long, value_enum, default_value = "none")]
    pub hints: schedule::HintSource,
    /// A fleet serves a request its server fails (gone, refusing, timing out) on the next
    /// server, as a router would, and passes the failed one over for a second; counted as
    /// rerouted. Without it such a request stops the replay.
    #[arg(long)]
    pub failover: bool,
    /// Also report the hit rate in windows of this many seconds of wall time (by when each
    /// request began), with the requests rerouted and the corrupt blocks in each: the dip
    /// and recovery around a fault.
    #[arg(long, value_name = "SECONDS", value_parser = positive_seconds)]
    pub window_s: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speedup(pub Option<f64>);

fn parse_speedup(s: &str) -> Result<Speedup, String> {
    if s.eq_ignore_ascii_case("max") {
        return Ok(Speedup(None));
    }
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(Speedup(Some(v))),
        _ => Err(format!("{s:?}: expected a positive number or \"max\"")),
    }
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.01 => Ok(v),
        _ => Err(format!("{s:?}: expected seconds, at least 0.01")),
    }
}

/// The block shape.
#[derive(Clone, Debug, Serialize)]
pub struct ModelProfile {
    pub name: String,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
    pub block_tokens: u32,
    pub block_bytes: u64,
}

fn layout_for(a: &ReplayArgs, block_tokens: u32) -> Result<(KvLayout, String)> {
    let (name, l, h, d, t) = match a.model {
        ModelPreset::Tiny => ("tiny", 1, 1, 4, "bf16"),
        ModelPreset::Llama3_8b => ("llama3-8b", 32, 8, 128, "bf16"),
    };
    let custom = a.layers.is_some() || a.kv_heads.is_some() || a.head_dim.is_some();
    let dtype = Dtype::parse(a.dtype.as_deref().unwrap_or(t)).context("--dtype")?;
    let layout = KvLayout::new(
        a.layers.unwrap_or(l),
        a.kv_heads.unwrap_or(h),
        a.head_dim.unwrap_or(d),
        dtype,
        block_tokens,
    )
    .context("model profile")?;
    if (layout.block_bytes() as usize) < payload::HEADER_BYTES {
        bail!(
            "a block of this model is {} bytes; the replay needs at least {} (checksum and key)",
            layout.block_bytes(),
            payload::HEADER_BYTES
        );
    }
    let name = if custom || a.dtype.is_some() {
        format!("{name} (modified)")
    } else {
        name.to_owned()
    };
    Ok((layout, name))
}

/// What was read.
enum Workload {
    Mooncake(MooncakeTrace),
    Sessions(Vec<Session>),
}

fn read_workload(a: &ReplayArgs) -> Result<(Workload, Skipped, u32)> {
    let opts = ReadOptions {
        skip_bad: a.skip_bad,
        limit: a.limit,
    };
    let mooncake = match a.format {
        Format::Mooncake => true,
        Format::ClaudeCode => false,
        Format::Auto => {
            let jsonl = |p: &PathBuf| p.extension().is_some_and(|x| x == "jsonl");
            let n = a.traces.iter().filter(|p| jsonl(p)).count();
            if n > 0 && n < a.traces.len() {
                bail!(
                    "--trace mixes Mooncake (.jsonl) and session files: {}",
                    trace::display_paths(&a.traces)
                );
            }
            n > 0
        }
    };
    if mooncake {
        if a.traces.len() != 1 {
            bail!(
                "replay one Mooncake trace at a time (got {})",
                a.traces.len()
            );
        }
        let t = trace::read_mooncake(&a.traces[0], &opts)?;
        let skipped = t.skipped.clone();
        Ok((Workload::Mooncake(t), skipped, trace::MOONCAKE_BLOCK_TOKENS))
    } else {
        let (s, skipped) = trace::read_sessions(&a.traces, &opts)?;
        let bt = s[0].block_tokens;
        Ok((Workload::Sessions(s), skipped, bt))
    }
}

/// The replay's result.
#[derive(Serialize)]
pub struct ReplayReport {
    pub trace: String,
    pub format: &'static str,
    pub server: String,
    /// File system of the embedded NVMe tier.
    pub nvme_fs: Option<String>,
    pub model: ModelProfile,
    /// Capacity of each tier and of the simulations, in blocks and tokens.
    pub capacity: Capacity,
    pub speedup: Option<f64>,
    pub max_inflight: usize,
    /// "lookup + load + verify", or "lookup only (nothing loaded or verified)".
    pub load: &'static str,
    /// Whether bytes went through the server's mapped arena (unix:// zero-copy).
    pub zero_copy: bool,
    pub sessions: Option<usize>,
    pub repeat: u32,
    pub worker: Worker,
    pub skipped: Skipped,
    pub overall: Overall,
    pub tiers: Vec<TierRow>,
    pub policies: Policies,
    pub ttft: Option<Ttft>,
    /// Cumulative hit rate after each share of the requests: (requests, hit rate).
    pub timeline: Vec<(u64, f64)>,
    /// With `--window-s`: the requests that began in each window of wall time.
    pub windows: Vec<Window>,
}

/// The requests that began in one window of wall time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Window {
    /// Since the replay began, seconds.
    pub start_s: f64,
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub hit_rate: f64,
    /// Requests served elsewhere than their route picked (`--failover`).
    pub rerouted: u64,
    pub corrupt_blocks: u64,
}

/// `records` in windows of `w` seconds by when each began, every window up to the last one
/// that has a request (empty ones included, so a stall shows).
pub fn windows(records: &[Record], w: f64) -> Vec<Window> {
    let mut out: Vec<Window> = Vec::new();
    for r in records {
        let i = (r.start.as_secs_f64() / w) as usize;
        while out.len() <= i {
            out.push(Window {
                start_s: out.len() as f64 * w,
                ..Window::default()
            });
        }
        let x = &mut out[i];
        x.requests += 1;
        x.blocks += r.ids.len() as u64;
        x.hit_blocks += r.served.hit_blocks as u64;
        x.rerouted += u64::from(r.served.rerouted);
        x.corrupt_blocks += r.served.corrupt_blocks as u64;
    }
    for x in &mut out {
        x.hit_rate = x.hit_blocks as f64 / x.blocks.max(1) as f64;
    }
    out
}

#[derive(Serialize)]
pub struct Capacity {
    pub dram_blocks: u64,
    pub nvme_blocks: u64,
    pub demotion: String,
    /// Distinct blocks the server can hold (write-through: the larger tier; write-back: both)
    /// = the simulations' capacity.
    pub simulated_blocks: u64,
    pub simulated_tokens: u64,
}

#[derive(Serialize)]
pub struct Worker {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Whether the prefill rate was given (else the default, used only for timing).
    pub given: bool,
}

#[derive(Serialize, Default)]
pub struct Overall {
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub hit_rate: f64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub put_blocks: u64,
    pub stored_blocks: u64,
    /// Blocks the replay loaded whose bytes failed verification (must be 0).
    pub corrupt_blocks: u64,
    /// Blocks a lookup reported but the load did not deliver.
    pub lost_between_lookup_and_load: u64,
    /// A fleet with `--failover`: requests served elsewhere than their route picked, and
    /// the servers' failures behind them.
    pub rerouted_requests: u64,
    pub server_errors: u64,
    /// Lookups whose prefix the server held until the load, and lookups it refused a hold
    /// (its hold budget spent), from the server's statistics.
    pub lookup_holds: u64,
    pub lookup_holds_refused: u64,
    /// Lookups the client answered from the server's published slot table, with no round
    /// trip (`ClientConfig::fast_local_lookups`; Unix socket with the arena).
    pub lookups_in_place: u64,
    /// Where retention hints came from (`--hints`), and the server's counts of them:
    /// accepted, refused (a budget, or too far), honoured (the session came back while
    /// protected), expired (its hold ended first).
    pub hints: String,
    pub hints_accepted: u64,
    pub hints_refused: u64,
    pub hints_honoured: u64,
    pub hints_expired: u64,
    pub busy_answers: u64,
    pub bytes_loaded: u64,
    pub bytes_stored: u64,
    pub wall_s: f64,
    /// Until the last request finished, its model time included.
    pub span_s: f64,
    pub requests_per_s: f64,
    pub load_ms_p50: f64,
    pub load_ms_p99: f64,
    /// How late requests started against their due time (open loop), ms.
    pub lag_ms_p99: f64,
    pub lag_ms_max: f64,
    pub peak_rss_bytes: Option<u64>,
}

#[derive(Serialize)]
pub struct TierRow {
    pub tier: String,
    /// Hits the client saw from this tier.
    pub hit_blocks: u64,
    pub hit_share: f64,
    pub bytes_loaded: u64,
    /// The server's counters over the replay.
    pub server: Option<TierCounters>,
}

#[derive(Serialize)]
pub struct Policies {
    pub capacity_blocks: u64,
    pub measured: f64,
    pub default_simulated: f64,
    pub lru: f64,
    pub optimum: f64,
    pub unlimited: f64,
    /// Share of the LRU-to-optimum gap the measured run closes.
    pub gap_closed: f64,
}

#[derive(Serialize)]
pub struct Ttft {
    pub prefill_tok_s: f64,
    /// Sum over requests of input tokens / prefill rate.
    pub recompute_s: f64,
    /// Sum over requests of missed tokens / prefill rate + measured load time.
    pub with_cache_s: f64,
    pub saved_s: f64,
    pub saved_per_request_ms: f64,
    /// Requests whose load took longer than recomputing the hit tokens would have.
    pub loads_slower_than_recompute: u64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The requests in serving order as the simulator wants them (ids made global by scope).
pub fn simulated_trace(records: &[Record]) -> Vec<TraceRequest> {
    let mut clock_ms = 0u64;
    records
        .iter()
        .map(|r| {
            clock_ms = clock_ms.max((r.model_due_s * 1000.0) as u64);
            TraceRequest {
                timestamp_ms: clock_ms,
                block_ids: r
                    .ids
                    .iter()
                    .map(|id| (u64::from(r.scope) << 32) | id)
                    .collect(),
                blocks_to_store: r.blocks_to_store,
            }
        })
        .collect()
}

/// Writes `sim` as Mooncake JSONL: one line a request, ids renumbered densely, every block
/// stored (`input_length` a whole number of 512-token blocks).
fn write_order(path: &Path, sim: &[TraceRequest]) -> Result<()> {
    use std::io::Write;
    let f = std::fs::File::create(path)
        .with_context(|| format!("creating --order-out {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    // Renumbered densely in order of first appearance, as the Mooncake files are.
    let mut ids = std::collections::HashMap::new();
    for r in sim {
        let hash_ids: Vec<u64> = r
            .block_ids
            .iter()
            .map(|id| {
                let n = ids.len() as u64;
                *ids.entry(*id).or_insert(n)
            })
            .collect();
        let line = serde_json::json!({
            "timestamp": r.timestamp_ms,
            "input_length": r.block_ids.len() as u64 * u64::from(trace::MOONCAKE_BLOCK_TOKENS),
            "output_length": 0,
            "hash_ids": hash_ids,
        });
        writeln!(w, "{line}")?;
    }
    w.flush()
        .with_context(|| format!("writing --order-out {}", path.display()))
}

pub fn run(a: &ReplayArgs, seed: u64) -> Result<ReplayReport> {
    if a.max_inflight == 0 || a.sessions == 0 || a.repeat == 0 {
        bail!("--max-inflight, --sessions and --repeat must be at least 1");
    }
    if let Some(p) = a.prefill_tok_s
        && !(p.is_finite() && p > 0.0)
    {
        bail!("--prefill-tok-s must be a positive number");
    }
    if !(a.decode_tok_s.is_finite() && a.decode_tok_s > 0.0) {
        bail!("--decode-tok-s must be a positive number");
    }
    let (work, skipped, block_tokens) = read_workload(a)?;
    let (layout, model_name) = layout_for(a, block_tokens)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(a, seed, work, skipped, layout, model_name))
}

async fn run_async(
    a: &ReplayArgs,
    seed: u64,
    work: Workload,
    skipped: Skipped,
    layout: KvLayout,
    model_name: String,
) -> Result<ReplayReport> {
    let bt = u64::from(layout.block_tokens());
    let (embedded, urls) = match a.servers.is_empty() {
        false => (None, a.servers.clone()),
        true => {
            let dram_blocks = a.dram_tokens / bt;
            if dram_blocks == 0 {
                bail!(
                    "--dram-tokens {} is less than one {bt}-token block",
                    a.dram_tokens
                );
            }
            let nvme_base = match &a.nvme_dir {
                Some(d) => d.clone(),
                None => {
                    let local = PathBuf::from("kvtier-data/bench");
                    if std::fs::create_dir_all(&local).is_ok()
                        && crate::util::check_writable(&local).is_ok()
                    {
                        local
                    } else {
                        std::env::temp_dir()
                    }
                }
            };
            let e = Embedded::start(&EmbeddedConfig {
                layout,
                dram_blocks,
                nvme_blocks: a.nvme_tokens / bt,
                nvme_base,
                demotion: a.demotion.clone(),
                sets: a.sets.clone(),
            })
            .await?;
            let url = e.url.clone();
            (Some(e), vec![url])
        }
    };
    let nvme_fs = embedded.as_ref().and_then(|e| e.nvme_fs.clone());
    let result = replay_against(
        a,
        seed,
        &work,
        skipped,
        layout,
        model_name,
        &urls,
        embedded.is_some(),
    )
    .await
    .map(|mut r| {
        r.nvme_fs = nvme_fs;
        r
    });
    if let Some(e) = embedded {
        e.stop().await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn replay_against(
    a: &ReplayArgs,
    seed: u64,
    work: &Workload,
    skipped: Skipped,
    layout: KvLayout,
    model_name: String,
    urls: &[String],
    embedded: bool,
) -> Result<ReplayReport> {
    let bt = layout.block_tokens();
    let mut clients = Vec::with_capacity(urls.len());
    for url in urls {
        clients.push(
            backend::connect(url, a.token.as_deref(), a.quic_cert.as_deref(), !a.copy).await?,
        );
    }
    let block_bytes = clients[0].block_bytes() as u64;
    if let Some((u, c)) = urls
        .iter()
        .zip(&clients)
        .find(|(_, c)| c.block_bytes() as u64 != block_bytes)
    {
        bail!(
            "the servers' blocks differ: {} bytes at {}, {} at {u}",
            block_bytes,
            urls[0],
            c.block_bytes()
        );
    }
    if embedded && block_bytes != layout.block_bytes() {
        bail!(
            "the embedded server has {block_bytes}-byte blocks, the model profile {}",
            layout.block_bytes()
        );
    }
    let before_json = backend::fleet_stats(&clients).await?;
    let in_place = |cs: &[kvtier_client::Client]| cs.iter().map(|c| c.fast_lookups()).sum::<u64>();
    let in_place_before = in_place(&clients);
    let before = backend::sum_stats(&before_json)?;
    let slots = |name: &str| {
        before
            .iter()
            .find(|t| t.tier_name() == name)
            .map_or(0, |t| t.capacity_slots)
    };
    let (dram_blocks, nvme_blocks) = (slots("dram"), slots("nvme"));
    let simulated_blocks = if a.demotion == "write-back" {
        dram_blocks + nvme_blocks
    } else {
        dram_blocks.max(nvme_blocks)
    };
    if simulated_blocks == 0 {
        bail!("the server reports no tier capacity");
    }
    let worker = WorkerProfile {
        prefill_tok_s: a.prefill_tok_s.unwrap_or(DEFAULT_PREFILL_TOK_S),
        decode_tok_s: a.decode_tok_s,
    };
    let cfg = ScheduleConfig {
        speedup: a.speedup.0,
        max_inflight: a.max_inflight,
        sessions: a.sessions,
        block_tokens: bt,
        worker,
        seed,
        hints: a.hints,
    };
    let backend = Arc::new(
        Fleet::new(
            clients
                .iter()
                .map(|c| ClientBackend::new(c.clone(), a.lookup_only))
                .collect::<Result<_>>()?,
            a.route,
        )
        .failover(a.failover),
    );
    let (total, trace_name, format) = match work {
        Workload::Mooncake(t) => (
            t.requests.len() as u64,
            t.path.display().to_string(),
            "mooncake",
        ),
        Workload::Sessions(s) => (
            s.iter().map(|s| s.calls() as u64).sum::<u64>() * u64::from(a.repeat),
            format!(
                "{} session(s) from {}",
                s.len(),
                trace::display_paths(&a.traces)
            ),
            "claude-code",
        ),
    };
    let pb = crate::report::bar(total, "replay requests");
    let t0 = Instant::now();
    let records = match work {
        Workload::Mooncake(t) => {
            schedule::run_mooncake(
                backend,
                &t.requests,
                a.full_blocks_only,
                cfg,
                Some(pb.clone()),
            )
            .await?
        }
        Workload::Sessions(s) => {
            schedule::run_sessions(backend, s, a.repeat, cfg, Some(pb.clone())).await?
        }
    };
    let wall_s = t0.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let after_json = backend::fleet_stats(&clients).await?;
    let after = backend::sum_stats(&after_json)?;
    let holds = |js: &[String]| {
        js.iter()
            .map(|j| backend::parse_holds(j))
            .fold((0, 0), |(h, r), (a, b)| (h + a, r + b))
    };
    let (h0, r0) = holds(&before_json);
    let (h1, r1) = holds(&after_json);
    let (k0, k1) = (
        backend::parse_retain(&before_json),
        backend::parse_retain(&after_json),
    );
    let server_tiers: Vec<TierCounters> = after
        .iter()
        .map(|t| match before.iter().find(|b| b.tier == t.tier) {
            Some(b) => t.since(b),
            None => t.clone(),
        })
        .collect();

    // Overall and per tier, from what the client saw.
    let mut o = Overall {
        requests: records.len() as u64,
        wall_s,
        lookup_holds: h1.saturating_sub(h0),
        lookup_holds_refused: r1.saturating_sub(r0),
        lookups_in_place: in_place(&clients) - in_place_before,
        hints: format!("{:?}", a.hints).to_lowercase(),
        hints_accepted: k1.accepted.saturating_sub(k0.accepted),
        hints_refused: (k1.refused_namespace + k1.refused_global + k1.refused_too_far)
            .saturating_sub(k0.refused_namespace + k0.refused_global + k0.refused_too_far),
        hints_honoured: k1.honoured.saturating_sub(k0.honoured),
        hints_expired: k1.expired.saturating_sub(k0.expired),
        ..Overall::default()
    };
    let mut tier_hits = [0u64; 3];
    let mut loads = Vec::with_capacity(records.len());
    let mut lags = Vec::with_capacity(records.len());
    for r in &records {
        let s = &r.served;
        o.blocks += r.ids.len() as u64;
        o.hit_blocks += s.hit_blocks as u64;
        o.input_tokens += r.input_tokens;
        o.hit_tokens += r.hit_tokens(bt);
        o.put_blocks += s.put_blocks as u64;
        o.stored_blocks += s.stored_blocks as u64;
        o.corrupt_blocks += s.corrupt_blocks as u64;
        o.lost_between_lookup_and_load +=
            s.lookup_blocks
                .saturating_sub(s.hit_blocks + s.corrupt_blocks) as u64;
        o.busy_answers += s.busy as u64;
        o.rerouted_requests += u64::from(s.rerouted);
        o.server_errors += s.server_errors as u64;
        for t in &s.tiers {
            if let Some(c) = tier_hits.get_mut(usize::from(*t)) {
                *c += 1;
            }
        }
        loads.push(s.load_s * 1000.0);
        lags.push(r.start.saturating_sub(r.due).as_secs_f64() * 1000.0);
    }
    o.hit_rate = if o.blocks == 0 {
        0.0
    } else {
        o.hit_blocks as f64 / o.blocks as f64
    };
    o.bytes_loaded = o.hit_blocks * block_bytes;
    o.bytes_stored = o.put_blocks * block_bytes;
    o.requests_per_s = o.requests as f64 / wall_s.max(1e-9);
    o.span_s = records
        .iter()
        .map(|r| r.finish.as_secs_f64())
        .fold(0.0, f64::max);
    loads.sort_by(f64::total_cmp);
    lags.sort_by(f64::total_cmp);
    o.load_ms_p50 = percentile(&loads, 0.5);
    o.load_ms_p99 = percentile(&loads, 0.99);
    o.lag_ms_p99 = percentile(&lags, 0.99);
    o.lag_ms_max = lags.last().copied().unwrap_or(0.0);
    o.peak_rss_bytes = crate::util::peak_rss_bytes("self");
    let tiers: Vec<TierRow> = ["hbm", "dram", "nvme"]
        .iter()
        .enumerate()
        .filter_map(|(i, name)| {
            let server = server_tiers
                .iter()
                .find(|t| t.tier_name() == *name)
                .cloned();
            if server.is_none() && tier_hits[i] == 0 {
                return None;
            }
            Some(TierRow {
                tier: (*name).to_owned(),
                hit_blocks: tier_hits[i],
                hit_share: if o.blocks == 0 {
                    0.0
                } else {
                    tier_hits[i] as f64 / o.blocks as f64
                },
                bytes_loaded: tier_hits[i] * block_bytes,
                server,
            })
        })
        .collect();

    // The same requests, in the same order, simulated at the same capacity.
    let sim = simulated_trace(&records);
    if let Some(path) = &a.order_out {
        write_order(path, &sim)?;
    }
    let lru = replay(&sim, simulated_blocks, EvictionKind::Lru)?.hit_rate();
    let def = replay(&sim, simulated_blocks, EvictionKind::default())?.hit_rate();
    let opt = optimum(&sim, simulated_blocks);
    let unl = unlimited(&sim);
    let gap = opt - lru;
    let policies = Policies {
        capacity_blocks: simulated_blocks,
        measured: o.hit_rate,
        default_simulated: def,
        lru,
        optimum: opt,
        unlimited: unl,
        gap_closed: if gap > 1e-12 {
            (o.hit_rate - lru) / gap
        } else {
            0.0
        },
    };

    let ttft = a.prefill_tok_s.map(|x| {
        let mut t = Ttft {
            prefill_tok_s: x,
            recompute_s: 0.0,
            with_cache_s: 0.0,
            saved_s: 0.0,
            saved_per_request_ms: 0.0,
            loads_slower_than_recompute: 0,
        };
        for r in &records {
            let hit = r.hit_tokens(bt) as f64;
            t.recompute_s += r.input_tokens as f64 / x;
            t.with_cache_s += (r.input_tokens as f64 - hit) / x + r.served.load_s;
            if r.served.hit_blocks > 0 && r.served.load_s > hit / x {
                t.loads_slower_than_recompute += 1;
            }
        }
        t.saved_s = t.recompute_s - t.with_cache_s;
        t.saved_per_request_ms = t.saved_s * 1000.0 / records.len().max(1) as f64;
        t
    });

    let mut timeline = Vec::new();
    let step = records.len().div_ceil(TIMELINE_POINTS).max(1);
    let (mut hits, mut blocks) = (0u64, 0u64);
    for (i, r) in records.iter().enumerate() {
        hits += r.served.hit_blocks as u64;
        blocks += r.ids.len() as u64;
        if (i + 1) % step == 0 || i + 1 == records.len() {
            timeline.push(((i + 1) as u64, hits as f64 / blocks.max(1) as f64));
        }
    }

    Ok(ReplayReport {
        trace: trace_name,
        format,
        server: if embedded {
            format!("embedded ({})", urls[0])
        } else if urls.len() == 1 {
            urls[0].clone()
        } else {
            format!(
                "{} servers, routed by {}: {}",
                urls.len(),
                a.route.name(),
                urls.join(", ")
            )
        },
        nvme_fs: None,
        model: ModelProfile {
            name: model_name,
            layers: layout.num_layers(),
            kv_heads: layout.num_kv_heads(),
            head_dim: layout.head_dim(),
            dtype: layout.dtype().name().to_owned(),
            block_tokens: bt,
            block_bytes,
        },
        capacity: Capacity {
            dram_blocks,
            nvme_blocks,
            demotion: a.demotion.clone(),
            simulated_blocks,
            simulated_tokens: simulated_blocks * u64::from(bt),
        },
        speedup: a.speedup.0,
        max_inflight: a.max_inflight,
        load: if a.lookup_only {
            "lookup only (nothing loaded or verified)"
        } else {
            "lookup + load + verify"
        },
        zero_copy: clients.iter().all(|c| c.is_local()),
        sessions: matches!(work, Workload::Sessions(_)).then_some(a.sessions),
        repeat: a.repeat,
        worker: Worker {
            prefill_tok_s: worker.prefill_tok_s,
            decode_tok_s: worker.decode_tok_s,
            given: a.prefill_tok_s.is_some(),
        },
        skipped,
        overall: o,
        tiers,
        policies,
        ttft,
        timeline,
        windows: a.window_s.map_or_else(Vec::new, |w| windows(&records, w)),
    })
}

/// A replay that loaded corrupt blocks fails (after its report is printed).
pub fn fail_on_corruption(corrupt_blocks: u64) -> Result<()> {
    if corrupt_blocks > 0 {
        bail!("{corrupt_blocks} loaded block(s) failed verification (checksum or key)");
    }
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.2}", x * 100.0)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

impl Report for ReplayReport {
    fn tables(&self) -> Vec<Table> {
        let o = &self.overall;
        let m = &self.model;
        let speed = self
            .speedup
            .map_or("max (no waits)".to_owned(), |s| format!("{s}x"));
        let mut rows = vec![
            ("trace", format!("{} ({})", self.trace, self.format)),
            (
                "server",
                match &self.nvme_fs {
                    Some(fs) => format!("{}; NVMe tier on {fs}", self.server),
                    None => self.server.clone(),
                },
            ),
            (
                "model profile",
                format!(
                    "{}: {} layers x {} kv heads x {} dims, {}; {} tokens = {} B a block",
                    m.name,
                    m.layers,
                    m.kv_heads,
                    m.head_dim,
                    m.dtype,
                    m.block_tokens,
                    m.block_bytes
                ),
            ),
            (
                "capacity (blocks)",
                format!(
                    "dram {} + nvme {} ({}); simulated {} = {} tokens",
                    self.capacity.dram_blocks,
                    self.capacity.nvme_blocks,
                    self.capacity.demotion,
                    self.capacity.simulated_blocks,
                    self.capacity.simulated_tokens
                ),
            ),
            (
                "requests",
                format!(
                    "{}; bytes {}",
                    self.load,
                    if self.zero_copy {
                        "through the mapped arena (zero-copy)"
                    } else {
                        "over the socket"
                    }
                ),
            ),
            (
                "timing",
                format!(
                    "speedup {speed}, max in flight {}{}, worker prefill {} tok/s{}, decode {} tok/s",
                    self.max_inflight,
                    self.sessions.map_or(String::new(), |s| format!(
                        ", sessions at once {s}, repeat {}",
                        self.repeat
                    )),
                    self.worker.prefill_tok_s,
                    if self.worker.given { "" } else { " (default)" },
                    self.worker.decode_tok_s
                ),
            ),
        ];
        if self.skipped.count > 0 {
            rows.push((
                "skipped (bad input)",
                format!("{}: {}", self.skipped.count, self.skipped.first.join("; ")),
            ));
        }
        let title: Vec<String> = rows.iter().map(|(k, v)| format!("{k}: {v}")).collect();

        let mut overall = Table::new(
            format!("{}\n\noverall", title.join("\n")),
            &["metric", "value"],
        );
        for (k, v) in [
            ("requests", o.requests.to_string()),
            ("blocks", o.blocks.to_string()),
            ("hit blocks", o.hit_blocks.to_string()),
            ("hit rate %", pct(o.hit_rate)),
            (
                "hit tokens",
                format!("{} of {}", o.hit_tokens, o.input_tokens),
            ),
            (
                "blocks put / stored",
                format!("{} / {}", o.put_blocks, o.stored_blocks),
            ),
            (
                "corrupt blocks seen (must be 0)",
                o.corrupt_blocks.to_string(),
            ),
            (
                "lost between lookup and load",
                o.lost_between_lookup_and_load.to_string(),
            ),
            (
                "lookups held / refused a hold",
                format!("{} / {}", o.lookup_holds, o.lookup_holds_refused),
            ),
            (
                "lookups answered in place (no round trip)",
                o.lookups_in_place.to_string(),
            ),
            (
                "hints (source): accepted / refused / honoured / expired",
                format!(
                    "({}) {} / {} / {} / {}",
                    o.hints, o.hints_accepted, o.hints_refused, o.hints_honoured, o.hints_expired
                ),
            ),
            ("busy answers", o.busy_answers.to_string()),
            (
                "requests rerouted (failover) / server failures",
                format!("{} / {}", o.rerouted_requests, o.server_errors),
            ),
            (
                "MiB loaded / stored",
                format!("{} / {}", mib(o.bytes_loaded), mib(o.bytes_stored)),
            ),
            (
                "load ms p50 / p99",
                format!("{:.3} / {:.3}", o.load_ms_p50, o.load_ms_p99),
            ),
            (
                "start lag ms p99 / max",
                format!("{:.1} / {:.1}", o.lag_ms_p99, o.lag_ms_max),
            ),
            (
                "wall s (last finish, model time included)",
                format!("{:.2} ({:.2})", o.wall_s, o.span_s),
            ),
            ("requests/s", format!("{:.0}", o.requests_per_s)),
            (
                "peak RSS MiB (bench + embedded server)",
                o.peak_rss_bytes.map_or("?".into(), mib),
            ),
        ] {
            overall.row([k.to_owned(), v]);
        }

        let mut tiers = Table::new(
            "per tier (hits seen by the client; the rest: the server's counters over the replay)",
            &[
                "tier",
                "hit blocks",
                "hit %",
                "MiB loaded",
                "MiB in",
                "MiB out",
                "evictions",
                "demotions",
                "promotions",
                "corrupt dropped",
                "used / capacity slots",
            ],
        );
        for t in &self.tiers {
            let s = t.server.clone().unwrap_or_default();
            tiers.row([
                t.tier.clone(),
                t.hit_blocks.to_string(),
                pct(t.hit_share),
                mib(t.bytes_loaded),
                mib(s.bytes_in),
                mib(s.bytes_out),
                s.evictions.to_string(),
                s.demotions.to_string(),
                s.promotions.to_string(),
                s.corrupt_dropped.to_string(),
                format!("{} / {}", s.used_slots, s.capacity_slots),
            ]);
        }

        let p = &self.policies;
        let mut pol = Table::new(
            format!(
                "hit rate against policies simulated on the same requests in the same order, {} blocks",
                p.capacity_blocks
            ),
            &[
                "measured %",
                "default (simulated) %",
                "lru %",
                "optimum %",
                "unlimited %",
                "gap closed %",
            ],
        );
        pol.row([
            pct(p.measured),
            pct(p.default_simulated),
            pct(p.lru),
            pct(p.optimum),
            pct(p.unlimited),
            format!("{:.1}", p.gap_closed * 100.0),
        ]);
        let mut out = vec![overall, tiers, pol];
        if let Some(t) = &self.ttft {
            let mut tt = Table::new(
                format!(
                    "TTFT against recomputing, prefill {} tok/s",
                    t.prefill_tok_s
                ),
                &[
                    "recompute s",
                    "with cache s",
                    "saved s",
                    "saved ms / request",
                    "loads slower than recompute",
                ],
            );
            tt.row([
                format!("{:.2}", t.recompute_s),
                format!("{:.2}", t.with_cache_s),
                format!("{:.2}", t.saved_s),
                format!("{:.2}", t.saved_per_request_ms),
                t.loads_slower_than_recompute.to_string(),
            ]);
            out.push(tt);
        }
        if !self.windows.is_empty() {
            let mut w = Table::new(
                "by window of wall time (requests by when they began)",
                &[
                    "from s",
                    "requests",
                    "blocks",
                    "hit %",
                    "rerouted",
                    "corrupt blocks",
                ],
            );
            for x in &self.windows {
                w.row([
                    format!("{:.1}", x.start_s),
                    x.requests.to_string(),
                    x.blocks.to_string(),
                    pct(x.hit_rate),
                    x.rerouted.to_string(),
                    x.corrupt_blocks.to_string(),
                ]);
            }
            out.push(w);
        }
        out
    }

    fn plots(&self) -> Vec<Plot> {
        let p = &self.policies;
        vec![
            Plot {
                file: "replay-hit-rate".into(),
                title: format!("{}: cumulative hit rate", self.format),
                x_label: "requests served".into(),
                y_label: "hit rate %".into(),
                kind: PlotKind::Lines {
                    series: vec![Series {
                        name: "measured".into(),
                        points: self
                            .timeline
                            .iter()
                            .map(|(n, h)| (*n as f64, h * 100.0))
                            .collect(),
                    }],
                    log_x: false,
                },
            },
            Plot {
                file: "replay-policies".into(),
                title: format!("hit rate at {} blocks", p.capacity_blocks),
                x_label: "policy".into(),
                y_label: "hit rate %".into(),
                kind: PlotKind::Bars {
                    categories: vec![
                        "measured".into(),
                        "default (sim)".into(),
                        "lru".into(),
                        "optimum".into(),
                        "unlimited".into(),
                    ],
                    series: vec![(
                        "hit rate".into(),
                        vec![
                            p.measured * 100.0,
                            p.default_simulated * 100.0,
                            p.lru * 100.0,
                            p.optimum * 100.0,
                            p.unlimited * 100.0,
                        ],
                    )],
                },
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use kvtier_client::Client;
    use schedule::{Backend, Served};
    use std::time::Duration;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }

    fn args(list: &[&str]) -> ReplayArgs {
        let mut v = vec!["replay"];
        v.extend_from_slice(list);
        Cli::try_parse_from(v).unwrap().args
    }

    /// A small Mooncake trace with shared prefixes (ids renumbered like the real ones).
    fn mooncake_file(dir: &std::path::Path) -> PathBuf {
        let mut text = String::new();
        let mut next = 100u64;
        for i in 0..60u64 {
            // Three conversations that grow, and one-off requests.
            let conv = i % 4;
            let ids: Vec<u64> = if conv == 3 {
                next += 3;
                vec![0, next - 3, next - 2, next - 1]
            } else {
                (0..(2 + i / 4)).map(|k| conv * 1000 + k).collect()
            };
            let input = ids.len() as u64 * 512 - 100;
            text.push_str(&format!(
                "{{\"timestamp\": {}, \"input_length\": {input}, \"output_length\": 20, \"hash_ids\": {ids:?}}}\n",
                i * 10
            ));
        }
        let p = dir.join("mini.jsonl");
        std::fs::write(&p, text).unwrap();
        p
    }

    fn within<T>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T
    where
        T: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs))
            .expect("the replay did not finish in time")
    }

    /// An embedded server of 1,000 DRAM blocks of `layout`.
    async fn small_server(layout: KvLayout) -> Embedded {
        Embedded::start(&EmbeddedConfig {
            layout,
            dram_blocks: 1000,
            nvme_blocks: 0,
            nvme_base: std::env::temp_dir(),
            demotion: "write-through".into(),
            sets: vec![],
        })
        .await
        .unwrap()
    }

    /// Replays the mini trace against three separate embedded servers, routed by `route`.
    fn fleet_of_three(route: &str) -> ReplayReport {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        let a = args(&[
            "--trace",
            p.to_str().unwrap(),
            "--max-inflight",
            "1",
            "--route",
            route,
        ]);
        within(120, move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let (work, skipped, bt) = read_workload(&a).unwrap();
                let (layout, name) = layout_for(&a, bt).unwrap();
                let mut fleet = Vec::new();
                for _ in 0..3 {
                    fleet.push(small_server(layout).await);
                }
                let urls: Vec<String> = fleet.iter().map(|e| e.url.clone()).collect();
                let r = replay_against(&a, 7, &work, skipped, layout, name, &urls, false).await;
                for e in fleet {
                    e.stop().await;
                }
                r.unwrap()
            })
        })
    }

    /// A fleet of two servers, the first stopped after the fleet connected: without
    /// failover the request its route picks for the stopped one fails; with it, the request
    /// is served (and its blocks stored) by the other, counted as rerouted, and while the
    /// stopped one is passed over the next request goes straight to the other.
    #[test]
    fn a_fleet_with_failover_serves_what_a_stopped_server_fails_on_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        let a = args(&["--trace", p.to_str().unwrap()]);
        within(60, move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let (layout, _) = layout_for(&a, 512).unwrap();
                let (first, second) = (small_server(layout).await, small_server(layout).await);
                let mut clients = Vec::new();
                for e in [&first, &second] {
                    clients.push(backend::connect(&e.url, None, None, false).await.unwrap());
                }
                let fleet = |on: bool| {
                    Fleet::new(
                        clients
                            .iter()
                            .map(|c| ClientBackend::new(c.clone(), false).unwrap())
                            .collect(),
                        backend::Route::RoundRobin,
                    )
                    .failover(on)
                };
                first.stop().await;
                let keys: Vec<_> = (0..4).map(|i| payload::block_key(7, 1, i)).collect();

                // Round robin picks the stopped server first.
                let err = fleet(false).serve(keys.clone(), 4).await.unwrap_err();
                assert!(format!("{err:#}").contains("lookup"), "{err:#}");

                let f = fleet(true);
                let s = f.serve(keys.clone(), 4).await.unwrap();
                assert!(s.rerouted);
                assert_eq!(s.server_errors, 1);
                assert_eq!(s.stored_blocks, 4);
                // Picked for the stopped one again: passed over, no second failure.
                let _ = f.serve(keys.clone(), 4).await.unwrap();
                let s = f.serve(keys.clone(), 4).await.unwrap();
                assert!(s.rerouted);
                assert_eq!(s.server_errors, 0);
                assert_eq!(s.hit_blocks, 4, "stored by the first reroute, read back");
                second.stop().await;
            })
        });
    }

    #[test]
    fn windows_count_the_requests_that_began_in_each() {
        let rec = |start_ms: u64, blocks: usize, hits: usize, rerouted: bool| Record {
            seq: 0,
            scope: 0,
            ids: vec![0; blocks],
            blocks_to_store: blocks,
            input_tokens: 0,
            due: Duration::ZERO,
            start: Duration::from_millis(start_ms),
            finish: Duration::from_millis(start_ms),
            model_due_s: 0.0,
            served: Served {
                hit_blocks: hits,
                rerouted,
                ..Served::default()
            },
        };
        let w = windows(
            &[
                rec(100, 4, 2, false),
                rec(900, 4, 4, true),
                rec(3_200, 10, 1, false),
            ],
            1.0,
        );
        assert_eq!(w.len(), 4, "the empty windows between are kept: {w:?}");
        assert_eq!((w[0].requests, w[0].blocks, w[0].hit_blocks), (2, 8, 6));
        assert_eq!(w[0].rerouted, 1);
        assert!((w[0].hit_rate - 0.75).abs() < 1e-9);
        assert_eq!((w[1].requests, w[2].requests), (0, 0));
        assert_eq!(w[2].start_s, 2.0);
        assert!((w[3].hit_rate - 0.1).abs() < 1e-9);
        assert!(windows(&[], 1.0).is_empty());
        assert!(positive_seconds("0").is_err() && positive_seconds("nan").is_err());
        assert_eq!(positive_seconds("2.5"), Ok(2.5));
    }

    #[test]
    fn a_fleet_sums_its_servers_and_session_routing_keeps_conversations_together() {
        let rr = fleet_of_three("round-robin");
        let by_session = fleet_of_three("session");
        for r in [&rr, &by_session] {
            assert_eq!(r.capacity.dram_blocks, 3000, "capacity is the fleet's");
            assert_eq!(r.overall.requests, 60);
            assert_eq!(r.overall.corrupt_blocks, 0);
            assert!(r.server.starts_with("3 servers"), "{}", r.server);
            // The servers' own counters add up to what the client stored.
            let dram = r.tiers.iter().find(|t| t.tier == "dram").unwrap();
            assert_eq!(
                dram.server.as_ref().unwrap().used_slots,
                r.overall.stored_blocks,
                "{}",
                r.server
            );
        }
        // Three conversations of one request in four: round robin over three servers sends
        // each turn to another server than the last, so it misses what session routing hits
        // (measured: 79.6 % by session, 61.3 % round robin).
        assert!(
            by_session.overall.hit_rate > rr.overall.hit_rate + 0.1,
            "session {} vs round robin {}",
            by_session.overall.hit_rate,
            rr.overall.hit_rate
        );
    }

    #[test]
    fn a_large_cache_hits_exactly_what_an_unlimited_one_does() {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        for mode in ["--skip-bad", "--copy", "--lookup-only"] {
            let a = args(&[
                "--trace",
                p.to_str().unwrap(),
                "--dram-tokens",
                "1m",
                "--max-inflight",
                "1",
                "--prefill-tok-s",
                "5000",
                mode,
            ]);
            let r = within(60, move || run(&a, 7)).unwrap();
            let o = &r.overall;
            assert_eq!(o.requests, 60);
            assert_eq!(o.corrupt_blocks, 0);
            assert!(o.hit_blocks > 0);
            assert!(
                (r.policies.unlimited - o.hit_rate).abs() < 1e-12,
                "{mode}: {:?}",
                (r.policies.unlimited, o.hit_rate)
            );
            assert!((r.policies.optimum - o.hit_rate).abs() < 1e-12);
            assert_eq!(r.zero_copy, mode != "--copy");
            // Every hit came from DRAM (no NVMe tier), and every miss was stored.
            let dram = r.tiers.iter().find(|t| t.tier == "dram").unwrap();
            assert_eq!(dram.hit_blocks, o.hit_blocks);
            assert_eq!(o.stored_blocks, o.put_blocks);
            assert_eq!(o.put_blocks, o.blocks - o.hit_blocks);
            let t = r.ttft.as_ref().unwrap();
            assert!(t.recompute_s > t.with_cache_s);
            // The report renders.
            assert!(r.tables().iter().any(|t| t.render().contains("optimum")));
            assert_eq!(r.plots().len(), 2);
        }
    }

    #[test]
    fn a_small_cache_with_an_nvme_tier_evicts_and_stays_verified() {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        let a = args(&[
            "--trace",
            p.to_str().unwrap(),
            "--dram-tokens",
            "4096",
            "--nvme-tokens",
            "8192",
            "--nvme-dir",
            dir.path().to_str().unwrap(),
            "--max-inflight",
            "4",
        ]);
        let r = within(60, move || run(&a, 7)).unwrap();
        assert_eq!(r.capacity.dram_blocks, 8);
        assert_eq!(r.capacity.nvme_blocks, 16);
        assert_eq!(r.overall.corrupt_blocks, 0);
        let dram = r.tiers.iter().find(|t| t.tier == "dram").unwrap();
        assert!(
            dram.server.as_ref().unwrap().evictions > 0,
            "{:?}",
            dram.server
        );
        assert!(r.overall.hit_rate <= r.policies.unlimited + 1e-12);
        let by_tier: u64 = r.tiers.iter().map(|t| t.hit_blocks).sum();
        assert_eq!(by_tier, r.overall.hit_blocks);
    }

    #[test]
    fn the_claude_code_samples_replay_in_dependency_order() {
        let samples = trace::shared_traces_dir().join("claude-code-sample");
        let a = args(&[
            "--trace",
            samples.to_str().unwrap(),
            "--dram-tokens",
            "10m",
            "--max-inflight",
            "1",
            "--sessions",
            "3",
            "--repeat",
            "2",
        ]);
        let r = within(120, move || run(&a, 7)).unwrap();
        assert_eq!(r.format, "claude-code");
        assert_eq!(r.overall.corrupt_blocks, 0);
        assert!(r.overall.hit_rate > 0.5, "{}", r.overall.hit_rate);
        // Copies have their own scopes: the second copy does not hit the first's blocks, so
        // the hit rate is that of an unlimited cache over the same requests, no more.
        assert!((r.policies.unlimited - r.overall.hit_rate).abs() < 1e-12);
    }

    #[test]
    fn a_corrupt_block_is_caught_and_not_counted_as_a_hit() {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        let a = args(&["--trace", p.to_str().unwrap(), "--max-inflight", "1"]);
        let seed = 7;
        let r = within(60, move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let (work, skipped, bt) = read_workload(&a).unwrap();
                let (layout, name) = layout_for(&a, bt).unwrap();
                let e = small_server(layout).await;
                // Before the replay, store a wrong payload under the shared first block: the
                // server holds it intact (its own checksums pass), our verification must not.
                let c = Client::connect(&e.url, kvtier_client::ClientConfig::default())
                    .await
                    .unwrap();
                let key = payload::block_key(seed, 0, 0);
                let mut bad = vec![0u8; c.block_bytes()];
                payload::fill(key, &mut bad);
                bad[100] ^= 1;
                let s = c.put_chain(&[key], None, &[&bad]).await;
                assert_eq!(s.cached(), 1);
                let urls = std::slice::from_ref(&e.url);
                let r = replay_against(&a, seed, &work, skipped, layout, name, urls, true).await;
                e.stop().await;
                r
            })
        })
        .unwrap();
        // Block 0 starts one request in four; each time it is found corrupt, nothing hits.
        assert!(
            r.overall.corrupt_blocks >= 15,
            "{}",
            r.overall.corrupt_blocks
        );
        assert!(r.overall.hit_rate < r.policies.unlimited);
    }

    #[test]
    fn an_unreachable_server_is_a_prompt_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        // A port nobody listens on, and a socket path that does not exist.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        for url in [
            format!("tcp://127.0.0.1:{port}"),
            format!("unix://{}/none.sock", dir.path().display()),
        ] {
            let a = args(&["--trace", p.to_str().unwrap(), "--server", &url]);
            let t = std::time::Instant::now();
            let e = within(10, move || run(&a, 7)).err().unwrap();
            let msg = format!("{e:#}");
            assert!(
                msg.contains("cannot reach the kvtier server") && msg.contains(&url),
                "{msg}"
            );
            assert!(t.elapsed() < backend::CONNECT_TIMEOUT + std::time::Duration::from_secs(2));
        }
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(parse_speedup("0").is_err());
        assert!(parse_speedup("-2").is_err());
        assert!(parse_speedup("nan").is_err());
        assert_eq!(parse_speedup("max"), Ok(Speedup(None)));
        assert_eq!(parse_speedup("60"), Ok(Speedup(Some(60.0))));
        let dir = tempfile::tempdir().unwrap();
        let p = mooncake_file(dir.path());
        let a = args(&["--trace", p.to_str().unwrap(), "--dram-tokens", "100"]);
        let e = format!("{:#}", run(&a, 1).err().unwrap());
        assert!(e.contains("--dram-tokens"), "{e}");
        let a = args(&["--trace", p.to_str().unwrap(), "--head-dim", "0"]);
        assert!(run(&a, 1).is_err());
    }
}

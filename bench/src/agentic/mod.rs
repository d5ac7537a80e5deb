//! `kvtier-bench agentic`: agentic sessions (a context that grows every turn, a harness prefix
//! shared by every session, long-tailed think gaps, subagents that branch and rejoin), generated
//! from a seed or mapped from Claude Code traces, driven closed-loop against OpenAI-compatible
//! endpoints; with several targets, the same workload against each, side by side.
//!
//! * [`workload`]: the session model and the seeded generator;
//! * [`trace`]: Claude Code traces mapped onto that model;
//! * [`http`]: the streaming `/v1/completions` client (over `kvtier_client::http`, timeouts);
//! * [`driver`]: the closed loop and what each request measured;
//! * [`spawn`]: configurations the benchmark starts itself (`--spawn NAME=KIND`);
//! * [`mock`]: a mock endpoint for tests and `mock://` smoke targets.
//!
//! The library entry point is [`run_comparison`]. Docs: docs/bench-agentic.md.

pub mod driver;
pub mod http;
pub mod mock;
pub mod spawn;
pub mod trace;
pub mod workload;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::report::{Plot, PlotKind, Report, Series, Table};
use driver::{DriveOptions, PromptFormat, RunData, TurnKind};
use spawn::{SpawnOptions, SpawnSpec};
use workload::{GenParams, Workload};

#[derive(clap::Args, Debug, Clone)]
pub struct AgenticArgs {
    /// Drive this endpoint: NAME=URL (http://HOST:PORT, or mock://?cache=off for the built-in
    /// mock). Repeatable; configurations run one after another in the order given.
    #[arg(long = "target", value_name = "NAME=URL")]
    pub targets: Vec<String>,
    /// Start this configuration and drive it: NAME=KIND [WORKER ARGS], KIND one of off, dram,
    /// dram+nvme, disagg, worker, fleet:POLICY[:N] (N workers with their own DRAM servers
    /// behind kvtier-router --policy POLICY). Repeatable; runs after the --target entries.
    #[arg(long = "spawn", value_name = "NAME=KIND [ARGS]")]
    pub spawns: Vec<String>,
    /// Claude Code trace files or directories of them (instead of the generator).
    #[arg(long = "claude-trace", value_name = "PATH")]
    pub claude_traces: Vec<PathBuf>,

    /// Sessions run at once (closed loop: a finished session is replaced by the next).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Sessions in the workload (trace mode: default one per trace file).
    #[arg(long)]
    pub sessions: Option<usize>,
    /// Real seconds per workload second of think gaps (0.05: a 20 s gap waits 1 s).
    #[arg(long, default_value_t = 0.05)]
    pub time_scale: f64,
    /// Gaps of at least this many workload seconds make the next turn an "after idle" turn.
    #[arg(long, default_value_t = 20.0)]
    pub long_idle_s: f64,
    /// Prompt plus output never exceeds this many tokens (the reference model's context: 8192);
    /// a session that would pass it ends there.
    #[arg(long, default_value_t = 8192)]
    pub max_context: usize,

    /// Turns of a session's main chain: uniform in [turns-min, turns-max].
    #[arg(long, default_value_t = 4)]
    pub turns_min: usize,
    #[arg(long, default_value_t = 12)]
    pub turns_max: usize,
    /// Tokens of the harness prefix (system prompt, tool definitions) every session shares.
    #[arg(long, default_value_t = 1024)]
    pub harness_tokens: usize,
    /// Per-session system/task context after the harness: uniform in [t/2, 3t/2].
    #[arg(long, default_value_t = 256)]
    pub task_tokens: usize,
    /// Mean tool-result tokens appended per turn (lognormal, shape 0.6).
    #[arg(long, default_value_t = 192)]
    pub tool_tokens: usize,
    /// Mean output tokens per turn (lognormal, shape 0.6, capped at 4x).
    #[arg(long, default_value_t = 32)]
    pub output_tokens: usize,
    /// Tool gap: lognormal with this median (workload seconds)...
    #[arg(long, default_value_t = 2.0)]
    pub tool_gap_median_s: f64,
    /// ...and this shape.
    #[arg(long, default_value_t = 1.0)]
    pub tool_gap_sigma: f64,
    /// Probability that a gap is a person thinking instead of a tool running.
    #[arg(long, default_value_t = 0.15)]
    pub human_prob: f64,
    /// Human gap: Pareto with this minimum (workload seconds)...
    #[arg(long, default_value_t = 20.0)]
    pub human_gap_min_s: f64,
    /// ...and this tail index (smaller: longer tail).
    #[arg(long, default_value_t = 1.3)]
    pub human_gap_alpha: f64,
    /// No gap is longer than this (workload seconds).
    #[arg(long, default_value_t = 900.0)]
    pub gap_cap_s: f64,
    /// Probability that a main-chain turn spawns subagents.
    #[arg(long, default_value_t = 0.1)]
    pub subagent_prob: f64,
    /// Subagents per spawn: uniform in [1, max].
    #[arg(long, default_value_t = 2)]
    pub subagents_max: usize,
    /// Turns per subagent: uniform in [1, max].
    #[arg(long, default_value_t = 3)]
    pub subagent_turns_max: usize,
    /// Tokens each subagent's result adds to the parent's context when it rejoins.
    #[arg(long, default_value_t = 96)]
    pub subagent_result_tokens: usize,
    /// Skew: the first this many sessions are hot, with a long task context
    /// (`--hot-task-tokens`) and twice `--turns-max` turns (up to `--max-context`).
    #[arg(long, default_value_t = 0)]
    pub hot_sessions: usize,
    /// A hot session's task context after the harness, in tokens.
    #[arg(long, default_value_t = 4096)]
    pub hot_task_tokens: usize,

    /// Trace mode: prompt and output lengths are multiplied by this.
    #[arg(long, default_value_t = 0.05)]
    pub token_scale: f64,
    /// Trace mode: output tokens per request at most.
    #[arg(long, default_value_t = 256)]
    pub max_output: usize,

    /// Model name sent in requests (and given to spawned workers).
    #[arg(long, default_value = "kvtier-tiny")]
    pub model: String,
    /// Prompts as token-id arrays (ids below 256) or as text (the same bytes).
    #[arg(long, value_enum, default_value_t = PromptFormat::Tokens)]
    pub prompt_format: PromptFormat,
    /// Bearer token for the endpoints, if they need one.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Connect timeout per request (ms).
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Total time a request may take, to its last byte (s).
    #[arg(long, default_value_t = 120)]
    pub request_timeout_s: u64,
    /// Stop a configuration's run after this many failed requests.
    #[arg(long, default_value_t = 50)]
    pub max_errors: usize,
    /// Goodput counts requests with TTFT at most this (ms)...
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// ...and mean inter-token latency at most this (ms).
    #[arg(long, default_value_t = 200.0)]
    pub slo_itl_ms: f64,

    /// kvtier-worker binary for --spawn (default: next to this executable).
    #[arg(long)]
    pub worker_bin: Option<PathBuf>,
    /// kvtier-server binary for --spawn (default: next to this executable).
    #[arg(long)]
    pub server_bin: Option<PathBuf>,
    /// kvtier-router binary for --spawn fleet (default: next to this executable).
    #[arg(long)]
    pub router_bin: Option<PathBuf>,
    /// DRAM tier of spawned dram and disagg servers.
    #[arg(long, default_value = "256MiB")]
    pub dram_bytes: String,
    /// DRAM tier of spawned dram+nvme servers (small, so blocks spill to NVMe).
    #[arg(long, default_value = "8MiB")]
    pub nvme_dram_bytes: String,
    /// NVMe tier of spawned dram+nvme servers.
    #[arg(long, default_value = "1GiB")]
    pub nvme_bytes: String,
    /// Extra server setting for spawned servers: section.key=value (repeatable).
    #[arg(long = "server-set", value_name = "SECTION.KEY=VALUE")]
    pub server_sets: Vec<String>,
    /// Temporary directories of spawned configurations (the NVMe tier lives here: put it on
    /// the disk to measure).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    pub scratch_dir: PathBuf,
    /// Seconds a spawned process may take to print its ready line.
    #[arg(long, default_value_t = 120)]
    pub startup_timeout_s: u64,
}

/// A configuration to drive.
#[derive(Clone, Debug)]
pub enum TargetSpec {
    /// An endpoint already running.
    Url { name: String, url: String },
    /// The built-in mock (`mock://?...`), started for the run.
    Mock { name: String, url: String },
    /// A configuration started for the run.
    Spawn(SpawnSpec),
}

impl TargetSpec {
    pub fn name(&self) -> &str {
        match self {
            TargetSpec::Url { name, .. } | TargetSpec::Mock { name, .. } => name,
            TargetSpec::Spawn(s) => &s.name,
        }
    }

    pub fn parse_target(s: &str) -> Result<Self, String> {
        let (name, url) = s
            .split_once('=')
            .ok_or_else(|| format!("--target {s:?}: expected NAME=URL"))?;
        let (name, url) = (name.trim().to_owned(), url.trim().to_owned());
        if name.is_empty() {
            return Err(format!("--target {s:?}: empty name"));
        }
        if url.starts_with("mock://") {
            mock::MockConfig::from_url(&url)?;
            Ok(TargetSpec::Mock { name, url })
        } else {
            http::Endpoint::parse(&url)?;
            Ok(TargetSpec::Url { name, url })
        }
    }
}

/// Builds the workload the arguments describe.
pub fn workload(a: &AgenticArgs, seed: u64) -> Result<Workload> {
    if a.claude_traces.is_empty() {
        let p = GenParams {
            sessions: a.sessions.unwrap_or(16),
            turns_min: a.turns_min,
            turns_max: a.turns_max,
            harness_tokens: a.harness_tokens,
            task_tokens: a.task_tokens,
            tool_tokens: a.tool_tokens,
            output_tokens: a.output_tokens,
            tool_gap_median_s: a.tool_gap_median_s,
            tool_gap_sigma: a.tool_gap_sigma,
            human_prob: a.human_prob,
            human_gap_min_s: a.human_gap_min_s,
            human_gap_alpha: a.human_gap_alpha,
            gap_cap_s: a.gap_cap_s,
            long_idle_s: a.long_idle_s,
            subagent_prob: a.subagent_prob,
            subagents_max: a.subagents_max,
            subagent_turns_max: a.subagent_turns_max,
            subagent_result_tokens: a.subagent_result_tokens,
            max_context: a.max_context,
            hot_sessions: a.hot_sessions,
            hot_task_tokens: a.hot_task_tokens,
        };
        workload::generate(&p, seed).map_err(|e| anyhow::anyhow!(e))
    } else {
        trace::load(
            &a.claude_traces,
            &trace::TraceParams {
                token_scale: a.token_scale,
                max_context: a.max_context,
                max_output: a.max_output,
                long_idle_s: a.long_idle_s,
                sessions: a.sessions,
            },
            seed,
        )
    }
}

/// Options of a comparison besides the workload and its targets.
#[derive(Clone, Debug)]
pub struct ComparisonOptions {
    pub drive: DriveOptions,
    pub spawn: SpawnOptions,
    pub slo_ttft_ms: f64,
    pub slo_itl_ms: f64,
}

/// `kvtier-bench agentic` from its arguments.
pub fn run(a: &AgenticArgs, seed: u64, progress: bool) -> Result<Comparison> {
    let mut targets = a
        .targets
        .iter()
        .map(|s| TargetSpec::parse_target(s))
        .collect::<Result<Vec<_>, String>>()
        .map_err(|e| anyhow::anyhow!(e))?;
    for s in &a.spawns {
        targets.push(TargetSpec::Spawn(
            SpawnSpec::parse(s).map_err(|e| anyhow::anyhow!(e))?,
        ));
    }
    if targets.is_empty() {
        bail!(
            "nothing to drive: give --target NAME=URL (an OpenAI-compatible endpoint) or \
             --spawn NAME=KIND (off, dram, dram+nvme, disagg)"
        );
    }
    let w = workload(a, seed)?;
    let o = ComparisonOptions {
        drive: DriveOptions {
            concurrency: a.concurrency,
            time_scale: a.time_scale,
            model: a.model.clone(),
            prompt_format: a.prompt_format,
            timeouts: http::Timeouts {
                connect: Duration::from_millis(a.connect_timeout_ms.max(1)),
                total: Duration::from_secs(a.request_timeout_s.max(1)),
            },
            api_key: a.api_key.clone(),
            max_errors: a.max_errors.max(1),
            progress,
        },
        spawn: SpawnOptions {
            worker_bin: a.worker_bin.clone(),
            server_bin: a.server_bin.clone(),
            router_bin: a.router_bin.clone(),
            seed,
            model: a.model.clone(),
            dram_bytes: a.dram_bytes.clone(),
            nvme_dram_bytes: a.nvme_dram_bytes.clone(),
            nvme_bytes: a.nvme_bytes.clone(),
            scratch_dir: a.scratch_dir.clone(),
            server_sets: a.server_sets.clone(),
            startup_timeout: Duration::from_secs(a.startup_timeout_s.max(1)),
        },
        slo_ttft_ms: a.slo_ttft_ms,
        slo_itl_ms: a.slo_itl_ms,
    };
    run_comparison(&w, &targets, &o)
}

/// Runs `w` against every target in turn (each spawned configuration alone on the machine,
/// stopped before the next starts) and returns the results side by side. Ctrl-C stops the run
/// and every child process.
pub fn run_comparison(
    w: &Workload,
    targets: &[TargetSpec],
    o: &ComparisonOptions,
) -> Result<Comparison> {
    let mut names = std::collections::HashSet::new();
    for t in targets {
        if !names.insert(t.name()) {
            bail!("configuration name {:?} given twice", t.name());
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut configs = Vec::new();
    let mut failures = Vec::new();
    for t in targets {
        let mut interrupted = false;
        let r = rt.block_on(async {
            tokio::select! {
                r = run_one(w, t, o) => r,
                _ = tokio::signal::ctrl_c() => {
                    interrupted = true;
                    Err(anyhow::anyhow!("interrupted"))
                }
            }
        });
        match r {
            Ok(c) => configs.push(c),
            Err(e) if interrupted => return Err(e),
            // A configuration that cannot start or be reached is reported in its column; the
            // others still run.
            Err(e) => {
                let msg = format!("{e:#}");
                eprintln!("configuration {:?} failed: {msg}", t.name());
                failures.push(format!("configuration {:?}: {msg}", t.name()));
                configs.push(ConfigResult::failed(t.name(), &msg, o));
            }
        }
    }
    if failures.len() == targets.len() {
        bail!("{}", failures.join("\n"));
    }
    Ok(Comparison {
        workload: WorkloadSummary::of(w, o),
        configs,
    })
}

async fn run_one(w: &Workload, t: &TargetSpec, o: &ComparisonOptions) -> Result<ConfigResult> {
    let mut notes = Vec::new();
    let (name, url, processes, data) = match t {
        TargetSpec::Url { name, url } => {
            let ep = http::Endpoint::parse(url).map_err(|e| anyhow::anyhow!(e))?;
            (
                name,
                url.clone(),
                Vec::new(),
                driver::drive(w, &ep, &o.drive).await?,
            )
        }
        TargetSpec::Mock { name, url } => {
            let cfg = mock::MockConfig::from_url(url).map_err(|e| anyhow::anyhow!(e))?;
            let m = mock::MockServer::start(cfg).await?;
            let ep = http::Endpoint::parse(&m.url()).map_err(|e| anyhow::anyhow!(e))?;
            let d = driver::drive(w, &ep, &o.drive).await?;
            (
                name,
                url.clone(),
                vec![format!("in-process mock at {}", m.url())],
                d,
            )
        }
        TargetSpec::Spawn(spec) => {
            let (spec2, so) = (spec.clone(), o.spawn.clone());
            let sp = tokio::task::spawn_blocking(move || spawn::start(&spec2, &so))
                .await
                .context("the start task failed")??;
            let ep = http::Endpoint::parse(&sp.url).map_err(|e| anyhow::anyhow!(e))?;
            let d = driver::drive(w, &ep, &o.drive).await;
            if matches!(spec.kind, spawn::Kind::Fleet { .. }) {
                notes = router_notes(&sp.url).await;
            }
            let procs = sp.describe.clone();
            let url = sp.url.clone();
            tokio::task::spawn_blocking(move || drop(sp)).await.ok();
            (&spec.name, url, procs, d?)
        }
    };
    let mut r = ConfigResult::of(name, &url, processes, &data, o);
    r.notes = notes;
    Ok(r)
}

/// What a spawned fleet's router counted: requests per worker, retries, the cached tokens it
/// predicted against those the workers reported, and (under `kv`) why it placed each request.
async fn router_notes(url: &str) -> Vec<String> {
    let client = kvtier_client::http::HttpClient::new(kvtier_client::http::HttpConfig::default());
    let text = match client.get(&format!("{url}/metrics")).await {
        Ok(r) if r.status == 200 => r.text(),
        Ok(r) => return vec![format!("router /metrics: HTTP {}", r.status)],
        Err(e) => return vec![format!("router /metrics: {e}")],
    };
    // Samples of `name`, with their label text.
    let samples = |name: &str| -> Vec<(String, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let (labels, value) = match rest.strip_prefix('{') {
                    Some(r) => {
                        let (labels, v) = r.split_once('}')?;
                        (labels.to_owned(), v)
                    }
                    None if rest.starts_with(' ') => (String::new(), rest),
                    None => return None,
                };
                Some((labels, value.trim().parse().ok()?))
            })
            .collect()
    };
    let sum = |name: &str| samples(name).iter().map(|(_, v)| v).sum::<f64>() + 0.0;
    let routed: Vec<String> = samples("kvtier_router_routed_total")
        .iter()
        .map(|(l, v)| format!("{v} ({l})"))
        .collect();
    let placed: Vec<String> = samples("kvtier_router_placements_total")
        .iter()
        .map(|(l, v)| format!("{v} ({l})"))
        .collect();
    let mut notes = vec![
        format!("router: requests per worker: {}", routed.join(", ")),
        format!(
            "router: retries {}; cached tokens predicted {} / reported by the workers {}",
            sum("kvtier_router_retries_total"),
            sum("kvtier_router_predicted_cached_tokens_total"),
            sum("kvtier_router_reported_cached_tokens_total")
        ),
    ];
    if !placed.is_empty() {
        notes.push(format!("router: placements: {}", placed.join(", ")));
    }
    notes
}

/// Percentiles of one metric (milliseconds unless said otherwise).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Pct {
    pub n: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub p99: Option<f64>,
}

impl Pct {
    pub fn of(mut v: Vec<f64>) -> Self {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        let q = |p: f64| {
            (!v.is_empty()).then(|| {
                let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
                v[i]
            })
        };
        Self {
            n: v.len(),
            mean: (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64),
            p50: q(0.50),
            p95: q(0.95),
            p99: q(0.99),
        }
    }
}

/// One configuration's figures.
#[derive(Clone, Debug, Serialize)]
pub struct ConfigResult {
    pub name: String,
    pub url: String,
    /// Processes the benchmark started for it.
    pub processes: Vec<String>,
    pub requests: usize,
    pub errors: usize,
    /// Up to five distinct error messages with their counts.
    pub error_samples: Vec<(String, usize)>,
    pub aborted: Option<String>,
    /// Why the configuration has no figures (it did not start or could not be reached).
    pub failed: Option<String>,
    pub wall_s: f64,
    pub ttft_first_ms: Pct,
    pub ttft_warm_ms: Pct,
    pub ttft_after_idle_ms: Pct,
    pub ttft_subagent_ms: Pct,
    pub ttft_all_ms: Pct,
    pub itl_ms: Pct,
    pub e2e_ms: Pct,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// Requests within both SLOs per second of the run.
    pub goodput_rps: f64,
    /// Share of all requests within both SLOs.
    pub goodput_share: f64,
    pub prompt_tokens: u64,
    /// Sum of `cached_tokens` when every successful response reported it.
    pub cached_tokens: Option<u64>,
    /// cached / prompt tokens; None ("unknown") when the endpoint does not report it.
    pub prefix_hit_rate: Option<f64>,
    /// Share of prompt tokens (whole 16-token blocks) that repeat the start of an earlier
    /// prompt: what an unlimited prefix cache could reuse.
    pub reusable_share: f64,
    pub peak_inflight: usize,
    pub peak_sessions: usize,
    /// What the configuration's own processes reported (a spawned fleet's router counts).
    pub notes: Vec<String>,
    /// Mean TTFT (ms) by main-chain turn index.
    pub ttft_by_turn: Vec<(usize, f64)>,
    #[serde(skip)]
    pub ttft_samples: Vec<f64>,
}

impl ConfigResult {
    pub fn of(
        name: &str,
        url: &str,
        processes: Vec<String>,
        d: &RunData,
        o: &ComparisonOptions,
    ) -> Self {
        let ok: Vec<(&driver::Record, &driver::Measured)> = d
            .records
            .iter()
            .filter_map(|r| r.outcome.as_ref().ok().map(|m| (r, m)))
            .collect();
        let ttft = |k: Option<TurnKind>| {
            Pct::of(
                ok.iter()
                    .filter(|(r, _)| k.is_none_or(|k| r.kind == k))
                    .map(|(_, m)| m.ttft_ms)
                    .collect(),
            )
        };
        let mut samples: Vec<(String, usize)> = Vec::new();
        for r in &d.records {
            if let Err(e) = &r.outcome {
                if let Some(s) = samples.iter_mut().find(|(m, _)| m == e) {
                    s.1 += 1;
                } else if samples.len() < 5 {
                    samples.push((e.clone(), 1));
                }
            }
        }
        let wall_s = d.wall.as_secs_f64().max(1e-9);
        let output_tokens: u64 = ok.iter().map(|(_, m)| m.output_tokens).sum();
        let good = ok
            .iter()
            .filter(|(_, m)| {
                let itl = if m.itl_ms.is_empty() {
                    0.0
                } else {
                    m.itl_ms.iter().sum::<f64>() / m.itl_ms.len() as f64
                };
                m.ttft_ms <= o.slo_ttft_ms && itl <= o.slo_itl_ms
            })
            .count();
        let prompt_tokens: u64 = ok
            .iter()
            .map(|(r, m)| m.usage_prompt_tokens.unwrap_or(r.prompt_tokens as u64))
            .sum();
        let cached_tokens = if ok.is_empty() {
            None
        } else {
            ok.iter().map(|(_, m)| m.cached_tokens).sum::<Option<u64>>()
        };
        let all_prompt: usize = d.records.iter().map(|r| r.prompt_tokens).sum();
        let reusable: usize = d.records.iter().map(|r| r.reusable_tokens).sum();
        let mut by_turn: std::collections::BTreeMap<usize, (f64, usize)> = Default::default();
        for (r, m) in &ok {
            if r.chain == 0 {
                let e = by_turn.entry(r.turn).or_default();
                e.0 += m.ttft_ms;
                e.1 += 1;
            }
        }
        Self {
            name: name.to_owned(),
            url: url.to_owned(),
            processes,
            requests: d.records.len(),
            errors: d.records.len() - ok.len(),
            error_samples: samples,
            aborted: d.aborted.clone(),
            failed: None,
            wall_s,
            ttft_first_ms: ttft(Some(TurnKind::First)),
            ttft_warm_ms: ttft(Some(TurnKind::Warm)),
            ttft_after_idle_ms: ttft(Some(TurnKind::AfterIdle)),
            ttft_subagent_ms: ttft(Some(TurnKind::Subagent)),
            ttft_all_ms: ttft(None),
            itl_ms: Pct::of(ok.iter().flat_map(|(_, m)| m.itl_ms.clone()).collect()),
            e2e_ms: Pct::of(ok.iter().map(|(_, m)| m.e2e_ms).collect()),
            output_tokens,
            output_tokens_per_s: output_tokens as f64 / wall_s,
            goodput_rps: good as f64 / wall_s,
            goodput_share: if d.records.is_empty() {
                0.0
            } else {
                good as f64 / d.records.len() as f64
            },
            prompt_tokens,
            cached_tokens,
            prefix_hit_rate: cached_tokens
                .filter(|_| prompt_tokens > 0)
                .map(|c| c as f64 / prompt_tokens as f64),
            reusable_share: if all_prompt == 0 {
                0.0
            } else {
                reusable as f64 / all_prompt as f64
            },
            peak_inflight: d.peak_inflight,
            peak_sessions: d.peak_sessions,
            notes: Vec::new(),
            ttft_by_turn: by_turn
                .into_iter()
                .map(|(t, (s, n))| (t, s / n as f64))
                .collect(),
            ttft_samples: ok.iter().map(|(_, m)| m.ttft_ms).collect(),
        }
    }
}

impl ConfigResult {
    /// A configuration that produced no figures.
    pub fn failed(name: &str, why: &str, o: &ComparisonOptions) -> Self {
        let empty = RunData {
            records: Vec::new(),
            wall: Duration::ZERO,
            peak_inflight: 0,
            peak_sessions: 0,
            aborted: None,
        };
        let mut c = Self::of(name, "", Vec::new(), &empty, o);
        c.failed = Some(why.to_owned());
        c
    }
}

impl Comparison {
    /// An error naming every configuration that failed, if one did.
    pub fn failures(&self) -> Result<()> {
        let f: Vec<String> = self
            .configs
            .iter()
            .filter_map(|c| {
                c.failed
                    .as_ref()
                    .map(|m| format!("configuration {:?}: {m}", c.name))
            })
            .collect();
        if f.is_empty() {
            Ok(())
        } else {
            bail!("{}", f.join("\n"))
        }
    }
}

/// What was run, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadSummary {
    pub source: String,
    pub sessions: usize,
    pub turns: usize,
    pub subagents: usize,
    pub truncated_turns: usize,
    pub concurrency: usize,
    pub time_scale: f64,
    pub long_idle_s: f64,
    pub prompt_format: PromptFormat,
    pub slo_ttft_ms: f64,
    pub slo_itl_ms: f64,
}

impl WorkloadSummary {
    fn of(w: &Workload, o: &ComparisonOptions) -> Self {
        Self {
            source: w.source.clone(),
            sessions: w.sessions.len(),
            turns: w.turns(),
            subagents: w.sessions.iter().map(|s| s.main.subagents()).sum(),
            truncated_turns: w.truncated_turns,
            concurrency: o.drive.concurrency,
            time_scale: o.drive.time_scale,
            long_idle_s: w.long_idle_s,
            prompt_format: o.drive.prompt_format,
            slo_ttft_ms: o.slo_ttft_ms,
            slo_itl_ms: o.slo_itl_ms,
        }
    }
}

/// The result of `kvtier-bench agentic`.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub workload: WorkloadSummary,
    pub configs: Vec<ConfigResult>,
}

fn f(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("unknown".into(), |x| format!("{:.1} %", x * 100.0))
}

impl Report for Comparison {
    fn tables(&self) -> Vec<Table> {
        let w = &self.workload;
        let mut wt = Table::new("agentic workload", &["parameter", "value"]);
        for (k, v) in [
            ("source", w.source.clone()),
            ("sessions", w.sessions.to_string()),
            ("turns (all chains)", w.turns.to_string()),
            ("subagents", w.subagents.to_string()),
            (
                "turns cut by the context limit",
                w.truncated_turns.to_string(),
            ),
            ("concurrency (sessions)", w.concurrency.to_string()),
            ("time scale", w.time_scale.to_string()),
            (
                "long idle at or above (workload s)",
                w.long_idle_s.to_string(),
            ),
            (
                "prompt format",
                format!("{:?}", w.prompt_format).to_lowercase(),
            ),
            (
                "goodput SLO",
                format!(
                    "TTFT <= {} ms, mean ITL <= {} ms",
                    w.slo_ttft_ms, w.slo_itl_ms
                ),
            ),
        ] {
            wt.row([k.to_string(), v]);
        }
        let mut cols: Vec<String> = vec!["metric".into()];
        cols.extend(self.configs.iter().map(|c| c.name.clone()));
        if let Some(first) = self.configs.first() {
            for c in self.configs.iter().skip(1) {
                cols.push(format!("{}/{}", c.name, first.name));
            }
        }
        let mut t = Table {
            title: "agentic comparison (latencies in ms; ratios against the first configuration)"
                .into(),
            columns: cols,
            rows: Vec::new(),
        };
        type Get = Box<dyn Fn(&ConfigResult) -> Option<f64>>;
        let pct_rows = |label: &str, g: fn(&ConfigResult) -> &Pct| -> Vec<(String, Get)> {
            vec![
                (
                    format!("{label} n"),
                    Box::new(move |c: &ConfigResult| Some(g(c).n as f64)) as Get,
                ),
                (format!("{label} p50"), Box::new(move |c| g(c).p50)),
                (format!("{label} p95"), Box::new(move |c| g(c).p95)),
                (format!("{label} p99"), Box::new(move |c| g(c).p99)),
            ]
        };
        let mut rows: Vec<(String, Get)> = vec![
            ("requests".into(), Box::new(|c| Some(c.requests as f64))),
            ("errors".into(), Box::new(|c| Some(c.errors as f64))),
            ("wall s".into(), Box::new(|c| Some(c.wall_s))),
        ];
        rows.extend(pct_rows("TTFT first turn", |c| &c.ttft_first_ms));
        rows.extend(pct_rows("TTFT warm turn", |c| &c.ttft_warm_ms));
        rows.extend(pct_rows("TTFT after long idle", |c| &c.ttft_after_idle_ms));
        rows.extend(pct_rows("TTFT subagent", |c| &c.ttft_subagent_ms));
        rows.extend(pct_rows("TTFT all", |c| &c.ttft_all_ms).into_iter().skip(1));
        rows.extend(pct_rows("ITL", |c| &c.itl_ms).into_iter().skip(1));
        rows.extend(pct_rows("e2e", |c| &c.e2e_ms).into_iter().skip(1));
        rows.push((
            "output tokens/s".into(),
            Box::new(|c| Some(c.output_tokens_per_s)),
        ));
        rows.push(("goodput req/s".into(), Box::new(|c| Some(c.goodput_rps))));
        rows.push((
            "goodput share %".into(),
            Box::new(|c| Some(c.goodput_share * 100.0)),
        ));
        rows.push((
            "prefix hit rate %".into(),
            Box::new(|c| c.prefix_hit_rate.map(|x| x * 100.0)),
        ));
        rows.push((
            "reusable prefix % (unlimited cache)".into(),
            Box::new(|c| Some(c.reusable_share * 100.0)),
        ));
        rows.push((
            "peak requests in flight".into(),
            Box::new(|c| Some(c.peak_inflight as f64)),
        ));
        for (label, g) in rows {
            let vals: Vec<Option<f64>> = self
                .configs
                .iter()
                .map(|c| if c.failed.is_some() { None } else { g(c) })
                .collect();
            let mut row = vec![label.clone()];
            for v in &vals {
                row.push(match v {
                    None if label == "prefix hit rate %" => "unknown".into(),
                    v => f(*v),
                });
            }
            let base = vals.first().copied().flatten();
            for v in vals.iter().skip(1) {
                row.push(match (v, base) {
                    (Some(v), Some(b)) if b != 0.0 && !label.ends_with(" n") => {
                        format!("{:.2}x", v / b)
                    }
                    _ => String::new(),
                });
            }
            t.row(row);
        }
        let mut out = vec![wt, t];
        // One left-aligned column: process command lines are long.
        let mut et = Table::new(
            "configurations and errors",
            &["configuration: what: detail"],
        );
        for c in &self.configs {
            let mut line = |what: &str, detail: &str| {
                et.row([format!("{}: {what}: {detail}", c.name)]);
            };
            if let Some(m) = &c.failed {
                line("FAILED", m);
                continue;
            }
            line("url", &c.url);
            for p in &c.processes {
                line("process", p);
            }
            line("prefix hit rate", &pct(c.prefix_hit_rate));
            for n in &c.notes {
                line("note", n);
            }
            if let Some(a) = &c.aborted {
                line("aborted", a);
            }
            for (m, n) in &c.error_samples {
                line(&format!("error x{n}"), m);
            }
        }
        out.push(et);
        out
    }

    fn plots(&self) -> Vec<Plot> {
        let by_turn = self
            .configs
            .iter()
            .map(|c| Series {
                name: c.name.clone(),
                points: c
                    .ttft_by_turn
                    .iter()
                    .map(|(t, v)| (*t as f64, *v))
                    .collect(),
            })
            .collect();
        let cdf = self
            .configs
            .iter()
            .map(|c| {
                let mut v = c.ttft_samples.clone();
                v.sort_by(f64::total_cmp);
                let n = v.len();
                let step = n.div_ceil(200).max(1);
                let mut pts: Vec<(f64, f64)> = v
                    .iter()
                    .enumerate()
                    .step_by(step)
                    .map(|(i, x)| (*x, (i + 1) as f64 / n as f64))
                    .collect();
                if let Some(last) = v.last() {
                    pts.push((*last, 1.0));
                }
                Series {
                    name: c.name.clone(),
                    points: pts,
                }
            })
            .collect();
        vec![
            Plot {
                file: "agentic-ttft-by-turn".into(),
                title: "Mean TTFT by turn of the session (main chain)".into(),
                x_label: "turn index".into(),
                y_label: "TTFT (ms)".into(),
                kind: PlotKind::Lines {
                    series: by_turn,
                    log_x: false,
                },
            },
            Plot {
                file: "agentic-ttft-cdf".into(),
                title: "CDF of TTFT, every request".into(),
                x_label: "TTFT (ms)".into(),
                y_label: "share of requests".into(),
                kind: PlotKind::Lines {
                    series: cdf,
                    log_x: false,
                },
            },
        ]
    }
}

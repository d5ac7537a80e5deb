//! `kvtier-router`: KV-aware routing in front of OpenAI-compatible inference workers (see
//! `docs/router.md`). Prints `listening http=IP:PORT` on stdout when ready; SIGTERM or SIGINT
//! drains and exits 0.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvtier_router::{Router, RouterConfig};

#[derive(Parser)]
#[command(
    name = "kvtier-router",
    version,
    about = "KV-aware request routing across inference workers"
)]
struct Args {
    /// TOML configuration file (docs/router.md); the flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// HTTP listen address (port 0 picks a free port). Default 127.0.0.1:8080.
    #[arg(long)]
    listen: Option<String>,
    /// A worker: HTTP_URL[,kvtier=URL][,token=T][,prefill_tokens_per_s=R]; repeat for more
    /// (added to the file's workers).
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// Token for the workers' kvtier servers over TCP/QUIC (default: KVTIER_TOKEN).
    #[arg(long)]
    kvtier_token: Option<String>,
    /// The workers' model (their --model-dir); only its configuration and tokenizer are read.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The workers' --model-name. Default kvtier-tiny.
    #[arg(long)]
    model_name: Option<String>,
    /// The workers' --hash-secret-file.
    #[arg(long)]
    hash_secret_file: Option<PathBuf>,
    /// Tokens per KV block, as the workers (vLLM: its --block-size). Default 16.
    #[arg(long)]
    block_tokens: Option<usize>,
    /// What the workers are: kvtier (kvtier-worker; default) or vllm (vLLM with kvtier's KV
    /// connector; needs --kv-dtype).
    #[arg(long)]
    engine: Option<String>,
    /// The model id in the keys' namespace: the connector's model_id, else vLLM's --model
    /// (engine vllm). Default: --model-name.
    #[arg(long)]
    kv_model_id: Option<String>,
    /// The workers' KV cache dtype: bf16, f16 or f32 (vLLM's --dtype as resolved). Default f32
    /// (kvtier).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// The vLLM workers' tensor-parallel size. Default 1.
    #[arg(long)]
    tensor_parallel_size: Option<u32>,
    /// Default prefill rate of a worker, tokens/s. Default 3000.
    #[arg(long)]
    prefill_tokens_per_s: Option<f64>,
    /// Most blocks tracked per kvtier server. Default 1048576.
    #[arg(long)]
    max_blocks_per_server: Option<usize>,
    /// kv (expected time to first token; default), or the baselines round_robin,
    /// least_loaded, random and session_sticky (by the x-session-id header or the body's user).
    #[arg(long)]
    policy: Option<String>,
    /// How often each worker's /health is asked, ms. Default 1000.
    #[arg(long)]
    health_interval_ms: Option<u64>,
    /// How long a block routed to a worker counts as held there before its server's events
    /// show it, ms (kv policy; 0: off). Default 20000.
    #[arg(long)]
    recent_route_ttl_ms: Option<u64>,
    /// How long a session's home is remembered after its last request, ms (kv policy; 0:
    /// no session affinity). Default 3600000.
    #[arg(long)]
    session_ttl_ms: Option<u64>,
    /// How long after its last request a session counts as active at its home, ms (kv
    /// policy: new sessions go where the fewest are; 0: by load alone). Default 60000.
    #[arg(long)]
    session_active_ms: Option<u64>,
    /// A session leaves its home only for a worker expected to answer in less than the
    /// home's time divided by this (at least 1). Default 2.
    #[arg(long)]
    affinity_ratio: Option<f64>,
    /// Use only the configured rates, not those measured from the workers' answers.
    #[arg(long)]
    no_measured_rates: bool,
    /// The workers' kvtier servers are one kvtier cluster: a block any of them holds counts
    /// for every worker, fetched at cluster_bytes_per_s.
    #[arg(long)]
    cluster: bool,
    /// Workers from the kvtier cluster's membership on these etcd URLs (comma-separated):
    /// each member whose record names a worker (its cluster.worker_url). Feature `cluster`.
    #[arg(long)]
    cluster_etcd: Option<String>,
    /// The cluster's name (the servers' cluster.name). Default kvtier.
    #[arg(long)]
    cluster_name: Option<String>,
    /// The cluster secret's file (the servers' cluster.secret_file): unsigned or otherwise
    /// signed member records are refused.
    #[arg(long)]
    cluster_secret_file: Option<std::path::PathBuf>,
}

fn config(a: Args) -> anyhow::Result<RouterConfig> {
    let mut c = match &a.config {
        Some(p) => RouterConfig::from_file(p)?,
        None => RouterConfig::default(),
    };
    for w in &a.workers {
        c.workers.push(RouterConfig::parse_worker_flag(w)?);
    }
    if let Some(v) = a.listen {
        c.listen = v;
    }
    if let Some(v) = a.kvtier_token {
        c.kvtier_token = Some(v);
    }
    if let Some(v) = a.model_dir {
        c.model_dir = Some(v);
    }
    if let Some(v) = a.model_name {
        c.model_name = v;
    }
    if let Some(v) = a.hash_secret_file {
        c.hash_secret_file = Some(v);
    }
    if let Some(v) = a.block_tokens {
        c.block_tokens = v;
    }
    if let Some(v) = a.engine {
        c.engine = kvtier_router::config::Engine::parse(&v)
            .map_err(|e| anyhow::anyhow!("--engine: {e}"))?;
    }
    if let Some(v) = a.kv_model_id {
        c.kv_model_id = Some(v);
    }
    if let Some(v) = a.kv_dtype {
        c.kv_dtype = Some(v);
    }
    if let Some(v) = a.tensor_parallel_size {
        c.tensor_parallel_size = v;
    }
    if let Some(v) = a.prefill_tokens_per_s {
        c.costs.prefill_tokens_per_s = v;
    }
    if let Some(v) = a.max_blocks_per_server {
        c.max_blocks_per_server = v;
    }
    if let Some(v) = a.policy {
        c.policy = kvtier_router::score::Policy::parse(&v).map_err(anyhow::Error::msg)?;
    }
    if let Some(v) = a.health_interval_ms {
        c.health_interval_ms = v;
    }
    if let Some(v) = a.recent_route_ttl_ms {
        c.recent_route_ttl_ms = v;
    }
    if let Some(v) = a.session_ttl_ms {
        c.session_ttl_ms = v;
    }
    if let Some(v) = a.session_active_ms {
        c.session_active_ms = v;
    }
    if let Some(v) = a.affinity_ratio {
        c.costs.affinity_ratio = v;
    }
    if a.no_measured_rates {
        c.costs.measured = false;
    }
    c.cluster |= a.cluster;
    if let Some(v) = a.cluster_etcd {
        c.cluster_etcd = v;
    }
    if let Some(v) = a.cluster_name {
        c.cluster_name = v;
    }
    if let Some(v) = a.cluster_secret_file {
        c.cluster_secret_file = Some(v);
    }
    c.check()?;
    Ok(c)
}

async fn run(c: RouterConfig) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let router = Router::start(c).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening http={}", router.addr())?;
        out.flush()?;
    }
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("interrupt: draining"),
    }
    router.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let c = config(Args::parse()).context("kvtier-router")?;
    tokio::runtime::Runtime::new()?.block_on(run(c))
}

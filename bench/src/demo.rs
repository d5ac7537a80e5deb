//! `kvtier-bench demo`: the README's one-command demonstration. Starts a kvtier server and two
//! reference workers in this process (one with the cache off, one loading prefixes from the
//! server over its Unix socket), drives the same seeded agentic workload against both, and
//! prints them side by side. Nothing to configure; everything lives in a temporary directory
//! and is stopped at the end.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser};
use kvtier_core::{HashScheme, HashSecret};
use kvtier_server::server::{ConfigLoader, Server};
use kvtier_worker::config::ModelConfig;
use kvtier_worker::serve::{ServeConfig, WorkerServer};

use crate::agentic::{self, AgenticArgs, Comparison};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Agentic sessions in the workload.
    #[arg(long, default_value_t = 6)]
    pub sessions: usize,
    /// Sessions run at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Most turns of a session's main chain.
    #[arg(long, default_value_t = 6)]
    pub turns_max: usize,
    /// Real seconds per workload second of think gaps.
    #[arg(long, default_value_t = 0.01)]
    pub time_scale: f64,
    /// DRAM tier of the embedded kvtier server.
    #[arg(long, default_value = "256MiB")]
    pub dram: String,
}

/// Lets the demo reuse `agentic`'s argument defaults.
#[derive(Parser)]
struct AgenticCli {
    #[command(flatten)]
    args: AgenticArgs,
}

/// The running pieces of the demo.
struct Stack {
    server: Server,
    off: WorkerServer,
    on: WorkerServer,
    _dir: tempfile::TempDir,
}

async fn start(dram: &str, seed: u64) -> Result<Stack> {
    let mcfg = ModelConfig::default();
    let layout = mcfg.kv_layout()?;
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let q = |s: &str| format!("{s:?}");
    let config = ConfigLoader::new()
        .set(&format!(
            "server.runtime_dir={}",
            q(&dir.path().display().to_string())
        ))?
        .set("server.tcp=\"off\"")?
        .set("server.quic=\"off\"")?
        .set("server.admin=\"off\"")?
        .set(&format!("store.dram_bytes={}", q(dram)))?
        .set("store.nvme_dir=\"\"")?
        .set(&format!("layout.layers={}", layout.num_layers()))?
        .set(&format!("layout.kv_heads={}", layout.num_kv_heads()))?
        .set(&format!("layout.head_dim={}", layout.head_dim()))?
        .set("layout.dtype=\"f32\"")?
        .set(&format!("layout.block_tokens={}", mcfg.block_tokens))?
        .build()?;
    let server = Server::start(config)
        .await
        .context("cannot start the embedded kvtier server")?;
    let unix = server
        .endpoints()
        .unix
        .as_ref()
        .context("the embedded server has no Unix socket")?
        .display()
        .to_string();
    // A per-run block-key secret (the demo's blocks live only as long as the run).
    let mut rng = kvtier_core::SplitMix64::new(seed);
    let secret: Vec<u8> = (0..4).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
    let secret = HashSecret::new(HashScheme::default(), &secret)?;
    let worker = |sidecar: Option<String>| ServeConfig {
        listen: "127.0.0.1:0".into(),
        hash_secret: Some(secret.clone()),
        // "Cache off" reuses nothing: no local prefix cache either.
        prefix_cache: sidecar.is_some(),
        sidecar,
        ..ServeConfig::default()
    };
    let off = WorkerServer::start(worker(None))
        .await
        .context("cannot start the cache-off worker")?;
    let on = WorkerServer::start(worker(Some(format!("unix://{unix}"))))
        .await
        .context("cannot start the kvtier worker")?;
    eprintln!(
        "demo: kvtier server on unix://{unix} ({dram} DRAM); workers: cache off at http://{}, \
         kvtier at http://{}",
        off.addr(),
        on.addr()
    );
    Ok(Stack {
        server,
        off,
        on,
        _dir: dir,
    })
}

pub fn run(a: &DemoArgs, seed: u64) -> Result<Comparison> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mcfg = ModelConfig::default();
    eprintln!(
        "demo: model: random-weight Llama, {} layers, hidden {}, {} parameters, {} KV bytes per \
         token, {}-token blocks",
        mcfg.num_layers,
        mcfg.hidden_size,
        mcfg.param_count(),
        mcfg.kv_layout()?.bytes_per_token(),
        mcfg.block_tokens
    );
    let stack = rt.block_on(start(&a.dram, seed))?;
    let cli = AgenticCli::try_parse_from([
        "agentic".to_owned(),
        format!("--target=cache-off=http://{}", stack.off.addr()),
        format!("--target=kvtier=http://{}", stack.on.addr()),
        format!("--sessions={}", a.sessions),
        format!("--concurrency={}", a.concurrency),
        format!("--turns-min={}", a.turns_max.min(3)),
        format!("--turns-max={}", a.turns_max),
        format!("--time-scale={}", a.time_scale),
    ])
    .map_err(|e| anyhow::anyhow!("demo settings: {e}"))?;
    // The comparison runs on its own runtime; the servers keep running on `rt`'s threads.
    let result = agentic::run(&cli.args, seed, true);
    rt.block_on(async {
        let stop = async {
            stack.on.shutdown().await;
            stack.off.shutdown().await;
            stack.server.shutdown().await;
        };
        if tokio::time::timeout(Duration::from_secs(30), stop)
            .await
            .is_err()
        {
            eprintln!("demo: shutdown took over 30 s; exiting anyway");
        }
    });
    result
}

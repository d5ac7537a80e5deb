//! Disaggregated TTFT against a single worker's, in one process: a prefill worker (its HTTP
//! router on 127.0.0.1 and its transfer agent) and a decode worker, both with the seeded
//! random model, and a plain engine for the single-worker figure.
//!
//! `cargo run --release -p kvtier-worker --example disagg_ttft -- --tokens 1024,4096 --reps 3`
//!
//! Prints a Markdown table of medians: single-worker TTFT (full prefill to the first logits),
//! disaggregated TTFT (request to the first logits on the decode worker), when layer 0 and the
//! last layer landed, and the time from the last layer landing to the first logits.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use kvtier_testkit::prompt::byte_prompt;
use kvtier_transfer::{Agent, AgentConfig};
use kvtier_worker::disagg::{
    DecodeConfig, DisaggDecoder, PrefillConfig, PrefillPath, PrefillServer, engine_in_agent,
    parse_backend, prefill_router,
};
use kvtier_worker::{BlockTable, Engine, Model, ModelConfig};

#[derive(Parser)]
struct Args {
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    tokens: Vec<usize>,
    /// Transfer backends.
    #[arg(long, value_delimiter = ',', default_value = "shm,tcp")]
    backends: Vec<String>,
    /// Runs per cell (the median is shown), after one warm-up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Model layers (the default random model has 4).
    #[arg(long, default_value_t = 4)]
    layers: usize,
}

fn prompt(len: usize) -> Vec<u32> {
    byte_prompt(len as u64, len)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.reps > 0, "--reps must be above 0");
    let cfg = ModelConfig {
        num_layers: args.layers,
        ..ModelConfig::default()
    };
    let max = args.tokens.iter().copied().max().context("no --tokens")?;
    let blocks = 2 * max.div_ceil(cfg.block_tokens) + 2;
    let agent_cfg = AgentConfig::default();

    let prefill_agent = Arc::new(Agent::new("prefill", agent_cfg.clone()).await?);
    let engine = engine_in_agent(Model::random(cfg.clone(), 0)?, blocks, &prefill_agent)?;
    let server = PrefillServer::new(
        Arc::new(Mutex::new(engine)),
        prefill_agent,
        PrefillConfig::default(),
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = prefill_router(Arc::clone(&server));
    let serving = tokio::spawn(async move { axum::serve(listener, app).await });

    // Run like the roles run their engines: on a blocking-pool thread.
    let single = Arc::new(Mutex::new(Engine::new(
        Model::random(cfg.clone(), 0)?,
        blocks,
    )?));
    println!(
        "model: {} layers, {} KiB of KV per 16-token block; medians of {} runs",
        cfg.num_layers,
        cfg.kv_layout()?.block_bytes() / 1024,
        args.reps
    );
    println!();
    println!(
        "| prompt tokens | backend | single-worker TTFT ms | disaggregated TTFT ms | layer 0 landed ms | last layer landed ms | decode step started ms | last layer -> first logits ms |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for &n in &args.tokens {
        let p = prompt(n);
        let mut single_runs = Vec::new();
        for i in 0..=args.reps {
            let (single, p) = (Arc::clone(&single), p.clone());
            let d = tokio::task::spawn_blocking(move || -> Result<Duration> {
                let mut e = single.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                let mut t = BlockTable::new();
                let t0 = Instant::now();
                e.prefill(&p, 0, &mut t)?;
                let d = t0.elapsed();
                e.cache_mut().release_table(&mut t)?;
                Ok(d)
            })
            .await??;
            if i > 0 {
                single_runs.push(d);
            }
        }
        for name in &args.backends {
            let backend = parse_backend(name)?;
            let agent = Arc::new(Agent::new("decode", agent_cfg.clone()).await?);
            let engine = engine_in_agent(Model::random(cfg.clone(), 0)?, blocks, &agent)?;
            let mut dc = DecodeConfig::new(&url, backend);
            dc.request_timeout = Duration::from_secs(300);
            let d = DisaggDecoder::new(Arc::new(Mutex::new(engine)), agent, dc)?;
            let mut rows: Vec<[Duration; 5]> = Vec::new();
            for i in 0..=args.reps {
                let got = d.prefill(p.clone()).await?;
                ensure!(got.path == PrefillPath::Remote, "{:?}", got.path);
                let r = got.remote.context("remote timings")?;
                let mut table = got.table;
                d.engine()
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .cache_mut()
                    .release_table(&mut table)?;
                if i > 0 {
                    rows.push([
                        got.ttft,
                        r.first_layer_landed,
                        r.last_layer_landed,
                        r.step_started,
                        r.first_logits_after_last_layer,
                    ]);
                }
            }
            let col = |k: usize| median(rows.iter().map(|r| r[k]).collect());
            println!(
                "| {n} | {name} | {} | {} | {} | {} | {} | {:.2} |",
                ms(median(single_runs.clone())),
                ms(col(0)),
                ms(col(1)),
                ms(col(2)),
                ms(col(3)),
                col(4).as_secs_f64() * 1e3,
            );
        }
    }
    // The last answer may still be on its way (the decode side does not wait for it).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = server.stats();
    println!();
    println!(
        "prefill worker: {} served, {} failed, {:.1} MiB written",
        s.served,
        s.failed,
        s.bytes as f64 / (1 << 20) as f64
    );
    serving.abort();
    Ok(())
}

//! TTFT of a warm turn (>= 95 % of the prompt cached in the sidecar's DRAM) against the same
//! request recomputed, and against the physical floor, all measured in one run:
//!
//! ```text
//! cargo run --release -p kvtier-worker --example ttft -- [--contexts 1024,4096,8192] [--reps 3]
//! cargo run --release -p kvtier-worker --features cuda --example ttft -- --device cuda
//! ```
//!
//! It starts a kvtier-server in-process (DRAM tier only, this model's layout, Unix socket in a
//! temporary directory) and two workers on loopback: one with the sidecar, one without. For
//! each context length and repetition it sends a "previous turn" (the first `cached` tokens,
//! one output token, which stores its blocks), waits for the stores, then times the full
//! prompt (the previous turn plus a fresh suffix) as a streaming `/v1/completions` request:
//! TTFT = request sent -> first `data:` chunk received. The cold worker runs the same prompt.
//!
//! The floor = time to compute the uncached tokens with the prefix already in the pool
//! (measured on an `Engine` of the same model, in this process) + cached bytes / the
//! sidecar's measured get bandwidth (`get_into` of the same blocks over the Unix socket,
//! copied once out of the mapped arena). A plain memcpy of the same bytes is reported too.
//! With `--device cuda` (a `cuda` build) both workers and the floor's compute run on the GPU;
//! the floor's load part is still the sidecar's host-side bandwidth (the host-to-device copy
//! of the loaded blocks is not in the floor, so it is a stricter floor there).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};
use kvtier_client::{Client, ClientConfig};
use kvtier_core::{HashSecret, NamespaceBuilder, PrefixHasher, SplitMix64};
use kvtier_server::server::{ConfigLoader, Server};
use kvtier_worker::scheduler::PREFILL_CHUNK_TOKENS;
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use kvtier_worker::{BlockTable, ByteTokenizer, DeviceSpec, Engine, Model, ModelConfig};

struct Args {
    contexts: Vec<usize>,
    reps: usize,
    cached_fraction: f64,
    device: DeviceSpec,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        contexts: vec![1024, 4096, 8192],
        reps: 3,
        cached_fraction: 0.95,
        device: DeviceSpec::Cpu,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--contexts" => {
                a.contexts = v
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse()
                            .context("--contexts: comma-separated integers")
                    })
                    .collect::<Result<_>>()?
            }
            "--reps" => a.reps = v.parse().context("--reps")?,
            "--cached-fraction" => a.cached_fraction = v.parse().context("--cached-fraction")?,
            "--device" => a.device = v.parse()?,
            other => {
                bail!("unknown flag {other} (--contexts, --reps, --cached-fraction, --device)")
            }
        }
    }
    if a.reps == 0 || !(0.0..1.0).contains(&a.cached_fraction) {
        bail!("--reps must be >= 1 and --cached-fraction in [0, 1)");
    }
    Ok(a)
}

/// Deterministic pseudo-random byte tokens.
fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| (r.next_u64() % 256) as u32).collect()
}

/// Sends a streaming completion on a new connection (as this example always measured: the
/// loopback handshake is in the figure, for warm and cold alike) and returns the time to the
/// first `data:` chunk; reads the rest of the response.
async fn ttft(addr: SocketAddr, prompt: &[u32], max_tokens: usize) -> Result<Duration> {
    let http = HttpClient::new(HttpConfig::default());
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "stream": true})
    .to_string();
    let t0 = Instant::now();
    let mut s = http
        .stream(HttpRequest::post_json(
            format!("http://{addr}/v1/completions"),
            body,
        ))
        .await?;
    let mut raw = Vec::new();
    let mut first = None;
    while let Some(piece) = s.chunk().await? {
        raw.extend_from_slice(&piece);
        if first.is_none() && raw.windows(6).any(|w| w == b"data: ") {
            first = Some(t0.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&raw);
    if s.status != 200 || !text.contains("[DONE]") {
        bail!(
            "bad response {}: {}",
            s.status,
            &text[..text.len().min(400)]
        );
    }
    first.context("no data chunk")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn wait_stored(w: &WorkerServer, blocks: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.metrics().blocks_stored.get() < blocks {
        if Instant::now() > deadline {
            bail!("stores did not reach the sidecar");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let mcfg = ModelConfig::default();
    let layout = mcfg.kv_layout()?;
    let bt = mcfg.block_tokens;
    let block = layout.block_bytes() as usize;
    let max_ctx = *args.contexts.iter().max().context("no context")?;
    if max_ctx > mcfg.max_context_tokens {
        bail!(
            "contexts above the model's {} tokens",
            mcfg.max_context_tokens
        );
    }
    let dir = tempfile::tempdir()?;
    let q = |s: String| format!("{s:?}");
    let scfg = ConfigLoader::new()
        .set(&format!(
            "server.runtime_dir={}",
            q(dir.path().display().to_string())
        ))?
        .set("server.tcp=\"off\"")?
        .set("server.quic=\"off\"")?
        .set("server.tls=\"off\"")?
        .set("server.admin=\"off\"")?
        .set("store.dram_bytes=\"1GiB\"")?
        .set("store.nvme_dir=\"\"")?
        .set(&format!("layout.layers={}", layout.num_layers()))?
        .set(&format!("layout.kv_heads={}", layout.num_kv_heads()))?
        .set(&format!("layout.head_dim={}", layout.head_dim()))?
        .set("layout.dtype=\"f32\"")?
        .set(&format!("layout.block_tokens={bt}"))?
        .build()?;
    let server = Server::start(scfg).await?;
    let unix = format!(
        "unix://{}",
        server.endpoints().unix.as_ref().context("unix")?.display()
    );
    let pool_blocks = 2 * max_ctx.div_ceil(bt) + 16;
    let worker = |sidecar: Option<String>| ServeConfig {
        listen: "127.0.0.1:0".into(),
        sidecar,
        pool_blocks,
        max_batch: 1,
        device: args.device,
        ..ServeConfig::default()
    };
    let warm = WorkerServer::start(worker(Some(unix.clone()))).await?;
    let cold = WorkerServer::start(worker(None)).await?;
    let client = Client::connect(&unix, ClientConfig::default()).await?;
    let model = Model::random(mcfg.clone(), 0)?.to_device(args.device)?;
    println!(
        "model: random-weight Llama on {}, {} layers, hidden {}, {} heads / {} kv heads x {}, {} parameters, f32; KV {} bytes/token, {} KiB blocks of {} tokens",
        model.device_label(),
        mcfg.num_layers,
        mcfg.hidden_size,
        mcfg.num_heads,
        mcfg.num_kv_heads,
        mcfg.head_dim,
        mcfg.param_count(),
        layout.bytes_per_token(),
        block >> 10,
        bt
    );
    let mut engine = Engine::new(model, pool_blocks)?;
    // Warm everything once (allocator, page faults, the sidecar connection).
    ttft(warm.addr(), &tokens(200, 999), 1).await?;
    ttft(cold.addr(), &tokens(200, 998), 1).await?;

    println!(
        "\n| context | cached tokens | cold TTFT ms | warm TTFT ms | floor ms (compute + load) | warm / floor | cold / warm | sidecar get GB/s | memcpy GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let secret = HashSecret::development();
    let mut stored_total = 0u64;
    for &n in &args.contexts {
        let cached_len =
            ((n as f64 * args.cached_fraction / bt as f64).ceil() as usize * bt).min(n - 1);
        let cached_blocks = cached_len / bt;
        let (mut cold_ms, mut warm_ms, mut compute_ms, mut get_bw, mut copy_bw) =
            (vec![], vec![], vec![], vec![], vec![]);
        for rep in 0..args.reps {
            let seed = (n * 100 + rep) as u64;
            let mut prompt = vec![ByteTokenizer::BOS];
            prompt.extend(tokens(n - 1, seed));
            let prev = &prompt[..cached_len];
            // Previous turn: stores its full blocks.
            ttft(warm.addr(), prev, 1).await?;
            stored_total += cached_blocks as u64;
            wait_stored(&warm, stored_total).await?;
            // This turn: the same prefix plus a fresh suffix.
            warm_ms.push(ttft(warm.addr(), &prompt, 1).await?.as_secs_f64() * 1e3);
            stored_total += (n / bt - cached_blocks) as u64;
            wait_stored(&warm, stored_total).await?;
            cold_ms.push(ttft(cold.addr(), &prompt, 1).await?.as_secs_f64() * 1e3);

            // Floor part 1: compute the uncached tokens with the prefix in the pool.
            let mut table = BlockTable::new();
            // In the worker's chunks (a one-shot 8k prefill would need an 8k x 8k score matrix
            // per head).
            for end in (0..cached_len)
                .step_by(PREFILL_CHUNK_TOKENS)
                .skip(1)
                .chain([cached_len])
            {
                let start = (end - 1) / PREFILL_CHUNK_TOKENS * PREFILL_CHUNK_TOKENS;
                engine.prefill(&prompt[..end], start, &mut table)?;
            }
            let t = Instant::now();
            engine.prefill(&prompt, cached_len, &mut table)?;
            compute_ms.push(t.elapsed().as_secs_f64() * 1e3);
            engine.cache_mut().release_table(&mut table)?;

            // Floor part 2: the sidecar's get bandwidth for these very blocks, and memcpy.
            let ns = NamespaceBuilder::new("kvtier-tiny", layout.fingerprint()).build(&secret)?;
            let mut h = PrefixHasher::new(secret.clone(), ns, bt as u32)?;
            let mut keys = Vec::new();
            h.prompt_keys(prev, &mut keys);
            let mut dst = vec![0u8; cached_blocks * block];
            let got = {
                let mut bufs: Vec<&mut [u8]> = dst.chunks_exact_mut(block).collect();
                let t = Instant::now();
                let got = client.get_into(&keys, &mut bufs).await;
                (got, t.elapsed())
            };
            if got.0.blocks != cached_blocks {
                bail!(
                    "the sidecar served {} of {cached_blocks} blocks",
                    got.0.blocks
                );
            }
            get_bw.push(dst.len() as f64 / got.1.as_secs_f64() / 1e9);
            let src = vec![7u8; dst.len()];
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            copy_bw.push(dst.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        let (cold_m, warm_m, comp_m) = (median(cold_ms), median(warm_ms), median(compute_ms));
        let (get_m, copy_m) = (median(get_bw), median(copy_bw));
        let load_ms = (cached_blocks * block) as f64 / (get_m * 1e9) * 1e3;
        let floor = comp_m + load_ms;
        println!(
            "| {n} | {cached_len} ({:.1} %) | {cold_m:.1} | {warm_m:.1} | {floor:.1} ({comp_m:.1} + {load_ms:.2}) | {:.2}x | {:.1}x | {get_m:.2} | {copy_m:.2} |",
            100.0 * cached_len as f64 / n as f64,
            warm_m / floor,
            cold_m / warm_m,
        );
    }
    let m = warm.metrics();
    println!(
        "\nwarm worker: {} cached prompt tokens, {} computed, {} stores dropped, fallbacks: corrupt {} unavailable {} timeout {}",
        m.prompt_tokens_cached.get(),
        m.prompt_tokens_computed.get(),
        m.stores_dropped.get(),
        m.cache_fallbacks.get("corrupt"),
        m.cache_fallbacks.get("unavailable"),
        m.cache_fallbacks.get("timeout"),
    );
    drop(client);
    warm.shutdown().await;
    cold.shutdown().await;
    server.shutdown().await;
    Ok(())
}

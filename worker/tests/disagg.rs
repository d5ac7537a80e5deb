//! Disaggregated prefill/decode: a prefill worker (axum router + transfer agent) writes a
//! prompt's KV layer by layer into a decode worker's blocks; the decode worker continues. The
//! output must be a single worker's, the transferred bytes those computed locally, and any
//! failure of the remote path must end in a correct local prefill.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};
use kvtier_testkit::prompt::{byte_prompt, max_abs_diff};
use kvtier_transfer::{Agent, AgentConfig, BackendKind};
use kvtier_worker::disagg::{
    DecodeConfig, DisaggDecoder, PREFILL_PATH, PrefillConfig, PrefillPath, PrefillRequest,
    PrefillServer, engine_in_agent, prefill_router, wire,
};
use kvtier_worker::{BlockTable, Engine, Model, ModelConfig, Sampling, WorkerError};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const SEED: u64 = 7;
const POOL_BLOCKS: usize = 64;
/// Logits of the decode worker's last-token step against a single worker's full prefill. The
/// split of the prompt differs, and with it the attention kernel of the last position: a
/// decode step's f32 attention on one side, the prefill kernel on the other, which rounds to
/// 13-14 bits where the CPU has AVX-512 VNNI (docs/worker.md; measured up to 1.5e-4 here, 1e-6
/// with the f32 kernel). A wrong or misplaced block of KV moves the logits by far more.
const TOL: f32 = 2e-3;
/// Every test finishes well inside this.
const DEADLINE: Duration = Duration::from_secs(60);

fn cfg() -> ModelConfig {
    ModelConfig::default()
}

fn agent_config() -> AgentConfig {
    AgentConfig {
        quic: false,
        ..AgentConfig::default()
    }
}

async fn agent(name: &str) -> Result<Arc<Agent>> {
    Ok(Arc::new(Agent::new(name, agent_config()).await?))
}

/// A running prefill worker on 127.0.0.1.
struct PrefillWorker {
    url: String,
    server: Arc<PrefillServer>,
    /// The engine the server runs its forwards on.
    engine: Arc<Mutex<Engine>>,
    task: JoinHandle<()>,
}

impl PrefillWorker {
    async fn start() -> Result<Self> {
        let agent = agent("prefill").await?;
        let engine = engine_in_agent(Model::random(cfg(), SEED)?, POOL_BLOCKS, &agent)?;
        let engine = Arc::new(Mutex::new(engine));
        let server = PrefillServer::new(Arc::clone(&engine), agent, PrefillConfig::default())?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let app = prefill_router(Arc::clone(&server));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            url,
            server,
            engine,
            task,
        })
    }

    /// Kills it: the listener closes and the agent goes with the server.
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn decoder_with(
    cfg_for: impl FnOnce(&mut DecodeConfig),
    url: &str,
    backend: BackendKind,
) -> Result<DisaggDecoder> {
    let agent = agent("decode").await?;
    let engine = engine_in_agent(Model::random(cfg(), SEED)?, POOL_BLOCKS, &agent)?;
    let mut c = DecodeConfig::new(url, backend);
    c.request_timeout = Duration::from_secs(20);
    cfg_for(&mut c);
    Ok(DisaggDecoder::new(Arc::new(Mutex::new(engine)), agent, c)?)
}

async fn decoder(url: &str, backend: BackendKind) -> Result<DisaggDecoder> {
    decoder_with(|_| {}, url, backend).await
}

/// A single worker's greedy tokens and first logits.
fn reference(p: &[u32], max_tokens: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let mut e = Engine::new(Model::random(cfg(), SEED)?, POOL_BLOCKS)?;
    let mut t = BlockTable::new();
    let logits = e.prefill(p, 0, &mut t)?;
    e.cache_mut().release_table(&mut t)?;
    let g = e.generate(p, max_tokens, Sampling::GREEDY)?;
    Ok((g.tokens, logits))
}

async fn bounded<F: std::future::Future<Output = Result<()>>>(f: F) -> Result<()> {
    tokio::time::timeout(DEADLINE, f)
        .await
        .context("test ran past its deadline")?
}

/// Prefills remotely, checks the transferred KV against a local computation of the same
/// positions (bit for bit) and the continuation against a single worker.
async fn check_remote(d: &DisaggDecoder, p: Vec<u32>) -> Result<()> {
    let n = p.len();
    let (want_tokens, want_logits) = reference(&p, 8)?;
    let got = d.prefill(p.clone()).await?;
    ensure!(
        got.path == PrefillPath::Remote,
        "{n} tokens: path {:?}",
        got.path
    );
    let timings = got.remote.context("remote timings")?;
    ensure!(timings.first_layer_landed <= timings.last_layer_landed);
    ensure!(
        max_abs_diff(&got.logits, &want_logits) <= TOL,
        "{n} tokens: logits differ by {}",
        max_abs_diff(&got.logits, &want_logits)
    );

    // What the prefill worker computed for positions 0..n-1, computed here.
    let mut local = Engine::new(Model::random(cfg(), SEED)?, POOL_BLOCKS)?;
    let mut lt = BlockTable::new();
    local.prefill(&p[..n - 1], 0, &mut lt)?;
    let mut table = got.table;
    let engine = Arc::clone(d.engine());
    let mut e = engine.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let bt = cfg().block_tokens;
    for layer in 0..cfg().num_layers {
        ensure!(
            e.cache().gather(&table, layer, n - 1)? == local.cache().gather(&lt, layer, n - 1)?,
            "{n} tokens: layer {layer} KV differs"
        );
    }
    // Blocks wholly before the last position hold exactly the local bytes.
    for i in 0..(n - 1) / bt {
        ensure!(
            e.cache().block_bytes(table.blocks()[i])?
                == local.cache().block_bytes(lt.blocks()[i])?,
            "{n} tokens: block {i} bytes differ"
        );
    }
    let (tokens, _) = e.decode(&mut table, n, got.logits, 8, Sampling::GREEDY)?;
    e.cache_mut().release_table(&mut table)?;
    ensure!(
        tokens == want_tokens,
        "{n} tokens: {tokens:?} != {want_tokens:?}"
    );
    ensure!(e.cache().free_blocks() == POOL_BLOCKS, "blocks leaked");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_equals_a_single_worker_over_shm_and_tcp() -> Result<()> {
    bounded(async {
        let pw = PrefillWorker::start().await?;
        for backend in [BackendKind::Shm, BackendKind::Tcp] {
            let d = decoder(&pw.url, backend).await?;
            // 16-token blocks: the transferred part ends mid-block (37, 48) or on a block
            // boundary (49); the prompt itself ends mid-block (37, 49) or on one (48).
            for (i, n) in [37, 48, 49, 2].into_iter().enumerate() {
                check_remote(&d, byte_prompt(i as u64, n))
                    .await
                    .context(backend)?;
            }
            let s = d.stats();
            ensure!(
                s.remote == 4 && s.fallbacks == 0 && s.stray_notifications == 0,
                "{s:?}"
            );
            // The all-in-one call gives the single worker's generation too.
            let p = byte_prompt(9, 70);
            let g = d.generate(p.clone(), 12, Sampling::GREEDY).await?;
            ensure!(g.path == PrefillPath::Remote);
            ensure!(g.generation.tokens == reference(&p, 12)?.0, "{backend}");
            // Sampling stays on the decode side: a seeded sampled generation matches too.
            let sampling = Sampling {
                temperature: 0.8,
                seed: 11,
            };
            let g = d.generate(p.clone(), 12, sampling).await?;
            let mut single = Engine::new(Model::random(cfg(), SEED)?, POOL_BLOCKS)?;
            ensure!(g.generation.tokens == single.generate(&p, 12, sampling)?.tokens);
        }
        let s = pw.server.stats();
        ensure!(s.served == 12 && s.rejected == 0 && s.failed == 0, "{s:?}");
        ensure!(s.bytes > 0);
        pw.stop().await;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_quic() -> Result<()> {
    bounded(async {
        let pw = PrefillWorker::start().await?;
        // The decode agent serves QUIC (the test agents otherwise do not).
        let agent = Arc::new(Agent::new("decode", AgentConfig::default()).await?);
        let engine = engine_in_agent(Model::random(cfg(), SEED)?, POOL_BLOCKS, &agent)?;
        let d = DisaggDecoder::new(
            Arc::new(Mutex::new(engine)),
            agent,
            DecodeConfig::new(&pw.url, BackendKind::Quic),
        )?;
        check_remote(&d, byte_prompt(21, 45)).await?;
        ensure!(d.stats().remote == 1 && d.stats().fallbacks == 0);
        pw.stop().await;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_each_get_their_own_kv() -> Result<()> {
    bounded(async {
        let pw = PrefillWorker::start().await?;
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| byte_prompt(100 + i, 20 + 13 * i as usize))
            .collect();
        let wants = prompts
            .iter()
            .map(|p| Ok(reference(p, 6)?.0))
            .collect::<Result<Vec<_>>>()?;
        // With layer streaming, and without (every layer landed before the engine is taken).
        for stream_layers in [true, false] {
            let d = decoder_with(
                |c| c.stream_layers = stream_layers,
                &pw.url,
                BackendKind::Tcp,
            );
            let d = Arc::new(d.await?);
            let mut tasks = Vec::new();
            for p in prompts.clone() {
                let d = Arc::clone(&d);
                tasks.push(tokio::spawn(async move {
                    d.generate(p, 6, Sampling::GREEDY).await
                }));
            }
            for (want, t) in wants.iter().zip(tasks) {
                let g = t.await??;
                ensure!(g.path == PrefillPath::Remote, "{:?}", g.path);
                ensure!(
                    &g.generation.tokens == want,
                    "stream_layers {stream_layers}"
                );
            }
            ensure!(d.stats().remote == 4);
            let free = d
                .engine()
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .cache()
                .free_blocks();
            ensure!(free == POOL_BLOCKS, "{free} free");
        }
        pw.stop().await;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_unreachable_prefill_worker_means_a_local_prefill() -> Result<()> {
    bounded(async {
        let p = byte_prompt(3, 40);
        let want = reference(&p, 8)?.0;

        // Nothing listens there.
        let closed = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", closed.local_addr()?);
        drop(closed);
        let d = decoder(&url, BackendKind::Tcp).await?;
        let g = d.generate(p.clone(), 8, Sampling::GREEDY).await?;
        ensure!(
            matches!(g.path, PrefillPath::Fallback { .. }),
            "{:?}",
            g.path
        );
        ensure!(g.generation.tokens == want);
        let s = d.stats();
        ensure!(
            s.fallbacks == 1 && s.remote == 0 && s.quarantined_blocks == 0,
            "{s:?}"
        );

        // A worker that served once, then was killed.
        let pw = PrefillWorker::start().await?;
        let d = decoder(&pw.url, BackendKind::Shm).await?;
        ensure!(d.generate(p.clone(), 8, Sampling::GREEDY).await?.path == PrefillPath::Remote);
        pw.stop().await;
        let g = d.generate(p.clone(), 8, Sampling::GREEDY).await?;
        ensure!(
            matches!(g.path, PrefillPath::Fallback { .. }),
            "{:?}",
            g.path
        );
        ensure!(g.generation.tokens == want);
        ensure!(d.stats().fallbacks == 1 && d.stats().remote == 1);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_or_failing_prefill_worker_means_a_local_prefill_and_fenced_blocks() -> Result<()> {
    bounded(async {
        let p = byte_prompt(4, 50);
        let want = reference(&p, 8)?.0;

        // Accepts and never answers: the request times out; its 4 blocks are quarantined
        // (a late write could still land) and return once the quarantine is over.
        let hung = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", hung.local_addr()?);
        let held = tokio::spawn(async move {
            let mut socks = Vec::new();
            while let Ok((s, _)) = hung.accept().await {
                socks.push(s);
            }
        });
        let d = decoder_with(
            |c| {
                c.request_timeout = Duration::from_millis(300);
                c.quarantine = Duration::from_millis(100);
            },
            &url,
            BackendKind::Tcp,
        )
        .await?;
        let g = d.generate(p.clone(), 8, Sampling::GREEDY).await?;
        ensure!(
            matches!(g.path, PrefillPath::Fallback { .. }),
            "{:?}",
            g.path
        );
        ensure!(g.generation.tokens == want);
        ensure!(d.stats().quarantined_blocks == 4, "{:?}", d.stats());
        let free = || -> Result<usize> {
            Ok(d.engine()
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .cache()
                .free_blocks())
        };
        ensure!(free()? == POOL_BLOCKS - 4);
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while free()? != POOL_BLOCKS {
            ensure!(
                tokio::time::Instant::now() < until,
                "quarantined blocks never came back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        held.abort();

        // The prefill worker cannot write over the backend asked for (the decode agent has
        // no QUIC endpoint): it answers 502 and the decode worker prefills locally.
        let pw = PrefillWorker::start().await?;
        let d = decoder(&pw.url, BackendKind::Quic).await?;
        let g = d.generate(p.clone(), 8, Sampling::GREEDY).await?;
        match &g.path {
            PrefillPath::Fallback { reason } => ensure!(reason.contains("502"), "{reason}"),
            other => anyhow::bail!("{other:?}"),
        }
        ensure!(g.generation.tokens == want);
        ensure!(pw.server.stats().failed == 1);

        // A decode worker that gives up while the prefill worker is busy hangs up on it; the
        // prefill request still runs to its end (writes, then its source blocks freed) and is
        // counted, and the decode worker's output is a single worker's. The prefill worker's
        // engine is held for 600 ms from another thread (as another request's forward would),
        // so the 150 ms timeout hits however fast the forward itself is.
        let long = byte_prompt(6, 1000);
        let d = decoder_with(
            |c| c.request_timeout = Duration::from_millis(150),
            &pw.url,
            BackendKind::Tcp,
        )
        .await?;
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let engine = Arc::clone(&pw.engine);
        let holder = std::thread::spawn(move || {
            let _busy = engine.lock();
            let _ = held_tx.send(());
            std::thread::sleep(Duration::from_millis(600));
        });
        held_rx
            .recv_timeout(Duration::from_secs(10))
            .context("the engine was never taken")?;
        let g = d.generate(long.clone(), 4, Sampling::GREEDY).await?;
        holder
            .join()
            .map_err(|_| anyhow::anyhow!("the holding thread panicked"))?;
        ensure!(
            matches!(g.path, PrefillPath::Fallback { .. }),
            "{:?}",
            g.path
        );
        ensure!(g.generation.tokens == reference(&long, 4)?.0);
        // 63 of the 64 blocks were the failed request's: no room for fresh ones, so the
        // fallback waited for its writes to be over and reused them.
        ensure!(d.stats().fence_waits == 1 && d.stats().quarantined_blocks == 0);
        let until = tokio::time::Instant::now() + Duration::from_secs(30);
        while pw.server.stats().served != 1 {
            ensure!(
                tokio::time::Instant::now() < until,
                "{:?}",
                pw.server.stats()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        pw.stop().await;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_and_bad_setups() -> Result<()> {
    bounded(async {
        let pw = PrefillWorker::start().await?;
        let d = decoder(&pw.url, BackendKind::Tcp).await?;
        let p = vec![256];
        let g = d.generate(p.clone(), 5, Sampling::GREEDY).await?;
        ensure!(g.path == PrefillPath::Short);
        ensure!(g.generation.tokens == reference(&p, 5)?.0);
        ensure!(matches!(
            d.prefill(vec![]).await,
            Err(WorkerError::EmptyPrompt)
        ));
        ensure!(matches!(
            d.prefill(vec![256, 100_000]).await,
            Err(WorkerError::TokenOutOfVocab { id: 100_000, .. })
        ));
        ensure!(d.stats().fallbacks == 0 && d.stats().short == 1);

        let plain = Arc::new(Mutex::new(Engine::new(Model::random(cfg(), SEED)?, 4)?));
        let a = agent("decode").await?;
        let not_registered = DisaggDecoder::new(
            plain,
            Arc::clone(&a),
            DecodeConfig::new(&pw.url, BackendKind::Tcp),
        );
        ensure!(matches!(not_registered, Err(WorkerError::Config { .. })));
        let e = engine_in_agent(Model::random(cfg(), SEED)?, 4, &a)?;
        let bad_url = DisaggDecoder::new(
            Arc::new(Mutex::new(e)),
            a,
            DecodeConfig::new("localhost:1", BackendKind::Tcp),
        );
        ensure!(matches!(bad_url, Err(WorkerError::Config { .. })));
        pw.stop().await;
        Ok(())
    })
    .await
}

/// One control-channel exchange: status and body.
async fn post_raw(url: &str, body: &[u8]) -> Result<(u16, String)> {
    let r = HttpClient::new(HttpConfig::default())
        .send(HttpRequest::post_json(
            format!("{url}{PREFILL_PATH}"),
            body.to_vec(),
        ))
        .await?;
    Ok((r.status, r.text()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_control_requests_get_clear_errors() -> Result<()> {
    bounded(async {
        let pw = PrefillWorker::start().await?;
        let decode_agent = agent("decode").await?;
        let decode_engine = engine_in_agent(Model::random(cfg(), SEED)?, 8, &decode_agent)?;
        let region = decode_engine.cache().region().context("region")?.id().0;
        let good = PrefillRequest {
            request_id: 1,
            tokens: byte_prompt(5, 20),
            layout_fingerprint: cfg().kv_layout()?.fingerprint(),
            agent_blob: wire::hex_encode(&decode_agent.metadata()?),
            backend: "tcp".into(),
            region,
            blocks: vec![0, 1],
        };
        let json = |r: &PrefillRequest| serde_json::to_vec(r).map_err(anyhow::Error::from);
        let edit = |f: &dyn Fn(&mut PrefillRequest)| {
            let mut r = good.clone();
            f(&mut r);
            r
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"not json".to_vec(), "malformed prefill request"),
            (b"{\"request_id\": 1}".to_vec(), "missing field"),
            (
                br#"{"request_id":1,"tokens":[1],"layout_fingerprint":0,"agent_blob":"","backend":"tcp","region":0,"blocks":[0],"extra":1}"#.to_vec(),
                "unknown field",
            ),
            (b"{\"request_id\": -1}".to_vec(), "malformed"),
            (json(&edit(&|r| r.tokens.clear()))?, "no tokens"),
            (json(&edit(&|r| r.layout_fingerprint ^= 1))?, "fingerprint"),
            (json(&edit(&|r| r.blocks.push(2)))?, "destination blocks"),
            (json(&edit(&|r| r.backend = "carrier-pigeon".into()))?, "unknown transfer backend"),
            (json(&edit(&|r| r.agent_blob = "xyz".into()))?, "not hex"),
            (json(&edit(&|r| r.agent_blob = "00ff".into()))?, "decode agent"),
            (json(&edit(&|r| r.tokens[3] = 9999))?, "outside the vocabulary"),
            (json(&edit(&|r| r.region = 12345))?, "no region 12345"),
            (json(&edit(&|r| r.blocks = vec![0, 8]))?, "outside the decode region"),
        ];
        for (body, want) in &cases {
            let (status, text) = post_raw(&pw.url, body).await?;
            ensure!(status == 400, "{want}: status {status}: {text}");
            let err: wire::ErrorBody = serde_json::from_str(&text).context(text.clone())?;
            ensure!(err.error.contains(want), "wanted `{want}` in `{}`", err.error);
        }
        // Still serving, and the rejections were counted.
        let (status, text) = post_raw(&pw.url, &json(&good)?).await?;
        ensure!(status == 200, "{text}");
        let r: kvtier_worker::disagg::PrefillResponse = serde_json::from_str(&text)?;
        ensure!(r.request_id == 1 && r.layers == cfg().num_layers as u32);
        ensure!(r.bytes == 20 * cfg().kv_layout()?.bytes_per_token(), "{r:?}");
        let s = pw.server.stats();
        ensure!(s.rejected == cases.len() as u64 && s.served == 1, "{s:?}");
        pw.stop().await;
        Ok(())
    })
    .await
}

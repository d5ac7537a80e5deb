//! The worker's own prefix cache in its KV pool (issue 17): a request that repeats a prefix
//! right after the previous one ended uses the blocks still in the pool, with or without a
//! sidecar, with output identical to recomputing; idle cached blocks give way under pressure.
//! And a store the sidecar refuses is counted.

mod common;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_core::{BlockKey, HashSecret};
use kvtier_server::TierKind;
use kvtier_worker::metrics::Metrics;
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use kvtier_worker::sidecar::{Sidecar, SidecarSettings, StoreJob};
use kvtier_worker::{ByteTokenizer, Engine, Model, ModelConfig, Sampling};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);
const BT: usize = 16;

/// The reference: the model alone, one-shot prefill, no cache.
fn solo(prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
    let mut e = Engine::new(Model::random(ModelConfig::default(), 0)?, 256)?;
    Ok(e.generate(prompt, max_tokens, Sampling::GREEDY)?.tokens)
}

fn text(tokens: &[u32]) -> Result<String> {
    Ok(ByteTokenizer.decode(tokens)?)
}

/// Greedy completion of token ids: (text, usage).
async fn complete(w: &WorkerServer, prompt: &[u32], max_tokens: usize) -> Result<(String, Value)> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let r = post(w.addr(), "/v1/completions", &body).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let v = r.json()?;
    let t = v["choices"][0]["text"].as_str().context("text")?.to_owned();
    Ok((t, v["usage"].clone()))
}

fn cached(usage: &Value) -> usize {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .map_or(usize::MAX, |n| n as usize)
}

fn prompt(text: &str) -> Vec<u32> {
    ByteTokenizer.encode(text, true)
}

/// Leading blocks a repeat of `len` prompt tokens takes from the local cache (every whole
/// block before the last token's).
fn local_blocks(len: usize) -> usize {
    (len - 1) / BT
}

const PROMPT: &str = "An agent's tool returned at once: the same prompt comes back before the \
                      store of the first one is committed.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_hits_the_pool_without_a_sidecar() -> Result<()> {
    let w = start_worker(None).await?;
    for p in [prompt(PROMPT), prompt(&"x".repeat(47))] {
        // 48 tokens: whole blocks, so the last block is recomputed (only 2 of 3 come cached).
        let want = text(&solo(&p, 12)?)?;
        let (cold, u) = complete(&w, &p, 12).await?;
        assert_eq!(cold, want);
        assert_eq!(cached(&u), 0);
        for _ in 0..2 {
            let (warm, u) = complete(&w, &p, 12).await?;
            assert_eq!(warm, want, "output from cached blocks equals recomputing");
            assert_eq!(cached(&u), local_blocks(p.len()) * BT, "{u}");
        }
    }
    let m = w.metrics();
    let hits = 2 * (local_blocks(prompt(PROMPT).len()) + 2) * BT;
    assert_eq!(m.prompt_tokens_local_hit.get() as usize, hits);
    assert_eq!(m.prompt_tokens_cached.get() as usize, hits);
    let text = w.metrics().render();
    assert!(
        text.contains(&format!(
            "kvtier_worker_prompt_tokens_local_hit_total {hits}"
        )),
        "{text}"
    );
    w.shutdown().await;

    // Switched off: no reuse at all.
    let w = WorkerServer::start(ServeConfig {
        prefix_cache: false,
        ..worker_config(None)
    })
    .await?;
    let p = prompt(PROMPT);
    complete(&w, &p, 4).await?;
    assert_eq!(cached(&complete(&w, &p, 4).await?.1), 0);
    w.shutdown().await;
    Ok(())
}

/// The defect of issue 17: immediate repeats through a sidecar whose store is not committed
/// yet. The pool still holds the blocks, so every repeat hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_repeat_hits_even_before_the_store_is_committed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
    let w = start_worker(Some(unix)).await?;
    let p = prompt(&format!("{PROMPT} {PROMPT}"));
    let want = text(&solo(&p, 8)?)?;
    assert_eq!(complete(&w, &p, 8).await?.0, want);
    for _ in 0..6 {
        let (warm, u) = complete(&w, &p, 8).await?;
        assert_eq!(warm, want);
        assert!(
            cached(&u) >= local_blocks(p.len()) * BT,
            "an immediate repeat missed: {u}"
        );
    }
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// Blocks the pool holds are not fetched from the sidecar again; only those past them are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_blocks_past_the_local_ones_are_fetched() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (server, _unix, tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
    let w = start_worker(Some(tcp)).await?;
    let m = w.metrics().clone();
    let stored = |n: usize| {
        let m = m.clone();
        wait_for(LIMIT, move || m.blocks_stored.get() as usize >= n)
    };
    let loaded = || m.blocks_loaded.get() as usize;
    // Blocks the server handed out (gets and pins count, lookups do not).
    let served = || {
        server
            .store()
            .stats()
            .tier(TierKind::Dram)
            .map_or(0, |t| t.hits)
    };
    // Mid-block: every full block is in the pool, nothing is fetched.
    let p = prompt(PROMPT);
    let want = text(&solo(&p, 6)?)?;
    assert_eq!(complete(&w, &p, 6).await?.0, want);
    stored(p.len() / BT).await?;
    let before = served();
    let (warm, u) = complete(&w, &p, 6).await?;
    assert_eq!(warm, want);
    assert_eq!(cached(&u), local_blocks(p.len()) * BT);
    assert_eq!(served(), before, "no block was fetched");
    assert_eq!(loaded(), 0);
    // Whole blocks: the pool gives all but the last, the sidecar that one (over TCP).
    let q = prompt(&"q".repeat(47));
    let want = text(&solo(&q, 6)?)?;
    assert_eq!(complete(&w, &q, 6).await?.0, want);
    stored(p.len() / BT + 3).await?;
    let before = served();
    let (warm, u) = complete(&w, &q, 6).await?;
    assert_eq!(warm, want);
    assert_eq!(cached(&u), 47, "{u}");
    assert_eq!(served(), before + 1, "only the block past the local ones");
    assert_eq!(loaded(), 1);
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// The next turn of an agent (prompt + answer + more) finds the answer's blocks too; several
/// requests share cached blocks while they run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_and_concurrent_repeats_share_the_blocks() -> Result<()> {
    let w = start_worker(None).await?;
    let first = prompt("An agent asks a question; the worker keeps the answer in its pool.");
    let g = Engine::new(Model::random(ModelConfig::default(), 0)?, 256)?.generate(
        &first,
        40,
        Sampling::GREEDY,
    )?;
    let answer = g.tokens;
    let (t, _) = complete(&w, &first, 40).await?;
    assert_eq!(t, text(&answer)?);

    let mut next = first.clone();
    next.extend(&answer);
    next.extend(ByteTokenizer.encode(" And then?", false));
    // KV exists for the prompt and every fed answer token (the last one sampled at
    // max_tokens never is).
    let fed = answer.len() - usize::from(g.finish == kvtier_worker::FinishReason::MaxTokens);
    let with_kv = first.len() + fed;
    ensure!(
        with_kv / BT > first.len() / BT,
        "the answer fills no block ({} prompt tokens, {fed} fed)",
        first.len()
    );
    let want = text(&solo(&next, 8)?)?;
    let (got, u) = complete(&w, &next, 8).await?;
    assert_eq!(got, want);
    assert_eq!(
        cached(&u),
        (with_kv / BT).min(local_blocks(next.len())) * BT
    );

    // Four at once on the same cached prefix, each with its own continuation.
    let mut asks = Vec::new();
    for i in 0..4 {
        let mut p = next.clone();
        p.extend(ByteTokenizer.encode(&format!(" variant {i}"), false));
        asks.push(p);
    }
    let results = futures_util::future::join_all(asks.iter().map(|p| complete(&w, p, 10))).await;
    for (p, r) in asks.iter().zip(results) {
        let (got, u) = r?;
        assert_eq!(got, text(&solo(p, 10)?)?);
        assert!(cached(&u) > 0, "{u}");
    }
    w.shutdown().await;
    Ok(())
}

/// A small pool: cached blocks are given up (least recently used first) when a request needs
/// their pages, and every answer stays right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_blocks_give_way_under_pressure() -> Result<()> {
    let w = WorkerServer::start(ServeConfig {
        pool_blocks: 12,
        ..worker_config(None)
    })
    .await?;
    let a = prompt(&"a".repeat(100)); // 101 tokens: 6 full blocks, 7 with 8 generated
    let b = prompt(&"b".repeat(150)); // 151 tokens: 10 blocks with 8 generated
    let (want_a, want_b) = (text(&solo(&a, 8)?)?, text(&solo(&b, 8)?)?);
    let mut rounds = Vec::new();
    for p in [&a, &b, &a, &a, &b, &b] {
        let (got, u) = tokio::time::timeout(LIMIT, complete(&w, p, 8))
            .await
            .context("a request waited for pages held by idle cached blocks")??;
        let want = if p == &a { &want_a } else { &want_b };
        assert_eq!(&got, want);
        rounds.push(cached(&u));
    }
    // a, b (a's blocks evicted for it), a (b's partly evicted), a again (hit), b, b (hit).
    assert_eq!(rounds[0], 0);
    assert_eq!(rounds[3], local_blocks(a.len()) * BT, "{rounds:?}");
    assert_eq!(rounds[5], local_blocks(b.len()) * BT, "{rounds:?}");
    assert!(rounds[2] < local_blocks(a.len()) * BT, "{rounds:?}");
    w.shutdown().await;
    Ok(())
}

/// A store the sidecar refuses (here: a chain whose parent it does not hold) is counted and
/// rendered, not only logged at debug level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_store_is_counted() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
    let cfg = ModelConfig::default();
    let metrics = Arc::new(Metrics::default());
    let sc = Sidecar::connect(
        SidecarSettings {
            url: unix,
            token: Some(TOKEN.into()),
            quic_cert_der: None,
            secret: HashSecret::development(),
            model_id: "kvtier-tiny".into(),
        },
        cfg.kv_layout()?,
        metrics.clone(),
    )
    .await?;
    let block = sc.block_bytes();
    let orphan = StoreJob {
        keys: vec![BlockKey::from_u128(7), BlockKey::from_u128(8)],
        parent: Some(BlockKey::from_u128(6)),
        bytes: vec![1; 2 * block],
        retain: None,
    };
    assert!(sc.queue_store(|| Some(orphan)));
    let m = metrics.clone();
    wait_for(LIMIT, || m.stores_refused.get() == 1).await?;
    assert_eq!(metrics.blocks_stored.get(), 0);
    assert_eq!(metrics.store_failures.get(), 0);
    // A chain with its parent stored is taken, and not counted as refused.
    // With a retention hint (what `kvtier_retain_s` queues): sent after the store, so it
    // finds the block in DRAM and is accepted.
    let good = StoreJob {
        keys: vec![BlockKey::from_u128(6)],
        parent: None,
        bytes: vec![2; block],
        retain: Some((vec![BlockKey::from_u128(6)], Duration::from_secs(30))),
    };
    assert!(sc.queue_store(|| Some(good)));
    let m = metrics.clone();
    wait_for(LIMIT, || m.blocks_stored.get() == 1).await?;
    let m = metrics.clone();
    wait_for(LIMIT, || m.retain_hints_accepted.get() == 1).await?;
    assert_eq!(metrics.retain_hints_refused.get(), 0);
    // A hint for blocks the server does not hold is refused (nothing cached) and counted.
    let hint_only = StoreJob {
        keys: Vec::new(),
        parent: None,
        bytes: Vec::new(),
        retain: Some((vec![BlockKey::from_u128(99)], Duration::from_secs(30))),
    };
    assert!(sc.queue_store(|| Some(hint_only)));
    let m = metrics.clone();
    wait_for(LIMIT, || m.retain_hints_refused.get() == 1).await?;
    assert_eq!(metrics.stores_refused.get(), 1);
    assert!(
        metrics
            .render()
            .contains("kvtier_worker_stores_refused_total 1")
    );
    sc.close(Duration::from_secs(5)).await;
    server.shutdown().await;
    Ok(())
}

//! The serving worker end to end: HTTP API, continuous batching, and prefix reuse through a
//! real kvtier-server (started in-process on loopback and a temporary NVMe directory).

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_server::TierKind;
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use kvtier_worker::{ByteTokenizer, Engine, Model, ModelConfig, Sampling};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

/// The reference: the same model run alone through `Engine::generate` (one-shot prefill, no
/// cache, no scheduler).
fn solo(prompt: &[u32], max_tokens: usize, sampling: Sampling) -> Result<String> {
    let model = Model::random(ModelConfig::default(), 0)?;
    let mut e = Engine::new(model, 256)?;
    let g = e.generate(prompt, max_tokens, sampling)?;
    Ok(ByteTokenizer.decode(&g.tokens)?)
}

fn solo_text(prompt: &str, max_tokens: usize) -> Result<String> {
    solo(
        &ByteTokenizer.encode(prompt, true),
        max_tokens,
        Sampling::GREEDY,
    )
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog; kvtier keeps its KV blocks for the next turn of the agent.";

async fn complete(w: &WorkerServer, prompt: &str, max_tokens: usize) -> Result<(String, Value)> {
    let r = post(
        w.addr(),
        "/v1/completions",
        &json!({"model": "kvtier-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    )
    .await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let v = r.json()?;
    let text = v["choices"][0]["text"].as_str().context("text")?.to_owned();
    Ok((text, v["usage"].clone()))
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

/// A worker whose repeated prefixes can only come from the sidecar (no local prefix cache):
/// for the tests of the kvtier path itself.
async fn start_sidecar_worker(url: String) -> Result<WorkerServer> {
    Ok(WorkerServer::start(ServeConfig {
        prefix_cache: false,
        ..worker_config(Some(url))
    })
    .await?)
}

/// Waits until the worker's queued stores reached the sidecar.
async fn stores_done(w: &WorkerServer, blocks: u64) -> Result<()> {
    let m = w.metrics().clone();
    wait_for(LIMIT, || m.blocks_stored.get() >= blocks).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_from_dram_nvme_and_after_restart_equals_recompute() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, _tcp) = start_kvtier(&cfg).await?;
    let w = start_sidecar_worker(unix).await?;
    let want = solo_text(PROMPT, 12)?;
    let full_blocks = (PROMPT.len() as u64 + 1) / 16;

    let (cold, u) = complete(&w, PROMPT, 12).await?;
    assert_eq!(cold, want, "cold output equals the solo reference");
    assert_eq!(cached(&u), 0);
    stores_done(&w, full_blocks).await?;

    // DRAM hit.
    let (warm, u) = complete(&w, PROMPT, 12).await?;
    assert_eq!(warm, want, "output with the prefix loaded from DRAM");
    assert_eq!(cached(&u), full_blocks * 16);
    assert_eq!(u["prompt_tokens"], PROMPT.len() + 1);
    // usage.kvtier: every cached block loaded from DRAM, none from the local pool (off).
    let k = &u["kvtier"];
    assert_eq!(
        (&k["local_tokens"], &k["loaded_tokens"]),
        (
            &json!(0),
            &json!({"hbm": 0, "dram": full_blocks * 16, "nvme": 0, "remote": 0})
        ),
        "{u}"
    );
    assert!(k["loaded_bytes"]["dram"].as_u64() > Some(0), "{u}");
    assert!(k["load_s"].as_f64() > Some(0.0), "{u}");
    let dram_hits = server
        .store()
        .stats()
        .tier(TierKind::Dram)
        .map_or(0, |t| t.hits);
    assert!(dram_hits >= full_blocks, "DRAM hits {dram_hits}");

    // Restart: DRAM is empty, the NVMe tier is rebuilt from its headers.
    server.shutdown().await;
    let (server, _unix, _tcp) = start_kvtier(&cfg).await?;
    // The first request after the restart may still meet the old connection (a miss, then
    // the SDK reconnects): every answer must be right, and one must come from NVMe.
    let mut hit = false;
    for _ in 0..3 {
        let (after, u) = complete(&w, PROMPT, 12).await?;
        assert_eq!(after, want, "output after a restart");
        if cached(&u) == full_blocks * 16 {
            // ... from NVMe, as usage.kvtier says.
            let k = &u["kvtier"];
            assert_eq!(
                k["loaded_tokens"],
                json!({"hbm": 0, "dram": 0, "nvme": full_blocks * 16, "remote": 0}),
                "{u}"
            );
            assert_eq!(k["loaded_bytes"]["dram"], 0, "{u}");
            hit = true;
            break;
        }
    }
    assert!(hit, "no NVMe hit after the restart");
    let nvme_hits = server
        .store()
        .stats()
        .tier(TierKind::Nvme)
        .map_or(0, |t| t.hits);
    assert!(nvme_hits >= full_blocks, "NVMe hits {nvme_hits}");
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_over_tcp_equals_recompute() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, _unix, tcp) = start_kvtier(&cfg).await?;
    let w = start_sidecar_worker(tcp).await?;
    let prompt = "tcp tcp tcp: a remote sidecar serves the prefix with get_into, staged once";
    let want = solo_text(prompt, 10)?;
    let blocks = (prompt.len() as u64 + 1) / 16;
    assert_eq!(complete(&w, prompt, 10).await?.0, want);
    stores_done(&w, blocks).await?;
    let (warm, u) = complete(&w, prompt, 10).await?;
    assert_eq!(warm, want);
    assert_eq!(cached(&u), blocks * 16);
    // Blocks copied out with get_into (a remote sidecar) are reported too.
    assert_eq!(
        u["kvtier"]["loaded_tokens"],
        json!({"hbm": 0, "dram": blocks * 16, "nvme": 0, "remote": 0}),
        "{u}"
    );
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// `kvtier_retain_s` on a request: after the response the worker sends the sidecar a
/// retention hint for the conversation so far, which the server accepts and counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvtier_retain_s_sends_a_retention_hint_after_the_response() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, _tcp) = start_kvtier(&cfg).await?;
    let w = start_sidecar_worker(unix).await?;
    let r = post(
        w.addr(),
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "kvtier_retain_s": 30}),
    )
    .await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let m = w.metrics().clone();
    wait_for(LIMIT, || m.retain_hints_accepted.get() == 1).await?;
    assert_eq!(w.metrics().retain_hints_refused.get(), 0);
    // Without the field, no hint.
    complete(
        &w,
        "another prompt, long enough for a block or two of tokens",
        4,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(w.metrics().retain_hints_accepted.get(), 1);
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// A full-prompt hit (the prompt is whole blocks) still computes the last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_prompt_hit_recomputes_the_last_token() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, _) = start_kvtier(&cfg).await?;
    let w = start_worker(Some(unix)).await?;
    let prompt = "x".repeat(47); // + BOS = 48 tokens = 3 blocks
    let want = solo_text(&prompt, 6)?;
    assert_eq!(complete(&w, &prompt, 6).await?.0, want);
    stores_done(&w, 3).await?;
    let (warm, u) = complete(&w, &prompt, 6).await?;
    assert_eq!(warm, want);
    assert_eq!(
        cached(&u),
        47,
        "every token but the last came from the cache"
    );
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// Flips a payload byte of every written NVMe slot (docs/nvme-format.md: slot = 4 KiB header
/// + payload; stride 4096 + 32 KiB for this layout).
fn corrupt_nvme(dir: &std::path::Path) -> Result<usize> {
    let stride = 4096 + 32 * 1024;
    let mut flipped = 0;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().is_none_or(|x| x != "kvt") {
            continue;
        }
        let mut data = std::fs::read(&p)?;
        for slot in 0..data.len() / stride {
            let at = slot * stride;
            if &data[at..at + 8] == b"KVTSLOT1" {
                data[at + 4096 + 1000] ^= 0x5a;
                flipped += 1;
            }
        }
        std::fs::write(&p, &data)?;
    }
    Ok(flipped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_blocks_on_disk_are_recomputed_and_counted() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, _) = start_kvtier(&cfg).await?;
    let w = start_sidecar_worker(unix).await?;
    let want = solo_text(PROMPT, 12)?;
    let blocks = (PROMPT.len() as u64 + 1) / 16;
    assert_eq!(complete(&w, PROMPT, 12).await?.0, want);
    stores_done(&w, blocks).await?;
    server.shutdown().await;
    let flipped = corrupt_nvme(&dir.path().join("nvme"))?;
    assert!(flipped as u64 >= blocks, "flipped {flipped}");

    let (server, _, _) = start_kvtier(&cfg).await?;
    // The worker reconnects to the restarted server with a back-off, so the first requests may
    // run without it; on a loaded machine that can take more than a few requests. Each request
    // must be right; within the bound, one must meet the corruption.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while w.metrics().cache_fallbacks.get("corrupt") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no request met the corrupt blocks within 30 s"
        );
        let (text, u) = complete(&w, PROMPT, 12).await?;
        assert_eq!(text, want, "corrupt blocks are never used");
        assert_eq!(cached(&u), 0);
        if w.metrics().cache_fallbacks.get("corrupt") == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let corrupt = server
        .store()
        .stats()
        .tier(TierKind::Nvme)
        .map_or(0, |t| t.corrupt_dropped);
    assert!(corrupt >= 1, "the server counted the corruption");
    assert!(w.metrics().cache_fallbacks.get("corrupt") >= 1);
    // The recomputed first block was stored again; later ones are still corrupt on disk
    // (the server found them present): each turn stays right and repairs a little more.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(complete(&w, PROMPT, 12).await?.0, want);
    }
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_or_absent_sidecar_never_fails_a_request() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, _) = start_kvtier(&cfg).await?;
    let w = start_sidecar_worker(unix).await?;
    let want = solo_text(PROMPT, 8)?;
    assert_eq!(complete(&w, PROMPT, 8).await?.0, want);
    server.shutdown().await;
    for _ in 0..3 {
        let (text, u) = complete(&w, PROMPT, 8).await?;
        assert_eq!(text, want);
        assert_eq!(cached(&u), 0);
    }
    let m = w.metrics();
    let fallbacks: u64 = ["disconnected", "unavailable", "timeout", "refused"]
        .iter()
        .map(|r| m.cache_fallbacks.get(r))
        .sum();
    assert!(fallbacks >= 1, "{}", m.render());
    w.shutdown().await;

    // A sidecar that was never there.
    let w = start_worker(Some(format!("unix://{}/none.sock", dir.path().display()))).await?;
    assert_eq!(complete(&w, PROMPT, 8).await?.0, want);
    assert!(w.metrics().cache_fallbacks.get("unavailable") >= 1);
    w.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_with_other_blocks_is_a_clear_startup_error() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // 8 layers: 64 KiB blocks, not the model's 32 KiB.
    let cfg = kvtier_config(dir.path(), "8MiB", 8)?;
    let (server, unix, _) = start_kvtier(&cfg).await?;
    let e = match start_worker(Some(unix)).await {
        Ok(_) => anyhow::bail!("a worker started against a server with other blocks"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("32768"), "{e}");
    assert!(e.contains("--set layout.layers=4"), "{e}");
    server.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_streaming_and_not() -> Result<()> {
    let w = start_worker(None).await?;
    let a = w.addr();
    let want = solo_text("hello", 9)?;

    // Token-id prompt equals the same text prompt.
    let ids: Vec<u32> = ByteTokenizer.encode("hello", true);
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 9, "temperature": 0}),
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json()?;
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "kvtier-tiny");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(v["usage"]["completion_tokens"], 9);
    assert_eq!(v["usage"]["total_tokens"], 15);

    // Streaming: chunks concatenate to the same text, usage last, then [DONE].
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 9, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await?;
    assert_eq!(r.status, 200);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d))
        .collect::<Result<_, _>>()?;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|c| c["text"].as_str()))
        .collect();
    assert_eq!(text, want);
    let usage = &chunks.last().context("chunks")?["usage"];
    assert_eq!(usage["completion_tokens"], 9);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(chunks.len() >= 3);

    // Chat: the documented template, streaming and not.
    let prompt = "<|user|>\nhi there\n<|assistant|>\n";
    let want = solo_text(prompt, 7)?;
    let body = json!({"model": "kvtier-tiny", "messages": [{"role": "user", "content": "hi there"}],
                      "max_tokens": 7, "temperature": 0});
    let v = post(a, "/v1/chat/completions", &body).await?.json()?;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post(a, "/v1/chat/completions", &sbody).await?;
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d))
        .collect::<Result<_, _>>()?;
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    assert_eq!(
        chunks.last().context("last")?["choices"][0]["finish_reason"],
        "length"
    );

    // Seeded sampling is reproducible.
    let body = json!({"prompt": "seeded", "max_tokens": 12, "temperature": 0.9, "seed": 42});
    let x = post(a, "/v1/completions", &body).await?.json()?;
    let y = post(a, "/v1/completions", &body).await?.json()?;
    assert_eq!(x["choices"][0]["text"], y["choices"][0]["text"]);
    let want = solo(
        &ByteTokenizer.encode("seeded", true),
        12,
        Sampling {
            temperature: 0.9,
            seed: 42,
        },
    )?;
    assert_eq!(x["choices"][0]["text"], want.as_str());

    // Models, health, metrics.
    let v = request(a, "GET", "/v1/models", "").await?.json()?;
    assert_eq!(v["data"][0]["id"], "kvtier-tiny");
    let v = request(a, "GET", "/health", "").await?.json()?;
    assert_eq!(v["status"], "ok");
    assert_eq!(v["sidecar"], "off");
    let m = request(a, "GET", "/metrics", "").await?.body;
    for needle in [
        "kvtier_worker_ttft_seconds_bucket",
        "kvtier_worker_inter_token_seconds_count",
        "kvtier_worker_e2e_seconds_sum",
        "kvtier_worker_prompt_tokens_computed_total",
        "kvtier_worker_requests_total{status=\"ok\"} 6",
    ] {
        assert!(m.contains(needle), "{needle} missing in\n{m}");
    }
    w.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_style_errors() -> Result<()> {
    let w = WorkerServer::start(ServeConfig {
        pool_blocks: 64,
        ..worker_config(None)
    })
    .await?;
    let a = w.addr();
    let check = |status: u16, param: Value, needle: &'static str| {
        move |r: HttpResponse| -> Result<()> {
            ensure!(r.status == status, "status {} body {}", r.status, r.body);
            let v = r.json()?;
            let e = &v["error"];
            ensure!(
                e["message"].as_str().is_some_and(|m| m.contains(needle)),
                "{v}"
            );
            ensure!(e["type"].is_string(), "{v}");
            ensure!(e["param"] == param, "{v}");
            ensure!(e.get("code").is_some(), "{v}");
            Ok(())
        }
    };
    check(400, Value::Null, "invalid JSON")(
        request(a, "POST", "/v1/completions", "{\"prompt\": ").await?,
    )?;
    check(400, json!("max_tokens"), "at least 1")(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": -3}),
        )
        .await?,
    )?;
    check(404, json!("model"), "does not exist")(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": "x", "model": "gpt-4o"}),
        )
        .await?,
    )?;
    check(400, json!("temperature"), "between")(
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "temperature": 9}),
        )
        .await?,
    )?;
    check(400, json!("prompt"), "maximum context length is 8192")(
        post(a, "/v1/completions", &json!({"prompt": "y".repeat(9000)})).await?,
    )?;
    // The prompt plus max_tokens past the context is refused, as vLLM does (not cut short).
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 8191}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8180}),
            "messages",
        ),
    ] {
        let r = post(a, path, &body).await?;
        let v = r.json()?;
        check(400, json!(param), "maximum context length is 8192")(r)?;
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    // 64 blocks = 1024 tokens: a request whose worst case needs more can never run.
    check(400, json!("max_tokens"), "pool holds 64")(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 2000}),
        )
        .await?,
    )?;
    let big = "z".repeat(kvtier_worker::api::MAX_BODY_BYTES + 1);
    let r = request(a, "POST", "/v1/completions", &big).await?;
    assert_eq!(r.status, 413, "{}", r.body);
    let r = request(a, "GET", "/v1/nothing", "").await?;
    assert_eq!(r.status, 404);
    assert!(r.json()?["error"]["message"].is_string());
    let m = w.metrics();
    assert!(m.requests.get("bad_request") >= 5);
    assert_eq!(m.requests.get("ok"), 0);
    w.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_interleave_and_each_equals_its_solo_run() -> Result<()> {
    let w = start_worker(None).await?;
    let prompts = [
        "alpha alpha",
        "bravo: a longer prompt here",
        "c",
        "delta delta delta delta",
    ];
    let max_tokens = 48;
    let mut tasks = Vec::new();
    for p in prompts {
        let a = w.addr();
        tasks.push(tokio::spawn(async move {
            post(
                a,
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0}),
            )
            .await
        }));
    }
    for (p, t) in prompts.iter().zip(tasks) {
        let r = t.await??;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json()?;
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(solo_text(p, max_tokens)?.as_str()),
            "{p}"
        );
    }
    let peak = w.metrics().peak_running.get();
    assert!(peak >= 2, "requests ran one after another (peak {peak})");
    let batched = w.metrics().batched_decode_tokens.get();
    assert!(
        batched >= 2,
        "no decode step ran several sequences in one forward"
    );
    w.shutdown().await;
    Ok(())
}

/// An agent's next prompt repeats the previous answer: the answer's full blocks are stored when
/// its sequence ends, so the next turn loads them instead of recomputing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_loads_the_previous_answer_from_kvtier() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
    let w = start_sidecar_worker(unix).await?;
    let prompt = ByteTokenizer.encode("An agent asks a question; kvtier keeps the answer.", true);
    let g = Engine::new(Model::random(ModelConfig::default(), 0)?, 256)?.generate(
        &prompt,
        40,
        Sampling::GREEDY,
    )?;
    // Positions with KV: the prompt and every generated token fed back (the last one sampled
    // at max_tokens never is).
    let fed = g.tokens.len() - usize::from(g.finish == kvtier_worker::FinishReason::MaxTokens);
    let (prompt_blocks, all_blocks) = (prompt.len() / 16, (prompt.len() + fed) / 16);
    ensure!(
        all_blocks > prompt_blocks,
        "the answer fills no block ({} prompt tokens, {fed} fed)",
        prompt.len()
    );

    let ask = |p: &[u32], n: usize| json!({"model": "kvtier-tiny", "prompt": p, "max_tokens": n, "temperature": 0});
    let r = post(w.addr(), "/v1/completions", &ask(&prompt, 40)).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    assert_eq!(r.json()?["usage"]["completion_tokens"], g.tokens.len());
    stores_done(&w, all_blocks as u64).await?;
    let m = w.metrics().clone();
    assert_eq!(
        m.generated_blocks_queued.get(),
        (all_blocks - prompt_blocks) as u64
    );

    // Turn 2: the previous prompt, the answer, a new message.
    let mut next = prompt.clone();
    next.extend(&g.tokens);
    next.extend(ByteTokenizer.encode(" And then?", false));
    let r = post(w.addr(), "/v1/completions", &ask(&next, 8)).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let v = r.json()?;
    assert_eq!(cached(&v["usage"]), (all_blocks * 16) as u64, "{v}");
    assert_eq!(
        v["choices"][0]["text"].as_str().context("text")?,
        solo(&next, 8, Sampling::GREEDY)?,
        "output with the answer's blocks loaded equals recomputing them"
    );
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

//! `serve --role prefill|decode`: a decode worker takes the client's request, its prefill
//! worker writes the prompt's KV into the decode worker's pool over kvtier-transfer, and the
//! decode worker decodes. The answers must be a single worker's (`role both`), and a prefill
//! worker that is gone must only cost a local prefill.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_transfer::BackendKind;
use kvtier_worker::serve::{Role, ServeConfig, WorkerServer};
use serde_json::{Value, json};

/// Every test finishes well inside this.
const DEADLINE: Duration = Duration::from_secs(120);

/// Prompt lengths in tokens (BOS included), blocks of 16: the prefill worker computes all
/// but the last token, so 17 and 33 hand it whole blocks, 16 and 40 end mid-block, 2 hands it
/// the BOS alone.
const LENGTHS: [usize; 5] = [2, 16, 17, 33, 40];

fn text(tokens: usize) -> String {
    "disaggregated prefill writes the KV layer by layer; "
        .chars()
        .cycle()
        .take(tokens - 1)
        .collect()
}

fn config(role: Role, backend: BackendKind, prefill_url: Option<String>) -> ServeConfig {
    ServeConfig {
        role,
        prefill_url,
        transfer_backend: backend,
        ..worker_config(None)
    }
}

/// The decode worker's pool: 128 positions, so a leaked block would soon stall requests.
const DECODE_POOL_BLOCKS: usize = 8;

/// A prefill worker and a decode worker pointed at it.
async fn pair(backend: BackendKind) -> Result<(WorkerServer, WorkerServer)> {
    let prefill = WorkerServer::start(config(Role::Prefill, backend, None)).await?;
    let url = format!("http://{}", prefill.addr());
    let decode = WorkerServer::start(ServeConfig {
        pool_blocks: DECODE_POOL_BLOCKS,
        ..config(Role::Decode, backend, Some(url))
    })
    .await?;
    Ok((prefill, decode))
}

/// Greedy completion: text and usage, streamed or not.
async fn complete(addr: SocketAddr, prompt: &str, stream: bool) -> Result<(String, Value)> {
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream,
                "stream_options": {"include_usage": true}}),
    )
    .await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    if !stream {
        let v = r.json()?;
        let t = v["choices"][0]["text"].as_str().context("text")?.to_owned();
        return Ok((t, v["usage"].clone()));
    }
    let data = r.sse_data();
    ensure!(
        data.last().map(String::as_str) == Some("[DONE]"),
        "{}",
        r.body
    );
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d))
        .collect::<Result<_, _>>()?;
    ensure!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{}",
        r.body
    );
    let t = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|c| c["text"].as_str()))
        .collect();
    let usage = chunks.last().context("no chunks")?["usage"].clone();
    Ok((t, usage))
}

/// The value of the sample `name` (with its labels) in the worker's /metrics.
async fn metric(addr: SocketAddr, name: &str) -> Result<f64> {
    let r = request(addr, "GET", "/metrics", "").await?;
    ensure!(r.status == 200, "{}", r.body);
    let line = r
        .body
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|v| v.starts_with(' ')))
        .with_context(|| format!("no {name} in:\n{}", r.body))?;
    Ok(line[name.len()..].trim().parse()?)
}

const REMOTE: &str = "kvtier_worker_disagg_prefills_total{path=\"remote\"}";
const FALLBACK: &str = "kvtier_worker_disagg_prefills_total{path=\"fallback\"}";

async fn decode_equals_both(backend: BackendKind) -> Result<()> {
    let both = start_worker(None).await?;
    let (prefill, decode) = pair(backend).await?;
    let mut want = Vec::new();
    for n in LENGTHS {
        want.push(complete(both.addr(), &text(n), false).await?.0);
    }
    for stream in [false, true] {
        for (n, want) in LENGTHS.iter().zip(&want) {
            let (got, usage) = complete(decode.addr(), &text(*n), stream).await?;
            assert_eq!(&got, want, "{n} tokens, stream {stream}, over {backend:?}");
            assert_eq!(usage["prompt_tokens"], *n);
            assert_eq!(usage["completion_tokens"], 12);
            // Nothing came from kvtier's cache.
            assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
        }
    }
    // Concurrent requests share the decode worker's scheduler and its small pool (they wait
    // for blocks rather than fail).
    let prompts: Vec<String> = LENGTHS.iter().map(|n| text(*n)).collect();
    let answers =
        futures_util::future::join_all(prompts.iter().map(|p| complete(decode.addr(), p, false)))
            .await;
    for (a, want) in answers.into_iter().zip(&want) {
        assert_eq!(&a?.0, want, "concurrent, over {backend:?}");
    }
    let requests = (3 * LENGTHS.len()) as f64;
    assert_eq!(metric(decode.addr(), REMOTE).await?, requests);
    assert_eq!(metric(decode.addr(), FALLBACK).await?, 0.0);
    // The decode worker's scheduler computed no prompt token: it decoded on the KV it got.
    assert_eq!(
        metric(decode.addr(), "kvtier_worker_prompt_tokens_computed_total").await?,
        0.0
    );
    let received = metric(decode.addr(), "kvtier_worker_disagg_received_bytes_total").await?;
    assert_eq!(
        metric(
            decode.addr(),
            "kvtier_worker_disagg_remote_prefill_seconds_count"
        )
        .await?,
        requests
    );
    assert_eq!(
        metric(prefill.addr(), "kvtier_worker_disagg_prefill_served_total").await?,
        requests
    );
    let sent = metric(prefill.addr(), "kvtier_worker_disagg_sent_bytes_total").await?;
    assert!(received > 0.0);
    assert_eq!(received, sent, "bytes the decode worker counts as received");
    // Every block came back to the decode worker's pool: a request needing all of it runs.
    let whole = text(DECODE_POOL_BLOCKS * 16 - 11);
    assert_eq!(
        complete(decode.addr(), &whole, false).await?.0,
        complete(both.addr(), &whole, false).await?.0
    );

    // The prefill worker still serves the OpenAI API itself.
    assert_eq!(complete(prefill.addr(), &text(17), false).await?.0, want[2]);
    let health = request(prefill.addr(), "GET", "/health", "")
        .await?
        .json()?;
    assert_eq!(health["role"], "prefill");
    decode.shutdown().await;
    prefill.shutdown().await;
    both.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_over_shm_answers_as_one_worker() -> Result<()> {
    tokio::time::timeout(DEADLINE, decode_equals_both(BackendKind::Shm)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_over_tcp_answers_as_one_worker() -> Result<()> {
    tokio::time::timeout(DEADLINE, decode_equals_both(BackendKind::Tcp)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_prefill_worker_costs_a_local_prefill() -> Result<()> {
    tokio::time::timeout(DEADLINE, async {
        let both = start_worker(None).await?;
        let (prefill, decode) = pair(BackendKind::Shm).await?;
        let want = complete(both.addr(), &text(33), false).await?.0;
        assert_eq!(complete(decode.addr(), &text(33), false).await?.0, want);
        assert_eq!(metric(decode.addr(), REMOTE).await?, 1.0);
        prefill.shutdown().await;
        for stream in [false, true] {
            let (got, usage) = complete(decode.addr(), &text(33), stream).await?;
            assert_eq!(
                got, want,
                "after the prefill worker stopped, stream {stream}"
            );
            assert_eq!(usage["completion_tokens"], 12);
        }
        assert_eq!(metric(decode.addr(), REMOTE).await?, 1.0);
        assert_eq!(metric(decode.addr(), FALLBACK).await?, 2.0);
        assert_eq!(
            metric(
                decode.addr(),
                "kvtier_worker_disagg_local_prompt_tokens_total"
            )
            .await?,
            66.0
        );
        // The fallback prompts ran in the scheduler (chunked between other sequences' steps),
        // not under the decoder's own hold of the engine.
        assert_eq!(
            metric(decode.addr(), "kvtier_worker_prompt_tokens_computed_total").await?,
            66.0
        );
        decode.shutdown().await;
        both.shutdown().await;
        Ok(())
    })
    .await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_with_a_sidecar_stores_remote_prefills_and_reuses_them() -> Result<()> {
    tokio::time::timeout(DEADLINE, async {
        let dir = tempfile::tempdir()?;
        let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
        let both = start_worker(None).await?;
        let prefill = WorkerServer::start(config(Role::Prefill, BackendKind::Shm, None)).await?;
        let decode = WorkerServer::start(ServeConfig {
            sidecar: Some(unix),
            ..config(
                Role::Decode,
                BackendKind::Shm,
                Some(format!("http://{}", prefill.addr())),
            )
        })
        .await?;
        let prompt = text(40);
        let want = complete(both.addr(), &prompt, false).await?.0;
        // Cold: the prefill worker computes the prompt; its two full blocks go to the sidecar.
        let (cold, usage) = complete(decode.addr(), &prompt, false).await?;
        assert_eq!(cold, want);
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(metric(decode.addr(), REMOTE).await?, 1.0);
        let m = decode.metrics().clone();
        wait_for(Duration::from_secs(20), || m.blocks_stored.get() >= 2).await?;
        // Warm: the cached prefix is loaded here and only the rest computed locally.
        let (warm, usage) = complete(decode.addr(), &prompt, true).await?;
        assert_eq!(warm, want);
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 32);
        assert_eq!(metric(decode.addr(), REMOTE).await?, 1.0);
        assert_eq!(
            metric(decode.addr(), "kvtier_worker_prompt_tokens_computed_total").await?,
            8.0
        );
        decode.shutdown().await;
        prefill.shutdown().await;
        both.shutdown().await;
        server.shutdown().await;
        Ok(())
    })
    .await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_settings_that_do_not_go_together_are_startup_errors() -> Result<()> {
    let cases = [
        (
            config(Role::Decode, BackendKind::Shm, None),
            "role decode needs --prefill-url",
        ),
        (
            config(
                Role::Both,
                BackendKind::Shm,
                Some("http://127.0.0.1:9".into()),
            ),
            "is for role decode only",
        ),
        (
            config(
                Role::Prefill,
                BackendKind::Shm,
                Some("http://127.0.0.1:9".into()),
            ),
            "is for role decode only",
        ),
        (
            ServeConfig {
                listen: "0.0.0.0:0".into(),
                ..config(Role::Prefill, BackendKind::Shm, None)
            },
            "need a concrete IP in --listen",
        ),
        (
            config(Role::Prefill, BackendKind::Cuda, None),
            "--transfer-backend cuda is not supported by serve",
        ),
        (
            config(Role::Decode, BackendKind::Shm, Some("ftp://x".into())),
            "is not http://host:port",
        ),
    ];
    for (cfg, want) in cases {
        let e = match WorkerServer::start(cfg).await {
            Ok(w) => {
                w.shutdown().await;
                anyhow::bail!("started; expected an error with {want:?}");
            }
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{e} (expected {want:?})");
    }
    Ok(())
}

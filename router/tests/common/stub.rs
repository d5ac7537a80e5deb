//! A stand-in OpenAI worker whose speed the test sets: it answers `/v1/completions` (stream
//! or not) after the time a worker of that speed would take, and reports what it "loaded" in
//! kvtier-worker's `usage.kvtier` shape (`docs/worker.md`). It computes nothing: with the
//! byte tokenizer a prompt's tokens are its bytes after a BOS, and the prompt's leading
//! 16-token blocks it "holds" are those shared with a prompt it answered before, "loaded"
//! from DRAM. Stopped when dropped.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio_util::sync::{CancellationToken, DropGuard};

pub const BLOCK_TOKENS: usize = 16;
/// The default worker model's block (4 layers, 2 KV heads of 32, f32).
pub const BLOCK_BYTES: u64 = 32 << 10;

/// How fast the stub is.
#[derive(Clone, Copy, Debug)]
pub struct Speed {
    pub prefill_tokens_per_s: f64,
    pub decode_step_s: f64,
    /// Bytes per second it "loads" a held prefix at.
    pub load_bytes_per_s: f64,
}

struct Inner {
    speed: Speed,
    seen: Mutex<Vec<Vec<u8>>>,
}

pub struct Stub {
    pub url: String,
    _stop: DropGuard,
}

pub async fn start(speed: Speed) -> anyhow::Result<Stub> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    let inner = Arc::new(Inner {
        speed,
        seen: Mutex::new(Vec::new()),
    });
    let routes = axum::Router::new()
        .route("/v1/completions", post(complete))
        .route("/health", get(|| async { "{}" }))
        .with_state(inner);
    let stop = CancellationToken::new();
    tokio::spawn(kvtier_worker::serve::serve_streaming(
        l,
        routes,
        stop.clone(),
    ));
    Ok(Stub {
        url,
        _stop: stop.drop_guard(),
    })
}

async fn complete(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let prompt = req["prompt"]
        .as_str()
        .unwrap_or_default()
        .as_bytes()
        .to_vec();
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(4).max(1);
    let stream = req["stream"].as_bool().unwrap_or(false);
    // BOS, then the bytes.
    let tokens = prompt.len() + 1;
    let held_bytes = {
        let mut seen = s.seen.lock().unwrap();
        let lcp = seen
            .iter()
            .map(|p| p.iter().zip(&prompt).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        seen.push(prompt.clone());
        lcp
    };
    // Full blocks held (the BOS and the shared bytes), the last token always computed.
    let held_blocks = (held_bytes + 1).min(tokens - 1) / BLOCK_TOKENS;
    let cached = held_blocks * BLOCK_TOKENS;
    let loaded_bytes = held_blocks as u64 * BLOCK_BYTES;
    let sp = s.speed;
    let load_s = loaded_bytes as f64 / sp.load_bytes_per_s;
    let ttft = load_s + (tokens - cached) as f64 / sp.prefill_tokens_per_s;
    let usage = json!({
        "prompt_tokens": tokens,
        "completion_tokens": max_tokens,
        "total_tokens": tokens as u64 + max_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "kvtier": {
            "local_tokens": 0,
            "loaded_tokens": {"hbm": 0, "dram": cached, "nvme": 0},
            "loaded_bytes": {"hbm": 0, "dram": loaded_bytes, "nvme": 0},
            "load_s": load_s,
        },
    });
    if !stream {
        tokio::time::sleep(Duration::from_secs_f64(ttft)).await;
        let text = "x".repeat(max_tokens as usize);
        return axum::Json(json!({
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": usage,
        }))
        .into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
    tokio::spawn(async move {
        let event = |v: Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        tokio::time::sleep(Duration::from_secs_f64(ttft)).await;
        for i in 0..max_tokens {
            if i > 0 {
                tokio::time::sleep(Duration::from_secs_f64(sp.decode_step_s)).await;
            }
            let chunk = json!({"object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": null}]});
            if tx.send(event(chunk)).await.is_err() {
                return;
            }
        }
        let last = json!({"object": "text_completion", "choices": [], "usage": usage});
        let _ = tx.send(event(last)).await;
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|c| (c, rx))
    }));
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(body)
        .unwrap_or_else(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

//! A mock OpenAI-compatible completions endpoint (axum, loopback): streams `max_tokens` text
//! chunks with a known time to first token and gap, reports `cached_tokens` from a simulated
//! unlimited prefix cache, and can be told to fail. Used by the tests and by `mock://` targets
//! (a smoke run of the benchmark with no worker).
//!
//! Timing model: first chunk after `ttft_ms + uncached_prompt_tokens * prefill_us_per_token`,
//! then one chunk every `itl_ms`. With the cache off every prompt token is uncached.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use http_body::Frame;
use serde_json::Value;
use tokio::sync::mpsc;

/// How the mock fails, if it does (the tests choose; `mock://` targets never fail).
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Debug, PartialEq)]
pub enum Fail {
    /// Answer with this status and body.
    Status(u16, String),
    /// Stream one good chunk, then a data line that is not JSON.
    MalformedSse,
    /// Stream one good chunk, then end the body without `[DONE]`.
    Truncate,
}

#[derive(Clone, Debug)]
pub struct MockConfig {
    pub ttft_ms: f64,
    pub itl_ms: f64,
    pub prefill_us_per_token: f64,
    /// Simulate a prefix cache (else nothing is ever cached).
    pub cache: bool,
    /// Put `prompt_tokens_details.cached_tokens` in the usage chunk.
    pub report_cached: bool,
    /// Fail every `fail_every`-th request (1: all) this way.
    pub fail: Option<(Fail, usize)>,
    /// Cache granularity in tokens.
    pub block_tokens: usize,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            ttft_ms: 1.0,
            itl_ms: 1.0,
            prefill_us_per_token: 20.0,
            cache: true,
            report_cached: true,
            fail: None,
            block_tokens: 16,
        }
    }
}

impl MockConfig {
    /// Parses the query of a `mock://?key=value&...` target: `cache=on|off`, `ttft_ms`,
    /// `itl_ms`, `prefill_us_per_token`, `report_cached=on|off`.
    pub fn from_url(url: &str) -> Result<Self, String> {
        let mut c = Self::default();
        let q = url
            .strip_prefix("mock://")
            .ok_or_else(|| format!("{url}: not a mock:// target"))?;
        let q = q.trim_start_matches('/').trim_start_matches('?');
        for kv in q.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("{url}: {kv:?} is not key=value"))?;
            let num = || {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| format!("{url}: {k}={v:?} is not a number >= 0"))
            };
            let onoff = || match v {
                "on" | "true" | "1" => Ok(true),
                "off" | "false" | "0" => Ok(false),
                _ => Err(format!("{url}: {k}={v:?}: expected on or off")),
            };
            match k {
                "cache" => c.cache = onoff()?,
                "report_cached" => c.report_cached = onoff()?,
                "ttft_ms" => c.ttft_ms = num()?,
                "itl_ms" => c.itl_ms = num()?,
                "prefill_us_per_token" => c.prefill_us_per_token = num()?,
                _ => return Err(format!("{url}: unknown mock setting {k:?}")),
            }
        }
        Ok(c)
    }
}

/// What the mock saw.
#[derive(Default)]
pub struct MockLog {
    /// Prompts in arrival order (token ids; text prompts as bytes).
    pub prompts: Vec<Vec<u32>>,
    pub max_tokens: Vec<u64>,
}

struct MockState {
    cfg: MockConfig,
    log: Mutex<MockLog>,
    seen: Mutex<HashSet<u64>>,
    requests: AtomicUsize,
    inflight: AtomicUsize,
    peak_inflight: AtomicUsize,
}

/// A running mock; stopped when dropped.
pub struct MockServer {
    pub addr: SocketAddr,
    state: Arc<MockState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MockServer {
    /// Binds 127.0.0.1:0 and serves on the current runtime.
    pub async fn start(cfg: MockConfig) -> std::io::Result<Self> {
        let state = Arc::new(MockState {
            cfg,
            log: Mutex::new(MockLog::default()),
            seen: Mutex::new(HashSet::new()),
            requests: AtomicUsize::new(0),
            inflight: AtomicUsize::new(0),
            peak_inflight: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            // As the worker does: streamed chunks are not held back by Nagle's algorithm.
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, state, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Most requests streaming at once.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn peak_inflight(&self) -> usize {
        self.state.peak_inflight.load(Ordering::SeqCst)
    }

    /// What the mock received so far.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn with_log<R>(&self, f: impl FnOnce(&MockLog) -> R) -> R {
        f(&self.state.log.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A response body fed from a channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// Decrements the in-flight count when the stream ends (or the client goes away).
struct Inflight(Arc<MockState>);

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn completions(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let n = st.requests.fetch_add(1, Ordering::SeqCst) + 1;
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad JSON: {e}")).into_response(),
    };
    let prompt: Vec<u32> = match v.get("prompt") {
        Some(Value::String(s)) => s.bytes().map(u32::from).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().map(|x| x as u32))
            .collect::<Option<_>>()
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let max_tokens = v.get("max_tokens").and_then(Value::as_u64).unwrap_or(16);
    if prompt.is_empty() || v.get("stream") != Some(&Value::Bool(true)) {
        return (
            StatusCode::BAD_REQUEST,
            "expected a non-empty prompt and stream: true",
        )
            .into_response();
    }
    let fail = st
        .cfg
        .fail
        .as_ref()
        .filter(|(_, every)| *every > 0 && n.is_multiple_of(*every))
        .map(|(f, _)| f.clone());
    if let Some(Fail::Status(code, msg)) = &fail {
        let code = StatusCode::from_u16(*code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return (code, msg.clone()).into_response();
    }
    let cached = if st.cfg.cache {
        let mut h = DefaultHasher::new();
        let hashes: Vec<u64> = prompt
            .chunks_exact(st.cfg.block_tokens.max(1))
            .map(|b| {
                b.hash(&mut h);
                h.finish()
            })
            .collect();
        let mut seen = st.seen.lock().unwrap_or_else(|p| p.into_inner());
        let hit = hashes.iter().take_while(|k| seen.contains(k)).count();
        seen.extend(hashes);
        hit * st.cfg.block_tokens
    } else {
        0
    };
    let prompt_len = prompt.len();
    {
        let mut log = st.log.lock().unwrap_or_else(|p| p.into_inner());
        log.prompts.push(prompt);
        log.max_tokens.push(max_tokens);
    }
    let now = st.inflight.fetch_add(1, Ordering::SeqCst) + 1;
    st.peak_inflight.fetch_max(now, Ordering::SeqCst);
    let guard = Inflight(st.clone());
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let cfg = st.cfg.clone();
    let first = Duration::from_secs_f64(
        (cfg.ttft_ms + (prompt_len - cached) as f64 * cfg.prefill_us_per_token / 1e3) / 1e3,
    );
    tokio::spawn(async move {
        let _guard = guard;
        let chunk = |i: u64| {
            Bytes::from(format!(
                "data: {{\"id\":\"cmpl-mock\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"t{i}\",\"finish_reason\":null}}]}}\n\n"
            ))
        };
        tokio::time::sleep(first).await;
        for i in 0..max_tokens {
            if i > 0 {
                tokio::time::sleep(Duration::from_secs_f64(cfg.itl_ms / 1e3)).await;
            }
            if tx.send(chunk(i)).await.is_err() {
                return;
            }
            if i == 0 {
                match fail {
                    Some(Fail::MalformedSse) => {
                        let _ = tx.send(Bytes::from_static(b"data: {not json\n\n")).await;
                        return;
                    }
                    Some(Fail::Truncate) => return,
                    _ => {}
                }
            }
        }
        let details = if cfg.report_cached {
            format!(",\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}")
        } else {
            String::new()
        };
        let usage = format!(
            "data: {{\"id\":\"cmpl-mock\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt_len},\"completion_tokens\":{max_tokens},\"total_tokens\":{}{details}}}}}\n\ndata: [DONE]\n\n",
            prompt_len as u64 + max_tokens
        );
        let _ = tx.send(Bytes::from(usage)).await;
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::new(ChannelBody(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

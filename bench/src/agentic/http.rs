//! The streaming client for OpenAI-compatible `/v1/completions`, over the workspace's HTTP
//! client ([`kvtier_client::http`]: hyper, one connection per request, no TLS: put a local
//! proxy in front of an HTTPS endpoint). This module adds what an OpenAI stream needs: the
//! endpoint URL's forms, server-sent events split as the body arrives, and their timing (TTFT
//! from the first event carrying text, the gaps between text events). Every request has a
//! connect timeout and a total deadline.

use std::time::{Duration, Instant};

use kvtier_client::ClientError;
use kvtier_client::http::header::{ACCEPT, AUTHORIZATION};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};
use serde_json::Value;

/// Where requests go: `http://host:port[/prefix]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// Path prefix before `/v1/completions` (empty or starting with `/`, no trailing `/`).
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = if let Some(r) = url.strip_prefix("http://") {
            r
        } else if url.starts_with("https://") {
            return Err(format!(
                "{url}: https is not supported (plain HTTP only; put a local proxy in front)"
            ));
        } else {
            return Err(format!("{url}: expected http://HOST:PORT[/PATH]"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let path = path.strip_suffix("/v1").unwrap_or(path);
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() => (
                h.trim_start_matches('[').trim_end_matches(']'),
                p.parse::<u16>()
                    .map_err(|_| format!("{url}: bad port {p:?}"))?,
            ),
            _ if !authority.is_empty() => (authority, 80),
            _ => return Err(format!("{url}: no host")),
        };
        Ok(Self {
            host: host.to_owned(),
            port,
            prefix: path.to_owned(),
        })
    }

    pub fn url(&self) -> String {
        if self.host.contains(':') {
            format!("http://[{}]:{}{}", self.host, self.port, self.prefix)
        } else {
            format!("http://{}:{}{}", self.host, self.port, self.prefix)
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    pub total: Duration,
}

/// What one streamed completion measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    /// Time to the first chunk carrying text.
    pub ttft: Duration,
    /// Gaps between consecutive text chunks.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    /// Text chunks received.
    pub chunks: u64,
    /// From the final `usage`, when the server sent one.
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

const MAX_ERROR_BODY: usize = 2048;
/// Bound on one streamed completion's body (a long answer is a few hundred KiB of events).
const MAX_STREAM_BYTES: usize = 256 << 20;

/// The OpenAI client of one run: an [`HttpClient`] that opens one connection per request, so
/// every request is measured alike (the connect, tens of microseconds on loopback, is in its
/// TTFT; no request waits behind a server's Nagle delay on a reused connection), the endpoint
/// and its key.
#[derive(Clone, Debug)]
pub struct CompletionClient {
    http: HttpClient,
    url: String,
    api_key: Option<String>,
}

impl CompletionClient {
    /// Needs a Tokio runtime when used.
    pub fn new(ep: &Endpoint, api_key: Option<&str>, t: Timeouts) -> Self {
        let http = HttpClient::new(HttpConfig {
            connect_timeout: t.connect.min(t.total),
            timeout: t.total,
            max_body_bytes: MAX_STREAM_BYTES,
            keep_alive: false,
        });
        Self {
            http,
            url: format!("{}/v1/completions", ep.url()),
            api_key: api_key.map(str::to_owned),
        }
    }

    /// Checks that a TCP connection opens within the connect timeout.
    pub async fn probe(&self) -> Result<(), String> {
        self.http.probe(&self.url).await.map_err(|e| e.to_string())
    }

    /// POSTs `body` to `/v1/completions` and reads the event stream to `[DONE]`. TTFT runs from
    /// the call (the connect included) to the first event carrying text.
    pub async fn complete(&self, body: &[u8]) -> Result<Completion, String> {
        let start = Instant::now();
        let total = self.http.config().timeout;
        let timed_out = |e: ClientError| match e {
            ClientError::Timeout => format!("no complete response within {total:?}"),
            e => e.to_string(),
        };
        let mut req =
            HttpRequest::post_json(&self.url, body.to_vec()).header(ACCEPT, "text/event-stream");
        if let Some(k) = &self.api_key {
            req = req.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        let mut s = self.http.stream(req).await.map_err(timed_out)?;
        if !(200..300).contains(&s.status) {
            let text = s.prefix(MAX_ERROR_BODY).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            let text = text.trim();
            return Err(if text.is_empty() {
                format!("HTTP {} (empty body)", s.status)
            } else {
                format!("HTTP {}: {text}", s.status)
            });
        }
        let mut sse = Sse::new(start);
        while let Some(piece) = s.chunk().await.map_err(timed_out)? {
            if sse.feed(&piece)? {
                break;
            }
        }
        if !sse.done {
            // A final event may lack its trailing newline.
            if !sse.pending.is_empty() {
                let rest = std::mem::take(&mut sse.pending);
                sse.line(&rest)?;
            }
            if !sse.done {
                return Err(format!(
                    "the event stream ended without data: [DONE] (after {} text chunks)",
                    sse.c.chunks
                ));
            }
        }
        let mut c = sse.c;
        if c.chunks == 0 {
            return Err("the response carried no text".into());
        }
        c.e2e = start.elapsed();
        Ok(c)
    }
}

/// A server-sent-event splitter that records chunk times.
struct Sse {
    start: Instant,
    pending: Vec<u8>,
    last: Option<Instant>,
    done: bool,
    c: Completion,
}

impl Sse {
    fn new(start: Instant) -> Self {
        Self {
            start,
            pending: Vec::new(),
            last: None,
            done: false,
            c: Completion::default(),
        }
    }

    /// Feeds body bytes; true once `[DONE]` arrived.
    fn feed(&mut self, bytes: &[u8]) -> Result<bool, String> {
        self.pending.extend_from_slice(bytes);
        while let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
            let mut l: Vec<u8> = self.pending.drain(..=i).collect();
            l.pop();
            if l.last() == Some(&b'\r') {
                l.pop();
            }
            self.line(&l)?;
            if self.done {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn line(&mut self, l: &[u8]) -> Result<(), String> {
        let Some(data) = l.strip_prefix(b"data:") else {
            // Blank separators, comments (`:`), `event:`/`id:`/`retry:` fields.
            return Ok(());
        };
        let data = String::from_utf8_lossy(data);
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|e| {
            format!(
                "malformed event data {:?}: {e}",
                data.chars().take(120).collect::<String>()
            )
        })?;
        if let Some(e) = v.get("error") {
            let msg = e
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| e.to_string());
            return Err(format!("error event: {msg}"));
        }
        let text = v
            .get("choices")
            .and_then(|c| c.get(0))
            .and_then(|c| c.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !text.is_empty() {
            let now = Instant::now();
            match self.last {
                None => self.c.ttft = now - self.start,
                Some(prev) => self.c.itl.push(now - prev),
            }
            self.last = Some(now);
            self.c.chunks += 1;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.c.completion_tokens = u.get("completion_tokens").and_then(Value::as_u64);
            self.c.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
            self.c.cached_tokens = u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        let check = |url: &str, want: Result<(&str, u16, &str), &str>| {
            let got = Endpoint::parse(url);
            match want {
                Ok((h, p, pre)) => {
                    let e = got.unwrap_or_else(|e| panic!("{url}: {e}"));
                    assert_eq!((e.host.as_str(), e.port, e.prefix.as_str()), (h, p, pre));
                }
                Err(part) => {
                    let e = got.expect_err(url);
                    assert!(e.contains(part), "{url}: {e}");
                }
            }
        };
        check("http://127.0.0.1:8000", Ok(("127.0.0.1", 8000, "")));
        check("http://127.0.0.1:8000/", Ok(("127.0.0.1", 8000, "")));
        check("http://127.0.0.1:8000/v1", Ok(("127.0.0.1", 8000, "")));
        check("http://h:1/api/v1/", Ok(("h", 1, "/api")));
        check("http://[::1]:9", Ok(("::1", 9, "")));
        assert_eq!(
            Endpoint::parse("http://[::1]:9/a").unwrap().url(),
            "http://[::1]:9/a"
        );
        check("http://host", Ok(("host", 80, "")));
        check("https://x:1", Err("https is not supported"));
        check("x:1", Err("expected http://"));
        check("http://h:99999", Err("bad port"));
    }

    #[test]
    fn sse_counts_chunks_and_reads_usage() {
        let mut s = Sse::new(Instant::now());
        let done = s
            .feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n: comment\ndata: {\"choices\":[{\"text\":\"b\"}]}\r\n\r\n")
            .unwrap();
        assert!(!done);
        let done = s
            .feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n")
            .unwrap();
        assert!(done);
        assert_eq!(s.c.chunks, 2);
        assert_eq!(s.c.itl.len(), 1);
        assert_eq!(s.c.cached_tokens, Some(8));
        assert_eq!(s.c.prompt_tokens, Some(10));
        assert_eq!(s.c.completion_tokens, Some(2));
        let e = Sse::new(Instant::now()).feed(b"data: {oops\n").unwrap_err();
        assert!(e.contains("malformed event data"), "{e}");
        let e = Sse::new(Instant::now())
            .feed(b"data: {\"error\":{\"message\":\"too long\"}}\n")
            .unwrap_err();
        assert!(e.contains("too long"), "{e}");
    }
}

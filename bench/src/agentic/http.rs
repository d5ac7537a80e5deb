//! A small streaming client for OpenAI-compatible `/v1/completions` over plain HTTP/1.1.
//!
//! One connection per request (`Connection: close`), no TLS (put a local proxy in front of an
//! HTTPS endpoint), no new dependency: it writes the request, parses the status line and
//! headers, decodes a chunked, sized or read-to-close body and splits it into server-sent
//! events. Every request has a connect timeout and a total deadline. A connection on loopback
//! costs tens of microseconds, which lands in TTFT; remote endpoints pay one TCP handshake per
//! request, as a client without keep-alive would.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
                "{url}: https is not supported (plain HTTP/1.1 only; put a local proxy in front)"
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
        format!("http://{}:{}{}", self.host, self.port, self.prefix)
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

const MAX_HEAD_BYTES: usize = 64 << 10;
const MAX_ERROR_BODY: usize = 2048;

/// Checks that a TCP connection opens within the connect timeout.
pub async fn probe(ep: &Endpoint, t: Timeouts) -> Result<(), String> {
    connect(ep, t.connect).await.map(|_| ())
}

async fn connect(ep: &Endpoint, timeout: Duration) -> Result<TcpStream, String> {
    let s = tokio::time::timeout(timeout, TcpStream::connect((ep.host.as_str(), ep.port)))
        .await
        .map_err(|_| {
            format!(
                "connect to {}:{} timed out after {timeout:?}",
                ep.host, ep.port
            )
        })?
        .map_err(|e| format!("cannot connect to {}:{}: {e}", ep.host, ep.port))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// POSTs `body` to `/v1/completions` and reads the event stream to `[DONE]`.
pub async fn complete(
    ep: &Endpoint,
    body: &[u8],
    api_key: Option<&str>,
    t: Timeouts,
) -> Result<Completion, String> {
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + t.total;
    let fut = async {
        let mut s = connect(ep, t.connect.min(t.total)).await?;
        let mut req = format!(
            "POST {}/v1/completions HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\n\
             Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
            ep.prefix,
            ep.host,
            ep.port,
            body.len()
        );
        if let Some(k) = api_key {
            req.push_str(&format!("Authorization: Bearer {k}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("sending the request: {e}"))?;
        s.write_all(body)
            .await
            .map_err(|e| format!("sending the request: {e}"))?;
        read_response(&mut s, start).await
    };
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!("no complete response within {:?}", t.total)),
    }
}

/// Reads bytes from a connection, buffered.
struct Reader<'a> {
    s: &'a mut TcpStream,
    buf: Vec<u8>,
    eof: bool,
}

impl Reader<'_> {
    async fn fill(&mut self) -> Result<bool, String> {
        if self.eof {
            return Ok(false);
        }
        let mut tmp = [0u8; 16 << 10];
        let n = self
            .s
            .read(&mut tmp)
            .await
            .map_err(|e| format!("reading the response: {e}"))?;
        if n == 0 {
            self.eof = true;
            return Ok(false);
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(true)
    }

    /// A line ending in CRLF (or LF), without it.
    async fn line(&mut self, what: &str) -> Result<Vec<u8>, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let mut l: Vec<u8> = self.buf.drain(..=i).collect();
                l.pop();
                if l.last() == Some(&b'\r') {
                    l.pop();
                }
                return Ok(l);
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(format!("{what} longer than {MAX_HEAD_BYTES} bytes"));
            }
            if !self.fill().await? {
                return Err(format!("connection closed in the middle of {what}"));
            }
        }
    }

    async fn exact(&mut self, n: usize, what: &str) -> Result<Vec<u8>, String> {
        while self.buf.len() < n {
            if !self.fill().await? {
                return Err(format!("connection closed in the middle of {what}"));
            }
        }
        Ok(self.buf.drain(..n).collect())
    }
}

enum Framing {
    Chunked,
    Length(usize),
    Close,
}

/// The body, piece by piece as it arrives.
struct Body<'a> {
    r: Reader<'a>,
    framing: Framing,
    done: bool,
}

impl Body<'_> {
    async fn next(&mut self) -> Result<Option<Vec<u8>>, String> {
        if self.done {
            return Ok(None);
        }
        match &mut self.framing {
            Framing::Chunked => {
                let l = self.r.line("a chunk size").await?;
                let txt = String::from_utf8_lossy(&l);
                let size_txt = txt.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_txt, 16)
                    .map_err(|_| format!("bad chunk size line {txt:?}"))?;
                if size == 0 {
                    self.done = true;
                    return Ok(None);
                }
                let data = self.r.exact(size, "a chunk").await?;
                let crlf = self.r.line("a chunk's end").await?;
                if !crlf.is_empty() {
                    return Err("chunk not followed by CRLF".into());
                }
                Ok(Some(data))
            }
            Framing::Length(left) => {
                if *left == 0 {
                    self.done = true;
                    return Ok(None);
                }
                if self.r.buf.is_empty() && !self.r.fill().await? {
                    return Err(format!(
                        "connection closed with {left} bytes of the body missing"
                    ));
                }
                let n = self.r.buf.len().min(*left);
                *left -= n;
                Ok(Some(self.r.buf.drain(..n).collect()))
            }
            Framing::Close => {
                if self.r.buf.is_empty() && !self.r.fill().await? {
                    self.done = true;
                    return Ok(None);
                }
                Ok(Some(std::mem::take(&mut self.r.buf)))
            }
        }
    }
}

async fn read_response(s: &mut TcpStream, start: Instant) -> Result<Completion, String> {
    let mut r = Reader {
        s,
        buf: Vec::new(),
        eof: false,
    };
    let status_line = r.line("the status line").await?;
    let status_txt = String::from_utf8_lossy(&status_line).into_owned();
    let mut parts = status_txt.splitn(3, ' ');
    let (proto, code) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if !proto.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1.x response: {status_txt:?}"));
    }
    let code: u16 = code
        .parse()
        .map_err(|_| format!("bad status line {status_txt:?}"))?;
    let mut framing = Framing::Close;
    let mut head_bytes = 0usize;
    loop {
        let l = r.line("the headers").await?;
        head_bytes += l.len();
        if head_bytes > MAX_HEAD_BYTES {
            return Err(format!("headers longer than {MAX_HEAD_BYTES} bytes"));
        }
        if l.is_empty() {
            break;
        }
        let h = String::from_utf8_lossy(&l);
        let Some((name, value)) = h.split_once(':') else {
            return Err(format!("bad header line {h:?}"));
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked") {
            framing = Framing::Chunked;
        } else if name == "content-length" && !matches!(framing, Framing::Chunked) {
            framing = Framing::Length(
                value
                    .parse()
                    .map_err(|_| format!("bad Content-Length {value:?}"))?,
            );
        }
    }
    let mut body = Body {
        r,
        framing,
        done: false,
    };
    if !(200..300).contains(&code) {
        let mut text = Vec::new();
        while text.len() < MAX_ERROR_BODY {
            match body.next().await {
                Ok(Some(p)) => text.extend_from_slice(&p),
                _ => break,
            }
        }
        text.truncate(MAX_ERROR_BODY);
        let text = String::from_utf8_lossy(&text);
        let text = text.trim();
        return Err(if text.is_empty() {
            format!("HTTP {code} (empty body)")
        } else {
            format!("HTTP {code}: {text}")
        });
    }
    let mut sse = Sse::new(start);
    while let Some(piece) = body.next().await? {
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

//! The workspace's one HTTP/1.1 client: hyper's pooled client (`hyper-util`'s
//! `client::legacy::Client`) with the limits every kvtier caller needs.
//!
//! It lives here, in the SDK every other kvtier HTTP caller already links, so the dependency
//! direction stays as it is: `kvtier-core` does no I/O and gains nothing; the worker (its
//! disaggregation control channel), the benchmark (the agentic driver's OpenAI client) and the
//! tests of every package (admin ports, worker APIs) depend on `kvtier-client` anyway; and the
//! server never depends on it outside its tests and binary.
//!
//! What it guarantees:
//! * a connect timeout ([`HttpConfig::connect_timeout`]) and a deadline for the whole exchange,
//!   head and body ([`HttpConfig::timeout`]); a call that runs past it is
//!   [`ClientError::Timeout`];
//! * a failure to connect is [`ClientError::Connect`], so a caller knows the request was never
//!   sent;
//! * bodies are bounded ([`HttpConfig::max_body_bytes`], [`ClientError::TooLarge`]); a body cut
//!   short or malformed on the wire is [`ClientError::Http`];
//! * keep-alive connections are pooled per client and reused (one client per component: its
//!   connections belong to the runtime that made them), unless [`HttpConfig::keep_alive`] is
//!   off;
//! * streamed bodies ([`HttpClient::stream`]) hand out each piece as it arrives, so a caller
//!   can time the first chunk of a server-sent-event stream.
//!
//! Plain `http://` only (no TLS).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client as Pooled;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use crate::ClientError;

pub use hyper::{Method, header};

/// Limits of one [`HttpClient`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// Bound on opening a TCP connection. Default: 5 s.
    pub connect_timeout: Duration,
    /// Bound on one whole exchange: connect, request, response head and body. Default: 60 s.
    pub timeout: Duration,
    /// Most body bytes one response may carry. Default: 16 MiB.
    pub max_body_bytes: usize,
    /// Keep connections open after a response and reuse them; without it every request opens
    /// its own connection, closed after its response (a measuring client that wants each
    /// request alike: no server-side Nagle delay behind the previous response's unacknowledged
    /// bytes). Default: true.
    pub keep_alive: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(60),
            max_body_bytes: 16 << 20,
            keep_alive: true,
        }
    }
}

/// One request: method, `http://` URL, headers and body.
#[derive(Clone, Debug)]
pub struct HttpRequest {
    method: Method,
    url: String,
    headers: Vec<(HeaderName, String)>,
    body: Bytes,
}

impl HttpRequest {
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Self {
            method,
            url: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    pub fn get(url: impl Into<String>) -> Self {
        Self::new(Method::GET, url)
    }

    /// A `POST` of `body` as `application/json`.
    pub fn post_json(url: impl Into<String>, body: impl Into<Bytes>) -> Self {
        Self::new(Method::POST, url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(body)
    }

    pub fn header(mut self, name: HeaderName, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }
}

/// A whole response.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: Option<String>,
    /// Every header of the answer.
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl HttpResponse {
    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A response whose body is read piece by piece, under the request's deadline.
#[derive(Debug)]
pub struct HttpStream {
    pub status: u16,
    pub content_type: Option<String>,
    /// Every header of the answer.
    pub headers: hyper::HeaderMap,
    body: Incoming,
    deadline: Instant,
    max_body_bytes: usize,
    read: usize,
}

impl HttpStream {
    /// The next piece of the body as it arrived; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, ClientError> {
        loop {
            let frame = tokio::time::timeout_at(self.deadline, self.body.frame())
                .await
                .map_err(|_| ClientError::Timeout)?;
            let Some(frame) = frame else {
                return Ok(None);
            };
            let frame = frame.map_err(|e| ClientError::Http(chain("reading the body", &e)))?;
            // Trailers carry no body bytes.
            let Ok(data) = frame.into_data() else {
                continue;
            };
            self.read = self.read.saturating_add(data.len());
            if self.read > self.max_body_bytes {
                return Err(ClientError::TooLarge {
                    limit: self.max_body_bytes,
                });
            }
            return Ok(Some(data));
        }
    }

    /// The rest of the body, at most `limit` bytes of it (the rest is not read); for short
    /// error bodies.
    pub async fn prefix(&mut self, limit: usize) -> Result<Bytes, ClientError> {
        let mut out = Vec::new();
        while out.len() < limit {
            match self.chunk().await? {
                Some(c) => out.extend_from_slice(&c),
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out.into())
    }

    /// The whole rest of the body.
    pub async fn collect(mut self) -> Result<Bytes, ClientError> {
        let mut out = Vec::new();
        while let Some(c) = self.chunk().await? {
            out.extend_from_slice(&c);
        }
        Ok(out.into())
    }
}

/// A pooled HTTP/1.1 client. Cheap to clone (clones share the pool).
#[derive(Clone, Debug)]
pub struct HttpClient {
    pool: Pooled<HttpConnector, Full<Bytes>>,
    config: HttpConfig,
}

impl HttpClient {
    /// Needs a Tokio runtime when used (connections run as its tasks).
    pub fn new(config: HttpConfig) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(config.connect_timeout));
        conn.set_nodelay(true);
        conn.enforce_http(true);
        let mut b = Pooled::builder(TokioExecutor::new());
        b.pool_timer(TokioTimer::new());
        if !config.keep_alive {
            b.pool_max_idle_per_host(0);
        }
        let pool = b.build(conn);
        Self { pool, config }
    }

    pub fn config(&self) -> &HttpConfig {
        &self.config
    }

    /// Sends `req` and reads the whole response, within the limits.
    pub async fn send(&self, req: HttpRequest) -> Result<HttpResponse, ClientError> {
        let s = self.stream(req).await?;
        let (status, content_type) = (s.status, s.content_type.clone());
        let headers = s.headers.clone();
        let body = s.collect().await?;
        Ok(HttpResponse {
            status,
            content_type,
            headers,
            body,
        })
    }

    /// `GET url`, whole response.
    pub async fn get(&self, url: &str) -> Result<HttpResponse, ClientError> {
        self.send(HttpRequest::get(url)).await
    }

    /// Sends `req` and returns once the response head arrived; the body follows through
    /// [`HttpStream::chunk`], under the same deadline.
    pub async fn stream(&self, req: HttpRequest) -> Result<HttpStream, ClientError> {
        let deadline = Instant::now() + self.config.timeout;
        let uri = parse_url(&req.url)?;
        let mut b = Request::builder().method(req.method).uri(uri);
        for (name, value) in req.headers {
            let v = HeaderValue::try_from(value)
                .map_err(|e| ClientError::HttpUrl(format!("header {name}: {e}")))?;
            b = b.header(name, v);
        }
        let request = b
            .body(Full::new(req.body))
            .map_err(|e| ClientError::HttpUrl(format!("{}: {e}", req.url)))?;
        let resp = tokio::time::timeout_at(deadline, self.pool.request(request))
            .await
            .map_err(|_| ClientError::Timeout)?
            .map_err(|e| {
                if e.is_connect() {
                    ClientError::Connect(chain(&req.url, &e))
                } else {
                    ClientError::Http(chain(&req.url, &e))
                }
            })?;
        let content_type = resp
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let declared = resp
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.config.max_body_bytes as u64) {
            return Err(ClientError::TooLarge {
                limit: self.config.max_body_bytes,
            });
        }
        Ok(HttpStream {
            status: resp.status().as_u16(),
            content_type,
            headers: resp.headers().clone(),
            body: resp.into_body(),
            deadline,
            max_body_bytes: self.config.max_body_bytes,
            read: 0,
        })
    }

    /// Opens (and closes) a TCP connection to `url`'s host within the connect timeout: is
    /// anything listening there?
    pub async fn probe(&self, url: &str) -> Result<(), ClientError> {
        let uri = parse_url(url)?;
        let host = uri.host().unwrap_or_default();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = uri.port_u16().unwrap_or(80);
        let t = self.config.connect_timeout;
        match tokio::time::timeout(t, tokio::net::TcpStream::connect((host, port))).await {
            Err(_) => Err(ClientError::Connect(format!(
                "{host}:{port}: timed out after {t:?}"
            ))),
            Ok(Err(e)) => Err(ClientError::Connect(format!("{host}:{port}: {e}"))),
            Ok(Ok(_)) => Ok(()),
        }
    }
}

/// An `http://host[:port]/path` URL.
pub fn parse_url(url: &str) -> Result<Uri, ClientError> {
    let uri: Uri = url
        .parse()
        .map_err(|e| ClientError::HttpUrl(format!("{url}: {e}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ClientError::HttpUrl(format!(
                "{url}: https is not supported (plain HTTP only; put a local proxy in front)"
            )));
        }
        _ => {
            return Err(ClientError::HttpUrl(format!(
                "{url}: expected http://HOST:PORT"
            )));
        }
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(ClientError::HttpUrl(format!("{url}: no host")));
    }
    Ok(uri)
}

/// `what: error: cause: cause ...`, so a message says why (refused, reset, cut short).
fn chain(what: &str, e: &dyn std::error::Error) -> String {
    let mut s = format!("{what}: {e}");
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot server that answers every connection with `answer` (raw bytes, so that
    /// malformed answers can be served), after reading the request head.
    async fn serve_raw(answer: &'static [u8]) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(answer).await;
                let _ = s.shutdown().await;
            }
        });
        url
    }

    fn client(max_body_bytes: usize) -> HttpClient {
        HttpClient::new(HttpConfig {
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(5),
            max_body_bytes,
            keep_alive: true,
        })
    }

    #[tokio::test]
    async fn answers_are_read_whole_or_refused_with_a_reason() {
        let check = |answer: &'static [u8], want: Result<(u16, &'static str), &'static str>| async move {
            let url = serve_raw(answer).await;
            let got = client(8).get(&format!("{url}/x")).await;
            match (got, want) {
                (Ok(r), Ok((status, body))) => {
                    assert_eq!((r.status, r.text().as_str()), (status, body))
                }
                (Err(e), Err(variant)) => assert!(format!("{e:?}").starts_with(variant), "{e:?}"),
                (got, want) => panic!("{answer:?}: got {got:?}, wanted {want:?}"),
            }
        };
        check(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
            Ok((200, "{}")),
        )
        .await;
        check(
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 1\r\nconnection: close\r\n\r\nxy",
            Ok((404, "x")),
        )
        .await;
        check(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n1\r\n!\r\n0\r\n\r\n",
            Ok((200, "{}!")),
        )
        .await;
        check(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nto-eof",
            Ok((200, "to-eof")),
        )
        .await;
        check(
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{}",
            Err("Http("),
        )
        .await;
        check(
            b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n",
            Err("TooLarge"),
        )
        .await;
        check(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n0123456789",
            Err("TooLarge"),
        )
        .await;
        check(b"FTP 200\r\n\r\n", Err("Http(")).await;
        check(b"HTTP/1.1 200 OK\r\n", Err("Http(")).await;
    }

    #[tokio::test]
    async fn urls_connects_and_deadlines_fail_clearly() {
        let c = client(1 << 10);
        for (url, part) in [
            ("https://h:1/", "https is not supported"),
            ("h:1", "expected http://"),
            ("http:///x", "http:///x"),
        ] {
            let e = c.get(url).await.unwrap_err();
            assert!(
                matches!(e, ClientError::HttpUrl(_)) && e.to_string().contains(part),
                "{url}: {e}"
            );
        }
        // Nothing listening: a connect error, so the caller knows nothing was sent.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", l.local_addr().unwrap());
        drop(l);
        assert!(matches!(c.get(&url).await, Err(ClientError::Connect(_))));
        assert!(matches!(c.probe(&url).await, Err(ClientError::Connect(_))));
        // A listener that accepts and never answers: the deadline ends the call.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", l.local_addr().unwrap());
        c.probe(&url).await.unwrap();
        let quick = HttpClient::new(HttpConfig {
            timeout: Duration::from_millis(200),
            ..HttpConfig::default()
        });
        let t = std::time::Instant::now();
        assert!(matches!(quick.get(&url).await, Err(ClientError::Timeout)));
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    /// Counts the connections a server accepted; answers every request on each with `{}`.
    async fn serve_counting() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", l.local_addr().unwrap());
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    loop {
                        while let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            got.drain(..i + 4);
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
                            if s.write_all(ok).await.is_err() {
                                return;
                            }
                        }
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => got.extend_from_slice(&buf[..k]),
                        }
                    }
                });
            }
        });
        (url, accepted)
    }

    #[tokio::test]
    async fn keep_alive_reuses_one_connection_and_off_opens_one_per_request() {
        for (keep_alive, want) in [(true, 1), (false, 3)] {
            let (url, accepted) = serve_counting().await;
            let c = HttpClient::new(HttpConfig {
                keep_alive,
                ..HttpConfig::default()
            });
            for _ in 0..3 {
                assert_eq!(c.get(&url).await.unwrap().text(), "{}");
            }
            let n = accepted.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(n, want, "keep_alive {keep_alive}");
        }
    }

    #[tokio::test]
    async fn streams_hand_out_pieces_as_they_arrive() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/s", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                .await
                .unwrap();
            // The second piece only after the client saw the first.
            let _ = rx.await;
            s.write_all(b"6\r\nsecond\r\n0\r\n\r\n").await.unwrap();
        });
        let c = client(1 << 10);
        let mut s = c.stream(HttpRequest::post_json(url, "{}")).await.unwrap();
        assert_eq!(s.status, 200);
        assert_eq!(s.chunk().await.unwrap().as_deref(), Some(&b"first"[..]));
        tx.send(()).unwrap();
        assert_eq!(s.collect().await.unwrap(), Bytes::from_static(b"second"));
    }
}

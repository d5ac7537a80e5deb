//! Helpers for the serving tests: an in-process kvtier-server with this model's layout, a
//! worker on a loopback port, and requests over the workspace's HTTP client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest, Method, header};
use kvtier_server::server::{ConfigLoader, Server, ServerConfig};
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use serde_json::Value;

/// Bound on every HTTP exchange of the tests.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
pub const TOKEN: &str = "worker-test-token-0123456789";

/// A kvtier-server config for the default model (4 layers, 2 KV heads, head dim 32, f32,
/// 16-token blocks = 32 KiB), with a Unix socket and TCP on loopback, NVMe in `dir/nvme`.
pub fn kvtier_config(dir: &Path, dram: &str, layers: u32) -> Result<ServerConfig> {
    let q = |s: String| format!("{s:?}");
    let c = ConfigLoader::new()
        .set(&format!(
            "server.runtime_dir={}",
            q(dir.join("run").display().to_string())
        ))?
        .set(&format!(
            "server.unix={}",
            q(dir.join("kvtier.sock").display().to_string())
        ))?
        .set("server.tcp=\"127.0.0.1:0\"")?
        .set("server.quic=\"127.0.0.1:0\"")?
        .set("server.tls=\"127.0.0.1:0\"")?
        .set("server.admin=\"off\"")?
        .set(&format!("server.token={}", q(TOKEN.into())))?
        .set(&format!("store.dram_bytes={}", q(dram.into())))?
        .set("store.dram_prefault=false")?
        .set(&format!(
            "store.nvme_dir={}",
            q(dir.join("nvme").display().to_string())
        ))?
        .set("store.nvme_bytes=\"16MiB\"")?
        .set(&format!("layout.layers={layers}"))?
        .set("layout.kv_heads=2")?
        .set("layout.head_dim=32")?
        .set("layout.dtype=\"f32\"")?
        .set("layout.block_tokens=16")?
        .build()?;
    Ok(c)
}

pub async fn start_kvtier(config: &ServerConfig) -> Result<(Server, String, String)> {
    let server = Server::start(config.clone()).await?;
    let e = server.endpoints();
    let unix = format!(
        "unix://{}",
        e.unix.as_ref().context("unix socket")?.display()
    );
    let tcp = format!("tcp://{}", e.tcp.context("tcp")?);
    Ok((server, unix, tcp))
}

pub fn worker_config(sidecar: Option<String>) -> ServeConfig {
    ServeConfig {
        listen: "127.0.0.1:0".into(),
        sidecar,
        sidecar_token: Some(TOKEN.into()),
        pool_blocks: 256,
        max_batch: 4,
        ..ServeConfig::default()
    }
}

pub async fn start_worker(sidecar: Option<String>) -> Result<WorkerServer> {
    Ok(WorkerServer::start(worker_config(sidecar)).await?)
}

/// An HTTP response: status and body.
pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {}", self.body))
    }

    /// The `data:` payloads of a server-sent-event body.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// One exchange over the workspace's HTTP client, bounded by [`HTTP_TIMEOUT`].
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<HttpResponse> {
    request_within(addr, method, path, body, HTTP_TIMEOUT).await
}

/// [`request`], bounded by `timeout` (a real model's forward in a debug build on a loaded
/// machine can take minutes).
pub async fn request_within(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<HttpResponse> {
    let http = HttpClient::new(HttpConfig {
        timeout,
        ..HttpConfig::default()
    });
    let method = Method::from_bytes(method.as_bytes())?;
    let req = HttpRequest::new(method, format!("http://{addr}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.to_owned());
    let r = http.send(req).await.with_context(|| path.to_owned())?;
    Ok(HttpResponse {
        status: r.status,
        body: r.text(),
    })
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Result<HttpResponse> {
    request(addr, "POST", path, &body.to_string()).await
}

/// Waits until `f` holds, up to `limit`.
pub async fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + limit;
    while !f() {
        if Instant::now() > deadline {
            bail!("condition not met within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

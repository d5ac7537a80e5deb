//! `kvtier-bench server-demo`: the server's demonstration. Starts a kvtier server in this
//! process (small tiers, ephemeral ports, its own runtime directory), plays an inference worker
//! against it through the SDK over every transport (unix zero-copy, TCP, TLS, QUIC; a wrong token
//! refused; another tenant's salt missing), subscribes to block events, reads the admin
//! `/metrics`, then restarts the server to show the NVMe tier keeping the cache warm, and
//! exits. Every block fetched is verified ([`crate::replay::payload`]).
//!
//! It lives here, not in the server binary, so that the server does not depend on the client.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use kvtier_client::http::{HttpClient, HttpConfig};
use kvtier_client::{Client, ClientConfig, TierCode};
use kvtier_core::{BlockKey, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use kvtier_server::server::{ConfigLoader, Server, ServerConfig};

use crate::replay::payload;

#[derive(Args, Debug)]
pub struct ServerDemoArgs {
    /// TOML configuration file of the server (template: config/kvtier.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one server setting: section.key=value (repeatable; wins over the file, the
    /// environment and the demo's own defaults).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    /// DRAM tier size (e.g. 512MiB). [default: 512MiB]
    #[arg(long)]
    pub dram_bytes: Option<String>,
    /// NVMe tier directory ("" to disable the tier). [default: the server's, ./kvtier-data/nvme]
    #[arg(long)]
    pub nvme_dir: Option<String>,
    /// NVMe tier size. [default: twice the prompt, at least 64 MiB]
    #[arg(long)]
    pub nvme_bytes: Option<String>,
    /// Prompt length of the demonstration, in blocks.
    #[arg(long, default_value_t = 64)]
    pub demo_blocks: usize,
}

/// Runs the demonstration.
pub fn run(args: &ServerDemoArgs) -> Result<()> {
    if args.demo_blocks == 0 {
        anyhow::bail!("--demo-blocks must be at least 1");
    }
    let mut config = load_config(args)?;
    demo_defaults(args, &mut config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier")
        .build()?;
    rt.block_on(demo(config, args.demo_blocks))
}

/// The server's configuration as `kvtier-server` builds it: file, environment, flags, `--set`.
fn load_config(args: &ServerDemoArgs) -> Result<ServerConfig> {
    let mut l = ConfigLoader::new();
    if let Some(p) = &args.config {
        l = l.merge_file(p)?;
    }
    l = l.merge_env(std::env::vars())?;
    for (key, v) in [
        ("store.dram_bytes", &args.dram_bytes),
        ("store.nvme_dir", &args.nvme_dir),
        ("store.nvme_bytes", &args.nvme_bytes),
    ] {
        if let Some(v) = v {
            l = l.set(&format!("{key}={v:?}"))?;
        }
    }
    for s in &args.set {
        l = l.set(s)?;
    }
    Ok(l.build()?)
}

/// The demo runs beside anything else on the machine: its own runtime dir, ephemeral ports,
/// small tiers (flags and --set still win). The NVMe tier is sized to the demo's prompt (twice
/// its blocks, at least 64 MiB), not to a fixed size, so the demo runs on a nearly full disk.
fn demo_defaults(args: &ServerDemoArgs, c: &mut ServerConfig) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kvtier-demo-{}", std::process::id()));
    let nvme_mib = demo_nvme_bytes(c.layout()?.block_bytes(), args.demo_blocks).div_ceil(1 << 20);
    let mut l = ConfigLoader::new()
        .set(&format!(
            "server.runtime_dir={:?}",
            dir.display().to_string()
        ))?
        .set("server.tcp=\"127.0.0.1:0\"")?
        .set("server.quic=\"127.0.0.1:0\"")?
        .set("server.tls=\"127.0.0.1:0\"")?
        .set("server.admin=\"127.0.0.1:0\"")?
        .set("store.dram_bytes=\"512MiB\"")?
        .set(&format!("store.nvme_bytes=\"{nvme_mib}MiB\""))?;
    for s in &args.set {
        l = l.set(s)?;
    }
    let d = l.build()?;
    c.server.runtime_dir = d.server.runtime_dir;
    c.server.tcp = d.server.tcp;
    c.server.quic = d.server.quic;
    c.server.tls = d.server.tls;
    c.server.admin = d.server.admin;
    if args.dram_bytes.is_none() {
        c.store.dram_bytes = d.store.dram_bytes;
    }
    if args.nvme_bytes.is_none() {
        c.store.nvme_bytes = d.store.nvme_bytes;
    }
    c.validate()?;
    Ok(())
}

/// NVMe bytes the demo asks for: room for its prompt twice over, at least 64 MiB.
fn demo_nvme_bytes(block_bytes: u64, blocks: usize) -> u64 {
    (block_bytes.saturating_mul(blocks as u64).saturating_mul(2)).max(64 << 20)
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-9) / 1e9
}

fn summary(tiers: &[TierCode]) -> String {
    let count = |t| tiers.iter().filter(|x| **x == t).count();
    let (d, n) = (count(TierCode::Dram), count(TierCode::Nvme));
    format!("{} blocks ({d} DRAM, {n} NVMe)", tiers.len())
}

/// Fetches `keys` and checks every byte.
async fn fetch_verified(client: &Client, keys: &[BlockKey]) -> Result<(usize, Duration)> {
    let block = client.block_bytes();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; block]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let t = Instant::now();
    let got = client.get_into(keys, &mut dst).await;
    let took = t.elapsed();
    for (k, b) in keys.iter().zip(&bufs).take(got.blocks) {
        payload::verify(*k, b).map_err(|c| anyhow::anyhow!("block {k} came back wrong ({c:?})"))?;
    }
    anyhow::ensure!(got.miss.is_none(), "fetch stopped early: {:?}", got.miss);
    Ok((got.blocks, took))
}

async fn demo(config: ServerConfig, blocks: usize) -> Result<()> {
    let layout: KvLayout = config.layout()?;
    let nvme_dir = PathBuf::from(&config.store.nvme_dir);
    let block = layout.block_bytes() as usize;
    println!(
        "kvtier-server {} demo: layout {} layers x {} kv heads x {} dims, {}, {} tokens = {} KiB a block",
        env!("CARGO_PKG_VERSION"),
        layout.num_layers(),
        layout.num_kv_heads(),
        layout.head_dim(),
        layout.dtype().name(),
        layout.block_tokens(),
        block >> 10
    );
    let server = Server::start(config.clone())
        .await
        .context("starting the server")?;
    let e = server.endpoints().clone();
    let show = |a: Option<std::net::SocketAddr>| a.map_or("off".to_string(), |a| a.to_string());
    println!(
        "server up: tcp={} tls={} quic={} admin={}",
        show(e.tcp),
        show(e.tls),
        show(e.quic),
        show(e.admin)
    );
    let unix = format!(
        "unix://{}",
        e.unix
            .as_ref()
            .context("the demo needs the Unix socket")?
            .display()
    );

    // The worker side: keys of a prompt under the model's namespace and the tenant's salt.
    let secret = HashSecret::development();
    let keys_for = |salt: &[u8]| -> Result<Vec<BlockKey>> {
        let ns = NamespaceBuilder::new("llama-3-8b", layout.fingerprint())
            .cache_salt(salt)
            .build(&secret)?;
        let mut h = PrefixHasher::new(secret.clone(), ns, layout.block_tokens())?;
        let tokens: Vec<u32> = (0..(blocks * layout.block_tokens() as usize) as u32)
            .map(|i| i.wrapping_mul(2654435761) % 128_000)
            .collect();
        let mut keys = Vec::new();
        h.prompt_keys(&tokens, &mut keys);
        Ok(keys)
    };
    let keys = keys_for(b"tenant-a")?;
    let local = Client::connect(&unix, ClientConfig::default()).await?;
    let mut events = local.events(None, false).await?;
    println!(
        "worker (unix, zero-copy {}): prompt of {} tokens = {} blocks",
        local.is_local(),
        blocks * layout.block_tokens() as usize,
        keys.len()
    );
    let before = local.lookup(&keys).await;
    println!("  lookup before: {} cached", summary(&before.tiers));
    let start = before.tiers.len();
    let data: Vec<Vec<u8>> = keys[start..]
        .iter()
        .map(|k| {
            let mut b = vec![0u8; block];
            payload::fill(*k, &mut b);
            b
        })
        .collect();
    let bufs: Vec<&[u8]> = data.iter().map(|b| b.as_slice()).collect();
    let t = Instant::now();
    let stored = local
        .put_chain(&keys[start..], start.checked_sub(1).map(|p| keys[p]), &bufs)
        .await;
    anyhow::ensure!(stored.failure.is_none(), "put failed: {:?}", stored.failure);
    println!(
        "  put {} new blocks in {:.1} ms ({:.2} GB/s into reserved arena slots)",
        stored.cached(),
        t.elapsed().as_secs_f64() * 1e3,
        gbps(stored.cached() * block, t.elapsed())
    );
    let after = local.lookup(&keys).await;
    println!("  lookup after:  {} cached", summary(&after.tiers));
    let (n, took) = fetch_verified(&local, &keys).await?;
    println!(
        "  get {n} blocks, every byte verified: {:.2} GB/s (copied once, out of the mapped arena)",
        gbps(n * block, took)
    );
    let other = local.lookup(&keys_for(b"tenant-b")?).await;
    println!(
        "  the same prompt under another cache_salt: {} cached (tenants never share)",
        other.tiers.len()
    );
    for (name, url, cfg) in [
        (
            "tcp ",
            e.tcp.map(|a| format!("tcp://{a}")),
            ClientConfig::default().token(&e.token),
        ),
        (
            "tls ",
            e.tls.map(|a| format!("tls://{a}")),
            ClientConfig::default()
                .token(&e.token)
                .server_cert_der(e.quic_cert_der.clone()),
        ),
        (
            "quic",
            e.quic.map(|a| format!("quic://{a}")),
            ClientConfig::default()
                .token(&e.token)
                .server_cert_der(e.quic_cert_der.clone()),
        ),
    ] {
        let Some(url) = url else { continue };
        let remote = Client::connect(&url, cfg).await?;
        let (n, took) = fetch_verified(&remote, &keys).await?;
        println!(
            "worker ({name}, token): get {n} blocks verified, {:.2} GB/s",
            gbps(n * block, took)
        );
    }
    let denied = Client::connect(
        &format!("tcp://{}", e.tcp.context("tcp")?),
        ClientConfig::default().token("wrong"),
    )
    .await;
    println!(
        "a TCP client with a wrong token: {}",
        match denied {
            Ok(_) => "accepted (unexpected!)".to_string(),
            Err(e) => format!("refused ({e})"),
        }
    );
    let mut seen = 0;
    while let Ok(Some(batch)) =
        tokio::time::timeout(Duration::from_millis(200), events.next_batch()).await
    {
        seen += batch.len();
    }
    println!("block events seen by a subscriber (for KV-aware routers): {seen}");
    if let Some(a) = e.admin {
        let metrics = http_get(a, "/metrics").await?;
        println!(
            "admin /metrics: {} lines, e.g. {}",
            metrics.lines().count(),
            metrics
                .lines()
                .find(|l| l.starts_with("kvtier_tier_hits_total{tier=\"dram\"}"))
                .unwrap_or("?")
        );
    }
    drop((local, events));
    server.shutdown().await;

    println!("restarting the server...");
    let server = Server::start(config).await?;
    let local = Client::connect(&unix, ClientConfig::default()).await?;
    let warm = local.lookup(&keys).await;
    println!("  lookup after restart: {} cached", summary(&warm.tiers));
    let (n, took) = fetch_verified(&local, &keys).await?;
    println!(
        "  get {n} blocks from NVMe, every byte verified: {:.2} GB/s (promoted into DRAM)",
        gbps(n * block, took)
    );
    let again = local.lookup(&keys).await;
    println!("  lookup now: {} cached", summary(&again.tiers));
    drop(local);
    server.shutdown().await;
    let data_dir = std::fs::canonicalize(&nvme_dir).unwrap_or(nvme_dir);
    println!(
        "done. NVMe data lives in {} (remove it to start cold; run again to start warm)",
        data_dir.display()
    );
    Ok(())
}

/// The body of a GET on the admin port, through the workspace's HTTP client.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String> {
    let http = HttpClient::new(HttpConfig {
        timeout: Duration::from_secs(5),
        ..HttpConfig::default()
    });
    let resp = http.get(&format!("http://{addr}{path}")).await?;
    anyhow::ensure!(resp.status == 200, "GET {path}: HTTP {}", resp.status);
    Ok(resp.text())
}

#[cfg(test)]
mod tests {
    use super::demo_nvme_bytes;

    #[test]
    fn demo_nvme_tier_is_sized_to_the_prompt() {
        let block = 2u64 << 20;
        assert_eq!(demo_nvme_bytes(block, 8), 64 << 20, "the floor");
        assert_eq!(demo_nvme_bytes(block, 64), 256 << 20, "twice the prompt");
        assert_eq!(demo_nvme_bytes(u64::MAX, 2), u64::MAX, "no overflow");
    }
}

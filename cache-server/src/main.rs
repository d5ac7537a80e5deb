//! kvtier-server: the sidecar daemon. Runs on embedded defaults with no configuration
//! (`docs/operations.md` lists every setting). Its demonstration, which plays a worker
//! against it through the client SDK, is `kvtier-bench server-demo`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use kvtier_server::server::{ConfigLoader, Server, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "kvtier cache server: KV-cache blocks in DRAM and NVMe tiers for inference workers"
)]
struct Args {
    /// TOML configuration file (template: config/kvtier.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override one setting: section.key=value (repeatable; wins over file and environment).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Unix socket path ("off" to disable).
    #[arg(long)]
    unix: Option<String>,
    /// Plain TCP listen address ("off" to disable; loopback only unless
    /// server.tcp_plaintext = true).
    #[arg(long)]
    tcp: Option<String>,
    /// TLS-over-TCP listen address ("off" to disable).
    #[arg(long)]
    tls: Option<String>,
    /// QUIC listen address ("off" to disable).
    #[arg(long)]
    quic: Option<String>,
    /// HTTP admin address ("off" to disable).
    #[arg(long)]
    admin: Option<String>,
    /// Token for TCP, TLS and QUIC clients.
    #[arg(long)]
    token: Option<String>,
    /// DRAM tier size (e.g. 4GiB, or auto).
    #[arg(long)]
    dram_bytes: Option<String>,
    /// NVMe tier directory ("" to disable the tier).
    #[arg(long)]
    nvme_dir: Option<String>,
    /// NVMe tier size (e.g. 100GiB, or auto).
    #[arg(long)]
    nvme_bytes: Option<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

/// Descriptors the server needs beside its connections (listeners, the arena, NVMe slot
/// files, the runtime's own).
const FD_HEADROOM: u64 = 64;

fn load_config(args: &Args) -> Result<ServerConfig> {
    let mut l = ConfigLoader::new();
    if let Some(p) = &args.config {
        l = l.merge_file(p)?;
    }
    l = l.merge_env(std::env::vars())?;
    let quoted = |v: &str| format!("{:?}", v);
    for (key, v) in [
        ("server.unix", &args.unix),
        ("server.tcp", &args.tcp),
        ("server.tls", &args.tls),
        ("server.quic", &args.quic),
        ("server.admin", &args.admin),
        ("server.token", &args.token),
        ("store.dram_bytes", &args.dram_bytes),
        ("store.nvme_dir", &args.nvme_dir),
        ("store.nvme_bytes", &args.nvme_bytes),
    ] {
        if let Some(v) = v {
            l = l.set(&format!("{key}={}", quoted(v)))?;
        }
    }
    for s in &args.set {
        l = l.set(s)?;
    }
    Ok(l.build()?)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,quinn=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = load_config(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    // Room for max_connections (each a descriptor) and the server's own files; past the
    // limit, connections are refused cleanly, and the operator is told why up front.
    match kvtier_server::server::raise_nofile_limit() {
        Ok(n) if n < config.limits.max_connections as u64 + FD_HEADROOM => tracing::warn!(
            "the open-file limit is {n}, below limits.max_connections ({}) + {FD_HEADROOM}: \
             connections past the limit are refused as \"out of file descriptors\"; raise it \
             (ulimit -n, LimitNOFILE) or lower limits.max_connections",
            config.limits.max_connections
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier")
        .build()?;
    rt.block_on(serve(config))
}

async fn serve(config: ServerConfig) -> Result<()> {
    // Handlers first: a SIGTERM that arrives as soon as we report ready is a clean stop.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let server = Server::start(config).await?;
    let e = server.endpoints().clone();
    println!("kvtier-server {} ready", env!("CARGO_PKG_VERSION"));
    print_endpoints(&e);
    // One machine-readable line (tests and scripts parse it).
    let show = |a: Option<std::net::SocketAddr>| a.map_or("off".to_string(), |a| a.to_string());
    println!(
        "listening unix={} tcp={} quic={} admin={} tls={} zmq={}",
        e.unix
            .as_ref()
            .map_or("off".into(), |p| p.display().to_string()),
        show(e.tcp),
        show(e.quic),
        show(e.admin),
        show(e.tls),
        e.zmq.as_deref().unwrap_or("off")
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("interrupt: draining"),
    }
    let report = server.shutdown().await;
    tracing::info!(cut = report.connections_cut, "stopped");
    Ok(())
}

fn print_endpoints(e: &kvtier_server::server::Endpoints) {
    if let Some(p) = &e.unix {
        println!("  unix  unix://{}  (local workers; zero-copy)", p.display());
    }
    if let Some(a) = e.tcp {
        println!("  tcp   tcp://{a}  (token required; plain text)");
    }
    if let Some(a) = e.tls {
        println!("  tls   tls://{a}  (token required; TLS)");
    }
    if let Some(a) = e.quic {
        println!("  quic  quic://{a}  (token required; TLS)");
    }
    if let Some(a) = e.admin {
        println!("  admin http://{a}/metrics  /stats  /health  /ready  /cluster");
    }
    if let Some(t) = &e.token_file {
        println!("  token file {} (mode 0600)", t.display());
    }
    if let Some(c) = &e.quic_cert_file {
        println!(
            "  certificate of QUIC and TLS {} (clients pin it)",
            c.display()
        );
    }
}

//! The real binaries on loopback: kvtier-server sidecars, kvtier-worker processes (the default
//! random-weight model) and kvtier-router, each killed when dropped; requests over the
//! workspace's HTTP client.
//!
//! kvtier-server and kvtier-worker are other packages' binaries: they are found next to this
//! test's executable (`target/<profile>/`, where `cargo test --workspace` or `cargo build -p
//! kvtier-server -p kvtier-worker` puts them), or at `KVTIER_SERVER_BIN` / `KVTIER_WORKER_BIN`.
#![allow(dead_code)]

pub mod stub;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest, HttpResponse};
use kvtier_testkit::process::ChildGuard;
use serde_json::Value;

pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
const STARTUP: Duration = Duration::from_secs(60);

/// The entry of worker `w` in a `/debug/route` answer.
pub fn entry<'a>(v: &'a Value, w: &str) -> &'a Value {
    v["workers"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["url"] == w))
        .unwrap_or_else(|| panic!("{w} not in {v}"))
}

/// Runs `f` with a deadline: a hung test fails instead of hanging CI.
pub async fn bounded<F: std::future::Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test exceeded its time bound")
}

/// Another package's binary, next to this test's executable or named by `env`.
pub fn bin(name: &str, env: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .expect("target directory");
    assert!(
        p.is_file(),
        "{} not found: build it first (cargo build -p {name}; `cargo test --workspace` does) or set {env}",
        p.display()
    );
    p
}

/// A child process that printed its ready line; killed when dropped.
pub struct Proc {
    guard: Option<ChildGuard>,
    pub ready: String,
    cmd: Vec<String>,
}

impl Proc {
    /// Starts `program args` and waits for a stdout line starting with `prefix`.
    pub fn start(program: &Path, args: &[String], prefix: &str) -> Result<Proc> {
        let mut child = Command::new(program)
            .args(args)
            .env("RUST_LOG", "warn,kvtier_router=info")
            .env_remove("KVTIER_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let stdout = child.stdout.take().context("stdout")?;
        let guard = ChildGuard::new(child);
        let (tx, rx) = std::sync::mpsc::channel();
        let prefix = prefix.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with(&prefix) {
                    let _ = tx.send(line);
                }
            }
        });
        let ready = rx.recv_timeout(STARTUP).with_context(|| {
            format!(
                "{} {args:?}: no ready line within {STARTUP:?}",
                program.display()
            )
        })?;
        let mut cmd = vec![program.display().to_string()];
        cmd.extend(args.iter().cloned());
        Ok(Proc {
            guard: Some(guard),
            ready,
            cmd,
        })
    }

    /// The value of `name=` in the ready line.
    pub fn field(&self, name: &str) -> String {
        self.ready
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_default()
            .to_owned()
    }

    /// SIGKILL, at once.
    pub fn kill(&mut self) {
        if let Some(mut g) = self.guard.take() {
            let _ = g.child().kill();
            let _ = g.child().wait();
        }
    }

    /// SIGTERM, then waits (SIGKILL after 20 s); the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut g = self.guard.take()?;
        let pid = g.child().id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(s)) = g.child().try_wait() {
                return Some(s);
            }
            if Instant::now() > until {
                return None; // the guard kills it
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A kvtier-server for the default worker model (32 KiB blocks), on a Unix socket in `dir`
/// (a fixed path, so a restart comes back where the router looks), with an NVMe tier in
/// `dir/nvme` so a restart keeps the blocks.
pub struct KvServer {
    pub proc: Proc,
    pub dir: PathBuf,
    args: Vec<String>,
}

impl KvServer {
    pub fn start(dir: &Path) -> Result<KvServer> {
        std::fs::create_dir_all(dir)?;
        let mut args: Vec<String> = vec![
            "--unix".into(),
            dir.join("kvtier.sock").display().to_string(),
            "--tcp".into(),
            "off".into(),
            "--quic".into(),
            "off".into(),
            "--tls".into(),
            "off".into(),
            "--admin".into(),
            "off".into(),
            "--dram-bytes".into(),
            "16MiB".into(),
            "--nvme-dir".into(),
            dir.join("nvme").display().to_string(),
            "--nvme-bytes".into(),
            "32MiB".into(),
        ];
        for s in [
            format!(
                "server.runtime_dir={:?}",
                dir.join("run").display().to_string()
            ),
            "store.dram_prefault=false".into(),
            "layout.layers=4".into(),
            "layout.kv_heads=2".into(),
            "layout.head_dim=32".into(),
            "layout.dtype=\"f32\"".into(),
            "layout.block_tokens=16".into(),
        ] {
            args.push("--set".into());
            args.push(s);
        }
        let proc = Proc::start(
            &bin("kvtier-server", "KVTIER_SERVER_BIN"),
            &args,
            "listening ",
        )?;
        Ok(KvServer {
            proc,
            dir: dir.to_owned(),
            args,
        })
    }

    pub fn url(&self) -> String {
        format!("unix://{}", self.dir.join("kvtier.sock").display())
    }

    /// Stops (SIGTERM) and starts again on the same directory and socket.
    pub fn restart(&mut self) -> Result<()> {
        let s = self.proc.terminate();
        if !s.is_some_and(|s| s.success()) {
            bail!("the server did not stop cleanly: {s:?}");
        }
        self.proc = Proc::start(
            &bin("kvtier-server", "KVTIER_SERVER_BIN"),
            &self.args,
            "listening ",
        )?;
        Ok(())
    }
}

/// A kvtier-worker on `listen` (e.g. 127.0.0.1:0) with `sidecar` (a URL or "off").
pub fn worker(listen: &str, sidecar: &str, extra: &[&str]) -> Result<(Proc, String)> {
    let mut args: Vec<String> = [
        "serve",
        "--listen",
        listen,
        "--sidecar",
        sidecar,
        "--pool-blocks",
        "512",
        "--max-batch",
        "4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let p = Proc::start(
        &bin("kvtier-worker", "KVTIER_WORKER_BIN"),
        &args,
        "listening http=",
    )?;
    let url = format!("http://{}", p.field("http"));
    Ok((p, url))
}

/// kvtier-router with `args` on a free port.
pub fn router(args: &[String]) -> Result<(Proc, String)> {
    let mut a: Vec<String> = vec!["--listen".into(), "127.0.0.1:0".into()];
    a.extend(args.iter().cloned());
    let p = Proc::start(
        Path::new(env!("CARGO_BIN_EXE_kvtier-router")),
        &a,
        "listening http=",
    )?;
    let url = format!("http://{}", p.field("http"));
    Ok((p, url))
}

pub fn http() -> HttpClient {
    HttpClient::new(HttpConfig {
        timeout: HTTP_TIMEOUT,
        ..HttpConfig::default()
    })
}

pub async fn post(url: &str, body: &Value) -> Result<HttpResponse> {
    http()
        .send(HttpRequest::post_json(url, body.to_string()))
        .await
        .with_context(|| url.to_owned())
}

pub async fn get(url: &str) -> Result<HttpResponse> {
    http().get(url).await.with_context(|| url.to_owned())
}

pub fn json(r: &HttpResponse) -> Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()))
}

/// The worker that answered (the router's `x-kvtier-worker` header).
pub fn answered_by(r: &HttpResponse) -> String {
    r.headers
        .get("x-kvtier-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// `kvtier_router_load_reports_total{worker=w, outcome=o}` in a `/metrics` text.
pub fn load_reports(text: &str, w: &str, o: &str) -> f64 {
    metric(
        text,
        "kvtier_router_load_reports_total",
        &[("worker", w), ("outcome", o)],
    )
}

/// Sum of the samples of metric `name` whose labels contain every `labels` pair, in a
/// Prometheus text exposition.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Waits until `f` gives true, up to `limit`, asking every 100 ms.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let until = Instant::now() + limit;
    loop {
        if f().await? {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A completion request for `prompt` (greedy).
pub fn completion(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// A text of about `n` bytes (the byte tokenizer: one token each) that differs by `seed`.
pub fn text(seed: u64, n: usize) -> String {
    let words = [
        "agent", "tool", "cache", "block", "prefix", "router", "worker", "token",
    ];
    let mut s = format!("[{seed}] ");
    let mut rng = kvtier_core::SplitMix64::new(seed);
    while s.len() < n {
        s.push_str(words[rng.below(words.len() as u64) as usize]);
        s.push(' ');
    }
    s.truncate(n);
    s
}

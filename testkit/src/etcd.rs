//! A real etcd (Debian's `etcd-server`, `/usr/bin/etcd`) on loopback for the tests (the
//! server's cluster tests, the router's membership test): a temp data dir, free ports, started
//! and checked within a bound, killed on drop. Missing etcd fails the test, naming
//! `.ci/install-deps`.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// etcd's binary: `$KVTIER_ETCD`, else `/usr/bin/etcd`.
fn binary() -> PathBuf {
    let p = std::env::var_os("KVTIER_ETCD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
    assert!(
        p.is_file(),
        "etcd not found at {}: the cluster tests need a real etcd. Install it with \
         .ci/install-deps (Debian package etcd-server), or point KVTIER_ETCD at an etcd binary",
        p.display()
    );
    p
}

/// Two distinct free ports on `host` (both held while chosen, so they differ). Another process
/// may still take one before etcd binds it: [`Etcd::start_on`] then tries again.
fn free_ports(host: &str) -> (u16, u16) {
    let bind = || TcpListener::bind((host, 0)).expect("a free port");
    let (a, b) = (bind(), bind());
    let port = |l: &TcpListener| l.local_addr().expect("a bound port").port();
    (port(&a), port(&b))
}

pub struct Etcd {
    child: Option<Child>,
    host: String,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd on loopback and waits (at most 20 s) until it answers `/health`.
    pub async fn start() -> Etcd {
        Self::start_on("127.0.0.1").await
    }

    /// Starts etcd listening on `host` (an address of the caller's network namespace). A port
    /// taken between its choice and etcd's bind (tests start servers in parallel) makes etcd
    /// exit at start: up to three tries, each on new ports and a fresh data dir.
    pub async fn start_on(host: &str) -> Etcd {
        let mut last = String::new();
        for _ in 0..3 {
            let (client_port, peer_port) = free_ports(host);
            let mut e = Etcd {
                child: None,
                host: host.to_owned(),
                client_port,
                peer_port,
                dir: tempfile::tempdir().unwrap(),
            };
            match e.try_spawn().await {
                Ok(()) => return e,
                Err(why) => last = why,
            }
        }
        panic!("etcd did not start in three tries: {last}");
    }

    /// The client URL (`http://HOST:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.host, self.client_port)
    }

    async fn spawn(&mut self) {
        if let Err(why) = self.try_spawn().await {
            panic!("{why}");
        }
    }

    /// Starts etcd and waits (at most 20 s) until it is healthy; `Err` if it exited first.
    async fn try_spawn(&mut self) -> Result<(), String> {
        let client = self.url();
        let peer = format!("http://{}:{}", self.host, self.peer_port);
        let child = Command::new(binary())
            .arg("--name=kvtier-test")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=kvtier-test={peer}"))
            .arg("--logger=zap")
            .arg("--log-level=error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning etcd");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(20);
        let addr = format!("{}:{}", self.host, self.client_port)
            .parse()
            .unwrap();
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                self.child = None;
                return Err(format!("etcd exited at start: {status}"));
            }
            if let Ok(Some(body)) = tokio::time::timeout(Duration::from_secs(2), health(addr)).await
                && body.contains("true")
            {
                return Ok(());
            }
            assert!(
                Instant::now() < until,
                "etcd did not become healthy in 20 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills etcd (SIGKILL), keeping its data dir and ports.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same data dir and ports.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

/// The body of etcd's `/health` if it answers 200 (HTTP/1.0, so the body ends at close).
async fn health(addr: std::net::SocketAddr) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    s.take(64 << 10).read_to_end(&mut out).await.ok()?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n")?;
    (head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")).then(|| body.to_string())
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

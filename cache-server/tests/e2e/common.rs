//! Starts the real `kvtier-server` binary on loopback with small tiers, in a temporary
//! directory, and stops it (SIGTERM, then SIGKILL) when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_client::http::{HttpClient, HttpConfig};
use kvtier_client::{Client, ClientConfig};
use kvtier_core::protocol::{HEADER_BYTES, Header, Limits, Request, Response};
use kvtier_core::{BlockKey, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const TOKEN: &str = "e2e-secret-token";
/// 1 layer x 4 kv heads x 16 dims x f16 x 16 tokens: 4 KiB blocks.
pub const BLOCK: usize = 4096;

pub fn layout() -> KvLayout {
    KvLayout::new(1, 4, 16, kvtier_core::Dtype::F16, 16).unwrap()
}

/// Runs `f` with a deadline: a hung test fails instead of hanging CI.
pub async fn bounded<F: std::future::Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test exceeded its time bound")
}

pub struct ServerProc {
    child: Option<Child>,
    pub dir: PathBuf,
    pub unix: PathBuf,
    pub tcp: SocketAddr,
    /// TLS over TCP.
    pub tls: SocketAddr,
    pub quic: SocketAddr,
    pub admin: SocketAddr,
    args: Vec<String>,
    _tmp: Option<tempfile::TempDir>,
}

/// What a server process is started through.
enum Wrap<'a> {
    None,
    /// `sh -c "ulimit -n N && exec ..."`.
    Nofile(u32),
    /// `ip netns exec NS ...` (the cluster tests' hosts).
    #[allow(dead_code)]
    Netns(&'a str),
}

impl ServerProc {
    /// Starts a server; `extra` are more `--set` assignments.
    pub fn start(extra: &[&str]) -> ServerProc {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let mut p = Self::start_in(&dir, extra);
        p._tmp = Some(tmp);
        p
    }

    /// The `--set` assignments of a server in `dir`, then `extra` (which win).
    fn args(dir: &Path, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = [
            format!(
                "server.runtime_dir={:?}",
                dir.join("run").display().to_string()
            ),
            "server.tcp=\"127.0.0.1:0\"".into(),
            "server.quic=\"127.0.0.1:0\"".into(),
            "server.tls=\"127.0.0.1:0\"".into(),
            "server.admin=\"127.0.0.1:0\"".into(),
            format!("server.token={TOKEN:?}"),
            "store.dram_bytes=\"4MiB\"".into(),
            "store.dram_prefault=false".into(),
            format!(
                "store.nvme_dir={:?}",
                dir.join("nvme").display().to_string()
            ),
            "store.nvme_bytes=\"8MiB\"".into(),
            "store.io_threads=2".into(),
            "layout.layers=1".into(),
            "layout.kv_heads=4".into(),
            "layout.head_dim=16".into(),
            "layout.dtype=\"f16\"".into(),
            "limits.frame_timeout_ms=1500".into(),
            "limits.drain_timeout_ms=3000".into(),
        ]
        .into();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Runs a server in `dir` that must refuse to start; its exit status and what it said
    /// on stderr (within 30 s).
    pub fn refused_in(dir: &Path, extra: &[&str]) -> (std::process::ExitStatus, String) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-server"));
        for a in Self::args(dir, extra) {
            cmd.arg("--set").arg(a);
        }
        let mut child = cmd
            .env("RUST_LOG", "warn")
            .env_remove("KVTIER_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kvtier-server");
        let until = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the server did not refuse to start within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        (status, err)
    }

    /// Starts a server whose state lives in `dir` (kept by the caller across restarts).
    pub fn start_in(dir: &Path, extra: &[&str]) -> ServerProc {
        Self::spawn(dir, extra, Wrap::None)
    }

    /// Starts a server that may hold at most `nofile` file descriptors (`ulimit -n`).
    pub fn start_with_nofile(nofile: u32, extra: &[&str]) -> ServerProc {
        let tmp = tempfile::tempdir().unwrap();
        let mut p = Self::spawn(tmp.path(), extra, Wrap::Nofile(nofile));
        p._tmp = Some(tmp);
        p
    }

    /// Starts a server in network namespace `ns` (`ip netns exec`, which becomes the server);
    /// used by the cluster tests (tests/cluster/partition.rs).
    #[allow(dead_code)]
    pub fn start_in_netns(ns: &str, extra: &[&str]) -> ServerProc {
        let tmp = tempfile::tempdir().unwrap();
        let mut p = Self::spawn(tmp.path(), extra, Wrap::Netns(ns));
        p._tmp = Some(tmp);
        p
    }

    fn spawn(dir: &Path, extra: &[&str], wrap: Wrap) -> ServerProc {
        let args = Self::args(dir, extra);
        let bin = env!("CARGO_BIN_EXE_kvtier-server");
        let mut cmd = match wrap {
            Wrap::None => Command::new(bin),
            Wrap::Nofile(n) => {
                // The shell lowers its own limit, then becomes the server.
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(bin);
                c
            }
            Wrap::Netns(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
        };
        for a in &args {
            cmd.arg("--set").arg(a);
        }
        let mut child = cmd
            .env(
                "RUST_LOG",
                std::env::var("KVTIER_TEST_SERVER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env_remove("KVTIER_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning kvtier-server");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("listening ") {
                    let _ = tx.send(line);
                }
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(30)).ok();
        let field = |name: &str| -> Option<&str> {
            line.as_deref()?
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        };
        let addr = |name: &str| field(name)?.parse::<SocketAddr>().ok();
        let (Some(unix), Some(tcp), Some(tls), Some(quic), Some(admin)) = (
            field("unix"),
            addr("tcp"),
            addr("tls"),
            addr("quic"),
            addr("admin"),
        ) else {
            // Not left running behind a failed test.
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the server did not report its endpoints within 30 s as this helper reads them: {line:?}"
            );
        };
        ServerProc {
            child: Some(child),
            dir: dir.to_path_buf(),
            unix: PathBuf::from(unix),
            tcp,
            tls,
            quic,
            admin,
            args,
            _tmp: None,
        }
    }

    /// Stops (SIGTERM) and starts again on the same directory.
    pub fn restart(mut self) -> ServerProc {
        let status = self.stop();
        assert!(status.success(), "server exited with {status}");
        self.start_again()
    }

    /// SIGKILL (no shutdown at all), then starts again on the same directory: a crash and a
    /// supervisor's restart.
    #[allow(dead_code)] // used by the cluster tests
    pub fn kill_and_start_again(mut self) -> ServerProc {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.start_again()
    }

    /// A server on this one's directory and arguments (this one already stopped).
    fn start_again(mut self) -> ServerProc {
        let extra: Vec<String> = self.args.clone();
        let tmp = self._tmp.take();
        let mut p = ServerProc::start_in(
            &self.dir,
            &extra.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        );
        p._tmp = tmp;
        p
    }

    /// Lets this process's group through the socket's directories (mode 0710; the socket
    /// itself is 0660 with `server.unix_group`).
    #[allow(dead_code)] // the e2e tests'; the cluster tests share this file
    pub fn open_to_group(&self) {
        use std::os::unix::fs::PermissionsExt;
        for d in [self.dir.as_path(), self.unix.parent().unwrap()] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o710)).unwrap();
        }
    }

    /// Sends `signal` to the server (SIGSTOP: it hangs, answering no one; SIGCONT: it goes on).
    #[allow(dead_code)] // used by the cluster tests
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet waited for); no memory
        // is touched.
        unsafe { libc::kill(self.pid() as i32, signal) };
    }

    /// SIGTERM, and the exit status (SIGKILL after 15 s).
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) with a pid we spawned; no memory is touched.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > until {
                let _ = child.kill();
                return child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The server's resident memory (VmRSS), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb * 1024
    }

    pub fn unix_url(&self) -> String {
        format!("unix://{}", self.unix.display())
    }
    pub fn tcp_url(&self) -> String {
        format!("tcp://{}", self.tcp)
    }
    pub fn tls_url(&self) -> String {
        format!("tls://{}", self.tls)
    }
    pub fn quic_url(&self) -> String {
        format!("quic://{}", self.quic)
    }
    pub fn cert(&self) -> Vec<u8> {
        std::fs::read(self.dir.join("run").join("quic-cert.der")).unwrap()
    }

    /// Clients for every transport: (name, url, config).
    pub fn transports(&self) -> Vec<(&'static str, String, ClientConfig)> {
        vec![
            ("unix", self.unix_url(), ClientConfig::default()),
            ("tcp", self.tcp_url(), ClientConfig::default().token(TOKEN)),
            (
                "tls",
                self.tls_url(),
                ClientConfig::default()
                    .token(TOKEN)
                    .server_cert_der(self.cert()),
            ),
            (
                "quic",
                self.quic_url(),
                ClientConfig::default()
                    .token(TOKEN)
                    .quic_cert_der(self.cert()),
            ),
        ]
    }

    pub async fn client(&self, transport: &str) -> Client {
        let (_, url, cfg) = self
            .transports()
            .into_iter()
            .find(|t| t.0 == transport)
            .unwrap();
        Client::connect(&url, cfg).await.unwrap()
    }

    /// The server's /stats document.
    pub async fn stats(&self) -> serde_json::Value {
        let body = http_get(self.admin, "/stats").await.1;
        serde_json::from_str(&body).unwrap()
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A TCP client presenting `token` (a tenant's, with `[tenants]`).
#[allow(dead_code)] // the e2e tests'; the cluster tests share this file
pub async fn as_tenant(srv: &ServerProc, token: &str) -> Client {
    Client::connect(&srv.tcp_url(), ClientConfig::default().token(token))
        .await
        .unwrap()
}

/// The effective uid and gid of this test process.
#[allow(dead_code)] // the e2e tests'; the cluster tests share this file
pub fn my_ids() -> (u32, u32) {
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

/// Runs `python3 -c script args...` as uid 65534 in this process's group (directly as
/// root, else through `sudo -n`): a client of another user, for the Unix socket's
/// `server.unix_group` tests. Fails the test when it cannot run or fails; returns its
/// standard output.
#[allow(dead_code)] // the e2e tests'; the cluster tests share this file
pub fn python_as_another_user(script: &str, args: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    let (me, my_gid) = my_ids();
    let mut cmd = if me == 0 {
        let mut c = Command::new("python3");
        c.uid(65534).gid(my_gid);
        c
    } else {
        let mut c = Command::new("sudo");
        c.args(["-n", "-u", "#65534", "-g", &format!("#{my_gid}"), "python3"]);
        c
    };
    let out = cmd
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (as root, or through sudo -n)");
    assert!(
        out.status.success(),
        "the client as uid 65534 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// (status code, body) of an HTTP GET.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = HttpClient::new(HttpConfig::default())
        .get(&format!("http://{addr}{path}"))
        .await
        .unwrap();
    (r.status, r.text())
}

/// Fails the test, saying why, unless `promtool check metrics` accepts `text`.
pub fn promtool_check(text: &str) {
    if let Err(e) = kvtier_testkit::promtool::check_metrics(text) {
        panic!("{e:#}");
    }
}

/// Keys of a prompt of `blocks` blocks under a tenant's salt.
pub fn keys(salt: &[u8], blocks: usize, seed: u32) -> Vec<BlockKey> {
    let secret = HashSecret::development();
    let ns = NamespaceBuilder::new("e2e-model", layout().fingerprint())
        .cache_salt(salt)
        .build(&secret)
        .unwrap();
    let mut h = PrefixHasher::new(secret, ns, 16).unwrap();
    let tokens: Vec<u32> = (0..(blocks * 16) as u32).map(|i| i ^ seed).collect();
    let mut k = Vec::new();
    h.prompt_keys(&tokens, &mut k);
    k
}

pub fn block_data(k: BlockKey) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    kvtier_testkit::block::fill_block(k, &mut v);
    v
}

pub async fn put_all(c: &Client, keys: &[BlockKey]) {
    let data: Vec<Vec<u8>> = keys.iter().map(|k| block_data(*k)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let s = c.put_chain(keys, None, &bufs).await;
    assert_eq!(s.failure, None);
    assert_eq!(s.cached(), keys.len(), "{:?}", s.statuses);
}

/// Gets `keys`, asserts every returned block is exact; returns how many came back.
pub async fn get_verified(c: &Client, keys: &[BlockKey]) -> usize {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let f = c.get_into(keys, &mut dst).await;
    for (k, b) in keys.iter().zip(&bufs).take(f.blocks) {
        assert!(*b == block_data(*k), "wrong bytes for {k}");
    }
    f.blocks
}

/// A QUIC connection to `srv`, handshaken (the server's certificate pinned), with no stream
/// yet. The endpoint must outlive the connection.
pub async fn quic_handshake(srv: &ServerProc) -> (quinn::Endpoint, quinn::Connection) {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(srv.cert()))
        .unwrap();
    let cc = quinn::ClientConfig::with_root_certificates(std::sync::Arc::new(roots)).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(cc);
    let conn = ep.connect(srv.quic, "localhost").unwrap().await.unwrap();
    (ep, conn)
}

/// A raw protocol connection, for sending what the SDK never would.
pub struct Raw<S> {
    pub s: S,
    next: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    pub fn new(s: S) -> Self {
        Raw { s, next: 1 }
    }

    pub fn frame(req: &Request, id: u64, payload: u64) -> Vec<u8> {
        let meta = req.encode_meta();
        let mut v = Header::request(req.opcode(), id, meta.len(), payload)
            .encode()
            .to_vec();
        v.extend_from_slice(&meta);
        v
    }

    pub async fn send(&mut self, req: &Request, payload: &[u8]) -> u64 {
        let id = self.next;
        self.next += 1;
        let f = Self::frame(req, id, payload.len() as u64);
        self.s.write_all(&f).await.unwrap();
        self.s.write_all(payload).await.unwrap();
        id
    }

    pub async fn hello(&mut self, token: &str) -> Response {
        let v = kvtier_core::protocol::VERSION;
        self.hello_versions(token, v, v).await
    }

    /// A hello speaking versions `min..=max` (an older client's).
    pub async fn hello_versions(&mut self, token: &str, min: u16, max: u16) -> Response {
        self.send(
            &Request::Hello(kvtier_core::protocol::Hello {
                min_version: min,
                max_version: max,
                client: "raw".into(),
                token: token.into(),
                block_bytes: 0,
                want_arena: false,
            }),
            &[],
        )
        .await;
        self.recv().await.expect("hello reply").1
    }

    /// The next frame: (header, response, payload). `None` when the server closed.
    pub async fn recv(&mut self) -> Option<(Header, Response, Vec<u8>)> {
        let mut head = [0u8; HEADER_BYTES];
        self.s.read_exact(&mut head).await.ok()?;
        let limits = Limits {
            max_payload_bytes: u64::MAX,
            max_meta_bytes: u32::MAX,
            max_keys: u32::MAX,
        };
        let h = Header::decode(&head, &limits).unwrap();
        let mut meta = vec![0u8; h.meta_len as usize];
        self.s.read_exact(&mut meta).await.ok()?;
        let mut payload = vec![0u8; h.payload_len as usize];
        self.s.read_exact(&mut payload).await.ok()?;
        let r = Response::decode(&h, &meta, &limits).unwrap();
        Some((h, r, payload))
    }

    /// True when the server closed the connection (EOF or reset) within `secs`.
    pub async fn closed_within(&mut self, secs: u64) -> bool {
        let mut b = [0u8; 1];
        loop {
            match tokio::time::timeout(Duration::from_secs(secs), self.s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue, // drain any last error frame
                Err(_) => return false,
            }
        }
    }
}

pub fn error_code(r: &Response) -> Option<kvtier_core::protocol::ErrorCode> {
    match r {
        Response::Error(e) => kvtier_core::protocol::ErrorCode::from_u16(e.code),
        _ => None,
    }
}

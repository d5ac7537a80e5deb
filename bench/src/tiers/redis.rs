//! The Redis reference of the server part: a `redis-server` started for the run (or an
//! external one from `--redis`), reached over its Unix socket or TCP with a minimal RESP
//! client (GET and SET of one block).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::case::{CONNECT_TIMEOUT, OP_TIMEOUT, RedisUrl};

/// Distinct Redis keys the GETs cycle through.
pub const REDIS_KEYS: u64 = 16;

/// A Redis reached over TCP, its Unix socket, or both: one started for the run (stopped by
/// [`Redis::stop`] or on drop), or an external one (its keys deleted by `stop`).
pub struct Redis {
    child: Option<Child>,
    pub(super) tcp: Option<String>,
    pub(super) unix: Option<PathBuf>,
    /// Prefix of every key the bench writes.
    pub(super) prefix: String,
    /// What this Redis is, for the report.
    pub label: String,
    _dir: Option<tempfile::TempDir>,
}

impl Redis {
    /// Starts `redis-server` on a private port and socket; None when it is not installed.
    pub fn start(seed: u64) -> Result<Option<Redis>> {
        let Some(bin) = which("redis-server") else {
            return Ok(None);
        };
        let version = Command::new(&bin)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let dir = tempfile::tempdir()?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let unix = dir.path().join("redis.sock");
        let child = Command::new(&bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--unixsocket",
                &unix.display().to_string(),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--proto-max-bulk-len",
                "1gb",
            ])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let r = Redis {
            child: Some(child),
            tcp: Some(format!("127.0.0.1:{port}")),
            unix: Some(unix),
            prefix: format!("kvtier-bench:{seed}:"),
            label: format!("started for this run ({version})"),
            _dir: Some(dir),
        };
        let until = Instant::now() + CONNECT_TIMEOUT;
        while !r.unix.as_ref().is_some_and(|u| u.exists()) {
            if Instant::now() > until {
                bail!("redis-server did not open its socket within {CONNECT_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Some(r))
    }

    /// An external Redis; fails unless it answers PING.
    pub fn external(url: &RedisUrl, seed: u64) -> Result<Redis> {
        let (tcp, unix, label) = match url {
            RedisUrl::Tcp(a) => (Some(a.clone()), None, format!("external, tcp {a}")),
            RedisUrl::Unix(p) => (
                None,
                Some(p.clone()),
                format!("external, unix {}", p.display()),
            ),
        };
        let r = Redis {
            child: None,
            tcp,
            unix,
            prefix: format!("kvtier-bench:{seed}:"),
            label,
            _dir: None,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut s = r.connect(r.unix.is_some()).await?;
            resp(s.as_mut(), &[b"PING"], &mut []).await
        })
        .with_context(|| format!("--redis: {} does not answer PING", r.label))?;
        Ok(r)
    }

    pub async fn connect(&self, unix: bool) -> Result<Box<dyn Stream>> {
        let s: Box<dyn Stream> = match (unix, &self.unix, &self.tcp) {
            (true, Some(p), _) => Box::new(
                tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(p))
                    .await
                    .map_err(|_| anyhow!("connecting to redis at {} timed out", p.display()))?
                    .with_context(|| format!("connecting to redis at {}", p.display()))?,
            ),
            (false, _, Some(a)) => {
                let s = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    tokio::net::TcpStream::connect(a.as_str()),
                )
                .await
                .map_err(|_| anyhow!("connecting to redis at {a} timed out"))?
                .with_context(|| format!("connecting to redis at {a}"))?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
            _ => bail!(
                "this redis has no {} endpoint",
                if unix { "unix" } else { "tcp" }
            ),
        };
        Ok(s)
    }

    /// Stops a started Redis, or deletes the bench's keys from an external one.
    pub fn stop(mut self) -> Result<()> {
        if self.child.is_none() {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let mut s = self.connect(self.unix.is_some()).await?;
                for i in 0..REDIS_KEYS {
                    let k = format!("{}{i}", self.prefix);
                    tokio::time::timeout(
                        OP_TIMEOUT,
                        resp(s.as_mut(), &[b"DEL", k.as_bytes()], &mut []),
                    )
                    .await
                    .map_err(|_| anyhow!("redis DEL timed out"))??;
                }
                Ok::<_, anyhow::Error>(())
            })
            .context("deleting the bench's keys from --redis")?;
        }
        self.kill();
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// Longest RESP reply header we accept (`$<len>\r\n`, `+OK\r\n`, `:1\r\n`, an error).
const RESP_HEAD_MAX: usize = 512;

/// One RESP command; a bulk-string reply lands in `buf` (which must be its exact size);
/// simple-string and integer replies are accepted; an error reply is an error.
pub async fn resp(s: &mut dyn Stream, args: &[&[u8]], buf: &mut [u8]) -> Result<()> {
    let mut cmd = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        cmd.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        cmd.extend_from_slice(a);
        cmd.extend_from_slice(b"\r\n");
    }
    s.write_all(&cmd).await?;
    let mut head = Vec::with_capacity(32);
    loop {
        let b = s.read_u8().await?;
        head.push(b);
        if head.ends_with(b"\r\n") {
            break;
        }
        if head.len() > RESP_HEAD_MAX {
            bail!("redis reply header longer than {RESP_HEAD_MAX} bytes");
        }
    }
    match head[0] {
        b'+' | b':' => Ok(()),
        b'$' => {
            let n: i64 = std::str::from_utf8(&head[1..head.len() - 2])?.parse()?;
            if n != buf.len() as i64 {
                bail!("redis returned {n} bytes, expected {}", buf.len());
            }
            s.read_exact(buf).await?;
            let mut crlf = [0u8; 2];
            s.read_exact(&mut crlf).await?;
            Ok(())
        }
        _ => bail!("redis said {:?}", String::from_utf8_lossy(&head).trim_end()),
    }
}

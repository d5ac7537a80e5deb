//! Named configurations the comparison starts itself: `kvtier-worker serve` processes and, where
//! the configuration has a cache, a `kvtier-server` sidecar configured for the worker's KV
//! layout. Every child is stopped (SIGTERM, then SIGKILL after a grace period) when the
//! [`Spawned`] is dropped: at the end of its configuration's run, on error, and on Ctrl-C (the
//! driver turns it into an error).
//!
//! Syntax of `--spawn NAME=KIND [WORKER ARGS...]`:
//! * `off`: one worker, `--sidecar off` (recompute every prompt);
//! * `dram`: a server with a DRAM tier only, one worker on its Unix socket;
//! * `dram+nvme`: a server with a small DRAM tier over an NVMe tier, one worker;
//! * `disagg`: a server (DRAM), a prefill worker (`--role prefill`) and a decode worker
//!   (`--role decode --prefill-url` the prefill worker), both on the socket; requests go to the
//!   decode worker;
//! * `worker`: one worker with exactly the given arguments (no server);
//! * `fleet:POLICY[:N]`: N workers (default 3), each with its own DRAM server as in `dram`,
//!   behind a `kvtier-router --policy POLICY` that follows every server's block events;
//!   requests go to the router.
//!
//! Extra words after KIND go to every worker of the configuration (e.g.
//! `dram=dram --pool-blocks 256`).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The reference worker's KV layout (its default model: 4 layers, 2 KV heads of 32 dims, f32,
/// 16-token blocks = 32 KiB a block). The server must store blocks of exactly this layout.
pub const WORKER_LAYOUT_SETS: [&str; 5] = [
    "layout.layers=4",
    "layout.kv_heads=2",
    "layout.head_dim=32",
    "layout.dtype=\"f32\"",
    "layout.block_tokens=16",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    Off,
    Dram,
    DramNvme,
    Disagg,
    Worker,
    /// Workers, each with its own DRAM server, behind a router.
    Fleet {
        workers: usize,
    },
}

/// Most workers a `fleet` may have.
pub const MAX_FLEET_WORKERS: usize = 16;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SpawnSpec {
    pub name: String,
    pub kind: Kind,
    /// The router's `--policy` for a `fleet`.
    pub router_policy: Option<String>,
    pub worker_args: Vec<String>,
}

impl SpawnSpec {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("--spawn {s:?}: expected NAME=KIND [WORKER ARGS]"))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("--spawn {s:?}: empty name"));
        }
        let mut words = rest.split_whitespace();
        let mut router_policy = None;
        let kind = match words.next() {
            Some(k) if k.starts_with("fleet:") => {
                let mut parts = k["fleet:".len()..].split(':');
                let policy = parts.next().unwrap_or_default();
                if policy.is_empty() {
                    return Err(format!("--spawn {s:?}: expected fleet:POLICY[:N]"));
                }
                let workers = match parts.next() {
                    None => 3,
                    Some(n) => n
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_FLEET_WORKERS).contains(n))
                        .ok_or_else(|| {
                            format!(
                                "--spawn {s:?}: a fleet has 1 to {MAX_FLEET_WORKERS} workers, \
                                 not {n:?}"
                            )
                        })?,
                };
                if parts.next().is_some() {
                    return Err(format!("--spawn {s:?}: expected fleet:POLICY[:N]"));
                }
                router_policy = Some(policy.to_owned());
                Kind::Fleet { workers }
            }
            Some("off") => Kind::Off,
            Some("dram") => Kind::Dram,
            Some("dram+nvme") => Kind::DramNvme,
            Some("disagg") => Kind::Disagg,
            Some("worker") => Kind::Worker,
            Some(k) => {
                return Err(format!(
                    "--spawn {s:?}: unknown kind {k:?} (off, dram, dram+nvme, disagg, worker, \
                     fleet:POLICY[:N])"
                ));
            }
            None => return Err(format!("--spawn {s:?}: no kind after '='")),
        };
        Ok(Self {
            name: name.to_owned(),
            kind,
            router_policy,
            worker_args: words.map(str::to_owned).collect(),
        })
    }
}

/// How spawned configurations are built.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    pub worker_bin: Option<PathBuf>,
    pub server_bin: Option<PathBuf>,
    /// `kvtier-router`, for `fleet`.
    pub router_bin: Option<PathBuf>,
    pub seed: u64,
    pub model: String,
    /// DRAM tier of `dram` and `disagg`.
    pub dram_bytes: String,
    /// DRAM tier of `dram+nvme` (small, so blocks spill to NVMe).
    pub nvme_dram_bytes: String,
    pub nvme_bytes: String,
    /// Where temporary directories go (the NVMe tier lives there).
    pub scratch_dir: PathBuf,
    /// Extra `--set section.key=value` for every server.
    pub server_sets: Vec<String>,
    pub startup_timeout: Duration,
}

/// A running configuration.
pub struct Spawned {
    /// The URL requests go to.
    pub url: String,
    /// The processes and their command lines, for the report.
    pub describe: Vec<String>,
    children: Vec<(String, Child)>,
    _dir: tempfile::TempDir,
}

impl Spawned {
    /// Process ids of the children, in start order.
    #[cfg(test)]
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(_, c)| c.id()).collect()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // Stop in reverse order of start (workers before the server).
        for (_, c) in self.children.iter_mut().rev() {
            stop(c);
        }
    }
}

fn stop(c: &mut Child) {
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    if let Ok(pid) = i32::try_from(c.id()) {
        // SAFETY: kill(2) with a pid of our own child that has not been reaped yet (try_wait
        // above returned None), so the pid cannot have been reused; no memory is involved.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// A sibling binary of the running executable, or `explicit`.
pub fn find_bin(name: &str, explicit: Option<&Path>, flag: &str) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_owned());
        }
        bail!("{flag} {}: no such file", p.display());
    }
    let exe = std::env::current_exe().context("cannot locate the running executable")?;
    let mut dirs = Vec::new();
    if let Some(d) = exe.parent() {
        dirs.push(d.to_owned());
        // Test binaries live in target/<profile>/deps.
        if let Some(up) = d.parent() {
            dirs.push(up.to_owned());
        }
    }
    for d in &dirs {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "{name} not found next to {} (build it: cargo build --release -p {}, or pass {flag} PATH)",
        exe.display(),
        name
    )
}

/// Starts a configuration and waits until every process is listening.
pub fn start(spec: &SpawnSpec, o: &SpawnOptions) -> Result<Spawned> {
    std::fs::create_dir_all(&o.scratch_dir)
        .with_context(|| format!("cannot create {}", o.scratch_dir.display()))?;
    let dir = tempfile::Builder::new()
        .prefix("kvtier-agentic-")
        .tempdir_in(&o.scratch_dir)
        .with_context(|| format!("cannot create a directory in {}", o.scratch_dir.display()))?;
    let root = dir.path().to_owned();
    let mut sp = Spawned {
        url: String::new(),
        describe: Vec::new(),
        children: Vec::new(),
        _dir: dir,
    };
    let worker_bin = find_bin("kvtier-worker", o.worker_bin.as_deref(), "--worker-bin")?;
    let sidecar = match spec.kind {
        Kind::Off | Kind::Worker | Kind::Fleet { .. } => None,
        Kind::Dram | Kind::DramNvme | Kind::Disagg => Some(start_server(
            &mut sp,
            o,
            &root,
            "server",
            spec.kind == Kind::DramNvme,
        )?),
    };
    let worker_args = |role: Option<(&str, Option<&str>)>, sidecar: Option<&str>| -> Vec<String> {
        let mut a: Vec<String> = vec!["serve".into()];
        if spec.kind != Kind::Worker {
            a.extend([
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--sidecar".into(),
                sidecar.unwrap_or("off").into(),
                "--seed".into(),
                o.seed.to_string(),
                "--model-name".into(),
                o.model.clone(),
            ]);
        }
        if spec.kind == Kind::Off {
            // Recompute every prompt: no prefix cache in the worker's pool either.
            a.push("--no-prefix-cache".into());
        }
        if let Some((r, prefill)) = role {
            a.extend(["--role".into(), r.into()]);
            if let Some(u) = prefill {
                a.extend(["--prefill-url".into(), u.into()]);
            }
        }
        a.extend(spec.worker_args.iter().cloned());
        a
    };
    let addr = |line: &str| -> Result<String> {
        line.strip_prefix("listening http=")
            .map(|a| format!("http://{}", a.trim()))
            .ok_or_else(|| anyhow::anyhow!("unexpected ready line {line:?}"))
    };
    if spec.kind == Kind::Disagg {
        let a = worker_args(Some(("prefill", None)), sidecar.as_deref());
        let line = launch(
            &mut sp,
            &worker_bin,
            &a,
            &root,
            "prefill worker",
            "listening http=",
            o.startup_timeout,
        )?;
        let prefill = addr(&line)?;
        let a = worker_args(Some(("decode", Some(&prefill))), sidecar.as_deref());
        let line = launch(
            &mut sp,
            &worker_bin,
            &a,
            &root,
            "decode worker",
            "listening http=",
            o.startup_timeout,
        )?;
        sp.url = addr(&line)?;
    } else if let Kind::Fleet { workers } = spec.kind {
        let router_bin = find_bin("kvtier-router", o.router_bin.as_deref(), "--router-bin")?;
        let mut args: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--policy".into(),
            spec.router_policy.clone().unwrap_or_else(|| "kv".into()),
            "--model-name".into(),
            o.model.clone(),
        ];
        for i in 0..workers {
            let dir = root.join(format!("s{i}"));
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let kv = start_server(&mut sp, o, &dir, &format!("server {i}"), false)?;
            let line = launch(
                &mut sp,
                &worker_bin,
                &worker_args(None, Some(&kv)),
                &dir,
                &format!("worker {i}"),
                "listening http=",
                o.startup_timeout,
            )?;
            args.extend(["--worker".into(), format!("{},kvtier={kv}", addr(&line)?)]);
        }
        let line = launch(
            &mut sp,
            &router_bin,
            &args,
            &root,
            "router",
            "listening http=",
            o.startup_timeout,
        )?;
        sp.url = addr(&line)?;
    } else {
        let a = worker_args(None, sidecar.as_deref());
        let line = launch(
            &mut sp,
            &worker_bin,
            &a,
            &root,
            "worker",
            "listening http=",
            o.startup_timeout,
        )?;
        sp.url = addr(&line)?;
    }
    Ok(sp)
}

/// Starts a kvtier-server for the worker's layout in `dir`: a DRAM tier (`o.dram_bytes`), or a
/// small DRAM tier over NVMe in `dir/nvme`. Returns its Unix socket's URL.
fn start_server(
    sp: &mut Spawned,
    o: &SpawnOptions,
    dir: &Path,
    what: &str,
    nvme: bool,
) -> Result<String> {
    let server_bin = find_bin("kvtier-server", o.server_bin.as_deref(), "--server-bin")?;
    let sock = dir.join("kvtier.sock");
    let mut args: Vec<String> = vec![
        "--unix".into(),
        sock.display().to_string(),
        "--tcp".into(),
        "off".into(),
        "--quic".into(),
        "off".into(),
        "--tls".into(),
        "off".into(),
        "--admin".into(),
        "off".into(),
        "--set".into(),
        format!("server.runtime_dir={:?}", dir.display().to_string()),
    ];
    if nvme {
        args.extend([
            "--dram-bytes".into(),
            o.nvme_dram_bytes.clone(),
            "--nvme-dir".into(),
            dir.join("nvme").display().to_string(),
            "--nvme-bytes".into(),
            o.nvme_bytes.clone(),
        ]);
    } else {
        args.extend([
            "--dram-bytes".into(),
            o.dram_bytes.clone(),
            "--nvme-dir".into(),
            String::new(),
        ]);
    }
    for s in WORKER_LAYOUT_SETS
        .iter()
        .map(|s| s.to_string())
        .chain(o.server_sets.clone())
    {
        args.push("--set".into());
        args.push(s);
    }
    let line = launch(
        sp,
        &server_bin,
        &args,
        dir,
        what,
        "listening unix=",
        o.startup_timeout,
    )?;
    let path = line
        .strip_prefix("listening unix=")
        .and_then(|r| r.split_whitespace().next())
        .filter(|p| *p != "off")
        .ok_or_else(|| anyhow::anyhow!("kvtier-server reported no Unix socket: {line}"))?;
    Ok(format!("unix://{path}"))
}

/// Starts `bin args`, stderr to a log file, and waits for a stdout line starting with `ready`.
fn launch(
    sp: &mut Spawned,
    bin: &Path,
    args: &[String],
    dir: &Path,
    what: &str,
    ready: &str,
    timeout: Duration,
) -> Result<String> {
    let log_path = dir.join(format!("{}.log", what.replace(' ', "-")));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let cmd_line = std::iter::once(bin.display().to_string())
        .chain(args.iter().map(|a| {
            if a.is_empty() || a.contains(' ') {
                format!("{a:?}")
            } else {
                a.clone()
            }
        }))
        .collect::<Vec<_>>()
        .join(" ");
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log));
    // ETXTBSY: a binary just written (a copy put in place, a test's script) is still open
    // for writing in a child another thread forked and has not yet exec'd; it passes.
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r.with_context(|| format!("cannot start {what}: {cmd_line}"))?,
        }
    };
    let stdout = child.stdout.take();
    sp.children.push((what.to_owned(), child));
    sp.describe.push(cmd_line.clone());
    let (tx, rx) = mpsc::channel::<String>();
    let ready_prefix = ready.to_owned();
    if let Some(out) = stdout {
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut sent = false;
            let mut line = String::new();
            // Keep draining after the ready line so the child never blocks on a full pipe.
            while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                if !sent && line.starts_with(&ready_prefix) {
                    let _ = tx.send(line.trim_end().to_owned());
                    sent = true;
                }
                line.clear();
            }
        });
    }
    let until = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => return Ok(l),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::thread::sleep(Duration::from_millis(100));
                bail!(
                    "{what} exited before it was ready: {cmd_line}\n{}",
                    tail(&log_path)
                );
            }
        }
        if let Some((_, c)) = sp.children.last_mut()
            && let Ok(Some(st)) = c.try_wait()
        {
            bail!(
                "{what} exited ({st}) before it was ready: {cmd_line}\n{}",
                tail(&log_path)
            );
        }
        if Instant::now() >= until {
            bail!(
                "{what} did not print {ready:?} within {timeout:?}: {cmd_line}\n{}",
                tail(&log_path)
            );
        }
    }
}

/// The last lines of a log file, indented.
fn tail(p: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(p) {
        let _ = f.read_to_string(&mut s);
    }
    let lines: Vec<&str> = s.lines().collect();
    let from = lines.len().saturating_sub(15);
    let body = lines[from..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n");
    if body.is_empty() {
        format!("  (its log {} is empty)", p.display())
    } else {
        format!("  last lines of {}:\n{body}", p.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_spawn_specs() {
        let s = SpawnSpec::parse("on=dram --pool-blocks 64").unwrap();
        assert_eq!(s.name, "on");
        assert_eq!(s.kind, Kind::Dram);
        assert_eq!(s.worker_args, ["--pool-blocks", "64"]);
        assert_eq!(
            SpawnSpec::parse("x=dram+nvme").unwrap().kind,
            Kind::DramNvme
        );
        assert_eq!(SpawnSpec::parse("x=disagg").unwrap().kind, Kind::Disagg);
        assert_eq!(SpawnSpec::parse("x=off").unwrap().kind, Kind::Off);
        let f = SpawnSpec::parse("kv=fleet:kv --pool-blocks 64").unwrap();
        assert_eq!(
            (f.kind, f.router_policy.as_deref()),
            (Kind::Fleet { workers: 3 }, Some("kv"))
        );
        assert_eq!(f.worker_args, ["--pool-blocks", "64"]);
        let f = SpawnSpec::parse("s=fleet:session_sticky:4").unwrap();
        assert_eq!(
            (f.kind, f.router_policy.as_deref()),
            (Kind::Fleet { workers: 4 }, Some("session_sticky"))
        );
        for (bad, part) in [
            ("x=fleet:", "fleet:POLICY"),
            ("x=fleet:kv:0", "1 to 16 workers"),
            ("x=fleet:kv:17", "1 to 16 workers"),
            ("x=fleet:kv:2:9", "fleet:POLICY"),
            ("dram", "expected NAME=KIND"),
            ("=dram", "empty name"),
            ("x=", "no kind"),
            ("x=hbm", "unknown kind \"hbm\""),
        ] {
            let e = SpawnSpec::parse(bad).unwrap_err();
            assert!(e.contains(part), "{bad}: {e}");
        }
    }

    #[test]
    fn stop_ends_a_running_child() {
        // Exercises the kill(2) call: a sleeping child stops on SIGTERM, well before the grace.
        let mut c = Command::new("sleep").arg("30").spawn().unwrap();
        let t = Instant::now();
        stop(&mut c);
        assert!(c.try_wait().unwrap().is_some());
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    }

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn options(dir: &Path, worker: PathBuf, server: Option<PathBuf>) -> SpawnOptions {
        SpawnOptions {
            worker_bin: Some(worker),
            server_bin: server,
            router_bin: None,
            seed: 9,
            model: "tiny".into(),
            dram_bytes: "16MiB".into(),
            nvme_dram_bytes: "8MiB".into(),
            nvme_bytes: "64MiB".into(),
            scratch_dir: dir.to_owned(),
            server_sets: vec!["limits.max_keys=100".into()],
            startup_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn disagg_starts_a_server_and_two_workers_wired_together_and_stops_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let worker = script(
            dir.path(),
            "fake-worker",
            &format!(
                "echo \"$@\" >> {d}/worker-args\necho loading\n\
                 case \"$*\" in *\"--role prefill\"*) p=1001;; *) p=1002;; esac\n\
                 echo \"listening http=127.0.0.1:$p\"\nexec sleep 30"
            ),
        );
        let server = script(
            dir.path(),
            "fake-server",
            &format!(
                "echo \"$@\" > {d}/server-args\n\
                 echo \"listening unix={d}/s.sock tcp=off quic=off admin=off\"\nexec sleep 30"
            ),
        );
        let spec = SpawnSpec::parse("split=disagg --pool-blocks 64").unwrap();
        let sp = start(&spec, &options(dir.path(), worker, Some(server))).unwrap();
        assert_eq!(sp.url, "http://127.0.0.1:1002");
        assert_eq!(sp.describe.len(), 3);
        let pids = sp.pids();
        let args = std::fs::read_to_string(dir.path().join("worker-args")).unwrap();
        let lines: Vec<&str> = args.lines().collect();
        assert_eq!(lines.len(), 2, "{args}");
        let sidecar = format!("--sidecar unix://{d}/s.sock");
        assert!(
            lines[0].starts_with("serve --listen 127.0.0.1:0"),
            "{}",
            lines[0]
        );
        for want in [
            &sidecar,
            "--role prefill",
            "--seed 9",
            "--model-name tiny",
            "--pool-blocks 64",
        ] {
            assert!(lines[0].contains(want), "{want}: {}", lines[0]);
        }
        assert!(
            lines[1].contains("--role decode --prefill-url http://127.0.0.1:1001"),
            "{}",
            lines[1]
        );
        assert!(lines[1].contains(&sidecar), "{}", lines[1]);
        let sargs = std::fs::read_to_string(dir.path().join("server-args")).unwrap();
        for want in [
            "layout.layers=4",
            "layout.kv_heads=2",
            "layout.head_dim=32",
            "layout.dtype=\"f32\"",
            "layout.block_tokens=16",
            "--dram-bytes 16MiB",
            "--tcp off",
            "limits.max_keys=100",
        ] {
            assert!(sargs.contains(want), "{want}: {sargs}");
        }
        drop(sp);
        for pid in pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "{pid} still runs"
            );
        }
    }

    #[test]
    fn a_fleet_starts_servers_workers_and_a_router_over_them_and_stops_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let worker = script(
            dir.path(),
            "fake-worker",
            &format!(
                "echo \"$@\" >> {d}/worker-args\n\
                 n=$(wc -l < {d}/worker-args)\n\
                 echo \"listening http=127.0.0.1:$((3000 + n))\"\nexec sleep 30"
            ),
        );
        let server = script(
            dir.path(),
            "fake-server",
            "sock=$(echo \"$@\" | sed -n 's/.*--unix \\([^ ]*\\).*/\\1/p')\n\
             echo \"listening unix=$sock tcp=off\"\nexec sleep 30",
        );
        let router = script(
            dir.path(),
            "fake-router",
            &format!(
                "echo \"$@\" > {d}/router-args\necho \"listening http=127.0.0.1:2999\"\nexec sleep 30"
            ),
        );
        let mut o = options(dir.path(), worker, Some(server));
        o.router_bin = Some(router);
        let spec = SpawnSpec::parse("sticky=fleet:session_sticky:3 --pool-blocks 64").unwrap();
        let sp = start(&spec, &o).unwrap();
        assert_eq!(sp.url, "http://127.0.0.1:2999");
        assert_eq!(sp.describe.len(), 7, "{:#?}", sp.describe);
        let pids = sp.pids();
        let wargs = std::fs::read_to_string(dir.path().join("worker-args")).unwrap();
        let rargs = std::fs::read_to_string(dir.path().join("router-args")).unwrap();
        assert!(
            rargs.starts_with("--listen 127.0.0.1:0 --policy session_sticky --model-name tiny"),
            "{rargs}"
        );
        // Each worker on its own server, and the router told which server is whose.
        for (i, line) in wargs.lines().enumerate() {
            let sock = sp.describe[2 * i]
                .split("--unix ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .unwrap()
                .to_owned();
            assert!(sock.ends_with(&format!("s{i}/kvtier.sock")), "{sock}");
            assert!(line.contains(&format!("--sidecar unix://{sock}")), "{line}");
            assert!(line.contains("--pool-blocks 64"), "{line}");
            let want = format!(
                "--worker http://127.0.0.1:{},kvtier=unix://{sock}",
                3001 + i
            );
            assert!(rargs.contains(&want), "{want}: {rargs}");
        }
        assert_eq!(wargs.lines().count(), 3, "{wargs}");
        drop(sp);
        for pid in pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "{pid} still runs"
            );
        }
    }

    #[test]
    fn a_child_that_dies_or_stays_silent_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let dies = script(dir.path(), "dies", "echo model file missing >&2\nexit 3");
        let spec = SpawnSpec::parse("x=off").unwrap();
        let e = start(&spec, &options(dir.path(), dies, None))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("exited") && e.contains("model file missing"),
            "{e}"
        );
        let silent = script(dir.path(), "silent", "exec sleep 30");
        let mut o = options(dir.path(), silent, None);
        o.startup_timeout = Duration::from_millis(500);
        let t = Instant::now();
        let e = start(&spec, &o).err().unwrap().to_string();
        assert!(e.contains("did not print \"listening http=\""), "{e}");
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        let e = start(
            &SpawnSpec::parse("x=dram").unwrap(),
            &options(
                dir.path(),
                dir.path().join("dies"),
                Some(dir.path().join("nope")),
            ),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("--server-bin"), "{e}");
    }

    #[test]
    fn missing_binaries_name_the_flag() {
        let e = find_bin(
            "kvtier-worker",
            Some(Path::new("/nonexistent/w")),
            "--worker-bin",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--worker-bin /nonexistent/w"), "{e}");
    }
}

//! A binary run as a child process with a time bound. The child's output is read on its own
//! threads while it runs (a chatty child never blocks on a full pipe); it is killed when it
//! overruns the bound, and also if the caller unwinds while it runs ([`ChildGuard`]). Only the
//! child itself is killed, not processes it started: run binaries directly (or `exec` them).

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How a bounded run ended.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// stdout, then stderr.
    pub fn output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// A child process killed (and reaped) when dropped, unless it was waited for.
pub struct ChildGuard(Option<Child>);

impl ChildGuard {
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// The child, while it is held.
    pub fn child(&mut self) -> &mut Child {
        // The option is only emptied by `Drop`.
        self.0.as_mut().expect("the child is held until drop")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take()
            && c.try_wait().ok().flatten().is_none()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `cmd` (stdin closed, stdout and stderr captured) until it exits or `limit` passes;
/// an overrun kills it and is an error that names the command and shows its output so far.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<Finished> {
    let what = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut guard = ChildGuard::new(child);
    let out = drain(guard.child().stdout.take());
    let err = drain(guard.child().stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = guard.child().try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // An overrun: kill it now, so the pipes close and the readers finish.
    drop(guard);
    let (stdout, stderr) = (join(out), join(err));
    match status {
        Some(status) => Ok(Finished {
            status,
            stdout,
            stderr,
        }),
        None => bail!("{what} still running after {limit:?}; killed. Output:\n{stdout}{stderr}"),
    }
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Option<JoinHandle<String>> {
    pipe.map(|mut p| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = p.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    })
}

fn join(h: Option<JoinHandle<String>>) -> String {
    h.and_then(|h| h.join().ok()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn a_run_returns_status_and_both_outputs() {
        let f = run_bounded(
            &mut sh("echo out; echo err >&2; exit 3"),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(f.status.code(), Some(3));
        assert_eq!((f.stdout.as_str(), f.stderr.as_str()), ("out\n", "err\n"));
        assert_eq!(f.output(), "out\nerr\n");
    }

    #[test]
    fn a_chatty_child_does_not_block_on_its_pipe() {
        // 1 MiB of output, far over a pipe's buffer.
        let f = run_bounded(
            &mut sh("head -c 1048576 /dev/zero | tr '\\0' x"),
            Duration::from_secs(20),
        )
        .unwrap();
        assert!(f.status.success());
        assert_eq!(f.stdout.len(), 1 << 20);
    }

    #[test]
    fn an_overrun_is_killed_and_reported() {
        let t = Instant::now();
        let e = run_bounded(
            &mut sh("echo started; exec sleep 30"),
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let msg = e.to_string();
        assert!(
            msg.contains("still running after") && msg.contains("started"),
            "{msg}"
        );
    }

    #[test]
    fn a_guard_kills_its_child_on_drop_and_leaves_a_finished_one_be() {
        let mut g = ChildGuard::new(sh("exec sleep 30").spawn().unwrap());
        let pid = g.child().id();
        let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
        assert!(proc_dir.exists());
        drop(g);
        assert!(!proc_dir.exists(), "pid {pid} outlived its guard");
        let mut done = ChildGuard::new(sh("exit 0").spawn().unwrap());
        assert!(done.child().wait().unwrap().success());
        drop(done);
    }
}

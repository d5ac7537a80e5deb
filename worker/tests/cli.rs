//! The `kvtier-worker` binary runs end to end as a real process.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kvtier_testkit::process::{ChildGuard, run_bounded};

/// Runs the binary with `args`, killing it after `limit`: (success, stdout + stderr).
fn run(args: &[&str], limit: Duration) -> Result<(bool, String)> {
    let f = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_kvtier-worker")).args(args),
        limit,
    )?;
    Ok((f.status.success(), f.output()))
}

#[test]
fn generate_prints_model_size_text_and_speed() -> Result<()> {
    let args = [
        "generate",
        "--prompt",
        "hello kvtier",
        "--max-tokens",
        "5",
        "--seed",
        "3",
    ];
    let (ok, out) = run(&args, Duration::from_secs(120))?;
    assert!(ok, "{out}");
    for want in [
        "2903296 parameters",
        "KV 2048 bytes/token",
        "prefill: 13 tokens",
        "decode: 4 steps",
        "tokens/s",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    // Same seed, same output.
    assert_eq!(
        run(&args, Duration::from_secs(120))?.1.lines().nth(1),
        out.lines().nth(1)
    );
    Ok(())
}

#[test]
fn a_bad_model_dir_fails_with_its_path() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("config.json"), r#"{"vocab_size": "x"}"#)?;
    let path = dir.path().to_string_lossy().into_owned();
    let (ok, out) = run(
        &["generate", "--prompt", "a", "--model-dir", &path],
        Duration::from_secs(60),
    )?;
    assert!(!ok);
    assert!(
        out.contains(&path) && out.contains("num_attention_heads"),
        "{out}"
    );
    Ok(())
}

/// `serve` prints exactly `listening http=IP:PORT` when ready, answers HTTP there, and stops
/// cleanly (exit 0) on SIGTERM.
#[test]
fn serve_prints_its_address_and_stops_on_sigterm() -> Result<()> {
    use std::io::{BufRead, BufReader, Read, Write};
    // Killed on drop, also when an assertion below fails.
    let mut guard = ChildGuard::new(
        Command::new(env!("CARGO_BIN_EXE_kvtier-worker"))
            .args(["serve", "--listen", "127.0.0.1:0", "--pool-blocks", "64"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let child = guard.child();
    {
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(60))?;
        let addr = line
            .trim_end()
            .strip_prefix("listening http=")
            .ok_or_else(|| anyhow::anyhow!("first line {line:?}"))?;
        let addr: std::net::SocketAddr = addr.parse()?;
        assert_ne!(addr.port(), 0);
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("\"status\":\"ok\""), "{resp}");
        let killed = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        assert!(killed.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait()? {
                assert!(status.success(), "exit status {status}");
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("still running 20 s after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn serve_refuses_role_settings_that_do_not_go_together() -> Result<()> {
    let (ok, out) = run(
        &["serve", "--listen", "127.0.0.1:0", "--role", "decode"],
        Duration::from_secs(60),
    )?;
    assert!(!ok);
    assert!(out.contains("role decode needs --prefill-url"), "{out}");
    let (ok, out) = run(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--prefill-url",
            "http://127.0.0.1:9",
        ],
        Duration::from_secs(60),
    )?;
    assert!(!ok);
    assert!(out.contains("is for role decode only"), "{out}");
    let (ok, out) = run(
        &["serve", "--role", "prefill", "--transfer-backend", "pigeon"],
        Duration::from_secs(60),
    )?;
    assert!(!ok);
    assert!(out.contains("unknown transfer backend `pigeon`"), "{out}");
    let (ok, out) = run(&["serve", "--role", "other"], Duration::from_secs(60))?;
    assert!(!ok);
    assert!(out.contains("unknown role"), "{out}");
    Ok(())
}

#[test]
fn serve_refuses_a_missing_or_pem_sidecar_certificate() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pem = dir.path().join("cert.pem");
    std::fs::write(
        &pem,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )?;
    let missing = dir.path().join("nope.der");
    for (file, want) in [(&pem, "a PEM file"), (&missing, "cannot read")] {
        let (ok, out) = run(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--sidecar",
                "quic://127.0.0.1:9",
                "--sidecar-cert",
                file.to_str().unwrap_or_default(),
            ],
            Duration::from_secs(60),
        )?;
        assert!(!ok);
        assert!(
            out.contains("--sidecar-cert") && out.contains(want),
            "{out}"
        );
    }
    Ok(())
}

#[test]
fn the_device_flag_is_checked() -> Result<()> {
    let (ok, out) = run(
        &["generate", "--prompt", "x", "--device", "gpu0"],
        Duration::from_secs(60),
    )?;
    assert!(!ok && out.contains("expected cpu, cuda or cuda:N"), "{out}");
    // A GPU that cannot be had is a clear error, never a silent CPU run: without the `cuda`
    // feature, the build says so; with it, on a machine without a GPU, the driver's absence is
    // named (and on a GPU machine it runs there).
    let (ok, out) = run(
        &["generate", "--prompt", "x", "--device", "cuda"],
        Duration::from_secs(120),
    )?;
    if cfg!(feature = "cuda") {
        assert!(
            (ok && out.contains("on cuda")) || (!ok && out.contains("no GPU")),
            "{out}"
        );
    } else {
        assert!(
            !ok && out.contains("built without the `cuda` feature"),
            "{out}"
        );
    }
    Ok(())
}

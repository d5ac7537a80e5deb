//! The `kvtier-worker` binary runs end to end as a real process.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest, HttpResponse};
use kvtier_testkit::process::run_bounded;
use kvtier_testkit::promtool::check_metrics;

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

/// Starts `kvtier-worker serve --listen 127.0.0.1:0 ARGS` and reads the address it prints
/// (`listening http=IP:PORT`) when ready.
fn start_serve(args: &[&str]) -> Result<(Child, SocketAddr)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-worker"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let addr = (|| -> Result<SocketAddr> {
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
        Ok(addr.parse()?)
    })();
    match addr {
        Ok(a) => Ok((child, a)),
        Err(e) => {
            stop(&mut child)?;
            Err(e)
        }
    }
}

fn stop(child: &mut Child) -> Result<()> {
    if child.try_wait()?.is_none() {
        child.kill()?;
        child.wait()?;
    }
    Ok(())
}

/// One exchange over the workspace's HTTP client (bounded by its default deadline).
fn http(req: HttpRequest) -> Result<HttpResponse> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(HttpClient::new(HttpConfig::default()).send(req))?)
}

/// `serve` prints exactly `listening http=IP:PORT` when ready, answers HTTP there, and stops
/// cleanly (exit 0) on SIGTERM.
#[test]
fn serve_prints_its_address_and_stops_on_sigterm() -> Result<()> {
    let (mut child, addr) = start_serve(&["--pool-blocks", "64"])?;
    let result = (|| -> Result<()> {
        assert_ne!(addr.port(), 0);
        let resp = http(HttpRequest::get(format!("http://{addr}/health")))?;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert!(resp.text().contains("\"status\":\"ok\""), "{}", resp.text());
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
    })();
    stop(&mut child)?;
    result
}

/// The /metrics of a prefill and a decode worker (real binaries), after a remotely prefilled
/// request, pass `promtool check metrics`: every family of the worker, both roles' included.
/// Fails when promtool is missing.
#[test]
fn metrics_pass_promtool_check() -> Result<()> {
    let (mut prefill, paddr) = start_serve(&["--role", "prefill", "--pool-blocks", "64"])?;
    let result = (|| -> Result<()> {
        let url = format!("http://{paddr}");
        let (mut decode, daddr) = start_serve(&[
            "--role",
            "decode",
            "--prefill-url",
            &url,
            "--pool-blocks",
            "64",
        ])?;
        let r = (|| -> Result<()> {
            let prompt: Vec<u32> = (0..80).map(|i| i % 200).collect();
            let body = serde_json::json!({"prompt": prompt, "max_tokens": 3, "temperature": 0});
            let resp = http(HttpRequest::post_json(
                format!("http://{daddr}/v1/completions"),
                body.to_string(),
            ))?;
            assert_eq!(resp.status, 200, "{}", resp.text());
            for (role, addr) in [("prefill", paddr), ("decode", daddr)] {
                let family = if role == "decode" {
                    "kvtier_worker_disagg_prefills_total{path=\"remote\"} 1"
                } else {
                    "kvtier_worker_disagg_prefill_served_total 1"
                };
                // The decode worker answers once every layer's notification is in, which can
                // be before the prefill worker's task has counted the request as served: poll
                // for the count, for a bounded time.
                let deadline = Instant::now() + Duration::from_secs(10);
                let text = loop {
                    let m = http(HttpRequest::get(format!("http://{addr}/metrics")))?;
                    assert_eq!(m.status, 200);
                    assert_eq!(
                        m.content_type.as_deref(),
                        Some("text/plain; version=0.0.4; charset=utf-8")
                    );
                    let text = m.text();
                    if text.contains(family) || Instant::now() >= deadline {
                        break text;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                };
                assert!(text.contains(family), "{role}: no {family} in\n{text}");
                check_metrics(&text).map_err(|e| anyhow::anyhow!("{role} worker: {e}"))?;
            }
            Ok(())
        })();
        stop(&mut decode)?;
        r
    })();
    stop(&mut prefill)?;
    result
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

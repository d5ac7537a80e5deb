//! The `kvtier-worker` binary runs end to end as a real process.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Runs the binary with `args`, killing it after `limit`.
fn run(args: &[&str], limit: Duration) -> Result<(bool, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-worker"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + limit;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            child.kill()?;
            child.wait()?;
            bail!("kvtier-worker {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.success(), text))
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

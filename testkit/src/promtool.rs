//! `promtool check metrics` over a process's `/metrics` text.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Result, bail};

/// Fails, saying why, unless `promtool check metrics` (Debian's `prometheus` package, which
/// `.ci/install-deps` installs) accepts `text` without a complaint. A missing promtool is a
/// failure, never a skip.
pub fn check_metrics(text: &str) -> Result<()> {
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "promtool is not installed: install Debian's `prometheus` package (.ci/install-deps does)"
        ),
        r => r?,
    };
    let Some(mut stdin) = child.stdin.take() else {
        bail!("promtool: no stdin");
    };
    stdin.write_all(text.as_bytes())?;
    drop(stdin);
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || !said.trim().is_empty() {
        bail!(
            "promtool check metrics: {}: {said}\non:\n{text}",
            out.status
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_metrics;

    /// promtool accepts a well-formed family and rejects a counter without help text, so the
    /// tests that use it can fail.
    #[test]
    fn accepts_good_and_rejects_bad_exposition() {
        check_metrics("# HELP x_total Things.\n# TYPE x_total counter\nx_total 1\n").unwrap();
        let bad = check_metrics("# TYPE y_total counter\ny_total 1\n").unwrap_err();
        assert!(bad.to_string().contains("promtool check metrics"), "{bad}");
    }
}

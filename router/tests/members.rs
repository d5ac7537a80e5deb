//! Workers from a kvtier cluster's membership (feature `cluster`): a real etcd, real
//! kvtier-server members whose records name stand-in workers (`cluster.worker_url`), and the
//! real router binary started with no worker of its own (`--cluster-etcd`). Members join and
//! are routed to (over TLS with the certificate their signed record carries, or plain TCP);
//! one that leaves is no candidate, and comes back in place; a record signed with another
//! secret adds nothing; etcd down keeps the workers. The test bounds its time; every process
//! is killed when it ends.

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use common::stub::{self, Speed};
use common::*;
use kvtier_testkit::etcd::Etcd;
use serde_json::Value;

const TOKEN: &str = "members-test-token";
const SECRET: &str = "members-test-cluster-secret";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn secret_file(dir: &Path, name: &str, secret: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, secret).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// A member `id` of the cluster `test` naming `worker`, its data endpoint `data` (a
/// `server.tcp` or `server.tls` address: the other is off), signed with the secret in
/// `secret`.
fn member(
    etcd: &Etcd,
    dir: &Path,
    id: &str,
    worker: &str,
    data: (&str, u16),
    secret: &str,
) -> Result<Proc> {
    let d = dir.join(id);
    std::fs::create_dir_all(&d)?;
    let (listener, port) = data;
    let mut sets = vec![
        format!(
            "server.runtime_dir={:?}",
            d.join("run").display().to_string()
        ),
        format!(
            "server.unix={:?}",
            d.join("kvtier.sock").display().to_string()
        ),
        "server.quic=\"off\"".into(),
        "server.admin=\"off\"".into(),
        format!("server.token={TOKEN:?}"),
        "store.dram_bytes=\"4MiB\"".into(),
        "store.dram_prefault=false".into(),
        "store.nvme_dir=\"\"".into(),
        format!("cluster.etcd_endpoints={:?}", etcd.url()),
        "cluster.name=\"test\"".into(),
        format!("cluster.node_id={id:?}"),
        "cluster.lease_ttl_s=2".into(),
        "cluster.etcd_timeout_ms=1000".into(),
        format!("cluster.secret_file={secret:?}"),
        format!("cluster.worker_url={worker:?}"),
    ];
    for l in ["tcp", "tls"] {
        let addr = if l == listener {
            format!("127.0.0.1:{port}")
        } else {
            "off".into()
        };
        sets.push(format!("server.{l}={addr:?}"));
    }
    let args: Vec<String> = sets.into_iter().flat_map(|s| ["--set".into(), s]).collect();
    Proc::start(
        &bin("kvtier-server", "KVTIER_SERVER_BIN"),
        &args,
        "listening ",
    )
}

async fn health(url: &str) -> Result<Value> {
    Ok(json(&get(&format!("{url}/health")).await?))
}

/// The present workers in `/health`, with whether their server's events are synced.
fn present(h: &Value) -> Vec<(String, bool)> {
    let mut v: Vec<(String, bool)> = h["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .filter(|w| w["present"] == true)
                .map(|w| {
                    (
                        w["url"].as_str().unwrap_or_default().to_string(),
                        w["kvtier_synced"] == true,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Until `/health` shows exactly `want` present, each synced to its server's events.
async fn until_present(url: &str, want: &[&str]) -> Result<()> {
    let mut want: Vec<(String, bool)> = want.iter().map(|u| (u.to_string(), true)).collect();
    want.sort();
    wait_until(
        Duration::from_secs(20),
        &format!("workers {want:?}"),
        || {
            let want = want.clone();
            async move { Ok(present(&health(url).await?) == want) }
        },
    )
    .await
}

/// Sends `n` cold completions; the workers that answered them.
async fn answered(url: &str, seed: u64, n: u64) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for i in 0..n {
        let r = post(
            &format!("{url}/v1/completions"),
            &completion(&text(seed + i, 200), 2, false),
        )
        .await?;
        anyhow::ensure!(r.status == 200, "{} {}", r.status, r.text());
        out.push(answered_by(&r));
    }
    out.sort();
    out.dedup();
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_follow_the_clusters_membership() -> Result<()> {
    bounded(150, async {
        let dir = tempfile::tempdir()?;
        let mut etcd = Etcd::start().await;
        let secret = secret_file(dir.path(), "secret", SECRET);
        let speed = Speed {
            prefill_tokens_per_s: 5000.0,
            decode_step_s: 0.001,
            load_bytes_per_s: 1e9,
        };
        let (wa, wb, wc) = (
            stub::start(speed).await?,
            stub::start(speed).await?,
            stub::start(speed).await?,
        );
        // a: TLS only (its record carries the certificate to pin); b: plain TCP, on a port
        // it keeps across its restart.
        let b_port = free_port();
        let _a = member(
            &etcd,
            dir.path(),
            "a",
            &wa.url,
            ("tls", free_port()),
            &secret,
        )?;
        let mut b = member(&etcd, dir.path(), "b", &wb.url, ("tcp", b_port), &secret)?;
        let (_router, url) = router(&[
            "--cluster-etcd".into(),
            etcd.url(),
            "--cluster-name".into(),
            "test".into(),
            "--cluster-secret-file".into(),
            secret.clone(),
            "--kvtier-token".into(),
            TOKEN.into(),
            "--health-interval-ms".into(),
            "200".into(),
        ])?;
        until_present(&url, &[&wa.url, &wb.url]).await?;
        let h = health(&url).await?;
        assert_eq!(h["cluster"]["etcd"]["state"], "connected", "{h}");
        assert_eq!(
            h["cluster"]["members"],
            serde_json::json!(["a", "b"]),
            "{h}"
        );
        assert_eq!(answered(&url, 0, 8).await?, sorted(&[&wa.url, &wb.url]));

        // A member signed with another secret: refused, its worker never added.
        let other = secret_file(dir.path(), "other", "another-cluster-secret-entirely");
        let _c = member(
            &etcd,
            dir.path(),
            "c",
            &wc.url,
            ("tcp", free_port()),
            &other,
        )?;
        wait_until(Duration::from_secs(20), "c's record refused", || {
            let url = url.clone();
            async move {
                let m = get(&format!("{url}/metrics")).await?.text();
                Ok(metric(&m, "kvtier_router_cluster_records_refused_total", &[]) >= 1.0)
            }
        })
        .await?;
        assert_eq!(present(&health(&url).await?).len(), 2);

        // b stops (its lease revoked): its worker is no candidate, everything goes to a.
        b.terminate();
        until_present(&url, &[&wa.url]).await?;
        assert_eq!(answered(&url, 100, 6).await?, sorted(&[&wa.url]));
        let m = get(&format!("{url}/metrics")).await?.text();
        let workers = |s: &str| metric(&m, "kvtier_router_cluster_workers", &[("state", s)]);
        assert_eq!((workers("present"), workers("left")), (1.0, 1.0), "{m}");

        // b back on the same endpoint: the same place in the list, routed to again.
        b = member(&etcd, dir.path(), "b", &wb.url, ("tcp", b_port), &secret)?;
        until_present(&url, &[&wa.url, &wb.url]).await?;
        let h = health(&url).await?;
        assert_eq!(
            h["workers"].as_array().map(Vec::len),
            Some(2),
            "no new place: {h}"
        );
        assert_eq!(answered(&url, 200, 8).await?, sorted(&[&wa.url, &wb.url]));

        // etcd down: the router keeps its workers and says so; back: connected again.
        etcd.kill();
        wait_until(
            Duration::from_secs(20),
            "etcd unreachable in /health",
            || {
                let url = url.clone();
                async move { Ok(health(&url).await?["cluster"]["etcd"]["state"] == "unreachable") }
            },
        )
        .await?;
        assert_eq!(answered(&url, 300, 8).await?, sorted(&[&wa.url, &wb.url]));
        etcd.restart().await;
        wait_until(Duration::from_secs(30), "etcd connected again", || {
            let url = url.clone();
            async move { Ok(health(&url).await?["cluster"]["etcd"]["state"] == "connected") }
        })
        .await?;
        until_present(&url, &[&wa.url, &wb.url]).await?;
        drop(b);
        Ok(())
    })
    .await
}

fn sorted(urls: &[&String]) -> Vec<String> {
    let mut v: Vec<String> = urls.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

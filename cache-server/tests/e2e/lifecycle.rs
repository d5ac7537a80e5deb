//! Start, admin port, graceful shutdown, bad configuration.

use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_port_reports_health_readiness_metrics_and_stats() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("tcp").await;
        let k = keys(b"admin", 4, 0);
        put_all(&c, &k).await;
        assert_eq!(get_verified(&c, &k).await, 4);
        assert_eq!(http_get(srv.admin, "/health").await.0, 200);
        assert_eq!(http_get(srv.admin, "/ready").await.0, 200);
        assert_eq!(http_get(srv.admin, "/nope").await.0, 404);
        let (code, m) = http_get(srv.admin, "/metrics").await;
        assert_eq!(code, 200);
        for family in [
            "kvtier_tier_hits_total{tier=\"dram\"}",
            "kvtier_tier_misses_total{tier=\"nvme\"}",
            "kvtier_tier_bytes_out_total{tier=\"dram\"}",
            "kvtier_tier_evictions_total{tier=\"dram\"}",
            "kvtier_connections{transport=\"tcp\"} 1",
            "kvtier_request_duration_seconds_bucket{op=\"get\",le=\"+Inf\"} 1",
            // (the get's pins may still be held for an instant after its last byte)
            "kvtier_tier_pins{tier=\"dram\"} ",
        ] {
            assert!(m.contains(family), "missing {family} in:\n{m}");
        }
        // No key or token ever appears on the admin port.
        assert!(!m.contains(&k[0].to_string()));
        assert!(!m.contains(TOKEN));
        let st = srv.stats().await;
        assert_eq!(st["store"]["blocks"].as_u64().unwrap(), 4);
        assert_eq!(st["connections"].as_u64().unwrap(), 1);
    })
    .await;
}

/// The admin port's /metrics, after traffic on every transport, passes `promtool check
/// metrics` (names, types, help, histogram buckets). Fails when promtool is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool_check() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        for t in ["unix", "tcp", "tls", "quic"] {
            let c = srv.client(t).await;
            let k = keys(t.as_bytes(), 2, 0);
            put_all(&c, &k).await;
            assert_eq!(get_verified(&c, &k).await, 2);
        }
        let r = kvtier_client::http::HttpClient::new(Default::default())
            .get(&format!("http://{}/metrics", srv.admin))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(
            r.content_type.as_deref(),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        let m = r.text();
        assert!(m.contains("kvtier_requests_total{op=\"put\"}"), "{m}");
        assert!(
            m.contains("kvtier_connections_total{transport=\"tls\"} 1"),
            "{m}"
        );
        assert!(m.contains("kvtier_tls_handshake_failures_total 0"), "{m}");
        promtool_check(&m);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_work_flushes_and_exits_zero() {
    let mut srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let k = keys(b"term", 64, 0);
        put_all(&c, &k).await;
        // Requests racing the signal: each either completes or fails cleanly.
        let racer = {
            let c = c.clone();
            let k = k.clone();
            tokio::spawn(async move {
                for _ in 0..50 {
                    let n = get_verified(&c, &k).await;
                    assert!(n == 0 || n == 64, "a get is whole or nothing, got {n}");
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        let status = tokio::task::block_in_place(|| srv.stop());
        assert!(status.success(), "exit status {status}");
        racer.await.unwrap();
        // Write-through copies were flushed: everything is on NVMe after the restart.
        let srv2 = ServerProc::start_in(&srv.dir, &[]);
        let c = srv2.client("unix").await;
        assert_eq!(c.lookup(&k).await.tiers.len(), 64);
        assert_eq!(get_verified(&c, &k).await, 64);
    })
    .await;
}

#[test]
fn bad_configuration_fails_with_the_settings_name() {
    for (args, needle) in [
        (vec!["--set", "store.dram_bytes=lots"], "lots"),
        (vec!["--set", "limits.bogus=1"], "bogus"),
        (vec!["--tcp", "not-an-address"], "server.tcp"),
        (
            vec!["--config", "/nonexistent/kvtier.toml"],
            "/nonexistent/kvtier.toml",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-server"))
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // The template prints back as the defaults.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-server"))
        .args([
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../config/kvtier.toml"),
            "--print-config",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("tcp = \"127.0.0.1:7450\""));
}

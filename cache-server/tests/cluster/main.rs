//! Cluster membership with a real etcd and real `kvtier-server` processes on loopback (built
//! with the `cluster` feature; this target requires it), and on hosts in network namespaces
//! the tests make (`netns`, `partition`). Each test bounds its time and stops the servers and
//! etcd it starts. etcd missing: the tests fail naming `.ci/install-deps`.

#[allow(dead_code)]
#[path = "../e2e/common.rs"]
mod common;
mod data_path;
mod faults;
mod netns;
mod partition;

use std::time::{Duration, Instant};

use common::{ServerProc, bounded, get_verified, http_get, keys, put_all};
use kvtier_testkit::etcd::Etcd;
use serde_json::Value;

/// A secret file (0600) in `dir`.
fn secret_file(dir: &std::path::Path, secret: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("cluster-secret");
    std::fs::write(&p, secret).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// A server in the cluster of `etcd` as `id`, with `ttl_s` leases and the secret at `secret`.
fn member(etcd: &Etcd, id: &str, ttl_s: u64, secret: &str) -> ServerProc {
    member_with(etcd, id, ttl_s, secret, &[])
}

/// [`member`], with more `--set` assignments.
fn member_with(etcd: &Etcd, id: &str, ttl_s: u64, secret: &str, extra: &[&str]) -> ServerProc {
    let mut sets = vec![
        format!("cluster.etcd_endpoints={:?}", etcd.url()),
        "cluster.name=\"test\"".into(),
        format!("cluster.node_id={id:?}"),
        format!("cluster.lease_ttl_s={ttl_s}"),
        "cluster.etcd_timeout_ms=1000".into(),
        format!("cluster.secret_file={secret:?}"),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(&sets.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn cluster_doc(s: &ServerProc, query: &str) -> Value {
    let (status, body) = http_get(s.admin, &format!("/cluster{query}")).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn member_ids(doc: &Value) -> Vec<String> {
    doc["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["node_id"].as_str().unwrap().to_string())
        .collect()
}

/// Waits (polling every 50 ms, at most `limit`) until `s`'s view is exactly `ids` with etcd
/// connected; returns how long it took.
async fn until_view(s: &ServerProc, ids: &[&str], limit: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let d = cluster_doc(s, "").await;
        if member_ids(&d) == ids && d["etcd"]["state"] == "connected" {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "view of {} is not {ids:?} after {limit:?}: {d:#}",
            d["node_id"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// Three members join and see each other (same owners for a key everywhere); one killed
/// (SIGKILL) is gone from the others' views within its lease TTL + 3 s; one stopped
/// (SIGTERM) is gone at once (its lease revoked), well before its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_see_each_other_and_leave() {
    bounded(120, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), "a cluster secret of 32 bytes....");
        let ttl = 4;
        let a = member(&etcd, "a", ttl, &secret);
        let mut b = member(&etcd, "b", ttl, &secret);
        let c = member(&etcd, "c", ttl, &secret);
        for s in [&a, &b, &c] {
            until_view(s, &["a", "b", "c"], Duration::from_secs(15)).await;
        }
        // Every member names the same owners for a key, and they are members.
        let key = "00112233445566778899aabbccddeeff";
        let owners: Vec<Value> = {
            let mut v = Vec::new();
            for s in [&a, &b, &c] {
                let d = cluster_doc(s, &format!("?key={key}")).await;
                assert_eq!(d["key"]["key"], key);
                v.push(d["key"]["owners"].clone());
            }
            v
        };
        assert_eq!(owners[0].as_array().unwrap().len(), 1, "{owners:?}");
        assert!(owners.iter().all(|o| *o == owners[0]), "{owners:?}");
        let d = cluster_doc(&a, "").await;
        assert_eq!(d["node_id"], "a");
        assert_eq!(d["records_signed"], true);
        assert!(d["lease_id"].as_i64().unwrap() != 0);
        let me: Vec<&Value> = d["members"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["self"] == true)
            .collect();
        assert_eq!(me.len(), 1);
        assert_eq!(me[0]["data_endpoint"], format!("tls://{}", a.tls));
        assert!(me[0]["tiers"].as_array().unwrap().len() == 2, "{d:#}");
        assert!(me[0]["weight"].as_f64().unwrap() > 0.0);
        let (s, _) = http_get(a.admin, "/cluster?key=xyz").await;
        assert_eq!(s, 400);
        let (_, health) = http_get(a.admin, "/health").await;
        assert!(
            health.starts_with("ok\netcd: connected (view: 3 members)"),
            "{health}"
        );
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_members"), 3.0);
        assert_eq!(metric(&m, "kvtier_cluster_etcd_connected"), 1.0);
        assert_eq!(metric(&m, "kvtier_cluster_enabled"), 1.0);
        assert!(
            metric(&m, "kvtier_cluster_watch_events_total") >= 1.0,
            "{m}"
        );
        common::promtool_check(&m);

        // SIGKILL c: its lease expires, etcd deletes its key, a and b see it go.
        drop(c);
        let killed = Instant::now();
        for s in [&a, &b] {
            until_view(s, &["a", "b"], Duration::from_secs(ttl + 3)).await;
        }
        let gone = killed.elapsed();
        println!("killed member gone from both views after {gone:?} (ttl {ttl} s)");

        // SIGTERM b: it revokes its lease on the way out; a sees it go well before the TTL.
        let stopped = Instant::now();
        assert!(b.stop().success());
        until_view(&a, &["a"], Duration::from_secs(ttl + 3)).await;
        let gone = stopped.elapsed();
        println!("stopped member gone from the last view after {gone:?} (ttl {ttl} s)");
        assert!(
            gone < Duration::from_secs(ttl - 1),
            "a stopped member should leave at once (lease revoked), took {gone:?}"
        );
        let m = http_get(a.admin, "/metrics").await.1;
        assert!(
            metric(&m, "kvtier_cluster_lease_renewals_total") >= 1.0,
            "{m}"
        );
    })
    .await;
}

/// etcd killed: the members keep serving (a put and get through the SDK), keep their last
/// view and say etcd is unreachable in /health, /cluster and metrics; etcd restarted: they
/// register again and converge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_keeps_serving_and_recovers() {
    bounded(120, async {
        let mut etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), "another secret, long enough.....");
        let a = member(&etcd, "a", 3, &secret);
        let b = member(&etcd, "b", 3, &secret);
        for s in [&a, &b] {
            until_view(s, &["a", "b"], Duration::from_secs(15)).await;
        }
        let c = a.client("tcp").await;
        let before = keys(b"outage", 8, 1);
        put_all(&c, &before).await;

        etcd.kill();
        // Unreachable within a renewal period + the request bound (ttl/3 + 1 s), say 5 s.
        let t0 = Instant::now();
        loop {
            let (status, health) = http_get(a.admin, "/health").await;
            assert_eq!(
                status, 200,
                "an etcd outage must not fail /health: {health}"
            );
            if health.contains("etcd: unreachable") {
                assert!(health.contains("last known view (2 members)"), "{health}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "{health}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let d = cluster_doc(&a, "").await;
        assert_eq!(d["etcd"]["state"], "unreachable", "{d:#}");
        assert_eq!(member_ids(&d), ["a", "b"], "the last known view is kept");
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_etcd_connected"), 0.0);
        assert_eq!(metric(&m, "kvtier_cluster_members"), 2.0);
        // The local tiers still serve, old blocks and new.
        assert_eq!(get_verified(&c, &before).await, before.len());
        let during = keys(b"outage-during", 8, 2);
        put_all(&c, &during).await;
        assert_eq!(get_verified(&c, &during).await, during.len());
        // Longer than a lease: still the last view, still serving.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(member_ids(&cluster_doc(&a, "").await), ["a", "b"]);

        etcd.restart().await;
        for s in [&a, &b] {
            until_view(s, &["a", "b"], Duration::from_secs(15)).await;
        }
        let m = http_get(a.admin, "/metrics").await.1;
        assert!(
            metric(&m, "kvtier_cluster_registrations_total") >= 2.0,
            "{m}"
        );
        assert!(metric(&m, "kvtier_cluster_etcd_errors_total") >= 1.0, "{m}");
        let (_, health) = http_get(b.admin, "/health").await;
        assert!(
            health.contains("etcd: connected (view: 2 members)"),
            "{health}"
        );
        assert_eq!(get_verified(&c, &during).await, during.len());
    })
    .await;
}

/// A process with another secret cannot register a member the others accept (and does not
/// accept theirs); both count the refused records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_the_secret_is_refused() {
    bounded(60, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let d2 = tempfile::tempdir().unwrap();
        let good = secret_file(dir.path(), "the real cluster secret.........");
        let bad = secret_file(d2.path(), "a guessed secret................");
        let a = member(&etcd, "a", 5, &good);
        until_view(&a, &["a"], Duration::from_secs(15)).await;
        let x = member(&etcd, "intruder", 5, &bad);
        until_view(&x, &["intruder"], Duration::from_secs(15)).await;
        // a has seen the intruder's record by now (x listed a's, so the put happened
        // before); give the watch a moment, then check it was refused and counted.
        let t0 = Instant::now();
        loop {
            let m = http_get(a.admin, "/metrics").await.1;
            if m.contains("kvtier_cluster_records_rejected_total{reason=\"bad_mac\"} 1") {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "{m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(member_ids(&cluster_doc(&a, "").await), ["a"]);
        let d = cluster_doc(&x, "").await;
        assert_eq!(d["records_rejected"]["bad_mac"], 1, "{d:#}");
    })
    .await;
}

/// A server without `[cluster]` answers `/cluster` with `enabled: false` and its `/health`
/// is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cluster_section_no_cluster() {
    bounded(30, async {
        let s = ServerProc::start(&[]);
        assert_eq!(
            cluster_doc(&s, "").await,
            serde_json::json!({"enabled": false})
        );
        assert_eq!(http_get(s.admin, "/health").await.1, "ok\n");
        let m = http_get(s.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_enabled"), 0.0);
    })
    .await;
}

/// A member told to talk to its peers over a listener that is off, or bound to no specific
/// address, refuses to start and says which setting and what to do.
#[test]
fn peers_on_a_listener_that_is_off_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "a secret of the refusal test....");
    for (listener, off) in [
        ("quic", "server.quic=\"off\""),
        ("tls", "server.tls=\"0.0.0.0:0\""),
    ] {
        let sets = [
            // No etcd is reached: the refusal comes first.
            "cluster.etcd_endpoints=\"http://127.0.0.1:9\"".to_string(),
            format!("cluster.secret_file={secret:?}"),
            format!("cluster.peer_transport={listener:?}"),
            off.to_string(),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let (status, err) = ServerProc::refused_in(dir.path(), &sets);
        assert!(!status.success(), "{listener}: {err}");
        assert!(
            err.contains("cluster.peer_transport") && err.contains("cluster.advertise_data"),
            "{listener}: {err}"
        );
    }
}

//! Members on separate hosts ([`Net`]: network namespaces the test makes), partitioned and
//! healed.

use std::time::{Duration, Instant};

use super::common::{ServerProc, bounded, get_verified, keys, put_all};
use super::etcd::Etcd;
use super::netns::{Net, as_root};
use super::{secret_file, until_view};

/// A member on host `i` of `net`, its listeners on that host's address.
fn member_on(net: &Net, i: usize, etcd: &Etcd, ttl_s: u64, secret: &str) -> ServerProc {
    let a = net.addr(i);
    ServerProc::start_in_netns(
        net.ns(i),
        &[
            &format!("server.tcp=\"{a}:0\""),
            // Peers and the test reach it over these hosts' own network only.
            "server.tcp_plaintext=true",
            &format!("server.quic=\"{a}:0\""),
            &format!("server.tls=\"{a}:0\""),
            &format!("server.admin=\"{a}:0\""),
            &format!("cluster.etcd_endpoints={:?}", etcd.url()),
            "cluster.name=\"test\"",
            &format!("cluster.node_id=\"h{i}\""),
            &format!("cluster.lease_ttl_s={ttl_s}"),
            "cluster.etcd_timeout_ms=1000",
            &format!("cluster.secret_file={secret:?}"),
        ],
    )
}

/// Runs `f` on a runtime whose threads live in `net`'s hub namespace.
fn in_hub<F: std::future::Future>(net: &Net, f: F) -> F::Output {
    net.enter_hub();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A member cut off from its peers and etcd: the others drop it within its lease TTL + 3 s;
/// it keeps serving its local clients (over its Unix socket) what it holds; healed, it
/// registers again and every view has all three members.
#[test]
fn a_partitioned_member_leaves_the_views_keeps_serving_and_rejoins() {
    if !as_root("partition::a_partitioned_member_leaves_the_views_keeps_serving_and_rejoins") {
        return;
    }
    let net = Net::new(3);
    in_hub(&net, async {
        bounded(150, async {
            let etcd = Etcd::start_on(Net::HUB).await;
            let dir = tempfile::tempdir().unwrap();
            let secret = secret_file(dir.path(), "a secret for partitioned members");
            let ttl = 3;
            let m: Vec<ServerProc> = (0..3)
                .map(|i| member_on(&net, i, &etcd, ttl, &secret))
                .collect();
            let all = ["h0", "h1", "h2"];
            for s in &m {
                until_view(s, &all, Duration::from_secs(20)).await;
            }
            let local = m[2].client("unix").await;
            let ks = keys(b"partition", 8, 1);
            put_all(&local, &ks).await;

            net.cut(2);
            let t0 = Instant::now();
            for s in &m[..2] {
                until_view(s, &["h0", "h1"], Duration::from_secs(ttl + 3)).await;
            }
            println!(
                "partitioned member gone from the others' views after {:?}",
                t0.elapsed()
            );
            // Cut off, it still serves its local clients what it holds.
            assert_eq!(get_verified(&local, &ks).await, ks.len());

            net.heal(2);
            let t0 = Instant::now();
            for s in &m {
                until_view(s, &all, Duration::from_secs(20)).await;
            }
            println!("healed member back in every view after {:?}", t0.elapsed());
        })
        .await
    });
}

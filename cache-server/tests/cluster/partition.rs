//! Members on separate hosts ([`Net`]: network namespaces the test makes), partitioned and
//! healed.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig};
use kvtier_core::BlockKey;
use kvtier_server::cluster::record::peer_token;

use super::common::{ServerProc, bounded, get_verified, keys, put_all};
use super::data_path::{RUN, run_owners};
use super::netns::{Net, as_root};
use super::{secret_file, until_view};
use kvtier_testkit::etcd::Etcd;

/// A member on host `i` of `net`, its listeners on that host's address; `extra` are more
/// settings.
fn member_on(
    net: &Net,
    i: usize,
    etcd: &Etcd,
    ttl_s: u64,
    secret: &str,
    extra: &[&str],
) -> ServerProc {
    let a = net.addr(i);
    let mut sets: Vec<String> = [
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start_in_netns(
        net.ns(i),
        &sets.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    )
}

/// Runs test `name` (its full path, for [`as_root`]) on `hosts` hosts: the body gets them
/// and an etcd at the hub, on a runtime whose threads live in the hub namespace, bounded to
/// 150 s.
fn on_hosts<F: Future<Output = ()>>(
    name: &str,
    hosts: usize,
    body: impl FnOnce(Arc<Net>, Etcd) -> F,
) {
    if !as_root(name) {
        return;
    }
    let net = Arc::new(Net::new(hosts));
    net.enter_hub();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bounded(150, async {
            let etcd = Etcd::start_on(Net::HUB).await;
            body(net.clone(), etcd).await
        }));
}

/// A member cut off from its peers and etcd: the others drop it within its lease TTL + 3 s;
/// it keeps serving its local clients (over its Unix socket) what it holds; healed, it
/// registers again and every view has all three members.
#[test]
fn a_partitioned_member_leaves_the_views_keeps_serving_and_rejoins() {
    on_hosts(
        "partition::a_partitioned_member_leaves_the_views_keeps_serving_and_rejoins",
        3,
        |net, etcd| async move {
            let dir = tempfile::tempdir().unwrap();
            let secret = secret_file(dir.path(), "a secret for partitioned members");
            let ttl = 3;
            let m: Vec<ServerProc> = (0..3)
                .map(|i| member_on(&net, i, &etcd, ttl, &secret, &[]))
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
        },
    );
}

/// The data path across a partition: a chain put on h0 reaches its owners by offers; with
/// one owner cut off (still in the views), a lookup on the third member returns, within
/// twice the peer timeout, exactly the prefix before that owner's first run, and every byte
/// it serves is right; healed, the same lookup finds the whole chain again.
#[test]
fn a_partitioned_owner_is_a_miss_within_the_deadline_and_found_again_when_healed() {
    on_hosts(
        "partition::a_partitioned_owner_is_a_miss_within_the_deadline_and_found_again_when_healed",
        3,
        |net, etcd| async move {
            let dir = tempfile::tempdir().unwrap();
            const SECRET: &str = "the partitioned data path secret";
            let secret = secret_file(dir.path(), SECRET);
            let runs = format!("cluster.run_blocks={RUN}");
            let extra = [
                runs.as_str(),
                "cluster.head_blocks=0",
                "cluster.peer_timeout_ms=500",
            ];
            let m: Vec<ServerProc> = (0..3)
                .map(|i| member_on(&net, i, &etcd, 3, &secret, &extra))
                .collect();
            let all = ["h0", "h1", "h2"];
            for s in &m {
                until_view(s, &all, Duration::from_secs(20)).await;
            }
            let chain = keys(b"partitioned", 96, 1);
            put_all(&m[0].client("unix").await, &chain).await;
            let owners = run_owners(&m[0], &chain).await;
            // The first run another member owns decides who is cut off; the third member
            // looks the chain up.
            let Some(first) = owners.iter().position(|o| o != "h0") else {
                panic!("h0 owns every run of the chain: {owners:?}");
            };
            let cut: usize = owners[first][1..].parse().unwrap();
            let observer = 3 - cut;
            until_held(&m[cut], SECRET, &chain[first * RUN..(first + 1) * RUN]).await;

            net.cut(cut);
            let local = m[observer].client("unix").await;
            let t0 = Instant::now();
            let l = local.lookup(&chain).await;
            let took = t0.elapsed();
            println!(
                "lookup with owner h{cut} cut off: {} blocks in {took:?}",
                l.tiers.len()
            );
            assert!(took < Duration::from_millis(2 * 500 + 1000), "{took:?}");
            assert_eq!(
                l.tiers.len(),
                first * RUN,
                "owners {owners:?}, h{cut} cut off"
            );
            assert_eq!(get_verified(&local, &chain).await, first * RUN);

            net.heal(cut);
            for s in &m {
                until_view(s, &all, Duration::from_secs(20)).await;
            }
            // The observer's connection to the healed owner may wait out a reconnect pause.
            let t0 = Instant::now();
            loop {
                if local.lookup(&chain).await.tiers.len() == chain.len() {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(15),
                    "never found whole again"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            assert_eq!(get_verified(&local, &chain).await, chain.len());
        },
    );
}

/// Waits (at most 10 s) until `s` holds `run` (an offer arrived), asked as a peer (a
/// local-only lookup) with the token derived from `secret`.
async fn until_held(s: &ServerProc, secret: &str, run: &[BlockKey]) {
    let token = peer_token(secret.as_bytes(), "test");
    let c = Client::connect(&s.tcp_url(), ClientConfig::default().token(token))
        .await
        .expect("a peer connects");
    let t0 = Instant::now();
    while c.lookup(run).await.tiers.len() < run.len() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the offer never arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

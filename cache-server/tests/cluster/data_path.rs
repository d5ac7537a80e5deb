//! The cluster data path with a real etcd and real servers on loopback: lookups that ask
//! the owners, fetch, verify and store; puts offered to their owners; peers authenticated
//! with the token derived from the cluster secret; a dead owner and a lying one are misses.

use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig, ClientError, Source, TierCode};
use kvtier_core::BlockKey;
use kvtier_core::protocol::{
    ErrorCode, FetchReply, HEADER_BYTES, Header, HelloReply, KeyList, Limits, Request, Response,
    block_sum,
};
use kvtier_server::cluster::record::{
    MemberRecord, RECORD_VERSION, RecordSealer, TierCapacity, peer_token,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::common::{
    BLOCK, Raw, ServerProc, TOKEN, bounded, get_verified, http_get, keys, put_all,
};
use super::{cluster_doc, member_with, metric, secret_file, until_view};
use kvtier_testkit::etcd::Etcd;
use tokio::net::TcpStream;

const SECRET: &str = "the data path's secret, 32 bytes";
/// `cluster.run_blocks` of these tests (and of `partition.rs`'s).
pub(super) const RUN: usize = 8;

/// An etcd, the cluster secret, and members `ids` (leases of `ttl_s`, settings `extra`),
/// each seeing all of them. Dropped, it stops the members, then etcd.
struct Fleet {
    members: Vec<ServerProc>,
    etcd: Etcd,
    _dir: tempfile::TempDir,
}

impl Fleet {
    async fn start(ids: &[&str], ttl_s: u64, extra: &[&str]) -> Fleet {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let members: Vec<ServerProc> = ids
            .iter()
            .map(|id| member_with(&etcd, id, ttl_s, &secret, extra))
            .collect();
        for s in &members {
            until_view(s, ids, Duration::from_secs(15)).await;
        }
        Fleet {
            members,
            etcd,
            _dir: dir,
        }
    }
}

fn token() -> String {
    peer_token(SECRET.as_bytes(), "test")
}

async fn peer(s: &ServerProc) -> Client {
    Client::connect(&s.tcp_url(), ClientConfig::default().token(token()))
        .await
        .expect("a peer connects with the derived token")
}

/// The owner of each run of `chain` (runs of [`RUN`]), as `s` names them.
pub(super) async fn run_owners(s: &ServerProc, chain: &[BlockKey]) -> Vec<String> {
    let mut out = Vec::new();
    for i in (0..chain.len()).step_by(RUN) {
        let d = cluster_doc(s, &format!("?key={}", chain[i])).await;
        let o = d["key"]["owners"][0].as_str().unwrap().to_string();
        out.push(o);
    }
    out
}

/// A chain of `blocks` blocks (runs of [`RUN`]) whose first run owned by `owner` (as `s`
/// places it) is not run 0: the chain, its runs' owners, and where that run starts.
async fn chain_with_a_later_run_of(
    s: &ServerProc,
    owner: &str,
    salt: &[u8],
    blocks: usize,
) -> (Vec<BlockKey>, Vec<String>, usize) {
    for seed in 1..100 {
        let chain = keys(salt, blocks, seed);
        let owners = run_owners(s, &chain).await;
        if let Some(first) = owners.iter().position(|o| o == owner)
            && first > 0
        {
            return (chain, owners, first * RUN);
        }
    }
    panic!("no chain with a run of {owner}'s after the first in 99 seeds");
}

/// A lookup of `chain` on `s` whose owner of the run at `expect` is `what` (dead, silent):
/// it returns the `expect` blocks before that run within twice the peer timeout (500 ms)
/// plus a second, and they read back byte-exact.
async fn lookup_stops_in_time(
    s: &ServerProc,
    chain: &[BlockKey],
    owners: &[String],
    expect: usize,
    what: &str,
) {
    let cl = s.client("tcp").await;
    let t0 = Instant::now();
    let l = cl.lookup(chain).await;
    let took = t0.elapsed();
    println!(
        "lookup with a {what} owner: {took:?}, {} of {}",
        l.tiers.len(),
        chain.len()
    );
    assert_eq!(l.tiers.len(), expect, "{owners:?} {l:?}");
    assert!(
        took < Duration::from_millis(2 * 500 + 1000),
        "a {what} peer must not hold a lookup past its deadline: {took:?}"
    );
    assert_eq!(get_verified(&cl, chain).await, expect);
}

/// Waits (at most 10 s) until each run owned by one of `members` (other than `putter`) is
/// held by its owner: the offers arrived. Asked over peer connections (local-only lookups).
async fn until_offered(
    members: &[(&str, &ServerProc)],
    putter: &str,
    chain: &[BlockKey],
    owners: &[String],
) {
    let t0 = Instant::now();
    for (r, o) in owners.iter().enumerate() {
        let Some((_, s)) = members.iter().find(|(id, _)| id == o && *id != putter) else {
            continue;
        };
        let p = peer(s).await;
        let run = &chain[r * RUN..((r + 1) * RUN).min(chain.len())];
        loop {
            let l = p.lookup(run).await;
            if l.tiers.len() == run.len() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "run {r} never reached its owner {o}: {l:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// DRAM slots holding guest copies, from a `/metrics` text.
fn guest_slots(m: &str) -> usize {
    labelled(m, "kvtier_tier_guest_slots", "tier=\"dram\"") as usize
}

/// Waits (at most 10 s) until `s` holds `want` guest copies in DRAM.
async fn until_guests(s: &ServerProc, want: usize, what: &str) {
    let t0 = Instant::now();
    while guest_slots(&http_get(s.admin, "/metrics").await.1) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: guests != {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn labelled(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}{{{label}}} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A chain put on one member is found by a lookup on each other member and read back
/// byte-equal through a plain get (the SDK unchanged); each counts exactly the blocks it
/// fetched from the others; a peer's lookup is local-only.
/// Blocks come from their owners by one-sided reads of the owners' DRAM over
/// kvtier-transfer (the default, `cluster.fetch = "tcp"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_put_on_one_member_is_found_and_read_on_the_others() {
    found_and_read_on_the_others("tcp", "tls").await
}

/// The same with the reads over kvtier-transfer's QUIC backend (encrypted; the owner's
/// certificate pinned from its signed record's blob).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_put_on_one_member_is_found_and_read_over_quic() {
    found_and_read_on_the_others("quic", "tls").await
}

/// The same over the kvtier protocol: by default (`cluster.fetch = "auto"`), since these
/// members talk TLS to each other and a one-sided read over TCP would carry blocks in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_put_on_one_member_is_found_and_fetched_over_the_protocol() {
    found_and_read_on_the_others("auto", "tls").await
}

/// The same with the members talking the protocol to each other over QUIC
/// (`cluster.peer_transport = "quic"`; the certificate pinned from the signed record), where
/// `auto` fetches over the protocol, encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_put_on_one_member_is_found_and_fetched_with_peers_on_quic() {
    found_and_read_on_the_others("auto", "quic").await
}

/// Members a, b, c (`cluster.fetch` = `fetch`, peers over `peers`: `tls` or `quic`).
async fn found_and_read_on_the_others(fetch: &str, peers: &str) {
    let fetch_setting = format!("cluster.fetch=\"{fetch}\"");
    let peers_setting = format!("cluster.peer_transport=\"{peers}\"");
    let one_sided = fetch == "tcp" || fetch == "quic";
    bounded(120, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=1000",
            fetch_setting.as_str(),
            peers_setting.as_str(),
        ];
        let fleet = Fleet::start(&["a", "b", "c"], 5, &extra).await;
        let [a, b, c] = &fleet.members[..] else {
            unreachable!()
        };
        let members = [("a", a), ("b", b), ("c", c)];
        let chain = keys(b"data-path", 96, 1);
        put_all(&a.client("tcp").await, &chain).await;
        let owners = run_owners(a, &chain).await;
        until_offered(&members, "a", &chain, &owners).await;
        let m = http_get(a.admin, "/metrics").await.1;
        let offered: usize = owners.iter().filter(|o| *o != "a").map(|_| RUN).sum();
        let sent = labelled(&m, "kvtier_cluster_peer_offered_blocks_total", "peer=\"b\"")
            + labelled(&m, "kvtier_cluster_peer_offered_blocks_total", "peer=\"c\"");
        assert_eq!(sent as usize, offered, "{owners:?}");
        // The putter's copies of what its owners now hold are guests (evicted first there).
        until_guests(a, offered, "a").await;

        for (id, s) in [("b", &b), ("c", &c)] {
            let cl = s.client("tcp").await;
            let t0 = Instant::now();
            let l = cl.lookup(&chain).await;
            println!(
                "lookup of {} blocks on {id}: {:?}",
                chain.len(),
                t0.elapsed()
            );
            assert_eq!(l.tiers.len(), chain.len(), "{id}: {l:?}");
            assert_eq!(l.miss, None);
            // The reply says which blocks came from another member, and from which: the
            // runs others own, each from its owner (neighbouring runs of one owner in one
            // source); its own runs are here (DRAM).
            let (tiers, sources) = expected_sources(&owners, id);
            assert_eq!(l.tiers, tiers, "{id}: {owners:?}");
            assert_eq!(l.sources, sources, "{id}: {owners:?}");
            assert_eq!(get_verified(&cl, &chain).await, chain.len(), "{id}");
            // It fetched exactly the runs others own.
            let remote = owners.iter().filter(|o| *o != id).count() * RUN;
            let m = http_get(s.admin, "/metrics").await.1;
            assert_eq!(
                metric(&m, "kvtier_cluster_remote_hits_total") as usize,
                remote,
                "{id}: {owners:?}"
            );
            // What it fetched is a guest here; what it was offered as an owner is not.
            assert_eq!(guest_slots(&m), remote, "{id}: {owners:?}");
            super::common::promtool_check(&m);
            let d = cluster_doc(s, "").await;
            assert_eq!(d["data_path"]["enabled"], true, "{d:#}");
            let way = if one_sided { fetch } else { "protocol" };
            assert_eq!(d["data_path"]["fetch"], way, "{d:#}");
            let fetched: u64 = d["members"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["traffic"]["fetched_blocks"].as_u64())
                .sum();
            assert_eq!(fetched as usize, remote, "{d:#}");
            // How the blocks came: a locate and a one-sided read per owner, or a lookup and
            // a fetch; never both ways.
            let ops = |op: &str| -> f64 {
                ["a", "b", "c"]
                    .iter()
                    .map(|p| {
                        labelled(
                            &m,
                            "kvtier_cluster_peer_requests_total",
                            &format!("op=\"{op}\",peer=\"{p}\""),
                        )
                    })
                    .sum()
            };
            if remote > 0 {
                let (used, unused) = if one_sided {
                    (["locate", "read"], ["lookup", "fetch"])
                } else {
                    (["lookup", "fetch"], ["locate", "read"])
                };
                for op in used {
                    assert!(ops(op) >= 1.0, "{id}: no {op} with fetch={fetch}: {m}");
                }
                for op in unused {
                    assert_eq!(ops(op), 0.0, "{id}: a {op} with fetch={fetch}: {m}");
                }
            }
            // A second lookup is all local.
            let again = cl.lookup(&chain).await;
            assert_eq!(again.tiers, vec![TierCode::Dram; chain.len()]);
            assert_eq!(again.sources, vec![]);
            let m = http_get(s.admin, "/metrics").await.1;
            assert_eq!(
                metric(&m, "kvtier_cluster_remote_hits_total") as usize,
                remote
            );
        }

        // Members advertise their TLS (or QUIC) listener and peers reach each other over it,
        // pinning the certificate in the (authenticated) record; this test's own clients use
        // TCP.
        let d = cluster_doc(a, "").await;
        for m in d["members"].as_array().unwrap() {
            let ep = m["data_endpoint"].as_str().unwrap();
            assert!(ep.starts_with(&format!("{peers}://")), "{d:#}");
        }
        let mut conns = 0.0;
        for (_, s) in &members {
            let m = http_get(s.admin, "/metrics").await.1;
            let label = format!("transport=\"{peers}\"");
            conns += labelled(&m, "kvtier_connections_total", &label);
        }
        assert!(conns >= 1.0, "no peer connected over {peers}");

        // A peer's lookup is local-only: it asks nobody.
        let chain2 = keys(b"local-only", 16, 2);
        put_all(&a.client("tcp").await, &chain2).await;
        let owners2 = run_owners(a, &chain2).await;
        until_offered(&members, "a", &chain2, &owners2).await;
        let (xid, x) = members[1..]
            .iter()
            .find(|(id, _)| owners2[0] != *id)
            .unwrap();
        let asked = |m: &str| -> f64 {
            ["lookup", "locate"]
                .iter()
                .flat_map(|op| ["a", "b", "c"].map(|p| (op, p)))
                .map(|(op, p)| {
                    labelled(
                        m,
                        "kvtier_cluster_peer_requests_total",
                        &format!("op=\"{op}\",peer=\"{p}\""),
                    )
                })
                .sum()
        };
        let before = asked(&http_get(x.admin, "/metrics").await.1);
        let l = peer(x).await.lookup(&chain2).await;
        assert_eq!(l.tiers.len(), 0, "{xid} does not hold run 0: {l:?}");
        assert_eq!(asked(&http_get(x.admin, "/metrics").await.1), before);
        // A client's lookup there asks the owners. This client speaks protocol version 3
        // only: its reply has no sources, and the blocks fetched are DRAM, where they are.
        let mut raw = Raw::new(TcpStream::connect(x.tcp).await.unwrap());
        match raw.hello_versions(TOKEN, 3, 3).await {
            Response::Hello(h) => assert_eq!(h.version, 3),
            r => panic!("{r:?}"),
        }
        raw.send(
            &Request::Lookup(KeyList {
                keys: chain2.clone(),
            }),
            &[],
        )
        .await;
        let (h, r, _) = raw.recv().await.expect("a lookup reply");
        assert_eq!(h.version, 3, "the frame's header");
        let fetched = owners2.iter().filter(|o| *o != xid).count() * RUN;
        assert!(fetched > 0, "{owners2:?}");
        assert_eq!(
            r,
            Response::Lookup {
                tiers: vec![TierCode::Dram as u8; chain2.len()],
                miss: 0,
                sources: None,
            }
        );
        assert!(asked(&http_get(x.admin, "/metrics").await.1) > before);

        // A long chain: each owner's fetch is over 512 KiB, whose sums the owner hashes on
        // its blocking pool (smaller ones, above, on its runtime worker).
        let chain3 = keys(b"long fetch", 600, 3);
        put_all(&a.client("tcp").await, &chain3).await;
        let owners3 = run_owners(a, &chain3).await;
        until_offered(&members, "a", &chain3, &owners3).await;
        let share = |id: &str| owners3.iter().filter(|o| *o == id).count() * RUN * BLOCK;
        let (yid, y) = members[1..]
            .iter()
            .find(|(id, _)| members.iter().any(|(o, _)| o != id && share(o) > 512 << 10))
            .expect("another member owns over 512 KiB of the chain");
        let cl = y.client("tcp").await;
        let l = cl.lookup(&chain3).await;
        assert_eq!(l.tiers.len(), chain3.len(), "{yid}: {l:?}");
        assert_eq!(get_verified(&cl, &chain3).await, chain3.len(), "{yid}");
    })
    .await;
}

/// The tiers and sources a lookup on member `id` reports for a chain of runs of [`RUN`]
/// blocks owned by `owners` (one a run), none of it on `id` but its own runs.
fn expected_sources(owners: &[String], id: &str) -> (Vec<TierCode>, Vec<Source>) {
    let mut tiers = Vec::new();
    let mut sources: Vec<Source> = Vec::new();
    for (r, o) in owners.iter().enumerate() {
        let blocks = r * RUN..(r + 1) * RUN;
        if o == id {
            tiers.extend([TierCode::Dram; RUN]);
            continue;
        }
        tiers.extend([TierCode::Remote; RUN]);
        match sources.last_mut() {
            Some(s) if s.node == *o && s.blocks.end == blocks.start => s.blocks.end = blocks.end,
            _ => sources.push(Source {
                blocks,
                node: o.clone(),
            }),
        }
    }
    (tiers, sources)
}

/// Members a and b (`cluster.fetch` = `fetch`, 16 MiB of DRAM each, runs of 8) and a 4 MiB
/// chain of 4 KiB blocks put on a, about half of it in runs a owns (over 1 MiB), found whole
/// by a lookup on b and read back byte-equal there. Returns the fleet, the bytes b took from
/// a, and b's and a's metrics after it: b's requests to a by op, and a's block sums by source.
async fn large_part_from_a(fetch: &str, salt: &[u8], seed: u32) -> (Fleet, usize, String, String) {
    let fetch_setting = format!("cluster.fetch=\"{fetch}\"");
    let extra = [
        "cluster.run_blocks=8",
        "cluster.head_blocks=0",
        "cluster.peer_timeout_ms=2000",
        "store.dram_bytes=\"16MiB\"",
        fetch_setting.as_str(),
    ];
    let fleet = Fleet::start(&["a", "b"], 5, &extra).await;
    let [a, b] = &fleet.members[..] else {
        unreachable!()
    };
    let members = [("a", a), ("b", b)];
    let chain = keys(salt, 1024, seed);
    put_all(&a.client("tcp").await, &chain).await;
    let owners = run_owners(a, &chain).await;
    until_offered(&members, "a", &chain, &owners).await;
    let on_a = owners.iter().filter(|o| *o == "a").count() * RUN * BLOCK;
    assert!(on_a > 1 << 20, "a owns {on_a} bytes of the chain");
    let cl = b.client("tcp").await;
    let l = cl.lookup(&chain).await;
    assert_eq!(l.tiers.len(), chain.len(), "{l:?}");
    assert_eq!(get_verified(&cl, &chain).await, chain.len());
    let mb = http_get(b.admin, "/metrics").await.1;
    assert_eq!(
        labelled(&mb, "kvtier_cluster_peer_bad_blocks_total", "peer=\"a\""),
        0.0
    );
    assert_eq!(
        metric(&mb, "kvtier_cluster_remote_hits_total") as usize,
        on_a / BLOCK
    );
    let ma = http_get(a.admin, "/metrics").await.1;
    // The owner hashed each block it sent once.
    assert_eq!(
        labelled(&ma, "kvtier_cluster_fetch_sums_total", "source=\"hashed\"") as usize,
        on_a / BLOCK,
        "{ma}"
    );
    (fleet, on_a, mb, ma)
}

/// b's count of requests `op` to peer a in its metrics `m`.
fn to_a(m: &str, op: &str) -> f64 {
    labelled(
        m,
        "kvtier_cluster_peer_requests_total",
        &format!("op=\"{op}\",peer=\"a\""),
    )
}

/// A lookup whose blocks on one owner come to more than 1 MiB fetches them in stripes, each
/// a request on its own connection to that owner, all at once; every stripe is verified and
/// the whole prefix is found and read back byte-equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_fetch_comes_in_verified_stripes() {
    bounded(90, async {
        let (_fleet, _, m, ma) = large_part_from_a("protocol", b"striped", 5).await;
        assert_eq!(to_a(&m, "fetch"), 1.0, "{m}");
        assert!(to_a(&m, "fetch_stripe") >= 2.0, "{m}");
        assert_eq!(
            labelled(&ma, "kvtier_cluster_fetch_sums_total", "source=\"kept\""),
            0.0,
            "{ma}"
        );
    })
    .await;
}

/// The same large part read one-sided (`cluster.fetch = "tcp"`): one locate, then reads
/// of the owner's DRAM in stripes straight into reserved slots, each verified; the owner
/// hashed each block once. A process holding the owner's published blob but not the cluster
/// secret cannot read its DRAM: the blob carries no token and the one it derives is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_part_is_read_one_sided_and_verified() {
    bounded(90, async {
        let (fleet, on_a, m, _) = large_part_from_a("tcp", b"one-sided", 6).await;
        let b = &fleet.members[1];
        assert_eq!(to_a(&m, "read"), 1.0, "{m}");
        assert_eq!(to_a(&m, "locate"), 1.0, "{m}");
        assert_eq!(
            to_a(&m, "fetch") + to_a(&m, "fetch_stripe") + to_a(&m, "lookup"),
            0.0,
            "{m}"
        );
        assert_eq!(
            labelled(&m, "kvtier_cluster_peer_fetched_bytes_total", "peer=\"a\"") as usize,
            on_a
        );

        // a's record publishes its transfer blob without a token.
        let d = cluster_doc(b, "").await;
        let rec = d["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node_id"] == "a")
            .unwrap_or_else(|| panic!("{d:#}"));
        let meta = rec["transfer_meta"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(!meta.is_empty(), "{d:#}");
        let blob = kvtier_server::cluster::record::unhex(&meta).unwrap();
        let outsider = kvtier_transfer::Agent::new("outsider", Default::default())
            .await
            .unwrap();
        for token in [
            [0u8; kvtier_transfer::TOKEN_BYTES],
            kvtier_server::cluster::record::transfer_token(
                b"another secret, 32 bytes long..",
                "test",
            ),
        ] {
            let Err(e) = outsider
                .connect_with_token(&blob, kvtier_transfer::BackendKind::Tcp, token)
                .await
            else {
                panic!("a wrong token is accepted");
            };
            assert_eq!(e.kind(), kvtier_transfer::ErrorKind::Auth, "{e}");
        }
    })
    .await;
}

/// A block of a remote run that is here already, after one that is not: the lookup fetches
/// the missing ones around it and finds the whole chain. (It used to end the remote prefix
/// there: the lookup came back short, seen as "short lookups" in `scripts/bench-mooncake.py`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_here_already_inside_a_remote_run_does_not_end_the_prefix() {
    for fetch in ["tcp", "protocol"] {
        block_here_already_inside_a_remote_run(fetch).await;
    }
}

async fn block_here_already_inside_a_remote_run(fetch: &str) {
    let fetch_setting = format!("cluster.fetch=\"{fetch}\"");
    bounded(90, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=2000",
            fetch_setting.as_str(),
        ];
        let fleet = Fleet::start(&["a", "b"], 5, &extra).await;
        let [a, b] = &fleet.members[..] else {
            unreachable!()
        };
        let members = [("a", a), ("b", b)];
        // A chain whose first run a owns.
        let mut seed = 40;
        let chain = loop {
            let c = keys(b"here inside a run", 16, seed);
            if run_owners(a, &c).await[0] == "a" {
                break c;
            }
            seed += 1;
        };
        put_all(&a.client("tcp").await, &chain).await;
        let owners = run_owners(a, &chain).await;
        until_offered(&members, "a", &chain, &owners).await;
        // b holds blocks 0, 1 and 3 of a's run, not 2.
        let cb = b.client("tcp").await;
        put_all(&cb, &chain[..4]).await;
        assert_eq!(cb.remove(&chain[2..3]).await.unwrap(), 1);
        let l = cb.lookup(&chain).await;
        assert_eq!(l.tiers.len(), chain.len(), "fetch={fetch}: {l:?}");
        assert_eq!(
            get_verified(&cb, &chain).await,
            chain.len(),
            "fetch={fetch}"
        );
    })
    .await;
}

/// Chains that share their first block (a system prompt) and diverge after it. With the
/// head of a chain placed per block (`cluster.head_blocks`), each head block goes to its own
/// key's owner, so the chains spread over the members instead of all following the shared
/// block's owner; blocks past the head go in runs again. Each owner holds what it owns, and a
/// lookup on another member finds and reads every whole chain, fetching exactly what others
/// own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_sharing_a_first_block_spread_over_the_members() {
    const HEAD: usize = 8;
    const LEN: usize = HEAD + RUN / 2;
    bounded(120, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let head = format!("cluster.head_blocks={HEAD}");
        let extra = [
            "cluster.run_blocks=8",
            head.as_str(),
            "cluster.peer_timeout_ms=1000",
        ];
        let a = member_with(&etcd, "a", 5, &secret, &extra);
        let b = member_with(&etcd, "b", 5, &secret, &extra);
        let c = member_with(&etcd, "c", 5, &secret, &extra);
        for s in [&a, &b, &c] {
            until_view(s, &["a", "b", "c"], Duration::from_secs(15)).await;
        }
        let members = [("a", &a), ("b", &b), ("c", &c)];
        let shared = keys(b"system prompt", 1, 1)[0];
        let chains: Vec<Vec<BlockKey>> = (1..=6)
            .map(|j| {
                let mut ch = keys(b"spread", LEN, j);
                ch[0] = shared;
                ch
            })
            .collect();
        let put = a.client("tcp").await;
        let mut owner_of = Vec::new(); // per chain, per position
        for ch in &chains {
            put_all(&put, ch).await;
            let mut owners = Vec::new();
            for i in 0..LEN {
                // Head blocks place themselves; the rest by the run's first key.
                let anchor = if i < HEAD { ch[i] } else { ch[HEAD] };
                let d = cluster_doc(&a, &format!("?key={anchor}")).await;
                owners.push(d["key"]["owners"][0].as_str().unwrap().to_string());
            }
            owner_of.push(owners);
        }
        // The blocks after the shared one are spread: every member owns some.
        for (id, _) in &members {
            let owned = owner_of
                .iter()
                .flat_map(|o| &o[1..HEAD])
                .filter(|o| o == id);
            assert!(owned.count() > 0, "{id} owns no head block: {owner_of:?}");
        }
        // Each owner holds its blocks (offered by a).
        let t0 = Instant::now();
        for (ch, owners) in chains.iter().zip(&owner_of) {
            for (k, o) in ch.iter().zip(owners) {
                let (_, s) = members.iter().find(|(id, _)| id == o).unwrap();
                let p = peer(s).await;
                while p.lookup(&[*k]).await.tiers.len() != 1 {
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "{k} never reached its owner {o}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        let cl = b.client("tcp").await;
        let mut fetched = std::collections::HashSet::new();
        for (ch, owners) in chains.iter().zip(&owner_of) {
            let l = cl.lookup(ch).await;
            assert_eq!(l.tiers.len(), LEN, "{owners:?} {l:?}");
            assert_eq!(get_verified(&cl, ch).await, LEN);
            fetched.extend(
                ch.iter()
                    .zip(owners)
                    .filter(|(_, o)| *o != "b")
                    .map(|(k, _)| *k),
            );
        }
        let m = http_get(b.admin, "/metrics").await.1;
        assert_eq!(
            metric(&m, "kvtier_cluster_remote_hits_total") as usize,
            fetched.len(),
            "{owner_of:?}"
        );

        // Every member states its placement rule, and they agree ...
        let d = cluster_doc(&a, "").await;
        assert_eq!(d["placement_mismatch"], serde_json::json!([]), "{d:#}");
        for m in d["members"].as_array().unwrap() {
            let rule = serde_json::json!({"replicas": 1, "run_blocks": 8, "head_blocks": HEAD});
            assert_eq!(m["placement"], rule, "{d:#}");
        }
        // ... until a member with another rule joins: each side names the other.
        let odd = ["cluster.run_blocks=8", "cluster.peer_timeout_ms=1000"];
        let x = member_with(&etcd, "x", 5, &secret, &odd);
        until_view(&a, &["a", "b", "c", "x"], Duration::from_secs(15)).await;
        until_view(&x, &["a", "b", "c", "x"], Duration::from_secs(15)).await;
        let d = cluster_doc(&a, "").await;
        assert_eq!(d["placement_mismatch"], serde_json::json!(["x"]), "{d:#}");
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_placement_mismatch_members"), 1.0);
        let d = cluster_doc(&x, "").await;
        assert_eq!(
            d["placement_mismatch"],
            serde_json::json!(["a", "b", "c"]),
            "{d:#}"
        );
    })
    .await;
}

/// The same chains with no `head_blocks`: the members find the shared block themselves.
/// After lookups of chains that diverge after one block, a member publishes it as a split
/// (`cluster.split_check_s`), every member's view has it, and chains put from then on start
/// a run after it: their blocks go to the owners of their second block, not all to the
/// shared block's owner; a lookup on another member finds each whole chain. A member with
/// `split_check_s = 0` publishes none, and follows the others'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_find_a_shared_first_block_and_split_chains_after_it() {
    const LEN: usize = RUN / 2;
    bounded(120, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let extra = [
            "cluster.run_blocks=8",
            "cluster.split_check_s=1",
            "cluster.peer_timeout_ms=1000",
        ];
        let a = member_with(&etcd, "a", 5, &secret, &extra);
        let b = member_with(&etcd, "b", 5, &secret, &extra);
        let quiet = [
            "cluster.run_blocks=8",
            "cluster.split_check_s=0",
            "cluster.peer_timeout_ms=1000",
        ];
        let c = member_with(&etcd, "c", 5, &secret, &quiet);
        for s in [&a, &b, &c] {
            until_view(s, &["a", "b", "c"], Duration::from_secs(15)).await;
        }
        let members = [("a", &a), ("b", &b), ("c", &c)];
        let shared = keys(b"system prompt", 1, 1)[0];
        let chain = |salt: &[u8], j: u32| {
            let mut ch = keys(salt, LEN, j);
            ch[0] = shared;
            ch
        };
        // Lookups (nothing stored yet) of 24 chains that diverge after the shared block,
        // on a and on c; sampled at most one per 5 ms.
        for s in [&a, &c] {
            let cl = s.client("tcp").await;
            for j in 1..=24 {
                assert_eq!(cl.lookup(&chain(b"asked", j)).await.tiers.len(), 0);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let want = serde_json::json!([{"position": 0, "key": shared.to_string()}]);
        let t0 = Instant::now();
        for (id, s) in &members {
            loop {
                let d = cluster_doc(s, "").await;
                if d["splits"] == want {
                    let by: Vec<&str> = d["members"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|m| m["splits"].as_array().is_some_and(|v| !v.is_empty()))
                        .map(|m| m["node_id"].as_str().unwrap())
                        .collect();
                    assert!(
                        !by.contains(&"c"),
                        "c publishes with split_check_s=0: {d:#}"
                    );
                    assert!(by.contains(&"a"), "{d:#}");
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "{id} has no split after {:?}: {d:#}",
                    t0.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let m = http_get(s.admin, "/metrics").await.1;
            assert_eq!(metric(&m, "kvtier_cluster_splits"), 1.0, "{id}");
        }
        // Chains put on a from now on: position 0 is the shared block's own run, the rest
        // a run anchored at the second block.
        let chains: Vec<Vec<BlockKey>> = (1..=12).map(|j| chain(b"put", j)).collect();
        let put = a.client("tcp").await;
        let owner = |d: serde_json::Value| d["key"]["owners"][0].as_str().unwrap().to_string();
        let first = owner(cluster_doc(&a, &format!("?key={shared}")).await);
        let mut seconds = Vec::new();
        for ch in &chains {
            put_all(&put, ch).await;
            seconds.push(owner(cluster_doc(&a, &format!("?key={}", ch[1])).await));
        }
        assert!(
            seconds.iter().any(|o| *o != first),
            "every chain's run follows the shared block's owner {first}: {seconds:?}"
        );
        // Each run reaches the owner of its second block (offered by a when not a itself).
        let t0 = Instant::now();
        for (ch, o) in chains.iter().zip(&seconds) {
            let (_, s) = members.iter().find(|(id, _)| id == o).unwrap();
            let p = peer(s).await;
            while p.lookup(&ch[1..]).await.tiers.len() != LEN - 1 {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "the run after the split never reached its owner {o}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // A lookup on b finds each whole chain, the run after the split from its owner.
        let cl = b.client("tcp").await;
        for (ch, o) in chains.iter().zip(&seconds) {
            let l = cl.lookup(ch).await;
            assert_eq!(l.tiers.len(), LEN, "{l:?}");
            if o != "b" {
                assert!(
                    l.sources
                        .iter()
                        .any(|s| s.blocks.contains(&1) && s.node == *o),
                    "run after the split not from {o}: {:?}",
                    l.sources
                );
            }
            assert_eq!(get_verified(&cl, ch).await, LEN);
        }
        // b's copies of the runs others own are guests; its copy of the shared block is
        // its own, even when another member owns it.
        let guests: usize = seconds.iter().filter(|o| *o != "b").count() * (LEN - 1);
        let m = http_get(b.admin, "/metrics").await.1;
        assert_eq!(
            guest_slots(&m),
            guests,
            "shared block owned by {first}; runs by {seconds:?}"
        );
    })
    .await;
}

/// With `cluster.routing = "sticky"` the guests are the other way round: the putter's
/// copies of runs others own stay its own (its sessions come back to it), and what the
/// owners were offered is their guests; a member's copies of what its lookup fetched are
/// its own too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sticky_routing_the_offered_copies_are_the_guests() {
    bounded(120, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=1000",
            "cluster.routing=\"sticky\"",
        ];
        let fleet = Fleet::start(&["a", "b", "c"], 5, &extra).await;
        let [a, b, c] = &fleet.members[..] else {
            unreachable!()
        };
        let members = [("a", a), ("b", b), ("c", c)];
        // A chain with runs owned by each member.
        let mut chain = Vec::new();
        let mut owners = Vec::new();
        for seed in 1..100 {
            chain = keys(b"sticky", 96, seed);
            owners = run_owners(a, &chain).await;
            if ["a", "b", "c"]
                .iter()
                .all(|m| owners.iter().any(|o| o == m))
            {
                break;
            }
        }
        let runs_of = |m: &str| owners.iter().filter(|o| *o == m).count() * RUN;
        assert!(runs_of("a") * runs_of("b") * runs_of("c") > 0, "{owners:?}");
        put_all(&a.client("tcp").await, &chain).await;
        until_offered(&members, "a", &chain, &owners).await;
        // Each owner's offered copies become its guests.
        for (id, s) in [("b", b), ("c", c)] {
            until_guests(s, runs_of(id), id).await;
        }
        // The putter has handed them over (its offers are counted once answered) and keeps
        // its copies as its own.
        let offered = runs_of("b") + runs_of("c");
        let t0 = Instant::now();
        loop {
            let m = http_get(a.admin, "/metrics").await.1;
            let sent = labelled(&m, "kvtier_cluster_peer_offered_blocks_total", "peer=\"b\"")
                + labelled(&m, "kvtier_cluster_peer_offered_blocks_total", "peer=\"c\"");
            if sent as usize == offered {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "{m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(guest_slots(&m), 0, "a: {owners:?}");
        // b's lookup fetches the runs a and c own; its copies of them are not guests.
        let cl = b.client("tcp").await;
        let l = cl.lookup(&chain).await;
        assert_eq!(l.tiers.len(), chain.len(), "{l:?}");
        assert_eq!(get_verified(&cl, &chain).await, chain.len());
        let m = http_get(b.admin, "/metrics").await.1;
        assert_eq!(
            metric(&m, "kvtier_cluster_remote_hits_total") as usize,
            runs_of("a") + runs_of("c")
        );
        assert_eq!(guest_slots(&m), runs_of("b"), "b: {owners:?}");
        let d = cluster_doc(b, "").await;
        assert_eq!(d["data_path"]["routing"], "sticky", "{d:#}");
    })
    .await;
}

/// With `cluster.routing = "auto"` (the default) each member chooses from where its own
/// clients' lookups end: a member whose clients find the chains they put there turns
/// sticky; one whose clients find chains put elsewhere stays spread; neither chooses before
/// it has seen 32 such lookups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auto_routing_a_member_whose_chains_come_back_turns_sticky() {
    bounded(120, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=1000",
        ];
        let fleet = Fleet::start(&["a", "b"], 5, &extra).await;
        let [a, b] = &fleet.members[..] else {
            unreachable!()
        };
        let (ca, cb) = (a.client("tcp").await, b.client("tcp").await);
        let state = |d: &serde_json::Value| {
            let p = &d["data_path"];
            (
                p["routing"].as_str().unwrap().to_string(),
                p["sticky"].as_bool().unwrap(),
                p["returns"]["samples"].as_u64().unwrap(),
            )
        };
        let mut a_guests = 0;
        for i in 0..40u32 {
            if i == 31 {
                // Before the choice: a's copies of runs b owns are guests.
                let m = http_get(a.admin, "/metrics").await.1;
                a_guests = guest_slots(&m);
            }
            let chain = keys(b"auto-routing", 16, i + 1);
            put_all(&ca, &chain).await;
            let owners = run_owners(a, &chain).await;
            until_offered(&[("a", a), ("b", b)], "a", &chain, &owners).await;
            // a's client comes back to a; b's finds the chain put on a.
            assert_eq!(ca.lookup(&chain).await.tiers.len(), 16);
            assert_eq!(cb.lookup(&chain).await.tiers.len(), 16);
            let (ra, rb) = (cluster_doc(a, "").await, cluster_doc(b, "").await);
            let n = u64::from(i) + 1;
            assert_eq!(state(&ra), ("auto".into(), n >= 32, n), "{ra:#}");
            assert_eq!(state(&rb), ("auto".into(), false, n), "{rb:#}");
        }
        // a's copies of the runs b owns were guests while it was spread; when it turned
        // sticky it cleared them, and marks none since. b, spread, keeps what it fetched
        // from a as guests.
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_sticky"), 1.0);
        assert_eq!(metric(&m, "kvtier_cluster_returns_per_mille"), 1000.0);
        assert!(a_guests > 0);
        assert_eq!(guest_slots(&m), 0, "a");
        let m = http_get(b.admin, "/metrics").await.1;
        assert_eq!(metric(&m, "kvtier_cluster_sticky"), 0.0);
        assert_eq!(metric(&m, "kvtier_cluster_returns_per_mille"), 0.0);
        assert!(guest_slots(&m) > 0, "b");
    })
    .await;
}

/// Blocks owned by a member that is then killed are misses, answered within the deadline;
/// the prefix before them is served, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owners_blocks_are_misses_within_the_deadline() {
    bounded(120, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=500",
        ];
        // A long lease: the dead member stays in the view while we look.
        let a = member_with(&etcd, "a", 30, &secret, &extra);
        let b = member_with(&etcd, "b", 30, &secret, &extra);
        let c = member_with(&etcd, "c", 30, &secret, &extra);
        for s in [&a, &b, &c] {
            until_view(s, &["a", "b", "c"], Duration::from_secs(15)).await;
        }
        // A chain whose first run c owns is not run 0.
        let (chain, owners, expect) = chain_with_a_later_run_of(&a, "c", b"killed", 48).await;
        put_all(&a.client("tcp").await, &chain).await;
        until_offered(&[("a", &a), ("b", &b), ("c", &c)], "a", &chain, &owners).await;
        drop(c); // SIGKILL
        lookup_stops_in_time(&b, &chain, &owners, expect, "dead").await;
        let m = http_get(b.admin, "/metrics").await.1;
        let failed = labelled(&m, "kvtier_cluster_peer_errors_total", "peer=\"c\"")
            + labelled(&m, "kvtier_cluster_peer_timeouts_total", "peer=\"c\"");
        assert!(failed >= 1.0, "{m}");
    })
    .await;
}

/// Only a holder of the secret is a peer: a token derived from another secret (or for
/// another cluster) is refused at hello; a client's token cannot fetch; a peer can do
/// nothing but the data path's operations, and the sums it gets verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_holders_of_the_secret_fetch() {
    bounded(60, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let a = member_with(&etcd, "a", 5, &secret, &[]);
        until_view(&a, &["a"], Duration::from_secs(15)).await;
        let chain = keys(b"secret", 4, 3);
        let client = a.client("tcp").await;
        put_all(&client, &chain).await;
        for wrong in [
            peer_token(b"a guessed secret................", "test"),
            peer_token(SECRET.as_bytes(), "another-cluster"),
        ] {
            let e = Client::connect(&a.tcp_url(), ClientConfig::default().token(wrong))
                .await
                .err()
                .expect("a wrong peer token is refused");
            assert!(e.to_string().contains("token"), "{e}");
        }
        let p = peer(&a).await;
        let f = p.fetch(&chain).await.unwrap();
        assert_eq!(f.blocks.len(), chain.len());
        for ((k, b), s) in chain.iter().zip(&f.blocks).zip(&f.sums) {
            assert_eq!(*s, block_sum(k, b));
            assert_eq!(*b, super::common::block_data(*k));
        }
        let forbidden = |e: ClientError| match e {
            ClientError::Server { code, .. } => assert_eq!(code, Some(ErrorCode::Forbidden)),
            e => panic!("{e}"),
        };
        // A peer's locate pins the blocks and states the same sums; release lets them go.
        let l = p.locate(&chain, Duration::from_secs(5)).await.unwrap();
        assert_eq!(l.offsets.len(), chain.len());
        assert_ne!(l.lease_id, 0);
        assert_eq!(l.sums, f.sums);
        p.release(l.lease_id).await.unwrap();
        forbidden(client.fetch(&chain).await.unwrap_err());
        forbidden(
            client
                .locate(&chain, Duration::from_secs(1))
                .await
                .unwrap_err(),
        );
        forbidden(p.clear().await.unwrap_err());
        forbidden(p.remove(&chain).await.unwrap_err());
        assert_eq!(get_verified(&client, &chain).await, chain.len());
    })
    .await;
}

/// A "member" that answers every lookup with "all present" and every fetch with wrong
/// bytes: its blocks are misses, counted, and never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_sending_wrong_bytes_is_a_miss() {
    bounded(90, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=1000",
        ];
        let a = member_with(&etcd, "a", 5, &secret, &extra);
        let b = member_with(&etcd, "b", 5, &secret, &extra);
        let liar = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Its record, signed with the secret (a holder of the secret gone wrong, or a
        // corrupting path: either way the bytes do not match their sums).
        fake_member(&etcd, &liar).await;
        tokio::spawn(lying_peer(liar));
        for s in [&a, &b] {
            until_view(s, &["a", "b", "zz"], Duration::from_secs(15)).await;
        }
        let (chain, owners, expect) = chain_with_a_later_run_of(&a, "zz", b"liar", 32).await;
        put_all(&a.client("tcp").await, &chain).await;
        until_offered(&[("a", &a), ("b", &b)], "a", &chain, &owners).await;
        let cl = b.client("tcp").await;
        let l = cl.lookup(&chain).await;
        assert_eq!(l.tiers.len(), expect, "{owners:?} {l:?}");
        assert_eq!(get_verified(&cl, &chain).await, expect);
        let m = http_get(b.admin, "/metrics").await.1;
        assert!(
            labelled(&m, "kvtier_cluster_peer_bad_blocks_total", "peer=\"zz\"") >= 1.0,
            "{m}"
        );
    })
    .await;
}

/// Registers member `zz` (signed with the secret, as much capacity as a test server)
/// whose data endpoint is `l`.
async fn fake_member(etcd: &Etcd, l: &tokio::net::TcpListener) {
    let record = MemberRecord {
        data_endpoint: format!("tcp://{}", l.local_addr().unwrap()),
        ..fake_record()
    };
    register_member(etcd, record).await;
}

/// The record of member `zz`: as much capacity as a test server, no endpoints.
fn fake_record() -> MemberRecord {
    MemberRecord {
        v: RECORD_VERSION,
        node_id: "zz".into(),
        version: "0".into(),
        data_endpoint: String::new(),
        data_cert_der: String::new(),
        data_cert_name: String::new(),
        transfer_endpoint: String::new(),
        transfer_meta: String::new(),
        admin_endpoint: String::new(),
        worker_endpoint: String::new(),
        tiers: vec![TierCapacity {
            kind: "dram".into(),
            capacity_bytes: 12 << 20,
        }],
        registered_unix_ms: 0,
        placement: None,
        splits: Vec::new(),
    }
}

/// Writes `record` under its member key, signed with the secret (no lease: it stays).
async fn register_member(etcd: &Etcd, record: MemberRecord) {
    let key = format!("/kvtier/test/members/{}", record.node_id);
    let value = RecordSealer::new(Some(SECRET.as_bytes()), "test").seal(key.as_bytes(), &record);
    let mut e = etcd_client::Client::connect([etcd.url()], None)
        .await
        .unwrap();
    e.put(key, value, None).await.unwrap();
}

/// A member that accepts connections and never answers: a lookup on a real member is not
/// held past the peer timeout; the silent member's runs are misses, counted as timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_owner_is_a_miss_within_the_deadline() {
    bounded(90, async {
        let etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=500",
        ];
        let a = member_with(&etcd, "a", 5, &secret, &extra);
        let b = member_with(&etcd, "b", 5, &secret, &extra);
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        fake_member(&etcd, &silent).await;
        // Accepts, holds the connections, never reads or writes.
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        for s in [&a, &b] {
            until_view(s, &["a", "b", "zz"], Duration::from_secs(15)).await;
        }
        let (chain, owners, expect) = chain_with_a_later_run_of(&a, "zz", b"silent", 32).await;
        put_all(&a.client("tcp").await, &chain).await;
        until_offered(&[("a", &a), ("b", &b)], "a", &chain, &owners).await;
        lookup_stops_in_time(&b, &chain, &owners, expect, "silent").await;
        let m = http_get(b.admin, "/metrics").await.1;
        assert!(
            labelled(&m, "kvtier_cluster_peer_timeouts_total", "peer=\"zz\"") >= 1.0,
            "{m}"
        );
    })
    .await;
}

/// Offers under back-pressure: with a queue of one block, a long put still stores every
/// block here at once, and the offers that did not fit are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offers_beyond_the_queue_are_dropped_and_counted() {
    bounded(60, async {
        let extra = ["cluster.run_blocks=1", "cluster.offer_queue_blocks=1"];
        let fleet = Fleet::start(&["a", "b"], 5, &extra).await;
        let [a, _b] = &fleet.members[..] else {
            unreachable!()
        };
        let chain = keys(b"back-pressure", 512, 4);
        put_all(&a.client("tcp").await, &chain).await;
        let d = cluster_doc(a, "").await;
        let dropped = d["data_path"]["offers_dropped"]["queue_full"]
            .as_u64()
            .unwrap();
        assert!(dropped > 0, "{d:#}");
        let m = http_get(a.admin, "/metrics").await.1;
        assert_eq!(
            labelled(
                &m,
                "kvtier_cluster_offers_dropped_total",
                "reason=\"queue_full\""
            ) as u64,
            dropped
        );
    })
    .await;
}

/// Speaks just enough of the protocol: hello, "every key present", fetches of wrong bytes
/// (sums of zero), puts "stored".
async fn lying_peer(l: tokio::net::TcpListener) {
    loop {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let limits = Limits::default();
            loop {
                let mut head = [0u8; HEADER_BYTES];
                if s.read_exact(&mut head).await.is_err() {
                    return;
                }
                let Ok(h) = Header::decode(&head, &limits) else {
                    return;
                };
                let mut meta = vec![0u8; h.meta_len as usize];
                let mut payload = vec![0u8; h.payload_len as usize];
                if s.read_exact(&mut meta).await.is_err()
                    || s.read_exact(&mut payload).await.is_err()
                {
                    return;
                }
                let Some(op) = h.opcode() else { return };
                let Ok(req) = Request::decode(op, &meta, h.payload_len, &limits) else {
                    return;
                };
                let (resp, body) = match req {
                    Request::Hello(_) => (
                        Response::Hello(HelloReply {
                            version: kvtier_core::protocol::VERSION,
                            server: "liar".into(),
                            block_bytes: BLOCK as u64,
                            layout_fingerprint: 0,
                            arena_bytes: 0,
                            staging_bytes: 0,
                            slot_table_bytes: 0,
                            max_keys: limits.max_keys,
                            max_meta_bytes: limits.max_meta_bytes,
                            max_payload_bytes: limits.max_payload_bytes,
                            max_lease_ms: 1000,
                            event_seq: 0,
                            namespace_key: None,
                        }),
                        vec![],
                    ),
                    Request::Lookup(k) => (
                        Response::Lookup {
                            tiers: vec![1; k.keys.len()],
                            miss: 0,
                            sources: None,
                        },
                        vec![],
                    ),
                    Request::Fetch(k) => (
                        Response::Fetch(FetchReply {
                            tiers: vec![1; k.keys.len()],
                            miss: 0,
                            sums: vec![0; k.keys.len()],
                        }),
                        vec![0xab; k.keys.len() * BLOCK],
                    ),
                    Request::Put(e) => (
                        Response::Put(kvtier_core::protocol::PutReply {
                            statuses: vec![0; e.len()],
                        }),
                        vec![],
                    ),
                    _ => (Response::Pong, vec![]),
                };
                let (fl, meta) = resp.encode_meta();
                let out = Header {
                    version: kvtier_core::protocol::VERSION,
                    opcode: h.opcode,
                    flags: fl,
                    request_id: h.request_id,
                    meta_len: meta.len() as u32,
                    payload_len: body.len() as u64,
                };
                let mut frame = out.encode().to_vec();
                frame.extend_from_slice(&meta);
                frame.extend_from_slice(&body);
                if s.write_all(&frame).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Every owner of each run of `chain` (runs of [`RUN`]), as `s` names them.
async fn all_owners(s: &ServerProc, chain: &[BlockKey]) -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for r in chain.chunks(RUN) {
        let d = cluster_doc(s, &format!("?key={}", r[0])).await;
        let o: Vec<String> = d["key"]["owners"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(o.len(), 2, "{d:#}");
        all.push(o);
    }
    all
}

/// On `fleet` (members a, b, c; two replicas; runs of [`RUN`]): a 48-block chain (of
/// `salt`) with a run b does not own, put on a and held by every owner of every run (a put
/// them; offers reached the others). Returns the chain, each run's owners (best first) and
/// the first run b does not own (read on b, it comes from the others).
async fn chain_b_reads_from_others(
    fleet: &Fleet,
    salt: &[u8],
) -> (Vec<BlockKey>, Vec<Vec<String>>, usize) {
    let ids = ["a", "b", "c"];
    let a = &fleet.members[0];
    let mut found = None;
    for seed in 1..50 {
        let chain = keys(salt, 48, seed);
        let owners = all_owners(a, &chain).await;
        if let Some(r) = owners.iter().position(|o| !o.contains(&"b".to_string())) {
            found = Some((chain, owners, r));
            break;
        }
    }
    let (chain, owners, r) = found.expect("a chain with a run b does not own");
    put_all(&a.client("tcp").await, &chain).await;
    let t0 = Instant::now();
    for (i, run) in chain.chunks(RUN).enumerate() {
        for o in owners[i].iter().filter(|o| *o != "a") {
            let p = peer(&fleet.members[ids.iter().position(|id| id == o).unwrap()]).await;
            while p.lookup(run).await.tiers.len() < run.len() {
                assert!(t0.elapsed() < Duration::from_secs(10), "run {i} not at {o}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    (chain, owners, r)
}

/// With two owners a block, a hung owner (SIGSTOP: registered, silent) costs one lookup a
/// timed-out run; the lookups after it ask the other owner and find the whole chain,
/// byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_a_hung_owners_runs_come_from_the_other() {
    bounded(120, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=300",
            "cluster.replicas=2",
        ];
        // A long lease: the hung member stays in the view.
        let fleet = Fleet::start(&["a", "b", "c"], 30, &extra).await;
        let [a, b, c] = &fleet.members[..] else {
            unreachable!()
        };
        let members = [("a", &a), ("b", &b), ("c", &c)];
        let (chain, owners, r) = chain_b_reads_from_others(&fleet, b"replicas").await;
        // Hang the first owner of the first run b does not own.
        let hung = owners[r][0].clone();
        let (_, x) = members.iter().find(|(id, _)| *id == hung).unwrap();
        x.signal(libc::SIGSTOP);
        let cl = b.client("tcp").await;
        let mut lookups = Vec::new();
        for _ in 0..5 {
            let l = cl.lookup(&chain).await;
            lookups.push(l.tiers.len());
            if l.tiers.len() == chain.len() {
                break;
            }
        }
        x.signal(libc::SIGCONT);
        println!("hung {hung}, owners {owners:?}: lookups found {lookups:?}");
        assert_eq!(*lookups.last().unwrap(), chain.len(), "{lookups:?}");
        assert!(
            lookups.len() <= 2,
            "the second lookup asks the other owner: {lookups:?}"
        );
        assert_eq!(get_verified(&cl, &chain).await, chain.len());
    })
    .await;
}

/// With two owners a block, a member restarted empty (no NVMe) is passed over for its runs
/// while it warms up (`cluster.warmup_s`): the first lookup on another member, and one on
/// the restarted member itself, find the whole chain at the co-owner that was there before
/// it, byte-exact. The control, `cluster.warmup_s=0` (owners by placement rank alone), is
/// the same steps: both lookups stop short at the restarted owner's runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_a_restarted_owner_is_passed_over_while_it_warms_up() {
    bounded(180, async {
        let with = restarted_owner_lookups(WARMUP_S).await;
        let without = restarted_owner_lookups(0).await;
        println!("lookups found (on another member, on the restarted one): warm-up {with:?}, none {without:?}");
        let (len, on_other, on_restarted) = with;
        assert_eq!((on_other, on_restarted), (len, len), "with the warm-up");
        let (len, on_other, on_restarted) = without;
        assert!(
            on_other < len && on_restarted < len,
            "by rank alone the restarted owner is asked (or looks in its own store) and \
             has nothing: {without:?}"
        );
    })
    .await;
}

/// `cluster.warmup_s` of [`restarted_owner_lookups`]: the members are past it before one
/// restarts, and the lookups after the restart come well within it.
const WARMUP_S: u64 = 6;

/// Members a, b, c (two replicas, no NVMe, `cluster.warmup_s=warmup_s`) past [`WARMUP_S`];
/// a chain put on a and held by all its owners; the first owner `x` of a run b does not own
/// restarted (SIGTERM, then started again empty). Returns the chain's length and what a
/// lookup on b, then one on `x`, found (each verified byte for byte where whole).
async fn restarted_owner_lookups(warmup_s: u64) -> (usize, usize, usize) {
    let warmup = format!("cluster.warmup_s={warmup_s}");
    let extra = [
        "cluster.run_blocks=8",
        "cluster.head_blocks=0",
        "cluster.peer_timeout_ms=300",
        "cluster.replicas=2",
        "store.nvme_dir=\"\"",
        warmup.as_str(),
    ];
    let mut fleet = Fleet::start(&["a", "b", "c"], 5, &extra).await;
    // Every member has registered (its record's start time is behind this).
    let registered_by = Instant::now();
    let (chain, owners, r) = chain_b_reads_from_others(&fleet, b"warm-up").await;
    let x = ["a", "b", "c"]
        .iter()
        .position(|id| *id == owners[r][0])
        .unwrap();
    // Every member past the warm-up before x restarts.
    let settled = Duration::from_secs(WARMUP_S) + Duration::from_millis(300);
    tokio::time::sleep(settled.saturating_sub(registered_by.elapsed())).await;
    let old = fleet.members.remove(x);
    let restarted_at = Instant::now();
    fleet.members.insert(x, old.restart());
    // Every view holds x's new record (not the one its stopped process left).
    let registered = |d: &serde_json::Value, id: &str| {
        let ms = d["members"].as_array().unwrap().iter();
        ms.filter(|m| m["node_id"] == id)
            .map(|m| m["registered_unix_ms"].as_u64().unwrap())
            .next()
    };
    let id = ["a", "b", "c"][x];
    until_view(&fleet.members[x], &["a", "b", "c"], Duration::from_secs(15)).await;
    let new = registered(&cluster_doc(&fleet.members[x], "").await, id);
    for s in &fleet.members {
        until_view(s, &["a", "b", "c"], Duration::from_secs(15)).await;
        while registered(&cluster_doc(s, "").await, id) != new {
            assert!(restarted_at.elapsed() < Duration::from_secs(WARMUP_S));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let b = &fleet.members[1];
    let on_b = b.client("tcp").await;
    let found_on_b = on_b.lookup(&chain).await.tiers.len();
    let on_x = fleet.members[x].client("tcp").await;
    let found_on_x = on_x.lookup(&chain).await.tiers.len();
    assert!(
        restarted_at.elapsed() < Duration::from_secs(WARMUP_S),
        "the lookups came {:?} after the restart, past the warm-up: slow machine?",
        restarted_at.elapsed()
    );
    for (c, n) in [(&on_b, found_on_b), (&on_x, found_on_x)] {
        if n == chain.len() {
            assert_eq!(get_verified(c, &chain).await, chain.len());
        }
    }
    (chain.len(), found_on_b, found_on_x)
}

/// An owner that answers over the protocol but whose transfer agent cannot be reached
/// (member `zz`: c's data endpoint, and the published agent of a member d that has since
/// stopped): a lookup on b locates zz's blocks, cannot read them one-sided, and fetches
/// them over the protocol instead, so the whole chain is found, byte-exact, and the
/// fallback is counted. (Before, such runs were misses until the connect's back-off ended,
/// up to 5 s after a network fault had healed: the lossy netns test saw it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_whose_agent_cannot_be_reached_is_read_over_the_protocol() {
    bounded(120, async {
        let extra = [
            "cluster.run_blocks=8",
            "cluster.head_blocks=0",
            "cluster.peer_timeout_ms=1000",
            "cluster.fetch=\"tcp\"",
            // TLS on no one address: the members advertise their plain TCP endpoints, so
            // zz's record can name c's without its certificate.
            "server.tls=\"0.0.0.0:0\"",
        ];
        let mut fleet = Fleet::start(&["a", "b", "c", "d"], 5, &extra).await;
        let doc = cluster_doc(&fleet.members[0], "").await;
        let record = |id: &str| {
            let mut ms = doc["members"].as_array().unwrap().iter();
            ms.find(|m| m["node_id"] == id).unwrap().clone()
        };
        let (of_c, of_d) = (record("c"), record("d"));
        assert!(
            !of_d["transfer_meta"].as_str().unwrap().is_empty(),
            "{of_d:#}"
        );
        assert_eq!(fleet.members[3].stop().code(), Some(0));
        register_member(
            &fleet.etcd,
            MemberRecord {
                data_endpoint: of_c["data_endpoint"].as_str().unwrap().into(),
                transfer_endpoint: of_d["transfer_endpoint"].as_str().unwrap().into(),
                transfer_meta: of_d["transfer_meta"].as_str().unwrap().into(),
                ..fake_record()
            },
        )
        .await;
        let [a, b, c, _] = &fleet.members[..] else {
            unreachable!()
        };
        for s in [a, b, c] {
            until_view(s, &["a", "b", "c", "zz"], Duration::from_secs(15)).await;
        }
        let (chain, owners, _) = chain_with_a_later_run_of(b, "zz", b"no agent", 32).await;
        put_all(&a.client("tcp").await, &chain).await;
        // zz's runs were offered to its data endpoint: c holds them.
        until_offered(&[("b", b), ("c", c), ("zz", c)], "a", &chain, &owners).await;
        let cl = b.client("tcp").await;
        let l = cl.lookup(&chain).await;
        assert_eq!(l.tiers.len(), chain.len(), "{owners:?} {l:?}");
        assert_eq!(get_verified(&cl, &chain).await, chain.len());
        let m = http_get(b.admin, "/metrics").await.1;
        assert!(
            labelled(
                &m,
                "kvtier_cluster_peer_read_fallbacks_total",
                "peer=\"zz\""
            ) >= 1.0,
            "{m}"
        );
    })
    .await;
}

//! Shares of what every client draws on, each an attack that must fail against the real
//! binary: one connection (or one tenant's connections) pinning every DRAM slot so that others'
//! puts find none; connections that never read their large gets holding the whole send budget;
//! one tenant's token, or one Unix group member, taking every connection place.

use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig};
use kvtier_core::BlockKey;
use kvtier_core::protocol::{KeyList, Request};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::brakes::metric;
use crate::common::*;

/// Puts `keys` as one chain and returns how many were stored.
async fn stored(c: &Client, keys: &[BlockKey]) -> usize {
    let data: Vec<Vec<u8>> = keys.iter().map(|k| block_data(*k)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    c.put_chain(keys, None, &bufs).await.cached()
}

/// Requests refused for want of share `share` (`kvtier_share_refusals_total{share}`).
async fn refusals(srv: &ServerProc, share: &str) -> u64 {
    metric(
        srv,
        &format!("kvtier_share_refusals_total{{share=\"{share}\"}}"),
    )
    .await
}

/// Blocks pinned by a pin of `keys` for the longest lease.
async fn pinned(c: &Client, keys: &[BlockKey]) -> usize {
    c.pin(keys, Duration::from_secs(30)).await.unwrap().1.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_cannot_pin_the_slots_others_need() {
    // DRAM only: 1,024 slots of 4 KiB; a connection's pins hold at most a quarter of them.
    let srv = ServerProc::start(&["store.nvme_dir=\"\""]);
    bounded(60, async {
        let owner = srv.client("tcp").await;
        let k = keys(b"pinned", 600, 0);
        put_all(&owner, &k).await;
        // The local engine, passed the arena (trusted with every block), pins whole
        // prefixes: DRAM alone bounds it.
        let local = srv.client("unix").await;
        assert!(local.is_local());
        let p = local.get_pinned(&k, Duration::from_secs(5)).await.unwrap();
        assert_eq!(p.len(), 600);
        drop(p); // released in the background
        let until = Instant::now() + Duration::from_secs(5);
        while srv.stats().await["leases_open"] != 0 {
            assert!(Instant::now() < until, "the local lease was never released");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The attacker pins all it can, over TCP, with the longest lease, twice.
        let hog = srv.client("tcp").await;
        let (lease, tiers) = hog.pin(&k, Duration::from_secs(30)).await.unwrap();
        assert_eq!(tiers.len(), 256, "cut at the connection's share");
        assert_eq!(pinned(&hog, &k[256..]).await, 0, "its share is spent");
        // Another client's puts still find slots: 768 are not pinned.
        let other = srv.client("tcp").await;
        assert_eq!(stored(&other, &keys(b"victim", 700, 1)).await, 700);
        assert!(refusals(&srv, "pins_connection").await >= 2);
        // A released lease gives its share back.
        hog.release(lease).await.unwrap();
        assert_eq!(pinned(&hog, &k[..200]).await, 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_connections_cannot_pin_every_slot_together() {
    // DRAM only, 1,024 slots; a tenant's pins hold at most half of them, a connection's a
    // quarter.
    let srv = ServerProc::start(&[
        "store.nvme_dir=\"\"",
        "server.token=\"\"",
        "tenants.a={token=\"tok-a\"}",
        "tenants.b={token=\"tok-b\"}",
    ]);
    bounded(60, async {
        let a = as_tenant(&srv, "tok-a").await;
        let k = keys(b"tenant-a", 800, 0);
        assert_eq!(stored(&a, &k).await, 800);
        // Three connections of tenant a pin the 800 blocks between them.
        let (a1, a2, a3) = (
            as_tenant(&srv, "tok-a").await,
            as_tenant(&srv, "tok-a").await,
            as_tenant(&srv, "tok-a").await,
        );
        assert_eq!(pinned(&a1, &k[288..]).await, 256);
        assert_eq!(pinned(&a2, &k[544..]).await, 256);
        assert_eq!(
            pinned(&a3, &k[..288]).await,
            0,
            "the tenant's share is spent"
        );
        // Tenant b still stores: 512 slots are not pinned.
        let b = as_tenant(&srv, "tok-b").await;
        assert_eq!(stored(&b, &keys(b"tenant-b", 500, 1)).await, 500);
        assert!(refusals(&srv, "pins_tenant").await >= 1);
        // Its own pins draw on its own share.
        let kb = keys(b"tenant-b", 50, 2);
        assert_eq!(stored(&b, &kb).await, 50);
        assert_eq!(pinned(&b, &kb).await, 50);
    })
    .await;
}

/// `n` raw TCP connections (hello with `token`) that each pipeline 100 gets of `keys` and
/// never read a byte.
async fn stuck_readers(srv: &ServerProc, token: &str, n: usize, k: &[BlockKey]) -> Vec<TcpStream> {
    let get = Raw::<TcpStream>::frame(&Request::Get(KeyList { keys: k.to_vec() }), 0, 0);
    let mut out = Vec::new();
    for _ in 0..n {
        let mut r = Raw::new(TcpStream::connect(srv.tcp).await.unwrap());
        assert!(matches!(
            r.hello(token).await,
            kvtier_core::protocol::Response::Hello(_)
        ));
        for _ in 0..100 {
            if r.s.write_all(&get).await.is_err() {
                break;
            }
        }
        out.push(r.s);
    }
    // Until their socket buffers are full and each holds a get unsent.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    out
}

/// For 2 s, `c`'s gets of `k` are served in full (never answered busy).
async fn served_throughout(c: &Client, k: &[BlockKey]) {
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert_eq!(
            get_verified(c, k).await,
            k.len(),
            "starved by clients that never read"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_larger_than_a_connections_share_cannot_take_the_send_budget() {
    // Each connection may queue 1 MiB; the server sends 4 MiB at once. A get is 2 MiB.
    let srv = ServerProc::start(&[
        "limits.write_timeout_ms=10000",
        "limits.max_queued_bytes_per_connection=\"1MiB\"",
        "limits.max_inflight_bytes=\"4MiB\"",
        "store.nvme_dir=\"\"",
    ]);
    bounded(60, async {
        let c = srv.client("tcp").await;
        let big = keys(b"big", 512, 0);
        put_all(&c, &big).await;
        // Three connections that never read: each holds a 2 MiB get unsent. Charged the
        // whole 2 MiB, two of them would hold the server's budget; charged their share,
        // three hold 3 MiB of it.
        let _stuck = stuck_readers(&srv, TOKEN, 3, &big).await;
        served_throughout(&c, &big[..64]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_readers_cannot_take_the_send_budget() {
    // Tenant a's connections together send at most 2 MiB at once of the server's 4 MiB.
    let srv = ServerProc::start(&[
        "limits.write_timeout_ms=10000",
        "limits.max_queued_bytes_per_connection=\"1MiB\"",
        "limits.max_inflight_bytes=\"4MiB\"",
        "limits.max_inflight_bytes_per_tenant=\"2MiB\"",
        "store.nvme_dir=\"\"",
        "server.token=\"\"",
        "tenants.a={token=\"tok-a\"}",
        "tenants.b={token=\"tok-b\"}",
    ]);
    bounded(60, async {
        let a = as_tenant(&srv, "tok-a").await;
        let big = keys(b"big", 256, 0);
        put_all(&a, &big).await;
        let b = as_tenant(&srv, "tok-b").await;
        let small = keys(b"small", 64, 1);
        put_all(&b, &small).await;
        // Four of tenant a's connections never read (1 MiB of the budget each, at most).
        let _stuck = stuck_readers(&srv, "tok-a", 4, &big).await;
        served_throughout(&b, &small).await;
        assert!(refusals(&srv, "send_tenant").await >= 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_take_every_connection() {
    let srv = ServerProc::start(&[
        "limits.max_connections_per_tenant=3",
        "server.token=\"\"",
        "tenants.a={token=\"tok-a\"}",
        "tenants.b={token=\"tok-b\"}",
    ]);
    bounded(60, async {
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(as_tenant(&srv, "tok-a").await);
        }
        // A fourth of tenant a is refused, over any transport...
        for (url, config) in [
            (srv.tcp_url(), ClientConfig::default().token("tok-a")),
            (
                srv.quic_url(),
                ClientConfig::default()
                    .token("tok-a")
                    .quic_cert_der(srv.cert()),
            ),
        ] {
            let e = Client::connect(&url, config)
                .await
                .err()
                .expect("a fourth connection of one tenant was let in");
            assert!(e.to_string().contains("max_connections_per_tenant"), "{e}");
        }
        // ...while another tenant gets in, and a closed connection gives its place back.
        as_tenant(&srv, "tok-b").await.ping().await.unwrap();
        held.pop();
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match Client::connect(&srv.tcp_url(), ClientConfig::default().token("tok-a")).await {
                Ok(c) => {
                    c.ping().await.unwrap();
                    break;
                }
                Err(e) => assert!(Instant::now() < until, "no place came back: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for c in &held {
            c.ping().await.unwrap();
        }
        assert!(refusals(&srv, "connections_tenant").await >= 2);
    })
    .await;
}

/// A Unix socket client running as uid 65534, a member of the socket's group
/// (`server.unix_group`), opens four connections at once: three are kept, the fourth is
/// refused "busy" at accept. The client is a small Python program run as uid 65534 (as root
/// directly, else through `sudo -n`), as in the tenants tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_group_member_cannot_take_the_local_workers_places() {
    let (_, my_gid) = my_ids();
    let group = format!("server.unix_group=\"{my_gid}\"");
    let srv = ServerProc::start(&[
        &group,
        "limits.max_connections=16",
        "limits.unix_reserved_connections=8",
        "limits.max_unix_connections_per_uid=3",
    ]);
    srv.open_to_group();
    // Each connection waits up to a second for the unsolicited refusal; all stay open.
    let script = [
        "import socket,sys",
        "said=[]",
        "held=[]",
        "for _ in range(4):",
        "    s=socket.socket(socket.AF_UNIX)",
        "    s.connect(sys.argv[1])",
        "    s.settimeout(1.0)",
        "    try:",
        "        said.append('refused' if s.recv(64) else 'closed')",
        "    except socket.timeout:",
        "        said.append('kept')",
        "    held.append(s)",
        "print(' '.join(said))",
    ]
    .join("\n");
    let path = srv.unix.display().to_string();
    assert_eq!(
        python_as_another_user(&script, &[&path]).trim(),
        "kept kept kept refused"
    );
    bounded(60, async {
        // The server's own user is not capped: the local worker takes more places than that.
        let mut local = Vec::new();
        for _ in 0..8 {
            let c = srv.client("unix").await;
            c.ping().await.unwrap();
            local.push(c);
        }
        assert!(refusals(&srv, "connections_uid").await >= 1);
    })
    .await;
}

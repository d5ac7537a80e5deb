//! Tenants the server enforces (`[tenants]`): a tenant's token names its namespace; no
//! request of one tenant sees, reads, overwrites or removes another's blocks, whatever keys it
//! sends; events and snapshots carry only the subscriber's namespace; `clear` needs an admin;
//! a sharing group shares; a quota bounds a namespace by removing its own blocks, never
//! another's.

use std::time::Duration;

use kvtier_client::{
    BlockEvent, Client, ClientConfig, ClientError, ErrorCode, EventItem, EventKind, EventStream,
};
use kvtier_core::BlockKey;

use crate::common::*;

/// Tenants `a` and `b`, `c` and `d` sharing group `g`, and an admin.
const TENANTS: &[&str] = &[
    "server.token=\"\"",
    "tenants.a={token=\"tok-a\"}",
    "tenants.b={token=\"tok-b\"}",
    "tenants.c={token=\"tok-c\", group=\"g\"}",
    "tenants.d={token=\"tok-d\", group=\"g\"}",
    "tenants.root={token=\"tok-root\", role=\"admin\"}",
];

async fn as_tenant(srv: &ServerProc, token: &str) -> Client {
    Client::connect(&srv.tcp_url(), ClientConfig::default().token(token))
        .await
        .unwrap()
}

/// Every event that arrives until the stream has been quiet for 300 ms.
async fn drain(s: &mut EventStream) -> Vec<BlockEvent> {
    let mut out = Vec::new();
    while let Ok(Some(batch)) =
        tokio::time::timeout(Duration::from_millis(300), s.next_batch()).await
    {
        for item in batch {
            match item {
                EventItem::Event(e) => out.push(e),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    out
}

/// Puts `keys` as one chain whose blocks hold `fill`'s bytes.
async fn put_bytes(c: &Client, keys: &[BlockKey], fill: u8) -> usize {
    let data: Vec<Vec<u8>> = keys.iter().map(|_| vec![fill; BLOCK]).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    c.put_chain(keys, None, &bufs).await.cached()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_cannot_see_read_replace_remove_or_clear_blocks() {
    let srv = ServerProc::start(TENANTS);
    bounded(60, async {
        let a = as_tenant(&srv, "tok-a").await;
        let b = as_tenant(&srv, "tok-b").await;
        let mut b_events = b.events(Some(1), true).await.unwrap();
        let mut a_events = a.events(None, false).await.unwrap();
        let ka = keys(b"victim", 4, 0);
        put_all(&a, &ka).await;

        // A sees its own blocks, in its own keys, numbered without a hole.
        let seen = drain(&mut a_events).await;
        let stored: Vec<_> = seen
            .iter()
            .filter(|e| e.kind == EventKind::Stored as u8)
            .map(|e| e.key)
            .collect();
        for k in &ka {
            assert!(stored.contains(k), "A's own event for {k}");
        }
        for (i, e) in seen.iter().enumerate() {
            assert_eq!(e.seq, a_events.start_seq + i as u64, "{seen:?}");
        }
        let mut snap = a.events(None, true).await.unwrap();
        let snap: Vec<_> = drain(&mut snap).await.iter().map(|e| e.key).collect();
        assert!(ka.iter().all(|k| snap.contains(k)), "A's snapshot");

        // B learns nothing: no event, no snapshot entry (live, replayed or fresh).
        assert!(drain(&mut b_events).await.is_empty());
        let mut s = b.events(Some(1), true).await.unwrap();
        assert!(drain(&mut s).await.is_empty());

        // Knowing A's keys is no help either.
        assert_eq!(b.lookup(&ka).await.tiers.len(), 0);
        assert_eq!(get_verified(&b, &ka).await, 0);
        assert_eq!(b.remove(&ka).await.unwrap(), 0);
        // B's put under A's key lands in B's namespace: A still reads its own bytes.
        assert_eq!(put_bytes(&b, &ka, 0xEE).await, ka.len());
        assert_eq!(get_verified(&a, &ka).await, ka.len());
        let mut buf = vec![0u8; BLOCK];
        let f = b.get_into(&ka[..1], &mut [buf.as_mut_slice()]).await;
        assert_eq!(f.blocks, 1);
        assert!(buf.iter().all(|&x| x == 0xEE), "B reads B's bytes");
        assert_eq!(b.remove(&ka).await.unwrap(), ka.len() as u64);
        assert_eq!(
            get_verified(&a, &ka).await,
            ka.len(),
            "B removed only its own"
        );

        // Clear needs an admin.
        let e = b.clear().await.expect_err("a tenant may not clear");
        assert!(
            matches!(
                e,
                ClientError::Server {
                    code: Some(ErrorCode::Forbidden),
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(a.lookup(&ka).await.tiers.len(), ka.len());

        // The Unix socket's clients (no tenant marked for it) are an admin of their own
        // namespace: they do not see A's blocks by key either.
        let u = srv.client("unix").await;
        assert_eq!(u.lookup(&ka).await.tiers.len(), 0);
        // With tenants the published slot table (internal keys) is not sent: gets take pins.
        assert!(u.is_local() && !u.has_fast_gets().await);

        // The old server-wide token is gone; a wrong one is refused as before.
        for t in [TOKEN, "tok-x", ""] {
            let e = Client::connect(&srv.tcp_url(), ClientConfig::default().token(t))
                .await
                .err()
                .expect("refused");
            assert!(
                matches!(
                    e,
                    ClientError::Server {
                        code: Some(ErrorCode::Unauthorized),
                        ..
                    }
                ),
                "{e}"
            );
        }

        // An admin clears every namespace; A is told.
        let root = as_tenant(&srv, "tok-root").await;
        let mut a_events = a.events(None, false).await.unwrap();
        root.clear().await.unwrap();
        assert_eq!(a.lookup(&ka).await.tiers.len(), 0);
        let seen = drain(&mut a_events).await;
        assert!(
            seen.iter().any(|e| e.kind == EventKind::Cleared as u8),
            "{seen:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharing_group_shares_and_the_unix_socket_can_join_it() {
    let mut args = TENANTS.to_vec();
    args.push("tenants.worker={group=\"g\", unix=true}");
    let srv = ServerProc::start(&args);
    bounded(60, async {
        let (a, c, d) = (
            as_tenant(&srv, "tok-a").await,
            as_tenant(&srv, "tok-c").await,
            as_tenant(&srv, "tok-d").await,
        );
        let mut d_events = d.events(None, false).await.unwrap();
        let k = keys(b"system-prompt", 3, 0);
        put_all(&c, &k).await;
        assert_eq!(get_verified(&d, &k).await, k.len(), "D shares C's group");
        let seen: Vec<_> = drain(&mut d_events).await.iter().map(|e| e.key).collect();
        assert!(
            k.iter().all(|x| seen.contains(x)),
            "D sees the group's events"
        );
        assert_eq!(a.lookup(&k).await.tiers.len(), 0, "A is not in the group");
        // The worker on the Unix socket is a member too (a tenant, not an admin).
        let u = srv.client("unix").await;
        assert_eq!(get_verified(&u, &k).await, k.len());
        // Its puts (reserve and commit through its staging region) land in the group, and
        // the group's subscribers hear of them in the worker's keys; A hears nothing.
        let mut a_events = a.events(None, false).await.unwrap();
        let kw = keys(b"worker", 3, 0);
        put_all(&u, &kw).await;
        assert_eq!(get_verified(&d, &kw).await, kw.len());
        let seen: Vec<_> = drain(&mut d_events).await.iter().map(|e| e.key).collect();
        assert!(kw.iter().all(|x| seen.contains(x)), "{seen:?}");
        assert!(drain(&mut a_events).await.is_empty());
        let mut snap = d.events(None, true).await.unwrap();
        let snap: Vec<_> = drain(&mut snap).await.iter().map(|e| e.key).collect();
        assert!(k.iter().chain(&kw).all(|x| snap.contains(x)), "{snap:?}");
        let e = u.clear().await.expect_err("the worker is not an admin");
        assert!(
            matches!(
                e,
                ClientError::Server {
                    code: Some(ErrorCode::Forbidden),
                    ..
                }
            ),
            "{e}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_filling_its_quota_gives_up_its_own_blocks_not_anothers() {
    // DRAM only, 16 blocks: without the quota, B's 40 blocks would push A's out.
    let srv = ServerProc::start(&[
        "server.token=\"\"",
        "store.dram_bytes=\"64KiB\"",
        "store.nvme_dir=\"\"",
        "tenants.a={token=\"tok-a\"}",
        "tenants.b={token=\"tok-b\", quota=\"32KiB\"}",
    ]);
    bounded(60, async {
        let (a, b) = (
            as_tenant(&srv, "tok-a").await,
            as_tenant(&srv, "tok-b").await,
        );
        let ka = keys(b"a", 6, 0);
        put_all(&a, &ka).await;
        let kb = keys(b"b", 40, 0);
        for chunk in kb.chunks(4) {
            let first = kb.iter().position(|k| *k == chunk[0]).unwrap();
            let parent = first.checked_sub(1).map(|p| kb[p]);
            let d: Vec<Vec<u8>> = chunk.iter().map(|k| block_data(*k)).collect();
            let bufs: Vec<&[u8]> = d.iter().map(|x| x.as_slice()).collect();
            let s = b.put_chain(chunk, parent, &bufs).await;
            assert_eq!(s.cached(), chunk.len(), "{:?}", s.statuses);
        }
        assert_eq!(get_verified(&a, &ka).await, ka.len(), "A keeps every block");
        // B holds its newest 8 (32 KiB), its older ones removed first.
        assert_eq!(get_verified(&b, &kb[32..]).await, 8);
        assert_eq!(b.lookup(&kb[31..]).await.tiers.len(), 0);
        // /stats counts each namespace's blocks against its quota.
        let st = srv.stats().await;
        let ns = |name: &str| {
            st["namespaces"]
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["namespace"] == name)
                .cloned()
                .unwrap()
        };
        assert_eq!(ns("tenant:a")["blocks"], 6);
        assert_eq!(ns("tenant:a")["quota_blocks"], serde_json::Value::Null);
        assert_eq!(ns("tenant:b")["blocks"], 8);
        assert_eq!(ns("tenant:b")["quota_blocks"], 8);
        assert_eq!(ns("unix")["blocks"], 0);
    })
    .await;
}

#[test]
fn tenant_configuration_errors_stop_the_server_naming_the_setting() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, setting, says) in [
        (
            vec!["tenants.a={token=\"t\"}", "tenants.b={token=\"t\"}"],
            "tenants.b.token",
            "same token",
        ),
        (
            vec!["tenants.a={token=\"t\", role=\"root\"}"],
            "tenants.a.role",
            "expected",
        ),
        (
            vec!["tenants.a={token=\"t\", quota=\"1GiB\"}"],
            "tenants.a.quota",
            "more than the store holds",
        ),
        (
            vec!["tenants.a={role=\"admin\"}"],
            "tenants.a.token",
            "needs a token",
        ),
        (
            vec!["tenants.a={token=\"t\", colour=\"red\"}"],
            "tenants",
            "unknown field",
        ),
    ] {
        let mut args = vec!["server.token=\"\""];
        args.extend(extra);
        let (status, err) = ServerProc::refused_in(tmp.path(), &args);
        assert!(!status.success());
        assert!(
            err.contains(setting) && err.contains(says),
            "{args:?}: {err}"
        );
    }
    // The server-wide token is refused beside tenants (it would name no tenant).
    let (status, err) = ServerProc::refused_in(tmp.path(), &["tenants.a={token=\"t\"}"]);
    assert!(!status.success());
    assert!(err.contains("server.token"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_blocks_do_not_survive_a_restart_and_are_shown_to_no_one() {
    let srv = ServerProc::start(TENANTS);
    let ka = keys(b"before", 4, 0);
    bounded(30, async {
        let a = as_tenant(&srv, "tok-a").await;
        put_all(&a, &ka).await;
        assert_eq!(a.lookup(&ka).await.tiers.len(), ka.len());
    })
    .await;
    let srv = srv.restart();
    bounded(30, async {
        // The blocks are still on NVMe, under internal keys no one can name any more.
        let blocks = srv.stats().await["store"]["blocks"].as_u64().unwrap();
        assert!(blocks >= ka.len() as u64, "{blocks}");
        let a = as_tenant(&srv, "tok-a").await;
        assert_eq!(a.lookup(&ka).await.tiers.len(), 0, "a new secret: new keys");
        for token in ["tok-a", "tok-root"] {
            let c = as_tenant(&srv, token).await;
            let mut s = c.events(Some(1), true).await.unwrap();
            assert!(drain(&mut s).await.is_empty(), "{token}");
        }
        let u = srv.client("unix").await;
        let mut s = u.events(Some(1), true).await.unwrap();
        assert!(drain(&mut s).await.is_empty());
    })
    .await;
}

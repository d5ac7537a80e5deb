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
use kvtier_core::protocol::{FrameBody, Hello, Limits, Request, Response, decode_frame};

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

        // B's stats name only B's namespace (not A's name, blocks or event sequence); an
        // admin's name every namespace.
        let names = |c: &Client| {
            let c = c.clone();
            async move {
                let st: serde_json::Value =
                    serde_json::from_str(&c.stats().await.unwrap()).unwrap();
                let ns = st["namespaces"].as_array().unwrap().clone();
                ns.iter()
                    .map(|n| n["namespace"].as_str().unwrap().to_string())
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(names(&b).await, ["tenant:b"]);
        let root = as_tenant(&srv, "tok-root").await;
        assert!(names(&root).await.contains(&"tenant:a".to_string()));

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
        // namespace: they do not see A's blocks by key either, and are not passed the arena
        // (which holds every namespace's blocks).
        let u = srv.client("unix").await;
        assert_eq!(u.lookup(&ka).await.tiers.len(), 0);
        assert!(!u.is_local() && !u.has_fast_gets().await);

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
    args.push("tenants.worker={group=\"g\", unix=true, local_arena=true}");
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
        assert!(u.is_local(), "trusted with the arena");
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
async fn only_a_tenant_trusted_with_the_arena_is_passed_it() {
    for trusted in [false, true] {
        let worker = format!("tenants.worker={{group=\"g\", unix=true, local_arena={trusted}}}");
        let mut args = TENANTS.to_vec();
        args.push(&worker);
        let srv = ServerProc::start(&args);
        bounded(60, async {
            // A hello asking for the arena, read as a client written from docs/protocol.md.
            let (_raw, hello, fds) = crate::arena::local_hello(&srv.unix).await;
            if trusted {
                assert!(
                    hello.arena_bytes > 0 && hello.staging_bytes > 0,
                    "{hello:?}"
                );
                // The arena, the staging region and the slot table, with the namespace key
                // that maps the worker's keys to the table's.
                assert!(hello.slot_table_bytes > 0, "{hello:?}");
                assert_eq!(fds.len(), 3);
                assert!(hello.namespace_key.is_some());
            } else {
                assert_eq!(
                    (
                        hello.arena_bytes,
                        hello.staging_bytes,
                        hello.slot_table_bytes,
                        hello.namespace_key
                    ),
                    (0, 0, 0, None)
                );
                assert!(fds.is_empty(), "{} descriptors", fds.len());
            }
            // The SDK asks for the arena by default and works either way: gets and puts in
            // place, or copies over the socket.
            let u = srv.client("unix").await;
            assert_eq!(u.is_local(), trusted);
            assert_eq!(u.has_fast_gets().await, trusted);
            let c = as_tenant(&srv, "tok-c").await;
            let kw = keys(b"worker", 3, 0);
            put_all(&u, &kw).await;
            assert_eq!(get_verified(&c, &kw).await, kw.len(), "trusted: {trusted}");
            let kc = keys(b"member", 3, 0);
            put_all(&c, &kc).await;
            assert_eq!(get_verified(&u, &kc).await, kc.len(), "trusted: {trusted}");
            // A group member's blocks are the worker's namespace's: read in place when trusted.
            assert_eq!(u.fast_hits(), if trusted { 3 } else { 0 });
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_clients_uid_names_its_tenant() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    let (me, my_gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // This test's own uid (the server's too) mapped to tenant u; the socket given our group.
    let u = format!("tenants.u={{token=\"tok-u\", unix_uids=[{me}]}}");
    let group = format!("server.unix_group=\"{my_gid}\"");
    let mut args = TENANTS.to_vec();
    args.extend([u.as_str(), group.as_str()]);
    let srv = ServerProc::start(&args);
    let m = std::fs::metadata(&srv.unix).unwrap();
    assert_eq!((m.permissions().mode() & 0o777, m.gid()), (0o660, my_gid));
    bounded(60, async {
        let unix = srv.client("unix").await;
        let k = keys(b"by-uid", 3, 0);
        put_all(&unix, &k).await;
        // The blocks are u's: u reads them over TCP, a does not see them.
        assert_eq!(
            get_verified(&as_tenant(&srv, "tok-u").await, &k).await,
            k.len()
        );
        assert_eq!(
            as_tenant(&srv, "tok-a").await.lookup(&k).await.tiers.len(),
            0
        );
        // u is a tenant, not the implicit Unix admin, and not trusted with the arena.
        assert!(!unix.is_local());
        let e = unix.clear().await.expect_err("u may not clear");
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

/// A Unix socket client running as a uid no tenant lists is refused at hello (error 4,
/// counted): the socket's group lets it connect, the mapping does not let it in. The client
/// is a small Python program run as uid 65534 (as root directly, else through `sudo -n`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_client_whose_uid_no_tenant_lists_is_refused_at_hello() {
    let (me, my_gid) = my_ids();
    let u = format!("tenants.u={{token=\"tok-u\", unix_uids=[{me}]}}");
    let group = format!("server.unix_group=\"{my_gid}\"");
    let mut args = TENANTS.to_vec();
    args.extend([u.as_str(), group.as_str()]);
    let srv = ServerProc::start(&args);
    srv.open_to_group();
    let hello = Raw::<tokio::net::UnixStream>::frame(
        &Request::Hello(Hello {
            min_version: kvtier_core::protocol::VERSION,
            max_version: kvtier_core::protocol::VERSION,
            client: "stranger".into(),
            token: String::new(),
            block_bytes: 0,
            want_arena: false,
        }),
        1,
        0,
    );
    let hex: String = hello.iter().map(|b| format!("{b:02x}")).collect();
    let script = "import socket,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.settimeout(10)\n\
        s.connect(sys.argv[1])\n\
        s.sendall(bytes.fromhex(sys.argv[2]))\n\
        b=b''\n\
        while True:\n\
        \x20   c=s.recv(65536)\n\
        \x20   if not c: break\n\
        \x20   b+=c\n\
        print(b.hex())\n";
    let path = srv.unix.display().to_string();
    let text = python_as_another_user(script, &[&path, &hex]);
    let bytes: Vec<u8> = (0..text.trim().len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text.trim()[i..i + 2], 16).unwrap())
        .collect();
    let limits = Limits {
        max_meta_bytes: 1 << 20,
        max_keys: 1 << 16,
        max_payload_bytes: 1 << 20,
    };
    let ((_, body, _), _) = decode_frame(&bytes, &limits).expect("one reply frame");
    match body {
        FrameBody::Response(Response::Error(e)) => {
            assert_eq!(e.code, ErrorCode::Unauthorized as u16, "{e:?}");
            assert!(e.message.contains("uid 65534"), "{e:?}");
        }
        other => panic!("a stranger's hello got {other:?}"),
    }
    bounded(30, async {
        let m = http_get(srv.admin, "/metrics").await.1;
        assert!(
            m.lines().any(|l| l == "kvtier_auth_failures_total 1"),
            "the refusal is counted"
        );
        // The uid the configuration maps still gets in.
        let unix = srv.client("unix").await;
        unix.ping().await.unwrap();
    })
    .await;
}

/// A client certificate and its key (DER), and the hex SHA-256 a tenant pins it by.
fn client_cert(name: &str) -> (Vec<u8>, Vec<u8>, String) {
    let ck = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    let der = ck.cert.der().to_vec();
    let hex = ring::digest::digest(&ring::digest::SHA256, &der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":");
    (der, ck.signing_key.serialize_der(), hex)
}

/// Connects over `transport` ("tls" or "quic") with `cert` and `token` (none when empty).
async fn with_cert(
    srv: &ServerProc,
    transport: &str,
    cert: Option<&(Vec<u8>, Vec<u8>, String)>,
    token: &str,
) -> Result<Client, ClientError> {
    let mut cfg = ClientConfig::default().server_cert_der(srv.cert());
    if !token.is_empty() {
        cfg = cfg.token(token);
    }
    if let Some((der, key, _)) = cert {
        cfg = cfg.client_cert_der(der.clone(), key.clone());
    }
    let url = if transport == "tls" {
        srv.tls_url()
    } else {
        srv.quic_url()
    };
    Client::connect(&url, cfg).await
}

fn unauthorized(r: Result<Client, ClientError>, says: &str) {
    match r {
        Err(ClientError::Server {
            code: Some(ErrorCode::Unauthorized),
            message,
            ..
        }) => assert!(message.contains(says), "{message}"),
        Err(e) => panic!("expected unauthorized ({says}), got {e}"),
        Ok(_) => panic!("expected unauthorized ({says}), got a connection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_client_certificate_names_its_tenant_over_tls_and_quic() {
    let (ca, stranger) = (client_cert("client-a"), client_cert("stranger"));
    let a = format!(
        "tenants.a={{token=\"tok-a\", client_cert_sha256=[\"{}\"]}}",
        ca.2
    );
    let mut args = TENANTS.to_vec();
    args.push(&a);
    let srv = ServerProc::start(&args);
    bounded(60, async {
        let ka = keys(b"by-cert", 3, 0);
        for transport in ["tls", "quic"] {
            // The certificate alone names A: its blocks are A's, seen by A's token.
            let c = with_cert(&srv, transport, Some(&ca), "").await.unwrap();
            put_all(&c, &ka).await;
            assert_eq!(get_verified(&as_tenant(&srv, "tok-a").await, &ka).await, 3);
            assert_eq!(
                as_tenant(&srv, "tok-b").await.lookup(&ka).await.tiers.len(),
                0
            );
            // With A's token too: the same tenant.
            let c = with_cert(&srv, transport, Some(&ca), "tok-a")
                .await
                .unwrap();
            assert_eq!(get_verified(&c, &ka).await, 3, "{transport}");
            // A certificate and a token of different tenants: refused.
            unauthorized(
                with_cert(&srv, transport, Some(&ca), "tok-b").await,
                "the token another",
            );
            // A certificate no tenant pins: refused, whatever the token.
            unauthorized(
                with_cert(&srv, transport, Some(&stranger), "tok-b").await,
                "pinned by no tenant",
            );
            // No certificate: the token still works (certificates are optional).
            let b = with_cert(&srv, transport, None, "tok-b").await.unwrap();
            assert_eq!(b.lookup(&ka).await.tiers.len(), 0, "{transport}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_client_certificates_refuse_a_handshake_without_one() {
    let ca = client_cert("client-a");
    let a = format!("tenants.a={{client_cert_sha256=[\"{}\"]}}", ca.2);
    let mut args = TENANTS.to_vec();
    args.extend([a.as_str(), "server.tls_client_auth=\"required\""]);
    let srv = ServerProc::start(&args);
    bounded(60, async {
        for transport in ["tls", "quic"] {
            // TLS 1.3 ends the handshake at the server: the client learns it at its hello.
            let e = with_cert(&srv, transport, None, "tok-b").await.err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| !matches!(e, ClientError::Server { .. })),
                "{transport}: {e:?}"
            );
            let c = with_cert(&srv, transport, Some(&ca), "").await.unwrap();
            c.ping().await.unwrap();
        }
        // Plain TCP and the Unix socket are not TLS: tokens and the uid as before.
        as_tenant(&srv, "tok-b").await.ping().await.unwrap();
    })
    .await;
}

/// A server with 16 blocks of DRAM and no NVMe, tenant a (token `tok-a`, no quota) and
/// tenant b as `b` configures it.
fn small_store(b: &str) -> ServerProc {
    ServerProc::start(&[
        "server.token=\"\"",
        "store.dram_bytes=\"64KiB\"",
        "store.nvme_dir=\"\"",
        "tenants.a={token=\"tok-a\"}",
        b,
    ])
}

/// A client of tenant a and one of tenant b (tokens `tok-a`, `tok-b`).
async fn a_and_b(srv: &ServerProc) -> (Client, Client) {
    (as_tenant(srv, "tok-a").await, as_tenant(srv, "tok-b").await)
}

/// Puts chain `keys` on `c` four blocks a request; every block must be stored.
async fn put_in_fours(c: &Client, keys: &[BlockKey]) {
    for (i, chunk) in keys.chunks(4).enumerate() {
        let parent = (i * 4).checked_sub(1).map(|p| keys[p]);
        let d: Vec<Vec<u8>> = chunk.iter().map(|k| block_data(*k)).collect();
        let bufs: Vec<&[u8]> = d.iter().map(|x| x.as_slice()).collect();
        let s = c.put_chain(chunk, parent, &bufs).await;
        assert_eq!(s.cached(), chunk.len(), "{:?}", s.statuses);
    }
}

/// Namespace `name`'s entry in a `/stats` document.
fn namespace(stats: &serde_json::Value, name: &str) -> serde_json::Value {
    stats["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["namespace"] == name)
        .cloned()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_filling_its_quota_gives_up_its_own_blocks_not_anothers() {
    // DRAM only, 16 blocks: without the quota, B's 40 blocks would push A's out.
    let srv = small_store("tenants.b={token=\"tok-b\", quota=\"32KiB\"}");
    bounded(60, async {
        let (a, b) = a_and_b(&srv).await;
        let ka = keys(b"a", 6, 0);
        put_all(&a, &ka).await;
        let kb = keys(b"b", 40, 0);
        put_in_fours(&b, &kb).await;
        assert_eq!(get_verified(&a, &ka).await, ka.len(), "A keeps every block");
        // B holds its newest 8 (32 KiB), its older ones removed first.
        assert_eq!(get_verified(&b, &kb[32..]).await, 8);
        assert_eq!(b.lookup(&kb[31..]).await.tiers.len(), 0);
        // /stats counts each namespace's blocks against its quota.
        let st = srv.stats().await;
        let ns = |name: &str| namespace(&st, name);
        assert_eq!(ns("tenant:a")["blocks"], 6);
        assert_eq!(ns("tenant:a")["quota_blocks"], serde_json::Value::Null);
        assert_eq!(ns("tenant:b")["blocks"], 8);
        assert_eq!(ns("tenant:b")["quota_blocks"], 8);
        assert_eq!(ns("unix")["blocks"], 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_without_a_quota_cannot_flush_another_out_of_a_full_store() {
    // DRAM only, 16 blocks, no quotas: a, b and the Unix socket's namespace share it, 5 each.
    let srv = small_store("tenants.b={token=\"tok-b\"}");
    bounded(60, async {
        let (a, b) = a_and_b(&srv).await;
        let ka = keys(b"a", 3, 0);
        put_all(&a, &ka).await;
        // b stores 40 blocks, far past the store: it fills the free room, then pays with its
        // own oldest, never with a's.
        let kb = keys(b"b", 40, 0);
        put_in_fours(&b, &kb).await;
        assert_eq!(get_verified(&a, &ka).await, ka.len(), "A keeps every block");
        assert_eq!(get_verified(&b, &kb[27..]).await, 13, "B keeps the rest");
        let st = srv.stats().await;
        let ns = |name: &str| namespace(&st, name);
        assert_eq!(ns("tenant:a")["share_blocks"], 5);
        assert_eq!(ns("tenant:b")["blocks"], 13);
        // Below its share, a takes room from b, the one over its share (b's oldest).
        let ka2 = keys(b"a2", 2, 0);
        put_all(&a, &ka2).await;
        assert_eq!(get_verified(&a, &ka).await, 3);
        assert_eq!(get_verified(&a, &ka2).await, 2);
        assert_eq!(get_verified(&b, &kb[29..]).await, 11);
        assert_eq!(b.lookup(&kb[28..]).await.tiers.len(), 0);
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
            vec!["tenants.a={token=\"t\", local_arena=true}"],
            "tenants.a.local_arena",
            "unix = true",
        ),
        (
            vec![
                "tenants.a={token=\"t\", unix_uids=[1001]}",
                "tenants.b={token=\"u\", unix_uids=[1002, 1001]}",
            ],
            "tenants.b.unix_uids",
            "uid 1001",
        ),
        (
            vec![
                "server.unix_group=\"no-such-group-kvtier\"",
                "tenants.a={token=\"t\"}",
            ],
            "server.unix_group",
            "no group named",
        ),
        (
            vec!["tenants.a={client_cert_sha256=[\"abcd\"]}"],
            "tenants.a.client_cert_sha256",
            "64 hex digits",
        ),
        (
            vec![
                "tenants.a={token=\"t\"}",
                "server.tls_client_auth=\"required\"",
            ],
            "server.tls_client_auth",
            "no tenant pins",
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
async fn tenants_blocks_survive_a_restart_with_the_nvme_tier_and_stay_their_own() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let mut srv = ServerProc::start_in(tmp.path(), TENANTS);
    let ka = keys(b"before", 4, 0);
    bounded(30, async {
        let a = as_tenant(&srv, "tok-a").await;
        put_all(&a, &ka).await;
        assert_eq!(a.lookup(&ka).await.tiers.len(), ka.len());
    })
    .await;
    assert!(srv.stop().success());
    // The key secret the first start made, beside the data it keys.
    let secret = tmp.path().join("nvme").join("tenant-key-secret");
    let m = std::fs::metadata(&secret).unwrap();
    assert_eq!((m.permissions().mode() & 0o777, m.len()), (0o600, 32));

    // Started again, with one more tenant: namespaces keep their keys when others join.
    let mut args = TENANTS.to_vec();
    args.push("tenants.e={token=\"tok-e\"}");
    let mut srv = ServerProc::start_in(tmp.path(), &args);
    bounded(30, async {
        let a = as_tenant(&srv, "tok-a").await;
        assert_eq!(
            get_verified(&a, &ka).await,
            ka.len(),
            "A reads its own bytes"
        );
        for token in ["tok-b", "tok-e", "tok-root"] {
            let c = as_tenant(&srv, token).await;
            assert_eq!(c.lookup(&ka).await.tiers.len(), 0, "{token}");
            assert_eq!(get_verified(&c, &ka).await, 0, "{token}");
            let mut s = c.events(Some(1), true).await.unwrap();
            assert!(drain(&mut s).await.is_empty(), "{token}");
        }
        let u = srv.client("unix").await;
        assert_eq!(u.lookup(&ka).await.tiers.len(), 0);
    })
    .await;
    assert!(srv.stop().success());

    // A secret others may read, or one changed, is a clear startup error.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (status, err) = ServerProc::refused_in(tmp.path(), TENANTS);
    assert!(!status.success());
    assert!(
        err.contains("tenant-key-secret") && err.contains("0644") && err.contains("chmod 0600"),
        "{err}"
    );
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&secret, [0u8; 31]).unwrap();
    let (status, err) = ServerProc::refused_in(tmp.path(), TENANTS);
    assert!(!status.success());
    assert!(
        err.contains("tenant-key-secret") && err.contains("31 bytes"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_given_one_key_secret_file_map_a_tenants_keys_alike() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("key-secret");
    std::fs::write(&file, "a secret of more than sixteen bytes\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let setting = format!(
        "server.tenant_key_secret_file={:?}",
        file.display().to_string()
    );
    let mut args = TENANTS.to_vec();
    args.push(&setting);
    // Two servers on one NVMe directory in turn, the second knowing nothing of the first's
    // start but the file: the NVMe tier's own secret is not made.
    let ka = keys(b"shared-secret", 3, 0);
    let mut srv = ServerProc::start_in(tmp.path(), &args);
    bounded(30, async {
        put_all(&as_tenant(&srv, "tok-a").await, &ka).await
    })
    .await;
    assert!(srv.stop().success());
    assert!(!tmp.path().join("nvme").join("tenant-key-secret").exists());
    let srv = ServerProc::start_in(tmp.path(), &args);
    bounded(30, async {
        let a = as_tenant(&srv, "tok-a").await;
        assert_eq!(get_verified(&a, &ka).await, ka.len());
        let b = as_tenant(&srv, "tok-b").await;
        assert_eq!(get_verified(&b, &ka).await, 0);
    })
    .await;
    // Readable by its group: refused.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (status, err) = ServerProc::refused_in(&tmp.path().join("other"), &args);
    assert!(!status.success());
    assert!(err.contains("server.tenant_key_secret_file"), "{err}");
}

//! Brakes and bounded resources, each an attack that must fail against the real binary:
//! guessing tokens, floods of connections that never say hello (and their memory), a client
//! that never reads, running out of file descriptors, and the admin port.

use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig};
use kvtier_core::protocol::{ErrorCode, Header, Opcode, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::common::*;

/// A counter of the server's /metrics (the first series whose line starts with `series`).
pub(crate) async fn metric(srv: &ServerProc, series: &str) -> u64 {
    let body = http_get(srv.admin, "/metrics").await.1;
    let line = body
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no {series} in /metrics"));
    line[series.len()..].trim().parse().unwrap()
}

async fn tcp(srv: &ServerProc) -> Raw<TcpStream> {
    Raw::new(TcpStream::connect(srv.tcp).await.unwrap())
}

fn error_message(r: &Response) -> String {
    match r {
        Response::Error(e) => e.message.clone(),
        r => panic!("expected an error, got {r:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_tokens_is_braked_per_address() {
    let srv = ServerProc::start(&[
        "limits.auth_failures_burst=5",
        "limits.auth_failures_per_minute=1",
    ]);
    bounded(60, async {
        // 600 guesses from one address: 5 are compared, the rest refused unlooked-at.
        let mut said = std::collections::BTreeMap::<String, usize>::new();
        for i in 0..600 {
            let mut r = tcp(&srv).await;
            let reply = r.hello(&format!("guess-{i}")).await;
            assert_eq!(error_code(&reply), Some(ErrorCode::Unauthorized));
            *said.entry(error_message(&reply)).or_default() += 1;
            assert!(r.closed_within(5).await);
        }
        assert_eq!(said.get("wrong or missing token"), Some(&5), "{said:?}");
        let throttled: usize = said
            .iter()
            .filter(|(m, _)| m.starts_with("too many failed hellos from this address"))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(throttled, 595, "{said:?}");
        // The brake holds for the right token too, from that address...
        let e = Client::connect(&srv.tcp_url(), ClientConfig::default().token(TOKEN))
            .await
            .err()
            .expect("a braked address is refused");
        assert!(e.to_string().contains("too many failed hellos"), "{e}");
        // ...over QUIC as well: the brake is the address's, not the transport's...
        let e = Client::connect(
            &srv.quic_url(),
            ClientConfig::default()
                .token(TOKEN)
                .quic_cert_der(srv.cert()),
        )
        .await
        .err()
        .expect("a braked address is refused over QUIC too");
        assert!(e.to_string().contains("too many failed hellos"), "{e}");
        // ...while the local socket is not braked, and the refusals are counted.
        srv.client("unix").await.ping().await.unwrap();
        assert_eq!(metric(&srv, "kvtier_auth_failures_total").await, 5);
        assert!(metric(&srv, "kvtier_auth_throttled_total").await >= 597);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_before_hello_cannot_lock_the_local_worker_out() {
    let srv = ServerProc::start(&[
        "limits.max_connections=48",
        "limits.unix_reserved_connections=8",
        "limits.max_pre_hello_connections=16",
        "limits.hello_timeout_ms=2000",
    ]);
    bounded(60, async {
        // 64 connections that never say hello: 16 are let wait, the rest refused at once.
        let mut idle = Vec::new();
        for _ in 0..64 {
            idle.push(tcp(&srv).await);
        }
        let started = Instant::now();
        let mut refused = 0;
        let mut waiting = Vec::new();
        // Each one's answer (or silence), all at once: the waiting ones' deadline is running.
        let mut set = tokio::task::JoinSet::new();
        for mut r in idle {
            set.spawn(async move {
                let got = tokio::time::timeout(Duration::from_millis(500), r.recv()).await;
                (r, got)
            });
        }
        while let Some(j) = set.join_next().await {
            match j.unwrap() {
                (_, Ok(Some((h, reply, _)))) => {
                    // The unsolicited refusal: opcode 0, request id 0, "busy".
                    assert_eq!((h.opcode, h.request_id), (0, 0));
                    assert_eq!(error_code(&reply), Some(ErrorCode::Busy));
                    assert!(error_message(&reply).contains("hello"), "{reply:?}");
                    refused += 1;
                }
                (_, Ok(None)) => panic!("closed without a word"),
                (r, Err(_)) => waiting.push(r),
            }
        }
        assert_eq!((refused, waiting.len()), (48, 16));
        assert_eq!(srv.stats().await["connections_pre_hello"], 16);
        // The local worker still gets in, and so does an authenticated network client
        // (hello first, then the flood's connections are refused only for being early).
        let local = srv.client("unix").await;
        local.ping().await.unwrap();
        // The waiting ones are closed at the hello deadline, not after the idle timeout.
        for r in &mut waiting {
            assert!(
                r.closed_within(5).await,
                "a connection outlived its hello deadline"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(srv.stats().await["connections_pre_hello"], 0);
        srv.client("tcp").await.ping().await.unwrap();
        local.ping().await.unwrap();
        assert_eq!(
            metric(
                &srv,
                "kvtier_connection_refusals_total{reason=\"pre_hello\"}"
            )
            .await,
            48
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_network_cannot_take_the_places_reserved_for_the_unix_socket() {
    let srv = ServerProc::start(&[
        "limits.max_connections=12",
        "limits.unix_reserved_connections=4",
    ]);
    bounded(60, async {
        // Eight authenticated TCP clients fill the network's share...
        let mut clients = Vec::new();
        for _ in 0..8 {
            clients.push(srv.client("tcp").await);
        }
        let over = Client::connect(&srv.tcp_url(), ClientConfig::default().token(TOKEN)).await;
        assert!(over.is_err(), "a ninth network connection was let in");
        // ...and four local ones still fit.
        for _ in 0..4 {
            srv.client("unix").await.ping().await.unwrap();
        }
        for c in &clients {
            c.ping().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_before_hello_allocate_no_large_buffers() {
    const N: usize = 300;
    let srv = ServerProc::start(&[
        "limits.max_pre_hello_connections=400",
        // Long enough that, were the megabyte allocated, it would still be held when measured.
        "limits.frame_timeout_ms=30000",
    ]);
    bounded(60, async {
        let before = srv.rss_bytes();
        // Each announces 1 MiB of metadata (the server's max_meta_bytes), sends 16 bytes of
        // it and stalls: an unauthenticated peer must not get the megabyte allocated.
        let head = Header::request(Opcode::Hello, 1, 1 << 20, 0).encode();
        let mut conns = Vec::new();
        for _ in 0..N {
            let mut s = TcpStream::connect(srv.tcp).await.unwrap();
            s.write_all(&head).await.unwrap();
            s.write_all(&[0u8; 16]).await.unwrap();
            conns.push(Raw::new(s));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let grown = srv.rss_bytes().saturating_sub(before);
        let mut too_large = 0;
        for r in &mut conns {
            if let Ok(Some((_, reply, _))) =
                tokio::time::timeout(Duration::from_secs(5), r.recv()).await
                && error_code(&reply) == Some(ErrorCode::TooLarge)
            {
                too_large += 1;
            }
        }
        println!(
            "{N} connections announcing 1 MiB before hello: RSS grew {} KiB",
            grown >> 10
        );
        // 1 MiB each would be 300 MiB; allow for allocator and runtime noise.
        assert!(grown < 48 << 20, "RSS grew {grown} bytes");
        assert_eq!(too_large, N, "each is told its frame is too large");
        srv.client("tcp").await.ping().await.unwrap();
    })
    .await;
}

/// A raw connection that has said hello over TCP.
async fn authed_tcp(srv: &ServerProc) -> Raw<TcpStream> {
    let mut r = tcp(srv).await;
    assert!(matches!(r.hello(TOKEN).await, Response::Hello(_)));
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_cut_off_and_starves_no_one() {
    let srv = ServerProc::start(&[
        "limits.write_timeout_ms=4000",
        "limits.max_queued_bytes_per_connection=\"1MiB\"",
        "limits.max_inflight_bytes=\"4MiB\"",
        "store.nvme_dir=\"\"",
    ]);
    bounded(60, async {
        let c = srv.client("tcp").await;
        let k = keys(b"slow", 64, 0); // 256 KiB a get
        put_all(&c, &k).await;
        // The stuck client pipelines gets (256 KiB each) and never reads a byte: 200 at
        // once, then more every 10 ms, so that what the server does send (what fits its
        // per-connection queue; the rest is answered busy) surely outgrows the sockets'
        // buffers, however fast the server drains into them, and its writer stalls.
        let stuck = authed_tcp(&srv).await;
        let (mut stuck_rd, mut stuck_wr) = stuck.s.into_split();
        let get = Raw::<TcpStream>::frame(
            &Request::Get(kvtier_core::protocol::KeyList { keys: k.clone() }),
            0,
            0,
        );
        for _ in 0..200 {
            if stuck_wr.write_all(&get).await.is_err() {
                break;
            }
        }
        let pusher = tokio::spawn(async move {
            for _ in 0..2000 {
                if stuck_wr.write_all(&get).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let stalled = Instant::now();
        // Meanwhile another client's gets are served, not answered busy (the server's send
        // budget is 4 MiB: without a per-connection bound the stuck client would hold it).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let until = Instant::now() + Duration::from_secs(2);
        let mut served = 0;
        while Instant::now() < until {
            assert_eq!(
                get_verified(&c, &k).await,
                64,
                "starved by a client that never reads"
            );
            served += 1;
        }
        assert!(served > 0);
        // Past the write timeout its connection is closed: what it finds is finite.
        tokio::time::sleep(
            (stalled + Duration::from_secs(5)).saturating_duration_since(Instant::now()),
        )
        .await;
        let mut sink = Vec::new();
        let drained =
            tokio::time::timeout(Duration::from_secs(10), stuck_rd.read_to_end(&mut sink)).await;
        pusher.abort();
        assert!(
            drained.is_ok(),
            "the server kept a client that did not read for longer than the write timeout"
        );
        assert!(metric(&srv, "kvtier_timeouts_total").await >= 1);
        assert_eq!(get_verified(&c, &k).await, 64);
        assert_eq!(srv.stats().await["connections"], 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_refuses_cleanly_and_recovers() {
    let srv = ServerProc::start_with_nofile(
        64,
        &[
            "store.nvme_dir=\"\"",
            "limits.hello_timeout_ms=60000",
            "limits.max_pre_hello_connections=1000",
        ],
    );
    bounded(60, async {
        // More connections than the server has descriptors for.
        let mut held = Vec::new();
        let mut refused = 0;
        for _ in 0..100 {
            let Ok(s) = UnixStream::connect(&srv.unix).await else {
                continue;
            };
            let mut r = Raw::new(s);
            // Each is either kept (waiting for its hello) or told "busy" and closed: none
            // hangs in the backlog.
            match tokio::time::timeout(Duration::from_millis(300), r.recv()).await {
                Ok(Some((h, reply, _))) => {
                    assert_eq!(h.opcode, 0);
                    assert_eq!(error_code(&reply), Some(ErrorCode::Busy));
                    assert!(
                        error_message(&reply).contains("file descriptors"),
                        "{reply:?}"
                    );
                    refused += 1;
                }
                Ok(None) => panic!("closed without a word"),
                Err(_) => held.push(r),
            }
        }
        assert!(refused > 0, "the limit was never reached");
        assert!(held.len() > 10, "only {} kept", held.len());
        // The held ones are real connections: one says hello and is served.
        assert!(matches!(held[0].hello("").await, Response::Hello(_)));
        // Freed descriptors are used again.
        drop(held);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let ok = match Client::connect(&srv.unix_url(), ClientConfig::default()).await {
                Ok(c) => c.ping().await.is_ok(),
                Err(_) => false,
            };
            if ok {
                break;
            }
            assert!(
                Instant::now() < until,
                "no recovery after descriptors came free"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let n = metric(&srv, "kvtier_connection_refusals_total{reason=\"no_fds\"}").await;
        assert!(n >= refused as u64, "{n} < {refused}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_is_bounded() {
    let srv = ServerProc::start(&[
        "limits.admin_max_connections=4",
        "limits.admin_timeout_ms=800",
    ]);
    bounded(60, async {
        let mut idle = Vec::new();
        for _ in 0..4 {
            idle.push(TcpStream::connect(srv.admin).await.unwrap());
        }
        // A fifth is closed at once.
        let mut fifth = TcpStream::connect(srv.admin).await.unwrap();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(2), fifth.read(&mut b)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
        // The idle ones are closed at the header timeout.
        for s in &mut idle {
            let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await;
            assert!(
                matches!(r, Ok(Ok(0)) | Ok(Err(_))),
                "idle admin connection kept: {r:?}"
            );
        }
        // One that sends half a request is closed too.
        let mut half = TcpStream::connect(srv.admin).await.unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut sink = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(5), half.read_to_end(&mut sink)).await;
        assert!(r.is_ok(), "a slow request's connection was kept");
        assert_eq!(http_get(srv.admin, "/health").await.0, 200);
        assert!(metric(&srv, "kvtier_connection_refusals_total{reason=\"admin\"}").await >= 1);
    })
    .await;
}

//! Malformed input: each bad client gets an error or loses its own connection, and the
//! server keeps serving everyone else.

use std::time::Duration;

use kvtier_core::protocol::{ErrorCode, Header, KeyList, PutEntry, Request, Response};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};

use crate::common::*;

async fn tcp(srv: &ServerProc) -> Raw<TcpStream> {
    let mut r = Raw::new(TcpStream::connect(srv.tcp).await.unwrap());
    assert!(matches!(r.hello(TOKEN).await, Response::Hello(_)));
    r
}

/// A well-behaved client that must keep being served while others misbehave.
async fn still_serving(srv: &ServerProc, bystander: &kvtier_client::Client) {
    bystander
        .ping()
        .await
        .expect("the server stopped serving others");
    let k = keys(b"bystander", 2, 0);
    assert_eq!(get_verified(bystander, &k).await, 2);
    let _ = srv;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_refused_and_others_keep_being_served() {
    let srv = ServerProc::start(&["limits.max_keys=4096"]);
    bounded(120, async {
        let bystander = srv.client("unix").await;
        put_all(&bystander, &keys(b"bystander", 2, 0)).await;

        // Wrong magic: an error frame, then the connection is closed.
        let mut r = tcp(&srv).await;
        let mut f = Raw::<TcpStream>::frame(&Request::Ping, 9, 0);
        f[0..4].copy_from_slice(b"HTTP");
        r.s.write_all(&f).await.unwrap();
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadRequest), "{resp:?}");
        assert!(r.closed_within(5).await);
        still_serving(&srv, &bystander).await;

        // Oversized metadata length: refused before reading it, connection closed.
        let mut r = tcp(&srv).await;
        let mut h = Header::request(kvtier_core::protocol::Opcode::Lookup, 3, 0, 0);
        h.meta_len = u32::MAX;
        r.s.write_all(&h.encode()).await.unwrap();
        let (hh, resp, _) = r.recv().await.unwrap();
        assert_eq!(hh.request_id, 3);
        assert_eq!(error_code(&resp), Some(ErrorCode::TooLarge));
        assert!(r.closed_within(5).await);

        // Oversized payload length.
        let mut r = tcp(&srv).await;
        let h = Header::request(kvtier_core::protocol::Opcode::Put, 4, 0, u64::MAX);
        r.s.write_all(&h.encode()).await.unwrap();
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::TooLarge));
        assert!(r.closed_within(5).await);

        // Unknown opcode: answered, and the connection stays usable.
        let mut r = tcp(&srv).await;
        let mut f = Raw::<TcpStream>::frame(&Request::Ping, 5, 0);
        f[6] = 200;
        r.s.write_all(&f).await.unwrap();
        let (hh, resp, _) = r.recv().await.unwrap();
        assert_eq!(
            (hh.request_id, error_code(&resp)),
            (5, Some(ErrorCode::UnknownOp))
        );
        r.send(&Request::Ping, &[]).await;
        assert!(matches!(r.recv().await.unwrap().1, Response::Pong));

        // A put whose payload disagrees with the layout: refused, connection usable.
        let k = keys(b"badput", 1, 0);
        let put = Request::Put(vec![PutEntry {
            key: k[0],
            parent: None,
        }]);
        r.send(&put, &vec![1u8; BLOCK - 1]).await;
        let resp = r.recv().await.unwrap().1;
        assert_eq!(error_code(&resp), Some(ErrorCode::BadRequest), "{resp:?}");
        r.send(&Request::Ping, &[]).await;
        assert!(matches!(r.recv().await.unwrap().1, Response::Pong));
        assert_eq!(bystander.lookup(&k).await.tiers.len(), 0, "nothing stored");

        // Metadata that does not decode: refused, connection usable.
        let mut f = Raw::<TcpStream>::frame(&Request::Release { lease_id: 1 }, 6, 0);
        f.truncate(f.len() - 3);
        f[16..20].copy_from_slice(&5u32.to_le_bytes());
        r.s.write_all(&f).await.unwrap();
        let (hh, resp, _) = r.recv().await.unwrap();
        assert_eq!(
            (hh.request_id, error_code(&resp)),
            (6, Some(ErrorCode::BadRequest))
        );

        // A lookup of a million keys: over every limit, refused; the server survives.
        let mut r = tcp(&srv).await;
        let million = Request::Lookup(KeyList {
            keys: vec![kvtier_core::BlockKey::from_u128(1); 1_000_000],
        });
        let f = Raw::<TcpStream>::frame(&million, 7, 0);
        let _ = r.s.write_all(&f).await; // the server may close before reading it all
        if let Some((_, resp, _)) = r.recv().await {
            assert_eq!(error_code(&resp), Some(ErrorCode::TooLarge), "{resp:?}");
        }
        assert!(r.closed_within(5).await);
        // Within the metadata limit but over the key limit: refused, connection kept.
        let srv_keys = Request::Lookup(KeyList {
            keys: vec![kvtier_core::BlockKey::from_u128(1); 5000],
        });
        let mut r = tcp(&srv).await;
        let f = Raw::<TcpStream>::frame(&srv_keys, 8, 0);
        r.s.write_all(&f).await.unwrap();
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::TooLarge), "{resp:?}");

        // Truncated frame then hang up.
        let mut s = UnixStream::connect(&srv.unix).await.unwrap();
        let f = Raw::<UnixStream>::frame(&Request::Ping, 1, 0);
        s.write_all(&f[..10]).await.unwrap();
        drop(s);

        // A response frame sent as a request.
        let mut r = tcp(&srv).await;
        let mut f = Raw::<TcpStream>::frame(&Request::Ping, 11, 0);
        f[7] = kvtier_core::protocol::flags::RESPONSE;
        r.s.write_all(&f).await.unwrap();
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadRequest));
        // After hello the connection stays; before hello, any error ends it
        // (docs/protocol.md).
        r.send(&Request::Ping, &[]).await;
        assert!(matches!(r.recv().await.unwrap().1, Response::Pong));
        let mut r = Raw::new(TcpStream::connect(srv.tcp).await.unwrap());
        r.s.write_all(&f).await.unwrap();
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadRequest));
        assert!(r.closed_within(5).await);

        still_serving(&srv, &bystander).await;
        let st = srv.stats().await;
        assert!(st["bad_frames"].as_u64().unwrap() >= 6, "{st}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_one_byte_a_second_is_cut_off() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let bystander = srv.client("tcp").await;
        put_all(&bystander, &keys(b"bystander", 2, 0)).await;
        let mut r = tcp(&srv).await;
        let f = Raw::<TcpStream>::frame(&Request::Ping, 1, 0);
        let mut cut = false;
        for b in f {
            if r.s.write_all(&[b]).await.is_err() {
                cut = true;
                break;
            }
            // Meanwhile everyone else is served.
            still_serving(&srv, &bystander).await;
            tokio::time::sleep(Duration::from_millis(1000)).await;
        }
        // frame_timeout is 1.5 s in these tests: the frame never completes.
        assert!(cut || r.closed_within(5).await);
        let st = srv.stats().await;
        assert!(st["connections"].as_u64().unwrap() >= 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_budget_answers_busy_instead_of_queueing() {
    // Room for one block in flight: a get of two can never fit and is told so.
    let srv = ServerProc::start(&["limits.max_inflight_bytes=4096"]);
    bounded(60, async {
        let c = srv.client("tcp").await;
        let k = keys(b"busy", 2, 0);
        put_all(&c, &k).await;
        let mut bufs = [vec![0u8; BLOCK], vec![0u8; BLOCK]];
        let [a, b] = &mut bufs;
        let f = c.get_into(&k, &mut [&mut a[..], &mut b[..]]).await;
        assert_eq!(f.miss, Some(kvtier_client::Miss::Busy), "{f:?}");
        assert_eq!(get_verified(&c, &k[..1]).await, 1);
        assert!(srv.stats().await["busy"].as_u64().unwrap() >= 1);
    })
    .await;
}

/// A raw protocol stream over QUIC (one bidirectional stream), the way the SDK opens one.
/// Returns the endpoint and connection too: they must outlive the stream.
async fn quic_raw(
    srv: &ServerProc,
) -> (
    Raw<tokio::io::Join<quinn::RecvStream, quinn::SendStream>>,
    quinn::Endpoint,
    quinn::Connection,
) {
    let (ep, conn) = quic_handshake(srv).await;
    let (send, recv) = conn.open_bi().await.unwrap();
    (Raw::new(tokio::io::join(recv, send)), ep, conn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_refuses_bad_frames_and_keeps_serving() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let bystander = srv.client("tcp").await;
        put_all(&bystander, &keys(b"bystander", 2, 0)).await;
        // Unix socket: unknown opcode answered, then wrong magic closes.
        let mut u = Raw::new(UnixStream::connect(&srv.unix).await.unwrap());
        assert!(matches!(u.hello("").await, Response::Hello(_)));
        let mut f = Raw::<UnixStream>::frame(&Request::Ping, 2, 0);
        f[6] = 99;
        u.s.write_all(&f).await.unwrap();
        assert_eq!(
            error_code(&u.recv().await.unwrap().1),
            Some(ErrorCode::UnknownOp)
        );
        let mut f = Raw::<UnixStream>::frame(&Request::Ping, 3, 0);
        f[0] = 0;
        u.s.write_all(&f).await.unwrap();
        assert_eq!(
            error_code(&u.recv().await.unwrap().1),
            Some(ErrorCode::BadRequest)
        );
        assert!(u.closed_within(5).await);
        still_serving(&srv, &bystander).await;
        // QUIC: the same.
        let (mut q, _ep, _conn) = quic_raw(&srv).await;
        assert!(matches!(q.hello(TOKEN).await, Response::Hello(_)));
        let mut f = Raw::<UnixStream>::frame(&Request::Ping, 4, 0);
        f[6] = 77;
        q.s.write_all(&f).await.unwrap();
        assert_eq!(
            error_code(&q.recv().await.unwrap().1),
            Some(ErrorCode::UnknownOp)
        );
        q.send(&Request::Ping, &[]).await;
        assert!(matches!(q.recv().await.unwrap().1, Response::Pong));
        let mut h = Header::request(kvtier_core::protocol::Opcode::Get, 5, 0, 0);
        h.meta_len = 64 << 20;
        q.s.write_all(&h.encode()).await.unwrap();
        assert_eq!(
            error_code(&q.recv().await.unwrap().1),
            Some(ErrorCode::TooLarge)
        );
        assert!(q.closed_within(5).await);
        // QUIC without the token.
        let (mut q, _ep2, _conn2) = quic_raw(&srv).await;
        assert_eq!(
            error_code(&q.hello("nope").await),
            Some(ErrorCode::Unauthorized)
        );
        still_serving(&srv, &bystander).await;
    })
    .await;
}

/// NO_REPLY is honoured by release and abort only, and never hides an error
/// (docs/protocol.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reply_is_honoured_by_release_and_abort_only() {
    use kvtier_core::protocol::flags::NO_REPLY;
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("tcp").await;
        let k = keys(b"noreply", 2, 0);
        put_all(&c, &k).await;
        let mut r = tcp(&srv).await;
        let send = |req: Request, id: u64| {
            let mut f = Raw::<TcpStream>::frame(&req, id, 0);
            f[7] = NO_REPLY;
            f
        };
        // A ping with NO_REPLY is answered anyway.
        r.s.write_all(&send(Request::Ping, 1)).await.unwrap();
        let (h, resp, _) = r.recv().await.unwrap();
        assert_eq!((h.request_id, matches!(resp, Response::Pong)), (1, true));
        // A release of a lease this connection does not hold: the error still comes.
        r.s.write_all(&send(Request::Release { lease_id: 999 }, 2))
            .await
            .unwrap();
        let (h, resp, _) = r.recv().await.unwrap();
        assert_eq!(
            (h.request_id, error_code(&resp)),
            (2, Some(ErrorCode::NotFound))
        );
        // A release that succeeds sends nothing: the next frame is the ping's.
        r.send(
            &Request::Pin {
                keys: k.clone(),
                lease_ms: 10_000,
            },
            &[],
        )
        .await;
        let lease = match r.recv().await.unwrap().1 {
            Response::Pin(p) => p.lease_id,
            other => panic!("{other:?}"),
        };
        assert_ne!(lease, 0);
        r.s.write_all(&send(Request::Release { lease_id: lease }, 4))
            .await
            .unwrap();
        r.s.write_all(&Raw::<TcpStream>::frame(&Request::Ping, 5, 0))
            .await
            .unwrap();
        let (h, resp, _) = r.recv().await.unwrap();
        assert_eq!((h.request_id, matches!(resp, Response::Pong)), (5, true));
        assert_eq!(srv.stats().await["leases_open"], 0);
    })
    .await;
}

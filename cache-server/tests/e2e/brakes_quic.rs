//! QUIC connections before their hello, an attack that must fail against the real binary:
//! handshaken connections that open no stream (QUIC's keep-alive would hold them for ever) are
//! counted before hello from their first packet and closed at the hello deadline.

use std::time::{Duration, Instant};

use kvtier_core::protocol::{ErrorCode, Response};
use tokio::net::TcpStream;

use crate::brakes::metric;
use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_connections_without_a_stream_are_counted_and_closed() {
    let srv = ServerProc::start(&[
        "limits.max_pre_hello_connections=8",
        "limits.hello_timeout_ms=2000",
    ]);
    bounded(60, async {
        // Eight handshaken connections that never open a stream.
        let mut silent = Vec::new();
        for _ in 0..8 {
            silent.push(quic_handshake(&srv).await);
        }
        let started = Instant::now();
        assert_eq!(srv.stats().await["connections_pre_hello"], 8);
        // They hold the places before hello: a ninth QUIC connection is refused, and so is
        // a TCP one.
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(srv.cert()))
            .unwrap();
        let cc = quinn::ClientConfig::with_root_certificates(std::sync::Arc::new(roots)).unwrap();
        let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let ninth = ep.connect_with(cc, srv.quic, "localhost").unwrap().await;
        assert!(ninth.is_err(), "a ninth connection before hello was let in");
        let mut t = Raw::new(TcpStream::connect(srv.tcp).await.unwrap());
        let (h, reply, _) = t.recv().await.expect("the unsolicited refusal");
        assert_eq!(h.opcode, 0);
        assert_eq!(error_code(&reply), Some(ErrorCode::Busy));
        // Each is closed at the hello deadline.
        for (_, c) in &silent {
            tokio::time::timeout(Duration::from_secs(5), c.closed())
                .await
                .expect("a QUIC connection without a stream outlived its hello deadline");
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(srv.stats().await["connections_pre_hello"], 0);
        assert!(metric(&srv, "kvtier_timeouts_total").await >= 8);
        // A real client gets in.
        srv.client("quic").await.ping().await.unwrap();
        // A connection whose only stream has ended waits as one before hello again: it must
        // open a new stream in time, else it is closed.
        let (_ep, c) = quic_handshake(&srv).await;
        let (send, recv) = c.open_bi().await.unwrap();
        let mut r = Raw::new(tokio::io::join(recv, send));
        assert!(matches!(r.hello(TOKEN).await, Response::Hello(_)));
        drop(r);
        let ended = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), c.closed())
            .await
            .expect("a QUIC connection with no stream left was kept");
        assert!(
            ended.elapsed() >= Duration::from_millis(1500),
            "closed before its deadline"
        );
        srv.client("quic").await.ping().await.unwrap();
    })
    .await;
}

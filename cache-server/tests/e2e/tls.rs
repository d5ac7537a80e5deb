//! TLS over TCP (`server.tls`, `tls://`): a round trip whose token never crosses the wire in
//! clear, a client that trusts another certificate, a plaintext client on the TLS port,
//! handshakes that stall, and plain TCP off loopback refused at startup.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig, ClientError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

/// A counter of the server's /metrics.
async fn metric(srv: &ServerProc, series: &str) -> u64 {
    let body = http_get(srv.admin, "/metrics").await.1;
    let line = body
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no {series} in /metrics"));
    line[series.len()..].trim().parse().unwrap()
}

/// A TCP proxy on loopback to `to` that keeps every byte it forwards, both ways. Returns
/// its address and the bytes; its task ends with the test's runtime.
async fn recording_proxy(to: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = seen.clone();
    tokio::spawn(async move {
        while let Ok((a, _)) = l.accept().await {
            let b = TcpStream::connect(to).await.unwrap();
            let (ar, aw) = a.into_split();
            let (br, bw) = b.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(ar) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(bw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(br), Box::new(aw)),
            ] {
                let rec = rec.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        rec.lock().unwrap().extend_from_slice(&buf[..n]);
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = w.shutdown().await;
                });
            }
        }
    });
    (addr, seen)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn tls_config(srv: &ServerProc) -> ClientConfig {
    ClientConfig::default()
        .token(TOKEN)
        .server_cert_der(srv.cert())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_round_trip_never_shows_the_token_or_the_blocks_on_the_wire() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        // Through a proxy that records what crosses the wire.
        let (via, seen) = recording_proxy(srv.tls).await;
        let c = Client::connect(&format!("tls://{via}"), tls_config(&srv))
            .await
            .unwrap();
        assert!(!c.is_local());
        let k = keys(b"tls", 8, 0);
        put_all(&c, &k).await;
        assert_eq!(get_verified(&c, &k).await, 8);
        drop(c);
        let wire = seen.lock().unwrap().clone();
        assert!(wire.len() > 8 * BLOCK, "the blocks went through the proxy");
        assert!(
            !contains(&wire, TOKEN.as_bytes()),
            "the token crossed in clear"
        );
        assert!(
            !contains(&wire, &block_data(k[0])[..64]),
            "a block crossed in clear"
        );
        assert!(!contains(&wire, b"KVT1"), "a kvtier frame crossed in clear");
        // The same capture over plain TCP does show the token: the check can fail.
        let (via, seen) = recording_proxy(srv.tcp).await;
        let c = Client::connect(
            &format!("tcp://{via}"),
            ClientConfig::default().token(TOKEN),
        )
        .await
        .unwrap();
        c.ping().await.unwrap();
        drop(c);
        assert!(contains(&seen.lock().unwrap(), TOKEN.as_bytes()));
        // The token is still required inside TLS.
        let e = Client::connect(
            &srv.tls_url(),
            ClientConfig::default()
                .token("wrong-token")
                .server_cert_der(srv.cert()),
        )
        .await
        .err()
        .expect("tls with a wrong token");
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
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trusts_another_certificate_or_none_is_refused() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let e = Client::connect(
            &srv.tls_url(),
            ClientConfig::default()
                .token(TOKEN)
                .server_cert_der(other.cert.der().to_vec()),
        )
        .await
        .err()
        .expect("tls with the wrong certificate");
        let msg = e.to_string();
        assert!(matches!(e, ClientError::Connect(_)), "{e}");
        assert!(
            msg.contains("TLS handshake") && msg.contains("server_cert_der"),
            "{msg}"
        );
        // The right certificate under another name is refused too.
        let e = Client::connect(&srv.tls_url(), tls_config(&srv).server_name("kv.example"))
            .await
            .err()
            .expect("tls with a name the certificate does not carry");
        assert!(e.to_string().contains("TLS handshake"), "{e}");
        // No certificate at all: said before any connection is tried.
        let e = Client::connect(&srv.tls_url(), ClientConfig::default().token(TOKEN))
            .await
            .err()
            .expect("tls without a certificate to trust");
        assert!(
            e.to_string().contains("server_cert_der") && e.to_string().contains("system roots"),
            "{e}"
        );
        // The server counted the two failed handshakes and serves on.
        let until = Instant::now() + Duration::from_secs(5);
        while metric(&srv, "kvtier_tls_handshake_failures_total").await < 2 {
            assert!(Instant::now() < until, "handshake failures not counted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let c = Client::connect(&srv.tls_url(), tls_config(&srv))
            .await
            .unwrap();
        c.ping().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_on_the_tls_port_is_told_and_the_server_serves_on() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        // The SDK over plain TCP to the TLS port: refused, saying what to use.
        let e = Client::connect(
            &format!("tcp://{}", srv.tls),
            ClientConfig::default().token(TOKEN),
        )
        .await
        .err()
        .expect("plain TCP on the TLS port");
        assert!(
            matches!(
                &e,
                ClientError::Server {
                    code: Some(ErrorCode::Unauthorized),
                    message
                } if message.contains("tls://")
            ),
            "{e}"
        );
        // Bytes that are neither TLS nor kvtier: closed.
        let mut s = TcpStream::connect(srv.tls).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut r = Raw::new(s);
        assert!(r.closed_within(5).await);
        // And a TLS client on the plain TCP port fails its handshake, cleanly.
        let e = Client::connect(&format!("tls://{}", srv.tcp), tls_config(&srv))
            .await
            .err()
            .expect("TLS on the plain TCP port");
        assert!(matches!(e, ClientError::Connect(_)), "{e}");
        assert!(metric(&srv, "kvtier_tls_handshake_failures_total").await >= 2);
        for t in ["tls", "tcp"] {
            srv.client(t).await.ping().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_is_cut_at_the_hello_timeout() {
    let srv = ServerProc::start(&[
        "limits.hello_timeout_ms=1000",
        "limits.max_pre_hello_connections=2",
    ]);
    bounded(60, async {
        let started = Instant::now();
        // Silent, and half a ClientHello: each holds a place before hello.
        let mut stalled = Vec::new();
        for first in [&b""[..], &[0x16, 0x03, 0x01][..]] {
            let mut s = TcpStream::connect(srv.tls).await.unwrap();
            s.write_all(first).await.unwrap();
            stalled.push(Raw::new(s));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(srv.stats().await["connections_pre_hello"], 2);
        // A third is refused at once: stalled handshakes count against the cap.
        let mut third = Raw::new(TcpStream::connect(srv.tls).await.unwrap());
        assert!(third.closed_within(1).await, "over the pre-hello cap");
        for r in &mut stalled {
            assert!(
                r.closed_within(5).await,
                "a stalled handshake outlived its timeout"
            );
        }
        let took = started.elapsed();
        assert!(
            (Duration::from_millis(900)..Duration::from_secs(4)).contains(&took),
            "{took:?}"
        );
        // Half a kvtier magic, then nothing: cut too.
        let mut part = TcpStream::connect(srv.tls).await.unwrap();
        part.write_all(b"KV").await.unwrap();
        assert!(Raw::new(part).closed_within(5).await);
        assert_eq!(srv.stats().await["connections_pre_hello"], 0);
        assert!(metric(&srv, "kvtier_tls_handshake_failures_total").await >= 3);
        srv.client("tls").await.ping().await.unwrap();
    })
    .await;
}

#[test]
fn plain_tcp_off_loopback_needs_tcp_plaintext() {
    let tmp = tempfile::tempdir().unwrap();
    let (status, err) = ServerProc::refused_in(tmp.path(), &["server.tcp=\"0.0.0.0:0\""]);
    assert!(!status.success(), "it started: {err}");
    for says in [
        "server.tcp",
        "in clear",
        "server.tls",
        "server.tcp_plaintext = true",
    ] {
        assert!(err.contains(says), "{says:?} missing from: {err}");
    }
    // Said explicitly, it starts, and serves plain TCP with the token.
    let srv = ServerProc::start(&["server.tcp=\"0.0.0.0:0\"", "server.tcp_plaintext=true"]);
    assert!(srv.tcp.ip().is_unspecified(), "{}", srv.tcp);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bounded(30, async {
            let c = Client::connect(
                &format!("tcp://127.0.0.1:{}", srv.tcp.port()),
                ClientConfig::default().token(TOKEN),
            )
            .await
            .unwrap();
            c.ping().await.unwrap();
        }));
}

/// A rustls client trusting the server's certificate, offering `alpn`.
fn raw_tls(srv: &ServerProc, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(srv.cert()))
        .unwrap();
    let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_is_kvtier_and_a_silent_tls_client_is_cut_at_the_hello_deadline() {
    let srv = ServerProc::start(&["limits.hello_timeout_ms=1000"]);
    bounded(60, async {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        // Another protocol only: refused in the handshake.
        let tcp = TcpStream::connect(srv.tls).await.unwrap();
        let e = raw_tls(&srv, &[b"h2"])
            .connect(name.clone(), tcp)
            .await
            .expect_err("a handshake offering only h2");
        assert!(e.to_string().contains("NoApplicationProtocol"), "{e}");
        // kvtier/1 is chosen; then a client that says nothing is closed at the hello
        // deadline, which the handshake's time counts against.
        let started = Instant::now();
        let tcp = TcpStream::connect(srv.tls).await.unwrap();
        let mut s = raw_tls(&srv, &[b"other", kvtier_core::protocol::TLS_ALPN])
            .connect(name, tcp)
            .await
            .unwrap();
        assert_eq!(
            s.get_ref().1.alpn_protocol(),
            Some(kvtier_core::protocol::TLS_ALPN)
        );
        let mut b = [0u8; 1];
        let end = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await;
        assert!(
            matches!(end, Ok(Ok(0)) | Ok(Err(_))),
            "still open after its hello deadline: {end:?}"
        );
        let took = started.elapsed();
        assert!(
            (Duration::from_millis(900)..Duration::from_secs(3)).contains(&took),
            "{took:?}"
        );
        assert_eq!(srv.stats().await["connections_pre_hello"], 0);
        assert!(metric(&srv, "kvtier_timeouts_total").await >= 1);
    })
    .await;
}

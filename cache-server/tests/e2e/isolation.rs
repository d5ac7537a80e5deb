//! Tenant isolation and authentication.

use std::time::Duration;

use kvtier_client::{Client, ClientConfig, ClientError, ErrorCode};
use kvtier_core::protocol::{Request, Response};
use tokio::net::TcpStream;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salts_never_share_blocks_on_any_tier_or_after_restart() {
    // DRAM holds 16 blocks: 48 per tenant push most of them down to NVMe.
    let srv = ServerProc::start(&["store.dram_bytes=\"64KiB\""]);
    bounded(120, async {
        let c = srv.client("unix").await;
        let (a, b) = (keys(b"tenant-a", 48, 0), keys(b"tenant-b", 48, 0));
        assert_ne!(a[0], b[0], "same tokens, different salts: different keys");
        for chunk in a.chunks(8) {
            let d: Vec<Vec<u8>> = chunk.iter().map(|k| block_data(*k)).collect();
            let bufs: Vec<&[u8]> = d.iter().map(|x| x.as_slice()).collect();
            let first = a.iter().position(|k| *k == chunk[0]).unwrap();
            let parent = first.checked_sub(1).map(|p| a[p]);
            let s = c.put_chain(chunk, parent, &bufs).await;
            assert_eq!(s.cached(), chunk.len(), "{:?}", s.statuses);
            tokio::time::sleep(Duration::from_millis(20)).await; // let write-through keep up
        }
        let check = |srv: &ServerProc| {
            let url = srv.unix_url();
            let (a, b) = (a.clone(), b.clone());
            async move {
                let c = Client::connect(&url, ClientConfig::default())
                    .await
                    .unwrap();
                let la = c.lookup(&a).await;
                if la.tiers.len() != 48 {
                    eprintln!("{la:?}\n{}", c.stats().await.unwrap());
                }
                assert_eq!(la.tiers.len(), 48, "same salt hits");
                assert!(
                    la.tiers.contains(&kvtier_client::TierCode::Nvme),
                    "{:?}",
                    la.tiers
                );
                assert_eq!(c.lookup(&b).await.tiers.len(), 0, "other salt misses");
                assert_eq!(get_verified(&c, &b).await, 0);
                assert_eq!(get_verified(&c, &a).await, 48);
            }
        };
        check(&srv).await;
        let srv = srv.restart();
        check(&srv).await;
        // And over TCP, by the other tenant.
        let t = srv.client("tcp").await;
        assert_eq!(t.lookup(&b).await.tiers.len(), 0);
        assert_eq!(t.lookup(&a).await.tiers.len(), 48);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_tcp_and_quic_clients_are_refused() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        for token in ["", "wrong-token"] {
            let e = Client::connect(&srv.tcp_url(), ClientConfig::default().token(token))
                .await
                .err()
                .expect("tcp without the token");
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
            let e = Client::connect(
                &srv.quic_url(),
                ClientConfig::default()
                    .token(token)
                    .quic_cert_der(srv.cert()),
            )
            .await
            .err()
            .expect("quic without the token");
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
        // QUIC with a certificate that is not the server's: TLS fails.
        let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let e = Client::connect(
            &srv.quic_url(),
            ClientConfig::default()
                .token(TOKEN)
                .quic_cert_der(other.cert.der().to_vec()),
        )
        .await
        .err()
        .expect("quic with the wrong certificate");
        assert!(matches!(e, ClientError::Connect(_)), "{e}");
        // A request before the hello: refused and closed.
        let mut r = Raw::new(TcpStream::connect(srv.tcp).await.unwrap());
        r.send(&Request::Stats, &[]).await;
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::Unauthorized));
        assert!(r.closed_within(5).await);
        // The local socket needs no token, but only its owner may open it.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&srv.unix).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "socket mode {mode:o}");
        let mut r = Raw::new(tokio::net::UnixStream::connect(&srv.unix).await.unwrap());
        assert!(matches!(r.hello("").await, Response::Hello(_)));
        assert!(srv.stats().await["auth_failures"].as_u64().unwrap() >= 5);
        // A client whose block size differs is refused by name.
        let e = Client::connect(&srv.unix_url(), ClientConfig::default().block_bytes(8192))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(
                e,
                ClientError::Server {
                    code: Some(ErrorCode::LayoutMismatch),
                    ..
                }
            ),
            "{e}"
        );
    })
    .await;
}

//! An expired reservation can never be written by its late client: its commit is refused,
//! and its DRAM slots are reused at once (the client only ever wrote its own staging
//! region, never the arena).

use std::time::Duration;

use kvtier_core::protocol::{ErrorCode, Hello, PutEntry, Request, Response};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_reservation_is_refused_and_its_slots_freed() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let keys = keys(b"expired", 2, 0);
        let mut r = Raw::new(tokio::net::UnixStream::connect(&srv.unix).await.unwrap());
        r.send(
            &Request::Hello(Hello {
                min_version: kvtier_core::protocol::VERSION,
                max_version: kvtier_core::protocol::VERSION,
                client: "late".into(),
                token: String::new(),
                block_bytes: 0,
                want_arena: true,
            }),
            &[],
        )
        .await;
        // The arena's fds ride with the reply; this test never uses them.
        assert!(matches!(r.recv().await.unwrap().1, Response::Hello(_)));
        let entries = vec![
            PutEntry {
                key: keys[0],
                parent: None,
            },
            PutEntry {
                key: keys[1],
                parent: Some(keys[0]),
            },
        ];
        r.send(
            &Request::Reserve {
                entries,
                lease_ms: 1,
            },
            &[],
        )
        .await;
        let Response::Reserve(p) = r.recv().await.unwrap().1 else {
            panic!("reserve refused");
        };
        assert_ne!(p.reservation_id, 0);
        // Past the 1 ms lease (the server may or may not have reaped it yet: both refuse).
        tokio::time::sleep(Duration::from_millis(50)).await;
        r.send(
            &Request::Commit {
                reservation_id: p.reservation_id,
            },
            &[],
        )
        .await;
        let (_, resp, _) = r.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::NotFound), "{resp:?}");
        // Nothing was stored, and nobody waits for the keys...
        let c = srv.client("tcp").await;
        assert_eq!(c.lookup(&keys).await.tiers.len(), 0);
        // ... and both slots are free again while the late client's connection is still
        // open: it could never write them.
        let mut st = serde_json::Value::Null;
        for _ in 0..200 {
            st = srv.stats().await;
            if st["store"]["tiers"][0]["pins_outstanding"] == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(st["reservations_open"], 0, "{st}");
        assert_eq!(st["store"]["tiers"][0]["pins_outstanding"], 0, "{st}");
        drop(r);
    })
    .await;
}

//! Every SDK operation over every transport.

use std::time::Duration;

use kvtier_client::{Client, EventItem, EventKind, Miss, PutStatus, TierCode};
use kvtier_core::protocol::{Request, Response};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_over_every_transport() {
    let srv = ServerProc::start(&[]);
    bounded(120, async {
        for (i, (name, url, cfg)) in srv.transports().into_iter().enumerate() {
            let c = Client::connect(&url, cfg).await.unwrap();
            assert_eq!(c.block_bytes(), BLOCK);
            assert_eq!(c.is_local(), name == "unix", "{name}");
            c.ping().await.unwrap();
            let keys = keys(b"sdk", 24, i as u32);
            assert_eq!(c.lookup(&keys).await.tiers.len(), 0);
            put_all(&c, &keys[..16]).await;
            // A second put of the same blocks is "already present", not an error.
            let again = c
                .put_chain(
                    &keys[..2],
                    None,
                    &[&block_data(keys[0]), &block_data(keys[1])],
                )
                .await;
            assert_eq!(again.statuses, vec![PutStatus::AlreadyPresent; 2]);
            let l = c.lookup(&keys).await;
            assert_eq!(l.tiers.len(), 16, "{name}");
            assert_eq!(l.miss, Some(Miss::NotCached));
            assert_eq!(get_verified(&c, &keys).await, 16, "{name}");
            // Every transport sees blocks stored through another (the unix round removed
            // its 16th block).
            if i > 0 {
                let earlier = crate::common::keys(b"sdk", 24, 0);
                assert_eq!(get_verified(&c, &earlier[..16]).await, 15, "{name}");
            }
            let (lease, tiers) = c.pin(&keys[..4], Duration::from_secs(5)).await.unwrap();
            assert_ne!(lease, 0);
            assert_eq!(tiers, vec![TierCode::Dram; 4]);
            c.release(lease).await.unwrap();
            assert!(c.release(lease).await.is_err(), "a lease is released once");
            assert_eq!(c.remove(&keys[15..16]).await.unwrap(), 1);
            assert_eq!(c.lookup(&keys).await.tiers.len(), 15);
            let _ = c.prefetch(&keys).await.unwrap();
            let stats: serde_json::Value = serde_json::from_str(&c.stats().await.unwrap()).unwrap();
            assert_eq!(stats["block_bytes"], BLOCK);
            // Wrong-size buffers are the caller's bug: a refusal, not a crash.
            let mut small = [0u8; 10];
            let f = c.get_into(&keys[..1], &mut [&mut small[..]]).await;
            assert!(matches!(f.miss, Some(Miss::Refused(_))), "{f:?}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_zero_copy_pins_lend_arena_bytes() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let keys = keys(b"zc", 8, 7);
        put_all(&c, &keys).await;
        let p = c.get_pinned(&keys, Duration::from_secs(5)).await.unwrap();
        assert_eq!(p.len(), 8);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(p.block(i), &block_data(*k)[..]);
        }
        assert_eq!(srv.stats().await["leases_open"], 1);
        drop(p);
        // The release is sent in the background.
        for _ in 0..100 {
            if srv.stats().await["leases_open"] == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(srv.stats().await["leases_open"], 0);
        let tcp = srv.client("tcp").await;
        assert!(tcp.get_pinned(&keys, Duration::from_secs(1)).await.is_err());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_report_stores_and_removals_with_sequence_numbers() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let early = keys(b"ev", 3, 1);
        put_all(&c, &early).await;
        // A snapshot first, then live events.
        let mut ev = c.events(None, true).await.unwrap();
        let start = ev.start_seq;
        let keys = keys(b"ev", 4, 2);
        put_all(&c, &keys).await;
        assert_eq!(c.remove(&keys[3..]).await.unwrap(), 1);
        let mut snap = 0;
        let mut live = Vec::new();
        while live.len() < 5 {
            let batch = tokio::time::timeout(Duration::from_secs(5), ev.next_batch())
                .await
                .unwrap()
                .unwrap();
            for item in batch {
                match item {
                    EventItem::Event(e) if e.seq == 0 => snap += 1,
                    EventItem::Event(e) => live.push(e),
                    EventItem::Gap { .. } => panic!("no gap expected"),
                }
            }
        }
        assert!(snap >= 3, "snapshot holds the earlier blocks");
        let dram_stores: Vec<_> = live
            .iter()
            .filter(|e| e.kind == EventKind::Stored as u8 && e.tier == TierCode::Dram as u8)
            .collect();
        assert_eq!(dram_stores.len(), 4);
        assert!(live.windows(2).all(|w| w[0].seq < w[1].seq));
        assert!(live[0].seq >= start);
        // Replay from a past sequence number.
        let mut again = c.events(Some(start), false).await.unwrap();
        let b = again.next_batch().await.unwrap();
        assert!(matches!(b[0], EventItem::Event(e) if e.seq == start));
        // Each stream has a connection of its own, which ends with it: one client subscribes
        // as often as it likes (a router resyncing after gaps), and the server lets go.
        drop((ev, again));
        let connections = || async { srv.stats().await["connections"].as_u64().unwrap() };
        let before = connections().await;
        for _ in 0..8 {
            let s = c.events(None, true).await.unwrap();
            drop(s);
        }
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while connections().await > before {
            assert!(
                std::time::Instant::now() < until,
                "subscriptions outlive their streams"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The server bounds subscriptions per connection: four, then busy.
        let mut raw = Raw::new(tokio::net::TcpStream::connect(srv.tcp).await.unwrap());
        assert!(matches!(raw.hello(TOKEN).await, Response::Hello(_)));
        let sub = Request::Subscribe {
            from_seq: None,
            snapshot: false,
        };
        for _ in 0..4 {
            raw.send(&sub, &[]).await;
            let (_, r, _) = raw.recv().await.unwrap();
            assert!(matches!(r, Response::Subscribed { .. }), "{r:?}");
        }
        raw.send(&sub, &[]).await;
        let (_, r, _) = raw.recv().await.unwrap();
        match r {
            Response::Error(e) => {
                assert_eq!(e.code, kvtier_core::protocol::ErrorCode::Busy as u16);
                assert!(e.message.contains("subscriptions"), "{e:?}");
            }
            r => panic!("a fifth subscription got {r:?}"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_works_without_a_runtime() {
    let srv = ServerProc::start(&[]);
    let url = srv.tcp_url();
    std::thread::spawn(move || {
        let c = kvtier_client::blocking::BlockingClient::connect(
            &url,
            kvtier_client::ClientConfig::default().token(TOKEN),
        )
        .unwrap();
        let k = keys(b"blocking", 2, 0);
        let d: Vec<Vec<u8>> = k.iter().map(|k| block_data(*k)).collect();
        let s = c.put_chain(&k, None, &[&d[0], &d[1]]);
        assert_eq!(s.cached(), 2);
        let mut a = vec![0u8; BLOCK];
        let mut b = vec![0u8; BLOCK];
        let f = c.get_into(&k, &mut [&mut a[..], &mut b[..]]);
        assert_eq!(f.blocks, 2);
        assert_eq!(a, d[0]);
        assert_eq!(c.lookup(&k).tiers.len(), 2);
    })
    .join()
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_a_miss_and_the_client_reconnects() {
    let srv = ServerProc::start(&[]);
    bounded(90, async {
        let cfg = kvtier_client::ClientConfig::default()
            .token(TOKEN)
            .timeout(Duration::from_secs(2))
            .reconnect_backoff(Duration::from_millis(100));
        let c = Client::connect(&srv.unix_url(), cfg).await.unwrap();
        let k = keys(b"reconnect", 4, 0);
        put_all(&c, &k).await;
        let srv = srv.restart();
        // The old connection is gone: the first call may miss, later ones reconnect.
        let mut found = 0;
        for _ in 0..50 {
            let l = c.lookup(&k).await;
            if l.miss.is_none() {
                found = l.tiers.len();
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            found, 4,
            "reconnected and the NVMe copies survived the restart"
        );
        assert_eq!(get_verified(&c, &k).await, 4);
        drop(srv);
        let l = c.lookup(&k).await;
        assert!(
            matches!(
                l.miss,
                Some(Miss::Disconnected | Miss::Unavailable(_) | Miss::Timeout)
            ),
            "{l:?}"
        );
    })
    .await;
}

/// A subscriber has nothing to say: its connection outlives `limits.idle_timeout_ms` and still
/// gets the events, while a connection that only said hello is closed at the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_connection_is_not_idle() {
    let srv = ServerProc::start(&["limits.idle_timeout_ms=300"]);
    bounded(60, async {
        let connect = || async {
            let mut raw = Raw::new(tokio::net::TcpStream::connect(srv.tcp).await.unwrap());
            assert!(matches!(raw.hello(TOKEN).await, Response::Hello(_)));
            raw
        };
        let mut idle = connect().await;
        let mut sub = connect().await;
        sub.send(
            &Request::Subscribe {
                from_seq: None,
                snapshot: false,
            },
            &[],
        )
        .await;
        let (_, r, _) = sub.recv().await.unwrap();
        assert!(matches!(r, Response::Subscribed { .. }), "{r:?}");
        assert!(idle.closed_within(5).await, "the idle connection is closed");
        tokio::time::sleep(Duration::from_millis(700)).await;
        let c = srv.client("unix").await;
        put_all(&c, &keys(b"quiet", 1, 1)).await;
        let (_, r, _) = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("an event within 5 s")
            .expect("the subscribed connection is open");
        assert!(matches!(r, Response::Events(_)), "{r:?}");
    })
    .await;
}

//! Retention hints through the real server: a hinted prefix survives a flood that evicts an
//! unhinted one; a hint past the budget is refused and counted; the session's return is
//! counted as honoured.

use std::time::Duration;

use kvtier_client::RetainStatus;
use kvtier_core::protocol::{ErrorCode, Request, RetainHint};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hinted_prefix_survives_a_flood_and_over_budget_is_refused() {
    // DRAM only, 1,024 blocks of 4 KiB; hints may hold 5 % of it (51 blocks).
    let srv = ServerProc::start(&["store.nvme_dir=\"\"", "store.retain_max_fraction=0.05"]);
    bounded(90, async {
        let c = srv.client("unix").await;
        let hinted = keys(b"retain", 40, 1);
        let plain = keys(b"retain", 40, 2);
        put_all(&c, &hinted).await;
        put_all(&c, &plain).await;
        let r = c
            .retain(42, &hinted, Duration::from_secs(60), 0)
            .await
            .unwrap();
        assert_eq!(r.status, Some(RetainStatus::Accepted), "{r:?}");
        assert_eq!((r.blocks, r.hold), (40, Duration::from_secs(90)));
        // A second session's hint would pass the budget (40 + 40 > 51): refused, counted.
        let r = c
            .retain(43, &plain, Duration::from_secs(60), 0)
            .await
            .unwrap();
        assert_eq!(r.status, Some(RetainStatus::OverGlobalBudget), "{r:?}");
        assert_eq!(r.blocks, 0);
        // Later than the longest hold (300 s by default): refused as not worth it.
        let r = c
            .retain(44, &plain, Duration::from_secs(301), 0)
            .await
            .unwrap();
        assert_eq!(r.status, Some(RetainStatus::TooFar), "{r:?}");
        // Flood DRAM (1,024 slots) with 1,500 other blocks.
        for seed in 10..25 {
            put_all(&c, &keys(b"flood", 100, seed)).await;
        }
        assert_eq!(
            c.lookup(&plain).await.tiers.len(),
            0,
            "the unhinted prefix is gone"
        );
        assert_eq!(
            c.lookup(&hinted).await.tiers.len(),
            40,
            "the hinted prefix stayed"
        );
        assert_eq!(get_verified(&c, &hinted).await, 40);
        let st = srv.stats().await;
        let r = &st["store"]["retain"];
        assert_eq!(r["accepted"], 1, "{r}");
        assert_eq!(r["refused_global"], 1, "{r}");
        assert_eq!(r["refused_too_far"], 1, "{r}");
        assert_eq!(r["blocks_protected"], 40, "{r}");
        assert_eq!(r["honoured"], 1, "the session's lookup came back: {r}");
        assert_eq!(r["hints"], 0, "{r}");
        let metrics = http_get(srv.admin, "/metrics").await.1;
        assert!(
            metrics.contains("kvtier_retain_hints_total{outcome=\"refused_global\"} 1"),
            "{metrics}"
        );
        promtool_check(&metrics);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_hint_is_a_delimited_bad_request() {
    let srv = ServerProc::start(&[]);
    bounded(30, async {
        let s = tokio::net::UnixStream::connect(&srv.unix).await.unwrap();
        let mut raw = Raw::new(s);
        raw.hello("").await;
        let bad = [
            (vec![], 1_000, 0, ErrorCode::BadRequest),
            (keys(b"r", 1, 0), 86_400_001, 0, ErrorCode::BadRequest),
            (keys(b"r", 1, 0), 1_000, 8, ErrorCode::BadRequest),
        ];
        for (keys, return_ms, priority, code) in bad {
            raw.send(
                &Request::Retain(RetainHint {
                    session: 1,
                    keys,
                    return_ms,
                    priority,
                }),
                &[],
            )
            .await;
            let (_, r, _) = raw.recv().await.unwrap();
            assert_eq!(error_code(&r), Some(code), "{r:?}");
        }
        // The connection is still good.
        raw.send(&Request::Ping, &[]).await;
        let (_, r, _) = raw.recv().await.unwrap();
        assert_eq!(r, kvtier_core::protocol::Response::Pong);
    })
    .await;
}

//! A prefix longer than the server's DRAM tier (issue 17): stored in full over every
//! transport (the rest of the chain is not refused because DRAM slots are busy being copied
//! to NVMe), and read back in full and exact, the DRAM tier streaming it in rounds.

use kvtier_client::PutStatus;

use crate::common::*;

/// DRAM holds 64 blocks; the prompts are 2.5 times that.
const DRAM_BLOCKS: usize = 64;
const PROMPT_BLOCKS: usize = 160;

fn long_server() -> ServerProc {
    ServerProc::start(&[
        "store.dram_bytes=\"256KiB\"",
        "store.nvme_bytes=\"16MiB\"",
        "limits.frame_timeout_ms=10000",
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_longer_than_dram_is_stored_and_read_back_in_full() {
    let srv = long_server();
    bounded(120, async {
        for (i, (name, url, cfg)) in srv.transports().into_iter().enumerate() {
            let c = kvtier_client::Client::connect(&url, cfg).await.unwrap();
            let keys = keys(b"long", PROMPT_BLOCKS, i as u32);
            let data: Vec<Vec<u8>> = keys.iter().map(|k| block_data(*k)).collect();
            let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            let s = c.put_chain(&keys, None, &bufs).await;
            assert_eq!(s.failure, None, "{name}");
            assert_eq!(
                s.statuses,
                vec![PutStatus::Stored; PROMPT_BLOCKS],
                "{name}: every block of a chain longer than DRAM is stored"
            );
            assert_eq!(c.lookup(&keys).await.tiers.len(), PROMPT_BLOCKS, "{name}");
            // Twice: the second read finds the head of the chain evicted from DRAM by the
            // first read's tail, so every round promotes from NVMe again.
            for round in 0..2 {
                assert_eq!(
                    get_verified(&c, &keys).await,
                    PROMPT_BLOCKS,
                    "{name}, read {round}: all of a prefix longer than DRAM comes back"
                );
            }
        }
        let st = srv.stats().await;
        let dram = &st["store"]["tiers"][0];
        assert_eq!(dram["tier"], "dram", "{st}");
        assert_eq!(dram["capacity_slots"], DRAM_BLOCKS, "{st}");
        // Nothing was refused, so nothing is counted as refused.
        let (_, metrics) = http_get(srv.admin, "/metrics").await;
        for reason in ["backlog", "no_slot", "orphan"] {
            let line = format!("kvtier_puts_refused_total{{reason=\"{reason}\"}} 0");
            assert!(metrics.contains(&line), "{line} not in\n{metrics}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_put_is_counted_by_reason() {
    let srv = long_server();
    bounded(60, async {
        let transports = srv.transports();
        let orphans = transports.len();
        for (i, (name, url, cfg)) in transports.into_iter().enumerate() {
            let c = kvtier_client::Client::connect(&url, cfg).await.unwrap();
            let keys = keys(b"orphan", 3, i as u32);
            // The parent was never stored: no lookup could reach the child, so it is refused.
            let s = c
                .put_chain(&keys[1..2], Some(keys[0]), &[&block_data(keys[1])])
                .await;
            assert_eq!(s.statuses, vec![PutStatus::RejectedOrphan], "{name}");
        }
        let (_, metrics) = http_get(srv.admin, "/metrics").await;
        for (reason, n) in [("backlog", 0), ("no_slot", 0), ("orphan", orphans)] {
            let line = format!("kvtier_puts_refused_total{{reason=\"{reason}\"}} {n}");
            assert!(metrics.contains(&line), "{line} not in\n{metrics}");
        }
    })
    .await;
}

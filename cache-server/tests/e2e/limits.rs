//! The SDK never sends what the server refuses: requests are chunked by every limit the
//! server states at hello (`max_keys`, `max_meta_bytes`, `max_payload_bytes`), tested one
//! below, exactly at and one above the largest count each limit lets one request carry.

use kvtier_client::{Client, PutStatus};
use kvtier_core::BlockKey;

use crate::common::*;

/// Stores, looks up, reads, prefetches and removes a chain of `n` blocks over `c`; every
/// block must be served.
async fn check(c: &Client, name: &str, n: usize, seed: u32) {
    let keys = keys(b"limits", n, seed);
    let data: Vec<Vec<u8>> = keys.iter().map(|k| block_data(*k)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    // The server may refuse part of a put while its copies to NVMe are backed up (more than
    // 1,024 queued): put again (stored blocks answer "already present") until all are in.
    for _ in 0..500 {
        let s = c.put_chain(&keys, None, &bufs).await;
        assert_eq!(s.failure, None, "{name}: put of {n}");
        assert_eq!(s.statuses.len(), n, "{name}: put of {n}");
        if s.cached() == n {
            break;
        }
        assert!(
            s.statuses.iter().all(|st| *st != PutStatus::Failed),
            "{name}: put of {n}: {:?}",
            s.statuses
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let l = c.lookup(&keys).await;
    assert_eq!((l.tiers.len(), l.miss), (n, None), "{name}: lookup of {n}");
    assert_eq!(get_verified(c, &keys).await, n, "{name}: get of {n}");
    c.prefetch(&keys).await.unwrap();
    assert_eq!(
        c.remove(&keys).await.unwrap(),
        n as u64,
        "{name}: remove of {n}"
    );
    assert_eq!(c.lookup(&keys).await.tiers.len(), 0, "{name}: after remove");
}

/// Connections the server has accepted over `transport` (its Prometheus counter).
async fn connections_total(srv: &ServerProc, transport: &str) -> u64 {
    let body = http_get(srv.admin, "/metrics").await.1;
    let want = format!("kvtier_connections_total{{transport=\"{transport}\"}} ");
    let line = body.lines().find(|l| l.starts_with(&want)).unwrap();
    line[want.len()..].trim().parse().unwrap()
}

/// Runs `check` at `at - 1`, `at` and `at + 1` blocks for each of `ats`, over the unix
/// socket (reserve/commit and pin) and TCP (put and get), each on one connection that must
/// never be closed.
async fn boundaries(srv: &ServerProc, ats: &[usize]) {
    for transport in ["unix", "tcp"] {
        let c = srv.client(transport).await;
        for (i, at) in ats.iter().enumerate() {
            for n in [at - 1, *at, at + 1] {
                check(&c, transport, n, (i * 3 + n) as u32).await;
            }
        }
        assert_eq!(connections_total(srv, transport).await, 1, "{transport}");
    }
}

/// Metadata bytes of a key list of `n` keys: a u64 count, then the keys.
fn key_list_bytes(n: usize) -> usize {
    8 + n * BlockKey::BYTES
}

/// Metadata bytes of a put of a chain of `n` entries (the first without a parent).
fn chain_bytes(n: usize) -> usize {
    8 + (1 + BlockKey::BYTES) + (n - 1) * (1 + 2 * BlockKey::BYTES)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_chunked_by_max_keys() {
    let srv = ServerProc::start(&["limits.max_keys=100"]);
    bounded(120, boundaries(&srv, &[100])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_chunked_by_max_meta_bytes() {
    // 4104 bytes: exactly a key list of 256 keys; a chain of 124 entries fits (4084
    // bytes, 4100 with a reserve's lease) and 125 do not. A pin's lease leaves 255 keys.
    let meta = key_list_bytes(256);
    assert_eq!(meta, 4104);
    assert!(chain_bytes(124) + 8 <= meta && chain_bytes(125) > meta);
    let srv = ServerProc::start(&["limits.max_keys=65536", "limits.max_meta_bytes=4104"]);
    bounded(120, boundaries(&srv, &[256, 255, 124])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_chunked_by_max_payload_bytes() {
    // Eight 4 KiB blocks per get or put.
    let srv = ServerProc::start(&[&format!("limits.max_payload_bytes={}", 8 * BLOCK)]);
    bounded(120, boundaries(&srv, &[8])).await;
}

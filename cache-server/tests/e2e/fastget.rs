//! Local gets with no message: a DRAM hit is read through the server's published slot table
//! (a seqlock per slot). These tests check that a hit is always exactly the block put under
//! its key, while other clients' puts evict, reuse, promote and remove the very slots being
//! read, and that removal, clear and tenants are honoured.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig};

use crate::common::*;

async fn get_exact(c: &Client, keys: &[kvtier_core::BlockKey]) -> usize {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let f = c.get_into(keys, &mut dst).await;
    for (k, b) in keys.iter().zip(&bufs).take(f.blocks) {
        assert!(*b == block_data(*k), "a get returned wrong bytes for {k}");
    }
    f.blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fast_hits_are_exact_while_puts_evict_the_keys_being_read() {
    // 64 DRAM slots, NVMe below: puts evict (and demote) continuously, prefetches promote.
    let srv = Arc::new(ServerProc::start(&["store.dram_bytes=\"256KiB\""]));
    bounded(120, async {
        let chains: Arc<Vec<Vec<kvtier_core::BlockKey>>> =
            Arc::new((0..64u32).map(|i| keys(b"stress", 4, i)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let reader_hits = Arc::new(AtomicU64::new(0));
        let mut writers = Vec::new();
        for w in 0..2u32 {
            let srv = srv.clone();
            let (chains, stop) = (chains.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                let c = srv.client("unix").await;
                let mut i = w as usize;
                while !stop.load(Ordering::Relaxed) {
                    let ks = &chains[i % chains.len()];
                    let data: Vec<Vec<u8>> = ks.iter().map(|k| block_data(*k)).collect();
                    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
                    let _ = c.put_chain(ks, None, &bufs).await;
                    match i % 7 {
                        3 => {
                            let _ = c.remove(&ks[2..]).await;
                        }
                        5 => {
                            let _ = c.prefetch(&chains[(i * 13) % chains.len()]).await;
                        }
                        _ => {}
                    }
                    i += 3;
                }
            }));
        }
        let mut readers = Vec::new();
        for r in 0..2u32 {
            let srv = srv.clone();
            let (chains, stop, hits) = (chains.clone(), stop.clone(), reader_hits.clone());
            readers.push(tokio::spawn(async move {
                let c = srv.client("unix").await;
                assert!(c.has_fast_gets().await, "no slot table mapped");
                let mut i = r as usize;
                let mut blocks = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    blocks += get_exact(&c, &chains[i % chains.len()]).await as u64;
                    // One block a request too (the benchmark's shape).
                    blocks += get_exact(&c, &chains[(i * 7) % chains.len()][..1]).await as u64;
                    i += 1;
                }
                hits.fetch_add(c.fast_hits(), Ordering::Relaxed);
                blocks
            }));
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.await.unwrap();
        }
        let mut blocks = 0;
        for r in readers {
            blocks += r.await.unwrap();
        }
        let fast = reader_hits.load(Ordering::Relaxed);
        eprintln!("{blocks} blocks read, {fast} with no message");
        assert!(fast > 0, "no fast-path hit in {blocks} blocks");
        assert!(
            blocks > fast,
            "every block read in place: the pin path went untested"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_and_clear_end_fast_hits_and_the_switch_turns_them_off() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("unix").await;
        assert!(c.has_fast_gets().await);
        let ks = keys(b"fast", 4, 1);
        put_all(&c, &ks).await;
        assert_eq!(get_exact(&c, &ks).await, 4);
        assert_eq!(c.fast_hits(), 4, "a DRAM hit should take no message");
        assert_eq!(c.remove(&ks[2..]).await.unwrap(), 2);
        assert_eq!(get_exact(&c, &ks).await, 2);
        assert_eq!(c.fast_hits(), 6);
        c.clear().await.unwrap();
        assert_eq!(get_exact(&c, &ks).await, 0);
        assert_eq!(c.fast_hits(), 6);
        // Put again: readable in place again.
        put_all(&c, &ks).await;
        assert_eq!(get_exact(&c, &ks).await, 4);
        assert_eq!(c.fast_hits(), 10);

        let off = Client::connect(
            &srv.unix_url(),
            ClientConfig::default().fast_local_gets(false),
        )
        .await
        .unwrap();
        assert!(!off.has_fast_gets().await);
        assert_eq!(get_exact(&off, &ks).await, 4);
        assert_eq!(off.fast_hits(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_promoted_from_nvme_are_read_in_place() {
    // 16 DRAM slots: a chain of 32 blocks cannot stay in DRAM whole.
    let srv = ServerProc::start(&["store.dram_bytes=\"64KiB\""]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let ks = keys(b"promote", 32, 2);
        for part in ks.chunks(4) {
            put_all_after(&c, &ks, part).await;
        }
        let first = &ks[..4];
        // Wait until the first blocks have left DRAM (lookup says NVMe), then prefetch them.
        let t0 = Instant::now();
        loop {
            let l = c.lookup(first).await;
            if l.tiers.first().is_some_and(|t| t.name() == "nvme") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "never demoted: {l:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let before = c.fast_hits();
        let t0 = Instant::now();
        loop {
            // Asked again each turn: a prefetch the I/O queue has no room for is dropped.
            c.prefetch(first).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            let l = c.lookup(first).await;
            if l.tiers.len() == 4 && l.tiers.iter().all(|t| t.name() == "dram") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "never promoted: {l:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(get_exact(&c, first).await, 4);
        assert!(c.fast_hits() > before, "promoted blocks not read in place");
    })
    .await;
}

/// Puts `part` of the chain `all` (its parent is the block before it in `all`).
async fn put_all_after(c: &Client, all: &[kvtier_core::BlockKey], part: &[kvtier_core::BlockKey]) {
    let at = all.iter().position(|k| *k == part[0]).unwrap();
    let parent = (at > 0).then(|| all[at - 1]);
    let data: Vec<Vec<u8>> = part.iter().map(|k| block_data(*k)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let s = c.put_chain(part, parent, &bufs).await;
    assert_eq!(s.failure, None, "{:?}", s.statuses);
}

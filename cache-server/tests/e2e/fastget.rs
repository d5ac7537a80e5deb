//! Local gets with no message: a DRAM hit is read through the server's published slot table
//! (a seqlock per slot). These tests check that a hit is always exactly the block put under
//! its key, while other clients' puts evict, reuse, promote and remove the very slots being
//! read, and that removal and clear are honoured; and, with tenants, that the local engine
//! trusted with the arena reads its own namespace's hits with no message and never another
//! namespace's blocks.

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
    stress(&[], None).await;
}

/// The same with tenants: the local clients are the tenant trusted with the arena (its keys
/// mapped through its namespace key for the table), and another tenant keeps putting the very
/// same client keys with other bytes over TCP, so the table holds both namespaces' blocks
/// under those keys, evicting each other: a local hit must still be exactly the local
/// tenant's block.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fast_hits_are_exact_with_tenants_while_another_tenant_puts_the_same_keys() {
    stress(
        &[
            "server.token=\"\"",
            "tenants.w={unix=true, local_arena=true}",
            "tenants.b={token=\"tok-b\"}",
        ],
        Some("tok-b"),
    )
    .await;
}

/// Two local writers and two local readers over 64 chains for 6 s; with `other` (a tenant's
/// token), a third writer puts the same keys as that tenant, every byte 0xEE.
async fn stress(tenants: &[&str], other: Option<&'static str>) {
    // 64 DRAM slots, NVMe below: puts evict (and demote) continuously, prefetches promote.
    let mut args = vec!["store.dram_bytes=\"256KiB\""];
    args.extend_from_slice(tenants);
    let srv = Arc::new(ServerProc::start(&args));
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
        if let Some(token) = other {
            let srv = srv.clone();
            let (chains, stop) = (chains.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                let c = Client::connect(&srv.tcp_url(), ClientConfig::default().token(token))
                    .await
                    .unwrap();
                let data = vec![vec![0xEEu8; BLOCK]; 4];
                let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
                let mut i = 1usize;
                while !stop.load(Ordering::Relaxed) {
                    let ks = &chains[i % chains.len()];
                    let _ = c.put_chain(ks, None, &bufs).await;
                    i += 5;
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

/// Requests the server has answered, all operations together (`/metrics`).
async fn requests(srv: &ServerProc) -> u64 {
    let (code, text) = http_get(srv.admin, "/metrics").await;
    assert_eq!(code, 200);
    text.lines()
        .filter(|l| l.starts_with("kvtier_requests_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tenants_the_trusted_engine_reads_its_hits_with_no_message_and_no_one_elses() {
    let srv = ServerProc::start(&[
        "server.token=\"\"",
        "tenants.w={unix=true, local_arena=true}",
        "tenants.b={token=\"tok-b\"}",
    ]);
    bounded(60, async {
        let w = srv.client("unix").await;
        assert!(w.is_local() && w.has_fast_gets().await, "no slot table");
        let b = Client::connect(&srv.tcp_url(), ClientConfig::default().token("tok-b"))
            .await
            .unwrap();
        let kw = keys(b"worker", 4, 0);
        put_all(&w, &kw).await;
        // Hits with no message: the SDK read them through the table and the server answered
        // nothing meanwhile.
        let before = requests(&srv).await;
        assert_eq!(get_exact(&w, &kw).await, 4);
        assert_eq!(w.fast_hits(), 4, "a DRAM hit should take no message");
        assert_eq!(requests(&srv).await, before, "a fast get sent a request");

        // B's blocks are in DRAM and in the table, under B's internal keys: the local
        // tenant's get of B's keys misses, through the table and through the server.
        let kb = keys(b"tenant-b", 4, 0);
        put_all(&b, &kb).await;
        assert_eq!(get_verified(&b, &kb).await, 4);
        assert_eq!(
            get_exact(&w, &kb).await,
            0,
            "read another namespace's block"
        );
        assert_eq!(w.fast_hits(), 4);
        // B stores its own blocks under the worker's very keys: the worker still reads its
        // own bytes in place, B its own.
        let data = vec![vec![0xEEu8; BLOCK]; 4];
        let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        assert_eq!(b.put_chain(&kw, None, &bufs).await.cached(), 4);
        assert_eq!(get_exact(&w, &kw).await, 4);
        assert_eq!(w.fast_hits(), 8);
        let mut got = vec![0u8; BLOCK];
        assert_eq!(b.get_into(&kw[..1], &mut [&mut got[..]]).await.blocks, 1);
        assert_eq!(got, data[0]);

        // What the hello passed: three descriptors and the namespace key, which maps the
        // worker's keys to the table's and is not the other namespace's mapping. The table
        // indeed holds all twelve blocks.
        let (_raw, hello, fds) = crate::arena::local_hello(&srv.unix).await;
        assert_eq!(fds.len(), 3);
        let nk = hello.namespace_key.expect("no namespace key with tenants");
        let table = std::fs::File::from(fds.into_iter().nth(2).unwrap());
        let map = memmap2::MmapOptions::new()
            .len(hello.slot_table_bytes as usize)
            .map_raw_read_only(&table)
            .unwrap();
        let word = |off: usize| {
            // SAFETY: 8-aligned offsets inside the mapping (the table's layout; the mapping
            // is page aligned), read once each; the server writes these words atomically.
            unsafe { std::ptr::read_volatile(map.as_ptr().add(off) as *const u64) }
        };
        use kvtier_core::slot_table::{HEADER_BYTES, RECORD_BYTES};
        let slots = (word(8) & 0xffff_ffff) as usize;
        let held: Vec<u128> = (0..slots)
            .map(|s| HEADER_BYTES + RECORD_BYTES * s)
            .filter(|r| word(*r) % 2 == 0)
            .map(|r| u128::from(word(r + 8)) | u128::from(word(r + 16)) << 64)
            .collect();
        assert_eq!(held.len(), 12, "blocks in the table");
        let mine = kvtier_core::KeyMap::from_bytes(nk);
        for k in &kw {
            assert!(held.contains(&mine.internal(*k).to_u128()));
            assert!(!held.contains(&k.to_u128()), "a client key in the table");
        }
        for k in &kb {
            assert!(!held.contains(&mine.internal(*k).to_u128()));
        }
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

/// A local client whose lookups all ask the server (`fast_local_lookups` off).
async fn asking(srv: &ServerProc) -> Client {
    Client::connect(
        &srv.unix_url(),
        ClientConfig::default().fast_local_lookups(false),
    )
    .await
    .unwrap()
}

/// A lookup of a prefix the published table names in DRAM is answered with no round trip,
/// with the server's own answer; the server still hears of it (one request, its hold taken);
/// a list with a key the table does not name (never stored, removed) is asked the usual way;
/// the switch turns it off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_of_a_prefix_in_dram_is_answered_in_place_and_the_server_hears_of_it() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let asks = asking(&srv).await;
        let ks = keys(b"lookup", 8, 0);
        put_all(&c, &ks).await;
        let want = asks.lookup(&ks).await;
        assert_eq!((want.tiers.len(), &want.miss), (8, &None), "{want:?}");
        assert_eq!(asks.fast_lookups(), 0, "the switch is off");

        let holds = |st: serde_json::Value| st["store"]["lookup_holds"].as_u64().unwrap();
        let holds_before = holds(srv.stats().await);
        let before = requests(&srv).await;
        assert_eq!(c.lookup(&ks).await, want);
        assert_eq!(
            c.fast_lookups(),
            1,
            "a DRAM prefix should be answered in place"
        );
        // Sent one way: the server ran it as a lookup (counted, and the prefix held).
        let deadline = Instant::now() + Duration::from_secs(10);
        while requests(&srv).await < before + 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            requests(&srv).await,
            before + 1,
            "the server did not hear of it"
        );
        assert_eq!(holds(srv.stats().await), holds_before + 1, "no hold taken");

        // A key the table does not name: the usual lookup, the server's answer.
        let mut longer = ks.clone();
        longer.extend(keys(b"lookup-absent", 1, 9));
        let l = c.lookup(&longer).await;
        assert_eq!(l, asks.lookup(&longer).await);
        assert_eq!(
            (l.tiers.len(), l.miss),
            (8, Some(kvtier_client::Miss::NotCached))
        );
        // Removed blocks leave the table at once.
        assert_eq!(c.remove(&ks[4..]).await.unwrap(), 4);
        let l = c.lookup(&ks).await;
        assert_eq!(
            (l.tiers.len(), l.miss),
            (4, Some(kvtier_client::Miss::NotCached))
        );
        assert_eq!(c.fast_lookups(), 1);
        assert_eq!(c.lookup(&ks[..4]).await.tiers.len(), 4);
        assert_eq!(c.fast_lookups(), 2);

        // On the wire: a lookup flagged NO_REPLY is answered with nothing (the next frame is
        // the ping's pong), and a plain one still gets its reply.
        use kvtier_core::protocol::{KeyList, Request, Response, flags};
        let (mut raw, _, _) = crate::arena::local_hello(&srv.unix).await;
        let lookup = Request::Lookup(KeyList {
            keys: ks[..4].to_vec(),
        });
        let mut f = Raw::<tokio::net::UnixStream>::frame(&lookup, 100, 0);
        f[7] |= flags::NO_REPLY;
        f.extend(Raw::<tokio::net::UnixStream>::frame(&Request::Ping, 101, 0));
        f.extend(Raw::<tokio::net::UnixStream>::frame(&lookup, 102, 0));
        tokio::io::AsyncWriteExt::write_all(&mut raw.s, &f)
            .await
            .unwrap();
        let (h, r, _) = raw.recv().await.unwrap();
        assert_eq!((h.request_id, &r), (101, &Response::Pong));
        let (h, r, _) = raw.recv().await.unwrap();
        assert!(
            h.request_id == 102
                && matches!(r, Response::Lookup { ref tiers, .. } if tiers.len() == 4),
            "{h:?} {r:?}"
        );
    })
    .await;
}

/// With DRAM the only tier (no NVMe, no cluster) the table is exact: a partly cached list
/// is answered in place too, its prefix then a miss, as the server answers it; while a put
/// is in flight (a reservation not committed) a key the table does not name may be on its
/// way, so such a list takes the round trip until the put is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_dram_alone_a_partly_cached_lookup_is_answered_in_place_unless_a_put_is_in_flight() {
    use kvtier_client::Miss;
    use kvtier_core::protocol::{PutEntry, Request, Response};
    let srv = ServerProc::start(&["store.nvme_dir=\"\""]);
    bounded(60, async {
        let c = srv.client("unix").await;
        let asks = asking(&srv).await;
        let ks = keys(b"exact", 6, 0);
        put_all(&c, &ks).await;
        let mut longer = ks.clone();
        longer.extend(keys(b"exact-new", 3, 1));
        let l = c.lookup(&longer).await;
        assert_eq!((l.tiers.len(), &l.miss), (6, &Some(Miss::NotCached)));
        assert_eq!(l, asks.lookup(&longer).await);
        assert_eq!(
            c.fast_lookups(),
            1,
            "a partly cached list, answered in place"
        );
        let none = keys(b"exact-none", 2, 2);
        assert_eq!(c.lookup(&none).await.tiers.len(), 0);
        assert_eq!(c.fast_lookups(), 2, "nothing cached, answered in place");

        // A put in flight: a reservation of other keys, not committed.
        let (mut raw, _, _) = crate::arena::local_hello(&srv.unix).await;
        let coming = keys(b"exact-coming", 1, 3);
        raw.send(
            &Request::Reserve {
                entries: vec![PutEntry {
                    key: coming[0],
                    parent: None,
                }],
                lease_ms: 10_000,
            },
            &[],
        )
        .await;
        let Response::Reserve(r) = raw.recv().await.unwrap().1 else {
            panic!("reserve refused");
        };
        let l = c.lookup(&longer).await;
        assert_eq!((l.tiers.len(), &l.miss), (6, &Some(Miss::NotCached)));
        assert_eq!(
            c.fast_lookups(),
            2,
            "asked the server while a put is in flight"
        );
        // A fully cached list needs no such care.
        assert_eq!(c.lookup(&ks).await.tiers.len(), 6);
        assert_eq!(c.fast_lookups(), 3);
        raw.send(
            &Request::Abort {
                reservation_id: r.reservation_id,
            },
            &[],
        )
        .await;
        let _ = raw.recv().await.unwrap();
        assert_eq!(c.lookup(&longer).await.tiers.len(), 6);
        assert_eq!(c.fast_lookups(), 4, "in place again once the put is done");
    })
    .await;
}

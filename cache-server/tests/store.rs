//! Behaviour of the tiered store through its public API.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvtier_core::BlockKey;
use kvtier_server::policy::admission::RejectReason;
use kvtier_server::{GetOutcome, MissReason, PutOutcome, StoreError, TierKind, TieredStore};

#[test]
fn put_get_lookup_in_dram() {
    let (s, _) = TieredStore::open(config(16, None)).unwrap();
    let keys: Vec<_> = (0..5).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| keys[p]);
        assert_eq!(
            s.put(*k, parent, &data(*k)).unwrap(),
            PutOutcome::Stored(TierKind::Dram)
        );
    }
    assert_eq!(
        s.put(keys[0], None, &data(keys[0])).unwrap(),
        PutOutcome::AlreadyPresent
    );
    assert_eq!(get(&s, keys[3]), GetOutcome::Hit(TierKind::Dram));
    assert_eq!(get(&s, key(99)), GetOutcome::Miss(MissReason::NotCached));
    // Longest prefix stops at the first miss.
    let mut probe = keys.clone();
    probe.insert(3, key(77));
    assert_eq!(s.lookup(&probe), vec![TierKind::Dram; 3]);
    assert!(s.remove(&keys[1]));
    assert!(!s.remove(&keys[1]));
    assert_eq!(s.lookup(&keys).len(), 1);
    let st = s.stats();
    let d = st.tier(TierKind::Dram).unwrap();
    assert_eq!((d.hits, d.misses, st.blocks), (1, 1, 4));
}

#[test]
fn wrong_sizes_are_errors() {
    let (s, _) = TieredStore::open(config(4, None)).unwrap();
    let e = s.put(key(1), None, &[0u8; 100]).unwrap_err();
    assert!(matches!(e, StoreError::WrongSize { got: 100, .. }), "{e}");
    let e = s.get(&key(1), &mut [0u8; 5000]).unwrap_err();
    assert!(e.to_string().contains("5000"), "{e}");
}

#[test]
fn dram_never_holds_more_than_its_capacity() {
    let cap_blocks = 8;
    let (s, _) = TieredStore::open(config(cap_blocks, None)).unwrap();
    assert!(s.dram().arena_bytes() <= cap_blocks * BLOCK as u64);
    for i in 0..200 {
        let k = key(i);
        s.put(k, None, &data(k)).unwrap();
        let d = s.stats();
        let d = d.tier(TierKind::Dram).unwrap();
        assert!(d.used_slots <= cap_blocks);
    }
    let st = s.stats();
    assert_eq!(st.blocks, cap_blocks);
    assert_eq!(st.tier(TierKind::Dram).unwrap().evictions, 200 - cap_blocks);
}

#[test]
fn pinned_blocks_are_never_evicted_and_leases_expire() {
    let (s, _) = TieredStore::open(config(4, None)).unwrap();
    let pinned = [key(1), key(2)];
    for k in pinned {
        s.put(k, None, &data(k)).unwrap();
    }
    let lease = s.pin(&pinned, Duration::from_millis(300));
    assert_eq!(lease.blocks.len(), 2);
    for b in &lease.blocks {
        assert_eq!(b.offset, s.dram().slot_offset(b.slot));
    }
    for i in 10..100 {
        let k = key(i);
        s.put(k, None, &data(k)).unwrap();
    }
    for k in pinned {
        assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
    }
    // With every slot pinned, new blocks are refused, not waited for.
    let other = s.pin(&[key(98), key(99)], Duration::from_secs(5));
    assert_eq!(other.blocks.len(), 2);
    assert_eq!(
        s.put(key(500), None, &data(key(500))).unwrap(),
        PutOutcome::Rejected(RejectReason::NoEvictableSlot)
    );
    assert!(s.release(other.id));
    assert!(!s.release(other.id));
    // The first lease expires on its own (the reaper runs every 100 ms).
    let t0 = Instant::now();
    while s.stats().leases_outstanding > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "lease never expired");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().pins_outstanding, 0);
    assert_eq!(
        s.put(key(500), None, &data(key(500))).unwrap(),
        PutOutcome::Stored(TierKind::Dram)
    );
}

#[test]
fn write_through_survives_restart_and_promotes_on_hit() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<_> = (0..6).map(key).collect();
    {
        let (s, _) = TieredStore::open(config(4, Some((dir.path(), 16)))).unwrap();
        for k in &keys {
            s.put(*k, None, &data(*k)).unwrap();
            // A DRAM slot is busy until its copy to NVMe is done; without waiting, a burst
            // larger than DRAM is refused (counted), never stalled.
            s.flush();
        }
        let st = s.stats();
        assert_eq!(st.tier(TierKind::Dram).unwrap().demotions, 6);
        // Two of six were evicted from DRAM but are still on NVMe.
        assert_eq!(s.lookup(&keys).len(), 6);
    }
    let (s, report) = TieredStore::open(config(4, Some((dir.path(), 16)))).unwrap();
    assert_eq!(report.nvme.unwrap().recovered, 6);
    assert_eq!(s.lookup(&keys), vec![TierKind::Nvme; 6]);
    assert_eq!(get(&s, keys[2]), GetOutcome::Hit(TierKind::Nvme));
    assert_eq!(s.lookup(&keys[2..3]), vec![TierKind::Dram]);
    assert_eq!(get(&s, keys[2]), GetOutcome::Hit(TierKind::Dram));
    let st = s.stats();
    assert_eq!(st.tier(TierKind::Dram).unwrap().promotions, 1);
    assert_eq!(st.tier(TierKind::Nvme).unwrap().hits, 1);
    // Prefetch promotes ahead of need.
    assert_eq!(s.prefetch(&keys[3..5]), 2);
    s.flush();
    assert_eq!(s.lookup(&keys[3..5]), vec![TierKind::Dram; 2]);
}

#[test]
fn remove_and_clear_hold_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<_> = (0..4).map(key).collect();
    {
        let (s, _) = TieredStore::open(config(8, Some((dir.path(), 8)))).unwrap();
        for k in &keys {
            s.put(*k, None, &data(*k)).unwrap();
        }
        s.flush();
        assert!(s.remove(&keys[0]));
        s.flush();
    }
    {
        let (s, _) = TieredStore::open(config(8, Some((dir.path(), 8)))).unwrap();
        assert!(!s.contains(&keys[0]));
        assert!(s.contains(&keys[1]));
        s.clear().unwrap();
        assert!(!s.contains(&keys[1]));
        let k = key(50);
        s.put(k, None, &data(k)).unwrap();
        s.flush();
    }
    let (s, _) = TieredStore::open(config(8, Some((dir.path(), 8)))).unwrap();
    assert_eq!(s.lookup(&keys).len(), 0);
    assert_eq!(get(&s, key(50)), GetOutcome::Hit(TierKind::Nvme));
}

#[test]
fn write_back_demotes_only_on_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(4, Some((dir.path(), 8)));
    c.demotion = kvtier_server::policy::DemotionPolicy::WriteBack;
    let (s, _) = TieredStore::open(c).unwrap();
    for i in 0..2 {
        s.put(key(i), None, &data(key(i))).unwrap();
    }
    s.flush();
    assert_eq!(s.stats().tier(TierKind::Nvme).unwrap().used_slots, 0);
    for i in 2..8 {
        s.put(key(i), None, &data(key(i))).unwrap();
        s.flush();
    }
    let st = s.stats();
    assert!(st.tier(TierKind::Dram).unwrap().demotions >= 2, "{st:?}");
    for i in 0..8 {
        assert!(
            matches!(get(&s, key(i)), GetOutcome::Hit(_)),
            "block {i} lost"
        );
        s.flush();
    }
}

#[test]
fn selective_write_through_waits_for_hits() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(4, Some((dir.path(), 8)));
    c.demotion = kvtier_server::policy::DemotionPolicy::SelectiveWriteThrough { after_hits: 2 };
    let (s, _) = TieredStore::open(c).unwrap();
    let k = key(1);
    s.put(k, None, &data(k)).unwrap();
    get(&s, k);
    s.flush();
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().demotions, 0);
    get(&s, k);
    s.flush();
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().demotions, 1);
}

#[test]
fn corrupt_nvme_blocks_are_misses_counted_and_erased() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<_> = (0..4).map(key).collect();
    {
        let (s, _) = TieredStore::open(config(4, Some((dir.path(), 4)))).unwrap();
        for k in &keys {
            s.put(*k, None, &data(*k)).unwrap();
        }
        s.flush();
    }
    // Flip one payload bit in every slot.
    let file = dir.path().join("slots-00000.kvt");
    let mut bytes = std::fs::read(&file).unwrap();
    for slot in 0..4 {
        bytes[slot * 8192 + 4096 + 1000] ^= 0x04;
    }
    std::fs::write(&file, &bytes).unwrap();
    let (s, _) = TieredStore::open(config(4, Some((dir.path(), 4)))).unwrap();
    for k in &keys {
        assert_eq!(get(&s, *k), GetOutcome::Miss(MissReason::Corrupt));
        assert!(!s.contains(k));
    }
    s.flush();
    assert_eq!(s.stats().tier(TierKind::Nvme).unwrap().corrupt_dropped, 4);
    drop(s);
    let (s, r) = TieredStore::open(config(4, Some((dir.path(), 4)))).unwrap();
    assert_eq!(
        r.nvme.unwrap().recovered,
        0,
        "corrupt blocks were indexed again"
    );
    assert_eq!(s.stats().blocks, 0);
}

#[test]
fn random_disk_damage_is_never_served() {
    use kvtier_core::SplitMix64;
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<_> = (0..12).map(key).collect();
    let mut rng = SplitMix64::new(99);
    for round in 0..20 {
        {
            let (s, _) = TieredStore::open(config(4, Some((dir.path(), 12)))).unwrap();
            for k in &keys {
                s.put(*k, None, &data(*k)).unwrap();
                s.flush();
            }
        }
        // Scribble over random bytes of every file in the directory, the manifest included.
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            let mut bytes = std::fs::read(&path).unwrap();
            if bytes.is_empty() {
                continue;
            }
            for _ in 0..1 + rng.below(40) {
                let at = rng.below(bytes.len() as u64) as usize;
                bytes[at] = rng.next_u64() as u8;
            }
            if round % 5 == 4 {
                bytes.truncate(rng.below(bytes.len() as u64) as usize);
            }
            std::fs::write(&path, &bytes).unwrap();
        }
        let (s, _) = TieredStore::open(config(4, Some((dir.path(), 12)))).unwrap();
        for k in &keys {
            get(&s, *k); // exact bytes or a miss, checked inside
        }
        assert!(!s.contains(&key(500)));
    }
}

#[test]
fn metadata_per_block_fits_the_budget_on_a_large_nvme_tier() {
    // The target (docs/benchmarks.md): index memory per cached block <= 128 bytes (a 10 TB NVMe tier of 2 MiB
    // blocks is 5 M blocks). A store dominated by its NVMe tier must stay under it.
    for tiers in [Tiers::DramNvme, Tiers::HbmDramNvme] {
        let dir = tempfile::tempdir().unwrap();
        let c = config_tiers(tiers, 64, (dir.path(), 20_000), 64);
        let (s, _) = TieredStore::open(c).unwrap();
        let st = s.stats();
        eprintln!(
            "{tiers:?}: metadata bytes per block: {} (dram {} per slot, nvme {} per slot)",
            st.metadata_bytes_per_block,
            st.tier(TierKind::Dram).unwrap().metadata_bytes_per_slot,
            st.tier(TierKind::Nvme).unwrap().metadata_bytes_per_slot
        );
        assert!(st.metadata_bytes_per_block <= 128, "{st:?}");
    }
}

#[test]
fn chain_links_survive_a_restart_so_nvme_evicts_suffixes_first() {
    let dir = tempfile::tempdir().unwrap();
    let chain: Vec<_> = (0..3).map(key).collect();
    {
        let (s, _) = TieredStore::open(config(4, Some((dir.path(), 8)))).unwrap();
        for (i, k) in chain.iter().enumerate() {
            s.put(*k, i.checked_sub(1).map(|p| chain[p]), &data(*k))
                .unwrap();
            s.flush();
        }
    }
    let (s, r) = TieredStore::open(config(4, Some((dir.path(), 8)))).unwrap();
    assert_eq!(r.nvme.unwrap().recovered, 3);
    // Six more blocks overflow the eight NVMe slots by one: the victim must be the chain's
    // tip (the oldest leaf), never its first block, although that is the oldest write.
    for i in 100..106 {
        s.put(key(i), None, &data(key(i))).unwrap();
        s.flush();
    }
    assert_eq!(s.stats().tier(TierKind::Nvme).unwrap().evictions, 1);
    assert_eq!(
        s.lookup(&chain).len(),
        2,
        "the chain lost its prefix, not its tip"
    );
}

#[test]
fn reservations_fill_in_place_commit_or_free_their_slot() {
    let (s, _) = TieredStore::open(config(4, None)).unwrap();
    let (a, b) = (key(1), key(2));
    let mut r = s.reserve(a, None).unwrap();
    assert_eq!(r.offset() % 4096, 0);
    r.bytes_mut().copy_from_slice(&data(a));
    // Not readable before commit.
    assert!(!s.contains(&a));
    assert_eq!(r.commit().unwrap(), PutOutcome::Stored(TierKind::Dram));
    assert_eq!(get(&s, a), GetOutcome::Hit(TierKind::Dram));
    assert_eq!(s.reserve(a, None).unwrap_err(), PutOutcome::AlreadyPresent);
    // Dropped uncommitted: nothing stored, slot free again.
    let mut r = s.reserve(b, Some(a)).unwrap();
    r.bytes_mut().fill(7);
    drop(r);
    assert!(!s.contains(&b));
    assert_eq!(
        s.reserve(key(3), Some(key(99))).unwrap_err(),
        PutOutcome::Rejected(RejectReason::OrphanBlock)
    );
    // Every slot reserved at once: the next is refused, never blocks.
    let held: Vec<_> = (10..13).map(|i| s.reserve(key(i), None).unwrap()).collect();
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().used_slots, 4);
    drop(held);
    s.check_consistency().unwrap();
}

#[test]
fn pin_read_lends_pinned_bytes_and_unpins_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(2, Some((dir.path(), 16)))).unwrap();
    let keys: Vec<_> = (0..4).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        s.put(*k, i.checked_sub(1).map(|p| keys[p]), &data(*k))
            .unwrap();
        s.flush(); // the write-through copy holds its DRAM slot until done
    }
    s.flush();
    // Without blocking: a prefix starting on NVMe is declined, pinning nothing.
    assert!(s.try_pin_read(&keys).is_none());
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().pins_outstanding, 0);
    let p = s.try_pin_read(&keys[2..]).expect("both in DRAM");
    assert_eq!(p.blocks().len(), 2);
    assert_eq!(p.bytes(1), &data(keys[3])[..]);
    drop(p);
    assert!(s.try_pin(&keys[..1], Duration::from_secs(1)).is_none());
    // Two blocks fit in DRAM: the others come from NVMe, promoted and pinned.
    let mut probe = keys[..3].to_vec();
    probe.push(key(50));
    let p = s.pin_read(&probe);
    assert_eq!(p.blocks().len(), 2, "DRAM holds two slots, both pinned now");
    assert_eq!(p.miss(), Some(MissReason::Busy));
    for (i, b) in p.blocks().iter().enumerate() {
        assert_eq!(p.bytes(i), &data(b.key)[..]);
    }
    drop(p);
    let p = s.pin_read(&probe[..2]);
    assert_eq!(p.blocks().len(), 2);
    assert_eq!(p.miss(), None);
    drop(p);
    assert_eq!(s.stats().tier(TierKind::Dram).unwrap().pins_outstanding, 0);
    s.check_consistency().unwrap();
}

/// The sum a cluster peer's fetch is told is kept per DRAM slot once computed, and forgotten
/// whenever the slot is written again: the same key stored again with other bytes (a put, a
/// reservation filled in place) is hashed afresh, never answered with the old sum.
#[test]
fn a_kept_block_sum_is_forgotten_when_its_slot_is_written() {
    use kvtier_core::protocol::block_sum;
    let (s, _) = TieredStore::open(config(1, None)).unwrap();
    let k = key(1);
    let first = data(k);
    s.put(k, None, &first).unwrap();
    let p = s.pin_read(&[k]);
    assert_eq!(p.kept_sums(), None, "nothing kept before a first fetch");
    assert_eq!(p.sums(), (vec![block_sum(&k, &first)], 1), "hashed");
    assert_eq!(p.kept_sums(), Some(vec![block_sum(&k, &first)]));
    assert_eq!(p.sums(), (vec![block_sum(&k, &first)], 0), "kept");
    drop(p);
    // Stored again in the one slot, with other bytes, through a put.
    assert!(s.remove(&k));
    let second = vec![9u8; first.len()];
    s.put(k, None, &second).unwrap();
    let p = s.pin_read(&[k]);
    assert_eq!(p.kept_sums(), None, "the put forgot the kept sum");
    assert_eq!(p.sums(), (vec![block_sum(&k, &second)], 1));
    drop(p);
    // And through a reservation filled in place.
    assert!(s.remove(&k));
    let mut r = s.reserve(k, None).unwrap();
    r.bytes_mut().fill(5);
    r.commit().unwrap();
    let p = s.pin_read(&[k]);
    assert_eq!(p.kept_sums(), None, "the reservation forgot the kept sum");
    assert_eq!(p.sums(), (vec![block_sum(&k, &vec![5u8; first.len()])], 1));
    drop(p);
    s.check_consistency().unwrap();
}

#[test]
fn events_follow_every_change_of_place() {
    use kvtier_server::{StoreEvent, StoreEventKind as K};
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(2, Some((dir.path(), 16)))).unwrap();
    let seen: Arc<Mutex<Vec<StoreEvent>>> = Arc::default();
    let sink = seen.clone();
    assert!(s.set_event_sink(Arc::new(move |e| sink.lock().unwrap().push(e))));
    let (a, b, c) = (key(1), key(2), key(3));
    s.put(a, None, &data(a)).unwrap();
    s.put(b, Some(a), &data(b)).unwrap();
    s.flush();
    s.put(c, Some(b), &data(c)).unwrap(); // evicts a DRAM block
    s.flush();
    assert!(s.remove(&c));
    s.clear().unwrap();
    let ev = seen.lock().unwrap().clone();
    let has = |kind, tier, k| ev.contains(&StoreEvent { kind, tier, key: k });
    for k in [a, b, c] {
        assert!(
            has(K::Stored, TierKind::Dram, k),
            "{k} stored in DRAM: {ev:?}"
        );
        assert!(
            has(K::Stored, TierKind::Nvme, k),
            "{k} copied to NVMe: {ev:?}"
        );
    }
    assert!(has(K::Removed, TierKind::Dram, c) && has(K::Removed, TierKind::Nvme, c));
    assert!(
        ev.iter()
            .any(|e| e.kind == K::Removed && e.tier == TierKind::Dram && e.key != c),
        "the eviction is reported: {ev:?}"
    );
    assert_eq!(ev.last().unwrap().kind, K::Cleared);
    assert!(s.snapshot().is_empty());
}

#[test]
fn snapshot_lists_every_block_and_its_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(2, Some((dir.path(), 16)))).unwrap();
    let keys: Vec<_> = (0..3).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        s.put(*k, i.checked_sub(1).map(|p| keys[p]), &data(*k))
            .unwrap();
        s.flush(); // the write-through copy holds its DRAM slot until done
    }
    s.flush();
    let mut snap = s.snapshot();
    snap.sort_by_key(|e| e.key);
    assert_eq!(snap.len(), 3);
    assert!(snap.iter().all(|e| e.in_nvme));
    assert_eq!(snap.iter().filter(|e| e.in_dram).count(), 2);
}

/// A chain stored as one batch (each block reserved after its uncommitted parent, then all
/// committed) must look to the eviction policy exactly like the same chain stored block by
/// block: same blocks survive the same later traffic.
#[test]
fn batch_reserved_chains_evict_like_chains_put_one_by_one() {
    use std::sync::Arc;
    let clock = Arc::new(kvtier_server::clock::ManualClock::default());
    let open = || {
        let mut c = config(24, None);
        c.clock = clock.clone();
        TieredStore::open(c).unwrap().0
    };
    let (one_by_one, batched) = (open(), open());
    // Conversations: a shared 3-block system prefix, then each conversation's own blocks,
    // revisited (lookup) now and then, so the chain-aware policy has chains to reason about.
    let mut next = 1000u64;
    let mut chains: Vec<Vec<BlockKey>> = Vec::new();
    let system: Vec<BlockKey> = (0..3).map(key).collect();
    for step in 0..60u64 {
        clock.set_ms(step * 1000);
        let chain: Vec<BlockKey> = if step % 3 == 2 && !chains.is_empty() {
            // A later turn of an earlier conversation: its chain plus two new blocks.
            let mut c = chains[(step as usize * 7) % chains.len()].clone();
            c.extend((0..2).map(|_| {
                next += 1;
                key(next)
            }));
            c
        } else {
            let mut c = system.clone();
            c.extend((0..(2 + step % 4)).map(|_| {
                next += 1;
                key(next)
            }));
            c
        };
        for s in [&one_by_one, &batched] {
            let _ = s.lookup(&chain);
        }
        let cached = one_by_one.lookup(&chain).len();
        assert_eq!(cached, batched.lookup(&chain).len(), "step {step}");
        let new = &chain[cached..];
        let parent = cached.checked_sub(1).map(|i| chain[i]);
        for (i, k) in new.iter().enumerate() {
            let p = if i == 0 { parent } else { Some(new[i - 1]) };
            let _ = one_by_one.put(*k, p, &data(*k)).unwrap();
        }
        let mut held: Vec<kvtier_server::store::Reservation> = Vec::new();
        for (i, k) in new.iter().enumerate() {
            let r = match held.last() {
                Some(prev) if i > 0 => batched.reserve_after(*k, prev),
                _ => batched.reserve(*k, parent),
            };
            let Ok(mut r) = r else { break };
            r.bytes_mut().copy_from_slice(&data(*k));
            held.push(r);
        }
        for r in held {
            r.commit().unwrap();
        }
        chains.push(chain);
    }
    let all: Vec<BlockKey> = chains.iter().flatten().copied().collect();
    let survivors = |s: &TieredStore| all.iter().filter(|k| s.contains(k)).count();
    assert!(survivors(&one_by_one) < all.len(), "the test must evict");
    for k in &all {
        assert_eq!(one_by_one.contains(k), batched.contains(k), "{k:?}");
    }
    one_by_one.check_consistency().unwrap();
    batched.check_consistency().unwrap();
}

#[test]
fn a_block_being_stored_is_pending_until_committed_and_never_served_before() {
    let (s, _) = TieredStore::open(config(8, None)).unwrap();
    let (a, b, c) = (key(1), key(2), key(3));
    assert_eq!(s.pending_blocks(), 0);
    // Announced by a put in flight: pending, not cached.
    let mut ann = s.announce(&[a, b]);
    assert!(s.is_pending(&a) && s.is_pending(&b));
    assert_eq!(s.first_pending(&[c, b, a]), Some(1));
    assert_eq!(s.first_pending(&[c]), None);
    let mut r = s.reserve(a, None).unwrap();
    r.bytes_mut().copy_from_slice(&data(a));
    assert!(s.is_pending(&a));
    assert_eq!(get(&s, a), GetOutcome::Miss(MissReason::NotCached));
    assert!(s.lookup(&[a]).is_empty());
    assert_eq!(r.commit().unwrap(), PutOutcome::Stored(TierKind::Dram));
    // Still announced until the put says it is done with it.
    assert!(s.is_pending(&a));
    ann.done(0);
    ann.done(0);
    assert!(!s.is_pending(&a));
    assert_eq!(get(&s, a), GetOutcome::Hit(TierKind::Dram));
    // An abandoned reservation and a dropped announcement withdraw their keys.
    let r = s.reserve(c, None).unwrap();
    assert!(s.is_pending(&c));
    drop(r);
    assert!(!s.is_pending(&c));
    drop(ann);
    assert!(!s.is_pending(&b));
    assert_eq!(s.pending_blocks(), 0);
    assert_eq!(s.first_pending(&[a, b, c]), None);
    s.check_consistency().unwrap();
}

/// The published slot table (what local clients read DRAM hits through) names exactly the
/// blocks the store holds in DRAM, in their slots, through puts that evict, promotions, gets,
/// removal and clear.
#[test]
fn the_published_slot_table_follows_dram_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(8, Some((dir.path(), 64)))).unwrap();
    let keys: Vec<_> = (0..40).map(key).collect();
    let check = |what: &str| {
        for k in &keys {
            let in_dram = s.lookup(std::slice::from_ref(k)) == [TierKind::Dram];
            let published = s.dram().published().find(*k);
            assert_eq!(published.is_some(), in_dram, "{what}: {k}");
            if let Some(slot) = published {
                // The slot named holds the block's bytes.
                let mut buf = vec![0u8; BLOCK];
                kvtier_server::tier::Tier::read(s.dram(), slot, *k, &mut buf).unwrap();
                assert!(buf == data(*k), "{what}: wrong bytes for {k}");
            }
        }
    };
    for k in &keys {
        s.put(*k, None, &data(*k)).unwrap();
        s.flush();
    }
    check("after puts that evicted");
    for k in &keys[..6] {
        let _ = get(&s, *k);
    }
    s.flush();
    check("after gets that promoted");
    assert_eq!(s.prefetch(&keys[10..13]), 3);
    s.flush();
    check("after a prefetch");
    for k in keys.iter().step_by(3) {
        s.remove(k);
    }
    check("after removals");
    s.clear().unwrap();
    check("after clear");
    assert!(keys.iter().all(|k| s.dram().published().find(*k).is_none()));
}

/// Puts `keys` as one chain after `parent`.
fn put_chain(s: &TieredStore, parent: Option<BlockKey>, keys: &[BlockKey]) {
    let mut p = parent;
    for &k in keys {
        s.put(k, p, &data(k)).unwrap();
        p = Some(k);
    }
}

/// Between a lookup and its load, neither other requests' puts nor the request's own puts
/// evict the looked-up prefix; once released, it is evictable again.
#[test]
fn a_held_lookup_keeps_its_prefix_until_released() {
    for eviction in kvtier_server::policy::EvictionKind::ALL {
        let mut c = config(16, None);
        c.eviction = eviction;
        c.lookup_hold_max_blocks = 8;
        let (s, _) = TieredStore::open(c).unwrap();
        let prefix: Vec<BlockKey> = (1..=4).map(key).collect();
        put_chain(&s, None, &prefix);
        let (tiers, hold) = s.lookup_held(&prefix);
        assert_eq!(tiers.len(), 4);
        let kvtier_server::LookupHold::Held { lease_id, blocks } = hold else {
            panic!("{}: no hold: {hold:?}", eviction.name());
        };
        assert_eq!(blocks, 4);
        // The request's own continuation, then other requests' chains: 44 blocks through a
        // 16-block cache.
        let own: Vec<BlockKey> = (5..=16).map(key).collect();
        put_chain(&s, Some(prefix[3]), &own);
        for c in 0..8u64 {
            let other: Vec<BlockKey> = (0..4).map(|i| key(100 + c * 10 + i)).collect();
            put_chain(&s, None, &other);
        }
        assert_eq!(s.lookup(&prefix).len(), 4, "{}", eviction.name());
        for &k in &prefix {
            assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
        }
        assert_eq!(s.stats().held_blocks, 4);
        assert!(s.release(lease_id));
        assert_eq!(s.stats().held_blocks, 0);
        for c in 0..8u64 {
            let other: Vec<BlockKey> = (0..4).map(|i| key(500 + c * 10 + i)).collect();
            put_chain(&s, None, &other);
        }
        if eviction == kvtier_server::policy::EvictionKind::Lru {
            // (The chain-aware policy may keep it on its own: it is a continuing chain.)
            assert!(
                s.lookup(&prefix).len() < 4,
                "released blocks stay unevictable"
            );
        }
        s.check_consistency().unwrap();
    }
}

/// Holds share a budget: past it a lookup holds nothing and is counted; unreleased holds
/// expire on their own, so a client that never loads cannot keep the cache.
#[test]
fn held_lookups_are_bounded_and_expire() {
    let mut c = config(16, None);
    c.lookup_hold_max_blocks = 6;
    c.lookup_hold = Duration::from_millis(200);
    let (s, _) = TieredStore::open(c).unwrap();
    let a: Vec<BlockKey> = (1..=4).map(key).collect();
    let b: Vec<BlockKey> = (11..=14).map(key).collect();
    put_chain(&s, None, &a);
    put_chain(&s, None, &b);
    assert!(matches!(
        s.lookup_held(&a).1,
        kvtier_server::LookupHold::Held { blocks: 4, .. }
    ));
    let (tiers, hold) = s.lookup_held(&b);
    assert_eq!(
        tiers.len(),
        4,
        "an over-budget lookup still reports the prefix"
    );
    assert_eq!(hold, kvtier_server::LookupHold::OverBudget);
    assert_eq!(
        s.lookup_held(&[key(999)]).1,
        kvtier_server::LookupHold::Nothing
    );
    let st = s.stats();
    assert_eq!(
        (st.lookup_holds, st.lookup_holds_refused, st.held_blocks),
        (1, 1, 4)
    );
    // Puts still find room: at most the budget is held.
    for i in 0..40 {
        let k = key(1000 + i);
        assert!(matches!(
            s.put(k, None, &data(k)).unwrap(),
            PutOutcome::Stored(_)
        ));
    }
    let t0 = Instant::now();
    while s.stats().held_blocks > 0 || s.stats().leases_outstanding > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a hold never expired"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.check_consistency().unwrap();
}

#[test]
fn a_removal_by_policy_leaves_pinned_and_held_blocks_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(8, Some((dir.path(), 16)))).unwrap();
    let (held, pinned, free) = (key(1), key(2), key(3));
    for k in [held, pinned, free] {
        s.put(k, None, &data(k)).unwrap();
    }
    s.flush();
    let (found, hold) = s.lookup_held(&[held]);
    assert_eq!(found.len(), 1);
    let kvtier_server::LookupHold::Held { lease_id, .. } = hold else {
        panic!("the lookup holds its block");
    };
    let read = s.pin_read(&[pinned]);
    assert!(!s.remove_unpinned(&held), "a held lookup's block");
    assert!(!s.remove_unpinned(&pinned), "a reader's block");
    assert!(s.remove_unpinned(&free));
    assert!(!s.remove_unpinned(&free), "already gone");
    assert!(s.contains(&held) && s.contains(&pinned) && !s.contains(&free));
    // Once let go, they may be removed.
    drop(read);
    assert!(s.release(lease_id));
    assert!(s.remove_unpinned(&held) && s.remove_unpinned(&pinned));
    s.check_consistency().unwrap();
}

/// A lookup probes in rounds that grow (256 keys, then 1,024, then 4,096): the prefix it
/// reports ends at the first missing key wherever that falls, at a round's first or last key
/// or past every round, and a held lookup holds exactly that prefix.
#[test]
fn a_lookup_ends_at_the_first_missing_key_across_its_rounds() {
    let n = 6000u64;
    let mut c = config(n + 16, None);
    c.lookup_hold_max_blocks = 4 * n;
    let (s, _) = TieredStore::open(c).unwrap();
    let chain: Vec<BlockKey> = (0..n).map(|i| key(10_000 + i)).collect();
    put_chain(&s, None, &chain);
    assert_eq!(s.lookup(&chain).len(), n as usize);
    let mut asked = chain.clone();
    for hole in [0usize, 1, 255, 256, 257, 1279, 1280, 1281, 5375, 5376, 5999] {
        asked[hole] = key(999_999);
        assert_eq!(s.lookup(&asked).len(), hole, "missing key at {hole}");
        let (tiers, hold) = s.lookup_held(&asked);
        assert_eq!(tiers.len(), hole);
        match hold {
            kvtier_server::LookupHold::Held { lease_id, blocks } => {
                assert_eq!(blocks, hole);
                assert_eq!(s.stats().held_blocks, hole as u64);
                assert!(s.release(lease_id));
            }
            kvtier_server::LookupHold::Nothing => assert_eq!(hole, 0),
            other => panic!("hole at {hole}: {other:?}"),
        }
        asked[hole] = chain[hole];
    }
    assert_eq!(s.stats().held_blocks, 0);
    s.check_consistency().unwrap();
}

/// Guest copies (blocks another cluster member owns) are evicted before the blocks the
/// policy ranks, whatever the policy and however recently they were read; a pinned guest is
/// passed over; a slot given to a new block is no longer a guest.
#[test]
fn guests_are_evicted_before_owned_blocks() {
    for eviction in kvtier_server::policy::EvictionKind::ALL {
        let name = eviction.name();
        let mut c = config(8, None);
        c.eviction = eviction;
        let (s, _) = TieredStore::open(c).unwrap();
        let owned: Vec<BlockKey> = (1..=4).map(key).collect();
        let guests: Vec<BlockKey> = (11..=14).map(key).collect();
        put_chain(&s, None, &owned);
        put_chain(&s, None, &guests);
        assert_eq!(s.mark_guests(&guests), 4, "{name}");
        assert_eq!(s.mark_guests(&guests), 0, "{name}: marked twice");
        assert_eq!(s.mark_guests(&[key(99)]), 0, "{name}: an absent key");
        // The guests are the most recently used: a policy alone would evict the owned ones.
        for _ in 0..3 {
            assert_eq!(s.lookup(&guests).len(), 4);
            for &k in &guests {
                assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
            }
        }
        let d = s.stats();
        assert_eq!(d.tier(TierKind::Dram).unwrap().guest_slots, 4, "{name}");
        let newer: Vec<BlockKey> = (21..=24).map(key).collect();
        put_chain(&s, None, &newer);
        assert_eq!(
            s.lookup(&owned).len(),
            4,
            "{name}: an owned block was evicted"
        );
        assert_eq!(s.lookup(&newer).len(), 4, "{name}");
        assert!(
            guests.iter().all(|k| !s.contains(k)),
            "{name}: a guest survived"
        );
        let d = s.stats();
        let d = d.tier(TierKind::Dram).unwrap();
        assert_eq!((d.guest_evictions, d.guest_slots), (4, 0), "{name}");

        s.check_consistency().unwrap();

        // A pinned guest is passed over; the unpinned one goes first (a fresh store: 6 owned
        // blocks and 2 guests fill it).
        let mut c = config(8, None);
        c.eviction = eviction;
        let (s, _) = TieredStore::open(c).unwrap();
        put_chain(&s, None, &(1..=6).map(key).collect::<Vec<_>>());
        let (g1, g2) = (key(31), key(32));
        put_chain(&s, None, &[g1, g2]);
        assert_eq!(s.mark_guests(&[g1, g2]), 2, "{name}");
        let lease = s.pin(&[g1], Duration::from_secs(5));
        s.put(key(41), None, &data(key(41))).unwrap();
        assert!(s.contains(&g1) && !s.contains(&g2), "{name}");
        // No evictable guest left: the policy's victim, and the pinned guest stays.
        s.put(key(42), None, &data(key(42))).unwrap();
        assert!(s.contains(&g1), "{name}: a pinned guest was evicted");
        assert_eq!(s.stats().tier(TierKind::Dram).unwrap().guest_slots, 1);
        assert!(s.release(lease.id));
        s.put(key(43), None, &data(key(43))).unwrap();
        assert!(
            !s.contains(&g1),
            "{name}: the released guest is evicted first"
        );
        let d = s.stats();
        let d = d.tier(TierKind::Dram).unwrap();
        assert_eq!((d.guest_evictions, d.guest_slots), (2, 0), "{name}");
        s.check_consistency().unwrap();
    }
}

/// A guest keeps no copy below DRAM (the tier below keeps its room for the blocks this
/// member owns): a write-through copy made before the block was marked is dropped, and one
/// not made yet when it was marked is not kept; owned blocks keep theirs.
#[test]
fn guests_keep_no_copy_below_dram() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) = TieredStore::open(config(16, Some((dir.path(), 32)))).unwrap();
    let owned: Vec<BlockKey> = (1..=3).map(key).collect();
    let copied: Vec<BlockKey> = (11..=13).map(key).collect();
    put_chain(&s, None, &owned);
    put_chain(&s, None, &copied);
    s.flush();
    let in_nvme = |k: &BlockKey| s.snapshot().iter().any(|e| e.key == *k && e.in_nvme);
    assert!(owned.iter().chain(&copied).all(in_nvme), "written through");
    assert_eq!(s.mark_guests(&copied), 3);
    assert!(owned.iter().all(in_nvme), "an owned block lost its copy");
    assert!(!copied.iter().any(in_nvme), "a guest kept its copy below");
    // Marked at once after the put, whether its copy has run, is running or is queued.
    for i in 0..20 {
        let k = key(100 + i);
        s.put(k, None, &data(k)).unwrap();
        assert_eq!(s.mark_guests(&[k]), 1);
        s.flush();
        assert!(!in_nvme(&k), "guest {i} kept its copy below");
        assert!(s.contains(&k), "guest {i} left DRAM");
    }
    let st = s.stats();
    assert_eq!(st.tier(TierKind::Nvme).unwrap().used_slots, 3);
    s.check_consistency().unwrap();
}

/// A block whose parent is not cached is refused as an orphan, unless the store admits
/// orphans (a cluster member: the parent may be held by another member).
#[test]
fn orphans_are_refused_unless_admitted() {
    for admit in [false, true] {
        let mut c = config(8, None);
        c.admit_orphans = admit;
        let (s, _) = TieredStore::open(c).unwrap();
        let out = s.put(key(2), Some(key(1)), &data(key(2))).unwrap();
        if admit {
            assert_eq!(out, PutOutcome::Stored(TierKind::Dram));
            assert!(s.contains(&key(2)));
        } else {
            assert_eq!(out, PutOutcome::Rejected(RejectReason::OrphanBlock));
            assert!(!s.contains(&key(2)));
        }
        s.check_consistency().unwrap();
    }
}

#[test]
fn local_lookups_are_allowed_only_where_no_tier_is_above_dram() {
    // A block the published table names must be in the fastest tier holding it, the tier a
    // lookup reply names: with an HBM tier above DRAM it may not be, so the flag stays off.
    // A key it does not name may be on a tier below: only with DRAM alone is it exact.
    use kvtier_core::slot_table::flags::{CHAINED, EXACT, KEYS_AES, LOOKUPS, TAGGED, TWO_CHOICE};
    for (tiers, want) in [
        (Tiers::Dram, LOOKUPS | EXACT),
        (Tiers::DramNvme, LOOKUPS),
        (Tiers::HbmDramNvme, 0),
    ] {
        for (local, exact, want) in [
            (true, true, want),
            (true, false, want & !EXACT),
            (false, true, 0),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut c = config_tiers(tiers, 16, (dir.path(), 64), 16);
            c.local_lookups = local;
            c.local_lookups_exact = exact;
            let (s, _) = TieredStore::open(c).unwrap();
            let flags = s.dram().published().flags();
            let always = TWO_CHOICE | TAGGED | KEYS_AES | CHAINED;
            assert_eq!(flags, want | always, "{tiers:?} {local} {exact}");
        }
    }
}

#[test]
fn the_published_table_marks_chains_the_store_holds() {
    // A chain put root first is marked to its end; evicting blocks to make room keeps every
    // current mark true (`check_consistency` checks them); a lookup marks its run again.
    let (s, _) = TieredStore::open(config(16, None)).unwrap();
    let p = s.dram().published();
    let data = vec![7u8; s.block_bytes()];
    let chain: Vec<_> = (0..10).map(key).collect();
    let mut parent = None;
    for k in &chain {
        assert!(matches!(
            s.put(*k, parent, &data),
            Ok(PutOutcome::Stored(_))
        ));
        parent = Some(*k);
    }
    assert!(chain.iter().all(|k| p.vouched(*k)));
    s.check_consistency().unwrap();
    // Another chain of 10 into 16 slots: blocks of the first make room.
    let other: Vec<_> = (100..110).map(key).collect();
    let mut parent = None;
    for k in &other {
        s.put(*k, parent, &data).unwrap();
        parent = Some(*k);
        s.check_consistency().unwrap();
    }
    assert_eq!(s.lookup(&other).len(), 10);
    assert!(other.iter().all(|k| p.vouched(*k)));
    // The first chain's root taken out while its child is still cached: the epoch voids
    // every mark, the other chain's too.
    assert!(s.contains(&chain[0]) && s.contains(&chain[1]));
    let epoch = p.epoch();
    assert!(s.remove(&chain[0]));
    assert_eq!(p.epoch(), epoch + 1);
    assert!(other.iter().all(|k| !p.vouched(*k)));
    s.check_consistency().unwrap();
    // A lookup of the other chain marks it again.
    assert_eq!(s.lookup(&other).len(), 10);
    assert!(other.iter().all(|k| p.vouched(*k)), "renewed by the lookup");
    s.check_consistency().unwrap();
}

#[test]
fn the_published_table_counts_the_keys_being_stored() {
    // What a local client reads before it calls a key missing (`flags::EXACT`).
    let (s, _) = TieredStore::open(config(16, None)).unwrap();
    let p = s.dram().published();
    assert_eq!(p.pending(), 0);
    let keys: Vec<_> = (0..3).map(key).collect();
    let mut a = s.announce(&keys);
    let b = s.announce(&keys[..1]);
    assert_eq!(p.pending(), 3);
    a.done(1);
    assert_eq!(p.pending(), 2);
    drop(a);
    assert_eq!(p.pending(), 1, "the other announcement still holds a key");
    drop(b);
    assert_eq!(p.pending(), 0);
}

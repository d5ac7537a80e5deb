//! Every tier passes the one conformance suite (`kvtier_testkit::tier`): the DRAM arena, the
//! NVMe slot files (direct and buffered I/O, across a reopen), the HBM tier on a GPU (a clear
//! refusal elsewhere) and the device-memory test double. Then the tier list: the HBM position
//! (the double, or the real device on a GPU machine) as a full member of the store, and the
//! list's validation.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::device::{HeapDevice, hbm, real_gpu};
use common::*;
use kvtier_server::tier::TierKind;
use kvtier_server::tier::{DramTierConfig, NvmeTierConfig, Tier};
use kvtier_server::{GetOutcome, HbmSettings, StoreError, StoreEvent, StoreEventKind, TieredStore};
use kvtier_testkit::tier as conformance;

#[test]
fn the_dram_tier_passes_the_tier_conformance_suite() {
    conformance::run_volatile(&|| Box::new(DramTierConfig::new(64 * 8192, 8192).open().unwrap()));
}

#[test]
fn the_nvme_tier_passes_the_tier_conformance_suite_direct_and_buffered() {
    // 8 slots of 16 KiB payload, 3 slots a file: several files, one partly filled.
    let cfg = |dir: &std::path::Path| {
        NvmeTierConfig::new(dir, 8 * (16384 + 4096), 16384, 0xfeed).file_bytes(3 * (16384 + 4096))
    };
    for direct in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let fresh = || -> Box<dyn Tier> {
            let _ = std::fs::remove_dir_all(&path);
            Box::new(cfg(&path).direct_io(direct).open().unwrap().0)
        };
        let reopen = || -> Box<dyn Tier> {
            let (t, r) = cfg(&path).direct_io(direct).open().unwrap();
            assert_eq!(r.cold_start, None);
            Box::new(t)
        };
        conformance::run_persistent(&fresh, &reopen);
    }
}

/// On a GPU machine: the full conformance suite over the HBM tier. Elsewhere: the tier must
/// refuse to open with a reason, never panic (cudarc's context constructor panics without a
/// driver). `KVTIER_REQUIRE_GPU=1` (.ci/gpu-check) turns the refusal into a failure.
#[cfg(feature = "cuda")]
#[test]
fn the_hbm_tier_passes_the_conformance_suite_on_a_gpu_or_refuses_clearly() {
    use kvtier_server::tier::TierError;
    use kvtier_server::tier::hbm::{HbmTierConfig, probe};
    match probe() {
        Ok(n) => {
            eprintln!("HBM conformance: running on {n} CUDA device(s)");
            conformance::run_volatile(&|| {
                Box::new(HbmTierConfig::new(64 * 8192, 8192).open().unwrap())
            });
        }
        Err(e) => {
            assert!(
                std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
                "KVTIER_REQUIRE_GPU is set but {e}"
            );
            eprintln!("HBM conformance NOT run: {e}");
            let e = HbmTierConfig::new(1 << 20, 4096).open().err().unwrap();
            assert!(matches!(e, TierError::Unavailable { .. }), "{e}");
        }
    }
}

#[test]
fn the_device_double_passes_the_tier_conformance_suite() {
    conformance::run_volatile(&|| Box::new(HeapDevice::new(64 * 8192, 8192).unwrap()));
}

#[test]
fn a_hit_is_promoted_into_hbm_and_every_report_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) =
        TieredStore::open(config_tiers(Tiers::HbmDramNvme, 4, (dir.path(), 16), 2)).unwrap();
    eprintln!(
        "HBM position: {}",
        if real_gpu() {
            "CUDA device"
        } else {
            "test double"
        }
    );
    assert_eq!(
        s.tiers(),
        vec![TierKind::Hbm, TierKind::Dram, TierKind::Nvme]
    );
    let events: Arc<Mutex<Vec<StoreEvent>>> = Arc::default();
    let sink = events.clone();
    assert!(s.set_event_sink(Arc::new(move |e| sink.lock().unwrap().push(e))));
    let k = key(1);
    s.put(k, None, &data(k)).unwrap();
    // The first hit is served by DRAM and promotes the block one tier up, in the background.
    assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
    s.flush();
    assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Hbm));
    assert_eq!(s.lookup(&[k]), vec![TierKind::Hbm]);
    let snap = s.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(
        snap[0].tiers().collect::<Vec<_>>(),
        vec![TierKind::Hbm, TierKind::Dram, TierKind::Nvme]
    );
    assert!(events.lock().unwrap().contains(&StoreEvent {
        kind: StoreEventKind::Stored,
        tier: TierKind::Hbm,
        key: k,
    }));
    let st = s.stats();
    let names: Vec<_> = st.tiers.iter().filter_map(|t| t.tier).collect();
    assert_eq!(names, s.tiers());
    let metrics = kvtier_server::server::metrics::Metrics::default().render(&st, true);
    for t in ["hbm", "dram", "nvme"] {
        assert!(
            metrics.contains(&format!("tier=\"{t}\"")),
            "metrics lack {t}"
        );
    }
    // One hit each: DRAM served the first get (its promotion is not another hit), HBM the
    // second, which HBM counts after one miss (the first get looked there first).
    let d = st.tier(TierKind::Dram).unwrap();
    assert_eq!((d.hits, d.misses), (1, 0));
    let h = st.tier(TierKind::Hbm).unwrap();
    assert_eq!(h.misses, 1);
    assert_eq!(
        (h.promotions, h.hits, h.used_slots, h.capacity_slots),
        (1, 1, 1, 2)
    );
    s.check_consistency().unwrap();
}

#[test]
fn a_block_held_only_in_hbm_is_copied_into_dram_for_a_pin() {
    let dir = tempfile::tempdir().unwrap();
    let (s, _) =
        TieredStore::open(config_tiers(Tiers::HbmDramNvme, 2, (dir.path(), 16), 4)).unwrap();
    let k = key(1);
    s.put(k, None, &data(k)).unwrap();
    get(&s, k);
    s.flush();
    // Push it out of DRAM (write-through keeps the NVMe copy).
    for i in 10..14 {
        s.put(key(i), None, &data(key(i))).unwrap();
    }
    s.flush();
    let held: Vec<_> = s.snapshot().into_iter().filter(|e| e.key == k).collect();
    assert!(held[0].in_hbm && !held[0].in_dram, "{held:?}");
    assert!(
        s.try_pin_read(&[k]).is_none(),
        "a copy from HBM is not non-blocking"
    );
    let r = s.pin_read(&[k]);
    assert_eq!(r.blocks().len(), 1);
    assert_eq!(r.blocks()[0].found_in, TierKind::Hbm);
    assert!(
        r.bytes(0) == data(k).as_slice(),
        "wrong bytes copied down from HBM"
    );
    drop(r);
    let l = s.pin(&[k], Duration::from_secs(1));
    assert_eq!(l.blocks[0].found_in, TierKind::Dram);
    assert!(s.release(l.id));
    s.check_consistency().unwrap();
}

#[test]
fn hbm_victims_are_written_back_to_dram() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config_tiers(Tiers::HbmDramNvme, 8, (dir.path(), 32), 2);
    c.demotion = kvtier_server::policy::DemotionPolicy::WriteBack;
    let (s, _) = TieredStore::open(c).unwrap();
    for i in 0..6 {
        s.put(key(i), None, &data(key(i))).unwrap();
        get(&s, key(i));
        s.flush();
    }
    let st = s.stats();
    let h = st.tier(TierKind::Hbm).unwrap();
    assert!(h.evictions >= 4 && h.used_slots <= 2, "{h:?}");
    // Every block is still served, with its bytes (checked by `get`).
    for i in 0..6 {
        assert!(
            matches!(get(&s, key(i)), GetOutcome::Hit(_)),
            "lost block {i}"
        );
    }
    s.flush();
    s.check_consistency().unwrap();
}

#[test]
fn selective_write_through_counts_hits_served_from_hbm() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config_tiers(Tiers::HbmDramNvme, 4, (dir.path(), 16), 2);
    c.demotion = kvtier_server::policy::DemotionPolicy::SelectiveWriteThrough { after_hits: 2 };
    let (s, _) = TieredStore::open(c).unwrap();
    let k = key(1);
    s.put(k, None, &data(k)).unwrap();
    assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
    s.flush();
    assert!(!s.snapshot()[0].in_nvme, "copied down after one hit");
    assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Hbm));
    s.flush();
    let e = s.snapshot()[0];
    assert!(e.in_hbm && e.in_dram && e.in_nvme, "{e:?}");
    s.check_consistency().unwrap();
}

fn check_refused(tiers: &[TierKind], hbm_set: bool, nvme_set: bool, want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(4, nvme_set.then_some((dir.path(), 4)));
    c.tiers = tiers.to_vec();
    if hbm_set {
        c.hbm = Some(hbm(2));
    }
    match TieredStore::open(c) {
        Err(e @ StoreError::Config { .. }) => {
            assert!(
                e.to_string().contains(want),
                "{tiers:?}: {e} (want {want:?})"
            )
        }
        Err(e) => panic!("{tiers:?}: {e}, want a config error"),
        Ok(_) => panic!("{tiers:?}: opened, want {want:?}"),
    }
}

#[test]
fn bad_tier_lists_are_refused_by_name() {
    use TierKind::*;
    check_refused(&[Nvme, Dram], false, true, "fastest first");
    check_refused(&[Dram, Dram], false, false, "at most once");
    check_refused(&[Nvme], false, true, "dram is required");
    check_refused(
        &[Hbm, Dram],
        false,
        false,
        "hbm is listed but not configured",
    );
    check_refused(&[Dram], false, true, "nvme is configured but not listed");
}

/// Without device memory given, the HBM position needs the `cuda` feature and a device; it
/// is refused with a reason otherwise.
#[test]
fn hbm_without_a_device_is_refused_clearly() {
    let mut c = config(4, None);
    c.hbm = Some(HbmSettings::new(1 << 20));
    match TieredStore::open(c) {
        Ok((s, _)) => {
            assert!(real_gpu());
            assert_eq!(s.tiers()[0], TierKind::Hbm);
        }
        Err(e) => {
            assert!(!real_gpu(), "a GPU is present but {e}");
            let msg = e.to_string();
            assert!(msg.contains("cuda") || msg.contains("CUDA"), "{msg}");
        }
    }
}

#[test]
fn the_store_keeps_as_many_blocks_as_the_largest_tier_every_block_reaches() {
    use kvtier_server::policy::DemotionPolicy;
    let dir = tempfile::tempdir().unwrap();
    for (tiers, demotion, dram, kept) in [
        (Tiers::Dram, DemotionPolicy::WriteThrough, 8, 8),
        (Tiers::DramNvme, DemotionPolicy::WriteThrough, 8, 32),
        // Write-backs are skipped when backed up: only DRAM's are sure, less the free slots
        // write-back keeps in reserve (1/64 of them, at least one).
        (Tiers::DramNvme, DemotionPolicy::WriteBack, 8, 7),
        (Tiers::DramNvme, DemotionPolicy::WriteBack, 128, 126),
        // With nothing below DRAM there is nothing to write back, and no reserve.
        (Tiers::Dram, DemotionPolicy::WriteBack, 8, 8),
        (Tiers::HbmDramNvme, DemotionPolicy::WriteThrough, 8, 32),
        // Blocks may leave DRAM without a copy below: only DRAM's are kept.
        (
            Tiers::DramNvme,
            DemotionPolicy::SelectiveWriteThrough { after_hits: 2 },
            8,
            8,
        ),
    ] {
        let sub = dir.path().join(format!("{tiers:?}-{demotion:?}-{dram}"));
        let mut c = config_tiers(tiers, dram, (&sub, 32), 2);
        c.demotion = demotion;
        let (s, _) = TieredStore::open(c).unwrap();
        assert_eq!(s.kept_blocks(), kept, "{tiers:?} {demotion:?} {dram}");
        // That many distinct blocks are all still there after the last one is stored.
        for i in 0..kept {
            s.put(key(i), None, &data(key(i))).unwrap();
            s.flush();
        }
        for i in 0..kept {
            assert!(
                matches!(get(&s, key(i)), GetOutcome::Hit(_)),
                "{tiers:?} {demotion:?} {dram}: lost block {i} of {kept}"
            );
        }
        s.check_consistency().unwrap();
    }
}

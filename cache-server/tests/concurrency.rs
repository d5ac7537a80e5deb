//! Many threads putting, getting, pinning, removing, prefetching and clearing at once, under
//! each demotion policy and over every tier list: every hit has its exact bytes, and once quiet the store's slot
//! invariants hold (no slot leaked, freed twice or shared, no pin left behind).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvtier_core::SplitMix64;
use kvtier_server::TieredStore;
use kvtier_server::policy::DemotionPolicy;

fn storm(demotion: DemotionPolicy, seed: u64) {
    for tiers in Tiers::ALL {
        storm_on(tiers, demotion, seed);
    }
}

fn storm_on(tiers: Tiers, demotion: DemotionPolicy, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config_tiers(tiers, 8, (dir.path(), 16), 4);
    c.demotion = demotion;
    c.io_threads = 2;
    let s = Arc::new(TieredStore::open(c).unwrap().0);
    std::thread::scope(|scope| {
        for t in 0..6u64 {
            let s = s.clone();
            scope.spawn(move || {
                let mut rng = SplitMix64::new(seed * 10 + t);
                let mut leases = Vec::new();
                for _ in 0..1500 {
                    let k = key(rng.below(40));
                    match rng.below(100) {
                        0..=39 => {
                            s.put(k, None, &data(k)).unwrap();
                        }
                        40..=74 => {
                            get(&s, k);
                        }
                        75..=82 => {
                            s.remove(&k);
                        }
                        83..=90 => {
                            let l = s.pin(&[k, key(rng.below(40))], Duration::from_secs(30));
                            for b in &l.blocks {
                                assert_eq!(b.offset, s.dram().slot_offset(b.slot));
                            }
                            leases.push(l.id);
                        }
                        91..=95 => {
                            if let Some(id) = leases.pop() {
                                s.release(id);
                            }
                        }
                        96..=97 => {
                            s.prefetch(&[k]);
                        }
                        98 => {
                            s.clear().unwrap();
                        }
                        _ => {
                            s.lookup(&[k, key(rng.below(40))]);
                        }
                    }
                }
                for id in leases {
                    s.release(id);
                }
            });
        }
    });
    s.check_consistency().unwrap();
}

#[test]
fn storm_write_through() {
    storm(DemotionPolicy::WriteThrough, 1);
}

#[test]
fn storm_write_back() {
    storm(DemotionPolicy::WriteBack, 2);
}

#[test]
fn storm_selective() {
    storm(DemotionPolicy::SelectiveWriteThrough { after_hits: 1 }, 3);
}

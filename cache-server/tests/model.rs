//! Property test: random operations against the store and a reference model. The store may
//! drop any block at any time (it is a cache), so the model checks what it must never do:
//! serve bytes other than the ones put, serve a removed or never-put block, lose a block that
//! a live lease pins, or break its capacity bounds.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use kvtier_server::policy::{DemotionPolicy, EvictionKind};
use kvtier_server::{GetOutcome, PutOutcome, TierKind, TieredStore};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Put(u8),
    Get(u8),
    Remove(u8),
    Pin(u8),
    Release(u8),
    Prefetch(u8),
    Flush,
    Reopen,
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..24).prop_map(Op::Put),
        6 => (0u8..24).prop_map(Op::Get),
        1 => (0u8..24).prop_map(Op::Remove),
        1 => (0u8..24).prop_map(Op::Pin),
        1 => (0u8..8).prop_map(Op::Release),
        1 => (0u8..24).prop_map(Op::Prefetch),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
        1 => Just(Op::Clear),
    ]
}

fn policy() -> impl Strategy<Value = (DemotionPolicy, EvictionKind, Tiers)> {
    (
        prop_oneof![
            Just(DemotionPolicy::WriteThrough),
            Just(DemotionPolicy::WriteBack),
            Just(DemotionPolicy::SelectiveWriteThrough { after_hits: 1 }),
        ],
        prop_oneof![Just(EvictionKind::Lru), Just(EvictionKind::ChainAware)],
        prop_oneof![
            Just(Tiers::Dram),
            Just(Tiers::DramNvme),
            Just(Tiers::HbmDramNvme)
        ],
    )
}

const HBM_BLOCKS: u64 = 3;

fn run(ops: Vec<Op>, (demotion, eviction, tiers): (DemotionPolicy, EvictionKind, Tiers)) {
    let dir = tempfile::tempdir().unwrap();
    let nvme = tiers.has_nvme();
    let open = || {
        let mut c = config_tiers(tiers, 4, (dir.path(), 6), HBM_BLOCKS);
        c.demotion = demotion;
        c.eviction = eviction;
        TieredStore::open(c).unwrap().0
    };
    let mut store = Some(open());
    // Keys ever put and not removed since (a hit on anything else is a bug).
    let mut live: HashSet<u8> = HashSet::new();
    let mut leases: HashMap<u8, (u64, u8)> = HashMap::new();
    for op in ops {
        let s = store.as_ref().unwrap();
        match op {
            Op::Put(k) => {
                let parent = k.checked_sub(1).map(|p| key(u64::from(p)));
                match s
                    .put(key(u64::from(k)), parent, &data(key(u64::from(k))))
                    .unwrap()
                {
                    PutOutcome::Stored(_) | PutOutcome::AlreadyPresent => {
                        live.insert(k);
                    }
                    PutOutcome::Rejected(_) => {}
                }
            }
            Op::Get(k) => {
                let o = get(s, key(u64::from(k)));
                if matches!(o, GetOutcome::Hit(_)) {
                    assert!(live.contains(&k), "served block {k} that is not live");
                }
                if leases.values().any(|(_, pk)| *pk == k) {
                    assert!(matches!(o, GetOutcome::Hit(_)), "pinned block {k} missed");
                }
            }
            Op::Remove(k) => {
                if leases.values().any(|(_, pk)| *pk == k) {
                    continue; // the model keeps pinned blocks; removal semantics are tested elsewhere
                }
                s.remove(&key(u64::from(k)));
                live.remove(&k);
                assert!(!s.contains(&key(u64::from(k))));
            }
            Op::Pin(k) => {
                let l = s.pin(&[key(u64::from(k))], Duration::from_secs(60));
                if !l.blocks.is_empty() {
                    assert!(live.contains(&k), "pinned block {k} that is not live");
                    let slot = leases.len() as u8;
                    leases.insert(slot, (l.id, k));
                }
            }
            Op::Release(i) => {
                if let Some((id, _)) = leases.remove(&i) {
                    assert!(s.release(id));
                }
            }
            Op::Prefetch(k) => {
                s.prefetch(&[key(u64::from(k))]);
            }
            Op::Flush => s.flush(),
            Op::Reopen => {
                leases.clear();
                drop(store.take()); // the NVMe directory lock is released before reopening
                store = Some(open());
                if !nvme {
                    live.clear();
                }
            }
            Op::Clear => {
                for (_, (id, _)) in leases.drain() {
                    assert!(s.release(id));
                }
                s.clear().unwrap();
                live.clear();
                assert_eq!(s.stats().blocks, 0);
            }
        }
        let s = store.as_ref().unwrap();
        let st = s.stats();
        let d = st.tier(TierKind::Dram).unwrap();
        assert!(d.used_slots <= 4);
        assert!(st.blocks <= 4 + 6 + HBM_BLOCKS);
        let names: Vec<TierKind> = st.tiers.iter().filter_map(|t| t.tier).collect();
        assert_eq!(names, s.tiers(), "stats name every tier, in order");
    }
    let s = store.take().unwrap();
    s.flush();
    for (id, _) in leases.values() {
        s.release(*id);
    }
    s.check_consistency().unwrap();
    let st = s.stats();
    for t in &st.tiers {
        assert_eq!(t.pins_outstanding, 0, "leaked pins: {st:?}");
        assert_eq!(t.corrupt_dropped, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..120), p in policy()) {
        run(ops, p);
    }
}

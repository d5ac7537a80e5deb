//! Retention hints through the store's public API: protection from eviction, the end of a
//! hold on the store's clock, the session's return, and the budgets.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvtier_core::BlockKey;
use kvtier_server::clock::ManualClock;
use kvtier_server::config::StoreConfig;
use kvtier_server::policy::EvictionKind;
use kvtier_server::{PutOutcome, RetainOutcome, RetainRequest, TieredStore};

fn chain(from: u64, n: u64) -> Vec<BlockKey> {
    (from..from + n).map(key).collect()
}

fn put_chain(s: &TieredStore, keys: &[BlockKey]) {
    for (i, k) in keys.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| keys[p]);
        s.put(*k, parent, &data(*k)).unwrap();
    }
}

/// Puts `n` unrelated one-block chains: enough to evict everything unprotected.
fn flood(s: &TieredStore, from: u64, n: u64) {
    for i in from..from + n {
        let k = key(i);
        s.put(k, None, &data(k)).unwrap();
    }
}

fn present(s: &TieredStore, keys: &[BlockKey]) -> usize {
    keys.iter().filter(|k| s.contains(k)).count()
}

fn hint(namespace: usize, session: u64, keys: &[BlockKey], secs: u64) -> RetainRequest<'_> {
    RetainRequest {
        namespace,
        session,
        keys,
        expected_return: Duration::from_secs(secs),
        priority: 0,
    }
}

/// A hint of namespace 0 expected back in `ms` milliseconds.
fn in_ms(session: u64, keys: &[BlockKey], ms: u64) -> RetainRequest<'_> {
    RetainRequest {
        expected_return: Duration::from_millis(ms),
        ..hint(0, session, keys, 0)
    }
}

fn store(dram_blocks: u64, set: impl FnOnce(&mut StoreConfig)) -> (TieredStore, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::default());
    let mut c = config(dram_blocks, None);
    c.clock = clock.clone();
    c.retain_max_fraction = 0.5;
    set(&mut c);
    (TieredStore::open(c).unwrap().0, clock)
}

#[test]
fn a_hinted_prefix_survives_a_flood_that_evicts_an_unhinted_one() {
    let (s, _) = store(32, |_| {});
    let (a, b) = (chain(1000, 8), chain(2000, 8));
    put_chain(&s, &a);
    put_chain(&s, &b);
    let got = s.retain(hint(0, 7, &a, 10));
    assert_eq!(
        got,
        RetainOutcome::Accepted {
            blocks: 8,
            hold: Duration::from_secs(15)
        }
    );
    flood(&s, 1, 200);
    assert_eq!(present(&s, &a), 8, "the hinted prefix stays");
    assert_eq!(present(&s, &b), 0, "the unhinted prefix is evicted");
    let r = s.stats().retain;
    assert_eq!(
        (r.accepted, r.hints, r.protected_blocks, r.blocks_protected),
        (1, 1, 8, 8)
    );
    // The session comes back: its lookup reaches the hinted tip, the hint is honoured and
    // forgotten, and the prefix is an ordinary prefix again.
    let mut next = a.clone();
    next.push(key(3000));
    assert_eq!(s.lookup(&next).len(), 8);
    let r = s.stats().retain;
    assert_eq!((r.honoured, r.hints, r.protected_blocks), (1, 0, 0));
    flood(&s, 10_000, 200);
    assert_eq!(present(&s, &a), 0, "no longer protected");
    s.check_consistency().unwrap();
}

#[test]
fn a_hold_ends_on_the_stores_clock() {
    let (s, clock) = store(32, |c| c.retain_slack = 1.5);
    let a = chain(1000, 4);
    put_chain(&s, &a);
    clock.set_ms(1_000);
    assert_eq!(
        s.retain(in_ms(0, &a, 1_000)),
        RetainOutcome::Accepted {
            blocks: 4,
            hold: Duration::from_millis(1_500)
        }
    );
    clock.set_ms(2_499);
    assert_eq!(
        s.expire_retained(),
        0,
        "1.5 x 1 s from t = 1 s is t = 2.5 s"
    );
    flood(&s, 1, 100);
    assert_eq!(present(&s, &a), 4);
    clock.set_ms(2_500);
    assert_eq!(s.expire_retained(), 1);
    let r = s.stats().retain;
    assert_eq!(
        (r.expired, r.hints, r.protected_blocks, r.honoured),
        (1, 0, 0, 0)
    );
    flood(&s, 1_000_000, 100);
    assert_eq!(present(&s, &a), 0);
}

#[test]
fn only_the_dram_blocks_of_a_prefix_are_protected_and_counted() {
    let (s, _) = store(32, |_| {});
    let a = chain(1000, 4);
    put_chain(&s, &a);
    let mut longer = a.clone();
    longer.extend(chain(5000, 3)); // never stored
    assert!(matches!(
        s.retain(hint(0, 0, &longer, 5)),
        RetainOutcome::Accepted { blocks: 4, .. }
    ));
    assert_eq!(
        s.retain(hint(0, 0, &chain(9000, 3), 5)),
        RetainOutcome::NothingCached
    );
    assert_eq!(s.stats().retain.nothing_cached, 1);
}

#[test]
fn budgets_refuse_count_and_let_priority_displace() {
    // 40 slots: hints may hold 10 blocks, one namespace 8.
    let (s, _) = store(40, |c| {
        c.retain_max_fraction = 0.25;
        c.retain_namespace_max_fraction = 0.2;
    });
    let (a, b, c) = (chain(1000, 8), chain(2000, 3), chain(3000, 1));
    put_chain(&s, &a);
    put_chain(&s, &b);
    put_chain(&s, &c);
    assert!(matches!(
        s.retain(hint(0, 1, &a, 5)),
        RetainOutcome::Accepted { blocks: 8, .. }
    ));
    assert_eq!(
        s.retain(hint(0, 2, &c, 5)),
        RetainOutcome::OverNamespaceBudget,
        "namespace 0 holds its 8"
    );
    assert_eq!(
        s.retain(hint(1, 1, &b, 5)),
        RetainOutcome::OverGlobalBudget,
        "8 + 3 > 10, nothing of lower priority"
    );
    let urgent = RetainRequest {
        priority: 1,
        ..hint(1, 1, &b, 5)
    };
    assert!(matches!(
        s.retain(urgent),
        RetainOutcome::Accepted { blocks: 3, .. }
    ));
    assert_eq!(
        s.retain(hint(0, 3, &c, 301)),
        RetainOutcome::TooFar,
        "longer than retain_max (300 s)"
    );
    let r = s.stats().retain;
    assert_eq!(
        (
            r.accepted,
            r.refused_namespace,
            r.refused_global,
            r.displaced,
            r.refused_too_far
        ),
        (2, 1, 1, 1, 1)
    );
    assert_eq!((r.hints, r.hinted_blocks, r.max_blocks), (1, 3, 10));
    // A newer hint of the same session replaces the older one.
    assert!(matches!(
        s.retain(hint(1, 1, &c, 5)),
        RetainOutcome::Accepted { blocks: 1, .. }
    ));
    let r = s.stats().retain;
    assert_eq!((r.replaced, r.hints, r.hinted_blocks), (1, 1, 1));
}

#[test]
fn without_a_namespace_share_each_namespace_gets_an_equal_part() {
    let (s, _) = store(40, |c| c.retain_max_fraction = 0.5);
    s.set_retain_namespaces(4);
    assert_eq!(s.stats().retain.namespace_max_blocks, 5);
    let a = chain(1000, 6);
    put_chain(&s, &a);
    assert_eq!(
        s.retain(hint(2, 0, &a, 5)),
        RetainOutcome::OverNamespaceBudget
    );
    assert!(matches!(
        s.retain(hint(2, 0, &a[..5], 5)),
        RetainOutcome::Accepted { blocks: 5, .. }
    ));
}

#[test]
fn retention_off_and_clear() {
    let (s, _) = store(16, |c| c.retain_max_fraction = 0.0);
    let a = chain(1000, 2);
    put_chain(&s, &a);
    assert_eq!(s.retain(hint(0, 0, &a, 5)), RetainOutcome::Off);
    let (s, _) = store(16, |_| {});
    put_chain(&s, &a);
    assert!(matches!(
        s.retain(hint(0, 0, &a, 5)),
        RetainOutcome::Accepted { .. }
    ));
    s.clear().unwrap();
    assert_eq!(s.stats().retain.hints, 0);
    s.check_consistency().unwrap();
}

#[test]
fn at_the_same_priority_a_sooner_return_displaces_a_later_one() {
    // 40 slots: hints may hold 10 blocks.
    let (s, _) = store(40, |c| c.retain_max_fraction = 0.25);
    let (a, b, c) = (chain(1000, 8), chain(2000, 3), chain(3000, 8));
    put_chain(&s, &a);
    put_chain(&s, &b);
    put_chain(&s, &c);
    assert!(matches!(
        s.retain(hint(0, 1, &a, 100)),
        RetainOutcome::Accepted { blocks: 8, .. }
    ));
    // 8 + 3 > 10: b is back sooner than a, so a goes.
    assert!(matches!(
        s.retain(hint(0, 2, &b, 5)),
        RetainOutcome::Accepted { blocks: 3, .. }
    ));
    // 3 + 8 > 10: c is back later than b, which stays.
    assert_eq!(
        s.retain(hint(0, 3, &c, 200)),
        RetainOutcome::OverGlobalBudget
    );
    let r = s.stats().retain;
    assert_eq!(
        (r.accepted, r.displaced, r.refused_global, r.hints),
        (2, 1, 1, 1)
    );
    flood(&s, 1, 200);
    assert_eq!(present(&s, &b), 3, "the sooner hint protects its prefix");
    assert_eq!(present(&s, &a), 0, "the displaced one no longer does");
    s.check_consistency().unwrap();
}

#[test]
fn among_many_hints_the_one_that_ends_last_is_displaced() {
    // 4,096 slots: hints may hold 1,024 blocks, here 1,024 hints of one block each, every
    // one ending at another time (back in 1,000 + i ms, held 1.5x).
    let (s, _) = store(4096, |c| c.retain_max_fraction = 0.25);
    let blocks = chain(1, 1026);
    put_chain(&s, &blocks);
    for i in 0..1024 {
        let got = s.retain(in_ms(i as u64 + 1, &blocks[i..=i], 1_000 + i as u64));
        assert!(
            matches!(got, RetainOutcome::Accepted { blocks: 1, .. }),
            "{i}: {got:?}"
        );
    }
    // Back sooner than all of them: it takes the room of the last to end, and only that.
    assert!(matches!(
        s.retain(in_ms(5000, &blocks[1024..1025], 500)),
        RetainOutcome::Accepted { blocks: 1, .. }
    ));
    let r = s.stats().retain;
    assert_eq!((r.displaced, r.hints, r.hinted_blocks), (1, 1024, 1024));
    // Ending later than every live hint (the latest ends at 1.5 x 2,022 ms): nothing to
    // displace.
    assert_eq!(
        s.retain(in_ms(5001, &blocks[1025..], 2_100)),
        RetainOutcome::OverGlobalBudget
    );
    // Between the last two left (1,021 and 1,022 ms after 1 s): it displaces the later.
    assert!(matches!(
        s.retain(in_ms(5002, &blocks[1025..], 1_000 + 1_022 - 1)),
        RetainOutcome::Accepted { .. }
    ));
    let r = s.stats().retain;
    assert_eq!((r.displaced, r.hints), (2, 1024));
}

#[test]
fn more_hinted_leaves_than_a_victim_search_looks_at_do_not_stop_puts() {
    // 2,048 slots, hints may hold half: 600 one-block chains, each hinted, are the oldest
    // blocks (and leaves), more than a victim search looks at before it gives up (512).
    for policy in EvictionKind::ALL {
        let (s, _) = store(2048, |c| {
            c.retain_max_fraction = 0.5;
            c.eviction = policy;
        });
        let roots = chain(1, 600);
        for (i, k) in roots.iter().enumerate() {
            s.put(*k, None, &data(*k)).unwrap();
            let got = s.retain(hint(0, i as u64 + 1, std::slice::from_ref(k), 100));
            assert!(
                matches!(got, RetainOutcome::Accepted { blocks: 1, .. }),
                "{policy:?}: {got:?}"
            );
        }
        // Every later put finds a victim past them, and the hinted blocks stay.
        for i in 10_000..15_000 {
            let k = key(i);
            let got = s.put(k, None, &data(k)).unwrap();
            assert!(
                matches!(got, PutOutcome::Stored(_)),
                "{policy:?}, put {i}: {got:?}"
            );
        }
        assert_eq!(present(&s, &roots), 600, "{policy:?}");
        s.check_consistency().unwrap();
    }
}

//! The conformance suite every [`EvictionPolicy`] passes, run through the [`Checked`]
//! wrapper (so every call of every check is also held to the trait's contract). Public, like
//! the `Tier` suite, so a new policy's tests run the same checks. Each check panics with a
//! description on failure.

use std::collections::HashSet;

use kvtier_core::BlockKey;

use super::{Checked, EvictionPolicy, InsertContext, LookupContext, MAX_VICTIM_SCAN};
use kvtier_core::SplitMix64;

/// Builds the policy under test over `slots` slots.
pub type MakePolicy<'a> = &'a dyn Fn(u32) -> Box<dyn EvictionPolicy>;

fn checked(make: MakePolicy<'_>, slots: u32) -> Checked {
    Checked::new(make(slots), slots)
}

fn key(i: u64) -> BlockKey {
    BlockKey::from_u128(u128::from(i) << 1 | 1)
}

fn ctx(parent: Option<u32>, now_ms: u64) -> InsertContext {
    InsertContext { parent, now_ms }
}

/// Evicts (and removes) victims until there are none; returns them in order.
fn drain(p: &mut dyn EvictionPolicy, evictable: &dyn Fn(u32) -> bool, now_ms: u64) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(v) = p.victim(&mut |s| evictable(s)) {
        p.on_remove(v, now_ms);
        out.push(v);
    }
    out
}

/// Independent blocks, all evictable: each is a victim exactly once, then there are none.
pub fn every_slot_is_evicted_once(make: MakePolicy<'_>) {
    let n = 64;
    let mut p = checked(make, n);
    for s in 0..n {
        p.on_insert(s, key(u64::from(s)), ctx(None, u64::from(s)));
    }
    let order = drain(&mut p, &|_| true, 1_000);
    let set: HashSet<u32> = order.iter().copied().collect();
    assert_eq!(
        (order.len(), set.len()),
        (n as usize, n as usize),
        "{}: drained {order:?}",
        p.name()
    );
    assert_eq!(
        p.victim(&mut |_| true),
        None,
        "{}: a victim when empty",
        p.name()
    );
}

/// Slots the caller refuses (pinned) are never victims; the rest still are.
pub fn refused_slots_are_never_victims(make: MakePolicy<'_>) {
    let n = 32;
    let mut p = checked(make, n);
    for s in 0..n {
        p.on_insert(s, key(u64::from(s)), ctx(None, 0));
    }
    let order = drain(&mut p, &|s| s % 3 != 0, 10);
    assert!(order.iter().all(|s| s % 3 != 0), "{}: {order:?}", p.name());
    assert_eq!(order.len(), (0..n).filter(|s| s % 3 != 0).count());
}

/// Removed slots are never victims, and a removed slot can be inserted again (new key).
pub fn removed_slots_are_forgotten_and_reusable(make: MakePolicy<'_>) {
    let n = 16;
    let mut p = checked(make, n);
    for s in 0..n {
        p.on_insert(s, key(u64::from(s)), ctx(None, 0));
    }
    for s in (0..n).step_by(2) {
        p.on_remove(s, 5);
    }
    p.on_insert(4, key(100), ctx(None, 6));
    let order = drain(&mut p, &|_| true, 10);
    let want: HashSet<u32> = (0..n).filter(|s| s % 2 == 1).chain([4]).collect();
    assert_eq!(
        order.iter().copied().collect::<HashSet<_>>(),
        want,
        "{}",
        p.name()
    );
}

/// Calls naming slots the policy does not track are ignored: they never become victims.
pub fn untracked_slots_are_ignored(make: MakePolicy<'_>) {
    let n = 8;
    let mut p = checked(make, n);
    p.on_insert(1, key(1), ctx(None, 0));
    p.on_hit(5, 1);
    p.on_remove(6, 1);
    p.on_lookup(LookupContext {
        hits: &[1, 7],
        rest: &[key(9)],
        now_ms: 2,
    });
    assert_eq!(drain(&mut p, &|_| true, 3), vec![1], "{}", p.name());
}

/// Chains (each block's parent inserted first) drain completely when all are evictable,
/// whatever order the policy prefers.
pub fn chains_drain_completely(make: MakePolicy<'_>) {
    let n = 48;
    let mut p = checked(make, n);
    for chain in 0..4u32 {
        for i in 0..12u32 {
            let s = chain * 12 + i;
            let parent = (i > 0).then(|| s - 1);
            p.on_insert(s, key(u64::from(s)), ctx(parent, u64::from(s)));
        }
    }
    p.on_lookup(LookupContext {
        hits: &[12, 13, 14],
        rest: &[],
        now_ms: 100,
    });
    let order = drain(&mut p, &|_| true, 200);
    assert_eq!(order.len(), n as usize, "{}: {order:?}", p.name());
}

/// Random inserts, hits, lookups, removals and victim searches with random pins, every call
/// checked by [`Checked`]; a victim search over all-evictable tracked slots (fewer than the
/// scan bound) always finds one.
pub fn random_operations_keep_the_contract(make: MakePolicy<'_>) {
    let n = 64u32;
    let mut rng = SplitMix64::new(7);
    let mut p = checked(make, n);
    let mut next_key = 0u64;
    for step in 0..5_000u64 {
        let s = rng.below(u64::from(n)) as u32;
        match rng.below(6) {
            0 | 1 if !p.is_tracked(s) => {
                let parent = rng.below(2).eq(&0).then(|| rng.below(u64::from(n)) as u32);
                let parent = parent.filter(|&q| q != s && p.is_tracked(q));
                next_key += 1;
                p.on_insert(s, key(next_key), ctx(parent, step));
            }
            2 => p.on_hit(s, step),
            3 => p.on_remove(s, step),
            4 => {
                let hits: Vec<u32> = (0..rng.below(4))
                    .map(|_| rng.below(u64::from(n)) as u32)
                    .collect();
                p.on_lookup(LookupContext {
                    hits: &hits,
                    rest: &[],
                    now_ms: step,
                });
            }
            _ => {
                let pinned = rng.next_u64();
                if let Some(v) = p.victim(&mut |x| pinned >> (x % 64) & 1 == 0) {
                    assert!(
                        pinned >> (v % 64) & 1 == 0,
                        "{}: pinned victim {v}",
                        p.name()
                    );
                    p.on_remove(v, step);
                }
            }
        }
        let tracked = (0..n).filter(|&x| p.is_tracked(x)).count();
        if tracked > 0 && step % 97 == 0 {
            assert!(tracked <= MAX_VICTIM_SCAN);
            assert!(
                p.victim(&mut |_| true).is_some(),
                "{}: {tracked} tracked slots, all evictable, and no victim",
                p.name()
            );
        }
    }
}

/// Every check above.
pub fn run(make: MakePolicy<'_>) {
    every_slot_is_evicted_once(make);
    refused_slots_are_never_victims(make);
    removed_slots_are_forgotten_and_reusable(make);
    untracked_slots_are_ignored(make);
    chains_drain_completely(make);
    random_operations_keep_the_contract(make);
}

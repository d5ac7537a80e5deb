//! The consistency check of a quiescent store (tests and debugging), over every tier of the
//! list.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use kvtier_core::BlockKey;

use super::{Inner, lock};

impl Inner {
    pub(super) fn check_consistency(&self) -> Result<(), String> {
        // Debug builds check every eviction-policy call; a violation in a background copy
        // panicked on the I/O pool, which survived it.
        let violations = crate::policy::eviction::store_violations();
        if violations != 0 {
            return Err(format!("{violations} eviction-policy contract violations"));
        }
        // (tier position, slot) -> the key whose entry references it.
        let mut refs: HashMap<(usize, u32), BlockKey> = HashMap::new();
        for shard in self.shards.iter() {
            for (k, e) in lock(shard).iter() {
                if e.is_empty() {
                    return Err(format!("{k}: an index entry with no location"));
                }
                for (t, s) in e.held() {
                    let Some(tier) = self.tiers.get(t) else {
                        return Err(format!(
                            "{k}: a location in tier position {t}, past the list"
                        ));
                    };
                    if s >= tier.tier.slot_count() {
                        return Err(format!("{k}: {} slot {s} is out of range", tier.kind));
                    }
                    if let Some(other) = refs.insert((t, s), *k) {
                        return Err(format!(
                            "{} slot {s} referenced by {k} and {other}",
                            tier.kind
                        ));
                    }
                }
            }
        }
        for (t, tier) in self.tiers.iter().enumerate() {
            let kind = tier.kind;
            let st = lock(&tier.state);
            let mut free = vec![false; tier.pins.len()];
            for &s in &st.free {
                if std::mem::replace(&mut free[s as usize], true) {
                    return Err(format!("{kind} slot {s} is on the free list twice"));
                }
                if refs.contains_key(&(t, s)) {
                    return Err(format!("{kind} slot {s} is free and referenced"));
                }
            }
            for (s, p) in tier.pins.iter().enumerate() {
                let p = p.load(Ordering::Acquire);
                if p != 0 {
                    return Err(format!(
                        "{kind} slot {s} has pin word {p:#x} while quiescent"
                    ));
                }
                match refs.get(&(t, s as u32)) {
                    None if !free[s] => {
                        return Err(format!(
                            "{kind} slot {s} leaked: neither free nor referenced"
                        ));
                    }
                    Some(k) if st.keys[s] != *k => {
                        return Err(format!(
                            "{kind} slot {s} is referenced by {k} but records {}",
                            st.keys[s]
                        ));
                    }
                    _ => {}
                }
            }
            if t == self.host {
                // Every hold counted on a slot is one the budget counts, and the other way.
                let held: u64 = st.held.iter().map(|&n| u64::from(n)).sum();
                let budget = self.holds.blocks.load(Ordering::Acquire);
                if held != budget {
                    return Err(format!(
                        "{kind}: {held} slot holds counted but {budget} in the hold budget"
                    ));
                }
            }
        }
        self.dram.published().check_chains()
    }
}

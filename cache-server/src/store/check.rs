//! The consistency check of a quiescent store (tests and debugging).

use crate::tier::TierKind;
use kvtier_core::BlockKey;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;

use super::Inner;
use super::lock;
use super::slots::NONE;
use super::slots::TierState;

impl Inner {
    pub(super) fn check_consistency(&self) -> Result<(), String> {
        let mut refs: HashMap<(TierKind, u32), BlockKey> = HashMap::new();
        for shard in self.shards.iter() {
            for (k, e) in lock(shard).iter() {
                if e.is_empty() {
                    return Err(format!("{k}: an index entry with no location"));
                }
                for (t, s) in [(TierKind::Dram, e.dram), (TierKind::Nvme, e.nvme)] {
                    if s != NONE
                        && let Some(other) = refs.insert((t, s), *k)
                    {
                        return Err(format!("{t} slot {s} referenced by {k} and {other}"));
                    }
                }
            }
        }
        let check = |t: TierKind, state: &Mutex<TierState>, pins: &[AtomicU32]| {
            let st = lock(state);
            let mut free = vec![false; pins.len()];
            for &s in &st.free {
                if std::mem::replace(&mut free[s as usize], true) {
                    return Err(format!("{t} slot {s} is on the free list twice"));
                }
                if refs.contains_key(&(t, s)) {
                    return Err(format!("{t} slot {s} is free and referenced"));
                }
            }
            for (s, p) in pins.iter().enumerate() {
                let p = p.load(Ordering::Acquire);
                if p != 0 {
                    return Err(format!("{t} slot {s} has pin word {p:#x} while quiescent"));
                }
                if !free[s] && !refs.contains_key(&(t, s as u32)) {
                    return Err(format!("{t} slot {s} leaked: neither free nor referenced"));
                }
            }
            Ok(())
        };
        check(TierKind::Dram, &self.dram.state, &self.dram.pins)?;
        if let Some(n) = &self.nvme {
            check(TierKind::Nvme, &n.state, &n.pins)?;
        }
        Ok(())
    }
}

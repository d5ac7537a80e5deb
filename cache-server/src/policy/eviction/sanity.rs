//! [`Checked`]: a wrapper that checks the [`EvictionPolicy`] contract on every call, the way
//! foyer's `sanity.rs` wraps its eviction containers. The conformance suite runs every policy
//! through it, and the store wraps its policies in it in debug builds (so every store test
//! checks the contract too). A violation panics with what was wrong.
//!
//! The contract it checks:
//! * slots are in range;
//! * no slot is inserted twice without a removal between;
//! * a victim is a tracked slot (inserted, not removed since) that the caller's `evictable`
//!   was asked about and accepted.
//!
//! Calls naming an untracked slot (`on_hit`, `on_remove`, lookup hits) are allowed: the
//! policy must ignore them, which the victim check then enforces.

use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_core::BlockKey;

use super::{EvictionPolicy, InsertContext, LookupContext};

/// Violations seen by the store's wrapped policies in this process (see
/// [`store_violations`]).
static STORE_VIOLATIONS: AtomicU64 = AtomicU64::new(0);

/// How many contract violations the store's policies (built by
/// [`super::EvictionKind::build`] in a debug build) have hit in this process. A violation in a
/// background copy panics inside the I/O pool, which survives it; the store's consistency
/// check reports this count so such a panic still fails the test.
pub fn store_violations() -> u64 {
    STORE_VIOLATIONS.load(Ordering::Relaxed)
}

/// See the module documentation.
pub struct Checked {
    inner: Box<dyn EvictionPolicy>,
    /// The slots the policy tracks, as the calls so far say.
    tracked: Box<[bool]>,
    /// Count violations in [`store_violations`].
    for_store: bool,
}

impl Checked {
    /// Wraps `inner`, a policy over `slots` slots.
    pub fn new(inner: Box<dyn EvictionPolicy>, slots: u32) -> Self {
        Self {
            inner,
            tracked: vec![false; slots as usize].into(),
            for_store: false,
        }
    }

    /// [`Checked::new`] for a store's tier: violations also count in [`store_violations`].
    pub(crate) fn for_store(inner: Box<dyn EvictionPolicy>, slots: u32) -> Self {
        Self {
            for_store: true,
            ..Self::new(inner, slots)
        }
    }

    /// Reports a violation: panics with `what`.
    fn violated(&self, what: String) -> ! {
        if self.for_store {
            STORE_VIOLATIONS.fetch_add(1, Ordering::Relaxed);
        }
        panic!("{}: {what}", self.inner.name())
    }

    /// Whether `slot` is tracked (inserted and not removed since).
    pub fn is_tracked(&self, slot: u32) -> bool {
        self.tracked.get(slot as usize).copied().unwrap_or(false)
    }

    fn in_range(&self, what: &str, slot: u32) {
        if slot as usize >= self.tracked.len() {
            self.violated(format!(
                "{what} of slot {slot}, past the {} slots",
                self.tracked.len()
            ));
        }
    }

    /// The inner policy's victim (bounded or not), checked against the contract.
    fn checked_victim(
        &mut self,
        evictable: &mut dyn FnMut(u32) -> bool,
        unbounded: bool,
    ) -> Option<u32> {
        // The slots the caller accepted during this search.
        let mut accepted: Vec<u32> = Vec::new();
        let mut check = |s| {
            let ok = evictable(s);
            if ok {
                accepted.push(s);
            }
            ok
        };
        let v = if unbounded {
            self.inner.victim_unbounded(&mut check)
        } else {
            self.inner.victim(&mut check)
        }?;
        self.in_range("victim", v);
        if !self.tracked[v as usize] {
            self.violated(format!(
                "victim {v} is not tracked (never inserted, or removed)"
            ));
        }
        if !accepted.contains(&v) {
            self.violated(format!(
                "victim {v} was not accepted by the caller's evictable check"
            ));
        }
        Some(v)
    }
}

impl EvictionPolicy for Checked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn on_lookup(&mut self, ctx: LookupContext<'_>) {
        for &s in ctx.hits {
            self.in_range("lookup hit", s);
        }
        self.inner.on_lookup(ctx);
    }

    fn on_insert(&mut self, slot: u32, key: BlockKey, ctx: InsertContext) {
        self.in_range("insert", slot);
        if let Some(p) = ctx.parent {
            self.in_range("parent", p);
        }
        if std::mem::replace(&mut self.tracked[slot as usize], true) {
            self.violated(format!("slot {slot} inserted twice without a removal"));
        }
        self.inner.on_insert(slot, key, ctx);
    }

    fn on_hit(&mut self, slot: u32, now_ms: u64) {
        self.in_range("hit", slot);
        self.inner.on_hit(slot, now_ms);
    }

    fn on_remove(&mut self, slot: u32, now_ms: u64) {
        self.in_range("remove", slot);
        self.tracked[slot as usize] = false;
        self.inner.on_remove(slot, now_ms);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.checked_victim(evictable, false)
    }

    fn victim_unbounded(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.checked_victim(evictable, true)
    }

    fn bytes_per_slot(&self) -> usize {
        // The policy's own figure: the check is a debugging aid, not part of its footprint.
        self.inner.bytes_per_slot()
    }
}

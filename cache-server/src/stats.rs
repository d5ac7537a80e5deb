//! Counters per tier, readable at any time without locks.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::tier::TierKind;

/// Live counters of one tier.
#[derive(Default, Debug)]
pub struct TierCounters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub evictions: AtomicU64,
    pub demotions: AtomicU64,
    pub demotions_dropped: AtomicU64,
    pub promotions: AtomicU64,
    pub admissions_refused: AtomicU64,
    pub corrupt_dropped: AtomicU64,
    pub io_errors: AtomicU64,
    /// Guest copies (blocks another cluster member owns) evicted ahead of the policy.
    pub guest_evictions: AtomicU64,
}

impl TierCounters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A point-in-time copy of one tier's counters and gauges (also what a client reads back
/// from the server's `stats` JSON: fields a server does not send stay 0).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TierStats {
    pub tier: Option<TierKind>,
    pub hits: u64,
    pub misses: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub evictions: u64,
    pub demotions: u64,
    pub demotions_dropped: u64,
    pub promotions: u64,
    pub admissions_refused: u64,
    pub corrupt_dropped: u64,
    pub io_errors: u64,
    /// Of `evictions`, guest copies (blocks another cluster member owns), evicted first.
    pub guest_evictions: u64,
    /// Slots holding a block.
    pub used_slots: u64,
    pub capacity_slots: u64,
    pub slot_bytes: u64,
    /// Slots held by a reader, a lease or an in-flight copy.
    pub pins_outstanding: u64,
    /// Memory the store keeps per slot of this tier (excluding the index), in bytes.
    pub metadata_bytes_per_slot: u64,
    /// Slots holding a guest copy (a block another cluster member owns).
    pub guest_slots: u64,
}

impl TierStats {
    pub(crate) fn from_counters(kind: TierKind, c: &TierCounters) -> Self {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Self {
            tier: Some(kind),
            hits: l(&c.hits),
            misses: l(&c.misses),
            bytes_in: l(&c.bytes_in),
            bytes_out: l(&c.bytes_out),
            evictions: l(&c.evictions),
            demotions: l(&c.demotions),
            demotions_dropped: l(&c.demotions_dropped),
            promotions: l(&c.promotions),
            admissions_refused: l(&c.admissions_refused),
            corrupt_dropped: l(&c.corrupt_dropped),
            io_errors: l(&c.io_errors),
            guest_evictions: l(&c.guest_evictions),
            ..Self::default()
        }
    }

    /// The counters' change since `before` (saturating); gauges (slots, pins, sizes) as in
    /// `self`.
    pub fn since(&self, before: &TierStats) -> TierStats {
        self.zip_counters(before, u64::saturating_sub)
    }

    /// Adds another server's figures for the same tier: counters, slots and pins summed; the
    /// per-slot sizes the larger of the two.
    pub fn add(&mut self, other: &TierStats) {
        let mut sum = self.zip_counters(other, u64::saturating_add);
        sum.used_slots = self.used_slots.saturating_add(other.used_slots);
        sum.capacity_slots = self.capacity_slots.saturating_add(other.capacity_slots);
        sum.pins_outstanding = self.pins_outstanding.saturating_add(other.pins_outstanding);
        sum.guest_slots = self.guest_slots.saturating_add(other.guest_slots);
        sum.slot_bytes = self.slot_bytes.max(other.slot_bytes);
        sum.metadata_bytes_per_slot = self
            .metadata_bytes_per_slot
            .max(other.metadata_bytes_per_slot);
        *self = sum;
    }

    /// `f` applied to each counter of `self` and `other`; the gauges as in `self`.
    fn zip_counters(&self, other: &TierStats, f: impl Fn(u64, u64) -> u64) -> TierStats {
        TierStats {
            hits: f(self.hits, other.hits),
            misses: f(self.misses, other.misses),
            bytes_in: f(self.bytes_in, other.bytes_in),
            bytes_out: f(self.bytes_out, other.bytes_out),
            evictions: f(self.evictions, other.evictions),
            demotions: f(self.demotions, other.demotions),
            demotions_dropped: f(self.demotions_dropped, other.demotions_dropped),
            promotions: f(self.promotions, other.promotions),
            admissions_refused: f(self.admissions_refused, other.admissions_refused),
            corrupt_dropped: f(self.corrupt_dropped, other.corrupt_dropped),
            io_errors: f(self.io_errors, other.io_errors),
            guest_evictions: f(self.guest_evictions, other.guest_evictions),
            ..self.clone()
        }
    }

    /// The tier's name (`"?"` when unknown).
    pub fn tier_name(&self) -> &'static str {
        self.tier.map_or("?", TierKind::name)
    }

    /// Hits over hits + misses (0 when nothing was asked).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// Every tier's stats plus store-wide gauges.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    pub tiers: Vec<TierStats>,
    /// Keys in the index.
    pub blocks: u64,
    pub leases_outstanding: u64,
    /// Lookups that pinned their DRAM prefix until its load (held lookups).
    pub lookup_holds: u64,
    /// Held lookups refused a hold because the hold budget was spent (nothing pinned).
    pub lookup_holds_refused: u64,
    /// DRAM blocks pinned by held lookups now.
    pub held_blocks: u64,
    /// Background jobs queued or running.
    pub io_backlog: u64,
    /// Store memory per block of capacity, all tiers and the index together, in bytes
    /// (allocated up front, so this is also the figure for a full store).
    pub metadata_bytes_per_block: u64,
    /// Retention hints ([`crate::TieredStore::retain`]).
    pub retain: RetainStats,
}

/// Retention hints: gauges (now) and counters (since start).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RetainStats {
    /// Live hints.
    pub hints: u64,
    /// Blocks of the live hints, counted per hint (the budgets' measure).
    pub hinted_blocks: u64,
    /// Distinct DRAM blocks eviction skips now.
    pub protected_blocks: u64,
    /// The global budget, in blocks (`retain_max_fraction` of the DRAM slots).
    pub max_blocks: u64,
    /// One namespace's budget, in blocks.
    pub namespace_max_blocks: u64,
    /// Hints accepted.
    pub accepted: u64,
    /// Hints refused: their namespace's budget was spent.
    pub refused_namespace: u64,
    /// Hints refused: the global budget was spent (nothing of lower priority, or of the same
    /// priority ending later, to displace).
    pub refused_global: u64,
    /// Hints refused: expected back later than the longest hold.
    pub refused_too_far: u64,
    /// Hints with no block of their prefix in DRAM.
    pub nothing_cached: u64,
    /// Blocks accepted hints protected, summed over hints.
    pub blocks_protected: u64,
    /// Hints displaced by a hint of higher priority, or of the same priority and a sooner
    /// end.
    pub displaced: u64,
    /// Hints replaced by a newer hint of the same session.
    pub replaced: u64,
    /// Hints whose hold ended before the session came back.
    pub expired: u64,
    /// Hints whose session came back (a lookup reached the hint's last block) in time.
    pub honoured: u64,
}

impl StoreStats {
    pub fn tier(&self, kind: TierKind) -> Option<&TierStats> {
        self.tiers.iter().find(|t| t.tier == Some(kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_stats_read_back_from_json_and_subtract() {
        let before = TierStats {
            tier: Some(TierKind::Nvme),
            hits: 3,
            corrupt_dropped: 1,
            used_slots: 7,
            ..TierStats::default()
        };
        let after = TierStats {
            hits: 10,
            corrupt_dropped: 4,
            used_slots: 9,
            ..before.clone()
        };
        let json = serde_json::to_string(&[&after]).unwrap();
        assert!(json.contains("\"tier\":\"nvme\""), "{json}");
        let back: Vec<TierStats> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, vec![after.clone()]);
        // A server that sends fewer fields still parses; the rest stay 0.
        let partial: TierStats = serde_json::from_str(r#"{"tier":"dram","hits":5}"#).unwrap();
        assert_eq!(
            (partial.tier_name(), partial.hits, partial.misses),
            ("dram", 5, 0)
        );
        let d = after.since(&before);
        assert_eq!((d.hits, d.corrupt_dropped, d.used_slots), (7, 3, 9));
        assert_eq!(before.since(&after).hits, 0);
    }
}

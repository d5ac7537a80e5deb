//! Whether requests come back to the member that served their chain before
//! (`cluster.routing = "auto"`, `docs/cluster.md`, "Guests").
//!
//! A member remembers the blocks its own clients put (two generations of `capacity` keys'
//! low 64 bits). A client's lookup whose prefix reaches past the shared blocks is a sample:
//! did the prefix's last block come from a put here? Under routing that keeps a session on
//! one member (a router's session affinity) nearly every sample says yes, whatever was
//! evicted (the prefix then ends at an earlier block of the same chain, also put here).
//! Under round robin over N members about 1/N do. Content that many chains share (a
//! system prompt) is put by every member itself, so a prefix ending in it says nothing of
//! where the chain's last request went: a lookup whose prefix ends at a block that ended an
//! earlier sampled lookup here is no sample (a session's chain grows, so its prefix ends at
//! a new block each time; a shared prompt's end comes back again and again). Without that,
//! on Mooncake's conversation trace over three members, every member chose sticky in the
//! first seconds, before the shared prompt was found to be a split, and the hit rate fell
//! from 12.98 % to 11.50 %.
//!
//! The share (a moving average over about [`WINDOW`] samples) decides which copy of a
//! block another member owns is the guest, the one evicted first. The copy on the member
//! that used it is kept (sticky) only once nearly every request comes back,
//! [`STICKY_AT`]; the member goes back to spread below [`SPREAD_AT`]. Keeping the wrong
//! copy costs more under round robin (the owners' copies are what the other members read:
//! about half the cluster's hits on the Claude Code samples) than under session routing
//! (a few points), so the rule leans to spread. Nothing is chosen before [`MIN_SAMPLES`].

use kvtier_core::BlockKey;

/// Samples the moving average spans, about (its weight is 1 / WINDOW).
pub const WINDOW: f64 = 128.0;
/// Samples before the first choice (until then: spread).
pub const MIN_SAMPLES: u64 = 32;
/// The share at or above which a member keeps its own copies.
pub const STICKY_AT: f64 = 0.9;
/// The share at or below which it goes back to spread (between the two: as it is).
pub const SPREAD_AT: f64 = 0.75;

/// See the module doc.
pub struct Returns {
    /// Blocks this member's clients put.
    puts: Generations,
    /// Blocks sampled lookups' prefixes ended at.
    ends: Generations,
    share: f64,
    samples: u64,
    sticky: bool,
}

impl Returns {
    /// Remembers up to `capacity` put blocks a generation (two generations), and a quarter
    /// as many ends of sampled lookups (one a lookup), at least 1,024.
    pub fn new(capacity: usize) -> Self {
        Self {
            puts: Generations::new(capacity),
            ends: Generations::new((capacity / 4).max(1024)),
            share: 0.0,
            samples: 0,
            sticky: false,
        }
    }

    /// A client of this member put `key`.
    pub fn put(&mut self, key: &BlockKey) {
        self.puts.insert(key.low_u64());
    }

    /// A client's lookup found a prefix (past the shared blocks) ending at `last`: one
    /// sample, unless an earlier sample ended there. Returns whether the member now keeps
    /// its own copies (sticky).
    pub fn looked_up(&mut self, last: &BlockKey) -> bool {
        let k = last.low_u64();
        if !self.ends.insert(k) {
            return self.sticky;
        }
        let here = self.puts.contains(k);
        self.samples += 1;
        let w = (1.0 / self.samples as f64).max(1.0 / WINDOW);
        self.share += w * (f64::from(u8::from(here)) - self.share);
        if self.samples >= MIN_SAMPLES {
            if self.share >= STICKY_AT {
                self.sticky = true;
            } else if self.share <= SPREAD_AT {
                self.sticky = false;
            }
        }
        self.sticky
    }

    /// The share of samples whose prefix ended at a block put here (0 before any).
    pub fn share(&self) -> f64 {
        self.share
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn sticky(&self) -> bool {
        self.sticky
    }
}

/// A set of keys' low 64 bits in two generations of up to `capacity` each: the older
/// generation goes when the newer one is full.
struct Generations {
    capacity: usize,
    now: std::collections::HashSet<u64>,
    old: std::collections::HashSet<u64>,
}

impl Generations {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            now: std::collections::HashSet::new(),
            old: std::collections::HashSet::new(),
        }
    }

    fn contains(&self, k: u64) -> bool {
        self.now.contains(&k) || self.old.contains(&k)
    }

    /// Whether `k` was not in the set.
    fn insert(&mut self, k: u64) -> bool {
        if self.contains(k) {
            return false;
        }
        if self.now.len() >= self.capacity {
            self.old = std::mem::take(&mut self.now);
        }
        self.now.insert(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u128) -> BlockKey {
        BlockKey::from_u128(n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
    }

    #[test]
    fn sessions_that_come_back_make_it_sticky_and_round_robin_does_not() {
        // Every prefix ends at a block put here: sticky once there are enough samples.
        let mut r = Returns::new(1024);
        for i in 0..(MIN_SAMPLES as u128) {
            r.put(&k(i));
            assert_eq!(r.looked_up(&k(i)), i + 1 >= MIN_SAMPLES as u128, "{i}");
        }
        assert!(r.share() > 0.99);
        // Round robin over three members: one in three. It goes back to spread.
        let mut i = 1000;
        while r.sticky() {
            i += 1;
            r.put(&k(i));
            let back = if i % 3 == 0 { k(i) } else { k(i + 1_000_000) };
            r.looked_up(&back);
            assert!(
                i < 1000 + 4 * WINDOW as u128,
                "still sticky at {}",
                r.share()
            );
        }
        assert!(r.share() <= SPREAD_AT);
        for _ in 0..1000 {
            i += 1;
            r.put(&k(i));
            r.looked_up(&if i % 3 == 0 { k(i) } else { k(i + 1_000_000) });
            assert!(!r.sticky(), "{}", r.share());
        }
        assert!((r.share() - 1.0 / 3.0).abs() < 0.15, "{}", r.share());
    }

    #[test]
    fn a_share_between_the_thresholds_keeps_the_choice() {
        // Five lookups in six come back (83 %): the choice does not move either way.
        for start_sticky in [false, true] {
            let mut r = Returns::new(1 << 16);
            if start_sticky {
                for i in 0..200 {
                    r.put(&k(i));
                    r.looked_up(&k(i));
                }
                assert!(r.sticky());
            }
            for i in 0..3000u128 {
                r.put(&k(10_000 + i));
                r.looked_up(&k(if i % 6 == 0 {
                    (1 << 40) + i
                } else {
                    10_000 + i
                }));
                if i > 4 * WINDOW as u128 {
                    assert_eq!(r.sticky(), start_sticky, "{i}: {}", r.share());
                }
            }
        }
        // Two members in turn (50 %): spread, from either side.
        let mut r = Returns::new(1 << 16);
        for i in 0..2000u128 {
            r.put(&k(i));
            r.looked_up(&k(if i % 2 == 0 { i } else { (1 << 40) + i }));
            assert!(!r.sticky(), "{i}");
        }
    }

    #[test]
    fn few_samples_choose_nothing_and_old_puts_are_forgotten() {
        let mut r = Returns::new(4);
        for i in 0..(MIN_SAMPLES as u128 - 1) {
            r.put(&k(i));
            assert!(!r.looked_up(&k(i)));
        }
        // Two generations of 4: the 9th put on forgets the first.
        let mut r = Returns::new(4);
        for i in 0..9 {
            r.put(&k(i));
        }
        assert!(!r.puts.contains(k(0).low_u64()));
        assert!(r.puts.contains(k(4).low_u64()) && r.puts.contains(k(8).low_u64()));
        r.looked_up(&k(8));
        r.looked_up(&k(0));
        assert_eq!(r.samples(), 2);
        assert!((r.share() - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_prefix_ending_where_an_earlier_one_did_is_no_sample() {
        // Every member put the shared prompt itself; lookups of many chains end in it.
        let mut r = Returns::new(1024);
        r.put(&k(7));
        for _ in 0..100 {
            assert!(!r.looked_up(&k(7)));
        }
        assert_eq!(r.samples(), 1);
        // Chains put elsewhere: their prefixes end at new blocks each time.
        for i in 0..100 {
            r.looked_up(&k(1000 + i));
        }
        assert_eq!(r.samples(), 101);
        assert!(r.share() < 0.02 && !r.sticky(), "{}", r.share());
    }
}

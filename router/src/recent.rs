//! Blocks the router has sent each worker, remembered for a short while: a worker computes and
//! stores a prompt's blocks only after the router has routed it, and its server's events
//! reach the router later still, so a session's next turn that comes within that window would
//! find its own worker holding nothing and be sent elsewhere. Until the events catch up (or
//! the memory expires), a block the router sent a worker counts as held by that worker.
//! Free of I/O and of the clock (callers pass `now`): tested on constructed timelines.
//!
//! **Memory.** At most `cap` remembered entries per worker (a key may be entered more than
//! once; each entry is a 16-byte key and an 8-byte instant in a queue, plus at most one map
//! entry per key): about 60 bytes an entry, so 65,536 entries are about 4 MiB a worker.
//!
//! **Invariant:** every key in the map has an entry in the queue with the map's expiry, so
//! dropping queue entries from the front bounds the map too.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvtier_core::BlockKey;

/// Blocks recently routed to one worker.
#[derive(Debug)]
pub struct RecentRoutes {
    ttl: Duration,
    cap: usize,
    expiry: HashMap<BlockKey, Instant>,
    queue: VecDeque<(BlockKey, Instant)>,
}

impl RecentRoutes {
    /// Remembers a block for `ttl`, at most `cap` entries (0: remembers nothing).
    pub fn new(ttl: Duration, cap: usize) -> Self {
        Self {
            ttl,
            cap,
            expiry: HashMap::new(),
            queue: VecDeque::new(),
        }
    }

    /// The worker was sent a prompt with these blocks at `now`.
    pub fn record(&mut self, keys: &[BlockKey], now: Instant) {
        if self.cap == 0 || self.ttl.is_zero() {
            return;
        }
        let until = now + self.ttl;
        // Only the last `cap` keys can stay: skip the rest of a prompt longer than the cap.
        for k in &keys[keys.len().saturating_sub(self.cap)..] {
            self.expiry.insert(*k, until);
            self.queue.push_back((*k, until));
        }
        self.trim(now);
    }

    /// Whether the worker was sent `key` within the last `ttl`.
    pub fn holds(&self, key: &BlockKey, now: Instant) -> bool {
        self.expiry.get(key).is_some_and(|until| *until > now)
    }

    /// Remembered entries (keys entered more than once count once per entry).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Drops expired entries and the oldest beyond the cap.
    fn trim(&mut self, now: Instant) {
        while let Some(&(k, until)) = self.queue.front() {
            if until > now && self.queue.len() <= self.cap {
                break;
            }
            self.queue.pop_front();
            // A later entry of the same key keeps it (its expiry is later).
            if self.expiry.get(&k) == Some(&until) {
                self.expiry.remove(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey::from_bytes([i; 16])
    }

    #[test]
    fn a_routed_block_is_held_until_it_expires() {
        let t0 = Instant::now();
        let mut r = RecentRoutes::new(Duration::from_secs(10), 100);
        r.record(&[key(1), key(2)], t0);
        assert!(r.holds(&key(1), t0 + Duration::from_secs(9)));
        assert!(!r.holds(&key(3), t0));
        assert!(!r.holds(&key(1), t0 + Duration::from_secs(10)));
        // Routed again later: held again from then, and the old entry's expiry does not
        // take the new one away.
        r.record(&[key(1)], t0 + Duration::from_secs(5));
        r.record(&[key(9)], t0 + Duration::from_secs(11));
        assert!(r.holds(&key(1), t0 + Duration::from_secs(14)));
        assert!(!r.holds(&key(2), t0 + Duration::from_secs(11)));
        assert_eq!(r.len(), 2, "the expired entries are gone");
    }

    #[test]
    fn the_cap_bounds_the_memory_and_keeps_the_newest() {
        let t0 = Instant::now();
        let mut r = RecentRoutes::new(Duration::from_secs(60), 4);
        r.record(&[key(1), key(2), key(3)], t0);
        r.record(&[key(4), key(5)], t0);
        assert_eq!(r.len(), 4);
        assert!(!r.holds(&key(1), t0));
        assert!((2..=5).all(|i| r.holds(&key(i), t0)));
        // A prompt longer than the cap: its last blocks are kept.
        r.record(&(10..20).map(key).collect::<Vec<_>>(), t0);
        assert_eq!(r.len(), 4);
        assert!((16..20).all(|i| r.holds(&key(i), t0)));
        assert!(r.expiry.len() <= 4);
        // Nothing remembered at all with a zero cap or ttl.
        for mut off in [
            RecentRoutes::new(Duration::from_secs(60), 0),
            RecentRoutes::new(Duration::ZERO, 10),
        ] {
            off.record(&[key(1)], t0);
            assert!(off.is_empty() && !off.holds(&key(1), t0));
        }
    }
}

//! Each session's home: the worker that answered its last request (`kv` policy). The next
//! turn of a session stays there while that worker holds the longest prefix of it, unless
//! another is expected to answer much sooner (`score::kv_order`); a session the router has
//! not seen goes where the fewest active sessions are at home, then by load. Free of I/O and
//! of the clock (callers pass `now`).
//!
//! **Active sessions.** A session is *active* for `active` after its last request (its home
//! counts it); [`SessionHomes::homed`] gives, per worker, the active sessions at home there.
//! Sessions stay where they start, so the sessions a worker is home to are the load it will
//! carry, which the load of the moment misses (a session between turns, waiting on a tool,
//! sends nothing). Bounded like the homes (`cap` sessions, two queue entries each at most).
//!
//! **Memory.** At most `cap` sessions, each for `ttl` after its last request (the oldest go
//! first), kept by a 64-bit keyed hash of the id (SipHash with keys drawn per process), so an
//! entry's size does not depend on what a client sends as its id: a map entry and at most two
//! queue entries, about 100 bytes, so 65,536 sessions are about 6.5 MiB. Two ids with one hash
//! (about one pair in 2^64 / sessions^2) share a home: a routing preference, never data.
//!
//! **Invariant** (as in `recent.rs`): every session in the map has a queue entry with the
//! map's expiry, so dropping queue entries from the front bounds the map too.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct SessionHomes {
    ttl: Duration,
    cap: usize,
    /// The session id's hash -> (worker, expiry, the number of its newest queue entry).
    home: HashMap<u64, (usize, Instant, u64)>,
    /// (the session id's hash, expiry, entry number), oldest first.
    queue: VecDeque<(u64, Instant, u64)>,
    next: u64,
    /// The keys of the ids' hash.
    keys: RandomState,
    /// How long after its last request a session counts as active.
    active: Duration,
    /// Active sessions: the id's hash -> (worker, the number of its newest entry).
    live: HashMap<u64, (usize, u64)>,
    /// (the id's hash, when it was seen, entry number), oldest first.
    live_queue: VecDeque<(u64, Instant, u64)>,
    /// Per worker, the active sessions at home there (`live` counted by worker).
    homed: Vec<u32>,
}

impl SessionHomes {
    /// Remembers a session for `ttl` after its last request, at most `cap` sessions (0:
    /// remembers none).
    pub fn new(ttl: Duration, cap: usize) -> Self {
        Self {
            ttl,
            cap,
            home: HashMap::new(),
            queue: VecDeque::new(),
            next: 0,
            keys: RandomState::new(),
            active: ttl,
            live: HashMap::new(),
            live_queue: VecDeque::new(),
            homed: Vec::new(),
        }
    }

    /// Counts a session as active for `active` after its last request (at most the `ttl`;
    /// zero: none is).
    pub fn with_active(mut self, active: Duration) -> Self {
        self.active = active.min(self.ttl);
        self
    }

    /// Per worker (by index; missing: 0), the sessions at home there that sent a request
    /// within the active time.
    pub fn homed(&mut self, now: Instant) -> &[u32] {
        self.trim_live(now);
        &self.homed
    }

    fn trim_live(&mut self, now: Instant) {
        while let Some(&(id, seen, n)) = self.live_queue.front() {
            if seen + self.active > now
                && self.live.len() <= self.cap
                && self.live_queue.len() <= 2 * self.cap
            {
                break;
            }
            // A later request of the same session keeps it (a newer entry).
            if let Some(&(w, m)) = self.live.get(&id)
                && m == n
            {
                self.live.remove(&id);
                self.homed[w] -= 1;
            }
            self.live_queue.pop_front();
        }
    }

    fn id(&self, session: &str) -> u64 {
        self.keys.hash_one(session)
    }

    /// `worker` answered a request of `session` at `now`.
    pub fn set(&mut self, session: &str, worker: usize, now: Instant) {
        if self.cap == 0 || self.ttl.is_zero() {
            return;
        }
        let until = now + self.ttl;
        let n = self.next;
        self.next += 1;
        let id = self.id(session);
        self.home.insert(id, (worker, until, n));
        self.queue.push_back((id, until, n));
        self.trim(now);
        if self.active.is_zero() {
            return;
        }
        if let Some((was, _)) = self.live.insert(id, (worker, n)) {
            self.homed[was] -= 1;
        }
        if self.homed.len() <= worker {
            self.homed.resize(worker + 1, 0);
        }
        self.homed[worker] += 1;
        self.live_queue.push_back((id, now, n));
        self.trim_live(now);
    }

    /// The worker that answered the session's last request within `ttl`.
    pub fn get(&self, session: &str, now: Instant) -> Option<usize> {
        self.home
            .get(&self.id(session))
            .and_then(|&(w, until, _)| (until > now).then_some(w))
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.home.len()
    }

    pub fn is_empty(&self) -> bool {
        self.home.is_empty()
    }

    fn trim(&mut self, now: Instant) {
        while let Some((id, until, n)) = self.queue.front() {
            if *until > now && self.home.len() <= self.cap && self.queue.len() <= 2 * self.cap {
                break;
            }
            // A later request of the same session keeps it (a newer entry).
            if self.home.get(id).is_some_and(|(_, _, m)| m == n) {
                self.home.remove(id);
            }
            self.queue.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_at_its_last_worker_until_it_expires() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut h = SessionHomes::new(Duration::from_secs(10), 100);
        h.set("a", 2, t0);
        assert_eq!(h.get("a", s(9)), Some(2));
        assert_eq!(h.get("b", t0), None);
        assert_eq!(h.get("a", s(10)), None);
        // Moved, later: the new worker, for 10 s from then, whatever the old entry's expiry.
        h.set("a", 1, s(5));
        h.set("c", 0, s(11));
        assert_eq!(h.get("a", s(14)), Some(1));
        assert_eq!(h.len(), 2);
        h.set("c", 0, s(16));
        assert_eq!(h.get("a", s(16)), None);
        assert_eq!(h.len(), 1, "the expired session is gone");
    }

    #[test]
    fn active_sessions_are_counted_at_their_home() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut h =
            SessionHomes::new(Duration::from_secs(100), 100).with_active(Duration::from_secs(10));
        assert!(h.homed(t0).is_empty());
        h.set("a", 0, t0);
        h.set("b", 0, t0);
        h.set("c", 2, s(1));
        assert_eq!(h.homed(s(1)), [2, 0, 1]);
        // A session that moves is counted at its new home only; asked again, once.
        h.set("a", 1, s(5));
        h.set("a", 1, s(6));
        assert_eq!(h.homed(s(6)), [1, 1, 1]);
        // Quiet for the active time: no longer counted, though still at home.
        assert_eq!(h.homed(s(10)), [0, 1, 1]);
        assert_eq!(h.homed(s(16)), [0, 0, 0]);
        assert_eq!(h.get("a", s(16)), Some(1));
        // Back: counted again.
        h.set("b", 2, s(20));
        assert_eq!(h.homed(s(20)), [0, 0, 1]);
        // Zero active time: nothing is counted.
        let mut off = SessionHomes::new(Duration::from_secs(100), 100).with_active(Duration::ZERO);
        off.set("a", 3, t0);
        assert!(off.homed(t0).iter().all(|&n| n == 0));
        // The cap bounds the active sessions too.
        let mut capped = SessionHomes::new(Duration::from_secs(100), 2);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            capped.set(id, i, t0);
        }
        assert_eq!(capped.homed(t0).iter().sum::<u32>(), 2);
        assert!(capped.live_queue.len() <= 4);
    }

    #[test]
    fn the_cap_keeps_the_most_recent_sessions() {
        let t0 = Instant::now();
        let mut h = SessionHomes::new(Duration::from_secs(60), 3);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            h.set(id, i, t0);
        }
        assert_eq!(h.len(), 3);
        assert_eq!(h.get("a", t0), None);
        assert_eq!(h.get("d", t0), Some(3));
        // One session asked again and again keeps the queue bounded too.
        for _ in 0..100 {
            h.set("d", 3, t0);
        }
        assert!(h.queue.len() <= 6, "{}", h.queue.len());
        assert_eq!(h.get("d", t0), Some(3));
        for mut off in [
            SessionHomes::new(Duration::from_secs(60), 0),
            SessionHomes::new(Duration::ZERO, 10),
        ] {
            off.set("a", 1, t0);
            assert!(off.is_empty() && off.get("a", t0).is_none());
        }
    }
}

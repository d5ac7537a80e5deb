//! Retention hints: a client tells the store that a session's prefix will be looked up again
//! in about `expected_return` (an agent waiting on a tool call). The host tier's eviction
//! skips the prefix's DRAM blocks until the first of: the session comes back (a lookup
//! whose served prefix reaches the hint's last block), the hold ends (`min(expected_return
//! x slack, retain_max)` on the store's clock), the same session sends a newer hint, or a
//! hint of higher priority displaces it.
//!
//! What hints may hold is bounded: at most `retain_max_fraction` of the DRAM tier's slots
//! over all hints, and a namespace's share of that (`retain_namespace_max_fraction`, or an
//! equal share per namespace) so one tenant cannot starve the others. Blocks are counted per
//! hint (a block two hints share counts twice), so the count bounds the protected slots from
//! above. A hint that would pass a budget is refused and counted; it never waits.
//!
//! Over the global budget a hint displaces hints of lower priority and, at the same
//! priority, hints that end later than it would (lowest priority first, the latest to end
//! first): the room goes to the sessions back soonest. A protected block costs its slot for
//! the whole hold and saves one block if its session comes back, and the offline optimum
//! evicts first the block used furthest in the future: a session that says it will be away
//! long is the one to give up. Without this, hints that came first kept the budget for as
//! long as their sessions said, however far away, and the hints that would have paid were
//! refused (`docs/benchmarks.md`, "Retention hints in the replay").
//!
//! Locking: the retention state has its own lock. Eviction takes it under the tier lock (the
//! order is tier -> retention); the hint path reads the index (shard locks) before taking it
//! and takes no other lock under it.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvtier_core::BlockKey;

use crate::keyhash::KeyHashing;
use crate::stats::RetainStats;

use super::slots::NONE;
use super::{Inner, lock};

/// How many keys at the end of a lookup's served prefix are checked for a hint's last
/// block: a returning session's prefix ends at (or just past) the block it hinted.
pub const RETAIN_TIP_PROBES: usize = 64;

/// A retention hint, as the store takes it.
#[derive(Clone, Copy, Debug)]
pub struct RetainRequest<'a> {
    /// The namespace the hint's keys live in (its budget is this namespace's).
    pub namespace: usize,
    /// The client's session id (0 = none); a newer hint of the session replaces the older.
    pub session: u64,
    /// The prefix's keys, in chain order.
    pub keys: &'a [BlockKey],
    /// When the session is expected back.
    pub expected_return: Duration,
    /// 0 is the lowest; over the global budget a hint displaces hints of lower priority (and
    /// of its own priority that end later).
    pub priority: u8,
}

/// What became of a retention hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetainOutcome {
    /// `blocks` DRAM blocks of the prefix are protected for `hold`.
    Accepted { blocks: usize, hold: Duration },
    /// No block of the prefix is in DRAM.
    NothingCached,
    /// The namespace's share of protected blocks is spent.
    OverNamespaceBudget,
    /// The store's share is spent, with no lower-priority hint to displace.
    OverGlobalBudget,
    /// The expected return is later than the longest hold (`retain_max`).
    TooFar,
    /// Retention is off (`retain_max_fraction` is 0).
    Off,
}

struct Hint {
    namespace: usize,
    session: u64,
    /// The prefix's keys that were in DRAM when the hint came, in chain order.
    keys: Vec<BlockKey>,
    /// The key the session's return is recognised by: the last of the prefix's keys.
    tip: BlockKey,
    deadline_ms: u64,
    priority: u8,
}

struct State {
    next_id: u64,
    hints: HashMap<u64, Hint>,
    /// The live hints in the order they are displaced: lowest priority first, then the
    /// latest to end (so the hints a new one may displace are a prefix of it).
    by_rank: BTreeSet<(u8, Reverse<u64>, u64)>,
    /// The live hints by the end of their hold, soonest first.
    by_deadline: BTreeSet<(u64, u64)>,
    by_session: HashMap<(usize, u64), u64>,
    by_tip: HashMap<BlockKey, Vec<u64>, KeyHashing>,
    /// How many live hints protect each key.
    protected: HashMap<BlockKey, u32, KeyHashing>,
    /// Blocks of all live hints, and per namespace.
    blocks: u64,
    namespace_blocks: HashMap<usize, u64>,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    refused_namespace: AtomicU64,
    refused_global: AtomicU64,
    refused_too_far: AtomicU64,
    nothing_cached: AtomicU64,
    blocks_protected: AtomicU64,
    displaced: AtomicU64,
    replaced: AtomicU64,
    expired: AtomicU64,
    honoured: AtomicU64,
}

/// The hints and their budgets.
pub(super) struct Retention {
    state: Mutex<State>,
    /// Live hints (read without the lock: eviction and lookups skip all of this at zero).
    live: AtomicUsize,
    max_blocks: u64,
    namespace_max_blocks: AtomicU64,
    /// The configured namespace share; 0 = an equal share per namespace.
    namespace_fraction: f64,
    max_hold_ms: u64,
    slack: f64,
    counters: Counters,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Retention {
    pub(super) fn new(
        host_slots: u64,
        max_fraction: f64,
        namespace_fraction: f64,
        max_hold: Duration,
        slack: f64,
        hashing: KeyHashing,
    ) -> Self {
        let max_blocks = (host_slots as f64 * max_fraction.clamp(0.0, 1.0)) as u64;
        let namespace_max = if namespace_fraction > 0.0 {
            ((host_slots as f64 * namespace_fraction.clamp(0.0, 1.0)) as u64).min(max_blocks)
        } else {
            max_blocks
        };
        Self {
            state: Mutex::new(State {
                next_id: 0,
                hints: HashMap::new(),
                by_rank: BTreeSet::new(),
                by_deadline: BTreeSet::new(),
                by_session: HashMap::new(),
                by_tip: HashMap::with_hasher(hashing.clone()),
                protected: HashMap::with_hasher(hashing),
                blocks: 0,
                namespace_blocks: HashMap::new(),
            }),
            live: AtomicUsize::new(0),
            max_blocks,
            namespace_max_blocks: AtomicU64::new(namespace_max),
            namespace_fraction,
            max_hold_ms: max_hold.as_millis().min(u128::from(u64::MAX)) as u64,
            slack: slack.max(0.0),
            counters: Counters::default(),
        }
    }

    /// Tells the budgets how many namespaces share the store: without a configured namespace
    /// share, each gets an equal part of the global budget.
    pub(super) fn set_namespaces(&self, n: usize) {
        if self.namespace_fraction <= 0.0 {
            self.namespace_max_blocks
                .store(self.max_blocks / n.max(1) as u64, Ordering::Relaxed);
        }
    }

    pub(super) fn any(&self) -> bool {
        self.live.load(Ordering::Acquire) > 0
    }

    /// The protected keys, for an eviction to consult under the tier lock.
    pub(super) fn protected(&self) -> RetainGuard<'_> {
        RetainGuard(lock(&self.state))
    }

    fn remove_hint(st: &mut State, id: u64) -> Option<Hint> {
        let h = st.hints.remove(&id)?;
        st.by_rank.remove(&(h.priority, Reverse(h.deadline_ms), id));
        st.by_deadline.remove(&(h.deadline_ms, id));
        for k in &h.keys {
            if let Some(c) = st.protected.get_mut(k) {
                *c -= 1;
                if *c == 0 {
                    st.protected.remove(k);
                }
            }
        }
        if let Some(ids) = st.by_tip.get_mut(&h.tip) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                st.by_tip.remove(&h.tip);
            }
        }
        if st.by_session.get(&(h.namespace, h.session)) == Some(&id) {
            st.by_session.remove(&(h.namespace, h.session));
        }
        let n = h.keys.len() as u64;
        st.blocks -= n;
        if let Some(b) = st.namespace_blocks.get_mut(&h.namespace) {
            *b -= n;
            if *b == 0 {
                st.namespace_blocks.remove(&h.namespace);
            }
        }
        Some(h)
    }

    fn publish(&self, st: &State) {
        self.live.store(st.hints.len(), Ordering::Release);
    }

    /// Forgets hints whose hold has ended by `now_ms`; returns how many.
    pub(super) fn expire(&self, now_ms: u64) -> usize {
        if !self.any() {
            return 0;
        }
        let mut st = lock(&self.state);
        let n = Self::expire_locked(&mut st, now_ms);
        self.counters.expired.fetch_add(n as u64, Ordering::Relaxed);
        self.publish(&st);
        n
    }

    fn expire_locked(st: &mut State, now_ms: u64) -> usize {
        let mut n = 0;
        while let Some(&(deadline, id)) = st.by_deadline.first()
            && deadline <= now_ms
        {
            Self::remove_hint(st, id);
            n += 1;
        }
        n
    }

    /// A lookup served `served` (a prefix of its keys): hints whose last block is among the
    /// last [`RETAIN_TIP_PROBES`] of them are honoured (the session came back) and forgotten.
    pub(super) fn returned(&self, served: &[BlockKey]) {
        if !self.any() || served.is_empty() {
            return;
        }
        let mut st = lock(&self.state);
        let from = served.len().saturating_sub(RETAIN_TIP_PROBES);
        for k in served[from..].iter().rev() {
            let Some(ids) = st.by_tip.get(k).cloned() else {
                continue;
            };
            for id in ids {
                if Self::remove_hint(&mut st, id).is_some() {
                    inc(&self.counters.honoured);
                }
            }
        }
        self.publish(&st);
    }

    /// Forgets every hint (the store was cleared).
    pub(super) fn clear(&self) {
        let mut st = lock(&self.state);
        let ids: Vec<u64> = st.hints.keys().copied().collect();
        for id in ids {
            Self::remove_hint(&mut st, id);
        }
        self.publish(&st);
    }

    pub(super) fn stats(&self) -> RetainStats {
        let (hints, blocks, protected) = {
            let st = lock(&self.state);
            (st.hints.len(), st.blocks, st.protected.len())
        };
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RetainStats {
            hints: hints as u64,
            hinted_blocks: blocks,
            protected_blocks: protected as u64,
            max_blocks: self.max_blocks,
            namespace_max_blocks: self.namespace_max_blocks.load(Ordering::Relaxed),
            accepted: r(&c.accepted),
            refused_namespace: r(&c.refused_namespace),
            refused_global: r(&c.refused_global),
            refused_too_far: r(&c.refused_too_far),
            nothing_cached: r(&c.nothing_cached),
            blocks_protected: r(&c.blocks_protected),
            displaced: r(&c.displaced),
            replaced: r(&c.replaced),
            expired: r(&c.expired),
            honoured: r(&c.honoured),
        }
    }
}

/// The retention state, locked: which keys eviction must skip.
pub(super) struct RetainGuard<'a>(std::sync::MutexGuard<'a, State>);

impl RetainGuard<'_> {
    pub(super) fn contains(&self, key: &BlockKey) -> bool {
        self.0.protected.contains_key(key)
    }
}

impl Inner {
    pub(super) fn retain(&self, req: RetainRequest<'_>) -> RetainOutcome {
        let r = &self.retain;
        if r.max_blocks == 0 {
            return RetainOutcome::Off;
        }
        let expected_ms = req.expected_return.as_millis().min(u128::from(u64::MAX)) as u64;
        if expected_ms > r.max_hold_ms {
            inc(&r.counters.refused_too_far);
            return RetainOutcome::TooFar;
        }
        let hold_ms = ((expected_ms as f64 * r.slack).ceil() as u64).clamp(1, r.max_hold_ms.max(1));
        // The prefix's blocks in DRAM now: only those are protected (and counted).
        let h = self.host;
        let keys: Vec<BlockKey> = req
            .keys
            .iter()
            .filter(|k| self.shard(k).get(k).is_some_and(|e| e.loc[h] != NONE))
            .copied()
            .collect();
        let Some(&tip) = req.keys.last() else {
            inc(&r.counters.nothing_cached);
            return RetainOutcome::NothingCached;
        };
        if keys.is_empty() {
            inc(&r.counters.nothing_cached);
            return RetainOutcome::NothingCached;
        }
        let n = keys.len() as u64;
        let now = self.now();
        let deadline_ms = now.saturating_add(hold_ms);
        let mut st = lock(&r.state);
        let expired = Retention::expire_locked(&mut st, now);
        r.counters
            .expired
            .fetch_add(expired as u64, Ordering::Relaxed);
        // A newer hint of the same session supersedes the older (its prefix grew).
        if req.session != 0
            && let Some(&old) = st.by_session.get(&(req.namespace, req.session))
        {
            Retention::remove_hint(&mut st, old);
            inc(&r.counters.replaced);
        }
        let ns_used = st
            .namespace_blocks
            .get(&req.namespace)
            .copied()
            .unwrap_or(0);
        let ns_max = r.namespace_max_blocks.load(Ordering::Relaxed);
        // A namespace share as large as the whole budget is the global budget's to refuse.
        if ns_used + n > ns_max && ns_max < r.max_blocks {
            inc(&r.counters.refused_namespace);
            r.publish(&st);
            return RetainOutcome::OverNamespaceBudget;
        }
        if st.blocks + n > r.max_blocks {
            // Displace hints of lower priority, and of the same priority that end later
            // (lowest priority first, the latest to end first), if that frees enough; else
            // refuse.
            let need = st.blocks + n - r.max_blocks;
            // A prefix of the displacement order; at most `need` hints (each holds a
            // block or more) are looked at when they free enough, fewer than `need` when
            // they do not: the work is bounded by the new hint's size, not by how many
            // hints live.
            let mut freed = 0;
            let mut victims = Vec::new();
            for &(priority, Reverse(deadline), id) in &st.by_rank {
                if freed >= need
                    || priority > req.priority
                    || (priority == req.priority && deadline <= deadline_ms)
                {
                    break;
                }
                freed += st.hints.get(&id).map_or(0, |x| x.keys.len() as u64);
                victims.push(id);
            }
            if freed < need {
                inc(&r.counters.refused_global);
                r.publish(&st);
                return RetainOutcome::OverGlobalBudget;
            }
            for id in victims {
                Retention::remove_hint(&mut st, id);
                inc(&r.counters.displaced);
            }
        }
        let id = st.next_id;
        st.next_id += 1;
        for k in &keys {
            *st.protected.entry(*k).or_insert(0) += 1;
        }
        st.by_tip.entry(tip).or_default().push(id);
        if req.session != 0 {
            st.by_session.insert((req.namespace, req.session), id);
        }
        st.blocks += n;
        *st.namespace_blocks.entry(req.namespace).or_insert(0) += n;
        st.by_rank.insert((req.priority, Reverse(deadline_ms), id));
        st.by_deadline.insert((deadline_ms, id));
        st.hints.insert(
            id,
            Hint {
                namespace: req.namespace,
                session: req.session,
                keys,
                tip,
                deadline_ms,
                priority: req.priority,
            },
        );
        r.publish(&st);
        inc(&r.counters.accepted);
        r.counters.blocks_protected.fetch_add(n, Ordering::Relaxed);
        RetainOutcome::Accepted {
            blocks: n as usize,
            hold: Duration::from_millis(hold_ms),
        }
    }
}

//! Set dueling for [`super::ChainAware`]: small shadow caches, run on a fixed sample of the
//! keys, one without conversation protection (leaf-first recency) and one for each
//! protection horizon the policy may use. The main policy uses the horizon of the shadow that
//! has hit most over the recent requests, and no protection unless that shadow leads the
//! unprotected one by a margin.
//!
//! Protection is an admission filter: it wins when many long conversations cycle through a
//! cache too small for all of them (it keeps some whole instead of losing all), and loses
//! when their returns are quick enough for recency alone; too short a horizon lets a
//! conversation go just before it returns, too long a one keeps conversations that never do.
//! Which case holds depends on the traffic and the capacity, not on a constant, so the
//! policy measures it.
//!
//! A shadow holds only the sampled keys (about 1 in [`SAMPLE`]) in `slots / SAMPLE` slots:
//! the sampled keys of a request form a chain of their own, and a shadow sees each request
//! as the store does (a lookup of the chain, then inserts of the missing keys after the hit
//! run). Its clock counts sampled blocks only, so every horizon scales with it. The shadows
//! share one map from key to slot (a column per shadow), so a request's keys are looked up
//! once for all of them.
//!
//! A last shadow runs bimodal admission without protection (see [`super::ChainAware`]): it
//! is followed only where its score leads every other shadow's by [`BIMODAL_LEAD`] of a
//! request's sampled keys (10 points of hit rate over the window), since turning requests
//! away costs much when the traffic changes.
//!
//! The scores are moving averages over about [`WINDOW_REQUESTS`] requests; until the shadows
//! have seen that many, the duel chooses no protection (a few requests' hits are noise, and at
//! the start of a short trace a few protected requests decided the whole replay).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use kvtier_core::BlockKey;

use crate::keyhash::KeyHashing;

use super::chain::ChainAware;
use super::{EvictionPolicy, InsertContext, LookupContext, NIL};

/// About one key in this many is sampled into the shadows.
pub(crate) const SAMPLE: u64 = 16;
/// Shadows smaller than this are not worth running (the duel is then off and the policy
/// always protects, as before the duel).
const MIN_SHADOW_SLOTS: u32 = 32;
/// Weight of each request's hits in the shadows' moving scores: a window of about this many
/// requests. Until the shadows have seen this many requests (with sampled keys), their
/// scores are a few requests' worth of noise, and the duel chooses no protection.
const WINDOW_REQUESTS: u32 = 128;
/// A protecting shadow must lead the unprotected one by this share to switch protection on;
/// on a tie the policy is plain leaf-first recency. None: the best shadow counts as soon as
/// it scores more than the unprotected one. The parameter study's stated rule picked 0 among
/// 0, 5, 10 and 20 % on its tuning traces (`docs/benchmarks.md`, "A window before the duel
/// chooses"); the margin was 5 % before.
pub const PROTECT_MARGIN: f64 = 0.0;

/// The lead the bimodal-admission shadow needs over every other shadow to be followed: this
/// share of a request's sampled keys, i.e. its hit rate over the window must be this many
/// points (10) above the best other's. Turning most new requests away costs much where the
/// traffic changes, and a small shadow's lead over a cache that has hit nothing yet is a few
/// requests' luck. Chosen by the parameter study's rule on its tuning traces among 0.01,
/// 0.02, 0.05 and 0.1 (`docs/benchmarks.md`, "Bimodal admission").
const BIMODAL_LEAD: f64 = 0.1;

/// Which of the shadows (their `scores`, the unprotected one first) the policy follows: the
/// highest-scoring protecting shadow whose score leads the unprotected one's by `margin` (a
/// share), the first of equals (the shorter horizon); 0, no protection, when none does.
fn choose(mut scores: impl Iterator<Item = f64>, margin: f64) -> usize {
    let Some(unprotected) = scores.next() else {
        return 0;
    };
    let floor = unprotected * (1.0 + margin);
    let mut best = (0, floor);
    for (i, s) in scores.enumerate() {
        if s > best.1 {
            best = (i + 1, s);
        }
    }
    best.0
}

/// Whether `key` is in the sample (keys are hashes; the multiply mixes any low-bit pattern).
pub(crate) fn sampled(key: &BlockKey) -> bool {
    key.low_u64().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60 == 0
}

/// Which slot each shadow holds each sampled key in, in one map for all the shadows: a
/// request's keys are looked up once, not once a shadow.
struct KeySlots {
    /// Key -> its row; a key has a row while any shadow holds it.
    rows: HashMap<BlockKey, u32, KeyHashing>,
    /// Row `r`'s slot in shadow `i` is `slots[r * shadows + i]`; [`NIL`] where that shadow
    /// does not hold the key.
    slots: Box<[u32]>,
    free_rows: Vec<u32>,
    shadows: usize,
}

impl KeySlots {
    /// Room for `shadows` shadows of `slots` slots each, all holding different keys.
    fn new(shadows: usize, slots: u32) -> Self {
        let rows = shadows * slots as usize;
        Self {
            rows: HashMap::with_capacity_and_hasher(rows + 1, KeyHashing::new()),
            slots: vec![NIL; rows * shadows].into(),
            free_rows: (0..rows as u32).rev().collect(),
            shadows,
        }
    }

    fn row(&self, key: &BlockKey) -> Option<u32> {
        self.rows.get(key).copied()
    }

    /// Shadow `shadow`'s slot in `row`.
    fn in_row(&self, row: u32, shadow: usize) -> Option<u32> {
        let s = self.slots[row as usize * self.shadows + shadow];
        (s != NIL).then_some(s)
    }

    fn slot(&self, key: &BlockKey, shadow: usize) -> Option<u32> {
        self.row(key).and_then(|r| self.in_row(r, shadow))
    }

    fn insert(&mut self, key: BlockKey, shadow: usize, slot: u32) {
        // A row per key some shadow holds: at most `shadows x slots`, the rows made.
        let free = &mut self.free_rows;
        let row = *self
            .rows
            .entry(key)
            .or_insert_with(|| free.pop().expect("a row per held key"));
        self.slots[row as usize * self.shadows + shadow] = slot;
    }

    fn remove(&mut self, key: &BlockKey, shadow: usize) {
        let Entry::Occupied(e) = self.rows.entry(*key) else {
            return;
        };
        let base = *e.get() as usize * self.shadows;
        self.slots[base + shadow] = NIL;
        if self.slots[base..base + self.shadows]
            .iter()
            .all(|&s| s == NIL)
        {
            self.free_rows.push(e.remove());
        }
    }

    fn bytes(&self) -> usize {
        self.rows.capacity() * (16 + 4 + 1) + (self.slots.len() + self.free_rows.capacity()) * 4
    }
}

/// A simulated cache of sampled keys under one setting of the policy.
struct Shadow {
    policy: ChainAware,
    free: Vec<u32>,
    hits: Vec<u32>,
    score: f64,
}

impl Shadow {
    fn new(slots: u32, setting: Setting) -> Self {
        let mut policy = ChainAware::plain(slots, setting.horizon);
        policy.set_bimodal(setting.bimodal);
        Self {
            policy,
            free: (0..slots).rev().collect(),
            hits: Vec::with_capacity(slots as usize),
            score: 0.0,
        }
    }

    /// One request's sampled keys, in chain order, for shadow `me`; `rows` are the keys' rows
    /// in `map` when the request began: returns how many lead cached.
    ///
    /// A row read before other shadows ran is still right for this one: only this shadow
    /// writes its column, and a row is given to another key only when no shadow holds its
    /// key, so this one's column of it stays empty until this shadow writes it.
    fn request(
        &mut self,
        me: usize,
        keys: &[BlockKey],
        rows: &[Option<u32>],
        map: &mut KeySlots,
    ) -> usize {
        self.hits.clear();
        for r in rows {
            match r.and_then(|r| map.in_row(r, me)) {
                Some(s) => self.hits.push(s),
                None => break,
            }
        }
        let n = self.hits.len();
        self.policy.on_lookup(LookupContext {
            hits: &self.hits,
            rest: &keys[n..],
            now_ms: 0,
        });
        let mut parent = self.hits.last().copied();
        for &k in &keys[n..] {
            if let Some(s) = map.slot(&k, me) {
                // Cached past a hole: the store finds it already present.
                self.policy.on_hit(s, 0);
                parent = Some(s);
                continue;
            }
            let slot = match self.free.pop() {
                Some(s) => s,
                None => {
                    let Some(v) = self.policy.victim(&mut |_| true) else {
                        break;
                    };
                    map.remove(&self.policy.key_of(v), me);
                    self.policy.on_remove(v, 0);
                    if parent == Some(v) {
                        // The store refuses a put whose parent is gone: the request stops.
                        self.free.push(v);
                        break;
                    }
                    v
                }
            };
            map.insert(k, me, slot);
            self.policy
                .on_insert(slot, k, InsertContext { parent, now_ms: 0 });
            parent = Some(slot);
        }
        n
    }

    fn bytes(&self) -> usize {
        self.policy.bytes_per_slot() * self.free.capacity()
            + (self.free.capacity() + self.hits.capacity()) * 4
    }
}

/// What a shadow runs, and what the duel tells the policy to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Setting {
    /// Protection horizon: ticks a slot for the policy, ticks in all for a shadow; 0 is none.
    pub horizon: u64,
    /// Bimodal admission (see [`super::ChainAware`]).
    pub bimodal: bool,
}

/// The shadows (one a horizon, the first without protection, the last with bimodal admission
/// where the duel has it) and the keys of the request being sampled.
pub(crate) struct Duel {
    /// Shadow `i` runs `settings[i]` (horizons in ticks a slot); `settings[0]` is plain
    /// leaf-first recency.
    shadows: Vec<Shadow>,
    settings: Vec<Setting>,
    map: KeySlots,
    keys: Vec<BlockKey>,
    rows: Vec<Option<u32>>,
    /// The lead a protecting shadow needs over the one without (a share of its score).
    margin: f64,
    /// Requests with sampled keys seen so far (counted up to [`WINDOW_REQUESTS`]).
    seen: u32,
    /// Moving average of the sampled keys a request names (the scores' scale).
    keys_avg: f64,
}

impl Duel {
    /// A duel for a tier of `slots` slots between no protection, a protection horizon of
    /// each of `horizons_per_slot` ticks a slot, and (with `bimodal`) bimodal admission
    /// without protection; `None` when the tier is too small to sample.
    pub(crate) fn new(
        slots: u32,
        horizons_per_slot: &[u64],
        margin: f64,
        bimodal: bool,
    ) -> Option<Self> {
        debug_assert!(margin >= 0.0 && margin.is_finite(), "margin {margin}");
        let n = (u64::from(slots) / SAMPLE) as u32;
        let protect = |horizon| Setting {
            horizon,
            bimodal: false,
        };
        let settings: Vec<Setting> = std::iter::once(protect(0))
            .chain(horizons_per_slot.iter().map(|&h| protect(h)))
            .chain(bimodal.then_some(Setting {
                horizon: 0,
                bimodal: true,
            }))
            .collect();
        (n >= MIN_SHADOW_SLOTS).then(|| Self {
            shadows: settings
                .iter()
                .map(|s| {
                    Shadow::new(
                        n,
                        Setting {
                            horizon: s.horizon.saturating_mul(u64::from(n)),
                            ..*s
                        },
                    )
                })
                .collect(),
            map: KeySlots::new(settings.len(), n),
            settings,
            keys: Vec::with_capacity(1024),
            rows: Vec::with_capacity(1024),
            margin,
            seen: 0,
            keys_avg: 0.0,
        })
    }

    /// Runs one request's keys (`keys` yields them in chain order) through every shadow;
    /// returns the setting (horizon in ticks a slot) of the best-scoring shadow, plain
    /// recency unless another leads it by the margin, and plain recency until the shadows
    /// have seen a window's worth of requests.
    pub(crate) fn request(&mut self, keys: impl Iterator<Item = BlockKey>) -> Setting {
        self.keys.clear();
        self.keys.extend(keys.filter(sampled));
        if !self.keys.is_empty() {
            self.seen = (self.seen + 1).min(WINDOW_REQUESTS);
            let map = &mut self.map;
            self.rows.clear();
            self.rows.extend(self.keys.iter().map(|k| map.row(k)));
            for (i, s) in self.shadows.iter_mut().enumerate() {
                let h = s.request(i, &self.keys, &self.rows, map) as f64;
                s.score += (h - s.score) / f64::from(WINDOW_REQUESTS);
            }
            self.keys_avg += (self.keys.len() as f64 - self.keys_avg) / f64::from(WINDOW_REQUESTS);
        }
        if self.seen < WINDOW_REQUESTS {
            return Setting::default();
        }
        let mut c = choose(self.shadows.iter().map(|s| s.score), self.margin);
        let last = self.shadows.len() - 1;
        if c == last && self.settings[last].bimodal {
            let others = &self.shadows[..last];
            let best = others.iter().map(|s| s.score).fold(0.0, f64::max);
            if self.shadows[last].score - best < BIMODAL_LEAD * self.keys_avg {
                c = choose(others.iter().map(|s| s.score), self.margin);
            }
        }
        self.settings[c]
    }

    pub(crate) fn bytes(&self) -> usize {
        self.shadows.iter().map(Shadow::bytes).sum::<usize>()
            + self.map.bytes()
            + self.keys.capacity() * 16
            + self.rows.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` sampled keys for chain `c`.
    fn chain(c: u64, n: usize) -> Vec<BlockKey> {
        (0u64..)
            .map(|i| BlockKey::from_u128((u128::from(c) << 64) | u128::from(i + 1)))
            .filter(sampled)
            .take(n)
            .collect()
    }

    #[test]
    fn about_one_key_in_sample_is_sampled() {
        let n = (0..64_000u128)
            .filter(|&i| sampled(&BlockKey::from_u128(i.wrapping_mul(0x2545_F491_4F6C_DD1D))))
            .count();
        assert!((3_000..5_000).contains(&n), "{n} of 64,000");
    }

    #[test]
    fn a_shadow_counts_the_cached_leading_run() {
        let mut s = Shadow::new(64, Setting::default());
        let mut map = KeySlots::new(1, 64);
        let mut run = |keys: &[BlockKey]| {
            let rows: Vec<_> = keys.iter().map(|k| map.row(k)).collect();
            s.request(0, keys, &rows, &mut map)
        };
        let a = chain(1, 10);
        assert_eq!(run(&a[..6]), 0);
        assert_eq!(run(&a), 6);
        assert_eq!(run(&a), 10);
    }

    /// The shadows share one key map; each must still see exactly what it would alone. A
    /// seeded mix of returning conversations, shared prefixes and one-off chains, through
    /// more keys than the shadows hold, run by one duel of every horizon and by each horizon's
    /// shadow alone with a map of its own: the scores are the same (and differ between
    /// horizons, so the mix tells them apart), and the map gives back every row.
    #[test]
    fn shadows_sharing_one_key_map_score_as_they_would_alone() {
        const N: u32 = 40;
        let horizons = [1, 2, 4, 8, 16];
        let mut all = Duel::new(N * SAMPLE as u32, &horizons, PROTECT_MARGIN, true).unwrap();
        let mut alone: Vec<(Shadow, KeySlots)> = all
            .settings
            .iter()
            .map(|s| {
                let setting = Setting {
                    horizon: s.horizon * u64::from(N),
                    ..*s
                };
                (Shadow::new(N, setting), KeySlots::new(1, N))
            })
            .collect();
        assert_eq!(alone.len(), horizons.len() + 2);
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |m: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) % m
        };
        let convs: Vec<Vec<BlockKey>> = (0..6).map(|c| chain(c, 8)).collect();
        for r in 0..4_000u64 {
            let keys: Vec<BlockKey> = match next(4) {
                0 | 1 => {
                    let c = &convs[next(6) as usize];
                    c[..2 + next(7) as usize].to_vec()
                }
                2 => convs[0][..2]
                    .iter()
                    .copied()
                    .chain(chain(10_000 + r, 1 + next(6) as usize))
                    .collect(),
                _ => chain(20_000 + r, 1 + next(12) as usize),
            };
            all.request(keys.iter().copied());
            for (s, map) in &mut alone {
                let rows: Vec<_> = keys.iter().map(|k| map.row(k)).collect();
                let h = s.request(0, &keys, &rows, map) as f64;
                s.score += (h - s.score) / f64::from(WINDOW_REQUESTS);
            }
        }
        let shared = scores(&all);
        let own: Vec<f64> = alone.iter().map(|(s, _)| s.score).collect();
        assert_eq!(shared, own);
        let mut distinct = own.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        assert!(distinct.len() >= 3, "scores {own:?}");
        assert!(all.shadows.iter().all(|s| s.free.is_empty()), "no eviction");
        let held = all.shadows.len() * N as usize;
        assert!(all.map.rows.len() <= held);
        assert_eq!(
            all.map.rows.len() + all.map.free_rows.len(),
            held,
            "a row lost"
        );
    }

    fn scores(d: &Duel) -> Vec<f64> {
        d.shadows.iter().map(|s| s.score).collect()
    }

    #[test]
    fn the_policy_follows_the_best_shadow_that_leads_the_unprotected_one_by_the_margin() {
        let m = 0.05;
        // None leads by 5 %: no protection.
        assert_eq!(choose([10.0, 10.4, 10.2].into_iter(), m), 0);
        // The best; of equals, the first (the shorter horizon).
        assert_eq!(choose([10.0, 10.6, 12.0, 12.0, 11.0].into_iter(), m), 2);
        assert_eq!(choose([10.0, 12.0, 10.6].into_iter(), m), 1);
        // Nothing scored yet: off; anything over nothing leads.
        assert_eq!(choose([0.0, 0.0].into_iter(), m), 0);
        assert_eq!(choose([0.0, 0.5].into_iter(), m), 1);
        assert_eq!(choose(std::iter::empty(), m), 0);
        // The default margin (none): any lead counts, a tie does not.
        assert_eq!(choose([10.0, 10.4, 10.2].into_iter(), PROTECT_MARGIN), 1);
        assert_eq!(choose([10.0, 10.0, 9.0].into_iter(), PROTECT_MARGIN), 0);
    }

    /// Conversations that return after more one-off blocks than a cache's worth: the
    /// shortest horizon of the ladder lets them go just before they return, so the duel
    /// chooses a longer one, and its shadow has hit more.
    #[test]
    fn the_ladder_chooses_a_horizon_long_enough_for_the_returns() {
        let convs: Vec<Vec<BlockKey>> = (0..8).map(|c| chain(c, 6)).collect();
        let mut d =
            Duel::new(64 * SAMPLE as u32, &[1, 2, 4, 8, 16], PROTECT_MARGIN, false).unwrap();
        let mut h = 0;
        let mut scan = 1_000;
        for _ in 0..40 {
            for c in &convs {
                d.request(c.iter().copied());
                d.request(c.iter().copied());
                h = d.request(chain(scan, 8).into_iter()).horizon;
                scan += 1;
            }
        }
        let sc = scores(&d);
        assert!(h >= 4, "chose {h}; scores {sc:?}");
        assert!(sc[1] < sc[3], "scores {sc:?}");
    }

    /// Conversations cycling in turn through a cache that holds about half of them: recency
    /// (with or without protection, since every one of them continues) loses each just
    /// before it returns, and bimodal admission keeps a few whole. The duel follows it.
    #[test]
    fn bimodal_admission_is_chosen_when_conversations_cycle_through_a_cache_too_small() {
        let convs: Vec<Vec<BlockKey>> = (0..6).map(|c| chain(c, 20)).collect();
        let mut d = Duel::new(
            64 * SAMPLE as u32,
            &super::super::chain::LADDER,
            PROTECT_MARGIN,
            true,
        )
        .unwrap();
        let mut chosen = Vec::new();
        for _ in 0..60 {
            for c in &convs {
                chosen.push(d.request(c.iter().copied()));
            }
        }
        let sc = scores(&d);
        let last = sc.len() - 1;
        let best_other = sc[..last].iter().copied().fold(0.0, f64::max);
        assert!(
            sc[last] - best_other >= BIMODAL_LEAD * d.keys_avg,
            "scores {sc:?}, keys {}",
            d.keys_avg
        );
        assert!(chosen.last().unwrap().bimodal, "{chosen:?}");
        // Off by default during the window, as every other setting.
        let warm = WINDOW_REQUESTS as usize - 1;
        assert!(chosen[..warm].iter().all(|s| !s.bimodal));
    }

    /// A lead under BIMODAL_LEAD of the requests' sampled keys is not followed.
    #[test]
    fn a_small_lead_of_bimodal_admission_is_not_followed() {
        let mut d = Duel::new(64 * SAMPLE as u32, &[4], PROTECT_MARGIN, true).unwrap();
        d.seen = WINDOW_REQUESTS;
        d.keys_avg = 20.0;
        let set = |d: &mut Duel, s: [f64; 3]| {
            for (sh, v) in d.shadows.iter_mut().zip(s) {
                sh.score = v;
            }
            d.request(std::iter::empty())
        };
        // 1.5 sampled hits a request more than the best other, under 10 % of 20 keys.
        assert_eq!(set(&mut d, [1.0, 2.0, 3.5]).horizon, 4);
        assert!(!set(&mut d, [1.0, 2.0, 3.5]).bimodal);
        assert!(set(&mut d, [1.0, 2.0, 4.5]).bimodal);
        assert_eq!(set(&mut d, [1.0, 0.5, 2.5]), Setting::default());
    }

    /// Until the shadows have seen a window's worth of requests, their scores are a few
    /// requests' worth of evidence: the duel protects nothing, even where the scores already
    /// show a lead (as at the start of a short trace, where a few protected requests decided
    /// a whole replay, `docs/benchmarks.md`). Requests with no sampled key do not count.
    #[test]
    fn the_duel_protects_nothing_before_a_window_of_requests() {
        let convs: Vec<Vec<BlockKey>> = (0..8).map(|c| chain(c, 6)).collect();
        let mut d = Duel::new(
            64 * SAMPLE as u32,
            &super::super::chain::LADDER,
            PROTECT_MARGIN,
            false,
        )
        .unwrap();
        let mut chosen = Vec::new();
        let mut scan = 1_000;
        for _ in 0..40 {
            for c in &convs {
                chosen.push(d.request(c.iter().copied()));
                chosen.push(d.request(c.iter().copied()));
                chosen.push(d.request(chain(scan, 8).into_iter()));
                scan += 1;
                // No sampled key: not a request the shadows saw.
                assert_eq!(d.request(std::iter::empty()), *chosen.last().unwrap());
            }
            if chosen.len() == 3 * 40 {
                // The scores lead already; the duel still waits.
                let sc = scores(&d);
                assert_ne!(
                    choose(sc.iter().copied(), PROTECT_MARGIN),
                    0,
                    "scores {sc:?}"
                );
            }
        }
        let warm = WINDOW_REQUESTS as usize - 1;
        assert!(
            chosen[..warm].iter().all(|&s| s == Setting::default()),
            "{chosen:?}"
        );
        assert!(chosen[warm..].iter().any(|&s| s.horizon > 0), "{chosen:?}");
    }

    /// Conversations that return at once: recency loses nothing, so protection stays off
    /// (a tie is off), while both shadows score their hits.
    #[test]
    fn protection_stays_off_when_recency_loses_nothing() {
        let chains: Vec<Vec<BlockKey>> = (0..6).map(|c| chain(c, 30)).collect();
        let mut d = Duel::new(64 * SAMPLE as u32, &[4], PROTECT_MARGIN, true).unwrap();
        let mut on = true;
        for _ in 0..20 {
            for c in &chains {
                for _ in 0..3 {
                    on = d.request(c.iter().copied()) != Setting::default();
                }
            }
        }
        assert!(!on, "scores {:?}", scores(&d));
        assert!(d.shadows.iter().all(|s| s.score > 10.0));
    }

    /// Conversations that come back between one-off requests that would flush them: the
    /// protecting shadow keeps them and leads, so protection turns on; a margin larger than
    /// that lead keeps it off.
    #[test]
    fn protection_turns_on_when_it_keeps_returning_conversations_by_the_margin() {
        let convs: Vec<Vec<BlockKey>> = (0..8).map(|c| chain(c, 6)).collect();
        let run = |margin: f64| {
            let mut d = Duel::new(64 * SAMPLE as u32, &[4], margin, false).unwrap();
            let mut on = false;
            let mut scan = 1_000;
            for _ in 0..40 {
                for c in &convs {
                    // The second time at once: a hit for both shadows, so both score.
                    d.request(c.iter().copied());
                    d.request(c.iter().copied());
                    on = d.request(chain(scan, 8).into_iter()).horizon > 0;
                    scan += 1;
                }
            }
            (on, scores(&d))
        };
        let (on, scores) = run(PROTECT_MARGIN);
        assert!(on, "scores {scores:?}");
        assert!(scores[0] > 0.0, "scores {scores:?}");
        let lead = scores[1] / scores[0] - 1.0;
        let (on, scores) = run(lead + 0.01);
        assert!(!on, "scores {scores:?}");
    }
}

//! The default eviction policy: leaf-first, with protection for continuing conversations.
//!
//! Agentic and multi-turn traffic re-sends the whole previous prompt plus a little more, so a
//! block's value is whether its *conversation* comes back, and a child block is worthless
//! without its parent. Measured on the Mooncake conversation trace (see `docs/benchmarks.md`),
//! the one strong online signal of a conversation coming back is how many turns it has already
//! had; plain recency and frequency (LRU, S3-FIFO, segmented LRU) cannot see it.
//!
//! * **Leaf-first.** Only leaves (blocks with no cached child in this tier) are evicted, so a
//!   chain is shortened from its end and no orphan is ever left behind.
//! * **Turns.** A lookup whose longest cached prefix ends at the tip of a chain (a block with at
//!   most one cached child: not a shared system prompt) continues that chain's conversation:
//!   its turn is the tip's turn plus one. A ghost list of recently evicted keys lets a returning
//!   conversation whose tail was evicted still be recognised. New blocks inherit the turn of the
//!   request that wrote them; touched blocks take the highest turn that touched them (level).
//! * **Protection classes.** Level 0 (first turns, one-off requests) is plain LRU; levels 1-2
//!   live `B` longer and level 3+ `2B` longer: the victim is the leaf with the smallest
//!   `last_access + multiplier x B`.
//! * **Self-tuning `B`.** `R0` is a moving average of how long class-0 blocks survive before
//!   eviction; `B = max(0, horizon - R0)`. A cache large enough to keep first turns for the
//!   whole horizon needs no protection and behaves as leaf-first LRU.
//! * **Logical time.** The policy's clock is its own count of blocks: every key a lookup
//!   names and every block inserted is one tick, and the horizon is counted in ticks a slot.
//!   The same requests in the same order give the same decisions at any speed (the store's
//!   clock is not read).
//! * **Duel over a ladder of horizons.** Protection is an admission filter that wins when
//!   many long conversations cycle through a cache too small for all of them and loses when
//!   they return quickly; how long it should last depends on how far apart a conversation's
//!   turns are against the cache's size, which differs by trace and capacity. Sampled shadow
//!   caches, one without protection and one for each horizon of [`LADDER`], replay the same
//!   requests; the policy uses the horizon of the best shadow, or none unless one leads the
//!   unprotected shadow by the margin (see [`super::duel`]), and none before the shadows have
//!   seen a window's worth of requests (128). Tiers under 512 slots run no duel and always
//!   protect (for [`HORIZON_SLOTS`] ticks a slot under the ladder).
//! * **Bimodal admission (the thrash guard).** When more long conversations cycle through
//!   the cache than it holds, every one of them has continued, so protection (which tells
//!   continuing conversations from first turns) keeps none whole, and recency evicts each
//!   just before it returns: the hit rate falls to almost nothing while the optimum keeps
//!   half of them. The duel also runs a shadow with bimodal admission (Qureshi et al.,
//!   ISCA 2007, for conversations): a request that finds less than half its prompt cached is
//!   turned away, but for one in [`ADMIT_EVERY`]; its blocks are stored but go first (oldest
//!   first, from their chain's end) once a later request has begun, and a hit admits them.
//!   The cache then keeps the conversations it holds and lets the others pass. The policy
//!   follows that shadow only where it leads every other by 10 points of hit rate (see
//!   [`super::duel`]); without that lead it behaves exactly as before.
//!
//! Cost: O(log n) per touch, insert and eviction (one binary heap per class, and one for
//! turned-away blocks, with lazy deletion, compacted in place), plus each lookup's sampled
//! keys (1 in 16) run through the duel's shadows (seven under the ladder with bimodal
//! admission; one key map for all of them); all memory is allocated at construction.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use kvtier_core::BlockKey;

use crate::keyhash::KeyHashing;

use super::duel::{Duel, PROTECT_MARGIN};
use super::{EvictionPolicy, InsertContext, LookupContext, MAX_VICTIM_SCAN, NIL};

/// How long [`ChainAware`] protects continuing conversations beyond first turns, in ticks of
/// its logical clock per slot of the tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Horizon {
    /// Chosen online, request by request, among [`LADDER`]: the duel runs one sampled
    /// shadow cache per horizon beside one without protection, and the policy takes the
    /// horizon of the best-scoring shadow that leads the unprotected one by the margin (the
    /// default: nothing to fit).
    Ladder,
    /// This one horizon, switched on and off by a duel of two shadows (the policy before the
    /// ladder, with 4; kept for parameter studies).
    Fixed(u64),
}

impl Horizon {
    /// The protecting shadows' horizons (ticks a slot).
    fn choices(&self) -> &[u64] {
        match self {
            Horizon::Ladder => &LADDER,
            Horizon::Fixed(h) => std::slice::from_ref(h),
        }
    }

    /// The horizon of a tier too small to sample (no duel; protection always on).
    fn unsampled(self) -> u64 {
        match self {
            Horizon::Ladder => HORIZON_SLOTS,
            Horizon::Fixed(h) => h,
        }
    }
}

impl std::fmt::Display for Horizon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Horizon::Ladder => f.write_str("ladder"),
            Horizon::Fixed(h) => write!(f, "{h}"),
        }
    }
}

/// The parameters of [`ChainAware`] that parameter studies vary (the rest are set by
/// reasoning): its protection horizon and the lead its duel's protecting shadows need.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChainAwareTuning {
    /// Protection horizon: chosen online (the default) or fixed.
    pub horizon: Horizon,
    /// A protecting shadow counts only while its score leads the unprotected shadow's by this
    /// share (0.05: 5 %; the default, [`PROTECT_MARGIN`], is 0: any lead).
    pub protect_margin: f64,
    /// Whether the duel also runs a shadow with bimodal admission (the thrash guard; on by
    /// default): chosen when it leads, the policy turns away most requests that find less
    /// than half their prompt cached.
    pub bimodal: bool,
}

impl Default for ChainAwareTuning {
    fn default() -> Self {
        Self {
            horizon: Horizon::Ladder,
            protect_margin: PROTECT_MARGIN,
            bimodal: true,
        }
    }
}

/// The horizons the default policy chooses among, ticks of the logical clock a slot: every
/// power of two from 1 (a cache's worth of blocks named once) to 16, the range the parameter
/// studies spanned (`docs/benchmarks.md`, "One horizon chosen online"). Each costs a shadow
/// of 1/[`super::duel::SAMPLE`] of the tier.
pub const LADDER: [u64; 5] = [1, 2, 4, 8, 16];
/// The horizon of a tier too small for the duel's shadows (under 512 slots), where
/// protection is always on: the middle of [`LADDER`] (and the fixed horizon before it).
pub const HORIZON_SLOTS: u64 = 4;
/// Weight of each new class-0 eviction age in `R0`.
const R0_ALPHA: f64 = 0.001;
const CLASSES: usize = 3;
/// The heap of blocks a bimodal policy did not admit (after the protection classes): they
/// go first, oldest first.
const BYPASS: usize = CLASSES;
/// Under bimodal admission, one request in this many of those that would not be admitted is
/// admitted anyway, so a new working set still gets in (the 1/32 of bimodal insertion in
/// Qureshi et al., "Adaptive insertion policies for high performance caching", ISCA 2007).
const ADMIT_EVERY: u32 = 32;
/// Protection class of each level (levels past the end take the last entry), and each
/// class's multiplier of `B`: first turns 0, turns 1-2 1x, turn 3 and later 2x.
const CLASS_OF_LEVEL: [u8; 4] = [0, 1, 1, 2];
const CLASS_MULTIPLIER: [u64; CLASSES] = [0, 1, 2];
/// A tip may have this many cached children and still count as a conversation's tip.
const MAX_TIP_CHILDREN: u32 = 1;
/// Pending request turns remembered for the first block a request will put.
const MAX_PENDING_TURNS: usize = 4096;
const NOT_LEAF: u8 = u8::MAX;

/// (last access << 20 | inverted depth, filing sequence, slot): oldest first, deepest first
/// among equals, then in the order they were filed.
type HeapEntry = Reverse<(u64, u32, u32)>;
const DEPTH_BITS: u32 = 20;
const DEPTH_MASK: u64 = (1 << DEPTH_BITS) - 1;

fn order_key(last_ms: u64, depth: u32) -> u64 {
    (last_ms << DEPTH_BITS) | (DEPTH_MASK - u64::from(depth).min(DEPTH_MASK))
}

/// See the module documentation.
pub struct ChainAware {
    /// Logical time: blocks named by lookups plus blocks inserted, so far.
    now: u64,
    /// Chooses `horizon` online (0: no protection), when the tier is large enough to sample.
    duel: Option<Box<Duel>>,
    /// Protection horizon now, in ticks (0: turns 1+ are not protected, and the policy is
    /// leaf-first recency).
    horizon: u64,
    /// Bimodal admission now (the thrash guard, chosen by the duel): a request that finds
    /// less than half its prompt cached has its new blocks filed to go first, except one in
    /// [`ADMIT_EVERY`]; a later hit admits them.
    bimodal: bool,
    /// Requests bimodal admission has turned away or let in so far (which one in
    /// [`ADMIT_EVERY`] gets in).
    turned: u32,
    /// The clock when the latest lookup began: blocks turned away since (the request being
    /// stored) are not yet first to go, or a turned-away request would evict its own chain.
    /// Requests interleaved by the server share one mark: a lookup that comes in while a
    /// turned-away request stores makes that request's earlier blocks first to go.
    mark: u64,
    r0: f64,
    tracked: Box<[bool]>,
    keys: Box<[BlockKey]>,
    last: Box<[u64]>,
    depth: Box<[u32]>,
    turn: Box<[u8]>,
    level: Box<[u8]>,
    req_turn: Box<[u8]>,
    /// The block was stored by a request bimodal admission turned away, and not hit since.
    bypass: Box<[bool]>,
    /// Whether the request that last touched the block was turned away (its next blocks
    /// inherit it, as they inherit `req_turn`).
    req_bypass: Box<[bool]>,
    parent: Box<[u32]>,
    parent_gen: Box<[u32]>,
    insert_gen: Box<[u32]>,
    children: Box<[u32]>,
    class: Box<[u8]>,
    /// The filing sequence of each slot's live heap entry (older entries are stale). It wraps
    /// after 2^32 filings; a stale entry surviving that long uncompacted and matching again
    /// would only make one block look older than it is (the store re-checks every victim).
    filed: Box<[u32]>,
    seq: u32,
    /// One heap per protection class, then [`BYPASS`].
    heaps: [BinaryHeap<HeapEntry>; CLASSES + 1],
    /// Recently evicted keys: key -> (turn, entry sequence). The order queue may hold stale
    /// entries (a key removed and added again); a pop removes the map entry only if the
    /// sequence matches.
    ghost: HashMap<BlockKey, (u8, u64), KeyHashing>,
    ghost_order: VecDeque<(BlockKey, u64)>,
    ghost_cap: usize,
    /// Request turns waiting for the first block a request will put: key -> (turn, turned
    /// away, seq).
    pending: HashMap<BlockKey, (u8, bool, u64), KeyHashing>,
    pending_order: VecDeque<(BlockKey, u64)>,
    /// One per request in flight at most; no more than the tier has slots.
    pending_cap: usize,
    entry_seq: u64,
    scratch: Vec<(usize, HeapEntry)>,
}

impl ChainAware {
    /// The default: the protection horizon chosen online among [`LADDER`] by a duel of
    /// sampled shadows (see [`Duel`]).
    pub fn new(slots: u32) -> Self {
        Self::tuned(slots, ChainAwareTuning::default())
    }

    /// The policy with other values of its parameters (for the policy simulator's parameter
    /// studies; the server uses the defaults).
    pub fn tuned(slots: u32, tuning: ChainAwareTuning) -> Self {
        let h = tuning.horizon.unsampled();
        let mut p = Self::plain(slots, h.saturating_mul(u64::from(slots)));
        p.duel = Duel::new(
            slots,
            tuning.horizon.choices(),
            tuning.protect_margin,
            tuning.bimodal,
        )
        .map(Box::new);
        if tuning.bimodal && p.duel.is_some() {
            p.make_room_to_turn_away();
        }
        p
    }

    /// A policy whose protection horizon is `horizon` ticks of its logical clock, always
    /// on (no duel).
    pub fn plain(slots: u32, horizon: u64) -> Self {
        let n = slots as usize;
        let heap = || BinaryHeap::with_capacity(2 * n + 64);
        let ghost_cap = 2 * n;
        let pending_cap = n.clamp(16, MAX_PENDING_TURNS);
        Self {
            now: 0,
            duel: None,
            horizon,
            bimodal: false,
            turned: 0,
            mark: 0,
            r0: 0.0,
            tracked: vec![false; n].into(),
            keys: vec![BlockKey::default(); n].into(),
            last: vec![0; n].into(),
            depth: vec![0; n].into(),
            turn: vec![0; n].into(),
            level: vec![0; n].into(),
            req_turn: vec![0; n].into(),
            bypass: vec![false; n].into(),
            req_bypass: vec![false; n].into(),
            parent: vec![NIL; n].into(),
            parent_gen: vec![0; n].into(),
            insert_gen: vec![0; n].into(),
            children: vec![0; n].into(),
            class: vec![NOT_LEAF; n].into(),
            filed: vec![0; n].into(),
            seq: 0,
            // The bypass heap only where bimodal admission can be on.
            heaps: [heap(), heap(), heap(), BinaryHeap::new()],
            ghost: HashMap::with_capacity_and_hasher(ghost_cap + 1, KeyHashing::new()),
            ghost_order: VecDeque::with_capacity(ghost_cap + 1),
            ghost_cap,
            pending: HashMap::with_capacity_and_hasher(pending_cap + 1, KeyHashing::new()),
            pending_order: VecDeque::with_capacity(pending_cap + 1),
            pending_cap,
            entry_seq: 0,
            scratch: Vec::with_capacity(MAX_VICTIM_SCAN + CLASSES),
        }
    }

    /// Switches bimodal admission on or off (shadows; the duel sets it for the policy).
    pub(super) fn set_bimodal(&mut self, on: bool) {
        if on {
            self.make_room_to_turn_away();
        }
        self.bimodal = on;
    }

    /// Allocates the bypass heap (at most one entry a slot, plus stale ones until compacted).
    fn make_room_to_turn_away(&mut self) {
        let want = self.tracked.len() + 64;
        let heap = &mut self.heaps[BYPASS];
        heap.reserve_exact(want.saturating_sub(heap.len()));
    }

    /// Current protection bonus for class-1 blocks, in ticks of the logical clock.
    pub fn protection(&self) -> u64 {
        (self.horizon as f64 - self.r0).max(0.0) as u64
    }

    /// The key the policy was told `slot` holds.
    pub(super) fn key_of(&self, slot: u32) -> BlockKey {
        self.keys[slot as usize]
    }

    fn class_of(level: u8) -> u8 {
        CLASS_OF_LEVEL[(level as usize).min(CLASS_OF_LEVEL.len() - 1)]
    }

    /// (Re)files `slot` in its class heap if it is a leaf, else takes it out of every heap.
    fn refile(&mut self, slot: u32) {
        let s = slot as usize;
        if self.children[s] > 0 || !self.tracked[s] {
            self.class[s] = NOT_LEAF;
            return;
        }
        let c = if self.bypass[s] {
            BYPASS as u8
        } else {
            Self::class_of(self.level[s])
        };
        self.class[s] = c;
        let heap = &mut self.heaps[c as usize];
        if heap.len() >= heap.capacity() {
            // Stale entries pile up under touches; drop them in place (no allocation).
            let (class, filed) = (&self.class, &self.filed);
            heap.retain(|Reverse((_, seq, sl))| {
                class[*sl as usize] == c && filed[*sl as usize] == *seq
            });
        }
        self.seq = self.seq.wrapping_add(1);
        self.filed[s] = self.seq;
        heap.push(Reverse((
            order_key(self.last[s], self.depth[s]),
            self.seq,
            slot,
        )));
    }

    fn valid(&self, c: usize, e: &HeapEntry) -> bool {
        let Reverse((_, seq, slot)) = *e;
        self.class[slot as usize] as usize == c && self.filed[slot as usize] == seq
    }

    fn remember_pending(&mut self, key: BlockKey, turn: u8, bypass: bool) {
        self.entry_seq += 1;
        bounded_insert(
            &mut self.pending,
            &mut self.pending_order,
            self.pending_cap,
            key,
            (turn, bypass, self.entry_seq),
            |v| v.2,
        );
    }

    /// The victim among the leaves `evictable` accepts, looking past at most `bound`
    /// refused ones: the oldest block bimodal admission turned away, else the leaf with the
    /// smallest protected age.
    fn search(&mut self, evictable: &mut dyn FnMut(u32) -> bool, bound: usize) -> Option<u32> {
        let b = self.protection();
        let mut best: Option<(u64, usize, u32)> = None;
        let mut scanned = 0;
        'classes: for c in std::iter::once(BYPASS).chain(0..CLASSES) {
            while let Some(top) = self.heaps[c].peek().copied() {
                if !self.valid(c, &top) {
                    self.heaps[c].pop();
                    continue;
                }
                let Reverse((order, _, slot)) = top;
                let last = order >> DEPTH_BITS;
                if !evictable(slot) {
                    scanned += 1;
                    if scanned > bound {
                        break;
                    }
                    self.heaps[c].pop();
                    self.scratch.push((c, top));
                    continue;
                }
                if c == BYPASS && self.bimodal && last <= self.mark {
                    best = Some((0, c, slot));
                    break 'classes;
                }
                // Out of bimodal mode, blocks it turned away are first turns again.
                let score = last.saturating_add(CLASS_MULTIPLIER.get(c).map_or(0, |m| m * b));
                if best.is_none_or(|(s, _, _)| score < s) {
                    best = Some((score, c, slot));
                }
                break;
            }
        }
        for (c, e) in self.scratch.drain(..) {
            self.heaps[c].push(e);
        }
        best.map(|(_, _, slot)| slot)
    }

    fn bump(t: u8) -> u8 {
        t.saturating_add(1).min(u8::MAX - 1)
    }
}

impl EvictionPolicy for ChainAware {
    fn name(&self) -> &'static str {
        "chain-aware"
    }

    fn on_lookup(&mut self, ctx: LookupContext<'_>) {
        let hits = ctx.hits;
        if let Some(duel) = self.duel.as_mut() {
            let keys = &self.keys;
            let all = hits.iter().map(|&s| keys[s as usize]);
            let setting = duel.request(all.chain(ctx.rest.iter().copied()));
            self.horizon = setting.horizon.saturating_mul(self.tracked.len() as u64);
            self.bimodal = setting.bimodal;
        }
        self.mark = self.now;
        self.now += (hits.len() + ctx.rest.len()) as u64;
        let now = self.now;
        // Continue through keys evicted recently: a returning conversation whose tail is gone.
        let ghost_run = ctx
            .rest
            .iter()
            .take_while(|k| self.ghost.contains_key(k))
            .count();
        let turn = if ghost_run > 0 {
            Self::bump(self.ghost[&ctx.rest[ghost_run - 1]].0)
        } else {
            match hits.last() {
                Some(&tip)
                    if self.tracked[tip as usize]
                        && self.children[tip as usize] <= MAX_TIP_CHILDREN =>
                {
                    Self::bump(self.turn[tip as usize])
                }
                _ => 0,
            }
        };
        // Bimodal admission: a request that finds less than half its prompt cached (a new
        // conversation, or one the cache lost) is turned away, but for one in ADMIT_EVERY.
        let bypass = self.bimodal && hits.len() * 2 < hits.len() + ctx.rest.len() && {
            self.turned = self.turned.wrapping_add(1);
            !self.turned.is_multiple_of(ADMIT_EVERY)
        };
        for &slot in hits.iter().rev() {
            let s = slot as usize;
            if !self.tracked[s] {
                continue;
            }
            self.last[s] = now;
            self.level[s] = self.level[s].max(turn);
            self.req_turn[s] = turn;
            self.bypass[s] = false;
            self.req_bypass[s] = bypass;
            self.refile(slot);
        }
        if let Some(first) = ctx.rest.first() {
            self.remember_pending(*first, turn, bypass);
        }
    }

    fn on_insert(&mut self, slot: u32, key: BlockKey, ctx: InsertContext) {
        let s = slot as usize;
        let parent = ctx
            .parent
            .filter(|&p| p != slot && self.tracked[p as usize]);
        let (req_turn, req_bypass) = match self.pending.remove(&key) {
            Some((t, b, _)) => (t, b),
            None => parent.map_or((0, false), |p| {
                (self.req_turn[p as usize], self.req_bypass[p as usize])
            }),
        };
        let turn = match self.ghost.remove(&key) {
            Some((t, _)) => t,
            None => req_turn,
        };
        self.now += 1;
        self.tracked[s] = true;
        self.keys[s] = key;
        self.insert_gen[s] = self.insert_gen[s].wrapping_add(1);
        self.last[s] = self.now;
        self.turn[s] = turn;
        self.level[s] = req_turn;
        self.req_turn[s] = req_turn;
        self.bypass[s] = req_bypass;
        self.req_bypass[s] = req_bypass;
        self.children[s] = 0;
        match parent {
            Some(p) => {
                self.parent[s] = p;
                self.parent_gen[s] = self.insert_gen[p as usize];
                self.depth[s] = self.depth[p as usize].saturating_add(1);
                self.children[p as usize] += 1;
                self.refile(p);
            }
            None => {
                self.parent[s] = NIL;
                self.depth[s] = 0;
            }
        }
        self.refile(slot);
    }

    fn on_hit(&mut self, slot: u32, _now_ms: u64) {
        let s = slot as usize;
        if self.tracked[s] {
            self.last[s] = self.now;
            self.bypass[s] = false;
            self.refile(slot);
        }
    }

    fn on_remove(&mut self, slot: u32, _now_ms: u64) {
        let s = slot as usize;
        if !self.tracked[s] {
            return;
        }
        if self.class[s] == 0 {
            let age = self.now.saturating_sub(self.last[s]) as f64;
            self.r0 += R0_ALPHA * (age - self.r0);
        }
        self.entry_seq += 1;
        bounded_insert(
            &mut self.ghost,
            &mut self.ghost_order,
            self.ghost_cap,
            self.keys[s],
            (self.turn[s], self.entry_seq),
            |v| v.1,
        );
        self.tracked[s] = false;
        self.refile(slot);
        let p = self.parent[s];
        self.parent[s] = NIL;
        if p != NIL && self.tracked[p as usize] && self.insert_gen[p as usize] == self.parent_gen[s]
        {
            let pc = &mut self.children[p as usize];
            *pc = pc.saturating_sub(1);
            if *pc == 0 {
                self.refile(p);
            }
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.search(evictable, MAX_VICTIM_SCAN)
    }

    fn victim_unbounded(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.search(evictable, usize::MAX)
    }

    fn bytes_per_slot(&self) -> usize {
        let arrays = 1 + 16 + 8 + 4 + 1 + 1 + 1 + 1 + 1 + 4 + 4 + 4 + 4 + 1 + 4;
        let heaps: usize = self.heaps.iter().map(|h| h.capacity()).sum::<usize>()
            * std::mem::size_of::<HeapEntry>();
        let ghost = self.ghost.capacity() * (16 + 16 + 1) + self.ghost_order.capacity() * 24;
        let pending = self.pending.capacity() * (16 + 16 + 1) + self.pending_order.capacity() * 24;
        let duel = self.duel.as_ref().map_or(0, |d| d.bytes());
        arrays + (heaps + ghost + pending + duel) / self.tracked.len().max(1)
    }
}

/// Inserts into a map bounded by a FIFO of (key, seq); the oldest live entries go first.
/// `seq_of` reads a value's entry sequence.
fn bounded_insert<V, S: std::hash::BuildHasher>(
    map: &mut HashMap<BlockKey, V, S>,
    order: &mut VecDeque<(BlockKey, u64)>,
    cap: usize,
    key: BlockKey,
    value: V,
    seq_of: fn(&V) -> u64,
) {
    order.push_back((key, seq_of(&value)));
    map.insert(key, value);
    while order.len() > cap {
        let Some((old, seq)) = order.pop_front() else {
            break;
        };
        if map.get(&old).is_some_and(|v| seq_of(v) == seq) {
            map.remove(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_maps_keep_re_added_keys() {
        let (mut map, mut order) = (HashMap::new(), VecDeque::new());
        let k = |i| BlockKey::from_u128(i);
        bounded_insert(&mut map, &mut order, 2, k(1), (0u8, 1u64), |v| v.1);
        map.remove(&k(1));
        bounded_insert(&mut map, &mut order, 2, k(2), (0, 2), |v| v.1);
        bounded_insert(&mut map, &mut order, 2, k(1), (5, 3), |v| v.1);
        // The stale (1, seq 1) entry is popped without removing the re-added key.
        assert_eq!(map.get(&k(1)), Some(&(5, 3)));
        assert_eq!(map.len(), 2);
        assert!(order.len() <= 2);
    }

    fn k(i: u64) -> BlockKey {
        BlockKey::from_u128(u128::from(i) + 1)
    }

    fn insert_chain(p: &mut ChainAware, slots: &[u32], now: u64) {
        for (i, &s) in slots.iter().enumerate() {
            let parent = i.checked_sub(1).map(|j| slots[j]);
            p.on_insert(
                s,
                k(u64::from(s)),
                InsertContext {
                    parent,
                    now_ms: now,
                },
            );
        }
    }

    #[test]
    fn evicts_leaves_only_suffix_first() {
        let mut p = ChainAware::new(8);
        insert_chain(&mut p, &[0, 1, 2], 10);
        insert_chain(&mut p, &[3, 4], 20);
        let mut order = Vec::new();
        while let Some(v) = p.victim(&mut |_| true) {
            p.on_remove(v, 30);
            order.push(v);
        }
        assert_eq!(order, vec![2, 1, 0, 4, 3]);
    }

    #[test]
    fn continuing_conversations_outlive_first_turns() {
        let mut p = ChainAware::new(16);
        // Conversation A, turn 0 at t=0, then its second turn at t=1000 (a lookup hitting
        // its tip) that appends two blocks.
        insert_chain(&mut p, &[0, 1], 0);
        p.on_lookup(LookupContext {
            hits: &[0, 1],
            rest: &[k(2), k(3)],
            now_ms: 1000,
        });
        p.on_insert(
            2,
            k(2),
            InsertContext {
                parent: Some(1),
                now_ms: 1000,
            },
        );
        p.on_insert(
            3,
            k(3),
            InsertContext {
                parent: Some(2),
                now_ms: 1000,
            },
        );
        // A one-off request arrives later.
        insert_chain(&mut p, &[8, 9], 2000);
        // The newer one-off is evicted before the older continuing conversation.
        let v = p.victim(&mut |_| true).unwrap();
        assert_eq!(v, 9);
        assert_eq!(p.turn[3], 1);
        assert_eq!(p.level[0], 1);
    }

    #[test]
    fn pinned_leaves_are_skipped_and_stay_evictable_later() {
        let mut p = ChainAware::new(4);
        insert_chain(&mut p, &[0], 0);
        insert_chain(&mut p, &[1], 5);
        assert_eq!(p.victim(&mut |s| s != 0), Some(1));
        assert_eq!(p.victim(&mut |_| true), Some(0));
        assert_eq!(p.victim(&mut |_| false), None);
    }

    #[test]
    fn ghost_recognises_a_returning_conversation() {
        let mut p = ChainAware::new(4);
        insert_chain(&mut p, &[0, 1], 0);
        p.on_lookup(LookupContext {
            hits: &[0, 1],
            rest: &[k(2)],
            now_ms: 10,
        });
        p.on_insert(
            2,
            k(2),
            InsertContext {
                parent: Some(1),
                now_ms: 10,
            },
        );
        for s in [2, 1, 0] {
            p.on_remove(s, 20);
        }
        // All gone; the conversation returns: its turn continues from the ghost.
        p.on_lookup(LookupContext {
            hits: &[],
            rest: &[k(0), k(1), k(2), k(5)],
            now_ms: 30,
        });
        p.on_insert(
            0,
            k(0),
            InsertContext {
                parent: None,
                now_ms: 30,
            },
        );
        assert_eq!(p.level[0], 2);
    }

    fn lookup(p: &mut ChainAware, hits: &[u32], rest: &[BlockKey]) {
        p.on_lookup(LookupContext {
            hits,
            rest,
            now_ms: 0,
        });
    }

    /// Bimodal admission: a request that finds less than half its prompt cached is turned
    /// away and its blocks go first, once a later request has begun (never while the request
    /// stores its own chain); a hit admits them again; out of bimodal mode they are ordinary.
    #[test]
    fn turned_away_blocks_go_first_until_a_hit_admits_them() {
        let setup = |bimodal: bool| {
            let mut p = ChainAware::plain(16, 0);
            p.set_bimodal(bimodal);
            // A: stored, then hit whole (admitted, whatever the mode).
            lookup(&mut p, &[], &[k(0), k(1)]);
            insert_chain(&mut p, &[0, 1], 0);
            lookup(&mut p, &[0, 1], &[]);
            // B, newer than A: turned away in bimodal mode.
            lookup(&mut p, &[], &[k(4), k(5)]);
            insert_chain(&mut p, &[4, 5], 0);
            p
        };
        // While B is the request being stored, its blocks are not first.
        let mut p = setup(true);
        assert_eq!(p.victim(&mut |_| true), Some(1));
        // Once another request began, B's go first, though A is older.
        lookup(&mut p, &[], &[k(9)]);
        assert_eq!(p.victim(&mut |_| true), Some(5));
        // Plain recency: the oldest leaf, A's.
        let mut p = setup(false);
        lookup(&mut p, &[], &[k(9)]);
        assert_eq!(p.victim(&mut |_| true), Some(1));
        // A hit on B admits it: then A's tail is the oldest again.
        let mut p = setup(true);
        lookup(&mut p, &[4, 5], &[]);
        lookup(&mut p, &[], &[k(9)]);
        assert_eq!(p.victim(&mut |_| true), Some(1));
        // Out of bimodal mode, B's blocks are ordinary leaves again.
        let mut p = setup(true);
        lookup(&mut p, &[], &[k(9)]);
        p.set_bimodal(false);
        assert_eq!(p.victim(&mut |_| true), Some(1));
    }

    /// One request in ADMIT_EVERY of those turned away gets in, so a new working set can.
    #[test]
    fn bimodal_admission_lets_one_request_in_so_many_through() {
        let mut p = ChainAware::plain(4, 0);
        p.set_bimodal(true);
        let mut admitted = 0;
        for r in 0..ADMIT_EVERY * 3 {
            let key = k(u64::from(r) + 100);
            lookup(&mut p, &[], &[key]);
            p.on_insert(
                0,
                key,
                InsertContext {
                    parent: None,
                    now_ms: 0,
                },
            );
            admitted += u32::from(!p.bypass[0]);
            p.on_remove(0, 0);
        }
        assert_eq!(admitted, 3);
        // A request that finds half its prompt or more is never turned away.
        lookup(&mut p, &[], &[k(1)]);
        insert_chain(&mut p, &[1], 0);
        lookup(&mut p, &[1], &[k(2)]);
        p.on_insert(
            2,
            k(2),
            InsertContext {
                parent: Some(1),
                now_ms: 0,
            },
        );
        assert!(!p.bypass[2]);
    }

    #[test]
    fn heaps_stay_bounded_under_many_touches() {
        let mut p = ChainAware::new(4);
        insert_chain(&mut p, &[0, 1, 2, 3], 0);
        for t in 0..10_000 {
            p.on_hit(3, t);
        }
        assert!(p.heaps.iter().all(|h| h.len() <= h.capacity()));
        assert_eq!(p.victim(&mut |_| true), Some(3));
    }
}

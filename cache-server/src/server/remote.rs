//! The cluster data path, on a server with `[cluster]` and a cluster secret
//! (`docs/cluster.md`, "Data path"):
//!
//! * **Lookup.** A client's lookup whose local prefix is shorter than its keys asks the
//!   owners of the rest (its own runs it looks up in its own store), one batched lookup per
//!   owner, in parallel; combines
//!   their answers in chain order ([`chain::combine`]); reserves slots for those blocks in
//!   the local store (chain order), fetches them from their owners (in parallel) straight
//!   into the reserved slots (in stripes over several connections when large), verifies
//!   each ([`chain::matched`]: the checksum over key and bytes that the SDK computed as they
//!   arrived against the one the owner states), and commits them in chain order, so the
//!   lookup's answer, and the get that follows, are local.
//! * **Offers.** A block a client put here is offered to its owners (if this node is not
//!   one) through a bounded queue and a task: the local put never waits for it.
//! * **Guests.** A copy here of a block this node does not own (fetched from its owner, or
//!   put here and accepted by its owner) is marked a guest in the store, which evicts guests
//!   first: when room is short the cluster keeps one copy of a block, its owner's, and the
//!   members' capacities add up to one cache instead of holding up to N copies.
//!
//! Requests from peers never come here: a peer's lookup is local-only and a peer's put is
//! never offered on, so no request loops between members.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtier_client::Located;
use kvtier_core::BlockKey;
use kvtier_core::protocol::{PutEntry, block_sum};
use kvtier_transfer::Descriptor;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::Shared;
use super::conn::{INLINE_SUM_BYTES, admit, reserve_waiting};
use super::reads::Reads;
use super::tenants::Ns;
use crate::cluster::ClusterNode;
use crate::cluster::chain::{self, Ask, ChainIndex, RunAsk};
use crate::cluster::peers::{self, PeerAddr, PeerFailure, PeerPool};
use crate::store::Reservation;

/// Puts remembered for placing their children (two generations of this many).
const CHAIN_INDEX_ENTRIES: usize = 1 << 18;
/// Block bytes one lookup fetches from peers, at most.
const FETCH_BYTES_PER_LOOKUP: u64 = 256 << 20;
/// The index of this node among the owners a lookup plans with.
const SELF: usize = 0;
/// Offers taken from the queue at a time (sent to their owners in parallel), at most.
const OFFER_BATCH: usize = 256;
/// Block bytes one offer request carries, at most (more go in several, one after another):
/// each is bounded by `cluster.offer_timeout_ms`, and a failure loses at most this much.
const OFFER_CHUNK_BYTES: usize = 16 << 20;
/// Lookups sampled for the split detector, at most one per this many µs (about 200 a
/// second: at most a percent of a core for the detector, `cluster::shared`).
const SAMPLE_EVERY_US: u64 = 5_000;

/// A block to offer to an owner.
struct Offer {
    key: BlockKey,
    /// `None` for the first block of a run (the owner need not hold the run before it).
    parent: Option<BlockKey>,
    owner: PeerAddr,
    /// This node is not among the block's owners: once an owner holds it, the copy here is
    /// a guest (evicted first).
    guest: bool,
}

/// The data path of one server. See the module doc.
pub(crate) struct Remote {
    node: Arc<ClusterNode>,
    /// Connections for lookups (lookup, locate, fetch), bounded by `cluster.peer_timeout_ms`.
    pool: Arc<PeerPool>,
    /// Connections of their own for offers, bounded by `cluster.offer_timeout_ms`: a bulk
    /// offer never queues a lookup behind it, and its failures mark no peer suspect for
    /// lookups.
    offer_pool: PeerPool,
    /// One-sided reads of the owners' DRAM (`cluster.fetch` = `tcp` / `quic`); `None`: every
    /// block comes over the protocol.
    reads: Option<Arc<Reads>>,
    offers: mpsc::Sender<Offer>,
    chains: Mutex<ChainIndex>,
    /// The view's change count when the pool last dropped departed peers.
    pruned_at: Mutex<u64>,
    /// Sampled lookups' chains to the split detector (`None`: `cluster.split_check_s` 0).
    samples: Option<mpsc::Sender<Vec<BlockKey>>>,
    /// When the last lookup was sampled (µs since `started`).
    sampled_at: std::sync::atomic::AtomicU64,
    started: Instant,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Remote {
    /// The data path of `node`, if it has a secret; starts the offer task (it ends with the
    /// server's shutdown token).
    pub fn start(
        shared: &Arc<Shared>,
        node: Arc<ClusterNode>,
        reads: Option<Reads>,
    ) -> Option<Arc<Self>> {
        let token = node.peer_token.clone()?;
        let pool = Arc::new(PeerPool::new(
            token.clone(),
            node.settings.peer_timeout,
            shared.block_bytes as u64,
            node.metrics.peer.clone(),
        ));
        let offer_pool = PeerPool::new(
            token,
            node.settings.offer_timeout,
            shared.block_bytes as u64,
            node.metrics.peer.clone(),
        );
        let (tx, rx) = mpsc::channel(node.settings.offer_queue_blocks.max(1));
        let cut = node.settings.runs();
        let check = node.settings.split_check;
        let (samples, sample_rx) = if check.is_zero() {
            (None, None)
        } else {
            let (tx, rx) = mpsc::channel(64);
            (Some(tx), Some(rx))
        };
        let r = Arc::new(Self {
            node,
            pool,
            offer_pool,
            reads: reads.map(Arc::new),
            offers: tx,
            chains: Mutex::new(ChainIndex::new(CHAIN_INDEX_ENTRIES, cut)),
            pruned_at: Mutex::new(u64::MAX),
            samples,
            sampled_at: std::sync::atomic::AtomicU64::new(0),
            started: Instant::now(),
        });
        tokio::spawn(offer_loop(shared.clone(), r.clone(), rx));
        if let Some(rx) = sample_rx {
            tokio::spawn(split_loop(shared.clone(), r.node.clone(), rx, check));
        }
        Some(r)
    }

    /// Drops the connections of peers that left the view (when the view changed).
    fn prune(&self) {
        let (changes, members) = self.node.with_view(|v| (v.changes(), v.members().clone()));
        let mut at = lock(&self.pruned_at);
        if *at != changes {
            *at = changes;
            self.pool.retain(&members);
            self.offer_pool.retain(&members);
            if let Some(r) = &self.reads {
                r.retain(|id| members.contains_key(id));
            }
        }
    }

    /// Extends a lookup of `keys` (internal keys; `client_keys` as the client sent them, in
    /// namespace `ns`) whose first `local` blocks are here: asks the owners of the rest,
    /// fetches what they hold, verifies it and stores it here in chain order. Returns how
    /// many blocks it stored (the prefix is now `local` + that many, unless evicted
    /// meanwhile), the keys of those this node does not own (guests, which the caller
    /// marks once its lookup holds them), and which member each fetched block came from.
    /// Bounded: two rounds of requests, each within `cluster.peer_timeout_ms`.
    pub async fn extend_lookup(
        &self,
        s: &Arc<Shared>,
        ns: Ns,
        client_keys: &[BlockKey],
        keys: &[BlockKey],
        local: usize,
    ) -> Extended {
        if local >= keys.len() {
            return Extended::default();
        }
        self.prune();
        let me = self.node.record.node_id.clone();
        let rule = self.node.settings.runs();
        // A member's record says when its process started (its own clock: skew between
        // members is small against the warm-up).
        let warmup_ms = self.node.settings.warmup.as_millis() as u64;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // Plan under the view's lock: one owner per run, by index into `peers`; index 0 is
        // this node, for the runs it owns (they are here or nowhere: it is not asked).
        // Per run, in order: whether this node is among its owners.
        let mut mine = Vec::new();
        // Blocks up to the last split the chain passes are shared by many chains: every
        // member keeps its copies of them as its own (never guests), so the hottest blocks
        // are not fetched again after each eviction of a guest.
        let mut shared = 0;
        let (runs, peers) = self.node.with_view(|v| {
            let mut peers = vec![PeerAddr {
                id: me.clone(),
                ..PeerAddr::default()
            }];
            let cut = rule.cut(keys, v.splits());
            shared = cut.shared_len();
            let runs = chain::plan(keys.len(), local, &cut, |anchor| {
                let owners = v.placement().owners(&keys[anchor]);
                mine.push(owners.contains(&me.as_str()));
                let ask = chain::owner_to_ask(
                    &owners,
                    &me,
                    |o| self.pool.usable(o),
                    |o| {
                        let started = match v.members().get(o) {
                            Some(m) => m.record.registered_unix_ms,
                            None if o == me => self.node.record.registered_unix_ms,
                            None => 0,
                        };
                        now_ms.saturating_sub(started) >= warmup_ms
                    },
                )?;
                let Ask::Peer(id) = ask else {
                    return Some(SELF);
                };
                if let Some(i) = peers.iter().position(|p| p.id == id) {
                    return Some(i);
                }
                peers.push(PeerAddr::of(id, &v.members().get(id)?.record));
                Some(peers.len() - 1)
            });
            (runs, peers)
        });
        if peers.len() == 1 {
            return Extended::default(); // every run is this node's own
        }
        // At most FETCH_BYTES_PER_LOOKUP of blocks come in for one lookup (they are held in
        // memory until stored): a longer remote prefix is served in part, the rest by the
        // lookups that follow.
        let cap = (FETCH_BYTES_PER_LOOKUP / s.block_bytes.max(1) as u64).max(1) as usize;
        // Round 1: each owner looks up its runs' keys (one list, chain order); this node
        // looks at its own store. An owner this node reads one-sided is asked to locate
        // them instead (at most `cap` of them): to pin them and say where they lie and
        // their sums.
        let lists = key_lists(&runs, keys, peers.len(), usize::MAX);
        let mut present = vec![None; peers.len()];
        let mut located: Vec<Option<Located>> = vec![None; peers.len()];
        let mut set = JoinSet::new();
        for (i, (peer, mut list)) in peers.iter().zip(lists).enumerate() {
            if i == SELF {
                present[SELF] = Some(s.store.lookup(&list).len());
                continue;
            }
            if list.is_empty() {
                continue;
            }
            let (pool, peer) = (self.pool.clone(), peer.clone());
            if self.reads.is_some() && !peer.transfer_meta.is_empty() {
                list.truncate(cap);
                let lease = self.read_lease();
                set.spawn(async move {
                    let l = pool.locate(&peer, &list, lease).await.ok();
                    (i, l.as_ref().map(|l| l.offsets.len()), l)
                });
            } else {
                set.spawn(async move { (i, pool.lookup(&peer, &list).await.ok(), None) });
            }
        }
        while let Some(r) = set.join_next().await {
            if let Ok((i, p, l)) = r {
                present[i] = p;
                located[i] = l;
            }
        }
        let found = chain::combine(&runs, &present).min(cap);
        if found == 0 {
            self.release_all(&peers, &mut located);
            return Extended::default();
        }
        // Round 2: reserve slots here for the found blocks, in chain order; fetch each
        // owner's blocks straight into its slots, all owners in parallel; verify; commit in
        // chain order.
        let end = local + found;
        let until = Instant::now() + self.pool.timeout();
        let (mut slots, end) = self
            .reserve(s, ns, client_keys, keys, &runs, local..end, until)
            .await;
        // Per owner: the positions it is asked for (chain order) and their reservations,
        // moved into its fetch task and back.
        let mut asks: Vec<Asked> = (0..peers.len()).map(|_| Vec::new()).collect();
        for r in &runs {
            let Some(o) = r.owner.filter(|&o| o != SELF) else {
                continue;
            };
            for p in r.start..(r.start + r.len).min(end) {
                // Only reservations move: a block here already (`Present`) stays, so the
                // commit below goes on past it.
                let slot = &mut slots[p - local];
                if matches!(slot, Some(Slot::Reserved(_)))
                    && let Some(Slot::Reserved(res)) = slot.take()
                {
                    asks[o].push((p, res));
                }
            }
        }
        let mut set = JoinSet::new();
        for (i, ask) in asks.into_iter().enumerate() {
            if ask.is_empty() {
                continue;
            }
            let (pool, peer) = (self.pool.clone(), peers[i].clone());
            let keys: Vec<BlockKey> = ask.iter().map(|(p, _)| keys[*p]).collect();
            match (located[i].as_ref(), &self.reads) {
                (Some(l), Some(reads)) => {
                    // Where each asked block is in the owner's located list.
                    let at = list_positions(&runs, i);
                    let places = ask
                        .iter()
                        .map(|(p, _)| {
                            let j = at.binary_search(p).ok()?;
                            Some((*l.offsets.get(j)?, *l.sums.get(j)?))
                        })
                        .collect();
                    let reads = reads.clone();
                    set.spawn(read_owner(
                        reads,
                        pool,
                        peer,
                        places,
                        keys,
                        ask,
                        s.block_bytes,
                    ));
                }
                _ => {
                    set.spawn(fetch_owner(pool, peer, keys, ask, s.block_bytes));
                }
            }
        }
        while let Some(r) = set.join_next().await {
            if let Ok((ask, ok)) = r {
                for (n, (p, res)) in ask.into_iter().enumerate() {
                    slots[p - local] = Some(if n < ok {
                        Slot::Filled(res)
                    } else {
                        Slot::Reserved(res)
                    });
                }
            }
        }
        self.release_all(&peers, &mut located);
        // Commit in chain order up to the first block that did not come (or check out); the
        // reservations after it are dropped, which frees their slots. Blocks of runs this
        // node owns (fetched from an owner that was there before it), and shared ones, are
        // its own, not guests.
        // Positions come in chain order, as the runs do: one walk over the runs. Each
        // position's run: its owner (the peer a fetched block came from) and whether this
        // node is among its owners.
        let mut runs_mine = runs.iter().zip(mine.iter().copied()).peekable();
        let mut run_of = |p: usize| {
            while runs_mine.next_if(|(r, _)| p >= r.start + r.len).is_some() {}
            runs_mine.peek().copied().filter(|(r, _)| p >= r.start)
        };
        let mut stored = Vec::new();
        let mut sources: Vec<(std::ops::Range<usize>, usize)> = Vec::new();
        for (p, slot) in (local..end).zip(slots) {
            let run = run_of(p);
            let own = run.is_some_and(|(_, m)| m) || p < shared;
            match slot {
                Some(Slot::Own) => continue, // here already
                Some(Slot::Present) => stored.push((keys[p], own)),
                Some(Slot::Filled(res)) => match res.commit() {
                    Ok(crate::PutOutcome::Stored(_) | crate::PutOutcome::AlreadyPresent) => {
                        stored.push((keys[p], own));
                        // Filled only from its run's owner's fetch or read.
                        let Some(i) = run.and_then(|(r, _)| r.owner) else {
                            continue;
                        };
                        match sources.last_mut() {
                            Some((r, from)) if *from == i && r.end == p => r.end += 1,
                            _ => sources.push((p..p + 1, i)),
                        }
                    }
                    _ => break,
                },
                // Not fetched, not verified, or its fetch task failed.
                Some(Slot::Reserved(_)) | None => break,
            }
        }
        let (fetched, guests) = self.stored(stored);
        Extended {
            fetched,
            guests,
            sources: sources
                .into_iter()
                .map(|(r, i)| (r, peers[i].id.clone()))
                .collect(),
        }
    }

    /// How long an owner keeps blocks it located for this node: the reads that follow are
    /// bounded by the peer timeout, and the lease outlasts them (a lease is released as soon
    /// as the reads are done; one whose release is lost passes by itself).
    fn read_lease(&self) -> std::time::Duration {
        self.pool.timeout() * 4 + std::time::Duration::from_millis(500)
    }

    /// Releases every owner's located lease (without waiting: their pins go as soon as the
    /// owners read the release).
    fn release_all(&self, peers: &[PeerAddr], located: &mut [Option<Located>]) {
        for (peer, l) in peers.iter().zip(located.iter_mut()) {
            if let Some(l) = l.take().filter(|l| l.lease_id != 0) {
                let (pool, peer) = (self.pool.clone(), peer.clone());
                tokio::spawn(async move { pool.release(&peer, l.lease_id).await });
            }
        }
    }

    /// Reserves this node's slots for the blocks in `span` (`local..end`) that other members own,
    /// in chain order (each after its parent's reservation when that is the block before),
    /// stopping at the first block refused (admission, quota, no slot within `until`).
    /// Returns a slot per position from `local` and the end it reached.
    #[allow(clippy::too_many_arguments)]
    async fn reserve(
        &self,
        s: &Arc<Shared>,
        ns: Ns,
        client_keys: &[BlockKey],
        keys: &[BlockKey],
        runs: &[RunAsk],
        span: std::ops::Range<usize>,
        until: Instant,
    ) -> (Vec<Option<Slot>>, usize) {
        let (local, end) = (span.start, span.end);
        let mut slots: Vec<Option<Slot>> = (local..end).map(|_| None).collect();
        for r in runs {
            let Some(o) = r.owner else {
                return (slots, r.start.min(end));
            };
            if o == SELF {
                // Here already (its blocks were counted by a local lookup).
                for p in r.start..(r.start + r.len).min(end) {
                    slots[p - local] = Some(Slot::Own);
                }
                continue;
            }
            for p in r.start..(r.start + r.len).min(end) {
                let parent = p.checked_sub(1).map(|q| keys[q]);
                let after = match p.checked_sub(1).filter(|&q| q >= local) {
                    Some(q) => match &slots[q - local] {
                        Some(Slot::Reserved(prev)) => Some(prev),
                        _ => None,
                    },
                    None => None,
                };
                if admit(s, ns, keys[p], client_keys[p]).is_none() {
                    return (slots, p);
                }
                slots[p - local] = Some(
                    match reserve_waiting(s, keys[p], parent, after, until).await {
                        Ok(res) => Slot::Reserved(res),
                        Err(crate::PutOutcome::AlreadyPresent) => Slot::Present,
                        Err(_) => return (slots, p),
                    },
                );
            }
        }
        (slots, end)
    }

    /// Marks this node's copies of `keys` (blocks other members own) as guests in the
    /// store, unless `cluster.guests_first` is off or requests are routed sticky (a
    /// member's sessions come back to it: its copies are what it reads next).
    pub fn guests(&self, s: &Shared, keys: &[BlockKey]) {
        if self.node.settings.guests_first && !self.node.sticky() && !keys.is_empty() {
            s.store.mark_guests(keys);
        }
    }

    /// A client's put request stored (or found) `keys` here, once, after its last block.
    pub fn client_puts<'a>(&self, keys: impl IntoIterator<Item = &'a BlockKey>) {
        self.node.client_puts(keys);
    }

    /// Whether the blocks peers offer this node (their owner) are its guests: requests are
    /// routed sticky (`cluster.routing`), so the member that put them serves their sessions
    /// from its own copies and these keep only room nothing else wants.
    pub fn offers_are_guests(&self) -> bool {
        self.node.settings.guests_first && self.node.sticky()
    }

    /// Counts the blocks a lookup stored here as remote hits; returns the keys of those
    /// this node does not own (`(key, own)`): its guests.
    fn stored(&self, blocks: Vec<(BlockKey, bool)>) -> (usize, Vec<BlockKey>) {
        self.node.metrics.remote_hits.inc_by(blocks.len() as u64);
        let hits = blocks.len();
        let guests = blocks
            .into_iter()
            .filter(|(_, own)| !own)
            .map(|(k, _)| k)
            .collect();
        (hits, guests)
    }

    /// A client's lookup of `keys` (a chain from its first block, internal keys) found the
    /// first `found` here: remembers the last one's place in the chain, so the puts that
    /// continue it are placed (and offered) even when this node never saw the chain's start
    /// (its blocks were put on another member, or fetched).
    ///
    /// Also samples the chain for the split detector (at most one lookup per
    /// `SAMPLE_EVERY_US`; a full queue drops the sample).
    pub fn looked_up(&self, s: &Shared, keys: &[BlockKey], found: usize) {
        if let Some(last) = found.checked_sub(1).filter(|&l| l < keys.len()) {
            let cut = self
                .node
                .with_view(|v| self.node.settings.runs().cut(keys, v.splits()));
            lock(&self.chains).record_at(keys, &cut, last);
            // Past the blocks every member keeps: where the prefix ends says whether its
            // chain came back to this member.
            if found > cut.shared_len() && self.node.client_looked_up(&keys[last]) {
                // The guests marked under the other choice are the wrong copies now.
                s.store.clear_guests();
            }
        }
        if let Some(tx) = &self.samples {
            use std::sync::atomic::Ordering::Relaxed;
            let now = self.started.elapsed().as_micros() as u64;
            let last = self.sampled_at.load(Relaxed);
            if now.saturating_sub(last) >= SAMPLE_EVERY_US
                && self
                    .sampled_at
                    .compare_exchange(last, now, Relaxed, Relaxed)
                    .is_ok()
            {
                let n = keys.len().min(crate::cluster::shared::WALK);
                let _ = tx.try_send(keys[..n].to_vec());
            }
        }
    }

    /// A client's put of `key` (internal) after `parent` is cached here: remembers its place
    /// in its chain and, if this node is not among its owners, queues it for them. Never
    /// waits: a full queue drops the offer (counted).
    pub fn offered(&self, s: &Shared, key: BlockKey, parent: Option<BlockKey>, stored: bool) {
        if !s.tenants.keys_as_sent() {
            // Offers carry internal keys, and an owner cannot tell their namespace.
            if stored {
                self.drop_offer("tenants", 1);
            }
            return;
        }
        let splits = self.node.with_view(|v| v.splits().clone());
        let place = lock(&self.chains).record(key, parent, &splits);
        if !stored {
            return;
        }
        let Some(place) = place else {
            self.drop_offer("unplaced", 1);
            return;
        };
        let me = &self.node.record.node_id;
        let (owners, guest): (Vec<PeerAddr>, bool) = self.node.with_view(|v| {
            let all = v.placement().owners(&place.anchor);
            let guest = !all.contains(&me.as_str());
            let others = all
                .into_iter()
                .filter(|o| *o != me.as_str())
                .filter_map(|o| Some(PeerAddr::of(o, &v.members().get(o)?.record)))
                .collect();
            (others, guest)
        });
        // The first block of a run: its owner need not hold the run before it.
        let parent = if place.anchor == key { None } else { parent };
        for owner in owners {
            let offer = Offer {
                key,
                parent,
                owner,
                guest,
            };
            if self.offers.try_send(offer).is_err() {
                self.drop_offer("queue_full", 1);
            }
        }
    }

    fn drop_offer(&self, reason: &str, n: u64) {
        self.node
            .metrics
            .offers_dropped
            .with_label_values(&[reason])
            .inc_by(n);
    }
}

/// Blocks asked of an owner: their positions in the chain and their reservations here.
type Asked = Vec<(usize, Reservation)>;

/// What [`Remote::extend_lookup`] brought in.
#[derive(Debug, Default)]
pub struct Extended {
    /// Blocks past the local prefix now here, in chain order (fetched, or stored meanwhile).
    pub fetched: usize,
    /// Those of them other members own (to mark as guests once the lookup's hold is on).
    pub guests: Vec<BlockKey>,
    /// The positions (in the lookup's keys) of the blocks fetched from a member, in runs,
    /// each with the member's node id: the lookup reply's remote tier and sources.
    pub sources: Vec<(std::ops::Range<usize>, String)>,
}

/// One owner's part of a remote lookup: its blocks (`keys`, in chain order, with their
/// reservations here) fetched in stripes over several connections at once
/// ([`peers::stripes`]), each block summed as it arrives and checked against its owner's
/// sum. Returns the reservations, in order, and how many
/// lead the chain filled and verified: the leading blocks up to the first stripe that came
/// short, failed or did not check out. Counts the whole round as one `fetch` of `peer`.
async fn fetch_owner(
    pool: Arc<PeerPool>,
    peer: PeerAddr,
    keys: Vec<BlockKey>,
    mut ask: Asked,
    block_bytes: usize,
) -> (Asked, usize) {
    let t0 = Instant::now();
    let cuts = peers::stripes(ask.len(), block_bytes as u64);
    // Split from the back so each stripe owns its reservations.
    let mut stripes = Vec::with_capacity(cuts.len());
    for r in cuts.iter().rev() {
        stripes.push((r.start, ask.split_off(r.start), keys[r.clone()].to_vec()));
    }
    let mut done: Vec<(usize, Asked, Option<usize>)> = Vec::new();
    if stripes.len() == 1 {
        // One stripe: fetched right here (a task of its own would cost a hand-off).
        let (start, part, list) = stripes.pop().expect("one stripe");
        let (part, ok) = fetch_stripe(&pool, &peer, 0, list, part).await;
        done.push((start, part, ok));
    } else {
        let mut set = JoinSet::new();
        for (stream, (start, part, list)) in stripes.into_iter().rev().enumerate() {
            let (pool, peer) = (pool.clone(), peer.clone());
            set.spawn(async move {
                let (part, ok) = fetch_stripe(&pool, &peer, stream, list, part).await;
                (start, part, ok)
            });
        }
        while let Some(r) = set.join_next().await {
            if let Ok(d) = r {
                done.push(d);
            }
        }
    }
    done.sort_by_key(|(start, _, _)| *start);
    let ok = leading_verified(done.iter().map(|(start, part, n)| (*start, part.len(), *n)));
    let out: Asked = done.into_iter().flat_map(|(_, part, _)| part).collect();
    pool.round("fetch", &peer, t0.elapsed(), ok == keys.len());
    (out, ok)
}

/// How many blocks lead a striped fetch filled and verified, from its stripes' (start, length,
/// verified count or `None` when the fetch failed) sorted by start (a stripe whose task died
/// is missing): the stripes in order up to the first that is missing, failed or short, and
/// that one's verified blocks.
fn leading_verified(done: impl Iterator<Item = (usize, usize, Option<usize>)>) -> usize {
    let mut ok = 0;
    for (start, len, n) in done {
        if start != ok {
            break; // the stripe before this one is missing
        }
        ok += n.unwrap_or(0).min(len);
        if n != Some(len) {
            break;
        }
    }
    ok
}

/// One stripe of [`fetch_owner`] on connection `stream`: fetched into its reservations and
/// verified. `None` when the fetch failed; else how many leading blocks verified.
async fn fetch_stripe(
    pool: &PeerPool,
    peer: &PeerAddr,
    stream: usize,
    list: Vec<BlockKey>,
    mut part: Asked,
) -> (Asked, Option<usize>) {
    let fetched = {
        let mut bufs: Vec<&mut [u8]> = part.iter_mut().map(|(_, r)| r.bytes_mut()).collect();
        pool.fetch_into(peer, stream, &list, &mut bufs).await
    };
    let Ok(f) = fetched else {
        return (part, None);
    };
    // The SDK summed each block as it arrived: checking is a comparison.
    let n = f.blocks.min(part.len());
    let ok = chain::matched(&f.sums[..n.min(f.sums.len())], &f.arrived);
    if ok < n {
        bad_block(pool, peer, "fetched");
    }
    pool.metrics()
        .fetched_blocks
        .with_label_values(&[&peer.id])
        .inc_by(ok as u64);
    (part, Some(ok))
}

/// One owner's part of a remote lookup read one-sided from its DRAM (`server/reads.rs`):
/// its blocks (`keys`, chain order, with their reservations here) at the places its locate
/// gave (`places`: arena offset and stated sum, `None` where it located nothing), read in
/// stripes ([`peers::stripes`]) straight into the reserved slots, each stripe's blocks
/// summed and checked as soon as it lands while the others are still on the wire. Returns
/// the reservations of the leading stripes that landed (in order) and how many lead the
/// chain verified. The reservations of a stripe that failed, timed out or came after one that
/// did are **not** returned: a READ may still land in them until its transfer settles, so a
/// task holds them until then (closing the connection to a peer that timed out, which
/// settles its reads), and only then are their slots freed. Counts the round as one `read`
/// of `peer`.
async fn read_owner(
    reads: Arc<Reads>,
    pool: Arc<PeerPool>,
    peer: PeerAddr,
    places: Vec<Option<(u64, u64)>>,
    keys: Vec<BlockKey>,
    mut ask: Asked,
    block_bytes: usize,
) -> (Asked, usize) {
    let t0 = Instant::now();
    let deadline = tokio::time::Instant::now() + pool.timeout();
    let n = places.iter().take_while(|p| p.is_some()).count();
    ask.truncate(n); // the rest are dropped: never posted, nothing lands in them
    let (tp, region, _) = match reads
        .peer(&peer.id, &peer.transfer_meta, pool.timeout())
        .await
    {
        Ok(p) => p,
        // A connect that took the whole peer timeout: no time is left for a fetch within
        // the lookup's bound (two rounds, each within the timeout).
        Err(e @ PeerFailure::Timeout) => {
            pool.failed(&peer, "read", &e);
            pool.round("read", &peer, t0.elapsed(), false);
            return (Vec::new(), 0);
        }
        Err(e) => {
            // The owner answered the locate, so it is up; only its agent cannot be reached
            // now (a connect refused, or the back-off after a failed one: up to 5 s past a
            // network fault), and that was known at once. Nothing was posted: fetch the
            // blocks over the protocol instead, so the lookup does not lose what the owner
            // just located.
            if reads.warn_fallback(&peer.id) {
                tracing::warn!(
                    peer = %peer.id,
                    "one-sided reads from this peer are unavailable ({e:?}): fetching over the \
                     protocol (kvtier_cluster_peer_read_fallbacks_total); check that its \
                     transfer port is reachable if this lasts"
                );
            } else {
                tracing::debug!(peer = %peer.id, "one-sided read unavailable ({e:?}): fetching over the protocol");
            }
            pool.round("read", &peer, t0.elapsed(), false);
            pool.metrics()
                .read_fallbacks
                .with_label_values(&[&peer.id])
                .inc();
            let keys = keys[..n].to_vec();
            return fetch_owner(pool, peer, keys, ask, block_bytes).await;
        }
    };
    let cuts = peers::stripes(n, block_bytes as u64);
    let mut parts = Vec::with_capacity(cuts.len());
    for r in cuts.iter().rev() {
        parts.push((r.start, ask.split_off(r.start)));
    }
    parts.reverse();
    // Post every stripe at once: the agent spreads them over its connections.
    let mut stripes = Vec::with_capacity(parts.len());
    for (start, part) in parts {
        let descs: Vec<Descriptor> = part
            .iter()
            .enumerate()
            .map(|(k, (_, res))| {
                let (at, _) = places[start + k].expect("only located blocks are read");
                Descriptor::new(reads.arena(), res.offset(), region, at, block_bytes as u64)
            })
            .collect();
        let t = tp.read(&descs).ok();
        let settle = t.as_ref().and_then(|t| t.settle_handle());
        stripes.push((start, part, t, settle));
    }
    let mut done: Asked = Vec::with_capacity(n);
    let mut ok = 0;
    let mut failure = None;
    let mut stripes = stripes.into_iter();
    for (start, part, t, settle) in stripes.by_ref() {
        let landed = match t {
            None => Err(PeerFailure::Failed("read refused at post".into())),
            Some(t) => match tokio::time::timeout_at(deadline, t).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(PeerFailure::Failed(format!("read: {e}"))),
                Err(_) => Err(PeerFailure::Timeout),
            },
        };
        if let Err(e) = landed {
            failure = Some(e);
            quarantine(part, settle);
            break;
        }
        let sums: Vec<u64> = (start..start + part.len())
            .map(|j| places[j].expect("located").1)
            .collect();
        let (part, good) = verify(part, &keys[start..], sums, block_bytes).await;
        let whole = good == part.len();
        ok += good;
        done.extend(part);
        if !whole {
            bad_block(&pool, &peer, "read");
            break;
        }
    }
    // Stripes not awaited (after a failure or a bad block): their reads may still land.
    for (_, part, t, settle) in stripes {
        drop(t);
        quarantine(part, settle);
    }
    if let Some(e) = &failure {
        // A read that failed or hung: its connections are closed, so every read still
        // waiting on them settles, and the next lookup connects again.
        tp.close();
        reads.forget(&peer.id);
        pool.failed(&peer, "read", e);
    }
    pool.metrics()
        .fetched_blocks
        .with_label_values(&[&peer.id])
        .inc_by(ok as u64);
    pool.metrics()
        .fetched_bytes
        .with_label_values(&[&peer.id])
        .inc_by((ok * block_bytes) as u64);
    pool.round("read", &peer, t0.elapsed(), ok == n && failure.is_none());
    (done, ok)
}

/// Holds `part`'s reservations until the READ into them settles (no byte of it can land
/// any more), then frees them. A READ whose backend cannot tell (`settle` is `None`) was
/// never posted.
fn quarantine(part: Asked, settle: Option<kvtier_transfer::SettleHandle>) {
    match settle {
        None => drop(part),
        Some(h) => {
            tokio::spawn(async move {
                h.settled().await;
                drop(part);
            });
        }
    }
}

/// Sums each of `part`'s landed blocks (over its key and bytes) and compares it with the
/// owner's: how many lead verified. On the blocking pool when over [`INLINE_SUM_BYTES`].
async fn verify(
    mut part: Asked,
    keys: &[BlockKey],
    sums: Vec<u64>,
    block_bytes: usize,
) -> (Asked, usize) {
    let keys = keys[..part.len()].to_vec();
    let check = move |part: &mut Asked| {
        let mut good = 0;
        for ((_, res), (key, sum)) in part.iter_mut().zip(keys.iter().zip(&sums)) {
            if block_sum(key, res.bytes_mut()) != *sum {
                break;
            }
            good += 1;
        }
        good
    };
    if part.len() * block_bytes <= INLINE_SUM_BYTES {
        let good = check(&mut part);
        return (part, good);
    }
    // A task that panicked (hashing cannot) verified nothing; its slots go with it.
    tokio::task::spawn_blocking(move || {
        let good = check(&mut part);
        (part, good)
    })
    .await
    .unwrap_or_default()
}

/// The chain positions of owner `o`'s located list, in its order (as [`key_lists`] builds
/// it): ascending.
fn list_positions(runs: &[RunAsk], o: usize) -> Vec<usize> {
    runs.iter()
        .filter(|r| r.owner == Some(o))
        .flat_map(|r| r.start..r.start + r.len)
        .collect()
}

/// Counts and reports a block that came from `peer` (`how`: fetched or read) and failed its
/// check: it and what follows it in that owner's part are dropped, never served.
fn bad_block(pool: &PeerPool, peer: &PeerAddr, how: &str) {
    pool.metrics()
        .bad_blocks
        .with_label_values(&[&peer.id])
        .inc();
    tracing::warn!(
        peer = %peer.id,
        "a block {how} from a peer failed verification (its checksum); dropped, not served"
    );
}

/// A fetched block's place in this node's store during a remote lookup.
enum Slot {
    /// Reserved, waiting for its bytes.
    Reserved(Reservation),
    /// Its bytes came and checked out: to commit.
    Filled(Reservation),
    /// Here already (stored meanwhile): nothing to fetch.
    Present,
    /// In a run this node owns: here already, never fetched.
    Own,
}

/// The keys each peer is asked for: its runs' keys up to position `end`, in chain order.
fn key_lists(runs: &[RunAsk], keys: &[BlockKey], peers: usize, end: usize) -> Vec<Vec<BlockKey>> {
    let mut lists = vec![Vec::new(); peers];
    for r in runs {
        if let Some(o) = r.owner {
            let stop = (r.start + r.len).min(end);
            if r.start < stop {
                lists[o].extend_from_slice(&keys[r.start..stop]);
            }
        }
    }
    lists
}

/// Feeds sampled lookups to the split detector; every `period`, publishes the splits it
/// finds (the etcd driver writes them into this node's record) and ages its counts. A
/// server that just started checks sooner (after 1, 2, 4, ... s, up to `period`), so a
/// fresh cluster learns its shared prompt within seconds. Ends with the server.
async fn split_loop(
    s: Arc<Shared>,
    node: Arc<ClusterNode>,
    mut rx: mpsc::Receiver<Vec<BlockKey>>,
    period: std::time::Duration,
) {
    let mut detector = crate::cluster::shared::SplitDetector::new();
    let mut step = std::time::Duration::from_secs(1).min(period);
    let mut next = tokio::time::Instant::now() + step;
    let mut aged = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = s.shutdown.cancelled() => return,
            chain = rx.recv() => match chain {
                Some(c) => detector.observe(&c),
                None => return,
            },
            _ = tokio::time::sleep_until(next) => {
                let kept: Vec<(usize, BlockKey)> =
                    node.published().iter().filter_map(|r| r.parse()).collect();
                node.publish_splits(&detector.splits(&kept));
                node.metrics.split_nodes.set(detector.len() as i64);
                if aged.elapsed() >= period {
                    detector.age();
                    aged = tokio::time::Instant::now();
                }
                step = (step * 2).min(period);
                next = tokio::time::Instant::now() + step;
            }
        }
    }
}

/// Sends queued offers: takes what is queued (up to [`OFFER_BATCH`] at a time), reads the
/// blocks from the local store (pinned while sent) and puts them to their owner. Ends with
/// the server's shutdown.
async fn offer_loop(s: Arc<Shared>, r: Arc<Remote>, mut rx: mpsc::Receiver<Offer>) {
    loop {
        let first = tokio::select! {
            _ = s.shutdown.cancelled() => return,
            o = rx.recv() => match o { Some(o) => o, None => return },
        };
        let mut batch = vec![first];
        while batch.len() < OFFER_BATCH {
            match rx.try_recv() {
                Ok(o) => batch.push(o),
                Err(_) => break,
            }
        }
        // Per owner, in queue order, with whether each block is a guest here.
        let mut by_owner: Vec<(PeerAddr, Vec<PutEntry>, Vec<bool>)> = Vec::new();
        for o in batch {
            let e = PutEntry {
                key: o.key,
                parent: o.parent,
            };
            match by_owner.iter_mut().find(|(p, _, _)| *p == o.owner) {
                Some((_, v, g)) => {
                    v.push(e);
                    g.push(o.guest);
                }
                None => by_owner.push((o.owner, vec![e], vec![o.guest])),
            }
        }
        // Owners in parallel: one slow owner does not hold up the offers to the others.
        let mut sends = JoinSet::new();
        for (owner, entries, guests) in by_owner {
            let (s, r) = (s.clone(), r.clone());
            sends.spawn(async move { send_offer(&s, &r, &owner, entries, guests).await });
        }
        while sends.join_next().await.is_some() {}
    }
}

async fn send_offer(
    s: &Arc<Shared>,
    r: &Remote,
    owner: &PeerAddr,
    entries: Vec<PutEntry>,
    guests: Vec<bool>,
) {
    let keys: Vec<BlockKey> = entries.iter().map(|e| e.key).collect();
    let store = s.store.clone();
    // The blocks stay pinned (not evicted, not rewritten) until sent.
    let Ok(pinned) = tokio::task::spawn_blocking(move || store.pin_read(&keys)).await else {
        return;
    };
    let n = pinned.blocks().len();
    if n < entries.len() {
        r.drop_offer("evicted", (entries.len() - n) as u64);
    }
    if n == 0 {
        return;
    }
    let bufs: Vec<&[u8]> = (0..n).map(|i| pinned.bytes(i)).collect();
    let per = (OFFER_CHUNK_BYTES / bufs[0].len().max(1)).max(1);
    // The owner holds these now: the copies here are guests.
    let mut handed = Vec::new();
    for at in (0..n).step_by(per) {
        let end = (at + per).min(n);
        match r
            .offer_pool
            .offer(owner, &entries[at..end], &bufs[at..end])
            .await
        {
            Ok(held) => handed.extend(
                entries[at..end]
                    .iter()
                    .zip(&guests[at..end])
                    .zip(&held)
                    .filter(|((_, g), h)| **g && **h)
                    .map(|((e, _), _)| e.key),
            ),
            Err(e) => {
                tracing::debug!(peer = %owner.id, "an offer of {} blocks failed: {e:?}", end - at);
                // The rest would arrive without their parents.
                r.drop_offer("failed", (n - at) as u64);
                break;
            }
        }
    }
    drop(bufs);
    drop(pinned);
    r.guests(s, &handed);
}

#[cfg(test)]
mod tests {
    use super::leading_verified;

    #[test]
    fn a_striped_fetch_counts_up_to_its_first_gap() {
        let all = |d: &[(usize, usize, Option<usize>)]| leading_verified(d.iter().copied());
        // Four stripes of 4, all verified.
        let whole = [
            (0, 4, Some(4)),
            (4, 4, Some(4)),
            (8, 4, Some(4)),
            (12, 4, Some(4)),
        ];
        assert_eq!(all(&whole), 16);
        // The second came short (2 of 4): the later ones do not count, though verified.
        assert_eq!(all(&[(0, 4, Some(4)), (4, 4, Some(2)), (8, 4, Some(4))]), 6);
        // The second failed.
        assert_eq!(all(&[(0, 4, Some(4)), (4, 4, None), (8, 4, Some(4))]), 4);
        // The second is missing (its task died): the third starts past the gap.
        assert_eq!(all(&[(0, 4, Some(4)), (8, 4, Some(4))]), 4);
        // The first is missing, or failed: nothing.
        assert_eq!(all(&[(4, 4, Some(4))]), 0);
        assert_eq!(all(&[(0, 4, None), (4, 4, Some(4))]), 0);
        // A stripe that came back empty and failed.
        assert_eq!(all(&[(0, 4, Some(4)), (4, 0, None)]), 4);
        assert_eq!(all(&[]), 0);
    }
}

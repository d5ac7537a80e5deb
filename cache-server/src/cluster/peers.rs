//! Connections to the other members' data endpoints, one per live peer, through the kvtier
//! SDK (the same protocol clients speak; the hello carries the cluster's peer token). Every
//! request, connecting included, is bounded by `cluster.peer_timeout_ms`: a peer that does
//! not answer in time is a miss, counted, and never waited on past the bound.
//!
//! A peer whose connect fails is not tried again before a back-off (100 ms, doubling to at
//! most 5 s, reset by a success); once connected, the SDK reconnects by itself. A peer whose
//! request failed or timed out is *suspect* for [`SUSPECT_FOR`]: with replicas, callers ask
//! another owner meanwhile ([`PeerPool::usable`]). A peer that left the view is dropped with
//! its metric series ([`PeerPool::retain`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use kvtier_client::{Client, ClientConfig, FetchedInto, Located, Miss};
use kvtier_core::BlockKey;
use kvtier_core::protocol::{PutEntry, PutStatus};

use super::metrics::PeerMetrics;
use super::record::{MemberRecord, unhex};
use super::view::Member;

/// First pause after a failed connect; doubled per failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long a peer whose request failed or timed out is passed over for another owner.
pub const SUSPECT_FOR: Duration = Duration::from_secs(1);
/// Connections a fetch may stripe over, at most (kvtier-transfer's TCP backend opens as many
/// a peer by default): a fetch is one request a connection, and one connection reads at
/// about half the rate of several on loopback, the owner hashing a part's sums before it
/// sends them and this node verifying them after.
pub const FETCH_STREAMS: usize = 4;
/// Block bytes a stripe carries, at least: smaller fetches go whole on one connection (a
/// second request costs more than it saves).
pub const STRIPE_MIN_BYTES: u64 = 512 << 10;

/// A member to talk to: its id, its advertised data endpoint and the certificate to pin
/// there (the record's: hex DER and the name it carries; "" over plain TCP).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerAddr {
    pub id: String,
    pub endpoint: String,
    pub cert_der: String,
    pub cert_name: String,
    /// Hex of its kvtier-transfer blob without the token ("": it serves no one-sided reads).
    pub transfer_meta: String,
}

impl PeerAddr {
    /// Member `id` as its record advertises it.
    pub fn of(id: &str, record: &MemberRecord) -> PeerAddr {
        PeerAddr {
            id: id.to_string(),
            endpoint: record.data_endpoint.clone(),
            cert_der: record.data_cert_der.clone(),
            cert_name: record.data_cert_name.clone(),
            transfer_meta: record.transfer_meta.clone(),
        }
    }
}

#[derive(Default)]
struct Slot {
    endpoint: String,
    /// Connections to the peer: the first for every request, more for striped fetches (at
    /// most [`FETCH_STREAMS`]).
    clients: Vec<Client>,
    /// Connections being opened for striped fetches (not in `clients` yet).
    opening: usize,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// Passed over for another owner until then (a request failed or timed out).
    suspect_until: Option<Instant>,
}

/// Why a request to a peer got no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerFailure {
    Timeout,
    Failed(String),
}

/// The pool. See the module doc.
pub struct PeerPool {
    token: String,
    timeout: Duration,
    block_bytes: u64,
    metrics: PeerMetrics,
    slots: Mutex<HashMap<String, Slot>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PeerPool {
    pub fn new(token: String, timeout: Duration, block_bytes: u64, metrics: PeerMetrics) -> Self {
        Self {
            token,
            timeout,
            block_bytes,
            metrics,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn metrics(&self) -> &PeerMetrics {
        &self.metrics
    }

    /// Drops the connections (and metric series) of peers no longer in `members`.
    pub fn retain(&self, members: &BTreeMap<String, Member>) {
        let mut g = lock(&self.slots);
        let gone: Vec<String> = g
            .keys()
            .filter(|id| !members.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            g.remove(&id);
            self.metrics.forget(&id);
        }
    }

    /// Whether `id` is worth asking first: not backing off after a failed connect, and no
    /// request of it failed or timed out in the last [`SUSPECT_FOR`].
    pub fn usable(&self, id: &str) -> bool {
        let now = Instant::now();
        lock(&self.slots).get(id).is_none_or(|s| {
            s.retry_at.is_none_or(|t| now >= t) && s.suspect_until.is_none_or(|t| now >= t)
        })
    }

    /// A connected client for `peer`, connecting if needed (the caller bounds the time).
    async fn client(&self, peer: &PeerAddr) -> Result<Client, PeerFailure> {
        {
            let mut g = lock(&self.slots);
            let slot = g.entry(peer.id.clone()).or_default();
            if slot.endpoint != peer.endpoint {
                // New peer, or it moved: start over.
                *slot = Slot {
                    endpoint: peer.endpoint.clone(),
                    ..Slot::default()
                };
            }
            if let Some(c) = slot.clients.first() {
                return Ok(c.clone());
            }
            if slot.retry_at.is_some_and(|t| Instant::now() < t) {
                return Err(PeerFailure::Failed(
                    "backing off after a failed connect".into(),
                ));
            }
        }
        let r = self.connect(peer).await;
        let mut g = lock(&self.slots);
        let slot = g.entry(peer.id.clone()).or_default();
        match r {
            Ok(c) => {
                if slot.clients.len() < FETCH_STREAMS {
                    slot.clients.push(c.clone());
                }
                slot.retry_at = None;
                slot.backoff = Duration::ZERO;
                Ok(c)
            }
            Err(e) => {
                slot.backoff = (slot.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                slot.retry_at = Some(Instant::now() + slot.backoff);
                Err(e)
            }
        }
    }

    /// A new connection to `peer` (no bookkeeping; the caller bounds the time).
    async fn connect(&self, peer: &PeerAddr) -> Result<Client, PeerFailure> {
        if peer.endpoint.is_empty() {
            return Err(PeerFailure::Failed("no advertised data endpoint".into()));
        }
        let mut cfg = ClientConfig::default()
            .token(self.token.clone())
            .timeout(self.timeout)
            .block_bytes(self.block_bytes)
            .reconnect_backoff(FIRST_BACKOFF);
        // The caller's bound (`bounded`) cuts a connect that hangs, counted as a timeout.
        cfg.connect_timeout = self.timeout * 2;
        cfg.name = "kvtier-cluster-peer".into();
        if !peer.endpoint.starts_with("tcp://") {
            // TLS or QUIC: pin exactly the certificate its (authenticated) record carries.
            let Some(der) = unhex(&peer.cert_der).filter(|d| !d.is_empty()) else {
                return Err(PeerFailure::Failed(format!(
                    "{} needs a certificate and its record carries none",
                    peer.endpoint
                )));
            };
            cfg = cfg.server_cert_der(der).server_name(peer.cert_name.clone());
        }
        Client::connect(&peer.endpoint, cfg)
            .await
            .map_err(|e| PeerFailure::Failed(e.to_string()))
    }

    /// Connection `i` to `peer` (see [`stripes`]): the first connects as [`PeerPool::client`]
    /// does; for a later one, the missing connections up to it that no other request is
    /// opening are opened, in parallel. One not open (yet, or it failed to open) is shared
    /// with an open one: the first says whether the peer is reachable.
    async fn stream(&self, peer: &PeerAddr, i: usize) -> Result<Client, PeerFailure> {
        let first = self.client(peer).await?;
        if i == 0 {
            return Ok(first);
        }
        let want = (i + 1).min(FETCH_STREAMS);
        let open = match lock(&self.slots).get_mut(&peer.id) {
            Some(slot) => {
                let open = want.saturating_sub(slot.clients.len().max(1) + slot.opening);
                slot.opening += open;
                open
            }
            None => 0,
        };
        if open > 0 {
            let opened = join_all((0..open).map(|_| self.connect(peer))).await;
            if let Some(slot) = lock(&self.slots).get_mut(&peer.id) {
                slot.opening = slot.opening.saturating_sub(open);
                if slot.endpoint == peer.endpoint {
                    let room = FETCH_STREAMS.saturating_sub(slot.clients.len());
                    slot.clients.extend(opened.into_iter().flatten().take(room));
                }
            }
        }
        Ok(lock(&self.slots)
            .get(&peer.id)
            .filter(|s| !s.clients.is_empty())
            .map_or(first, |s| s.clients[i % s.clients.len()].clone()))
    }

    /// Runs `f` on `peer`'s client (connection `stream`, see [`PeerPool::stream`]) within the
    /// timeout, counting the request, its latency and its failure.
    async fn bounded<T, F>(
        &self,
        peer: &PeerAddr,
        op: &'static str,
        stream: usize,
        f: impl FnOnce(Client) -> F,
    ) -> Result<T, PeerFailure>
    where
        F: std::future::Future<Output = Result<T, PeerFailure>>,
    {
        let m = &self.metrics;
        m.requests.with_label_values(&[&peer.id, op]).inc();
        let t0 = Instant::now();
        let r = tokio::time::timeout(self.timeout, async {
            let c = self.stream(peer, stream).await?;
            f(c).await
        })
        .await
        .unwrap_or(Err(PeerFailure::Timeout));
        if let Some(slot) = lock(&self.slots).get_mut(&peer.id) {
            slot.suspect_until = r.is_err().then(|| Instant::now() + SUSPECT_FOR);
            if matches!(r, Err(PeerFailure::Timeout)) {
                // A connection whose request timed out is in no known state: its stream may
                // be stalled in TCP's retransmission backoff (which outlasts the loss that
                // caused it), or still carrying the late reply. Requests after it would
                // queue behind either, so the peer's connections are opened afresh; the
                // ones in use close when their last request ends.
                slot.clients.clear();
            }
        }
        match &r {
            Ok(_) => m
                .latency
                .with_label_values(&[&peer.id, op])
                .observe(t0.elapsed().as_secs_f64()),
            Err(PeerFailure::Timeout) => m.timeouts.with_label_values(&[&peer.id]).inc(),
            Err(PeerFailure::Failed(why)) => {
                tracing::debug!(peer = %peer.id, op, "peer request failed: {why}");
                m.errors.with_label_values(&[&peer.id]).inc();
            }
        }
        r
    }

    /// How many leading `keys` `peer` holds (its lookup, local to it).
    pub async fn lookup(&self, peer: &PeerAddr, keys: &[BlockKey]) -> Result<usize, PeerFailure> {
        self.bounded(peer, "lookup", 0, |c| async move {
            let l = c.lookup(keys).await;
            match l.miss {
                None | Some(Miss::NotCached) => Ok(l.tiers.len()),
                Some(Miss::Timeout) => Err(PeerFailure::Timeout),
                Some(m) => Err(PeerFailure::Failed(format!("lookup: {m:?}"))),
            }
        })
        .await
    }

    /// Pins the leading `keys` `peer` holds in its DRAM for `lease` (its locate, local to
    /// it), on its first connection: where each lies in its arena and the sum it states.
    /// The caller releases the lease ([`PeerPool::release`]) once it has read them.
    pub async fn locate(
        &self,
        peer: &PeerAddr,
        keys: &[BlockKey],
        lease: Duration,
    ) -> Result<Located, PeerFailure> {
        self.bounded(peer, "locate", 0, |c| async move {
            let l = c
                .locate(keys, lease)
                .await
                .map_err(|e| PeerFailure::Failed(format!("locate: {e}")))?;
            if l.sums.len() != l.offsets.len() {
                return Err(PeerFailure::Failed("locate: sums and blocks differ".into()));
            }
            Ok(l)
        })
        .await
    }

    /// Releases lease `lease_id` that a locate took on `peer` (on the same connection),
    /// without waiting for an answer; a lease the peer no longer has (the connection was
    /// made again meanwhile) simply passes its deadline there.
    pub async fn release(&self, peer: &PeerAddr, lease_id: u64) {
        if lease_id == 0 {
            return;
        }
        let _ = self
            .bounded(peer, "release", 0, |c| async move {
                c.release_nowait(lease_id)
                    .await
                    .map_err(|e| PeerFailure::Failed(format!("release: {e}")))
            })
            .await;
    }

    /// The blocks of the leading `keys` `peer` holds, read straight into `bufs` (one
    /// block-sized buffer a key) over connection `stream` (see [`stripes`]; one that is not
    /// open yet is shared with an open one), with the sums it states (unverified: the caller
    /// verifies), asked in as many requests as replies need. Counted as a `fetch_stripe`.
    pub async fn fetch_into(
        &self,
        peer: &PeerAddr,
        stream: usize,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<FetchedInto, PeerFailure> {
        let r = self
            .bounded(peer, "fetch_stripe", stream, |c| async move {
                fetch_all(&c, keys, bufs).await
            })
            .await;
        if let Ok(f) = &r {
            self.metrics
                .fetched_bytes
                .with_label_values(&[&peer.id])
                .inc_by(f.blocks as u64 * self.block_bytes);
        }
        r
    }

    /// Counts a request to `peer` made outside the pool (a one-sided read) that failed or
    /// timed out, and passes the peer over for [`SUSPECT_FOR`] as [`PeerPool::bounded`]
    /// does.
    pub fn failed(&self, peer: &PeerAddr, op: &'static str, why: &PeerFailure) {
        if let Some(slot) = lock(&self.slots).get_mut(&peer.id) {
            slot.suspect_until = Some(Instant::now() + SUSPECT_FOR);
        }
        match why {
            PeerFailure::Timeout => self.metrics.timeouts.with_label_values(&[&peer.id]).inc(),
            PeerFailure::Failed(w) => {
                tracing::debug!(peer = %peer.id, op, "peer request failed: {w}");
                self.metrics.errors.with_label_values(&[&peer.id]).inc();
            }
        }
    }

    /// Counts one round of requests to `peer` made as a whole (a lookup's fetch from one
    /// owner, all its stripes) as a request `op` taking `took`; its latency only when
    /// `complete` (its stripes' failures are counted as theirs).
    pub fn round(&self, op: &'static str, peer: &PeerAddr, took: Duration, complete: bool) {
        let m = &self.metrics;
        m.requests.with_label_values(&[&peer.id, op]).inc();
        if complete {
            m.latency
                .with_label_values(&[&peer.id, op])
                .observe(took.as_secs_f64());
        }
    }

    /// Offers blocks to `peer` (a put; the entries are in chain order). Returns, for each
    /// entry, whether the peer now holds it.
    pub async fn offer(
        &self,
        peer: &PeerAddr,
        entries: &[PutEntry],
        bufs: &[&[u8]],
    ) -> Result<Vec<bool>, PeerFailure> {
        let r = self
            .bounded(peer, "offer", 0, |c| async move {
                let s = c.put(entries, bufs).await;
                match s.failure {
                    Some(Miss::Timeout) => Err(PeerFailure::Timeout),
                    Some(m) if s.statuses.is_empty() => {
                        Err(PeerFailure::Failed(format!("offer: {m:?}")))
                    }
                    _ => Ok(s
                        .statuses
                        .iter()
                        .map(|s| matches!(s, PutStatus::Stored | PutStatus::AlreadyPresent))
                        .collect::<Vec<bool>>()),
                }
            })
            .await;
        if let Ok(held) = &r {
            self.metrics
                .offered_blocks
                .with_label_values(&[&peer.id])
                .inc_by(held.iter().filter(|&&h| h).count() as u64);
        }
        r
    }
}

/// The leading `keys` `c`'s server holds, into `bufs`, in as many requests as its replies
/// need; stops at the first reply that comes back short.
async fn fetch_all(
    c: &Client,
    keys: &[BlockKey],
    bufs: &mut [&mut [u8]],
) -> Result<FetchedInto, PeerFailure> {
    let mut all = FetchedInto {
        asked: keys.len(),
        blocks: 0,
        sums: Vec::new(),
        arrived: Vec::new(),
        miss: None,
    };
    while all.blocks < keys.len() {
        let at = all.blocks;
        let f = c.fetch_into(&keys[at..], &mut bufs[at..]).await.map_err(
            |e| match Miss::from_error(&e) {
                Miss::Timeout => PeerFailure::Timeout,
                _ => PeerFailure::Failed(format!("fetch: {e}")),
            },
        )?;
        let short = f.blocks < f.asked || f.blocks == 0;
        all.blocks += f.blocks;
        all.sums.extend(f.sums);
        all.arrived.extend(f.arrived);
        if short {
            all.miss = f.miss.or(Some(Miss::NotCached));
            break;
        }
    }
    Ok(all)
}

/// How a fetch of `n` blocks of `block_bytes` is cut: contiguous ranges in chain order, one
/// a connection, each of at least [`STRIPE_MIN_BYTES`] (a single block is never split), at
/// most [`FETCH_STREAMS`] of them.
pub fn stripes(n: usize, block_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let bytes = n as u64 * block_bytes;
    let by_size = (bytes / STRIPE_MIN_BYTES).max(1) as usize;
    even_cuts(n, by_size.min(FETCH_STREAMS))
}

/// `0..n` cut into `k` contiguous ranges (at most `n`, at least one) whose lengths differ by
/// at most one, the longer first.
fn even_cuts(n: usize, k: usize) -> Vec<std::ops::Range<usize>> {
    let k = k.clamp(1, n.max(1));
    let (per, extra) = (n / k, n % k);
    let mut at = 0;
    (0..k)
        .map(|i| {
            let len = per + usize::from(i < extra);
            let r = at..at + len;
            at += len;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_the_fetch_in_order_and_never_split_a_block() {
        const K: u64 = 1 << 10;
        // (blocks, block bytes) -> stripe lengths
        for (n, bb, want) in [
            (0, 2048 * K, vec![0]),
            (1, 2048 * K, vec![1]),
            (16, 32 * K, vec![16]),           // 512 KiB: one stripe
            (17, 32 * K, vec![17]),           // just over: still one (544 KiB / 512)
            (32, 32 * K, vec![16, 16]),       // 1 MiB: two
            (16, 256 * K, vec![4, 4, 4, 4]),  // 4 MiB: four
            (16, 2048 * K, vec![4, 4, 4, 4]), // 32 MiB: at most FETCH_STREAMS
            (3, 2048 * K, vec![1, 1, 1]),     // never more stripes than blocks
            (10, 2048 * K, vec![3, 3, 2, 2]), // the longer first
        ] {
            let s = stripes(n, bb);
            let lens: Vec<usize> = s.iter().map(|r| r.len()).collect();
            assert_eq!(lens, want, "{n} blocks of {bb} bytes");
            let mut at = 0;
            for r in &s {
                assert_eq!(r.start, at, "contiguous");
                at = r.end;
            }
            assert_eq!(at, n, "covers every block");
            assert!(s.len() <= FETCH_STREAMS);
        }
    }
}

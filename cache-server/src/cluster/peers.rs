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

use kvtier_client::{Client, ClientConfig, FetchedInto, Miss};
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

/// A member to talk to: its id, its advertised data endpoint and the certificate to pin
/// there (the record's: hex DER and the name it carries; "" over plain TCP).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerAddr {
    pub id: String,
    pub endpoint: String,
    pub cert_der: String,
    pub cert_name: String,
}

impl PeerAddr {
    /// Member `id` as its record advertises it.
    pub fn of(id: &str, record: &MemberRecord) -> PeerAddr {
        PeerAddr {
            id: id.to_string(),
            endpoint: record.data_endpoint.clone(),
            cert_der: record.data_cert_der.clone(),
            cert_name: record.data_cert_name.clone(),
        }
    }
}

#[derive(Default)]
struct Slot {
    endpoint: String,
    client: Option<Client>,
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
            if let Some(c) = &slot.client {
                return Ok(c.clone());
            }
            if slot.retry_at.is_some_and(|t| Instant::now() < t) {
                return Err(PeerFailure::Failed(
                    "backing off after a failed connect".into(),
                ));
            }
        }
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
        let r = Client::connect(&peer.endpoint, cfg).await;
        let mut g = lock(&self.slots);
        let slot = g.entry(peer.id.clone()).or_default();
        match r {
            Ok(c) => {
                slot.client = Some(c.clone());
                slot.retry_at = None;
                slot.backoff = Duration::ZERO;
                Ok(c)
            }
            Err(e) => {
                slot.backoff = (slot.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                slot.retry_at = Some(Instant::now() + slot.backoff);
                Err(PeerFailure::Failed(e.to_string()))
            }
        }
    }

    /// Runs `f` on `peer`'s client within the timeout, counting the request, its latency
    /// and its failure.
    async fn bounded<T, F>(
        &self,
        peer: &PeerAddr,
        op: &'static str,
        f: impl FnOnce(Client) -> F,
    ) -> Result<T, PeerFailure>
    where
        F: std::future::Future<Output = Result<T, PeerFailure>>,
    {
        let m = &self.metrics;
        m.requests.with_label_values(&[&peer.id, op]).inc();
        let t0 = Instant::now();
        let r = tokio::time::timeout(self.timeout, async {
            let c = self.client(peer).await?;
            f(c).await
        })
        .await
        .unwrap_or(Err(PeerFailure::Timeout));
        if let Some(slot) = lock(&self.slots).get_mut(&peer.id) {
            slot.suspect_until = r.is_err().then(|| Instant::now() + SUSPECT_FOR);
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
        self.bounded(peer, "lookup", |c| async move {
            let l = c.lookup(keys).await;
            match l.miss {
                None | Some(Miss::NotCached) => Ok(l.tiers.len()),
                Some(Miss::Timeout) => Err(PeerFailure::Timeout),
                Some(m) => Err(PeerFailure::Failed(format!("lookup: {m:?}"))),
            }
        })
        .await
    }

    /// The blocks of the leading `keys` `peer` holds, read straight into `bufs` (one
    /// block-sized buffer a key), with the sums it states (unverified: the caller verifies),
    /// asked in as many requests as replies need.
    pub async fn fetch_into(
        &self,
        peer: &PeerAddr,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<FetchedInto, PeerFailure> {
        let r = self
            .bounded(peer, "fetch", |c| async move {
                let mut all = FetchedInto {
                    asked: keys.len(),
                    blocks: 0,
                    sums: Vec::new(),
                    miss: None,
                };
                while all.blocks < keys.len() {
                    let at = all.blocks;
                    let f = c
                        .fetch_into(&keys[at..], &mut bufs[at..])
                        .await
                        .map_err(|e| match Miss::from_error(&e) {
                            Miss::Timeout => PeerFailure::Timeout,
                            _ => PeerFailure::Failed(format!("fetch: {e}")),
                        })?;
                    let short = f.blocks < f.asked || f.blocks == 0;
                    all.blocks += f.blocks;
                    all.sums.extend(f.sums);
                    if short {
                        all.miss = f.miss.or(Some(Miss::NotCached));
                        break;
                    }
                }
                Ok(all)
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

    /// Offers blocks to `peer` (a put; the entries are in chain order). Returns, for each
    /// entry, whether the peer now holds it.
    pub async fn offer(
        &self,
        peer: &PeerAddr,
        entries: &[PutEntry],
        bufs: &[&[u8]],
    ) -> Result<Vec<bool>, PeerFailure> {
        let r = self
            .bounded(peer, "offer", |c| async move {
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

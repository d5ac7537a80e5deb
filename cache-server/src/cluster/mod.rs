//! A cluster of kvtier servers: membership on etcd and placement of blocks over the members.
//! See `docs/cluster.md`.
//!
//! * [`placement`]: weighted rendezvous hashing of a key over the members, replicas, and
//!   the runs a prefix chain is cut into. Pure.
//! * [`record`]: a member's record in etcd and its HMAC with the cluster secret. Pure.
//! * [`view`]: the membership view, a state machine fed by the etcd driver. Pure.
//! * `etcd` (feature `cluster`): the driver: registers this node under a lease, renews it,
//!   lists and watches the members, and reconnects after an outage.
//! * [`ClusterNode`]: what the server holds: this node's record, the view behind a lock,
//!   the metrics; `/cluster` and `/health` read it.
//!
//! * [`chain`]: the data path's pure parts: which owner to ask for which run, combining
//!   their answers in chain order, verifying fetched blocks, chain positions of puts.
//! * [`shared`]: finding the blocks after which many chains diverge (the splits this
//!   member publishes). Pure.
//! * [`peers`]: connections to the peers' data endpoints (the kvtier SDK, the peer token),
//!   every request bounded by `cluster.peer_timeout_ms`.
//!
//! The data path itself (a lookup that asks the owners and fetches, puts offered to their
//! owners) is `server/remote.rs`: it needs the store and the wire. It is on only with a
//! cluster secret (`docs/cluster.md`, "Data path").

pub mod chain;
#[cfg(feature = "cluster")]
mod etcd;
#[cfg(feature = "cluster")]
pub use etcd::{listed, watch_changes};
mod metrics;
pub mod peers;
pub mod placement;
pub mod record;
pub mod returns;
pub mod shared;
pub mod view;

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::BlockKey;
use serde_json::{Value, json};

pub use metrics::{ClusterMetrics, PeerMetrics};
pub use placement::{Candidate, Placement};
pub use record::{MemberRecord, RecordSealer, Rejection, SplitRecord, TierCapacity};
pub use view::{Applied, Change, EtcdLink, Member, MembershipView};

fn dropped(m: &ClusterMetrics, reason: &str) -> u64 {
    m.offers_dropped
        .get_metric_with_label_values(&[reason])
        .map_or(0, |c| c.get())
}

/// Everything the driver needs, resolved from `[cluster]` and the running server.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    pub etcd_endpoints: Vec<String>,
    pub name: String,
    pub node_id: String,
    pub replicas: usize,
    pub run_blocks: usize,
    /// Blocks at a chain's head placed each by its own key.
    pub head_blocks: usize,
    /// How often this member looks for splits in its sampled lookups (zero: never; it
    /// publishes none).
    pub split_check: Duration,
    pub lease_ttl: Duration,
    pub etcd_timeout: Duration,
    /// The cluster secret, if configured.
    pub secret: Option<Vec<u8>>,
    /// Bound on each request to a peer on a lookup's path.
    pub peer_timeout: Duration,
    /// Bound on each offer request to an owner.
    pub offer_timeout: Duration,
    /// Put blocks queued for offers, at most.
    pub offer_queue_blocks: usize,
    /// How long a member that joined is passed over for owners that were there before it.
    pub warmup: Duration,
    /// Copies of blocks other members own are marked as guests (evicted first).
    pub guests_first: bool,
    /// `cluster.routing`: which copies are the guests.
    pub routing: Routing,
    /// Client puts `cluster.routing = "auto"` remembers, a generation (two of them).
    pub returns_keys: usize,
}

/// `cluster.routing`: how requests reach the members, which says which copy of a block is
/// the guest (evicted first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// A session's requests go to several members (round robin): the guests are a member's
    /// copies of blocks others own; the owners keep the cluster's copy.
    Spread,
    /// A session stays on one member: it keeps its copies; those its owners were offered
    /// are their guests.
    Sticky,
    /// Chosen by each member from where its clients' lookups end ([`returns`]).
    Auto,
}

impl Routing {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "spread" => Some(Self::Spread),
            "sticky" => Some(Self::Sticky),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Spread => "spread",
            Self::Sticky => "sticky",
            Self::Auto => "auto",
        }
    }
}

impl ClusterSettings {
    /// The etcd prefix of member keys: `/kvtier/<name>/members/`.
    pub fn members_prefix(&self) -> String {
        format!("/kvtier/{}/members/", self.name)
    }

    /// How chains are cut for placement (`head_blocks`, `run_blocks`).
    pub fn runs(&self) -> placement::Runs {
        placement::Runs::new(self.head_blocks, self.run_blocks)
    }
}

/// This node's cluster state, shared by the driver, the admin port and the metrics.
pub struct ClusterNode {
    pub settings: ClusterSettings,
    /// What this node registers (its splits apart: `published`).
    pub record: MemberRecord,
    /// The splits this node publishes in its record now.
    published: Mutex<Vec<SplitRecord>>,
    /// Woken when `published` changed: the etcd driver writes the record again.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    republish: tokio::sync::Notify,
    sealer: RecordSealer,
    view: Mutex<MembershipView>,
    /// The lease this node's key lives under now (0: not registered).
    lease_id: AtomicI64,
    /// The view change at which members' placement rules were last compared with this
    /// node's (`u64::MAX`: never).
    placement_checked: AtomicU64,
    pub metrics: ClusterMetrics,
    /// The token peers present (`record::peer_token`); `None` without a secret: then no
    /// peer is trusted and the data path is off.
    pub peer_token: Option<String>,
    /// Where this member's clients' lookups end (`cluster.routing = "auto"`).
    returns: Mutex<returns::Returns>,
    /// Whether this member keeps its own copies (see [`Routing`]) now.
    sticky: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ClusterNode {
    pub fn new(settings: ClusterSettings, record: MemberRecord, metrics: ClusterMetrics) -> Self {
        let sealer = RecordSealer::new(settings.secret.as_deref(), &settings.name);
        let view =
            MembershipView::new(settings.members_prefix(), sealer.clone(), settings.replicas);
        metrics.enabled.set(1);
        let settings_sticky = settings.routing == Routing::Sticky;
        let returns = returns::Returns::new(settings.returns_keys);
        metrics.sticky.set(i64::from(settings_sticky));
        let peer_token = settings
            .secret
            .as_deref()
            .map(|s| record::peer_token(s, &settings.name));
        Self {
            peer_token,
            settings,
            record,
            published: Mutex::new(Vec::new()),
            republish: tokio::sync::Notify::new(),
            sealer,
            view: Mutex::new(view),
            lease_id: AtomicI64::new(0),
            placement_checked: AtomicU64::new(u64::MAX),
            sticky: std::sync::atomic::AtomicBool::new(settings_sticky),
            returns: Mutex::new(returns),
            metrics,
        }
    }

    /// Whether this member keeps its own copies of blocks others own, and makes the copies
    /// it was offered its guests (`cluster.routing`).
    pub fn sticky(&self) -> bool {
        self.sticky.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A client of this member put `keys` (`cluster.routing = "auto"` remembers them).
    pub fn client_puts<'a>(&self, keys: impl IntoIterator<Item = &'a BlockKey>) {
        if self.settings.routing == Routing::Auto {
            let mut r = lock(&self.returns);
            for k in keys {
                r.put(k);
            }
        }
    }

    /// A client's lookup found a prefix reaching past the shared blocks, ending at `last`:
    /// with `cluster.routing = "auto"`, a sample of whether its chain came back here.
    /// Returns whether this member changed which of its copies are guests (the caller then
    /// clears the guests it marked under the other choice).
    pub fn client_looked_up(&self, last: &BlockKey) -> bool {
        if self.settings.routing != Routing::Auto {
            return false;
        }
        // The choice changes under the lock, so concurrent samples apply in order.
        let mut r = lock(&self.returns);
        let sticky = r.looked_up(last);
        let share = r.share();
        self.metrics.returns.set((share * 1000.0).round() as i64);
        let changed = self
            .sticky
            .swap(sticky, std::sync::atomic::Ordering::Relaxed)
            != sticky;
        self.metrics.sticky.set(i64::from(sticky));
        drop(r);
        if changed {
            tracing::info!(
                "cluster.routing auto: {} (sampled lookups whose prefix ended at a block put here: {:.0} %)",
                if sticky {
                    "sticky, keeping this member's copies"
                } else {
                    "spread, the owners keep the cluster's copies"
                },
                share * 100.0
            );
        }
        changed
    }

    fn returns_share(&self) -> f64 {
        lock(&self.returns).share()
    }

    /// The members whose record states a placement rule other than this node's (a record
    /// without one, from an older server, is not counted).
    fn placement_mismatch(&self, v: &MembershipView) -> Vec<String> {
        v.members()
            .values()
            .filter(|m| {
                m.record
                    .placement
                    .is_some_and(|p| Some(p) != self.record.placement)
            })
            .map(|m| m.record.node_id.clone())
            .collect()
    }

    /// This node's etcd key.
    pub fn own_key(&self) -> String {
        format!("{}{}", self.settings.members_prefix(), self.record.node_id)
    }

    /// The value this node writes at its key: its record, with the splits it publishes.
    pub fn own_value(&self) -> Vec<u8> {
        let mut record = self.record.clone();
        record.splits = self.published();
        self.sealer.seal(self.own_key().as_bytes(), &record)
    }

    /// The splits this node publishes now.
    pub fn published(&self) -> Vec<SplitRecord> {
        self.published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Publishes `splits` (sorted) in this node's record, if they differ from what it
    /// publishes now; the etcd driver writes the record again. Returns whether they did.
    pub fn publish_splits(&self, splits: &[(usize, BlockKey)]) -> bool {
        let new: Vec<SplitRecord> = splits
            .iter()
            .map(|(p, k)| SplitRecord::new(*p, k))
            .collect();
        let mut cur = self.published.lock().unwrap_or_else(|p| p.into_inner());
        if *cur == new {
            return false;
        }
        tracing::info!(
            splits = ?new.iter().map(|s| format!("{}@{}", s.key, s.position)).collect::<Vec<_>>(),
            "cluster: publishing the blocks many chains diverge after (runs start after them)"
        );
        *cur = new;
        drop(cur);
        self.republish.notify_one();
        true
    }

    /// Waits until this node's published splits change.
    #[cfg(feature = "cluster")]
    pub(crate) async fn republished(&self) {
        self.republish.notified().await
    }

    /// Runs `f` on the view under its lock (held briefly: no I/O, no await inside).
    pub fn with_view<R>(&self, f: impl FnOnce(&mut MembershipView) -> R) -> R {
        // A panic while the lock was held left a view that is still consistent (every
        // method finishes its update before returning), so a poisoned lock is used as is.
        let mut v = self.view.lock().unwrap_or_else(|p| p.into_inner());
        let out = f(&mut v);
        self.metrics.members.set(v.members().len() as i64);
        self.metrics.splits.set(v.splits().len() as i64);
        if self.placement_checked.swap(v.changes(), Ordering::Relaxed) != v.changes() {
            let odd = self.placement_mismatch(&v);
            let before = self.metrics.placement_mismatch.get();
            self.metrics.placement_mismatch.set(odd.len() as i64);
            if !odd.is_empty() && before != odd.len() as i64 {
                tracing::warn!(
                    members = ?odd,
                    own = ?self.record.placement,
                    "cluster: members place blocks by another rule (cluster.replicas, \
                     run_blocks, head_blocks): lookups across them miss; set the same on \
                     every member"
                );
            }
        }
        self.metrics
            .etcd_connected
            .set(matches!(v.link(), EtcdLink::Connected { .. }) as i64);
        out
    }

    pub fn lease_id(&self) -> i64 {
        self.lease_id.load(Ordering::Relaxed)
    }

    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn set_lease_id(&self, id: i64) {
        self.lease_id.store(id, Ordering::Relaxed);
    }

    /// The owners of `key` (as a run's anchor: a head block, or the first key of a run), best
    /// first, in the current view.
    pub fn owners(&self, key: &BlockKey) -> Vec<String> {
        self.with_view(|v| {
            v.placement()
                .owners(key)
                .into_iter()
                .map(String::from)
                .collect()
        })
    }

    /// Whether the data path is on (a cluster secret is configured).
    pub fn data_path(&self) -> bool {
        self.peer_token.is_some()
    }

    /// One line for `/health`: the etcd link and the view's size.
    pub fn health_line(&self, now: Instant) -> String {
        self.with_view(|v| {
            let n = v.members().len();
            match v.link() {
                EtcdLink::Connecting => format!("etcd: connecting (view: {n} members)"),
                EtcdLink::Connected { .. } => format!("etcd: connected (view: {n} members)"),
                EtcdLink::Unreachable { error, .. } => format!(
                    "etcd: unreachable for {} s, serving local tiers with the last known view \
                     ({n} members): {error}",
                    v.unreachable_for(now).unwrap_or_default().as_secs()
                ),
            }
        })
    }

    /// The `/cluster` document (see `docs/cluster.md`, "Operations").
    pub fn json(&self, now: Instant, key: Option<&BlockKey>) -> Value {
        let s = &self.settings;
        self.with_view(|v| {
            let (state, for_s, error) = match v.link() {
                EtcdLink::Connecting => ("connecting", None, None),
                EtcdLink::Connected { since } => (
                    "connected",
                    Some(now.saturating_duration_since(*since).as_secs_f64()),
                    None,
                ),
                EtcdLink::Unreachable { since, error } => (
                    "unreachable",
                    Some(now.saturating_duration_since(*since).as_secs_f64()),
                    Some(error.clone()),
                ),
            };
            let data_path = self.data_path();
            let members: Vec<Value> = v
                .members()
                .values()
                .map(|m| {
                    let me = m.record.node_id == self.record.node_id;
                    let traffic =
                        (data_path && !me).then(|| self.metrics.peer.json(&m.record.node_id));
                    json!({
                        "traffic": traffic,
                        "node_id": m.record.node_id,
                        "self": m.record.node_id == self.record.node_id,
                        "lease_id": m.lease_id,
                        "mod_revision": m.mod_revision,
                        "version": m.record.version,
                        "data_endpoint": m.record.data_endpoint,
                        "transfer_endpoint": m.record.transfer_endpoint,
                        "transfer_meta": m.record.transfer_meta,
                        "admin_endpoint": m.record.admin_endpoint,
                        "worker_endpoint": m.record.worker_endpoint,
                        "tiers": m.record.tiers,
                        "weight": m.record.weight(),
                        "registered_unix_ms": m.record.registered_unix_ms,
                        "placement": m.record.placement,
                        "splits": m.record.splits,
                    })
                })
                .collect();
            let mut doc = json!({
                "enabled": true,
                "cluster": s.name,
                "node_id": self.record.node_id,
                "etcd": {
                    "endpoints": s.etcd_endpoints,
                    "state": state,
                    "state_for_s": for_s,
                    "error": error,
                },
                "lease_id": self.lease_id(),
                "lease_ttl_s": s.lease_ttl.as_secs(),
                "revision": v.revision(),
                "view_changes": v.changes(),
                "replicas": s.replicas,
                "run_blocks": s.run_blocks,
                "head_blocks": s.head_blocks,
                "split_check_s": s.split_check.as_secs(),
                "splits": v.splits().iter().map(|(p, k)| json!({"position": p, "key": k.to_string()})).collect::<Vec<_>>(),
                "placement_mismatch": self.placement_mismatch(v),
                "records_signed": self.sealer.signs(),
                "records_rejected": v.rejected(),
                "members": members,
                "data_path": if data_path {
                    json!({
                        "enabled": true,
                        // How this node reads peers' blocks: one-sided over kvtier-transfer
                        // when it serves a transfer endpoint itself, else over the protocol.
                        "fetch": if self.record.transfer_meta.is_empty() {
                            "protocol".to_string()
                        } else {
                            self.record.transfer_endpoint.split("://").next().unwrap_or("").to_string()
                        },
                        "peer_timeout_ms": s.peer_timeout.as_millis() as u64,
                        "offer_timeout_ms": s.offer_timeout.as_millis() as u64,
                        "offer_queue_blocks": s.offer_queue_blocks,
                        "warmup_s": s.warmup.as_secs(),
                        "guests_first": s.guests_first,
                        "routing": s.routing.name(),
                        "sticky": self.sticky(),
                        "returns": {
                            "share": self.returns_share(),
                            "samples": lock(&self.returns).samples(),
                        },
                        "remote_hits": self.metrics.remote_hits.get(),
                        "offers_dropped": {
                            "queue_full": dropped(&self.metrics, "queue_full"),
                            "unplaced": dropped(&self.metrics, "unplaced"),
                            "tenants": dropped(&self.metrics, "tenants"),
                            "evicted": dropped(&self.metrics, "evicted"),
                            "failed": dropped(&self.metrics, "failed"),
                        },
                    })
                } else {
                    json!({"enabled": false, "why": "no cluster.secret_file: no peer is trusted"})
                },
            });
            if let Some(k) = key {
                let owners: Vec<&str> = v.placement().owners(k);
                doc["key"] = json!({ "key": k.to_string(), "owners": owners });
            }
            doc
        })
    }

    /// Starts the etcd driver: it registers this node, keeps its lease, watches the members
    /// and reconnects until `stop` is cancelled, then revokes its lease (bounded).
    #[cfg(feature = "cluster")]
    pub fn spawn(
        self: &std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(etcd::run(self.clone(), stop))
    }
}

//! The cluster's metrics, registered in the server's one registry (`server/metrics.rs`
//! creates them). Present (and zero) on a server without a cluster; `kvtier_cluster_enabled`
//! tells which.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// Counters and gauges of membership. Cheap to clone (the `prometheus` handles are shared).
#[derive(Clone, Debug)]
pub struct ClusterMetrics {
    /// 1 when `[cluster]` is on.
    pub enabled: IntGauge,
    /// Members in this node's view (itself included once registered).
    pub members: IntGauge,
    /// Members whose record states a placement rule other than this node's.
    pub placement_mismatch: IntGauge,
    /// Splits in this node's view (the union of the members' published ones), which every
    /// member starts a run after.
    pub splits: IntGauge,
    /// Nodes of this node's split detector (its prefix tree of sampled lookups).
    pub split_nodes: IntGauge,
    /// 1 while this member keeps its own copies of blocks others own and makes the copies
    /// it was offered its guests (`cluster.routing` sticky, or auto and chosen so).
    pub sticky: IntGauge,
    /// Per mille of sampled lookups whose prefix ended at a block a client put here
    /// (`cluster.routing = "auto"`).
    pub returns: IntGauge,
    /// 1 while this node is registered and watching etcd.
    pub etcd_connected: IntGauge,
    /// Lease renewals etcd answered.
    pub lease_renewals: IntCounter,
    /// Registrations (a lease granted and this node's record written): 1 at start, one more
    /// after each reconnection.
    pub registrations: IntCounter,
    /// Membership changes read from the watch (puts and deletes of member keys).
    pub watch_events: IntCounter,
    /// Sessions with etcd that ended in an error (each is followed by a reconnection).
    pub etcd_errors: IntCounter,
    /// Member records refused, by reason (`malformed`, `secret_mismatch`, `bad_mac`,
    /// `wrong_key`).
    pub records_rejected: IntCounterVec,
    /// The data path, per peer (label `peer`: a member's node id; a member's series are
    /// removed when it leaves the view, so the label's values are at most the members).
    pub peer: PeerMetrics,
    /// Blocks a lookup found at their owners, fetched, verified and stored here.
    pub remote_hits: IntCounter,
    /// Block sums this node sent in its fetch replies to peers, by `source`: `kept` (kept
    /// with the block's DRAM slot since an earlier fetch) or `hashed`.
    pub fetch_sums: IntCounterVec,
    /// Put blocks this node offered nobody: `queue_full` (back-pressure), `unplaced` (the
    /// block's position in its chain is unknown), `tenants` (offers are off with tenants),
    /// `evicted` (gone from this node before it was sent), `failed` (the owner refused it
    /// or did not take it within `cluster.offer_timeout_ms`).
    pub offers_dropped: IntCounterVec,
}

/// Per-peer traffic of the data path.
#[derive(Clone, Debug)]
pub struct PeerMetrics {
    /// Requests sent to a peer, by op (`lookup`, `offer`; `fetch_stripe`: one request on one
    /// connection; `fetch`: one lookup's fetch from the peer, all its stripes at once).
    pub requests: IntCounterVec,
    /// Blocks fetched from a peer that verified.
    pub fetched_blocks: IntCounterVec,
    /// Block bytes received from a peer (verified or not).
    pub fetched_bytes: IntCounterVec,
    /// Blocks from a peer whose length or checksum did not verify (dropped, never served).
    pub bad_blocks: IntCounterVec,
    /// Requests to a peer that failed (connect, refusal, protocol error).
    pub errors: IntCounterVec,
    /// Requests to a peer not answered within `cluster.peer_timeout_ms`.
    pub timeouts: IntCounterVec,
    /// Blocks offered to a peer (sent in a put).
    pub offered_blocks: IntCounterVec,
    /// Lookups whose one-sided read from a peer went over the protocol instead: the peer
    /// answered the locate, but its transfer agent could not be reached (a connect that
    /// failed, or its back-off).
    pub read_fallbacks: IntCounterVec,
    /// Latency of answered requests to a peer, by op (a `fetch` only when all its stripes
    /// came and verified).
    pub latency: HistogramVec,
}

impl PeerMetrics {
    /// Forgets a peer's series (it left the view).
    pub fn forget(&self, peer: &str) {
        for v in [
            &self.fetched_blocks,
            &self.fetched_bytes,
            &self.bad_blocks,
            &self.errors,
            &self.timeouts,
            &self.offered_blocks,
            &self.read_fallbacks,
        ] {
            let _ = v.remove_label_values(&[peer]);
        }
        for op in [
            "lookup",
            "fetch",
            "fetch_stripe",
            "offer",
            "locate",
            "read",
            "release",
        ] {
            let _ = self.requests.remove_label_values(&[peer, op]);
            let _ = self.latency.remove_label_values(&[peer, op]);
        }
    }

    /// A peer's traffic, for `/cluster`.
    pub fn json(&self, peer: &str) -> serde_json::Value {
        let c = |v: &IntCounterVec| {
            v.get_metric_with_label_values(&[peer])
                .map_or(0, |c| c.get())
        };
        let r = |op: &str| {
            self.requests
                .get_metric_with_label_values(&[peer, op])
                .map_or(0, |c| c.get())
        };
        serde_json::json!({
            "lookups": r("lookup"),
            "fetches": r("fetch"),
            "locates": r("locate"),
            "reads": r("read"),
            "offers": r("offer"),
            "fetched_blocks": c(&self.fetched_blocks),
            "fetched_bytes": c(&self.fetched_bytes),
            "bad_blocks": c(&self.bad_blocks),
            "errors": c(&self.errors),
            "timeouts": c(&self.timeouts),
            "offered_blocks": c(&self.offered_blocks),
            "read_fallbacks": c(&self.read_fallbacks),
        })
    }
}

impl ClusterMetrics {
    /// Registers the cluster's metrics in `r`. Fails only for a name registered twice.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        fn gauge(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
            let g = IntGauge::new(name, help)?;
            r.register(Box::new(g.clone()))?;
            Ok(g)
        }
        fn counter(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            r.register(Box::new(c.clone()))?;
            Ok(c)
        }
        let rejected = IntCounterVec::new(
            Opts::new(
                "kvtier_cluster_records_rejected_total",
                "Member records in etcd this node refused, by reason.",
            ),
            &["reason"],
        )?;
        r.register(Box::new(rejected.clone()))?;
        let vec = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
            let v = IntCounterVec::new(Opts::new(name, help), labels)?;
            r.register(Box::new(v.clone()))?;
            Ok(v)
        };
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "kvtier_cluster_peer_request_seconds",
                "Latency of answered requests to a peer, by peer and op.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0,
            ]),
            &["peer", "op"],
        )?;
        r.register(Box::new(latency.clone()))?;
        let peer = PeerMetrics {
            requests: vec(
                "kvtier_cluster_peer_requests_total",
                "Requests sent to a peer, by peer and op (lookup, offer, fetch_stripe: a request \
                 on one connection, fetch: one lookup's fetch from the peer, all its stripes).",
                &["peer", "op"],
            )?,
            fetched_blocks: vec(
                "kvtier_cluster_peer_fetched_blocks_total",
                "Blocks fetched from a peer that verified.",
                &["peer"],
            )?,
            fetched_bytes: vec(
                "kvtier_cluster_peer_fetched_bytes_total",
                "Block bytes received from a peer.",
                &["peer"],
            )?,
            bad_blocks: vec(
                "kvtier_cluster_peer_bad_blocks_total",
                "Blocks from a peer that failed verification (dropped, never served).",
                &["peer"],
            )?,
            errors: vec(
                "kvtier_cluster_peer_errors_total",
                "Requests to a peer that failed (connect, refusal, protocol).",
                &["peer"],
            )?,
            timeouts: vec(
                "kvtier_cluster_peer_timeouts_total",
                "Requests to a peer not answered within cluster.peer_timeout_ms.",
                &["peer"],
            )?,
            offered_blocks: vec(
                "kvtier_cluster_peer_offered_blocks_total",
                "Put blocks offered to a peer (their owner).",
                &["peer"],
            )?,
            read_fallbacks: vec(
                "kvtier_cluster_peer_read_fallbacks_total",
                "Lookups whose one-sided read from a peer went over the protocol instead (its \
                 transfer agent could not be reached).",
                &["peer"],
            )?,
            latency,
        };
        let offers_dropped = vec(
            "kvtier_cluster_offers_dropped_total",
            "Put blocks not offered to their owner, by reason.",
            &["reason"],
        )?;
        let remote_hits = counter(
            r,
            "kvtier_cluster_remote_hits_total",
            "Blocks a lookup fetched from their owners, verified and stored here.",
        )?;
        let fetch_sums = vec(
            "kvtier_cluster_fetch_sums_total",
            "Block sums sent in fetch replies to peers, by source (kept: with the block's DRAM \
             slot since an earlier fetch; hashed).",
            &["source"],
        )?;
        Ok(Self {
            peer,
            remote_hits,
            fetch_sums,
            offers_dropped,
            enabled: gauge(r, "kvtier_cluster_enabled", "1 when [cluster] is on.")?,
            members: gauge(r, "kvtier_cluster_members", "Members in this node's view.")?,
            placement_mismatch: gauge(
                r,
                "kvtier_cluster_placement_mismatch_members",
                "Members whose placement rule (replicas, run_blocks, head_blocks) differs from \
                 this node's: their lookups and this node's name different owners.",
            )?,
            splits: gauge(
                r,
                "kvtier_cluster_splits",
                "Blocks after which many chains diverge, as the members publish them: every \
                 member starts a run after each.",
            )?,
            split_nodes: gauge(
                r,
                "kvtier_cluster_split_detector_nodes",
                "Prefix-tree nodes of this member's split detector (sampled lookups).",
            )?,
            sticky: gauge(
                r,
                "kvtier_cluster_sticky",
                "1 while this member keeps its own copies of blocks others own and the copies \
                 it was offered as an owner are its guests (cluster.routing sticky, or auto \
                 and chosen).",
            )?,
            returns: gauge(
                r,
                "kvtier_cluster_returns_per_mille",
                "Per mille of sampled client lookups whose prefix ended at a block a client \
                 put on this member (moving average; cluster.routing = auto).",
            )?,
            etcd_connected: gauge(
                r,
                "kvtier_cluster_etcd_connected",
                "1 while registered in etcd and watching the members.",
            )?,
            lease_renewals: counter(
                r,
                "kvtier_cluster_lease_renewals_total",
                "Lease renewals etcd answered.",
            )?,
            registrations: counter(
                r,
                "kvtier_cluster_registrations_total",
                "Registrations of this node in etcd (one per session).",
            )?,
            watch_events: counter(
                r,
                "kvtier_cluster_watch_events_total",
                "Member key changes read from the etcd watch.",
            )?,
            etcd_errors: counter(
                r,
                "kvtier_cluster_etcd_errors_total",
                "Sessions with etcd that ended in an error.",
            )?,
            records_rejected: rejected,
        })
    }
}

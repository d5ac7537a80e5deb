//! The cluster's metrics, registered in the server's one registry (`server/metrics.rs`
//! creates them). Present (and zero) on a server without a cluster; `kvtier_cluster_enabled`
//! tells which.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Counters and gauges of membership. Cheap to clone (the `prometheus` handles are shared).
#[derive(Clone, Debug)]
pub struct ClusterMetrics {
    /// 1 when `[cluster]` is on.
    pub enabled: IntGauge,
    /// Members in this node's view (itself included once registered).
    pub members: IntGauge,
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
        Ok(Self {
            enabled: gauge(r, "kvtier_cluster_enabled", "1 when [cluster] is on.")?,
            members: gauge(r, "kvtier_cluster_members", "Members in this node's view.")?,
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

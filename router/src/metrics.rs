//! The router's Prometheus registry (the `prometheus` crate, as the server and the worker),
//! served at `GET /metrics` in the classic text format.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

pub struct Metrics {
    registry: Registry,
    /// `endpoint`, `outcome`: ok, client_error, worker_error, no_worker.
    pub requests: IntCounterVec,
    /// `worker`: requests answered by each worker.
    pub routed: IntCounterVec,
    /// `worker`, `reason`: a worker passed over after trying it (connect, http, status_5xx,
    /// timeout).
    pub retries: IntCounterVec,
    /// `worker`: predicted and reported cached prompt tokens of answered requests.
    pub predicted_cached_tokens: IntCounterVec,
    pub reported_cached_tokens: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    /// `worker`, `direction` (lower, higher): answers whose cached tokens disagreed with the
    /// prediction.
    pub cache_mismatch: IntCounterVec,
    /// `worker`: 1 while a run of disagreements says the router's keys differ from the
    /// worker's.
    pub key_mismatch_suspected: IntGaugeVec,
    /// `worker`, `outcome`: what became of each 200 answer's `usage.kvtier` load report: a
    /// sample of a tier (hbm, dram, nvme), nothing_loaded, mixed_tiers, small, bad, malformed,
    /// absent.
    pub load_reports: IntCounterVec,
    pub worker_healthy: IntGaugeVec,
    pub outstanding_requests: IntGaugeVec,
    pub outstanding_prefill_tokens: IntGaugeVec,
    /// `server`: blocks tracked, events applied, events dropped at the cap, resyncs by reason.
    pub index_blocks: IntGaugeVec,
    pub index_events: IntCounterVec,
    pub index_dropped: IntCounterVec,
    /// `server`, `reason`: connect, lost, gap, sequence.
    pub index_resyncs: IntCounterVec,
    pub index_synced: IntGaugeVec,
    /// `state` (present, left): workers taken from the cluster's membership (`cluster_etcd`).
    pub cluster_workers: IntGaugeVec,
    /// 1 while the membership's etcd answers (no series without `cluster_etcd`).
    pub cluster_etcd_connected: IntGaugeVec,
    /// `reason`: member records refused (another secret, malformed, ...).
    pub cluster_records_refused: IntCounterVec,
    /// `placement` (expected_ttft, home, left_home, new_session): why the `kv` policy put its
    /// first worker first, per routed request.
    pub placements: IntCounterVec,
    /// Requests forwarded to vLLM workers without keys: the router could not analyse them
    /// (engine "vllm"; routed by load).
    pub unanalysed: IntCounter,
    /// Parsing, tokenizing, hashing and scoring one request.
    pub decision_seconds: Histogram,
}

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let m = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(m.clone()))?;
    Ok(m)
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
    let m = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(m.clone()))?;
    Ok(m)
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let r = Registry::new();
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvtier_router_decision_seconds",
                "Parsing, tokenizing, hashing and scoring one request",
            )
            .buckets(vec![
                1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
            ]),
        )?;
        r.register(Box::new(decision_seconds.clone()))?;
        Ok(Self {
            requests: counter(
                &r,
                "kvtier_router_requests_total",
                "Requests by endpoint and outcome",
                &["endpoint", "outcome"],
            )?,
            routed: counter(
                &r,
                "kvtier_router_routed_total",
                "Requests answered by each worker",
                &["worker"],
            )?,
            retries: counter(
                &r,
                "kvtier_router_retries_total",
                "Workers passed over after trying them",
                &["worker", "reason"],
            )?,
            predicted_cached_tokens: counter(
                &r,
                "kvtier_router_predicted_cached_tokens_total",
                "Cached prompt tokens the router predicted on the worker it chose",
                &["worker"],
            )?,
            reported_cached_tokens: counter(
                &r,
                "kvtier_router_reported_cached_tokens_total",
                "Cached prompt tokens the worker reported (usage.prompt_tokens_details.cached_tokens)",
                &["worker"],
            )?,
            prompt_tokens: counter(
                &r,
                "kvtier_router_prompt_tokens_total",
                "Prompt tokens routed to each worker",
                &["worker"],
            )?,
            cache_mismatch: counter(
                &r,
                "kvtier_router_cache_mismatch_total",
                "Answers whose cached tokens disagreed with the prediction",
                &["worker", "direction"],
            )?,
            key_mismatch_suspected: gauge(
                &r,
                "kvtier_router_key_mismatch_suspected",
                "1 while the router's block keys seem to differ from the worker's (tokenizer, template, model name, salt or secret)",
                &["worker"],
            )?,
            load_reports: counter(
                &r,
                "kvtier_router_load_reports_total",
                "Workers' usage.kvtier load reports by outcome: a bandwidth sample of a tier (hbm, dram, nvme) or why not",
                &["worker", "outcome"],
            )?,
            worker_healthy: gauge(
                &r,
                "kvtier_router_worker_healthy",
                "1 while the worker is a candidate",
                &["worker"],
            )?,
            outstanding_requests: gauge(
                &r,
                "kvtier_router_outstanding_requests",
                "Requests sent to the worker and not finished",
                &["worker"],
            )?,
            outstanding_prefill_tokens: gauge(
                &r,
                "kvtier_router_outstanding_prefill_tokens",
                "Uncached prompt tokens sent to the worker whose answer has not started",
                &["worker"],
            )?,
            index_blocks: gauge(
                &r,
                "kvtier_router_index_blocks",
                "Blocks tracked for the kvtier server",
                &["server"],
            )?,
            index_events: counter(
                &r,
                "kvtier_router_index_events_total",
                "Block events applied",
                &["server"],
            )?,
            index_dropped: counter(
                &r,
                "kvtier_router_index_dropped_total",
                "Stored events dropped at the index's cap",
                &["server"],
            )?,
            index_resyncs: counter(
                &r,
                "kvtier_router_index_resyncs_total",
                "Subscriptions started over with a snapshot",
                &["server", "reason"],
            )?,
            index_synced: gauge(
                &r,
                "kvtier_router_index_synced",
                "1 while subscribed to the server's events",
                &["server"],
            )?,
            cluster_workers: gauge(
                &r,
                "kvtier_router_cluster_workers",
                "Workers taken from the cluster's membership, present or whose member left",
                &["state"],
            )?,
            cluster_etcd_connected: gauge(
                &r,
                "kvtier_router_cluster_etcd_connected",
                "1 while the cluster's etcd answers the router's membership watch",
                &[],
            )?,
            cluster_records_refused: counter(
                &r,
                "kvtier_router_cluster_records_refused_total",
                "Member records the router refused (not signed with its cluster secret, malformed)",
                &["reason"],
            )?,
            placements: counter(
                &r,
                "kvtier_router_placements_total",
                "Requests routed by the kv policy, by why its first worker came first",
                &["placement"],
            )?,
            unanalysed: {
                let c = IntCounter::new(
                    "kvtier_router_unanalysed_total",
                    "Requests forwarded to vLLM workers that the router could not analyse \
                     (routed by load)",
                )?;
                r.register(Box::new(c.clone()))?;
                c
            },
            decision_seconds,
            registry: r,
        })
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

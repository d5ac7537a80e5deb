//! The worker's metrics in one Prometheus registry (the `prometheus` crate, as the server's),
//! rendered as Prometheus text on `GET /metrics`. Counters, gauges and histograms are atomics
//! (no lock on the request path); the two labelled families (cache fallbacks by reason,
//! requests by status) look their label up in the library's small map.

use std::time::Duration;

use prometheus::{Encoder, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The content type of [`Metrics::render`]'s text (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets, seconds: 1 ms .. 60 s.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Inter-token buckets, seconds: 0.5 ms .. 5 s.
pub const INTER_TOKEN_BUCKETS_S: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// A latency histogram (seconds) that takes [`Duration`]s.
#[derive(Clone)]
pub struct Histogram(prometheus::Histogram);

impl Histogram {
    fn new(r: &Registry, name: &str, help: &str, bounds: &[f64]) -> Self {
        let h = prometheus::Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(bounds.to_vec()),
        )
        .expect("fixed histogram names and increasing buckets");
        Self(reg(r, h))
    }

    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }

    pub fn count(&self) -> u64 {
        self.0.get_sample_count()
    }
}

/// A counter family with one label.
#[derive(Clone)]
pub struct LabelledCounter(IntCounterVec);

impl LabelledCounter {
    fn new(r: &Registry, name: &str, label: &str, help: &str) -> Self {
        let v = IntCounterVec::new(Opts::new(name, help), &[label])
            .expect("fixed metric names and labels");
        Self(reg(r, v))
    }

    pub fn inc(&self, label: &'static str) {
        self.0.with_label_values(&[label]).inc();
    }

    /// The count under `label` (reading a label that never counted makes its series appear,
    /// at 0).
    pub fn get(&self, label: &str) -> u64 {
        self.0.with_label_values(&[label]).get()
    }
}

/// Registers `m` in `r`. Fails only for an invalid or twice-registered name, which the fixed
/// names of this module never are (the unit tests render every family).
fn reg<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: M) -> M {
    r.register(Box::new(m.clone()))
        .expect("fixed, valid and unique metric names");
    m
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    reg(r, IntCounter::new(name, help).expect("fixed metric names"))
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    reg(r, IntGauge::new(name, help).expect("fixed metric names"))
}

/// Every metric of one worker, and the registry they (and [`DisaggMetrics`]) are in.
pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    /// Time to bring a cached prefix into the pool (sidecar calls + copies).
    pub load_time: Histogram,
    pub prompt_tokens_cached: IntCounter,
    pub prompt_tokens_computed: IntCounter,
    pub generated_tokens: IntCounter,
    pub bytes_loaded: IntCounter,
    pub blocks_loaded: IntCounter,
    pub stores_queued: IntCounter,
    pub stores_dropped: IntCounter,
    pub blocks_stored: IntCounter,
    /// Blocks that hold generated tokens, queued for storing when their sequence ended.
    pub generated_blocks_queued: IntCounter,
    /// Batched decode forwards (several sequences' next tokens in one) and the tokens in them.
    pub batched_decode_steps: IntCounter,
    pub batched_decode_tokens: IntCounter,
    pub store_failures: IntCounter,
    /// Store jobs the sidecar refused in whole or in part (busy, backlog, no slot, orphan).
    pub stores_refused: IntCounter,
    /// Retention hints (`kvtier_retain_s`) the sidecar accepted, and refused or failed.
    pub retain_hints_accepted: IntCounter,
    pub retain_hints_refused: IntCounter,
    /// Prompt tokens whose KV was found in the worker's own prefix cache (in its pool).
    pub prompt_tokens_local_hit: IntCounter,
    /// Loads skipped because the cost model said recomputing is faster.
    pub loads_skipped_cost: IntCounter,
    /// Sequences running in the scheduler now, and the most at once since start.
    pub running: IntGauge,
    pub peak_running: IntGauge,
    /// Why a cached prefix was not used (requests recomputed it): `unavailable`, `timeout`,
    /// `disconnected`, `corrupt`, `io_error`, `busy`, `refused`, `lease_expired`, ...
    pub cache_fallbacks: LabelledCounter,
    /// Finished requests by HTTP status class of their outcome: `ok`, `bad_request`,
    /// `not_found`, `busy`, `too_large`, `error`, `cancelled`.
    pub requests: LabelledCounter,
}

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::new();
        let c = |name, help| counter(&r, name, help);
        Self {
            ttft: Histogram::new(
                &r,
                "kvtier_worker_ttft_seconds",
                "Time from request arrival to the first generated token.",
                LATENCY_BUCKETS_S,
            ),
            inter_token: Histogram::new(
                &r,
                "kvtier_worker_inter_token_seconds",
                "Time between consecutive generated tokens of one request.",
                INTER_TOKEN_BUCKETS_S,
            ),
            e2e: Histogram::new(
                &r,
                "kvtier_worker_e2e_seconds",
                "Time from request arrival to its last token.",
                LATENCY_BUCKETS_S,
            ),
            load_time: Histogram::new(
                &r,
                "kvtier_worker_prefix_load_seconds",
                "Time to load a cached prefix from kvtier into the KV pool.",
                LATENCY_BUCKETS_S,
            ),
            prompt_tokens_cached: c(
                "kvtier_worker_prompt_tokens_cached_total",
                "Prompt tokens not recomputed: KV loaded from kvtier or found in the worker's \
                 own prefix cache.",
            ),
            prompt_tokens_computed: c(
                "kvtier_worker_prompt_tokens_computed_total",
                "Prompt tokens computed by prefill.",
            ),
            generated_tokens: c("kvtier_worker_generated_tokens_total", "Tokens generated."),
            bytes_loaded: c(
                "kvtier_worker_bytes_loaded_total",
                "KV bytes loaded from kvtier.",
            ),
            blocks_loaded: c(
                "kvtier_worker_blocks_loaded_total",
                "KV blocks loaded from kvtier.",
            ),
            stores_queued: c(
                "kvtier_worker_stores_queued_total",
                "Store jobs (one per request) queued for the sidecar.",
            ),
            stores_dropped: c(
                "kvtier_worker_stores_dropped_total",
                "Store jobs dropped because the store queue was full.",
            ),
            blocks_stored: c(
                "kvtier_worker_blocks_stored_total",
                "Blocks the sidecar reports cached after a store.",
            ),
            generated_blocks_queued: c(
                "kvtier_worker_generated_blocks_queued_total",
                "Full blocks of generated tokens queued for storing at the end of their \
                 sequence (an agent's next prompt repeats the answer).",
            ),
            batched_decode_steps: c(
                "kvtier_worker_batched_decode_steps_total",
                "Decode forwards that advanced several sequences at once.",
            ),
            batched_decode_tokens: c(
                "kvtier_worker_batched_decode_tokens_total",
                "Tokens decoded in batched forwards (divide by the steps for the mean batch).",
            ),
            store_failures: c(
                "kvtier_worker_store_failures_total",
                "Store jobs the sidecar did not complete.",
            ),
            stores_refused: c(
                "kvtier_worker_stores_refused_total",
                "Store jobs the sidecar refused in whole or in part (busy, backlog, no slot, \
                 orphan): those blocks are not cached.",
            ),
            retain_hints_accepted: c(
                "kvtier_worker_retain_hints_accepted_total",
                "Retention hints (kvtier_retain_s) the sidecar accepted.",
            ),
            retain_hints_refused: c(
                "kvtier_worker_retain_hints_refused_total",
                "Retention hints the sidecar refused (a budget, too far, nothing cached) or \
                 that failed.",
            ),
            prompt_tokens_local_hit: c(
                "kvtier_worker_prompt_tokens_local_hit_total",
                "Prompt tokens whose KV was found in the worker's own prefix cache.",
            ),
            loads_skipped_cost: c(
                "kvtier_worker_loads_skipped_cost_total",
                "Cached prefixes not loaded because recomputing was estimated faster.",
            ),
            running: gauge(
                &r,
                "kvtier_worker_running_sequences",
                "Sequences in the running batch.",
            ),
            peak_running: gauge(
                &r,
                "kvtier_worker_peak_running_sequences",
                "Most sequences that ran at once.",
            ),
            cache_fallbacks: LabelledCounter::new(
                &r,
                "kvtier_worker_cache_fallbacks_total",
                "reason",
                "Requests that recomputed (part of) a prefix because of the cache, by reason.",
            ),
            requests: LabelledCounter::new(
                &r,
                "kvtier_worker_requests_total",
                "status",
                "Finished requests by outcome.",
            ),
            registry: r,
        }
    }
}

pub(crate) fn add(c: &IntCounter, n: u64) {
    c.inc_by(n);
}

impl Metrics {
    /// The registry every metric of this worker is in.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Prometheus text exposition (format 0.0.4, [`CONTENT_TYPE`]) of the registry.
    pub fn render(&self) -> String {
        let mut out = Vec::with_capacity(8 << 10);
        // Encoding into a Vec fails only for a malformed family, which `gather` never returns.
        if let Err(e) = prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!("encoding metrics: {e}");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// The disaggregation metrics of a prefill or decode worker, in the worker's registry. The
/// role's own statistics ([`crate::disagg::DecodeStats`], [`crate::disagg::PrefillStats`]) are
/// copied in at each scrape ([`DisaggMetrics::set`]).
pub struct DisaggMetrics {
    decode: Option<DecodeFamilies>,
    prefill: Option<PrefillFamilies>,
}

struct DecodeFamilies {
    /// From the call to the remote prefill to its logits, per remote prefill.
    remote_prefill: Histogram,
    /// Prompt tokens the prefill worker computed.
    remote_tokens: IntCounter,
    /// Prompt tokens prefilled here (fallbacks and short prompts).
    local_tokens: IntCounter,
    /// KV bytes the prefill worker wrote into this pool.
    remote_bytes: IntCounter,
    /// How prompts were prefilled (label `path`), from [`crate::disagg::DecodeStats`].
    prefills: IntCounterVec,
    quarantined_blocks: IntCounter,
    stray_notifications: IntCounter,
}

struct PrefillFamilies {
    served: IntCounter,
    rejected: IntCounter,
    failed: IntCounter,
    sent_bytes: IntCounter,
}

/// Sets counter `c` to `v` (the statistics it mirrors only grow).
fn set_counter(c: &IntCounter, v: u64) {
    c.inc_by(v.saturating_sub(c.get()));
}

impl DisaggMetrics {
    /// The families of a decode worker (`decode`) and of a prefill worker (`prefill`), in
    /// `r`.
    pub fn new(r: &Registry, decode: bool, prefill: bool) -> Self {
        let c = |name, help| counter(r, name, help);
        let decode = decode.then(|| DecodeFamilies {
            remote_prefill: Histogram::new(
                r,
                "kvtier_worker_disagg_remote_prefill_seconds",
                "Decode role: time from asking the prefill worker to the prompt's last logits.",
                LATENCY_BUCKETS_S,
            ),
            remote_tokens: c(
                "kvtier_worker_disagg_remote_prompt_tokens_total",
                "Decode role: prompt tokens computed by the prefill worker.",
            ),
            local_tokens: c(
                "kvtier_worker_disagg_local_prompt_tokens_total",
                "Decode role: prompt tokens prefilled locally (fallbacks, short prompts).",
            ),
            remote_bytes: c(
                "kvtier_worker_disagg_received_bytes_total",
                "Decode role: KV bytes the prefill worker wrote into this pool.",
            ),
            prefills: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_worker_disagg_prefills_total",
                        "Decode role: prompts by how they were prefilled (remote, fallback = \
                         locally after the remote path failed, short = too short to send).",
                    ),
                    &["path"],
                )
                .expect("fixed metric names and labels"),
            ),
            quarantined_blocks: c(
                "kvtier_worker_disagg_quarantined_blocks_total",
                "Decode role: blocks kept out of the pool for a while after a failure.",
            ),
            stray_notifications: c(
                "kvtier_worker_disagg_stray_notifications_total",
                "Decode role: transfer notifications for no request in flight.",
            ),
        });
        let prefill = prefill.then(|| PrefillFamilies {
            served: c(
                "kvtier_worker_disagg_prefill_served_total",
                "Prefill role: requests whose every layer was written.",
            ),
            rejected: c(
                "kvtier_worker_disagg_prefill_rejected_total",
                "Prefill role: malformed requests (answered 400).",
            ),
            failed: c(
                "kvtier_worker_disagg_prefill_failed_total",
                "Prefill role: requests that failed after validation.",
            ),
            sent_bytes: c(
                "kvtier_worker_disagg_sent_bytes_total",
                "Prefill role: KV bytes written to decode workers.",
            ),
        });
        Self { decode, prefill }
    }

    /// Decode role: a remote prefill of `tokens` tokens that wrote `bytes` took `took`.
    pub fn observe_remote(&self, took: Duration, tokens: usize, bytes: u64) {
        if let Some(d) = &self.decode {
            d.remote_prefill.observe(took);
            add(&d.remote_tokens, tokens as u64);
            add(&d.remote_bytes, bytes);
        }
    }

    /// Decode role: `tokens` prompt tokens prefilled here.
    pub fn observe_local(&self, tokens: usize) {
        if let Some(d) = &self.decode {
            add(&d.local_tokens, tokens as u64);
        }
    }

    /// Copies in the decode role's statistics (with `decode`) and the prefill role's (with
    /// `prefill`); call before rendering the registry.
    pub fn set(
        &self,
        decode: Option<crate::disagg::DecodeStats>,
        prefill: Option<crate::disagg::PrefillStats>,
    ) {
        if let (Some(f), Some(d)) = (&self.decode, decode) {
            for (path, v) in [
                ("remote", d.remote),
                ("fallback", d.fallbacks),
                ("short", d.short),
            ] {
                set_counter(&f.prefills.with_label_values(&[path]), v);
            }
            set_counter(&f.quarantined_blocks, d.quarantined_blocks);
            set_counter(&f.stray_notifications, d.stray_notifications);
        }
        if let (Some(f), Some(p)) = (&self.prefill, prefill) {
            set_counter(&f.served, p.served);
            set_counter(&f.rejected, p.rejected);
            set_counter(&f.failed, p.failed);
            set_counter(&f.sent_bytes, p.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let r = Registry::new();
        let h = Histogram::new(&r, "x", "help", &[0.01, 0.1]);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_secs(1));
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&r.gather(), &mut out)
            .unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains("x_bucket{le=\"0.01\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"0.1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
        assert!(s.contains("x_sum 1.055\n"), "{s}");
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn labelled_counters_render_each_label() {
        let m = Metrics::default();
        m.cache_fallbacks.inc("timeout");
        m.cache_fallbacks.inc("timeout");
        m.requests.inc("ok");
        let s = m.render();
        assert!(s.contains("kvtier_worker_cache_fallbacks_total{reason=\"timeout\"} 2\n"));
        assert!(s.contains("kvtier_worker_requests_total{status=\"ok\"} 1\n"));
        assert_eq!(m.cache_fallbacks.get("timeout"), 2);
    }

    #[test]
    fn both_roles_families_share_the_registry_and_follow_the_stats() {
        let m = Metrics::default();
        let d = DisaggMetrics::new(m.registry(), true, true);
        d.observe_remote(Duration::from_millis(3), 40, 4096);
        let decode = |remote| crate::disagg::DecodeStats {
            remote,
            fallbacks: 1,
            ..Default::default()
        };
        let prefill = crate::disagg::PrefillStats {
            served: 2,
            bytes: 10,
            ..Default::default()
        };
        d.set(Some(decode(1)), Some(prefill));
        d.set(Some(decode(3)), None);
        let s = m.render();
        for line in [
            "kvtier_worker_disagg_prefills_total{path=\"remote\"} 3\n",
            "kvtier_worker_disagg_prefills_total{path=\"fallback\"} 1\n",
            "kvtier_worker_disagg_remote_prompt_tokens_total 40\n",
            "kvtier_worker_disagg_received_bytes_total 4096\n",
            "kvtier_worker_disagg_prefill_served_total 2\n",
            "kvtier_worker_disagg_sent_bytes_total 10\n",
            "kvtier_worker_disagg_remote_prefill_seconds_count 1\n",
            "kvtier_worker_ttft_seconds_count 0\n",
        ] {
            assert!(s.contains(line), "no {line:?} in\n{s}");
        }
    }
}

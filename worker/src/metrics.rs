//! The worker's metrics, rendered as Prometheus text on `GET /metrics`. Counters and
//! histograms are atomics (no lock on the request path); the two labelled families (cache
//! fallbacks by reason, requests by status) take a short lock on a small map.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A histogram with fixed upper bounds (seconds), as Prometheus renders it.
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, plus the `+Inf` bucket; not cumulative (summed when rendered).
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

/// Latency buckets, seconds: 1 ms .. 60 s.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Inter-token buckets, seconds: 0.5 ms .. 5 s.
pub const INTER_TOKEN_BUCKETS_S: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cum}");
    }
}

/// A counter family with one label.
#[derive(Default)]
pub struct LabelledCounter {
    values: Mutex<BTreeMap<&'static str, u64>>,
}

impl LabelledCounter {
    pub fn inc(&self, label: &'static str) {
        *self
            .values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(label)
            .or_default() += 1;
    }

    pub fn get(&self, label: &str) -> u64 {
        self.values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(label)
            .copied()
            .unwrap_or(0)
    }

    fn render(&self, out: &mut String, name: &str, label: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (k, v) in self.values.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "{name}{{{label}=\"{k}\"}} {v}");
        }
    }
}

/// Every metric of one worker.
pub struct Metrics {
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    /// Time to bring a cached prefix into the pool (sidecar calls + copies).
    pub load_time: Histogram,
    pub prompt_tokens_cached: AtomicU64,
    pub prompt_tokens_computed: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub blocks_loaded: AtomicU64,
    pub stores_queued: AtomicU64,
    pub stores_dropped: AtomicU64,
    pub blocks_stored: AtomicU64,
    /// Blocks that hold generated tokens, queued for storing when their sequence ended.
    pub generated_blocks_queued: AtomicU64,
    /// Batched decode forwards (several sequences' next tokens in one) and the tokens in them.
    pub batched_decode_steps: AtomicU64,
    pub batched_decode_tokens: AtomicU64,
    pub store_failures: AtomicU64,
    /// Store jobs the sidecar refused in whole or in part (busy, backlog, no slot, orphan).
    pub stores_refused: AtomicU64,
    /// Prompt tokens whose KV was found in the worker's own prefix cache (in its pool).
    pub prompt_tokens_local_hit: AtomicU64,
    /// Loads skipped because the cost model said recomputing is faster.
    pub loads_skipped_cost: AtomicU64,
    /// Sequences running in the scheduler now, and the most at once since start.
    pub running: AtomicU64,
    pub peak_running: AtomicU64,
    /// Why a cached prefix was not used (requests recomputed it): `unavailable`, `timeout`,
    /// `disconnected`, `corrupt`, `io_error`, `busy`, `refused`, `lease_expired`, ...
    pub cache_fallbacks: LabelledCounter,
    /// Finished requests by HTTP status class of their outcome: `ok`, `bad_request`,
    /// `not_found`, `busy`, `too_large`, `error`, `cancelled`.
    pub requests: LabelledCounter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(LATENCY_BUCKETS_S),
            inter_token: Histogram::new(INTER_TOKEN_BUCKETS_S),
            e2e: Histogram::new(LATENCY_BUCKETS_S),
            load_time: Histogram::new(LATENCY_BUCKETS_S),
            prompt_tokens_cached: AtomicU64::new(0),
            prompt_tokens_computed: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            bytes_loaded: AtomicU64::new(0),
            blocks_loaded: AtomicU64::new(0),
            stores_queued: AtomicU64::new(0),
            stores_dropped: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            generated_blocks_queued: AtomicU64::new(0),
            batched_decode_steps: AtomicU64::new(0),
            batched_decode_tokens: AtomicU64::new(0),
            store_failures: AtomicU64::new(0),
            stores_refused: AtomicU64::new(0),
            prompt_tokens_local_hit: AtomicU64::new(0),
            loads_skipped_cost: AtomicU64::new(0),
            running: AtomicU64::new(0),
            peak_running: AtomicU64::new(0),
            cache_fallbacks: LabelledCounter::default(),
            requests: LabelledCounter::default(),
        }
    }
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Metrics {
    /// Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        self.ttft.render(
            &mut out,
            "kvtier_worker_ttft_seconds",
            "Time from request arrival to the first generated token.",
        );
        self.inter_token.render(
            &mut out,
            "kvtier_worker_inter_token_seconds",
            "Time between consecutive generated tokens of one request.",
        );
        self.e2e.render(
            &mut out,
            "kvtier_worker_e2e_seconds",
            "Time from request arrival to its last token.",
        );
        self.load_time.render(
            &mut out,
            "kvtier_worker_prefix_load_seconds",
            "Time to load a cached prefix from kvtier into the KV pool.",
        );
        let counters: [(&str, &AtomicU64, &str); 15] = [
            (
                "kvtier_worker_prompt_tokens_cached_total",
                &self.prompt_tokens_cached,
                "Prompt tokens not recomputed: KV loaded from kvtier or found in the worker's \
                 own prefix cache.",
            ),
            (
                "kvtier_worker_prompt_tokens_computed_total",
                &self.prompt_tokens_computed,
                "Prompt tokens computed by prefill.",
            ),
            (
                "kvtier_worker_generated_tokens_total",
                &self.generated_tokens,
                "Tokens generated.",
            ),
            (
                "kvtier_worker_bytes_loaded_total",
                &self.bytes_loaded,
                "KV bytes loaded from kvtier.",
            ),
            (
                "kvtier_worker_blocks_loaded_total",
                &self.blocks_loaded,
                "KV blocks loaded from kvtier.",
            ),
            (
                "kvtier_worker_stores_queued_total",
                &self.stores_queued,
                "Store jobs (one per request) queued for the sidecar.",
            ),
            (
                "kvtier_worker_stores_dropped_total",
                &self.stores_dropped,
                "Store jobs dropped because the store queue was full.",
            ),
            (
                "kvtier_worker_blocks_stored_total",
                &self.blocks_stored,
                "Blocks the sidecar reports cached after a store.",
            ),
            (
                "kvtier_worker_generated_blocks_queued_total",
                &self.generated_blocks_queued,
                "Full blocks of generated tokens queued for storing at the end of their \
                 sequence (an agent's next prompt repeats the answer).",
            ),
            (
                "kvtier_worker_batched_decode_steps_total",
                &self.batched_decode_steps,
                "Decode forwards that advanced several sequences at once.",
            ),
            (
                "kvtier_worker_batched_decode_tokens_total",
                &self.batched_decode_tokens,
                "Tokens decoded in batched forwards (divide by the steps for the mean batch).",
            ),
            (
                "kvtier_worker_store_failures_total",
                &self.store_failures,
                "Store jobs the sidecar did not complete.",
            ),
            (
                "kvtier_worker_stores_refused_total",
                &self.stores_refused,
                "Store jobs the sidecar refused in whole or in part (busy, backlog, no slot, \
                 orphan): those blocks are not cached.",
            ),
            (
                "kvtier_worker_prompt_tokens_local_hit_total",
                &self.prompt_tokens_local_hit,
                "Prompt tokens whose KV was found in the worker's own prefix cache.",
            ),
            (
                "kvtier_worker_loads_skipped_cost_total",
                &self.loads_skipped_cost,
                "Cached prefixes not loaded because recomputing was estimated faster.",
            ),
        ];
        for (name, c, help) in counters {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", c.load(Ordering::Relaxed));
        }
        for (name, g, help) in [
            (
                "kvtier_worker_running_sequences",
                &self.running,
                "Sequences in the running batch.",
            ),
            (
                "kvtier_worker_peak_running_sequences",
                &self.peak_running,
                "Most sequences that ran at once.",
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {}", g.load(Ordering::Relaxed));
        }
        self.cache_fallbacks.render(
            &mut out,
            "kvtier_worker_cache_fallbacks_total",
            "reason",
            "Requests that recomputed (part of) a prefix because of the cache, by reason.",
        );
        self.requests.render(
            &mut out,
            "kvtier_worker_requests_total",
            "status",
            "Finished requests by outcome.",
        );
        out
    }
}

/// The disaggregation metrics of a prefill or decode worker, rendered after [`Metrics`].
pub struct DisaggMetrics {
    /// Decode role: from the call to the remote prefill to its logits, per remote prefill.
    pub remote_prefill: Histogram,
    /// Decode role: prompt tokens the prefill worker computed.
    pub remote_tokens: AtomicU64,
    /// Decode role: KV bytes the prefill worker wrote into this pool.
    pub remote_bytes: AtomicU64,
    /// Decode role: prompt tokens prefilled here (fallbacks and short prompts).
    pub local_tokens: AtomicU64,
}

impl Default for DisaggMetrics {
    fn default() -> Self {
        Self {
            remote_prefill: Histogram::new(LATENCY_BUCKETS_S),
            remote_tokens: AtomicU64::new(0),
            remote_bytes: AtomicU64::new(0),
            local_tokens: AtomicU64::new(0),
        }
    }
}

impl DisaggMetrics {
    pub fn observe_remote(&self, took: Duration, tokens: usize, bytes: u64) {
        self.remote_prefill.observe(took);
        add(&self.remote_tokens, tokens as u64);
        add(&self.remote_bytes, bytes);
    }

    pub fn observe_local(&self, tokens: usize) {
        add(&self.local_tokens, tokens as u64);
    }

    /// Appends the decode role's metrics (with `decode`) and the prefill role's (with
    /// `prefill`).
    pub fn render(
        &self,
        out: &mut String,
        decode: Option<crate::disagg::DecodeStats>,
        prefill: Option<crate::disagg::PrefillStats>,
    ) {
        let counter = |out: &mut String, name: &str, v: u64, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {v}");
        };
        if let Some(d) = decode {
            self.remote_prefill.render(
                out,
                "kvtier_worker_disagg_remote_prefill_seconds",
                "Decode role: time from asking the prefill worker to the prompt's last logits.",
            );
            let _ = writeln!(
                out,
                "# HELP kvtier_worker_disagg_prefills_total Decode role: prompts by how they \
                 were prefilled (remote, fallback = locally after the remote path failed, \
                 short = too short to send)."
            );
            let _ = writeln!(out, "# TYPE kvtier_worker_disagg_prefills_total counter");
            for (path, v) in [
                ("remote", d.remote),
                ("fallback", d.fallbacks),
                ("short", d.short),
            ] {
                let _ = writeln!(
                    out,
                    "kvtier_worker_disagg_prefills_total{{path=\"{path}\"}} {v}"
                );
            }
            for (name, v, help) in [
                (
                    "kvtier_worker_disagg_remote_prompt_tokens_total",
                    self.remote_tokens.load(Ordering::Relaxed),
                    "Decode role: prompt tokens computed by the prefill worker.",
                ),
                (
                    "kvtier_worker_disagg_local_prompt_tokens_total",
                    self.local_tokens.load(Ordering::Relaxed),
                    "Decode role: prompt tokens prefilled locally (fallbacks, short prompts).",
                ),
                (
                    "kvtier_worker_disagg_received_bytes_total",
                    self.remote_bytes.load(Ordering::Relaxed),
                    "Decode role: KV bytes the prefill worker wrote into this pool.",
                ),
                (
                    "kvtier_worker_disagg_quarantined_blocks_total",
                    d.quarantined_blocks,
                    "Decode role: blocks kept out of the pool for a while after a failure.",
                ),
                (
                    "kvtier_worker_disagg_stray_notifications_total",
                    d.stray_notifications,
                    "Decode role: transfer notifications for no request in flight.",
                ),
            ] {
                counter(out, name, v, help);
            }
        }
        if let Some(p) = prefill {
            for (name, v, help) in [
                (
                    "kvtier_worker_disagg_prefill_served_total",
                    p.served,
                    "Prefill role: requests whose every layer was written.",
                ),
                (
                    "kvtier_worker_disagg_prefill_rejected_total",
                    p.rejected,
                    "Prefill role: malformed requests (answered 400).",
                ),
                (
                    "kvtier_worker_disagg_prefill_failed_total",
                    p.failed,
                    "Prefill role: requests that failed after validation.",
                ),
                (
                    "kvtier_worker_disagg_sent_bytes_total",
                    p.bytes,
                    "Prefill role: KV bytes written to decode workers.",
                ),
            ] {
                counter(out, name, v, help);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.01, 0.1]);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_secs(1));
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.01\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"0.1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
        assert!(s.contains("x_sum 1.055\n"), "{s}");
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
}

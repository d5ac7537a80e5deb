//! Server metrics in one Prometheus registry (the `prometheus` crate): counters, gauges and
//! fixed-bucket latency histograms updated on the request path without a lock, and the store's
//! per-tier statistics copied in from a [`StoreStats`] snapshot at each scrape. Rendered in the
//! Prometheus text format (version 0.0.4, [`CONTENT_TYPE`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvtier_core::protocol::Opcode;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::cluster::ClusterMetrics;
use crate::policy::admission::RejectReason;
use crate::{RetainStats, StoreStats, TierStats};

/// A refused put is logged at most once per this interval (with the count since the last).
pub const REFUSED_PUT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The reasons a put is refused, as the `reason` label of `kvtier_puts_refused_total` names
/// them (in the order of [`refusal_idx`]).
pub const REFUSAL_REASONS: [&str; 3] = ["backlog", "no_slot", "orphan"];

fn refusal_idx(r: RejectReason) -> usize {
    match r {
        RejectReason::Backlog => 0,
        RejectReason::NoEvictableSlot => 1,
        RejectReason::OrphanBlock => 2,
    }
}

/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 10_000_000,
];

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The transports a connection can arrive on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Unix,
    Tcp,
    Quic,
    /// TLS over TCP (`server.tls`).
    Tls,
}

impl Transport {
    pub const ALL: [Transport; 4] = [
        Transport::Unix,
        Transport::Tcp,
        Transport::Quic,
        Transport::Tls,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Transport::Unix => "unix",
            Transport::Tcp => "tcp",
            Transport::Quic => "quic",
            Transport::Tls => "tls",
        }
    }
    fn idx(self) -> usize {
        self as usize
    }
}

/// Every metric of one server. The request path holds the label children directly (no
/// lookup by label, no lock).
pub struct Metrics {
    registry: Registry,
    connections_open: [IntGauge; 4],
    connections_total: [IntCounter; 4],
    pub connections_refused: IntCounter,
    refusals: [IntCounter; 4],
    /// Requests cut short or refused at a per-connection or per-tenant share.
    share_refusals: [IntCounter; 5],
    pub auth_failures: IntCounter,
    pub auth_throttled: IntCounter,
    /// TLS handshakes on the `server.tls` port that failed or timed out.
    pub tls_handshake_failures: IntCounter,
    /// Batches published on `events.zmq` (vLLM's KV-events format).
    pub zmq_batches: IntCounter,
    /// Block events the `events.zmq` publisher fell behind on and skipped.
    pub zmq_events_lost: IntCounter,
    /// Network (TCP, TLS, QUIC) connections before their hello (set at each scrape).
    pub pre_hello: IntGauge,
    requests: Vec<IntCounter>,
    latency: Vec<Histogram>,
    pub errors: IntCounter,
    pub busy: IntCounter,
    pub bad_frames: IntCounter,
    pub timeouts: IntCounter,
    pub bytes_sent: IntCounter,
    pub bytes_received: IntCounter,
    pub leases_open: IntGauge,
    pub reservations_open: IntGauge,
    pub events_dropped: IntCounter,
    pub pending_waits: IntCounter,
    pub pending_wait_expired: IntCounter,
    puts_refused: [IntCounter; 3],
    /// (last warning, refusals since it) for the rate-limited warning.
    refused_log: Mutex<(Option<Instant>, u64)>,
    ready: IntGauge,
    /// Membership on etcd (zero and `kvtier_cluster_enabled 0` without `[cluster]`).
    pub cluster: ClusterMetrics,
    /// The store's families, set from a snapshot under this lock at each scrape (so two
    /// scrapes never interleave their reset-and-set).
    store: Mutex<StoreMetrics>,
}

/// The opcode's place in `Opcode::ALL` (codes are not contiguous: retain is 20).
fn op_idx(op: Opcode) -> usize {
    // Every opcode is in ALL by construction of the wire enum.
    Opcode::ALL.iter().position(|&o| o == op).unwrap_or(0)
}

/// Registers `m` in `r`. Only fails for a name or label that is invalid or registered twice,
/// which the fixed names below never are (a unit test renders them all).
fn reg<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: M) -> M {
    r.register(Box::new(m.clone()))
        .expect("metric names are fixed, valid and unique");
    m
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    reg(
        r,
        IntCounter::new(name, help).expect("valid metric name and help"),
    )
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    reg(
        r,
        IntGauge::new(name, help).expect("valid metric name and help"),
    )
}

fn counter_vec(r: &Registry, name: &str, help: &str, label: &str) -> IntCounterVec {
    reg(
        r,
        IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric name and label"),
    )
}

fn gauge_vec(r: &Registry, name: &str, help: &str, label: &str) -> IntGaugeVec {
    reg(
        r,
        IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric name and label"),
    )
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts a connection refused at accept.
    pub(crate) fn connection_refused(&self, why: super::Refusal) {
        self.connections_refused.inc();
        self.refusals[why as usize].inc();
    }

    /// Counts a request cut short or refused at a share.
    pub(crate) fn share_refused(&self, kind: super::shares::ShareKind) {
        self.share_refusals[kind as usize].inc();
    }

    pub fn new() -> Self {
        let r = Registry::new();
        let ready = gauge(&r, "kvtier_ready", "1 when the server accepts requests.");
        let open = gauge_vec(
            &r,
            "kvtier_connections",
            "Open client connections.",
            "transport",
        );
        let total = counter_vec(
            &r,
            "kvtier_connections_total",
            "Connections accepted.",
            "transport",
        );
        let connections_open = Transport::ALL.map(|t| open.with_label_values(&[t.name()]));
        let connections_total = Transport::ALL.map(|t| total.with_label_values(&[t.name()]));
        let requests = counter_vec(
            &r,
            "kvtier_requests_total",
            "Requests served, by operation.",
            "op",
        );
        let latency = reg(
            &r,
            HistogramVec::new(
                HistogramOpts::new(
                    "kvtier_request_duration_seconds",
                    "Request latency from the whole frame read to the response queued, by \
                     operation.",
                )
                .buckets(
                    LATENCY_BUCKETS_US
                        .iter()
                        .map(|us| *us as f64 / 1e6)
                        .collect(),
                ),
                &["op"],
            )
            .expect("valid histogram"),
        );
        // Indexed by op_idx: the opcode's place in Opcode::ALL.
        let requests = Opcode::ALL
            .iter()
            .map(|op| requests.with_label_values(&[op.name()]))
            .collect();
        let latency = Opcode::ALL
            .iter()
            .map(|op| latency.with_label_values(&[op.name()]))
            .collect();
        let refused = counter_vec(
            &r,
            "kvtier_puts_refused_total",
            "Blocks of puts (and reservations) refused, by reason.",
            "reason",
        );
        let puts_refused = REFUSAL_REASONS.map(|n| refused.with_label_values(&[n]));
        let refusals = counter_vec(
            &r,
            "kvtier_connection_refusals_total",
            "Connections refused at accept, by reason (max_connections, pre_hello: too many \
             waiting for their hello, no_fds: out of file descriptors, admin: the admin port's \
             cap).",
            "reason",
        );
        let refusals = super::Refusal::ALL.map(|w| refusals.with_label_values(&[w.name()]));
        let shares = counter_vec(
            &r,
            "kvtier_share_refusals_total",
            "Requests cut short or refused for passing a share, by share (pins_connection, \
             pins_tenant: DRAM blocks a connection's or a tenant's pins hold; send_tenant: a \
             tenant's part of the send budget; connections_tenant: a tenant's connections; \
             connections_uid: a Unix socket uid's connections).",
            "share",
        );
        let share_refusals =
            super::shares::ShareKind::ALL.map(|k| shares.with_label_values(&[k.name()]));
        let store = StoreMetrics::new(&r);
        Self {
            refusals,
            share_refusals,
            pre_hello: gauge(
                &r,
                "kvtier_connections_pre_hello",
                "Network (TCP, TLS, QUIC) connections that have not completed their hello.",
            ),
            zmq_batches: counter(
                &r,
                "kvtier_zmq_event_batches_total",
                "Batches of block events published on events.zmq, in vLLM's KV-events format.",
            ),
            zmq_events_lost: counter(
                &r,
                "kvtier_zmq_events_lost_total",
                "Block events the events.zmq publisher fell behind on and skipped (its \
                 subscribers see a gap in the batches' sequence numbers).",
            ),
            tls_handshake_failures: counter(
                &r,
                "kvtier_tls_handshake_failures_total",
                "TLS handshakes on the TLS port that failed or did not finish within \
                 limits.hello_timeout_ms (a plaintext client, a client that does not trust \
                 the certificate, a stalled peer).",
            ),
            auth_throttled: counter(
                &r,
                "kvtier_auth_throttled_total",
                "Hellos refused without a look at their token: their peer failed too often.",
            ),
            pending_waits: counter(
                &r,
                "kvtier_pending_waits_total",
                "Lookups, gets and pins that waited for blocks still being stored.",
            ),
            pending_wait_expired: counter(
                &r,
                "kvtier_pending_wait_expired_total",
                "Waits for blocks being stored that ended at their bound, uncommitted.",
            ),
            puts_refused,
            refused_log: Mutex::new((None, 0)),
            connections_open,
            connections_total,
            connections_refused: counter(
                &r,
                "kvtier_connections_refused_total",
                "Connections refused at accept, whatever the reason.",
            ),
            auth_failures: counter(
                &r,
                "kvtier_auth_failures_total",
                "Hellos refused for a missing or wrong credential (token, client certificate, or \
                 a Unix peer's uid mapped to no tenant).",
            ),
            requests,
            latency,
            errors: counter(
                &r,
                "kvtier_request_errors_total",
                "Requests answered with an error.",
            ),
            busy: counter(
                &r,
                "kvtier_busy_total",
                "Requests answered busy (over budget).",
            ),
            bad_frames: counter(&r, "kvtier_bad_frames_total", "Malformed frames received."),
            timeouts: counter(
                &r,
                "kvtier_timeouts_total",
                "Connections closed for a slow frame or write.",
            ),
            bytes_sent: counter(&r, "kvtier_bytes_sent_total", "Block payload bytes sent."),
            bytes_received: counter(
                &r,
                "kvtier_bytes_received_total",
                "Block payload bytes received.",
            ),
            leases_open: gauge(&r, "kvtier_leases_open", "Pin leases held by clients."),
            reservations_open: gauge(
                &r,
                "kvtier_reservations_open",
                "Put reservations held by local clients.",
            ),
            events_dropped: counter(
                &r,
                "kvtier_events_dropped_total",
                "Events a slow subscriber missed.",
            ),
            ready,
            cluster: ClusterMetrics::register(&r)
                .expect("cluster metric names are fixed, valid and unique"),
            store: Mutex::new(store),
            registry: r,
        }
    }

    pub fn connection_opened(&self, t: Transport) {
        self.connections_open[t.idx()].inc();
        self.connections_total[t.idx()].inc();
    }
    pub fn connection_closed(&self, t: Transport) {
        self.connections_open[t.idx()].dec();
    }
    pub fn open_connections(&self) -> u64 {
        self.connections_open
            .iter()
            .map(|c| c.get().max(0) as u64)
            .sum()
    }
    pub fn request_done(&self, op: Opcode, took: Duration) {
        self.requests[op_idx(op)].inc();
        self.latency[op_idx(op)].observe(took.as_secs_f64());
    }
    /// Counts a block refused for `why` (of a put from `transport`), and warns at most once
    /// per [`REFUSED_PUT_LOG_INTERVAL`] with the number refused since the last warning.
    pub fn put_refused(&self, why: RejectReason, transport: Transport) {
        self.puts_refused[refusal_idx(why)].inc();
        let mut g = self.refused_log.lock().unwrap_or_else(|p| p.into_inner());
        g.1 += 1;
        let now = Instant::now();
        if g.0
            .is_none_or(|t| now.duration_since(t) >= REFUSED_PUT_LOG_INTERVAL)
        {
            tracing::warn!(
                reason = REFUSAL_REASONS[refusal_idx(why)],
                transport = transport.name(),
                refused_since_last_warning = g.1,
                "put refused (see kvtier_puts_refused_total)"
            );
            *g = (Some(now), 0);
        }
    }

    /// Blocks refused for `why` so far.
    pub fn puts_refused(&self, why: RejectReason) -> u64 {
        self.puts_refused[refusal_idx(why)].get()
    }

    /// Counts one.
    pub fn inc(c: &IntCounter) {
        c.inc();
    }

    /// The Prometheus text exposition of these metrics and `store`.
    pub fn render(&self, store: &StoreStats, ready: bool) -> String {
        self.ready.set(i64::from(ready));
        let s = self.store.lock().unwrap_or_else(|p| p.into_inner());
        s.set(store);
        let families = self.registry.gather();
        drop(s);
        let mut out = Vec::with_capacity(16 << 10);
        // Encoding into a Vec fails only for a family that is malformed, which `gather`
        // never returns.
        if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
            tracing::warn!("encoding metrics: {e}");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

type Field = fn(&TierStats) -> u64;

/// The per-tier families (label `tier`, one series per tier the store holds) and the index
/// size.
struct StoreMetrics {
    counters: Vec<(IntCounterVec, Field)>,
    gauges: Vec<(IntGaugeVec, Field)>,
    blocks: IntGauge,
    /// Retention hints by outcome (label `outcome`), the blocks they protected, and now.
    retain_hints: IntCounterVec,
    retain_blocks: IntCounter,
    retain_live: IntGauge,
    retain_protected: IntGauge,
}

type RetainField = fn(&RetainStats) -> u64;

/// The outcomes of `kvtier_retain_hints_total`.
const RETAIN_OUTCOMES: [(&str, RetainField); 9] = [
    ("accepted", |r| r.accepted),
    ("refused_namespace", |r| r.refused_namespace),
    ("refused_global", |r| r.refused_global),
    ("refused_too_far", |r| r.refused_too_far),
    ("nothing_cached", |r| r.nothing_cached),
    ("displaced", |r| r.displaced),
    ("replaced", |r| r.replaced),
    ("expired", |r| r.expired),
    ("honoured", |r| r.honoured),
];

impl StoreMetrics {
    fn new(r: &Registry) -> Self {
        let counters: [(&str, &str, Field); 12] = [
            ("kvtier_tier_hits_total", "Block hits.", |t| t.hits),
            ("kvtier_tier_misses_total", "Block misses.", |t| t.misses),
            (
                "kvtier_tier_bytes_in_total",
                "Bytes written into the tier.",
                |t| t.bytes_in,
            ),
            (
                "kvtier_tier_bytes_out_total",
                "Bytes read out of the tier.",
                |t| t.bytes_out,
            ),
            ("kvtier_tier_evictions_total", "Blocks evicted.", |t| {
                t.evictions
            }),
            (
                "kvtier_tier_demotions_total",
                "Blocks copied down a tier.",
                |t| t.demotions,
            ),
            (
                "kvtier_tier_demotions_dropped_total",
                "Copies down dropped under pressure.",
                |t| t.demotions_dropped,
            ),
            (
                "kvtier_tier_promotions_total",
                "Blocks copied up into the tier.",
                |t| t.promotions,
            ),
            (
                "kvtier_tier_admissions_refused_total",
                "New blocks refused.",
                |t| t.admissions_refused,
            ),
            (
                "kvtier_tier_corrupt_dropped_total",
                "Corrupt blocks dropped (served as misses).",
                |t| t.corrupt_dropped,
            ),
            ("kvtier_tier_io_errors_total", "I/O errors.", |t| {
                t.io_errors
            }),
            (
                "kvtier_tier_guest_evictions_total",
                "Guest copies (blocks another cluster member owns) evicted first.",
                |t| t.guest_evictions,
            ),
        ];
        let gauges: [(&str, &str, Field); 5] = [
            ("kvtier_tier_pins", "Pins outstanding.", |t| {
                t.pins_outstanding
            }),
            ("kvtier_tier_used_slots", "Slots holding a block.", |t| {
                t.used_slots
            }),
            ("kvtier_tier_capacity_slots", "Slots in the tier.", |t| {
                t.capacity_slots
            }),
            ("kvtier_tier_slot_bytes", "Bytes a slot.", |t| t.slot_bytes),
            (
                "kvtier_tier_guest_slots",
                "Slots holding a guest copy (a block another cluster member owns).",
                |t| t.guest_slots,
            ),
        ];
        Self {
            counters: counters
                .into_iter()
                .map(|(n, h, f)| (counter_vec(r, n, h, "tier"), f))
                .collect(),
            gauges: gauges
                .into_iter()
                .map(|(n, h, f)| (gauge_vec(r, n, h, "tier"), f))
                .collect(),
            blocks: gauge(r, "kvtier_blocks", "Blocks indexed."),
            retain_hints: counter_vec(
                r,
                "kvtier_retain_hints_total",
                "Retention hints by what became of them (accepted, refused by budget or as \
                 too far, nothing cached; then displaced, replaced, expired or honoured).",
                "outcome",
            ),
            retain_blocks: counter(
                r,
                "kvtier_retain_blocks_protected_total",
                "DRAM blocks accepted retention hints protected, summed over hints.",
            ),
            retain_live: gauge(r, "kvtier_retain_hints", "Retention hints live."),
            retain_protected: gauge(
                r,
                "kvtier_retain_protected_blocks",
                "Distinct DRAM blocks retention hints protect now.",
            ),
        }
    }

    /// Copies `s` in: one series per tier of `s.tiers`, whatever tiers the store holds.
    fn set(&self, s: &StoreStats) {
        for (v, _) in &self.counters {
            v.reset();
        }
        for (v, _) in &self.gauges {
            v.reset();
        }
        for t in &s.tiers {
            let Some(kind) = t.tier else { continue };
            let label = [kind.name()];
            for (v, f) in &self.counters {
                v.with_label_values(&label).inc_by(f(t));
            }
            for (v, f) in &self.gauges {
                v.with_label_values(&label)
                    .set(i64::try_from(f(t)).unwrap_or(i64::MAX));
            }
        }
        self.blocks.set(i64::try_from(s.blocks).unwrap_or(i64::MAX));
        self.retain_hints.reset();
        for (outcome, f) in RETAIN_OUTCOMES {
            self.retain_hints
                .with_label_values(&[outcome])
                .inc_by(f(&s.retain));
        }
        self.retain_blocks.reset();
        self.retain_blocks.inc_by(s.retain.blocks_protected);
        self.retain_live
            .set(i64::try_from(s.retain.hints).unwrap_or(i64::MAX));
        self.retain_protected
            .set(i64::try_from(s.retain.protected_blocks).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TierKind;

    #[test]
    fn histogram_buckets_are_cumulative_in_the_text() {
        let m = Metrics::default();
        m.request_done(Opcode::Get, Duration::from_micros(5));
        m.request_done(Opcode::Get, Duration::from_micros(30));
        m.request_done(Opcode::Get, Duration::from_secs(100));
        let text = m.render(&StoreStats::default(), true);
        assert!(
            text.contains("kvtier_request_duration_seconds_bucket{op=\"get\",le=\"0.00001\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_request_duration_seconds_bucket{op=\"get\",le=\"0.00005\"} 2")
        );
        assert!(text.contains("kvtier_request_duration_seconds_bucket{op=\"get\",le=\"+Inf\"} 3"));
        assert!(text.contains("kvtier_requests_total{op=\"get\"} 3"));
        assert!(text.contains("kvtier_ready 1"));
        assert!(text.contains("kvtier_connections{transport=\"quic\"} 0"));
    }

    #[test]
    fn every_tier_of_the_snapshot_is_rendered_with_its_values() {
        let m = Metrics::default();
        let tier = |kind, hits| TierStats {
            tier: Some(kind),
            hits,
            used_slots: hits * 2,
            ..TierStats::default()
        };
        let snap = |tiers| StoreStats {
            tiers,
            blocks: 9,
            ..StoreStats::default()
        };
        let all = snap(TierKind::ALL.iter().map(|k| tier(*k, 3)).collect());
        let text = m.render(&all, false);
        for k in TierKind::ALL {
            let n = k.name();
            assert!(
                text.contains(&format!("kvtier_tier_hits_total{{tier=\"{n}\"}} 3\n")),
                "{text}"
            );
            assert!(text.contains(&format!("kvtier_tier_used_slots{{tier=\"{n}\"}} 6\n")));
        }
        assert!(text.contains("kvtier_blocks 9\n") && text.contains("kvtier_ready 0\n"));
        // A second scrape shows the new snapshot, not a sum, and only the tiers it holds.
        let text = m.render(&snap(vec![tier(TierKind::Dram, 5)]), true);
        assert!(
            text.contains("kvtier_tier_hits_total{tier=\"dram\"} 5\n"),
            "{text}"
        );
        assert!(!text.contains("tier=\"nvme\""), "{text}");
    }
}

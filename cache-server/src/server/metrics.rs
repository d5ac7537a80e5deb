//! Server metrics: lock-free counters and fixed-bucket latency histograms, rendered in the
//! Prometheus text format together with the store's per-tier statistics.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvtier_core::protocol::Opcode;

use crate::{StoreStats, TierKind};

/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 10_000_000,
];

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = LATENCY_BUCKETS_US.partition_point(|b| *b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// The transports a connection can arrive on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Unix,
    Tcp,
    Quic,
}

impl Transport {
    pub const ALL: [Transport; 3] = [Transport::Unix, Transport::Tcp, Transport::Quic];
    pub fn name(self) -> &'static str {
        match self {
            Transport::Unix => "unix",
            Transport::Tcp => "tcp",
            Transport::Quic => "quic",
        }
    }
    fn idx(self) -> usize {
        self as usize
    }
}

#[derive(Default)]
pub struct Metrics {
    pub connections_open: [AtomicU64; 3],
    pub connections_total: [AtomicU64; 3],
    pub connections_refused: AtomicU64,
    pub auth_failures: AtomicU64,
    pub requests: [AtomicU64; Opcode::ALL.len()],
    pub latency: [Histogram; Opcode::ALL.len()],
    pub errors: AtomicU64,
    pub busy: AtomicU64,
    pub bad_frames: AtomicU64,
    pub timeouts: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub leases_open: AtomicU64,
    pub reservations_open: AtomicU64,
    pub events_dropped: AtomicU64,
}

fn op_idx(op: Opcode) -> usize {
    op as usize - 1
}

impl Metrics {
    pub fn connection_opened(&self, t: Transport) {
        self.connections_open[t.idx()].fetch_add(1, Ordering::Relaxed);
        self.connections_total[t.idx()].fetch_add(1, Ordering::Relaxed);
    }
    pub fn connection_closed(&self, t: Transport) {
        self.connections_open[t.idx()].fetch_sub(1, Ordering::Relaxed);
    }
    pub fn open_connections(&self) -> u64 {
        self.connections_open
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
    pub fn request_done(&self, op: Opcode, took: Duration) {
        self.requests[op_idx(op)].fetch_add(1, Ordering::Relaxed);
        self.latency[op_idx(op)].observe(took);
    }
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of these metrics and `store`.
    pub fn render(&self, store: &StoreStats, ready: bool) -> String {
        let mut o = String::with_capacity(16 << 10);
        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(
            &mut o,
            "kvtier_ready",
            "gauge",
            "1 when the server accepts requests.",
        );
        let _ = writeln!(o, "kvtier_ready {}", u8::from(ready));
        family(
            &mut o,
            "kvtier_connections",
            "gauge",
            "Open client connections.",
        );
        for t in Transport::ALL {
            let _ = writeln!(
                o,
                "kvtier_connections{{transport=\"{}\"}} {}",
                t.name(),
                ld(&self.connections_open[t.idx()])
            );
        }
        family(
            &mut o,
            "kvtier_connections_total",
            "counter",
            "Connections accepted.",
        );
        for t in Transport::ALL {
            let _ = writeln!(
                o,
                "kvtier_connections_total{{transport=\"{}\"}} {}",
                t.name(),
                ld(&self.connections_total[t.idx()])
            );
        }
        for (name, help, v) in [
            (
                "kvtier_connections_refused_total",
                "Connections refused over max_connections.",
                &self.connections_refused,
            ),
            (
                "kvtier_auth_failures_total",
                "Hellos refused for a missing or wrong token.",
                &self.auth_failures,
            ),
            (
                "kvtier_request_errors_total",
                "Requests answered with an error.",
                &self.errors,
            ),
            (
                "kvtier_busy_total",
                "Requests answered busy (over budget).",
                &self.busy,
            ),
            (
                "kvtier_bad_frames_total",
                "Malformed frames received.",
                &self.bad_frames,
            ),
            (
                "kvtier_timeouts_total",
                "Connections closed for a slow frame or write.",
                &self.timeouts,
            ),
            (
                "kvtier_bytes_sent_total",
                "Block payload bytes sent.",
                &self.bytes_sent,
            ),
            (
                "kvtier_bytes_received_total",
                "Block payload bytes received.",
                &self.bytes_received,
            ),
            (
                "kvtier_events_dropped_total",
                "Events a slow subscriber missed.",
                &self.events_dropped,
            ),
        ] {
            family(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {}", ld(v));
        }
        for (name, help, v) in [
            (
                "kvtier_leases_open",
                "Pin leases held by clients.",
                &self.leases_open,
            ),
            (
                "kvtier_reservations_open",
                "Put reservations held by local clients.",
                &self.reservations_open,
            ),
        ] {
            family(&mut o, name, "gauge", help);
            let _ = writeln!(o, "{name} {}", ld(v));
        }
        family(
            &mut o,
            "kvtier_requests_total",
            "counter",
            "Requests served, by operation.",
        );
        for &op in Opcode::ALL {
            let _ = writeln!(
                o,
                "kvtier_requests_total{{op=\"{}\"}} {}",
                op.name(),
                ld(&self.requests[op_idx(op)])
            );
        }
        family(
            &mut o,
            "kvtier_request_duration_seconds",
            "histogram",
            "Request latency from the whole frame read to the response queued, by operation.",
        );
        for &op in Opcode::ALL {
            let h = &self.latency[op_idx(op)];
            let mut cum = 0;
            for (i, b) in LATENCY_BUCKETS_US.iter().enumerate() {
                cum += ld(&h.buckets[i]);
                let _ = writeln!(
                    o,
                    "kvtier_request_duration_seconds_bucket{{op=\"{}\",le=\"{}\"}} {cum}",
                    op.name(),
                    *b as f64 / 1e6
                );
            }
            cum += ld(&h.buckets[LATENCY_BUCKETS_US.len()]);
            let _ = writeln!(
                o,
                "kvtier_request_duration_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {cum}",
                op.name()
            );
            let _ = writeln!(
                o,
                "kvtier_request_duration_seconds_sum{{op=\"{}\"}} {}",
                op.name(),
                ld(&h.sum_us) as f64 / 1e6
            );
            let _ = writeln!(
                o,
                "kvtier_request_duration_seconds_count{{op=\"{}\"}} {}",
                op.name(),
                ld(&h.count)
            );
        }
        render_store(&mut o, store);
        o
    }
}

fn render_store(o: &mut String, s: &StoreStats) {
    let tiers: Vec<_> = TierKind::ALL
        .into_iter()
        .filter_map(|t| Some((t.name(), s.tier(t)?)))
        .collect();
    type Field = fn(&crate::TierStats) -> u64;
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
        ("kvtier_tier_pins", "Pins outstanding (gauge).", |t| {
            t.pins_outstanding
        }),
    ];
    for (name, help, f) in counters {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (tn, t) in &tiers {
            let _ = writeln!(o, "{name}{{tier=\"{tn}\"}} {}", f(t));
        }
    }
    let gauges: [(&str, &str, Field); 3] = [
        ("kvtier_tier_used_slots", "Slots holding a block.", |t| {
            t.used_slots
        }),
        ("kvtier_tier_capacity_slots", "Slots in the tier.", |t| {
            t.capacity_slots
        }),
        ("kvtier_tier_slot_bytes", "Bytes a slot.", |t| t.slot_bytes),
    ];
    for (name, help, f) in gauges {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (tn, t) in &tiers {
            let _ = writeln!(o, "{name}{{tier=\"{tn}\"}} {}", f(t));
        }
    }
    let _ = writeln!(
        o,
        "# HELP kvtier_blocks Blocks indexed.\n# TYPE kvtier_blocks gauge\nkvtier_blocks {}",
        s.blocks
    );
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}

//! What each worker's answers show of its speed, measured by the router from the answers it
//! passes through: its prefill rate, the time of one decode step, and its load bandwidth from
//! each tier. Free of I/O and of the clock (callers pass durations): tested on constructed
//! samples.
//!
//! * **Prefill rate**: an answer's uncached prompt tokens (its prompt less the `cached_tokens`
//!   the worker reported) over its time to first byte less the load time the worker reported
//!   (`usage.kvtier.load_s`, when it reports a valid one), for answers sent while no other
//!   prompt the router had sent that worker was still in prefill (so the wait is the answer's
//!   own prefill, beside whatever was decoding), and with at least
//!   [`MIN_PREFILL_SAMPLE_TOKENS`] uncached tokens (below that the fixed costs of a request
//!   dominate).
//! * **Decode step**: a streamed answer's time from its first byte to its end over its
//!   `completion_tokens`, divided by the requests decoding on that worker when its first byte
//!   came (itself included): the worker runs its sequences a step each in turn
//!   (`kvtier_worker::scheduler`), so one token of one answer costs a round of every
//!   sequence's step.
//! * **Load bandwidth per tier** (HBM, DRAM, NVMe of the worker's kvtier server): the bytes a
//!   worker says it loaded over the time it says loading took, from the `usage.kvtier` object
//!   kvtier-worker puts in its answers (`docs/worker.md`; a worker that sends none, such as
//!   vLLM, leaves the configured bandwidths in place). The worker times one load for all the
//!   blocks of a prompt, so only an answer whose loaded blocks all came from one tier is a
//!   sample of that tier ([`LoadOutcome::Mixed`] otherwise), and only with at least
//!   [`MIN_LOAD_SAMPLE_BYTES`] (below that the fixed cost of the sidecar calls dominates). The
//!   report is outside input: a bandwidth that is not a positive finite number at most
//!   [`MAX_LOAD_BYTES_PER_S`] is [`LoadOutcome::Bad`], ignored and counted, never a sample.
//!
//! Each is an exponentially weighted mean ([`ALPHA`] to the newest sample), used once it has
//! [`MIN_SAMPLES`] samples; until then the configured values stand.

use std::time::Duration;

use kvtier_core::protocol::TierCode;

/// Weight of the newest sample.
pub const ALPHA: f64 = 0.2;
/// Samples before a measured value replaces the configured one.
pub const MIN_SAMPLES: u64 = 3;
/// Fewest uncached tokens for an answer to be a prefill-rate sample.
pub const MIN_PREFILL_SAMPLE_TOKENS: u64 = 128;
/// Fewest bytes loaded for an answer to be a load-bandwidth sample.
pub const MIN_LOAD_SAMPLE_BYTES: u64 = 1 << 20;
/// A reported bandwidth above this (10 TB/s, beyond any HBM) is not believed.
pub const MAX_LOAD_BYTES_PER_S: f64 = 1e13;

/// What a worker reported loading for one answer (`usage.kvtier`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Bytes loaded, by tier (index: `TierCode as usize`; `Remote`: fetched by the server's
    /// cluster from another member for the lookup).
    pub loaded_bytes: [u64; 4],
    /// Seconds the load took, as the worker measured it.
    pub load_s: f64,
}

impl LoadReport {
    /// The load time, when it is a number the prefill-rate sample can subtract.
    fn valid_load_s(&self) -> Option<f64> {
        (self.load_s.is_finite() && self.load_s >= 0.0).then_some(self.load_s)
    }
}

/// What became of one answer's load report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadOutcome {
    /// A sample of this tier's bandwidth.
    Sample(TierCode),
    /// Nothing was loaded.
    Nothing,
    /// Blocks from more than one tier: one time for all, no tier's bandwidth.
    Mixed,
    /// Fewer than [`MIN_LOAD_SAMPLE_BYTES`].
    Small,
    /// A time or bandwidth that cannot be (not finite, negative, zero for some bytes, above
    /// [`MAX_LOAD_BYTES_PER_S`]).
    Bad,
}

impl LoadOutcome {
    /// The `outcome` label of `kvtier_router_load_reports_total`.
    pub fn label(self) -> &'static str {
        match self {
            LoadOutcome::Sample(t) => t.name(),
            LoadOutcome::Nothing => "nothing_loaded",
            LoadOutcome::Mixed => "mixed_tiers",
            LoadOutcome::Small => "small",
            LoadOutcome::Bad => "bad",
        }
    }
}

/// An exponentially weighted mean.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ewma {
    pub value: f64,
    pub samples: u64,
}

impl Ewma {
    fn add(&mut self, x: f64) {
        self.value = if self.samples == 0 {
            x
        } else {
            ALPHA * x + (1.0 - ALPHA) * self.value
        };
        self.samples += 1;
    }

    /// The mean, once it has [`MIN_SAMPLES`] samples.
    pub fn get(&self) -> Option<f64> {
        (self.samples >= MIN_SAMPLES).then_some(self.value)
    }
}

/// One worker's measured speed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measured {
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: Ewma,
    /// Seconds of one decode step of one sequence.
    pub decode_step_s: Ewma,
    /// Bytes per second loaded from each tier of its kvtier server (index: `TierCode as
    /// usize`), and (`TierCode::Remote`) of blocks its server fetched from the cluster.
    pub load_bytes_per_s: [Ewma; 4],
}

impl Measured {
    /// An answer with `uncached_tokens` to prefill started `ttft` after it was sent, with no
    /// other prompt in prefill there; the worker reported `load` (when it did), whose time is
    /// not prefill. Ignored below [`MIN_PREFILL_SAMPLE_TOKENS`] or at no time left.
    pub fn prefill_sample(
        &mut self,
        uncached_tokens: u64,
        ttft: Duration,
        load: Option<&LoadReport>,
    ) {
        let load_s = load.and_then(LoadReport::valid_load_s).unwrap_or(0.0);
        let s = ttft.as_secs_f64() - load_s;
        if uncached_tokens < MIN_PREFILL_SAMPLE_TOKENS || s <= 0.0 {
            return;
        }
        self.prefill_tokens_per_s.add(uncached_tokens as f64 / s);
    }

    /// An answer's load report: a sample of one tier's bandwidth, or why not.
    pub fn load_sample(&mut self, r: &LoadReport) -> LoadOutcome {
        let bytes: u64 = r
            .loaded_bytes
            .iter()
            .fold(0u64, |a, b| a.saturating_add(*b));
        let Some(load_s) = r.valid_load_s() else {
            return LoadOutcome::Bad;
        };
        if bytes == 0 {
            return LoadOutcome::Nothing;
        }
        let mut tiers = r.loaded_bytes.iter().enumerate().filter(|(_, b)| **b > 0);
        let (Some((t, _)), None) = (tiers.next(), tiers.next()) else {
            return LoadOutcome::Mixed;
        };
        if bytes < MIN_LOAD_SAMPLE_BYTES {
            return LoadOutcome::Small;
        }
        let bw = bytes as f64 / load_s;
        if !(bw.is_finite() && bw > 0.0 && bw <= MAX_LOAD_BYTES_PER_S) {
            return LoadOutcome::Bad;
        }
        let Some(tier) = TierCode::from_u8(t as u8) else {
            return LoadOutcome::Bad; // unreachable: four codes, four slots
        };
        self.load_bytes_per_s[t].add(bw);
        LoadOutcome::Sample(tier)
    }

    /// A streamed answer decoded `tokens` tokens in `decode` (first byte to end) with
    /// `decoding` requests decoding on the worker when it started (itself included). Ignored
    /// with fewer than 2 tokens (one token is all prefill) or a zero time.
    pub fn decode_sample(&mut self, decode: Duration, tokens: u64, decoding: u64) {
        let s = decode.as_secs_f64();
        if tokens < 2 || s <= 0.0 {
            return;
        }
        // The first token came with the first byte: `tokens - 1` steps since.
        self.decode_step_s
            .add(s / (tokens - 1) as f64 / decoding.max(1) as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_values_replace_the_configured_ones_after_three_samples() {
        let mut m = Measured::default();
        m.prefill_sample(1000, Duration::from_millis(500), None);
        m.prefill_sample(1000, Duration::from_millis(500), None);
        assert_eq!(
            m.prefill_tokens_per_s.get(),
            None,
            "two samples are not enough"
        );
        m.prefill_sample(1000, Duration::from_millis(500), None);
        assert_eq!(m.prefill_tokens_per_s.get(), Some(2000.0));
        // A slower answer moves the mean a fifth of the way.
        m.prefill_sample(1000, Duration::from_secs(1), None);
        let want = 0.2 * 1000.0 + 0.8 * 2000.0;
        assert!((m.prefill_tokens_per_s.get().unwrap() - want).abs() < 1e-9);
    }

    #[test]
    fn small_prefills_and_zero_times_are_not_samples() {
        let mut m = Measured::default();
        for _ in 0..5 {
            m.prefill_sample(
                MIN_PREFILL_SAMPLE_TOKENS - 1,
                Duration::from_millis(1),
                None,
            );
            m.prefill_sample(4000, Duration::ZERO, None);
            m.decode_sample(Duration::from_secs(1), 1, 1);
            m.decode_sample(Duration::ZERO, 100, 1);
        }
        assert_eq!(m, Measured::default());
    }

    #[test]
    fn a_decode_step_is_the_answers_token_time_shared_by_the_sequences_decoding() {
        let mut m = Measured::default();
        // 101 tokens in 2 s (the first with the first byte): 20 ms a token; 4 sequences took
        // turns, so one step is 5 ms.
        for _ in 0..3 {
            m.decode_sample(Duration::from_secs(2), 101, 4);
        }
        assert!((m.decode_step_s.get().unwrap() - 0.005).abs() < 1e-12);
        // Alone (or a count of 0, which cannot be): the whole token time.
        let mut alone = Measured::default();
        for _ in 0..3 {
            alone.decode_sample(Duration::from_secs(2), 101, 0);
        }
        assert!((alone.decode_step_s.get().unwrap() - 0.02).abs() < 1e-12);
    }

    fn report(hbm: u64, dram: u64, nvme: u64, load_s: f64) -> LoadReport {
        LoadReport {
            loaded_bytes: [hbm, dram, nvme, 0],
            load_s,
        }
    }

    #[test]
    fn a_load_all_from_the_cluster_is_a_sample_of_its_rate_and_a_mixed_one_is_not() {
        let mut m = Measured::default();
        let mib = 1u64 << 20;
        let remote = |dram, remote| LoadReport {
            loaded_bytes: [0, dram, 0, remote],
            load_s: 0.02,
        };
        for _ in 0..3 {
            let o = m.load_sample(&remote(0, 8 * mib));
            assert_eq!(o, LoadOutcome::Sample(TierCode::Remote));
        }
        let bw = m.load_bytes_per_s[TierCode::Remote as usize].get().unwrap();
        assert!((bw - 8.0 * mib as f64 / 0.02).abs() < 1e-3, "{bw}");
        // Part DRAM, part fetched: the time is mostly the fetch, no sample of either.
        assert_eq!(m.load_sample(&remote(8 * mib, mib)), LoadOutcome::Mixed);
        assert_eq!(m.load_bytes_per_s[TierCode::Dram as usize].samples, 0);
    }

    #[test]
    fn a_single_tier_load_is_a_sample_of_that_tiers_bandwidth() {
        let mut m = Measured::default();
        let mib = 1u64 << 20;
        // 4 MiB from NVMe in 10 ms, three times: 419 MB/s replaces the configured value.
        for _ in 0..3 {
            let o = m.load_sample(&report(0, 0, 4 * mib, 0.01));
            assert_eq!(o, LoadOutcome::Sample(TierCode::Nvme));
        }
        let nvme = m.load_bytes_per_s[TierCode::Nvme as usize].get().unwrap();
        assert!((nvme - 4.0 * mib as f64 / 0.01).abs() < 1e-3, "{nvme}");
        assert_eq!(m.load_bytes_per_s[TierCode::Dram as usize].samples, 0);
        // One DRAM sample is not enough to be used.
        assert_eq!(
            m.load_sample(&report(0, 2 * mib, 0, 0.001)),
            LoadOutcome::Sample(TierCode::Dram)
        );
        assert_eq!(m.load_bytes_per_s[TierCode::Dram as usize].get(), None);
    }

    #[test]
    fn mixed_small_empty_and_impossible_loads_are_not_samples() {
        let mut m = Measured::default();
        let mib = 1u64 << 20;
        for (r, want) in [
            (report(0, 0, 0, 0.0), LoadOutcome::Nothing),
            (report(0, 2 * mib, 2 * mib, 0.01), LoadOutcome::Mixed),
            (report(0, mib - 1, 0, 0.001), LoadOutcome::Small),
            (report(0, 2 * mib, 0, 0.0), LoadOutcome::Bad),
            (report(0, 2 * mib, 0, -1.0), LoadOutcome::Bad),
            (report(0, 2 * mib, 0, f64::NAN), LoadOutcome::Bad),
            (report(0, 2 * mib, 0, f64::INFINITY), LoadOutcome::Bad),
            // 2 MiB in a nanosecond: 2 PB/s.
            (report(0, 2 * mib, 0, 1e-9), LoadOutcome::Bad),
            (report(u64::MAX, u64::MAX, 0, 1.0), LoadOutcome::Mixed),
        ] {
            assert_eq!(m.load_sample(&r), want, "{r:?}");
        }
        assert_eq!(m, Measured::default());
        assert_eq!(LoadOutcome::Sample(TierCode::Hbm).label(), "hbm");
    }

    #[test]
    fn the_reported_load_time_is_not_prefill() {
        // 1000 uncached tokens, first byte after 600 ms of which the worker spent 100 ms
        // loading: 2000 tokens/s, not 1667.
        let mut m = Measured::default();
        let load = report(0, 4 << 20, 0, 0.1);
        for _ in 0..3 {
            m.prefill_sample(1000, Duration::from_millis(600), Some(&load));
        }
        assert!((m.prefill_tokens_per_s.get().unwrap() - 2000.0).abs() < 1e-9);
        // A load time that cannot be is not subtracted; one as long as the wait leaves no
        // prefill time, no sample.
        let mut m = Measured::default();
        for _ in 0..3 {
            m.prefill_sample(
                1000,
                Duration::from_millis(500),
                Some(&report(0, 1, 0, -5.0)),
            );
            m.prefill_sample(
                1000,
                Duration::from_millis(500),
                Some(&report(0, 1, 0, 0.5)),
            );
        }
        assert_eq!(m.prefill_tokens_per_s.samples, 3);
        assert_eq!(m.prefill_tokens_per_s.get(), Some(2000.0));
    }
}

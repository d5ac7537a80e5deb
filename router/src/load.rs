//! What each worker's answers show of its speed, measured by the router from the answers it
//! passes through (no help from the worker): its prefill rate and the time of one decode
//! step. Free of I/O and of the clock (callers pass durations): tested on constructed samples.
//!
//! * **Prefill rate**: an answer's uncached prompt tokens (its prompt less the `cached_tokens`
//!   the worker reported) over its time to first byte, for answers sent while no other prompt
//!   the router had sent that worker was still in prefill (so the wait is the answer's own
//!   prefill, beside whatever was decoding), and with at least [`MIN_PREFILL_SAMPLE_TOKENS`]
//!   uncached tokens (below that the fixed costs of a request dominate).
//! * **Decode step**: a streamed answer's time from its first byte to its end over its
//!   `completion_tokens`, divided by the requests decoding on that worker when its first byte
//!   came (itself included): the worker runs its sequences a step each in turn
//!   (`kvtier_worker::scheduler`), so one token of one answer costs a round of every
//!   sequence's step.
//!
//! Each is an exponentially weighted mean ([`ALPHA`] to the newest sample), used once it has
//! [`MIN_SAMPLES`] samples; until then the configured values stand.

use std::time::Duration;

/// Weight of the newest sample.
pub const ALPHA: f64 = 0.2;
/// Samples before a measured value replaces the configured one.
pub const MIN_SAMPLES: u64 = 3;
/// Fewest uncached tokens for an answer to be a prefill-rate sample.
pub const MIN_PREFILL_SAMPLE_TOKENS: u64 = 128;

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
}

impl Measured {
    /// An answer with `uncached_tokens` to prefill started `ttft` after it was sent, with no
    /// other prompt in prefill there. Ignored below [`MIN_PREFILL_SAMPLE_TOKENS`] or at a zero
    /// time.
    pub fn prefill_sample(&mut self, uncached_tokens: u64, ttft: Duration) {
        let s = ttft.as_secs_f64();
        if uncached_tokens < MIN_PREFILL_SAMPLE_TOKENS || s <= 0.0 {
            return;
        }
        self.prefill_tokens_per_s.add(uncached_tokens as f64 / s);
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
        m.prefill_sample(1000, Duration::from_millis(500));
        m.prefill_sample(1000, Duration::from_millis(500));
        assert_eq!(
            m.prefill_tokens_per_s.get(),
            None,
            "two samples are not enough"
        );
        m.prefill_sample(1000, Duration::from_millis(500));
        assert_eq!(m.prefill_tokens_per_s.get(), Some(2000.0));
        // A slower answer moves the mean a fifth of the way.
        m.prefill_sample(1000, Duration::from_secs(1));
        let want = 0.2 * 1000.0 + 0.8 * 2000.0;
        assert!((m.prefill_tokens_per_s.get().unwrap() - want).abs() < 1e-9);
    }

    #[test]
    fn small_prefills_and_zero_times_are_not_samples() {
        let mut m = Measured::default();
        for _ in 0..5 {
            m.prefill_sample(MIN_PREFILL_SAMPLE_TOKENS - 1, Duration::from_millis(1));
            m.prefill_sample(4000, Duration::ZERO);
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
}

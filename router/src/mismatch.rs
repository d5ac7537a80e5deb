//! Detects a router that computes other block keys than its workers (another tokenizer, chat
//! template, model name, `block_tokens`, hash secret or `cache_salt` handling): the cached
//! tokens a worker reports (`usage.prompt_tokens_details.cached_tokens`) keep disagreeing with
//! what the router predicted from the worker's kvtier events. One disagreement proves nothing
//! (a block evicted since its event, a load the worker's cost model skipped, blocks still
//! being stored); `streak` disagreements in a row with no agreement between are reported.

/// How one answer compared with the prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Both small: says nothing about the keys.
    NoEvidence,
    Agree,
    /// The worker found much less than the router predicted.
    Lower,
    /// The worker found much more than the router predicted.
    Higher,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::NoEvidence => "no_evidence",
            Verdict::Agree => "agree",
            Verdict::Lower => "lower",
            Verdict::Higher => "higher",
        }
    }
}

/// Compares a prediction with the worker's report: disagreement is a factor of two either way
/// on at least `min_tokens`.
pub fn verdict(predicted: u64, reported: u64, min_tokens: u64) -> Verdict {
    verdict_range(predicted, predicted, reported, min_tokens)
}

/// [`verdict`] for a prediction known only within `low..=high` (a worker in a kvtier cluster:
/// its own server's blocks at least, those fetched from other members at most): lower is
/// judged against `low`, higher against `high`.
pub fn verdict_range(low: u64, high: u64, reported: u64, min_tokens: u64) -> Verdict {
    if low >= min_tokens && reported.saturating_mul(2) < low {
        Verdict::Lower
    } else if reported >= min_tokens && high.saturating_mul(2) < reported {
        Verdict::Higher
    } else if high >= min_tokens || reported >= min_tokens {
        Verdict::Agree
    } else {
        Verdict::NoEvidence
    }
}

/// Disagreements in a row for one worker.
#[derive(Debug, Default)]
pub struct Streak {
    run: u64,
}

impl Streak {
    /// Records `v`; true when the run of disagreements just reached a multiple of `streak`
    /// (time to report loudly).
    pub fn record(&mut self, v: Verdict, streak: u64) -> bool {
        match v {
            Verdict::NoEvidence => false,
            Verdict::Agree => {
                self.run = 0;
                false
            }
            Verdict::Lower | Verdict::Higher => {
                self.run += 1;
                streak > 0 && self.run.is_multiple_of(streak)
            }
        }
    }

    /// Whether the current run of disagreements has reached `streak`.
    pub fn suspected(&self, streak: u64) -> bool {
        streak > 0 && self.run >= streak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_agrees_with_anything_between_its_ends() {
        // 100 tokens from the worker's own server, up to 400 with the cluster's.
        for (r, want) in [
            (40, Verdict::Lower),
            (100, Verdict::Agree),
            (400, Verdict::Agree),
            (800, Verdict::Agree),
            (801, Verdict::Higher),
        ] {
            assert_eq!(verdict_range(100, 400, r, 32), want, "reported {r}");
        }
        assert_eq!(verdict_range(0, 20, 10, 32), Verdict::NoEvidence);
        assert_eq!(verdict_range(0, 64, 0, 32), Verdict::Agree);
    }

    #[test]
    fn verdicts() {
        let check = |p, r, want| assert_eq!(verdict(p, r, 32), want, "predicted {p}, reported {r}");
        check(0, 0, Verdict::NoEvidence);
        check(16, 0, Verdict::NoEvidence);
        check(0, 16, Verdict::NoEvidence);
        check(64, 64, Verdict::Agree);
        check(64, 48, Verdict::Agree);
        check(64, 32, Verdict::Agree);
        check(64, 31, Verdict::Lower);
        check(640, 0, Verdict::Lower);
        check(0, 640, Verdict::Higher);
        check(100, 640, Verdict::Higher);
        check(320, 640, Verdict::Agree);
    }

    #[test]
    fn a_run_of_disagreements_is_reported_once_per_streak() {
        let mut s = Streak::default();
        let fired: Vec<bool> = [
            Verdict::Lower,
            Verdict::NoEvidence,
            Verdict::Higher,
            Verdict::Lower,
            Verdict::Lower,
            Verdict::Lower,
            Verdict::Lower,
            Verdict::Lower,
        ]
        .into_iter()
        .map(|v| s.record(v, 3))
        .collect();
        assert_eq!(
            fired,
            [false, false, false, true, false, false, true, false]
        );
        assert!(s.suspected(3));
        assert!(!s.record(Verdict::Agree, 3));
        assert!(!s.suspected(3));
    }
}

//! Rate-limited warnings for errors that can repeat per block (a failing disk): counted
//! always, logged at most once per interval with the count since the last line.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Least time between two warnings of one [`WarnEvery`].
pub(super) const IO_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

pub(super) struct WarnEvery {
    interval: Duration,
    /// When the last warning went out, and the events since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl WarnEvery {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Notes one event at `now`; returns the events since the last warning (this one
    /// included) when a warning is due, and starts a new interval.
    pub(super) fn note(&self, now: Instant) -> Option<u64> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.1 += 1;
        if g.0.is_some_and(|t| now.duration_since(t) < self.interval) {
            return None;
        }
        let n = g.1;
        *g = (Some(now), 0);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_once_per_interval_with_the_count() {
        let w = WarnEvery::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(w.note(at(0)), Some(1));
        assert_eq!(w.note(at(1)), None);
        assert_eq!(w.note(at(9)), None);
        assert_eq!(w.note(at(10)), Some(3));
        assert_eq!(w.note(at(11)), None);
        assert_eq!(w.note(at(25)), Some(2));
    }
}

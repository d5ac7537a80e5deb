//! Admission: under pressure, new writes are dropped and counted; callers never wait.

/// The admission decision for one new block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Dropped: the reason is counted and reported to the caller.
    Reject(RejectReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Background work (demotions, promotions) is backed up past its bound.
    Backlog,
    /// No slot could be freed: everything evictable is pinned.
    NoEvictableSlot,
    /// The block's parent is not cached, so no lookup could ever reach it.
    OrphanBlock,
}

/// Drops new writes while the background queue is deeper than `max_backlog`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionPolicy {
    pub max_backlog: usize,
}

impl Default for AdmissionPolicy {
    /// Admit until 1,024 background jobs are waiting.
    fn default() -> Self {
        Self { max_backlog: 1024 }
    }
}

impl AdmissionPolicy {
    pub fn admit(&self, backlog: usize) -> Admission {
        if backlog > self.max_backlog {
            Admission::Reject(RejectReason::Backlog)
        } else {
            Admission::Admit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_only_past_the_bound() {
        let p = AdmissionPolicy { max_backlog: 2 };
        assert_eq!(p.admit(0), Admission::Admit);
        assert_eq!(p.admit(2), Admission::Admit);
        assert_eq!(p.admit(3), Admission::Reject(RejectReason::Backlog));
    }
}

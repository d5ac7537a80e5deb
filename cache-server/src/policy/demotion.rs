//! When blocks move between DRAM and NVMe.

/// When a DRAM block gets a copy on NVMe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemotionPolicy {
    /// Only when DRAM evicts it (fewest NVMe writes; a crash loses what was only in DRAM).
    WriteBack,
    /// Every stored block is also written to NVMe, in the background (a restart keeps it all).
    WriteThrough,
    /// A block is written to NVMe once it has been hit `after_hits` times (protects the
    /// drive from one-off blocks); blocks evicted before that are dropped.
    SelectiveWriteThrough { after_hits: u32 },
}

impl Default for DemotionPolicy {
    /// Write-through, so a restart keeps the cache warm.
    fn default() -> Self {
        DemotionPolicy::WriteThrough
    }
}

impl DemotionPolicy {
    /// Copy to NVMe right after a put?
    pub fn on_put(self) -> bool {
        matches!(
            self,
            DemotionPolicy::WriteThrough | DemotionPolicy::SelectiveWriteThrough { after_hits: 0 }
        )
    }

    /// Copy to NVMe after the `hits`-th hit (counted from 1)?
    pub fn on_hit(self, hits: u32) -> bool {
        matches!(self, DemotionPolicy::SelectiveWriteThrough { after_hits } if after_hits > 0 && hits == after_hits)
    }

    /// Copy to NVMe when DRAM evicts a block that has no NVMe copy?
    pub fn on_evict(self) -> bool {
        matches!(self, DemotionPolicy::WriteBack)
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "write-back" => Some(DemotionPolicy::WriteBack),
            "write-through" => Some(DemotionPolicy::WriteThrough),
            _ => s
                .strip_prefix("selective:")
                .and_then(|n| n.parse().ok())
                .map(|after_hits| DemotionPolicy::SelectiveWriteThrough { after_hits }),
        }
    }
}

/// Whether an NVMe hit is copied up into DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PromotionPolicy {
    /// Copy up on every NVMe hit (the default: the next hit is a DRAM hit, and a local client
    /// can then map it).
    #[default]
    OnHit,
    /// Serve NVMe hits through a bounce buffer and leave DRAM alone.
    Never,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let check = |p: DemotionPolicy, put: bool, hit2: bool, evict: bool| {
            assert_eq!(
                (p.on_put(), p.on_hit(2), p.on_evict()),
                (put, hit2, evict),
                "{p:?}"
            );
        };
        check(DemotionPolicy::WriteBack, false, false, true);
        check(DemotionPolicy::WriteThrough, true, false, false);
        check(
            DemotionPolicy::SelectiveWriteThrough { after_hits: 2 },
            false,
            true,
            false,
        );
        check(
            DemotionPolicy::SelectiveWriteThrough { after_hits: 3 },
            false,
            false,
            false,
        );
        check(
            DemotionPolicy::SelectiveWriteThrough { after_hits: 0 },
            true,
            false,
            false,
        );
        assert_eq!(
            DemotionPolicy::parse("selective:2"),
            Some(DemotionPolicy::SelectiveWriteThrough { after_hits: 2 })
        );
        assert_eq!(DemotionPolicy::parse("sometimes"), None);
    }
}

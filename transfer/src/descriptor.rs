//! Descriptors (one contiguous range on each side of a transfer) and merging of adjacent
//! descriptors. Their bounds are checked against the regions by `region::check_range`.

use crate::region::RegionId;

/// The direction of a one-sided transfer, seen from the agent that posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Copy remote bytes into local memory.
    Read,
    /// Copy local bytes into remote memory.
    Write,
}

/// One contiguous range of a transfer: `len` bytes at `local_offset` in the local region
/// `local` and at `remote_offset` in the peer's region `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Descriptor {
    pub local: RegionId,
    pub local_offset: u64,
    pub remote: RegionId,
    pub remote_offset: u64,
    pub len: u64,
}

impl Descriptor {
    /// A descriptor of `len` bytes between `local`+`local_offset` and `remote`+`remote_offset`.
    pub fn new(
        local: RegionId,
        local_offset: u64,
        remote: RegionId,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        }
    }

    /// Whether `next` continues this descriptor on both sides (same regions, both ranges
    /// adjacent), so the two can travel as one.
    pub fn is_followed_by(&self, next: &Descriptor) -> bool {
        self.local == next.local
            && self.remote == next.remote
            && self.local_offset.checked_add(self.len) == Some(next.local_offset)
            && self.remote_offset.checked_add(self.len) == Some(next.remote_offset)
    }
}

/// Merges runs of adjacent descriptors in place (in order; descriptors are not sorted, so a
/// caller's ordering is kept) and returns the merged list.
pub fn merge_adjacent(descs: &[Descriptor]) -> Vec<Descriptor> {
    let mut out: Vec<Descriptor> = Vec::with_capacity(descs.len());
    for d in descs {
        match out.last_mut() {
            Some(last) if last.is_followed_by(d) => last.len += d.len,
            _ => out.push(*d),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::check_range;

    fn d(l: u64, lo: u64, r: u64, ro: u64, len: u64) -> Descriptor {
        Descriptor::new(RegionId(l), lo, RegionId(r), ro, len)
    }

    fn check(input: &[Descriptor], expected: &[Descriptor]) {
        assert_eq!(merge_adjacent(input), expected, "input {input:?}");
    }

    #[test]
    fn merges_only_runs_adjacent_on_both_sides() {
        check(&[], &[]);
        check(&[d(1, 0, 2, 0, 8)], &[d(1, 0, 2, 0, 8)]);
        check(
            &[d(1, 0, 2, 0, 8), d(1, 8, 2, 8, 8), d(1, 16, 2, 16, 4)],
            &[d(1, 0, 2, 0, 20)],
        );
        // Local adjacent, remote not.
        check(
            &[d(1, 0, 2, 0, 8), d(1, 8, 2, 9, 8)],
            &[d(1, 0, 2, 0, 8), d(1, 8, 2, 9, 8)],
        );
        // Different regions.
        check(
            &[d(1, 0, 2, 0, 8), d(3, 8, 2, 8, 8)],
            &[d(1, 0, 2, 0, 8), d(3, 8, 2, 8, 8)],
        );
        // Reverse order is not merged.
        check(
            &[d(1, 8, 2, 8, 8), d(1, 0, 2, 0, 8)],
            &[d(1, 8, 2, 8, 8), d(1, 0, 2, 0, 8)],
        );
        // Overflowing offsets do not merge.
        check(
            &[d(1, u64::MAX, 2, 0, 1), d(1, 0, 2, 1, 1)],
            &[d(1, u64::MAX, 2, 0, 1), d(1, 0, 2, 1, 1)],
        );
    }

    #[test]
    fn range_checks() {
        assert!(check_range(0, "local", 0, 8, 8).is_ok());
        assert!(check_range(0, "local", 7, 1, 8).is_ok());
        assert!(check_range(0, "local", 8, 1, 8).is_err());
        assert!(check_range(0, "local", 0, 0, 8).is_err());
        assert!(check_range(3, "remote", u64::MAX, 2, 8).is_err());
    }

    /// Applies a list to a byte model (local bytes into a remote buffer), in order.
    fn apply(list: &[Descriptor], local: &[u8], remote: &mut [u8]) {
        for d in list {
            let (lo, ro, n) = (
                d.local_offset as usize,
                d.remote_offset as usize,
                d.len as usize,
            );
            remote[ro..ro + n].copy_from_slice(&local[lo..lo + n]);
        }
    }

    proptest::proptest! {
        /// Merging keeps the bytes moved, the mapping, and never yields adjacent neighbours.
        #[test]
        fn merging_preserves_the_mapping(
            pieces in proptest::collection::vec((0u64..2, 0u64..256, 0u64..256, 1u64..64, proptest::bool::ANY), 0..40)
        ) {
            let mut list: Vec<Descriptor> = Vec::new();
            for (region, lo, ro, len, chain) in pieces {
                match list.last() {
                    Some(p) if chain && p.local_offset + p.len + len <= 512 && p.remote_offset + p.len + len <= 512 => {
                        list.push(Descriptor::new(p.local, p.local_offset + p.len, p.remote, p.remote_offset + p.len, len));
                    }
                    _ => list.push(Descriptor::new(RegionId(region), lo, RegionId(region), ro, len)),
                }
            }
            let merged = merge_adjacent(&list);
            proptest::prop_assert_eq!(
                merged.iter().map(|d| d.len).sum::<u64>(),
                list.iter().map(|d| d.len).sum::<u64>()
            );
            proptest::prop_assert!(merged.len() <= list.len());
            for w in merged.windows(2) {
                proptest::prop_assert!(!w[0].is_followed_by(&w[1]));
            }
            let local: Vec<u8> = (0..512u32).map(|i| (i * 7) as u8).collect();
            let (mut a, mut b) = (vec![0u8; 512], vec![0u8; 512]);
            apply(&list, &local, &mut a);
            apply(&merged, &local, &mut b);
            proptest::prop_assert_eq!(a, b);
        }
    }
}

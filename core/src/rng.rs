//! The workspace's one seeded PRNG, SplitMix64 (Steele, Lea, Flood 2014): deterministic across
//! platforms and versions, which a `rand` dependency would not promise. The worker draws its
//! random weights and its sampling from it, the benchmarks their workloads, keys and payloads;
//! a seed gives the same sequence everywhere. Not for secrets.

/// SplitMix64: 64 bits of state, one add and two multiply-xorshift rounds per output.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift of one output; 0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)` with 24 bits of precision (the top 24 bits of one output).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[0, 1)` with 53 bits of precision (the top 53 bits of one output).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut r = SplitMix64::new(5);
        assert_eq!(r.below(0), 0);
        assert_eq!(r.below(1), 0);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let v = r.below(7);
            assert!(v < 7);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }

    #[test]
    fn known_outputs_and_ranges() {
        // Reference values of SplitMix64 seeded with 0 (the published test vector).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(r.next_u64(), 0x06C4_5D18_8009_454F);
        let mut r = SplitMix64::new(7);
        for _ in 0..1000 {
            let x = r.next_f32();
            assert!((0.0..1.0).contains(&x));
            let y = r.next_f64();
            assert!((0.0..1.0).contains(&y));
        }
    }

    #[test]
    fn floats_are_the_top_bits_of_one_output() {
        let (mut a, mut b) = (SplitMix64::new(42), SplitMix64::new(42));
        assert_eq!(a.next_f32(), (b.next_u64() >> 40) as f32 / 16_777_216.0);
        assert_eq!(
            a.next_f64(),
            (b.next_u64() >> 11) as f64 / 9_007_199_254_740_992.0
        );
    }
}

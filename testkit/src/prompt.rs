//! Seeded prompts of byte tokens, and how far two logit vectors are apart.

use kvtier_core::SplitMix64;

/// The byte-level tokenizer's BOS token.
pub const BOS: u32 = 256;

/// A prompt of `len` tokens: [`BOS`], then byte tokens (0..256) drawn from `seed`. The same
/// seed gives the same prompt everywhere.
pub fn byte_prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut r = SplitMix64::new(seed);
    std::iter::once(BOS)
        .chain((1..len).map(|_| (r.next_u64() % 256) as u32))
        .collect()
}

/// The largest absolute difference between `a` and `b` element by element (they must be the
/// same length).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logits of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_seeded_byte_tokens_after_bos() {
        let p = byte_prompt(3, 50);
        assert_eq!(p.len(), 50);
        assert_eq!(p[0], BOS);
        assert!(p[1..].iter().all(|t| *t < 256));
        assert_eq!(p, byte_prompt(3, 50));
        assert_ne!(p, byte_prompt(4, 50));
        // The first token after BOS is SplitMix64(3)'s first output, mod 256.
        assert_eq!(u64::from(p[1]), SplitMix64::new(3).next_u64() % 256);
        assert_eq!(byte_prompt(9, 1), vec![BOS]);
    }

    #[test]
    fn max_abs_diff_is_the_largest_gap() {
        assert_eq!(max_abs_diff(&[1.0, 2.0, 3.0], &[1.5, 2.0, 0.0]), 3.0);
        assert_eq!(max_abs_diff(&[], &[]), 0.0);
    }
}

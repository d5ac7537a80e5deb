//! The prefill GEMM for quantized weights: `x @ w^T` with `x` f32 `[t, k]` and `w` a
//! [`QuantMatrix`](crate::quant::QuantMatrix) `[n, k]`. The weights are dequantized one strip
//! of [`NR`] output rows at a time into an f32 panel laid out `[k][NR]` (which stays in L2),
//! and a register-blocked kernel multiplies [`MR`] activation rows by it; strips are split
//! across rayon's pool. The products are the f32 products of the dequantized weights (the
//! reference's arithmetic; only the order of the sums differs).
//!
//! Hand-written rather than candle's f32 matmul: candle's `gemm` crate (0.19) runs its AVX2
//! kernels on stable Rust (AVX-512 only with its `nightly` feature), and would need the whole
//! matrix dequantized first. The kernel is plain Rust over fixed-size arrays compiled a second
//! time with AVX-512 enabled (the compiler keeps the `MR x NR` accumulators in 24 zmm
//! registers); it is used only where the CPU has AVX-512 (checked at run time), callers fall
//! back to candle elsewhere.

use rayon::prelude::*;

/// Output rows (weight rows) per strip: two 16-lane vectors.
pub(crate) const NR: usize = 32;
/// Activation rows per kernel call.
const MR: usize = 12;

/// Whether [`matmul`] runs here (the CPU has AVX-512F and FMA).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x @ w^T`, `[t, n]` row-major, where `pack(first_row, panel)` writes rows
/// `first_row..first_row + NR` of `w` into `panel` as `panel[p * NR + r] = w[first_row + r][p]`
/// (zeros past row `n`). `None` when the CPU lacks AVX-512 ([`available`]).
pub(crate) fn matmul<F>(x: &[f32], t: usize, k: usize, n: usize, pack: F) -> Option<Vec<f32>>
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if !available() {
        return None;
    }
    assert_eq!(x.len(), t * k, "x is not [t, k]");
    // Per strip its [t][NR] block of the output.
    let strips: Vec<Vec<f32>> = (0..n.div_ceil(NR))
        .into_par_iter()
        .map(|s| {
            let mut panel = vec![0f32; k * NR];
            pack(s * NR, &mut panel);
            let mut out = vec![0f32; t * NR];
            // SAFETY: `available()` returned true above: the CPU has AVX-512F and FMA, the
            // only requirement of this `target_feature` function (otherwise safe code).
            unsafe { strip_avx512(x, k, &panel, &mut out) };
            out
        })
        .collect();
    Some(join_strips(&strips, t, n))
}

/// The `[t][n]` product from per-strip `[t][NR]` blocks of its columns (the last strip's
/// columns past `n` are padding).
pub(crate) fn join_strips(strips: &[Vec<f32>], t: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * n];
    for (s, strip) in strips.iter().enumerate() {
        let cols = NR.min(n - s * NR);
        for (dst, src) in y.chunks_exact_mut(n).zip(strip.chunks_exact(NR)) {
            dst[s * NR..s * NR + cols].copy_from_slice(&src[..cols]);
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn strip_avx512(x: &[f32], k: usize, panel: &[f32], out: &mut [f32]) {
    strip(x, k, panel, out)
}

#[cfg(not(target_arch = "x86_64"))]
fn strip_avx512(x: &[f32], k: usize, panel: &[f32], out: &mut [f32]) {
    strip(x, k, panel, out)
}

/// All rows of `x` (`[t][k]`) times one packed panel (`[k][NR]`) into `out` (`[t][NR]`).
#[inline(always)]
fn strip(x: &[f32], k: usize, panel: &[f32], out: &mut [f32]) {
    let mut pad = Vec::new();
    for (rows, dst) in x.chunks(MR * k).zip(out.chunks_mut(MR * NR)) {
        let full = if rows.len() == MR * k {
            rows
        } else {
            // The last, partial tile: zero rows after the real ones.
            pad.clear();
            pad.extend_from_slice(rows);
            pad.resize(MR * k, 0.0);
            &pad[..]
        };
        let acc = tile(full, k, panel);
        for (d, a) in dst.chunks_exact_mut(NR).zip(&acc) {
            d.copy_from_slice(a);
        }
    }
}

/// `MR` rows of `k` values times the panel: `acc[i][j] = sum_p x[i][p] * panel[p][j]`.
#[inline(always)]
fn tile(x: &[f32], k: usize, panel: &[f32]) -> [[f32; NR]; MR] {
    let rows: [&[f32]; MR] = std::array::from_fn(|i| &x[i * k..(i + 1) * k]);
    let mut acc = [[0f32; NR]; MR];
    for (p, w) in panel.chunks_exact(NR).enumerate().take(k) {
        let w: &[f32; NR] = w.try_into().expect("chunks_exact(NR) yields NR values");
        for (acc, row) in acc.iter_mut().zip(&rows) {
            let a = row[p];
            for (c, &wj) in acc.iter_mut().zip(w) {
                *c = a.mul_add(wj, *c);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against a plain triple loop in f64, ragged sizes included.
    #[test]
    fn matmul_matches_a_plain_product() {
        if !available() {
            eprintln!("no AVX-512 here: the kernel is not used, nothing to check");
            return;
        }
        let mut rng = kvtier_core::SplitMix64::new(7);
        for (t, k, n) in [
            (1, 32, 1),
            (12, 64, 32),
            (13, 96, 33),
            (40, 576, 70),
            (29, 1536, 100),
        ] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.next_f32() - 0.5).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.next_f32() - 0.5).collect();
            let pack = |first: usize, panel: &mut [f32]| {
                for p in 0..k {
                    for r in 0..NR {
                        panel[p * NR + r] = if first + r < n {
                            w[(first + r) * k + p]
                        } else {
                            0.0
                        };
                    }
                }
            };
            let y = matmul(&x, t, k, n, pack).expect("available");
            for i in 0..t {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| f64::from(x[i * k + p]) * f64::from(w[j * k + p]))
                        .sum();
                    let got = y[i * n + j];
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (k as f64).sqrt(),
                        "t={t} k={k} n={n} [{i},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

//! The prefill GEMM in integers: `x @ w^T` with `x` f32 `[t, k]` and `w` a Q4_1 or Q8_0
//! [`QuantMatrix`](crate::quant::QuantMatrix) `[n, k]`, on AVX-512 VNNI (`vpdpwssd`: pairs of
//! 16-bit integers multiplied and added into 32-bit lanes, 32 multiply-adds per instruction,
//! twice the f32 FMA's 16).
//!
//! The activations are quantized once per call as the decode kernel quantizes them
//! ([`crate::quant`]): per row and 32-value block, `s * q` with `q` an i16 (`s = max|x| /
//! 32767`, rounded to nearest), and the block's `s * sum(q)` for Q4_1's minimum. The weights
//! are expanded one strip of [`NR`] output rows at a time into a panel of their integer quants
//! widened to i16 (exact: a Q4_1 nibble or a Q8_0 byte), with each block's scale `d` (and Q4_1's
//! minimum `m`) beside it. Within a block the products are summed exactly in i32 (at most
//! `128 * 32767 * 32 < 2^31` in magnitude); at the block's end the sum is converted to f32 and
//! added as `d * s * sum + m * s * sum(q)`. So the result is the f32 product of the dequantized
//! weights and the 16-bit-rounded activations, the decode kernel's arithmetic: within about
//! 1e-4 of the reference's f32 product (scripts/tests/test_gguf_reference.py's tolerance is
//! 0.05 on the logits).
//!
//! Used only where the CPU has AVX-512F, BW and VNNI ([`available`], checked at run time);
//! [`crate::gemm`]'s f32 kernel (AVX-512F) or candle's matmul elsewhere.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512, __m512i, _mm512_cvtepi32_ps, _mm512_dpwssd_epi32, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_setzero_si512, _mm512_storeu_ps,
};

use rayon::prelude::*;

/// Values per quantized block (the weights' and the activations').
pub(crate) const BLOCK: usize = 32;
/// Output rows (weight rows) per strip: two 16-lane vectors.
pub(crate) const NR: usize = crate::gemm::NR;
/// Activation rows per kernel call: `MR x 2` i32 block sums and as many f32 totals stay in
/// the 32 zmm registers with the two weight vectors and a broadcast.
const MR: usize = 6;
/// Pairs of values per block (one `vpdpwssd` step each).
const PAIRS: usize = BLOCK / 2;

/// Whether [`matmul`] runs here (the CPU has AVX-512F, AVX-512BW and AVX-512 VNNI).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One strip of [`NR`] weight rows over `kb` blocks, filled by [`matmul`]'s `pack`.
pub(crate) struct Panel {
    /// `[kb][PAIRS][NR][2]`: value `2p + e` of block `b` of row `first + r` at
    /// `((b * PAIRS + p) * NR + r) * 2 + e`; zeros for rows past the last.
    pub(crate) q: Vec<i16>,
    /// `[kb][NR]`: the block's scale `d` (zero past the last row).
    pub(crate) d: Vec<f32>,
    /// `[kb][NR]`: the block's minimum `m` (Q4_1; zero for Q8_0 and past the last row).
    pub(crate) m: Vec<f32>,
}

impl Panel {
    fn new(kb: usize) -> Self {
        Self {
            q: vec![0; kb * BLOCK * NR],
            d: vec![0.0; kb * NR],
            m: vec![0.0; kb * NR],
        }
    }
}

/// The activations quantized and laid out by tiles of [`MR`] rows (rows past `t` are zeros).
struct Activations {
    /// `[tile][MR][kb * PAIRS]`: each row's values, the two i16 of a pair in one i32 (the
    /// first in the low half).
    q: Vec<i32>,
    /// `[tile][kb][MR]`: the block's scale `s`.
    s: Vec<f32>,
    /// `[tile][kb][MR]`: `s * sum(q)` over the block.
    s_sum: Vec<f32>,
}

impl Activations {
    /// The quantized `x` (`[t, k]`). Only after [`available`] returned true.
    fn new(x: &[f32], t: usize, k: usize) -> Self {
        let kb = k / BLOCK;
        let tiles = t.div_ceil(MR);
        let mut q = vec![0i32; tiles * MR * kb * PAIRS];
        let mut s = vec![0f32; tiles * kb * MR];
        let mut s_sum = vec![0f32; tiles * kb * MR];
        q.par_chunks_mut(kb * PAIRS * MR)
            .zip(s.par_chunks_mut(kb * MR).zip(s_sum.par_chunks_mut(kb * MR)))
            .enumerate()
            .for_each(|(tile, (q, (s, s_sum)))| {
                let rows = &x[tile * MR * k..((tile + 1) * MR).min(t) * k];
                // SAFETY: `Activations` are built only by `matmul` after `available()`
                // returned true: the CPU has AVX-512F and BW, what `tile_avx512` is compiled
                // for (otherwise safe code).
                unsafe { quantize_tile_avx512(rows, k, q, s, s_sum) };
            });
        Self { q, s, s_sum }
    }
}

/// The rows of one tile (`rows`: up to `MR` rows of `k` values) into its parts of
/// [`Activations`] (rows past the last stay zero): [`quantize_block`]'s arithmetic, 32 values
/// at a time in two vectors (the conversion rounds to nearest, ties to even, as
/// `quantize_block`'s adds do; the same results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_tile_avx512(rows: &[f32], k: usize, q: &mut [i32], s: &mut [f32], s_sum: &mut [f32]) {
    use std::arch::x86_64::{
        _mm256_storeu_si256, _mm512_abs_ps, _mm512_add_epi32, _mm512_cvtepi32_epi16,
        _mm512_cvtps_epi32, _mm512_max_ps, _mm512_reduce_add_epi32, _mm512_reduce_max_ps,
    };
    for (i, (row, q)) in rows
        .chunks_exact(k)
        .zip(q.chunks_exact_mut(k / 2))
        .enumerate()
    {
        for (b, (values, q)) in row
            .chunks_exact(BLOCK)
            .zip(q.chunks_exact_mut(PAIRS))
            .enumerate()
        {
            // SAFETY: `values` holds 32 f32 (chunks_exact): two 16-lane unaligned loads.
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_ps(values.as_ptr()),
                    _mm512_loadu_ps(values.as_ptr().add(16)),
                )
            };
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            let scale = amax / 32767.0;
            let inv = _mm512_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
            let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));
            let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            s[b * MR + i] = scale;
            s_sum[b * MR + i] = scale * sum as f32;
            // SAFETY: `q` holds 16 i32 (chunks_exact(PAIRS)): two 32-byte unaligned stores of
            // 16 i16 each, values 0..16 then 16..32, so pair `p` is one i32, first value low.
            unsafe {
                _mm256_storeu_si256(q.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(q0));
                _mm256_storeu_si256(q.as_mut_ptr().add(8).cast(), _mm512_cvtepi32_epi16(q1));
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn quantize_tile_avx512(_: &[f32], _: usize, _: &mut [i32], _: &mut [f32], _: &mut [f32]) {
    unreachable!("qgemm::available() is false off x86_64")
}

/// 32 values as `s * q` with `s = max|x| / 32767` and `q` rounded to nearest, ties to even
/// (the decode kernel's rounding too, [`crate::quant`]).
#[inline]
pub(crate) fn quantize_block(x: &[f32]) -> (f32, [i16; BLOCK]) {
    // Adding and subtracting 1.5 * 2^23 rounds an f32 below 2^22 in magnitude to an integer,
    // ties to even (the default rounding mode), in two vectorizable adds where `f32::round`
    // is a call to libm per value (a tenth of a prefill's time when it was).
    const ROUND: f32 = 12_582_912.0;
    // The largest magnitude lane-wise, then across lanes; comparisons rather than
    // `f32::max`, whose NaN rules keep the compiler from vectorizing it.
    let mut lanes = [0f32; 16];
    for c in x.chunks_exact(16) {
        for (m, &v) in lanes.iter_mut().zip(c) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    let s = amax / 32767.0;
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    let mut q = [0i16; BLOCK];
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * inv| <= 32767 (up to rounding of `inv`): exact, and within i16 after rounding.
        *q = ((v * inv + ROUND) - ROUND) as i16;
    }
    (s, q)
}

/// `x @ w^T`, `[t, n]` row-major, `k` a multiple of [`BLOCK`], where `pack(first_row, panel)`
/// fills `panel` with rows `first_row..first_row + NR` of `w` as [`Panel`] says (its buffers
/// come zeroed). `with_min`: the weights have a minimum term (Q4_1). `None` when the CPU lacks
/// the instructions ([`available`]).
pub(crate) fn matmul<F>(
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
    with_min: bool,
    pack: F,
) -> Option<Vec<f32>>
where
    F: Fn(usize, &mut Panel) + Sync,
{
    if !available() {
        return None;
    }
    assert_eq!(x.len(), t * k, "x is not [t, k]");
    assert!(k.is_multiple_of(BLOCK), "k is not a multiple of {BLOCK}");
    let kb = k / BLOCK;
    let tiles = t.div_ceil(MR);
    let acts = Activations::new(x, t, k);
    // Per strip its [tiles * MR][NR] block of the output.
    let strips: Vec<Vec<f32>> = (0..n.div_ceil(NR))
        .into_par_iter()
        .map(|strip| {
            let mut panel = Panel::new(kb);
            pack(strip * NR, &mut panel);
            let mut out = vec![0f32; tiles * MR * NR];
            for (tile, dst) in out.chunks_exact_mut(MR * NR).enumerate() {
                let q = &acts.q[tile * kb * PAIRS * MR..(tile + 1) * kb * PAIRS * MR];
                let s = &acts.s[tile * kb * MR..(tile + 1) * kb * MR];
                let s_sum = &acts.s_sum[tile * kb * MR..(tile + 1) * kb * MR];
                // SAFETY: `available()` returned true above: the CPU has AVX-512F, BW and
                // VNNI, what `tile_vnni` is compiled for; the slices' lengths are the ones
                // `tile_vnni` asserts before its unchecked loads.
                unsafe {
                    if with_min {
                        tile_vnni::<true>(q, s, s_sum, &panel, kb, dst);
                    } else {
                        tile_vnni::<false>(q, s, s_sum, &panel, kb, dst);
                    }
                }
            }
            out
        })
        .collect();
    Some(crate::gemm::join_strips(&strips, t, n))
}

/// One tile of [`MR`] activation rows (`q`, `s`, `s_sum` laid out as [`Activations`]'s tile)
/// times the panel, into `out` (`[MR][NR]`).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_vnni<const WITH_MIN: bool>(
    q: &[i32],
    s: &[f32],
    s_sum: &[f32],
    panel: &Panel,
    kb: usize,
    out: &mut [f32],
) {
    // The bounds every unchecked access below stays within.
    assert!(q.len() == MR * kb * PAIRS && s.len() == kb * MR && s_sum.len() == kb * MR);
    assert!(panel.q.len() == kb * BLOCK * NR && panel.d.len() == kb * NR);
    assert!(panel.m.len() == kb * NR && out.len() == MR * NR);
    let mut total: [[__m512; 2]; MR] = [[_mm512_setzero_ps(); 2]; MR];
    for b in 0..kb {
        let mut acc: [[__m512i; 2]; MR] = [[_mm512_setzero_si512(); 2]; MR];
        for p in 0..PAIRS {
            let step = b * PAIRS + p;
            // SAFETY: `step < kb * PAIRS`, so the two 64-byte vectors at `step * NR * 2` and
            // 32 i16 later end within `panel.q` (`kb * PAIRS * NR * 2` values, asserted);
            // unaligned loads are allowed.
            let (w0, w1) = unsafe {
                let wq = panel.q.as_ptr().add(step * NR * 2);
                (
                    _mm512_loadu_si512(wq.cast()),
                    _mm512_loadu_si512(wq.add(NR).cast()),
                )
            };
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i < MR` and `step < kb * PAIRS`: within `q` (asserted).
                let a = _mm512_set1_epi32(unsafe { *q.as_ptr().add(i * kb * PAIRS + step) });
                acc[0] = _mm512_dpwssd_epi32(acc[0], a, w0);
                acc[1] = _mm512_dpwssd_epi32(acc[1], a, w1);
            }
        }
        // SAFETY: `b < kb`: the 2 x 16 scales at `b * NR` lie within `panel.d` and
        // `panel.m` (`kb * NR` values each, asserted).
        let (d0, d1, m0, m1) = unsafe {
            let d = panel.d.as_ptr().add(b * NR);
            let m = panel.m.as_ptr().add(b * NR);
            (
                _mm512_loadu_ps(d),
                _mm512_loadu_ps(d.add(16)),
                _mm512_loadu_ps(m),
                _mm512_loadu_ps(m.add(16)),
            )
        };
        for (i, (total, acc)) in total.iter_mut().zip(&acc).enumerate() {
            let si = _mm512_set1_ps(s[b * MR + i]);
            total[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0]), _mm512_mul_ps(d0, si), total[0]);
            total[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[1]), _mm512_mul_ps(d1, si), total[1]);
            if WITH_MIN {
                let sum = _mm512_set1_ps(s_sum[b * MR + i]);
                total[0] = _mm512_fmadd_ps(m0, sum, total[0]);
                total[1] = _mm512_fmadd_ps(m1, sum, total[1]);
            }
        }
    }
    for (i, total) in total.iter().enumerate() {
        // SAFETY: row `i < MR` of `out` (`MR * NR` values, asserted): 2 x 16 values.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr().add(i * NR), total[0]);
            _mm512_storeu_ps(out.as_mut_ptr().add(i * NR + 16), total[1]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_vnni<const WITH_MIN: bool>(
    _q: &[i32],
    _s: &[f32],
    _s_sum: &[f32],
    _panel: &Panel,
    _kb: usize,
    _out: &mut [f32],
) {
    unreachable!("qgemm::available() is false off x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random weights in blocks: per row and block `d`, `m` and the integer quants (Q4_1:
    /// 0..16 with a minimum; Q8_0: -128..128, no minimum).
    struct Weights {
        n: usize,
        k: usize,
        d: Vec<f32>,
        m: Vec<f32>,
        q: Vec<i16>,
    }

    impl Weights {
        fn random(n: usize, k: usize, with_min: bool, rng: &mut kvtier_core::SplitMix64) -> Self {
            let kb = k / BLOCK;
            let d = (0..n * kb).map(|_| 0.001 + 0.02 * rng.next_f32()).collect();
            let m = (0..n * kb)
                .map(|_| if with_min { -0.2 * rng.next_f32() } else { 0.0 })
                .collect();
            let q = (0..n * k)
                .map(|_| {
                    let r = (rng.next_f32() * 256.0) as i16;
                    if with_min { r % 16 } else { r - 128 }
                })
                .collect();
            Self { n, k, d, m, q }
        }

        fn value(&self, row: usize, p: usize) -> f64 {
            let b = row * (self.k / BLOCK) + p / BLOCK;
            f64::from(self.d[b]) * f64::from(self.q[row * self.k + p]) + f64::from(self.m[b])
        }

        /// [`Panel`]'s layout, written out independently of `quant.rs`'s packing.
        fn pack(&self, first: usize, panel: &mut Panel) {
            let kb = self.k / BLOCK;
            for r in 0..NR.min(self.n.saturating_sub(first)) {
                for b in 0..kb {
                    panel.d[b * NR + r] = self.d[(first + r) * kb + b];
                    panel.m[b * NR + r] = self.m[(first + r) * kb + b];
                    for j in 0..BLOCK {
                        let at = ((b * PAIRS + j / 2) * NR + r) * 2 + j % 2;
                        panel.q[at] = self.q[(first + r) * self.k + b * BLOCK + j];
                    }
                }
            }
        }
    }

    /// The kernel against a plain triple loop in f64 over the dequantized weights and the
    /// unrounded activations, on ragged shapes (rows not a multiple of the tile's 6, several
    /// blocks, outputs not a multiple of 32). The only error allowed is the activations'
    /// rounding to 16 bits (half a step, `max|x| / 65534` per value, times `|w|`) plus f32
    /// summation.
    #[test]
    fn matmul_matches_a_plain_product() {
        if !available() {
            eprintln!("no AVX-512 VNNI here: the kernel is not used, nothing to check");
            return;
        }
        let mut rng = kvtier_core::SplitMix64::new(11);
        for with_min in [true, false] {
            for (t, k, n) in [
                (1, 32, 1),
                (6, 64, 32),
                (7, 96, 33),
                (13, 160, 70),
                (40, 576, 45),
                (33, 1536, 100),
            ] {
                let w = Weights::random(n, k, with_min, &mut rng);
                // Activations over a wide range, some blocks all zero.
                let x: Vec<f32> = (0..t * k)
                    .map(|i| {
                        if (i / BLOCK) % 7 == 3 {
                            0.0
                        } else {
                            (rng.next_f32() - 0.5) * 8.0
                        }
                    })
                    .collect();
                let y = matmul(&x, t, k, n, with_min, |first, panel| w.pack(first, panel))
                    .expect("available");
                for i in 0..t {
                    let row = &x[i * k..(i + 1) * k];
                    let step: Vec<f64> = row
                        .chunks_exact(BLOCK)
                        .map(|b| f64::from(b.iter().fold(0f32, |a, v| a.max(v.abs()))) / 32767.0)
                        .collect();
                    for j in 0..n {
                        let (mut want, mut bound) = (0f64, 0f64);
                        for (p, &xv) in row.iter().enumerate() {
                            let wv = w.value(j, p);
                            want += wv * f64::from(xv);
                            bound +=
                                wv.abs() * (step[p / BLOCK] * 0.5 + 1e-6 * f64::from(xv).abs());
                        }
                        let got = f64::from(y[i * n + j]);
                        assert!(
                            (got - want).abs() <= bound + 1e-6,
                            "min={with_min} t={t} k={k} n={n} [{i},{j}]: {got} vs {want} (bound {bound})"
                        );
                    }
                }
            }
        }
    }

    /// The activations' vector quantizer gives [`quantize_block`]'s scales and quants (which
    /// the decode kernel uses), laid out as [`Activations`] says, on a ragged last tile, with
    /// ties, zero blocks and large values.
    #[test]
    fn activations_equal_quantize_block() {
        if !available() {
            eprintln!("no AVX-512 VNNI here: the quantizer is not used, nothing to check");
            return;
        }
        let mut rng = kvtier_core::SplitMix64::new(5);
        let (t, k) = (MR + 3, 96);
        let mut x: Vec<f32> = (0..t * k).map(|_| (rng.next_f32() - 0.5) * 1e3).collect();
        x[BLOCK..2 * BLOCK].fill(0.0);
        x[2 * BLOCK] = 32767.0;
        x[2 * BLOCK + 1] = 2.5;
        x[2 * BLOCK + 2] = -3.5;
        let acts = Activations::new(&x, t, k);
        let kb = k / BLOCK;
        for tile in 0..t.div_ceil(MR) {
            for i in 0..MR {
                let row = tile * MR + i;
                for b in 0..kb {
                    let (want_s, want_q) = if row < t {
                        quantize_block(&x[row * k + b * BLOCK..row * k + (b + 1) * BLOCK])
                    } else {
                        (0.0, [0; BLOCK])
                    };
                    let sum: i32 = want_q.iter().map(|&v| i32::from(v)).sum();
                    let at = tile * kb * MR + b * MR + i;
                    assert_eq!(acts.s[at], want_s, "row {row} block {b}");
                    assert_eq!(acts.s_sum[at], want_s * sum as f32, "row {row} block {b}");
                    for p in 0..PAIRS {
                        let got = acts.q[(tile * MR + i) * kb * PAIRS + b * PAIRS + p];
                        let want = [want_q[2 * p], want_q[2 * p + 1]];
                        assert_eq!(
                            [got as i16, (got >> 16) as i16],
                            want,
                            "row {row} block {b}"
                        );
                    }
                }
            }
        }
    }

    /// The rounding: to nearest on the block's own scale, ties to even, zeros staying zero.
    #[test]
    fn quantize_block_rounds_to_the_blocks_scale() {
        let mut x = [0f32; BLOCK];
        x[0] = -32767.0;
        x[1] = 1.0;
        x[2] = 10.4;
        x[3] = -10.6;
        x[4] = 2.5;
        x[5] = -3.5;
        x[6] = 32766.5;
        let (s, q) = quantize_block(&x);
        assert_eq!(s, 1.0);
        assert_eq!(&q[..8], &[-32767, 1, 10, -11, 2, -4, 32766, 0]);
        assert_eq!(quantize_block(&[0.0; BLOCK]), (0.0, [0; BLOCK]));
    }
}

//! Causal attention of a prefill chunk over the cached K/V, computed block by block with an
//! online softmax (the flash-attention schedule): for a tile of [`QT`] query rows of one head,
//! the scores of [`KB`] keys at a time, their running maximum and sum, and the weighted sum of
//! the values, so no `[queries, keys]` score matrix is ever materialized and keys after a
//! query's position are never visited past the tile's last position. One work item takes the
//! tiles of every query head sharing a K/V head ([`TILES_PER_GROUP`] per head), which read each
//! block of K and V in turn while it is in L1; items are split across rayon's pool.
//!
//! AVX-512 intrinsics (`std::arch`), the output accumulators of a tile held in zmm registers;
//! used only where the CPU has AVX-512 ([`crate::gemm::available`], checked at run time). Where
//! it also has AVX-512 VNNI the two products run in 16-bit integers ([`vnni`]: about 1.5x the
//! f32 kernel at 2-4k tokens of context), elsewhere in f32. The
//! model falls back to its candle attention elsewhere, and for head dims other than 32, 64
//! and 128. Hand-written because candle has no fused CPU attention: its ops materialize the
//! `[heads, queries, keys]` scores and a mask of the same size, several passes over memory per
//! layer that grow with the context.

use rayon::prelude::*;

/// Query rows per tile.
const QT: usize = 6;
/// Keys per step.
const KB: usize = 32;
/// Tiles of each query head one work item takes (with all the heads of a kv head).
const TILES_PER_GROUP: usize = 2;

/// The shape of one chunk's attention.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Queries in the chunk.
    pub queries: usize,
    /// Position of the first query; the keys are positions `0..start_pos + queries`.
    pub start_pos: usize,
}

/// Attention of `q` (`[heads][queries][head_dim]`, rotated) over `k` and `v` (each
/// `[start_pos + queries][kv_heads][head_dim]`), query `i` seeing keys `0..=start_pos + i`;
/// `[queries][heads * head_dim]`. `None` where the kernel does not run (no AVX-512, or a head
/// dim other than 32, 64, 128).
pub fn causal(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Option<Vec<f32>> {
    if !runs(s.heads, s.kv_heads, s.head_dim) {
        return None;
    }
    let total = s.start_pos + s.queries;
    assert_eq!(
        q.len(),
        s.heads * s.queries * s.head_dim,
        "q is not [heads][t][hd]"
    );
    assert_eq!(
        k.len(),
        total * s.kv_heads * s.head_dim,
        "k is not [total][kv][hd]"
    );
    assert_eq!(v.len(), k.len(), "v is not [total][kv][hd]");
    match s.head_dim {
        32 => Some(run::<32>(q, k, v, s)),
        64 => Some(run::<64>(q, k, v, s)),
        128 => Some(run::<128>(q, k, v, s)),
        _ => None,
    }
}

/// Whether [`causal`] computes attention of this shape here (the CPU has AVX-512, the head
/// dim is 32, 64 or 128, and the heads split evenly over the K/V heads).
pub fn runs(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    crate::gemm::available()
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && matches!(head_dim, 32 | 64 | 128)
}

fn run<const HD: usize>(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<f32> {
    if crate::qgemm::available() {
        return vnni::run::<HD>(q, k, v, s);
    }
    run_f32::<HD>(q, k, v, s)
}

/// The f32 kernel: every product and sum in f32 (where the CPU lacks AVX-512 VNNI).
fn run_f32<const HD: usize>(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<f32> {
    let total = s.start_pos + s.queries;
    let blocks = total.div_ceil(KB);
    // K per kv head, transposed per block of keys: kt[g][b][d][j] = k[b * KB + j][g][d]
    // (zeros past the last key).
    let kt: Vec<Vec<f32>> = (0..s.kv_heads)
        .into_par_iter()
        .map(|g| {
            let mut t = vec![0f32; blocks * HD * KB];
            for key in 0..total {
                let (b, j) = (key / KB, key % KB);
                let src = &k[(key * s.kv_heads + g) * HD..][..HD];
                for (d, &x) in src.iter().enumerate() {
                    t[(b * HD + d) * KB + j] = x;
                }
            }
            t
        })
        .collect();
    let groups = s.queries.div_ceil(QT * TILES_PER_GROUP);
    let scale = 1.0 / (HD as f32).sqrt();
    // One item per (kv head, group of TILES_PER_GROUP * QT queries): the tiles of every query
    // head on that kv head, which read each block of K and V while it is in L1.
    let outs: Vec<Vec<TileOut<HD>>> = (0..s.kv_heads * groups)
        .into_par_iter()
        .map(|item| {
            let g = item / groups;
            let tiles: Vec<Tile<HD>> = item_tiles(s, item, groups)
                .map(|(h, first)| {
                    // Scaled queries; rows past the chunk repeat the last one (their output is
                    // dropped).
                    let q: [[f32; HD]; QT] = std::array::from_fn(|r| {
                        let i = (first + r).min(s.queries - 1);
                        let row = &q[(h * s.queries + i) * HD..][..HD];
                        std::array::from_fn(|d| row[d] * scale)
                    });
                    let last =
                        std::array::from_fn(|r| s.start_pos + (first + r).min(s.queries - 1));
                    Tile { h, first, q, last }
                })
                .collect();
            let vg = VHead {
                v,
                kv_heads: s.kv_heads,
                g,
            };
            // SAFETY: `causal` returned early unless `gemm::available()`: the CPU has AVX-512F
            // and FMA, the only requirement of this `target_feature` function (otherwise safe
            // code).
            let rows = unsafe { tiles_avx512::<HD>(&tiles, &kt[g], &vg) };
            tiles
                .iter()
                .zip(rows)
                .map(|(t, r)| (t.h, t.first, r))
                .collect()
        })
        .collect();
    scatter_rows::<HD>(&outs, s)
}

/// The tiles of work item `item` (of `groups` per K/V head) as (query head, first row): one
/// item per (K/V head, group of `TILES_PER_GROUP * QT` queries) takes the tiles of every query
/// head on that K/V head, which read each block of K and V while it is in L1.
fn item_tiles(s: Shape, item: usize, groups: usize) -> impl Iterator<Item = (usize, usize)> {
    let (g, group) = (item / groups, item % groups);
    let rep = s.heads / s.kv_heads;
    (g * rep..(g + 1) * rep).flat_map(move |h| {
        (0..TILES_PER_GROUP)
            .map(move |t| (group * TILES_PER_GROUP + t) * QT)
            .take_while(move |&first| first < s.queries)
            .map(move |first| (h, first))
    })
}

/// The tiles' output rows in `[queries][heads * HD]` (rows past the chunk dropped).
fn scatter_rows<const HD: usize>(outs: &[Vec<TileOut<HD>>], s: Shape) -> Vec<f32> {
    let mut out = vec![0f32; s.queries * s.heads * HD];
    for (h, first, rows) in outs.iter().flatten() {
        for (r, row) in rows.iter().enumerate() {
            let i = first + r;
            if i < s.queries {
                out[(i * s.heads + h) * HD..][..HD].copy_from_slice(row);
            }
        }
    }
    out
}

/// A tile's head, first row, and output rows.
type TileOut<const HD: usize> = (usize, usize, [[f32; HD]; QT]);

/// `QT` query rows of one head.
struct Tile<const HD: usize> {
    h: usize,
    /// The chunk's index of the first row.
    first: usize,
    /// Scaled by `1 / sqrt(HD)`.
    q: [[f32; HD]; QT],
    /// Row `r` sees keys `0..=last[r]`.
    last: [usize; QT],
}

/// The values of one kv head.
struct VHead<'a> {
    v: &'a [f32],
    kv_heads: usize,
    g: usize,
}

impl VHead<'_> {
    #[inline(always)]
    fn row<const HD: usize>(&self, key: usize) -> &[f32; HD] {
        self.v[(key * self.kv_heads + self.g) * HD..][..HD]
            .try_into()
            .expect("a slice of HD values")
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn tiles_avx512<const HD: usize>(
    _tiles: &[Tile<HD>],
    _kt: &[f32],
    _v: &VHead,
) -> Vec<[[f32; HD]; QT]> {
    unreachable!("gemm::available() is false off x86_64")
}

/// Softmax attention of each tile (all on the kv head of `kt` and `v`), block of keys by
/// block of keys, with the accumulators of the tile at work in registers: per row `HD / 16`
/// vectors of the output and two of scores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn tiles_avx512<const HD: usize>(
    tiles: &[Tile<HD>],
    kt: &[f32],
    v: &VHead,
) -> Vec<[[f32; HD]; QT]> {
    match HD {
        32 => attend_tiles::<HD, 2>(tiles, kt, v),
        64 => attend_tiles::<HD, 4>(tiles, kt, v),
        128 => attend_tiles::<HD, 8>(tiles, kt, v),
        _ => unreachable!("causal() takes head dims 32, 64 and 128 only"),
    }
}

/// Sixteen lanes from the start of `s`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn load(s: &[f32]) -> std::arch::x86_64::__m512 {
    let s = &s[..16];
    // SAFETY: `s` holds 16 f32 (the slice above checked it); the load is unaligned.
    unsafe { std::arch::x86_64::_mm512_loadu_ps(s.as_ptr()) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn attend_tiles<const HD: usize, const V: usize>(
    tiles: &[Tile<HD>],
    kt: &[f32],
    v: &VHead,
) -> Vec<[[f32; HD]; QT]> {
    use std::arch::x86_64::*;
    debug_assert_eq!(V * 16, HD);
    // Per tile: the output accumulators, and per row the running maximum and sum.
    let mut state: Vec<TileState<V>> = tiles
        .iter()
        .map(|_| {
            (
                [[_mm512_setzero_ps(); V]; QT],
                [f32::NEG_INFINITY; QT],
                [0f32; QT],
            )
        })
        .collect();
    let ends: Vec<usize> = tiles
        .iter()
        .map(|t| t.last.iter().max().copied().unwrap_or(0) + 1)
        .collect();
    let end_all = ends.iter().max().copied().unwrap_or(0);
    let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    let mut p = [[0f32; KB]; QT];
    let mut scale = [0f32; QT];
    for (b, kb) in kt
        .chunks_exact(HD * KB)
        .enumerate()
        .take(end_all.div_ceil(KB))
    {
        let key0 = b * KB;
        for ((tile, (acc, max, sum)), &end) in tiles.iter().zip(state.iter_mut()).zip(&ends) {
            if key0 >= end {
                // Every key of this block is after every row of the tile.
                continue;
            }
            let (q, last) = (&tile.q, &tile.last);
            let mut sc = [[_mm512_setzero_ps(); 2]; QT];
            for (d, kd) in kb.chunks_exact(KB).enumerate() {
                let (k0, k1) = (load(kd), load(&kd[16..]));
                for (s, qr) in sc.iter_mut().zip(q) {
                    let a = _mm512_set1_ps(qr[d]);
                    s[0] = _mm512_fmadd_ps(a, k0, s[0]);
                    s[1] = _mm512_fmadd_ps(a, k1, s[1]);
                }
            }
            let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
            for r in 0..QT {
                // Keys after this row's position (and past the last key) do not count. Positions
                // fit an i32: the context is far below 2^31.
                let lim = _mm512_set1_epi32(last[r] as i32);
                let idx0 = _mm512_add_epi32(iota, _mm512_set1_epi32(key0 as i32));
                let idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(16));
                let s0 = _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(idx0, lim), sc[r][0]);
                let s1 = _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(idx1, lim), sc[r][1]);
                let m = max[r].max(_mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
                // Key 0 is in the first block for every row, so `m` is finite from there on.
                let alpha = (max[r] - m).exp();
                max[r] = m;
                let mv = _mm512_set1_ps(m);
                let (p0, p1) = (exp16(_mm512_sub_ps(s0, mv)), exp16(_mm512_sub_ps(s1, mv)));
                sum[r] = sum[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                // SAFETY: `p[r]` holds KB = 32 f32: two unaligned 16-lane stores.
                unsafe {
                    _mm512_storeu_ps(p[r].as_mut_ptr(), p0);
                    _mm512_storeu_ps(p[r][16..].as_mut_ptr(), p1);
                }
                scale[r] = alpha;
            }
            // A local copy indexed only by constants (the loops unroll), so that it lives in
            // registers across the keys.
            let mut a = *acc;
            for (ar, &s) in a.iter_mut().zip(&scale) {
                let sv = _mm512_set1_ps(s);
                for x in ar.iter_mut() {
                    *x = _mm512_mul_ps(*x, sv);
                }
            }
            for j in 0..KB.min(end - key0) {
                let vr = v.row::<HD>(key0 + j);
                let vv: [__m512; V] = std::array::from_fn(|c| load(&vr[c * 16..]));
                for (ar, pr) in a.iter_mut().zip(&p) {
                    let pj = _mm512_set1_ps(pr[j]);
                    for (x, &vc) in ar.iter_mut().zip(&vv) {
                        *x = _mm512_fmadd_ps(pj, vc, *x);
                    }
                }
            }
            *acc = a;
        }
    }
    state
        .iter()
        .map(|(acc, _, sum)| finish::<HD, V>(acc, sum))
        .collect()
}

/// A tile's output accumulators, and per row the running maximum and sum of the softmax.
#[cfg(target_arch = "x86_64")]
type TileState<const V: usize> = ([[std::arch::x86_64::__m512; V]; QT], [f32; QT], [f32; QT]);

/// The output rows: the accumulators over the softmax sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn finish<const HD: usize, const V: usize>(
    acc: &[[std::arch::x86_64::__m512; V]; QT],
    sum: &[f32; QT],
) -> [[f32; HD]; QT] {
    use std::arch::x86_64::*;
    let mut out = [[0f32; HD]; QT];
    for ((o, a), &s) in out.iter_mut().zip(acc).zip(sum) {
        let inv = _mm512_set1_ps(1.0 / s);
        for (c, &x) in a.iter().enumerate() {
            // SAFETY: `o` holds HD = 16 * V f32 and `c < V`: 16 f32 from `16 * c` are in it.
            unsafe { _mm512_storeu_ps(o[c * 16..].as_mut_ptr(), _mm512_mul_ps(x, inv)) };
        }
    }
    out
}

/// `e^x` of 16 lanes, each `<= 0` or `-inf` (which gives 0), without a libm call:
/// `x = n ln 2 + r`, `e^r` by Cephes' `expf` polynomial (within about 1 ulp), times `2^n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Below this e^x is under f32's smallest normal; the result is then 0.
    const MIN: f32 = -87.3;
    let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(MIN));
    let xc = _mm512_max_ps(x, _mm512_set1_ps(MIN));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), xc);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(e, n))
}

/// [`exp16`] of 16 values (for the tests).
#[cfg(all(test, target_arch = "x86_64"))]
#[target_feature(enable = "avx512f,fma")]
fn exp_lanes(x: &[f32; 16]) -> [f32; 16] {
    let mut out = [0f32; 16];
    // SAFETY: `out` holds 16 f32.
    unsafe { std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), exp16(load(x))) };
    out
}

/// The kernel in integers, where the CPU has AVX-512 VNNI ([`crate::qgemm::available`]): the
/// two products of attention, scores `q . k` and the weighted sum of the values, run on
/// `vpdpwssd` (32 multiply-adds of 16-bit integers per instruction, twice the f32 FMA's 16),
/// the softmax in f32 as in the f32 kernel.
///
/// * Queries and keys are rounded to integers per row (a query row of a head, a key of a K/V
///   head) with one f32 scale each: `x = s * q`, `|q| <= `[`qk_max`]`(HD)`, the largest that
///   keeps a score's `HD` products in an i32. A score is the exact integer dot product times
///   the two scales.
/// * Values are rounded per key (`|q| <= 5792`), and each key's softmax weight is multiplied
///   by that key's scale, then the 64 weights of a block are rounded per row (`<= 5792`), so
///   a block's weighted sum is one exact i32 per output value (64 products of at most
///   5792^2) and is added to the f32 accumulator with the block's scale.
///
/// The rounding errors are relative to the row's largest value: about 2^-13 of it per value.
/// `scripts/tests/test_gguf_reference.py` holds the model's greedy tokens and logits to the
/// float32 reference with this kernel, as with the f32 one.
mod vnni {
    use rayon::prelude::*;

    use super::{QT, Shape, TILES_PER_GROUP, TileOut, item_tiles, scatter_rows};

    /// Keys per step: twice the f32 kernel's, so that the softmax's per-row work (a maximum
    /// across lanes, the rescaling factor, the weights' scale) is shared by 64 keys.
    const KB: usize = 64;

    /// The largest magnitude of a rounded value in a weighted sum of values: a block's [`KB`]
    /// products of two fit an i32 (`(i32::MAX / 64).isqrt()`).
    const PV_MAX: f32 = 5792.0;

    /// The largest magnitude of a rounded query or key value: `hd` products of two fit an i32.
    fn qk_max(hd: usize) -> f32 {
        ((i32::MAX as u64 / hd as u64).isqrt()) as f32
    }

    /// One K/V head's keys and values rounded to integers, per key.
    struct KvHead {
        /// `[block][HD / 2][KB][2]`: value `d` of key `b * KB + j` at
        /// `((b * HD / 2 + d / 2) * KB + j) * 2 + d % 2`, so one i32 lane holds a key's pair
        /// of values and 16 lanes hold 16 keys (zeros past the last key).
        k: Vec<i16>,
        /// `[block * KB]`: each key's scale (0 past the last key).
        ks: Vec<f32>,
        /// `[block][KB / 2][HD][2]`: value `c` of key `b * KB + j` at
        /// `((b * KB / 2 + j / 2) * HD + c) * 2 + j % 2`, so one i32 lane holds a pair of keys'
        /// value `c` (zeros past the last key).
        v: Vec<i16>,
        /// `[block * KB]`: each key's scale (0 past the last key).
        vs: Vec<f32>,
    }

    /// A tile of [`QT`] query rows of head `h`, from the chunk's row `first`.
    struct Tile {
        h: usize,
        first: usize,
        /// The chunk's row of each tile row (rows past the chunk repeat the last one).
        rows: [usize; QT],
        /// Row `r` sees keys `0..=last[r]`.
        last: [usize; QT],
    }

    pub(super) fn run<const HD: usize>(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<f32> {
        let total = s.start_pos + s.queries;
        let heads: Vec<KvHead> = (0..s.kv_heads)
            .into_par_iter()
            // SAFETY: `causal` reaches this module only where `qgemm::available()`: the CPU has
            // AVX-512F, BW and VNNI, the requirements of these `target_feature` functions
            // (otherwise safe code).
            .map(|g| unsafe { kv_head::<HD>(k, v, total, s.kv_heads, g) })
            .collect();
        let groups = s.queries.div_ceil(QT * TILES_PER_GROUP);
        let outs: Vec<Vec<TileOut<HD>>> = (0..s.kv_heads * groups)
            .into_par_iter()
            .map(|item| {
                let g = item / groups;
                let tiles: Vec<Tile> = item_tiles(s, item, groups)
                    .map(|(h, first)| {
                        let rows = std::array::from_fn(|r| (first + r).min(s.queries - 1));
                        let last = rows.map(|i| s.start_pos + i);
                        Tile {
                            h,
                            first,
                            rows,
                            last,
                        }
                    })
                    .collect();
                // SAFETY: as above.
                let out = unsafe { tiles_vnni::<HD>(&tiles, q, s.queries, &heads[g]) };
                tiles
                    .iter()
                    .zip(out)
                    .map(|(t, r)| (t.h, t.first, r))
                    .collect()
            })
            .collect();
        scatter_rows::<HD>(&outs, s)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn kv_head<const HD: usize>(
        _: &[f32],
        _: &[f32],
        _: usize,
        _: usize,
        _: usize,
    ) -> KvHead {
        unreachable!("qgemm::available() is false off x86_64")
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn tiles_vnni<const HD: usize>(
        _: &[Tile],
        _: &[f32],
        _: usize,
        _: &KvHead,
    ) -> Vec<[[f32; HD]; QT]> {
        unreachable!("qgemm::available() is false off x86_64")
    }

    /// `HD` values `x * mul` rounded to integers of magnitude at most `max` into `out`, and
    /// their scale (`x * mul ~ scale * out`; 0 for a row of zeros).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn quantize<const HD: usize>(x: &[f32], mul: f32, max: f32, out: &mut [i16; HD]) -> f32 {
        use std::arch::x86_64::*;
        let x = &x[..HD];
        let mut m = _mm512_setzero_ps();
        for c in x.chunks_exact(16) {
            m = _mm512_max_ps(m, _mm512_abs_ps(super::load(c)));
        }
        let amax = _mm512_reduce_max_ps(m) * mul.abs();
        if amax == 0.0 {
            out.fill(0);
            return 0.0;
        }
        let inv = _mm512_set1_ps(mul * max / amax);
        for (c, o) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // Rounded to nearest, ties to even (the default MXCSR mode); at most `max` in
            // magnitude, which fits an i16.
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(super::load(c), inv));
            // SAFETY: `o` holds 16 i16 (chunks_exact): one 32-byte unaligned store.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(q)) };
        }
        amax / max
    }

    /// Keys and values of K/V head `g` rounded per key, laid out for [`tiles_vnni`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn kv_head<const HD: usize>(
        k: &[f32],
        v: &[f32],
        total: usize,
        kv_heads: usize,
        g: usize,
    ) -> KvHead {
        let blocks = total.div_ceil(KB);
        let mut h = KvHead {
            k: vec![0; blocks * KB * HD],
            ks: vec![0.0; blocks * KB],
            v: vec![0; blocks * KB * HD],
            vs: vec![0.0; blocks * KB],
        };
        let mut row = [0i16; HD];
        for key in 0..total {
            let (b, j) = (key / KB, key % KB);
            let at = (key * kv_heads + g) * HD;
            h.ks[key] = quantize::<HD>(&k[at..], 1.0, qk_max(HD), &mut row);
            for (d, &x) in row.iter().enumerate() {
                h.k[((b * HD / 2 + d / 2) * KB + j) * 2 + d % 2] = x;
            }
            h.vs[key] = quantize::<HD>(&v[at..], 1.0, PV_MAX, &mut row);
            let base = (b * KB / 2 + j / 2) * HD * 2 + j % 2;
            for (c, &x) in row.iter().enumerate() {
                h.v[base + c * 2] = x;
            }
        }
        h
    }

    /// 16 i32 lanes from the start of `s` (32 i16).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn load_i(s: &[i16]) -> std::arch::x86_64::__m512i {
        let s = &s[..32];
        // SAFETY: `s` holds 32 i16, 64 bytes (the slice above checked it); the load is
        // unaligned.
        unsafe { std::arch::x86_64::_mm512_loadu_si512(s.as_ptr().cast()) }
    }

    /// Softmax attention of each tile over the K/V head `kv`, block of keys by block of keys.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    fn tiles_vnni<const HD: usize>(
        tiles: &[Tile],
        q: &[f32],
        queries: usize,
        kv: &KvHead,
    ) -> Vec<[[f32; HD]; QT]> {
        match HD {
            32 => attend::<HD, 2>(tiles, q, queries, kv),
            64 => attend::<HD, 4>(tiles, q, queries, kv),
            128 => attend::<HD, 8>(tiles, q, queries, kv),
            _ => unreachable!("causal() takes head dims 32, 64 and 128 only"),
        }
    }

    /// A tile's output accumulators, and per row the running maximum and the running sum of
    /// the weights in 16 lanes.
    #[cfg(target_arch = "x86_64")]
    type TileState<const V: usize> = (
        [[std::arch::x86_64::__m512; V]; QT],
        [f32; QT],
        [std::arch::x86_64::__m512; QT],
    );

    /// A tile's queries rounded to integers: per row the pairs of values as i32 lanes (the
    /// first `HD / 2` of 64 used) and the row's scale.
    type TileQueries = ([[i32; 64]; QT], [f32; QT]);

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    #[inline]
    fn attend<const HD: usize, const V: usize>(
        tiles: &[Tile],
        q: &[f32],
        queries: usize,
        kv: &KvHead,
    ) -> Vec<[[f32; HD]; QT]> {
        use std::arch::x86_64::*;
        debug_assert_eq!(V * 16, HD);
        let qk = qk_max(HD);
        let scale = 1.0 / (HD as f32).sqrt();
        let tq: Vec<TileQueries> = tiles
            .iter()
            .map(|t| {
                let mut pairs = [[0i32; 64]; QT];
                let mut qs = [0f32; QT];
                let mut row = [0i16; HD];
                for r in 0..QT {
                    let x = &q[(t.h * queries + t.rows[r]) * HD..];
                    qs[r] = quantize::<HD>(x, scale, qk, &mut row);
                    for (p, two) in pairs[r].iter_mut().zip(row.chunks_exact(2)) {
                        *p = i32::from(two[0] as u16) | (i32::from(two[1]) << 16);
                    }
                }
                (pairs, qs)
            })
            .collect();
        // Per tile: the output accumulators, and per row the running maximum and the running
        // sum of the weights in 16 lanes (added across lanes once, at the end).
        let mut state: Vec<TileState<V>> = tiles
            .iter()
            .map(|_| {
                (
                    [[_mm512_setzero_ps(); V]; QT],
                    [f32::NEG_INFINITY; QT],
                    [_mm512_setzero_ps(); QT],
                )
            })
            .collect();
        let ends: Vec<usize> = tiles
            .iter()
            .map(|t| t.last.iter().max().copied().unwrap_or(0) + 1)
            .collect();
        let end_all = ends.iter().max().copied().unwrap_or(0);
        let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        // Per row: the block's rounded weights (64 i16 as 32 pairs) and their scale, and the
        // factor that rescales the accumulators to the new running maximum.
        let mut w = [[0i32; KB / 2]; QT];
        let mut ws = [0f32; QT];
        let mut alpha = [_mm512_setzero_ps(); QT];
        for b in 0..end_all.div_ceil(KB) {
            let key0 = b * KB;
            let kb = &kv.k[b * KB * HD..][..KB * HD];
            let vb = &kv.v[b * KB * HD..][..KB * HD];
            let ks: [__m512; 4] = std::array::from_fn(|c| super::load(&kv.ks[key0 + 16 * c..]));
            let vs: [__m512; 4] = std::array::from_fn(|c| super::load(&kv.vs[key0 + 16 * c..]));
            let idx: [__m512i; 4] = std::array::from_fn(|c| {
                _mm512_add_epi32(iota, _mm512_set1_epi32((key0 + 16 * c) as i32))
            });
            for (((tile, (pairs, qs)), (acc, max, sum)), &end) in
                tiles.iter().zip(&tq).zip(state.iter_mut()).zip(&ends)
            {
                if key0 >= end {
                    // Every key of this block is after every row of the tile.
                    continue;
                }
                let mut sc = [[_mm512_setzero_si512(); 4]; QT];
                for (dp, kd) in kb.chunks_exact(KB * 2).take(HD / 2).enumerate() {
                    let kk: [__m512i; 4] = std::array::from_fn(|c| load_i(&kd[32 * c..]));
                    for (s, pr) in sc.iter_mut().zip(pairs) {
                        let a = _mm512_set1_epi32(pr[dp]);
                        for (x, &kc) in s.iter_mut().zip(&kk) {
                            *x = _mm512_dpwssd_epi32(*x, a, kc);
                        }
                    }
                }
                for r in 0..QT {
                    let qsr = _mm512_set1_ps(qs[r]);
                    // Keys after this row's position (and past the last key) do not count.
                    // Positions fit an i32: the context is far below 2^31.
                    let lim = _mm512_set1_epi32(tile.last[r] as i32);
                    let sf: [__m512; 4] = std::array::from_fn(|c| {
                        let x =
                            _mm512_mul_ps(_mm512_cvtepi32_ps(sc[r][c]), _mm512_mul_ps(ks[c], qsr));
                        _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(idx[c], lim), x)
                    });
                    let top =
                        _mm512_max_ps(_mm512_max_ps(sf[0], sf[1]), _mm512_max_ps(sf[2], sf[3]));
                    let m = max[r].max(_mm512_reduce_max_ps(top));
                    // Key 0 is in the first block for every row, so `m` is finite from there on
                    // (and the first factor is e^-inf = 0).
                    alpha[r] = super::exp16(_mm512_set1_ps(max[r] - m));
                    max[r] = m;
                    let mv = _mm512_set1_ps(m);
                    let p: [__m512; 4] =
                        std::array::from_fn(|c| super::exp16(_mm512_sub_ps(sf[c], mv)));
                    let ps = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
                    sum[r] = _mm512_fmadd_ps(sum[r], alpha[r], ps);
                    // The weights times each key's value scale, rounded for the block.
                    let wf: [__m512; 4] = std::array::from_fn(|c| _mm512_mul_ps(p[c], vs[c]));
                    let wtop =
                        _mm512_max_ps(_mm512_max_ps(wf[0], wf[1]), _mm512_max_ps(wf[2], wf[3]));
                    let wmax = _mm512_reduce_max_ps(wtop);
                    let inv = _mm512_set1_ps(if wmax > 0.0 { PV_MAX / wmax } else { 0.0 });
                    ws[r] = wmax / PV_MAX;
                    for (c, &x) in wf.iter().enumerate() {
                        let h = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)));
                        // SAFETY: `w[r]` holds 32 i32: four 32-byte unaligned stores of 16 i16
                        // each (keys 16c..16c + 16 at i32 8c), so pair `p` (keys 2p, 2p + 1) is
                        // one i32, the first key low.
                        unsafe { _mm256_storeu_si256(w[r][8 * c..].as_mut_ptr().cast(), h) };
                    }
                }
                // The block's weighted sums in i32, in registers, then into the accumulators.
                let mut bs = [[_mm512_setzero_si512(); V]; QT];
                let pairs_in = (end - key0).min(KB).div_ceil(2);
                for (jp, vj) in vb.chunks_exact(HD * 2).take(pairs_in).enumerate() {
                    let vv: [__m512i; V] = std::array::from_fn(|c| load_i(&vj[c * 32..]));
                    for (br, wr) in bs.iter_mut().zip(&w) {
                        let a = _mm512_set1_epi32(wr[jp]);
                        for (x, &vc) in br.iter_mut().zip(&vv) {
                            *x = _mm512_dpwssd_epi32(*x, a, vc);
                        }
                    }
                }
                for ((ar, br), (&al, &sw)) in acc.iter_mut().zip(&bs).zip(alpha.iter().zip(&ws)) {
                    let sw = _mm512_set1_ps(sw);
                    for (x, &bc) in ar.iter_mut().zip(br) {
                        *x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bc), sw, _mm512_mul_ps(*x, al));
                    }
                }
            }
        }
        state
            .iter()
            .map(|(acc, _, sum)| super::finish::<HD, V>(acc, &sum.map(|s| _mm512_reduce_add_ps(s))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain attention in f64: scores, causal mask, softmax, weighted values.
    fn reference(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<f32> {
        let (hd, kvh) = (s.head_dim, s.kv_heads);
        let rep = s.heads / kvh;
        let mut out = vec![0f32; s.queries * s.heads * hd];
        for h in 0..s.heads {
            let g = h / rep;
            for i in 0..s.queries {
                let qr = &q[(h * s.queries + i) * hd..][..hd];
                let keys = s.start_pos + i + 1;
                let sc: Vec<f64> = (0..keys)
                    .map(|j| {
                        let kr = &k[(j * kvh + g) * hd..][..hd];
                        let dot: f64 = qr.iter().zip(kr).map(|(a, b)| f64::from(a * b)).sum();
                        dot / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..keys)
                        .map(|j| e[j] * f64::from(v[(j * kvh + g) * hd + d]))
                        .sum();
                    out[(i * s.heads + h) * hd + d] = (o / z) as f32;
                }
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_matches_std() {
        if !crate::gemm::available() {
            eprintln!("no AVX-512 here: the kernel is not used, nothing to check");
            return;
        }
        let xs: Vec<f32> = (0..=20_000)
            .map(|i| -90.0 * i as f32 / 20_000.0)
            .chain([f32::NEG_INFINITY; 15])
            .collect();
        for c in xs.chunks(16) {
            let mut x = [f32::NEG_INFINITY; 16];
            x[..c.len()].copy_from_slice(c);
            // SAFETY: the CPU has AVX-512F and FMA (checked above).
            let got = unsafe { exp_lanes(&x) };
            for (&x, g) in x.iter().zip(got) {
                let want = x.exp();
                assert!(
                    (g - want).abs() <= 2e-7 * want + 2.0 * f32::MIN_POSITIVE,
                    "exp({x}) = {g}, std {want}"
                );
            }
        }
    }

    /// Every kernel that runs here on these inputs: its name, its output and how far from the
    /// f64 reference it may be. The f32 kernel differs from it only in the order of f32 sums;
    /// the integer kernel also rounds queries, keys, values and weights to 13-14 bits of their
    /// row's largest value (on these inputs, values up to 3 in magnitude with sharp scores,
    /// the largest differences seen were 0.2-1.7e-3).
    fn kernels(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<(&'static str, Vec<f32>, f32)> {
        fn by_dim(s: Shape, f32_kernel: bool, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
            match (s.head_dim, f32_kernel) {
                (32, true) => run_f32::<32>(q, k, v, s),
                (64, true) => run_f32::<64>(q, k, v, s),
                (128, true) => run_f32::<128>(q, k, v, s),
                (32, false) => vnni::run::<32>(q, k, v, s),
                (64, false) => vnni::run::<64>(q, k, v, s),
                (128, false) => vnni::run::<128>(q, k, v, s),
                _ => unreachable!("head dims 32, 64, 128"),
            }
        }
        let mut out = vec![("f32", by_dim(s, true, q, k, v), 1e-4)];
        if crate::qgemm::available() {
            out.push(("vnni", by_dim(s, false, q, k, v), 4e-3));
        } else {
            eprintln!("no AVX-512 VNNI here: the integer kernel is not used, not checked");
        }
        out
    }

    #[test]
    fn causal_attention_matches_a_plain_softmax() {
        if !crate::gemm::available() {
            eprintln!("no AVX-512 here: the kernel is not used, nothing to check");
            return;
        }
        let mut rng = kvtier_core::SplitMix64::new(11);
        // (heads, kv heads, head dim, queries, start): ragged tiles and key blocks, a chunk
        // after a cached prefix, one query.
        for (heads, kv_heads, head_dim, queries, start_pos) in [
            (1, 1, 32, 1, 0),
            (3, 1, 64, 7, 0),
            (9, 3, 64, 40, 0),
            (9, 3, 64, 33, 64),
            (4, 2, 128, 13, 5),
            (2, 2, 32, 70, 100),
        ] {
            let s = Shape {
                heads,
                kv_heads,
                head_dim,
                queries,
                start_pos,
            };
            let total = start_pos + queries;
            // Scores spread over several units, as a trained model's are.
            let mut rand =
                |n: usize| -> Vec<f32> { (0..n).map(|_| (rng.next_f32() - 0.5) * 6.0).collect() };
            let q = rand(heads * queries * head_dim);
            let k = rand(total * kv_heads * head_dim);
            let v = rand(total * kv_heads * head_dim);
            let want = reference(&q, &k, &v, s);
            for (kernel, got, tolerance) in kernels(&q, &k, &v, s) {
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, f32::max);
                eprintln!("{kernel} {s:?}: largest difference {worst:e}");
                assert!(
                    worst <= tolerance,
                    "{kernel} {s:?}: largest difference {worst} over {tolerance}"
                );
            }
            // What the model calls: the integer kernel where the CPU has VNNI.
            let got = causal(&q, &k, &v, s).expect("available");
            let (_, chosen, _) = kernels(&q, &k, &v, s).pop().expect("one kernel at least");
            assert_eq!(got, chosen, "{s:?}: causal() runs the best kernel here");
        }
        let odd = Shape {
            heads: 1,
            kv_heads: 1,
            head_dim: 48,
            queries: 1,
            start_pos: 0,
        };
        assert!(causal(&[0.0; 48], &[0.0; 48], &[0.0; 48], odd).is_none());
    }
}

//! Causal attention of a prefill chunk over the cached K/V, computed block by block with an
//! online softmax (the flash-attention schedule): for a tile of [`QT`] query rows of one head,
//! the scores of [`KB`] keys at a time, their running maximum and sum, and the weighted sum of
//! the values, so no `[queries, keys]` score matrix is ever materialized and keys after a
//! query's position are never visited past the tile's last position. One work item takes the
//! tiles of every query head sharing a K/V head ([`TILES_PER_GROUP`] per head), which read each
//! block of K and V in turn while it is in L1; items are split across rayon's pool.
//!
//! AVX-512 intrinsics (`std::arch`), the output accumulators of a tile held in zmm registers;
//! used only where the CPU has AVX-512 ([`crate::gemm::available`], checked at run time). The
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
pub(crate) struct Shape {
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
pub(crate) fn causal(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Option<Vec<f32>> {
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
pub(crate) fn runs(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    crate::gemm::available()
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && matches!(head_dim, 32 | 64 | 128)
}

fn run<const HD: usize>(q: &[f32], k: &[f32], v: &[f32], s: Shape) -> Vec<f32> {
    let total = s.start_pos + s.queries;
    let blocks = total.div_ceil(KB);
    let rep = s.heads / s.kv_heads;
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
            let (g, group) = (item / groups, item % groups);
            let mut tiles = Vec::new();
            for h in g * rep..(g + 1) * rep {
                for t in 0..TILES_PER_GROUP {
                    let first = (group * TILES_PER_GROUP + t) * QT;
                    if first >= s.queries {
                        break;
                    }
                    // Scaled queries; rows past the chunk repeat the last one (their output is
                    // dropped).
                    let q: [[f32; HD]; QT] = std::array::from_fn(|r| {
                        let i = (first + r).min(s.queries - 1);
                        let row = &q[(h * s.queries + i) * HD..][..HD];
                        std::array::from_fn(|d| row[d] * scale)
                    });
                    let last =
                        std::array::from_fn(|r| s.start_pos + (first + r).min(s.queries - 1));
                    tiles.push(Tile { h, first, q, last });
                }
            }
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
            let got = causal(&q, &k, &v, s).expect("available");
            let want = reference(&q, &k, &v, s);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-4, "{s:?} [{i}]: {g} vs {w}");
            }
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

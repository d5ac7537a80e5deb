//! The worker's own kernel for Q4_1 and Q8_0 matrices times f32 activations. candle computes
//! Q4_1 with a scalar loop, and rounds activations to 8 bits; SmolLM2's GGUF is Q4_1 (its
//! embedding and LM head Q8_0), so the worker multiplies those here: the weights stay in their
//! blocks (Q4_1: one scale `d` and one minimum `m` per 32 weights, a weight being `d * q + m`
//! with `q` in 0..16; Q8_0: `d * q` with `q` a signed byte), each activation
//! row is quantized to 16 bits per 32-value block, and the dot products run in integers.
//! llama.cpp and candle round activations to 8 bits (Q8_1); 16 bits keeps each product within
//! about 1e-4 of the f32 product of the dequantized weights, so the model's logits follow an
//! f32 reference closely (scripts/tests/test_gguf_reference.py). The loops are plain Rust
//! compiled a second time with AVX2 enabled, chosen at run time; each token's rows are split
//! across rayon's pool. From `PREFILL_FROM_TOKENS` tokens on (prefill) a register-blocked GEMM
//! takes over: [`crate::qgemm`]'s integer one (the same 16-bit activations, AVX-512 VNNI) where
//! the CPU has it, else [`crate::gemm`]'s f32 one on panels dequantized strip by strip
//! (AVX-512F), else candle's f32 matmul on the whole dequantized matrix.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::{KernelError, Result};

/// Values per quantized block (Q4_1, Q8_0 and the activations').
const BLOCK: usize = 32;
/// Bytes of one Q4_1 block in a GGUF file: f16 `d`, f16 `m`, 16 bytes of nibbles.
const Q4_1_BLOCK_BYTES: usize = 20;
/// From this many tokens on (prefill), the matrix is multiplied by a register-blocked GEMM
/// ([`crate::qgemm`]'s integer one, or [`crate::gemm`]'s f32 one on dequantized panels, or
/// candle's f32 matmul on the whole dequantized matrix, whichever the CPU allows); below it
/// (decode, small batches) the kernel here reads the quantized blocks row by row.
const PREFILL_FROM_TOKENS: usize = 32;
/// Output rows one work item computes.
const ROWS_PER_ITEM: usize = 64;

/// Bytes of one Q8_0 block in a GGUF file: f16 `d`, 32 signed bytes.
const Q8_0_BLOCK_BYTES: usize = 34;

/// The GEMMs a prefill chunk can run on, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrefillKernel {
    /// [`crate::qgemm`]: integer quants times 16-bit activations (AVX-512 VNNI).
    Integer,
    /// [`crate::gemm`]: f32 panels dequantized strip by strip (AVX-512F).
    F32,
    /// candle's f32 matmul on the whole dequantized matrix (any CPU).
    Candle,
}

impl PrefillKernel {
    /// The fastest this CPU runs.
    fn best() -> Self {
        if crate::qgemm::available() {
            Self::Integer
        } else if crate::gemm::available() {
            Self::F32
        } else {
            Self::Candle
        }
    }
}

/// A `[rows, cols]` quantized matrix (rows are output features), scales widened to f32.
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

/// The blocks, row-major.
enum Blocks {
    /// Per block `(d, m)`, and the nibbles: element `j < 16` in the low nibble of byte `j`,
    /// element `j + 16` in its high nibble (ggml's layout); a weight is `d * q + m`.
    Q4_1 {
        scales: Vec<(f32, f32)>,
        nibbles: Vec<[u8; 16]>,
    },
    /// Per block `d` and 32 signed bytes; a weight is `d * q`.
    Q8_0 { scales: Vec<f32>, q: Vec<[i8; 32]> },
}

/// One activation block: 32 values `d * q`.
#[derive(Clone, Copy)]
struct Q16Block {
    d: f32,
    /// `d * sum(q)`, for the Q4_1 minimum's term.
    d_sum: f32,
    q: [i16; BLOCK],
}

impl QuantMatrix {
    /// The matrix of a Q4_1 or Q8_0 tensor (`[rows, cols]`, `cols` a multiple of 32); `None`
    /// for other dtypes.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let block_bytes = match t.dtype() {
            GgmlDType::Q4_1 => Q4_1_BLOCK_BYTES,
            GgmlDType::Q8_0 => Q8_0_BLOCK_BYTES,
            _ => return Ok(None),
        };
        let (rows, cols) = t.shape().dims2()?;
        let data = t.data()?;
        if !cols.is_multiple_of(BLOCK) || data.len() != rows * cols / BLOCK * block_bytes {
            return Err(KernelError::Shape {
                what: format!("({:?} tensor)", t.dtype()),
                reason: format!("{rows}x{cols} does not match {} bytes", data.len()),
            });
        }
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let chunks = data.chunks_exact(block_bytes);
        let blocks = if t.dtype() == GgmlDType::Q4_1 {
            let (scales, nibbles) = chunks
                .map(|b| {
                    let mut q = [0u8; 16];
                    q.copy_from_slice(&b[4..]);
                    ((f16(&b[0..2]), f16(&b[2..4])), q)
                })
                .unzip();
            Blocks::Q4_1 { scales, nibbles }
        } else {
            let (scales, q) = chunks
                .map(|b| {
                    let q: [i8; 32] = std::array::from_fn(|j| b[2 + j] as i8);
                    (f16(&b[0..2]), q)
                })
                .unzip();
            Blocks::Q8_0 { scales, q }
        };
        Ok(Some(Self { rows, cols, blocks }))
    }

    /// Bytes of the weights as the file stores them.
    pub fn size_bytes(&self) -> usize {
        match &self.blocks {
            Blocks::Q4_1 { scales, .. } => scales.len() * Q4_1_BLOCK_BYTES,
            Blocks::Q8_0 { scales, .. } => scales.len() * Q8_0_BLOCK_BYTES,
        }
    }

    /// `x @ self^T`: `x` is `[t, cols]` f32, the result `[t, rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, cols) = x.dims2()?;
        if cols != self.cols {
            return Err(KernelError::Shape {
                what: "(quantized matmul)".to_owned(),
                reason: format!("input has {cols} columns, the weights {}", self.cols),
            });
        }
        if t >= PREFILL_FROM_TOKENS {
            return self.prefill(x, PrefillKernel::best());
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let acts: Vec<Q16Block> = xs.chunks_exact(BLOCK).map(quantize_block).collect();
        // Rows split across the pool; each row (in L1) against every token, so a batched
        // decode step reads the weights once. `out_t` is `[rows, t]`.
        let mut out_t = vec![0f32; t * self.rows];
        out_t
            .par_chunks_mut(ROWS_PER_ITEM * t)
            .enumerate()
            .for_each(|(i, dst)| self.rows_into(&acts, i * ROWS_PER_ITEM, dst));
        let out_t = Tensor::from_vec(out_t, (self.rows, t), &Device::Cpu)?;
        Ok(if t == 1 {
            out_t.reshape((1, self.rows))?
        } else {
            out_t.t()?.contiguous()?
        })
    }

    /// `x @ self^T` for a prefill chunk, by `kernel` (where the CPU lacks it: the next one
    /// down, candle's at the end).
    fn prefill(&self, x: &Tensor, kernel: PrefillKernel) -> Result<Tensor> {
        let (t, cols) = x.dims2()?;
        if kernel == PrefillKernel::Integer {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let with_min = matches!(self.blocks, Blocks::Q4_1 { .. });
            let pack =
                |first: usize, panel: &mut crate::qgemm::Panel| self.pack_int_panel(first, panel);
            if let Some(y) = crate::qgemm::matmul(&xs, t, cols, self.rows, with_min, pack) {
                return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
            }
        }
        if kernel != PrefillKernel::Candle {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let pack = |first: usize, panel: &mut [f32]| self.pack_panel(first, panel);
            if let Some(y) = crate::gemm::matmul(&xs, t, cols, self.rows, pack) {
                return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
            }
        }
        Ok(x.matmul(&self.dequantize()?.t()?)?)
    }

    /// The f32 matrix, `[rows, cols]`.
    pub fn dequantize(&self) -> Result<Tensor> {
        let mut w = vec![0f32; self.rows * self.cols];
        match &self.blocks {
            Blocks::Q4_1 { scales, nibbles } => {
                w.par_chunks_mut(BLOCK)
                    .zip(scales.par_iter().zip(nibbles))
                    .for_each(|(dst, (&(d, m), qs))| {
                        for j in 0..16 {
                            dst[j] = d * f32::from(qs[j] & 15) + m;
                            dst[j + 16] = d * f32::from(qs[j] >> 4) + m;
                        }
                    });
            }
            Blocks::Q8_0 { scales, q } => {
                w.par_chunks_mut(BLOCK)
                    .zip(scales.par_iter().zip(q))
                    .for_each(|(dst, (&d, qs))| {
                        for (o, &v) in dst.iter_mut().zip(qs) {
                            *o = d * f32::from(v);
                        }
                    });
            }
        }
        Ok(Tensor::from_vec(w, (self.rows, self.cols), &Device::Cpu)?)
    }

    /// Rows `first..first + gemm::NR` dequantized into `panel` (`[cols][NR]`: value `p` of
    /// row `first + r` at `p * NR + r`), zeros for rows past the last.
    fn pack_panel(&self, first: usize, panel: &mut [f32]) {
        use crate::gemm::NR;
        let kb = self.cols / BLOCK;
        panel.fill(0.0);
        for r in 0..NR.min(self.rows.saturating_sub(first)) {
            let row = first + r;
            for b in 0..kb {
                let i = row * kb + b;
                let base = b * BLOCK * NR + r;
                match &self.blocks {
                    Blocks::Q4_1 { scales, nibbles } => {
                        let ((d, m), qs) = (scales[i], &nibbles[i]);
                        for (j, &q) in qs.iter().enumerate() {
                            panel[base + j * NR] = d * f32::from(q & 15) + m;
                            panel[base + (j + 16) * NR] = d * f32::from(q >> 4) + m;
                        }
                    }
                    Blocks::Q8_0 { scales, q } => {
                        let d = scales[i];
                        for (j, &v) in q[i].iter().enumerate() {
                            panel[base + j * NR] = d * f32::from(v);
                        }
                    }
                }
            }
        }
    }

    /// Rows `first..first + qgemm::NR` into `panel` as [`crate::qgemm::Panel`] lays them out:
    /// the integer quants widened to i16 (exact), each block's `d` and (Q4_1) `m`. `panel`
    /// comes zeroed, so rows past the last stay zero.
    fn pack_int_panel(&self, first: usize, panel: &mut crate::qgemm::Panel) {
        use crate::qgemm::NR;
        let kb = self.cols / BLOCK;
        for r in 0..NR.min(self.rows.saturating_sub(first)) {
            let row = first + r;
            for b in 0..kb {
                let i = row * kb + b;
                // Value `j` of the block at `(b * 16 + j / 2) * NR * 2 + r * 2 + j % 2`.
                let q = &mut panel.q[b * BLOCK * NR..(b + 1) * BLOCK * NR];
                let at = |j: usize| (j / 2) * NR * 2 + r * 2 + j % 2;
                match &self.blocks {
                    Blocks::Q4_1 { scales, nibbles } => {
                        let (d, m) = scales[i];
                        panel.d[b * NR + r] = d;
                        panel.m[b * NR + r] = m;
                        for (j, &v) in nibbles[i].iter().enumerate() {
                            q[at(j)] = i16::from(v & 15);
                            q[at(j + 16)] = i16::from(v >> 4);
                        }
                    }
                    Blocks::Q8_0 { scales, q: quants } => {
                        panel.d[b * NR + r] = scales[i];
                        for (j, &v) in quants[i].iter().enumerate() {
                            q[at(j)] = i16::from(v);
                        }
                    }
                }
            }
        }
    }

    /// Rows `first..first + dst.len() / t` for the `t = act.len() / blocks per row` tokens of
    /// `act`, into `dst` as `[row][token]`.
    fn rows_into(&self, act: &[Q16Block], first: usize, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of a
            // `target_feature(enable = "avx2")` function; the function is otherwise safe code.
            unsafe { rows_into_avx2(self, act, first, dst) };
            return;
        }
        rows_into_generic(self, act, first, dst);
    }
}

#[inline(always)]
fn dot_row(w: &QuantMatrix, row: usize, act: &[Q16Block]) -> f32 {
    let kb = w.cols / BLOCK;
    let blocks = row * kb..(row + 1) * kb;
    let mut acc = 0f32;
    match &w.blocks {
        Blocks::Q4_1 { scales, nibbles } => {
            for ((&(d, m), qs), y) in scales[blocks.clone()].iter().zip(&nibbles[blocks]).zip(act) {
                // At most 15 * 32767 * 32 in magnitude: fits an i32.
                let mut s = 0i32;
                let (lo, hi) = y.q.split_at(16);
                for ((&b, &l), &h) in qs.iter().zip(lo).zip(hi) {
                    s += i32::from(b & 15) * i32::from(l) + i32::from(b >> 4) * i32::from(h);
                }
                acc += d * y.d * s as f32 + m * y.d_sum;
            }
        }
        Blocks::Q8_0 { scales, q } => {
            for ((&d, qs), y) in scales[blocks.clone()].iter().zip(&q[blocks]).zip(act) {
                // At most 128 * 32767 * 32 in magnitude: fits an i32.
                let mut s = 0i32;
                for (&w, &a) in qs.iter().zip(&y.q) {
                    s += i32::from(w) * i32::from(a);
                }
                acc += d * y.d * s as f32;
            }
        }
    }
    acc
}

#[inline(always)]
fn rows_into_generic(w: &QuantMatrix, act: &[Q16Block], first: usize, dst: &mut [f32]) {
    let kb = w.cols / BLOCK;
    let t = act.len() / kb;
    for (i, row) in dst.chunks_mut(t).enumerate() {
        for (o, a) in row.iter_mut().zip(act.chunks(kb)) {
            *o = dot_row(w, first + i, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn rows_into_avx2(w: &QuantMatrix, act: &[Q16Block], first: usize, dst: &mut [f32]) {
    rows_into_generic(w, act, first, dst)
}

/// 32 values as `d * q` with `d = max|x| / 32767`, `q` rounded to nearest (the prefill
/// kernel's rounding too: [`crate::qgemm::quantize_block`]).
fn quantize_block(x: &[f32]) -> Q16Block {
    let (d, q) = crate::qgemm::quantize_block(x);
    let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
    Q16Block {
        d,
        d_sum: d * sum as f32,
        q,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random `[rows, cols]` Q4_1 tensor quantized by candle, and random activations.
    fn case(dtype: GgmlDType, rows: usize, cols: usize, t: usize, seed: u64) -> (QTensor, Tensor) {
        let mut rng = kvtier_core::SplitMix64::new(seed);
        let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_f32() - 0.5).collect() };
        let w = Tensor::from_vec(rand(rows * cols), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(rand(t * cols), (t, cols), &Device::Cpu).unwrap();
        (QTensor::quantize(&w, dtype).unwrap(), x)
    }

    /// The kernel against the f32 product of the dequantized weights (what the reference
    /// computes): the only difference is the activations' 16-bit rounding.
    fn check(dtype: GgmlDType, rows: usize, cols: usize, t: usize) {
        check_with(dtype, rows, cols, t, None);
    }

    /// [`check`] through `forward` (`None`) or one prefill kernel.
    fn check_with(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        t: usize,
        kernel: Option<PrefillKernel>,
    ) {
        let (q, x) = case(dtype, rows, cols, t, (rows * 31 + cols * 7 + t) as u64);
        let m = QuantMatrix::from_qtensor(&q).unwrap().unwrap();
        let ours = match kernel {
            None => m.forward(&x),
            Some(k) => m.prefill(&x, k),
        };
        let ours = ours.unwrap().to_vec2::<f32>().unwrap();
        let f32_ref = x
            .matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let scale = f32_ref
            .iter()
            .flatten()
            .fold(0f32, |a, v| a.max(v.abs()))
            .max(1e-3);
        for (o, r) in ours.iter().flatten().zip(f32_ref.iter().flatten()) {
            assert!(
                (o - r).abs() <= 1e-4 * scale,
                "{dtype:?} {rows}x{cols} t={t}: {o} vs {r}"
            );
        }
    }

    #[test]
    fn matmul_matches_the_dequantized_product() {
        for (rows, cols, t) in [
            (1, 32, 1),
            (70, 64, 1),
            (130, 576, 1),
            (129, 96, 3),
            (64, 576, 17),
            (33, 1536, 31),
            (33, 1536, 40),
            (70, 576, 45),
            (100, 64, 130),
        ] {
            check(GgmlDType::Q4_1, rows, cols, t);
            check(GgmlDType::Q8_0, rows, cols, t);
        }
    }

    /// Every prefill GEMM this CPU has (each packs the blocks its own way) on ragged shapes:
    /// rows not a multiple of the kernels' tiles, several blocks, outputs not a multiple of
    /// their 32-row strips.
    #[test]
    fn each_prefill_kernel_matches_the_dequantized_product() {
        let mut kernels = vec![PrefillKernel::Candle];
        if crate::gemm::available() {
            kernels.push(PrefillKernel::F32);
        } else {
            eprintln!("no AVX-512 here: the f32 GEMM is not checked");
        }
        if crate::qgemm::available() {
            kernels.push(PrefillKernel::Integer);
        } else {
            eprintln!("no AVX-512 VNNI here: the integer GEMM is not checked");
        }
        for kernel in kernels {
            for (rows, cols, t) in [(45, 160, 37), (31, 96, 65), (100, 1536, 33), (70, 576, 50)] {
                check_with(GgmlDType::Q4_1, rows, cols, t, Some(kernel));
                check_with(GgmlDType::Q8_0, rows, cols, t, Some(kernel));
            }
        }
    }

    #[test]
    fn other_dtypes_are_not_taken() {
        let w = Tensor::zeros((4, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        assert!(QuantMatrix::from_qtensor(&q).unwrap().is_none());
    }
}

//! Element-wise ops of the CPU forward on rayon's pool: the residual adds and the SiLU gate.
//! Here rather than as candle ops: candle parallelizes element-wise ops over 64 Ki values on
//! a second, spinning thread pool of its own, which competes with rayon's (the projections'
//! pool) for the cores; on a busy machine its spin-waits took a fifth of a prefill's time.

use candle_core::Tensor;
use rayon::prelude::*;

use crate::{KernelError, Result};

/// Values per rayon work item of the element-wise ops below.
const ELEMWISE_CHUNK: usize = 16 * 1024;

/// `a + b`, two f32 tensors of one shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    elementwise(a, b, |x, y| x + y)
}

/// `silu(g) * u = g / (1 + e^-g) * u` (SwiGLU's gate), two f32 tensors of one shape.
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    elementwise(g, u, |g, u| g / (1.0 + (-g).exp()) * u)
}

/// `f` of each pair of elements of `a` and `b` (same shape), on rayon's pool (the CPU
/// forward's; the GPU forward has its own kernels).
fn elementwise(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(KernelError::Shape {
            what: "(element-wise op)".to_owned(),
            reason: format!("shapes {:?} and {:?}", a.shape(), b.shape()),
        });
    }
    let mut xs = a.flatten_all()?.to_vec1::<f32>()?;
    let ys = b.flatten_all()?.to_vec1::<f32>()?;
    xs.par_chunks_mut(ELEMWISE_CHUNK)
        .zip(ys.par_chunks(ELEMWISE_CHUNK))
        .for_each(|(xs, ys)| {
            for (x, &y) in xs.iter_mut().zip(ys) {
                *x = f(*x, y);
            }
        });
    Ok(Tensor::from_vec(xs, a.shape(), a.device())?)
}

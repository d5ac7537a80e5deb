//! The reference worker's (`kvtier-worker`) CPU kernels: its own Q4_1 / Q8_0 matrix products
//! ([`quant`]; register-blocked GEMMs for prefill in the private `qgemm` and `gemm`) and its
//! causal attention ([`attention`]), and the forward's element-wise ops ([`elementwise`]).
//!
//! A crate of their own so that a debug build can optimize them alone: the worker's tests
//! run the real model through these loops, and the root `Cargo.toml` builds this crate
//! optimized in the dev profile while the worker's many test crates stay unoptimized (the
//! test build after a change to the worker: 63 s, against 155 s with the whole worker at
//! opt-level 1).

pub mod attention;
pub mod elementwise;
mod gemm;
mod qgemm;
pub mod quant;

/// Why a kernel refused its input.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A matrix or an input whose shape the kernel cannot take.
    #[error("{what}: {reason}")]
    Shape { what: String, reason: String },
    /// A candle tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// A kernel's result.
pub type Result<T> = std::result::Result<T, KernelError>;

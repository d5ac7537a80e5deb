//! kvtier-worker: a reference inference worker. A Llama-architecture transformer run with
//! candle on the CPU, with a paged KV cache whose blocks are laid out byte for byte as kvtier's
//! [`kvtier_core::KvLayout`], so a block moves between the worker and kvtier as raw bytes.
//!
//! Model, tokenizers (byte-level or a Hugging Face `tokenizer.json`), paged cache and engine
//! (prefill from any block-aligned position, decode, sampling); prefix reuse through the kvtier sidecar ([`sidecar`]); continuous
//! batching ([`scheduler`]); the OpenAI-compatible HTTP server ([`serve`]); disaggregated
//! prefill/decode over kvtier-transfer ([`disagg`]). See `docs/worker.md`.

pub mod api;
pub mod chat;
pub mod config;
pub mod disagg;
pub mod engine;
mod error;
pub mod fetch;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kv_cache;
pub mod metrics;
pub mod model;
pub mod prefix_cache;
pub mod prompt_side;
/// The worker's Q4_1 / Q8_0 kernel (its own crate, `kvtier-kernels`, built optimized in
/// debug builds too).
pub use kvtier_kernels::quant;
pub mod scheduler;
pub mod serve;
pub mod sidecar;
pub mod tokenizer;

pub use config::ModelConfig;
pub use engine::{Engine, FinishReason, Generation, Sampler, Sampling};
pub use error::WorkerError;
pub use kv_cache::{BlockId, BlockTable, PagedKvCache};
pub use model::{DeviceSpec, Model, load_pretrained};
pub use tokenizer::{ByteTokenizer, TextStream, Tokenizer};

//! kvtier-worker: a reference inference worker. A Llama-architecture transformer run with
//! candle on the CPU, with a paged KV cache whose blocks are laid out byte for byte as kvtier's
//! [`kvtier_core::KvLayout`], so a block moves between the worker and kvtier as raw bytes.
//!
//! This part holds the model, the byte tokenizer, the paged cache and the engine (prefill from
//! any block-aligned position, decode, sampling) and disaggregated prefill/decode over
//! kvtier-transfer ([`disagg`]). Prefix reuse through the sidecar and the HTTP API come later;
//! see `docs/worker.md`.

pub mod config;
pub mod disagg;
pub mod engine;
mod error;
pub mod kv_cache;
pub mod model;
pub mod rng;
pub mod tokenizer;

pub use config::ModelConfig;
pub use engine::{Engine, Generation, Sampling};
pub use error::WorkerError;
pub use kv_cache::{BlockId, BlockTable, PagedKvCache};
pub use model::Model;
pub use tokenizer::ByteTokenizer;

use std::path::PathBuf;

/// Everything the worker can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A model configuration (a Hugging Face `config.json` or a built one) is unusable.
    #[error("model config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("KV layout: {0}")]
    Layout(#[from] kvtier_core::CoreError),
    /// The block pool cannot hold the request; nothing was allocated.
    #[error("KV cache full: {needed} blocks needed, {free} free")]
    CacheFull { needed: usize, free: usize },
    #[error("block {block} does not exist (the pool has {num_blocks} blocks)")]
    NoSuchBlock { block: u32, num_blocks: usize },
    #[error("block {block} is not allocated")]
    BlockNotAllocated { block: u32 },
    #[error("block write of {got} bytes, but a block is {expected} bytes")]
    BlockSize { got: usize, expected: usize },
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab { id: u32, vocab_size: usize },
    #[error("{tokens} tokens exceed the model's context of {max_context_tokens}")]
    ContextFull {
        tokens: usize,
        max_context_tokens: usize,
    },
    #[error(
        "prefill from position {start_pos} needs those positions cached, but the block table covers {covered_tokens} tokens"
    )]
    MissingPrefix {
        start_pos: usize,
        covered_tokens: usize,
    },
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    /// Disaggregated prefill: a control request is malformed, or a remote prefill failed (the
    /// decode side then prefills locally; see `disagg`).
    #[error("disaggregation: {reason}")]
    Disagg { reason: String },
    #[error("transfer: {0}")]
    Transfer(#[from] kvtier_transfer::TransferError),
    /// The kvtier sidecar cannot be used as configured (a wrong address, or a server whose
    /// blocks differ from this model's).
    #[error("sidecar {url}: {reason}")]
    Sidecar { url: String, reason: String },
    /// A model directory's `tokenizer.json` cannot be read or does not fit the model.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    /// The GPU path cannot run (no driver, no device, a CUDA call failed) or was not built.
    #[error("GPU: {reason}")]
    Gpu { reason: String },
    /// The reference model could not be fetched ([`crate::fetch`]).
    #[error("fetching the model: {reason}")]
    Fetch { reason: String },
    /// A `serve` setting is unusable.
    #[error("serve setting `{setting}`: {reason}")]
    Serve { setting: String, reason: String },
}

pub type Result<T, E = WorkerError> = std::result::Result<T, E>;

/// A kernel's refusal as the worker reports it: a shape it cannot take is a configuration
/// error (the model's matrices or its inputs), as it was before the kernels had a crate.
impl From<kvtier_kernels::KernelError> for WorkerError {
    fn from(e: kvtier_kernels::KernelError) -> Self {
        match e {
            kvtier_kernels::KernelError::Shape { what, reason } => WorkerError::Config {
                field: what,
                reason,
            },
            kvtier_kernels::KernelError::Candle(e) => WorkerError::Candle(e),
        }
    }
}

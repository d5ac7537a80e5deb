//! A request as the workers see it: rendered, tokenized and validated by the worker crate's own
//! code (`kvtier_worker::api::parse`: chat template, tokenizer, special tokens, limits), then
//! hashed into block keys with the workers' hasher and namespace (model name, KV layout
//! fingerprint, `cache_salt`) and secret. Nothing here re-implements what the worker does.

use kvtier_core::{BlockKey, HashSecret};
use kvtier_worker::api::{self, ApiError, Endpoint, Limits};
use kvtier_worker::prefix_cache::BlockKeys;
use kvtier_worker::{ModelConfig, Tokenizer};

/// What the router needs of a request to route it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Analysed {
    pub prompt_tokens: usize,
    /// Keys of the prompt's full blocks.
    pub keys: Vec<BlockKey>,
    pub stream: bool,
}

/// The workers' prompt side.
pub struct PromptModel {
    tokenizer: Tokenizer,
    keys: BlockKeys,
    model_name: String,
    config: ModelConfig,
}

impl PromptModel {
    pub fn new(
        config: ModelConfig,
        tokenizer: Tokenizer,
        model_name: String,
        secret: HashSecret,
    ) -> Result<Self, kvtier_worker::WorkerError> {
        let layout = config.kv_layout()?;
        Ok(Self {
            tokenizer,
            keys: BlockKeys::new(secret, model_name.clone(), layout),
            model_name,
            config,
        })
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    pub fn block_tokens(&self) -> usize {
        self.config.block_tokens
    }

    /// Bytes of one KV block of the model (f32, as the workers).
    pub fn block_bytes(&self) -> u64 {
        self.config
            .kv_layout()
            .map(|l| l.block_bytes())
            .unwrap_or(0)
    }

    /// Parses `body` as the workers would on `endpoint` and hashes its prompt. A request the
    /// workers would refuse gets the same 4xx here.
    pub fn analyse(&self, body: &[u8], endpoint: Endpoint) -> Result<Analysed, ApiError> {
        let lim = Limits {
            model_name: &self.model_name,
            max_context_tokens: self.config.max_context_tokens,
            vocab_size: self.config.vocab_size,
            tokenizer: &self.tokenizer,
            fallback_seed: 0,
        };
        let req = api::parse(body, endpoint, &lim)?;
        let bt = self.config.block_tokens;
        let full = req.tokens.len() / bt * bt;
        let keys = self
            .keys
            .keys(
                &req.tokens[..full],
                req.cache_salt.as_deref().map(str::as_bytes),
            )
            .map_err(|e| {
                ApiError::server(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot hash the prompt: {e}"),
                    "hash_error",
                )
            })?;
        Ok(Analysed {
            prompt_tokens: req.tokens.len(),
            keys,
            stream: req.stream,
        })
    }
}

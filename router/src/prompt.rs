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
    /// The session the request belongs to, for session-sticky routing: the request's OpenAI
    /// `user` field (the router's `x-session-id` header overrides it).
    pub session: Option<String>,
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
            session: req.user,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> PromptModel {
        let (cfg, tok) = kvtier_worker::prompt_side::model_and_tokenizer(None, 16).unwrap();
        PromptModel::new(cfg, tok, "kvtier-tiny".into(), HashSecret::development()).unwrap()
    }

    #[test]
    fn keys_are_the_workers_keys_of_the_workers_tokens() {
        let m = model();
        let text = "x".repeat(100);
        let layout = kvtier_worker::ModelConfig::default().kv_layout().unwrap();
        let keys = BlockKeys::new(HashSecret::development(), "kvtier-tiny".into(), layout);
        // The byte tokenizer puts BOS in front: 101 tokens, 6 full blocks.
        let tokens = Tokenizer::Byte.encode(&text, true).unwrap();
        for salt in [None, Some("tenant-a")] {
            let mut body = serde_json::json!({"prompt": text, "stream": true});
            if let Some(s) = salt {
                body["cache_salt"] = s.into();
            }
            let a = m
                .analyse(body.to_string().as_bytes(), Endpoint::Completions)
                .unwrap();
            let want = keys.keys(&tokens[..96], salt.map(str::as_bytes)).unwrap();
            assert_eq!((a.prompt_tokens, a.stream), (101, true));
            assert_eq!(a.keys, want, "salt {salt:?}");
        }
        let plain = m
            .analyse(
                format!(r#"{{"prompt":"{text}"}}"#).as_bytes(),
                Endpoint::Completions,
            )
            .unwrap();
        let salted = m
            .analyse(
                format!(r#"{{"prompt":"{text}","cache_salt":"s"}}"#).as_bytes(),
                Endpoint::Completions,
            )
            .unwrap();
        assert_ne!(plain.keys[0], salted.keys[0]);
        // Token ids are used as given, as the worker does.
        let ids: Vec<u32> = tokens.clone();
        let by_ids = m
            .analyse(
                serde_json::json!({"prompt": ids}).to_string().as_bytes(),
                Endpoint::Completions,
            )
            .unwrap();
        assert_eq!(by_ids.keys, plain.keys);
    }

    #[test]
    fn requests_the_workers_refuse_are_refused_alike() {
        let m = model();
        for (body, endpoint, status) in [
            ("{", Endpoint::Completions, 400),
            (
                r#"{"prompt":"x","model":"other"}"#,
                Endpoint::Completions,
                404,
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
                Endpoint::Completions,
                400,
            ),
            (r#"{"prompt":"x"}"#, Endpoint::Chat, 400),
            (
                r#"{"prompt":"x","max_tokens":100000}"#,
                Endpoint::Completions,
                400,
            ),
        ] {
            let e = m.analyse(body.as_bytes(), endpoint).unwrap_err();
            assert_eq!(e.status.as_u16(), status, "{body}: {e:?}");
        }
        let chat = m
            .analyse(
                br#"{"messages":[{"role":"user","content":"hello"}]}"#,
                Endpoint::Chat,
            )
            .unwrap();
        assert!(chat.prompt_tokens > 5);
    }
}

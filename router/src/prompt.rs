//! A request as the workers see it: rendered, tokenized and validated by the worker crate's own
//! code (`kvtier_worker::api::parse`: chat template, tokenizer, special tokens, limits), then
//! hashed into block keys with the workers' hasher and namespace (model name, KV layout
//! fingerprint, `cache_salt`) and secret. Nothing here re-implements what the worker does.
//!
//! vLLM workers (engine "vllm") render the same Hugging Face chat template and tokenizer; their
//! keys are those kvtier's vLLM connector makes (`python/kvtier/vllm.py`, `block_keys`): the
//! same kvtier-core hasher, in a namespace of the connector's model id, vLLM's KV layout (its
//! dtype and block size) and tensor-parallel rank 0 of the workers' size.

use kvtier_core::{BlockKey, Dtype, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use kvtier_worker::api::{self, ApiError, Endpoint, Limits};
use kvtier_worker::prefix_cache::BlockKeys;
use kvtier_worker::{ModelConfig, Tokenizer};
use serde_json::Value;

use crate::config::Engine;

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

/// The block keys' namespace beyond the model's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySpace {
    pub engine: Engine,
    /// The model id hashed into the namespace.
    pub model_id: String,
    /// The workers' KV cache dtype.
    pub dtype: Dtype,
    pub tensor_parallel_size: u32,
}

impl KeySpace {
    /// kvtier-worker's: its model name, f32, no tensor parallelism.
    pub fn kvtier(model_name: &str) -> Self {
        Self {
            engine: Engine::Kvtier,
            model_id: model_name.to_owned(),
            dtype: Dtype::F32,
            tensor_parallel_size: 1,
        }
    }
}

/// How a prompt's tokens become keys.
enum Hasher {
    /// kvtier-worker's own code.
    Worker(BlockKeys),
    /// The vLLM connector's namespace (see the module's doc).
    Vllm {
        secret: HashSecret,
        model_id: String,
        layout: KvLayout,
        tp_size: u32,
    },
}

impl Hasher {
    fn keys(&self, tokens: &[u32], salt: Option<&[u8]>) -> Result<Vec<BlockKey>, String> {
        match self {
            Hasher::Worker(k) => k.keys(tokens, salt).map_err(|e| e.to_string()),
            Hasher::Vllm {
                secret,
                model_id,
                layout,
                tp_size,
            } => {
                let mut ns = NamespaceBuilder::new(model_id.clone(), layout.fingerprint())
                    .tensor_parallel(0, *tp_size);
                if let Some(s) = salt {
                    ns = ns.cache_salt(s);
                }
                let ns = ns.build(secret).map_err(|e| e.to_string())?;
                let mut h = PrefixHasher::new(secret.clone(), ns, layout.block_tokens())
                    .map_err(|e| e.to_string())?;
                let mut keys = Vec::new();
                h.prompt_keys(tokens, &mut keys);
                Ok(keys)
            }
        }
    }
}

/// The workers' prompt side.
pub struct PromptModel {
    tokenizer: Tokenizer,
    keys: Hasher,
    engine: Engine,
    block_bytes: u64,
    model_name: String,
    config: ModelConfig,
}

impl PromptModel {
    pub fn new(
        config: ModelConfig,
        tokenizer: Tokenizer,
        model_name: String,
        secret: HashSecret,
        space: KeySpace,
    ) -> Result<Self, kvtier_worker::WorkerError> {
        let worker_layout = config.kv_layout()?;
        let (keys, block_bytes) = match space.engine {
            Engine::Kvtier => (
                Hasher::Worker(BlockKeys::new(secret, space.model_id, worker_layout)),
                worker_layout.block_bytes(),
            ),
            Engine::Vllm => {
                // vLLM's layout: the model's layers, KV heads and head size (as the connector's
                // `layout_from_spec`), its dtype and block size.
                let layout = KvLayout::new(
                    worker_layout.num_layers(),
                    worker_layout.num_kv_heads(),
                    worker_layout.head_dim(),
                    space.dtype,
                    worker_layout.block_tokens(),
                )?;
                (
                    Hasher::Vllm {
                        secret,
                        model_id: space.model_id,
                        layout,
                        tp_size: space.tensor_parallel_size,
                    },
                    layout.block_bytes(),
                )
            }
        };
        Ok(Self {
            tokenizer,
            keys,
            engine: space.engine,
            block_bytes,
            model_name,
            config,
        })
    }

    pub fn engine(&self) -> Engine {
        self.engine
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    pub fn block_tokens(&self) -> usize {
        self.config.block_tokens
    }

    /// Bytes of one KV block of the model as the workers keep it.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
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

    /// What the router knows of a request it cannot analyse (engine "vllm": forwarded anyway,
    /// routed by load): its `stream` and `user`, read leniently.
    pub fn unanalysed(body: &[u8]) -> Analysed {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        Analysed {
            prompt_tokens: 0,
            keys: Vec::new(),
            stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
            session: v
                .get("user")
                .and_then(Value::as_str)
                .filter(|s| s.len() <= api::MAX_USER_BYTES)
                .map(String::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> PromptModel {
        let (cfg, tok) = kvtier_worker::prompt_side::model_and_tokenizer(None, 16).unwrap();
        PromptModel::new(
            cfg,
            tok,
            "kvtier-tiny".into(),
            HashSecret::development(),
            KeySpace::kvtier("kvtier-tiny"),
        )
        .unwrap()
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

    fn vllm(dtype: Dtype, tp: u32) -> PromptModel {
        let (cfg, tok) = kvtier_worker::prompt_side::model_and_tokenizer(None, 16).unwrap();
        PromptModel::new(
            cfg,
            tok,
            "served-name".into(),
            HashSecret::development(),
            KeySpace {
                engine: Engine::Vllm,
                model_id: "kvtier-tiny".into(),
                dtype,
                tensor_parallel_size: tp,
            },
        )
        .unwrap()
    }

    #[test]
    fn vllm_keys_are_the_connectors_namespace() {
        let body = serde_json::json!({"prompt": "y".repeat(70), "model": "served-name"});
        let body = body.to_string();
        let a = |m: &PromptModel| m.analyse(body.as_bytes(), Endpoint::Completions).unwrap();
        let bf16 = a(&vllm(Dtype::Bf16, 1));
        assert_eq!((bf16.prompt_tokens, bf16.keys.len()), (71, 4));
        // The connector's namespace, built as `KvtierConnector.block_keys` builds it.
        let cfg = ModelConfig::default();
        let layout = KvLayout::new(
            cfg.num_layers as u32,
            cfg.num_kv_heads as u32,
            cfg.head_dim as u32,
            Dtype::Bf16,
            16,
        )
        .unwrap();
        let secret = HashSecret::development();
        let ns = NamespaceBuilder::new("kvtier-tiny", layout.fingerprint())
            .tensor_parallel(0, 1)
            .build(&secret)
            .unwrap();
        let mut h = PrefixHasher::new(secret, ns, 16).unwrap();
        let tokens = Tokenizer::Byte.encode(&"y".repeat(70), true).unwrap();
        let mut want = Vec::new();
        h.prompt_keys(&tokens[..64], &mut want);
        assert_eq!(bf16.keys, want);
        assert_eq!(vllm(Dtype::Bf16, 1).block_bytes(), layout.block_bytes());
        // The dtype and the tensor-parallel size are part of the namespace.
        assert_ne!(a(&vllm(Dtype::F16, 1)).keys[0], bf16.keys[0]);
        assert_ne!(a(&vllm(Dtype::Bf16, 2)).keys[0], bf16.keys[0]);
        // In f32 with one rank, the connector's and kvtier-worker's namespaces are one.
        let worker = PromptModel::new(
            cfg,
            Tokenizer::Byte,
            "served-name".into(),
            HashSecret::development(),
            KeySpace::kvtier("kvtier-tiny"),
        )
        .unwrap();
        assert_eq!(a(&vllm(Dtype::F32, 1)).keys, a(&worker).keys);
    }

    #[test]
    fn an_unanalysed_request_keeps_its_stream_and_user() {
        let u = PromptModel::unanalysed(br#"{"stream": true, "user": "s1", "n": 3}"#);
        assert_eq!(
            (
                u.prompt_tokens,
                u.keys.len(),
                u.stream,
                u.session.as_deref()
            ),
            (0, 0, true, Some("s1"))
        );
        let u = PromptModel::unanalysed(b"not json");
        assert_eq!((u.stream, u.session), (false, None));
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

//! The model's shape, built in ([`ModelConfig::default`]) or parsed from a Hugging Face
//! `config.json`.

use kvtier_core::{Dtype, KvLayout};
use serde_json::{Map, Value};

use crate::error::{Result, WorkerError};
use crate::tokenizer::ByteTokenizer;

/// The shape of a Llama-architecture model plus the KV block size.
///
/// The default is a small model sized for the CPU (the byte tokenizer's vocabulary):
/// vocab 258, hidden 256, intermediate 688, 4 layers, 8 query heads, 2 KV heads (GQA, 4 query
/// heads per KV head), head dim 32, rope theta 10000, RMS eps 1e-5, context 8192 tokens,
/// 16-token blocks. It has **2,903,296 parameters** (untied embedding and `lm_head`), and its
/// KV cache in f32 takes **2,048 bytes per token** (4 layers x K+V x 2 heads x 32 x 4 B), so a
/// 16-token block is 32 KiB.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f64,
    pub max_context_tokens: usize,
    /// Tokens per KV block (a power of two up to 512, as kvtier requires).
    pub block_tokens: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: ByteTokenizer::VOCAB_SIZE,
            hidden_size: 256,
            intermediate_size: 688,
            num_layers: 4,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 32,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_context_tokens: 8192,
            block_tokens: 16,
            tie_word_embeddings: false,
        }
    }
}

/// The KV dtype. The worker computes in f32 on the CPU: candle's CPU kernels for bf16/f16 are
/// slow and less exact, and f32 makes "loaded KV equals recomputed KV" checkable to tight
/// tolerances. A GPU build would switch this to bf16 (and the layout fingerprint with it, so
/// blocks of one never serve the other).
pub const KV_DTYPE: Dtype = Dtype::F32;

/// Largest context accepted (2^20 tokens).
pub const MAX_CONTEXT_TOKENS: usize = 1 << 20;
/// Largest rotary table, in f32 entries per table (2^26, 256 MiB).
pub const MAX_ROTARY_ELEMENTS: usize = 1 << 26;

impl ModelConfig {
    /// Parses a Hugging Face Llama `config.json`. Errors name the offending field.
    /// `block_tokens` is not part of the model; it comes from the deployment.
    pub fn from_hf_json(text: &str, block_tokens: usize) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| WorkerError::Config {
            field: "(config.json)".to_owned(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let Value::Object(obj) = value else {
            return Err(WorkerError::Config {
                field: "(config.json)".to_owned(),
                reason: "expected a JSON object at the top level".to_owned(),
            });
        };
        let num_heads = req_usize(&obj, "num_attention_heads")?;
        if num_heads == 0 {
            return Err(config_err(
                "num_attention_heads",
                "must be positive".to_owned(),
            ));
        }
        let hidden_size = req_usize(&obj, "hidden_size")?;
        let head_dim = match opt_usize(&obj, "head_dim")? {
            Some(d) => d,
            None => {
                if !hidden_size.is_multiple_of(num_heads) {
                    return Err(config_err(
                        "hidden_size",
                        format!(
                            "{hidden_size} is not divisible by num_attention_heads {num_heads}"
                        ),
                    ));
                }
                hidden_size / num_heads
            }
        };
        let cfg = Self {
            vocab_size: req_usize(&obj, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(&obj, "intermediate_size")?,
            num_layers: req_usize(&obj, "num_hidden_layers")?,
            num_heads,
            num_kv_heads: opt_usize(&obj, "num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            rope_theta: opt_f64(&obj, "rope_theta")?.unwrap_or(10_000.0) as f32,
            rms_norm_eps: opt_f64(&obj, "rms_norm_eps")?.unwrap_or(1e-6),
            max_context_tokens: opt_usize(&obj, "max_position_embeddings")?.unwrap_or(2048),
            block_tokens,
            tie_word_embeddings: match obj.get("tie_word_embeddings") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(config_err(
                        "tie_word_embeddings",
                        format!("expected true or false, got {other}"),
                    ));
                }
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the shape is one this worker can run.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_context_tokens),
        ] {
            if v == 0 {
                return Err(config_err(field, "must be positive".to_owned()));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(config_err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(config_err(
                "head_dim",
                format!(
                    "{} is odd; rotary embeddings need an even head dim",
                    self.head_dim
                ),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(config_err(
                "rope_theta",
                "must be a positive number".to_owned(),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(config_err(
                "rms_norm_eps",
                "must be a positive number".to_owned(),
            ));
        }
        // The rotary tables hold max_context_tokens x head_dim / 2 floats each, allocated up
        // front: bound them so a hostile config.json cannot ask for terabytes.
        if self.max_context_tokens > MAX_CONTEXT_TOKENS
            || self.max_context_tokens.saturating_mul(self.head_dim / 2) > MAX_ROTARY_ELEMENTS
        {
            return Err(config_err(
                "max_position_embeddings",
                format!(
                    "{} is too large (at most {MAX_CONTEXT_TOKENS}, and {MAX_ROTARY_ELEMENTS} rotary entries)",
                    self.max_context_tokens
                ),
            ));
        }
        // The KV layout checks block_tokens (power of two, at most 512) and the sizes.
        self.kv_layout()
            .map_err(|e| config_err("kv layout", e.to_string()))?;
        Ok(())
    }

    /// The kvtier layout of one KV block of this model (f32, see [`KV_DTYPE`]).
    pub fn kv_layout(&self) -> Result<KvLayout> {
        let u32_of = |field: &str, v: usize| {
            u32::try_from(v).map_err(|_| config_err(field, format!("{v} is too large")))
        };
        Ok(KvLayout::new(
            u32_of("num_hidden_layers", self.num_layers)?,
            u32_of("num_key_value_heads", self.num_kv_heads)?,
            u32_of("head_dim", self.head_dim)?,
            KV_DTYPE,
            u32_of("block_tokens", self.block_tokens)?,
        )?)
    }

    /// Parameters, counting a tied `lm_head` once.
    pub fn param_count(&self) -> u64 {
        let h = self.hidden_size as u64;
        let q = (self.num_heads * self.head_dim) as u64;
        let kv = (self.num_kv_heads * self.head_dim) as u64;
        let i = self.intermediate_size as u64;
        let v = self.vocab_size as u64;
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_layers as u64 * per_layer + h + head
    }
}

fn config_err(field: &str, reason: String) -> WorkerError {
    WorkerError::Config {
        field: field.to_owned(),
        reason,
    }
}

fn opt_usize(obj: &Map<String, Value>, field: &str) -> Result<Option<usize>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| config_err(field, format!("expected a non-negative integer, got {v}"))),
    }
}

fn req_usize(obj: &Map<String, Value>, field: &str) -> Result<usize> {
    opt_usize(obj, field)?.ok_or_else(|| config_err(field, "missing".to_owned()))
}

fn opt_f64(obj: &Map<String, Value>, field: &str) -> Result<Option<f64>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| config_err(field, format!("expected a number, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_model_size_is_as_documented() {
        let c = ModelConfig::default();
        c.validate().unwrap();
        assert_eq!(c.param_count(), 2_903_296);
        let l = c.kv_layout().unwrap();
        assert_eq!(l.bytes_per_token(), 2048);
        assert_eq!(l.block_bytes(), 32 * 1024);
    }

    const GOOD: &str = r#"{"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        "tie_word_embeddings": false}"#;

    #[test]
    fn parses_a_llama_config() {
        let c = ModelConfig::from_hf_json(GOOD, 16).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.num_kv_heads, 8);
        assert_eq!(c.rope_theta, 500_000.0);
        assert_eq!(
            c.kv_layout().unwrap().block_bytes(),
            32 * 2 * 16 * 8 * 128 * 4
        );
    }

    /// Replaces (or with `None` removes) one field of the good config and expects an error
    /// naming `field`.
    fn check(key: &str, value: Option<&str>, block_tokens: usize, field: &str) {
        let mut obj: Map<String, Value> = serde_json::from_str(GOOD).unwrap();
        match value {
            Some(v) => obj.insert(key.to_owned(), serde_json::from_str(v).unwrap()),
            None => obj.remove(key),
        };
        let text = serde_json::to_string(&obj).unwrap();
        match ModelConfig::from_hf_json(&text, block_tokens) {
            Err(WorkerError::Config { field: f, reason }) => {
                assert_eq!(f, field, "{key}={value:?}: reason {reason}")
            }
            other => panic!("{key}={value:?}: expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn bad_configs_name_the_field() {
        check("hidden_size", None, 16, "hidden_size");
        check("vocab_size", Some("\"lots\""), 16, "vocab_size");
        check("num_hidden_layers", Some("-1"), 16, "num_hidden_layers");
        check("intermediate_size", Some("0"), 16, "intermediate_size");
        check("num_key_value_heads", Some("5"), 16, "num_key_value_heads");
        check("hidden_size", Some("4095"), 16, "hidden_size");
        check("num_attention_heads", Some("0"), 16, "num_attention_heads");
        check("num_key_value_heads", Some("0"), 16, "num_key_value_heads");
        check("head_dim", Some("127"), 16, "head_dim");
        check("rope_theta", Some("\"big\""), 16, "rope_theta");
        check("rms_norm_eps", Some("0"), 16, "rms_norm_eps");
        check("tie_word_embeddings", Some("1"), 16, "tie_word_embeddings");
        check("vocab_size", Some("1.5"), 16, "vocab_size");
        check(
            "max_position_embeddings",
            Some("1000000000000"),
            16,
            "max_position_embeddings",
        );
        check("vocab_size", Some("32000"), 12, "kv layout");
        assert!(matches!(
            ModelConfig::from_hf_json("{not json", 16),
            Err(WorkerError::Config { field, .. }) if field == "(config.json)"
        ));
        assert!(matches!(
            ModelConfig::from_hf_json("[1]", 16),
            Err(WorkerError::Config { field, .. }) if field == "(config.json)"
        ));
    }
}

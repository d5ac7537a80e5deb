//! Loading a Llama-architecture GGUF file (llama.cpp's format) with its weights kept quantized:
//! every projection becomes a candle `QMatMul` over the file's blocks (Q4_1, the k-quants, ...),
//! the token embedding stays quantized (rows are dequantized as they are looked up), norms are
//! dequantized to f32. Activations and the KV cache stay f32 ([`crate::config::KV_DTYPE`]).
//!
//! The tokenizer and chat template come from the file's metadata (`tokenizer.ggml.*`,
//! `tokenizer.chat_template`): the byte-level BPE `tokenizer.json` that scripts/fetch-model.py
//! writes for the same file is built here in memory, with the same pre-tokenizer table.
//!
//! GGUF converters permute the rows of `attn_q` and `attn_k` for llama.cpp's interleaved
//! rotary (its `LlamaModel.permute`). The loader undoes that permutation on the quantized rows
//! (a ggml row is a run of whole blocks, so rows move as bytes without requantizing), so the
//! forward, its rotary and the K it stores are those of the Hugging Face layout.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QStorage, QTensor};
use serde_json::json;

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use crate::tokenizer::Tokenizer;

/// GGUF token types (llama.cpp's `llama_token_type`): control and user-defined tokens become
/// added tokens, control ones special.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// An opened GGUF file: its metadata and tensor directory (tensor bytes are read on demand).
pub struct GgufFile {
    path: PathBuf,
    file: std::fs::File,
    content: Content,
}

fn gguf_err(path: &Path, reason: impl Into<String>) -> WorkerError {
    WorkerError::Config {
        field: format!("(gguf {})", path.display()),
        reason: reason.into(),
    }
}

impl GgufFile {
    /// Opens `path` and reads its header.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|source| WorkerError::Io {
            path: path.to_owned(),
            source,
        })?;
        let content = Content::read(&mut file)
            .map_err(|e| gguf_err(path, format!("not a readable GGUF file: {e}")))?;
        Ok(Self {
            path: path.to_owned(),
            file,
            content,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn meta(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| gguf_err(&self.path, format!("no metadata key {key}")))
    }

    fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self.meta(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x.max(0) as u64))
            .map(|x| x as usize)
            .map_err(|e| gguf_err(&self.path, format!("{key}: {e}")))
    }

    fn meta_usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.content.metadata.get(key) {
            None => Ok(default),
            Some(_) => self.meta_usize(key),
        }
    }

    fn meta_f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.content.metadata.get(key) {
            None => Ok(default),
            Some(v) => v
                .to_f32()
                .map_err(|e| gguf_err(&self.path, format!("{key}: {e}"))),
        }
    }

    fn meta_bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.content.metadata.get(key) {
            None => Ok(default),
            Some(v) => v
                .to_bool()
                .map_err(|e| gguf_err(&self.path, format!("{key}: {e}"))),
        }
    }

    fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)?
            .to_string()
            .map(String::as_str)
            .map_err(|e| gguf_err(&self.path, format!("{key}: {e}")))
    }

    fn meta_strings(&self, key: &str) -> Result<Vec<&str>> {
        let list = self
            .meta(key)?
            .to_vec()
            .map_err(|e| gguf_err(&self.path, format!("{key}: {e}")))?;
        list.iter()
            .map(|v| {
                v.to_string()
                    .map(String::as_str)
                    .map_err(|e| gguf_err(&self.path, format!("{key}: {e}")))
            })
            .collect()
    }

    /// Whether the file holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name`, as stored (quantized or not), on the CPU.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(gguf_err(&self.path, format!("no tensor {name}")));
        }
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| gguf_err(&self.path, format!("tensor {name}: {e}")))
    }

    /// Tensor `name` (an `[n_head * head_dim, in]` q or k projection) with llama.cpp's row
    /// permutation undone: within each head, GGUF row `2i + a` is Hugging Face row
    /// `a * head_dim / 2 + i`.
    pub fn unpermuted(&mut self, name: &str, n_head: usize) -> Result<QTensor> {
        let t = self.tensor(name)?;
        let (rows, _) = t
            .shape()
            .dims2()
            .map_err(|e| gguf_err(&self.path, format!("{name}: {e}")))?;
        if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
            return Err(gguf_err(
                &self.path,
                format!("{name}: {rows} rows do not split into {n_head} heads of pairs"),
            ));
        }
        let data = t.data()?;
        let row_bytes = data.len() / rows;
        let head_dim = rows / n_head;
        let half = head_dim / 2;
        let mut out = vec![0u8; data.len()];
        for h in 0..n_head {
            for a in 0..2 {
                for i in 0..half {
                    let src = h * head_dim + 2 * i + a;
                    let dst = h * head_dim + a * half + i;
                    out[dst * row_bytes..(dst + 1) * row_bytes]
                        .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
                }
            }
        }
        let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, t.dtype())?;
        Ok(QTensor::new(storage, t.shape().clone())?)
    }

    /// The model's shape as a Hugging Face `config.json` would give it (llama only).
    pub fn model_config(&self, block_tokens: usize) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(&self.hf_config()?.to_string(), block_tokens)
    }

    /// The Hugging Face `config.json` equivalent of the file's `llama.*` metadata.
    fn hf_config(&self) -> Result<serde_json::Value> {
        let arch = self.meta_str("general.architecture")?;
        if arch != "llama" {
            return Err(gguf_err(
                &self.path,
                format!("architecture {arch:?}; this loader handles llama only"),
            ));
        }
        let hidden = self.meta_usize("llama.embedding_length")?;
        let n_head = self.meta_usize("llama.attention.head_count")?;
        if n_head == 0 {
            return Err(gguf_err(&self.path, "llama.attention.head_count is 0"));
        }
        let n_kv = self.meta_usize_or("llama.attention.head_count_kv", n_head)?;
        let head_dim = self.meta_usize_or("llama.attention.key_length", hidden / n_head)?;
        let rope_dim = self.meta_usize_or("llama.rope.dimension_count", head_dim)?;
        if rope_dim != head_dim {
            return Err(gguf_err(
                &self.path,
                format!("partial rotary (rope dim {rope_dim} of head dim {head_dim})"),
            ));
        }
        let tokens = self.meta_strings("tokenizer.ggml.tokens")?.len();
        let tied = !self.has_tensor("output.weight");
        Ok(json!({
            "hidden_size": hidden,
            "intermediate_size": self.meta_usize("llama.feed_forward_length")?,
            "num_hidden_layers": self.meta_usize("llama.block_count")?,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "vocab_size": self.meta_usize_or("llama.vocab_size", tokens)?,
            "max_position_embeddings": self.meta_usize("llama.context_length")?,
            "rms_norm_eps": self.meta_f32_or("llama.attention.layer_norm_rms_epsilon", 1e-6)?,
            "rope_theta": self.meta_f32_or("llama.rope.freq_base", 10_000.0)?,
            "tie_word_embeddings": tied,
            "bos_token_id": self.meta_usize("tokenizer.ggml.bos_token_id")?,
            "eos_token_id": self.meta_usize("tokenizer.ggml.eos_token_id")?,
        }))
    }

    /// The tokenizer of the file's metadata (byte-level BPE, `tokenizer.ggml.model` "gpt2"),
    /// with its special tokens as `add_bos_token` / `add_eos_token` say and the chat template
    /// of `tokenizer.chat_template`.
    pub fn tokenizer(&self, vocab_size: usize) -> Result<Tokenizer> {
        let model = self.meta_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(gguf_err(
                &self.path,
                format!("tokenizer.ggml.model {model:?}; only byte-level BPE (gpt2) is handled"),
            ));
        }
        let pre = match self.content.metadata.get("tokenizer.ggml.pre") {
            None => "gpt-2",
            Some(_) => self.meta_str("tokenizer.ggml.pre")?,
        };
        let byte_level = json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
        });
        // llama.cpp's pre-tokenizer names; "smollm" is its starcoder family: each digit alone,
        // then the GPT-2 regex (as scripts/fetch-model.py maps them).
        let pre_tokenizer = match pre {
            "smollm" | "starcoder" => json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
            }),
            "gpt-2" => byte_level,
            other => {
                return Err(gguf_err(
                    &self.path,
                    format!("tokenizer.ggml.pre {other:?} has no known equivalent here"),
                ));
            }
        };
        let tokens = self.meta_strings("tokenizer.ggml.tokens")?;
        let merges = self.meta_strings("tokenizer.ggml.merges")?;
        let types = self
            .meta("tokenizer.ggml.token_type")?
            .to_vec()
            .map_err(|e| gguf_err(&self.path, format!("tokenizer.ggml.token_type: {e}")))?
            .iter()
            .map(|v| v.to_i32())
            .collect::<std::result::Result<Vec<i32>, _>>()
            .map_err(|e| gguf_err(&self.path, format!("tokenizer.ggml.token_type: {e}")))?;
        if types.len() != tokens.len() {
            return Err(gguf_err(
                &self.path,
                format!("{} token types for {} tokens", types.len(), tokens.len()),
            ));
        }
        let added: Vec<_> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED].contains(ty))
            .map(|(id, (content, &ty))| {
                json!({
                    "id": id, "content": content, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
                })
            })
            .collect();
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| ((*t).to_owned(), json!(id)))
            .collect();
        let tokenizer_json = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": {
                "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                "use_regex": true
            },
            "decoder": {
                "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true
            },
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            },
        });
        let inner: tokenizers::Tokenizer =
            tokenizer_json
                .to_string()
                .parse()
                .map_err(|e: tokenizers::Error| {
                    gguf_err(
                        &self.path,
                        format!("the metadata's tokenizer does not build: {e}"),
                    )
                })?;
        let bos = self.meta_usize("tokenizer.ggml.bos_token_id")?;
        let eos = self.meta_usize("tokenizer.ggml.eos_token_id")?;
        let name = |id: usize| tokens.get(id).map_or(String::new(), |t| (*t).to_owned());
        let config = json!({"bos_token_id": bos, "eos_token_id": eos});
        let tok_config = json!({
            "add_bos_token": self.meta_bool_or("tokenizer.ggml.add_bos_token", false)?,
            "add_eos_token": self.meta_bool_or("tokenizer.ggml.add_eos_token", false)?,
            "bos_token": name(bos),
            "eos_token": name(eos),
        });
        let chat = match self.content.metadata.get("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(crate::chat::ChatTemplate::new(
                self.meta_str("tokenizer.chat_template")?.to_owned(),
                self.path.clone(),
                name(bos),
                name(eos),
            )?),
        };
        let tok = Tokenizer::from_parts(inner, &self.path, &config, &tok_config)?
            .with_chat_template(chat);
        tracing::info!(
            path = %self.path.display(),
            special_tokens = ?tok.special_tokens(),
            chat_template = tok.chat_template().is_some(),
            "using the GGUF's tokenizer"
        );
        tok.checked(vocab_size, &self.path)
    }
}

/// Finds the model file under `path`: `path` itself when it is a `.gguf` file, else the one
/// `.gguf` file of directory `path` when it holds no `*.safetensors`; `None` for a Hugging Face
/// directory.
pub fn gguf_in(path: &Path) -> Result<Option<PathBuf>> {
    let is_gguf = |p: &Path| p.extension().is_some_and(|x| x == "gguf");
    if path.is_file() {
        return Ok(is_gguf(path).then(|| path.to_owned()));
    }
    let entries: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|source| WorkerError::Io {
            path: path.to_owned(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    if entries
        .iter()
        .any(|p| p.extension().is_some_and(|x| x == "safetensors"))
    {
        return Ok(None);
    }
    let mut ggufs: Vec<_> = entries.into_iter().filter(|p| is_gguf(p)).collect();
    match ggufs.len() {
        0 => Ok(None),
        1 => Ok(ggufs.pop()),
        n => Err(gguf_err(
            path,
            format!("{n} .gguf files and no safetensors: name the file to load"),
        )),
    }
}

/// The quantized tensors of one Llama GGUF under Hugging Face names (q/k unpermuted).
pub(crate) fn llama_tensors(
    file: &mut GgufFile,
    cfg: &ModelConfig,
) -> Result<HashMap<String, Arc<QTensor>>> {
    let mut ts = HashMap::new();
    let mut put = |name: String, t: QTensor| {
        ts.insert(name, Arc::new(t));
    };
    put(
        "model.embed_tokens.weight".into(),
        file.tensor("token_embd.weight")?,
    );
    for l in 0..cfg.num_layers {
        let (p, b) = (format!("model.layers.{l}."), format!("blk.{l}."));
        let names = [
            ("input_layernorm", "attn_norm"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("post_attention_layernorm", "ffn_norm"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ];
        for (hf, gg) in names {
            put(
                format!("{p}{hf}.weight"),
                file.tensor(&format!("{b}{gg}.weight"))?,
            );
        }
        put(
            format!("{p}self_attn.q_proj.weight"),
            file.unpermuted(&format!("{b}attn_q.weight"), cfg.num_heads)?,
        );
        put(
            format!("{p}self_attn.k_proj.weight"),
            file.unpermuted(&format!("{b}attn_k.weight"), cfg.num_kv_heads)?,
        );
    }
    put(
        "model.norm.weight".into(),
        file.tensor("output_norm.weight")?,
    );
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), file.tensor("output.weight")?);
    }
    Ok(ts)
}

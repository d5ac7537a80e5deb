//! What turns a request into the worker's tokens and block keys, without the weights: the
//! model's shape (for the KV layout), its tokenizer and chat template, and the deployment's
//! block-key secret. The worker's own startup and a KV-aware router in front of workers
//! (kvtier-router) both use these, so the router renders, tokenizes and hashes a prompt exactly
//! as the workers do.

use std::path::Path;

use kvtier_core::{HashScheme, HashSecret};

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use crate::tokenizer::Tokenizer;

/// The model's configuration and tokenizer as `serve --model-dir path` loads them, weights
/// left unread: `None` is the built-in random-weight model (byte tokenizer); a GGUF file (or a
/// directory holding one and no safetensors) gives its metadata's shape, tokenizer and chat
/// template; a Hugging Face directory its `config.json` and `tokenizer.json` (else bytes).
pub fn model_and_tokenizer(
    model_dir: Option<&Path>,
    block_tokens: usize,
) -> Result<(ModelConfig, Tokenizer)> {
    let Some(path) = model_dir else {
        let cfg = ModelConfig {
            block_tokens,
            ..ModelConfig::default()
        };
        cfg.validate()?;
        return Ok((cfg, Tokenizer::Byte));
    };
    match crate::gguf::gguf_in(path)? {
        Some(file) => {
            let file = crate::gguf::GgufFile::open(&file)?;
            let cfg = file.model_config(block_tokens)?;
            let tok = file.tokenizer(cfg.vocab_size)?;
            Ok((cfg, tok))
        }
        None => {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|source| WorkerError::Io {
                path: cfg_path.clone(),
                source,
            })?;
            let cfg = ModelConfig::from_hf_json(&text, block_tokens)?;
            let tok = Tokenizer::for_model_dir(path, cfg.vocab_size)?;
            Ok((cfg, tok))
        }
    }
}

/// Reads a deployment's block-key secret from `path` (at least 16 bytes; trailing whitespace,
/// such as the newline an editor adds, is ignored).
pub fn read_hash_secret(path: &Path) -> Result<HashSecret> {
    let mut bytes = std::fs::read(path).map_err(|source| WorkerError::Io {
        path: path.to_owned(),
        source,
    })?;
    while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
        bytes.pop();
    }
    Ok(HashSecret::new(HashScheme::Xxh3Keyed, &bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_random_model_has_the_default_shape_and_bytes() {
        let (cfg, tok) = model_and_tokenizer(None, 16).unwrap();
        assert_eq!(cfg, ModelConfig::default());
        assert!(matches!(tok, Tokenizer::Byte));
        assert!(model_and_tokenizer(None, 3).is_err(), "block_tokens 3");
    }

    #[test]
    fn a_secret_file_ignores_its_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, b"0123456789abcdef0123\n").unwrap();
        let a = read_hash_secret(&p).unwrap();
        std::fs::write(&p, b"0123456789abcdef0123").unwrap();
        let b = read_hash_secret(&p).unwrap();
        let layout = ModelConfig::default().kv_layout().unwrap();
        let keys = |s: HashSecret| {
            crate::prefix_cache::BlockKeys::new(s, "m".into(), layout)
                .keys(&[7; 16], None)
                .unwrap()
        };
        assert_eq!(keys(a.clone()), keys(b));
        assert_ne!(keys(a), keys(HashSecret::development()));
        std::fs::write(&p, b"short\n").unwrap();
        assert!(read_hash_secret(&p).is_err());
        assert!(read_hash_secret(&dir.path().join("none")).is_err());
    }
}

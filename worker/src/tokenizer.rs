//! Tokenizers: a byte-level one (ids 0..=255 are the bytes, then BOS and EOS), enough for a
//! random-weight model and for prefix hashing, and a Hugging Face `tokenizer.json` loaded from
//! a model directory ([`Tokenizer::load`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Result, WorkerError};

#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const BOS: u32 = 256;
    pub const EOS: u32 = 257;
    pub const VOCAB_SIZE: usize = 258;

    /// UTF-8 bytes of `text`, after a BOS when `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        if add_bos {
            ids.push(Self::BOS);
        }
        ids.extend(text.bytes().map(u32::from));
        ids
    }

    /// Text of `ids`, skipping BOS/EOS; byte sequences that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) if id == Self::BOS || id == Self::EOS => {}
                Err(_) => {
                    return Err(WorkerError::TokenOutOfVocab {
                        id,
                        vocab_size: Self::VOCAB_SIZE,
                    });
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Added tokens taken as BOS when `config.json` names none.
const BOS_NAMES: &[&str] = &[
    "<s>",
    "<|begin_of_text|>",
    "<bos>",
    "<|startoftext|>",
    "[BOS]",
];
/// Added tokens taken as EOS when `config.json` names none.
const EOS_NAMES: &[&str] = &[
    "</s>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<eos>",
    "<|endoftext|>",
    "[EOS]",
];

/// The special tokens a plain-text prompt gets around its text, decided as `transformers`
/// decides them: each of `add_bos_token` / `add_eos_token` of `tokenizer_config.json` that is
/// set says whether its token is added; a side the file does not set (or no file) gets what
/// the `tokenizer.json`'s post-processor adds there (a `TemplateProcessing`'s `<s> $A`, or
/// nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Ids put in front of the text.
    pub prefix: Vec<u32>,
    /// Ids put after it.
    pub suffix: Vec<u32>,
}

/// A Hugging Face tokenizer with the BOS and stop tokens the worker uses.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Vec<u32>,
    /// What a plain-text prompt gets around its text.
    specials: SpecialTokens,
    /// One past the largest id the tokenizer can produce.
    id_bound: usize,
    /// The model directory's chat template ([`crate::chat`]), if it has one.
    chat: Option<crate::chat::ChatTemplate>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("id_bound", &self.id_bound)
            .field("chat", &self.chat)
            .finish_non_exhaustive()
    }
}

/// The tokenizer a worker encodes prompts and decodes completions with.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// [`ByteTokenizer`].
    Byte,
    /// A `tokenizer.json`.
    Hf(Arc<HfTokenizer>),
}

fn tok_err(path: &Path, reason: impl Into<String>) -> WorkerError {
    WorkerError::Tokenizer {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Ids under `key` of a `config.json` object: a number or a list of numbers.
fn config_ids(config: &serde_json::Value, key: &str) -> Vec<u32> {
    let one = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match config.get(key) {
        Some(serde_json::Value::Array(items)) => items.iter().filter_map(one).collect(),
        Some(v) => one(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// What the post-processor of `inner` puts before and after a text's ids, found by encoding
/// probe texts with and without it. `None` when it does something else than adding ids
/// around the text.
fn post_processor_specials(inner: &tokenizers::Tokenizer) -> Option<SpecialTokens> {
    for probe in ["a", "hello", "0", " "] {
        let (Ok(with), Ok(without)) = (inner.encode(probe, true), inner.encode(probe, false))
        else {
            continue;
        };
        let (with, without) = (with.get_ids(), without.get_ids());
        if without.is_empty() || with.len() < without.len() {
            continue;
        }
        let at = (0..=with.len() - without.len()).find(|&i| with[i..].starts_with(without))?;
        return Some(SpecialTokens {
            prefix: with[..at].to_vec(),
            suffix: with[at + without.len()..].to_vec(),
        });
    }
    None
}

/// A special token named in `tokenizer_config.json`: a string or `{"content": ...}`.
fn config_token(tok_config: &serde_json::Value, key: &str) -> Option<String> {
    match tok_config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

impl Tokenizer {
    /// The tokenizer for model directory `dir`: `dir/tokenizer.json` when there is one (its
    /// BOS/EOS from `dir/config.json`'s `bos_token_id`/`eos_token_id`, else from its added
    /// tokens; the special tokens a prompt gets from `dir/tokenizer_config.json`, see
    /// [`SpecialTokens`]), else the byte tokenizer. Every id the tokenizer can produce must be
    /// below `vocab_size`.
    pub fn for_model_dir(dir: &Path, vocab_size: usize) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            tracing::warn!(
                dir = %dir.display(),
                "no tokenizer.json in the model directory: prompts are byte-tokenized"
            );
            return Tokenizer::Byte.checked(vocab_size, &path);
        }
        let config = match std::fs::read(dir.join("config.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
            Err(_) => serde_json::Value::Null,
        };
        let cfg_path = dir.join("tokenizer_config.json");
        let tok_config = match std::fs::read(&cfg_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| tok_err(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(tok_err(&cfg_path, format!("cannot read: {e}"))),
        };
        let mut tok = Self::load_with(&path, &config, &tok_config)?;
        tracing::info!(
            path = %path.display(),
            special_tokens = ?tok.special_tokens(),
            "using the model directory's tokenizer"
        );
        if let (Tokenizer::Hf(h), Some(chat)) =
            (&mut tok, crate::chat::ChatTemplate::for_model_dir(dir)?)
        {
            tracing::info!(source = %chat.source().display(), "using the model's chat template");
            Arc::get_mut(h).expect("just built").chat = Some(chat);
        }
        tok.checked(vocab_size, &path)
    }

    /// Loads `path` (a `tokenizer.json`); `config` is the model's `config.json` (or null).
    /// Prompts get the special tokens of its post-processor (no `tokenizer_config.json`).
    pub fn load(path: &Path, config: &serde_json::Value) -> Result<Self> {
        Self::load_with(path, config, &serde_json::Value::Null)
    }

    /// [`load`](Self::load) with the model's `tokenizer_config.json` (or null), whose
    /// `add_bos_token` / `add_eos_token` decide the prompt's special tokens when set.
    pub fn load_with(
        path: &Path,
        config: &serde_json::Value,
        tok_config: &serde_json::Value,
    ) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| WorkerError::Io {
            path: path.to_owned(),
            source,
        })?;
        let inner: tokenizers::Tokenizer = std::str::from_utf8(&bytes)
            .map_err(|e| e.to_string())
            .and_then(|s| s.parse().map_err(|e: tokenizers::Error| e.to_string()))
            .map_err(|e| tok_err(path, format!("not a valid tokenizer.json: {e}")))?;
        Self::from_parts(inner, path, config, tok_config)
    }

    /// [`load_with`](Self::load_with) for a tokenizer already built in memory (`source` names
    /// where it came from in errors and logs).
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        source: &Path,
        config: &serde_json::Value,
        tok_config: &serde_json::Value,
    ) -> Result<Self> {
        let path = source;
        let by_name = |names: &[&str]| names.iter().find_map(|n| inner.token_to_id(n));
        let bos = config_ids(config, "bos_token_id")
            .first()
            .copied()
            .or_else(|| by_name(BOS_NAMES));
        let mut eos = config_ids(config, "eos_token_id");
        if eos.is_empty() {
            eos.extend(by_name(EOS_NAMES));
        }
        let id_bound = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .chain(bos.map(|id| id as usize + 1))
            .chain(eos.iter().map(|&id| id as usize + 1))
            .max()
            .unwrap_or(0);
        if id_bound == 0 {
            return Err(tok_err(path, "the vocabulary is empty"));
        }
        let post = post_processor_specials(&inner).unwrap_or_else(|| {
            tracing::warn!(
                path = %path.display(),
                "the tokenizer's post-processor does more than add tokens around the text; \
                 prompts get only the special tokens tokenizer_config.json asks for"
            );
            SpecialTokens::default()
        });
        let flag = |k: &str| tok_config.get(k).and_then(serde_json::Value::as_bool);
        // The token tokenizer_config.json names, else config.json's, else the post-processor's.
        let named = |key: &str| config_token(tok_config, key).and_then(|t| inner.token_to_id(&t));
        let specials = SpecialTokens {
            prefix: match flag("add_bos_token") {
                None => post.prefix,
                Some(false) => Vec::new(),
                Some(true) => named("bos_token")
                    .or(bos)
                    .map_or(post.prefix, |id| vec![id]),
            },
            suffix: match flag("add_eos_token") {
                None => post.suffix,
                Some(false) => Vec::new(),
                Some(true) => named("eos_token")
                    .or(eos.first().copied())
                    .map_or(post.suffix, |id| vec![id]),
            },
        };
        Ok(Tokenizer::Hf(Arc::new(HfTokenizer {
            inner,
            bos,
            eos,
            specials,
            id_bound,
            chat: None,
        })))
    }

    /// `self` with `chat` as its chat template (the byte tokenizer has none and is returned
    /// as it is).
    pub fn with_chat_template(mut self, chat: Option<crate::chat::ChatTemplate>) -> Self {
        if let Tokenizer::Hf(h) = &mut self
            && let Some(inner) = Arc::get_mut(h)
        {
            inner.chat = chat;
        }
        self
    }

    /// The model directory's chat template (only with its `tokenizer.json`).
    pub fn chat_template(&self) -> Option<&crate::chat::ChatTemplate> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Hf(h) => h.chat.as_ref(),
        }
    }

    /// `self`, if every id it can produce is below `vocab_size`.
    pub(crate) fn checked(self, vocab_size: usize, path: &Path) -> Result<Self> {
        let bound = self.id_bound();
        if bound > vocab_size {
            let what = match self {
                Tokenizer::Byte => {
                    PathBuf::from(format!("{} absent, so the byte tokenizer", path.display()))
                }
                Tokenizer::Hf(_) => path.to_owned(),
            };
            return Err(WorkerError::Tokenizer {
                path: what,
                reason: format!(
                    "produces token ids up to {}, but the model's vocab_size is {vocab_size}",
                    bound - 1
                ),
            });
        }
        Ok(self)
    }

    /// One past the largest id this tokenizer can produce.
    pub fn id_bound(&self) -> usize {
        match self {
            Tokenizer::Byte => ByteTokenizer::VOCAB_SIZE,
            Tokenizer::Hf(h) => h.id_bound,
        }
    }

    pub fn bos(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => Some(ByteTokenizer::BOS),
            Tokenizer::Hf(h) => h.bos,
        }
    }

    /// The special tokens [`encode`](Self::encode) puts around a plain-text prompt (the byte
    /// tokenizer: its BOS in front).
    pub fn special_tokens(&self) -> SpecialTokens {
        match self {
            Tokenizer::Byte => SpecialTokens {
                prefix: vec![ByteTokenizer::BOS],
                suffix: Vec::new(),
            },
            Tokenizer::Hf(h) => h.specials.clone(),
        }
    }

    /// Tokens that end generation.
    pub fn eos(&self) -> Vec<u32> {
        match self {
            Tokenizer::Byte => vec![ByteTokenizer::EOS],
            Tokenizer::Hf(h) => h.eos.clone(),
        }
    }

    /// Ids of `text`. With `add_special_tokens` (a plain-text prompt), the special tokens the
    /// model's configuration asks for ([`SpecialTokens`]; the byte tokenizer: its BOS), as
    /// `transformers`' `encode(text)`; without (a prompt rendered by a chat template, which
    /// writes its own), none.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.encode(text, add_special_tokens)),
            Tokenizer::Hf(h) => {
                let enc = h
                    .inner
                    .encode(text, false)
                    .map_err(|e| WorkerError::Tokenizer {
                        path: PathBuf::from("tokenizer.json"),
                        reason: format!("encoding failed: {e}"),
                    })?;
                if !add_special_tokens {
                    return Ok(enc.get_ids().to_vec());
                }
                let s = &h.specials;
                let mut ids = Vec::with_capacity(s.prefix.len() + enc.len() + s.suffix.len());
                ids.extend_from_slice(&s.prefix);
                ids.extend_from_slice(enc.get_ids());
                ids.extend_from_slice(&s.suffix);
                Ok(ids)
            }
        }
    }

    /// Text of `ids`, skipping special tokens (and, with a `tokenizer.json`, ids it does not
    /// know, such as a model's padding rows past the tokenizer's vocabulary).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Byte => ByteTokenizer.decode(ids),
            Tokenizer::Hf(h) => h
                .inner
                .decode(ids, true)
                .map_err(|e| WorkerError::Tokenizer {
                    path: PathBuf::from("tokenizer.json"),
                    reason: format!("decoding failed: {e}"),
                }),
        }
    }

    /// An incremental decoder for streamed text.
    pub fn stream(&self) -> TextStream {
        match self {
            Tokenizer::Byte => TextStream::Byte(Utf8Stream::default()),
            Tokenizer::Hf(h) => TextStream::Hf {
                tok: h.clone(),
                ids: Vec::new(),
                prefix: 0,
                read: 0,
            },
        }
    }
}

/// Turns generated tokens into text deltas whose concatenation is the decoded completion.
pub enum TextStream {
    Byte(Utf8Stream),
    /// Incremental detokenization over a sliding window: each push decodes only the ids from
    /// `prefix` on (the tokens of the last emitted delta and those after it), so the cost per
    /// token stays constant instead of growing with the completion. The window keeps the
    /// previous delta's tokens as context, because some decoders (SentencePiece's leading
    /// space, byte-level merges) render a token differently after another. New text is held
    /// back while it ends in an incomplete character (U+FFFD).
    Hf {
        tok: Arc<HfTokenizer>,
        ids: Vec<u32>,
        /// Start of the decode window.
        prefix: usize,
        /// End of the ids whose text was emitted.
        read: usize,
    },
}

impl TextStream {
    /// Text completed by `token` (possibly none).
    pub fn push(&mut self, token: u32) -> String {
        match self {
            TextStream::Byte(u) => u.push(token),
            TextStream::Hf {
                tok,
                ids,
                prefix,
                read,
            } => {
                ids.push(token);
                Self::delta(tok, ids, prefix, read, false)
            }
        }
    }

    /// Whatever is held back.
    pub fn finish(&mut self) -> String {
        match self {
            TextStream::Byte(u) => u.finish(),
            TextStream::Hf {
                tok,
                ids,
                prefix,
                read,
            } => Self::delta(tok, ids, prefix, read, true),
        }
    }

    /// The text `ids[read..]` adds after `ids[prefix..read]`, moving the window when any is
    /// emitted. `last`: emit even an incomplete character (the stream ended).
    fn delta(
        tok: &HfTokenizer,
        ids: &[u32],
        prefix: &mut usize,
        read: &mut usize,
        last: bool,
    ) -> String {
        let decode = |range: &[u32]| tok.inner.decode(range, true).ok();
        let (Some(before), Some(now)) = (decode(&ids[*prefix..*read]), decode(&ids[*prefix..]))
        else {
            return String::new();
        };
        if now.len() <= before.len() || (!last && now.ends_with('\u{FFFD}')) {
            return String::new();
        }
        // The window's earlier text is a prefix of its text now (its tokens are unchanged);
        // hold back while the cut falls inside a character.
        let Some(new) = now.get(before.len()..) else {
            return String::new();
        };
        *prefix = *read;
        *read = ids.len();
        new.to_owned()
    }
}

/// Turns byte tokens into text as they arrive: holds back an incomplete UTF-8 sequence until
/// its last byte comes; invalid bytes become U+FFFD (as [`ByteTokenizer::decode`]).
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Text completed by `token` (often one character, sometimes none).
    pub fn push(&mut self, token: u32) -> String {
        if let Ok(b) = u8::try_from(token) {
            self.pending.push(b);
        }
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_owned();
                self.pending.clear();
                s
            }
            Err(e) if e.error_len().is_none() => {
                // Incomplete at the end: emit the valid part, keep the tail.
                let valid = e.valid_up_to();
                let s = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
                s
            }
            Err(_) => {
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                s
            }
        }
    }

    /// Whatever is held back, lossily.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text() {
        let t = ByteTokenizer;
        for text in ["", "hello", "naïve café 🦀", "line\nbreak\0nul"] {
            let ids = t.encode(text, true);
            assert_eq!(ids[0], ByteTokenizer::BOS);
            assert_eq!(ids.len(), text.len() + 1);
            assert_eq!(t.decode(&ids).unwrap(), text);
            assert_eq!(t.decode(&t.encode(text, false)).unwrap(), text);
        }
    }

    #[test]
    fn specials_are_skipped_and_unknown_ids_rejected() {
        let t = ByteTokenizer;
        assert_eq!(t.decode(&[104, 257, 105]).unwrap(), "hi");
        assert!(matches!(
            t.decode(&[104, 258]),
            Err(WorkerError::TokenOutOfVocab { id: 258, .. })
        ));
        // A split multi-byte character decodes lossily rather than failing.
        assert_eq!(t.decode(&[0xC3]).unwrap(), "\u{FFFD}");
    }

    #[test]
    fn config_ids_take_a_number_or_a_list() {
        let v = serde_json::json!({"bos_token_id": 1, "eos_token_id": [2, 7], "pad": "x"});
        assert_eq!(config_ids(&v, "bos_token_id"), vec![1]);
        assert_eq!(config_ids(&v, "eos_token_id"), vec![2, 7]);
        assert!(config_ids(&v, "pad").is_empty());
        assert!(config_ids(&v, "absent").is_empty());
        assert!(config_ids(&serde_json::json!({"bos_token_id": -1}), "bos_token_id").is_empty());
    }

    #[test]
    fn the_byte_tokenizer_is_refused_for_a_smaller_vocabulary() {
        let p = Path::new("x/tokenizer.json");
        assert!(Tokenizer::Byte.checked(258, p).is_ok());
        let e = Tokenizer::Byte.checked(100, p).unwrap_err().to_string();
        assert!(
            e.contains("byte tokenizer") && e.contains("vocab_size is 100"),
            "{e}"
        );
    }
}

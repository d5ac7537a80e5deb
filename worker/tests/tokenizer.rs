//! A model directory's `tokenizer.json`: a small WordLevel tokenizer built at test time next to
//! a random-weight model saved as safetensors, served over loopback HTTP.

mod common;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_worker::model::random_weights;
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use kvtier_worker::{Engine, Model, ModelConfig, Sampling, Tokenizer, WorkerError};
use serde_json::{Value, json};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

const LIMIT: Duration = Duration::from_secs(60);
const BOS: u32 = 1;
const EOS: u32 = 2;
const WORDS: &[&str] = &[
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "kvtier", "keeps", "its", "KV",
    "blocks", "for", "next", "turn", "of", "agent", ".", ",", "a", "cache", "tier", "is", "fast",
    "slow", "warm", "cold", "hello", "world", "!", "?",
];

/// `<unk>` 0, `<s>` 1, `</s>` 2, then `WORDS` (and `extra` at the ids given); its
/// post-processor puts `<s>` in front, as Llama 2's `tokenizer.json` does.
fn hf_tokenizer(extra: &[(&str, u32)]) -> Result<HfTokenizer> {
    let mut tok = plain_tokenizer(extra)?;
    tok.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<s> $A")
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .try_pair("<s> $A <s> $B")
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .special_tokens(vec![("<s>", BOS)])
            .build()?,
    ));
    Ok(tok)
}

/// [`hf_tokenizer`] without a post-processor.
fn plain_tokenizer(extra: &[(&str, u32)]) -> Result<HfTokenizer> {
    let mut vocab: Vec<(String, u32)> = vec![
        ("<unk>".into(), 0),
        ("<s>".into(), BOS),
        ("</s>".into(), EOS),
    ];
    vocab.extend(WORDS.iter().zip(3u32..).map(|(w, i)| (w.to_string(), i)));
    vocab.extend(extra.iter().map(|&(w, i)| (w.to_owned(), i)));
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("<unk>".into())
        .build()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut tok = HfTokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.add_special_tokens([
        AddedToken::from("<s>", true),
        AddedToken::from("</s>", true),
    ])
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(tok)
}

fn vocab_size() -> usize {
    WORDS.len() + 3
}

fn model_config() -> ModelConfig {
    ModelConfig {
        vocab_size: vocab_size(),
        ..ModelConfig::default()
    }
}

/// Saves the seeded random model (config.json with BOS/EOS, model.safetensors) in `dir`.
fn save_model(dir: &Path, cfg: &ModelConfig) -> Result<()> {
    std::fs::write(
        dir.join("config.json"),
        json!({
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_context_tokens,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
        })
        .to_string(),
    )?;
    let weights = random_weights(cfg, 3)?;
    candle_core::safetensors::save(&weights, dir.join("model.safetensors"))?;
    Ok(())
}

async fn start(dir: &Path) -> Result<WorkerServer, WorkerError> {
    WorkerServer::start(ServeConfig {
        model_dir: Some(dir.to_owned()),
        pool_blocks: 64,
        ..worker_config(None)
    })
    .await
}

async fn complete(w: &WorkerServer, prompt: Value, stream: bool) -> Result<HttpResponse> {
    let r = tokio::time::timeout(
        LIMIT,
        post(
            w.addr(),
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}),
        ),
    )
    .await
    .context("request timed out")??;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    Ok(r)
}

fn text(v: &Value) -> Result<String> {
    Ok(v["choices"][0]["text"]
        .as_str()
        .context("choices[0].text")?
        .to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_use_the_model_directorys_tokenizer() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = model_config();
    save_model(dir.path(), &cfg)?;
    let hf = hf_tokenizer(&[])?;
    hf.save(dir.path().join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    let prompt = "the quick brown fox jumps over the lazy dog , kvtier keeps its KV blocks";
    let words = hf
        .encode(prompt, false)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .get_ids()
        .to_vec();
    assert_eq!(words.len(), prompt.split_whitespace().count());
    assert!(
        !words.contains(&0),
        "every prompt word is in the vocabulary"
    );
    let mut ids = vec![BOS];
    ids.extend(&words);

    // The library type: same ids, BOS from config.json, EOS the stop token.
    let tok = Tokenizer::for_model_dir(dir.path(), cfg.vocab_size)?;
    assert_eq!(tok.encode(prompt, true)?, ids);
    assert_eq!(tok.bos(), Some(BOS));
    assert_eq!(tok.eos(), vec![EOS]);

    // The reference: the loaded model alone, stopping at the tokenizer's EOS.
    let mut engine = Engine::new(Model::from_hf_dir(dir.path(), cfg.block_tokens)?, 64)?;
    engine.set_eos(tok.eos());
    let g = engine.generate(&ids, 12, Sampling::GREEDY)?;
    ensure!(!g.tokens.is_empty(), "the seeded model stopped at once");
    let want = hf
        .decode(&g.tokens, true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(!want.is_empty(), "the completion decodes to text");

    let w = start(dir.path()).await?;
    let v = complete(&w, json!(prompt), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], g.tokens.len(), "{v}");
    let got = text(&v)?;
    assert_eq!(got, want);

    // The same prompt as token ids gives the same completion.
    let v = complete(&w, json!(ids), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(text(&v)?, want);

    // Streaming deltas concatenate to the non-streaming text.
    let r = complete(&w, json!(prompt), true).await?;
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = String::new();
    let mut deltas = 0;
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d)?;
        if let Some(t) = c["choices"].get(0).and_then(|c| c["text"].as_str()) {
            streamed.push_str(t);
            deltas += usize::from(!t.is_empty());
        }
    }
    assert_eq!(streamed, want);
    assert!(deltas >= 2, "text arrives in pieces: {data:?}");

    // A word the tokenizer does not know is its <unk>, not bytes.
    let v = complete(&w, json!("the zebra"), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    w.shutdown().await;
    Ok(())
}

/// Writes `tokenizer.json` (with or without its BOS post-processor) and `tokenizer_config.json`
/// (or none) into `dir`.
fn write_tokenizer(dir: &Path, post_processor: bool, tok_config: Option<&Value>) -> Result<()> {
    let tok = if post_processor {
        hf_tokenizer(&[])?
    } else {
        plain_tokenizer(&[])?
    };
    tok.save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let cfg = dir.join("tokenizer_config.json");
    match tok_config {
        Some(c) => std::fs::write(&cfg, c.to_string())?,
        None if cfg.exists() => std::fs::remove_file(&cfg)?,
        None => {}
    }
    Ok(())
}

/// Special tokens as the model's tokenizer configuration says (issue 17): `add_bos_token` /
/// `add_eos_token` of `tokenizer_config.json` where set, else what `tokenizer.json`'s
/// post-processor adds; a prompt rendered by the model's chat template gets none added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_tokens_follow_the_tokenizer_configuration() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = model_config();
    save_model(dir.path(), &cfg)?;
    let prompt = "the quick brown fox";
    let words = plain_tokenizer(&[])?
        .encode(prompt, false)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .get_ids()
        .to_vec();
    assert_eq!(words.len(), 4);
    let with = |pre: &[u32], post: &[u32]| [pre, &words[..], post].concat();
    // (post-processor adds BOS, tokenizer_config.json, ids of the completion prompt)
    let cases = [
        (true, None, with(&[BOS], &[])),
        (false, None, with(&[], &[])),
        (true, Some(json!({"add_bos_token": false})), with(&[], &[])),
        (
            false,
            Some(json!({"add_bos_token": true})),
            with(&[BOS], &[]),
        ),
        (true, Some(json!({"bos_token": "<s>"})), with(&[BOS], &[])),
        // Only the EOS side set: the BOS side stays the post-processor's.
        (
            true,
            Some(json!({"add_eos_token": true})),
            with(&[BOS], &[EOS]),
        ),
        (
            false,
            Some(
                json!({"add_bos_token": true, "add_eos_token": true, "eos_token": {"content": "</s>"}}),
            ),
            with(&[BOS], &[EOS]),
        ),
    ];
    for (post, tok_config, want) in &cases {
        write_tokenizer(dir.path(), *post, tok_config.as_ref())?;
        let tok = Tokenizer::for_model_dir(dir.path(), cfg.vocab_size)?;
        let what = format!("post-processor {post}, tokenizer_config.json {tok_config:?}");
        assert_eq!(&tok.encode(prompt, true)?, want, "{what}");
        assert_eq!(tok.encode(prompt, false)?, words, "{what}");
    }

    // Served with add_bos_token false (SmolLM2's configuration) although the post-processor
    // adds BOS: no BOS, and the completion is the model's continuation of the bare words.
    let template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}";
    write_tokenizer(
        dir.path(),
        true,
        Some(&json!({"add_bos_token": false, "bos_token": "<s>", "chat_template": template})),
    )?;
    let mut engine = Engine::new(Model::from_hf_dir(dir.path(), cfg.block_tokens)?, 64)?;
    engine.set_eos(vec![EOS]);
    let g = engine.generate(&words, 12, Sampling::GREEDY)?;
    let want = hf_tokenizer(&[])?
        .decode(&g.tokens, true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let w = start(dir.path()).await?;
    let v = complete(&w, json!(prompt), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], words.len(), "{v}");
    assert_eq!(
        text(&v)?,
        want,
        "the continuation of the prompt without BOS"
    );
    // Chat: the template writes BOS itself; nothing is added (BOS once).
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2});
    let r = post(w.addr(), "/v1/chat/completions", &chat).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    assert_eq!(r.json()?["usage"]["prompt_tokens"], words.len() + 1);
    w.shutdown().await;

    // add_bos_token true: the completion prompt gets BOS, the chat prompt still has one.
    write_tokenizer(
        dir.path(),
        false,
        Some(&json!({"add_bos_token": true, "bos_token": "<s>", "chat_template": template})),
    )?;
    let w = start(dir.path()).await?;
    let v = complete(&w, json!(prompt), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], words.len() + 1, "{v}");
    let r = post(w.addr(), "/v1/chat/completions", &chat).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    assert_eq!(r.json()?["usage"]["prompt_tokens"], words.len() + 1);
    w.shutdown().await;

    // No template: the worker's own is encoded as a completion prompt is (here: no BOS).
    write_tokenizer(dir.path(), true, Some(&json!({"add_bos_token": false})))?;
    let tok = Tokenizer::for_model_dir(dir.path(), cfg.vocab_size)?;
    let builtin = format!("<|user|>\n{prompt}\n<|assistant|>\n");
    let ids = tok.encode(&builtin, true)?;
    assert_ne!(ids[0], BOS);
    let w = start(dir.path()).await?;
    let r = post(w.addr(), "/v1/chat/completions", &chat).await?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    assert_eq!(r.json()?["usage"]["prompt_tokens"], ids.len());
    w.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_tokenizer_json_is_a_startup_error_naming_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    save_model(dir.path(), &model_config())?;
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": [not json")?;
    let e = start(dir.path())
        .await
        .err()
        .context("a malformed tokenizer.json was accepted")?
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    assert!(e.contains("not a valid tokenizer.json"), "{e}");

    // Valid JSON that is not a tokenizer.
    std::fs::write(dir.path().join("tokenizer.json"), "{\"hello\": 1}")?;
    let e = start(dir.path())
        .await
        .err()
        .context("accepted")?
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_with_ids_past_the_models_vocabulary_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = model_config();
    save_model(dir.path(), &cfg)?;
    let big = cfg.vocab_size as u32 + 5;
    hf_tokenizer(&[("zebra", big)])?
        .save(dir.path().join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let e = start(dir.path())
        .await
        .err()
        .context("a tokenizer past the vocabulary was accepted")?
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    assert!(e.contains(&format!("up to {big}")), "{e}");
    assert!(
        e.contains(&format!("vocab_size is {}", cfg.vocab_size)),
        "{e}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokenizer_json_prompts_are_byte_tokenized() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = ModelConfig::default();
    save_model(dir.path(), &cfg)?;
    let w = start(dir.path()).await?;
    let v = complete(&w, json!("hello"), false).await?.json()?;
    assert_eq!(v["usage"]["prompt_tokens"], "hello".len() + 1);
    w.shutdown().await;

    // A model too small for the byte tokenizer is refused at startup.
    let small = tempfile::tempdir()?;
    save_model(small.path(), &model_config())?;
    let e = start(small.path())
        .await
        .err()
        .context("accepted")?
        .to_string();
    assert!(e.contains("byte tokenizer"), "{e}");
    Ok(())
}

/// GPT-2's byte-to-character map of byte-level BPE: printable Latin-1 bytes stand for
/// themselves, the others for the characters after U+00FF, in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted)
            }
            .expect("a valid char")
        })
        .collect()
}

/// The pre-tokenizer regex of Llama 3's tokenizer.json.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer.json shaped like Llama 3's (byte-level BPE: the Split regex then ByteLevel,
/// a ByteLevel decoder, special tokens added after the vocabulary), with the 256 byte tokens
/// (id = byte) and a few merges. Returns it and its vocabulary size; BOS is `n`, EOS `n + 1`
/// and `n + 2` (end of turn).
fn llama3_style_tokenizer_json() -> (Value, usize) {
    let chars = byte_chars();
    let mut vocab: Vec<(String, u32)> = chars
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), b as u32))
        .collect();
    let c = |b: u8| chars[b as usize].to_string();
    let space = c(b' ');
    let merges: Vec<(String, String)> = vec![
        (space.clone(), "t".into()),
        ("h".into(), "e".into()),
        (format!("{space}t"), "he".into()),
        (space.clone(), "k".into()),
        ("v".into(), "t".into()),
        (format!("{space}k"), "vt".into()),
        ("i".into(), "e".into()),
        ("ie".into(), "r".into()),
        (format!("{space}kvt"), "ier".into()),
        // é (C3 A9) as one token; other multi-byte characters stay split across tokens.
        (c(0xC3), c(0xA9)),
        (c(b'\n'), c(b'\n')),
    ];
    for (a, b) in &merges {
        let id = vocab.len() as u32;
        vocab.push((format!("{a}{b}"), id));
    }
    let n = vocab.len();
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            special(n, "<|begin_of_text|>"),
            special(n + 1, "<|end_of_text|>"),
            special(n + 2, "<|eot_id|>"),
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
             "use_regex": false},
        ]},
        // As Llama 3's: ByteLevel, then a template that puts BOS in front.
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
             "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [n],
                                                      "tokens": ["<|begin_of_text|>"]}}},
        ]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": true,
            "vocab": vocab
                .into_iter()
                .map(|(k, v)| (k, json!(v)))
                .collect::<serde_json::Map<String, Value>>(),
            "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
        },
    });
    (tok, n + 3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_llama3_style_byte_level_bpe_tokenizer_round_trips_and_streams() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tok_json, vocab) = llama3_style_tokenizer_json();
    let (bos, eos, eot) = (vocab as u32 - 3, vocab as u32 - 2, vocab as u32 - 1);
    std::fs::write(dir.path().join("tokenizer.json"), tok_json.to_string())?;
    let cfg = ModelConfig {
        vocab_size: vocab,
        ..ModelConfig::default()
    };
    save_model(dir.path(), &cfg)?;
    // Llama 3 instruct lists two stop tokens.
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json"))?)?;
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!([eos, eot]);
    std::fs::write(dir.path().join("config.json"), config.to_string())?;

    let tok = Tokenizer::for_model_dir(dir.path(), vocab)?;
    assert_eq!(tok.bos(), Some(bos));
    assert_eq!(tok.eos(), vec![eos, eot]);
    let reference = HfTokenizer::from_file(dir.path().join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let texts = [
        "hello kvtier",
        "the kvtier  café 🦀\n\nnaïve 中文, it's 12345 tokens!",
        " leading space and trailing space ",
        "\n",
    ];
    for text in texts {
        let ids = tok.encode(text, false)?;
        let want = reference
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .get_ids()
            .to_vec();
        assert_eq!(ids, want, "{text:?}: the tokenizers crate's own ids");
        assert_eq!(tok.decode(&ids)?, text, "{text:?} round trip");
        assert_eq!(tok.encode(text, true)?[0], bos);
        // Streaming, one token at a time: the deltas add up to the text, and a character
        // split across tokens (🦀 is four byte tokens) is held back until it is whole.
        let mut stream = tok.stream();
        let mut streamed = String::new();
        for &id in &ids {
            let delta = stream.push(id);
            assert!(
                !delta.contains('\u{FFFD}'),
                "{text:?}: partial character {delta:?}"
            );
            streamed.push_str(&delta);
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, text);
    }
    // The merges apply (" kvtier" is one token), and 🦀 takes four.
    let merged = tok.encode(" kvtier", false)?;
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(tok.encode("🦀", false)?.len(), 4);

    // Served: the prompt counts BOS + its tokens; streamed text equals the plain completion.
    let prompt = "the kvtier café 🦀";
    let w = start(dir.path()).await?;
    let v = complete(&w, json!(prompt), false).await?.json()?;
    assert_eq!(
        v["usage"]["prompt_tokens"],
        tok.encode(prompt, true)?.len(),
        "{v}"
    );
    let want = text(&v)?;
    let r = complete(&w, json!(prompt), true).await?;
    let data = r.sse_data();
    let mut streamed = String::new();
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d)?;
        if let Some(t) = c["choices"].get(0).and_then(|c| c["text"].as_str()) {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, want);
    w.shutdown().await;
    Ok(())
}

/// The incremental decoder (a sliding window, not the whole completion per token) over a
/// long completion with multi-byte characters split across tokens: the deltas add up to the
/// full decode.
#[test]
fn a_long_streamed_completion_adds_up_to_its_full_decode() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tok_json, vocab) = llama3_style_tokenizer_json();
    std::fs::write(dir.path().join("tokenizer.json"), tok_json.to_string())?;
    let tok = Tokenizer::load(&dir.path().join("tokenizer.json"), &Value::Null)?;
    let ids: Vec<u32> = tok
        .encode(&"the kvtier café 🦀 naïve 中文 ".repeat(200), false)?
        .into_iter()
        .take(4000)
        .collect();
    assert!(ids.iter().all(|&i| (i as usize) < vocab));
    let mut stream = tok.stream();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&stream.push(id));
    }
    streamed.push_str(&stream.finish());
    assert_eq!(streamed, tok.decode(&ids)?);
    Ok(())
}

/// A chat template of our own in the Llama 3 style: BOS, a header per message, the end-of-turn
/// token, the assistant header as the generation prompt; user and assistant turns alternate.
const CHAT_TEMPLATE: &str = "{{- bos_token }}\
{%- for message in messages %}\
{%- if message['role'] not in ['system', 'user', 'assistant'] %}\
{{- raise_exception('Only system, user and assistant roles are supported') }}\
{%- endif %}\
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

/// A model directory in `dir` with a Llama-3-style tokenizer (the header tokens the templates
/// write added as special tokens after the others) and `template` as its chat template; its
/// tokenizer and vocabulary size.
fn model_dir_with_template(dir: &std::path::Path, template: &str) -> Result<(Tokenizer, usize)> {
    let (mut tok_json, vocab) = llama3_style_tokenizer_json();
    let added = tok_json["added_tokens"]
        .as_array_mut()
        .context("added_tokens")?;
    for (i, name) in ["<|start_header_id|>", "<|end_header_id|>"]
        .iter()
        .enumerate()
    {
        added.push(
            json!({"id": vocab + i, "content": name, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let vocab = vocab + 2;
    std::fs::write(dir.join("tokenizer.json"), tok_json.to_string())?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
               "chat_template": template})
        .to_string(),
    )?;
    let cfg = ModelConfig {
        vocab_size: vocab,
        ..ModelConfig::default()
    };
    save_model(dir, &cfg)?;
    Ok((Tokenizer::for_model_dir(dir, vocab)?, vocab))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_use_the_models_own_chat_template() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tok, vocab) = model_dir_with_template(dir.path(), CHAT_TEMPLATE)?;
    let template = tok.chat_template().context("the template was loaded")?;
    assert!(template.source().ends_with("tokenizer_config.json"));

    let messages = json!([
        {"role": "system", "content": "You are terse. "},
        {"role": "user", "content": "What does kvtier keep?"},
    ]);
    let want_text = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nWhat does kvtier keep?<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\n";
    let want = tok.encode(want_text, false)?;
    // The special tokens are single ids, and BOS appears once.
    assert_eq!(want[0], (vocab - 5) as u32, "BOS first");
    assert_eq!(want.iter().filter(|&&t| t == want[0]).count(), 1);
    assert!(
        want.contains(&((vocab - 2) as u32)),
        "<|start_header_id|> is one token"
    );

    let w = start(dir.path()).await?;
    let chat = |messages: Value| {
        let body = json!({"messages": messages, "max_tokens": 4, "temperature": 0});
        let addr = w.addr();
        async move { post(addr, "/v1/chat/completions", &body).await }
    };
    let r = tokio::time::timeout(LIMIT, chat(messages)).await??;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    assert_eq!(r.json()?["usage"]["prompt_tokens"], want.len());

    // The template's own error is a 400 that carries its message.
    let r = tokio::time::timeout(LIMIT, chat(json!([{"role": "tool", "content": "x"}]))).await??;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body
            .contains("Only system, user and assistant roles are supported"),
        "{}",
        r.body
    );
    w.shutdown().await;

    // A template that does not compile stops the worker at startup, naming the file.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"chat_template": "{% for m in messages %}"}).to_string(),
    )?;
    let e = start(dir.path())
        .await
        .err()
        .context("a broken chat template was accepted")?
        .to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("does not compile"),
        "{e}"
    );
    Ok(())
}

/// [`CHAT_TEMPLATE`] with tools, as agent harnesses use it: the request's tools after BOS, an
/// assistant's tool calls and a `tool` message's answer (with its call id) as their own turns.
const TOOLS_TEMPLATE: &str = "{{- bos_token }}\
{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' }}\
{%- for t in tools %}{{- t.function.name + ' (' + t.function.description + ') ' }}{%- endfor %}\
{{- '<|eot_id|>' }}{%- endif %}\
{%- for message in messages %}\
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\
{%- if message.tool_calls %}{%- for c in message.tool_calls %}\
{{- 'call ' + c.function.name + ' ' + c.function.arguments }}{%- endfor %}\
{%- elif message.role == 'tool' %}{{- 'answer to ' + message.tool_call_id + ': ' + message.content }}\
{%- else %}{{- message['content'] | trim }}{%- endif %}\
{{- '<|eot_id|>' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

/// A chat completion with `tools`, an assistant message that only calls a tool (no content)
/// and the `tool` message answering it is accepted, and its prompt is the model's template
/// rendered with all of them: the prompt's token count is that of the text the template
/// makes with the tools, the call and the answer (each adds tokens, so a request whose tools
/// or tool fields were dropped would count fewer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_with_tools_render_them_through_the_template() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (tok, _) = model_dir_with_template(dir.path(), TOOLS_TEMPLATE)?;

    let tools = json!([{"type": "function", "function": {
        "name": "read_file", "description": "reads one file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]);
    let messages = json!([
        {"role": "user", "content": "What is in README.md?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_7", "type": "function",
            "function": {"name": "read_file", "arguments": "{\"path\": \"README.md\"}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "kvtier keeps KV blocks"},
    ]);
    let h = |role: &str| format!("<|start_header_id|>{role}<|end_header_id|>\n\n");
    let want_text = format!(
        "<|begin_of_text|>{}Tools: read_file (reads one file of the repository) <|eot_id|>\
         {}What is in README.md?<|eot_id|>\
         {}call read_file {{\"path\": \"README.md\"}}<|eot_id|>\
         {}answer to call_7: kvtier keeps KV blocks<|eot_id|>{}",
        h("system"),
        h("user"),
        h("assistant"),
        h("tool"),
        h("assistant"),
    );
    let want = tok.encode(&want_text, false)?;

    let w = start(dir.path()).await?;
    let chat = |body: Value| {
        let addr = w.addr();
        async move { post(addr, "/v1/chat/completions", &body).await }
    };
    let r = tokio::time::timeout(
        LIMIT,
        chat(json!({"messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0})),
    )
    .await??;
    ensure!(r.status == 200, "status {}: {}", r.body, r.status);
    assert_eq!(r.json()?["usage"]["prompt_tokens"], want.len());

    // The same messages without `tools`: the template writes no tools' turn, fewer tokens.
    let r = tokio::time::timeout(
        LIMIT,
        chat(json!({"messages": messages, "max_tokens": 4, "temperature": 0})),
    )
    .await??;
    ensure!(r.status == 200, "status {}: {}", r.body, r.status);
    let without = r.json()?["usage"]["prompt_tokens"]
        .as_u64()
        .context("prompt_tokens")?;
    let tools_turn = format!(
        "{}Tools: read_file (reads one file of the repository) <|eot_id|>",
        h("system")
    );
    let want_without = tok.encode(&want_text.replacen(&tools_turn, "", 1), false)?;
    assert_eq!(without as usize, want_without.len());
    assert!(want_without.len() < want.len());
    w.shutdown().await;
    Ok(())
}

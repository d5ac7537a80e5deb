//! Greedy continuations with every step's logits, for comparison against an independent
//! reference (scripts/tests/test_gguf_reference.py runs it against scripts/model_reference.py).
//!
//! ```text
//! cargo run -p kvtier-worker --example greedy_logits -- MODEL MAX_TOKENS OUT_DIR < prompts
//! ```
//!
//! MODEL is what `kvtier-worker --model-dir` takes (a GGUF file or a Hugging Face directory).
//! Each stdin line is a JSON string, a prompt, tokenized by the model's tokenizer (with the
//! special tokens its configuration asks for). For prompt `i` the example writes
//! `OUT_DIR/i.f32` (MAX_TOKENS rows of `vocab_size` little-endian f32 logits: row `s` is the
//! distribution step `s` chose from) and prints `{"prompt": ids, "tokens": generated ids}`.
//! Generation does not stop at EOS, so both sides compare the same number of steps. A prompt
//! is prefilled in the scheduler's chunks of `PREFILL_CHUNK_TOKENS`, as `serve` does, so a long
//! one also checks a chunk's attention over the chunks before it.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use kvtier_worker::model::argmax;
use kvtier_worker::scheduler::PREFILL_CHUNK_TOKENS;
use kvtier_worker::{BlockTable, Engine, load_pretrained};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, max_tokens, out] = args.as_slice() else {
        bail!("usage: greedy_logits MODEL MAX_TOKENS OUT_DIR < prompts (JSON strings)");
    };
    let max_tokens: usize = max_tokens.parse().context("MAX_TOKENS")?;
    let out = PathBuf::from(out);
    let (model, tok) = load_pretrained(model.as_ref(), 16)?;
    let mut engine = Engine::new(model, 512)?;
    let stdout = std::io::stdout();
    for (i, line) in std::io::stdin().lock().lines().enumerate() {
        let text: String = serde_json::from_str(&line?).context("a JSON string")?;
        let prompt = tok.encode(&text, true)?;
        let mut table = BlockTable::new();
        let mut logits = Vec::new();
        for start in (0..prompt.len()).step_by(PREFILL_CHUNK_TOKENS) {
            let end = (start + PREFILL_CHUNK_TOKENS).min(prompt.len());
            logits = engine.prefill(&prompt[..end], start, &mut table)?;
        }
        let mut tokens = Vec::with_capacity(max_tokens);
        let mut rows = Vec::with_capacity(max_tokens * logits.len() * 4);
        for step in 0..max_tokens {
            rows.extend(logits.iter().flat_map(|x| x.to_le_bytes()));
            let next = argmax(&logits);
            tokens.push(next);
            if step + 1 < max_tokens {
                logits = engine.decode_step(next, prompt.len() + step, &mut table)?;
            }
        }
        engine.cache_mut().release_table(&mut table)?;
        std::fs::write(out.join(format!("{i}.f32")), &rows)?;
        let line = serde_json::json!({"prompt": prompt, "tokens": tokens});
        writeln!(stdout.lock(), "{line}")?;
    }
    Ok(())
}

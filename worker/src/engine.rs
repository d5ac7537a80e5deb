//! The engine: a model plus the block pool, with prefill from any cached prefix, decode and
//! sampling. Sequences are identified by their [`BlockTable`]s, so several can share the pool;
//! scheduling them together (continuous batching) is later work.

use std::time::{Duration, Instant};

use crate::error::{Result, WorkerError};
use crate::kv_cache::{BlockTable, PagedKvCache};
use crate::model::{LayerHook, Model, NoHook, argmax};
use crate::tokenizer::ByteTokenizer;
use kvtier_core::SplitMix64;

/// How to pick the next token: greedy (argmax) when `temperature <= 0`, otherwise sampling
/// from `softmax(logits / temperature)` with a PRNG seeded by `seed`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        seed: 0,
    };
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    MaxTokens,
    ContextFull,
}

/// The result of [`Engine::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (an EOS that ended generation is not included).
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Time to run the prompt and get the first logits.
    pub prefill_time: Duration,
    /// Time of the decode steps after the first token.
    pub decode_time: Duration,
}

/// Picks tokens from logits under a [`Sampling`]; one per sequence (it holds the PRNG).
#[derive(Clone, Debug)]
pub struct Sampler {
    temperature: f32,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(s: Sampling) -> Self {
        Self {
            temperature: s.temperature,
            rng: SplitMix64::new(s.seed),
        }
    }

    /// The next token: argmax when greedy, else a seeded draw from the softmax.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature.is_nan() || self.temperature <= 0.0 {
            return argmax(logits);
        }
        let max = logits[argmax(logits) as usize];
        let weights: Vec<f32> = logits
            .iter()
            .map(|&l| ((l - max) / self.temperature).exp())
            .collect();
        let total: f32 = weights.iter().sum();
        let mut r = self.rng.next_f32() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return i as u32;
            }
            r -= w;
        }
        // Rounding left r past the last weight: the last token with weight.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }
}

/// A model and its KV block pool.
pub struct Engine {
    model: Model,
    cache: PagedKvCache,
    /// Tokens that end generation (the byte tokenizer's EOS unless set).
    eos: Vec<u32>,
}

impl Engine {
    /// An engine with a pool of `num_blocks` blocks, in the memory of the device the model
    /// runs on.
    pub fn new(model: Model, num_blocks: usize) -> Result<Self> {
        let layout = model.config().kv_layout()?;
        #[cfg(feature = "cuda")]
        if let Some(gpu) = model.gpu() {
            let cache = PagedKvCache::on_gpu(layout, num_blocks, gpu)?;
            return Self::with_cache(model, cache);
        }
        let cache = PagedKvCache::new(layout, num_blocks)?;
        Ok(Self {
            model,
            cache,
            eos: vec![ByteTokenizer::EOS],
        })
    }

    /// An engine over a pool built by the caller (for example one in a registered transfer
    /// region, [`PagedKvCache::in_region`]). The pool's layout must be the model's.
    pub fn with_cache(model: Model, cache: PagedKvCache) -> Result<Self> {
        let layout = model.config().kv_layout()?;
        if *cache.layout() != layout {
            return Err(WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: "the pool's KV layout is not the model's".to_owned(),
            });
        }
        #[cfg(feature = "cuda")]
        if let (Some(a), Some(b)) = (model.gpu(), cache.gpu())
            && !std::sync::Arc::ptr_eq(a, b)
        {
            return Err(WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: "the pool is on another GPU (or another opening of it) than the model"
                    .to_owned(),
            });
        }
        if cache.is_on_gpu() != model.on_gpu() {
            return Err(WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: format!(
                    "the model runs on {} but its pool is in {} memory",
                    model.device_label(),
                    if cache.is_on_gpu() { "GPU" } else { "host" }
                ),
            });
        }
        Ok(Self {
            model,
            cache,
            eos: vec![ByteTokenizer::EOS],
        })
    }

    /// Sets the tokens that end generation (the tokenizer's EOS ids).
    pub fn set_eos(&mut self, eos: Vec<u32>) {
        self.eos = eos;
    }

    /// The tokens that end generation.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// The pool, for loading blocks (`allocate` + `write_block`) or freeing tables.
    pub fn cache_mut(&mut self) -> &mut PagedKvCache {
        &mut self.cache
    }

    /// Runs the prompt `tokens` from `start_pos` and returns the last position's logits.
    ///
    /// Positions `0..start_pos` must already be in the cache through `table` (a prefix loaded
    /// from kvtier, or computed earlier); only later positions are computed. A `start_pos` at
    /// or past the end (a full-prompt hit) still recomputes the last token, since its logits
    /// are needed; its KV is rewritten with the same values. `table` grows to cover the prompt;
    /// the prompt is checked before any block is allocated.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        table: &mut BlockTable,
    ) -> Result<Vec<f32>> {
        self.prefill_hooked(tokens, start_pos, table, &mut NoHook)
    }

    /// [`prefill`](Self::prefill), calling `hook` around each layer of the forward.
    pub fn prefill_hooked(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        table: &mut BlockTable,
        hook: &mut dyn LayerHook,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(WorkerError::EmptyPrompt);
        }
        let start = start_pos.min(tokens.len() - 1);
        let covered_tokens = table.len() * self.cache.block_tokens();
        if start > covered_tokens {
            return Err(WorkerError::MissingPrefix {
                start_pos: start,
                covered_tokens,
            });
        }
        let max = self.model.config().max_context_tokens;
        if tokens.len() > max {
            return Err(WorkerError::ContextFull {
                tokens: tokens.len(),
                max_context_tokens: max,
            });
        }
        let vocab_size = self.model.config().vocab_size;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(WorkerError::TokenOutOfVocab { id, vocab_size });
        }
        self.cache.reserve(table, tokens.len())?;
        self.model
            .forward_hooked(&tokens[start..], start, &mut self.cache, table, hook)
    }

    /// Runs one token at position `pos` (positions `0..pos` cached) and returns its logits.
    pub fn decode_step(
        &mut self,
        token: u32,
        pos: usize,
        table: &mut BlockTable,
    ) -> Result<Vec<f32>> {
        let mut logits = self.decode_batch(&mut [(token, pos, table)])?;
        Ok(logits.pop().expect("one step, one result"))
    }

    /// One decode step for each of several sequences in one batched forward
    /// ([`Model::decode_batch`]): `steps[i]` is a token, its position and its sequence's table
    /// (grown to cover the position). Returns each sequence's logits, as
    /// [`decode_step`](Self::decode_step) would.
    pub fn decode_batch(
        &mut self,
        steps: &mut [(u32, usize, &mut BlockTable)],
    ) -> Result<Vec<Vec<f32>>> {
        for (_, pos, table) in steps.iter_mut() {
            let covered_tokens = table.len() * self.cache.block_tokens();
            if *pos > covered_tokens {
                return Err(WorkerError::MissingPrefix {
                    start_pos: *pos,
                    covered_tokens,
                });
            }
            self.cache.reserve(table, *pos + 1)?;
        }
        let tokens: Vec<(u32, usize)> = steps.iter().map(|(t, p, _)| (*t, *p)).collect();
        let tables: Vec<&BlockTable> = steps.iter().map(|(_, _, t)| &**t).collect();
        self.model.decode_batch(&tokens, &tables, &mut self.cache)
    }

    /// Decodes after a prefill: `logits` are those of position `len - 1`, where `len` tokens
    /// are cached through `table`. Stops at EOS, after `max_tokens` tokens, or when the
    /// context is full.
    pub fn decode(
        &mut self,
        table: &mut BlockTable,
        len: usize,
        logits: Vec<f32>,
        max_tokens: usize,
        sampling: Sampling,
    ) -> Result<(Vec<u32>, FinishReason)> {
        let mut sampler = Sampler::new(sampling);
        let mut logits = logits;
        let mut out = Vec::new();
        let max_ctx = self.model.config().max_context_tokens;
        loop {
            if out.len() >= max_tokens {
                return Ok((out, FinishReason::MaxTokens));
            }
            let token = sampler.sample(&logits);
            if self.eos.contains(&token) {
                return Ok((out, FinishReason::Eos));
            }
            out.push(token);
            let pos = len + out.len() - 1;
            if out.len() >= max_tokens {
                return Ok((out, FinishReason::MaxTokens));
            }
            if pos >= max_ctx {
                return Ok((out, FinishReason::ContextFull));
            }
            logits = self.decode_step(token, pos, table)?;
        }
    }

    /// Prefills `prompt` into fresh blocks, decodes up to `max_tokens` tokens, and frees the
    /// blocks.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        sampling: Sampling,
    ) -> Result<Generation> {
        let mut table = BlockTable::new();
        let result = self.generate_in(&mut table, prompt, max_tokens, sampling);
        // Free even after an error; a release failure would be a bug in this module.
        let released = self.cache.release_table(&mut table);
        let generation = result?;
        released?;
        Ok(generation)
    }

    fn generate_in(
        &mut self,
        table: &mut BlockTable,
        prompt: &[u32],
        max_tokens: usize,
        sampling: Sampling,
    ) -> Result<Generation> {
        let t0 = Instant::now();
        let logits = self.prefill(prompt, 0, table)?;
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let (tokens, finish) = self.decode(table, prompt.len(), logits, max_tokens, sampling)?;
        Ok(Generation {
            tokens,
            finish,
            prompt_tokens: prompt.len(),
            prefill_time,
            decode_time: t1.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_sampling_is_seeded() {
        let logits = [0.1, 2.0, -1.0, 2.0, 0.5];
        let mut g = Sampler::new(Sampling::GREEDY);
        assert_eq!(g.sample(&logits), 1);
        let draw = |seed| {
            let mut s = Sampler::new(Sampling {
                temperature: 1.0,
                seed,
            });
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        // Every draw has positive probability, and a high logit is drawn more than a low one.
        let d = draw(5);
        assert!(d.iter().all(|&i| i < 5));
        let count = |k| d.iter().filter(|&&i| i == k).count();
        assert!(count(1) + count(3) > count(2));
    }
}

//! `kvtier-worker`: for now, `kvtier-worker generate --prompt TEXT --max-tokens N` runs the
//! built-in random-weight model (or a Hugging Face directory) and prints the text and speed.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvtier_worker::{ByteTokenizer, Engine, Model, ModelConfig, Sampling};

#[derive(Parser)]
#[command(
    name = "kvtier-worker",
    version,
    about = "kvtier reference inference worker"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt and report prefill and decode speed.
    Generate {
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Seed of the random weights (and of sampling when --temperature > 0).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// A Hugging Face Llama directory (config.json + *.safetensors). Its tokenizer is not
        /// used yet: prompts are byte-tokenized, so only a byte-vocabulary model makes sense.
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Tokens per KV block.
        #[arg(long, default_value_t = 16)]
        block_tokens: usize,
        /// KV pool size in blocks.
        #[arg(long, default_value_t = 1024)]
        kv_blocks: usize,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Generate {
            prompt,
            max_tokens,
            seed,
            temperature,
            model_dir,
            block_tokens,
            kv_blocks,
        } => {
            let model = match &model_dir {
                Some(dir) => Model::from_hf_dir(dir, block_tokens)
                    .with_context(|| format!("loading {}", dir.display()))?,
                None => Model::random(
                    ModelConfig {
                        block_tokens,
                        ..ModelConfig::default()
                    },
                    seed,
                )?,
            };
            let cfg = model.config().clone();
            let layout = cfg.kv_layout()?;
            println!(
                "model: {} ({} layers, hidden {}, {} heads / {} kv heads x {}, vocab {}), {} parameters, KV {} bytes/token ({} bytes per {}-token block)",
                model_dir
                    .as_ref()
                    .map_or("random weights".to_owned(), |d| d.display().to_string()),
                cfg.num_layers,
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.vocab_size,
                cfg.param_count(),
                layout.bytes_per_token(),
                layout.block_bytes(),
                cfg.block_tokens,
            );
            let tok = ByteTokenizer;
            let ids = tok.encode(&prompt, true);
            let mut engine = Engine::new(model, kv_blocks)?;
            let g = engine.generate(&ids, max_tokens, Sampling { temperature, seed })?;
            println!("{:?}", tok.decode(&g.tokens)?);
            let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
            println!(
                "prefill: {} tokens in {:.1} ms ({:.0} tokens/s)",
                g.prompt_tokens,
                g.prefill_time.as_secs_f64() * 1e3,
                rate(g.prompt_tokens, g.prefill_time)
            );
            // The first generated token comes from the prefill's logits.
            let steps = g.tokens.len().saturating_sub(1);
            println!(
                "decode: {} steps in {:.1} ms ({:.0} tokens/s), stop: {:?}",
                steps,
                g.decode_time.as_secs_f64() * 1e3,
                rate(steps, g.decode_time),
                g.finish
            );
            Ok(())
        }
    }
}

//! `kvtier-bench hash`: throughput of the chained prefix hasher.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_core::{Dtype, HashScheme, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use serde::Serialize;

use kvtier_core::SplitMix64;

const SECRET: &[u8] = b"kvtier-bench-secret-0123456789abcdef";
/// Without `--iters`, each scheme is timed for about this long.
const AUTO_SECONDS: f64 = 1.0;
const WARMUP: Duration = Duration::from_millis(200);

#[derive(Args, Debug)]
pub struct HashArgs {
    /// Blocks in the prompt.
    #[arg(long, default_value_t = 4096)]
    pub blocks: usize,
    /// Tokens per block (a power of two from 1 to 512).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Prompts hashed per scheme (default: as many as fit in about one second).
    #[arg(long)]
    pub iters: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct HashReport {
    pub blocks: usize,
    pub block_tokens: u32,
    pub tokens: usize,
    pub token_bytes: usize,
    pub seed: u64,
    pub results: Vec<SchemeResult>,
}

#[derive(Debug, Serialize)]
pub struct SchemeResult {
    pub scheme: &'static str,
    pub iters: u64,
    pub seconds: f64,
    pub keys_per_sec: f64,
    pub ns_per_key: f64,
    pub token_mb_per_sec: f64,
    pub prompts_per_sec: f64,
}

pub fn run(args: &HashArgs, seed: u64) -> Result<HashReport> {
    if args.blocks == 0 {
        bail!("--blocks must be at least 1");
    }
    if args.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    let tokens_len = args
        .blocks
        .checked_mul(args.block_tokens as usize)
        .context("--blocks x --block-tokens overflows")?;
    let mut rng = SplitMix64::new(seed);
    // Token ids below 2^17, like a real vocabulary.
    let tokens: Vec<u32> = (0..tokens_len)
        .map(|_| (rng.next_u64() % 131_072) as u32)
        .collect();
    // Any valid layout: only its fingerprint goes into the namespace.
    let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, args.block_tokens)
        .context("--block-tokens must be a power of two from 1 to 512")?;

    let mut results = Vec::new();
    for scheme in [HashScheme::Xxh3Keyed, HashScheme::Blake3Keyed] {
        let secret = HashSecret::new(scheme, SECRET).context("bench secret")?;
        let ns = NamespaceBuilder::new("bench-model", layout.fingerprint())
            .build(&secret)
            .context("namespace")?;
        let mut h = PrefixHasher::new(secret, ns, args.block_tokens).context("prefix hasher")?;
        let mut out = Vec::with_capacity(args.blocks);
        let mut once = |out: &mut Vec<_>| {
            out.clear();
            let n = h.prompt_keys(black_box(&tokens), out);
            black_box(&out[..]);
            n
        };

        // Warm-up, which also calibrates the iteration count.
        let start = Instant::now();
        let mut warm = 0u64;
        while start.elapsed() < WARMUP || warm == 0 {
            let n = once(&mut out);
            if n != args.blocks {
                bail!("hasher returned {n} keys for {} blocks", args.blocks);
            }
            warm += 1;
        }
        let per_iter = start.elapsed().as_secs_f64() / warm as f64;
        let iters = args
            .iters
            .unwrap_or_else(|| ((AUTO_SECONDS / per_iter).ceil() as u64).max(1));

        let start = Instant::now();
        for _ in 0..iters {
            once(&mut out);
        }
        let secs = start.elapsed().as_secs_f64();
        let keys = (iters as f64) * args.blocks as f64;
        results.push(SchemeResult {
            scheme: scheme.name(),
            iters,
            seconds: secs,
            keys_per_sec: keys / secs,
            ns_per_key: secs * 1e9 / keys,
            token_mb_per_sec: (iters as f64) * (tokens_len * 4) as f64 / secs / 1e6,
            prompts_per_sec: iters as f64 / secs,
        });
    }
    Ok(HashReport {
        blocks: args.blocks,
        block_tokens: args.block_tokens,
        tokens: tokens_len,
        token_bytes: tokens_len * 4,
        seed,
        results,
    })
}

impl crate::report::Report for HashReport {
    fn tables(&self) -> Vec<crate::report::Table> {
        let mut t = crate::report::Table::new(
            format!(
                "prompt: {} blocks x {} tokens = {} tokens ({} token bytes), seed {}",
                self.blocks, self.block_tokens, self.tokens, self.token_bytes, self.seed
            ),
            &[
                "scheme",
                "iters",
                "seconds",
                "keys/s",
                "ns/key",
                "token MB/s",
                "prompts/s",
            ],
        );
        for s in &self.results {
            t.row([
                s.scheme.to_string(),
                s.iters.to_string(),
                format!("{:.2}", s.seconds),
                format!("{:.0}", s.keys_per_sec),
                format!("{:.2}", s.ns_per_key),
                format!("{:.2}", s.token_mb_per_sec),
                format!("{:.2}", s.prompts_per_sec),
            ]);
        }
        vec![t]
    }
}

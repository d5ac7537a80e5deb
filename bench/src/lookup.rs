//! `kvtier-bench lookup`: in-process longest-prefix lookup of a long prompt's block keys
//! through the store's index (the sidecar's lookup minus the network). The prompt's tokens
//! come from `--seed`. Target (docs/benchmarks.md, "The targets"): at least 5 M keys/s for a 4,096-block prefix.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use kvtier_core::{
    BlockKey, Dtype, HashScheme, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher,
};
use kvtier_server::{StoreConfig, TieredStore};
use serde::Serialize;

use crate::report::{Report, Table};
use crate::util::{Latency, fmt_f};
use kvtier_core::SplitMix64;

/// Keys per second the targets (docs/benchmarks.md) ask of an in-process lookup.
const TARGET_KEYS_PER_S: f64 = 5e6;

#[derive(Args, Debug)]
pub struct LookupArgs {
    /// Blocks in the prompt (all cached).
    #[arg(long, default_value_t = 4096)]
    pub blocks: usize,
    /// Seconds to time each case.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
}

#[derive(Serialize)]
pub struct LookupReport {
    pub seed: u64,
    pub blocks: usize,
    pub lookups: u64,
    pub keys_per_s: f64,
    pub lookup_us_p50: f64,
    pub lookup_us_p99: f64,
    pub contains_keys_per_s: f64,
    pub target_keys_per_s: f64,
    /// keys_per_s over the target.
    pub ratio_to_target: f64,
}

pub fn run(args: &LookupArgs, seed: u64) -> Result<LookupReport> {
    if args.blocks == 0 || !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--blocks and --seconds must be above zero");
    }
    let tokens_len = u32::try_from(args.blocks)
        .ok()
        .and_then(|b| b.checked_mul(16))
        .ok_or_else(|| anyhow::anyhow!("--blocks {} is too many", args.blocks))?;
    let layout = KvLayout::new(1, 1, 1, Dtype::F16, 16)?;
    let secret = HashSecret::new(HashScheme::Xxh3Keyed, b"kvtier-bench-lookup-secret")?;
    let ns = NamespaceBuilder::new("bench", layout.fingerprint()).build(&secret)?;
    let mut hasher = PrefixHasher::new(secret, ns, 16)?;
    let mut rng = SplitMix64::new(seed);
    let tokens: Vec<u32> = (0..tokens_len)
        .map(|_| (rng.next_u64() % 131_072) as u32)
        .collect();
    let mut keys: Vec<BlockKey> = Vec::new();
    hasher.prompt_keys(&tokens, &mut keys);
    let mut config = StoreConfig::new(layout, (args.blocks as u64 + 64) * 4096);
    config.dram_prefault = false;
    let (store, _) = TieredStore::open(config)?;
    let payload = vec![0u8; store.block_bytes()];
    for (i, k) in keys.iter().enumerate() {
        store.put(*k, i.checked_sub(1).map(|p| keys[p]), &payload)?;
    }
    if store.lookup(&keys).len() != keys.len() {
        bail!("the prompt is not fully cached; the store refused some blocks");
    }
    let budget = Duration::from_secs_f64(args.seconds);
    let mut lat = Latency::new();
    let mut total = Duration::ZERO;
    let t0 = Instant::now();
    while t0.elapsed() < budget {
        let t = Instant::now();
        let n = store.lookup(&keys).len();
        let el = t.elapsed();
        lat.record(el);
        total += el;
        std::hint::black_box(n);
    }
    let t = Instant::now();
    let mut contains = 0u64;
    while t.elapsed() < budget {
        for k in &keys {
            contains += u64::from(store.contains(k));
        }
    }
    let contains_rate = contains as f64 / t.elapsed().as_secs_f64();
    let keys_per_s = (lat.count() as f64 * keys.len() as f64) / total.as_secs_f64();
    Ok(LookupReport {
        seed,
        blocks: keys.len(),
        lookups: lat.count(),
        keys_per_s,
        lookup_us_p50: lat.quantile_us(0.5),
        lookup_us_p99: lat.quantile_us(0.99),
        contains_keys_per_s: contains_rate,
        target_keys_per_s: TARGET_KEYS_PER_S,
        ratio_to_target: keys_per_s / TARGET_KEYS_PER_S,
    })
}

impl Report for LookupReport {
    fn tables(&self) -> Vec<Table> {
        let mut t = Table::new(
            format!(
                "in-process lookup of a {}-block cached prefix (each lookup also tells the eviction policy)",
                self.blocks
            ),
            &[
                "case", "lookups", "M keys/s", "p50 us", "p99 us", "target", "ratio",
            ],
        );
        t.row([
            "lookup".to_string(),
            self.lookups.to_string(),
            fmt_f(self.keys_per_s / 1e6, 2),
            fmt_f(self.lookup_us_p50, 1),
            fmt_f(self.lookup_us_p99, 1),
            format!(">= {} M keys/s", self.target_keys_per_s / 1e6),
            format!("{:.2}x", self.ratio_to_target),
        ]);
        t.row([
            "contains (index only)".to_string(),
            String::new(),
            fmt_f(self.contains_keys_per_s / 1e6, 2),
        ]);
        vec![t]
    }
}

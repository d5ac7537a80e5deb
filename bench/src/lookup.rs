//! `kvtier-bench lookup`: in-process longest-prefix lookup of a long prompt's block keys
//! through the store's index (the sidecar's lookup minus the network).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use kvtier_core::{
    BlockKey, Dtype, HashScheme, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher,
};
use kvtier_server::{StoreConfig, TieredStore};
use serde::Serialize;

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
    pub blocks: usize,
    pub lookups: u64,
    pub keys_per_s: f64,
    pub lookup_us_p50: f64,
    pub lookup_us_p99: f64,
    pub contains_keys_per_s: f64,
}

pub fn run(args: &LookupArgs) -> Result<LookupReport> {
    if args.blocks == 0 || args.seconds <= 0.0 {
        bail!("--blocks and --seconds must be above zero");
    }
    let layout = KvLayout::new(1, 1, 1, Dtype::F16, 16)?;
    let secret = HashSecret::new(HashScheme::Xxh3Keyed, b"kvtier-bench-lookup-secret")?;
    let ns = NamespaceBuilder::new("bench", layout.fingerprint()).build(&secret)?;
    let mut hasher = PrefixHasher::new(secret, ns, 16)?;
    let tokens: Vec<u32> = (0..args.blocks as u32 * 16).collect();
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
    let mut times = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < budget {
        let t = Instant::now();
        let n = store.lookup(&keys).len();
        times.push(t.elapsed());
        std::hint::black_box(n);
    }
    let total: Duration = times.iter().sum();
    times.sort();
    let pct = |p: f64| times[((times.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    let t = Instant::now();
    let mut contains = 0u64;
    while t.elapsed() < budget {
        for k in &keys {
            contains += u64::from(store.contains(k));
        }
    }
    let contains_rate = contains as f64 / t.elapsed().as_secs_f64();
    Ok(LookupReport {
        blocks: keys.len(),
        lookups: times.len() as u64,
        keys_per_s: (times.len() * keys.len()) as f64 / total.as_secs_f64(),
        lookup_us_p50: pct(0.5),
        lookup_us_p99: pct(0.99),
        contains_keys_per_s: contains_rate,
    })
}

pub fn print(r: &LookupReport) {
    println!(
        "prefix of {} cached blocks, {} lookups (each also tells the eviction policy)",
        r.blocks, r.lookups
    );
    println!(
        "lookup: {:.2} M keys/s, p50 {:.1} us, p99 {:.1} us per {}-block lookup",
        r.keys_per_s / 1e6,
        r.lookup_us_p50,
        r.lookup_us_p99,
        r.blocks
    );
    println!(
        "contains (index only): {:.2} M keys/s",
        r.contains_keys_per_s / 1e6
    );
}

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
    /// Cluster mode: the members of one kvtier cluster (URLs, at least two; repeatable).
    /// Each round puts a fresh chain of `--blocks` blocks on the first, waits
    /// `--settle-ms` for its offers to reach their owners, then times a lookup of it on
    /// another member (which asks the owners and fetches what they hold) and a second
    /// lookup there (local by then). `scripts/bench-cluster.sh --lookup-blocks` runs it.
    #[arg(long = "server")]
    pub servers: Vec<String>,
    /// Token for the members (cluster mode).
    #[arg(long)]
    pub token: Option<String>,
    /// Rounds in cluster mode.
    #[arg(long, default_value_t = 40)]
    pub rounds: usize,
    /// Wait between the put and the timed lookup, ms (cluster mode).
    #[arg(long, default_value_t = 500)]
    pub settle_ms: u64,
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

/// What `kvtier-bench lookup --server ...` measured.
#[derive(Serialize)]
pub struct ClusterLookupReport {
    pub seed: u64,
    pub members: usize,
    pub blocks: usize,
    pub block_bytes: usize,
    pub rounds: usize,
    /// Rounds whose first lookup answered the whole chain.
    pub complete: usize,
    /// Blocks the first lookups answered, over all rounds.
    pub found_blocks: u64,
    pub remote_us_p50: f64,
    pub remote_us_p99: f64,
    pub local_us_p50: f64,
    pub local_us_p99: f64,
    /// Bytes the first lookups brought over from the owners, per second of those lookups: an
    /// estimate, (members - 1) / members of the blocks found (what the asking member does
    /// not own when placement is even), not a count of the bytes fetched.
    pub remote_bytes_per_s: f64,
}

/// Cluster mode of [`LookupArgs`]: see its `servers`.
pub fn run_cluster(args: &LookupArgs, seed: u64) -> Result<ClusterLookupReport> {
    if args.servers.len() < 2 {
        bail!("cluster mode needs at least two --server URLs (members of one cluster)");
    }
    if args.blocks == 0 || args.rounds == 0 {
        bail!("--blocks and --rounds must be above zero");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut clients = Vec::with_capacity(args.servers.len());
        for url in &args.servers {
            clients.push(
                crate::replay::backend::connect(url, args.token.as_deref(), None, false).await?,
            );
        }
        let block_bytes = clients[0].block_bytes();
        let mut rng = SplitMix64::new(seed);
        let (mut remote, mut local) = (Latency::new(), Latency::new());
        let (mut complete, mut found, mut remote_total) = (0, 0u64, Duration::ZERO);
        let mut buf = vec![0u8; args.blocks * block_bytes];
        for round in 0..args.rounds {
            let keys: Vec<BlockKey> = (0..args.blocks)
                .map(|_| {
                    BlockKey::from_u128(
                        (u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64()),
                    )
                })
                .collect();
            for (k, b) in keys.iter().zip(buf.chunks_mut(block_bytes)) {
                crate::replay::payload::fill(*k, b);
            }
            let bufs: Vec<&[u8]> = buf.chunks(block_bytes).collect();
            let stored = clients[0].put_chain(&keys, None, &bufs).await;
            if let Some(m) = stored.failure {
                bail!(
                    "round {round}: the put on {} failed: {m:?}",
                    args.servers[0]
                );
            }
            tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
            let asker = &clients[1 + round % (clients.len() - 1)];
            let t = Instant::now();
            let l = asker.lookup(&keys).await;
            let el = t.elapsed();
            remote.record(el);
            remote_total += el;
            let n = l.tiers.len().min(keys.len());
            found += n as u64;
            complete += usize::from(n == keys.len());
            let t = Instant::now();
            let again = asker.lookup(&keys).await;
            local.record(t.elapsed());
            std::hint::black_box(again);
        }
        // Of each chain, the asking member owns about 1/members: the rest comes over.
        let m = args.servers.len() as f64;
        let fetched = found as f64 * block_bytes as f64 * (m - 1.0) / m;
        Ok(ClusterLookupReport {
            seed,
            members: args.servers.len(),
            blocks: args.blocks,
            block_bytes,
            rounds: args.rounds,
            complete,
            found_blocks: found,
            remote_us_p50: remote.quantile_us(0.5),
            remote_us_p99: remote.quantile_us(0.99),
            local_us_p50: local.quantile_us(0.5),
            local_us_p99: local.quantile_us(0.99),
            remote_bytes_per_s: fetched / remote_total.as_secs_f64().max(1e-9),
        })
    })
}

impl Report for ClusterLookupReport {
    fn tables(&self) -> Vec<Table> {
        let mut t = Table::new(
            format!(
                "lookup of a {}-block chain put on one of {} cluster members, from another ({} B blocks, {} rounds)",
                self.blocks, self.members, self.block_bytes, self.rounds
            ),
            &["case", "p50 us", "p99 us", "note"],
        );
        t.row([
            "first lookup (owners asked, blocks fetched)".to_string(),
            fmt_f(self.remote_us_p50, 1),
            fmt_f(self.remote_us_p99, 1),
            format!(
                "{} of {} rounds complete; about {} MB/s fetched",
                self.complete,
                self.rounds,
                fmt_f(self.remote_bytes_per_s / 1e6, 1)
            ),
        ]);
        t.row([
            "second lookup (local)".to_string(),
            fmt_f(self.local_us_p50, 1),
            fmt_f(self.local_us_p99, 1),
            String::new(),
        ]);
        vec![t]
    }
}

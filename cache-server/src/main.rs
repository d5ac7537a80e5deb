//! kvtier-server. Until the sidecar's network protocol lands, the binary runs a self-contained
//! demonstration of the tiered store on embedded defaults: it opens the store, hashes a
//! synthetic prompt into block keys, stores and reads the blocks back (verifying every byte),
//! restarts the store to show the NVMe tier keeping the cache warm, and prints what it did
//! and where the data lives.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kvtier_core::{Dtype, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
use kvtier_server::tier::conformance::fill_block;
use kvtier_server::{GetOutcome, NvmeSettings, StoreConfig, StoreStats, TierKind, TieredStore};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "kvtier cache server (store demonstration on embedded defaults)"
)]
struct Args {
    /// Directory of the NVMe tier's slot files.
    #[arg(long, default_value = "./kvtier-data")]
    data_dir: PathBuf,
    /// DRAM tier capacity in MiB.
    #[arg(long, default_value_t = 256)]
    dram_mib: u64,
    /// NVMe tier capacity in MiB.
    #[arg(long, default_value_t = 512)]
    nvme_mib: u64,
    /// Prompt length of the demonstration, in 16-token blocks.
    #[arg(long, default_value_t = 96)]
    blocks: usize,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.blocks == 0 {
        anyhow::bail!("--blocks must be at least 1");
    }
    // Llama-3-8B's KV in bf16: 32 layers, 8 KV heads of 128, 16-token blocks = 2 MiB a block.
    let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, 16)?;
    let block_bytes = layout.block_bytes() as usize;
    println!(
        "kvtier-server {} — tiered store demonstration",
        env!("CARGO_PKG_VERSION")
    );
    println!(
        "layout: llama-3-8b, {} layers x {} kv heads x {} dims, {}, {} tokens a block = {} KiB a block",
        layout.num_layers(),
        layout.num_kv_heads(),
        layout.head_dim(),
        layout.dtype().name(),
        layout.block_tokens(),
        block_bytes >> 10
    );
    report_hbm();

    let open = || -> Result<(TieredStore, kvtier_server::OpenReport)> {
        let mut c = StoreConfig::new(layout, args.dram_mib << 20);
        c.nvme = Some(NvmeSettings::new(&args.data_dir, args.nvme_mib << 20));
        TieredStore::open(c)
            .with_context(|| format!("opening the store (data dir {})", args.data_dir.display()))
    };
    let (store, report) = open()?;
    let nvme = report.nvme.clone().unwrap_or_default();
    println!(
        "DRAM tier: memfd arena of {} MiB, {} slots (a local client can map it)",
        store.dram().arena_bytes() >> 20,
        store
            .stats()
            .tier(TierKind::Dram)
            .map_or(0, |t| t.capacity_slots)
    );
    let data_dir = std::fs::canonicalize(&args.data_dir).unwrap_or(args.data_dir.clone());
    println!(
        "NVMe tier: {} ({}), {} slots; found {} blocks from an earlier run{}",
        data_dir.display(),
        if nvme.direct_io {
            "O_DIRECT"
        } else {
            "buffered: the file system refused O_DIRECT"
        },
        store
            .stats()
            .tier(TierKind::Nvme)
            .map_or(0, |t| t.capacity_slots),
        nvme.recovered,
        nvme.cold_start
            .map(|w| format!(" (started cold: {w})"))
            .unwrap_or_default()
    );

    // A prompt's block keys: keyed, chained prefix hashes under the model's namespace.
    let secret = HashSecret::development();
    let ns = NamespaceBuilder::new("llama-3-8b", layout.fingerprint()).build(&secret)?;
    let mut hasher = PrefixHasher::new(secret, ns, layout.block_tokens())?;
    let tokens: Vec<u32> = (0..args.blocks as u32 * 16)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect();
    let mut keys = Vec::new();
    hasher.prompt_keys(&tokens, &mut keys);
    println!(
        "prompt: {} tokens -> {} block keys (first {})",
        tokens.len(),
        keys.len(),
        keys[0]
    );

    let cached = store.lookup(&keys).len();
    let mut buf = vec![0u8; block_bytes];
    let t = Instant::now();
    let mut stored = 0;
    for (i, k) in keys.iter().enumerate().skip(cached) {
        fill_block(*k, &mut buf);
        let parent = i.checked_sub(1).map(|p| keys[p]);
        if let kvtier_server::PutOutcome::Stored(_) = store.put(*k, parent, &buf)? {
            stored += 1;
        }
        if i % 8 == 7 {
            store.flush(); // let write-through copies keep up in this tiny demo
        }
    }
    store.flush();
    println!(
        "put: {stored} new blocks ({} already cached) in {:.1} ms, each also written through to NVMe",
        cached,
        t.elapsed().as_secs_f64() * 1e3
    );
    print_lookup("lookup", &store.lookup(&keys), keys.len());
    verify(&store, &keys, &mut buf)?;
    print_stats(&store.stats());
    drop(store);

    println!("restarting the store...");
    let (store, report) = open()?;
    println!(
        "reopened: {} blocks recovered from NVMe slot headers",
        report.nvme.map_or(0, |r| r.recovered)
    );
    print_lookup("lookup after restart", &store.lookup(&keys), keys.len());
    verify(&store, &keys, &mut buf)?;
    print_lookup(
        "lookup after reads (NVMe hits promoted)",
        &store.lookup(&keys),
        keys.len(),
    );
    verify(&store, &keys, &mut buf)?;
    print_stats(&store.stats());
    println!(
        "data lives in {} (remove it to start cold); run again to see a warm start",
        data_dir.display()
    );
    Ok(())
}

fn report_hbm() {
    #[cfg(feature = "cuda")]
    match kvtier_server::tier::hbm::probe() {
        Ok(n) => println!("HBM tier: {n} CUDA device(s) present"),
        Err(e) => println!("HBM tier: running without HBM ({e})"),
    }
    #[cfg(not(feature = "cuda"))]
    println!("HBM tier: not built (build with --features cuda)");
}

fn verify(store: &TieredStore, keys: &[kvtier_core::BlockKey], buf: &mut [u8]) -> Result<()> {
    let mut want = vec![0u8; buf.len()];
    let (mut dram, mut nvme, mut miss) = (0, 0, 0);
    let t = Instant::now();
    for k in keys {
        match store.get(k, buf)? {
            GetOutcome::Hit(tier) => {
                fill_block(*k, &mut want);
                anyhow::ensure!(buf == &want[..], "block {k} came back with other bytes");
                if tier == TierKind::Dram {
                    dram += 1
                } else {
                    nvme += 1
                }
            }
            GetOutcome::Miss(_) => miss += 1,
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let gb = ((dram + nvme) * buf.len()) as f64 / 1e9;
    println!(
        "get: {dram} DRAM hits, {nvme} NVMe hits, {miss} misses, every byte verified ({:.2} GB/s)",
        gb / secs.max(1e-9)
    );
    Ok(())
}

fn print_lookup(what: &str, tiers: &[TierKind], total: usize) {
    let dram = tiers.iter().filter(|t| **t == TierKind::Dram).count();
    println!(
        "{what}: longest cached prefix {}/{total} blocks ({dram} in DRAM, {} on NVMe)",
        tiers.len(),
        tiers.len() - dram
    );
}

fn print_stats(s: &StoreStats) {
    println!(
        "  store memory for index and policies: {} bytes per block of capacity",
        s.metadata_bytes_per_block
    );
    println!(
        "  tier  used/slots   hits  misses  evictions  demotions  promotions  refused  corrupt"
    );
    for t in &s.tiers {
        println!(
            "  {:<5} {:>5}/{:<6} {:>5} {:>7} {:>10} {:>10} {:>11} {:>8} {:>8}",
            t.tier.map_or("?", |k| k.name()),
            t.used_slots,
            t.capacity_slots,
            t.hits,
            t.misses,
            t.evictions,
            t.demotions,
            t.promotions,
            t.admissions_refused,
            t.corrupt_dropped
        );
    }
}

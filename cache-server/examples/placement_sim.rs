//! Simulation of the cluster's placement (`docs/cluster.md`, "At 100 and 1,000 nodes"):
//! balance (max / mean load), the share of blocks moved when a node joins or leaves, the
//! owners a 4,096-block chain touches per run size, and the cost of placing a key, at 10,
//! 100 and 1,000 nodes. Uses `kvtier_server::cluster::Placement`, the code the server runs.
//!
//! `cargo run --release -p kvtier-server --example placement_sim [-- --keys N --seed S]`

use std::collections::HashSet;
use std::time::Instant;

use kvtier_core::BlockKey;
use kvtier_core::rng::SplitMix64;
use kvtier_server::cluster::placement::{Candidate, Placement, Runs};

fn key(rng: &mut SplitMix64) -> BlockKey {
    BlockKey::from_u128(((rng.next_u64() as u128) << 64) | rng.next_u64() as u128)
}

/// `n` nodes; `mixed`: capacities 1, 2 and 4 (in turn), else all 1.
fn nodes(n: usize, mixed: bool) -> Vec<Candidate> {
    (0..n)
        .map(|i| {
            let w = if mixed { [1.0, 2.0, 4.0][i % 3] } else { 1.0 };
            Candidate::new(format!("node-{i:04}"), w)
        })
        .collect()
}

/// Max over nodes of (keys owned / keys its weight should own), with the mean 1 by
/// construction: the overload of the most loaded node. Counts every replica.
fn balance(p: &Placement, keys: &[BlockKey]) -> f64 {
    let total_w: f64 = p.members().iter().map(|m| m.weight).sum();
    let mut count = vec![0u64; p.members().len()];
    let mut out = Vec::new();
    for k in keys {
        p.owners_into(k, &mut out);
        for &i in &out {
            count[i] += 1;
        }
    }
    let placed: u64 = count.iter().sum();
    p.members()
        .iter()
        .zip(&count)
        .map(|(m, c)| *c as f64 / (placed as f64 * m.weight / total_w))
        .fold(0.0, f64::max)
}

/// The same max/mean for a uniformly random weighted assignment of as many keys (`r`
/// distinct owners each): the balance no hashing scheme beats on average, the reference.
fn random_balance(p: &Placement, n_keys: usize, rng: &mut SplitMix64) -> f64 {
    let m = p.members();
    let total_w: f64 = m.iter().map(|c| c.weight).sum();
    let cumulative: Vec<f64> = m
        .iter()
        .scan(0.0, |acc, c| {
            *acc += c.weight;
            Some(*acc)
        })
        .collect();
    let r = p.replicas().min(m.len());
    let mut count = vec![0u64; m.len()];
    let mut picked = Vec::with_capacity(r);
    for _ in 0..n_keys {
        picked.clear();
        while picked.len() < r {
            let x = rng.next_f64() * total_w;
            let i = cumulative.partition_point(|c| *c <= x).min(m.len() - 1);
            if !picked.contains(&i) {
                picked.push(i);
            }
        }
        for &i in &picked {
            count[i] += 1;
        }
    }
    let placed: u64 = count.iter().sum();
    m.iter()
        .zip(&count)
        .map(|(c, n)| *n as f64 / (placed as f64 * c.weight / total_w))
        .fold(0.0, f64::max)
}

/// The share of (key, replica) placements that differ between `a` and `b`.
fn moved(a: &Placement, b: &Placement, keys: &[BlockKey]) -> f64 {
    let mut changed = 0usize;
    let mut total = 0usize;
    for k in keys {
        let (oa, ob) = (a.owners(k), b.owners(k));
        total += oa.len();
        changed += oa.iter().filter(|o| !ob.contains(o)).count();
    }
    changed as f64 / total as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: u64| -> u64 {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n_keys = arg("--keys", 200_000) as usize;
    let seed = arg("--seed", 1);
    let mut rng = SplitMix64::new(seed);
    let keys: Vec<BlockKey> = (0..n_keys).map(|_| key(&mut rng)).collect();

    println!("# placement simulation: {n_keys} keys, seed {seed}");
    println!();
    println!("## balance and movement (weighted rendezvous, score -w/ln(u))");
    println!();
    println!(
        "| nodes | weights | replicas | max/mean load | random assignment (reference) | moved on join (ideal) | moved on leave (ideal) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for n in [10usize, 100, 1000] {
        for mixed in [false, true] {
            for r in [1usize, 2] {
                let base = nodes(n, mixed);
                let p = Placement::new(base.clone(), r);
                let bal = balance(&p, &keys);
                let reference = random_balance(&p, keys.len(), &mut rng);
                // Join: one more node of weight 2 (mixed) or 1.
                let mut grown = base.clone();
                let w_new = if mixed { 2.0 } else { 1.0 };
                grown.push(Candidate::new("joiner", w_new));
                let pj = Placement::new(grown, r);
                let total_w: f64 = base.iter().map(|c| c.weight).sum();
                let ideal_join = w_new / (total_w + w_new);
                // Leave: node 1 (weight 2 when mixed).
                let shrunk: Vec<Candidate> = base
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != 1)
                    .map(|(_, c)| c.clone())
                    .collect();
                let pl = Placement::new(shrunk, r);
                let ideal_leave = base[1].weight / total_w;
                println!(
                    "| {n} | {} | {r} | {bal:.3} | {reference:.3} | {:.4} ({ideal_join:.4}) | {:.4} ({ideal_leave:.4}) |",
                    if mixed { "1/2/4" } else { "equal" },
                    moved(&p, &pj, &keys),
                    moved(&p, &pl, &keys),
                );
            }
        }
    }

    println!();
    println!("## owners a 4,096-block chain touches, by run size (mean of 50 chains, 1 replica)");
    println!();
    println!("| nodes | run 1 | run 16 | run 64 | run 256 | head 64, run 64 |");
    println!("|---|---|---|---|---|---|");
    let chains: Vec<Vec<BlockKey>> = (0..50)
        .map(|_| (0..4096).map(|_| key(&mut rng)).collect())
        .collect();
    for n in [4usize, 10, 100, 1000] {
        let p = Placement::new(nodes(n, false), 1);
        let mut row = format!("| {n} |");
        for (head, run) in [(0, 1), (0, 16), (0, 64), (0, 256), (64, 64)] {
            let mut sum = 0usize;
            for c in &chains {
                let owners: HashSet<&str> = Runs::new(head, run)
                    .plain()
                    .runs(c)
                    .filter_map(|(_, a)| p.primary(&a))
                    .collect();
                sum += owners.len();
            }
            row += &format!(" {:.1} |", sum as f64 / chains.len() as f64);
        }
        println!("{row}");
    }

    println!();
    println!("## cost of placement (this machine, one core)");
    println!();
    println!("| nodes | replicas | ns per key | 4,096-block chain, run 64: us |");
    println!("|---|---|---|---|");
    for n in [10usize, 100, 1000] {
        for r in [1usize, 2] {
            let p = Placement::new(nodes(n, true), r);
            let sample = &keys[..keys.len().min(if n >= 1000 { 50_000 } else { 200_000 })];
            let mut out = Vec::new();
            let mut sink = 0usize;
            let t = Instant::now();
            for k in sample {
                p.owners_into(k, &mut out);
                sink += out[0];
            }
            let per_key = t.elapsed().as_nanos() as f64 / sample.len() as f64;
            let t = Instant::now();
            for c in &chains {
                for (_, a) in Runs::new(0, 64).plain().runs(c) {
                    p.owners_into(&a, &mut out);
                    sink += out[0];
                }
            }
            let per_chain = t.elapsed().as_secs_f64() * 1e6 / chains.len() as f64;
            std::hint::black_box(sink);
            println!("| {n} | {r} | {per_key:.0} | {per_chain:.1} |");
        }
    }
}

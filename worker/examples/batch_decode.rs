//! Decode throughput of continuous batching: B sequences of `CTX` prompt tokens each decode 32
//! tokens, stepped one at a time (`Engine::decode_step` per sequence) and in one batched
//! forward per step (`Engine::decode_batch`), alternating, best of 3, in one process:
//!
//! ```text
//! cargo run --release -p kvtier-worker --example batch_decode -- [CTX]
//! ```
use std::time::Instant;

use kvtier_worker::{BlockTable, Engine, Model, ModelConfig};

fn main() -> anyhow::Result<()> {
    let ctx: usize = std::env::args().nth(1).map_or(Ok(512), |s| s.parse())?;
    for b in [1usize, 2, 4, 8] {
        let mut best = [f64::MAX; 2];
        for _round in 0..3 {
            for (mode, slot) in best.iter_mut().enumerate() {
                let pool = b * (ctx.div_ceil(16) + 4) + 8;
                let mut e = Engine::new(Model::random(ModelConfig::default(), 1)?, pool)?;
                let mut tables = vec![BlockTable::new(); b];
                for (i, t) in tables.iter_mut().enumerate() {
                    let p: Vec<u32> = (0..ctx).map(|j| ((i * 7 + j * 13) % 256) as u32).collect();
                    e.prefill(&p, 0, t)?;
                }
                let steps = 32;
                let t0 = Instant::now();
                for s in 0..steps {
                    let pos = ctx + s;
                    if mode == 0 {
                        for t in tables.iter_mut() {
                            e.decode_step(65, pos, t)?;
                        }
                    } else {
                        let mut batch: Vec<(u32, usize, &mut BlockTable)> =
                            tables.iter_mut().map(|t| (65, pos, t)).collect();
                        e.decode_batch(&mut batch)?;
                    }
                }
                let tok_s = (steps * b) as f64 / t0.elapsed().as_secs_f64();
                *slot = slot.min(1.0 / tok_s);
            }
        }
        println!(
            "B={b} ctx={ctx}: one at a time {:.0} tok/s, batched {:.0} tok/s ({:.2}x)",
            1.0 / best[0],
            1.0 / best[1],
            best[0] / best[1]
        );
    }
    Ok(())
}

//! Replays a block-hash trace through a real [`TieredStore`] (DRAM tier only, tiny blocks, a
//! manual clock in trace time) to measure an eviction policy's hit rate at a capacity. Used by
//! the policy regression test and by `kvtier-bench`.
//!
//! Per request: a lookup of its keys (the hit count is the longest cached prefix, and the
//! policies learn about the request), then puts of the blocks after the prefix, in chain
//! order, each naming its parent. A put whose parent was evicted is refused by the store (no
//! lookup could reach it), which ends the request's puts.

use std::sync::Arc;

use kvtier_core::{BlockKey, Dtype, KvLayout};

use crate::clock::ManualClock;
use crate::policy::{ChainAwareTuning, EvictionKind};
use crate::{PutOutcome, StoreConfig, StoreError, TieredStore};

/// One request of a trace: block ids in chain order (equal leading ids = shared prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub timestamp_ms: u64,
    pub block_ids: Vec<u64>,
    /// How many leading blocks are stored after the request (all of them, or all but a
    /// partial last block).
    pub blocks_to_store: usize,
}

/// What a replay measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplayResult {
    pub blocks: u64,
    pub hits: u64,
    pub evictions: u64,
    pub refused: u64,
}

impl ReplayResult {
    pub fn hit_rate(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.hits as f64 / self.blocks as f64
        }
    }
}

fn key_of(id: u64) -> BlockKey {
    BlockKey::from_u128(
        (u128::from(id) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
    )
}

/// Replays `requests` against a store of `capacity_blocks` DRAM slots under `eviction`.
pub fn replay(
    requests: &[TraceRequest],
    capacity_blocks: u64,
    eviction: EvictionKind,
) -> Result<ReplayResult, StoreError> {
    replay_tuned(
        requests,
        capacity_blocks,
        eviction,
        ChainAwareTuning::default(),
    )
}

/// [`replay`] with other values of the default policy's chosen parameters.
pub fn replay_tuned(
    requests: &[TraceRequest],
    capacity_blocks: u64,
    eviction: EvictionKind,
    tuning: ChainAwareTuning,
) -> Result<ReplayResult, StoreError> {
    // The smallest layout: 4-byte blocks in page-sized slots. The payload does not matter.
    let layout = KvLayout::new(1, 1, 1, Dtype::F16, 1).map_err(|e| StoreError::Config {
        setting: "replay layout",
        reason: e.to_string(),
    })?;
    let clock = Arc::new(ManualClock::default());
    let mut config = StoreConfig::new(layout, capacity_blocks * 4096);
    config.dram_prefault = false;
    config.eviction = eviction;
    config.chain_tuning = tuning;
    config.io_threads = 1;
    config.clock = clock.clone();
    let (store, _) = TieredStore::open(config)?;
    let payload = vec![0u8; store.block_bytes()];
    let mut out = ReplayResult::default();
    let mut keys = Vec::new();
    for r in requests {
        clock.set_ms(r.timestamp_ms);
        keys.clear();
        keys.extend(r.block_ids.iter().map(|&id| key_of(id)));
        let hits = store.lookup(&keys).len();
        out.blocks += keys.len() as u64;
        out.hits += hits as u64;
        for i in hits..r.blocks_to_store.min(keys.len()) {
            let parent = i.checked_sub(1).map(|p| keys[p]);
            match store.put(keys[i], parent, &payload)? {
                PutOutcome::Stored(_) | PutOutcome::AlreadyPresent => {}
                PutOutcome::Rejected(_) => {
                    out.refused += 1;
                    break;
                }
            }
        }
    }
    let stats = store.stats();
    out.evictions = stats.tiers.first().map_or(0, |t| t.evictions);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Horizon;

    fn req(ts: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: ts,
            block_ids: ids.to_vec(),
            blocks_to_store: ids.len(),
        }
    }

    #[test]
    fn counts_the_longest_cached_prefix() {
        let trace = [
            req(0, &[0, 1, 2]),
            req(1, &[0, 1, 3]),
            req(2, &[0, 1, 3, 4]),
            req(3, &[5]),
        ];
        let r = replay(&trace, 100, EvictionKind::Lru).unwrap();
        assert_eq!((r.blocks, r.hits, r.evictions), (11, 5, 0));
        // A two-block cache cannot keep a three-block chain's prefix for long.
        let r = replay(&trace, 2, EvictionKind::ChainAware).unwrap();
        assert!(r.hits <= 5);
    }

    /// The tuning reaches the policy: a conversation that comes back after one-off requests
    /// that fill the cache is kept by a long protection horizon and lost under a short one;
    /// the default tuning is what `replay` uses.
    #[test]
    fn a_tuning_reaches_the_default_policy() {
        let conversation = [1, 2, 3, 4];
        let mut trace = vec![req(0, &conversation), req(1, &conversation)];
        for i in 0..6u64 {
            let base = 100 + 10 * i;
            trace.push(req(2 + i, &[base, base + 1, base + 2, base + 3]));
        }
        trace.push(req(9, &conversation));
        let hits = |horizon| {
            let tuning = ChainAwareTuning {
                horizon,
                ..ChainAwareTuning::default()
            };
            replay_tuned(&trace, 8, EvictionKind::ChainAware, tuning)
                .unwrap()
                .hits
        };
        let (long, short) = (hits(Horizon::Fixed(1024)), hits(Horizon::Fixed(1)));
        assert!(long > short, "{long} vs {short}");
        let d = replay(&trace, 8, EvictionKind::ChainAware).unwrap();
        assert_eq!(d.hits, hits(ChainAwareTuning::default().horizon));
    }
}

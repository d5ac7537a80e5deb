//! The default eviction policy against plain LRU on the Mooncake conversation trace
//! (`../shared/traces/`), replayed through the real store at the capacities the traces README
//! lists. Fails if the default ever falls below LRU. The figures themselves (and the offline
//! optimum) are produced by `kvtier-bench policy` into `docs/benchmarks.md`.

use std::path::PathBuf;

use kvtier_server::policy::EvictionKind;
use kvtier_server::replay::{TraceRequest, replay};

fn trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/conversation_trace.jsonl")
}

fn load() -> Vec<TraceRequest> {
    let path = trace_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the shared trace {} is required: {e}", path.display()));
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}:{}: {e}", path.display(), n + 1));
            let ids: Vec<u64> = v["hash_ids"]
                .as_array()
                .expect("hash_ids")
                .iter()
                .map(|x| x.as_u64().expect("integer id"))
                .collect();
            TraceRequest {
                timestamp_ms: v["timestamp"].as_u64().expect("timestamp"),
                blocks_to_store: ids.len(),
                block_ids: ids,
            }
        })
        .collect()
}

#[test]
fn default_eviction_never_below_lru_on_the_conversation_trace() {
    let trace = load();
    assert_eq!(trace.len(), 12_031);
    for tokens in [1_000_000u64, 3_000_000, 10_000_000] {
        let blocks = tokens / 512;
        let lru = replay(&trace, blocks, EvictionKind::Lru).unwrap();
        let default = replay(&trace, blocks, EvictionKind::default()).unwrap();
        eprintln!(
            "{}M tokens: lru {:.2} %, default {:.2} %",
            tokens / 1_000_000,
            lru.hit_rate() * 100.0,
            default.hit_rate() * 100.0
        );
        assert!(
            default.hit_rate() >= lru.hit_rate(),
            "at {tokens} tokens the default ({:.4}) fell below LRU ({:.4})",
            default.hit_rate(),
            lru.hit_rate()
        );
    }
}

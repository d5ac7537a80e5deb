//! Disaggregated prefill and decode over kvtier-transfer.
//!
//! A **decode worker** ([`DisaggDecoder`]) takes the client's request, allocates the prompt's
//! blocks in its own pool (which lives in memory registered with its transfer [`Agent`]) and
//! asks a **prefill worker** ([`PrefillServer`], served by [`prefill_router`] at
//! `POST /kvtier/prefill`) to compute the KV of all of the prompt but its last token. The
//! prefill worker writes each layer's slice of those blocks into the decode worker's blocks
//! with a one-sided write as soon as the layer's K/V is in its cache, with a notification per
//! layer, so layer `l`'s transfer overlaps layer `l + 1`'s compute. The decode worker runs the
//! last prompt token itself, layer by layer, each layer starting as soon as its KV has landed
//! (so it starts before the last layer lands), samples the first token from those logits and
//! decodes on. Any failure of the remote path (worker down, transfer error, timeout) makes the
//! decode worker prefill locally instead: a request never fails because the remote prefill
//! did. See `docs/worker.md`, section "Disaggregation".

mod client;
mod decode;
mod prefill;
pub mod wire;

use kvtier_transfer::{Agent, BackendKind};

pub use decode::{DecodeConfig, DecodeStats, DisaggDecoder, DisaggGeneration, Prefilled};
pub use decode::{PrefillPath, Remote, RemoteTimings};
pub use prefill::{PrefillConfig, PrefillServer, PrefillStats, prefill_router};
pub use wire::{PREFILL_PATH, PrefillRequest, PrefillResponse};

use crate::engine::Engine;
use crate::error::{Result, WorkerError};
use crate::kv_cache::PagedKvCache;
use crate::model::Model;

/// An engine whose pool of `num_blocks` blocks lives in DRAM registered with `agent` (a
/// memfd, so same-host peers reach it over shared memory too): what both roles need.
pub fn engine_in_agent(model: Model, num_blocks: usize, agent: &Agent) -> Result<Engine> {
    let layout = model.config().kv_layout()?;
    let bytes = layout
        .block_bytes()
        .checked_mul(num_blocks as u64)
        .ok_or_else(|| WorkerError::Config {
            field: "kv cache".to_owned(),
            reason: "the pool does not fit in memory".to_owned(),
        })?;
    let region = agent.alloc_dram(bytes.max(1))?;
    let cache = PagedKvCache::in_region(layout, num_blocks, region)?;
    Engine::with_cache(model, cache)
}

/// A backend by the name [`BackendKind::name`] gives it (`shm`, `tcp`, `quic`, `ucx`, `cuda`).
pub fn parse_backend(name: &str) -> Result<BackendKind> {
    [
        BackendKind::Shm,
        BackendKind::Tcp,
        BackendKind::Quic,
        BackendKind::Ucx,
        BackendKind::Cuda,
    ]
    .into_iter()
    .find(|b| b.name() == name)
    .ok_or_else(|| WorkerError::Disagg {
        reason: format!("unknown transfer backend `{name}` (shm, tcp, quic, ucx, cuda)"),
    })
}

/// Locks the engine, recovering it from a holder that panicked: the pool's block bookkeeping
/// changes only in short sections that call no candle code, so it stays consistent.
fn lock(engine: &std::sync::Mutex<Engine>) -> std::sync::MutexGuard<'_, Engine> {
    engine.lock().unwrap_or_else(|p| p.into_inner())
}

fn joined<T>(r: std::result::Result<T, tokio::task::JoinError>) -> Result<T> {
    r.map_err(|e| WorkerError::Disagg {
        reason: format!("worker task failed: {e}"),
    })
}

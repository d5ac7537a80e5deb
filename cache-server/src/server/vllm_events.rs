//! The store's block events in vLLM's KV-events wire format, for schedulers that read vLLM's
//! (llm-d's KV-cache manager, Dynamo's router): a ZMQ PUB socket (`events.zmq`) sending
//! multipart messages `[topic, sequence (8 bytes, big endian), payload]`, the payload a
//! msgpack `KVEventBatch` as `vllm/distributed/kv_events.py` defines it (checked by
//! `scripts/tests/test_vllm_events.py` with vLLM's own decoder).
//!
//! * `BlockStored` per block: `block_hashes` = `[key]` (16 bytes), `parent_block_hash` nil,
//!   `token_ids` empty (the server never sees tokens), `block_size` = the layout's tokens per
//!   block, `medium` = the tier (`GPU` for HBM, `CPU` for DRAM, `STORAGE` for NVMe);
//! * `BlockRemoved`: consecutive removals from one tier in one event;
//! * `AllBlocksCleared` after a `clear`.
//!
//! Batches go out every `events.zmq_batch_ms` or at `events.zmq_batch_events` events. A
//! publisher that falls behind the store skips the events it lost and skips one sequence
//! number too, so a subscriber sees a gap (as for a batch ZMQ dropped) and resyncs. There is
//! no replay socket.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvtier_core::protocol::{BlockEvent, EventKind, TierCode};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use zeromq::{Socket, SocketSend, ZmqMessage};

use super::Shared;
use super::events::EventBus;
use super::metrics::Metrics;

/// What the publisher needs besides its socket.
pub(crate) struct Publisher {
    pub topic: Bytes,
    pub block_tokens: u32,
    pub batch: Duration,
    pub batch_events: usize,
}

/// Binds the PUB socket; returns it and the address it got (port 0 picks one).
pub(crate) async fn bind(endpoint: &str) -> Result<(zeromq::PubSocket, String), String> {
    let mut sock = zeromq::PubSocket::new();
    let at = sock.bind(endpoint).await.map_err(|e| e.to_string())?;
    Ok((sock, at.to_string()))
}

impl Publisher {
    /// Publishes the store's events (the single namespace's stream) from now until the
    /// server shuts down.
    pub(crate) async fn run(self, mut sock: zeromq::PubSocket, shared: Arc<Shared>) {
        let bus: &EventBus = shared.tenants.bus(0);
        let metrics = &shared.metrics;
        let shutdown = shared.shutdown.clone();
        let mut rx = bus.subscribe(None).rx;
        let mut seq: u64 = 0;
        let mut batch: Vec<BlockEvent> = Vec::with_capacity(self.batch_events);
        loop {
            let first = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = rx.recv() => r,
            };
            match first {
                Ok(e) => batch.push(e),
                Err(RecvError::Lagged(n)) => {
                    lost(metrics, &mut seq, n);
                    continue;
                }
                Err(RecvError::Closed) => break,
            }
            let deadline = tokio::time::Instant::now() + self.batch;
            while batch.len() < self.batch_events {
                match rx.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(TryRecvError::Lagged(n)) => lost(metrics, &mut seq, n),
                    Err(TryRecvError::Closed) => break,
                    Err(TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, rx.recv()).await {
                            Ok(Ok(e)) => batch.push(e),
                            Ok(Err(RecvError::Lagged(n))) => lost(metrics, &mut seq, n),
                            Ok(Err(RecvError::Closed)) | Err(_) => break,
                        }
                    }
                }
            }
            let payload = encode_batch(&batch, self.block_tokens, now_s());
            batch.clear();
            let msg = ZmqMessage::try_from(vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ]);
            seq += 1;
            let Ok(msg) = msg else { continue };
            // A PUB socket drops what a slow subscriber cannot take (ZMTP's rule); an error
            // here is one peer's, and the socket drops that peer.
            if let Err(e) = sock.send(msg).await {
                tracing::debug!("events.zmq: send: {e}");
            }
            Metrics::inc(&metrics.zmq_batches);
        }
        let _ = sock.close().await;
    }
}

fn lost(metrics: &Metrics, seq: &mut u64, n: u64) {
    metrics.zmq_events_lost.inc_by(n);
    // One sequence number skipped: the subscribers see a gap.
    *seq += 1;
    tracing::warn!("events.zmq: fell {n} events behind the store; they are not published");
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn medium(tier: u8) -> &'static str {
    match TierCode::from_u8(tier) {
        Some(TierCode::Hbm) => "GPU",
        Some(TierCode::Nvme) => "STORAGE",
        _ => "CPU",
    }
}

/// A `KVEventBatch`: `[ts, [event, ...]]` (vLLM's `EventBatch` is `array_like`, and its
/// `data_parallel_rank`, None, is omitted), each event a map tagged by `type` first.
pub(crate) fn encode_batch(events: &[BlockEvent], block_tokens: u32, ts: f64) -> Vec<u8> {
    use rmp::encode as m;
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut i = 0;
    while i < events.len() {
        let e = &events[i];
        let mut w = Vec::with_capacity(96);
        match EventKind::from_u8(e.kind) {
            Some(EventKind::Stored) => {
                // Writing into a Vec cannot fail.
                let _ = m::write_map_len(&mut w, 8);
                str_kv(&mut w, "type", "BlockStored");
                let _ = m::write_str(&mut w, "block_hashes");
                let _ = m::write_array_len(&mut w, 1);
                let _ = m::write_bin(&mut w, e.key.as_bytes());
                nil_k(&mut w, "parent_block_hash");
                let _ = m::write_str(&mut w, "token_ids");
                let _ = m::write_array_len(&mut w, 0);
                let _ = m::write_str(&mut w, "block_size");
                let _ = m::write_uint(&mut w, u64::from(block_tokens));
                nil_k(&mut w, "lora_id");
                str_kv(&mut w, "medium", medium(e.tier));
                nil_k(&mut w, "lora_name");
                i += 1;
            }
            Some(EventKind::Removed) => {
                let run = events[i..]
                    .iter()
                    .take_while(|x| x.kind == e.kind && x.tier == e.tier)
                    .count();
                let _ = m::write_map_len(&mut w, 3);
                str_kv(&mut w, "type", "BlockRemoved");
                let _ = m::write_str(&mut w, "block_hashes");
                let _ = m::write_array_len(&mut w, run as u32);
                for x in &events[i..i + run] {
                    let _ = m::write_bin(&mut w, x.key.as_bytes());
                }
                str_kv(&mut w, "medium", medium(e.tier));
                i += run;
            }
            Some(EventKind::Cleared) => {
                let _ = m::write_map_len(&mut w, 1);
                str_kv(&mut w, "type", "AllBlocksCleared");
                i += 1;
            }
            None => {
                i += 1;
                continue;
            }
        }
        out.push(w);
    }
    let mut b = Vec::with_capacity(16 + out.iter().map(Vec::len).sum::<usize>());
    let _ = m::write_array_len(&mut b, 2);
    let _ = m::write_f64(&mut b, ts);
    let _ = m::write_array_len(&mut b, out.len() as u32);
    for w in out {
        b.extend_from_slice(&w);
    }
    b
}

fn str_kv(w: &mut Vec<u8>, k: &str, v: &str) {
    let _ = rmp::encode::write_str(w, k);
    let _ = rmp::encode::write_str(w, v);
}

fn nil_k(w: &mut Vec<u8>, k: &str) {
    let _ = rmp::encode::write_str(w, k);
    let _ = rmp::encode::write_nil(w);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::BlockKey;

    fn ev(kind: EventKind, tier: TierCode, k: u128) -> BlockEvent {
        BlockEvent {
            seq: 0,
            kind: kind as u8,
            tier: tier as u8,
            key: BlockKey::from_u128(k),
        }
    }

    #[test]
    fn a_batch_is_an_array_of_ts_and_tagged_events() {
        let evs = [
            ev(EventKind::Stored, TierCode::Dram, 1),
            ev(EventKind::Removed, TierCode::Dram, 1),
            ev(EventKind::Removed, TierCode::Dram, 2),
            ev(EventKind::Removed, TierCode::Nvme, 3),
            ev(EventKind::Cleared, TierCode::Dram, 0),
        ];
        let b = encode_batch(&evs, 128, 12.5);
        let mut r = &b[..];
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 2);
        assert_eq!(rmp::decode::read_f64(&mut r).unwrap(), 12.5);
        // Stored; Removed x2 from DRAM in one; Removed from NVMe; Cleared.
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 4);
        assert_eq!(rmp::decode::read_map_len(&mut r).unwrap(), 8);
        let mut s = [0u8; 32];
        assert_eq!(rmp::decode::read_str(&mut r, &mut s).unwrap(), "type");
        assert_eq!(
            rmp::decode::read_str(&mut r, &mut s).unwrap(),
            "BlockStored"
        );
        // The whole batch is well-formed msgpack of the expected length.
        let text = String::from_utf8_lossy(&b);
        for tag in ["BlockRemoved", "AllBlocksCleared", "STORAGE", "CPU"] {
            assert!(text.contains(tag), "{tag}");
        }
        assert_eq!(text.matches("BlockRemoved").count(), 2);
    }

    #[test]
    fn an_empty_batch_is_well_formed() {
        let b = encode_batch(&[], 16, 1.0);
        let mut r = &b[..];
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 2);
        assert_eq!(rmp::decode::read_f64(&mut r).unwrap(), 1.0);
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 0);
        assert!(r.is_empty());
    }
}

//! One task per kvtier server: subscribes to its block events with a snapshot, applies them to
//! the server's [`ServerIndex`], and starts over (forgetting the server's blocks, a fresh
//! snapshot) on a gap notice, a hole in the sequence numbers, a lost connection or a server
//! that restarted. While it is not subscribed the server's index is marked unsynced and holds
//! nothing, so the router predicts no cache there (it routes by load) rather than trusting a
//! stale view.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvtier_client::{Client, ClientConfig, EventItem};
use tokio_util::sync::CancellationToken;

use crate::index::{Applied, SeqTracker, ServerIndex, Step};
use crate::metrics::Metrics;

/// Wait before the first reconnect after a failure; doubled up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The shared view of one kvtier server.
#[derive(Debug)]
pub struct ServerView {
    pub url: String,
    pub index: RwLock<ServerIndex>,
    /// Bytes of one block on that server (from its hello); 0 until first connected.
    pub block_bytes: std::sync::atomic::AtomicU64,
    pub synced: std::sync::atomic::AtomicBool,
}

impl ServerView {
    pub fn new(url: String, max_blocks: usize) -> Self {
        Self {
            url,
            index: RwLock::new(ServerIndex::new(max_blocks)),
            block_bytes: 0.into(),
            synced: false.into(),
        }
    }

    /// The index, read; a poisoned lock (a panic while applying) still holds a usable map.
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, ServerIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ServerIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the view subscribed or not; not subscribed forgets every block.
    pub fn set_synced(&self, on: bool, m: &Metrics) {
        use std::sync::atomic::Ordering;
        self.synced.store(on, Ordering::Relaxed);
        m.index_synced
            .with_label_values(&[&self.url])
            .set(on as i64);
        if !on {
            self.write().clear();
            m.index_blocks.with_label_values(&[&self.url]).set(0);
        }
    }
}

impl ServerView {
    /// Applies one batch of a subscription; the reason to resync (`"gap"`: the server said
    /// events were lost; `"sequence"`: a hole in the numbers), if any. Events after the one
    /// that calls for a resync are not applied.
    pub fn apply_batch(
        &self,
        seq: &mut SeqTracker,
        batch: Vec<EventItem>,
        m: &Metrics,
    ) -> Option<&'static str> {
        let events = m.index_events.with_label_values(&[&self.url]);
        let dropped = m.index_dropped.with_label_values(&[&self.url]);
        let mut ix = self.write();
        let mut resync = None;
        for item in batch {
            let step = match &item {
                EventItem::Gap { from, to } => seq.gap(*from, *to),
                EventItem::Event(e) => seq.event(e.seq),
            };
            match (step, item) {
                (Step::Apply, EventItem::Event(e)) => {
                    events.inc();
                    if ix.apply(&e) == Applied::DroppedAtCap {
                        dropped.inc();
                    }
                }
                (Step::Skip, _) | (Step::Apply, EventItem::Gap { .. }) => {}
                (Step::Resync { from, to }, item) => {
                    tracing::warn!(server = %self.url, from, to, "block events lost");
                    resync = Some(if matches!(item, EventItem::Gap { .. }) {
                        "gap"
                    } else {
                        "sequence"
                    });
                    break;
                }
            }
        }
        m.index_blocks
            .with_label_values(&[&self.url])
            .set(ix.len() as i64);
        resync
    }
}

/// Why a subscription ended.
enum Ended {
    Cancelled,
    Resync(&'static str),
}

/// Runs until `cancel`: subscribe, apply, start over.
pub async fn follow(
    view: Arc<ServerView>,
    config: ClientConfig,
    m: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let reason = tokio::select! {
            _ = cancel.cancelled() => return,
            r = subscribe_once(&view, &config, &m, &cancel) => r,
        };
        match reason {
            Ok(Ended::Cancelled) => return,
            Ok(Ended::Resync(why)) => {
                view.set_synced(false, &m);
                m.index_resyncs.with_label_values(&[&view.url, why]).inc();
                tracing::warn!(server = %view.url, reason = why, "block events: resubscribing with a snapshot");
                backoff = MIN_BACKOFF;
                // A short pause, so a server going down is not hammered.
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(MIN_BACKOFF) => {}
                }
            }
            Err(e) => {
                view.set_synced(false, &m);
                m.index_resyncs
                    .with_label_values(&[&view.url, "connect"])
                    .inc();
                tracing::warn!(server = %view.url, error = %e, retry_in = ?backoff, "block events: cannot subscribe");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

async fn subscribe_once(
    view: &ServerView,
    config: &ClientConfig,
    m: &Metrics,
    cancel: &CancellationToken,
) -> Result<Ended, kvtier_client::ClientError> {
    use std::sync::atomic::Ordering;
    let client = Client::connect(&view.url, config.clone()).await?;
    view.block_bytes
        .store(client.block_bytes() as u64, Ordering::Relaxed);
    // From now on, what the snapshot and the stream say is the truth about this server.
    view.write().clear();
    let mut stream = client.events(None, true).await?;
    view.set_synced(true, m);
    tracing::info!(server = %view.url, next_seq = stream.start_seq, "block events: subscribed");
    let mut seq = SeqTracker::new(stream.start_seq);
    loop {
        let batch = tokio::select! {
            _ = cancel.cancelled() => return Ok(Ended::Cancelled),
            b = stream.next_batch() => b,
        };
        let Some(batch) = batch else {
            return Ok(Ended::Resync("lost"));
        };
        if let Some(why) = view.apply_batch(&mut seq, batch, m) {
            return Ok(Ended::Resync(why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::BlockKey;
    use kvtier_core::protocol::{BlockEvent, EventKind, TierCode};

    fn stored(seq: u64, k: u8) -> EventItem {
        EventItem::Event(BlockEvent {
            seq,
            kind: EventKind::Stored as u8,
            tier: TierCode::Dram as u8,
            key: BlockKey::from_bytes([k; 16]),
        })
    }

    fn keys(n: u8) -> Vec<BlockKey> {
        (1..=n).map(|k| BlockKey::from_bytes([k; 16])).collect()
    }

    #[test]
    fn a_gap_or_a_hole_asks_for_a_resync_and_unsyncing_forgets() {
        let m = Metrics::new().unwrap();
        let v = ServerView::new("tcp://s:1".into(), 100);
        v.set_synced(true, &m);
        let mut seq = SeqTracker::new(5);
        // Snapshot, then the live stream.
        assert_eq!(
            v.apply_batch(&mut seq, vec![stored(0, 1), stored(0, 2), stored(5, 3)], &m),
            None
        );
        assert_eq!(v.read().prefix(&keys(4)).len(), 3);
        // The server says 6..9 were lost: resync; the rest of the batch is not applied.
        let r = v.apply_batch(
            &mut seq,
            vec![EventItem::Gap { from: 6, to: 9 }, stored(9, 4)],
            &m,
        );
        assert_eq!(r, Some("gap"));
        assert_eq!(v.read().prefix(&keys(4)).len(), 3);
        // A hole in the numbers is a resync too.
        let mut seq = SeqTracker::new(5);
        assert_eq!(
            v.apply_batch(&mut seq, vec![stored(5, 4), stored(7, 5)], &m),
            Some("sequence")
        );
        assert_eq!(v.read().prefix(&keys(5)).len(), 4);
        // Until the next snapshot, the router knows nothing of this server.
        v.set_synced(false, &m);
        assert!(v.read().is_empty());
        assert!(!v.synced.load(std::sync::atomic::Ordering::Relaxed));
        let text = m.render();
        assert!(
            text.contains("kvtier_router_index_synced{server=\"tcp://s:1\"} 0"),
            "{text}"
        );
    }
}

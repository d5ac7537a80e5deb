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

    fn set_synced(&self, on: bool, m: &Metrics) {
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
    let events = m.index_events.with_label_values(&[&view.url]);
    let dropped = m.index_dropped.with_label_values(&[&view.url]);
    let blocks = m.index_blocks.with_label_values(&[&view.url]);
    loop {
        let batch = tokio::select! {
            _ = cancel.cancelled() => return Ok(Ended::Cancelled),
            b = stream.next_batch() => b,
        };
        let Some(batch) = batch else {
            return Ok(Ended::Resync("lost"));
        };
        let mut ix = view.write();
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
                    tracing::warn!(server = %view.url, from, to, "block events lost");
                    let why = if matches!(item, EventItem::Gap { .. }) {
                        "gap"
                    } else {
                        "sequence"
                    };
                    return Ok(Ended::Resync(why));
                }
            }
        }
        blocks.set(ix.len() as i64);
    }
}

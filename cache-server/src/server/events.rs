//! The block event stream: store events numbered in one sequence, kept in a bounded ring for
//! late subscribers, fanned out over a bounded broadcast channel. A subscriber that falls
//! behind loses events and is told exactly which sequence numbers it lost.

use std::collections::VecDeque;
use std::sync::Mutex;

use kvtier_core::protocol::{BlockEvent, EventKind, TierCode};
use tokio::sync::broadcast;

use crate::{StoreEvent, StoreEventKind, TierKind};

/// Events kept for subscribers that ask for a past sequence number.
pub const EVENT_RING: usize = 65_536;
/// Events a live subscriber may lag behind before it is told about a gap.
pub const EVENT_CHANNEL: usize = 16_384;

pub struct EventBus {
    state: Mutex<Ring>,
    tx: broadcast::Sender<BlockEvent>,
}

struct Ring {
    next_seq: u64,
    events: VecDeque<BlockEvent>,
}

pub fn tier_code(t: TierKind) -> TierCode {
    match t {
        TierKind::Hbm => TierCode::Hbm,
        TierKind::Dram => TierCode::Dram,
        TierKind::Nvme => TierCode::Nvme,
    }
}

/// What a new subscriber gets: the events it asked for that are still held, the gap
/// before them if some are not, and the live stream from there on.
pub struct Subscription {
    pub backlog: Vec<BlockEvent>,
    pub gap: Option<(u64, u64)>,
    pub next_seq: u64,
    pub rx: broadcast::Receiver<BlockEvent>,
}

impl Default for EventBus {
    fn default() -> Self {
        Self::new()
    }
}

impl EventBus {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(Ring {
                next_seq: 1,
                // Grown as events come (up to EVENT_RING): a namespace that stores little
                // costs little.
                events: VecDeque::new(),
            }),
            tx: broadcast::channel(EVENT_CHANNEL).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Numbers and publishes one store event. Never blocks (a full channel drops the oldest
    /// event for laggards, who see a gap).
    pub fn publish(&self, e: StoreEvent) {
        let kind = match e.kind {
            StoreEventKind::Stored => EventKind::Stored,
            StoreEventKind::Removed => EventKind::Removed,
            StoreEventKind::Cleared => EventKind::Cleared,
        };
        let mut g = self.lock();
        let ev = BlockEvent {
            seq: g.next_seq,
            kind: kind as u8,
            tier: tier_code(e.tier) as u8,
            key: e.key,
        };
        g.next_seq += 1;
        if g.events.len() == EVENT_RING {
            g.events.pop_front();
        }
        g.events.push_back(ev);
        // No receivers is fine: nobody is subscribed.
        let _ = self.tx.send(ev);
    }

    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// Subscribes from `from_seq` (`None`: from now).
    pub fn subscribe(&self, from_seq: Option<u64>) -> Subscription {
        let g = self.lock();
        // Subscribing under the lock: nothing published between the backlog and the stream.
        let rx = self.tx.subscribe();
        let next_seq = g.next_seq;
        let (mut backlog, mut gap) = (Vec::new(), None);
        if let Some(from) = from_seq.filter(|f| *f < next_seq) {
            let oldest = g.events.front().map_or(next_seq, |e| e.seq);
            if from < oldest {
                gap = Some((from, oldest));
            }
            backlog.extend(g.events.iter().filter(|e| e.seq >= from).copied());
        }
        Subscription {
            backlog,
            gap,
            next_seq,
            rx,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::BlockKey;

    fn ev(i: u128) -> StoreEvent {
        StoreEvent {
            kind: StoreEventKind::Stored,
            tier: TierKind::Dram,
            key: BlockKey::from_u128(i),
        }
    }

    #[test]
    fn late_subscribers_replay_or_learn_the_gap() {
        let bus = EventBus::new();
        for i in 0..10 {
            bus.publish(ev(i));
        }
        let s = bus.subscribe(Some(4));
        assert_eq!(s.backlog.first().map(|e| e.seq), Some(4));
        assert_eq!(s.backlog.len(), 7);
        assert_eq!((s.gap, s.next_seq), (None, 11));
        let s = bus.subscribe(None);
        assert!(s.backlog.is_empty());
        for i in 0..(EVENT_RING as u128 + 5) {
            bus.publish(ev(i));
        }
        let s = bus.subscribe(Some(1));
        assert_eq!(s.gap, Some((1, 16)));
        assert_eq!(s.backlog.len(), EVENT_RING);
    }

    #[test]
    fn a_lagging_live_subscriber_is_told() {
        let bus = EventBus::new();
        let mut s = bus.subscribe(None);
        for i in 0..(EVENT_CHANNEL as u128 + 10) {
            bus.publish(ev(i));
        }
        match s.rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 10),
            other => panic!("expected a lag, got {other:?}"),
        }
        assert_eq!(s.rx.try_recv().unwrap().seq, 11);
    }
}

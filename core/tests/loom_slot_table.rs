//! A `loom` model of the published slot table's seqlock (`docs/protocol.md`, "Local gets
//! without a message"; `cache-server/src/tier/published.rs` writes, `client/src/conn.rs`'s
//! `SlotView::read` reads). loom explores every interleaving and every weak-memory outcome
//! the orderings allow, and checks that a reader never accepts a copy that is not exactly the
//! block its record named.
//!
//! The block's bytes are modeled as two words the writer stores relaxed and the reader loads
//! relaxed (loom cannot model the plain `memcpy` of shared memory between two processes; a
//! relaxed atomic per word is the standard stand-in, and what the fences must order).
//! Writer: for each new block, `unpublish` (seq odd: relaxed store, release fence), write the
//! block's words, write the key, `publish` (seq even: release store). Reader: load seq
//! (acquire), skip if odd, load the key, copy the words, acquire fence, re-load seq (relaxed);
//! accept only if unchanged, and then the words must be the key's block.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering, fence};
use loom::thread;

struct Slot {
    seq: AtomicU64,
    key: AtomicU64,
    data: [AtomicU64; 2],
}

/// Block `k`'s two words: distinct for every key and word.
fn word(k: u64, i: u64) -> u64 {
    k * 1000 + i
}

impl Slot {
    fn new(key: u64) -> Self {
        // Published with `key` from the start (seq even).
        Self {
            seq: AtomicU64::new(2),
            key: AtomicU64::new(key),
            data: [AtomicU64::new(word(key, 0)), AtomicU64::new(word(key, 1))],
        }
    }

    /// The server reusing the slot for block `key` (evict, then fill, then publish).
    fn rewrite(&self, key: u64) {
        // unpublish
        let s = self.seq.load(Ordering::Relaxed);
        assert!(s.is_multiple_of(2));
        self.seq.store(s + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        // the fill (another thread in the server, ordered by its locks; same thread here)
        for (i, w) in self.data.iter().enumerate() {
            w.store(word(key, i as u64), Ordering::Relaxed);
        }
        // publish
        self.key.store(key, Ordering::Relaxed);
        self.seq.store(s + 2, Ordering::Release);
    }

    /// The client: `Some(key, words)` when it accepts a copy.
    fn read(&self) -> Option<(u64, [u64; 2])> {
        let s1 = self.seq.load(Ordering::Acquire);
        if !s1.is_multiple_of(2) {
            return None;
        }
        let key = self.key.load(Ordering::Relaxed);
        let copy = [
            self.data[0].load(Ordering::Relaxed),
            self.data[1].load(Ordering::Relaxed),
        ];
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == s1).then_some((key, copy))
    }
}

#[test]
fn a_reader_never_accepts_a_torn_or_foreign_block() {
    // Every interleaving up to 3 preemptions (the full space of two rewrites takes minutes).
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let slot = Arc::new(Slot::new(1));
        let w = {
            let slot = slot.clone();
            thread::spawn(move || {
                slot.rewrite(2);
                slot.rewrite(3);
            })
        };
        if let Some((key, copy)) = slot.read() {
            assert!((1..=3).contains(&key), "key {key}");
            assert_eq!(copy, [word(key, 0), word(key, 1)], "torn copy of {key}");
        }
        w.join().unwrap();
        // Once the writer is done, a read sees the last block.
        assert_eq!(slot.read(), Some((3, [word(3, 0), word(3, 1)])));
    });
}

#[test]
fn a_withdrawn_slot_is_not_read_after_the_withdrawal_is_seen() {
    // The server withdraws (removal, clear) without refilling; a reader that then runs after
    // the withdrawal (synchronized with it) must miss.
    loom::model(|| {
        let slot = Arc::new(Slot::new(7));
        let done = Arc::new(AtomicU64::new(0));
        let w = {
            let (slot, done) = (slot.clone(), done.clone());
            thread::spawn(move || {
                let s = slot.seq.load(Ordering::Relaxed);
                slot.seq.store(s + 1, Ordering::Relaxed);
                fence(Ordering::Release);
                // The server's reply to `remove` (a message the reader waits for).
                done.store(1, Ordering::Release);
            })
        };
        if done.load(Ordering::Acquire) == 1 {
            assert_eq!(slot.read(), None, "read a removed block");
        } else if let Some((k, copy)) = slot.read() {
            assert_eq!((k, copy), (7, [word(7, 0), word(7, 1)]));
        }
        w.join().unwrap();
    });
}

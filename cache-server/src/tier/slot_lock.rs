//! A per-slot reader/writer guard made of one atomic word: many readers or one writer, and a
//! conflicting request is refused instead of waiting (the store never makes one; a refusal
//! points at a caller bug, and refusing keeps a tier from ever serving a torn block).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use kvtier_core::BlockKey;

use super::{SlotId, TierError};

const WRITER: u32 = u32::MAX;

#[derive(Default)]
pub(crate) struct SlotLock(AtomicU32);

pub(crate) struct ReadGuard<'a>(&'a AtomicU32);
pub(crate) struct WriteGuard<'a>(&'a AtomicU32);

impl SlotLock {
    pub(crate) fn read(&self) -> Option<ReadGuard<'_>> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            if cur == WRITER || cur == WRITER - 1 {
                return None;
            }
            match self
                .0
                .compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Some(ReadGuard(&self.0)),
                Err(now) => cur = now,
            }
        }
    }

    pub(crate) fn write(&self) -> Option<WriteGuard<'_>> {
        self.0
            .compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| WriteGuard(&self.0))
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

const EMPTY_LEN: u64 = u64::MAX;

/// Per-slot lock plus the key and length of the block in it, for tiers whose memory carries
/// no header of its own (DRAM, HBM).
pub(crate) struct SlotTable {
    slots: Box<[SlotMeta]>,
}

struct SlotMeta {
    lock: SlotLock,
    key_lo: AtomicU64,
    key_hi: AtomicU64,
    len: AtomicU64,
}

/// An exclusive hold on a slot being written; `commit` makes the block readable.
pub(crate) struct SlotWrite<'a> {
    meta: &'a SlotMeta,
    _guard: WriteGuard<'a>,
}

impl SlotWrite<'_> {
    pub(crate) fn commit(self, key: BlockKey, len: usize) {
        let k = key.to_u128();
        self.meta.key_lo.store(k as u64, Ordering::Relaxed);
        self.meta.key_hi.store((k >> 64) as u64, Ordering::Relaxed);
        self.meta.len.store(len as u64, Ordering::Relaxed);
    }
}

impl SlotTable {
    pub(crate) fn new(slots: u32) -> Self {
        Self {
            slots: (0..slots)
                .map(|_| SlotMeta {
                    lock: SlotLock::default(),
                    key_lo: AtomicU64::new(0),
                    key_hi: AtomicU64::new(0),
                    len: AtomicU64::new(EMPTY_LEN),
                })
                .collect(),
        }
    }

    /// Locks `slot` for writing and marks it empty until the write commits.
    pub(crate) fn write(&self, slot: SlotId) -> Result<SlotWrite<'_>, TierError> {
        let meta = &self.slots[slot.index()];
        let guard = meta.lock.write().ok_or(TierError::Busy { slot })?;
        meta.len.store(EMPTY_LEN, Ordering::Relaxed);
        Ok(SlotWrite {
            meta,
            _guard: guard,
        })
    }

    /// Locks `slot` for reading if it holds block `key` of `len` bytes.
    pub(crate) fn read(
        &self,
        slot: SlotId,
        key: BlockKey,
        len: usize,
    ) -> Result<ReadGuard<'_>, TierError> {
        let m = &self.slots[slot.index()];
        let guard = m.lock.read().ok_or(TierError::Busy { slot })?;
        let stored = m.len.load(Ordering::Relaxed);
        let k = u128::from(m.key_lo.load(Ordering::Relaxed))
            | (u128::from(m.key_hi.load(Ordering::Relaxed)) << 64);
        let reason = if stored == EMPTY_LEN {
            "empty slot"
        } else if k != key.to_u128() {
            "another key"
        } else if stored != len as u64 {
            "another length"
        } else {
            return Ok(guard);
        };
        Err(TierError::Mismatch { slot, reason })
    }

    pub(crate) fn erase(&self, slot: SlotId) -> Result<(), TierError> {
        self.write(slot).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_share_writers_exclude() {
        let l = SlotLock::default();
        let r1 = l.read().unwrap();
        let r2 = l.read().unwrap();
        assert!(l.write().is_none());
        drop((r1, r2));
        let w = l.write().unwrap();
        assert!(l.read().is_none());
        assert!(l.write().is_none());
        drop(w);
        assert!(l.read().is_some());
    }
}

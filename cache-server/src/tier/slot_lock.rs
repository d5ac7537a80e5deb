//! A per-slot reader/writer guard made of one atomic word: many readers or one writer, and a
//! conflicting request is refused instead of waiting (the store never makes one; a refusal
//! points at a caller bug, and refusing keeps a tier from ever serving a torn block).

use std::sync::atomic::{AtomicU32, Ordering};

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

//! Blocks being stored: keys a put in flight has announced, or reserved and not yet
//! committed. A reader that meets one may wait (bounded) for its commit instead of missing
//! it. A pending key is never served: it only says the index will soon hold the block (or
//! will not, when the put is refused, aborted or expires, which withdraws it at once).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvtier_core::BlockKey;

use crate::keyhash::KeyHashing;
use crate::tier::dram::DramTier;

use super::{Inner, lock};

/// Pending keys, each with the number of announcements and reservations holding it.
pub(super) struct Pending {
    map: Mutex<HashMap<BlockKey, u32, KeyHashing>>,
    /// Distinct pending keys: readers skip the lock while it is zero.
    count: AtomicUsize,
    /// Where local clients read that count (the published slot table's `pending`: a
    /// client answering a lookup itself may not call a key missing while it is not zero).
    dram: Arc<DramTier>,
}

impl Pending {
    pub(super) fn new(hashing: KeyHashing, dram: Arc<DramTier>) -> Self {
        Self {
            map: Mutex::new(HashMap::with_hasher(hashing)),
            count: AtomicUsize::new(0),
            dram,
        }
    }

    /// The count changed (under the map's lock): readers here and local clients see it.
    fn counted(&self, n: usize) {
        self.count.store(n, Ordering::Release);
        self.dram.published().set_pending(n as u64);
    }

    pub(super) fn add(&self, keys: impl IntoIterator<Item = BlockKey>) {
        let mut m = lock(&self.map);
        for k in keys {
            *m.entry(k).or_insert(0) += 1;
        }
        self.counted(m.len());
    }

    pub(super) fn remove(&self, key: &BlockKey) {
        let mut m = lock(&self.map);
        if let Some(n) = m.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                m.remove(key);
            }
        }
        self.counted(m.len());
    }

    pub(super) fn contains(&self, key: &BlockKey) -> bool {
        self.count.load(Ordering::Acquire) != 0 && lock(&self.map).contains_key(key)
    }

    /// The index of the first of `keys` that is pending, under one lock (none: at once, without
    /// the lock, while nothing is pending).
    pub(super) fn first_of(&self, keys: &[BlockKey]) -> Option<usize> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let m = lock(&self.map);
        keys.iter().position(|k| m.contains_key(k))
    }

    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// Keys a put in flight has announced (see [`super::TieredStore::announce`]): each is
/// withdrawn by [`Announcement::done`] once stored or refused, and all are withdrawn when the
/// announcement drops, however the put ends.
pub struct Announcement {
    pub(super) inner: Arc<Inner>,
    pub(super) keys: Vec<Option<BlockKey>>,
}

impl Announcement {
    /// Withdraws the `i`-th key announced (a no-op the second time).
    pub fn done(&mut self, i: usize) {
        if let Some(k) = self.keys.get_mut(i).and_then(Option::take) {
            self.inner.pending.remove(&k);
        }
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        for k in self.keys.iter().flatten() {
            self.inner.pending.remove(k);
        }
    }
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement")
            .field("pending", &self.keys.iter().flatten().count())
            .finish()
    }
}

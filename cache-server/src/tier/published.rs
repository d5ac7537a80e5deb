//! The published slot table: what a local client needs to read a DRAM block with no message
//! at all (the "fast path" of a local get), in a second sealed memfd it maps read-only.
//!
//! Layout (little-endian, every field naturally aligned; `docs/protocol.md` has the same):
//!
//! * header, 64 bytes: `magic: u64 = "KVTSLOT1"`, `slots: u32`, `ways: u32 = 8`,
//!   `buckets: u32` (a power of two), `_pad: u32`, `block_bytes: u64`, `slot_bytes: u64`,
//!   `flags: u64` (`kvtier_core::slot_table::flags`: `TWO_CHOICE` and `KEYS_AES` always, `TAGGED` where
//!   `slots` allows, `LOOKUPS` set by [`Published::allow_lookups`] before any client maps
//!   the table), zeros up to 64;
//! * slot table at 64: `slots` records of 32 bytes: `seq: u64, key_lo: u64, key_hi: u64,
//!   _reserved: u64`. `seq` is a seqlock counter: **odd** while the slot holds no readable
//!   block (empty, being written, retired), **even** while it holds the block whose key is
//!   `key_lo | key_hi << 64` (`BlockKey::to_u128`), fully written, and not going to change
//!   while `seq` keeps that value;
//! * index at `64 + 32 * slots`: `buckets` buckets of `ways` `u32` entries, each `slot + 1`
//!   (0 = empty) with, under `TAGGED`, the key's 8-bit tag above it (`entry_of`). A key is
//!   indexed in whichever of its two buckets (`bucket_of`,
//!   `second_bucket_of`, masked) has more free entries, and looked for in both.
//!
//! The index is a hint: a key may be missing from it (its bucket was full, or a reader raced
//! an update) and an entry may be stale; the reader trusts only the slot record, and only
//! if `seq` is even, names the key, and is unchanged after the copy.
//!
//! **Writer protocol (this process only; callers serialize per slot):** [`Published::publish`]
//! once the slot's bytes are the committed block and the store's index names the slot;
//! [`Published::unpublish`] before the slot's bytes may change again (the store calls it when
//! it retires the slot, before any reuse; the tier calls it again before every write).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use kvtier_core::BlockKey;
use memmap2::MmapRaw;

use super::SlotId;

pub use kvtier_core::slot_table::{
    FLAGS_OFFSET, HEADER_BYTES, MAGIC, PENDING_OFFSET, RECORD_BYTES, TAGGED_MAX_SLOTS, WAYS,
    bucket_of, buckets_for, entry_of, flags, second_bucket_of, slot_of_entry, table_bytes,
};

/// See the module documentation.
pub struct Published {
    _file: File,
    read_only: File,
    map: MmapRaw,
    slots: u32,
    buckets: u32,
    /// Index entries carry their key's tag (`flags::TAGGED`).
    tagged: bool,
    /// Serializes index updates (slots' records need no lock: one writer per slot).
    index_lock: Mutex<()>,
}

impl Published {
    pub fn create(slots: u32, block_bytes: u64, slot_bytes: u64) -> std::io::Result<Self> {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"kvtier-slots".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let bytes = table_bytes(slots);
        file.set_len(bytes as u64)?;
        let map = MmapRaw::map_raw(&file)?;
        super::dram::seal_read_only(&file)?;
        let read_only = File::open(format!("/proc/self/fd/{fd}"))?;
        let p = Self {
            _file: file,
            read_only,
            map,
            slots,
            buckets: buckets_for(slots),
            tagged: slots <= TAGGED_MAX_SLOTS,
            index_lock: Mutex::new(()),
        };
        // The memfd starts zeroed: every index entry empty; records need an odd seq.
        p.word64(0).store(MAGIC, Ordering::Relaxed);
        p.word32(8).store(slots, Ordering::Relaxed);
        p.word32(12).store(WAYS as u32, Ordering::Relaxed);
        p.word32(16).store(p.buckets, Ordering::Relaxed);
        p.word64(24).store(block_bytes, Ordering::Relaxed);
        p.word64(32).store(slot_bytes, Ordering::Relaxed);
        let tag = if p.tagged { flags::TAGGED } else { 0 };
        p.word64(FLAGS_OFFSET)
            .store(flags::TWO_CHOICE | flags::KEYS_AES | tag, Ordering::Relaxed);
        for s in 0..slots {
            p.seq(s).store(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        Ok(p)
    }

    /// Sets `LOOKUPS` in the header's flags, and `EXACT` with `exact`: local clients may
    /// answer lookups from the table. The store calls it while it is built, before any
    /// client can map the table.
    pub fn allow_lookups(&self, exact: bool) {
        let bits = flags::LOOKUPS | if exact { flags::EXACT } else { 0 };
        self.word64(FLAGS_OFFSET).fetch_or(bits, Ordering::Release);
    }

    /// Publishes how many distinct keys puts in flight are storing (the header's
    /// `pending`). Callers serialize (the store's pending registry, under its lock).
    pub fn set_pending(&self, keys: u64) {
        self.word64(PENDING_OFFSET).store(keys, Ordering::SeqCst);
    }

    /// The header's `pending`.
    pub fn pending(&self) -> u64 {
        self.word64(PENDING_OFFSET).load(Ordering::SeqCst)
    }

    /// The header's `flags`.
    pub fn flags(&self) -> u64 {
        self.word64(FLAGS_OFFSET).load(Ordering::Acquire)
    }

    /// A read-only descriptor of the table, for a local client to map (`PROT_READ`).
    pub fn client_fd(&self) -> BorrowedFd<'_> {
        self.read_only.as_fd()
    }

    /// Bytes of the table (what the hello reply announces).
    pub fn bytes(&self) -> u64 {
        self.map.len() as u64
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.map.len(),
            "table offset"
        );
        // SAFETY: in bounds and 8-aligned (asserted; the mapping is page aligned); the memory
        // lives as long as `self.map`, and is only ever accessed through atomics here.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.map.len(),
            "table offset"
        );
        // SAFETY: as in `word64`, 4-aligned.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    fn record(&self, slot: u32) -> usize {
        HEADER_BYTES + RECORD_BYTES * slot as usize
    }

    fn seq(&self, slot: u32) -> &AtomicU64 {
        self.word64(self.record(slot))
    }

    fn entry(&self, bucket: u32, way: usize) -> &AtomicU32 {
        let base = HEADER_BYTES + RECORD_BYTES * self.slots as usize;
        self.word32(base + 4 * (WAYS * bucket as usize + way))
    }

    /// The key's two buckets (the same one twice where they coincide).
    fn buckets_of(&self, key: BlockKey) -> [u32; 2] {
        let m = u64::from(self.buckets - 1);
        [
            (bucket_of(key) & m) as u32,
            (second_bucket_of(key) & m) as u32,
        ]
    }

    fn free_entries(&self, bucket: u32) -> usize {
        (0..WAYS)
            .filter(|&w| self.entry(bucket, w).load(Ordering::Relaxed) == 0)
            .count()
    }

    /// Slot `slot` now holds block `key`, fully written, and the store's index names it.
    pub fn publish(&self, slot: SlotId, key: BlockKey) {
        let s = slot.0;
        let seq = self.seq(s);
        let cur = seq.load(Ordering::Relaxed);
        let cur = if cur.is_multiple_of(2) {
            // Published already (a caller bug): withdraw first so no reader mixes the two.
            self.unpublish(slot);
            seq.load(Ordering::Relaxed)
        } else {
            cur
        };
        let k = key.to_u128();
        let r = self.record(s);
        self.word64(r + 8).store(k as u64, Ordering::Relaxed);
        self.word64(r + 16)
            .store((k >> 64) as u64, Ordering::Relaxed);
        // Release: a reader that sees the even value sees the key above and the block's
        // bytes (written before this call, ordered by the store's locks before it).
        seq.store(cur + 1, Ordering::Release);
        let _g = self.index_lock.lock().unwrap_or_else(|p| p.into_inner());
        // The emptier of the key's two buckets (the first on a tie).
        let [b1, b2] = self.buckets_of(key);
        let b = if self.free_entries(b2) > self.free_entries(b1) {
            b2
        } else {
            b1
        };
        for w in 0..WAYS {
            let e = self.entry(b, w);
            if e.load(Ordering::Relaxed) == 0 {
                e.store(entry_of(s, key, self.tagged), Ordering::Release);
                return;
            }
        }
        // Both buckets full: the key is not indexed (its readers take the pin path).
    }

    /// Slot `slot` is no longer readable in place: from the store's next write on, its bytes
    /// may change. A no-op when it is not published.
    pub fn unpublish(&self, slot: SlotId) {
        let s = slot.0;
        let seq = self.seq(s);
        let cur = seq.load(Ordering::Relaxed);
        if !cur.is_multiple_of(2) {
            return;
        }
        seq.store(cur + 1, Ordering::Relaxed);
        // Release fence: the odd value is ordered before every later write of this thread
        // (and, through the store's locks, of whichever thread next writes the slot's
        // bytes), so a reader whose copy saw any of those writes sees `seq` changed after its
        // acquire fence.
        fence(Ordering::Release);
        let r = self.record(s);
        let k = u128::from(self.word64(r + 8).load(Ordering::Relaxed))
            | (u128::from(self.word64(r + 16).load(Ordering::Relaxed)) << 64);
        let key = BlockKey::from_u128(k);
        let mine = entry_of(s, key, self.tagged);
        let _g = self.index_lock.lock().unwrap_or_else(|p| p.into_inner());
        for b in self.buckets_of(key) {
            for w in 0..WAYS {
                let e = self.entry(b, w);
                if e.load(Ordering::Relaxed) == mine {
                    e.store(0, Ordering::Release);
                    return;
                }
            }
        }
    }

    /// Whether `slot` is published holding `key` (tests and checks).
    pub fn holds(&self, slot: SlotId, key: BlockKey) -> bool {
        let r = self.record(slot.0);
        self.seq(slot.0).load(Ordering::Acquire).is_multiple_of(2)
            && self.word64(r + 8).load(Ordering::Relaxed) == key.to_u128() as u64
            && self.word64(r + 16).load(Ordering::Relaxed) == (key.to_u128() >> 64) as u64
    }

    /// The slot the index names for `key`, if published (tests and checks).
    pub fn find(&self, key: BlockKey) -> Option<SlotId> {
        self.buckets_of(key)
            .into_iter()
            .flat_map(|b| (0..WAYS).map(move |w| (b, w)))
            .filter_map(|(b, w)| {
                slot_of_entry(self.entry(b, w).load(Ordering::Acquire), self.tagged)
            })
            .map(SlotId)
            .find(|&s| self.holds(s, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_unpublish_and_full_buckets() {
        let p = Published::create(64, 4096, 4096).unwrap();
        assert_eq!(p.bytes() as usize, table_bytes(64));
        let k = BlockKey::from_u128(42);
        assert_eq!(p.find(k), None);
        p.publish(SlotId(3), k);
        assert_eq!(p.find(k), Some(SlotId(3)));
        assert!(p.holds(SlotId(3), k));
        p.unpublish(SlotId(3));
        p.unpublish(SlotId(3));
        assert_eq!(p.find(k), None);
        assert_eq!(p.seq(3).load(Ordering::Relaxed), 3);
        // More keys whose two buckets are both bucket 0 than it has ways: the rest go
        // unindexed, nothing breaks.
        let same: Vec<BlockKey> = (0u128..1_000_000)
            .map(BlockKey::from_u128)
            .filter(|k| p.buckets_of(*k) == [0, 0])
            .take(WAYS + 2)
            .collect();
        assert_eq!(same.len(), WAYS + 2);
        for (i, k) in same.iter().enumerate() {
            p.publish(SlotId(i as u32), *k);
        }
        let found = same.iter().filter(|k| p.find(**k).is_some()).count();
        assert_eq!(found, WAYS);
        for i in 0..same.len() {
            p.unpublish(SlotId(i as u32));
        }
        assert!(same.iter().all(|k| p.find(*k).is_none()));
        // Keys whose first bucket is full go to their second: all indexed, and found.
        let first: Vec<BlockKey> = (0u128..1_000_000)
            .map(BlockKey::from_u128)
            .filter(|k| {
                let [a, b] = p.buckets_of(*k);
                a == 1 && b != 1
            })
            .take(2 * WAYS)
            .collect();
        for (i, k) in first.iter().enumerate() {
            p.publish(SlotId(i as u32), *k);
        }
        assert!(first.iter().all(|k| p.find(*k).is_some()));
        for i in 0..first.len() {
            p.unpublish(SlotId(i as u32));
        }
        assert!(first.iter().all(|k| p.find(*k).is_none()));
        let base = flags::TWO_CHOICE | flags::TAGGED | flags::KEYS_AES;
        assert_eq!(p.flags(), base);
        p.allow_lookups(true);
        assert_eq!(p.flags(), base | flags::LOOKUPS | flags::EXACT);
    }
}

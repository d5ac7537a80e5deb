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
//!   chain: u64`. `seq` is a seqlock counter: **odd** while the slot holds no readable
//!   block (empty, being written, retired), **even** while it holds the block whose key is
//!   `key_lo | key_hi << 64` (`BlockKey::to_u128`), fully written, and not going to change
//!   while `seq` keeps that value. `chain` is the block's chain mark (`CHAINED`, below);
//! * index at `64 + 32 * slots`: `buckets` buckets of `ways` `u32` entries, each `slot + 1`
//!   (0 = empty) with, under `TAGGED`, the key's 8-bit tag above it (`entry_of`). A key is
//!   indexed in whichever of its two buckets (`bucket_of`,
//!   `second_bucket_of`, masked) has more free entries, and looked for in both.
//!
//! **Chain marks** (`flags::CHAINED`, always set; `kvtier_core::slot_table::chain_mark`): a
//! record's `chain` is `epoch << 32 | fingerprint` while the block and every block of its
//! chain (its put's parent, that one's, ... to a block put with no parent) are published,
//! where `epoch` is the header's at the time and `fingerprint` the chain's `chain_fold`. The
//! server knows each slot's parent link (the slot that held the parent its put named, while
//! it still does) and how many published slots link to it. Taking out a slot that others
//! link to moves the header's epoch on **before** the slot's `seq` goes odd, which voids
//! every mark at once (there are no child lists to clear them one by one); marks come back
//! as blocks are published and as lookups walk their prefixes ([`Published::renew`]). So a
//! mark with the current epoch always tells the truth about its chain, which is what lets
//! a client binary-search a prompt's keys instead of probing each one.
//!
//! The index is a hint: a key may be missing from it (its bucket was full, or a reader raced
//! an update) and an entry may be stale; the reader trusts only the slot record, and only
//! if `seq` is even, names the key, and is unchanged after the copy.
//!
//! **Writer protocol (this process only; callers serialize per slot):** [`Published::publish`]
//! once the slot's bytes are the committed block and the store's index names the slot;
//! [`Published::unpublish`] before the slot's bytes may change again (the store calls it when
//! it retires the slot, before any reuse; the tier calls it again before every write). Both
//! run under one lock with the chain bookkeeping and index updates: records, marks, links
//! and the epoch only change under it.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use kvtier_core::BlockKey;
use kvtier_core::slot_table::marked_prefix;
use memmap2::MmapRaw;

use super::SlotId;

pub use kvtier_core::slot_table::{
    CHAIN_OFFSET, CHAIN_SEED, EPOCH_OFFSET, FLAGS_OFFSET, HEADER_BYTES, MAGIC, PENDING_OFFSET,
    RECORD_BYTES, TAGGED_MAX_SLOTS, WAYS, bucket_of, buckets_for, chain_fold, chain_mark, entry_of,
    flags, second_bucket_of, slot_of_entry, table_bytes,
};

/// The parent a block's put named, as [`Published::publish`] takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// The put named none: the first block of its chain.
    Root,
    /// The put named this key.
    Key(BlockKey),
    /// Not known here (a copy between tiers that did not carry it): the block gets no mark.
    Unknown,
}

/// `Link::parent_fp` of a block whose parent is not known.
const FP_UNKNOWN: u64 = 0;
/// `Link::parent_fp` of a block put with no parent.
const FP_ROOT: u64 = 1;

/// The fingerprint a block keeps of its parent's key, to link to the parent again once it is
/// back in DRAM (two values are kept apart for [`FP_UNKNOWN`] and [`FP_ROOT`]).
fn parent_fp(key: BlockKey) -> u64 {
    bucket_of(key).max(FP_ROOT + 1)
}

/// What the server alone knows of a slot's chain (under [`Published`]'s lock).
#[derive(Clone, Copy, Default)]
struct Link {
    /// [`parent_fp`] of the parent its put named, or [`FP_UNKNOWN`] / [`FP_ROOT`].
    parent_fp: u64,
    /// The parent's slot + 1 while linked (0: not linked), and that slot's [`Link::generation`]
    /// then: the link holds while the generation is unchanged.
    parent: u32,
    parent_gen: u32,
    /// Published slots whose current link names this one.
    children: u32,
    /// Moves on each time the slot is taken out: links made before then are stale.
    generation: u32,
}

/// Published's lock: the chain links of every slot.
struct Chains {
    links: Vec<Link>,
}

/// See the module documentation.
pub struct Published {
    _file: File,
    read_only: File,
    map: MmapRaw,
    slots: u32,
    buckets: u32,
    /// Index entries carry their key's tag (`flags::TAGGED`).
    tagged: bool,
    /// Serializes every write: records, marks, index entries, the epoch, and the links.
    chains: Mutex<Chains>,
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
            chains: Mutex::new(Chains {
                links: vec![Link::default(); slots as usize],
            }),
        };
        // The memfd starts zeroed: every index entry empty; records need an odd seq.
        p.word64(0).store(MAGIC, Ordering::Relaxed);
        p.word32(8).store(slots, Ordering::Relaxed);
        p.word32(12).store(WAYS as u32, Ordering::Relaxed);
        p.word32(16).store(p.buckets, Ordering::Relaxed);
        p.word64(24).store(block_bytes, Ordering::Relaxed);
        p.word64(32).store(slot_bytes, Ordering::Relaxed);
        let tag = if p.tagged { flags::TAGGED } else { 0 };
        p.word64(FLAGS_OFFSET).store(
            flags::TWO_CHOICE | flags::KEYS_AES | flags::CHAINED | tag,
            Ordering::Relaxed,
        );
        p.word64(EPOCH_OFFSET).store(1, Ordering::Relaxed);
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
    /// `parent`: the parent its put named, for its chain mark.
    pub fn publish(&self, slot: SlotId, key: BlockKey, parent: Parent) {
        let s = slot.0;
        let mut ch = self.lock();
        if self.seq(s).load(Ordering::Relaxed).is_multiple_of(2) {
            // Published already (a caller bug): withdraw first so no reader mixes the two.
            self.unpublish_locked(&mut ch, s);
        }
        let seq = self.seq(s);
        let cur = seq.load(Ordering::Relaxed);
        let k = key.to_u128();
        let r = self.record(s);
        self.word64(r + 8).store(k as u64, Ordering::Relaxed);
        self.word64(r + 16)
            .store((k >> 64) as u64, Ordering::Relaxed);
        // Release: a reader that sees the even value sees the key above and the block's
        // bytes (written before this call, ordered by the store's locks before it).
        seq.store(cur + 1, Ordering::Release);
        let link = &mut ch.links[s as usize];
        link.parent_fp = match parent {
            Parent::Root => FP_ROOT,
            Parent::Key(p) => parent_fp(p),
            Parent::Unknown => FP_UNKNOWN,
        };
        if let Parent::Key(p) = parent
            && let Some(ps) = self.find(p)
        {
            self.link(&mut ch, s, ps.0);
        }
        let mark = self.mark_of(&ch, s, key, self.epoch());
        self.word64(r + CHAIN_OFFSET).store(mark, Ordering::Release);
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
        let mut ch = self.lock();
        self.unpublish_locked(&mut ch, slot.0);
    }

    fn unpublish_locked(&self, ch: &mut Chains, s: u32) {
        let seq = self.seq(s);
        let cur = seq.load(Ordering::Relaxed);
        if !cur.is_multiple_of(2) {
            return;
        }
        let link = ch.links[s as usize];
        if link.children > 0 {
            // Marks of blocks below this one would name a chain no longer in DRAM: void
            // them all, before the slot stops being readable (a reader that saw the old
            // epoch again at its end saw this block still published).
            self.next_epoch();
        }
        seq.store(cur + 1, Ordering::Relaxed);
        // Release fence: the odd value is ordered before every later write of this thread
        // (and, through the store's locks, of whichever thread next writes the slot's
        // bytes), so a reader whose copy saw any of those writes sees `seq` changed after its
        // acquire fence.
        fence(Ordering::Release);
        let r = self.record(s);
        self.word64(r + CHAIN_OFFSET).store(0, Ordering::Relaxed);
        if let Some(p) = self.linked_parent(ch, s) {
            ch.links[p as usize].children -= 1;
        }
        ch.links[s as usize] = Link {
            generation: link.generation.wrapping_add(1),
            ..Link::default()
        };
        let k = u128::from(self.word64(r + 8).load(Ordering::Relaxed))
            | (u128::from(self.word64(r + 16).load(Ordering::Relaxed)) << 64);
        let key = BlockKey::from_u128(k);
        let mine = entry_of(s, key, self.tagged);
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

    /// Marks again what a lookup found: `slots[i]` is where the store found `keys[i]`, a
    /// leading run of a lookup's keys in DRAM. After the epoch moved on, the marks of that
    /// run come back here (a block's mark needs its parent's): from the last slot whose mark
    /// is current (a binary search, as a client's) on, in order, up to the first that
    /// cannot be marked. A block whose parent link broke (the parent taken out and stored
    /// again elsewhere) links again to the run's block before it when that one is the
    /// parent its put named. Costs O(log n) where the run is marked already.
    pub fn renew(&self, slots: &[u32], keys: &[BlockKey]) {
        let n = slots.len().min(keys.len());
        let Some(&last) = slots[..n].last() else {
            return;
        };
        if self.flags() & flags::LOOKUPS == 0 || self.current(last, self.epoch()) {
            return;
        }
        let mut ch = self.lock();
        let epoch = self.epoch();
        let marked =
            |i: usize| self.holds(SlotId(slots[i]), keys[i]) && self.current(slots[i], epoch);
        // The first of the run not marked, if marks run from its start.
        let lo = marked_prefix(n, marked);
        for i in lo..n {
            let (s, key) = (slots[i], keys[i]);
            if !self.holds(SlotId(s), key) {
                return;
            }
            if self.linked_parent(&ch, s).is_none()
                && i > 0
                && ch.links[s as usize].parent_fp == parent_fp(keys[i - 1])
                && self.holds(SlotId(slots[i - 1]), keys[i - 1])
            {
                self.link(&mut ch, s, slots[i - 1]);
            }
            let mark = self.mark_of(&ch, s, key, epoch);
            if mark == 0 {
                return;
            }
            self.word64(self.record(s) + CHAIN_OFFSET)
                .store(mark, Ordering::Release);
        }
    }

    /// The header's epoch (`EPOCH_OFFSET`).
    pub fn epoch(&self) -> u32 {
        self.word64(EPOCH_OFFSET).load(Ordering::SeqCst) as u32
    }

    /// Whether slot `slot`'s mark carries `epoch`.
    fn current(&self, slot: u32, epoch: u32) -> bool {
        let m = self
            .word64(self.record(slot) + CHAIN_OFFSET)
            .load(Ordering::Acquire);
        m != 0 && (m >> 32) as u32 == epoch
    }

    /// Moves the epoch on (under the lock). Past `u32::MAX` it starts again at 1, after
    /// clearing every mark, so that no mark of an earlier round can count again.
    fn next_epoch(&self) {
        let e = self.epoch();
        let next = if e == u32::MAX {
            for s in 0..self.slots {
                self.word64(self.record(s) + CHAIN_OFFSET)
                    .store(0, Ordering::Relaxed);
            }
            1
        } else {
            e + 1
        };
        self.word64(EPOCH_OFFSET)
            .store(u64::from(next), Ordering::SeqCst);
    }

    /// Links slot `s` to its parent's slot `p` (under the lock).
    fn link(&self, ch: &mut Chains, s: u32, p: u32) {
        let generation = ch.links[p as usize].generation;
        ch.links[p as usize].children += 1;
        let l = &mut ch.links[s as usize];
        l.parent = p + 1;
        l.parent_gen = generation;
    }

    /// Slot `s`'s parent slot while its link holds.
    fn linked_parent(&self, ch: &Chains, s: u32) -> Option<u32> {
        let l = ch.links[s as usize];
        let p = l.parent.checked_sub(1)?;
        (ch.links[p as usize].generation == l.parent_gen).then_some(p)
    }

    /// The mark slot `s` (holding `key`) may carry at `epoch`: its chain's, where it has no
    /// parent or its linked parent's mark is current; 0 otherwise.
    fn mark_of(&self, ch: &Chains, s: u32, key: BlockKey, epoch: u32) -> u64 {
        let prev = if ch.links[s as usize].parent_fp == FP_ROOT {
            CHAIN_SEED
        } else {
            match self.linked_parent(ch, s) {
                Some(p) if self.current(p, epoch) => {
                    self.word64(self.record(p) + CHAIN_OFFSET)
                        .load(Ordering::Relaxed) as u32
                }
                _ => return 0,
            }
        };
        chain_mark(epoch, chain_fold(prev, key))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Chains> {
        self.chains.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the mark of `key`'s slot carries the current epoch (tests and checks).
    pub fn vouched(&self, key: BlockKey) -> bool {
        self.find(key)
            .is_some_and(|s| self.current(s.0, self.epoch()))
    }

    /// Checks the chain bookkeeping (tests and checks; O(slots), under the lock): every
    /// current mark is on a published slot and is its chain's, through links that hold to
    /// published slots with current marks, up to a block stored with no parent; a slot that
    /// is not published has no mark; each slot's count of children is the number of links
    /// that hold to it.
    pub fn check_chains(&self) -> Result<(), String> {
        let ch = self.lock();
        let epoch = self.epoch();
        let mut children = vec![0u32; self.slots as usize];
        for s in 0..self.slots {
            let published = self.seq(s).load(Ordering::Acquire).is_multiple_of(2);
            let m = self
                .word64(self.record(s) + CHAIN_OFFSET)
                .load(Ordering::Acquire);
            if !published {
                if m != 0 {
                    return Err(format!("slot {s}: a mark on a slot not published"));
                }
                continue;
            }
            if let Some(p) = self.linked_parent(&ch, s) {
                children[p as usize] += 1;
                if !self.seq(p).load(Ordering::Acquire).is_multiple_of(2) {
                    return Err(format!("slot {s}: linked to slot {p}, not published"));
                }
            }
            if !self.current(s, epoch) {
                continue;
            }
            let r = self.record(s);
            let key = BlockKey::from_u128(
                u128::from(self.word64(r + 8).load(Ordering::Relaxed))
                    | (u128::from(self.word64(r + 16).load(Ordering::Relaxed)) << 64),
            );
            if self.mark_of(&ch, s, key, epoch) != m {
                return Err(format!(
                    "slot {s}: mark {m:#x} is not its chain's under epoch {epoch}"
                ));
            }
        }
        for (s, (l, n)) in ch.links.iter().zip(children).enumerate() {
            if l.children != n {
                return Err(format!(
                    "slot {s}: {} children counted, {n} links hold to it",
                    l.children
                ));
            }
        }
        Ok(())
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
        p.publish(SlotId(3), k, Parent::Root);
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
            p.publish(SlotId(i as u32), *k, Parent::Root);
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
            p.publish(SlotId(i as u32), *k, Parent::Root);
        }
        assert!(first.iter().all(|k| p.find(*k).is_some()));
        for i in 0..first.len() {
            p.unpublish(SlotId(i as u32));
        }
        assert!(first.iter().all(|k| p.find(*k).is_none()));
        let base = flags::TWO_CHOICE | flags::TAGGED | flags::KEYS_AES | flags::CHAINED;
        assert_eq!(p.flags(), base);
        p.allow_lookups(true);
        assert_eq!(p.flags(), base | flags::LOOKUPS | flags::EXACT);
    }

    /// The chain marks under any sequence of publications (parent named, none, or not
    /// known), withdrawals and renewals, over a forest of keys: a mark that carries the
    /// current epoch always names its block's whole chain, every block of it published,
    /// with the fingerprint of exactly that chain. And marks come back: a chain published
    /// root first is marked to its end, and after the epoch moved on a lookup's renewal marks
    /// the run again.
    mod chains {
        use super::*;
        use proptest::prelude::*;

        /// Key `i`'s parent in the forest: keys `i % 7 == 0` are roots.
        fn parent_of(i: u32) -> Option<u32> {
            (!i.is_multiple_of(7)).then(|| i - 1 - (i * 31 % 3).min((i - 1) % 7))
        }

        fn key(i: u32) -> BlockKey {
            BlockKey::from_u128(u128::from(i) * 0x9e37_79b9 + 5)
        }

        /// Key `i`'s chain, root first.
        fn chain(i: u32) -> Vec<u32> {
            let mut c = vec![i];
            while let Some(p) = parent_of(*c.last().unwrap()) {
                c.push(p);
            }
            c.reverse();
            c
        }

        fn mark(p: &Published, slot: u32) -> u64 {
            p.word64(p.record(slot) + CHAIN_OFFSET)
                .load(Ordering::Relaxed)
        }

        /// Every current mark tells the truth.
        fn check(p: &Published, at: &[Option<u32>]) {
            let e = p.epoch();
            for (slot, k) in at.iter().enumerate() {
                let m = mark(p, slot as u32);
                let Some(k) = *k else {
                    assert_eq!(m, 0, "a free slot has no mark");
                    continue;
                };
                if m == 0 || (m >> 32) as u32 != e {
                    continue;
                }
                let mut fp = CHAIN_SEED;
                for c in chain(k) {
                    assert!(
                        p.find(key(c)).is_some(),
                        "key {k} marked, {c} of its chain gone"
                    );
                    fp = chain_fold(fp, key(c));
                }
                assert_eq!(m, chain_mark(e, fp), "key {k}");
            }
        }

        const SLOTS: u32 = 48;
        const KEYS: u32 = 40;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]
            #[test]
            fn current_marks_tell_the_truth(ops in proptest::collection::vec((0u8..10, 0u32..KEYS), 1..200)) {
                let p = Published::create(SLOTS, 64, 64).unwrap();
                p.allow_lookups(true);
                // Slot -> key, and key -> slot.
                let mut at: Vec<Option<u32>> = vec![None; SLOTS as usize];
                let slot_of = |at: &[Option<u32>], k: u32| at.iter().position(|x| *x == Some(k)).map(|s| s as u32);
                for (op, k) in ops {
                    match op {
                        // Publish key k (its parent named; sometimes not known).
                        0..=5 => {
                            if slot_of(&at, k).is_some() { continue; }
                            let Some(free) = at.iter().position(Option::is_none) else { continue };
                            let parent = match (op, parent_of(k)) {
                                (5, _) => Parent::Unknown,
                                (_, Some(q)) => Parent::Key(key(q)),
                                (_, None) => Parent::Root,
                            };
                            p.publish(SlotId(free as u32), key(k), parent);
                            at[free] = Some(k);
                        }
                        // Take key k out.
                        6 | 7 => {
                            if let Some(s) = slot_of(&at, k) {
                                p.unpublish(SlotId(s));
                                at[s as usize] = None;
                            }
                        }
                        // A lookup of k's chain renews the run the store finds.
                        _ => {
                            let c = chain(k);
                            let run: Vec<u32> = c.iter().map_while(|x| slot_of(&at, *x)).collect();
                            let keys: Vec<BlockKey> = c.iter().map(|x| key(*x)).collect();
                            p.renew(&run, &keys);
                            if run.len() == c.len() && op == 9 {
                                // After a renewal a whole chain in DRAM whose blocks all
                                // know their parent is marked to its end.
                                let last = *run.last().unwrap();
                                let known = c.iter().all(|x| {
                                    let s = slot_of(&at, *x).unwrap();
                                    p.lock().links[s as usize].parent_fp != FP_UNKNOWN
                                });
                                if known {
                                    prop_assert!(p.current(last, p.epoch()), "chain of {k} not marked");
                                }
                            }
                        }
                    }
                    check(&p, &at);
                }
            }
        }

        #[test]
        fn marks_come_back_after_the_epoch_moves_on() {
            let p = Published::create(16, 64, 64).unwrap();
            p.allow_lookups(true);
            let keys: Vec<BlockKey> = (0..6).map(|i| key(i + 100)).collect();
            for (i, k) in keys.iter().enumerate() {
                let parent = if i == 0 {
                    Parent::Root
                } else {
                    Parent::Key(keys[i - 1])
                };
                p.publish(SlotId(i as u32), *k, parent);
            }
            let e = p.epoch();
            assert!(
                (0..6).all(|s| p.current(s, e)),
                "published root first: all marked"
            );
            // A leaf goes: nothing else changes.
            p.unpublish(SlotId(5));
            assert_eq!(p.epoch(), e);
            // A block with a child goes: every mark is void.
            p.unpublish(SlotId(2));
            let e2 = p.epoch();
            assert_eq!(e2, e + 1);
            assert!((0..5).all(|s| !p.current(s, e2)));
            // Stored again elsewhere: the lookup's renewal links its child to it again.
            p.publish(SlotId(9), keys[2], Parent::Key(keys[1]));
            let run = [0, 1, 9, 3, 4];
            p.renew(&run, &keys[..5]);
            assert!(run.iter().all(|s| p.current(*s, e2)));
            assert_eq!(p.lock().links[9].children, 1);
            // A list that is not the chain marks nothing wrong.
            p.unpublish(SlotId(0));
            let e3 = p.epoch();
            p.renew(&[4, 3], &[keys[4], keys[3]]);
            assert!(!p.current(4, e3) && !p.current(3, e3));
        }
    }
}

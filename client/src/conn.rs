//! One connection to a server: the hello, a writer shared by callers (each frame is written
//! whole under its lock, payloads straight from the caller's buffers), and a reader task that
//! routes responses to their callers by request id and events to their subscriptions.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvtier_core::protocol::{
    Events, FrameError, HEADER_BYTES, Header, Hello, HelloReply, Limits, MIN_VERSION, Request,
    Response, VERSION, flags,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedMutexGuard, mpsc, oneshot};

use crate::error::ClientError;
use crate::{ClientConfig, Endpoint};

type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// The read half plus bytes a caller left unread (a payload it gave up on).
pub(crate) struct ReadSide {
    rd: BoxRead,
    skip: u64,
}

/// A response's payload, still in the socket: read it with [`Payload::read_exact`]. Dropping
/// it early is safe (the reader skips what is left).
pub(crate) struct Payload {
    guard: OwnedMutexGuard<ReadSide>,
    remaining: u64,
}

impl Payload {
    pub(crate) fn remaining(&self) -> u64 {
        self.remaining
    }

    pub(crate) async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ClientError> {
        if buf.len() as u64 > self.remaining {
            return Err(ClientError::Protocol(
                "payload shorter than announced".into(),
            ));
        }
        self.guard
            .rd
            .read_exact(buf)
            .await
            .map_err(ClientError::Io)?;
        self.remaining -= buf.len() as u64;
        Ok(())
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        self.guard.skip += self.remaining;
    }
}

pub(crate) struct Reply {
    pub response: Response,
    pub payload: Option<Payload>,
}

/// The DRAM arena mapped from the server (local connections), read-only: the server passes
/// a read-only descriptor of a memfd sealed against writes and resizing.
pub(crate) struct Arena {
    map: memmap2::MmapRaw,
}

impl Arena {
    /// Copies `dst.len()` bytes at `offset` out of the arena.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ClientError> {
        let (o, n) = check_range(&self.map, "arena", offset, dst.len())?;
        // SAFETY: [o, o + n) is inside the mapping (checked). The server keeps the slot pinned
        // for our lease, so nobody writes it while we copy; a raw copy forms no reference into
        // the shared memory.
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(o), dst.as_mut_ptr(), n) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the arena with no pin: the server may be
    /// rewriting them, so what lands in `dst` is only trusted after a seqlock check
    /// ([`SlotView::read`]).
    pub(crate) fn read_racy(&self, offset: u64, dst: &mut [u8]) -> Result<(), ClientError> {
        let (o, n) = check_range(&self.map, "arena", offset, dst.len())?;
        // SAFETY: [o, o + n) is inside the mapping (checked), which stays mapped while `self`
        // lives and is never resized (sealed). Another process (the server) may write those
        // bytes during the copy: a raw copy forms no reference into the shared memory, every
        // bit pattern is a valid `u8`, and the caller discards the result unless the slot's
        // sequence number shows no write overlapped it.
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(o), dst.as_mut_ptr(), n) };
        Ok(())
    }

    /// The bytes at `offset` in place.
    ///
    /// # Safety
    /// The caller holds a pin on that range for as long as the slice lives.
    pub(crate) unsafe fn slice(&self, offset: u64, len: usize) -> Result<&[u8], ClientError> {
        let (o, n) = check_range(&self.map, "arena", offset, len)?;
        // SAFETY: in bounds (checked); the caller's pin keeps writers away.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(o), n) })
    }
}

/// The server's published slot table (local connections), mapped read-only: a DRAM hit is
/// read from the arena with no message (see `kvtier_core::slot_table` and
/// `docs/protocol.md`, "Local gets without a message").
pub(crate) struct SlotView {
    map: memmap2::MmapRaw,
    slots: u32,
    buckets: u32,
    slot_bytes: u64,
    /// With tenants, the table holds internal keys: this connection's namespace's mapping
    /// (from the hello reply). Only the table probe uses it; requests carry the caller's keys.
    keys: Option<kvtier_core::KeyMap>,
    /// The header's `flags` has `slot_table::flags::LOOKUPS`: a lookup of blocks the table
    /// names may be answered here (see `Client::lookup`).
    pub(crate) lookups: bool,
    /// The header's `flags` has `slot_table::flags::TWO_CHOICE`: a key may be indexed in
    /// its second bucket.
    two_choice: bool,
    /// The header's `flags` has `slot_table::flags::EXACT`: a key the table does not name
    /// is not cached, while no put is in flight ([`SlotView::pending`]).
    pub(crate) exact: bool,
    /// The header's `flags` has `slot_table::flags::TAGGED`: an index entry carries its
    /// key's tag, and only entries with the probed key's tag are looked at.
    tagged: bool,
    /// The header's `flags` has `slot_table::flags::CHAINED`: records carry chain marks,
    /// and [`SlotView::held_prefix`] binary-searches a list's keys on them first.
    chained: bool,
    /// The chain fingerprints of the last list searched, kept for the next (a buffer a call
    /// costs page faults).
    fingerprints: std::sync::Mutex<Vec<u32>>,
}

/// Keys [`SlotView::held_prefix`] probes at once.
const PROBE_GROUP: usize = 16;

/// Tries per slot when the slot changes under a copy, before the caller falls back to a pin.
const FAST_TRIES: usize = 2;

impl SlotView {
    fn word64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: every caller passes an 8-aligned offset inside the mapping (the layout was
        // checked against the mapping's length in `map_slot_table`; the mapping is page
        // aligned). The memory lives as long as `self.map`; this process only reads it, and
        // only through atomics, while the server writes it through atomics.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: as in `word64`, 4-aligned.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU32) }
    }

    /// Copies block `key` out of `arena` into `dst` if the table says DRAM holds it, and
    /// returns whether it did. `false` means "ask the server": not indexed, not in DRAM, or
    /// the slot kept changing under the copy. A `true` copy is exactly the bytes the server
    /// committed under `key` (the slot's `seq` was even and unchanged around the copy).
    pub(crate) fn read(&self, arena: &Arena, key: kvtier_core::BlockKey, dst: &mut [u8]) -> bool {
        if dst.len() as u64 > self.slot_bytes {
            return false;
        }
        self.find(key, |slot| {
            arena
                .read_racy(u64::from(slot) * self.slot_bytes, dst)
                .is_ok()
        })
    }

    /// The header's `pending`: distinct keys puts in flight are storing now.
    pub(crate) fn pending(&self) -> u64 {
        self.word64(kvtier_core::slot_table::PENDING_OFFSET)
            .load(Ordering::SeqCst)
    }

    /// How many leading keys of `keys` the table names as DRAM blocks now: for each in
    /// turn, up to the first it does not name, a slot's record held the key, committed,
    /// with its `seq` unchanged around the reading of the key (a key not named means "ask
    /// the server": not indexed, not in DRAM, or changing).
    ///
    /// In a table with chain marks ([`Self::chained_prefix`]) the leading keys the marks
    /// vouch for are found by a binary search, and only the keys after them are probed one
    /// by one (in the common case, the one key after a cached prefix).
    pub(crate) fn held_prefix(&self, keys: &[kvtier_core::BlockKey]) -> usize {
        // With tenants the table holds internal keys: map each key once.
        let mapped: Vec<kvtier_core::BlockKey>;
        let keys = match &self.keys {
            Some(m) => {
                mapped = m.internal_many(keys);
                &mapped[..]
            }
            None => keys,
        };
        let known = self.chained_prefix(keys);
        known + self.probed_prefix(&keys[known..])
    }

    /// How many leading keys of `keys` (as the table holds them) chain marks show to be in
    /// DRAM: with the epoch `e` read first, a binary search for the last key whose record
    /// holds it with the mark `chain_mark(e, chain_fold of keys[..=i])`, then the epoch read
    /// again (moved on: 0). Such a mark says the block's chain is exactly these keys and all
    /// of it was in DRAM under epoch `e`; the server moves the epoch on before it takes out a
    /// block that a mark's chain goes through, so if the epoch is still `e` here, every key up
    /// to it was in DRAM at that moment. The keys of a prompt are a chain; for a list that is
    /// not one, no mark matches and the answer is 0 (probe them all). The fingerprints are
    /// folded over the whole list first (one multiply a key).
    fn chained_prefix(&self, keys: &[kvtier_core::BlockKey]) -> usize {
        use kvtier_core::slot_table::{
            CHAIN_OFFSET, CHAIN_SEED, EPOCH_OFFSET, chain_fold, chain_mark,
        };
        if !self.chained || keys.is_empty() {
            return 0;
        }
        let epoch = self.word64(EPOCH_OFFSET).load(Ordering::SeqCst);
        let e = match u32::try_from(epoch) {
            Ok(e) if e > 0 => e,
            _ => return 0,
        };
        // Another lookup holding the buffer meanwhile leaves this one a new one.
        let mut fps = std::mem::take(&mut *lock(&self.fingerprints));
        fps.clear();
        let mut prev = CHAIN_SEED;
        fps.extend(keys.iter().map(|k| {
            prev = chain_fold(prev, *k);
            prev
        }));
        let marked = |i: usize| {
            let want = chain_mark(e, fps[i]);
            self.find_internal(keys[i], |slot| {
                let rec = Self::record_offset(slot);
                self.word64(rec + CHAIN_OFFSET).load(Ordering::Relaxed) == want
            })
        };
        // Most often the whole list is cached: one probe.
        let known = kvtier_core::slot_table::marked_prefix(keys.len(), marked);
        *lock(&self.fingerprints) = fps;
        // Orders the marks' loads before the epoch's second read.
        std::sync::atomic::fence(Ordering::Acquire);
        if self.word64(EPOCH_OFFSET).load(Ordering::SeqCst) != epoch {
            return 0;
        }
        known
    }

    /// How many leading keys of `keys` (as the table holds them) probing each one finds.
    ///
    /// The keys go [`PROBE_GROUP`] at a time, so that their cache misses overlap instead of
    /// following one another: the next group's first buckets are prefetched; in a tagged
    /// table each key's first bucket is searched for its tag and the record found there
    /// prefetched; then each key is checked in order, through that record, or, where it
    /// was not the key's, by the probe of both buckets a single key gets. What is decided
    /// is what probing each key alone decides (a prefetch is a hint no load depends on).
    fn probed_prefix(&self, keys: &[kvtier_core::BlockKey]) -> usize {
        for k in keys.iter().take(PROBE_GROUP) {
            self.prefetch_bucket(*k);
        }
        let mut found = [None; PROBE_GROUP];
        for (g, group) in keys.chunks(PROBE_GROUP).enumerate() {
            let start = g * PROBE_GROUP;
            for k in keys.iter().skip(start + PROBE_GROUP).take(PROBE_GROUP) {
                self.prefetch_bucket(*k);
            }
            for (f, k) in found.iter_mut().zip(group) {
                *f = self.tagged_candidate(*k);
            }
            for (i, k) in group.iter().enumerate() {
                let through_tag = found[i].is_some_and(|slot| {
                    self.check_slot(slot, k.to_u128(), &mut |_| true) == Some(true)
                });
                if !through_tag && !self.find_internal(*k, |_| true) {
                    return start + i;
                }
            }
        }
        keys.len()
    }

    /// In a tagged table, the slot of the first entry of internal key `key`'s first bucket
    /// that has its tag (likely its slot), with the load of its record started; `None`
    /// without tags or without such an entry.
    fn tagged_candidate(&self, key: kvtier_core::BlockKey) -> Option<u32> {
        use kvtier_core::slot_table::{WAYS, bucket_of, tag_of};
        if !self.tagged {
            return None;
        }
        let h = bucket_of(key);
        let (base, tag) = (self.bucket_offset(self.bucket_index(h)), Some(tag_of(h)));
        let slot = (0..WAYS).find_map(|w| {
            let e = self.word32(base + 4 * w).load(Ordering::Relaxed);
            self.entry_slot(e, tag)
        })?;
        self.prefetch(Self::record_offset(slot));
        Some(slot)
    }

    /// The slot index entry `e` names, if it may be the key's: not empty, inside the table,
    /// and, in a tagged table (`tag`: the key's), with the key's tag.
    fn entry_slot(&self, e: u32, tag: Option<u32>) -> Option<u32> {
        use kvtier_core::slot_table::{TAG_SHIFT, slot_of_entry};
        if tag.is_some_and(|t| e >> TAG_SHIFT != t) {
            return None;
        }
        slot_of_entry(e, tag.is_some()).filter(|s| *s < self.slots)
    }

    /// The bucket selector `h` picks (`h`: [`kvtier_core::slot_table::bucket_of`] or
    /// `second_bucket_of` of a key, before the mask).
    fn bucket_index(&self, h: u64) -> usize {
        (h & u64::from(self.buckets - 1)) as usize
    }

    /// The byte offset of slot `slot`'s record.
    fn record_offset(slot: u32) -> usize {
        use kvtier_core::slot_table::{HEADER_BYTES, RECORD_BYTES};
        HEADER_BYTES + RECORD_BYTES * slot as usize
    }

    /// The byte offset of bucket `bucket`'s first entry.
    fn bucket_offset(&self, bucket: usize) -> usize {
        use kvtier_core::slot_table::{HEADER_BYTES, RECORD_BYTES, WAYS};
        HEADER_BYTES + RECORD_BYTES * self.slots as usize + 4 * WAYS * bucket
    }

    /// Starts loading the cache line of internal key `key`'s first bucket.
    fn prefetch_bucket(&self, key: kvtier_core::BlockKey) {
        let b = self.bucket_index(kvtier_core::slot_table::bucket_of(key));
        self.prefetch(self.bucket_offset(b));
    }

    /// A prefetch hint for the table's byte `off` (x86-64; elsewhere nothing). It reads
    /// nothing the program sees and cannot fault.
    #[inline]
    fn prefetch(&self, off: usize) {
        debug_assert!(off < self.map.len());
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let p = self.map.as_ptr().wrapping_add(off).cast::<i8>();
            // SAFETY: `_mm_prefetch` is a hint: it never faults, whatever the address, and
            // changes no memory nor any value a load returns; SSE is in every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = off;
    }

    /// The seqlock read shared by [`Self::read`] and [`Self::held_prefix`]: finds the slot whose
    /// record names `key` with an even `seq`, runs `body` on it (`false`: give up), and
    /// returns true if `seq` was unchanged after it.
    fn find(&self, key: kvtier_core::BlockKey, body: impl FnMut(u32) -> bool) -> bool {
        let key = self.keys.as_ref().map_or(key, |m| m.internal(key));
        self.find_internal(key, body)
    }

    /// [`Self::find`] of a key as the table holds it (mapped, with tenants).
    fn find_internal(&self, key: kvtier_core::BlockKey, mut body: impl FnMut(u32) -> bool) -> bool {
        use kvtier_core::slot_table::{bucket_of, second_bucket_of, tag_of};
        let k = key.to_u128();
        let h = bucket_of(key);
        let tag = self.tagged.then(|| tag_of(h));
        let first = self.bucket_index(h);
        if let Some(found) = self.probe_bucket(first, k, tag, &mut body) {
            return found;
        }
        // The second bucket (hashed only when the first did not hold the key).
        if self.two_choice {
            let second = self.bucket_index(second_bucket_of(key));
            if second != first {
                return self
                    .probe_bucket(second, k, tag, &mut body)
                    .unwrap_or(false);
            }
        }
        false
    }

    /// [`Self::find`] in one bucket: `Some(true)` the key's slot, `body` run and `seq`
    /// unchanged; `Some(false)` `body` gave up; `None` not found here. `tag`: the key's
    /// tag, in a tagged table (entries with another tag are not the key's).
    fn probe_bucket(
        &self,
        bucket: usize,
        k: u128,
        tag: Option<u32>,
        body: &mut impl FnMut(u32) -> bool,
    ) -> Option<bool> {
        use kvtier_core::slot_table::WAYS;
        let base = self.bucket_offset(bucket);
        for w in 0..WAYS {
            let e = self.word32(base + 4 * w).load(Ordering::Acquire);
            let Some(slot) = self.entry_slot(e, tag) else {
                continue;
            };
            if let Some(r) = self.check_slot(slot, k, body) {
                return Some(r);
            }
        }
        None
    }

    /// The seqlock check of one slot for key `k` (as the table holds it): `Some(true)` its
    /// record names `k` with an even `seq`, `body` ran and `seq` was unchanged after it;
    /// `Some(false)` `body` gave up; `None` the slot is not `k`'s now (or kept changing).
    fn check_slot(&self, slot: u32, k: u128, body: &mut impl FnMut(u32) -> bool) -> Option<bool> {
        let rec = Self::record_offset(slot);
        for _ in 0..FAST_TRIES {
            let s1 = self.word64(rec).load(Ordering::Acquire);
            if s1 & 1 == 1 {
                break;
            }
            let lo = self.word64(rec + 8).load(Ordering::Relaxed);
            let hi = self.word64(rec + 16).load(Ordering::Relaxed);
            if u128::from(lo) | (u128::from(hi) << 64) != k {
                break;
            }
            if !body(slot) {
                return Some(false);
            }
            // Orders the body's loads (the key's above, a copy's) before the re-read: if
            // they saw any byte the server wrote after withdrawing the slot (its odd
            // store, then a release fence), this load sees that odd store or a later value.
            std::sync::atomic::fence(Ordering::Acquire);
            if self.word64(rec).load(Ordering::Relaxed) == s1 {
                return Some(true);
            }
        }
        None
    }
}

/// This connection's staging region, mapped read-write: the only memory of the server's
/// this client writes. A local put copies its blocks into the places a `reserve` names, and
/// the server copies them into the arena at `commit`.
pub(crate) struct Staging {
    map: memmap2::MmapRaw,
}

impl Staging {
    /// Copies `src` into the staging region at `offset`.
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> Result<(), ClientError> {
        let (o, n) = check_range(&self.map, "staging", offset, src.len())?;
        // SAFETY: [o, o + n) is inside the mapping (checked). The server lent that place to
        // one reservation of ours, and local puts on a connection are serialized, so nothing
        // else of ours writes it; the server only reads it at commit (after this copy).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(o), n) };
        Ok(())
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

fn check_range(
    map: &memmap2::MmapRaw,
    what: &str,
    offset: u64,
    len: usize,
) -> Result<(usize, usize), ClientError> {
    let end = offset.checked_add(len as u64);
    match end {
        Some(e) if e <= map.len() as u64 => Ok((offset as usize, len)),
        _ => Err(ClientError::Protocol(format!(
            "server named {what} range {offset}+{len} outside its {} bytes",
            map.len()
        ))),
    }
}

pub(crate) struct Conn {
    writer: tokio::sync::Mutex<BoxWrite>,
    /// The frame buffer of one-way key-list requests (local lookups), kept between calls:
    /// a prompt's keys are 64 KiB, and a fresh buffer each call costs page faults.
    key_frame: Mutex<Vec<u8>>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    subs: Mutex<HashMap<u64, mpsc::Sender<Events>>>,
    next_id: AtomicU64,
    dead: AtomicBool,
    pub hello: HelloReply,
    pub arena: Option<Arena>,
    pub staging: Option<Staging>,
    /// The published slot table: DRAM hits read with no message (None without the arena, or
    /// when [`ClientConfig::fast_local_gets`] is off).
    pub slot_table: Option<SlotView>,
    /// Local puts one at a time: they share the one staging region.
    pub put_lock: tokio::sync::Mutex<()>,
    limits: Limits,
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn frame(req: &Request, id: u64, payload_len: u64, fl: u8) -> Vec<u8> {
    let meta = req.encode_meta();
    let mut h = Header::request(req.opcode(), id, meta.len(), payload_len);
    h.flags = fl;
    let mut v = Vec::with_capacity(HEADER_BYTES + meta.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(&meta);
    v
}

impl Conn {
    /// Connects, says hello, and starts the reader.
    pub(crate) async fn open(ep: &Endpoint, cfg: &ClientConfig) -> Result<Arc<Conn>, ClientError> {
        let hello = Request::Hello(Hello {
            min_version: MIN_VERSION,
            max_version: VERSION,
            client: cfg.name.clone(),
            token: cfg.token.clone().unwrap_or_default(),
            block_bytes: cfg.block_bytes,
            want_arena: cfg.zero_copy,
        });
        let hello_frame = frame(&hello, 0, 0, 0);
        let (rd, wr, reply, fds): (BoxRead, BoxWrite, Vec<u8>, Vec<OwnedFd>) = match ep {
            Endpoint::Unix(path) => {
                let mut s = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| ClientError::Connect(format!("{}: {e}", path.display())))?;
                s.write_all(&hello_frame).await.map_err(ClientError::Io)?;
                let (head, fds) = recv_head_with_fds(&s).await?;
                let mut reply = head.to_vec();
                read_rest(&mut s, &mut reply).await?;
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w), reply, fds)
            }
            Endpoint::Tcp(addr) => {
                let mut s = tokio::net::TcpStream::connect(addr.as_str())
                    .await
                    .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))?;
                let _ = s.set_nodelay(true);
                s.write_all(&hello_frame).await.map_err(ClientError::Io)?;
                let mut reply = vec![0u8; HEADER_BYTES];
                s.read_exact(&mut reply).await.map_err(ClientError::Io)?;
                read_rest(&mut s, &mut reply).await?;
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w), reply, Vec::new())
            }
            Endpoint::Tls { addr, server_name } => {
                let mut s = crate::tls::connect(addr, server_name, cfg).await?;
                s.write_all(&hello_frame).await.map_err(ClientError::Io)?;
                let mut reply = vec![0u8; HEADER_BYTES];
                s.read_exact(&mut reply).await.map_err(ClientError::Io)?;
                read_rest(&mut s, &mut reply).await?;
                let (r, w) = tokio::io::split(s);
                (Box::new(r), Box::new(w), reply, Vec::new())
            }
            Endpoint::Quic { addr, server_name } => {
                let (mut send, mut recv) = crate::quic::connect(addr, server_name, cfg).await?;
                AsyncWriteExt::write_all(&mut send, &hello_frame)
                    .await
                    .map_err(ClientError::Io)?;
                let mut reply = vec![0u8; HEADER_BYTES];
                AsyncReadExt::read_exact(&mut recv, &mut reply)
                    .await
                    .map_err(ClientError::Io)?;
                read_rest(&mut recv, &mut reply).await?;
                (Box::new(recv), Box::new(send), reply, Vec::new())
            }
        };
        let client_limits = Limits {
            max_meta_bytes: 64 << 20,
            max_keys: u32::MAX,
            max_payload_bytes: u64::MAX,
        };
        let head: [u8; HEADER_BYTES] = reply[..HEADER_BYTES]
            .try_into()
            .map_err(|_| ClientError::Protocol("short hello reply".into()))?;
        let h = Header::decode(&head, &client_limits).map_err(ClientError::Frame)?;
        let hello = match Response::decode(&h, &reply[HEADER_BYTES..], &client_limits)
            .map_err(ClientError::Frame)?
        {
            Response::Hello(hr) => hr,
            Response::Error(e) => return Err(ClientError::from_reply(e)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected a hello reply, got {other:?}"
                )));
            }
        };
        if hello.namespace_key.is_some() && hello.slot_table_bytes == 0 {
            return Err(ClientError::Protocol(
                "the hello reply carries a namespace key but no slot table".into(),
            ));
        }
        let (arena, staging, slot_table) = if hello.arena_bytes > 0 {
            let want = if hello.slot_table_bytes > 0 { 3 } else { 2 };
            if fds.len() != want {
                return Err(ClientError::Protocol(format!(
                    "the hello reply names an arena but carried {} descriptors, not {want}",
                    fds.len()
                )));
            }
            let mut fds = fds.into_iter();
            let (arena, staging) = (fds.next().expect("counted"), fds.next().expect("counted"));
            let table = match fds.next() {
                Some(t) if cfg.fast_local_gets => map_slot_table(
                    t,
                    hello.slot_table_bytes,
                    hello.arena_bytes,
                    hello.namespace_key.map(kvtier_core::KeyMap::from_bytes),
                )?,
                _ => None,
            };
            (
                Some(map_arena(arena, hello.arena_bytes)?),
                Some(map_staging(staging, hello.staging_bytes)?),
                table,
            )
        } else {
            (None, None, None)
        };
        let limits = Limits {
            max_meta_bytes: hello.max_meta_bytes.max(1 << 20).saturating_mul(4),
            max_keys: hello.max_keys,
            max_payload_bytes: hello.max_payload_bytes,
        };
        let conn = Arc::new(Conn {
            writer: tokio::sync::Mutex::new(wr),
            key_frame: Mutex::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            subs: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            dead: AtomicBool::new(false),
            hello,
            arena,
            staging,
            slot_table,
            put_lock: tokio::sync::Mutex::new(()),
            limits,
            reader: Mutex::new(None),
        });
        let side = Arc::new(tokio::sync::Mutex::new(ReadSide { rd, skip: 0 }));
        let weak = Arc::downgrade(&conn);
        let task = tokio::spawn(read_loop(weak, side));
        *lock(&conn.reader) = Some(task);
        Ok(conn)
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        lock(&self.pending).clear();
        lock(&self.subs).clear();
    }

    /// Sends one request (payload from `payload` buffers, in order) and waits for its reply.
    pub(crate) async fn call(
        &self,
        req: &Request,
        payload: &[&[u8]],
        timeout: Duration,
    ) -> Result<Reply, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let r = tokio::time::timeout(timeout, async {
            self.send(req, id, payload, 0).await?;
            rx.await.map_err(|_| ClientError::Disconnected)
        })
        .await;
        match r {
            Ok(r) => r,
            Err(_) => {
                lock(&self.pending).remove(&id);
                Err(ClientError::Timeout)
            }
        }
    }

    /// Sends a request whose answer nobody waits for (release, abort).
    pub(crate) async fn send_no_reply(
        &self,
        req: &Request,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        tokio::time::timeout(timeout, self.send(req, id, &[], flags::NO_REPLY))
            .await
            .map_err(|_| ClientError::Timeout)?
    }

    /// Sends key-list request `op` (`Lookup`: the local lookups) of borrowed `keys` one way
    /// ([`flags::NO_REPLY`]): the frame [`Self::send_no_reply`] would write for it, built in
    /// this connection's kept buffer instead of three new ones.
    pub(crate) async fn send_keys_no_reply(
        &self,
        op: kvtier_core::protocol::Opcode,
        keys: &[kvtier_core::BlockKey],
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Another call on this connection holding the buffer meanwhile gets a new one.
        let mut buf = std::mem::take(&mut *lock(&self.key_frame));
        buf.clear();
        buf.resize(HEADER_BYTES, 0);
        kvtier_core::protocol::append_key_list_meta(keys, &mut buf);
        let mut h = Header::request(op, id, buf.len() - HEADER_BYTES, 0);
        h.flags = flags::NO_REPLY;
        buf[..HEADER_BYTES].copy_from_slice(&h.encode());
        let r = tokio::time::timeout(timeout, self.send_frame(&buf, &[])).await;
        *lock(&self.key_frame) = buf;
        r.map_err(|_| ClientError::Timeout)?
    }

    /// Registers an event subscription under a new id and sends the subscribe request.
    pub(crate) async fn subscribe(
        &self,
        req: &Request,
        tx: mpsc::Sender<Events>,
        timeout: Duration,
    ) -> Result<Reply, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.subs).insert(id, tx);
        let (otx, orx) = oneshot::channel();
        lock(&self.pending).insert(id, otx);
        let r = tokio::time::timeout(timeout, async {
            self.send(req, id, &[], 0).await?;
            orx.await.map_err(|_| ClientError::Disconnected)
        })
        .await;
        match r {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                lock(&self.subs).remove(&id);
                Err(e)
            }
            Err(_) => {
                lock(&self.subs).remove(&id);
                lock(&self.pending).remove(&id);
                Err(ClientError::Timeout)
            }
        }
    }

    async fn send(
        &self,
        req: &Request,
        id: u64,
        payload: &[&[u8]],
        fl: u8,
    ) -> Result<(), ClientError> {
        let len: u64 = payload.iter().map(|p| p.len() as u64).sum();
        self.send_frame(&frame(req, id, len, fl), payload).await
    }

    /// Writes a request's header and metadata (`head`), then its payload.
    async fn send_frame(&self, head: &[u8], payload: &[&[u8]]) -> Result<(), ClientError> {
        if self.is_dead() {
            return Err(ClientError::Disconnected);
        }
        let len: u64 = payload.iter().map(|p| p.len() as u64).sum();
        // The server closes a connection that sends more than it stated at hello: refuse
        // here instead (the callers chunk by these limits, so this is a last guard).
        let meta = (head.len() - HEADER_BYTES) as u64;
        if meta > u64::from(self.hello.max_meta_bytes) || len > self.hello.max_payload_bytes {
            return Err(ClientError::Buffer(format!(
                "request of {meta} metadata and {len} payload bytes is over the server's \
                 limits ({} and {})",
                self.hello.max_meta_bytes, self.hello.max_payload_bytes
            )));
        }
        let mut w = self.writer.lock().await;
        let r = async {
            w.write_all(head).await?;
            for p in payload {
                w.write_all(p).await?;
            }
            w.flush().await
        };
        // A frame cut off midway leaves the stream unusable: this connection is done.
        let guard = DeadOnDrop(self, true);
        let out = r.await;
        std::mem::forget(guard);
        if let Err(e) = out {
            self.kill();
            return Err(ClientError::Io(e));
        }
        Ok(())
    }

    pub(crate) fn max_keys(&self) -> usize {
        self.limits.max_keys as usize
    }

    /// How many items from the front of `items` one request may carry: at most the
    /// server's `max_keys` and `cap`, with its metadata (`base` bytes for the request
    /// without items, plus `item_bytes` of each) within the server's `max_meta_bytes`.
    /// At least one (a single item over the limits is refused by `send`).
    pub(crate) fn fit<T>(
        &self,
        base: usize,
        items: &[T],
        cap: usize,
        item_bytes: impl Fn(&T) -> usize,
    ) -> usize {
        let max = items.len().min(self.max_keys()).min(cap);
        let mut room = (self.hello.max_meta_bytes as usize).saturating_sub(base);
        let mut n = 0;
        for it in &items[..max] {
            let b = item_bytes(it);
            if b > room {
                break;
            }
            room -= b;
            n += 1;
        }
        n.max(1).min(items.len())
    }

    pub(crate) fn max_payload(&self) -> u64 {
        self.limits.max_payload_bytes
    }
}

/// Marks the connection dead if a frame write is abandoned (its future dropped) midway.
struct DeadOnDrop<'a>(&'a Conn, bool);

impl Drop for DeadOnDrop<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.kill();
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(t) = lock(&self.reader).take() {
            t.abort();
        }
    }
}

async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    reply: &mut Vec<u8>,
) -> Result<(), ClientError> {
    let head: [u8; HEADER_BYTES] = reply[..HEADER_BYTES]
        .try_into()
        .map_err(|_| ClientError::Protocol("short hello reply".into()))?;
    let limits = Limits::default();
    let h = Header::decode(&head, &limits).map_err(ClientError::Frame)?;
    let need = HEADER_BYTES + h.meta_len as usize;
    let have = reply.len();
    if have < need {
        reply.resize(need, 0);
        r.read_exact(&mut reply[have..])
            .await
            .map_err(ClientError::Io)?;
    }
    reply.truncate(need);
    Ok(())
}

async fn read_loop(conn: std::sync::Weak<Conn>, side: Arc<tokio::sync::Mutex<ReadSide>>) {
    let limits = match conn.upgrade() {
        Some(c) => c.limits,
        None => return,
    };
    let mut meta = Vec::new();
    loop {
        let mut g = side.clone().lock_owned().await;
        let r: Result<(), FrameError> = async {
            if g.skip > 0 {
                let n = g.skip;
                let mut sink = tokio::io::sink();
                tokio::io::copy(&mut (&mut g.rd).take(n), &mut sink)
                    .await
                    .map_err(|_| FrameError::Truncated { need: n, have: 0 })?;
                g.skip = 0;
            }
            Ok(())
        }
        .await;
        if r.is_err() {
            break;
        }
        let mut head = [0u8; HEADER_BYTES];
        if g.rd.read_exact(&mut head).await.is_err() {
            break;
        }
        let Ok(h) = Header::decode(&head, &limits) else {
            break;
        };
        meta.clear();
        meta.resize(h.meta_len as usize, 0);
        if g.rd.read_exact(&mut meta).await.is_err() {
            break;
        }
        let Some(c) = conn.upgrade() else { break };
        let resp = match Response::decode(&h, &meta, &limits) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("undecodable response from server: {e}");
                break;
            }
        };
        if let Response::Events(ev) = resp {
            let tx = lock(&c.subs).get(&h.request_id).cloned();
            if let Some(tx) = tx
                && tx.send(ev).await.is_err()
            {
                lock(&c.subs).remove(&h.request_id);
            }
            g.skip += h.payload_len;
            continue;
        }
        let waiter = lock(&c.pending).remove(&h.request_id);
        if h.opcode == 0 && h.is(flags::ERROR) {
            // A connection-level refusal (e.g. too many connections).
            break;
        }
        let Some(waiter) = waiter else {
            g.skip += h.payload_len;
            continue;
        };
        let payload = if h.payload_len > 0 {
            Some(Payload {
                remaining: h.payload_len,
                guard: g,
            })
        } else {
            drop(g);
            None
        };
        // A waiter that gave up drops the reply; the payload guard then skips the bytes.
        let _ = waiter.send(Reply {
            response: resp,
            payload,
        });
    }
    if let Some(c) = conn.upgrade() {
        c.kill();
    }
}

/// Receives the first bytes of the hello reply and the fds riding with them (the arena's,
/// then the staging region's).
async fn recv_head_with_fds(
    s: &tokio::net::UnixStream,
) -> Result<([u8; HEADER_BYTES], Vec<OwnedFd>), ClientError> {
    let mut head = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_BYTES {
        s.readable().await.map_err(ClientError::Io)?;
        match s.try_io(tokio::io::Interest::READABLE, || {
            recv_with_fds(s.as_raw_fd(), &mut head[got..])
        }) {
            Ok((0, _)) => return Err(ClientError::Disconnected),
            Ok((n, f)) => {
                got += n;
                fds.extend(f);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(ClientError::Io(e)),
        }
    }
    Ok((head, fds))
}

/// One `recvmsg` on a Unix socket: the bytes read into `buf`, and the descriptors an
/// `SCM_RIGHTS` message carried with them (close-on-exec, owned by the caller). What the hello
/// reply arrives with on `unix://` (`docs/protocol.md`).
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = [0u8; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = control.len() as _;
    // SAFETY: iov and control point at live buffers of the stated lengths for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to msg_controllen; CMSG_FIRSTHDR/NXTHDR walk
    // only within it, and an SCM_RIGHTS payload holds `(cmsg_len - CMSG_LEN(0)) / 4` fds the
    // kernel installed for us (so we own them; each is taken into an OwnedFd once).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, fds))
}

fn map_arena(fd: OwnedFd, bytes: u64) -> Result<Arena, ClientError> {
    let f = std::fs::File::from(fd);
    let len = f.metadata().map_err(ClientError::Io)?.len();
    if len < bytes {
        return Err(ClientError::Protocol(format!(
            "arena file is {len} bytes, server announced {bytes}"
        )));
    }
    // Read-only: the fd is, and the memfd is sealed against writable mappings.
    let map = memmap2::MmapOptions::new()
        .len(bytes as usize)
        .map_raw_read_only(&f)
        .map_err(ClientError::Io)?;
    Ok(Arena { map })
}

/// Maps the published slot table and checks its header against the arena it describes;
/// `keys`: the namespace's key mapping, with tenants. `None`: a table this client cannot
/// probe (with tenants, a server that maps keys otherwise: no `KEYS_AES`), so every read
/// takes the ordinary path.
fn map_slot_table(
    fd: OwnedFd,
    bytes: u64,
    arena_bytes: u64,
    keys: Option<kvtier_core::KeyMap>,
) -> Result<Option<SlotView>, ClientError> {
    use kvtier_core::slot_table::{FLAGS_OFFSET, MAGIC, WAYS, buckets_for, flags, table_bytes};
    let f = std::fs::File::from(fd);
    let len = f.metadata().map_err(ClientError::Io)?.len();
    if bytes < 64 || len < bytes {
        return Err(ClientError::Protocol(format!(
            "slot table file is {len} bytes, server announced {bytes}"
        )));
    }
    // Read-only: the fd is, and the memfd is sealed against writable mappings.
    let map = memmap2::MmapOptions::new()
        .len(bytes as usize)
        .map_raw_read_only(&f)
        .map_err(ClientError::Io)?;
    let mut head = [0u8; 64];
    // SAFETY: the mapping is at least 64 bytes (checked); the header is written once, before
    // the server hands out the descriptor.
    unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), head.as_mut_ptr(), 64) };
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().expect("8 bytes"));
    let u32_at = |o: usize| u32::from_le_bytes(head[o..o + 4].try_into().expect("4 bytes"));
    let (slots, ways, buckets) = (u32_at(8), u32_at(12), u32_at(16));
    let slot_bytes = u64_at(32);
    let ok = u64_at(0) == MAGIC
        && ways as usize == WAYS
        && buckets == buckets_for(slots)
        && table_bytes(slots) as u64 <= bytes
        && slot_bytes > 0
        && u64::from(slots) * slot_bytes <= arena_bytes;
    if !ok {
        return Err(ClientError::Protocol(
            "the slot table's header does not describe the arena".into(),
        ));
    }
    let flag = |f: u64| u64_at(FLAGS_OFFSET) & f != 0;
    if keys.is_some() && !flag(flags::KEYS_AES) {
        return Ok(None);
    }
    Ok(Some(SlotView {
        map,
        slots,
        buckets,
        slot_bytes,
        keys,
        lookups: flag(flags::LOOKUPS),
        two_choice: flag(flags::TWO_CHOICE),
        exact: flag(flags::EXACT),
        tagged: flag(flags::TAGGED),
        chained: flag(flags::CHAINED),
        fingerprints: std::sync::Mutex::new(Vec::new()),
    }))
}

fn map_staging(fd: OwnedFd, bytes: u64) -> Result<Staging, ClientError> {
    let f = std::fs::File::from(fd);
    let len = f.metadata().map_err(ClientError::Io)?.len();
    if bytes == 0 || len < bytes {
        return Err(ClientError::Protocol(format!(
            "staging file is {len} bytes, server announced {bytes}"
        )));
    }
    let map = memmap2::MmapOptions::new()
        .len(bytes as usize)
        .map_raw(&f)
        .map_err(ClientError::Io)?;
    Ok(Staging { map })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_and_staging_ranges_are_checked() {
        let f = tempfile_fd(8192);
        let same = f.try_clone().unwrap();
        let st = map_staging(f, 8192).unwrap();
        assert_eq!(st.len(), 8192);
        let a = map_arena(same, 8192).unwrap();
        st.write(4096, &[7u8; 16]).unwrap();
        let mut b = [0u8; 16];
        a.read(4096, &mut b).unwrap();
        assert_eq!(b, [7u8; 16]);
        assert!(a.read(8190, &mut b).is_err());
        assert!(st.write(u64::MAX - 2, &b).is_err());
        assert!(st.write(8190, &b).is_err());
        // SAFETY: nothing else writes this mapping during the test.
        let s = unsafe { a.slice(4096, 16) }.unwrap();
        assert_eq!(s, &[7u8; 16]);
        // Too small, or announced empty.
        assert!(map_arena(tempfile_fd(4096), 8192).is_err());
        assert!(map_staging(tempfile_fd(4096), 0).is_err());
    }

    /// The real reader against an in-process writer that keeps rewriting the one slot the
    /// reader reads, alternating two keys with different bytes, following the server's
    /// protocol (seq odd, fill, key, seq even). Blocks are 1 MiB so copies overlap rewrites
    /// often: an accepted copy must be exactly one key's block, and a header that does not
    /// describe the arena is refused.
    /// A published slot table of one slot (its header written, its one index entry naming
    /// slot 0, the slot unpublished) over an arena of one `SLOT`-byte slot: both memfds, and
    /// both mapped here as the server maps them.
    struct OneSlot<const SLOT: usize> {
        tf: OwnedFd,
        af: OwnedFd,
        tbytes: usize,
        tmap: memmap2::MmapRaw,
        amap: memmap2::MmapRaw,
    }

    impl<const SLOT: usize> OneSlot<SLOT> {
        fn new() -> Self {
            use kvtier_core::slot_table::{HEADER_BYTES, MAGIC, WAYS, buckets_for, table_bytes};
            let tbytes = table_bytes(1);
            let (tf, af) = (tempfile_fd(tbytes as u64), tempfile_fd(SLOT as u64));
            let map = |fd: &OwnedFd| {
                memmap2::MmapRaw::map_raw(&std::fs::File::from(fd.try_clone().unwrap())).unwrap()
            };
            let t = Self {
                tmap: map(&tf),
                amap: map(&af),
                tf,
                af,
                tbytes,
            };
            t.word(0).store(MAGIC, Ordering::Relaxed);
            t.word(8)
                .store(u64::from(WAYS as u32) << 32 | 1, Ordering::Relaxed);
            t.word(16)
                .store(u64::from(buckets_for(1)), Ordering::Relaxed);
            t.word(32).store(SLOT as u64, Ordering::Relaxed);
            t.word(kvtier_core::slot_table::FLAGS_OFFSET)
                .store(kvtier_core::slot_table::flags::KEYS_AES, Ordering::Relaxed);
            // Index: bucket 0 (the only one), way 0 names slot 0.
            t.word(HEADER_BYTES + 32).store(1, Ordering::Relaxed);
            t.word(HEADER_BYTES).store(1, Ordering::Relaxed);
            t
        }

        /// The table's 8-byte word at `off`.
        fn word(&self, off: usize) -> &AtomicU64 {
            assert!(off.is_multiple_of(8) && off + 8 <= self.tmap.len());
            // SAFETY: in bounds and aligned (asserted; the mapping is page aligned); the
            // mapping lives as long as `self`, which the returned reference borrows.
            unsafe { &*(self.tmap.as_mut_ptr().add(off) as *const AtomicU64) }
        }

        /// Slot 0's key words set to `k` (its seqlock word is the caller's).
        fn set_key(&self, k: kvtier_core::BlockKey) {
            use kvtier_core::slot_table::HEADER_BYTES;
            self.word(HEADER_BYTES + 8)
                .store(k.to_u128() as u64, Ordering::Relaxed);
            self.word(HEADER_BYTES + 16)
                .store((k.to_u128() >> 64) as u64, Ordering::Relaxed);
        }
    }

    #[test]
    fn slot_table_reads_are_never_torn_while_the_slot_is_rewritten() {
        use kvtier_core::BlockKey;
        use kvtier_core::slot_table::HEADER_BYTES;
        const SLOT: usize = 1 << 20;
        let t = OneSlot::<SLOT>::new();
        let (tf, af, tbytes, amap) = (&t.tf, &t.af, t.tbytes, &t.amap);
        let at = |off| t.word(off);
        let bad = map_slot_table(
            tf.try_clone().unwrap(),
            tbytes as u64,
            SLOT as u64 - 4096,
            None,
        );
        assert!(bad.is_err(), "a table describing more than the arena");
        let view = map_slot_table(tf.try_clone().unwrap(), tbytes as u64, SLOT as u64, None)
            .unwrap()
            .expect("a table without tenants is probed");
        let arena = map_arena(af.try_clone().unwrap(), SLOT as u64).unwrap();
        let keys = [BlockKey::from_u128(11), BlockKey::from_u128(22)];
        let stop = AtomicBool::new(false);
        let (mut hits, mut misses) = (0u64, 0u64);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut seq = 1u64;
                for i in 0..400usize {
                    let k = keys[i % 2];
                    // unpublish (already odd at the start)
                    if seq.is_multiple_of(2) {
                        seq += 1;
                        at(HEADER_BYTES).store(seq, Ordering::Relaxed);
                        std::sync::atomic::fence(Ordering::Release);
                    }
                    // SAFETY: the arena mapping is SLOT bytes and outlives this thread; the
                    // reader only copies from it (racy by design, checked by seq).
                    unsafe { std::ptr::write_bytes(amap.as_mut_ptr(), (i % 2) as u8 + 1, SLOT) };
                    t.set_key(k);
                    seq += 1;
                    at(HEADER_BYTES).store(seq, Ordering::Release);
                    // Mostly back to back (copies race the rewrites), sometimes a pause long
                    // enough for a whole copy to pass its check.
                    if i % 4 == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    } else {
                        std::thread::yield_now();
                    }
                }
                stop.store(true, Ordering::Release);
            });
            let mut dst = vec![0u8; SLOT];
            while !stop.load(Ordering::Acquire) {
                for (j, k) in keys.iter().enumerate() {
                    if view.read(&arena, *k, &mut dst) {
                        hits += 1;
                        let want = j as u8 + 1;
                        assert!(dst.iter().all(|b| *b == want), "torn copy of {k}");
                    } else {
                        misses += 1;
                    }
                }
            }
        });
        eprintln!("{hits} hits, {misses} misses while the slot was rewritten");
        // Stable again: the last block written (key 22, bytes 2) reads whole.
        let mut dst = vec![0u8; SLOT];
        assert!(view.read(&arena, keys[1], &mut dst));
        assert!(dst.iter().all(|b| *b == 2));
        assert!(
            !view.read(&arena, keys[0], &mut dst),
            "a key the slot no longer holds"
        );
    }

    /// With tenants the table holds internal keys: a view given the namespace's key mapping
    /// finds the caller's key; the internal key sent as if it were a client's key, or the
    /// caller's key without the mapping (or with another namespace's), is a miss.
    #[test]
    fn with_a_namespace_key_the_table_is_probed_by_internal_key() {
        use kvtier_core::slot_table::HEADER_BYTES;
        use kvtier_core::{BlockKey, KeyMap};
        const SLOT: usize = 4096;
        let t = OneSlot::<SLOT>::new();
        let (tf, tbytes, amap) = (&t.tf, t.tbytes, &t.amap);
        let mine = KeyMap::derive(&[5; 32], "tenant:w");
        let key = BlockKey::from_u128(77);
        let internal = mine.internal(key);
        t.set_key(internal);
        t.word(HEADER_BYTES).store(2, Ordering::Release);
        // SAFETY: the arena mapping is SLOT bytes; nothing else touches it.
        unsafe { std::ptr::write_bytes(amap.as_mut_ptr(), 9, SLOT) };
        let arena = map_arena(t.af.try_clone().unwrap(), SLOT as u64).unwrap();
        let view = |keys| {
            map_slot_table(tf.try_clone().unwrap(), tbytes as u64, SLOT as u64, keys)
                .unwrap()
                .expect("a table with KEYS_AES is probed")
        };
        let mut dst = vec![0u8; SLOT];
        let given = view(Some(KeyMap::from_bytes(*mine.bytes())));
        assert!(given.read(&arena, key, &mut dst));
        assert!(dst.iter().all(|b| *b == 9));
        assert!(
            !given.read(&arena, internal, &mut dst),
            "an internal key as sent"
        );
        let other = view(Some(KeyMap::derive(&[5; 32], "tenant:x")));
        assert!(
            !other.read(&arena, key, &mut dst),
            "another namespace's mapping"
        );
        assert!(!view(None).read(&arena, key, &mut dst), "no mapping");
        // A server that maps keys another way (no KEYS_AES): its table is not probed with a
        // namespace key (every probe would miss), and is without one.
        t.word(kvtier_core::slot_table::FLAGS_OFFSET)
            .store(0, Ordering::Relaxed);
        let older =
            |keys| map_slot_table(tf.try_clone().unwrap(), tbytes as u64, SLOT as u64, keys);
        assert!(
            older(Some(KeyMap::from_bytes(*mine.bytes())))
                .unwrap()
                .is_none()
        );
        assert!(older(None).unwrap().is_some());
    }

    fn tempfile_fd(len: u64) -> OwnedFd {
        // SAFETY: memfd_create with a valid C string; the fd is checked and then owned.
        let fd = unsafe { libc::memfd_create(c"kvtier-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh descriptor we own.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f.into()
    }

    /// A slot table built by hand as the server builds one: every slot used, slot `s`
    /// holding [`HandTable::key`]`(s)`, each key in the emptier of its two buckets.
    struct HandTable {
        fd: OwnedFd,
        map: memmap2::MmapRaw,
        slots: u32,
        tagged: bool,
    }

    impl HandTable {
        fn key(i: u32) -> kvtier_core::BlockKey {
            kvtier_core::BlockKey::from_u128(u128::from(i) * 0x9e37_79b9_7f4a_7c15 + 5)
        }

        fn full(slots: u32, tagged: bool, more_flags: u64) -> Self {
            use kvtier_core::slot_table::*;
            let tbytes = table_bytes(slots);
            let fd = tempfile_fd(tbytes as u64);
            let map =
                memmap2::MmapRaw::map_raw(&std::fs::File::from(fd.try_clone().unwrap())).unwrap();
            let t = Self {
                fd,
                map,
                slots,
                tagged,
            };
            let buckets = buckets_for(slots);
            t.w64(0).store(MAGIC, Ordering::Relaxed);
            t.w64(8).store(
                u64::from(WAYS as u32) << 32 | u64::from(slots),
                Ordering::Relaxed,
            );
            t.w64(16).store(u64::from(buckets), Ordering::Relaxed);
            t.w64(32).store(4096, Ordering::Relaxed);
            let tag_flag = if tagged { flags::TAGGED } else { 0 };
            t.w64(FLAGS_OFFSET)
                .store(flags::TWO_CHOICE | tag_flag | more_flags, Ordering::Relaxed);
            let m = u64::from(buckets - 1);
            let free = |b: u64| {
                (0..WAYS)
                    .filter(|&w| t.entry(b, w).load(Ordering::Relaxed) == 0)
                    .count()
            };
            for s in 0..slots {
                let (k, r) = (Self::key(s), Self::rec(s));
                t.w64(r + 8).store(k.to_u128() as u64, Ordering::Relaxed);
                t.w64(r + 16)
                    .store((k.to_u128() >> 64) as u64, Ordering::Relaxed);
                t.w64(r).store(2, Ordering::Relaxed);
                let (b1, b2) = (bucket_of(k) & m, second_bucket_of(k) & m);
                let b = if free(b2) > free(b1) { b2 } else { b1 };
                if let Some(w) = (0..WAYS).find(|&w| t.entry(b, w).load(Ordering::Relaxed) == 0) {
                    t.entry(b, w)
                        .store(entry_of(s, k, tagged), Ordering::Relaxed);
                }
            }
            t
        }

        fn view(&self) -> SlotView {
            let tbytes = kvtier_core::slot_table::table_bytes(self.slots);
            let v = map_slot_table(
                self.fd.try_clone().unwrap(),
                tbytes as u64,
                u64::from(self.slots) * 4096,
                None,
            )
            .unwrap()
            .expect("a table without tenants is probed");
            assert_eq!(v.tagged, self.tagged);
            v
        }

        fn rec(s: u32) -> usize {
            use kvtier_core::slot_table::{HEADER_BYTES, RECORD_BYTES};
            HEADER_BYTES + RECORD_BYTES * s as usize
        }

        fn w64(&self, off: usize) -> &AtomicU64 {
            assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
            // SAFETY: in bounds and aligned (asserted; the mapping is page aligned); the
            // mapping lives as long as `self`, and is only accessed through atomics.
            unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
        }

        fn entry(&self, b: u64, w: usize) -> &AtomicU32 {
            use kvtier_core::slot_table::{HEADER_BYTES, RECORD_BYTES, WAYS};
            let off =
                HEADER_BYTES + RECORD_BYTES * self.slots as usize + 4 * (WAYS * b as usize + w);
            assert!(off + 4 <= self.map.len());
            // SAFETY: as in `w64`, 4-aligned (the index starts 8-aligned).
            unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
        }
    }

    /// A full table, tagged and not: the prefix `held_prefix` names is the keys each probed
    /// alone would name, up to the first that is withdrawn (odd `seq`) or never stored, and
    /// with tags a key whose entry names another key's slot is not taken for it.
    #[test]
    fn held_prefix_agrees_with_each_key_probed_alone() {
        use kvtier_core::BlockKey;
        use kvtier_core::slot_table::*;
        let slots = 1u32 << 14;
        for tagged in [false, true] {
            let t = HandTable::full(slots, tagged, 0);
            let view = t.view();
            let m = u64::from(buckets_for(slots) - 1);
            let key = HandTable::key;
            let alone =
                |ks: &[BlockKey]| ks.iter().take_while(|k| view.find(**k, |_| true)).count();
            let keys: Vec<BlockKey> = (0..slots).map(key).collect();
            let window = &keys[100..100 + 4096];
            assert_eq!(view.held_prefix(window), 4096, "tagged {tagged}");
            assert_eq!(alone(window), 4096);
            // Withdrawn: the slot of the window's key 1,000.
            let r = HandTable::rec(1100);
            t.w64(r).store(3, Ordering::Relaxed);
            assert_eq!(view.held_prefix(window), 1000);
            assert_eq!(alone(window), 1000);
            t.w64(r).store(4, Ordering::Relaxed);
            // Never stored: a key in the middle, and an empty list.
            let mut with_new = window.to_vec();
            with_new[7] = key(slots + 1);
            assert_eq!(view.held_prefix(&with_new), 7);
            assert_eq!(view.held_prefix(&[]), 0);
            // Slot 0's entry rewritten to name slot 1, under slot 0's key's tag: slot 1's
            // record holds another key, so key 0 is not found through it.
            let k0 = key(0);
            for b in [bucket_of(k0) & m, second_bucket_of(k0) & m] {
                for w in 0..WAYS {
                    if t.entry(b, w).load(Ordering::Relaxed) == entry_of(0, k0, tagged) {
                        t.entry(b, w)
                            .store(entry_of(1, k0, tagged), Ordering::Relaxed);
                    }
                }
            }
            assert_eq!(view.held_prefix(&keys[..2]), 0);
            assert_eq!(view.held_prefix(&keys[1..3]), 2);
        }
    }

    /// With chain marks (the table's slots one chain, slot `s`'s block the child of slot
    /// `s - 1`'s): the binary search vouches for exactly the keys whose marks carry the
    /// current epoch and their chain's fingerprint, and `held_prefix` still names what each
    /// key probed alone names, whatever the marks say (current, stale, partial, or a list that
    /// is not a chain).
    #[test]
    fn chain_marks_are_searched_and_agree_with_each_key_probed_alone() {
        use kvtier_core::BlockKey;
        use kvtier_core::slot_table::*;
        let slots = 1u32 << 13;
        let t = HandTable::full(slots, true, flags::CHAINED);
        let keys: Vec<BlockKey> = (0..slots).map(HandTable::key).collect();
        let mut fp = CHAIN_SEED;
        let fps: Vec<u32> = keys
            .iter()
            .map(|k| {
                fp = chain_fold(fp, *k);
                fp
            })
            .collect();
        let mark = |s: u32, epoch: u32| {
            t.w64(HandTable::rec(s) + CHAIN_OFFSET)
                .store(chain_mark(epoch, fps[s as usize]), Ordering::Relaxed)
        };
        (0..slots).for_each(|s| mark(s, 7));
        t.w64(EPOCH_OFFSET).store(7, Ordering::Relaxed);
        let view = t.view();
        assert!(view.chained);
        let alone = |ks: &[BlockKey]| ks.iter().take_while(|k| view.find(**k, |_| true)).count();
        let agree = |ks: &[BlockKey], chained: usize, held: usize| {
            assert_eq!(view.chained_prefix(ks), chained);
            assert_eq!(view.held_prefix(ks), held);
            assert_eq!(alone(ks), held);
        };
        let prompt = &keys[..4096];
        agree(prompt, 4096, 4096);
        agree(&prompt[..1], 1, 1);
        agree(&[], 0, 0);
        // Keys after the prompt's, never stored: vouched up to the last cached one.
        let mut longer = prompt[..3000].to_vec();
        longer.extend((0..500).map(|i| HandTable::key(slots + i)));
        agree(&longer, 3000, 3000);
        // Not from the chain's root: no mark matches (probed one by one).
        agree(&keys[100..4196], 0, 4096);
        // Not a chain: the same keys in another order.
        let mut shuffled = prompt.to_vec();
        shuffled.swap(10, 4000);
        agree(&shuffled, 10, 4096);
        // Marks from 2,000 on not renewed yet: vouched to there, the rest probed.
        (2000..4096).for_each(|s| mark(s, 6));
        agree(prompt, 2000, 4096);
        // Withdrawn, the server having moved the epoch on: nothing vouched, the probe stops.
        t.w64(HandTable::rec(1000)).store(3, Ordering::Relaxed);
        t.w64(EPOCH_OFFSET).store(8, Ordering::Relaxed);
        agree(prompt, 0, 1000);
        // An epoch past 32 bits is not one a server writes: no mark is trusted.
        t.w64(HandTable::rec(1000)).store(4, Ordering::Relaxed);
        (0..slots).for_each(|s| mark(s, 8));
        agree(prompt, 4096, 4096);
        t.w64(EPOCH_OFFSET).store(1 << 40 | 8, Ordering::Relaxed);
        agree(prompt, 0, 4096);
    }
}

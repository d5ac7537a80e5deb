//! Layout of the published slot table: a local client reads DRAM hits through it with no
//! message (the server writes it, `kvtier-client` reads it; `docs/protocol.md` describes it).
//!
//! * header, 64 bytes: `magic: u64 = "KVTSLOT1"`, `slots: u32`, `ways: u32`, `buckets: u32`
//!   (a power of two), `_pad: u32`, `block_bytes: u64`, `slot_bytes: u64`, zeros up to 64;
//! * slot records at [`HEADER_BYTES`]: `slots` records of [`RECORD_BYTES`]:
//!   `seq: u64, key_lo: u64, key_hi: u64, _reserved: u64` (a seqlock: `seq` odd = nothing
//!   readable, even = the slot holds block `key_lo | key_hi << 64`, unchanged while `seq` is);
//! * index after the records: `buckets * ways` `u32` entries (`slot + 1`, 0 = empty); key `k`
//!   is looked for in bucket `bucket_of(k) & (buckets - 1)` only.

use crate::BlockKey;

/// `"KVTSLOT1"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVTSLOT1");
/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of one slot record.
pub const RECORD_BYTES: usize = 32;
/// Entries per index bucket.
pub const WAYS: usize = 8;

/// The bucket selector of a key (before masking): the splitmix64 finalizer of
/// `key_lo ^ (rotl(key_hi, 32) * 0x9e3779b97f4a7c15)` (wrapping), so that keys sent as they
/// are (no tenants: small integers, structured ids) spread too.
pub fn bucket_of(key: BlockKey) -> u64 {
    let k = key.to_u128();
    let hi = ((k >> 64) as u64)
        .rotate_left(32)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut z = (k as u64) ^ hi;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Buckets for `slots` slots: at least `slots / 4` (2x room over 8 ways), a power of two.
pub fn buckets_for(slots: u32) -> u32 {
    (slots.div_ceil(4)).max(1).next_power_of_two()
}

/// Total bytes of the table for `slots` slots (rounded up to a page).
pub fn table_bytes(slots: u32) -> usize {
    let b = HEADER_BYTES + RECORD_BYTES * slots as usize + 4 * WAYS * buckets_for(slots) as usize;
    b.next_multiple_of(4096)
}

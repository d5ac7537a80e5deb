//! Layout of the published slot table: a local client reads DRAM hits through it with no
//! message (the server writes it, `kvtier-client` reads it; `docs/protocol.md` describes it).
//!
//! * header, 64 bytes: `magic: u64 = "KVTSLOT1"`, `slots: u32`, `ways: u32`, `buckets: u32`
//!   (a power of two), `_pad: u32`, `block_bytes: u64`, `slot_bytes: u64`, `flags: u64`
//!   ([`FLAGS_OFFSET`], [`flags`]; 0 from servers before it), `pending: u64`
//!   ([`PENDING_OFFSET`]: distinct keys being stored now, kept by servers that set
//!   [`flags::EXACT`]), `epoch: u64` ([`EPOCH_OFFSET`], with [`flags::CHAINED`]);
//! * slot records at [`HEADER_BYTES`]: `slots` records of [`RECORD_BYTES`]:
//!   `seq: u64, key_lo: u64, key_hi: u64, chain: u64` (a seqlock: `seq` odd = nothing
//!   readable, even = the slot holds block `key_lo | key_hi << 64`, unchanged while `seq` is;
//!   `chain` with [`flags::CHAINED`], see [`chain_mark`]);
//! * index after the records: `buckets * ways` `u32` entries (`slot + 1`, 0 = empty; with
//!   [`flags::TAGGED`], `tag << TAG_SHIFT | (slot + 1)`, see [`entry_of`]); key `k` is looked
//!   for in bucket `bucket_of(k) & (buckets - 1)`, and, where the header's flags have
//!   [`flags::TWO_CHOICE`], also in `second_bucket_of(k) & (buckets - 1)`.

use crate::BlockKey;

/// `"KVTSLOT1"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVTSLOT1");
/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of one slot record.
pub const RECORD_BYTES: usize = 32;
/// Entries per index bucket.
pub const WAYS: usize = 8;
/// Offset of the header's `flags: u64` (written once, before the table is handed out).
pub const FLAGS_OFFSET: usize = 40;
/// Offset of the header's `pending: u64`: how many distinct keys puts in flight are storing
/// (raised before a put goes on, lowered once its keys are committed or withdrawn).
pub const PENDING_OFFSET: usize = 48;
/// Offset of the header's `epoch: u64` ([`flags::CHAINED`]): a record's chain mark counts
/// only while it carries this value (1 to `u32::MAX`; 0 is never current).
pub const EPOCH_OFFSET: usize = 56;
/// Offset of the chain mark in a slot record ([`flags::CHAINED`]).
pub const CHAIN_OFFSET: usize = 24;

/// Bits of the header's `flags`.
pub mod flags {
    /// Lookups may be answered from the table: no tier above DRAM holds blocks (so a block
    /// the table names is in the fastest tier that holds it, the tier a lookup reply would
    /// name), and the server takes a lookup sent with `NO_REPLY` as a lookup whose answer the
    /// client already has (it tells the eviction policy and takes the hold, and replies
    /// nothing). A client may then answer a lookup whose every key the table names itself,
    /// all `dram`, and send the lookup one way.
    pub const LOOKUPS: u64 = 1;
    /// The server indexes each key in whichever of its two buckets ([`super::bucket_of`],
    /// [`super::second_bucket_of`]) has more free entries: readers look in both. (Without
    /// it, only the first: a full DRAM tier would leave about 2 % of its keys unindexed,
    /// and a lookup answered from the table needs every key of a prefix.)
    pub const TWO_CHOICE: u64 = 2;
    /// With [`LOOKUPS`]: DRAM is the server's only tier and it belongs to no cluster, so a
    /// key the table does not name is not cached there, unless a put of it is in flight
    /// (the header's `pending` is then not zero). A client may answer a lookup whose
    /// leading keys the table names and whose next key it does not, while `pending` is
    /// zero: that prefix, then a miss.
    pub const EXACT: u64 = 4;
    /// Index entries carry an 8-bit tag of their key in their top bits ([`super::entry_of`]),
    /// so a reader loads the record only of an entry whose tag is its key's (one record a
    /// probe instead of up to eight). Set where `slots` leaves room for it
    /// ([`super::TAGGED_MAX_SLOTS`]).
    pub const TAGGED: u64 = 8;
    /// With tenants, the table's keys are internal keys of the AES-256 mapping
    /// (`crate::key_map`). A client given a namespace key probes only a table with this
    /// flag: servers before it mapped keys another way (HMAC-SHA256), so its probes there
    /// would all miss.
    pub const KEYS_AES: u64 = 16;
    /// Records carry chain marks ([`super::chain_mark`]): a record whose mark holds the
    /// header's current `epoch` ([`super::EPOCH_OFFSET`]) and the chain fingerprint of a
    /// key list's first `i + 1` keys ([`super::chain_fold`]) says that those keys are the
    /// block's chain, every one of them in DRAM. A client may then find the cached prefix
    /// of a list by a binary search over its keys instead of probing each one.
    pub const CHAINED: u64 = 32;
}

/// The chain fingerprint before any key ([`chain_fold`]).
pub const CHAIN_SEED: u32 = 0x6b76_7431;

/// The chain fingerprint of a key list's keys up to `key`, given that of the keys before
/// it (`prev`; [`CHAIN_SEED`] for a chain's first block): the high 32 bits of `(prev ^
/// key_lo ^ rotl(key_hi, 17)) * 0x9e3779b97f4a7c15` (wrapping). One multiply a key: a client
/// folds a whole prompt's keys before its search. A fingerprint, not a proof: two chains
/// share one about once in 2^32 (a wrong "cached" from it costs a miss at the load, as any
/// stale lookup does).
pub fn chain_fold(prev: u32, key: BlockKey) -> u32 {
    let k = key.to_u128();
    let x = u64::from(prev) ^ (k as u64) ^ ((k >> 64) as u64).rotate_left(17);
    (x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32
}

/// How many leading items of `0..n` a monotone `marked` vouches for (`marked(i)` true means
/// items `0..=i` are): the last item first (one call when all are), else a binary search for
/// the first unmarked one. Shared by the client's search and the server's renewal.
pub fn marked_prefix(n: usize, mut marked: impl FnMut(usize) -> bool) -> usize {
    if n == 0 || marked(n - 1) {
        return n;
    }
    // Invariant: items 0..lo vouched for (by a mark at lo - 1), item hi not.
    let (mut lo, mut hi) = (0, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if marked(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A record's chain mark ([`flags::CHAINED`]): `epoch << 32 | fingerprint`, where
/// `fingerprint` is the [`chain_fold`] of the block's chain (its put's parent's, that
/// parent's, ... to a block stored with no parent, then the block's own key). The server
/// writes it only while every block of that chain is in DRAM, and it counts only while the
/// header's epoch is `epoch`: the server moves the epoch on before it takes out of DRAM a
/// block that a marked block's chain may go through. 0: no mark.
pub fn chain_mark(epoch: u32, fingerprint: u32) -> u64 {
    u64::from(epoch) << 32 | u64::from(fingerprint)
}

/// Bits of an index entry below its tag ([`flags::TAGGED`]): the entry's `slot + 1`.
pub const TAG_SHIFT: u32 = 24;
/// The `slot + 1` part of a tagged entry.
pub const ENTRY_SLOT_MASK: u32 = (1 << TAG_SHIFT) - 1;
/// The most slots a table may have and still tag its entries (`slot + 1` fits below the
/// tag): 16,777,214, 1 TiB of 64 KiB blocks.
pub const TAGGED_MAX_SLOTS: u32 = ENTRY_SLOT_MASK - 1;

/// The tag of a key whose [`bucket_of`] is `first`: its top 8 bits (the bucket takes the
/// low bits, and buckets never reach 2^56).
pub fn tag_of(first: u64) -> u32 {
    (first >> 56) as u32
}

/// The index entry naming `slot` for `key`: `slot + 1`, and with `tagged` the key's tag
/// above it ([`flags::TAGGED`]).
pub fn entry_of(slot: u32, key: BlockKey, tagged: bool) -> u32 {
    if tagged {
        tag_of(bucket_of(key)) << TAG_SHIFT | (slot + 1)
    } else {
        slot + 1
    }
}

/// The slot an index entry names (`None` for an empty entry), in a table with or without
/// [`flags::TAGGED`].
pub fn slot_of_entry(e: u32, tagged: bool) -> Option<u32> {
    let s = if tagged { e & ENTRY_SLOT_MASK } else { e };
    s.checked_sub(1)
}

/// The bucket selector of a key (before masking): the splitmix64 finalizer of
/// `key_lo ^ (rotl(key_hi, 32) * 0x9e3779b97f4a7c15)` (wrapping), so that keys sent as they
/// are (no tenants: small integers, structured ids) spread too.
pub fn bucket_of(key: BlockKey) -> u64 {
    let k = key.to_u128();
    let hi = ((k >> 64) as u64)
        .rotate_left(32)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    mix((k as u64) ^ hi)
}

/// The second bucket selector ([`flags::TWO_CHOICE`]), before masking: the splitmix64
/// finalizer of `key_hi ^ (rotl(key_lo, 32) * 0xc2b2ae3d27d4eb4f)` (wrapping).
pub fn second_bucket_of(key: BlockKey) -> u64 {
    let k = key.to_u128();
    let lo = (k as u64)
        .rotate_left(32)
        .wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    mix(((k >> 64) as u64) ^ lo)
}

/// The splitmix64 finalizer.
fn mix(mut z: u64) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys placed as the server places them (the bucket of the two with more free entries)
    /// into a table as full as a DRAM tier gets (every slot used: 4 keys a bucket on
    /// average): none is left out, for keys as the server sees them with tenants (hashes)
    /// and without (small integers). With one choice about 2 % would be.
    #[test]
    fn two_choices_index_every_key_of_a_full_table() {
        let slots = 1u32 << 16;
        let buckets = buckets_for(slots);
        for (name, salt) in [("small integers", 0u128), ("hashes", 1)] {
            let mut load = vec![0u8; buckets as usize];
            let (mut one_choice_left_out, mut left_out) = (0, 0);
            let mut first = vec![0u8; buckets as usize];
            for i in 0..u128::from(slots) {
                let k = if salt == 0 {
                    BlockKey::from_u128(i)
                } else {
                    let h = mix(i as u64) as u128 | (mix(!(i as u64)) as u128) << 64;
                    BlockKey::from_u128(h)
                };
                let m = u64::from(buckets - 1);
                let (b1, b2) = (
                    (bucket_of(k) & m) as usize,
                    (second_bucket_of(k) & m) as usize,
                );
                if first[b1] as usize == WAYS {
                    one_choice_left_out += 1;
                } else {
                    first[b1] += 1;
                }
                let b = if load[b2] < load[b1] { b2 } else { b1 };
                if load[b] as usize == WAYS {
                    left_out += 1;
                } else {
                    load[b] += 1;
                }
            }
            assert_eq!(left_out, 0, "{name}");
            assert!(
                one_choice_left_out > slots / 200,
                "{name}: {one_choice_left_out}"
            );
        }
    }

    /// Tagged entries name their slot, and keys sharing a bucket rarely share a tag: in a
    /// full table a probe loads the record of about one entry (its own), not of up to eight.
    #[test]
    fn tagged_entries_name_their_slot_and_tell_keys_apart() {
        let k = BlockKey::from_u128(0xfeed);
        for tagged in [false, true] {
            for slot in [0, 1, 4095, TAGGED_MAX_SLOTS] {
                let e = entry_of(slot, k, tagged);
                assert_ne!(e, 0);
                assert_eq!(slot_of_entry(e, tagged), Some(slot));
            }
            assert_eq!(slot_of_entry(0, tagged), None);
        }
        assert_eq!(entry_of(7, k, true) >> TAG_SHIFT, tag_of(bucket_of(k)));
        // Every slot of a table of 2^16 used, keys in their first bucket: how often another
        // key of the bucket has the probed key's tag (a record loaded for nothing).
        let slots = 1u32 << 16;
        let m = u64::from(buckets_for(slots) - 1);
        let mut buckets = vec![Vec::new(); buckets_for(slots) as usize];
        for i in 0..u128::from(slots) {
            let h = bucket_of(BlockKey::from_u128(i));
            buckets[(h & m) as usize].push(tag_of(h));
        }
        let (mut probes, mut wasted) = (0u64, 0u64);
        for b in &buckets {
            for (i, t) in b.iter().enumerate() {
                probes += 1;
                wasted += b
                    .iter()
                    .enumerate()
                    .filter(|(j, u)| *j != i && *u == t)
                    .count() as u64;
            }
        }
        assert!(
            wasted * 50 < probes,
            "{wasted} wasted record loads in {probes} probes"
        );
    }
}

//! Block identity and content for the replay: a key from (scope, hash id), and a payload
//! made from the key that carries its own checksum, so every hit can be verified.
//!
//! Layout of a block: `[0..8)` xxh3-64 of bytes `[8..)`, little-endian; `[8..24)` the block's
//! key; the rest a SplitMix64 stream seeded from the key. A block served for the wrong key
//! fails the key check even though its checksum holds.

use kvtier_core::BlockKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_128_with_seed};

use kvtier_core::SplitMix64;

/// Bytes before the filler: checksum and key.
pub const HEADER_BYTES: usize = 8 + BlockKey::BYTES;

/// The key of block `id` of scope `scope` (a session copy; 0 for a Mooncake trace, whose ids
/// are global) under `seed` (another seed, other keys).
pub fn block_key(seed: u64, scope: u32, id: u64) -> BlockKey {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&scope.to_le_bytes());
    b[4..].copy_from_slice(&id.to_le_bytes());
    BlockKey::from_u128(xxh3_128_with_seed(&b, seed))
}

/// Fills `buf` (at least [`HEADER_BYTES`] long) with `key`'s block.
pub fn fill(key: BlockKey, buf: &mut [u8]) {
    debug_assert!(buf.len() >= HEADER_BYTES);
    buf[8..HEADER_BYTES].copy_from_slice(key.as_bytes());
    let k = key.to_u128();
    let mut rng = SplitMix64::new((k as u64) ^ ((k >> 64) as u64));
    for chunk in buf[HEADER_BYTES..].chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let sum = xxh3_64(&buf[8..]);
    buf[..8].copy_from_slice(&sum.to_le_bytes());
}

/// What is wrong with a block that fails verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corruption {
    /// The checksum does not match the bytes.
    Checksum,
    /// A well-formed block, but of another key.
    WrongKey,
}

/// Checks `buf` is `key`'s block as [`fill`] made it (checksum, then key).
pub fn verify(key: BlockKey, buf: &[u8]) -> Result<(), Corruption> {
    if buf.len() < HEADER_BYTES {
        return Err(Corruption::Checksum);
    }
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&buf[..8]);
    if u64::from_le_bytes(sum) != xxh3_64(&buf[8..]) {
        return Err(Corruption::Checksum);
    }
    if &buf[8..HEADER_BYTES] != key.as_bytes() {
        return Err(Corruption::WrongKey);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_scope_id_and_seed() {
        let k = block_key(1, 0, 5);
        assert_eq!(k, block_key(1, 0, 5));
        assert_ne!(k, block_key(1, 1, 5));
        assert_ne!(k, block_key(1, 0, 6));
        assert_ne!(k, block_key(2, 0, 5));
    }

    #[test]
    fn verification_catches_flips_and_swaps() {
        let (a, b) = (block_key(0, 0, 1), block_key(0, 0, 2));
        let mut buf = vec![0u8; 1000];
        fill(a, &mut buf);
        assert_eq!(verify(a, &buf), Ok(()));
        // Another key's intact block.
        assert_eq!(verify(b, &buf), Err(Corruption::WrongKey));
        for pos in [0, 7, 8, 30, 999] {
            let mut bad = buf.clone();
            bad[pos] ^= 0x10;
            assert!(verify(a, &bad).is_err(), "flip at {pos} passed");
        }
        assert_eq!(verify(a, &buf[..10]), Err(Corruption::Checksum));
        assert_eq!(verify(a, &vec![0u8; 1000]), Err(Corruption::Checksum));
    }
}

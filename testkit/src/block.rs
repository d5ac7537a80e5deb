//! Block payloads that verify themselves: the bytes stored for a key are a function of the key
//! and the length, so any byte served for a key can be checked without remembering it.

use kvtier_core::BlockKey;

/// The bytes every check stores for `key`: a function of the key and length, so any byte
/// served for a key can be verified without remembering it.
pub fn block_bytes(key: BlockKey, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill_block(key, &mut out);
    out
}

/// Fills `buf` with the bytes [`block_bytes`] gives for `key`.
pub fn fill_block(key: BlockKey, buf: &mut [u8]) {
    let mut x = key.low_u64() ^ (key.to_u128() >> 64) as u64 ^ buf.len() as u64;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_depend_on_key_and_length() {
        let (a, b) = (BlockKey::from_u128(1), BlockKey::from_u128(2));
        assert_eq!(block_bytes(a, 100), block_bytes(a, 100));
        assert_ne!(block_bytes(a, 100), block_bytes(b, 100));
        assert_ne!(block_bytes(a, 100)[..64], block_bytes(a, 101)[..64]);
        assert_eq!(block_bytes(a, 5).len(), 5);
    }
}

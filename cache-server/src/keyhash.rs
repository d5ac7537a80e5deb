//! Hashing of block keys for in-memory maps. Keys are opaque 16-byte values from outside
//! (an engine's own hashes, or worse, sequential ids), so maps hash them again with a
//! per-process random seed: no client can aim keys at one bucket or one shard. Seeded XXH3
//! is several times cheaper than the standard library's SipHash for 16 bytes.

use std::hash::Hasher;

use kvtier_core::BlockKey;

/// Keys are opaque 16-byte values from outside (an engine's own hashes, or worse, sequential
/// ids), so the index hashes them again with a per-process random seed: no client can aim
/// keys at one bucket or one shard.
#[derive(Clone)]
pub(crate) struct KeyHashing {
    seed: u64,
}

impl KeyHashing {
    pub(crate) fn new() -> Self {
        use std::hash::BuildHasher;
        // RandomState is seeded from the OS once per process.
        Self {
            seed: std::collections::hash_map::RandomState::new().hash_one(0x6b76_7469_6572u64),
        }
    }

    pub(crate) fn hash(&self, key: &BlockKey) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), self.seed)
    }
}

impl std::hash::BuildHasher for KeyHashing {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            seed: self.seed,
            value: 0,
        }
    }
}

/// Hashes the key's 16 bytes (the only write a `BlockKey` makes) with seeded XXH3.
pub(crate) struct KeyHasher {
    seed: u64,
    value: u64,
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.value
    }
    fn write(&mut self, bytes: &[u8]) {
        self.value = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.seed ^ self.value);
    }
    fn write_usize(&mut self, _: usize) {}
}

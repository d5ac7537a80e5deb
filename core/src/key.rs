//! Block identity: 128-bit [`BlockKey`]s made by a keyed, chained prefix hash.
//!
//! `key[0] = H(namespace, tokens[0..B])`, `key[i] = H(key[i-1], tokens[iB..(i+1)B])`, where the
//! hash input is the 16 parent bytes followed by the block's tokens as little-endian `u32`, and
//! `H` is keyed with a deployment secret ([`HashSecret`]): XXH3-128 with a secret derived from it
//! (the fast default) or keyed BLAKE3 truncated to 128 bits (for tenants that do not trust each
//! other). The namespace is itself a keyed hash of tagged fields ([`NamespaceBuilder`]).
//!
//! The encoding is pinned by golden-value tests: changing any byte of it changes every key and
//! so invalidates every persisted cache. Bump [`HASH_SCHEME_VERSION`] when it must change.

use std::fmt;

use crate::CoreError;

/// Version of the key derivation. It is hashed into every namespace, so keys made under two
/// versions never collide.
pub const HASH_SCHEME_VERSION: u32 = 1;

/// Shortest deployment secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;

/// Largest `model_id`, `adapter_id` or `cache_salt` accepted by the namespace, in bytes.
pub const MAX_NAMESPACE_FIELD_BYTES: usize = 4096;

const XXH3_SECRET_BYTES: usize = 192;
const NAMESPACE_DOMAIN: &[u8] = b"kvtier/namespace";

/// The identity of one cached block: 128 bits, opaque to everything but the hasher that made it.
///
/// Engines that hash blocks themselves may use their own 16-byte values; kvtier only needs
/// equal prefixes to have equal keys and different prefixes to have different ones.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    wincode::SchemaWrite,
    wincode::SchemaRead,
)]
#[repr(transparent)]
pub struct BlockKey([u8; 16]);

impl BlockKey {
    /// Width of a key on the wire and on disk.
    pub const BYTES: usize = 16;

    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub const fn from_u128(v: u128) -> Self {
        Self(v.to_le_bytes())
    }

    pub const fn to_u128(self) -> u128 {
        u128::from_le_bytes(self.0)
    }

    /// The low 64 bits; keys are uniform hashes, so this is a good shard or bucket selector.
    pub const fn low_u64(self) -> u64 {
        self.to_u128() as u64
    }

    /// Parses the 32-character lowercase hex form written by `Display`.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 32 {
            return None;
        }
        let v = u128::from_str_radix(s, 16).ok()?;
        Some(Self(v.to_be_bytes()))
    }
}

impl fmt::Display for BlockKey {
    /// Big-endian hex of the 16 bytes, i.e. the bytes in order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

/// Which keyed hash makes keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum HashScheme {
    /// XXH3-128 with a 192-byte secret derived from the deployment secret. Fast (the default).
    #[default]
    Xxh3Keyed,
    /// BLAKE3 in keyed mode, truncated to 128 bits. A cryptographic MAC: use it when tenants do
    /// not trust each other.
    Blake3Keyed,
}

impl HashScheme {
    fn tag(self) -> u8 {
        match self {
            HashScheme::Xxh3Keyed => 1,
            HashScheme::Blake3Keyed => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashScheme::Xxh3Keyed => "xxh3",
            HashScheme::Blake3Keyed => "blake3",
        }
    }

    pub fn parse(name: &str) -> Result<Self, CoreError> {
        match name {
            "xxh3" => Ok(HashScheme::Xxh3Keyed),
            "blake3" => Ok(HashScheme::Blake3Keyed),
            _ => Err(CoreError::UnknownName {
                what: "hash scheme",
                name: name.to_owned(),
                expected: "xxh3, blake3",
            }),
        }
    }
}

/// The deployment secret every key is keyed with, expanded for the chosen [`HashScheme`].
///
/// Every process of one deployment that must share blocks uses the same secret. Keep it out of
/// logs: `Debug` prints only the scheme.
#[derive(Clone)]
pub struct HashSecret {
    scheme: HashScheme,
    xxh3: Box<[u8; XXH3_SECRET_BYTES]>,
    blake3: [u8; 32],
}

impl fmt::Debug for HashSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HashSecret")
            .field("scheme", &self.scheme)
            .finish_non_exhaustive()
    }
}

impl HashSecret {
    /// Expands `secret` (at least [`MIN_SECRET_BYTES`] bytes) into the scheme's key material.
    pub fn new(scheme: HashScheme, secret: &[u8]) -> Result<Self, CoreError> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(CoreError::InvalidSecret {
                reason: "shorter than 16 bytes",
            });
        }
        if secret.iter().all(|&b| b == secret[0]) {
            return Err(CoreError::InvalidSecret {
                reason: "every byte is the same",
            });
        }
        // XXH3 wants a secret that looks random; BLAKE3's key derivation gives one from any
        // input, domain-separated from the BLAKE3 key itself.
        let mut xxh3 = Box::new([0u8; XXH3_SECRET_BYTES]);
        let mut h = blake3::Hasher::new_derive_key("kvtier 2026 xxh3 secret v1");
        h.update(secret);
        h.finalize_xof().fill(&mut xxh3[..]);
        let blake3 = blake3::derive_key("kvtier 2026 blake3 block key v1", secret);
        Ok(Self {
            scheme,
            xxh3,
            blake3,
        })
    }

    /// A fixed, public secret for demos and tests. Anyone can compute keys under it, so a
    /// deployment that serves more than one tenant must configure its own.
    pub fn development() -> Self {
        // The literal is 32 distinct-enough bytes, so `new` cannot refuse it.
        Self::new(HashScheme::Xxh3Keyed, b"kvtier-development-secret-0001!!")
            .expect("the built-in development secret is valid")
    }

    pub fn scheme(&self) -> HashScheme {
        self.scheme
    }

    #[inline]
    fn hash(&self, input: &[u8]) -> BlockKey {
        match self.scheme {
            HashScheme::Xxh3Keyed => BlockKey::from_u128(xxhash_rust::xxh3::xxh3_128_with_secret(
                input,
                &self.xxh3[..],
            )),
            HashScheme::Blake3Keyed => {
                let full = blake3::keyed_hash(&self.blake3, input);
                let mut out = [0u8; 16];
                out.copy_from_slice(&full.as_bytes()[..16]);
                BlockKey::from_bytes(out)
            }
        }
    }
}

/// The root of every key chain: a keyed hash of what must match for two blocks to be the same.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Namespace(BlockKey);

impl Namespace {
    pub fn key(&self) -> BlockKey {
        self.0
    }
}

/// Builds a [`Namespace`] from tagged fields, so no two fields can be confused
/// (`model="ab", adapter="c"` and `model="a", adapter="bc"` differ).
#[derive(Clone, Debug)]
pub struct NamespaceBuilder {
    model_id: String,
    layout_fingerprint: u64,
    tp_rank: u32,
    tp_size: u32,
    adapter_id: Option<String>,
    cache_salt: Option<Vec<u8>>,
}

mod tag {
    pub const SCHEME_VERSION: u8 = 1;
    pub const HASH_SCHEME: u8 = 2;
    pub const MODEL_ID: u8 = 3;
    pub const LAYOUT_FINGERPRINT: u8 = 4;
    pub const TP_RANK: u8 = 5;
    pub const TP_SIZE: u8 = 6;
    pub const ADAPTER_ID: u8 = 7;
    pub const CACHE_SALT: u8 = 8;
}

impl NamespaceBuilder {
    /// A namespace for `model_id` under a layout (see [`crate::KvLayout::fingerprint`]), with
    /// tensor parallelism 0 of 1, no adapter and no salt.
    pub fn new(model_id: impl Into<String>, layout_fingerprint: u64) -> Self {
        Self {
            model_id: model_id.into(),
            layout_fingerprint,
            tp_rank: 0,
            tp_size: 1,
            adapter_id: None,
            cache_salt: None,
        }
    }

    /// Tensor-parallel rank and size. Default: 0 of 1.
    pub fn tensor_parallel(mut self, rank: u32, size: u32) -> Self {
        self.tp_rank = rank;
        self.tp_size = size;
        self
    }

    /// LoRA adapter id. Default: none.
    pub fn adapter(mut self, adapter_id: impl Into<String>) -> Self {
        self.adapter_id = Some(adapter_id.into());
        self
    }

    /// Per-tenant salt: tenants with different salts never share a block. Default: none.
    pub fn cache_salt(mut self, salt: impl Into<Vec<u8>>) -> Self {
        self.cache_salt = Some(salt.into());
        self
    }

    /// The exact bytes that are hashed (public so the encoding can be pinned by tests and
    /// documented).
    pub fn encode(&self, scheme: HashScheme) -> Result<Vec<u8>, CoreError> {
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(CoreError::InvalidNamespace {
                field: "tp_rank/tp_size",
                reason: "rank must be below a non-zero size",
            });
        }
        let mut out = Vec::with_capacity(64 + self.model_id.len());
        out.extend_from_slice(NAMESPACE_DOMAIN);
        let mut field = |tag: u8, name: &'static str, value: &[u8]| {
            if value.len() > MAX_NAMESPACE_FIELD_BYTES {
                return Err(CoreError::InvalidNamespace {
                    field: name,
                    reason: "longer than 4096 bytes",
                });
            }
            out.push(tag);
            // Bounded by the check above, so the cast cannot truncate.
            out.extend_from_slice(&(value.len() as u32).to_le_bytes());
            out.extend_from_slice(value);
            Ok(())
        };
        field(
            tag::SCHEME_VERSION,
            "scheme_version",
            &HASH_SCHEME_VERSION.to_le_bytes(),
        )?;
        field(tag::HASH_SCHEME, "hash_scheme", &[scheme.tag()])?;
        field(tag::MODEL_ID, "model_id", self.model_id.as_bytes())?;
        field(
            tag::LAYOUT_FINGERPRINT,
            "layout_fingerprint",
            &self.layout_fingerprint.to_le_bytes(),
        )?;
        field(tag::TP_RANK, "tp_rank", &self.tp_rank.to_le_bytes())?;
        field(tag::TP_SIZE, "tp_size", &self.tp_size.to_le_bytes())?;
        if let Some(a) = &self.adapter_id {
            field(tag::ADAPTER_ID, "adapter_id", a.as_bytes())?;
        }
        if let Some(s) = &self.cache_salt {
            field(tag::CACHE_SALT, "cache_salt", s)?;
        }
        Ok(out)
    }

    pub fn build(&self, secret: &HashSecret) -> Result<Namespace, CoreError> {
        Ok(Namespace(secret.hash(&self.encode(secret.scheme())?)))
    }
}

/// Makes the chained keys of a prompt's full blocks. Holds one scratch buffer, so hashing
/// allocates nothing after construction. Not `Sync`; make one per thread (cloning is cheap).
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    secret: HashSecret,
    namespace: Namespace,
    block_tokens: usize,
    buf: Vec<u8>,
}

impl PrefixHasher {
    /// `block_tokens` must be a power of two from 1 to 512 (see [`crate::KvLayout`]).
    pub fn new(
        secret: HashSecret,
        namespace: Namespace,
        block_tokens: u32,
    ) -> Result<Self, CoreError> {
        crate::layout::check_block_tokens(block_tokens)?;
        let block_tokens = block_tokens as usize;
        Ok(Self {
            secret,
            namespace,
            block_tokens,
            buf: Vec::with_capacity(BlockKey::BYTES + 4 * block_tokens),
        })
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// The key of one block given its parent's key (`None` for the first block).
    pub fn block_key(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<BlockKey, CoreError> {
        if tokens.len() != self.block_tokens {
            return Err(CoreError::TokenCount {
                expected: self.block_tokens,
                got: tokens.len(),
            });
        }
        Ok(self.chain(parent.unwrap_or(self.namespace.0), tokens))
    }

    #[inline]
    fn chain(&mut self, parent: BlockKey, tokens: &[u32]) -> BlockKey {
        self.buf.clear();
        self.buf.extend_from_slice(parent.as_bytes());
        for t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        self.secret.hash(&self.buf)
    }

    /// Appends the keys of every full block of `tokens` to `out` (a trailing partial block has
    /// no key: only full blocks are cached). Returns how many keys were appended.
    pub fn prompt_keys(&mut self, tokens: &[u32], out: &mut Vec<BlockKey>) -> usize {
        let n = tokens.len() / self.block_tokens;
        out.reserve(n);
        let mut parent = self.namespace.0;
        for block in tokens.chunks_exact(self.block_tokens) {
            parent = self.chain(parent, block);
            out.push(parent);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(scheme: HashScheme, salt: Option<&[u8]>) -> PrefixHasher {
        let secret = HashSecret::new(scheme, b"golden-test-secret-0123456789abcdef").unwrap();
        let mut ns = NamespaceBuilder::new("llama-3-8b", 0x0123_4567_89ab_cdef);
        if let Some(s) = salt {
            ns = ns.cache_salt(s);
        }
        let ns = ns.build(&secret).unwrap();
        PrefixHasher::new(secret, ns, 4).unwrap()
    }

    fn keys(h: &mut PrefixHasher, tokens: &[u32]) -> Vec<String> {
        let mut out = Vec::new();
        h.prompt_keys(tokens, &mut out);
        out.iter().map(|k| k.to_string()).collect()
    }

    /// Pins the namespace encoding byte for byte.
    #[test]
    fn golden_namespace_encoding() {
        let enc = NamespaceBuilder::new("m", 0x1122_3344_5566_7788)
            .tensor_parallel(1, 2)
            .adapter("lora")
            .cache_salt(*b"s")
            .encode(HashScheme::Xxh3Keyed)
            .unwrap();
        let mut want = b"kvtier/namespace".to_vec();
        want.extend_from_slice(&[1, 4, 0, 0, 0, 1, 0, 0, 0]); // scheme version 1
        want.extend_from_slice(&[2, 1, 0, 0, 0, 1]); // xxh3
        want.extend_from_slice(&[3, 1, 0, 0, 0, b'm']);
        want.extend_from_slice(&[
            4, 8, 0, 0, 0, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
        ]);
        want.extend_from_slice(&[5, 4, 0, 0, 0, 1, 0, 0, 0]);
        want.extend_from_slice(&[6, 4, 0, 0, 0, 2, 0, 0, 0]);
        want.extend_from_slice(&[7, 4, 0, 0, 0, b'l', b'o', b'r', b'a']);
        want.extend_from_slice(&[8, 1, 0, 0, 0, b's']);
        assert_eq!(enc, want);
    }

    /// Pins the key values: any change to the derivation, the secret expansion or the token
    /// encoding fails here.
    #[test]
    fn golden_keys_xxh3() {
        let mut h = hasher(HashScheme::Xxh3Keyed, None);
        let got = keys(&mut h, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(got, GOLDEN_XXH3, "xxh3 keys changed: {got:?}");
    }

    #[test]
    fn golden_keys_blake3() {
        let mut h = hasher(HashScheme::Blake3Keyed, None);
        let got = keys(&mut h, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(got, GOLDEN_BLAKE3, "blake3 keys changed: {got:?}");
    }

    const GOLDEN_XXH3: [&str; 2] = [
        "ea8f9de2b720cb864bfbc95c22eedc25",
        "64d75a499fb0df995a972af8e2e3cd39",
    ];
    const GOLDEN_BLAKE3: [&str; 2] = [
        "6e41880d5d5f1e18e4472f78f58fc703",
        "bfae33da89e23a3335d1f8f785031ab2",
    ];

    #[test]
    fn tokens_are_little_endian_u32_after_the_parent() {
        let secret = HashSecret::development();
        let ns = NamespaceBuilder::new("m", 7).build(&secret).unwrap();
        let mut h = PrefixHasher::new(secret.clone(), ns, 2).unwrap();
        let k = h.block_key(None, &[0x0102_0304, 5]).unwrap();
        let mut input = ns.key().as_bytes().to_vec();
        input.extend_from_slice(&[4, 3, 2, 1, 5, 0, 0, 0]);
        assert_eq!(k, secret.hash(&input));
        let k2 = h.block_key(Some(k), &[6, 7]).unwrap();
        let mut input2 = k.as_bytes().to_vec();
        input2.extend_from_slice(&[6, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(k2, secret.hash(&input2));
    }

    #[test]
    fn chain_shares_exactly_the_common_prefix() {
        let mut h = hasher(HashScheme::Xxh3Keyed, None);
        let a = keys(&mut h, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let b = keys(&mut h, &[1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same tokens after a divergence still differ: the chain carries the prefix.
        assert_ne!(a[2], b[2]);
        assert_eq!(a.len(), 3);
    }

    #[test]
    fn every_namespace_field_separates_keys() {
        let secret = HashSecret::development();
        let base = NamespaceBuilder::new("m", 1);
        let variants = [
            base.clone(),
            NamespaceBuilder::new("m2", 1),
            NamespaceBuilder::new("m", 2),
            base.clone().tensor_parallel(1, 2),
            base.clone().tensor_parallel(0, 2),
            base.clone().adapter("a"),
            base.clone().cache_salt(*b"tenant-a"),
            base.clone().cache_salt(*b"tenant-b"),
            // Field boundaries: moving a byte between fields must change the namespace.
            NamespaceBuilder::new("ma", 1).adapter("b"),
            NamespaceBuilder::new("m", 1).adapter("ab"),
        ];
        let mut seen = std::collections::HashSet::new();
        for v in &variants {
            assert!(seen.insert(v.build(&secret).unwrap()), "{v:?} collided");
        }
        let other = HashSecret::new(HashScheme::Xxh3Keyed, b"another-deployment-secret").unwrap();
        assert!(seen.insert(base.build(&other).unwrap()));
        let blake = HashSecret::new(HashScheme::Blake3Keyed, b"kvtier-development-secret-0001!!");
        assert!(seen.insert(base.build(&blake.unwrap()).unwrap()));
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(HashSecret::new(HashScheme::Xxh3Keyed, b"short").is_err());
        assert!(HashSecret::new(HashScheme::Xxh3Keyed, &[7u8; 64]).is_err());
        let secret = HashSecret::development();
        assert!(
            NamespaceBuilder::new("m", 1)
                .tensor_parallel(2, 2)
                .build(&secret)
                .is_err()
        );
        assert!(
            NamespaceBuilder::new("x".repeat(5000), 1)
                .build(&secret)
                .is_err()
        );
        let ns = NamespaceBuilder::new("m", 1).build(&secret).unwrap();
        assert!(PrefixHasher::new(secret.clone(), ns, 3).is_err());
        assert!(PrefixHasher::new(secret.clone(), ns, 1024).is_err());
        let mut h = PrefixHasher::new(secret, ns, 4).unwrap();
        assert_eq!(
            h.block_key(None, &[1, 2, 3]),
            Err(CoreError::TokenCount {
                expected: 4,
                got: 3
            })
        );
        assert!(
            HashScheme::parse("md5")
                .unwrap_err()
                .to_string()
                .contains("xxh3")
        );
    }

    #[test]
    fn hex_round_trip_and_secret_not_printed() {
        let k = BlockKey::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff);
        assert_eq!(BlockKey::from_hex(&k.to_string()), Some(k));
        assert_eq!(BlockKey::from_hex("zz"), None);
        let dbg = format!("{:?}", HashSecret::development());
        assert!(!dbg.contains("development-secret"));
    }
}

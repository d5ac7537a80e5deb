//! How a server with tenants maps a client's block keys to its internal keys (`docs/
//! operations.md`, "Tenants"), in two steps, so that a client can be given its own
//! namespace's mapping and nothing more:
//!
//! 1. the **namespace key**: `SHA-256("kvtier tenant namespace v3" || secret || len(name) as
//!    u64 LE || name)`, from the server's secret and the namespace's name (`tenant:NAME`,
//!    `group:NAME` or `unix`). By name, not by number: adding a tenant changes no other
//!    namespace's keys.
//! 2. the **internal key** of a client's key: `HMAC-SHA256(namespace key, key)[..16]`.
//!
//! The server computes both; a local client trusted with the arena is sent its namespace's
//! key at hello and computes step 2 to probe the published slot table. Knowing one namespace
//! key tells nothing of the secret (SHA-256 is one-way) nor of another namespace's key (each
//! hashes its own name with the secret).
//!
//! Step 2 is HMAC rather than `SHA-256(namespace key || key)`: HMAC is the standard keyed
//! pseudo-random function, so no argument about length extension or key/message framing is
//! needed, and it costs little more: `ring` precomputes the padded key's inner and outer
//! states once per [`KeyMap`], leaving two SHA-256 compressions per key.

use ring::{digest, hmac};

use crate::BlockKey;

/// Bytes of a namespace key.
pub const NAMESPACE_KEY_BYTES: usize = 32;

/// Prefix of the namespace key's digest (version 3 of the derivation; version 2 hashed the
/// secret, the name and the key in one step, so blocks stored under it are not found).
const NAMESPACE_DOMAIN: &[u8] = b"kvtier tenant namespace v3";

/// One namespace's key mapping: client keys to internal keys.
#[derive(Clone)]
pub struct KeyMap {
    bytes: [u8; NAMESPACE_KEY_BYTES],
    hmac: hmac::Key,
}

impl std::fmt::Debug for KeyMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret of its namespace: never in logs.
        f.write_str("KeyMap(..)")
    }
}

impl KeyMap {
    /// The mapping of namespace `name` under the server's `secret` (step 1, then ready for 2).
    pub fn derive(secret: &[u8; 32], name: &str) -> Self {
        let mut c = digest::Context::new(&digest::SHA256);
        c.update(NAMESPACE_DOMAIN);
        c.update(secret);
        c.update(&(name.len() as u64).to_le_bytes());
        c.update(name.as_bytes());
        let mut bytes = [0u8; NAMESPACE_KEY_BYTES];
        bytes.copy_from_slice(c.finish().as_ref());
        Self::from_bytes(bytes)
    }

    /// The mapping of a namespace key (as a client receives it at hello).
    pub fn from_bytes(bytes: [u8; NAMESPACE_KEY_BYTES]) -> Self {
        Self {
            bytes,
            hmac: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
        }
    }

    /// The namespace key.
    pub fn bytes(&self) -> &[u8; NAMESPACE_KEY_BYTES] {
        &self.bytes
    }

    /// The internal key of a client's `key` (step 2).
    pub fn internal(&self, key: BlockKey) -> BlockKey {
        let tag = hmac::sign(&self.hmac, key.as_bytes());
        let mut b = [0u8; 16];
        b.copy_from_slice(&tag.as_ref()[..16]);
        BlockKey::from_bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both steps against a computation written out independently (SHA-256 of the
    /// concatenation, then HMAC by its definition over SHA-256), so the layout of each step is
    /// pinned, not just self-consistent.
    #[test]
    fn both_steps_match_their_definition() {
        let secret = [7u8; 32];
        let name = "tenant:a";
        let mut msg = b"kvtier tenant namespace v3".to_vec();
        msg.extend_from_slice(&secret);
        msg.extend_from_slice(&8u64.to_le_bytes());
        msg.extend_from_slice(name.as_bytes());
        let ns = digest::digest(&digest::SHA256, &msg);
        let m = KeyMap::derive(&secret, name);
        assert_eq!(m.bytes().as_slice(), ns.as_ref());

        let key = BlockKey::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        // HMAC (RFC 2104) with a 32-byte key: H((K ^ opad) || H((K ^ ipad) || m)).
        let pad = |x: u8| {
            let mut p = [x; 64];
            for (p, k) in p.iter_mut().zip(m.bytes()) {
                *p ^= k;
            }
            p
        };
        let mut inner = pad(0x36).to_vec();
        inner.extend_from_slice(key.as_bytes());
        let mut outer = pad(0x5c).to_vec();
        outer.extend_from_slice(digest::digest(&digest::SHA256, &inner).as_ref());
        let tag = digest::digest(&digest::SHA256, &outer);
        assert_eq!(m.internal(key).as_bytes().as_slice(), &tag.as_ref()[..16]);

        // A client given the namespace key maps exactly as the server does.
        let client = KeyMap::from_bytes(*m.bytes());
        assert_eq!(client.internal(key), m.internal(key));
    }

    #[test]
    fn namespaces_and_secrets_map_apart() {
        let key = BlockKey::from_u128(42);
        let a = KeyMap::derive(&[1; 32], "tenant:a");
        let b = KeyMap::derive(&[1; 32], "tenant:b");
        let a2 = KeyMap::derive(&[2; 32], "tenant:a");
        let g = KeyMap::derive(&[1; 32], "group:a");
        assert_ne!(a.internal(key), b.internal(key));
        assert_ne!(a.internal(key), a2.internal(key));
        assert_ne!(g.internal(key), a.internal(key));
        assert_ne!(a.bytes(), b.bytes());
        assert_eq!(
            a.internal(key),
            KeyMap::derive(&[1; 32], "tenant:a").internal(key)
        );
    }
}

//! The metadata blob an agent exports and a peer loads to reach its regions.
//!
//! Layout: a 16-byte header (`KVTXMETA`, version u16 LE, reserved u16 = 0, body length u32 LE)
//! then the body, a wincode encoding of [`AgentMetadata`]. Decoding checks the header, the
//! exact length, the size limits below and every field's shape before anything uses it.
//! The blob carries the agent's auth token: treat it as a secret.

use std::net::SocketAddr;

use wincode::{SchemaRead, SchemaWrite};

use crate::error::{Result, TransferError};
use crate::region::MemKind;

pub(crate) const MAGIC: [u8; 8] = *b"KVTXMETA";
pub(crate) const VERSION: u16 = 1;
pub(crate) const HEADER_BYTES: usize = 16;
/// Largest blob accepted.
pub const MAX_BLOB_BYTES: usize = 16 << 20;
/// Most regions one blob may list.
pub const MAX_REGIONS: usize = 1 << 16;
const MAX_NAME_BYTES: usize = 256;
const MAX_PATH_BYTES: usize = 4096;
const MAX_CERT_BYTES: usize = 16 << 10;
const MAX_KEY_BYTES: usize = 4096;
/// Bytes of an agent's auth token.
pub const TOKEN_BYTES: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub(crate) struct AgentMetadata {
    pub name: String,
    pub pid: u32,
    pub token: Vec<u8>,
    pub tcp: Option<String>,
    pub quic: Option<QuicEndpoint>,
    pub shm: Option<ShmEndpoint>,
    pub ucx: Option<Vec<u8>>,
    pub regions: Vec<RegionMeta>,
}

#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub(crate) struct QuicEndpoint {
    pub addr: String,
    pub cert_der: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub(crate) struct ShmEndpoint {
    /// Abstract Unix socket name of the control channel (notifications, liveness).
    pub control: Vec<u8>,
    /// `/proc/<pid>/fd/<n>` of the region table.
    pub table_path: String,
    pub table_slots: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub(crate) struct RegionMeta {
    pub id: u64,
    pub kind: u8,
    pub len: u64,
    pub addr: u64,
    /// `/proc/<pid>/fd/<n>` and table slot, for regions a same-host peer can map.
    pub shm: Option<ShmRegion>,
    /// Packed UCX remote key.
    pub ucx_rkey: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub(crate) struct ShmRegion {
    pub path: String,
    pub slot: u32,
}

fn bad(reason: impl Into<String>) -> TransferError {
    TransferError::Metadata {
        reason: reason.into(),
    }
}

impl AgentMetadata {
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let body = wincode::serialize(self).map_err(|e| bad(format!("encoding: {e}")))?;
        if body.len() + HEADER_BYTES > MAX_BLOB_BYTES {
            return Err(bad(format!(
                "the blob would be {} bytes, over the {MAX_BLOB_BYTES}-byte limit",
                body.len() + HEADER_BYTES
            )));
        }
        let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    pub(crate) fn decode(blob: &[u8]) -> Result<Self> {
        if blob.len() > MAX_BLOB_BYTES {
            return Err(bad(format!(
                "{} bytes, over the {MAX_BLOB_BYTES}-byte limit",
                blob.len()
            )));
        }
        let header = blob
            .get(..HEADER_BYTES)
            .ok_or_else(|| bad(format!("{} bytes, shorter than the header", blob.len())))?;
        if header[..8] != MAGIC {
            return Err(bad("wrong magic (not a kvtier transfer metadata blob)"));
        }
        let version = u16::from_le_bytes([header[8], header[9]]);
        if version != VERSION {
            return Err(bad(format!(
                "version {version}, this build reads {VERSION}"
            )));
        }
        if header[10..12] != [0, 0] {
            return Err(bad("reserved header bytes are not zero"));
        }
        let body_len = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
        let body = &blob[HEADER_BYTES..];
        if body.len() != body_len as usize {
            return Err(bad(format!(
                "header announces {body_len} body bytes, {} present",
                body.len()
            )));
        }
        let meta: AgentMetadata =
            wincode::deserialize_exact(body).map_err(|e| bad(format!("body: {e}")))?;
        meta.validate()?;
        Ok(meta)
    }

    fn validate(&self) -> Result<()> {
        if self.name.is_empty() || self.name.len() > MAX_NAME_BYTES {
            return Err(bad(format!(
                "agent name of {} bytes (1..={MAX_NAME_BYTES})",
                self.name.len()
            )));
        }
        if self.token.len() != TOKEN_BYTES {
            return Err(bad(format!(
                "token of {} bytes, expected {TOKEN_BYTES}",
                self.token.len()
            )));
        }
        if let Some(addr) = &self.tcp {
            parse_addr("tcp", addr)?;
        }
        if let Some(q) = &self.quic {
            parse_addr("quic", &q.addr)?;
            if q.cert_der.is_empty() || q.cert_der.len() > MAX_CERT_BYTES {
                return Err(bad(format!(
                    "QUIC certificate of {} bytes (1..={MAX_CERT_BYTES})",
                    q.cert_der.len()
                )));
            }
        }
        if let Some(s) = &self.shm {
            if s.control.is_empty() || s.control.len() > 107 {
                return Err(bad("shared-memory control socket name of a bad length"));
            }
            check_path(&s.table_path)?;
            if s.table_slots == 0 || s.table_slots as usize > MAX_REGIONS {
                return Err(bad(format!("{} region-table slots", s.table_slots)));
            }
        }
        if let Some(u) = &self.ucx
            && (u.is_empty() || u.len() > MAX_KEY_BYTES)
        {
            return Err(bad(format!("UCX worker address of {} bytes", u.len())));
        }
        if self.regions.len() > MAX_REGIONS {
            return Err(bad(format!(
                "{} regions, over the {MAX_REGIONS} limit",
                self.regions.len()
            )));
        }
        let mut ids = std::collections::HashSet::with_capacity(self.regions.len());
        for r in &self.regions {
            if !ids.insert(r.id) {
                return Err(bad(format!("region {} listed twice", r.id)));
            }
            if MemKind::from_code(r.kind).is_none() {
                return Err(bad(format!("region {} has unknown kind {}", r.id, r.kind)));
            }
            if r.len == 0 {
                return Err(bad(format!("region {} has zero length", r.id)));
            }
            if let Some(s) = &r.shm {
                check_path(&s.path)?;
                let slots = self.shm.as_ref().map_or(0, |e| e.table_slots);
                if s.slot >= slots {
                    return Err(bad(format!(
                        "region {} sits in table slot {} of {slots}",
                        r.id, s.slot
                    )));
                }
            }
            if let Some(k) = &r.ucx_rkey
                && (k.is_empty() || k.len() > MAX_KEY_BYTES)
            {
                return Err(bad(format!(
                    "region {} has a UCX key of {} bytes",
                    r.id,
                    k.len()
                )));
            }
        }
        Ok(())
    }
}

pub(crate) fn parse_addr(what: &str, addr: &str) -> Result<SocketAddr> {
    addr.parse()
        .map_err(|_| bad(format!("{what} address {addr:?} is not a socket address")))
}

fn check_path(path: &str) -> Result<()> {
    if path.is_empty() || path.len() > MAX_PATH_BYTES || path.contains('\0') {
        return Err(bad(format!("path of {} bytes", path.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "a".into(),
            pid: 7,
            token: vec![1; TOKEN_BYTES],
            tcp: Some("127.0.0.1:9".into()),
            quic: Some(QuicEndpoint {
                addr: "127.0.0.1:10".into(),
                cert_der: vec![3; 40],
            }),
            shm: Some(ShmEndpoint {
                control: b"x".to_vec(),
                table_path: "/proc/1/fd/3".into(),
                table_slots: 16,
            }),
            ucx: None,
            regions: vec![RegionMeta {
                id: 1,
                kind: 0,
                len: 4096,
                addr: 0,
                shm: Some(ShmRegion {
                    path: "/proc/1/fd/4".into(),
                    slot: 2,
                }),
                ucx_rkey: None,
            }],
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        let blob = m.encode().unwrap();
        assert_eq!(AgentMetadata::decode(&blob).unwrap(), m);
    }

    #[test]
    fn every_truncation_and_single_byte_flip_is_an_error_or_a_valid_blob() {
        let blob = sample().encode().unwrap();
        for cut in 0..blob.len() {
            assert!(AgentMetadata::decode(&blob[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..blob.len() {
            for bit in 0..8 {
                let mut b = blob.clone();
                b[i] ^= 1 << bit;
                // Must not panic; a flip inside a string or number can still decode.
                if let Ok(m) = AgentMetadata::decode(&b) {
                    m.validate().unwrap();
                }
            }
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let check = |f: &dyn Fn(&mut AgentMetadata), needle: &str| {
            let mut m = sample();
            f(&mut m);
            let err = AgentMetadata::decode(&m.encode().unwrap()).unwrap_err();
            assert!(err.to_string().contains(needle), "{err} lacks {needle}");
        };
        check(&|m| m.name.clear(), "agent name");
        check(&|m| m.token.pop().map(drop).unwrap_or(()), "token");
        check(&|m| m.tcp = Some("nope".into()), "not a socket address");
        check(&|m| m.regions.push(m.regions[0].clone()), "listed twice");
        check(&|m| m.regions[0].kind = 9, "unknown kind");
        check(&|m| m.regions[0].len = 0, "zero length");
        check(
            &|m| m.regions[0].shm.as_mut().unwrap().slot = 16,
            "table slot",
        );
    }

    #[test]
    fn rejects_bad_headers() {
        let blob = sample().encode().unwrap();
        let mut b = blob.clone();
        b[0] = b'X';
        assert!(
            AgentMetadata::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
        let mut b = blob.clone();
        b[8] = 2;
        assert!(
            AgentMetadata::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
        let mut b = blob.clone();
        b.push(0);
        assert!(
            AgentMetadata::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("announces")
        );
        let huge = vec![0u8; MAX_BLOB_BYTES + 1];
        assert!(
            AgentMetadata::decode(&huge)
                .unwrap_err()
                .to_string()
                .contains("limit")
        );
    }

    proptest::proptest! {
        /// Arbitrary bytes, with or without a valid header in front: an error or a valid
        /// blob, never a panic.
        #[test]
        fn decode_never_panics(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), with_header in proptest::bool::ANY) {
            let mut blob = Vec::new();
            if with_header {
                blob.extend_from_slice(&MAGIC);
                blob.extend_from_slice(&VERSION.to_le_bytes());
                blob.extend_from_slice(&0u16.to_le_bytes());
                blob.extend_from_slice(&(body.len() as u32).to_le_bytes());
            }
            blob.extend_from_slice(&body);
            if let Ok(m) = AgentMetadata::decode(&blob) {
                proptest::prop_assert!(m.validate().is_ok());
            }
        }
    }
}

//! The frame header of the stream protocol (TCP, QUIC, and the shared-memory control channel).
//! Sans-IO: encoding and checked decoding only; the byte table is in `docs/transfer.md`.

/// `KVTX` read as a little-endian u32.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"KVTX");
pub(crate) const VERSION: u8 = 1;
pub(crate) const HEADER_BYTES: usize = 40;
/// Largest data payload in one frame (a chunk).
pub(crate) const MAX_CHUNK_BYTES: u32 = 64 << 20;
/// Largest notification message.
pub const MAX_NOTIFICATION_BYTES: usize = 64 << 10;
/// Largest agent name.
pub(crate) const MAX_NAME_BYTES: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum FrameOp {
    Hello = 1,
    HelloAck = 2,
    Write = 3,
    WriteAck = 4,
    Read = 5,
    ReadData = 6,
    Notify = 7,
    NotifyAck = 8,
    /// Is region `region` still registered? (UCX's liveness check after RMA.)
    Check = 9,
    CheckAck = 10,
}

impl FrameOp {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Write,
            4 => Self::WriteAck,
            5 => Self::Read,
            6 => Self::ReadData,
            7 => Self::Notify,
            8 => Self::NotifyAck,
            9 => Self::Check,
            10 => Self::CheckAck,
            _ => return None,
        })
    }

    /// Largest payload a frame of this op may carry.
    fn max_payload(self) -> u32 {
        match self {
            Self::Hello => (crate::metadata::TOKEN_BYTES + MAX_NAME_BYTES) as u32,
            Self::Write | Self::ReadData => MAX_CHUNK_BYTES,
            Self::Notify => MAX_NOTIFICATION_BYTES as u32,
            // READ's `len` is the requested length, not a payload (checked as a chunk).
            Self::Read => MAX_CHUNK_BYTES,
            Self::HelloAck | Self::WriteAck | Self::NotifyAck | Self::Check | Self::CheckAck => 0,
        }
    }
}

/// Reply status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    RegionNotFound = 1,
    OutOfBounds = 2,
    AuthFailed = 3,
    UnsupportedMemory = 4,
    /// A WRITE into a region its agent made read-only to peers.
    ReadOnly = 5,
}

impl Status {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Ok,
            1 => Self::RegionNotFound,
            2 => Self::OutOfBounds,
            3 => Self::AuthFailed,
            4 => Self::UnsupportedMemory,
            5 => Self::ReadOnly,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub op: FrameOp,
    pub status: Status,
    pub id: u64,
    pub region: u64,
    pub offset: u64,
    pub len: u32,
}

impl Header {
    pub(crate) fn new(op: FrameOp, id: u64, region: u64, offset: u64, len: u32) -> Self {
        Self {
            op,
            status: Status::Ok,
            id,
            region,
            offset,
            len,
        }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.op as u8;
        b[6] = self.status as u8;
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.region.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks a header; the error says what is wrong.
    pub(crate) fn decode(b: &[u8; HEADER_BYTES]) -> Result<Self, String> {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(format!("bad frame magic {magic:#010x}"));
        }
        if b[4] != VERSION {
            return Err(format!("frame version {}, expected {VERSION}", b[4]));
        }
        let op = FrameOp::from_u8(b[5]).ok_or_else(|| format!("unknown frame op {}", b[5]))?;
        let status =
            Status::from_u8(b[6]).ok_or_else(|| format!("unknown frame status {}", b[6]))?;
        if b[7] != 0 || b[36..40] != [0, 0, 0, 0] {
            return Err("reserved frame bytes are not zero".into());
        }
        let len = u32::from_le_bytes([b[32], b[33], b[34], b[35]]);
        if len > op.max_payload() {
            return Err(format!(
                "{op:?} frame of {len} bytes, over its {}-byte limit",
                op.max_payload()
            ));
        }
        Ok(Self {
            op,
            status,
            id: u64_at(8),
            region: u64_at(16),
            offset: u64_at(24),
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let mut h = Header::new(FrameOp::Write, 7, 9, 1 << 40, 4096);
        h.status = Status::OutOfBounds;
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_each_bad_field() {
        let good = Header::new(FrameOp::Write, 1, 2, 3, 4).encode();
        let check = |i: usize, v: u8, needle: &str| {
            let mut b = good;
            b[i] = v;
            let e = Header::decode(&b).unwrap_err();
            assert!(e.contains(needle), "byte {i}={v}: {e}");
        };
        check(0, b'X', "magic");
        check(4, 9, "version");
        check(5, 0, "op");
        check(5, 99, "op");
        check(6, 77, "status");
        check(7, 1, "reserved");
        check(39, 1, "reserved");
        // WRITE_ACK carries no payload.
        let mut b = Header::new(FrameOp::WriteAck, 1, 2, 3, 1).encode();
        assert!(Header::decode(&b).unwrap_err().contains("limit"));
        b = Header::new(FrameOp::Notify, 1, 0, 0, MAX_NOTIFICATION_BYTES as u32 + 1).encode();
        assert!(Header::decode(&b).unwrap_err().contains("limit"));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_BYTES)) {
            let mut b = [0u8; HEADER_BYTES];
            b.copy_from_slice(&bytes);
            if let Ok(h) = Header::decode(&b) {
                prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
            }
        }
    }
}

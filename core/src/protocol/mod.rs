//! The kvtier wire protocol: a fixed 32-byte little-endian header, then `meta_len` bytes of
//! metadata encoded with wincode, then `payload_len` raw bytes (block payloads, never run
//! through a serializer). Byte tables in `docs/protocol.md`.
//!
//! This module does no I/O (the server and the SDK bring their own sockets), so every part of
//! it is testable and fuzzable on byte slices:
//! * [`Header`]: encode and validate the fixed header (magic, version, reserved bits, limits).
//! * [`message`]: the metadata of every request and response, and [`Request::decode`] /
//!   [`Response::decode`], which check every count against [`Limits`].
//! * [`decode_frame`]: a whole frame from one buffer (used by the fuzz target and tests).

/// A wire code: an enum with explicit discriminants, `ALL`, and a checked conversion from
/// the raw value (an unknown value is `None`, never a panic).
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident: $repr:ident, $from:ident {
            $($(#[$vmeta:meta])* $variant:ident = $value:expr,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            pub fn $from(v: $repr) -> Option<Self> {
                Self::ALL.iter().copied().find(|c| *c as $repr == v)
            }
        }
    };
}

pub mod message;

pub use message::{
    BlockEvent, BlockSource, BlockSum, ErrorCode, ErrorReply, EventKind, Events, FetchReply, Hello,
    HelloReply, KeyList, LocateReply, MAX_NODE_BYTES, MAX_RETAIN_PRIORITY, MAX_RETAIN_RETURN_MS,
    MissCode, PinReply, PinnedSlot, PutEntry, PutReply, PutStatus, Request, ReserveReply,
    ReservedSlot, Response, RetainHint, RetainReply, RetainStatus, TierCode, append_key_list_meta,
    block_sum,
};

use thiserror::Error;

/// `"KVT1"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVT1");
/// The protocol version this build speaks. A hello names the range a client speaks; the
/// server answers with the highest version both know. Version 4 adds the lookup reply's
/// remote tier and sources ([`Response::Lookup`]); nothing else differs from 3.
pub const VERSION: u16 = 4;
/// The version every frame's header carries. The framing has not changed since version 3,
/// so a side that speaks only 3 reads every frame of a newer one (and its hello, whose range
/// settles the version): what a newer version adds is in the metadata of the version the
/// hello agreed on. A header with any version from [`MIN_VERSION`] to [`VERSION`] is read.
pub const HEADER_VERSION: u16 = 3;
/// Oldest protocol version this build still speaks.
pub const MIN_VERSION: u16 = 3;
/// QUIC flow-control window (per stream and per connection) of kvtier's QUIC peers: a couple
/// of 2 MiB blocks in flight, and no more, because quinn buffers what is in flight in its own
/// memory, so the window bounds a server's memory per QUIC connection.
pub const QUIC_WINDOW_BYTES: u32 = 4 << 20;
/// ALPN protocol of the TLS-over-TCP transport (`tls://`): the same frames inside TLS. A
/// client that offers other protocols only is refused in the handshake.
pub const TLS_ALPN: &[u8] = b"kvtier/1";
/// Size of the fixed header.
pub const HEADER_BYTES: usize = 32;

/// Header flags.
pub mod flags {
    /// Set on every frame sent by the server in answer to a request (or an event).
    pub const RESPONSE: u8 = 1 << 0;
    /// The metadata is an [`super::ErrorReply`].
    pub const ERROR: u8 = 1 << 1;
    /// A pushed event frame on a subscription (request id = the subscribe's id).
    pub const EVENT: u8 = 1 << 2;
    /// The sender wants no answer (release, abort): the server sends none unless it fails.
    pub const NO_REPLY: u8 = 1 << 3;
    /// Every flag this version defines; any other bit is a framing error.
    pub const KNOWN: u8 = RESPONSE | ERROR | EVENT | NO_REPLY;
}

wire_enum! {
    /// Operation codes. Unknown codes are answered with [`ErrorCode::UnknownOp`] (the frame is
    /// well formed, so the connection stays open).
    pub enum Opcode: u8, from_u8 {
        Hello = 1,
        Ping = 2,
        Lookup = 3,
        Get = 4,
        Put = 5,
        Prefetch = 6,
        Pin = 7,
        Release = 8,
        Reserve = 9,
        Commit = 10,
        Abort = 11,
        Remove = 12,
        Clear = 13,
        Stats = 14,
        Subscribe = 15,
        /// Cluster peers only: a get whose reply carries a checksum per block.
        Fetch = 16,
        /// Cluster peers only: a pin whose reply carries a checksum per block, ahead of a
        /// one-sided read of the pinned slots over kvtier-transfer.
        Locate = 17,
        Retain = 20,
    }
}

impl Opcode {
    /// Lower-case name, as used in metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Hello => "hello",
            Opcode::Ping => "ping",
            Opcode::Lookup => "lookup",
            Opcode::Get => "get",
            Opcode::Put => "put",
            Opcode::Prefetch => "prefetch",
            Opcode::Pin => "pin",
            Opcode::Release => "release",
            Opcode::Reserve => "reserve",
            Opcode::Commit => "commit",
            Opcode::Abort => "abort",
            Opcode::Remove => "remove",
            Opcode::Clear => "clear",
            Opcode::Stats => "stats",
            Opcode::Subscribe => "subscribe",
            Opcode::Fetch => "fetch",
            Opcode::Locate => "locate",
            Opcode::Retain => "retain",
        }
    }

    /// Whether requests of this kind may carry a payload.
    pub fn carries_payload(self) -> bool {
        self == Opcode::Put
    }
}

/// Bounds on every length a peer sends. The server announces its own in the hello reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest metadata section accepted. Default: 1 MiB. A request must fit both this and
    /// `max_keys`: with the defaults this binds first (a 65,536-key list is 1 MiB + 8 B; see
    /// `docs/protocol.md`).
    pub max_meta_bytes: u32,
    /// Most keys in one request. Default: 65,536.
    pub max_keys: u32,
    /// Largest payload of one frame. Default: 256 MiB.
    pub max_payload_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_meta_bytes: 1 << 20,
            max_keys: 65_536,
            max_payload_bytes: 256 << 20,
        }
    }
}

/// The fixed frame header. See `docs/protocol.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u16,
    /// The raw opcode byte (decoded with [`Opcode::from_u8`], so an unknown one can still be
    /// answered by request id).
    pub opcode: u8,
    pub flags: u8,
    pub request_id: u64,
    pub meta_len: u32,
    pub payload_len: u64,
}

/// A frame the decoder cannot accept. [`FrameError::is_fatal`] tells whether the byte
/// stream can continue (the frame was well delimited) or must be closed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("bad magic {found:#010x} (expected {MAGIC:#010x}): not a kvtier peer")]
    BadMagic { found: u32 },
    #[error("protocol version {found} not spoken (this side speaks {MIN_VERSION}..={VERSION})")]
    BadVersion { found: u16 },
    #[error("unknown header flags {found:#04x}")]
    BadFlags { found: u8 },
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("{what} of {got} bytes exceeds the limit of {limit}")]
    TooLong {
        what: &'static str,
        got: u64,
        limit: u64,
    },
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated { need: u64, have: u64 },
    #[error("unknown opcode {0}")]
    UnknownOpcode(u8),
    #[error("{op} does not take a payload ({len} bytes sent)")]
    UnexpectedPayload { op: &'static str, len: u64 },
    #[error("bad {what} metadata: {reason}")]
    BadMeta { what: &'static str, reason: String },
    #[error("{what}: {count} keys exceeds the limit of {limit}")]
    TooManyKeys {
        what: &'static str,
        count: u64,
        limit: u32,
    },
}

impl FrameError {
    /// True when the stream's framing is lost (bad magic, version, flags, or a length over
    /// its limit): the receiver answers once if it can and closes the connection. Otherwise
    /// the frame was delimited and only it is refused.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            FrameError::BadMagic { .. }
                | FrameError::BadVersion { .. }
                | FrameError::BadFlags { .. }
                | FrameError::Reserved
                | FrameError::TooLong { .. }
                | FrameError::Truncated { .. }
        )
    }

    /// The error code a server answers with.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::UnknownOpcode(_) => ErrorCode::UnknownOp,
            FrameError::TooLong { .. } | FrameError::TooManyKeys { .. } => ErrorCode::TooLarge,
            FrameError::BadVersion { .. } => ErrorCode::VersionMismatch,
            _ => ErrorCode::BadRequest,
        }
    }
}

impl Header {
    pub fn request(op: Opcode, request_id: u64, meta_len: usize, payload_len: u64) -> Self {
        Self {
            version: HEADER_VERSION,
            opcode: op as u8,
            flags: 0,
            request_id,
            meta_len: meta_len as u32,
            payload_len,
        }
    }

    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.opcode)
    }

    pub fn is(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6] = self.opcode;
        b[7] = self.flags;
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        // 20..24 reserved, zero.
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and validates a header against `limits`. Every error here is fatal for the
    /// stream (see [`FrameError::is_fatal`]).
    pub fn decode(b: &[u8; HEADER_BYTES], limits: &Limits) -> Result<Self, FrameError> {
        let le32 = |r: std::ops::Range<usize>| {
            u32::from_le_bytes(b[r].try_into().expect("4-byte range of a 32-byte array"))
        };
        let le64 = |r: std::ops::Range<usize>| {
            u64::from_le_bytes(b[r].try_into().expect("8-byte range of a 32-byte array"))
        };
        let magic = le32(0..4);
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(FrameError::BadVersion { found: version });
        }
        let flags = b[7];
        if flags & !flags::KNOWN != 0 {
            return Err(FrameError::BadFlags { found: flags });
        }
        if le32(20..24) != 0 {
            return Err(FrameError::Reserved);
        }
        let h = Header {
            version,
            opcode: b[6],
            flags,
            request_id: le64(8..16),
            meta_len: le32(16..20),
            payload_len: le64(24..32),
        };
        if h.meta_len > limits.max_meta_bytes {
            return Err(FrameError::TooLong {
                what: "metadata",
                got: u64::from(h.meta_len),
                limit: u64::from(limits.max_meta_bytes),
            });
        }
        if h.payload_len > limits.max_payload_bytes {
            return Err(FrameError::TooLong {
                what: "payload",
                got: h.payload_len,
                limit: limits.max_payload_bytes,
            });
        }
        Ok(h)
    }
}

/// A whole frame parsed from one buffer: `(header, request or response, payload)`.
pub type Frame<'a> = (Header, FrameBody, &'a [u8]);

/// The decoded metadata of a frame.
#[derive(Clone, Debug, PartialEq)]
pub enum FrameBody {
    Request(Request),
    Response(Response),
}

/// Parses one complete frame from the start of `buf`; returns it and the bytes it used.
/// Requests and responses are told apart by the RESPONSE flag.
pub fn decode_frame<'a>(buf: &'a [u8], limits: &Limits) -> Result<(Frame<'a>, usize), FrameError> {
    let head: &[u8; HEADER_BYTES] = buf
        .get(..HEADER_BYTES)
        .and_then(|s| s.try_into().ok())
        .ok_or(FrameError::Truncated {
            need: HEADER_BYTES as u64,
            have: buf.len() as u64,
        })?;
    let h = Header::decode(head, limits)?;
    let meta_end = HEADER_BYTES + h.meta_len as usize;
    let total = (meta_end as u64).saturating_add(h.payload_len);
    if (buf.len() as u64) < total {
        return Err(FrameError::Truncated {
            need: total,
            have: buf.len() as u64,
        });
    }
    let meta = &buf[HEADER_BYTES..meta_end];
    let payload = &buf[meta_end..total as usize];
    let body = if h.is(flags::RESPONSE) {
        FrameBody::Response(Response::decode(&h, meta, limits)?)
    } else {
        let op = h.opcode().ok_or(FrameError::UnknownOpcode(h.opcode))?;
        FrameBody::Request(Request::decode(op, meta, h.payload_len, limits)?)
    };
    Ok(((h, body, payload), total as usize))
}

#[cfg(test)]
mod tests;

//! Metadata of every request and response. Each is a wincode struct (bincode-1 compatible
//! layout: integers little-endian fixed width, sequences and strings prefixed with a u64
//! length, `Option` as a 0/1 byte then the value). Codes travel as `u8`/`u16` with explicit
//! conversions, so an unknown code is a clear error and not a panic.

use wincode::{SchemaRead, SchemaWrite};

use super::{FrameError, Header, Limits, Opcode, flags};
use crate::BlockKey;

/// Longest client name or server name accepted in a hello.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest auth token accepted in a hello.
pub const MAX_TOKEN_BYTES: usize = 1024;
/// Longest error message or stats document a client accepts.
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// Latest expected return a retention hint may announce: one day, in milliseconds.
pub const MAX_RETAIN_RETURN_MS: u64 = 86_400_000;
/// Highest priority of a retention hint (0 is the lowest).
pub const MAX_RETAIN_PRIORITY: u8 = 7;

wire_enum! {
    /// A tier on the wire.
    pub enum TierCode: u8, from_u8 {
        Hbm = 0,
        Dram = 1,
        Nvme = 2,
        /// Lookup replies only (protocol version 4): the block was not on the answering
        /// server; another member of its cluster held it, and the lookup fetched it into
        /// this server's DRAM (where a get or pin now finds it). The reply's `sources` name
        /// the member. Never a tier of a stored block (events, gets, pins).
        Remote = 3,
    }
}

impl TierCode {
    /// The three tiers a block is stored in (what events, gets and pins report).
    pub const STORED: [TierCode; 3] = [TierCode::Hbm, TierCode::Dram, TierCode::Nvme];

    pub fn name(self) -> &'static str {
        match self {
            TierCode::Hbm => "hbm",
            TierCode::Dram => "dram",
            TierCode::Nvme => "nvme",
            TierCode::Remote => "remote",
        }
    }

    /// A code of a stored tier ([`Self::STORED`]); `None` for an unknown code and for
    /// [`TierCode::Remote`], which no stored block has.
    pub fn stored_from_u8(v: u8) -> Option<Self> {
        Self::from_u8(v).filter(|t| *t != TierCode::Remote)
    }

    /// The tier whose bytes a get of this block reads on the server that answered the
    /// lookup: a remote block was fetched into its DRAM.
    pub fn held(self) -> TierCode {
        match self {
            TierCode::Remote => TierCode::Dram,
            t => t,
        }
    }
}

/// Longest member name a lookup reply's source may carry.
pub const MAX_NODE_BYTES: usize = MAX_NAME_BYTES;

/// A run of a lookup reply's blocks that came from another member of the server's cluster
/// (protocol version 4): blocks `start..start + len` of the reply, each of tier
/// [`TierCode::Remote`], fetched from member `node` (its cluster node id).
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct BlockSource {
    pub start: u32,
    pub len: u32,
    pub node: String,
}

wire_enum! {
    /// Why blocks past a returned prefix were not served.
    pub enum MissCode: u8, from_u8 {
        /// Every key asked for was served.
        None = 0,
        NotCached = 1,
        /// The stored copy failed its checks; dropped and counted by the server.
        Corrupt = 2,
        IoError = 3,
        /// The server had no I/O capacity for the read just now.
        Busy = 4,
    }
}

wire_enum! {
    /// The fate of one block of a put or a reservation.
    pub enum PutStatus: u8, from_u8 {
        /// Stored (put, commit) or a slot is reserved at the given offset (reserve).
        Stored = 0,
        AlreadyPresent = 1,
        /// Refused: the server's copy queue is full.
        RejectedBacklog = 2,
        /// Refused: every slot is pinned.
        RejectedNoSlot = 3,
        /// Refused: the block's parent is not cached (a chain is stored in order).
        RejectedOrphan = 4,
        /// The server failed to store it (an I/O error, counted).
        Failed = 5,
    }
}

wire_enum! {
    /// Error codes of an [`ErrorReply`].
    pub enum ErrorCode: u16, from_u16 {
        /// Malformed metadata, or a request that makes no sense (wrong payload size, ...).
        BadRequest = 1,
        UnknownOp = 2,
        /// A length or count over the limits (announced in the hello reply).
        TooLarge = 3,
        /// No hello yet, or a wrong token.
        Unauthorized = 4,
        VersionMismatch = 5,
        /// The client's block size or layout differs from the server's.
        LayoutMismatch = 6,
        /// Over budget: retry later. Nothing was queued.
        Busy = 7,
        /// The lease or reservation named is unknown (released, expired, another connection's).
        NotFound = 8,
        /// The server is shutting down.
        ShuttingDown = 9,
        Internal = 10,
        /// The request needs the local (Unix socket) path, e.g. reserve/commit.
        LocalOnly = 11,
        /// Authenticated, but the caller's role does not allow the operation (`clear` needs
        /// the admin role when tenants are configured).
        Forbidden = 12,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct Hello {
    pub min_version: u16,
    pub max_version: u16,
    /// Free-form client name for logs (at most [`MAX_NAME_BYTES`]).
    pub client: String,
    /// Auth token (required on TCP and QUIC; ignored on the Unix socket).
    pub token: String,
    /// The block size the client will use; 0 = accept the server's.
    pub block_bytes: u64,
    /// Ask for the DRAM arena's file descriptor (Unix socket only).
    pub want_arena: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct HelloReply {
    pub version: u16,
    pub server: String,
    pub block_bytes: u64,
    pub layout_fingerprint: u64,
    /// Bytes of the arena whose fd rides with this frame (SCM_RIGHTS, read-only); 0 = no fd
    /// sent.
    pub arena_bytes: u64,
    /// Bytes of this connection's staging region, whose fd rides second with the arena's
    /// (read-write): `staging_bytes / block_bytes` block-sized places local puts are written
    /// into (a reserve's offsets point there). 0 = none (then no arena either).
    pub staging_bytes: u64,
    pub max_keys: u32,
    pub max_meta_bytes: u32,
    pub max_payload_bytes: u64,
    pub max_lease_ms: u64,
    /// The next event sequence number.
    pub event_seq: u64,
    /// Bytes of the published slot table, whose read-only fd rides third (after the arena's
    /// and the staging region's): local gets read DRAM hits through it with no message
    /// (`docs/protocol.md`, "Local gets without a message"). 0 = none sent (no arena).
    pub slot_table_bytes: u64,
    /// With tenants, sent with the slot table: the connection's namespace key
    /// ([`crate::key_map`]), which maps the client's keys to the internal keys the table
    /// holds. `None` without tenants (keys as sent) or without a slot table.
    pub namespace_key: Option<[u8; crate::key_map::NAMESPACE_KEY_BYTES]>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct KeyList {
    pub keys: Vec<BlockKey>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct PutEntry {
    pub key: BlockKey,
    /// The previous block of the chain; `None` for a prompt's first block.
    pub parent: Option<BlockKey>,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct PutMeta {
    entries: Vec<PutEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct PinMeta {
    keys: Vec<BlockKey>,
    lease_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct ReserveMeta {
    entries: Vec<PutEntry>,
    lease_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct IdMeta {
    id: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct SubscribeMeta {
    from_seq: Option<u64>,
    snapshot: bool,
}

/// A retention hint: the session's prefix will be looked up again in about `return_ms`.
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct RetainHint {
    /// The client's name for the session (0 = none). A later hint of the same session (in
    /// the same namespace) replaces the earlier one.
    pub session: u64,
    /// The prefix's chain keys, from its first block (at least 1, at most `max_keys`).
    pub keys: Vec<BlockKey>,
    /// When the session is expected back, in milliseconds from now (at most
    /// [`MAX_RETAIN_RETURN_MS`]).
    pub return_ms: u64,
    /// 0 (lowest) to [`MAX_RETAIN_PRIORITY`]: over the global budget, a hint displaces hints
    /// of lower priority.
    pub priority: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct Empty {}

/// A request's metadata, decoded and checked against [`Limits`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Hello(Hello),
    Ping,
    /// Longest cached prefix of the keys and the tier of each of its blocks.
    Lookup(KeyList),
    /// The blocks of the longest cached prefix, copied into the response payload.
    Get(KeyList),
    /// A get between cluster peers: the reply also carries each block's [`block_sum`], so
    /// the receiver verifies key, length and content before it stores a byte.
    Fetch(KeyList),
    /// Stores blocks; the payload is `entries.len() * block_bytes` bytes, in order.
    Put(Vec<PutEntry>),
    Prefetch(KeyList),
    /// Pins the longest cached prefix in DRAM for up to `lease_ms`; the reply gives arena
    /// offsets (readable in place by a local client).
    Pin {
        keys: Vec<BlockKey>,
        lease_ms: u64,
    },
    Release {
        lease_id: u64,
    },
    /// A pin between cluster peers: the reply also carries each pinned block's
    /// [`block_sum`], so the peer can read the slots one-sided (kvtier-transfer) and verify
    /// key, length and content before it stores a byte. Released like a pin.
    Locate {
        keys: Vec<BlockKey>,
        lease_ms: u64,
    },
    /// Reserves DRAM slots for a local client to fill in place (Unix socket only).
    Reserve {
        entries: Vec<PutEntry>,
        lease_ms: u64,
    },
    Commit {
        reservation_id: u64,
    },
    Abort {
        reservation_id: u64,
    },
    Remove(KeyList),
    Clear,
    Stats,
    /// Streams block events from `from_seq` (or from now). With `snapshot`, every cached
    /// block is first sent as a `Stored` event with sequence number 0; applying the
    /// snapshot and then the stream converges on the server's state.
    Subscribe {
        from_seq: Option<u64>,
        snapshot: bool,
    },
    /// Asks the server to keep a session's prefix in DRAM until the session comes back.
    Retain(RetainHint),
}

fn bad(what: &'static str, e: impl std::fmt::Display) -> FrameError {
    FrameError::BadMeta {
        what,
        reason: e.to_string(),
    }
}

fn dec<'de, T>(what: &'static str, meta: &'de [u8]) -> Result<T, FrameError>
where
    T: SchemaRead<'de, wincode::config::DefaultConfig, Dst = T>,
{
    wincode::deserialize_exact(meta).map_err(|e| bad(what, e))
}

/// Encoding is not limited (what we send is ours; the receiver enforces its limits).
fn enc<T>(v: &T) -> Vec<u8>
where
    T: SchemaWrite<EncodeConfig, Src = T>,
{
    // Serializing an in-memory value into a Vec fails only on allocation failure.
    wincode::config::serialize(v, ENCODE).expect("wincode serialization into a Vec")
}

/// Appends the metadata of a key-list request (`Lookup`, `Get`, `Fetch`, `Prefetch`,
/// `Remove`) of `keys` to `out`: the bytes [`Request::encode_meta`] gives for it, from a
/// borrowed list, with no buffer of its own (a local lookup sends a prompt's keys one way,
/// and three 64 KiB buffers a call cost more than the lookup).
pub fn append_key_list_meta(keys: &[BlockKey], out: &mut Vec<u8>) {
    // Serializing an in-memory value into a Vec fails only on allocation failure.
    wincode::config::serialize_into(out, keys, ENCODE).expect("wincode serialization into a Vec")
}

type EncodeConfig =
    wincode::config::Configuration<true, { wincode::config::PREALLOCATION_SIZE_LIMIT_DISABLED }>;
const ENCODE: EncodeConfig =
    wincode::config::Configuration::<true>::new().disable_preallocation_size_limit();

fn check_keys(what: &'static str, n: usize, limits: &Limits) -> Result<(), FrameError> {
    if n as u64 > u64::from(limits.max_keys) {
        return Err(FrameError::TooManyKeys {
            what,
            count: n as u64,
            limit: limits.max_keys,
        });
    }
    Ok(())
}

fn check_text(what: &'static str, s: &str, max: usize) -> Result<(), FrameError> {
    if s.len() > max {
        return Err(bad(what, format!("{} bytes, at most {max}", s.len())));
    }
    Ok(())
}

impl Request {
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Hello(_) => Opcode::Hello,
            Request::Ping => Opcode::Ping,
            Request::Lookup(_) => Opcode::Lookup,
            Request::Get(_) => Opcode::Get,
            Request::Fetch(_) => Opcode::Fetch,
            Request::Put(_) => Opcode::Put,
            Request::Prefetch(_) => Opcode::Prefetch,
            Request::Pin { .. } => Opcode::Pin,
            Request::Release { .. } => Opcode::Release,
            Request::Locate { .. } => Opcode::Locate,
            Request::Reserve { .. } => Opcode::Reserve,
            Request::Commit { .. } => Opcode::Commit,
            Request::Abort { .. } => Opcode::Abort,
            Request::Remove(_) => Opcode::Remove,
            Request::Clear => Opcode::Clear,
            Request::Stats => Opcode::Stats,
            Request::Subscribe { .. } => Opcode::Subscribe,
            Request::Retain(_) => Opcode::Retain,
        }
    }

    /// Encodes the metadata (the header is the caller's: it knows the payload).
    pub fn encode_meta(&self) -> Vec<u8> {
        match self {
            Request::Hello(h) => enc(h),
            Request::Ping | Request::Clear | Request::Stats => enc(&Empty {}),
            Request::Lookup(k)
            | Request::Get(k)
            | Request::Fetch(k)
            | Request::Prefetch(k)
            | Request::Remove(k) => enc(k),
            Request::Put(entries) => enc(&PutMeta {
                entries: entries.clone(),
            }),
            Request::Pin { keys, lease_ms } | Request::Locate { keys, lease_ms } => enc(&PinMeta {
                keys: keys.clone(),
                lease_ms: *lease_ms,
            }),
            Request::Reserve { entries, lease_ms } => enc(&ReserveMeta {
                entries: entries.clone(),
                lease_ms: *lease_ms,
            }),
            Request::Release { lease_id: id }
            | Request::Commit { reservation_id: id }
            | Request::Abort { reservation_id: id } => enc(&IdMeta { id: *id }),
            Request::Subscribe { from_seq, snapshot } => enc(&SubscribeMeta {
                from_seq: *from_seq,
                snapshot: *snapshot,
            }),
            Request::Retain(h) => enc(h),
        }
    }

    /// Decodes a request's metadata. `payload_len` is checked only for operations that take
    /// none (the payload size of a put depends on the server's block size: the server checks).
    pub fn decode(
        op: Opcode,
        meta: &[u8],
        payload_len: u64,
        limits: &Limits,
    ) -> Result<Self, FrameError> {
        if payload_len != 0 && !op.carries_payload() {
            return Err(FrameError::UnexpectedPayload {
                op: op.name(),
                len: payload_len,
            });
        }
        let what = op.name();
        let r = match op {
            Opcode::Hello => {
                let h: Hello = dec(what, meta)?;
                check_text("hello client", &h.client, MAX_NAME_BYTES)?;
                check_text("hello token", &h.token, MAX_TOKEN_BYTES)?;
                Request::Hello(h)
            }
            Opcode::Ping | Opcode::Clear | Opcode::Stats => {
                let Empty {} = dec(what, meta)?;
                match op {
                    Opcode::Ping => Request::Ping,
                    Opcode::Clear => Request::Clear,
                    _ => Request::Stats,
                }
            }
            Opcode::Lookup | Opcode::Get | Opcode::Fetch | Opcode::Prefetch | Opcode::Remove => {
                let k: KeyList = dec(what, meta)?;
                check_keys(what, k.keys.len(), limits)?;
                match op {
                    Opcode::Lookup => Request::Lookup(k),
                    Opcode::Get => Request::Get(k),
                    Opcode::Fetch => Request::Fetch(k),
                    Opcode::Prefetch => Request::Prefetch(k),
                    _ => Request::Remove(k),
                }
            }
            Opcode::Put => {
                let m: PutMeta = dec(what, meta)?;
                check_keys(what, m.entries.len(), limits)?;
                Request::Put(m.entries)
            }
            Opcode::Pin | Opcode::Locate => {
                let m: PinMeta = dec(what, meta)?;
                check_keys(what, m.keys.len(), limits)?;
                let (keys, lease_ms) = (m.keys, m.lease_ms);
                if op == Opcode::Pin {
                    Request::Pin { keys, lease_ms }
                } else {
                    Request::Locate { keys, lease_ms }
                }
            }
            Opcode::Reserve => {
                let m: ReserveMeta = dec(what, meta)?;
                check_keys(what, m.entries.len(), limits)?;
                Request::Reserve {
                    entries: m.entries,
                    lease_ms: m.lease_ms,
                }
            }
            Opcode::Release | Opcode::Commit | Opcode::Abort => {
                let IdMeta { id } = dec(what, meta)?;
                match op {
                    Opcode::Release => Request::Release { lease_id: id },
                    Opcode::Commit => Request::Commit { reservation_id: id },
                    _ => Request::Abort { reservation_id: id },
                }
            }
            Opcode::Subscribe => {
                let SubscribeMeta { from_seq, snapshot } = dec(what, meta)?;
                Request::Subscribe { from_seq, snapshot }
            }
            Opcode::Retain => {
                let h: RetainHint = dec(what, meta)?;
                check_keys(what, h.keys.len(), limits)?;
                if h.keys.is_empty() {
                    return Err(bad(what, "no keys"));
                }
                if h.return_ms > MAX_RETAIN_RETURN_MS {
                    return Err(bad(
                        what,
                        format!(
                            "return_ms {} is over {MAX_RETAIN_RETURN_MS} (one day)",
                            h.return_ms
                        ),
                    ));
                }
                if h.priority > MAX_RETAIN_PRIORITY {
                    return Err(bad(
                        what,
                        format!("priority {} is over {MAX_RETAIN_PRIORITY}", h.priority),
                    ));
                }
                Request::Retain(h)
            }
        };
        Ok(r)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct PinnedSlot {
    /// Byte offset of the block in the DRAM arena.
    pub offset: u64,
    /// The tier the block was found in (a NVMe hit is promoted into DRAM to be pinned).
    pub tier: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct PinReply {
    /// 0 when nothing was pinned (nothing to release).
    pub lease_id: u64,
    /// Lease time granted, in milliseconds from when the reply was sent.
    pub lease_ms: u64,
    pub blocks: Vec<PinnedSlot>,
    /// [`MissCode`] of the first key not pinned.
    pub miss: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct ReservedSlot {
    /// [`PutStatus`]: `Stored` means "reserved at `offset`".
    pub status: u8,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct ReserveReply {
    /// 0 when nothing was reserved (nothing to commit).
    pub reservation_id: u64,
    pub lease_ms: u64,
    pub slots: Vec<ReservedSlot>,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct PutReply {
    /// One [`PutStatus`] per entry, in order.
    pub statuses: Vec<u8>,
}

wire_enum! {
    /// What became of a retention hint ([`Request::Retain`]).
    pub enum RetainStatus: u8, from_u8 {
        /// Accepted: `blocks` of the prefix held in DRAM are protected for `hold_ms`.
        Accepted = 0,
        /// No block of the prefix is in DRAM: nothing to protect (a miss, not an error).
        NothingCached = 1,
        /// Refused: the caller's namespace already holds its share of protected blocks.
        OverNamespaceBudget = 2,
        /// Refused: hints already protect the store's share of DRAM (with no hint of a
        /// lower priority, or of the same priority expected back later, to displace).
        OverGlobalBudget = 3,
        /// Refused: the expected return is later than the longest protection the server
        /// grants (`store.retain_max_s`); holding DRAM that long would not pay.
        TooFar = 4,
        /// The server does not keep hints (`store.retain_max_fraction` = 0).
        Off = 5,
    }
}

/// The answer to a retention hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct RetainReply {
    /// [`RetainStatus`].
    pub status: u8,
    /// Blocks of the prefix now protected (0 unless accepted).
    pub blocks: u64,
    /// How long they are protected, in milliseconds from the reply (0 unless accepted).
    pub hold_ms: u64,
}

wire_enum! {
    /// What happened to a block, in a [`BlockEvent`].
    pub enum EventKind: u8, from_u8 {
        /// The block is now held by `tier`.
        Stored = 1,
        /// The block left `tier` (evicted or removed).
        Removed = 2,
        /// Every block is gone (key and tier are zero).
        Cleared = 3,
    }
}

/// One block event. Carries the block key only: no token ids ever leave the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct BlockEvent {
    pub seq: u64,
    /// [`EventKind`].
    pub kind: u8,
    /// [`TierCode`].
    pub tier: u8,
    pub key: BlockKey,
}

/// A batch of events pushed on a subscription.
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct Events {
    /// Set when events were lost before this batch (the subscriber fell behind, or asked for
    /// a sequence the server no longer holds): `(first lost, first not lost)`. The subscriber
    /// should resync (look its keys up again) before trusting its view.
    pub gap: Option<(u64, u64)>,
    pub events: Vec<BlockEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct ErrorReply {
    /// [`ErrorCode`].
    pub code: u16,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct CountMeta {
    count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct TiersMeta {
    tiers: Vec<u8>,
    miss: u8,
}

/// A lookup reply in protocol version 4: version 3's fields, then where remote blocks came
/// from.
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct LookupMeta {
    tiers: Vec<u8>,
    miss: u8,
    sources: Vec<BlockSource>,
}

/// A lookup reply's sources must be in order, not overlap, lie within its blocks, name a
/// member, and cover exactly the blocks of tier [`TierCode::Remote`] (none without sources).
fn check_sources(tiers: &[u8], sources: Option<&[BlockSource]>) -> Result<(), FrameError> {
    let what = "lookup sources";
    let remote = TierCode::Remote as u8;
    let mut next = 0usize;
    for s in sources.unwrap_or_default() {
        check_text("lookup source node", &s.node, MAX_NODE_BYTES)?;
        let (start, len) = (s.start as usize, s.len as usize);
        let end = start.checked_add(len).filter(|&e| e <= tiers.len());
        let Some(end) = end.filter(|_| len > 0 && start >= next && !s.node.is_empty()) else {
            return Err(bad(
                what,
                format!(
                    "run {}+{} from {:?} (after block {next}, of {} blocks)",
                    s.start,
                    s.len,
                    s.node,
                    tiers.len()
                ),
            ));
        };
        if let Some(i) = tiers[next..start].iter().position(|t| *t == remote) {
            return Err(bad(what, format!("remote block {} in no run", next + i)));
        }
        if let Some(i) = tiers[start..end].iter().position(|t| *t != remote) {
            return Err(bad(
                what,
                format!("block {} of a run is not remote", start + i),
            ));
        }
        next = end;
    }
    if let Some(i) = tiers[next..].iter().position(|t| *t == remote) {
        return Err(bad(what, format!("remote block {} in no run", next + i)));
    }
    Ok(())
}

/// The reply to a fetch: a get's, and one [`block_sum`] per block returned.
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct FetchReply {
    /// [`TierCode`] of each block returned (the payload holds `tiers.len()` blocks).
    pub tiers: Vec<u8>,
    /// [`MissCode`] of the first key not returned.
    pub miss: u8,
    /// [`block_sum`] of each block returned, in order (as many as `tiers`).
    pub sums: Vec<u64>,
}

/// The reply to a locate: a pin's, and one [`block_sum`] per block pinned.
#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
pub struct LocateReply {
    pub pin: PinReply,
    /// [`block_sum`] of each block pinned, in order (as many as `pin.blocks`).
    pub sums: Vec<u64>,
}

/// The checksum a fetch reply carries for a block: XXH3-64 over the key's 16 bytes, then
/// the block's bytes. It binds the bytes to the key they are sent for.
pub fn block_sum(key: &BlockKey, block: &[u8]) -> u64 {
    let mut h = BlockSum::new(key);
    h.update(block);
    h.digest()
}

/// [`block_sum`] of a block taken in pieces, as it arrives: the same value as over the whole.
pub struct BlockSum(xxhash_rust::xxh3::Xxh3);

impl BlockSum {
    pub fn new(key: &BlockKey) -> Self {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(key.as_bytes());
        Self(h)
    }

    /// The block's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn digest(&self) -> u64 {
        self.0.digest()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, SchemaWrite, SchemaRead)]
struct TextMeta {
    text: String,
}

/// A response's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    Hello(HelloReply),
    Pong,
    /// Tiers of the longest cached prefix; `miss` says why it stopped ([`MissCode`]).
    /// `sources`: `None` in the version-3 form (no remote tier: a block fetched from a
    /// cluster peer is reported as `dram`, where it is now); `Some` in version 4, whose
    /// tiers mark such blocks [`TierCode::Remote`] and whose sources say which member each
    /// run of them came from, in order (a remote block is in exactly one run).
    Lookup {
        tiers: Vec<u8>,
        miss: u8,
        sources: Option<Vec<BlockSource>>,
    },
    /// The payload holds `tiers.len()` blocks.
    Get {
        tiers: Vec<u8>,
        miss: u8,
    },
    Put(PutReply),
    /// The payload holds `tiers.len()` blocks, each with its sum.
    Fetch(FetchReply),
    Prefetch {
        queued: u64,
    },
    Pin(PinReply),
    Locate(LocateReply),
    Reserve(ReserveReply),
    /// Answer to release, abort, clear.
    Done,
    Commit(PutReply),
    Remove {
        removed: u64,
    },
    /// JSON document (the same as the admin port's `/stats`).
    Stats(String),
    /// Subscription accepted; events follow as [`Response::Events`] frames.
    Subscribed {
        next_seq: u64,
    },
    Events(Events),
    Retain(RetainReply),
    Error(ErrorReply),
}

impl Response {
    /// Encodes the metadata and returns the flags the header needs.
    pub fn encode_meta(&self) -> (u8, Vec<u8>) {
        let r = flags::RESPONSE;
        match self {
            Response::Hello(h) => (r, enc(h)),
            Response::Pong | Response::Done => (r, enc(&Empty {})),
            Response::Lookup {
                tiers,
                miss,
                sources: Some(sources),
            } => (
                r,
                enc(&LookupMeta {
                    tiers: tiers.clone(),
                    miss: *miss,
                    sources: sources.clone(),
                }),
            ),
            Response::Lookup {
                tiers,
                miss,
                sources: None,
            }
            | Response::Get { tiers, miss } => (
                r,
                enc(&TiersMeta {
                    tiers: tiers.clone(),
                    miss: *miss,
                }),
            ),
            Response::Put(p) | Response::Commit(p) => (r, enc(p)),
            Response::Fetch(f) => (r, enc(f)),
            Response::Prefetch { queued: n }
            | Response::Remove { removed: n }
            | Response::Subscribed { next_seq: n } => (r, enc(&CountMeta { count: *n })),
            Response::Pin(p) => (r, enc(p)),
            Response::Locate(l) => (r, enc(l)),
            Response::Reserve(p) => (r, enc(p)),
            Response::Retain(p) => (r, enc(p)),
            Response::Stats(s) => (r, enc(&TextMeta { text: s.clone() })),
            Response::Events(e) => (r | flags::EVENT, enc(e)),
            Response::Error(e) => (r | flags::ERROR, enc(e)),
        }
    }

    /// Decodes a response to a request of `h.opcode` (clients know what they asked).
    pub fn decode(h: &Header, meta: &[u8], limits: &Limits) -> Result<Self, FrameError> {
        if h.is(flags::ERROR) {
            let e: ErrorReply = dec("error", meta)?;
            check_text("error message", &e.message, MAX_TEXT_BYTES)?;
            return Ok(Response::Error(e));
        }
        if h.is(flags::EVENT) {
            let e: Events = dec("events", meta)?;
            check_keys("events", e.events.len(), limits)?;
            return Ok(Response::Events(e));
        }
        let op = h.opcode().ok_or(FrameError::UnknownOpcode(h.opcode))?;
        let what = op.name();
        let count = |meta| -> Result<u64, FrameError> {
            let CountMeta { count } = dec(what, meta)?;
            Ok(count)
        };
        let r = match op {
            Opcode::Hello => {
                let h: HelloReply = dec(what, meta)?;
                check_text("hello server", &h.server, MAX_NAME_BYTES)?;
                Response::Hello(h)
            }
            Opcode::Ping | Opcode::Release | Opcode::Abort | Opcode::Clear => {
                let Empty {} = dec(what, meta)?;
                if op == Opcode::Ping {
                    Response::Pong
                } else {
                    Response::Done
                }
            }
            Opcode::Lookup => {
                // Version 4's form carries the sources after version 3's fields; a version-3
                // reply ends before them (a server that negotiated 3 sends that form).
                let (tiers, miss, sources) = match dec::<LookupMeta>(what, meta) {
                    Ok(m) => (m.tiers, m.miss, Some(m.sources)),
                    Err(_) => {
                        let TiersMeta { tiers, miss } = dec(what, meta)?;
                        (tiers, miss, None)
                    }
                };
                check_keys(what, tiers.len(), limits)?;
                check_sources(&tiers, sources.as_deref())?;
                Response::Lookup {
                    tiers,
                    miss,
                    sources,
                }
            }
            Opcode::Get => {
                let TiersMeta { tiers, miss } = dec(what, meta)?;
                check_keys(what, tiers.len(), limits)?;
                Response::Get { tiers, miss }
            }
            Opcode::Fetch => {
                let f: FetchReply = dec(what, meta)?;
                check_keys(what, f.tiers.len(), limits)?;
                if f.sums.len() != f.tiers.len() {
                    return Err(bad(
                        what,
                        format!("{} sums for {} blocks", f.sums.len(), f.tiers.len()),
                    ));
                }
                Response::Fetch(f)
            }
            Opcode::Put | Opcode::Commit => {
                let p: PutReply = dec(what, meta)?;
                check_keys(what, p.statuses.len(), limits)?;
                if op == Opcode::Put {
                    Response::Put(p)
                } else {
                    Response::Commit(p)
                }
            }
            Opcode::Prefetch => Response::Prefetch {
                queued: count(meta)?,
            },
            Opcode::Remove => Response::Remove {
                removed: count(meta)?,
            },
            Opcode::Subscribe => Response::Subscribed {
                next_seq: count(meta)?,
            },
            Opcode::Pin => {
                let p: PinReply = dec(what, meta)?;
                check_keys(what, p.blocks.len(), limits)?;
                Response::Pin(p)
            }
            Opcode::Locate => {
                let l: LocateReply = dec(what, meta)?;
                check_keys(what, l.pin.blocks.len(), limits)?;
                if l.sums.len() != l.pin.blocks.len() {
                    return Err(bad(
                        what,
                        format!("{} sums for {} blocks", l.sums.len(), l.pin.blocks.len()),
                    ));
                }
                Response::Locate(l)
            }
            Opcode::Reserve => {
                let p: ReserveReply = dec(what, meta)?;
                check_keys(what, p.slots.len(), limits)?;
                Response::Reserve(p)
            }
            Opcode::Stats => {
                let TextMeta { text } = dec(what, meta)?;
                check_text("stats", &text, MAX_TEXT_BYTES)?;
                Response::Stats(text)
            }
            Opcode::Retain => Response::Retain(dec(what, meta)?),
        };
        Ok(r)
    }
}

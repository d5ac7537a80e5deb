//! kvtier-client: the SDK inference engines link to use a kvtier server.
//!
//! ```no_run
//! use kvtier_client::{Client, ClientConfig};
//! use kvtier_core::{Dtype, HashSecret, KvLayout, NamespaceBuilder, PrefixHasher};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("unix:///run/user/1000/kvtier/kvtier.sock", ClientConfig::default()).await?;
//! let block = client.block_bytes();
//! // Keys: a keyed, chained hash of the prompt's full blocks under the model's namespace
//! // (model, layout, tenant's cache_salt).
//! let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, 16)?;
//! let secret = HashSecret::development();
//! let ns = NamespaceBuilder::new("llama-3-8b", layout.fingerprint())
//!     .cache_salt(b"tenant-a")
//!     .build(&secret)?;
//! let mut hasher = PrefixHasher::new(secret, ns, layout.block_tokens())?;
//! let tokens: Vec<u32> = (0..64).collect();
//! let mut keys = Vec::new();
//! hasher.prompt_keys(&tokens, &mut keys);
//!
//! // Next request with this prefix: fetch what is cached, recompute the rest.
//! let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; block]).collect();
//! let mut dst: Vec<&mut [u8]> = out.iter_mut().map(|b| b.as_mut_slice()).collect();
//! let got = client.get_into(&keys, &mut dst).await;
//! println!("{} of {} blocks cached ({:?}); recompute the rest", got.blocks, keys.len(), got.miss);
//!
//! // After prefill: store the new blocks, parents first (a failure is reported, not raised).
//! let computed: Vec<Vec<u8>> = keys[got.blocks..].iter().map(|_| vec![0u8; block]).collect();
//! let bufs: Vec<&[u8]> = computed.iter().map(|b| b.as_slice()).collect();
//! let parent = got.blocks.checked_sub(1).map(|i| keys[i]);
//! let stored = client.put_chain(&keys[got.blocks..], parent, &bufs).await;
//! if let Some(why) = stored.failure {
//!     eprintln!("not cached this time: {why:?}");
//! }
//! # Ok(()) }
//! ```
//!
//! Addresses: `unix:///path/to/kvtier.sock` (local; with [`ClientConfig::zero_copy`] the
//! client maps the server's DRAM arena read-only and reads blocks from it in place, and
//! writes the blocks it puts into a staging region of its own that the server copies from;
//! [`Client::get_into`] reads DRAM hits through the server's published slot table with no
//! message at all (with tenants, for the tenant trusted with the arena, its keys mapped by
//! the namespace key the hello passes), see [`ClientConfig::fast_local_gets`], and
//! [`Client::lookup`] answers a prefix held in DRAM from that table too, telling the server
//! one way, see [`ClientConfig::fast_local_lookups`]),
//! `tcp://host:port` (plain text: for loopback, or a network the operator trusts),
//! `tls://host:port` (TLS over TCP) and `quic://host:port`. The network transports need
//! [`ClientConfig::token`]; the encrypted ones (TLS, QUIC) also the server's certificate,
//! or its CA's ([`ClientConfig::server_cert_der`]): there are no system roots.
//!
//! Every call has a timeout. A connection that fails is reopened on the next call (after
//! [`ClientConfig::reconnect_backoff`]; until then calls answer at once with a miss).
//! [`blocking::BlockingClient`] wraps it all for callers without an async runtime.
//!
//! [`http`] is the workspace's one HTTP client (hyper), for the other kvtier services' HTTP
//! APIs: the worker's OpenAI and control endpoints, the admin ports.

pub mod blocking;
mod conn;
mod error;
pub mod http;
mod quic;
mod tls;

pub use quic::transport as quic_transport;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use conn::recv_with_fds;
pub use error::ClientError;
pub use kvtier_core::BlockKey;
pub use kvtier_core::protocol::{
    BlockEvent, ErrorCode, EventKind, MAX_RETAIN_PRIORITY, MAX_RETAIN_RETURN_MS, PutEntry,
    PutStatus, RetainStatus, TierCode,
};
use kvtier_core::protocol::{Events, KeyList, MissCode, Opcode, Request, Response, RetainHint};
use tokio::sync::mpsc;

use conn::Conn;

/// The server's answer to a retention hint ([`Client::retain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retained {
    /// What became of it (`None`: a status this SDK does not know).
    pub status: Option<RetainStatus>,
    /// Blocks of the prefix now protected (those in DRAM; 0 unless accepted).
    pub blocks: u64,
    /// How long they are protected (zero unless accepted).
    pub hold: Duration,
}

impl Retained {
    pub fn accepted(&self) -> bool {
        self.status == Some(RetainStatus::Accepted)
    }
}

/// Rounds in a row a multi-round get may make no progress (the server still releasing the
/// previous round's pins) before it reports the miss; a caller that loops over pinned
/// rounds itself (the Python package's `get_pages`) keeps the same bound.
pub const BUSY_RETRIES: u32 = 3;

/// Client settings. Each field's doc ends with its default.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    /// Token for TCP, TLS and QUIC servers. Default: `KVTIER_TOKEN` from the environment,
    /// if set.
    pub token: Option<String>,
    /// The certificate (DER) `tls://` and `quic://` trust: the server's own (pinned; a
    /// server with a generated one writes it to `<runtime_dir>/quic-cert.der`), or the CA
    /// certificate that issued it. The only one trusted: there are no system roots.
    /// Default: none (TLS and QUIC refused, saying so).
    pub server_cert_der: Option<Vec<u8>>,
    /// Name the server's certificate must carry (TLS and QUIC). Default: "localhost".
    pub server_name: String,
    /// This client's certificate (DER) and its private key (PKCS#8, PKCS#1 or SEC1 DER),
    /// presented on `tls://` and `quic://`: a server with tenants names the tenant that pins
    /// the certificate's SHA-256 (`tenants.NAME.client_cert_sha256`), and then needs no
    /// token. Default: none.
    pub client_cert_der: Option<(Vec<u8>, Vec<u8>)>,
    /// Deadline of every call. Default: 5 s.
    pub timeout: Duration,
    /// Deadline of a connect and hello. Default: 2 s.
    pub connect_timeout: Duration,
    /// After a failed connect, calls fail fast for this long before trying again.
    /// Default: 1 s.
    pub reconnect_backoff: Duration,
    /// Block size the caller uses; the server refuses a different one. 0 = take the
    /// server's. Default: 0.
    pub block_bytes: u64,
    /// On `unix://`, map the server's DRAM arena and move bytes through it. Default: true.
    pub zero_copy: bool,
    /// On `unix://` with an arena, read DRAM hits through the server's published slot table
    /// with no message (`get_into` only; a miss or a slot changing under the copy falls back
    /// to a pin). Default: true.
    pub fast_local_gets: bool,
    /// With the slot table mapped ([`ClientConfig::fast_local_gets`]) and a server that
    /// allows it (no tier above DRAM), answer a lookup whose every key the table names as a
    /// DRAM block here, with no round trip; where DRAM is the server's only tier and it is in
    /// no cluster, also a partly cached one while no put is in flight (its prefix, then a
    /// miss). The lookup still goes to the server, one way, so that its eviction policy hears
    /// of it and it holds the prefix for the load; any other lookup goes as before.
    /// Default: true.
    pub fast_local_lookups: bool,
    /// Lease asked for pins taken by `get_into` on the local path. Default: 10 s.
    pub lease: Duration,
    /// Name for the server's logs. Default: "kvtier-client".
    pub name: String,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            token: std::env::var("KVTIER_TOKEN").ok().filter(|t| !t.is_empty()),
            server_cert_der: None,
            server_name: "localhost".into(),
            client_cert_der: None,
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            reconnect_backoff: Duration::from_secs(1),
            block_bytes: 0,
            zero_copy: true,
            fast_local_gets: true,
            fast_local_lookups: true,
            lease: Duration::from_secs(10),
            name: "kvtier-client".into(),
        }
    }
}

impl ClientConfig {
    pub fn token(mut self, t: impl Into<String>) -> Self {
        self.token = Some(t.into());
        self
    }
    /// Sets [`ClientConfig::server_cert_der`].
    pub fn server_cert_der(mut self, der: Vec<u8>) -> Self {
        self.server_cert_der = Some(der);
        self
    }
    /// The former name of [`ClientConfig::server_cert_der`] (the certificate serves QUIC
    /// and TLS alike).
    pub fn quic_cert_der(self, der: Vec<u8>) -> Self {
        self.server_cert_der(der)
    }
    /// Sets [`ClientConfig::client_cert_der`]: the certificate's DER and its private key's.
    pub fn client_cert_der(mut self, cert_der: Vec<u8>, key_der: Vec<u8>) -> Self {
        self.client_cert_der = Some((cert_der, key_der));
        self
    }
    /// Sets [`ClientConfig::server_name`].
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = name.into();
        self
    }
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn zero_copy(mut self, on: bool) -> Self {
        self.zero_copy = on;
        self
    }

    /// See [`ClientConfig::fast_local_gets`].
    pub fn fast_local_gets(mut self, on: bool) -> Self {
        self.fast_local_gets = on;
        self
    }
    /// See [`ClientConfig::fast_local_lookups`].
    pub fn fast_local_lookups(mut self, on: bool) -> Self {
        self.fast_local_lookups = on;
        self
    }
    pub fn block_bytes(mut self, b: u64) -> Self {
        self.block_bytes = b;
        self
    }
    pub fn reconnect_backoff(mut self, d: Duration) -> Self {
        self.reconnect_backoff = d;
        self
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
    Tls { addr: String, server_name: String },
    Quic { addr: String, server_name: String },
}

impl Endpoint {
    fn parse(url: &str, cfg: &ClientConfig) -> Result<Self, ClientError> {
        let bad = || ClientError::BadUrl(url.to_string());
        if let Some(p) = url.strip_prefix("unix://") {
            if p.is_empty() {
                return Err(bad());
            }
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        let hostport = |rest: &str| -> Result<String, ClientError> {
            let rest = rest.trim_end_matches('/');
            match rest.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => Ok(rest.to_string()),
                _ => Err(bad()),
            }
        };
        if let Some(r) = url.strip_prefix("tcp://") {
            return Ok(Endpoint::Tcp(hostport(r)?));
        }
        if let Some(r) = url.strip_prefix("tls://") {
            return Ok(Endpoint::Tls {
                addr: hostport(r)?,
                server_name: cfg.server_name.clone(),
            });
        }
        if let Some(r) = url.strip_prefix("quic://") {
            return Ok(Endpoint::Quic {
                addr: hostport(r)?,
                server_name: cfg.server_name.clone(),
            });
        }
        Err(bad())
    }
}

/// Why blocks were not served (or stored). Cache failures arrive as one of these, never as
/// an error: the caller recomputes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Miss {
    /// The server does not hold the next block.
    NotCached,
    /// The server found its copy corrupt (dropped and counted there).
    Corrupt,
    /// The server failed to read its copy.
    IoError,
    /// The server is over budget; nothing was done.
    Busy,
    Timeout,
    Disconnected,
    /// No server (connect failed, or backing off after a failure).
    Unavailable(String),
    /// The server refused the request.
    Refused(String),
}

impl Miss {
    fn from_code(c: u8) -> Option<Miss> {
        match MissCode::from_u8(c) {
            Some(MissCode::None) => None,
            Some(MissCode::NotCached) => Some(Miss::NotCached),
            Some(MissCode::Corrupt) => Some(Miss::Corrupt),
            Some(MissCode::IoError) => Some(Miss::IoError),
            Some(MissCode::Busy) => Some(Miss::Busy),
            None => Some(Miss::Refused(format!("unknown miss code {c}"))),
        }
    }

    /// The miss a failed call stands for (a timeout, a lost connection, a refusal, ...).
    pub fn from_error(e: &ClientError) -> Miss {
        match e {
            ClientError::Timeout => Miss::Timeout,
            ClientError::Disconnected | ClientError::Io(_) => Miss::Disconnected,
            ClientError::Connect(m) => Miss::Unavailable(m.clone()),
            ClientError::Server {
                code: Some(ErrorCode::Busy),
                ..
            } => Miss::Busy,
            other => Miss::Refused(other.to_string()),
        }
    }
}

/// The longest cached prefix of a key list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// Tier of each leading cached block. [`TierCode::Remote`]: the server fetched the block
    /// from another member of its cluster for this lookup; it is in the server's DRAM now
    /// ([`TierCode::held`]), and [`Lookup::sources`] names the member.
    pub tiers: Vec<TierCode>,
    /// Why it stopped (None: every key is cached).
    pub miss: Option<Miss>,
    /// Where the remote blocks came from, in order: each a run of them and the member's
    /// node id. Empty where none came from another member (or the server speaks only
    /// protocol version 3, which reports them as DRAM).
    pub sources: Vec<Source>,
}

/// A run of a lookup's blocks that its server fetched from another member of its cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// Positions in the looked-up keys.
    pub blocks: std::ops::Range<usize>,
    /// The member's node id (`/cluster` on the admin port lists them).
    pub node: String,
}

/// The result of [`Client::get_into`]: the first `blocks` buffers hold blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetch {
    pub blocks: usize,
    pub tiers: Vec<TierCode>,
    pub miss: Option<Miss>,
}

/// The result of [`Client::fetch`]: the blocks of `keys[..blocks.len()]`, each with the sum
/// the server stated for it (not yet verified).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// How many keys were asked (as many as fit one reply).
    pub asked: usize,
    pub blocks: Vec<Vec<u8>>,
    pub sums: Vec<u64>,
    /// Why it stopped before `asked` (None: every key asked was returned).
    pub miss: Option<Miss>,
}

/// The result of [`Client::fetch_into`]: the first `blocks` buffers hold the blocks of
/// `keys[..blocks]`, each with the sum the server stated for it (not yet verified).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchedInto {
    /// How many keys were asked (as many as fit one reply).
    pub asked: usize,
    pub blocks: usize,
    /// The sums the server states, one a block returned.
    pub sums: Vec<u64>,
    /// Each returned block's [`kvtier_core::protocol::block_sum`] over its key and the bytes
    /// that arrived, computed piece by piece as they were read: the block is what the server
    /// summed where `arrived[i] == sums[i]`.
    pub arrived: Vec<u64>,
    /// Why it stopped before `asked` (None: every key asked was returned).
    pub miss: Option<Miss>,
}

/// What a cluster peer's locate pinned (see [`Client::locate`]): the leading blocks of the
/// keys asked, pinned in the server's DRAM until the lease is released or passes, with each
/// one's place in the server's arena and the sum the server states for it (not verified:
/// the caller reads the bytes by other means and checks them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// 0 when nothing was pinned (nothing to release).
    pub lease_id: u64,
    /// When the server releases the pins by itself.
    pub deadline: Instant,
    /// How many keys were asked (as many as fit one request).
    pub asked: usize,
    /// Each pinned block's byte offset in the server's DRAM arena, in key order.
    pub offsets: Vec<u64>,
    /// The sums the server states, one a pinned block.
    pub sums: Vec<u64>,
    /// Why it stopped before `asked` (None: every key asked was pinned).
    pub miss: Option<Miss>,
}

/// Bytes of a fetched block read and summed at a time (see [`Client::fetch_into`]).
const SUM_PIECE_BYTES: usize = 256 << 10;

/// The result of a put: one status per block sent, and why the rest were not sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub statuses: Vec<PutStatus>,
    pub failure: Option<Miss>,
}

impl Stored {
    /// Blocks now cached (stored now or before).
    pub fn cached(&self) -> usize {
        self.statuses
            .iter()
            .filter(|s| matches!(s, PutStatus::Stored | PutStatus::AlreadyPresent))
            .count()
    }
}

/// Blocks the arena of `c` holds (an upper bound: slots may be padded past a block).
fn arena_blocks(c: &Conn, block_bytes: usize) -> usize {
    if c.arena.is_none() || block_bytes == 0 {
        return 0;
    }
    (c.hello.arena_bytes / block_bytes as u64) as usize
}

/// Blocks the staging region of `c` holds: what one local put may reserve at once.
fn staging_blocks(c: &Conn, block_bytes: usize) -> usize {
    match &c.staging {
        Some(s) if block_bytes > 0 => s.len() / block_bytes,
        _ => 0,
    }
}

/// Blocks pinned in the server's DRAM arena, readable in place (local connections only).
/// Released when dropped (or when the lease runs out).
pub struct PinnedBlocks {
    conn: Arc<Conn>,
    lease_id: u64,
    offsets: Vec<u64>,
    block: usize,
    tiers: Vec<TierCode>,
    miss: Option<Miss>,
    timeout: Duration,
    deadline: Instant,
}

impl PinnedBlocks {
    pub fn len(&self) -> usize {
        self.offsets.len()
    }
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }
    pub fn tiers(&self) -> &[TierCode] {
        &self.tiers
    }
    pub fn miss(&self) -> Option<&Miss> {
        self.miss.as_ref()
    }
    /// When the server may release the pins on its own.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Block `i`, in place in the server's arena. Valid until this guard drops; read it
    /// before the lease deadline (after it, the server may reuse the slot).
    pub fn block(&self, i: usize) -> &[u8] {
        let arena = self
            .conn
            .arena
            .as_ref()
            .expect("PinnedBlocks exist only on connections with an arena");
        // SAFETY: the server pinned this slot for our lease, which this guard holds; the
        // offset was range-checked when the guard was built.
        unsafe { arena.slice(self.offsets[i], self.block) }
            .expect("offset checked when the pin was taken")
    }
}

impl Drop for PinnedBlocks {
    fn drop(&mut self) {
        if self.lease_id == 0 {
            return;
        }
        let (conn, id, t) = (self.conn.clone(), self.lease_id, self.timeout);
        // Without a runtime the lease simply expires on the server.
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                let _ = conn
                    .send_no_reply(&Request::Release { lease_id: id }, t)
                    .await;
            });
        }
    }
}

/// A stream of block events (see [`Client::events`]).
pub struct EventStream {
    rx: mpsc::Receiver<Events>,
    /// The server's next sequence number when the subscription started.
    pub start_seq: u64,
    _conn: Arc<Conn>,
}

/// One item of an [`EventStream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventItem {
    Event(BlockEvent),
    /// Events `from..to` were lost (the subscriber fell behind): resync.
    Gap {
        from: u64,
        to: u64,
    },
}

impl EventStream {
    /// The next batch, or `None` when the connection closed.
    pub async fn next_batch(&mut self) -> Option<Vec<EventItem>> {
        let ev = self.rx.recv().await?;
        let mut out = Vec::with_capacity(ev.events.len() + 1);
        if let Some((from, to)) = ev.gap {
            out.push(EventItem::Gap { from, to });
        }
        out.extend(ev.events.into_iter().map(EventItem::Event));
        Some(out)
    }
}

struct Inner {
    endpoint: Endpoint,
    config: ClientConfig,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    backoff_until: std::sync::Mutex<Option<(Instant, String)>>,
    /// Blocks `get_into` read through the published slot table (no message).
    fast_hits: std::sync::atomic::AtomicU64,
    fast_lookups: std::sync::atomic::AtomicU64,
}

/// A connection to a kvtier server, reopened when it fails. Cheap to clone; every method
/// takes `&self` and may be called from many tasks at once (requests pipeline).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    block_bytes: usize,
    local: bool,
}

impl Client {
    /// Connects and says hello (version, token, block size).
    pub async fn connect(url: &str, config: ClientConfig) -> Result<Client, ClientError> {
        let endpoint = Endpoint::parse(url, &config)?;
        let conn = tokio::time::timeout(config.connect_timeout, Conn::open(&endpoint, &config))
            .await
            .map_err(|_| ClientError::Connect(format!("{url}: timed out")))??;
        let block_bytes = conn.hello.block_bytes as usize;
        let local = conn.arena.is_some();
        Ok(Client {
            inner: Arc::new(Inner {
                endpoint,
                config,
                conn: tokio::sync::Mutex::new(Some(conn)),
                backoff_until: std::sync::Mutex::new(None),
                fast_hits: std::sync::atomic::AtomicU64::new(0),
                fast_lookups: std::sync::atomic::AtomicU64::new(0),
            }),
            block_bytes,
            local,
        })
    }

    /// Size of every block on this server.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Whether gets and puts go through the mapped arena.
    pub fn is_local(&self) -> bool {
        self.local
    }

    fn timeout(&self) -> Duration {
        self.inner.config.timeout
    }

    async fn conn(&self) -> Result<Arc<Conn>, ClientError> {
        let mut g = self.inner.conn.lock().await;
        if let Some(c) = g.as_ref().filter(|c| !c.is_dead()) {
            return Ok(c.clone());
        }
        *g = None;
        if let Some((until, why)) = self
            .inner
            .backoff_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            && Instant::now() < until
        {
            return Err(ClientError::Connect(format!("backing off after: {why}")));
        }
        let cfg = &self.inner.config;
        let r = tokio::time::timeout(cfg.connect_timeout, Conn::open(&self.inner.endpoint, cfg))
            .await
            .unwrap_or_else(|_| Err(ClientError::Connect("connect timed out".into())));
        match r {
            Ok(c) if c.hello.block_bytes as usize == self.block_bytes => {
                *g = Some(c.clone());
                Ok(c)
            }
            Ok(c) => Err(ClientError::Protocol(format!(
                "server now has {}-byte blocks, this client {}",
                c.hello.block_bytes, self.block_bytes
            ))),
            Err(e) => {
                *self
                    .inner
                    .backoff_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now() + cfg.reconnect_backoff, e.to_string()));
                Err(e)
            }
        }
    }

    async fn call(&self, req: &Request) -> Result<(Arc<Conn>, conn::Reply), ClientError> {
        let c = self.conn().await?;
        let r = c.call(req, &[], self.timeout()).await?;
        if let Response::Error(e) = r.response {
            return Err(ClientError::from_reply(e));
        }
        Ok((c, r))
    }

    fn unexpected(r: &Response) -> ClientError {
        ClientError::Protocol(format!("unexpected response {r:?}"))
    }

    /// A lookup answered from the published slot table, where the server allows it
    /// (`slot_table::flags::LOOKUPS`) and the table settles it: every key a DRAM block
    /// there, or (an `EXACT` table, no put in flight) the leading ones and then a key it
    /// does not name. The answer comes after the lookup went to the server one way (its
    /// policy hears of it; it holds the prefix for the load). `None`: ask the server.
    async fn lookup_local(
        &self,
        c: &Arc<Conn>,
        base: usize,
        keys: &[BlockKey],
    ) -> Result<Option<Lookup>, ClientError> {
        let Some(table) = c.slot_table.as_ref() else {
            return Ok(None);
        };
        if !(self.inner.config.fast_local_lookups && table.lookups)
            || keys.is_empty()
            || c.fit(base, keys, usize::MAX, key_bytes) < keys.len()
        {
            return Ok(None);
        }
        let n = table.held_prefix(keys);
        // A key the table does not name may be on another tier, or being stored: only an
        // exact table, with no put in flight (read after the keys), says it is not cached.
        if n < keys.len() && !(table.exact && table.pending() == 0) {
            return Ok(None);
        }
        // One way: written before this returns, so the server sees this connection's requests
        // in the order they were made (a queue written later measured no faster here).
        c.send_keys_no_reply(Opcode::Lookup, keys, self.timeout())
            .await?;
        self.inner
            .fast_lookups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(Lookup {
            tiers: vec![TierCode::Dram; n],
            miss: (n < keys.len()).then_some(Miss::NotCached),
            sources: vec![],
        }))
    }

    /// Blocks [`Client::get_into`] has read through the server's published slot table, with
    /// no message (local connections; see [`ClientConfig::fast_local_gets`]).
    pub fn fast_hits(&self) -> u64 {
        self.inner
            .fast_hits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this connection reads DRAM hits with no message (a slot table was mapped).
    pub async fn has_fast_gets(&self) -> bool {
        self.conn().await.is_ok_and(|c| c.slot_table.is_some())
    }

    /// Round-trip time of a ping.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        let t = Instant::now();
        match self.call(&Request::Ping).await?.1.response {
            Response::Pong => Ok(t.elapsed()),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// The longest cached prefix of `keys` and the tier of each of its blocks. Key lists
    /// longer than the server's per-request limit are asked in pieces. On a local connection
    /// a list the published slot table settles (every key a DRAM block; with DRAM the only
    /// tier, a cached prefix and then a key not there) is answered from it, with no round
    /// trip ([`ClientConfig::fast_local_lookups`]).
    pub async fn lookup(&self, keys: &[BlockKey]) -> Lookup {
        match self.lookup_inner(keys).await {
            Ok(l) => l,
            Err(e) => Lookup {
                tiers: vec![],
                miss: Some(Miss::from_error(&e)),
                sources: vec![],
            },
        }
    }

    /// Lookups [`Client::lookup`] answered from the server's published slot table, with no
    /// round trip (local connections; see [`ClientConfig::fast_local_lookups`]).
    pub fn fast_lookups(&self) -> u64 {
        self.inner
            .fast_lookups
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn lookup_inner(&self, keys: &[BlockKey]) -> Result<Lookup, ClientError> {
        let c = self.conn().await?;
        let base = meta_base(&Request::Lookup(KeyList::default()));
        if let Some(l) = self.lookup_local(&c, base, keys).await? {
            return Ok(l);
        }
        let mut tiers = Vec::new();
        let mut sources = Vec::new();
        let mut rest = keys;
        while !rest.is_empty() {
            let (chunk, after) = rest.split_at(c.fit(base, rest, usize::MAX, key_bytes));
            rest = after;
            let req = Request::Lookup(KeyList {
                keys: chunk.to_vec(),
            });
            let r = c.call(&req, &[], self.timeout()).await?;
            let (t, miss, from) = match r.response {
                Response::Lookup {
                    tiers,
                    miss,
                    sources,
                } => (tiers, miss, sources.unwrap_or_default()),
                Response::Error(e) => return Err(ClientError::from_reply(e)),
                r => return Err(Self::unexpected(&r)),
            };
            // Positions in this chunk's reply: the decoder checked them against its tiers.
            let at = tiers.len();
            sources.extend(from.into_iter().map(|s| Source {
                blocks: at + s.start as usize..at + s.start as usize + s.len as usize,
                node: s.node,
            }));
            // An unknown code ends the prefix there (a newer server's tier this build cannot
            // load from).
            let known = t.iter().map_while(|x| TierCode::from_u8(*x));
            let before = tiers.len();
            tiers.extend(known);
            let n = t.len();
            let miss = Miss::from_code(miss);
            if miss.is_some() || n < chunk.len() || tiers.len() - before < n {
                sources.retain_mut(|s| {
                    s.blocks.end = s.blocks.end.min(tiers.len());
                    !s.blocks.is_empty()
                });
                return Ok(Lookup {
                    tiers,
                    miss: miss.or(Some(Miss::NotCached)),
                    sources,
                });
            }
        }
        Ok(Lookup {
            tiers,
            miss: None,
            sources,
        })
    }

    /// Copies the longest cached prefix of `keys` into `bufs` (one block-sized buffer per
    /// key). Local connections copy straight out of the mapped arena; remote ones receive
    /// the bytes straight into `bufs`.
    pub async fn get_into(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Fetch {
        match self.get_inner(keys, bufs).await {
            Ok(f) => f,
            Err(e) => Fetch {
                blocks: 0,
                tiers: vec![],
                miss: Some(Miss::from_error(&e)),
            },
        }
    }

    fn check_bufs(&self, n: usize, lens: impl Iterator<Item = usize>) -> Result<(), ClientError> {
        let mut count = 0;
        for l in lens {
            count += 1;
            if l != self.block_bytes {
                return Err(ClientError::Buffer(format!(
                    "buffer of {l} bytes; blocks are {} bytes",
                    self.block_bytes
                )));
            }
        }
        if count != n {
            return Err(ClientError::Buffer(format!("{n} keys but {count} buffers")));
        }
        Ok(())
    }

    async fn get_inner(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<Fetch, ClientError> {
        self.check_bufs(keys.len(), bufs.iter().map(|b| b.len()))?;
        if keys.is_empty() {
            return Ok(Fetch {
                blocks: 0,
                tiers: vec![],
                miss: None,
            });
        }
        let mut done = 0;
        let mut tiers = Vec::new();
        if self.local {
            // DRAM hits first, straight from the published slot table: no message at all.
            let c = self.conn().await?;
            if let (Some(table), Some(arena)) = (&c.slot_table, &c.arena) {
                while done < keys.len() && table.read(arena, keys[done], bufs[done]) {
                    done += 1;
                }
                if done > 0 {
                    tiers.resize(done, TierCode::Dram);
                    self.inner
                        .fast_hits
                        .fetch_add(done as u64, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        // A server whose DRAM cannot hold the whole prefix at once answers part of it with
        // "busy"; ask again for the rest (each round makes progress or stops).
        let mut miss = None;
        let mut stalls = 0;
        while done < keys.len() {
            let (n, t, m) = if self.local {
                self.get_local_round(&keys[done..], &mut bufs[done..])
                    .await?
            } else {
                self.get_remote_round(&keys[done..], &mut bufs[done..])
                    .await?
            };
            done += n;
            tiers.extend(t);
            miss = m;
            if miss != Some(Miss::Busy) {
                break;
            }
            // The previous round's pins may not be released yet: a few short retries.
            stalls = if n == 0 { stalls + 1 } else { 0 };
            if stalls > BUSY_RETRIES {
                break;
            }
            if n == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        Ok(Fetch {
            blocks: done,
            tiers,
            miss,
        })
    }

    async fn get_local_round(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<(usize, Vec<TierCode>, Option<Miss>), ClientError> {
        let mut pinned = self.pin_inner(keys, self.inner.config.lease).await?;
        let arena = pinned
            .conn
            .arena
            .as_ref()
            .ok_or(ClientError::NotLocal("get"))?;
        for (i, off) in pinned.offsets.iter().enumerate() {
            arena.read(*off, bufs[i])?;
        }
        let lease_id = std::mem::take(&mut pinned.lease_id);
        if lease_id != 0 {
            let release = Request::Release { lease_id };
            if pinned.miss == Some(Miss::Busy) {
                // Another round follows: its slots must be free first.
                let _ = pinned.conn.call(&release, &[], self.timeout()).await;
            } else {
                let _ = pinned.conn.send_no_reply(&release, self.timeout()).await;
            }
        }
        Ok((
            pinned.len(),
            std::mem::take(&mut pinned.tiers),
            pinned.miss.take(),
        ))
    }

    async fn get_remote_round(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<(usize, Vec<TierCode>, Option<Miss>), ClientError> {
        let c = self.conn().await?;
        // Ask in pieces the server accepts.
        let per = (c.max_payload() / self.block_bytes as u64).max(1) as usize;
        let base = meta_base(&Request::Get(KeyList::default()));
        let mut done = 0;
        let mut tiers = Vec::new();
        let mut rest = keys;
        while !rest.is_empty() {
            let (chunk, after) = rest.split_at(c.fit(base, rest, per, key_bytes));
            rest = after;
            let req = Request::Get(KeyList {
                keys: chunk.to_vec(),
            });
            let r = c.call(&req, &[], self.timeout()).await?;
            let (t, miss) = match r.response {
                Response::Get { tiers, miss } => (tiers, miss),
                Response::Error(e) => return Err(ClientError::from_reply(e)),
                r => return Err(Self::unexpected(&r)),
            };
            let n = t.len();
            let want = n as u64 * self.block_bytes as u64;
            let mut payload = r.payload;
            let have = payload.as_ref().map_or(0, |p| p.remaining());
            if have != want || n > chunk.len() {
                return Err(ClientError::Protocol(format!(
                    "get of {n} blocks carried {have} bytes"
                )));
            }
            let read = async {
                if let Some(p) = payload.as_mut() {
                    for b in bufs[done..done + n].iter_mut() {
                        p.read_exact(b).await?;
                    }
                }
                Ok::<(), ClientError>(())
            };
            tokio::time::timeout(self.timeout(), read)
                .await
                .map_err(|_| ClientError::Timeout)??;
            done += n;
            tiers.extend(t.iter().filter_map(|x| TierCode::from_u8(*x)));
            let miss = Miss::from_code(miss);
            if miss.is_some() || n < chunk.len() {
                return Ok((done, tiers, miss.or(Some(Miss::NotCached))));
            }
        }
        Ok((done, tiers, None))
    }

    /// A fetch between cluster peers (opcode 16): the longest cached prefix of `keys`, as
    /// many blocks as one reply may carry, each with the checksum the server states for it
    /// ([`kvtier_core::protocol::block_sum`]). The caller verifies them; this call checks
    /// only the counts and the payload length. Servers answer it only to a connection that
    /// said hello with the cluster's peer token (`docs/cluster.md`); applications use
    /// [`Client::get_into`]. [`Client::fetch_into`] reads into buffers the caller owns.
    pub async fn fetch(&self, keys: &[BlockKey]) -> Result<Fetched, ClientError> {
        let n = self.fetch_fit(keys).await?;
        let mut blocks: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; self.block_bytes]).collect();
        let mut bufs: Vec<&mut [u8]> = blocks.iter_mut().map(|b| b.as_mut_slice()).collect();
        let f = self.fetch_into(&keys[..n], &mut bufs).await?;
        blocks.truncate(f.blocks);
        Ok(Fetched {
            asked: f.asked,
            blocks,
            sums: f.sums,
            miss: f.miss,
        })
    }

    /// How many of `keys` one fetch reply may carry.
    async fn fetch_fit(&self, keys: &[BlockKey]) -> Result<usize, ClientError> {
        let c = self.conn().await?;
        let per = (c.max_payload() / self.block_bytes.max(1) as u64).max(1) as usize;
        let base = meta_base(&Request::Fetch(KeyList::default()));
        Ok(c.fit(base, keys, per, key_bytes))
    }

    /// [`Client::fetch`] straight into `bufs` (one block-sized buffer per key): the payload
    /// is read from the connection into them, with no copy of its own, and each block summed
    /// as it arrives (`arrived`, to compare with the stated `sums`). Asks as many keys as one
    /// reply may carry (`asked`); the first `blocks` buffers are filled.
    pub async fn fetch_into(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<FetchedInto, ClientError> {
        self.check_bufs(keys.len(), bufs.iter().map(|b| b.len()))?;
        let n = self.fetch_fit(keys).await?;
        let c = self.conn().await?;
        let req = Request::Fetch(KeyList {
            keys: keys[..n].to_vec(),
        });
        let r = c.call(&req, &[], self.timeout()).await?;
        let f = match r.response {
            Response::Fetch(f) => f,
            Response::Error(e) => return Err(ClientError::from_reply(e)),
            r => return Err(Self::unexpected(&r)),
        };
        let m = f.tiers.len();
        let want = m as u64 * self.block_bytes as u64;
        let mut payload = r.payload;
        let have = payload.as_ref().map_or(0, |p| p.remaining());
        if have != want || m > n || f.sums.len() != m {
            return Err(ClientError::Protocol(format!(
                "fetch of {n} keys answered {m} blocks ({} sums) in {have} bytes",
                f.sums.len()
            )));
        }
        // Each block is summed a piece at a time as it is read, while the rest is still on
        // its way, instead of all of it after the last byte.
        let mut arrived = Vec::with_capacity(m);
        let read = async {
            if let Some(p) = payload.as_mut() {
                for (b, key) in bufs.iter_mut().take(m).zip(keys) {
                    let mut sum = kvtier_core::protocol::BlockSum::new(key);
                    for piece in b.chunks_mut(SUM_PIECE_BYTES) {
                        p.read_exact(piece).await?;
                        sum.update(piece);
                    }
                    arrived.push(sum.digest());
                }
            }
            Ok::<(), ClientError>(())
        };
        tokio::time::timeout(self.timeout(), read)
            .await
            .map_err(|_| ClientError::Timeout)??;
        let miss = Miss::from_code(f.miss).or((m < n).then_some(Miss::NotCached));
        Ok(FetchedInto {
            asked: n,
            blocks: m,
            sums: f.sums,
            arrived,
            miss,
        })
    }

    /// How many blocks the server's DRAM arena holds (local connections; 0 otherwise, or
    /// when not connected): the most one [`Client::get_pinned`] can ever pin. A longer
    /// prefix is read in full with [`Client::get_into`], which streams it through DRAM in
    /// rounds.
    pub async fn arena_blocks(&self) -> usize {
        match self.conn().await {
            Ok(c) => arena_blocks(&c, self.block_bytes),
            Err(_) => 0,
        }
    }

    /// Pins the longest cached prefix of `keys` in the server's DRAM for `lease` and lends
    /// the blocks in place (local connections only): the zero-copy read path. At most
    /// [`Client::arena_blocks`] blocks (fewer while other readers hold pins): a longer
    /// prefix stops early with [`Miss::Busy`], as does one longer than a single request
    /// may carry (the server's `max_keys` and `max_meta_bytes`).
    pub async fn get_pinned(
        &self,
        keys: &[BlockKey],
        lease: Duration,
    ) -> Result<PinnedBlocks, ClientError> {
        if !self.local {
            return Err(ClientError::NotLocal("get_pinned"));
        }
        self.pin_inner(keys, lease).await
    }

    async fn pin_inner(
        &self,
        keys: &[BlockKey],
        lease: Duration,
    ) -> Result<PinnedBlocks, ClientError> {
        let lease_ms = lease.as_millis().max(1) as u64;
        let c = self.conn().await?;
        let base = meta_base(&Request::Pin {
            keys: vec![],
            lease_ms,
        });
        // A key list over the server's limits pins its first part; the rest is "busy".
        let n = c.fit(base, keys, usize::MAX, key_bytes);
        let cut = n < keys.len();
        let keys = &keys[..n];
        let req = Request::Pin {
            keys: keys.to_vec(),
            lease_ms,
        };
        let sent = Instant::now();
        let r = c.call(&req, &[], self.timeout()).await?;
        if let Response::Error(e) = r.response {
            return Err(ClientError::from_reply(e));
        }
        let Response::Pin(p) = r.response else {
            return Err(Self::unexpected(&r.response));
        };
        let mut guard = PinnedBlocks {
            conn: c.clone(),
            lease_id: p.lease_id,
            offsets: Vec::with_capacity(p.blocks.len()),
            block: self.block_bytes,
            tiers: p
                .blocks
                .iter()
                .filter_map(|b| TierCode::from_u8(b.tier))
                .collect(),
            miss: match Miss::from_code(p.miss) {
                None if cut && p.blocks.len() == keys.len() => Some(Miss::Busy),
                m => m,
            },
            timeout: self.timeout(),
            deadline: sent + Duration::from_millis(p.lease_ms),
        };
        if p.blocks.len() > keys.len() {
            return Err(ClientError::Protocol("more pinned blocks than keys".into()));
        }
        for b in &p.blocks {
            if let Some(a) = &c.arena {
                // Range-check now so `block()` cannot fail later.
                // SAFETY: only checks the range; the slice is dropped at once.
                unsafe { a.slice(b.offset, self.block_bytes) }?;
            }
            guard.offsets.push(b.offset);
        }
        Ok(guard)
    }

    /// Stores a chain of blocks: `keys[0]`'s parent is `parent`, each next key's parent is
    /// the key before it.
    pub async fn put_chain(
        &self,
        keys: &[BlockKey],
        parent: Option<BlockKey>,
        bufs: &[&[u8]],
    ) -> Stored {
        let entries: Vec<PutEntry> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| PutEntry {
                key: *k,
                parent: if i == 0 { parent } else { Some(keys[i - 1]) },
            })
            .collect();
        self.put(&entries, bufs).await
    }

    /// Stores blocks (parents before children). Local connections write into the places of
    /// their staging region a reserve names and commit (the server copies them into its
    /// arena); remote ones send the bytes straight from `bufs`.
    pub async fn put(&self, entries: &[PutEntry], bufs: &[&[u8]]) -> Stored {
        match self.put_inner(entries, bufs).await {
            Ok(s) => s,
            Err(e) => Stored {
                statuses: vec![],
                failure: Some(Miss::from_error(&e)),
            },
        }
    }

    fn statuses(raw: &[u8]) -> Vec<PutStatus> {
        raw.iter()
            .map(|s| PutStatus::from_u8(*s).unwrap_or(PutStatus::Failed))
            .collect()
    }

    async fn put_inner(&self, entries: &[PutEntry], bufs: &[&[u8]]) -> Result<Stored, ClientError> {
        self.check_bufs(entries.len(), bufs.iter().map(|b| b.len()))?;
        let c = self.conn().await?;
        let mut per = (c.max_payload() / self.block_bytes as u64).max(1) as usize;
        if self.local {
            // A local put reserves at most what the connection's staging region holds (the
            // server sizes it at a quarter of the arena, at most 64 MiB), so a chain longer
            // than DRAM is stored in windows, each committed before the next is reserved.
            per = per.min(staging_blocks(&c, self.block_bytes).max(1));
        }
        let base = meta_base(&if self.local {
            Request::Reserve {
                entries: vec![],
                lease_ms: 0,
            }
        } else {
            Request::Put(vec![])
        });
        let mut statuses = Vec::with_capacity(entries.len());
        let mut done = 0;
        while done < entries.len() {
            let n = c.fit(base, &entries[done..], per, entry_bytes);
            let (ents, bs) = (&entries[done..done + n], &bufs[done..done + n]);
            done += n;
            let raw = if self.local {
                self.put_local(&c, ents, bs).await?
            } else {
                let r = c
                    .call(&Request::Put(ents.to_vec()), bs, self.timeout())
                    .await?;
                match r.response {
                    Response::Put(p) => p.statuses,
                    Response::Error(e) => return Err(ClientError::from_reply(e)),
                    r => return Err(Self::unexpected(&r)),
                }
            };
            if raw.len() != ents.len() {
                return Err(ClientError::Protocol(
                    "put reply has the wrong count".into(),
                ));
            }
            statuses.extend(Self::statuses(&raw));
        }
        Ok(Stored {
            statuses,
            failure: None,
        })
    }

    async fn put_local(
        &self,
        c: &Arc<Conn>,
        ents: &[PutEntry],
        bs: &[&[u8]],
    ) -> Result<Vec<u8>, ClientError> {
        let staging = c.staging.as_ref().ok_or(ClientError::NotLocal("put"))?;
        // One put at a time per connection: the staging region is one.
        let _one = c.put_lock.lock().await;
        let req = Request::Reserve {
            entries: ents.to_vec(),
            lease_ms: self.timeout().as_millis().max(1) as u64,
        };
        let sent = Instant::now();
        let r = c.call(&req, &[], self.timeout()).await?;
        let p = match r.response {
            Response::Reserve(p) => p,
            Response::Error(e) => return Err(ClientError::from_reply(e)),
            r => return Err(Self::unexpected(&r)),
        };
        if p.slots.len() != ents.len() {
            return Err(ClientError::Protocol(
                "reserve reply has the wrong count".into(),
            ));
        }
        if p.reservation_id == 0 {
            return Ok(p.slots.iter().map(|s| s.status).collect());
        }
        // Past the reservation's deadline the server may reuse its slots (once this
        // connection is gone) and refuses the commit: never write or commit after it.
        let deadline = sent + Duration::from_millis(p.lease_ms);
        let in_time = || {
            if Instant::now() < deadline {
                Ok(())
            } else {
                Err(ClientError::Timeout)
            }
        };
        let copied = p.slots.iter().zip(bs).try_for_each(|(s, b)| {
            if s.status == PutStatus::Stored as u8 {
                in_time()?;
                staging.write(s.offset, b)
            } else {
                Ok(())
            }
        });
        let copied = copied.and_then(|()| in_time());
        if let Err(e) = copied {
            let _ = c
                .send_no_reply(
                    &Request::Abort {
                        reservation_id: p.reservation_id,
                    },
                    self.timeout(),
                )
                .await;
            return Err(e);
        }
        let r = c
            .call(
                &Request::Commit {
                    reservation_id: p.reservation_id,
                },
                &[],
                self.timeout(),
            )
            .await?;
        match r.response {
            Response::Commit(p) => Ok(p.statuses),
            Response::Error(e) => Err(ClientError::from_reply(e)),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// Asks the server to copy NVMe-only blocks among `keys` up into DRAM ahead of use;
    /// returns how many copies it queued.
    pub async fn prefetch(&self, keys: &[BlockKey]) -> Result<u64, ClientError> {
        let mut queued = 0;
        for chunk in self
            .key_chunks(keys, |k| Request::Prefetch(KeyList { keys: k }))
            .await?
        {
            match self.call(&chunk).await?.1.response {
                Response::Prefetch { queued: q } => queued += q,
                r => return Err(Self::unexpected(&r)),
            }
        }
        Ok(queued)
    }

    /// `keys` split into requests (made by `make`) that the server accepts.
    async fn key_chunks(
        &self,
        keys: &[BlockKey],
        make: impl Fn(Vec<BlockKey>) -> Request,
    ) -> Result<Vec<Request>, ClientError> {
        let c = self.conn().await?;
        let base = meta_base(&make(vec![]));
        let mut out = Vec::new();
        let mut rest = keys;
        while !rest.is_empty() {
            let (chunk, after) = rest.split_at(c.fit(base, rest, usize::MAX, key_bytes));
            rest = after;
            out.push(make(chunk.to_vec()));
        }
        Ok(out)
    }

    /// Pins the longest cached prefix in DRAM for `lease` (e.g. ahead of a transfer).
    /// Release with [`Client::release`]; returns the lease id (0 when nothing was pinned) and
    /// the pinned blocks' tiers.
    pub async fn pin(
        &self,
        keys: &[BlockKey],
        lease: Duration,
    ) -> Result<(u64, Vec<TierCode>), ClientError> {
        let mut p = self.pin_inner(keys, lease).await?;
        let id = std::mem::take(&mut p.lease_id);
        Ok((id, std::mem::take(&mut p.tiers)))
    }

    /// A locate between cluster peers (opcode 17): pins the longest cached prefix of `keys`
    /// in the server's DRAM for `lease`, as [`Client::pin`] does, and says where each block
    /// lies in the server's arena and the checksum the server states for it
    /// ([`kvtier_core::protocol::block_sum`]), so the caller can read the slots one-sided
    /// (kvtier-transfer) and verify them. Asks as many keys as one request may carry.
    /// Servers answer it only to a cluster peer (`docs/cluster.md`). Release with
    /// [`Client::release`] or [`Client::release_nowait`] on this client.
    pub async fn locate(&self, keys: &[BlockKey], lease: Duration) -> Result<Located, ClientError> {
        let lease_ms = lease.as_millis().max(1) as u64;
        let c = self.conn().await?;
        let base = meta_base(&Request::Locate {
            keys: vec![],
            lease_ms,
        });
        let n = c.fit(base, keys, usize::MAX, key_bytes);
        let req = Request::Locate {
            keys: keys[..n].to_vec(),
            lease_ms,
        };
        let sent = Instant::now();
        let r = c.call(&req, &[], self.timeout()).await?;
        let l = match r.response {
            Response::Locate(l) => l,
            Response::Error(e) => return Err(ClientError::from_reply(e)),
            r => return Err(Self::unexpected(&r)),
        };
        let m = l.pin.blocks.len();
        if m > n {
            return Err(ClientError::Protocol(format!(
                "locate of {n} keys answered {m} blocks"
            )));
        }
        Ok(Located {
            lease_id: l.pin.lease_id,
            deadline: sent + Duration::from_millis(l.pin.lease_ms),
            asked: n,
            offsets: l.pin.blocks.iter().map(|b| b.offset).collect(),
            sums: l.sums,
            miss: Miss::from_code(l.pin.miss).or((m < n).then_some(Miss::NotCached)),
        })
    }

    /// [`Client::release`] without waiting for (or getting) an answer.
    pub async fn release_nowait(&self, lease_id: u64) -> Result<(), ClientError> {
        let c = self.conn().await?;
        c.send_no_reply(&Request::Release { lease_id }, self.timeout())
            .await
    }

    pub async fn release(&self, lease_id: u64) -> Result<(), ClientError> {
        match self.call(&Request::Release { lease_id }).await?.1.response {
            Response::Done => Ok(()),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// A retention hint: the session's prefix `keys` (chain keys from its first block) will
    /// be looked up again in about `expected_return` (an agent waiting on a tool call). The
    /// server keeps the prefix's DRAM blocks from eviction until the session's next lookup
    /// reaches the last of `keys`, or for a bounded time, within its budgets; the reply says
    /// whether it did. `session` (0 = none) lets a newer hint replace the session's older
    /// one; `priority` (0 to [`MAX_RETAIN_PRIORITY`]) lets a hint displace ones of lower
    /// priority when the server's budget is spent (at the same priority, a hint displaces
    /// those that end later: give honest returns). A prefix must fit one request (at most
    /// `max_keys` keys and the metadata limit: 65,534 keys with the defaults); a longer one,
    /// an empty one, an `expected_return` over a day or a priority over the maximum is
    /// refused here without a message.
    pub async fn retain(
        &self,
        session: u64,
        keys: &[BlockKey],
        expected_return: Duration,
        priority: u8,
    ) -> Result<Retained, ClientError> {
        let return_ms = u64::try_from(expected_return.as_millis()).unwrap_or(u64::MAX);
        if keys.is_empty() || return_ms > MAX_RETAIN_RETURN_MS || priority > MAX_RETAIN_PRIORITY {
            return Err(ClientError::Protocol(format!(
                "a retention hint needs keys (got {}), a return within {MAX_RETAIN_RETURN_MS} ms \
                 (got {return_ms}) and a priority up to {MAX_RETAIN_PRIORITY} (got {priority})",
                keys.len()
            )));
        }
        let hint = |keys: Vec<BlockKey>| {
            Request::Retain(RetainHint {
                session,
                keys,
                return_ms,
                priority,
            })
        };
        let fits = {
            let c = self.conn().await?;
            c.fit(meta_base(&hint(vec![])), keys, usize::MAX, key_bytes)
        };
        if fits < keys.len() {
            return Err(ClientError::Protocol(format!(
                "a retention hint holds at most {fits} keys on this server, not {}",
                keys.len()
            )));
        }
        match self.call(&hint(keys.to_vec())).await?.1.response {
            Response::Retain(r) => Ok(Retained {
                status: RetainStatus::from_u8(r.status),
                blocks: r.blocks,
                hold: Duration::from_millis(r.hold_ms),
            }),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// Removes blocks; returns how many were cached.
    pub async fn remove(&self, keys: &[BlockKey]) -> Result<u64, ClientError> {
        let mut removed = 0;
        for chunk in self
            .key_chunks(keys, |k| Request::Remove(KeyList { keys: k }))
            .await?
        {
            match self.call(&chunk).await?.1.response {
                Response::Remove { removed: n } => removed += n,
                r => return Err(Self::unexpected(&r)),
            }
        }
        Ok(removed)
    }

    /// Removes every block of the server (all tenants).
    pub async fn clear(&self) -> Result<(), ClientError> {
        match self.call(&Request::Clear).await?.1.response {
            Response::Done => Ok(()),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// The server's statistics (JSON, as its admin port's `/stats`; with tenants, a
    /// tenant's lists only its own namespace).
    pub async fn stats(&self) -> Result<String, ClientError> {
        match self.call(&Request::Stats).await?.1.response {
            Response::Stats(s) => Ok(s),
            r => Err(Self::unexpected(&r)),
        }
    }

    /// Subscribes to block events from `from_seq` (None: from now). With `snapshot`, every
    /// cached block first arrives as a `Stored` event with sequence 0. Each stream has a
    /// connection of its own: dropping the stream ends the subscription on the server.
    pub async fn events(
        &self,
        from_seq: Option<u64>,
        snapshot: bool,
    ) -> Result<EventStream, ClientError> {
        // A connection of its own (no arena): a subscription lasts as long as the connection
        // that made it, so dropping the stream ends it on the server too.
        let cfg = self.inner.config.clone().zero_copy(false);
        let c = tokio::time::timeout(cfg.connect_timeout, Conn::open(&self.inner.endpoint, &cfg))
            .await
            .unwrap_or_else(|_| Err(ClientError::Connect("connect timed out".into())))?;
        let (tx, rx) = mpsc::channel(64);
        let r = c
            .subscribe(
                &Request::Subscribe { from_seq, snapshot },
                tx,
                self.timeout(),
            )
            .await?;
        match r.response {
            Response::Subscribed { next_seq } => Ok(EventStream {
                rx,
                start_seq: next_seq,
                _conn: c,
            }),
            Response::Error(e) => Err(ClientError::from_reply(e)),
            r => Err(Self::unexpected(&r)),
        }
    }
}

/// Metadata bytes of `r` without its keys or entries.
fn meta_base(r: &Request) -> usize {
    r.encode_meta().len()
}

/// Metadata bytes of one key of a key list.
fn key_bytes(_: &BlockKey) -> usize {
    BlockKey::BYTES
}

/// Metadata bytes of one put entry: its key, then the parent as an option tag and a key.
fn entry_bytes(e: &PutEntry) -> usize {
    1 + BlockKey::BYTES + e.parent.map_or(0, |_| BlockKey::BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_name_themselves() {
        let c = ClientConfig::default();
        assert_eq!(
            Endpoint::parse("unix:///run/kvtier.sock", &c).unwrap(),
            Endpoint::Unix("/run/kvtier.sock".into())
        );
        assert_eq!(
            Endpoint::parse("tcp://127.0.0.1:7450", &c).unwrap(),
            Endpoint::Tcp("127.0.0.1:7450".into())
        );
        assert!(matches!(
            Endpoint::parse("quic://localhost:7451/", &c).unwrap(),
            Endpoint::Quic { .. }
        ));
        assert_eq!(
            Endpoint::parse("tls://10.0.0.1:7453/", &c.clone().server_name("kv.example")).unwrap(),
            Endpoint::Tls {
                addr: "10.0.0.1:7453".into(),
                server_name: "kv.example".into()
            }
        );
        for bad in [
            "",
            "http://x:1",
            "tcp://nohost",
            "tcp://:80",
            "tcp://h:99999",
            "tls://nohost",
            "tls://h:0x1",
            "unix://",
        ] {
            let e = Endpoint::parse(bad, &c).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn errors_become_misses() {
        assert_eq!(Miss::from_error(&ClientError::Timeout), Miss::Timeout);
        assert_eq!(
            Miss::from_error(&ClientError::Disconnected),
            Miss::Disconnected
        );
        assert_eq!(
            Miss::from_error(&ClientError::Server {
                code: Some(ErrorCode::Busy),
                message: "x".into()
            }),
            Miss::Busy
        );
        assert!(matches!(
            Miss::from_error(&ClientError::Connect("no".into())),
            Miss::Unavailable(_)
        ));
        assert_eq!(Miss::from_code(0), None);
        assert_eq!(Miss::from_code(2), Some(Miss::Corrupt));
    }

    #[tokio::test]
    async fn an_absent_server_is_a_miss_not_an_error() {
        let dir = std::env::temp_dir().join(format!("kvtier-absent-{}", std::process::id()));
        let url = format!("unix://{}/none.sock", dir.display());
        let e = Client::connect(&url, ClientConfig::default())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ClientError::Connect(_)), "{e}");
    }
}

//! The daemon's configuration: defaults < TOML file < environment (`KVTIER_<SECTION>_<KEY>`)
//! < command-line `--set section.key=value` (and the shorthand flags of the binary). Every
//! setting is documented in `docs/operations.md`; `config/kvtier.toml` is a template holding
//! exactly the defaults (a test parses it and compares).
//!
//! Settings merge as TOML tables before anything is interpreted, so every layer speaks the
//! same names and a mistake in any layer is reported with the setting's name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtier_core::protocol::Limits;
use kvtier_core::{Dtype, KvKind, KvLayout};
use serde::{Deserialize, Deserializer, Serialize};

use crate::StoreConfig;
use crate::config::{HbmSettings, NvmeSettings};
use crate::policy::DemotionPolicy;
use crate::tier::TierKind;

/// A byte size: an integer, or a string like `"4GiB"`, `"512 MiB"`, `"64k"`; `"auto"` where
/// the setting allows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub enum Size {
    Auto,
    Bytes(u64),
}

impl From<Size> for String {
    fn from(s: Size) -> String {
        match s {
            Size::Auto => "auto".into(),
            Size::Bytes(b) => b.to_string(),
        }
    }
}

/// A SHA-256 digest written as 64 hex digits, `:` between bytes allowed (as `openssl x509
/// -fingerprint -sha256` prints it), either case.
pub(crate) fn parse_sha256(text: &str) -> Result<[u8; 32], String> {
    let hex: String = text.chars().filter(|c| *c != ':').collect();
    let bad = || format!("{text:?} is not a SHA-256 digest (64 hex digits)");
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// Parses `"4GiB"`, `"512m"`, `"1048576"`, `"auto"`.
pub fn parse_size(s: &str) -> Result<Size, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(Size::Auto);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        format!("{s:?} is not a size (examples: 4096, \"64KiB\", \"4GiB\", \"auto\")")
    })?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use B, KiB, MiB, GiB, TiB)"
            ));
        }
    };
    n.checked_mul(1u64 << shift)
        .map(Size::Bytes)
        .ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size::Bytes(n)),
            Raw::S(s) => parse_size(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// Everything the daemon reads. Unknown keys are errors.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub server: ListenConfig,
    pub store: StoreSection,
    pub layout: LayoutSection,
    pub limits: LimitsSection,
    /// Tenants by name (`[tenants.NAME]`); none: one tenant, today's single token, every
    /// client an admin. See `docs/operations.md`, "Tenants".
    pub tenants: std::collections::BTreeMap<String, TenantSection>,
    pub events: EventsSection,
    pub cluster: ClusterSection,
}

/// Cluster membership on etcd (`docs/cluster.md`). Off while `etcd_endpoints` is "". Needs a
/// server built with the `cluster` feature; one built without it refuses a cluster config.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// etcd client URLs, comma-separated (`http://10.0.0.1:2379,http://10.0.0.2:2379`); ""
    /// is no cluster. Default: "".
    pub etcd_endpoints: String,
    /// The cluster's name: its etcd prefix is `/kvtier/<name>/`. Default: "kvtier".
    pub name: String,
    /// This member's id, unique in the cluster (letters, digits, `.`, `_`, `-`; at most 128
    /// bytes); "" is the host name. Default: "".
    pub node_id: String,
    /// The protocol endpoint peers and clients are told (`tls://HOST:PORT`,
    /// `quic://HOST:PORT` or `tcp://HOST:PORT`); "" is the address of the listener
    /// `peer_transport` names, when it is bound to a specific address. Default: "".
    pub advertise_data: String,
    /// Which of this member's listeners peers talk to when `advertise_data` is "": `tls`
    /// (`server.tls`), `quic` (`server.quic`), `tcp` (`server.tcp`, in clear), each of which
    /// must then be bound to a specific address; `auto`, TLS's when it is, else TCP's. TLS
    /// and QUIC peers pin the certificate the member's signed record carries. Default:
    /// "auto".
    pub peer_transport: String,
    /// The IP address this member's kvtier-transfer agent binds and peers read its DRAM at
    /// (one-sided reads, `fetch`); "" is the address of the advertised data endpoint (it
    /// must then be an IP address; `localhost` is 127.0.0.1). Default: "".
    pub advertise_transfer: String,
    /// The port that agent binds (TCP for `fetch` = `tcp`, UDP for `quic`), for firewall
    /// rules; 0 is a free one at each start (peers learn it from the record). Default: 0.
    pub transfer_port: u16,
    /// How blocks come from a peer: `tcp` or `quic`, a one-sided read of the owner's DRAM
    /// over kvtier-transfer's backend of that name, after a locate that pins them there and
    /// states their sums (`docs/cluster.md`, "Data path"); `protocol`, a fetch over the
    /// kvtier protocol (`advertise_data`); `auto`, `tcp` when the advertised data endpoint is
    /// plain TCP anyway, else `protocol` (its TLS: a one-sided read over TCP would carry the
    /// blocks in clear). A peer whose record offers no transfer endpoint is fetched from over
    /// the protocol either way. Default: "auto".
    pub fetch: String,
    /// The admin endpoint peers are told (`http://HOST:PORT`); "" is the admin listener's
    /// address when it is bound to a specific address. Default: "".
    pub advertise_admin: String,
    /// The OpenAI-compatible inference worker this server sits beside (`http://HOST:PORT`),
    /// told to routers that take their worker list from the membership (kvtier-router's
    /// `cluster_etcd`, `docs/router.md`); "" is none. Default: "".
    pub worker_url: String,
    /// File holding the cluster secret (its bytes, trailing newline dropped): member records
    /// are signed with a key derived from it, and records not signed with it are refused.
    /// "" is no authentication (a warning at start). Default: "".
    pub secret_file: String,
    /// Owners per block (rendezvous hashing). Default: 1.
    pub replicas: usize,
    /// Blocks of a prefix chain placed together (a run; `docs/cluster.md`). Default: 64.
    pub run_blocks: usize,
    /// Blocks at the head of a chain placed each by its own key, before the runs begin
    /// (0..=65536; 0: runs from the first block): the length, in blocks, of a system prompt
    /// every request shares (`docs/cluster.md`, "How a chain is spread"). Default: 0.
    pub head_blocks: usize,
    /// How often, in seconds, this member looks in its sampled lookups for blocks after
    /// which many chains diverge (a shared system prompt's last block) and publishes them in
    /// its record; every member starts a run after each block any member published
    /// (`docs/cluster.md`, "Shared prefixes"). 0: this member publishes none (it still
    /// follows the others'). 1..=3600. Default: 10.
    pub split_check_s: u64,
    /// The registration lease's time to live, in seconds: a member that stops renewing is
    /// gone from every view this long after its last renewal. Default: 10.
    pub lease_ttl_s: u64,
    /// Bound on each etcd request and on connecting, in ms. Default: 2000.
    pub etcd_timeout_ms: u64,
    /// Bound on each request to a peer on a lookup's path (connect, lookup, locate, fetch,
    /// read), in ms: a peer that does not answer within it is a miss. The data path is on
    /// only with `secret_file`. Default: 250.
    pub peer_timeout_ms: u64,
    /// Bound on each offer request to an owner (at most 16 MiB of blocks; connecting
    /// included), in ms. Offers run in the background, on connections of their own, so they
    /// get the time a bulk transfer needs over a lossy or busy link; one that does not end
    /// within it is dropped and counted (`failed`). Default: 5000.
    pub offer_timeout_ms: u64,
    /// Put blocks waiting to be offered to their owners, at most; more are dropped and
    /// counted. Default: 16384.
    pub offer_queue_blocks: usize,
    /// With `replicas` > 1, a member whose process started (joined, or restarted) less than
    /// this many seconds ago is asked for a run only when no owner of it past its warm-up is
    /// usable: it holds only what was offered to it since, while those owners hold the run
    /// from before (registering again after an etcd outage keeps the process's start
    /// time). 0: owners by placement rank alone. Default: 120.
    pub warmup_s: u64,
    /// Copies here of blocks another member owns (fetched, or handed to their owner) are
    /// guests, evicted before other blocks, so the cluster keeps one copy of a block when
    /// room is short (`docs/cluster.md`, "Guests"). Default: true.
    pub guests_first: bool,
    /// How requests reach the members, which says which copies are the guests:
    /// `"spread"` (round robin, or any routing that sends a session's turns to several
    /// members): copies of blocks another member owns, on the member that used them;
    /// `"sticky"` (a router keeps each session on one member): copies owners were offered,
    /// so each member keeps what its own sessions use and the owners' copies use only room
    /// that is free; `"auto"`: each member chooses from where its clients' lookups end
    /// (`docs/cluster.md`, "Guests"). Default: "auto".
    pub routing: String,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            etcd_endpoints: String::new(),
            name: "kvtier".into(),
            node_id: String::new(),
            advertise_data: String::new(),
            peer_transport: "auto".into(),
            advertise_transfer: String::new(),
            transfer_port: 0,
            fetch: "auto".into(),
            advertise_admin: String::new(),
            worker_url: String::new(),
            secret_file: String::new(),
            replicas: 1,
            run_blocks: crate::cluster::placement::DEFAULT_RUN_BLOCKS,
            head_blocks: crate::cluster::placement::DEFAULT_HEAD_BLOCKS,
            split_check_s: 10,
            lease_ttl_s: 10,
            etcd_timeout_ms: 2000,
            peer_timeout_ms: 250,
            offer_timeout_ms: 5000,
            offer_queue_blocks: 16384,
            warmup_s: 120,
            guests_first: true,
            routing: "auto".into(),
        }
    }
}

/// Block events for other schedulers (`docs/operations.md`, "Events in vLLM's format").
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSection {
    /// ZMQ PUB endpoint publishing the store's block events in vLLM's KV-events wire format
    /// (`tcp://HOST:PORT`); "" or "off" disables. Default: "".
    pub zmq: String,
    /// The topic frame of every message. Default: "" (vLLM's default).
    pub zmq_topic: String,
    /// Longest wait to fill a batch, in ms. Default: 10.
    pub zmq_batch_ms: u64,
    /// Most events in one batch. Default: 1000.
    pub zmq_batch_events: usize,
}

impl Default for EventsSection {
    fn default() -> Self {
        Self {
            zmq: String::new(),
            zmq_topic: String::new(),
            zmq_batch_ms: 10,
            zmq_batch_events: 1000,
        }
    }
}

/// One tenant: the credential that names it, its role, quota and sharing group.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantSection {
    /// The token its TCP, TLS and QUIC clients present ("" with `token_file`, or for a tenant
    /// of the Unix socket only).
    pub token: String,
    /// File holding its token (first line).
    pub token_file: String,
    /// `"tenant"` (default) or `"admin"` (may also `clear` the store).
    pub role: String,
    /// Most bytes of blocks its namespace holds (counted once, whatever the tiers); `"auto"`:
    /// no quota.
    pub quota: Size,
    /// Sharing group: tenants of one group share one namespace. "": its own.
    pub group: String,
    /// Clients of the Unix socket are this tenant (at most one tenant says so).
    pub unix: bool,
    /// SHA-256 of client certificates (DER; 64 hex digits, `:` between bytes allowed) that
    /// name this tenant over TLS and QUIC; a certificate names at most one tenant. Default: [].
    pub client_cert_sha256: Vec<String>,
    /// Unix socket clients running as one of these users (their `SO_PEERCRED` uid) are this
    /// tenant; a uid names at most one tenant. Default: [].
    pub unix_uids: Vec<u32>,
    /// Its Unix socket clients are passed the DRAM arena (read-only) and a staging region at
    /// hello: they read blocks in place, every namespace's, so only for a tenant trusted with
    /// them all (the one local engine). Others' gets and puts are copies over the socket.
    /// Default: false.
    pub local_arena: bool,
}

impl Default for TenantSection {
    fn default() -> Self {
        Self {
            token: String::new(),
            token_file: String::new(),
            role: "tenant".into(),
            quota: Size::Auto,
            group: String::new(),
            unix: false,
            client_cert_sha256: Vec::new(),
            unix_uids: Vec::new(),
            local_arena: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenConfig {
    /// Name announced in hello replies and metrics. Default: "kvtier".
    pub name: String,
    /// Directory for the Unix socket, the generated token and certificate. Default:
    /// `$XDG_RUNTIME_DIR/kvtier`, else `/tmp/kvtier-<uid>`.
    pub runtime_dir: String,
    /// Unix socket path; "" = `<runtime_dir>/kvtier.sock`; "off" disables it.
    pub unix: String,
    /// Plain TCP listen address; "off" disables. Default: "127.0.0.1:7450". A token sent
    /// over it crosses the network in clear, so an address other than loopback is refused
    /// unless `tcp_plaintext` is true.
    pub tcp: String,
    /// Accept `tcp` on an address other than loopback (plain TCP across a network).
    /// Default: false.
    pub tcp_plaintext: bool,
    /// TLS-over-TCP listen address (the same frames inside TLS, ALPN "kvtier/1", the
    /// certificate of `tls_cert`); "off" disables. Default: "127.0.0.1:7453".
    pub tls: String,
    /// QUIC (UDP) listen address; "off" disables. Default: "127.0.0.1:7451".
    pub quic: String,
    /// HTTP admin address (/health /ready /metrics /stats); "off" disables. Default:
    /// "127.0.0.1:7452".
    pub admin: String,
    /// Token that TCP and QUIC clients must present. "" = read `token_file`, else generate
    /// one and write it to `<runtime_dir>/token` (mode 0600).
    pub token: String,
    /// File holding the token (first line). Default: "".
    pub token_file: String,
    /// PEM certificate chain and key for QUIC and TLS (both present the same one); "" =
    /// generate a self-signed certificate for `localhost` and write it to
    /// `<runtime_dir>/quic-cert.der` for clients to pin (over `quic://` and `tls://`).
    pub tls_cert: String,
    pub tls_key: String,
    /// With `[tenants]`: file holding the secret that maps tenants' keys to the store's
    /// (private, at least 16 bytes, trailing newline dropped), so tenants' blocks outlive a
    /// restart and every server given the same file maps keys alike. "" = derived from
    /// `cluster.secret_file` when that is set, else kept in `<nvme_dir>/tenant-key-secret`
    /// (created at first start) when the NVMe tier is on, else drawn at each start.
    /// Default: "".
    pub tenant_key_secret_file: String,
    /// Group (a name or a numeric gid) given the Unix socket, made 0660 so that its members
    /// may connect; with `[tenants]`, a client's uid must still name a tenant. The socket's
    /// directory must let the group through (e.g. 0710) and is still refused when others
    /// may write it. "" = the socket is 0600, the server's user only. Default: "".
    pub unix_group: String,
    /// Client certificates on TLS and QUIC, asked for when a tenant pins one
    /// (`tenants.NAME.client_cert_sha256`): `"optional"` (a client may present one, or a
    /// token only) or `"required"` (a handshake without one fails). Default: "optional".
    pub tls_client_auth: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    /// The tiers, fastest first: any of "hbm", "dram", "nvme", each at most once, "dram"
    /// required. "hbm" needs a build with the `cuda` feature and a CUDA device; `nvme_dir = ""`
    /// still disables "nvme". Default: ["dram", "nvme"].
    pub tiers: Vec<TierKind>,
    /// HBM tier size (device memory), when `tiers` names "hbm". Default: "1GiB".
    pub hbm_bytes: Size,
    /// CUDA device of the HBM tier. Default: 0.
    pub hbm_device: usize,
    /// DRAM tier size; "auto" = a quarter of available memory, at most 8 GiB.
    pub dram_bytes: Size,
    /// Reserve the DRAM arena at start. Default: true.
    pub dram_prefault: bool,
    /// Local clients may answer lookups of DRAM blocks from the published slot table (no
    /// round trip; without an HBM tier). Default: true.
    pub local_lookups: bool,
    /// NVMe tier directory; "" disables the tier. Default: "./kvtier-data".
    pub nvme_dir: String,
    /// NVMe tier size; "auto" = half the file system's free space, at most 64 GiB.
    pub nvme_bytes: Size,
    /// O_DIRECT on the NVMe tier where the file system allows. Default: true.
    pub nvme_direct_io: bool,
    /// `"write-through"` (default), `"write-back"`, or `"selective:<hits>"` (copy to NVMe after
    /// that many DRAM hits).
    pub demotion: String,
    /// Tier I/O threads. Default: 4.
    pub io_threads: usize,
    /// How long a lookup keeps its DRAM prefix pinned for the load that follows, when the
    /// connection does not load it first; 0 turns holds off. Default: 1,000.
    pub lookup_hold_ms: u64,
    /// Most DRAM blocks all held lookups may pin together (past it a lookup holds nothing,
    /// counted); 0 = a quarter of the DRAM tier. Default: 0.
    pub lookup_hold_max_blocks: u64,
    /// Share of the DRAM tier retention hints may protect together (0 to 1); 0 turns hints
    /// off. Default: 0.5.
    pub retain_max_fraction: f64,
    /// Share of the DRAM tier one tenant's hints may protect (0 to 1); 0 = an equal part of
    /// `retain_max_fraction` per namespace. Default: 0.
    pub retain_tenant_max_fraction: f64,
    /// Longest a hint protects its prefix, in seconds (at most 86,400); a hint expected
    /// back later is refused. Default: 300.
    pub retain_max_s: u64,
    /// A hint protects its prefix for its expected return times this (1 to 100), at most
    /// `retain_max_s`. Default: 1.5.
    pub retain_slack: f64,
}

/// The KV layout of the blocks this server holds (its size sets the slot size).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LayoutSection {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// "bf16", "f16", "f32", "fp8".
    pub dtype: String,
    pub block_tokens: u32,
    /// "kv" (K and V) or "mla" (one latent).
    pub kind: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    /// Default: 1,024. Past it, new connections get a "busy" error and are closed.
    pub max_connections: usize,
    /// Of `max_connections`, places only the Unix socket may take, so that a flood over the
    /// network cannot lock the local worker out. Default: 64.
    pub unix_reserved_connections: usize,
    /// TCP and QUIC connections that have not completed their hello, at most; they are
    /// counted apart from the others. Default: 128.
    pub max_pre_hello_connections: usize,
    /// A new connection must complete its hello within this. Default: 5,000 ms.
    pub hello_timeout_ms: u64,
    /// Failed hellos (wrong or missing token) one peer address (an IPv6 /64) may make at
    /// once before it is refused without a look at its token. Default: 10.
    pub auth_failures_burst: u32,
    /// ...and how many more a minute after that. Default: 6.
    pub auth_failures_per_minute: u32,
    /// Response bytes (metadata and get payloads) queued unsent on one connection; a get
    /// past it is answered "busy", other responses wait. Default: 64 MiB.
    pub max_queued_bytes_per_connection: Size,
    /// Connections to the admin port at once; more are closed at accept. Default: 64.
    pub admin_max_connections: usize,
    /// An admin connection must send a request's headers within this (also when idle
    /// between requests), and lives at most six times this. Default: 10,000 ms.
    pub admin_timeout_ms: u64,
    /// Requests of one connection in flight at once (pipelining depth). Default: 64.
    pub max_inflight_per_connection: usize,
    /// Block bytes being sent to clients at once, all connections together. Default: 1 GiB.
    pub max_inflight_bytes: Size,
    /// With tenants, block bytes being sent to one namespace's connections at once;
    /// `"auto"`: half of `max_inflight_bytes`. Default: "auto".
    pub max_inflight_bytes_per_tenant: Size,
    /// DRAM blocks one connection's pins may hold at once (a pin past it is cut short, miss
    /// "busy"); 0: a quarter of the DRAM tier's slots. Default: 0.
    pub max_pinned_blocks_per_connection: u64,
    /// With tenants, DRAM blocks one namespace's pins may hold at once, all its connections
    /// together; 0: half of the DRAM tier's slots. Default: 0.
    pub max_pinned_blocks_per_tenant: u64,
    /// With tenants, connections one namespace's clients hold at once, every transport
    /// together (a hello past it is refused "busy"); 0: half of `max_connections`.
    /// Default: 0.
    pub max_connections_per_tenant: usize,
    /// With `server.unix_group`, Unix socket connections one uid other than the server's
    /// may hold at once (more are refused "busy" at accept); 0: half of
    /// `unix_reserved_connections`. Default: 0.
    pub max_unix_connections_per_uid: usize,
    /// Keys in one request. Default: 65,536.
    pub max_keys: u32,
    /// Metadata bytes in one frame. Default: 1 MiB.
    pub max_meta_bytes: Size,
    /// Payload bytes in one frame. Default: 256 MiB.
    pub max_payload_bytes: Size,
    /// Longest pin or reservation lease. Default: 30,000 ms.
    pub max_lease_ms: u64,
    /// A connection idle this long between frames is closed (not one holding an event
    /// subscription: a subscriber only listens). Default: 300 s.
    pub idle_timeout_ms: u64,
    /// A frame must arrive whole within this once its first byte came. Default: 10,000 ms.
    pub frame_timeout_ms: u64,
    /// A response must be written within this. Default: 30,000 ms.
    pub write_timeout_ms: u64,
    /// On SIGTERM, wait this long for requests in flight. Default: 10,000 ms.
    pub drain_timeout_ms: u64,
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            name: "kvtier".into(),
            runtime_dir: String::new(),
            unix: String::new(),
            tcp: "127.0.0.1:7450".into(),
            tcp_plaintext: false,
            tls: "127.0.0.1:7453".into(),
            quic: "127.0.0.1:7451".into(),
            admin: "127.0.0.1:7452".into(),
            token: String::new(),
            token_file: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
            tenant_key_secret_file: String::new(),
            unix_group: String::new(),
            tls_client_auth: "optional".into(),
        }
    }
}

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            tiers: vec![TierKind::Dram, TierKind::Nvme],
            hbm_bytes: Size::Bytes(1 << 30),
            hbm_device: 0,
            dram_bytes: Size::Auto,
            dram_prefault: true,
            local_lookups: true,
            nvme_dir: "./kvtier-data".into(),
            nvme_bytes: Size::Auto,
            nvme_direct_io: true,
            demotion: "write-through".into(),
            io_threads: 4,
            lookup_hold_ms: 1_000,
            lookup_hold_max_blocks: 0,
            retain_max_fraction: 0.5,
            retain_tenant_max_fraction: 0.0,
            retain_max_s: 300,
            retain_slack: 1.5,
        }
    }
}

impl Default for LayoutSection {
    /// Llama-3-8B in bf16 with 16-token blocks: 2 MiB a block.
    fn default() -> Self {
        Self {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: "bf16".into(),
            block_tokens: 16,
            kind: "kv".into(),
        }
    }
}

impl Default for LimitsSection {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            max_connections: 1024,
            unix_reserved_connections: 64,
            max_pre_hello_connections: 128,
            hello_timeout_ms: 5_000,
            auth_failures_burst: 10,
            auth_failures_per_minute: 6,
            max_queued_bytes_per_connection: Size::Bytes(64 << 20),
            admin_max_connections: 64,
            admin_timeout_ms: 10_000,
            max_inflight_per_connection: 64,
            max_inflight_bytes: Size::Bytes(1 << 30),
            max_inflight_bytes_per_tenant: Size::Auto,
            max_pinned_blocks_per_connection: 0,
            max_pinned_blocks_per_tenant: 0,
            max_connections_per_tenant: 0,
            max_unix_connections_per_uid: 0,
            max_keys: l.max_keys,
            max_meta_bytes: Size::Bytes(u64::from(l.max_meta_bytes)),
            max_payload_bytes: Size::Bytes(l.max_payload_bytes),
            max_lease_ms: 30_000,
            idle_timeout_ms: 300_000,
            frame_timeout_ms: 10_000,
            write_timeout_ms: 30_000,
            drain_timeout_ms: 10_000,
        }
    }
}

/// A configuration error, naming the setting.
#[derive(Debug, thiserror::Error)]
#[error("config: {setting}: {reason}")]
pub struct ConfigError {
    pub setting: String,
    pub reason: String,
}

/// The longest head of a chain placed per block (`cluster.head_blocks`).
const MAX_HEAD_BLOCKS: usize = 65_536;

/// `value` is one of `choices`, else an error naming `setting` and them: `"x": must be "a",
/// "b" or "c"`.
fn one_of(setting: &str, value: &str, choices: &[&str]) -> Result<(), ConfigError> {
    if choices.contains(&value) {
        return Ok(());
    }
    let quoted: Vec<String> = choices.iter().map(|c| format!("{c:?}")).collect();
    let list = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => quoted.join(""),
    };
    Err(cerr(setting, format!("{value:?}: must be {list}")))
}

fn cerr(setting: impl Into<String>, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError {
        setting: setting.into(),
        reason: reason.to_string(),
    }
}

/// Builds a [`ServerConfig`] from its layers.
#[derive(Default)]
pub struct ConfigLoader {
    table: toml::Table,
}

impl ConfigLoader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Merges a TOML document (a config file's text); `origin` names it in errors.
    pub fn merge_toml(mut self, text: &str, origin: &str) -> Result<Self, ConfigError> {
        let t: toml::Table = text.parse().map_err(|e| cerr(origin, e))?;
        for (section, v) in t {
            let toml::Value::Table(inner) = v else {
                return Err(cerr(
                    format!("{origin}: {section}"),
                    "expected a [section] table",
                ));
            };
            for (k, v) in inner {
                self.set_value(&section, &k, v);
            }
        }
        Ok(self)
    }

    pub fn merge_file(self, path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cerr(format!("config file {}", path.display()), e))?;
        self.merge_toml(&text, &format!("config file {}", path.display()))
    }

    /// Merges `KVTIER_<SECTION>_<KEY>` variables (e.g. `KVTIER_STORE_DRAM_BYTES=4GiB`).
    pub fn merge_env(
        mut self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        for (name, value) in vars {
            let Some(rest) = name.strip_prefix("KVTIER_") else {
                continue;
            };
            let lower = rest.to_ascii_lowercase();
            let Some((section, key)) = ["server", "store", "layout", "limits", "cluster"]
                .iter()
                .find_map(|s| Some((*s, lower.strip_prefix(s)?.strip_prefix('_')?)))
            else {
                // Other KVTIER_ variables (e.g. the SDK's) are not ours.
                continue;
            };
            self.set_value(section, key, scalar(&value));
        }
        Ok(self)
    }

    /// Merges one `section.key=value` assignment (the `--set` flag).
    pub fn set(mut self, assignment: &str) -> Result<Self, ConfigError> {
        let (path, value) = assignment
            .split_once('=')
            .ok_or_else(|| cerr(assignment, "expected section.key=value"))?;
        let (section, key) = path
            .trim()
            .split_once('.')
            .ok_or_else(|| cerr(path, "expected section.key (e.g. store.dram_bytes)"))?;
        self.set_value(section, key, scalar(value.trim()));
        Ok(self)
    }

    fn set_value(&mut self, section: &str, key: &str, v: toml::Value) {
        let t = self
            .table
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(t) = t {
            t.insert(key.to_string(), v);
        }
    }

    pub fn build(self) -> Result<ServerConfig, ConfigError> {
        // Through text, so that a type error points at the offending `key = value` line.
        let text = toml::to_string(&self.table).map_err(|e| cerr("config", e))?;
        let c: ServerConfig = toml::from_str(&text).map_err(|e: toml::de::Error| {
            let setting = e
                .span()
                .map_or_else(|| "config".into(), |sp| setting_at(&text, sp.start));
            cerr(setting, e.message())
        })?;
        c.validate()?;
        Ok(c)
    }
}

/// `section.key` of the line holding byte `offset` of a TOML document.
fn setting_at(text: &str, offset: usize) -> String {
    let (mut section, mut key) = ("", "");
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if let Some(name) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            section = name;
        } else if let Some((k, _)) = t.split_once('=') {
            key = k.trim();
        }
        at += line.len();
        if at > offset {
            break;
        }
    }
    if section.is_empty() {
        key.to_string()
    } else {
        format!("{section}.{key}")
    }
}

/// An environment or flag value: a TOML scalar if it parses as one, else a string.
fn scalar(s: &str) -> toml::Value {
    match format!("v = {s}").parse::<toml::Table>() {
        Ok(mut t) => match t.remove("v") {
            Some(
                v @ (toml::Value::Integer(_)
                | toml::Value::Float(_)
                | toml::Value::Boolean(_)
                | toml::Value::String(_)
                | toml::Value::Array(_)
                | toml::Value::Table(_)),
            ) => v,
            _ => toml::Value::String(s.to_string()),
        },
        Err(_) => toml::Value::String(s.to_string()),
    }
}

/// An address setting: `None` when "off".
fn addr(setting: &str, v: &str) -> Result<Option<SocketAddr>, ConfigError> {
    if v.eq_ignore_ascii_case("off") || v.is_empty() {
        return Ok(None);
    }
    v.parse()
        .map(Some)
        .map_err(|e| cerr(setting, format!("{v:?}: {e}")))
}

impl ServerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.layout()?;
        self.tcp_addr()?;
        self.tls_addr()?;
        self.quic_addr()?;
        self.admin_addr()?;
        self.demotion()?;
        self.tiers()?;
        let l = &self.limits;
        for (name, v) in [
            ("limits.max_connections", l.max_connections as u64),
            (
                "limits.max_inflight_per_connection",
                l.max_inflight_per_connection as u64,
            ),
            ("limits.max_keys", u64::from(l.max_keys)),
            ("limits.max_lease_ms", l.max_lease_ms),
            ("limits.idle_timeout_ms", l.idle_timeout_ms),
            ("limits.frame_timeout_ms", l.frame_timeout_ms),
            ("limits.write_timeout_ms", l.write_timeout_ms),
            ("limits.hello_timeout_ms", l.hello_timeout_ms),
            (
                "limits.max_pre_hello_connections",
                l.max_pre_hello_connections as u64,
            ),
            (
                "limits.admin_max_connections",
                l.admin_max_connections as u64,
            ),
            ("limits.admin_timeout_ms", l.admin_timeout_ms),
            ("store.io_threads", self.store.io_threads as u64),
        ] {
            if v == 0 {
                return Err(cerr(name, "must be at least 1"));
            }
        }
        let meta = self.limits()?.max_meta_bytes;
        if u64::from(meta) < 4096 {
            return Err(cerr("limits.max_meta_bytes", "must be at least 4096"));
        }
        let block = self.layout()?.block_bytes();
        if self.limits()?.max_payload_bytes < block {
            return Err(cerr(
                "limits.max_payload_bytes",
                format!("must hold at least one block ({block} bytes)"),
            ));
        }
        if self.store.hbm_bytes == Size::Auto {
            return Err(cerr(
                "store.hbm_bytes",
                "give a size (\"auto\" is not supported)",
            ));
        }
        for (name, v) in [
            ("store.hbm_bytes", self.store.hbm_bytes),
            ("store.dram_bytes", self.store.dram_bytes),
            ("store.nvme_bytes", self.store.nvme_bytes),
        ] {
            if v == Size::Bytes(0) {
                return Err(cerr(
                    name,
                    "must not be 0 (use \"auto\", or disable the tier)",
                ));
            }
        }
        if l.unix_reserved_connections >= l.max_connections {
            return Err(cerr(
                "limits.unix_reserved_connections",
                format!(
                    "must be below limits.max_connections ({}), or the network has no place",
                    l.max_connections
                ),
            ));
        }
        if matches!(
            l.max_queued_bytes_per_connection,
            Size::Auto | Size::Bytes(0..4096)
        ) {
            return Err(cerr(
                "limits.max_queued_bytes_per_connection",
                "must be a size of at least 4 KiB",
            ));
        }
        if matches!(self.limits.max_inflight_bytes, Size::Auto | Size::Bytes(0)) {
            return Err(cerr(
                "limits.max_inflight_bytes",
                "must be a size of at least one block",
            ));
        }
        if self.limits.max_inflight_bytes_per_tenant == Size::Bytes(0) {
            return Err(cerr(
                "limits.max_inflight_bytes_per_tenant",
                "must be a size of at least one block, or \"auto\"",
            ));
        }
        if self.server.tls_cert.is_empty() != self.server.tls_key.is_empty() {
            return Err(cerr("server.tls_cert", "tls_cert and tls_key go together"));
        }
        self.zmq_endpoint()?;
        self.cluster_enabled()?;
        self.validate_tenants()
    }

    /// Whether `[cluster]` is on (`cluster.etcd_endpoints` set), after checking its settings;
    /// a build without the `cluster` feature refuses it.
    pub fn cluster_enabled(&self) -> Result<bool, ConfigError> {
        let c = &self.cluster;
        let endpoints = self.etcd_endpoints();
        if endpoints.is_empty() {
            return Ok(false);
        }
        if !cfg!(feature = "cluster") {
            return Err(cerr(
                "cluster.etcd_endpoints",
                "this kvtier-server was built without the `cluster` feature; build it with \
                 `cargo build -p kvtier-server --features cluster` (needs protoc: \
                 `apt-get install protobuf-compiler libprotobuf-dev`, or .ci/install-deps), or remove [cluster]",
            ));
        }
        for e in &endpoints {
            if !(e.starts_with("http://") || e.starts_with("https://")) || e.len() < 10 {
                return Err(cerr(
                    "cluster.etcd_endpoints",
                    format!("{e:?} is not an etcd URL (http://HOST:PORT)"),
                ));
            }
        }
        let id_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 128
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if !id_ok(&c.name) {
            return Err(cerr(
                "cluster.name",
                "must be 1-128 letters, digits, '.', '_' or '-'",
            ));
        }
        if !c.node_id.is_empty() && !id_ok(&c.node_id) {
            return Err(cerr(
                "cluster.node_id",
                "must be 1-128 letters, digits, '.', '_' or '-' (or \"\" for the host name)",
            ));
        }
        if !c.worker_url.is_empty() && !is_worker_url(&c.worker_url) {
            return Err(cerr(
                "cluster.worker_url",
                format!(
                    "{:?} is not a worker URL (http://HOST:PORT or https://HOST:PORT, no path)",
                    c.worker_url
                ),
            ));
        }
        for (name, v) in [
            ("cluster.replicas", c.replicas as u64),
            ("cluster.run_blocks", c.run_blocks as u64),
            ("cluster.etcd_timeout_ms", c.etcd_timeout_ms),
            ("cluster.peer_timeout_ms", c.peer_timeout_ms),
            ("cluster.offer_timeout_ms", c.offer_timeout_ms),
            ("cluster.offer_queue_blocks", c.offer_queue_blocks as u64),
        ] {
            if v == 0 {
                return Err(cerr(name, "must be at least 1"));
            }
        }
        if !c.advertise_data.is_empty()
            && !is_host_port_url(&c.advertise_data, &["tcp", "tls", "quic"])
        {
            return Err(cerr(
                "cluster.advertise_data",
                format!(
                    "{:?} is not a data endpoint (tcp://, tls:// or quic://, then HOST:PORT)",
                    c.advertise_data
                ),
            ));
        }
        one_of(
            "cluster.peer_transport",
            &c.peer_transport,
            &["auto", "tcp", "tls", "quic"],
        )?;
        one_of(
            "cluster.fetch",
            &c.fetch,
            &["auto", "tcp", "quic", "protocol"],
        )?;
        one_of("cluster.routing", &c.routing, &["auto", "spread", "sticky"])?;
        if !c.advertise_transfer.is_empty()
            && c.advertise_transfer
                .parse::<std::net::IpAddr>()
                .map_or(true, |ip| ip.is_unspecified())
        {
            return Err(cerr(
                "cluster.advertise_transfer",
                format!(
                    "{:?}: must be this member's IP address (peers connect to it)",
                    c.advertise_transfer
                ),
            ));
        }
        if c.head_blocks > MAX_HEAD_BLOCKS {
            return Err(cerr(
                "cluster.head_blocks",
                format!("must be at most {MAX_HEAD_BLOCKS} (each head block is placed alone)"),
            ));
        }
        if c.split_check_s > 3600 {
            return Err(cerr(
                "cluster.split_check_s",
                "must be 0 (off) or 1..=3600 seconds",
            ));
        }
        if !(2..=3600).contains(&c.lease_ttl_s) {
            return Err(cerr(
                "cluster.lease_ttl_s",
                "must be 2..=3600 seconds (etcd refuses shorter leases)",
            ));
        }
        Ok(true)
    }

    /// `cluster.etcd_endpoints`, split on commas, blanks dropped.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.cluster
            .etcd_endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    }

    /// The ZMQ PUB endpoint of `events.zmq` (`tcp://HOST:PORT`, HOST an IP address), or
    /// `None` when off. Refused with `[tenants]`: the stream has no authentication and would
    /// show every namespace's keys to anyone who connects.
    pub fn zmq_endpoint(&self) -> Result<Option<String>, ConfigError> {
        let v = self.events.zmq.as_str();
        if v.is_empty() || v.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let Some(rest) = v.strip_prefix("tcp://") else {
            return Err(cerr(
                "events.zmq",
                format!("{v:?}: expected tcp://HOST:PORT"),
            ));
        };
        rest.parse::<SocketAddr>()
            .map_err(|e| cerr("events.zmq", format!("{v:?}: {e} (expected tcp://IP:PORT)")))?;
        if !self.tenants.is_empty() {
            return Err(cerr(
                "events.zmq",
                "not with [tenants]: a ZMQ PUB socket has no authentication, so it would show \
                 every tenant's block keys to anyone who connects",
            ));
        }
        if self.events.zmq_batch_ms == 0 || self.events.zmq_batch_events == 0 {
            return Err(cerr(
                "events.zmq_batch_ms",
                "events.zmq_batch_ms and events.zmq_batch_events must be at least 1",
            ));
        }
        Ok(Some(v.to_string()))
    }

    fn validate_tenants(&self) -> Result<(), ConfigError> {
        match self.server.tls_client_auth.as_str() {
            "optional" => {}
            "required" if !self.tenants.is_empty() => {}
            "required" => {
                return Err(cerr(
                    "server.tls_client_auth",
                    "\"required\" needs [tenants] with pinned client certificates \
                     (tenants.NAME.client_cert_sha256)",
                ));
            }
            v => {
                return Err(cerr(
                    "server.tls_client_auth",
                    format!("{v:?}: expected \"optional\" or \"required\""),
                ));
            }
        }
        if self.tenants.is_empty() {
            return Ok(());
        }
        for s in ["server.token", "server.token_file"] {
            let v = if s == "server.token" {
                &self.server.token
            } else {
                &self.server.token_file
            };
            if !v.is_empty() {
                return Err(cerr(
                    s,
                    "unused when [tenants] is configured: give each tenant its token",
                ));
            }
        }
        let mut unix = None;
        let mut uids = std::collections::HashMap::new();
        let mut certs = std::collections::HashMap::new();
        let mut pinned = 0;
        for (name, t) in &self.tenants {
            let at = |k: &str| format!("tenants.{name}.{k}");
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(cerr(
                    format!("tenants.{name}"),
                    "a tenant's name is letters, digits, '-' and '_'",
                ));
            }
            if !matches!(t.role.as_str(), "tenant" | "admin") {
                return Err(cerr(
                    at("role"),
                    format!("{:?}: expected \"tenant\" or \"admin\"", t.role),
                ));
            }
            if !t.token.is_empty() && !t.token_file.is_empty() {
                return Err(cerr(at("token"), "token and token_file: give one"));
            }
            let on_unix = t.unix || !t.unix_uids.is_empty();
            if t.token.is_empty()
                && t.token_file.is_empty()
                && t.client_cert_sha256.is_empty()
                && !on_unix
            {
                return Err(cerr(
                    at("token"),
                    "a tenant needs a token (or token_file, or client_cert_sha256), unless it \
                     is reached over the Unix socket only (unix = true, or unix_uids)",
                ));
            }
            for hex in &t.client_cert_sha256 {
                let d = parse_sha256(hex).map_err(|why| cerr(at("client_cert_sha256"), why))?;
                pinned += 1;
                if let Some(other) = certs.insert(d, name) {
                    return Err(cerr(
                        at("client_cert_sha256"),
                        format!(
                            "{hex} is already tenant {other:?}'s: a certificate names one tenant"
                        ),
                    ));
                }
            }
            for uid in &t.unix_uids {
                if let Some(other) = uids.insert(*uid, name) {
                    return Err(cerr(
                        at("unix_uids"),
                        format!("uid {uid} is already tenant {other:?}'s: a uid names one tenant"),
                    ));
                }
            }
            if t.quota == Size::Bytes(0) {
                return Err(cerr(at("quota"), "must not be 0 (\"auto\": no quota)"));
            }
            if t.local_arena && !on_unix {
                return Err(cerr(
                    at("local_arena"),
                    "only the Unix socket's clients can map the arena: set unix = true or \
                     unix_uids too",
                ));
            }
            if t.unix
                && let Some(other) = unix.replace(name)
            {
                return Err(cerr(
                    at("unix"),
                    format!("tenant {other:?} is already the Unix socket's"),
                ));
            }
        }
        if self.server.tls_client_auth == "required" && pinned == 0 {
            return Err(cerr(
                "server.tls_client_auth",
                "\"required\", but no tenant pins a client certificate \
                 (tenants.NAME.client_cert_sha256): no client could connect",
            ));
        }
        Ok(())
    }

    pub fn layout(&self) -> Result<KvLayout, ConfigError> {
        let l = &self.layout;
        let dtype = Dtype::parse(&l.dtype).map_err(|e| cerr("layout.dtype", e))?;
        let kind = match l.kind.as_str() {
            "kv" => KvKind::KeyValue,
            "mla" => KvKind::Mla,
            k => {
                return Err(cerr(
                    "layout.kind",
                    format!("{k:?}: expected \"kv\" or \"mla\""),
                ));
            }
        };
        KvLayout::with_kind(
            l.layers,
            l.kv_heads,
            l.head_dim,
            dtype,
            l.block_tokens,
            kind,
        )
        .map_err(|e| cerr("layout", e))
    }

    pub fn limits(&self) -> Result<Limits, ConfigError> {
        let bytes = |name: &str, s: Size| match s {
            Size::Bytes(b) => Ok(b),
            Size::Auto => Err(cerr(name, "\"auto\" is not allowed here")),
        };
        Ok(Limits {
            max_meta_bytes: u32::try_from(bytes(
                "limits.max_meta_bytes",
                self.limits.max_meta_bytes,
            )?)
            .map_err(|_| cerr("limits.max_meta_bytes", "at most 4 GiB"))?,
            max_keys: self.limits.max_keys,
            max_payload_bytes: bytes("limits.max_payload_bytes", self.limits.max_payload_bytes)?,
        })
    }

    pub fn demotion(&self) -> Result<DemotionPolicy, ConfigError> {
        let d = self.store.demotion.as_str();
        DemotionPolicy::parse(d).ok_or_else(|| {
            cerr(
                "store.demotion",
                format!("{d:?}: expected write-through, write-back or selective:<hits>"),
            )
        })
    }

    /// The plain TCP address; one other than loopback only with `server.tcp_plaintext`.
    pub fn tcp_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let a = addr("server.tcp", &self.server.tcp)?;
        if let Some(a) = a
            && !a.ip().is_loopback()
            && !self.server.tcp_plaintext
        {
            return Err(cerr(
                "server.tcp",
                format!(
                    "{a} is not a loopback address, and plain TCP sends the token in clear; \
                     use server.tls, or set server.tcp_plaintext = true to accept it"
                ),
            ));
        }
        Ok(a)
    }
    pub fn tls_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        addr("server.tls", &self.server.tls)
    }
    pub fn quic_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        addr("server.quic", &self.server.quic)
    }
    pub fn admin_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        addr("server.admin", &self.server.admin)
    }

    pub fn runtime_dir(&self) -> PathBuf {
        if !self.server.runtime_dir.is_empty() {
            return PathBuf::from(&self.server.runtime_dir);
        }
        match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(d) if !d.is_empty() => PathBuf::from(d).join("kvtier"),
            // SAFETY: getuid has no preconditions and cannot fail.
            _ => PathBuf::from(format!("/tmp/kvtier-{}", unsafe { libc::getuid() })),
        }
    }

    /// The Unix socket path, or `None` when disabled.
    pub fn unix_path(&self) -> Option<PathBuf> {
        match self.server.unix.as_str() {
            "off" => None,
            "" => Some(self.runtime_dir().join("kvtier.sock")),
            p => Some(PathBuf::from(p)),
        }
    }

    pub fn frame_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.frame_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.idle_timeout_ms)
    }
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.write_timeout_ms)
    }
    pub fn hello_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.hello_timeout_ms)
    }
    pub fn admin_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.admin_timeout_ms)
    }
    /// Connections TCP and QUIC may hold together: `max_connections` less the Unix reserve.
    pub fn max_network_connections(&self) -> usize {
        self.limits
            .max_connections
            .saturating_sub(self.limits.unix_reserved_connections)
    }
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.drain_timeout_ms)
    }
    pub fn max_lease(&self) -> Duration {
        Duration::from_millis(self.limits.max_lease_ms)
    }

    /// The tiers the store opens, fastest first: `store.tiers`, less "nvme" when `nvme_dir`
    /// is "". Refuses a list out of order, with a duplicate or without "dram", and "hbm" on a
    /// build without the `cuda` feature or a machine without a CUDA device.
    pub fn tiers(&self) -> Result<Vec<TierKind>, ConfigError> {
        let l = &self.store.tiers;
        if !l.windows(2).all(|w| w[0] < w[1]) {
            return Err(cerr(
                "store.tiers",
                "each tier at most once, fastest first (\"hbm\", \"dram\", \"nvme\")",
            ));
        }
        if !l.contains(&TierKind::Dram) {
            return Err(cerr(
                "store.tiers",
                "\"dram\" is required (it holds new blocks and the local zero-copy path)",
            ));
        }
        if l.contains(&TierKind::Hbm) {
            hbm_available().map_err(|e| cerr("store.tiers", format!("\"hbm\": {e}")))?;
        }
        let nvme_off = self.store.nvme_dir.is_empty();
        Ok(l.iter()
            .copied()
            .filter(|&t| !(t == TierKind::Nvme && nvme_off))
            .collect())
    }

    /// The store's configuration, with "auto" sizes resolved against this machine.
    pub fn store_config(&self) -> Result<StoreConfig, ConfigError> {
        let layout = self.layout()?;
        let dram = match self.store.dram_bytes {
            Size::Bytes(b) => b,
            Size::Auto => (available_memory_bytes() / 4).clamp(256 << 20, 8 << 30),
        };
        let mut c = StoreConfig::new(layout, dram);
        c.dram_prefault = self.store.dram_prefault;
        c.local_lookups = self.store.local_lookups;
        // A member's other members may hold what this one does not.
        c.local_lookups_exact = !self.cluster_enabled()?;
        c.demotion = self.demotion()?;
        c.io_threads = self.store.io_threads;
        c.max_lease = self.max_lease();
        c.lookup_hold = Duration::from_millis(self.store.lookup_hold_ms);
        c.lookup_hold_max_blocks = self.store.lookup_hold_max_blocks;
        // A cluster member's blocks may continue chains whose parents other members hold.
        c.admit_orphans =
            !self.cluster.etcd_endpoints.is_empty() && !self.cluster.secret_file.is_empty();
        for (setting, v) in [
            ("store.retain_max_fraction", self.store.retain_max_fraction),
            (
                "store.retain_tenant_max_fraction",
                self.store.retain_tenant_max_fraction,
            ),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(cerr(setting, format!("{v}: give a share from 0 to 1")));
            }
        }
        if !(1.0..=100.0).contains(&self.store.retain_slack) {
            return Err(cerr(
                "store.retain_slack",
                format!("{}: give a factor from 1 to 100", self.store.retain_slack),
            ));
        }
        if self.store.retain_max_s > 86_400 {
            return Err(cerr(
                "store.retain_max_s",
                format!("{}: at most 86400 (a day)", self.store.retain_max_s),
            ));
        }
        c.retain_max_fraction = self.store.retain_max_fraction;
        c.retain_namespace_max_fraction = self.store.retain_tenant_max_fraction;
        c.retain_max = Duration::from_secs(self.store.retain_max_s);
        c.retain_slack = self.store.retain_slack;
        c.tiers = self.tiers()?;
        if c.tiers.contains(&TierKind::Hbm) {
            let Size::Bytes(bytes) = self.store.hbm_bytes else {
                return Err(cerr("store.hbm_bytes", "give a size"));
            };
            let mut h = HbmSettings::new(bytes);
            h.device = self.store.hbm_device;
            c.hbm = Some(h);
        }
        if c.tiers.contains(&TierKind::Nvme) {
            let dir = PathBuf::from(&self.store.nvme_dir);
            let bytes = match self.store.nvme_bytes {
                Size::Bytes(b) => b,
                Size::Auto => {
                    // Private, as the server's startup checks want it (docs/operations.md).
                    std::os::unix::fs::DirBuilderExt::mode(
                        std::fs::DirBuilder::new().recursive(true),
                        0o700,
                    )
                    .create(&dir)
                    .map_err(|e| cerr("store.nvme_dir", format!("{}: {e}", dir.display())))?;
                    auto_nvme_bytes(
                        crate::tier::nvme::available_bytes(&dir).map_err(|e| {
                            cerr("store.nvme_dir", format!("{}: {e}", dir.display()))
                        })?,
                        crate::tier::nvme::slot_files_bytes(&dir),
                    )
                }
            };
            let mut n = NvmeSettings::new(dir, bytes);
            n.direct_io = self.store.nvme_direct_io;
            c.nvme = Some(n);
        }
        Ok(c)
    }
}

/// A worker's base URL as routers take it: `http://` or `https://`, then `HOST:PORT` (a
/// bracketed IPv6 address allowed), nothing after.
pub fn is_worker_url(url: &str) -> bool {
    is_host_port_url(url, &["http", "https"])
}

/// `SCHEME://HOST:PORT` with one of `schemes` (a bracketed IPv6 address allowed), nothing
/// after.
fn is_host_port_url(url: &str, schemes: &[&str]) -> bool {
    let Some(rest) = schemes
        .iter()
        .find_map(|s| url.strip_prefix(s)?.strip_prefix("://"))
    else {
        return false;
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && !host.contains(['/', '?', '#', '@', ' '])
        && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// Whether this build and machine can hold an HBM tier; the reason when not.
fn hbm_available() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        crate::tier::hbm::probe()
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this kvtier-server was built without the `cuda` feature".into())
    }
}

/// MemAvailable from /proc/meminfo (1 GiB if unreadable).
pub fn available_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024)
}

/// `store.nvme_bytes = "auto"`: half the space the tier could have (the file system's free
/// space plus what its own slot files already hold, so a restart sizes it the same), 256 MiB
/// to 64 GiB.
fn auto_nvme_bytes(free: u64, own_files: u64) -> u64 {
    (free.saturating_add(own_files) / 2).clamp(256 << 20, 64 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_nvme_size_is_the_same_after_a_restart() {
        const GIB: u64 = 1 << 30;
        // First start: 40 GiB free, no tier files: 20 GiB.
        let first = auto_nvme_bytes(40 * GIB, 0);
        assert_eq!(first, 20 * GIB);
        // Restart: the tier's 20 GiB of files are no longer free, but count as its own.
        assert_eq!(auto_nvme_bytes(40 * GIB - first, first), first);
        assert_eq!(auto_nvme_bytes(0, 0), 256 << 20, "the floor");
        assert_eq!(
            auto_nvme_bytes(u64::MAX, u64::MAX),
            64 * GIB,
            "the cap, no overflow"
        );
    }

    #[test]
    fn the_tier_counts_only_its_own_slot_files() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(crate::tier::nvme::slot_files_bytes(dir.path()), 0);
        let write = |name: &str, len: usize| std::fs::write(dir.path().join(name), vec![1u8; len]);
        write("slots-00000.kvt", 1 << 20).unwrap();
        write("slots-00001.kvt", 1 << 20).unwrap();
        write("manifest", 1 << 20).unwrap();
        write("slots-x.kvt", 1 << 20).unwrap();
        let got = crate::tier::nvme::slot_files_bytes(dir.path());
        // Two files of 1 MiB, written in full (file systems may allocate a little more).
        assert!(((2 << 20)..(3 << 20)).contains(&got), "{got}");
        assert_eq!(
            crate::tier::nvme::slot_files_bytes(&dir.path().join("absent")),
            0
        );
    }

    fn cluster_config(sets: &[&str]) -> Result<ServerConfig, ConfigError> {
        let mut l = ConfigLoader::new().set("cluster.etcd_endpoints=\"http://127.0.0.1:2379\"")?;
        for a in sets {
            l = l.set(a)?;
        }
        l.build()
    }

    /// Without the `cluster` feature, a `[cluster]` config is refused, naming the feature.
    #[cfg(not(feature = "cluster"))]
    #[test]
    fn a_build_without_the_feature_refuses_a_cluster() {
        let e = cluster_config(&[]).unwrap_err();
        assert_eq!(e.setting, "cluster.etcd_endpoints");
        assert!(e.reason.contains("`cluster` feature"), "{e}");
        assert!(!ServerConfig::default().cluster_enabled().unwrap());
    }

    /// With it: good settings pass; each bad one is named.
    #[cfg(feature = "cluster")]
    #[test]
    fn cluster_settings_are_checked() {
        let c = cluster_config(&["cluster.etcd_endpoints=\"http://a:1, http://b:2\""]).unwrap();
        assert!(c.cluster_enabled().unwrap());
        assert_eq!(c.etcd_endpoints(), ["http://a:1", "http://b:2"]);
        assert!(!ServerConfig::default().cluster_enabled().unwrap());
        for good in [
            "cluster.advertise_data=\"quic://[::1]:7\"",
            "cluster.advertise_data=\"tls://node-3.example:7453\"",
            "cluster.advertise_data=\"tcp://10.0.0.1:7452\"",
            "cluster.peer_transport=\"quic\"",
            "cluster.routing=\"sticky\"",
            "cluster.routing=\"spread\"",
        ] {
            cluster_config(&[good]).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for (set, setting) in [
            ("cluster.etcd_endpoints=\"a:1\"", "cluster.etcd_endpoints"),
            ("cluster.name=\"a/b\"", "cluster.name"),
            ("cluster.name=\"\"", "cluster.name"),
            ("cluster.node_id=\"x y\"", "cluster.node_id"),
            (
                "cluster.worker_url=\"127.0.0.1:8000\"",
                "cluster.worker_url",
            ),
            ("cluster.worker_url=\"http://a:1/v1\"", "cluster.worker_url"),
            ("cluster.worker_url=\"http://\"", "cluster.worker_url"),
            ("cluster.replicas=0", "cluster.replicas"),
            ("cluster.run_blocks=0", "cluster.run_blocks"),
            ("cluster.head_blocks=65537", "cluster.head_blocks"),
            ("cluster.split_check_s=3601", "cluster.split_check_s"),
            ("cluster.lease_ttl_s=1", "cluster.lease_ttl_s"),
            ("cluster.etcd_timeout_ms=0", "cluster.etcd_timeout_ms"),
            ("cluster.peer_timeout_ms=0", "cluster.peer_timeout_ms"),
            ("cluster.offer_timeout_ms=0", "cluster.offer_timeout_ms"),
            ("cluster.offer_queue_blocks=0", "cluster.offer_queue_blocks"),
            ("cluster.fetch=\"rdma\"", "cluster.fetch"),
            ("cluster.peer_transport=\"udp\"", "cluster.peer_transport"),
            ("cluster.routing=\"session\"", "cluster.routing"),
            ("cluster.advertise_data=\"h:1\"", "cluster.advertise_data"),
            (
                "cluster.advertise_data=\"http://h:1\"",
                "cluster.advertise_data",
            ),
            (
                "cluster.advertise_data=\"quic://h\"",
                "cluster.advertise_data",
            ),
            (
                "cluster.advertise_data=\"tls://h:0\"",
                "cluster.advertise_data",
            ),
            (
                "cluster.advertise_data=\"tcp://:7\"",
                "cluster.advertise_data",
            ),
            (
                "cluster.advertise_transfer=\"0.0.0.0\"",
                "cluster.advertise_transfer",
            ),
            (
                "cluster.advertise_transfer=\"host:1\"",
                "cluster.advertise_transfer",
            ),
        ] {
            let e = cluster_config(&[set]).unwrap_err();
            assert_eq!(e.setting, setting, "{set}: {e}");
        }
        let e = cluster_config(&["cluster.fetch=\"rdma\""]).unwrap_err();
        assert_eq!(
            e.reason,
            "\"rdma\": must be \"auto\", \"tcp\", \"quic\" or \"protocol\""
        );
        // From the environment too.
        let c = ConfigLoader::new()
            .merge_env([("KVTIER_CLUSTER_NODE_ID".to_string(), "n7".to_string())])
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(c.cluster.node_id, "n7");
    }

    /// Retention settings reach the store; each bad one is named (fractions and the slack
    /// are TOML floats, also from `--set`).
    #[test]
    fn retain_settings_are_checked() {
        let build = |sets: &[&str]| {
            let mut l = ConfigLoader::new();
            for a in sets {
                l = l.set(a)?;
            }
            l.build()?.store_config()
        };
        let c = build(&[
            "store.retain_max_fraction=0.05",
            "store.retain_tenant_max_fraction=0.01",
            "store.retain_max_s=60",
            "store.retain_slack=2",
        ])
        .unwrap();
        assert_eq!(c.retain_max_fraction, 0.05);
        assert_eq!(c.retain_namespace_max_fraction, 0.01);
        assert_eq!(c.retain_max, Duration::from_secs(60));
        assert_eq!(c.retain_slack, 2.0);
        for (set, setting) in [
            ("store.retain_max_fraction=1.5", "store.retain_max_fraction"),
            (
                "store.retain_tenant_max_fraction=-0.1",
                "store.retain_tenant_max_fraction",
            ),
            ("store.retain_slack=0.5", "store.retain_slack"),
            ("store.retain_max_s=86401", "store.retain_max_s"),
        ] {
            let e = build(&[set]).unwrap_err();
            assert_eq!(e.setting, setting, "{set}: {e}");
        }
    }

    #[test]
    fn the_template_holds_exactly_the_defaults() {
        let text = include_str!("../../../config/kvtier.toml");
        let c = ConfigLoader::new()
            .merge_toml(text, "config/kvtier.toml")
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(c, ServerConfig::default());
        // And it names every setting (a new setting must be added to the template).
        let t: toml::Table = text.parse().unwrap();
        let d = toml::Table::try_from(ServerConfig::default()).unwrap();
        for (section, v) in &d {
            let keys = v.as_table().unwrap();
            let have = t[section].as_table().unwrap();
            for k in keys.keys() {
                assert!(have.contains_key(k), "template lacks {section}.{k}");
            }
        }
    }

    #[test]
    fn layers_override_in_order() {
        let c = ConfigLoader::new()
            .merge_toml("[store]\ndram_bytes = \"1GiB\"\nio_threads = 2\n", "file")
            .unwrap()
            .merge_env([
                ("KVTIER_STORE_DRAM_BYTES".to_string(), "2GiB".to_string()),
                ("KVTIER_LIMITS_MAX_KEYS".to_string(), "128".to_string()),
                ("KVTIER_CLIENT_TIMEOUT".to_string(), "ignored".to_string()),
                ("PATH".to_string(), "/bin".to_string()),
            ])
            .unwrap()
            .set("store.dram_bytes=3GiB")
            .unwrap()
            .set("server.tcp = off")
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(c.store.dram_bytes, Size::Bytes(3 << 30));
        assert_eq!(c.store.io_threads, 2);
        assert_eq!(c.limits.max_keys, 128);
        assert_eq!(c.tcp_addr().unwrap(), None);
    }

    fn check_err(assignments: &[&str], names: &str) {
        let mut l = ConfigLoader::new();
        for a in assignments {
            l = match l.set(a) {
                Ok(l) => l,
                Err(e) => {
                    assert!(e.to_string().contains(names), "{e}");
                    return;
                }
            };
        }
        let e = l.build().unwrap_err();
        assert!(e.to_string().contains(names), "{names}: {e}");
    }

    #[test]
    fn tiers_default_to_dram_and_nvme_and_an_empty_nvme_dir_drops_nvme() {
        use crate::tier::TierKind::{Dram, Hbm, Nvme};
        let c = ConfigLoader::new().build().unwrap();
        assert_eq!(c.tiers().unwrap(), vec![Dram, Nvme]);
        let c = ConfigLoader::new()
            .set("store.nvme_dir=\"\"")
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(c.tiers().unwrap(), vec![Dram]);
        assert!(c.store_config().unwrap().nvme.is_none());
        let c = ConfigLoader::new()
            .set(r#"store.tiers=["dram"]"#)
            .unwrap()
            .set("store.dram_bytes=64MiB")
            .unwrap()
            .build()
            .unwrap();
        let sc = c.store_config().unwrap();
        assert_eq!((sc.tiers.clone(), sc.nvme.is_none()), (vec![Dram], true));
        // "hbm" is taken only where a CUDA device is; elsewhere it is refused by name.
        let hbm = ConfigLoader::new()
            .set(r#"store.tiers=["hbm", "dram", "nvme"]"#)
            .unwrap()
            .build();
        match hbm {
            Ok(c) => assert_eq!(c.tiers().unwrap(), vec![Hbm, Dram, Nvme]),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("store.tiers") && msg.contains("hbm"), "{msg}");
                #[cfg(not(feature = "cuda"))]
                assert!(msg.contains("cuda"), "{msg}");
            }
        }
    }

    #[test]
    fn bad_settings_name_themselves() {
        check_err(&["store.dram_bytes=12 parsecs"], "parsecs");
        check_err(&["store.dram_bytes=0"], "store.dram_bytes");
        check_err(&["store.bogus=1"], "bogus");
        check_err(&["server.tcp=localhost"], "server.tcp");
        check_err(&["events.zmq=\"ipc:///tmp/x\""], "events.zmq");
        check_err(&["events.zmq=\"tcp://localhost:5557\""], "events.zmq");
        check_err(
            &[
                "events.zmq=\"tcp://127.0.0.1:5557\"",
                "events.zmq_batch_events=0",
            ],
            "events.zmq_batch",
        );
        check_err(&["layout.dtype=int3"], "layout.dtype");
        check_err(&["layout.kind=sparse"], "layout.kind");
        check_err(&["layout.layers=0"], "layout");
        check_err(&["store.demotion=sometimes"], "store.demotion");
        check_err(&["limits.max_keys=0"], "limits.max_keys");
        check_err(
            &["limits.max_payload_bytes=4096"],
            "limits.max_payload_bytes",
        );
        check_err(&["server.tls_cert=/x.pem"], "tls_cert");
        check_err(&["nodots=1"], "section.key");
        check_err(&["store.io_threads=\"many\""], "store.io_threads");
        check_err(&["limits.max_lease_ms=-5"], "limits.max_lease_ms");
        check_err(&["server.name=7"], "server.name");
        check_err(&[r#"store.tiers=["nvme", "dram"]"#], "store.tiers");
        check_err(&[r#"store.tiers=["nvme"]"#], "\"dram\" is required");
        check_err(&[r#"store.tiers=["dram", "tape"]"#], "tape");
        check_err(&["store.hbm_bytes=auto"], "store.hbm_bytes");
        let e = ConfigLoader::new()
            .merge_toml("[store\n", "f.toml")
            .err()
            .unwrap();
        assert!(e.to_string().contains("f.toml"), "{e}");
    }

    #[test]
    fn plain_tcp_leaves_loopback_only_when_asked() {
        let build = |sets: &[&str]| {
            let mut l = ConfigLoader::new();
            for s in sets {
                l = l.set(s).unwrap();
            }
            l.build()
        };
        // Loopback, v4 and v6: the default, no flag needed.
        for a in ["127.0.0.1:7450", "[::1]:0", "127.0.0.2:0"] {
            let c = build(&[&format!("server.tcp={a:?}")]).unwrap();
            assert!(c.tcp_addr().unwrap().unwrap().ip().is_loopback());
        }
        for a in ["0.0.0.0:7450", "10.1.2.3:7450", "[::]:7450"] {
            let e = build(&[&format!("server.tcp={a:?}")])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("server.tcp")
                    && e.contains("in clear")
                    && e.contains("server.tcp_plaintext = true"),
                "{e}"
            );
            let c = build(&[&format!("server.tcp={a:?}"), "server.tcp_plaintext=true"]).unwrap();
            assert_eq!(c.tcp_addr().unwrap(), Some(a.parse().unwrap()));
        }
        // The flag is a boolean, and the TLS port may listen anywhere without it.
        check_err(&["server.tcp_plaintext=\"yes\""], "server.tcp_plaintext");
        let c = build(&["server.tls=\"0.0.0.0:7453\""]).unwrap();
        assert_eq!(c.tls_addr().unwrap(), Some("0.0.0.0:7453".parse().unwrap()));
        assert_eq!(
            ServerConfig::default().tls_addr().unwrap(),
            Some("127.0.0.1:7453".parse().unwrap())
        );
        assert_eq!(
            build(&["server.tls=off"]).unwrap().tls_addr().unwrap(),
            None
        );
        check_err(&["server.tls=somewhere"], "server.tls");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4GiB"), Ok(Size::Bytes(4 << 30)));
        assert_eq!(parse_size("64k"), Ok(Size::Bytes(64 << 10)));
        assert_eq!(parse_size(" 512 MiB "), Ok(Size::Bytes(512 << 20)));
        assert_eq!(parse_size("AUTO"), Ok(Size::Auto));
        assert!(parse_size("99999999999TiB").is_err());
        assert!(parse_size("-1").is_err());
    }
}

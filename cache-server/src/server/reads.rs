//! One-sided reads of peers' DRAM over kvtier-transfer (`cluster.fetch` = `tcp` or `quic`;
//! `docs/cluster.md`, "Data path").
//!
//! Each member runs one kvtier-transfer [`Agent`] with its DRAM arena registered as a region
//! that peers may read and never write ([`RegionHandle::refuse_remote_writes`]: the TCP and
//! QUIC targets refuse a WRITE into it). Its metadata blob, without the token, goes into the
//! member's record (`transfer_meta`, under the record's MAC); the token is derived from the
//! cluster secret ([`crate::cluster::record::transfer_token`]) by every member and never
//! travels, so reading etcd lets no one read a member's DRAM. Shared memory and UCX are off
//! on this agent: neither can enforce the read-only rule (the peer maps or registers the
//! memory itself).
//!
//! The asking member's own arena is registered too (read-only to peers as well): a READ it
//! posts lands straight in the slots it reserved for the blocks, with no buffer between.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_transfer::{Agent, AgentConfig, BackendKind, Peer, RegionHandle, RegionId};

use crate::TieredStore;
use crate::cluster::peers::PeerFailure;
use crate::cluster::record::{hex, unhex};

/// First pause after a failed connect to a peer's agent; doubled per failure up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// At most one warning a peer this often that its reads go over the protocol (its agent
/// cannot be reached); the fallbacks themselves are all counted.
const FALLBACK_WARN_EVERY: Duration = Duration::from_secs(60);

/// A peer's agent as this node knows it.
#[derive(Default)]
struct PeerSlot {
    /// The hex blob the connection was made from (a peer that restarted has a new one).
    meta: String,
    peer: Option<(Peer, RegionId, u64)>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// When a read from this peer last fell back to the protocol with a warning.
    warned_at: Option<Instant>,
}

/// This node's agent and its connections to the peers' agents. See the module doc.
pub(crate) struct Reads {
    /// Declared before the agent so the region is withdrawn first.
    arena: RegionHandle,
    agent: Agent,
    backend: BackendKind,
    token: [u8; kvtier_transfer::TOKEN_BYTES],
    meta_hex: String,
    endpoint: String,
    peers: Mutex<HashMap<String, PeerSlot>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A connected peer agent: the peer, its arena's region id and length.
pub(crate) type PeerArena = (Peer, RegionId, u64);

impl Reads {
    /// Starts the agent on `at` (port 0: any) over `backend` (TCP or QUIC) with `token`, and registers
    /// `store`'s DRAM arena, read-only to peers.
    pub async fn start(
        store: &Arc<TieredStore>,
        at: SocketAddr,
        backend: BackendKind,
        token: [u8; kvtier_transfer::TOKEN_BYTES],
        node_id: &str,
    ) -> Result<Self, kvtier_transfer::TransferError> {
        let config = AgentConfig {
            listen_ip: at.ip(),
            listen_port: at.port(),
            shm: false,
            tcp: backend == BackendKind::Tcp,
            quic: backend == BackendKind::Quic,
            ucx: false,
            token: Some(token),
            ..AgentConfig::default()
        };
        let agent = Agent::new(node_id, config).await?;
        let dram = store.dram();
        // SAFETY: the arena is the DRAM tier's own mapping, `arena_bytes` long, mapped as long
        // as the tier, which the store (the `Arc` the region keeps) owns. Peers only read it
        // (writes are refused below, before the blob that names the region exists); this
        // node's own READs write only into slots it reserved (a reservation's slot is
        // written by no one else until committed or dropped, and the reservation is held
        // until the READ into it has settled: `remote::read_owner`, `remote::quarantine`).
        let arena = unsafe {
            agent.register_raw_owned(dram.arena_ptr(), dram.arena_bytes(), store.clone())?
        };
        arena.refuse_remote_writes();
        let meta_hex = hex(&agent.metadata_without_token()?);
        let endpoint = match backend {
            BackendKind::Quic => "quic",
            _ => "tcp",
        };
        Ok(Self {
            endpoint: endpoint.to_string(),
            arena,
            agent,
            backend,
            token,
            meta_hex,
            peers: Mutex::new(HashMap::new()),
        })
    }

    /// The hex blob for this node's record (`transfer_meta`).
    pub fn meta_hex(&self) -> &str {
        &self.meta_hex
    }

    /// The backend's name (`tcp` or `quic`), for the record's `transfer_endpoint`.
    pub fn backend_name(&self) -> &str {
        &self.endpoint
    }

    /// Where the agent listens (`IP:PORT`; "" if it does not).
    pub fn listen_addr(&self) -> String {
        self.agent
            .listen_addr(self.backend)
            .map_or(String::new(), |a| a.to_string())
    }

    /// This node's arena region (the local side of its READs).
    pub fn arena(&self) -> RegionId {
        self.arena.id()
    }

    /// Forgets the connection to `id` (a transfer on it failed: the next read connects
    /// again).
    pub fn forget(&self, id: &str) {
        if let Some(slot) = lock(&self.peers).get_mut(id) {
            slot.peer = None;
        }
    }

    /// Whether a read from `id` that falls back to the protocol now should say so in a
    /// warning (the first, then one every [`FALLBACK_WARN_EVERY`]).
    pub fn warn_fallback(&self, id: &str) -> bool {
        let now = Instant::now();
        let mut g = lock(&self.peers);
        let slot = g.entry(id.to_string()).or_default();
        if slot
            .warned_at
            .is_some_and(|t| now.duration_since(t) < FALLBACK_WARN_EVERY)
        {
            return false;
        }
        slot.warned_at = Some(now);
        true
    }

    /// Drops the connections of peers no longer in `live`.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        lock(&self.peers).retain(|id, _| live(id));
    }

    /// The agent of peer `id` whose record carries `meta` (hex), connecting if needed
    /// within `timeout`; its arena is the one host region its blob lists.
    pub async fn peer(
        &self,
        id: &str,
        meta: &str,
        timeout: Duration,
    ) -> Result<PeerArena, PeerFailure> {
        {
            let mut g = lock(&self.peers);
            let slot = g.entry(id.to_string()).or_default();
            if slot.meta != meta {
                *slot = PeerSlot {
                    meta: meta.to_string(),
                    ..PeerSlot::default()
                };
            }
            if let Some(p) = &slot.peer {
                return Ok(p.clone());
            }
            if slot.retry_at.is_some_and(|t| Instant::now() < t) {
                return Err(PeerFailure::Failed(
                    "backing off after a failed transfer connect".into(),
                ));
            }
        }
        let r = tokio::time::timeout(timeout, self.connect(meta))
            .await
            .unwrap_or(Err(PeerFailure::Timeout));
        let mut g = lock(&self.peers);
        let slot = g.entry(id.to_string()).or_default();
        match &r {
            Ok(p) if slot.meta == meta => {
                slot.peer = Some(p.clone());
                slot.retry_at = None;
                slot.backoff = Duration::ZERO;
            }
            Ok(_) => {}
            Err(_) => {
                slot.backoff = (slot.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                slot.retry_at = Some(Instant::now() + slot.backoff);
            }
        }
        r
    }

    async fn connect(&self, meta: &str) -> Result<PeerArena, PeerFailure> {
        let blob = unhex(meta)
            .filter(|b| !b.is_empty())
            .ok_or_else(|| PeerFailure::Failed("its transfer_meta is not hex".into()))?;
        let peer = self
            .agent
            .connect_with_token(&blob, self.backend, self.token)
            .await
            .map_err(|e| PeerFailure::Failed(format!("transfer connect: {e}")))?;
        let regions = peer.host_regions();
        let [(region, len)] = regions[..] else {
            return Err(PeerFailure::Failed(format!(
                "its transfer blob lists {} host regions, not its one arena",
                regions.len()
            )));
        };
        Ok((peer, region, len))
    }
}

//! Tenants the server enforces (`[tenants]` in the configuration; `docs/operations.md`,
//! "Tenants").
//!
//! With no tenants configured there is one namespace, keys are used as sent and every client
//! may do everything: the server behaves as it always has.
//!
//! With tenants, the credential that authenticated a connection (a tenant's token over TCP,
//! TLS and QUIC; the tenant marked `unix = true`, else an implicit admin, on the Unix socket)
//! names a tenant, and the tenant a **namespace**: its own, or its sharing group's. Every key
//! a client sends is mapped to an internal key in two steps ([`kvtier_core::key_map`]): the
//! namespace key `SHA-256("kvtier tenant namespace v3", secret, namespace name)` (the secret:
//! [`super::key_secret`]), then `HMAC-SHA256(namespace key, key)[..16]`. So namespaces never
//! meet in the store and no client can name an internal key of another namespace: it cannot
//! compute one without that namespace's key, which only the local engine trusted with the
//! arena is given, for its own namespace (to read DRAM hits through the published slot table).
//! Whatever keys a client sends, the server maps them. The store, its tiers and the NVMe
//! files work on internal keys unchanged.
//!
//! The server remembers, for each internal key a tenant stored, its namespace and the
//! client's key ([`Names`]), kept current by the store's events: that is what turns store
//! events and snapshots back into the client's keys, delivered only to subscribers of the
//! block's namespace, each namespace numbering its events in its own sequence. It also counts
//! each namespace's blocks for its quota: a put past the quota first removes the namespace's
//! own oldest blocks (first stored, first removed), never another's; and for its share of a
//! full store ([`Tenants::admit`]): once the namespaces hold all the store keeps, a new block
//! displaces one of the namespace furthest over its share, so none within its share is
//! flushed by another's puts.
//!
//! With a stable secret (a configured one, or the NVMe tier's), a namespace's internal keys
//! are the same after a restart, so a tenant reads the blocks it stored on NVMe before. What
//! the server remembers of them ([`Names`]) is not kept, though: until a tenant stores such a
//! block again, it is in no snapshot, its events go to no subscriber and it does not count
//! against the quota. With a secret drawn at each start, blocks stored before a restart are
//! unreachable and age out by eviction.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kvtier_core::{BlockKey, KeyMap};

use super::brakes::{token_digest, token_matches};
use super::config::{ServerConfig, Size, TenantSection};
use super::events::EventBus;
use crate::{StoreEvent, StoreEventKind, TierKind};

/// A namespace: an index into [`Tenants::buses`].
pub(crate) type Ns = usize;

/// Who a connection is, once it has said hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// May `clear` the store.
    pub admin: bool,
    /// The namespace its keys live in.
    pub ns: Ns,
    /// May be passed the DRAM arena on the Unix socket (it reads every namespace's blocks),
    /// and with it the published slot table and its namespace's key.
    pub local_arena: bool,
}

impl Identity {
    /// The single tenant of a deployment without `[tenants]`.
    pub const SINGLE: Identity = Identity {
        admin: true,
        ns: 0,
        local_arena: true,
    };
}

struct Tenant {
    name: String,
    /// SHA-256 of its token; `None` for a tenant reachable over the Unix socket only.
    digest: Option<[u8; 32]>,
    id: Identity,
}

struct Space {
    /// `tenant:NAME`, `group:NAME`, or `unix` (the Unix socket's own).
    name: String,
    /// Maps the namespace's client keys to internal keys.
    map: KeyMap,
    /// Most blocks the namespace holds; `None`: no quota.
    quota: Option<u64>,
    /// Blocks the namespace keeps whatever the others store: its quota, or an equal part of
    /// what the quotas leave of the store ([`Tenants::new`]).
    share: u64,
}

/// What the server knows of one internal key a tenant stored.
struct Name {
    ns: Ns,
    key: BlockKey,
    /// Tiers holding the block (bit = tier code), from the store's events.
    tiers: u8,
    /// Puts of it in progress.
    pending: u32,
}

#[derive(Default)]
struct Names {
    map: HashMap<BlockKey, Name>,
    /// Per namespace, internal keys in the order they were first stored (stale ones are
    /// skipped when met, and dropped when they outnumber the live ones).
    fifo: Vec<VecDeque<BlockKey>>,
    /// Per namespace, entries of `map` (blocks held or being stored).
    count: Vec<u64>,
}

impl Names {
    /// Takes the oldest block of `ns` still held off its order of storing.
    fn oldest(&mut self, ns: Ns) -> Option<BlockKey> {
        while let Some(v) = self.fifo[ns].pop_front() {
            if self.map.get(&v).is_some_and(|n| n.ns == ns && n.tiers != 0) {
                return Some(v);
            }
        }
        None
    }

    /// Appends a block of `ns` to its order of storing; drops the order's stale entries
    /// (blocks gone, or stored again later) when they outnumber the live ones, so the order
    /// stays within about twice the namespace's blocks.
    fn push_stored(&mut self, ns: Ns, internal: BlockKey) {
        self.fifo[ns].push_back(internal);
        if self.fifo[ns].len() as u64 <= 2 * self.count[ns] + 64 {
            return;
        }
        let mut seen = std::collections::HashSet::new();
        let mut kept: Vec<BlockKey> = Vec::with_capacity(self.count[ns] as usize);
        // Newest first: a block stored again keeps its latest place.
        for k in self.fifo[ns].iter().rev() {
            if self.map.get(k).is_some_and(|n| n.ns == ns && n.tiers != 0) && seen.insert(*k) {
                kept.push(*k);
            }
        }
        kept.reverse();
        self.fifo[ns] = kept.into();
    }
}

struct Multi {
    tenants: Vec<Tenant>,
    /// The Unix socket's clients running as the server's user.
    unix: Identity,
    /// The server's (effective) uid.
    own_uid: u32,
    /// Unix socket clients by uid (`unix_uids`).
    by_uid: HashMap<u32, Identity>,
    /// TLS and QUIC clients by their certificate's SHA-256 (`client_cert_sha256`): the index
    /// of the tenant in `tenants`.
    by_cert: HashMap<[u8; 32], usize>,
    spaces: Vec<Space>,
    /// Distinct blocks the store keeps without its own eviction dropping any
    /// ([`crate::TieredStore::kept_blocks`]): what the namespaces' shares divide.
    kept: u64,
    names: Mutex<Names>,
}

/// The server's tenants, their namespaces and event streams.
pub(crate) struct Tenants {
    multi: Option<Multi>,
    /// One event stream per namespace (one in all without tenants).
    buses: Vec<Arc<EventBus>>,
}

/// Why a block cannot be admitted to its namespace now.
pub(crate) enum Admit {
    /// Remove this block, then try again: the namespace's own oldest (over its quota, or at
    /// its share of a full store), or the oldest of the namespace most over its share.
    Evict(BlockKey),
    /// Over quota with nothing of its own to remove (all being stored), or an internal key
    /// that belongs to another namespace.
    Refuse,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn tier_bit(t: TierKind) -> u8 {
    match t {
        TierKind::Hbm => 1,
        TierKind::Dram => 2,
        TierKind::Nvme => 4,
    }
}

/// A configuration error of `[tenants]`, naming the setting.
pub(crate) type TenantError = super::config::ConfigError;

fn terr(setting: impl Into<String>, reason: impl std::fmt::Display) -> TenantError {
    super::config::ConfigError {
        setting: setting.into(),
        reason: reason.to_string(),
    }
}

/// A tenant's token: the setting, or the first line of `token_file`.
fn tenant_token(name: &str, t: &TenantSection) -> Result<Option<String>, TenantError> {
    if !t.token.is_empty() {
        return Ok(Some(t.token.clone()));
    }
    if t.token_file.is_empty() {
        return Ok(None);
    }
    let setting = format!("tenants.{name}.token_file");
    let text = std::fs::read_to_string(&t.token_file)
        .map_err(|e| terr(&setting, format!("{}: {e}", t.token_file)))?;
    let line = text.lines().next().unwrap_or("").trim().to_string();
    if line.is_empty() {
        return Err(terr(&setting, format!("{} holds no token", t.token_file)));
    }
    Ok(Some(line))
}

impl Tenants {
    /// The tenants of `c` (already validated), for blocks of `block_bytes` in a store that
    /// keeps `kept_blocks` distinct blocks ([`crate::TieredStore::kept_blocks`]). Reads token
    /// files. `secret` maps keys (unused without tenants).
    ///
    /// Each namespace gets a **share** of the store: its quota, or, without one, an equal part
    /// of what the quotas leave. Quotas that add up to more than the store keeps are an error:
    /// they could not all be held at once.
    pub fn new(
        c: &ServerConfig,
        secret: &[u8; 32],
        block_bytes: u64,
        kept_blocks: u64,
    ) -> Result<Tenants, TenantError> {
        if c.tenants.is_empty() {
            return Ok(Tenants {
                multi: None,
                buses: vec![Arc::new(EventBus::new())],
            });
        }
        // Namespaces: each group, then each tenant outside a group, in name order.
        let mut space_of: HashMap<String, Ns> = HashMap::new();
        let mut quotas: Vec<Option<u64>> = Vec::new();
        let mut space_names: Vec<String> = Vec::new();
        let mut tenants = Vec::new();
        let mut unix = None;
        let mut digests: HashMap<[u8; 32], String> = HashMap::new();
        let mut by_uid = HashMap::new();
        let mut by_cert = HashMap::new();
        for (name, t) in &c.tenants {
            let space = if t.group.is_empty() {
                format!("tenant:{name}")
            } else {
                format!("group:{}", t.group)
            };
            let quota = match t.quota {
                Size::Auto => None,
                Size::Bytes(b) => {
                    let blocks = b / block_bytes.max(1);
                    let setting = format!("tenants.{name}.quota");
                    if blocks == 0 {
                        return Err(terr(
                            setting,
                            format!("{b} bytes is less than one block ({block_bytes} bytes)"),
                        ));
                    }
                    // (More than the store keeps: refused below, with the other quotas.)
                    Some(blocks)
                }
            };
            let ns = match space_of.get(&space) {
                Some(&ns) => {
                    if quotas[ns] != quota {
                        return Err(terr(
                            format!("tenants.{name}.quota"),
                            format!(
                                "the members of group {:?} share one namespace and must give \
                                 the same quota (or none)",
                                t.group
                            ),
                        ));
                    }
                    ns
                }
                None => {
                    let ns = quotas.len();
                    let promised: u64 = quotas.iter().flatten().sum::<u64>() + quota.unwrap_or(0);
                    if promised > kept_blocks {
                        return Err(terr(
                            format!("tenants.{name}.quota"),
                            format!(
                                "the quotas add up to {promised} blocks, more than the store \
                                 holds ({kept_blocks} blocks kept by its tiers): they could not \
                                 all be held at once"
                            ),
                        ));
                    }
                    quotas.push(quota);
                    space_names.push(space.clone());
                    space_of.insert(space, ns);
                    ns
                }
            };
            let id = Identity {
                admin: t.role == "admin",
                ns,
                local_arena: t.local_arena,
            };
            let digest = match tenant_token(name, t)? {
                Some(tok) => {
                    let d = token_digest(tok.as_bytes());
                    if let Some(other) = digests.insert(d, name.clone()) {
                        return Err(terr(
                            format!("tenants.{name}.token"),
                            format!("the same token as tenant {other:?}: a token names one tenant"),
                        ));
                    }
                    Some(d)
                }
                None => None,
            };
            if t.unix {
                unix = Some(id);
            }
            for uid in &t.unix_uids {
                by_uid.insert(*uid, id);
            }
            for hex in &t.client_cert_sha256 {
                let d = super::config::parse_sha256(hex)
                    .map_err(|why| terr(format!("tenants.{name}.client_cert_sha256"), why))?;
                by_cert.insert(d, tenants.len());
            }
            tenants.push(Tenant {
                name: name.clone(),
                digest,
                id,
            });
        }
        // The Unix socket's clients run as the server's user: without a tenant marked for
        // it, they are an admin with a namespace of their own, not passed the arena (which
        // holds every namespace's blocks).
        let unix = unix.unwrap_or_else(|| {
            quotas.push(None);
            space_names.push("unix".into());
            Identity {
                admin: true,
                ns: quotas.len() - 1,
                local_arena: false,
            }
        });
        // Namespaces without a quota share equally what the quotas leave.
        let promised: u64 = quotas.iter().flatten().sum();
        let unbounded = quotas.iter().filter(|q| q.is_none()).count() as u64;
        let equal = (kept_blocks - promised) / unbounded.max(1);
        let spaces = quotas
            .iter()
            .enumerate()
            .map(|(ns, q)| {
                Space {
                    name: space_names[ns].clone(),
                    // By name, not number: a namespace keeps its keys when others are added.
                    map: KeyMap::derive(secret, &space_names[ns]),
                    quota: *q,
                    share: q.unwrap_or(equal),
                }
            })
            .collect::<Vec<_>>();
        let n = spaces.len();
        Ok(Tenants {
            multi: Some(Multi {
                tenants,
                unix,
                own_uid: super::places::euid(),
                by_uid,
                by_cert,
                spaces,
                kept: kept_blocks,
                names: Mutex::new(Names {
                    map: HashMap::new(),
                    fifo: vec![VecDeque::new(); n],
                    count: vec![0; n],
                }),
            }),
            buses: (0..n).map(|_| Arc::new(EventBus::new())).collect(),
        })
    }

    /// Whether tenants are configured.
    pub fn enforced(&self) -> bool {
        self.multi.is_some()
    }

    /// How many namespaces there are (1 without tenants).
    pub fn namespaces(&self) -> usize {
        self.buses.len()
    }

    /// The event stream of namespace `ns`.
    pub fn bus(&self, ns: Ns) -> &Arc<EventBus> {
        &self.buses[ns.min(self.buses.len() - 1)]
    }

    /// Who a Unix socket client running as `uid` (its `SO_PEERCRED`; `None`: unknown) is: the
    /// tenant whose `unix_uids` list it; else, for the server's own user, the tenant marked
    /// `unix = true` or the implicit Unix admin. Without tenants, the single tenant (the
    /// socket's mode decides who connects). `None`: a uid mapped to no tenant.
    pub fn unix_identity(&self, uid: Option<u32>) -> Option<Identity> {
        let Some(m) = &self.multi else {
            return Some(Identity::SINGLE);
        };
        let uid = uid?;
        m.by_uid
            .get(&uid)
            .copied()
            .or_else(|| (uid == m.own_uid).then_some(m.unix))
    }

    /// The tenant a token names, and its name, compared in constant time against every
    /// tenant's token (no early exit). `None` when tenants are not configured.
    pub fn by_token(&self, presented: &[u8]) -> Option<Option<(Identity, &str)>> {
        let m = self.multi.as_ref()?;
        let mut found = None;
        for t in &m.tenants {
            if let Some(d) = &t.digest
                && token_matches(presented, d)
            {
                found = Some((t.id, t.name.as_str()));
            }
        }
        Some(found)
    }

    /// The tenant a client certificate (its DER's SHA-256) names, and its name: `None`
    /// when tenants are not configured; `Some(None)`: pinned by no tenant.
    pub fn by_cert(&self, sha256: &[u8; 32]) -> Option<Option<(Identity, &str)>> {
        let m = self.multi.as_ref()?;
        Some(m.by_cert.get(sha256).map(|&i| {
            let t = &m.tenants[i];
            (t.id, t.name.as_str())
        }))
    }

    /// Whether a tenant pins a client certificate (TLS and QUIC then ask for one).
    pub fn pins_client_certs(&self) -> bool {
        self.multi.as_ref().is_some_and(|m| !m.by_cert.is_empty())
    }

    /// Whether keys are used as clients send them (no tenants configured).
    pub fn keys_as_sent(&self) -> bool {
        self.multi.is_none()
    }

    /// The internal key of a client's `key` in namespace `ns`.
    pub fn key(&self, ns: Ns, key: BlockKey) -> BlockKey {
        match &self.multi {
            Some(m) => m.spaces[ns].map.internal(key),
            None => key,
        }
    }

    /// The key mapping of namespace `ns`, for a local client trusted with the arena to read
    /// the published slot table; `None` without tenants (keys are used as sent).
    pub fn key_map(&self, ns: Ns) -> Option<&KeyMap> {
        self.multi.as_ref().map(|m| &m.spaces[ns].map)
    }

    /// The internal keys of a client's keys.
    pub fn keys(&self, ns: Ns, keys: &[BlockKey]) -> Vec<BlockKey> {
        match &self.multi {
            Some(m) => m.spaces[ns].map.internal_many(keys),
            None => keys.to_vec(),
        }
    }

    /// Registers a put of `key` (the client's; `internal`, its internal key) in `ns`, within
    /// the namespace's quota and, when the store is full, its share. Keep the returned guard
    /// until the put is committed or dropped.
    ///
    /// A new block of a namespace at its quota displaces the namespace's own oldest. When
    /// the namespaces together hold all the store keeps, it displaces the oldest block of the
    /// namespace furthest over its share (its own when it is at or over its own share), so
    /// the store's eviction never has to choose, and no namespace within its share loses a
    /// block to another's puts.
    pub fn admit(
        self: &Arc<Self>,
        ns: Ns,
        internal: BlockKey,
        key: BlockKey,
    ) -> Result<Registration, Admit> {
        let Some(m) = &self.multi else {
            return Ok(Registration {
                tenants: None,
                key: internal,
            });
        };
        let mut g = lock(&m.names);
        let names = &mut *g;
        if let Some(n) = names.map.get_mut(&internal) {
            if n.ns != ns {
                return Err(Admit::Refuse);
            }
            n.pending += 1;
        } else {
            if let Some(q) = m.spaces[ns].quota
                && names.count[ns] >= q
            {
                return match names.oldest(ns) {
                    Some(v) => Err(Admit::Evict(v)),
                    None => Err(Admit::Refuse),
                };
            }
            if names.count.iter().sum::<u64>() >= m.kept {
                let over = |v: Ns| names.count[v].saturating_sub(m.spaces[v].share);
                let from = if names.count[ns] >= m.spaces[ns].share {
                    Some(ns)
                } else {
                    (0..m.spaces.len())
                        .filter(|&v| over(v) > 0)
                        .max_by_key(|&v| over(v))
                };
                if let Some(from) = from
                    && let Some(v) = names.oldest(from)
                {
                    return Err(Admit::Evict(v));
                }
                // Nothing to displace (all being stored): the store's own eviction decides.
            }
            names.map.insert(
                internal,
                Name {
                    ns,
                    key,
                    tiers: 0,
                    pending: 1,
                },
            );
            names.count[ns] += 1;
        }
        Ok(Registration {
            tenants: Some(self.clone()),
            key: internal,
        })
    }

    /// Puts `internal` back at the end of its namespace's order of storing: a block chosen
    /// to make room that could not be removed (pinned: a request is reading it) goes to the
    /// back, as if stored again.
    pub fn requeue(&self, internal: BlockKey) {
        let Some(m) = &self.multi else { return };
        let mut g = lock(&m.names);
        if let Some(ns) = g.map.get(&internal).filter(|n| n.tiers != 0).map(|n| n.ns) {
            g.push_stored(ns, internal);
        }
    }

    fn settle(&self, internal: BlockKey) {
        let Some(m) = &self.multi else { return };
        let mut g = lock(&m.names);
        let names = &mut *g;
        if let Some(n) = names.map.get_mut(&internal) {
            n.pending = n.pending.saturating_sub(1);
            if n.pending == 0 && n.tiers == 0 {
                let ns = n.ns;
                names.map.remove(&internal);
                names.count[ns] -= 1;
            }
        }
    }

    /// Each namespace's blocks, quota and share, for `/stats` (`None` without tenants);
    /// `only`: that namespace alone.
    pub fn stats(&self, only: Option<Ns>) -> Option<serde_json::Value> {
        let m = self.multi.as_ref()?;
        let g = lock(&m.names);
        Some(
            m.spaces
                .iter()
                .enumerate()
                .filter(|(ns, _)| only.is_none_or(|o| o == *ns))
                .map(|(ns, sp)| {
                    serde_json::json!({
                        "namespace": sp.name,
                        "blocks": g.count[ns],
                        "quota_blocks": sp.quota,
                        "share_blocks": sp.share,
                        "event_seq": self.buses[ns].next_seq(),
                    })
                })
                .collect(),
        )
    }

    /// Blocks namespace `ns` holds (or is storing).
    #[cfg(test)]
    pub fn blocks(&self, ns: Ns) -> Option<u64> {
        self.multi.as_ref().map(|m| lock(&m.names).count[ns])
    }

    /// The store's event sink: keeps the names current and publishes each event, in the
    /// client's key, to its namespace's stream (`Cleared`: to every stream). An event of a
    /// block no tenant stored in this run is published nowhere.
    pub fn observe(&self, e: StoreEvent) {
        let Some(m) = &self.multi else {
            self.buses[0].publish(e);
            return;
        };
        let mut g = lock(&m.names);
        let names = &mut *g;
        match e.kind {
            StoreEventKind::Cleared => {
                names.map.retain(|_, n| {
                    n.tiers = 0;
                    n.pending > 0
                });
                names.count.iter_mut().for_each(|c| *c = 0);
                names.fifo.iter_mut().for_each(VecDeque::clear);
                for n in names.map.values() {
                    names.count[n.ns] += 1;
                }
                for b in &self.buses {
                    b.publish(e);
                }
            }
            StoreEventKind::Stored => {
                let Some(n) = names.map.get_mut(&e.key) else {
                    return;
                };
                let first = n.tiers == 0;
                n.tiers |= tier_bit(e.tier);
                let (ns, key) = (n.ns, n.key);
                if first {
                    names.push_stored(ns, e.key);
                }
                self.buses[ns].publish(StoreEvent { key, ..e });
            }
            StoreEventKind::Removed => {
                let Some(n) = names.map.get_mut(&e.key) else {
                    return;
                };
                n.tiers &= !tier_bit(e.tier);
                let (ns, key) = (n.ns, n.key);
                if n.tiers == 0 && n.pending == 0 {
                    names.map.remove(&e.key);
                    names.count[ns] -= 1;
                }
                self.buses[ns].publish(StoreEvent { key, ..e });
            }
        }
    }

    /// The client's key of internal key `internal`, when it belongs to namespace `ns`
    /// (always, with keys as sent, without tenants).
    pub fn client_keys(&self, ns: Ns, internal: &[BlockKey]) -> Vec<Option<BlockKey>> {
        let Some(m) = &self.multi else {
            return internal.iter().map(|k| Some(*k)).collect();
        };
        let g = lock(&m.names);
        internal
            .iter()
            .map(|k| {
                g.map
                    .get(k)
                    .filter(|n| n.ns == ns && n.tiers != 0)
                    .map(|n| n.key)
            })
            .collect()
    }
}

/// A put in progress of one internal key: while it lives, the server keeps the key's name
/// (so the store's `Stored` event finds its namespace).
pub(crate) struct Registration {
    tenants: Option<Arc<Tenants>>,
    key: BlockKey,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(t) = &self.tenants {
            t.settle(self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cfg(tenants: &[(&str, TenantSection)]) -> ServerConfig {
        ServerConfig {
            tenants: tenants
                .iter()
                .map(|(n, t)| (n.to_string(), t.clone()))
                .collect::<BTreeMap<_, _>>(),
            ..ServerConfig::default()
        }
    }

    fn tenant(token: &str) -> TenantSection {
        TenantSection {
            token: token.into(),
            ..TenantSection::default()
        }
    }

    const SECRET: [u8; 32] = [7; 32];

    fn with_secret(
        c: &ServerConfig,
        block_bytes: u64,
        capacity: u64,
    ) -> Result<Tenants, TenantError> {
        Tenants::new(c, &SECRET, block_bytes, capacity)
    }

    fn k(i: u128) -> BlockKey {
        BlockKey::from_u128(i)
    }

    fn stored(key: BlockKey) -> StoreEvent {
        StoreEvent {
            kind: StoreEventKind::Stored,
            tier: TierKind::Dram,
            key,
        }
    }

    #[test]
    fn without_tenants_keys_pass_as_sent() {
        let t = Tenants::new(&ServerConfig::default(), &SECRET, 4096, 10).unwrap();
        assert!(!t.enforced());
        assert_eq!(t.key(0, k(7)), k(7));
        assert_eq!(t.by_token(b"x"), None);
        assert_eq!(t.unix_identity(Some(12345)), Some(Identity::SINGLE));
    }

    #[test]
    fn namespaces_part_keys_and_groups_share_them() {
        let mut c = tenant("tc");
        c.group = "g".into();
        let mut d = tenant("td");
        d.group = "g".into();
        let t = with_secret(
            &cfg(&[("a", tenant("ta")), ("b", tenant("tb")), ("c", c), ("d", d)]),
            4096,
            10,
        )
        .unwrap();
        let id = |tok: &[u8]| t.by_token(tok).unwrap().unwrap().0;
        let (a, b, c, d) = (id(b"ta"), id(b"tb"), id(b"tc"), id(b"td"));
        assert_eq!(t.by_token(b"nope"), Some(None));
        assert!(!a.admin);
        assert_ne!(t.key(a.ns, k(1)), t.key(b.ns, k(1)));
        assert_ne!(t.key(a.ns, k(1)), k(1));
        assert_eq!(t.key(c.ns, k(1)), t.key(d.ns, k(1)));
        // A client given its namespace key (at hello) maps exactly as the server does, and
        // with it cannot reach another namespace's internal key.
        let given = KeyMap::from_bytes(*t.key_map(a.ns).unwrap().bytes());
        for i in 0..64 {
            assert_eq!(given.internal(k(i)), t.key(a.ns, k(i)));
            assert_ne!(given.internal(k(i)), t.key(b.ns, k(i)));
        }
        assert_eq!(
            t.key(a.ns, k(1)),
            KeyMap::derive(&SECRET, "tenant:a").internal(k(1)),
            "keyed by the namespace's name"
        );
        // By name: adding a tenant changes no other namespace's keys.
        let more = with_secret(
            &cfg(&[
                ("0", tenant("t0")),
                ("a", tenant("ta")),
                ("b", tenant("tb")),
            ]),
            4096,
            10,
        )
        .unwrap();
        let a2 = more.by_token(b"ta").unwrap().unwrap().0;
        assert_ne!(a2.ns, a.ns, "tenant 0 sorts first and takes namespace 0");
        assert_eq!(more.key(a2.ns, k(1)), t.key(a.ns, k(1)));
        let me = Some(crate::server::places::euid());
        assert!(t.unix_identity(me).unwrap().admin);
        assert_ne!(t.unix_identity(me).unwrap().ns, a.ns);
    }

    #[test]
    fn a_unix_clients_uid_names_its_tenant() {
        let me = crate::server::places::euid();
        let other = me.wrapping_add(1000);
        let mut w = tenant("");
        w.unix = true;
        w.local_arena = true;
        let mut u = tenant("");
        u.unix_uids = vec![other, other + 1];
        let t = with_secret(&cfg(&[("a", tenant("ta")), ("u", u), ("w", w)]), 4096, 10).unwrap();
        let (a, u, w) = (0, 1, 2);
        let id = |uid| t.unix_identity(uid).map(|i| (i.ns, i.admin, i.local_arena));
        assert_eq!(id(Some(other)), Some((u, false, false)));
        assert_eq!(id(Some(other + 1)), Some((u, false, false)));
        assert_eq!(
            id(Some(me)),
            Some((w, false, true)),
            "the server's own user"
        );
        assert_eq!(id(Some(other + 2)), None, "mapped to no tenant");
        assert_eq!(id(None), None);
        assert_ne!(id(Some(other)).unwrap().0, a);
        // Listing the server's own uid names that tenant for it, not the `unix` one.
        let mut mine = tenant("");
        mine.unix_uids = vec![me];
        let t = with_secret(&cfg(&[("m", mine)]), 4096, 10).unwrap();
        assert_eq!(
            t.unix_identity(Some(me)).map(|i| (i.ns, i.admin)),
            Some((0, false))
        );
        // Without tenants, whoever can open the socket is the single tenant.
        let t = with_secret(&ServerConfig::default(), 4096, 10).unwrap();
        assert_eq!(t.unix_identity(Some(other)), Some(Identity::SINGLE));
    }

    #[test]
    fn events_go_to_their_namespace_in_the_clients_key() {
        let t = Arc::new(
            with_secret(&cfg(&[("a", tenant("ta")), ("b", tenant("tb"))]), 4096, 10).unwrap(),
        );
        let (a, b) = (0, 1);
        let ia = t.key(a, k(1));
        let reg = t.admit(a, ia, k(1)).ok().unwrap();
        let mut sa = t.bus(a).subscribe(None);
        let mut sb = t.bus(b).subscribe(None);
        t.observe(stored(ia));
        drop(reg);
        assert_eq!(sa.rx.try_recv().unwrap().key, k(1));
        assert!(sb.rx.try_recv().is_err());
        assert_eq!(t.client_keys(a, &[ia]), vec![Some(k(1))]);
        assert_eq!(t.client_keys(b, &[ia]), vec![None]);
        // Unknown internal keys (another run's) go nowhere.
        t.observe(stored(k(99)));
        assert!(sa.rx.try_recv().is_err());
        assert_eq!(t.blocks(a), Some(1));
        t.observe(StoreEvent {
            kind: StoreEventKind::Removed,
            ..stored(ia)
        });
        assert_eq!(t.blocks(a), Some(0));
    }

    #[test]
    fn a_block_that_could_not_be_removed_goes_to_the_back_of_the_order() {
        let mut a = tenant("ta");
        a.quota = Size::Bytes(3 * 4096);
        let t = Arc::new(with_secret(&cfg(&[("a", a)]), 4096, 10).unwrap());
        assert!(fill(&t, 0, 0, 3).is_empty());
        let victim = |i: u128| match t.admit(0, t.key(0, k(i)), k(i)) {
            Err(Admit::Evict(v)) => v,
            _ => panic!("expected a victim"),
        };
        // The oldest is pinned: back it goes; the next oldest is chosen, then it again.
        assert_eq!(victim(9), t.key(0, k(0)));
        t.requeue(t.key(0, k(0)));
        assert_eq!(victim(9), t.key(0, k(1)));
        t.requeue(t.key(0, k(1)));
        assert_eq!(victim(9), t.key(0, k(2)));
        t.requeue(t.key(0, k(2)));
        assert_eq!(victim(9), t.key(0, k(0)));
    }

    #[test]
    fn a_namespace_over_quota_gives_up_its_own_oldest() {
        let mut a = tenant("ta");
        a.quota = Size::Bytes(2 * 4096);
        let t = Arc::new(with_secret(&cfg(&[("a", a), ("b", tenant("tb"))]), 4096, 10).unwrap());
        for i in 0..2 {
            let ik = t.key(0, k(i));
            let _r = t.admit(0, ik, k(i)).ok().unwrap();
            t.observe(stored(ik));
        }
        let ib = t.key(1, k(5));
        let _r = t.admit(1, ib, k(5)).ok().unwrap();
        t.observe(stored(ib));
        match t.admit(0, t.key(0, k(3)), k(3)) {
            Err(Admit::Evict(v)) => assert_eq!(v, t.key(0, k(0))),
            _ => panic!("expected its own oldest as the victim"),
        }
    }

    #[test]
    fn the_order_of_storing_stays_bounded_when_blocks_leave_by_other_ways() {
        let mut a = tenant("ta");
        a.quota = Size::Bytes(8 * 4096);
        let t = Arc::new(with_secret(&cfg(&[("a", a), ("b", tenant("tb"))]), 4096, 10).unwrap());
        for i in 0..10_000 {
            for ns in [0, 1] {
                let ik = t.key(ns, k(i));
                let r = t.admit(ns, ik, k(i)).ok().unwrap();
                t.observe(stored(ik));
                drop(r);
                // Evicted by the tiers, not by the quota.
                t.observe(StoreEvent {
                    kind: StoreEventKind::Removed,
                    ..stored(ik)
                });
            }
        }
        let m = t.multi.as_ref().unwrap();
        let g = lock(&m.names);
        for ns in [0, 1] {
            assert!(g.fifo[ns].len() <= 66, "{}", g.fifo[ns].len());
        }
        assert!(g.map.is_empty());
    }

    #[test]
    fn tenant_config_errors_name_the_setting() {
        let err = |c: ServerConfig| {
            Tenants::new(&c, &SECRET, 4096, 10)
                .err()
                .unwrap()
                .to_string()
        };
        let e = err(cfg(&[("a", tenant("same")), ("b", tenant("same"))]));
        assert!(
            e.contains("tenants.b.token") && e.contains("same token"),
            "{e}"
        );
        let mut a = tenant("ta");
        a.quota = Size::Bytes(11 * 4096);
        let e = err(cfg(&[("a", a)]));
        assert!(
            e.contains("tenants.a.quota") && e.contains("more than the store"),
            "{e}"
        );
        let mut a = tenant("ta");
        a.quota = Size::Bytes(100);
        assert!(err(cfg(&[("a", a)])).contains("less than one block"));
        // Each quota fits, together they do not.
        let (mut a, mut b) = (tenant("ta"), tenant("tb"));
        a.quota = Size::Bytes(6 * 4096);
        b.quota = Size::Bytes(5 * 4096);
        let e = err(cfg(&[("a", a), ("b", b)]));
        assert!(
            e.contains("tenants.b.quota") && e.contains("add up to 11 blocks"),
            "{e}"
        );
    }

    /// Stores `n` blocks of namespace `ns` (keys from `from`), displacing what `admit` says.
    fn fill(t: &Arc<Tenants>, ns: Ns, from: u128, n: u128) -> Vec<BlockKey> {
        let mut displaced = Vec::new();
        for i in from..from + n {
            let ik = t.key(ns, k(i));
            let r = loop {
                match t.admit(ns, ik, k(i)) {
                    Ok(r) => break r,
                    Err(Admit::Evict(v)) => {
                        displaced.push(v);
                        t.observe(StoreEvent {
                            kind: StoreEventKind::Removed,
                            ..stored(v)
                        });
                    }
                    Err(Admit::Refuse) => panic!("refused"),
                }
            };
            t.observe(stored(ik));
            drop(r);
        }
        displaced
    }

    #[test]
    fn shares_divide_what_the_quotas_leave() {
        let mut q = tenant("tq");
        q.quota = Size::Bytes(4 * 4096);
        let t = with_secret(&cfg(&[("a", tenant("ta")), ("q", q)]), 4096, 10).unwrap();
        let st = t.stats(None).unwrap();
        let share = |name: &str| {
            st.as_array()
                .unwrap()
                .iter()
                .find(|n| n["namespace"] == name)
                .unwrap()["share_blocks"]
                .clone()
        };
        // 10 kept, 4 promised to q: a and the Unix socket's own namespace get 3 each.
        assert_eq!(share("tenant:q"), 4);
        assert_eq!(share("tenant:a"), 3);
        assert_eq!(share("unix"), 3);
    }

    #[test]
    fn a_full_store_takes_from_the_namespace_over_its_share_never_from_one_within_it() {
        // 10 blocks kept; a, b and the Unix namespace (2): a share of 3 each.
        let c = cfg(&[("a", tenant("ta")), ("b", tenant("tb"))]);
        let t = Arc::new(with_secret(&c, 4096, 10).unwrap());
        let of =
            |ns: Ns, keys: std::ops::Range<u128>| keys.map(|i| t.key(ns, k(i))).collect::<Vec<_>>();
        // While there is room, a namespace may hold more than its share.
        assert!(fill(&t, 0, 0, 8).is_empty());
        assert!(fill(&t, 1, 100, 2).is_empty());
        // The store is full: b, below its share, takes a's oldest; at its share, its own.
        let taken = fill(&t, 1, 102, 5);
        let mut want = of(0, 0..1);
        want.extend(of(1, 100..104));
        assert_eq!(taken, want);
        assert_eq!((t.blocks(0), t.blocks(1)), (Some(7), Some(3)));
        // The Unix namespace, idle so far, takes its share from a, the one over its share.
        assert_eq!(fill(&t, 2, 300, 3), of(0, 1..4));
        // a, over its share, pays with its own; b and the Unix namespace keep theirs.
        let mut want = of(0, 4..8);
        want.extend(of(0, 50..51));
        assert_eq!(fill(&t, 0, 50, 5), want);
        assert_eq!(
            (t.blocks(0), t.blocks(1), t.blocks(2)),
            (Some(4), Some(3), Some(3))
        );
    }
}

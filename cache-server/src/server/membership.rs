//! The server's side of `[cluster]`: this node's settings and record from the config, the
//! bound listeners and the store, then the etcd driver started (feature `cluster`).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{ConfigError, Endpoints, ServerConfig, ServerError, places};
use crate::StoreStats;
use crate::cluster::record::RECORD_VERSION;
use crate::cluster::{ClusterMetrics, ClusterNode, ClusterSettings, MemberRecord, TierCapacity};

/// This node's cluster state, if `[cluster]` is on.
pub(crate) fn node(
    c: &ServerConfig,
    endpoints: &Endpoints,
    stats: &StoreStats,
    metrics: ClusterMetrics,
    transfer: Option<&TransferAd>,
) -> Result<Option<Arc<ClusterNode>>, ServerError> {
    if !c.cluster_enabled()? {
        return Ok(None);
    }
    let s = &c.cluster;
    let node_id = if s.node_id.is_empty() {
        host_name().ok_or_else(|| ConfigError {
            setting: "cluster.node_id".into(),
            reason: "not set, and the host name is unknown or not a valid id: set it".into(),
        })?
    } else {
        s.node_id.clone()
    };
    let secret = cluster_secret(c)?;
    if secret.is_none() {
        tracing::warn!(
            "cluster: no cluster.secret_file: member records are not authenticated (anyone \
             who can write to etcd can add a member)"
        );
    }
    let data_endpoint = data_endpoint(c, endpoints);
    if data_endpoint.is_empty() && s.peer_transport != "auto" {
        return Err(ConfigError {
            setting: "cluster.peer_transport".into(),
            reason: format!(
                "{:?}, but server.{} is off or bound to an unspecified address (0.0.0.0, ::): \
                 bind it to this member's address, or set cluster.advertise_data",
                s.peer_transport, s.peer_transport
            ),
        }
        .into());
    }
    // The generated certificate names `localhost`; a configured one, the advertised host.
    let data_cert_name = if c.server.tls_cert.is_empty() {
        "localhost".to_string()
    } else {
        url_host(&data_endpoint)
    };
    let record = MemberRecord {
        v: RECORD_VERSION,
        node_id: node_id.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        data_cert_der: crate::cluster::record::hex(&endpoints.quic_cert_der),
        data_cert_name,
        data_endpoint,
        transfer_endpoint: transfer.map_or(String::new(), |t| t.endpoint.clone()),
        transfer_meta: transfer.map_or(String::new(), |t| t.meta_hex.clone()),
        admin_endpoint: advertised(&s.advertise_admin, "http", endpoints.admin),
        worker_endpoint: s.worker_url.clone(),
        tiers: stats
            .tiers
            .iter()
            .map(|t| TierCapacity {
                kind: t.tier.map_or("unknown", |k| k.name()).into(),
                capacity_bytes: t.capacity_slots.saturating_mul(t.slot_bytes),
            })
            .collect(),
        registered_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        placement: Some(crate::cluster::record::PlacementRule {
            replicas: s.replicas,
            run_blocks: s.run_blocks,
            head_blocks: s.head_blocks,
        }),
        splits: Vec::new(),
    };
    let settings = ClusterSettings {
        etcd_endpoints: c.etcd_endpoints(),
        name: s.name.clone(),
        node_id,
        replicas: s.replicas,
        run_blocks: s.run_blocks,
        head_blocks: s.head_blocks,
        split_check: Duration::from_secs(s.split_check_s),
        lease_ttl: Duration::from_secs(s.lease_ttl_s),
        etcd_timeout: Duration::from_millis(s.etcd_timeout_ms),
        secret,
        peer_timeout: Duration::from_millis(s.peer_timeout_ms),
        offer_timeout: Duration::from_millis(s.offer_timeout_ms),
        offer_queue_blocks: s.offer_queue_blocks,
        warmup: Duration::from_secs(s.warmup_s),
        guests_first: s.guests_first,
        // Checked with the configuration.
        routing: crate::cluster::Routing::parse(&s.routing)
            .unwrap_or(crate::cluster::Routing::Auto),
        // Four times as many put blocks a generation as DRAM holds: a lookup's prefix ends
        // at a block still held, which the policy may have kept well past one DRAM's worth
        // of later puts.
        returns_keys: stats
            .tiers
            .first()
            .map_or(0, |t| (t.capacity_slots as usize).saturating_mul(4))
            .clamp(16_384, 1 << 18),
    };
    Ok(Some(Arc::new(ClusterNode::new(settings, record, metrics))))
}

/// What the record says of this node's kvtier-transfer agent.
pub(crate) struct TransferAd {
    /// `tcp://IP:PORT`-like, informational.
    pub endpoint: String,
    /// Hex of the blob without the token.
    pub meta_hex: String,
}

/// `set` if set, else `scheme://` + the bound address when it is a specific one, else "".
fn advertised(set: &str, scheme: &str, bound: Option<SocketAddr>) -> String {
    if !set.is_empty() {
        return set.to_string();
    }
    match bound {
        Some(a) if !a.ip().is_unspecified() => format!("{scheme}://{a}"),
        _ => String::new(),
    }
}

/// The protocol endpoint this member advertises: `cluster.advertise_data`, else the
/// listener `cluster.peer_transport` names when it is bound to an address peers can reach
/// (`auto`: TLS's when it is, else plain TCP's); "" when none is. Over TLS and QUIC peers pin
/// the certificate the record carries.
pub(crate) fn data_endpoint(c: &ServerConfig, endpoints: &Endpoints) -> String {
    let s = &c.cluster;
    if !s.advertise_data.is_empty() {
        return s.advertise_data.clone();
    }
    match s.peer_transport.as_str() {
        "tls" => advertised("", "tls", endpoints.tls),
        "quic" => advertised("", "quic", endpoints.quic),
        "tcp" => advertised("", "tcp", endpoints.tcp),
        _ => match advertised("", "tls", endpoints.tls) {
            tls if !tls.is_empty() => tls,
            _ => advertised("", "tcp", endpoints.tcp),
        },
    }
}

/// The address this member's kvtier-transfer agent binds and advertises:
/// `cluster.advertise_transfer`, else the advertised data endpoint's host when it is an IP
/// address (or `localhost`); `None` when neither names one.
pub(crate) fn transfer_ip(c: &ServerConfig, endpoints: &Endpoints) -> Option<std::net::IpAddr> {
    let set = &c.cluster.advertise_transfer;
    if !set.is_empty() {
        return set.parse().ok();
    }
    let host = url_host(&data_endpoint(c, endpoints));
    if host == "localhost" {
        return Some(std::net::IpAddr::from([127, 0, 0, 1]));
    }
    host.parse()
        .ok()
        .filter(|ip: &std::net::IpAddr| !ip.is_unspecified())
}

/// The host of `scheme://HOST:PORT` (brackets of an IPv6 address dropped).
fn url_host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// The cluster secret: the bytes of `cluster.secret_file` (private, trailing newline dropped,
/// at least 16 bytes); `None` when the setting is "".
pub(crate) fn cluster_secret(c: &ServerConfig) -> Result<Option<Vec<u8>>, ServerError> {
    let s = &c.cluster;
    if s.secret_file.is_empty() {
        return Ok(None);
    }
    let b = places::read_secret_file("cluster.secret_file", Path::new(&s.secret_file))?;
    Ok(Some(b))
}

/// The host name, if it is a valid node id.
fn host_name() -> Option<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let h = h.trim();
    (!h.is_empty()
        && h.len() <= 128
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
    .then(|| h.to_string())
}

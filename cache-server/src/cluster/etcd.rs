//! The etcd driver (feature `cluster`): one task per node that keeps it registered and its
//! view current. A *session* connects, grants a lease of `lease_ttl`, writes this node's
//! record under it, starts renewing it, lists the member prefix and watches it from the
//! listing's revision. Any failure (a request past `etcd_timeout`, a stream that ends, no
//! renewal answer within the TTL, a lease etcd says is gone, a cancelled watch) ends the
//! session: the view is marked unreachable and keeps its members, and a new session starts
//! after a short, growing pause (at most [`MAX_RETRY`]). The store never waits on any of
//! this.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, GetResponse, PutOptions, WatchOptions,
    WatchResponse,
};
use tokio_util::sync::CancellationToken;

use super::view::{Applied, Change};
use super::{ClusterNode, Rejection};

/// The longest pause between two sessions (before jitter).
pub const MAX_RETRY: Duration = Duration::from_secs(2);
/// The first pause after a failed session.
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("{what}: {source}")]
    Etcd {
        what: &'static str,
        source: etcd_client::Error,
    },
    #[error("{0}: no answer within {1:?}")]
    Timeout(&'static str, Duration),
    #[error("{0}")]
    Lost(String),
}

fn etcd(what: &'static str) -> impl FnOnce(etcd_client::Error) -> SessionError {
    move |source| SessionError::Etcd { what, source }
}

/// Runs `f` within `limit`, naming it in the error.
async fn bounded<T>(
    what: &'static str,
    limit: Duration,
    f: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, SessionError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(etcd(what)),
        Err(_) => Err(SessionError::Timeout(what, limit)),
    }
}

/// The driver: sessions until `stop`, then the lease revoked (bounded by `etcd_timeout`).
pub(super) async fn run(node: Arc<ClusterNode>, stop: CancellationToken) {
    let mut retry = FIRST_RETRY;
    let mut client: Option<Client> = None;
    let mut attempt = 0u64;
    loop {
        let outcome = tokio::select! {
            _ = stop.cancelled() => break,
            r = session(&node, &mut client) => r,
        };
        let Err(e) = outcome;
        node.set_lease_id(0);
        node.metrics.etcd_errors.inc();
        let now = Instant::now();
        let was_connected = node.with_view(|v| {
            let c = matches!(v.link(), super::EtcdLink::Connected { .. });
            v.disconnected(now, e.to_string());
            c
        });
        if was_connected {
            tracing::warn!(
                "cluster: etcd unreachable ({e}); serving local tiers with the last known view"
            );
            retry = FIRST_RETRY;
        } else {
            tracing::debug!("cluster: etcd session failed: {e}");
        }
        // A client whose connection failed may hold a broken channel: start afresh.
        client = None;
        // Jittered (50-150 %, from the node id and the attempt), so that a whole fleet that
        // lost etcd together does not come back in one burst of listings.
        attempt += 1;
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(node.record.node_id.as_bytes(), attempt);
        let pause = retry.mul_f64(0.5 + (h % 1000) as f64 / 1000.0);
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
        retry = (retry * 2).min(MAX_RETRY);
    }
    // Leaving: revoke the lease so the others see this node go now, not at the TTL.
    let lease = node.lease_id();
    if lease != 0
        && let Some(mut c) = client
    {
        let limit = node.settings.etcd_timeout;
        match bounded("lease revoke", limit, c.lease_revoke(lease)).await {
            Ok(_) => tracing::info!("cluster: left (lease {lease:x} revoked)"),
            Err(e) => tracing::warn!("cluster: leaving: {e}; the lease expires by itself"),
        }
        node.set_lease_id(0);
    }
}

/// One session; returns only with the error that ended it (`run` stops it by dropping it).
async fn session(
    node: &Arc<ClusterNode>,
    client: &mut Option<Client>,
) -> Result<std::convert::Infallible, SessionError> {
    let s = &node.settings;
    let limit = s.etcd_timeout;
    let ttl = s.lease_ttl;
    let c = match client {
        Some(c) => c,
        None => {
            let opts = ConnectOptions::new().with_connect_timeout(limit);
            client.insert(
                bounded(
                    "connect",
                    limit,
                    Client::connect(&s.etcd_endpoints, Some(opts)),
                )
                .await?,
            )
        }
    };
    let lease = bounded(
        "lease grant",
        limit,
        c.lease_grant(ttl.as_secs() as i64, None),
    )
    .await?
    .id();
    write_record(c, node, lease, "register").await?;
    node.set_lease_id(lease);
    node.metrics.registrations.inc();
    let (mut keeper, mut renewals) =
        bounded("lease keep-alive", limit, c.lease_keep_alive(lease)).await?;
    let prefix = s.members_prefix();
    let listing = bounded(
        "list members",
        limit,
        c.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let (revision, kvs) = listed(&listing);
    let refused = node.with_view(|v| v.reset(revision, kvs, Instant::now()));
    for r in refused {
        count(node, &r);
    }
    let mut watch = bounded(
        "watch members",
        limit,
        c.watch(
            prefix,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        ),
    )
    .await?;
    let n = node.with_view(|v| v.members().len());
    tracing::info!(
        "cluster: registered as {} (lease {lease:x}, ttl {} s); {n} members",
        node.record.node_id,
        ttl.as_secs()
    );
    // Renew three times per TTL; a renewal unanswered for a whole TTL ends the session.
    let mut tick = tokio::time::interval(ttl / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut answered = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if answered.elapsed() > ttl {
                    return Err(SessionError::Timeout("lease renewal", ttl));
                }
                bounded("lease renewal", limit, keeper.keep_alive()).await?;
            }
            m = renewals.message() => match m.map_err(etcd("lease renewal stream"))? {
                Some(r) if r.ttl() > 0 => {
                    answered = Instant::now();
                    node.metrics.lease_renewals.inc();
                }
                Some(_) => return Err(SessionError::Lost(format!("lease {lease:x} expired"))),
                None => return Err(SessionError::Lost("lease renewal stream ended".into())),
            },
            _ = node.republished() => {
                // The splits it publishes changed: the same key, under the same lease.
                write_record(c, node, lease, "update record").await?;
            }
            w = watch.message() => match w.map_err(etcd("watch"))? {
                Some(resp) => on_watch(node, resp)?,
                None => return Err(SessionError::Lost("watch stream ended".into())),
            },
        }
    }
}

/// A listing of the member prefix as [`super::MembershipView::reset`] takes it: its revision,
/// and (key, value, lease, mod revision) per key. Shared with readers of the membership that
/// do not register (kvtier-router's worker list).
/// Writes this node's record (with the splits it publishes now) at its key, under `lease`.
async fn write_record(
    c: &mut Client,
    node: &ClusterNode,
    lease: i64,
    what: &'static str,
) -> Result<(), SessionError> {
    let value = node.own_value();
    let put = c.put(
        node.own_key(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    );
    bounded(what, node.settings.etcd_timeout, put).await?;
    Ok(())
}

pub fn listed(listing: &GetResponse) -> (i64, Vec<super::view::ListedKey>) {
    let revision = listing.header().map_or(0, |h| h.revision());
    let kvs = listing
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key().to_vec(),
                kv.value().to_vec(),
                kv.lease(),
                kv.mod_revision(),
            )
        })
        .collect();
    (revision, kvs)
}

/// The membership changes in one watch response, in order; an error when etcd cancelled the
/// watch (a compacted revision: the caller lists again). Shared with readers of the
/// membership that do not register (kvtier-router's worker list).
pub fn watch_changes(resp: &WatchResponse) -> Result<Vec<Change>, String> {
    if resp.canceled() {
        return Err(format!(
            "watch cancelled by etcd (compacted at {}): {}",
            resp.compact_revision(),
            resp.cancel_reason()
        ));
    }
    Ok(resp
        .events()
        .iter()
        .filter_map(|ev| {
            let kv = ev.kv()?;
            Some(match ev.event_type() {
                EventType::Put => Change::Put {
                    key: kv.key().to_vec(),
                    value: kv.value().to_vec(),
                    lease_id: kv.lease(),
                    mod_revision: kv.mod_revision(),
                },
                EventType::Delete => Change::Delete {
                    key: kv.key().to_vec(),
                    mod_revision: kv.mod_revision(),
                },
            })
        })
        .collect())
}

fn on_watch(node: &ClusterNode, resp: WatchResponse) -> Result<(), SessionError> {
    let mut own_gone = false;
    for change in watch_changes(&resp).map_err(SessionError::Lost)? {
        node.metrics.watch_events.inc();
        let applied = node.with_view(|v| v.apply(change));
        match &applied {
            Applied::Joined(id) => tracing::info!("cluster: {id} joined"),
            Applied::Left(id) => {
                tracing::info!("cluster: {id} left");
                own_gone |= *id == node.record.node_id;
            }
            _ => {}
        }
        count(node, &applied);
    }
    if own_gone {
        // Our key was deleted while we hold the lease (an operator, or a lease etcd
        // expired early): register again.
        return Err(SessionError::Lost(
            "this node's key was deleted from etcd".into(),
        ));
    }
    Ok(())
}

fn count(node: &ClusterNode, a: &Applied) {
    if let Applied::Rejected(id, why) = a {
        node.metrics
            .records_rejected
            .with_label_values(&[why.name()])
            .inc();
        let hint = match why {
            Rejection::SecretMismatch | Rejection::BadMac => {
                " (not signed with this cluster's secret)"
            }
            _ => "",
        };
        tracing::warn!(
            "cluster: refused the record of {id:?}: {}{hint}",
            why.name()
        );
    }
}

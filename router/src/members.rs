//! Workers from a kvtier cluster's membership (feature `cluster`; `docs/router.md`, "Workers
//! from the cluster").
//!
//! A kvtier cluster's members register signed records under `/kvtier/<name>/members/` in
//! etcd (`kvtier_server::cluster`). A server started with `cluster.worker_url` names the
//! inference worker beside it in its record. The router reads the membership (it lists and
//! watches the prefix; it never registers) into the server crate's own [`MembershipView`],
//! which verifies each record with the cluster secret, and keeps its worker list in step:
//!
//! * a member naming a worker the router does not have adds it, its kvtier server the
//!   member's data endpoint (`tcp://`, or `tls://` with the certificate the signed record
//!   carries, pinned);
//! * a member that leaves (lease expired, revoked at shutdown, key deleted) makes its worker
//!   no candidate at all, its event subscription and health checks stopped; a member that
//!   comes back with the same worker and endpoint gets its place back (indices are stable:
//!   session homes and decisions refer to them);
//! * etcd unreachable: the last known workers stay as they are, `/health` says so, and the
//!   router reconnects with a growing pause (at most 2 s).
//!
//! Configured workers (`workers`, `--worker`) always stay; a member naming one of their URLs
//! adds nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions, WatchOptions};
use kvtier_client::ClientConfig;
use kvtier_server::cluster::record::unhex;
use kvtier_server::cluster::{
    Applied, EtcdLink, MembershipView, RecordSealer, listed, watch_changes,
};
use kvtier_server::server::config::is_worker_url;
use serde_json::{Value, json};

use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::server::{App, WorkerState, health_loop, set_health, subscribe};

/// Bound on each etcd request (connect, list, watch start).
const ETCD_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// A worker as a member's record advertises it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertised {
    pub node_id: String,
    /// The worker's base URL (`cluster.worker_url`, no trailing `/`).
    pub url: String,
    /// The member's data endpoint, whose events tell what the worker can load; None when it
    /// advertises none (or one the router cannot use: then the worker is routed by load).
    pub kvtier: Option<String>,
    /// The certificate to pin on a `tls://` endpoint (the signed record vouches for it).
    pub cert_der: Option<Vec<u8>>,
    pub cert_name: String,
}

/// The workers the members in `view` advertise: one per worker URL (the first member by id
/// when several name the same), members without a worker left out. Also what was refused or
/// degraded, as (member, why).
pub fn advertised(view: &MembershipView) -> (Vec<Advertised>, Vec<(String, String)>) {
    let mut out: Vec<Advertised> = Vec::new();
    let mut notes = Vec::new();
    for (id, m) in view.members() {
        let r = &m.record;
        if r.worker_endpoint.is_empty() {
            continue;
        }
        let url = r.worker_endpoint.trim_end_matches('/').to_string();
        if !is_worker_url(&url) {
            notes.push((
                id.clone(),
                format!(
                    "worker endpoint {:?} is not http(s)://HOST:PORT: not added",
                    r.worker_endpoint
                ),
            ));
            continue;
        }
        if let Some(first) = out.iter().find(|a| a.url == url) {
            notes.push((
                id.clone(),
                format!(
                    "names the worker {url} that {} names: not added twice",
                    first.node_id
                ),
            ));
            continue;
        }
        let d = &r.data_endpoint;
        let (kvtier, cert_der) = if d.starts_with("tcp://") {
            (Some(d.clone()), None)
        } else if d.starts_with("tls://") {
            match unhex(&r.data_cert_der).filter(|c| !c.is_empty()) {
                Some(c) => (Some(d.clone()), Some(c)),
                None => {
                    notes.push((
                        id.clone(),
                        format!(
                            "{d} comes without a certificate to pin: its worker is routed by load"
                        ),
                    ));
                    (None, None)
                }
            }
        } else {
            if !d.is_empty() {
                notes.push((
                    id.clone(),
                    format!(
                        "data endpoint {d:?} is not tcp:// or tls://: its worker is routed by load"
                    ),
                ));
            }
            (None, None)
        };
        out.push(Advertised {
            node_id: id.clone(),
            url,
            kvtier,
            cert_der,
            cert_name: r.data_cert_name.clone(),
        });
    }
    (out, notes)
}

/// What one reconciliation does to the worker list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Indices of membership workers to take back (present again).
    pub rejoin: Vec<usize>,
    /// Indices of membership workers whose member left.
    pub leave: Vec<usize>,
    /// Workers to add, in member id order.
    pub add: Vec<Advertised>,
    /// Advertised workers not added: (member, why).
    pub skipped: Vec<(String, String)>,
}

/// A worker of the list as reconciliation sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub url: String,
    pub kvtier: Option<String>,
    /// From the membership (else configured).
    pub member: bool,
    pub present: bool,
}

/// How the list of `slots` (index order) follows the `want`ed workers, adding at most
/// `max_added` membership workers over the router's life. Pure.
pub fn plan(slots: &[Slot], want: &[Advertised], max_added: usize) -> Plan {
    let mut p = Plan::default();
    let configured: HashSet<&str> = slots
        .iter()
        .filter(|s| !s.member)
        .map(|s| s.url.as_str())
        .collect();
    let mut wanted: BTreeMap<(&str, Option<&str>), &Advertised> = BTreeMap::new();
    for a in want {
        if configured.contains(a.url.as_str()) {
            p.skipped.push((
                a.node_id.clone(),
                format!("{} is a configured worker", a.url),
            ));
            continue;
        }
        wanted.insert((a.url.as_str(), a.kvtier.as_deref()), a);
    }
    for (i, s) in slots.iter().enumerate().filter(|(_, s)| s.member) {
        match wanted.remove(&(s.url.as_str(), s.kvtier.as_deref())) {
            Some(_) if !s.present => p.rejoin.push(i),
            Some(_) => {}
            None if s.present => p.leave.push(i),
            None => {}
        }
    }
    let mut room = max_added.saturating_sub(slots.iter().filter(|s| s.member).count());
    let mut add: Vec<&Advertised> = wanted.into_values().collect();
    add.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    for a in add {
        if room == 0 {
            p.skipped.push((
                a.node_id.clone(),
                format!("max_cluster_workers reached: {} not added", a.url),
            ));
            continue;
        }
        room -= 1;
        p.add.push(a.clone());
    }
    p
}

/// The router's reading of the membership.
pub struct Members {
    endpoints: Vec<String>,
    prefix: String,
    max_added: usize,
    view: Mutex<MembershipView>,
    /// Notes already logged (each is logged once while it holds).
    logged: Mutex<HashSet<(String, String)>>,
}

impl Members {
    /// From `cluster_etcd` and its settings; None when off.
    pub fn from_config(c: &RouterConfig) -> Result<Option<Members>, RouterError> {
        if c.cluster_etcd.is_empty() {
            return Ok(None);
        }
        let secret = match &c.cluster_secret_file {
            Some(p) => Some(
                kvtier_server::server::read_secret_file("cluster_secret_file", p).map_err(|e| {
                    RouterError::Config {
                        field: "cluster_secret_file".into(),
                        reason: e.to_string(),
                    }
                })?,
            ),
            None => {
                tracing::warn!(
                    "cluster_etcd without cluster_secret_file: only unsigned member records \
                     are accepted (anyone who can write to etcd can add a worker)"
                );
                None
            }
        };
        let prefix = format!("/kvtier/{}/members/", c.cluster_name);
        let sealer = RecordSealer::new(secret.as_deref(), &c.cluster_name);
        Ok(Some(Members {
            endpoints: c.cluster_etcd_endpoints(),
            view: Mutex::new(MembershipView::new(prefix.clone(), sealer, 1)),
            prefix,
            max_added: c.max_cluster_workers,
            logged: Mutex::new(HashSet::new()),
        }))
    }

    fn with_view<T>(&self, f: impl FnOnce(&mut MembershipView) -> T) -> T {
        f(&mut self.view.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The membership as `/health` shows it.
    pub fn health(&self) -> Value {
        self.with_view(|v| {
            let etcd = match v.link() {
                EtcdLink::Connecting => json!({"state": "connecting"}),
                EtcdLink::Connected { .. } => json!({"state": "connected"}),
                EtcdLink::Unreachable { since, error } => json!({
                    "state": "unreachable",
                    "for_s": since.elapsed().as_secs_f64(),
                    "error": error,
                }),
            };
            json!({
                "etcd": etcd,
                "members": v.members().keys().collect::<Vec<_>>(),
                "revision": v.revision(),
                "records_refused": v.rejected(),
            })
        })
    }
}

/// Reads the membership until the router stops: one etcd session after another, each
/// listing and then watching the member prefix; the worker list follows every change.
pub(crate) async fn follow(app: App, m: Arc<Members>) {
    let mut retry = FIRST_RETRY;
    loop {
        let r = tokio::select! {
            _ = app.cancel.cancelled() => return,
            r = session(&app, &m) => r,
        };
        let Err(e) = r;
        app.metrics
            .cluster_etcd_connected
            .with_label_values(&[] as &[&str])
            .set(0);
        let was_connected = m.with_view(|v| {
            let c = matches!(v.link(), EtcdLink::Connected { .. });
            v.disconnected(Instant::now(), e.clone());
            c
        });
        if was_connected {
            tracing::warn!("cluster: etcd unreachable ({e}); keeping the last known workers");
            retry = FIRST_RETRY;
        } else {
            tracing::debug!("cluster: etcd session failed: {e}");
        }
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = tokio::time::sleep(retry) => {}
        }
        retry = (retry * 2).min(MAX_RETRY);
    }
}

async fn bounded<T, E: std::fmt::Display>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(ETCD_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {ETCD_TIMEOUT:?}")),
    }
}

async fn session(app: &App, m: &Members) -> Result<Infallible, String> {
    let opts = ConnectOptions::new().with_connect_timeout(ETCD_TIMEOUT);
    let mut c = bounded("connect", Client::connect(&m.endpoints, Some(opts))).await?;
    let listing = bounded(
        "list members",
        c.get(m.prefix.clone(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let (revision, kvs) = listed(&listing);
    let refused = m.with_view(|v| v.reset(revision, kvs, Instant::now()));
    for a in &refused {
        count(app, a);
    }
    app.metrics
        .cluster_etcd_connected
        .with_label_values(&[] as &[&str])
        .set(1);
    reconcile(app, m);
    let mut watch = bounded(
        "watch members",
        c.watch(
            m.prefix.clone(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        ),
    )
    .await?;
    loop {
        let resp = match watch.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return Err("watch stream ended".into()),
            Err(e) => return Err(format!("watch: {e}")),
        };
        for change in watch_changes(&resp)? {
            let a = m.with_view(|v| v.apply(change));
            match &a {
                Applied::Joined(id) => tracing::info!("cluster: member {id} joined"),
                Applied::Left(id) => tracing::info!("cluster: member {id} left"),
                _ => {}
            }
            count(app, &a);
        }
        reconcile(app, m);
    }
}

fn count(app: &App, a: &Applied) {
    if let Applied::Rejected(id, why) = a {
        app.metrics
            .cluster_records_refused
            .with_label_values(&[why.name()])
            .inc();
        tracing::warn!(
            "cluster: refused the record of member {id:?}: {} (not signed with this \
             cluster_secret_file's secret, or malformed): its worker is not added",
            why.name()
        );
    }
}

/// Brings the worker list in step with the membership (see the module doc).
fn reconcile(app: &App, m: &Members) {
    let (want, notes) = m.with_view(|v| advertised(v));
    let all = app.workers.all();
    let slots: Vec<Slot> = all
        .iter()
        .map(|w| Slot {
            url: w.url.clone(),
            kvtier: w.view.as_ref().map(|v| v.url.clone()),
            member: w.member.is_some(),
            present: w.present.load(Ordering::Relaxed),
        })
        .collect();
    let p = plan(&slots, &want, m.max_added);
    {
        let mut logged = m.logged.lock().unwrap_or_else(|e| e.into_inner());
        let now: HashSet<(String, String)> = notes.into_iter().chain(p.skipped).collect();
        for (id, why) in now.difference(&logged) {
            tracing::warn!("cluster: member {id}: {why}");
        }
        *logged = now;
    }
    for &i in &p.leave {
        let w = &all[i];
        w.present.store(false, Ordering::Relaxed);
        if let Some(t) = w.follow.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.cancel();
        }
        set_health(w, false, &app.metrics, "its cluster member left");
        tracing::info!(worker = %w.url, member = ?w.member, "cluster: its member left: no longer a candidate");
    }
    let by_url: HashMap<&str, &Advertised> = want.iter().map(|a| (a.url.as_str(), a)).collect();
    for &i in &p.rejoin {
        let w = &all[i];
        if let (Some(v), Some(a)) = (&w.view, by_url.get(w.url.as_str())) {
            let token = app.cancel.child_token();
            tokio::spawn(crate::events::follow(
                v.clone(),
                client_config(app, a),
                app.metrics.clone(),
                token.clone(),
            ));
            *w.follow.lock().unwrap_or_else(|e| e.into_inner()) = Some(token);
        }
        // Taken back as healthy (it was marked unhealthy when its member left): its health
        // checks resume, and a failure passes it over.
        set_health(w, true, &app.metrics, "its cluster member joined again");
        w.present.store(true, Ordering::Relaxed);
        tracing::info!(worker = %w.url, member = ?w.member, "cluster: its member is back: a candidate again");
    }
    for a in &p.add {
        let token = app.cancel.child_token();
        let view = a.kvtier.as_ref().map(|url| {
            subscribe(
                url,
                client_config(app, a),
                &app.config,
                app.metrics.clone(),
                token.clone(),
            )
            .0
        });
        let w = WorkerState::new(
            &a.url,
            view,
            None,
            Some(a.node_id.clone()),
            &app.config,
            &app.metrics,
        );
        *w.follow.lock().unwrap_or_else(|e| e.into_inner()) = Some(token);
        app.workers.push(w.clone());
        tokio::spawn(health_loop(
            w.clone(),
            app.health.clone(),
            app.config.health_interval(),
            app.metrics.clone(),
            app.cancel.clone(),
        ));
        tracing::info!(worker = %a.url, member = %a.node_id, kvtier = ?a.kvtier,
            "cluster: worker added from the membership");
    }
    let all = app.workers.all();
    for (state, present) in [("present", true), ("left", false)] {
        let n = all
            .iter()
            .filter(|w| w.member.is_some() && w.present.load(Ordering::Relaxed) == present)
            .count();
        app.metrics
            .cluster_workers
            .with_label_values(&[state])
            .set(n as i64);
    }
}

/// The client configuration for a member's data endpoint: the router's token, and on
/// `tls://` the certificate its signed record carries.
fn client_config(app: &App, a: &Advertised) -> ClientConfig {
    let mut cc = ClientConfig::default().zero_copy(false);
    cc.token = app.config.kvtier_token.clone();
    if let Some(c) = &a.cert_der {
        cc.server_cert_der = Some(c.clone());
        if !a.cert_name.is_empty() {
            cc.server_name = a.cert_name.clone();
        }
    }
    cc
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_server::cluster::record::{RECORD_VERSION, hex};
    use kvtier_server::cluster::{MemberRecord, TierCapacity};

    const PREFIX: &str = "/kvtier/c/members/";

    fn record(id: &str, worker: &str, data: &str, cert: &[u8]) -> MemberRecord {
        MemberRecord {
            v: RECORD_VERSION,
            node_id: id.into(),
            version: "0".into(),
            data_endpoint: data.into(),
            data_cert_der: hex(cert),
            data_cert_name: "localhost".into(),
            transfer_endpoint: String::new(),
            transfer_meta: String::new(),
            admin_endpoint: String::new(),
            worker_endpoint: worker.into(),
            tiers: vec![TierCapacity {
                kind: "dram".into(),
                capacity_bytes: 1 << 30,
            }],
            registered_unix_ms: 0,
            placement: None,
            splits: Vec::new(),
        }
    }

    fn view(secret: Option<&[u8]>, records: &[(MemberRecord, Option<&[u8]>)]) -> MembershipView {
        let mut v = MembershipView::new(PREFIX, RecordSealer::new(secret, "c"), 1);
        let kvs = records.iter().map(|(r, signed_with)| {
            let key = format!("{PREFIX}{}", r.node_id).into_bytes();
            let value = RecordSealer::new(*signed_with, "c").seal(&key, r);
            (key, value, 1, 1)
        });
        v.reset(1, kvs, Instant::now());
        v
    }

    const S: &[u8] = b"0123456789abcdef-secret";

    #[test]
    fn members_advertise_workers_and_bad_ones_are_named() {
        let v = view(
            Some(S),
            &[
                (
                    record("a", "http://127.0.0.1:8000/", "tcp://127.0.0.1:7000", b""),
                    Some(S),
                ),
                (
                    record(
                        "b",
                        "http://127.0.0.1:8001",
                        "tls://127.0.0.1:7001",
                        b"CERT",
                    ),
                    Some(S),
                ),
                (record("c", "", "tcp://127.0.0.1:7002", b""), Some(S)),
                (
                    record("d", "127.0.0.1:8003", "tcp://127.0.0.1:7003", b""),
                    Some(S),
                ),
                (
                    record("e", "http://127.0.0.1:8000", "tcp://127.0.0.1:7004", b""),
                    Some(S),
                ),
                (
                    record("f", "http://127.0.0.1:8005", "tls://127.0.0.1:7005", b""),
                    Some(S),
                ),
                (record("g", "http://127.0.0.1:8006", "", b""), Some(S)),
                (
                    record("h", "http://127.0.0.1:8007", "tcp://127.0.0.1:7007", b""),
                    Some(b"another secret!!"),
                ),
                (
                    record("i", "http://127.0.0.1:8008", "tcp://127.0.0.1:7008", b""),
                    None,
                ),
            ],
        );
        let (want, notes) = advertised(&v);
        let urls: Vec<(&str, &str, Option<&str>)> = want
            .iter()
            .map(|a| (a.node_id.as_str(), a.url.as_str(), a.kvtier.as_deref()))
            .collect();
        assert_eq!(
            urls,
            [
                ("a", "http://127.0.0.1:8000", Some("tcp://127.0.0.1:7000")),
                ("b", "http://127.0.0.1:8001", Some("tls://127.0.0.1:7001")),
                ("f", "http://127.0.0.1:8005", None),
                ("g", "http://127.0.0.1:8006", None),
            ]
        );
        assert_eq!(want[1].cert_der.as_deref(), Some(&b"CERT"[..]));
        assert_eq!(want[1].cert_name, "localhost");
        let named: Vec<&str> = notes.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(named, ["d", "e", "f"], "{notes:?}");
        // Records signed with another secret, or unsigned, never reach the view.
        assert_eq!(v.rejected().values().sum::<u64>(), 2);
    }

    fn adv(id: &str, url: &str, kv: &str) -> Advertised {
        Advertised {
            node_id: id.into(),
            url: url.into(),
            kvtier: (!kv.is_empty()).then(|| kv.to_string()),
            cert_der: None,
            cert_name: String::new(),
        }
    }

    fn slot(url: &str, kv: &str, member: bool, present: bool) -> Slot {
        Slot {
            url: url.into(),
            kvtier: (!kv.is_empty()).then(|| kv.to_string()),
            member,
            present,
        }
    }

    #[test]
    fn the_list_follows_joins_leaves_and_returns() {
        let slots = [
            slot("http://w0", "", false, true),
            slot("http://w1", "tcp://s1", true, true),
            slot("http://w2", "tcp://s2", true, false),
            slot("http://w3", "tcp://s3", true, true),
        ];
        let want = [
            adv("n0", "http://w0", "tcp://s0"),
            adv("n2", "http://w2", "tcp://s2"),
            adv("n3", "http://w3", "tcp://s3-moved"),
            adv("n5", "http://w5", ""),
            adv("n4", "http://w4", "tcp://s4"),
        ];
        let p = plan(&slots, &want, 16);
        // w1 left; w2 is back; w3's server moved: the old place leaves, a new one is added.
        assert_eq!(p.leave, [1, 3]);
        assert_eq!(p.rejoin, [2]);
        let added: Vec<&str> = p.add.iter().map(|a| a.node_id.as_str()).collect();
        assert_eq!(added, ["n3", "n4", "n5"]);
        // A member naming a configured worker adds nothing.
        assert_eq!(p.skipped.len(), 1);
        assert_eq!(p.skipped[0].0, "n0");
        // Nothing changes once the list is in step.
        let settled = [
            slot("http://w0", "", false, true),
            slot("http://w2", "tcp://s2", true, true),
        ];
        assert_eq!(plan(&settled, &want[1..2], 16), Plan::default());
    }

    #[test]
    fn membership_workers_are_bounded() {
        let slots = [slot("http://w1", "", true, false)];
        let want = [adv("a", "http://a", ""), adv("b", "http://b", "")];
        let p = plan(&slots, &want, 2);
        assert_eq!(p.add.len(), 1);
        assert_eq!(p.add[0].node_id, "a");
        assert_eq!(p.skipped.len(), 1);
        assert!(p.skipped[0].1.contains("max_cluster_workers"), "{p:?}");
    }
}

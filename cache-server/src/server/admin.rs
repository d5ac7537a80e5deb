//! The HTTP admin port: `/health` (the process answers), `/ready` (listeners up, not
//! draining), `/metrics` (Prometheus text), `/stats` (JSON). It exposes counters only: no
//! keys, no token ids.
//!
//! Bounded like the data ports: at most `limits.admin_max_connections` connections (more are
//! closed at accept and counted), a request's headers must arrive within
//! `limits.admin_timeout_ms` (hyper's header timeout, which also runs while a kept-alive
//! connection sits idle), and a connection lives at most [`LIFETIME_FACTOR`] times that.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

use super::{Refusal, Shared};

/// An admin connection lives at most this many `admin_timeout_ms`.
const LIFETIME_FACTOR: u32 = 6;

pub(crate) async fn serve(shared: Arc<Shared>, l: tokio::net::TcpListener) {
    let stop = shared.shutdown.clone();
    let app = Router::new()
        .route("/health", get(health))
        .route("/cluster", get(cluster))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .with_state(shared.clone());
    let slots = Arc::new(Semaphore::new(shared.config.limits.admin_max_connections));
    let timeout = shared.config.admin_timeout();
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            r = l.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    if let Some(n) = shared.logs.accept.tick(std::time::Instant::now()) {
                        tracing::warn!("admin accept: {e} ({n} errors since the last warning)");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            super::refused(&shared, Refusal::Admin);
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new()).header_read_timeout(timeout);
            let conn = b.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = &mut conn => {}
                _ = tokio::time::sleep(timeout * LIFETIME_FACTOR) => {}
                _ = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(timeout, conn).await;
                }
            }
        });
    }
}

async fn ready(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    if s.ready.load(Ordering::Acquire) && !s.shutdown.is_cancelled() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let store = s.store.stats();
    s.metrics.pre_hello.set(s.pre_hello.open() as i64);
    let text = s.metrics.render(&store, s.ready.load(Ordering::Acquire));
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text)
}

async fn stats(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        s.stats_json(None),
    )
}

/// 200 while the process answers; with `[cluster]`, a second line on the etcd link (an
/// unreachable etcd is reported, not a failure: the node keeps serving its local tiers).
async fn health(State(s): State<Arc<Shared>>) -> String {
    match s.cluster.get() {
        Some(c) => format!("ok\n{}\n", c.health_line(std::time::Instant::now())),
        None => "ok\n".into(),
    }
}

/// `/cluster`: members, this node's view and lease, and with `?key=HEX` that key's owners
/// (`docs/cluster.md`). `{"enabled": false}` without `[cluster]`.
async fn cluster(State(s): State<Arc<Shared>>, RawQuery(q): RawQuery) -> axum::response::Response {
    // The one parameter, `key` (32 hex digits: nothing to percent-decode).
    let key_param = q.as_deref().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("key="))
            .map(str::to_string)
    });
    let key = match key_param.as_deref().map(str::trim) {
        None => None,
        Some(h) => match kvtier_core::BlockKey::from_hex(&h.to_ascii_lowercase()) {
            Some(k) => Some(k),
            None => {
                return (
                    StatusCode::BAD_REQUEST,
                    "key: expected 32 hex digits (a block key)\n",
                )
                    .into_response();
            }
        },
    };
    let doc = match s.cluster.get() {
        Some(c) => c.json(std::time::Instant::now(), key.as_ref()),
        None => serde_json::json!({ "enabled": false }),
    };
    (
        [(header::CONTENT_TYPE, "application/json")],
        doc.to_string(),
    )
        .into_response()
}

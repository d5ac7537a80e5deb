//! The HTTP admin port: `/health` (the process answers), `/ready` (listeners up, not
//! draining), `/metrics` (Prometheus text), `/stats` (JSON). It exposes counters only: no
//! keys, no token ids.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use super::Shared;

pub(crate) async fn serve(shared: Arc<Shared>, l: tokio::net::TcpListener) {
    let stop = shared.shutdown.clone();
    let app = Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .with_state(shared);
    if let Err(e) = axum::serve(l, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::warn!("admin server stopped: {e}");
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
    let text = s.metrics.render(&store, s.ready.load(Ordering::Acquire));
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text)
}

async fn stats(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], s.stats_json())
}

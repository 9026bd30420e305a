//! The HTTP admin server: Prometheus `/metrics`, `/healthz` (process alive) and `/readyz` (endpoints
//! loaded and not draining).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::extproc::PickerContext;

pub async fn run(
    listener: TcpListener,
    ctx: Arc<PickerContext>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(ctx);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics(State(ctx): State<Arc<PickerContext>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctx.metrics.encode(),
    )
}

async fn readyz(State(ctx): State<Arc<PickerContext>>) -> impl IntoResponse {
    if ctx.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if !ctx.store.synced() {
        (StatusCode::SERVICE_UNAVAILABLE, "endpoints not loaded")
    } else {
        (StatusCode::OK, "ready")
    }
}

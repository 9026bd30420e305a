//! The HTTP admin server: Prometheus `/metrics`, `/healthz` (process alive) and `/readyz` (endpoints
//! loaded and not draining).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::Path;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cluster::ClusterMember;
use crate::dataplane::PickerContext;

/// What the admin endpoints read: the request path's shared context, and the cluster member in
/// cluster mode.
#[derive(Debug)]
pub struct Admin {
    pub ctx: Arc<PickerContext>,
    pub cluster: Option<Arc<ClusterMember>>,
}

pub async fn run(
    listener: TcpListener,
    admin: Arc<Admin>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/debug/cluster", get(cluster_view))
        .route("/debug/cluster/probes", get(cluster_probes))
        .route("/debug/cluster/{op}", post(cluster_op))
        .route("/debug/prefix-index", get(prefix_index))
        .route("/debug/scrape", get(scrape_view))
        .route("/debug/flow", get(flow_view))
        .route("/debug/cost-model", get(cost_model_view))
        .route("/debug/inflight", get(inflight_view))
        .with_state(admin);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics(State(admin): State<Arc<Admin>>) -> impl IntoResponse {
    let ctx = &admin.ctx;
    if let Some(p) = &ctx.scheduler.prefix_index {
        ctx.metrics.set_prefix_size(p.entries());
    }
    let owned = ctx
        .store
        .endpoints()
        .iter()
        .filter(|e| ctx.store.shard.owns(&e.hostport))
        .count();
    ctx.metrics.gossip.set_owned(owned);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctx.metrics.encode(),
    )
}

async fn readyz(State(admin): State<Arc<Admin>>) -> impl IntoResponse {
    let ctx = &admin.ctx;
    if ctx.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if !ctx.store.synced() {
        (StatusCode::SERVICE_UNAVAILABLE, "endpoints not loaded")
    } else if let Some(why) = ctx.gate.not_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, why)
    } else {
        (StatusCode::OK, "ready")
    }
}

/// `GET /debug/scrape`: who scrapes each pod (cluster mode: its rendezvous owners) and how old this
/// replica's sample of it is, by its original scrape time.
async fn scrape_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    let ctx = &admin.ctx;
    let shard = &ctx.store.shard;
    let (owners_per_pod, members) = shard.layout();
    let now = std::time::Instant::now();
    let pods: Vec<serde_json::Value> = ctx
        .store
        .endpoints()
        .iter()
        .map(|e| {
            let age_ms = e
                .sample()
                .map(|s| now.saturating_duration_since(s.scraped_at).as_millis() as u64);
            serde_json::json!({
                "pod": e.hostport, "owned": shard.owns(&e.hostport),
                "owners": shard.owners(&e.hostport), "age_ms": age_ms,
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "owners_per_pod": owners_per_pod, "members": members, "pods": pods,
    }))
    .into_response()
}

/// `GET /debug/prefix-index`: the approximate prefix index per pod — epoch, entries and the
/// order-independent digest replicas compare (equal digests ⇔ equal content, with overwhelming
/// probability).
async fn prefix_index(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    let ctx = &admin.ctx;
    let Some(p) = &ctx.scheduler.prefix_index else {
        return (
            StatusCode::NOT_FOUND,
            "no approx-prefix-cache-producer configured",
        )
            .into_response();
    };
    let pods: Vec<serde_json::Value> = p
        .digests()
        .into_iter()
        .map(|d| {
            serde_json::json!({
                "pod": d.name, "epoch": d.epoch, "entries": d.len,
                "digest": format!("{:016x}", d.digest),
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "entries": p.entries(), "pods": pods })).into_response()
}

/// `GET /debug/cost-model`: what the cost model has learned — the fleet's and each pod's fit
/// (base ms, ms per prefill token, ms per running request), prefill tokens/s and service time.
async fn cost_model_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    match &admin.ctx.scheduler.cost_model {
        Some(m) => axum::Json(m.view()).into_response(),
        None => (StatusCode::NOT_FOUND, "no cost-model-producer configured").into_response(),
    }
}

/// `GET /debug/inflight`: the in-flight ledger — requests and unprefilled tokens per pod, this
/// replica's own and (cluster mode) the other replicas'.
async fn inflight_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    match &admin.ctx.inflight {
        Some(t) => axum::Json(t.view()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "no in-flight ledger (no plugin uses one)",
        )
            .into_response(),
    }
}

async fn cluster_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    match &admin.cluster {
        Some(c) => axum::Json(c.view().await).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "not in cluster mode (start with --peers or --join)",
        )
            .into_response(),
    }
}

/// `GET /debug/cluster/probes`: the probes this replica applied, in order (newest last).
async fn cluster_probes(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    match &admin.cluster {
        Some(c) => {
            let (log, applied_index) = c.probes().await;
            axum::Json(serde_json::json!({
                "applied_index": applied_index,
                "applied": log.applied,
                "recent": log.recent,
            }))
            .into_response()
        }
        None => (StatusCode::NOT_FOUND, "not in cluster mode").into_response(),
    }
}

/// `GET /debug/flow`: flow control — cluster-wide (this replica's side and the replicated global
/// queue, credit and ledger) or this replica's own queue.
async fn flow_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    match admin.ctx.gate.view().await {
        Some(view) => axum::Json(view).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "flow control is off (the flowControl feature gate is not set)",
        )
            .into_response(),
    }
}

async fn cluster_op(
    State(admin): State<Arc<Admin>>,
    Path(op): Path<String>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let Some(c) = &admin.cluster else {
        return (StatusCode::NOT_FOUND, "not in cluster mode").into_response();
    };
    if op == "probe" {
        let req: crate::cluster::member::ProbeRequest = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return (StatusCode::BAD_REQUEST, format!("bad request body: {e}")).into_response();
            }
        };
        return match c.probe(req).await {
            Ok(report) => axum::Json(report).into_response(),
            Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
        };
    }
    let req: crate::cluster::member::MembershipRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, format!("bad request body: {e}")).into_response();
        }
    };
    match c.membership(&op, req).await {
        Ok(msg) => (StatusCode::OK, msg).into_response(),
        Err(e) => (StatusCode::CONFLICT, e).into_response(),
    }
}

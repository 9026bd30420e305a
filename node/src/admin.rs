//! The HTTP admin server: Prometheus `/metrics`, `/healthz` (process alive) and `/readyz` (endpoints
//! loaded and not draining), and the `/debug` views and operations.
//!
//! Authorization: a caller is authorized when it presents `Authorization: Bearer <token>` with the
//! token of `--admin-token-file` (re-read on every check, so it can be rotated in place), or —
//! when no token file is configured — when it connects from a loopback address. Mutating calls
//! (`POST /debug/cluster/...`: membership changes, probes) need authorization (401/403 otherwise).
//! With a token file every `/debug` view needs it too (401); without one the views are open and
//! show tenant (fairness) ids and request keys only to authorized callers, `redacted` to others.
//! `/metrics`, `/healthz` and `/readyz` are open, as probes and Prometheus need them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use index::Replicated;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cluster::ClusterMember;
use crate::dataplane::PickerContext;

/// What the admin endpoints read: the request path's shared context, the cluster member in
/// cluster mode, and the admin token's file.
#[derive(Debug)]
pub struct Admin {
    pub ctx: Arc<PickerContext>,
    /// The KV-event subscriber, when a precise prefix producer runs.
    pub kv_events: Option<Arc<crate::datalayer::kvevents::Subscriber>>,
    pub cluster: Option<Arc<ClusterMember>>,
    pub token_file: Option<PathBuf>,
}

/// What replaces a tenant id or request key for a caller that is not authorized.
pub const REDACTED: &str = "redacted";

/// Whether a caller from `peer` presenting `authorization` (the header's value) is authorized,
/// given the configured token (`None`: no token file; `Some(Err)`: configured but unreadable,
/// which authorizes nobody).
pub fn authorized(
    token: Option<Result<String, String>>,
    authorization: Option<&str>,
    peer: SocketAddr,
) -> bool {
    match token {
        None => peer.ip().is_loopback(),
        Some(Err(_)) => false,
        Some(Ok(token)) => authorization
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| constant_time_eq(given.trim().as_bytes(), token.as_bytes())),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Read the admin token: the file's first line, trimmed; an empty or unreadable file is an error.
pub fn read_token(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("admin token file {}: {e}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        return Err(format!("admin token file {} is empty", path.display()));
    }
    Ok(token)
}

impl Admin {
    fn authorizes(&self, headers: &HeaderMap, peer: SocketAddr) -> bool {
        let token = self.token_file.as_deref().map(read_token);
        if let Some(Err(e)) = &token {
            tracing::warn!(error = %e, "admin call refused: the admin token cannot be read");
        }
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        authorized(token, auth, peer)
    }

    /// The refusal for an unauthorized mutating call (counted).
    fn refuse(&self) -> axum::response::Response {
        self.ctx.metrics.rejected_value("admin", "authorization");
        if self.token_file.is_some() {
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "admin token required (Authorization: Bearer <token of --admin-token-file>)",
            )
                .into_response()
        } else {
            (
                StatusCode::FORBIDDEN,
                "mutating admin calls are accepted from localhost only; configure \
                 --admin-token-file to allow them from elsewhere",
            )
                .into_response()
        }
    }
}

/// Replace tenant ids and request keys in a `/debug` view: every `fairness_id` value, and the
/// request key of each `oldest_inflight` row (`[owner, seq, key, pod]`).
pub fn redact(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                match (k.as_str(), child) {
                    ("fairness_id", c @ Value::String(_)) => *c = Value::from(REDACTED),
                    ("oldest_inflight", Value::Array(rows)) => {
                        for row in rows {
                            if let Some(key) = row.get_mut(2) {
                                *key = Value::from(REDACTED);
                            }
                        }
                    }
                    (_, c) => redact(c),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

pub async fn run(
    listener: TcpListener,
    admin: Arc<Admin>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let debug = Router::new()
        .route("/debug/cluster", get(cluster_view))
        .route("/debug/cluster/probes", get(cluster_probes))
        .route("/debug/cluster/{op}", post(cluster_op))
        .route("/debug/prefix-index", get(prefix_index))
        .route("/debug/kv-events", get(kv_events_view))
        .route("/debug/scrape", get(scrape_view))
        .route("/debug/flow", get(flow_view))
        .route("/debug/cost-model", get(cost_model_view))
        .route("/debug/inflight", get(inflight_view))
        .route("/debug/tenants", get(tenants_view))
        .route("/debug/usage", get(usage_view))
        .route(
            "/debug/schedule",
            post(schedule_dry_run).layer(axum::extract::DefaultBodyLimit::max(
                admin.ctx.max_body_bytes.saturating_mul(2) + 65_536,
            )),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            admin.clone(),
            debug_guard,
        ));
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .merge(debug)
        .with_state(admin);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move { shutdown.cancelled().await })
    .await
}

/// With an admin token configured, every `/debug` view and call needs it: the views show the
/// pool's topology, the cluster's members, pods' state. (Without one, views are open with tenant
/// ids and request keys redacted, and calls are accepted from localhost.)
async fn debug_guard(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if admin.token_file.is_some() && !admin.authorizes(&headers, peer) {
        return admin.refuse();
    }
    next.run(req).await
}

async fn metrics(State(admin): State<Arc<Admin>>) -> impl IntoResponse {
    let ctx = &admin.ctx;
    if let Some(p) = &ctx.scheduler.prefix_index {
        ctx.metrics.set_prefix_size(p.entries());
    }
    ctx.metrics.set_response_bindings(ctx.responses.len());
    let owned = ctx
        .store
        .endpoints()
        .iter()
        .filter(|e| ctx.store.shard.owns(&e.hostport))
        .count();
    ctx.metrics.gossip.set_owned(owned);
    let candidates = ctx.store.candidates(std::time::Instant::now());
    ctx.metrics
        .set_stale_endpoints(candidates.iter().filter(|c| c.stale).count());
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
    } else if let Some(why) = admin.cluster.as_ref().and_then(|m| m.not_ready()) {
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
                "batch_capacity": e.batch_capacity(),
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "owners_per_pod": owners_per_pod, "members": members, "pods": pods,
    }))
    .into_response()
}

/// `GET /debug/kv-events`: the precise index (size; per pod its distinct blocks, digest and
/// blocks by tier),
/// this replica's KV-event subscriptions (endpoint, sequence, counters, blocks held) and, in
/// centralized mode, the address the pods publish to.
async fn kv_events_view(State(admin): State<Arc<Admin>>) -> axum::response::Response {
    let (Some(sub), Some(p)) = (&admin.kv_events, &admin.ctx.scheduler.precise) else {
        return (
            StatusCode::NOT_FOUND,
            "no precise-prefix-cache-producer configured",
        )
            .into_response();
    };
    let (blocks, keys) = {
        let ix = p.read();
        (ix.len(), ix.distinct_keys())
    };
    // Every pod in the index (subscribed here or mirrored from its owner): distinct blocks
    // (over its tiers) and their digest, equal on every replica once converged, and its blocks
    // by tier.
    let mut tiers = p.tiers();
    let index: serde_json::Map<String, serde_json::Value> = p
        .digests()
        .into_iter()
        .map(|(pod, (n, d))| {
            let by_tier: serde_json::Map<String, serde_json::Value> = tiers
                .remove(&pod)
                .unwrap_or_default()
                .into_iter()
                .map(|(t, c)| (t, c.into()))
                .collect();
            let v =
                serde_json::json!({"blocks": n, "digest": format!("{d:016x}"), "tiers": by_tier});
            (pod, v)
        })
        .collect();
    axum::Json(serde_json::json!({
        "index": {"blocks": blocks, "distinct_keys": keys, "untokenized_requests": p.untokenized()},
        "pods": index,
        "subscriptions": sub.status(),
        // Centralized mode: where the pods publish (the bound address).
        "central_endpoint": sub.central_endpoint(),
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
/// Tenant mode's views show who is asking and spending: authorized callers only.
fn tenant_mode<'a>(
    admin: &'a Admin,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Result<&'a crate::request::quota::Quotas, Box<axum::response::Response>> {
    let Some(q) = &admin.ctx.quotas else {
        let off = (
            StatusCode::NOT_FOUND,
            "tenant mode is off (no --tenants-file)",
        );
        return Err(Box::new(off.into_response()));
    };
    if !admin.authorizes(headers, peer) {
        return Err(Box::new(admin.refuse()));
    }
    Ok(q)
}

/// `GET /debug/tenants`: each tenant's grants, limits, what is left and in flight.
async fn tenants_view(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> axum::response::Response {
    match tenant_mode(&admin, &headers, peer) {
        Ok(q) => axum::Json(q.status().await).into_response(),
        Err(r) => *r,
    }
}

#[derive(serde::Deserialize)]
struct UsageQuery {
    /// Unix seconds; rows of earlier minutes are left out.
    #[serde(default)]
    since: u64,
}

/// `GET /debug/usage?since=<unix s>`: the usage ledger, one row per tenant × model × minute
/// (`epp usage` prints it).
async fn usage_view(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    axum::extract::Query(query): axum::extract::Query<UsageQuery>,
) -> axum::response::Response {
    let q = match tenant_mode(&admin, &headers, peer) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let rows: Vec<_> = q
        .usage(query.since)
        .await
        .into_iter()
        .map(|(k, r)| {
            let rejected = |reason| r.rejected.get(&reason).copied().unwrap_or(0);
            serde_json::json!({
                "minute": k.minute * 60,
                "tenant": k.tenant,
                "model": k.model,
                "requests": r.requests,
                "input": r.input,
                "output": r.output,
                "cached": r.cached,
                "disconnects": r.disconnects,
                "rejected_rpm": rejected(flowctl::quota::QuotaReason::Rpm),
                "rejected_tpm": rejected(flowctl::quota::QuotaReason::Tpm),
                "rejected_concurrency": rejected(flowctl::quota::QuotaReason::Concurrency),
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "rows": rows })).into_response()
}

async fn flow_view(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> axum::response::Response {
    match admin.ctx.gate.view().await {
        Some(mut view) => {
            if !admin.authorizes(&headers, peer) {
                redact(&mut view);
            }
            axum::Json(view).into_response()
        }
        None => (
            StatusCode::NOT_FOUND,
            "flow control is off (the flowControl feature gate is not set)",
        )
            .into_response(),
    }
}

/// `POST /debug/schedule`: "why this pod?" — the scheduling profiles run as a dry run for the
/// request in the body (`{"path", "headers", "body"}`, see [`crate::dataplane::explain::DryRun`]):
/// every candidate's state, each filter's verdict, each scorer's raw and weighted scores, the
/// totals and the pick, with nothing recorded. Needs authorization (it shows every pod's state
/// and may call the token producer). A stage that would refuse the request answers with the
/// refusal's status and message.
async fn schedule_dry_run(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    if !admin.authorizes(&headers, peer) {
        tracing::warn!(%peer, "unauthorized dry run refused");
        return admin.refuse();
    }
    let run: crate::dataplane::explain::DryRun = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            admin.ctx.metrics.rejected_value("admin", "malformed");
            return (
                StatusCode::BAD_REQUEST,
                format!("bad request body (want {{\"path\", \"headers\", \"body\"}}): {e}"),
            )
                .into_response();
        }
    };
    match crate::dataplane::explain::dry_run(&admin.ctx, run).await {
        Ok(x) => axum::Json(x).into_response(),
        Err(r) => (
            StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST),
            r.body(),
        )
            .into_response(),
    }
}

async fn cluster_op(
    State(admin): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(op): Path<String>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    if !admin.authorizes(&headers, peer) {
        tracing::warn!(%peer, %op, "unauthorized admin call refused");
        return admin.refuse();
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localhost_or_the_token_authorizes() {
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let local6: SocketAddr = "[::1]:5000".parse().unwrap();
        let remote: SocketAddr = "10.1.2.3:5000".parse().unwrap();
        // No token file: localhost only.
        assert!(authorized(None, None, local));
        assert!(authorized(None, None, local6));
        assert!(!authorized(None, Some("Bearer x"), remote));
        // A token: from anywhere with it, from nowhere without it.
        let tok = || Some(Ok("s3cret".to_string()));
        assert!(authorized(tok(), Some("Bearer s3cret"), remote));
        assert!(!authorized(tok(), None, local), "localhost needs it too");
        assert!(!authorized(tok(), Some("Bearer s3cre"), remote));
        assert!(!authorized(tok(), Some("Bearer s3cretX"), remote));
        assert!(!authorized(tok(), Some("Basic s3cret"), remote));
        // A configured but unreadable token authorizes nobody.
        assert!(!authorized(Some(Err("gone".into())), None, local));
    }

    #[test]
    fn tokens_are_read_from_the_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, "  abc  \nignored\n").unwrap();
        assert_eq!(read_token(&p).unwrap(), "abc");
        std::fs::write(&p, "\n").unwrap();
        assert!(read_token(&p).unwrap_err().contains("empty"));
        assert!(read_token(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn views_lose_tenant_ids_and_request_keys() {
        let mut v = serde_json::json!({
            "local": {"node_id": 1},
            "global": {
                "flows": [{"fairness_id": "tenant-a", "priority": 0, "queued": 1}],
                "oldest_inflight": [[1, 7, "0123abcd", "10.0.0.1:8000"]],
                "pods": {"10.0.0.1:8000": {"requests": 1}},
            },
        });
        redact(&mut v);
        assert_eq!(v["global"]["flows"][0]["fairness_id"], REDACTED);
        assert_eq!(v["global"]["flows"][0]["queued"], 1);
        assert_eq!(
            v["global"]["oldest_inflight"][0],
            serde_json::json!([1, 7, REDACTED, "10.0.0.1:8000"])
        );
        assert_eq!(v["global"]["pods"]["10.0.0.1:8000"]["requests"], 1);
    }
}

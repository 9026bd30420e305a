//! The fleet's admin server: the pods (JSON and the endpoints-file YAML), knobs, crash, restart
//! and reset.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::fleet::Fleet;
use crate::knobs::KnobsPatch;

use super::*;

/// Renders the discovery file the EPP reads.
pub fn pods_yaml(fleet: &Fleet) -> String {
    let mut out = String::from("pods:\n");
    for p in &fleet.pods {
        out.push_str(&format!(
            "  - name: {}\n    address: {}\n    port: {}\n    labels:\n      llm-d.ai/engine-type: vllm\n",
            p.name,
            p.addr.ip(),
            p.addr.port()
        ));
        if let Some(role) = &p.role {
            out.push_str(&format!("      llm-d.ai/role: {role}\n"));
        }
        // Where the pod publishes its KV events (the EPP's subscriber reads these keys); a pod
        // that connects to a centralized subscriber names its replay socket only.
        if let Some(kv) = fleet.kv_endpoints(p.index) {
            if !kv.connects {
                out.push_str(&format!(
                    "      llm-d.ai/kv-events-endpoint: \"{}\"\n",
                    kv.publisher
                ));
            }
            out.push_str(&format!(
                "      llm-d.ai/kv-events-replay-endpoint: \"{}\"\n",
                kv.replay
            ));
        }
    }
    out
}

/// Router of the admin server:
/// - `GET /pods` — every pod with address, state (`up`), stats, knobs and KV-event endpoints;
/// - `GET /pods.yaml` — the discovery file;
/// - `GET|POST /pods/{i}/knobs` — read / patch one pod's knobs ([`KnobsPatch`] JSON);
/// - `POST /knobs` — patch every pod;
/// - `POST /pods/{i}/crash` — stop the pod's listener and cut its connections;
/// - `POST /pods/{i}/restart` — (crash if up, then) rebind the same port with fresh engine state;
/// - `POST /reset_prefix_caches` — drop every pod's unpinned cache blocks.
pub fn admin_router(fleet: Arc<Fleet>) -> Router {
    Router::new()
        .route("/pods", get(admin_pods))
        .route("/pods.yaml", get(admin_yaml))
        .route("/pods/{idx}/knobs", post(admin_knobs).get(admin_get_knobs))
        .route("/knobs", post(admin_all_knobs))
        .route("/pods/{idx}/crash", post(admin_crash))
        .route("/pods/{idx}/restart", post(admin_restart))
        .route("/reset_prefix_caches", post(admin_reset))
        .with_state(fleet)
}

pub(super) async fn admin_pods(State(fleet): State<Arc<Fleet>>) -> Response {
    let list: Vec<Value> = fleet
        .pods
        .iter()
        .map(|p| {
            json!({
                "index": p.index,
                "name": p.name,
                "address": p.addr.ip().to_string(),
                "port": p.addr.port(),
                "up": fleet.is_up(p.index),
                "role": p.role,
                "stats": p.stats(),
                "knobs": p.knobs(),
                "kv_events": fleet.kv_endpoints(p.index),
            })
        })
        .collect();
    axum::Json(list).into_response()
}

pub(super) async fn admin_yaml(State(fleet): State<Arc<Fleet>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/yaml")],
        pods_yaml(&fleet),
    )
        .into_response()
}

pub(super) fn no_such_pod() -> Response {
    error_response(StatusCode::NOT_FOUND, "NotFoundError", "no such pod")
}

pub(super) fn parse_patch(body: &[u8]) -> Result<KnobsPatch, String> {
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

pub(super) async fn admin_get_knobs(
    State(fleet): State<Arc<Fleet>>,
    Path(idx): Path<usize>,
) -> Response {
    match fleet.pods.get(idx) {
        Some(pod) => axum::Json(pod.knobs()).into_response(),
        None => no_such_pod(),
    }
}

pub(super) async fn admin_knobs(
    State(fleet): State<Arc<Fleet>>,
    Path(idx): Path<usize>,
    body: Bytes,
) -> Response {
    let Some(pod) = fleet.pods.get(idx) else {
        return no_such_pod();
    };
    let patch = match parse_patch(&body) {
        Ok(p) => p,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e),
    };
    match pod.set_knobs(&patch) {
        Ok(()) => axum::Json(pod.knobs()).into_response(),
        Err(e) => error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e.to_string()),
    }
}

pub(super) async fn admin_all_knobs(State(fleet): State<Arc<Fleet>>, body: Bytes) -> Response {
    let patch = match parse_patch(&body) {
        Ok(p) => p,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e),
    };
    // Validate against every pod first so a bad patch changes nothing.
    for pod in &fleet.pods {
        if let Err(e) = pod.knobs().patched(&patch).validate() {
            return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e.to_string());
        }
    }
    for pod in &fleet.pods {
        if let Err(e) = pod.set_knobs(&patch) {
            return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e.to_string());
        }
    }
    axum::Json(json!({"pods": fleet.pods.len()})).into_response()
}

pub(super) async fn admin_crash(
    State(fleet): State<Arc<Fleet>>,
    Path(idx): Path<usize>,
) -> Response {
    match fleet.crash(idx).await {
        Ok(()) => axum::Json(json!({"pod": idx, "up": false})).into_response(),
        Err(_) => no_such_pod(),
    }
}

pub(super) async fn admin_restart(
    State(fleet): State<Arc<Fleet>>,
    Path(idx): Path<usize>,
) -> Response {
    match fleet.restart(idx).await {
        Ok(()) => axum::Json(json!({"pod": idx, "up": true})).into_response(),
        Err(crate::SimError::NoSuchPod { .. }) => no_such_pod(),
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            &e.to_string(),
        ),
    }
}

pub(super) async fn admin_reset(State(fleet): State<Arc<Fleet>>) -> Response {
    let dropped: usize = fleet.pods.iter().map(|p| p.reset_prefix_cache()).sum();
    axum::Json(json!({"dropped_blocks": dropped})).into_response()
}

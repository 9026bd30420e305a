//! HTTP shells: the per-pod vLLM-compatible server and the admin server.
//!
//! Pod routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (+ `GET
//! /v1/responses/{id}`), `/v1/embeddings`, `/v1/messages` (Anthropic) and
//! `/v1/messages/count_tokens`, `/v1/models`, `/tokenize`, `/detokenize`,
//! `/v1/chat/completions/render`, `/v1/completions/render`, `/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, `/reset_prefix_cache`, `/health`, `/metrics` (the last two served
//! ahead of the router by [`crate::podsvc`]).
//! Admin routes: see [`admin_router`].
//!
//! Layout: [`job`] turns a generation request into a job on the engine; `generate` answers it
//! whole, `stream` as SSE, `responses` is the stateful Responses API; `utility` the token,
//! render, embedding, LoRA, model and metrics endpoints; `admin` the fleet's admin server.

mod admin;
mod generate;
pub mod job;
mod responses;
mod stream;
mod utility;

pub use admin::{admin_router, pods_yaml};
pub(crate) use utility::{PROMETHEUS_TEXT, exposition};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::engine::Pod;
use crate::podsvc::PodService;
use generate::{chat, completions, messages};
use responses::{get_response, responses};
use utility::{
    count_tokens, detokenize, embeddings, load_lora, metrics, models, render_chat,
    render_completions, tokenize, unload_lora,
};

const BODY_LIMIT: usize = 64 << 20;
/// `max_model_len` reported by `/v1/models` and `/tokenize`.
pub const MAX_MODEL_LEN: u64 = 131_072;

/// Runs `router` on `listener` until `shutdown` becomes true, then drains connections.
pub async fn serve(listener: TcpListener, router: Router, shutdown: watch::Receiver<bool>) {
    serve_until(listener, router, shutdown, std::future::pending()).await;
}

/// Like [`serve`], and when `kill` completes first, stops at once: the listener closes and every
/// open connection is cut (a simulated crash). Returns only when every connection task is gone, so
/// no request of this server still touches the pod's state.
pub async fn serve_until(
    listener: TcpListener,
    router: Router,
    shutdown: watch::Receiver<bool>,
    kill: impl Future<Output = ()>,
) {
    let svc = TowerToHyperService::new(router);
    serve_service(listener, move || svc.clone(), shutdown, kill).await;
}

/// Serves one pod on `listener` (see [`serve_until`] for `shutdown` and `kill`): `/metrics` and
/// `/health` on the fast path of [`PodService`], everything else through [`pod_router`].
pub async fn serve_pod(
    listener: TcpListener,
    pod: Arc<Pod>,
    shutdown: watch::Receiver<bool>,
    kill: impl Future<Output = ()>,
) {
    let svc = PodService::new(pod);
    serve_service(listener, move || svc.clone(), shutdown, kill).await;
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn serve_service<S, B>(
    listener: TcpListener,
    make_service: impl Fn() -> S,
    mut shutdown: watch::Receiver<bool>,
    kill: impl Future<Output = ()>,
) where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let addr = listener.local_addr().ok();
    let mut conns = JoinSet::new();
    tokio::pin!(kill);
    let killed = loop {
        tokio::select! {
            _ = &mut kill => break true,
            _ = async { shutdown.wait_for(|stop| *stop).await.map(|_| ()) } => break false,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    // SSE writes many small chunks; without TCP_NODELAY, Nagle plus the client's
                    // delayed ACK adds ~40 ms to the first token.
                    if let Err(error) = tcp.set_nodelay(true) {
                        tracing::debug!(%error, "cannot set TCP_NODELAY");
                    }
                    let svc = make_service();
                    let mut stop = shutdown.clone();
                    conns.spawn(async move {
                        let builder =
                            hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let conn = builder.serve_connection(TokioIo::new(tcp), svc);
                        tokio::pin!(conn);
                        tokio::select! {
                            biased;
                            r = conn.as_mut() => {
                                if let Err(error) = r {
                                    tracing::debug!(%error, "connection ended with an error");
                                }
                            }
                            _ = async { stop.wait_for(|s| *s).await.map(|_| ()) } => {
                                conn.as_mut().graceful_shutdown();
                                let _ = conn.await;
                            }
                        }
                    });
                }
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(?addr, %error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    };
    drop(listener);
    if killed {
        conns.abort_all();
    }
    while conns.join_next().await.is_some() {}
}

/// An OpenAI-style error response.
pub fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({
        "error": { "message": message, "type": kind, "param": null, "code": status.as_u16() }
    });
    (status, axum::Json(body)).into_response()
}

/// An Anthropic-style error response.
fn closed_response() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "engine is shutting down",
    )
}

fn anthropic_error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, axum::Json(body)).into_response()
}

fn bad_request(pod: &Pod, message: &str) -> Response {
    pod.record_error();
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// The headers every answer of `pod` carries: `x-inference-pod` (its name) and `x-inference-port`.
pub(crate) fn identity_headers(pod: &Pod) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::with_capacity(2);
    if let Ok(v) = HeaderValue::from_str(&pod.name) {
        out.push((HeaderName::from_static("x-inference-pod"), v));
    }
    out.push((
        HeaderName::from_static("x-inference-port"),
        HeaderValue::from(pod.addr.port()),
    ));
    out
}

/// Router of one simulated vLLM pod. [`serve_pod`] answers `GET /metrics` and `GET /health` ahead
/// of it ([`PodService`]); the routes here stay the reference behaviour for both.
pub fn pod_router(pod: Arc<Pod>) -> Router {
    let identity = identity_headers(&pod);
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(get_response))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn(echo_destination))
        .layer(axum::middleware::map_response(move |mut res: Response| {
            let identity = identity.clone();
            async move {
                let h = res.headers_mut();
                for (name, value) in identity {
                    h.insert(name, value);
                }
                res
            }
        }))
        .with_state(pod)
}

/// Header the endpoint picker sets to choose this pod.
pub(crate) const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Echo of [`DESTINATION_HEADER`] as received, so tests can check from the pod's side that the pod
/// serving a request is the one the picker chose.
pub const RECEIVED_DESTINATION_HEADER: &str = "x-sim-received-destination";

/// Header the endpoint picker sets on a disaggregated request: the prefill pod (`ip:port`).
const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Echo of [`PREFILLER_HEADER`] as received, so tests can see which requests were disaggregated.
pub const RECEIVED_PREFILLER_HEADER: &str = "x-sim-received-prefiller";

/// Echo of the W3C `traceparent` the request arrived with (whose span the pod's work would
/// belong to), so tests can follow a trace to the pod.
pub const RECEIVED_TRACEPARENT_HEADER: &str = "x-sim-received-traceparent";

/// The body's top-level `priority` (vLLM's priority scheduling field), when the request had one:
/// what the router wrote there, seen from the pod.
pub const RECEIVED_PRIORITY_HEADER: &str = "x-sim-received-priority";

/// The names of the `x-` headers the request arrived with (comma-separated, in arrival order), so
/// tests can check from the pod's side which control headers reached it.
pub const RECEIVED_HEADERS_HEADER: &str = "x-sim-received-headers";

/// The value of [`RECEIVED_HEADERS_HEADER`] for a request with `headers` (none without an `x-`
/// header). Both the router and the `/metrics` fast path echo it.
pub(crate) fn received_headers(headers: &axum::http::HeaderMap) -> Option<axum::http::HeaderValue> {
    let names: Vec<&str> = headers
        .keys()
        .map(|k| k.as_str())
        .filter(|k| k.starts_with("x-"))
        .collect();
    if names.is_empty() {
        return None;
    }
    axum::http::HeaderValue::from_str(&names.join(",")).ok()
}

async fn echo_destination(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let received = received_headers(req.headers());
    let dest = req.headers().get(DESTINATION_HEADER).cloned();
    let prefiller = req.headers().get(PREFILLER_HEADER).cloned();
    let traceparent = req.headers().get("traceparent").cloned();
    let mut res = next.run(req).await;
    if let Some(v) = received {
        res.headers_mut().insert(RECEIVED_HEADERS_HEADER, v);
    }
    if let Some(v) = traceparent {
        res.headers_mut().insert(RECEIVED_TRACEPARENT_HEADER, v);
    }
    if let Some(v) = dest {
        res.headers_mut().insert(RECEIVED_DESTINATION_HEADER, v);
    }
    if let Some(v) = prefiller {
        res.headers_mut().insert(RECEIVED_PREFILLER_HEADER, v);
    }
    res
}

async fn reset_prefix_cache(State(pod): State<Arc<Pod>>) -> Response {
    let dropped = pod.reset_prefix_cache();
    axum::Json(json!({ "dropped_blocks": dropped })).into_response()
}

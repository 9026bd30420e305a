//! HTTP shells: the per-pod OpenAI-compatible server and the admin server.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::{self, Pod, Running};
use crate::knobs::{KnobsPatch, PodKnobs};
use crate::tokenizer::{self, ChatMessage, Prompt};

const BODY_LIMIT: usize = 64 << 20;

/// Runs `router` on `listener` until `shutdown` becomes true, then drains connections.
pub async fn serve(listener: TcpListener, router: Router, mut shutdown: watch::Receiver<bool>) {
    let addr = listener.local_addr().ok();
    // SSE writes many small chunks; without TCP_NODELAY, Nagle plus the client's delayed ACK adds
    // ~40 ms to the first token.
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    });
    let result = axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await;
    if let Err(error) = result {
        tracing::error!(?addr, %error, "server failed");
    }
}

/// An OpenAI-style error response.
pub fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({
        "error": { "message": message, "type": kind, "param": null, "code": status.as_u16() }
    });
    (status, axum::Json(body)).into_response()
}

fn bad_request(pod: &Pod, message: &str) -> Response {
    pod.record_error();
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// Router of one simulated vLLM pod.
pub fn pod_router(pod: Arc<Pod>) -> Router {
    let pod_header = HeaderValue::from_str(&pod.name).ok();
    let port_header = HeaderValue::from(pod.addr.port());
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn(echo_destination))
        .layer(axum::middleware::map_response(move |mut res: Response| {
            let pod_header = pod_header.clone();
            let port_header = port_header.clone();
            async move {
                let h = res.headers_mut();
                if let Some(v) = pod_header {
                    h.insert("x-inference-pod", v);
                }
                h.insert("x-inference-port", port_header);
                res
            }
        }))
        .with_state(pod)
}

/// Header the endpoint picker sets to choose this pod.
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Echo of [`DESTINATION_HEADER`] as received, so tests can check from the pod's side that the pod
/// serving a request is the one the picker chose.
pub const RECEIVED_DESTINATION_HEADER: &str = "x-sim-received-destination";

async fn echo_destination(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let dest = req.headers().get(DESTINATION_HEADER).cloned();
    let mut res = next.run(req).await;
    if let Some(v) = dest {
        res.headers_mut().insert(RECEIVED_DESTINATION_HEADER, v);
    }
    res
}

async fn reset_prefix_cache(State(pod): State<Arc<Pod>>) -> Response {
    let dropped = pod.reset_prefix_cache();
    axum::Json(json!({ "dropped_blocks": dropped })).into_response()
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The fields of a generation request the simulator acts on; everything else is accepted and ignored.
#[derive(Debug, Deserialize)]
struct GenRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

struct Job {
    pod: Arc<Pod>,
    knobs: PodKnobs,
    kind: Kind,
    tokens: Vec<u32>,
    output_tokens: u32,
    id: String,
    created: u64,
    model: String,
    seed: u64,
}

async fn chat(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Chat, body).await
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Completion, body).await
}

async fn generate(pod: Arc<Pod>, kind: Kind, body: Bytes) -> Response {
    let req: GenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    let stream = req.stream.unwrap_or(false);
    if req.stream_options.is_some() && !stream {
        return bad_request(
            &pod,
            "Stream options can only be defined when `stream=True`.",
        );
    }
    let tokens = match kind {
        Kind::Chat => match &req.messages {
            Some(m) => tokenizer::chat_tokens(m),
            None => return bad_request(&pod, "field `messages` is required"),
        },
        Kind::Completion => match &req.prompt {
            Some(p) => tokenizer::prompt_tokens(p),
            None => return bad_request(&pod, "field `prompt` is required"),
        },
    };
    let knobs = pod.knobs();
    let requested = match kind {
        Kind::Chat => req.max_completion_tokens.or(req.max_tokens),
        Kind::Completion => req.max_tokens.or(req.max_completion_tokens),
    };
    let output_tokens = requested.unwrap_or(knobs.default_max_tokens);
    if output_tokens == 0 {
        return bad_request(&pod, "max_tokens must be at least 1");
    }
    if engine::inject_failure(&knobs) {
        pod.record_error();
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "injected failure",
        );
    }
    let n = pod.next_request_id();
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let seed = tokens
        .iter()
        .fold(n, |acc, t| acc.rotate_left(5) ^ u64::from(*t));
    let job = Job {
        id: format!("{prefix}-{}-{n}", pod.name),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: req.model.unwrap_or_else(|| pod.model.clone()),
        pod,
        knobs,
        kind,
        tokens,
        output_tokens,
        seed,
    };
    if stream {
        let include_usage = req
            .stream_options
            .map(|o| o.include_usage.unwrap_or(true))
            .unwrap_or(false);
        stream_response(job, include_usage)
    } else {
        full_response(job).await
    }
}

fn closed_response() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "engine is shutting down",
    )
}

fn usage(job: &Job, cached: usize) -> Value {
    let prompt = job.tokens.len() as u64;
    let completion = u64::from(job.output_tokens);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

fn token_text(job: &Job, i: u32) -> String {
    let w = tokenizer::output_word(job.seed, i);
    if i == 0 {
        w.to_owned()
    } else {
        format!(" {w}")
    }
}

async fn full_response(job: Job) -> Response {
    let mut run = match job
        .pod
        .admit(&job.tokens, job.output_tokens, &job.knobs)
        .await
    {
        Ok(r) => r,
        Err(_) => return closed_response(),
    };
    engine::pause(engine::ttft(&job.knobs, run.uncached_tokens())).await;
    run.prefilled();
    let decode = engine::inter_token(&job.knobs) * job.output_tokens.saturating_sub(1);
    engine::pause(decode).await;
    let cached = run.cached_tokens();
    run.finish(job.output_tokens);
    let text: String = (0..job.output_tokens)
        .map(|i| token_text(&job, i))
        .collect();
    let choice = match job.kind {
        Kind::Chat => json!({
            "index": 0,
            "message": { "role": "assistant", "content": text },
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null,
        }),
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null,
        }),
    };
    let object = match job.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    axum::Json(json!({
        "id": job.id,
        "object": object,
        "created": job.created,
        "model": job.model,
        "choices": [choice],
        "usage": usage(&job, cached),
    }))
    .into_response()
}

enum Step {
    Start,
    Token(u32),
    Finish,
    Usage,
    Done,
    End,
}

struct StreamState {
    job: Job,
    include_usage: bool,
    step: Step,
    run: Option<Running>,
    cached: usize,
    /// When the first token went out; token i is due at `first_token + i * inter_token`, so timer
    /// rounding does not accumulate over a long output.
    first_token: tokio::time::Instant,
}

impl StreamState {
    fn chunk(&self, choices: Value) -> String {
        let object = match self.job.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let v = json!({
            "id": self.job.id,
            "object": object,
            "created": self.job.created,
            "model": self.job.model,
            "choices": choices,
        });
        format!("data: {v}\n\n")
    }

    fn choice(&self, text: Option<String>, role: bool, finish: bool) -> Value {
        let finish_reason = if finish { json!("length") } else { Value::Null };
        match self.job.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason }])
            }
            Kind::Completion => json!([{
                "index": 0, "text": text.unwrap_or_default(), "logprobs": null,
                "finish_reason": finish_reason, "stop_reason": null,
            }]),
        }
    }

    fn next_after(&self, i: u32) -> Step {
        if i + 1 < self.job.output_tokens {
            Step::Token(i + 1)
        } else {
            Step::Finish
        }
    }

    /// Produces the next piece of the event stream, or `None` when it is over.
    async fn advance(&mut self) -> Option<String> {
        match std::mem::replace(&mut self.step, Step::End) {
            Step::Start => {
                let job = &self.job;
                let mut run = match job
                    .pod
                    .admit(&job.tokens, job.output_tokens, &job.knobs)
                    .await
                {
                    Ok(r) => r,
                    Err(e) => {
                        self.step = Step::Done;
                        let err = json!({"error": {"message": e.to_string(),
                            "type": "ServiceUnavailableError", "code": 503}});
                        return Some(format!("data: {err}\n\n"));
                    }
                };
                engine::pause(engine::ttft(&job.knobs, run.uncached_tokens())).await;
                run.prefilled();
                self.cached = run.cached_tokens();
                self.run = Some(run);
                self.first_token = tokio::time::Instant::now();
                let mut out = String::new();
                if self.job.kind == Kind::Chat {
                    out.push_str(&self.chunk(self.choice(Some(String::new()), true, false)));
                }
                out.push_str(&self.chunk(self.choice(
                    Some(token_text(&self.job, 0)),
                    false,
                    false,
                )));
                self.step = self.next_after(0);
                Some(out)
            }
            Step::Token(i) => {
                let due = self.first_token + engine::inter_token(&self.job.knobs) * i;
                engine::pause_until(due).await;
                self.step = self.next_after(i);
                Some(self.chunk(self.choice(Some(token_text(&self.job, i)), false, false)))
            }
            Step::Finish => {
                if let Some(run) = self.run.take() {
                    run.finish(self.job.output_tokens);
                }
                self.step = if self.include_usage {
                    Step::Usage
                } else {
                    Step::Done
                };
                let text = match self.job.kind {
                    Kind::Chat => None,
                    Kind::Completion => Some(String::new()),
                };
                Some(self.chunk(self.choice(text, false, true)))
            }
            Step::Usage => {
                self.step = Step::Done;
                let v = json!({
                    "id": self.job.id,
                    "object": match self.job.kind {
                        Kind::Chat => "chat.completion.chunk",
                        Kind::Completion => "text_completion",
                    },
                    "created": self.job.created,
                    "model": self.job.model,
                    "choices": [],
                    "usage": usage(&self.job, self.cached),
                });
                Some(format!("data: {v}\n\n"))
            }
            Step::Done => Some("data: [DONE]\n\n".to_owned()),
            Step::End => None,
        }
    }
}

fn stream_response(job: Job, include_usage: bool) -> Response {
    let state = StreamState {
        job,
        include_usage,
        step: Step::Start,
        run: None,
        cached: 0,
        first_token: tokio::time::Instant::now(),
    };
    // The state (and with it the running slot) lives in the body: a client that goes away drops the
    // body, which releases the slot and blocks.
    let body = futures::stream::unfold(state, |mut st| async move {
        let piece = st.advance().await?;
        Some((Ok::<_, Infallible>(Bytes::from(piece)), st))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn models(State(pod): State<Arc<Pod>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": pod.model,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": pod.model,
            "parent": null,
            "max_model_len": 131072,
        }],
    }))
    .into_response()
}

async fn metrics(State(pod): State<Arc<Pod>>) -> Response {
    let text = crate::metrics::render(&pod.model, &pod.knobs(), &pod.stats());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Renders the discovery file the EPP reads.
pub fn pods_yaml(pods: &[Arc<Pod>]) -> String {
    let mut out = String::from("pods:\n");
    for p in pods {
        out.push_str(&format!(
            "  - name: {}\n    address: {}\n    port: {}\n    labels:\n      llm-d.ai/engine-type: vllm\n",
            p.name,
            p.addr.ip(),
            p.addr.port()
        ));
    }
    out
}

/// Router of the admin server.
pub fn admin_router(pods: Arc<Vec<Arc<Pod>>>) -> Router {
    Router::new()
        .route("/pods", get(admin_pods))
        .route("/pods.yaml", get(admin_yaml))
        .route("/pods/{idx}/knobs", post(admin_knobs))
        .with_state(pods)
}

async fn admin_pods(State(pods): State<Arc<Vec<Arc<Pod>>>>) -> Response {
    let list: Vec<Value> = pods
        .iter()
        .map(|p| {
            json!({
                "index": p.index,
                "name": p.name,
                "address": p.addr.ip().to_string(),
                "port": p.addr.port(),
                "stats": p.stats(),
                "knobs": p.knobs(),
            })
        })
        .collect();
    axum::Json(list).into_response()
}

async fn admin_yaml(State(pods): State<Arc<Vec<Arc<Pod>>>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/yaml")],
        pods_yaml(&pods),
    )
        .into_response()
}

async fn admin_knobs(
    State(pods): State<Arc<Vec<Arc<Pod>>>>,
    Path(idx): Path<usize>,
    body: Bytes,
) -> Response {
    let Some(pod) = pods.get(idx) else {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", "no such pod");
    };
    let patch: KnobsPatch = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e.to_string());
        }
    };
    match pod.set_knobs(&patch) {
        Ok(()) => axum::Json(pod.knobs()).into_response(),
        Err(e) => error_response(StatusCode::BAD_REQUEST, "BadRequestError", &e.to_string()),
    }
}

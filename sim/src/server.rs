//! HTTP shells: the per-pod vLLM-compatible server and the admin server.
//!
//! Pod routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (+ `GET
//! /v1/responses/{id}`), `/v1/embeddings`, `/v1/messages` (Anthropic) and
//! `/v1/messages/count_tokens`, `/v1/models`, `/tokenize`, `/detokenize`,
//! `/v1/chat/completions/render`, `/v1/completions/render`, `/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, `/reset_prefix_cache`, `/health`, `/metrics` (the last two served
//! ahead of the router by [`crate::podsvc`]).
//! Admin routes: see [`admin_router`].

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::engine::{self, Adapter, LoraError, Pod, Running};
use crate::fleet::Fleet;
use crate::knobs::{KnobsPatch, MetricsFault, PodKnobs};
use crate::podsvc::PodService;
use crate::tokenizer::{self, ChatMessage, Content, ContentPart, Prompt};

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

async fn echo_destination(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let dest = req.headers().get(DESTINATION_HEADER).cloned();
    let prefiller = req.headers().get(PREFILLER_HEADER).cloned();
    let mut res = next.run(req).await;
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
    /// Anthropic's top-level system prompt.
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Chat,
    Completion,
    /// Anthropic `/v1/messages`.
    Messages,
}

/// Prefill/decode disaggregation leg, from `kv_transfer_params`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PdLeg {
    None,
    /// `do_remote_decode: true`: prefill here, hand the KV to a decode pod.
    Prefill,
    /// `do_remote_prefill: true`: the KV was computed elsewhere; skip the prefill cost.
    Decode,
}

fn pd_leg(params: Option<&Value>) -> PdLeg {
    let flag = |k: &str| {
        params
            .and_then(|p| p.get(k))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    if flag("do_remote_decode") {
        PdLeg::Prefill
    } else if flag("do_remote_prefill") {
        PdLeg::Decode
    } else {
        PdLeg::None
    }
}

struct Job {
    pod: Arc<Pod>,
    knobs: PodKnobs,
    kind: Kind,
    /// One entry per prompt (completions accept a batch).
    prompts: Vec<Vec<u32>>,
    output_tokens: u32,
    id: String,
    created: u64,
    model: String,
    seed: u64,
    lora: Option<Adapter>,
    pd: PdLeg,
    /// Set for `/v1/responses` (whose prompt is tokenized like a chat).
    responses: Option<Box<RespCtx>>,
}

/// The `/v1/responses` side of a job.
struct RespCtx {
    /// The conversation this answer continues (the previous response's history, then this input),
    /// without the instructions.
    history: Vec<ChatMessage>,
    instructions: Option<String>,
    max_output_tokens: Option<u32>,
    previous_response_id: Option<String>,
    store: bool,
    /// Id of the output message item.
    msg_id: String,
}

async fn chat(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Chat, body).await
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Completion, body).await
}

async fn messages(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Messages, body).await
}

/// Resolves `model` to the base model (`Ok(None)`) or a registered adapter, as vLLM does; anything
/// else is a 404.
fn resolve_model(pod: &Pod, model: Option<&str>) -> Result<Option<Adapter>, String> {
    match model {
        None => Ok(None),
        Some(m) if m == pod.model || m.is_empty() => Ok(None),
        Some(m) => match pod.adapter(m) {
            Some(a) => Ok(Some(a)),
            None => Err(format!("The model `{m}` does not exist.")),
        },
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Prompt tokens of an Anthropic request: the system prompt, then the messages.
fn messages_tokens(system: Option<&Content>, msgs: &[ChatMessage]) -> Vec<u32> {
    let mut all = Vec::with_capacity(msgs.len() + 1);
    if let Some(s) = system {
        all.push(ChatMessage {
            role: "system".into(),
            content: Some(s.clone()),
        });
    }
    all.extend(msgs.iter().cloned());
    tokenizer::chat_tokens(&all)
}

async fn generate(pod: Arc<Pod>, kind: Kind, body: Bytes) -> Response {
    let reject = |pod: &Pod, msg: &str| {
        if kind == Kind::Messages {
            pod.record_error();
            anthropic_error(StatusCode::BAD_REQUEST, "invalid_request_error", msg)
        } else {
            bad_request(pod, msg)
        }
    };
    let req: GenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return reject(&pod, &format!("invalid request body: {e}")),
    };
    let stream = req.stream.unwrap_or(false);
    if req.stream_options.is_some() && !stream {
        return reject(
            &pod,
            "Stream options can only be defined when `stream=True`.",
        );
    }
    let prompts = match kind {
        Kind::Chat => match &req.messages {
            Some(m) => vec![tokenizer::chat_tokens(m)],
            None => return reject(&pod, "field `messages` is required"),
        },
        Kind::Messages => match &req.messages {
            Some(m) => vec![messages_tokens(req.system.as_ref(), m)],
            None => return reject(&pod, "field `messages` is required"),
        },
        Kind::Completion => match &req.prompt {
            Some(p) => tokenizer::prompt_list(p),
            None => return reject(&pod, "field `prompt` is required"),
        },
    };
    if prompts.is_empty() {
        return reject(&pod, "`prompt` must not be empty");
    }
    let lora = match resolve_model(&pod, req.model.as_deref()) {
        Ok(l) => l,
        Err(msg) => {
            pod.record_error();
            return if kind == Kind::Messages {
                anthropic_error(StatusCode::NOT_FOUND, "not_found_error", &msg)
            } else {
                error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg)
            };
        }
    };
    let knobs = pod.knobs();
    let requested = match kind {
        Kind::Chat => req.max_completion_tokens.or(req.max_tokens),
        Kind::Completion => req.max_tokens.or(req.max_completion_tokens),
        Kind::Messages => match req.max_tokens {
            Some(n) => Some(n),
            None => return reject(&pod, "field `max_tokens` is required"),
        },
    };
    let pd = pd_leg(req.kv_transfer_params.as_ref());
    let mut output_tokens = requested.unwrap_or(knobs.default_max_tokens);
    if output_tokens == 0 {
        return reject(&pod, "max_tokens must be at least 1");
    }
    if pd == PdLeg::Prefill {
        // The prefill leg produces a single token; the decode pod generates the rest.
        output_tokens = 1;
    }
    if engine::inject_failure(&knobs) {
        pod.record_error();
        return if kind == Kind::Messages {
            anthropic_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                "injected failure",
            )
        } else {
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "injected failure",
            )
        };
    }
    let n = pod.next_request_id();
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
        Kind::Messages => "msg",
    };
    let seed = prompts
        .iter()
        .flatten()
        .fold(n, |acc, t| acc.rotate_left(5) ^ u64::from(*t));
    let job = Job {
        id: format!("{prefix}-{}-{n}", pod.name),
        created: now_secs(),
        model: req.model.unwrap_or_else(|| pod.model.clone()),
        pod,
        knobs,
        kind,
        prompts,
        output_tokens,
        seed,
        lora,
        pd,
        responses: None,
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

/// Sum over a job's prompts: (prompt tokens, cached tokens).
fn usage(job: &Job, prompt: usize, cached: usize) -> Value {
    let completion = u64::from(job.output_tokens) * job.prompts.len() as u64;
    let prompt = prompt as u64;
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

/// Anthropic usage: `input_tokens` excludes the tokens read from the prefix cache, which are
/// reported as `cache_read_input_tokens` (the Anthropic API's convention).
fn anthropic_usage(prompt: usize, cached: usize, output: u32) -> Value {
    json!({
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
}

fn token_text(job: &Job, prompt: usize, i: u32) -> String {
    let w = tokenizer::output_word(job.seed ^ prompt as u64, i);
    if i == 0 {
        w.to_owned()
    } else {
        format!(" {w}")
    }
}

fn finish_reason(job: &Job) -> &'static str {
    match (job.kind, job.pd) {
        (_, PdLeg::Prefill) => "remote_decode",
        (Kind::Messages, _) => "max_tokens",
        _ => "length",
    }
}

/// The `kv_transfer_params` a prefill leg returns for the decode pod.
fn transfer_params(job: &Job, run: &Running) -> Value {
    let blocks: Vec<usize> = (0..run.block_hashes().len()).collect();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": job.pod.name,
        "remote_block_ids": blocks,
        "remote_host": job.pod.addr.ip().to_string(),
        "remote_port": job.pod.addr.port(),
        "tp_size": 1,
    })
}

/// Admits `tokens`, waits the simulated prefill (skipped on a P/D decode leg, plus the adapter
/// swap-in when needed) and caches the prompt.
async fn prefill(job: &Job, tokens: &[u32]) -> Result<Running, engine::EngineClosed> {
    let mut run = job
        .pod
        .admit_lora(tokens, job.output_tokens, &job.knobs, job.lora.clone())
        .await?;
    let uncached = if job.pd == PdLeg::Decode {
        0
    } else {
        run.uncached_tokens()
    };
    let mut wait = engine::ttft(&job.knobs, uncached);
    if run.lora_swapped() {
        wait += engine::lora_load(&job.knobs);
    }
    engine::pause(wait).await;
    job.pod.unstalled().await;
    run.prefilled();
    Ok(run)
}

/// One prompt served without streaming: (text, prompt tokens, cached tokens, transfer params).
async fn run_prompt(
    job: &Job,
    idx: usize,
) -> Result<(String, usize, usize, Option<Value>), engine::EngineClosed> {
    let tokens = &job.prompts[idx];
    let run = prefill(job, tokens).await?;
    let decode = engine::inter_token(&job.knobs) * job.output_tokens.saturating_sub(1);
    engine::pause(decode).await;
    job.pod.unstalled().await;
    let cached = run.cached_tokens();
    let params = (job.pd == PdLeg::Prefill).then(|| transfer_params(job, &run));
    run.finish(job.output_tokens);
    let text: String = (0..job.output_tokens)
        .map(|i| token_text(job, idx, i))
        .collect();
    Ok((text, tokens.len(), cached, params))
}

async fn full_response(job: Job) -> Response {
    let results =
        futures::future::join_all((0..job.prompts.len()).map(|i| run_prompt(&job, i))).await;
    let mut outs = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Ok(o) => outs.push(o),
            Err(_) => return closed_response(),
        }
    }
    let prompt: usize = outs.iter().map(|o| o.1).sum();
    let cached: usize = outs.iter().map(|o| o.2).sum();
    let params = outs.first().and_then(|o| o.3.clone());
    let reason = finish_reason(&job);
    if job.responses.is_some() {
        let text = outs.into_iter().map(|o| o.0).collect::<String>();
        let mut body = response_object(
            &job,
            final_status(&job),
            Some(&text),
            Some(responses_usage(prompt, cached, job.output_tokens)),
        );
        if let Some(p) = params {
            body["kv_transfer_params"] = p;
        }
        remember_response(&job, &text, &body);
        return axum::Json(body).into_response();
    }
    if job.kind == Kind::Messages {
        let text = outs.into_iter().map(|o| o.0).collect::<String>();
        return axum::Json(json!({
            "id": job.id,
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": null,
            "usage": anthropic_usage(prompt, cached, job.output_tokens),
        }))
        .into_response();
    }
    let choices: Vec<Value> = outs
        .into_iter()
        .enumerate()
        .map(|(i, (text, ..))| match job.kind {
            Kind::Chat => json!({
                "index": i,
                "message": { "role": "assistant", "content": text },
                "logprobs": null,
                "finish_reason": reason,
                "stop_reason": null,
            }),
            _ => json!({
                "index": i, "text": text, "logprobs": null, "finish_reason": reason,
                "stop_reason": null,
            }),
        })
        .collect();
    let object = match job.kind {
        Kind::Chat => "chat.completion",
        _ => "text_completion",
    };
    let mut body = json!({
        "id": job.id,
        "object": object,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage(&job, prompt, cached),
    });
    if let Some(p) = params {
        body["kv_transfer_params"] = p;
    }
    axum::Json(body).into_response()
}

enum Step {
    /// `/v1/responses`: `response.created` and `response.in_progress`, before admission.
    Begin,
    /// Admit and prefill prompt `p`, then send its first token.
    Start(usize),
    /// Token `i` of prompt `p`.
    Token(usize, u32),
    /// Close prompt `p`.
    Finish(usize),
    Usage,
    Done,
    End,
}

struct StreamState {
    job: Job,
    include_usage: bool,
    step: Step,
    run: Option<Running>,
    prompt_tokens: usize,
    cached: usize,
    /// When the first token went out; token i is due at `first_token + i * inter_token`, so timer
    /// rounding does not accumulate over a long output.
    first_token: tokio::time::Instant,
    /// `/v1/responses`: the next event's `sequence_number` and the text so far.
    seq: u64,
    text: String,
}

fn sse_event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

impl StreamState {
    fn chunk(&self, choices: Value) -> String {
        let object = match self.job.kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
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

    fn choice(&self, p: usize, text: Option<String>, role: bool, finish: bool) -> Value {
        let finish_reason = if finish {
            json!(finish_reason(&self.job))
        } else {
            Value::Null
        };
        match self.job.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!([{ "index": p, "delta": delta, "logprobs": null, "finish_reason": finish_reason }])
            }
            _ => json!([{
                "index": p, "text": text.unwrap_or_default(), "logprobs": null,
                "finish_reason": finish_reason, "stop_reason": null,
            }]),
        }
    }

    /// One `/v1/responses` event (`type` and `sequence_number` added to `data`).
    fn resp_event(&mut self, kind: &str, mut data: Value) -> String {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        sse_event(kind, &data)
    }

    fn delta(&mut self, p: usize, i: u32) -> String {
        let text = token_text(&self.job, p, i);
        if self.job.responses.is_some() {
            self.text.push_str(&text);
            let item_id = self.msg_id();
            self.resp_event(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                       "delta": text, "logprobs": []}),
            )
        } else if self.job.kind == Kind::Messages {
            sse_event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}}),
            )
        } else {
            self.chunk(self.choice(p, Some(text), false, false))
        }
    }

    fn next_after(&self, p: usize, i: u32) -> Step {
        if i + 1 < self.job.output_tokens {
            Step::Token(p, i + 1)
        } else {
            Step::Finish(p)
        }
    }

    fn msg_id(&self) -> String {
        self.job
            .responses
            .as_ref()
            .map(|c| c.msg_id.clone())
            .unwrap_or_default()
    }

    /// `/v1/responses` events after prefill: the message item and its text part open.
    fn responses_open(&mut self) -> String {
        let item_id = self.msg_id();
        let mut out = self.resp_event(
            "response.output_item.added",
            json!({"output_index": 0, "item": {"id": item_id, "type": "message",
                   "status": "in_progress", "role": "assistant", "content": []}}),
        );
        out.push_str(&self.resp_event(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        ));
        out
    }

    /// `/v1/responses` events at the end: text, part and item done, then the final response
    /// (stored when asked).
    fn responses_close(&mut self, params: Option<Value>) -> String {
        let item_id = self.msg_id();
        let text = std::mem::take(&mut self.text);
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let mut out = self.resp_event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text,
                   "logprobs": []}),
        );
        out.push_str(&self.resp_event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
        ));
        out.push_str(&self.resp_event(
            "response.output_item.done",
            json!({"output_index": 0, "item": {"id": item_id, "type": "message",
                   "status": "completed", "role": "assistant", "content": [part]}}),
        ));
        let status = final_status(&self.job);
        let mut body = response_object(
            &self.job,
            status,
            Some(&text),
            Some(responses_usage(
                self.prompt_tokens,
                self.cached,
                self.job.output_tokens,
            )),
        );
        if let Some(p) = params {
            body["kv_transfer_params"] = p;
        }
        remember_response(&self.job, &text, &body);
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        out.push_str(&self.resp_event(kind, json!({ "response": body })));
        out
    }

    fn error_event(&mut self, message: &str) -> String {
        if self.job.responses.is_some() {
            self.step = Step::End;
            return self.resp_event(
                "error",
                json!({"code": "ServiceUnavailableError", "message": message, "param": null}),
            );
        }
        if self.job.kind == Kind::Messages {
            self.step = Step::End;
            sse_event(
                "error",
                &json!({"type": "error", "error": {"type": "overloaded_error", "message": message}}),
            )
        } else {
            self.step = Step::Done;
            let err = json!({"error": {"message": message,
                "type": "ServiceUnavailableError", "code": 503}});
            format!("data: {err}\n\n")
        }
    }

    /// Produces the next piece of the event stream, or `None` when it is over.
    async fn advance(&mut self) -> Option<String> {
        match std::mem::replace(&mut self.step, Step::End) {
            Step::Begin => {
                let created = response_object(&self.job, "in_progress", None, None);
                let mut out = self.resp_event("response.created", json!({ "response": created }));
                out.push_str(
                    &self.resp_event("response.in_progress", json!({ "response": created })),
                );
                self.step = Step::Start(0);
                Some(out)
            }
            Step::Start(p) => {
                let run = match prefill(&self.job, &self.job.prompts[p]).await {
                    Ok(r) => r,
                    Err(e) => return Some(self.error_event(&e.to_string())),
                };
                self.cached += run.cached_tokens();
                self.prompt_tokens += self.job.prompts[p].len();
                let mut out = String::new();
                match self.job.kind {
                    _ if self.job.responses.is_some() => out.push_str(&self.responses_open()),
                    Kind::Chat => {
                        out.push_str(&self.chunk(self.choice(p, Some(String::new()), true, false)))
                    }
                    Kind::Messages => {
                        let start = json!({"type": "message_start", "message": {
                            "id": self.job.id, "type": "message", "role": "assistant",
                            "model": self.job.model, "content": [], "stop_reason": null,
                            "stop_sequence": null,
                            "usage": anthropic_usage(self.prompt_tokens, self.cached, 0),
                        }});
                        out.push_str(&sse_event("message_start", &start));
                        out.push_str(&sse_event(
                            "content_block_start",
                            &json!({"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
                        ));
                        out.push_str(&sse_event("ping", &json!({"type": "ping"})));
                    }
                    Kind::Completion => {}
                }
                self.run = Some(run);
                self.first_token = tokio::time::Instant::now();
                out.push_str(&self.delta(p, 0));
                self.step = self.next_after(p, 0);
                Some(out)
            }
            Step::Token(p, i) => {
                let due = self.first_token + engine::inter_token(&self.job.knobs) * i;
                engine::pause_until(due).await;
                self.job.pod.unstalled().await;
                self.step = self.next_after(p, i);
                Some(self.delta(p, i))
            }
            Step::Finish(p) => {
                let params = self
                    .run
                    .as_ref()
                    .filter(|_| self.job.pd == PdLeg::Prefill)
                    .map(|r| transfer_params(&self.job, r));
                if let Some(run) = self.run.take() {
                    run.finish(self.job.output_tokens);
                }
                if self.job.responses.is_some() {
                    self.step = Step::End;
                    return Some(self.responses_close(params));
                }
                if self.job.kind == Kind::Messages {
                    self.step = Step::End;
                    let n = self.job.output_tokens;
                    let mut out = sse_event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": 0}),
                    );
                    out.push_str(&sse_event(
                        "message_delta",
                        &json!({"type": "message_delta",
                                "delta": {"stop_reason": finish_reason(&self.job), "stop_sequence": null},
                                "usage": {"output_tokens": n}}),
                    ));
                    out.push_str(&sse_event("message_stop", &json!({"type": "message_stop"})));
                    return Some(out);
                }
                self.step = if p + 1 < self.job.prompts.len() {
                    Step::Start(p + 1)
                } else if self.include_usage {
                    Step::Usage
                } else {
                    Step::Done
                };
                let text = match self.job.kind {
                    Kind::Chat => None,
                    _ => Some(String::new()),
                };
                let mut choice = self.choice(p, text, false, true);
                if let (Some(params), Some(c)) = (params, choice.get_mut(0)) {
                    c["kv_transfer_params"] = params;
                }
                Some(self.chunk(choice))
            }
            Step::Usage => {
                self.step = Step::Done;
                let v = json!({
                    "id": self.job.id,
                    "object": match self.job.kind {
                        Kind::Chat => "chat.completion.chunk",
                        _ => "text_completion",
                    },
                    "created": self.job.created,
                    "model": self.job.model,
                    "choices": [],
                    "usage": usage(&self.job, self.prompt_tokens, self.cached),
                });
                Some(format!("data: {v}\n\n"))
            }
            Step::Done => Some("data: [DONE]\n\n".to_owned()),
            Step::End => None,
        }
    }
}

fn stream_response(job: Job, include_usage: bool) -> Response {
    let step = if job.responses.is_some() {
        Step::Begin
    } else {
        Step::Start(0)
    };
    let state = StreamState {
        job,
        include_usage,
        step,
        run: None,
        prompt_tokens: 0,
        cached: 0,
        first_token: tokio::time::Instant::now(),
        seq: 0,
        text: String::new(),
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

/// `POST /v1/responses` body: the fields the simulator acts on (others are accepted and ignored).
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

/// Chat content of a Responses item: a string, or parts whose `text` carries the tokens.
fn item_content(v: Option<&Value>) -> Result<Option<Content>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(t)) => Ok(Some(Content::Text(t.clone()))),
        Some(Value::Array(parts)) => Ok(Some(Content::Parts(
            parts
                .iter()
                .map(|p| ContentPart {
                    kind: p
                        .get("type")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    text: p.get("text").and_then(Value::as_str).map(str::to_owned),
                })
                .collect(),
        ))),
        Some(_) => Err("item `content` must be a string or a list of parts".into()),
    }
}

/// The messages of a Responses `input`: a string is one user message; a list holds messages
/// (`role` + `content`), function calls and their outputs; reasoning items carry no prompt.
fn response_input(input: &Value) -> Result<Vec<ChatMessage>, String> {
    let items = match input {
        Value::String(t) => {
            return Ok(vec![ChatMessage {
                role: "user".into(),
                content: Some(Content::Text(t.clone())),
            }]);
        }
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => return Err("`input` must not be empty".into()),
        _ => return Err("`input` must be a string or a list of items".into()),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str);
        let text_of = |k: &str| {
            item.get(k)
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
        };
        let msg = match (item.get("role").and_then(Value::as_str), kind) {
            (Some(role), None | Some("message")) => ChatMessage {
                role: role.to_owned(),
                content: item_content(item.get("content"))
                    .map_err(|e| format!("input[{i}]: {e}"))?,
            },
            (_, Some("function_call")) => ChatMessage {
                role: "assistant".into(),
                content: text_of("arguments").map(Content::Text),
            },
            (_, Some("function_call_output")) => ChatMessage {
                role: "tool".into(),
                content: text_of("output").map(Content::Text),
            },
            (_, Some("reasoning")) => continue,
            _ => {
                return Err(format!(
                    "input[{i}]: unsupported item (needs a `role`, or a `type` of message, function_call, function_call_output or reasoning)"
                ));
            }
        };
        out.push(msg);
    }
    Ok(out)
}

/// `status` of a finished response: the simulator always writes the whole budget, so an explicit
/// `max_output_tokens` is what stopped it (`incomplete`), while without one it simply ended.
fn final_status(job: &Job) -> &'static str {
    match &job.responses {
        Some(c) if c.max_output_tokens.is_some() => "incomplete",
        _ => "completed",
    }
}

fn responses_usage(prompt: usize, cached: usize, output: u32) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt as u64 + u64::from(output),
    })
}

/// The Responses API object of `job` in `status`, with its output text once there is one.
fn response_object(job: &Job, status: &str, text: Option<&str>, usage: Option<Value>) -> Value {
    let Some(ctx) = &job.responses else {
        return Value::Null;
    };
    let output = match text {
        Some(t) => json!([{
            "id": ctx.msg_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}],
        }]),
        None => json!([]),
    };
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    json!({
        "id": job.id,
        "object": "response",
        "created_at": job.created,
        "status": status,
        "background": false,
        "error": null,
        "incomplete_details": incomplete,
        "instructions": ctx.instructions,
        "max_output_tokens": ctx.max_output_tokens,
        "model": job.model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": ctx.previous_response_id,
        "store": ctx.store,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": usage,
    })
}

/// Stores a finished response when the request asked for it (`store`, default true).
fn remember_response(job: &Job, text: &str, body: &Value) {
    let Some(ctx) = &job.responses else { return };
    if !ctx.store {
        return;
    }
    let mut history = ctx.history.clone();
    history.push(ChatMessage {
        role: "assistant".into(),
        content: Some(Content::Text(text.to_owned())),
    });
    job.pod.store_response(
        job.id.clone(),
        engine::StoredResponse {
            history,
            body: body.clone(),
        },
    );
}

/// `POST /v1/responses`: a chat-like generation with vLLM's per-process response store, so a
/// follow-up naming `previous_response_id` only works on the pod that answered the first turn.
async fn responses(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: ResponsesRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    if req.background == Some(true) {
        return bad_request(
            &pod,
            "`background` responses are not supported by the simulator",
        );
    }
    let Some(input) = &req.input else {
        return bad_request(&pod, "field `input` is required");
    };
    let input = match response_input(input) {
        Ok(m) => m,
        Err(msg) => return bad_request(&pod, &msg),
    };
    let lora = match resolve_model(&pod, req.model.as_deref()) {
        Ok(l) => l,
        Err(msg) => {
            pod.record_error();
            return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
        }
    };
    let mut history = match &req.previous_response_id {
        None => Vec::new(),
        Some(id) => match pod.stored_response(id) {
            Some(prev) => prev.history,
            None => {
                pod.record_error();
                return error_response(
                    StatusCode::NOT_FOUND,
                    "NotFoundError",
                    &format!("Response with id '{id}' not found."),
                );
            }
        },
    };
    history.extend(input);
    let mut convo = Vec::with_capacity(history.len() + 1);
    if let Some(i) = &req.instructions {
        convo.push(ChatMessage {
            role: "system".into(),
            content: Some(Content::Text(i.clone())),
        });
    }
    convo.extend(history.iter().cloned());
    let tokens = tokenizer::chat_tokens(&convo);
    let knobs = pod.knobs();
    let pd = pd_leg(req.kv_transfer_params.as_ref());
    let mut output_tokens = req.max_output_tokens.unwrap_or(knobs.default_max_tokens);
    if output_tokens == 0 {
        return bad_request(&pod, "max_output_tokens must be at least 1");
    }
    if pd == PdLeg::Prefill {
        output_tokens = 1;
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
    let seed = tokens
        .iter()
        .fold(n, |acc, t| acc.rotate_left(5) ^ u64::from(*t));
    let job = Job {
        id: format!("resp_{}-{n}", pod.name),
        created: now_secs(),
        model: req.model.unwrap_or_else(|| pod.model.clone()),
        knobs,
        kind: Kind::Chat,
        prompts: vec![tokens],
        output_tokens,
        seed,
        lora,
        pd,
        responses: Some(Box::new(RespCtx {
            history,
            instructions: req.instructions,
            max_output_tokens: req.max_output_tokens,
            previous_response_id: req.previous_response_id,
            store: req.store.unwrap_or(true),
            msg_id: format!("msg_{}-{n}", pod.name),
        })),
        pod,
    };
    if req.stream.unwrap_or(false) {
        stream_response(job, false)
    } else {
        full_response(job).await
    }
}

/// `GET /v1/responses/{id}`: a stored response of this pod.
async fn get_response(State(pod): State<Arc<Pod>>, Path(id): Path<String>) -> Response {
    match pod.stored_response(&id) {
        Some(r) => axum::Json(r.body).into_response(),
        None => error_response(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("Response with id '{id}' not found."),
        ),
    }
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /detokenize {model, tokens}` → `{prompt}` (see [`tokenizer::Vocab`] for what it can
/// recover).
async fn detokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: DetokenizeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
    }
    let prompt = pod
        .vocab
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .detokenize(&req.tokens);
    axum::Json(json!({ "prompt": prompt })).into_response()
}

#[derive(Debug, Deserialize)]
struct CountTokensRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    system: Option<Content>,
}

/// `POST /v1/messages/count_tokens` (Anthropic): `{input_tokens}` of a Messages request.
async fn count_tokens(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let bad = |msg: &str| anthropic_error(StatusCode::BAD_REQUEST, "invalid_request_error", msg);
    let req: CountTokensRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(&format!("invalid request body: {e}")),
    };
    let Some(msgs) = &req.messages else {
        return bad("field `messages` is required");
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return anthropic_error(StatusCode::NOT_FOUND, "not_found_error", &msg);
    }
    let n = messages_tokens(req.system.as_ref(), msgs).len();
    axum::Json(json!({ "input_tokens": n })).into_response()
}

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    #[serde(default)]
    model: Option<String>,
    input: Prompt,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<usize>,
}

/// Default embedding width.
const EMBEDDING_DIM: usize = 32;

/// A deterministic unit vector for `tokens`.
fn embedding(tokens: &[u32], dim: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..dim)
        .map(|i| {
            let h = tokens.iter().fold(i as u64 ^ 0x9e37_79b9, |acc, t| {
                acc.rotate_left(7) ^ u64::from(*t).wrapping_mul(0x100_0000_01b3)
            });
            ((h % 2001) as f32 / 1000.0) - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x /= norm;
        }
    }
    v
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn embeddings(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: EmbeddingRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    let lora = match resolve_model(&pod, req.model.as_deref()) {
        Ok(l) => l,
        Err(msg) => {
            pod.record_error();
            return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
        }
    };
    let dim = req.dimensions.unwrap_or(EMBEDDING_DIM);
    if dim == 0 || dim > 8192 {
        return bad_request(&pod, "dimensions must be within 1..=8192");
    }
    let base64_out = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return bad_request(&pod, &format!("unknown encoding_format {other:?}"));
        }
    };
    let inputs = tokenizer::prompt_list(&req.input);
    if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
        return bad_request(&pod, "input must not be empty");
    }
    let knobs = pod.knobs();
    if engine::inject_failure(&knobs) {
        pod.record_error();
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "injected failure",
        );
    }
    let mut data = Vec::with_capacity(inputs.len());
    let mut prompt_tokens = 0;
    for (i, tokens) in inputs.iter().enumerate() {
        // Pooling models prefill and produce no tokens.
        let mut run = match pod.admit_lora(tokens, 0, &knobs, lora.clone()).await {
            Ok(r) => r,
            Err(_) => return closed_response(),
        };
        engine::pause(engine::ttft(&knobs, run.uncached_tokens())).await;
        pod.unstalled().await;
        run.prefilled();
        run.finish(0);
        prompt_tokens += tokens.len();
        let v = embedding(tokens, dim);
        let value = if base64_out {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64(&bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": value}));
    }
    axum::Json(json!({
        "id": format!("embd-{}-{}", pod.name, pod.next_request_id()),
        "object": "list",
        "created": now_secs(),
        "model": req.model.unwrap_or_else(|| pod.model.clone()),
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    return_token_strs: Option<bool>,
}

async fn tokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: TokenizeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
    }
    {
        let mut vocab = pod.vocab.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &req.prompt {
            vocab.learn_text(p);
        }
        if let Some(m) = &req.messages {
            vocab.learn_chat(m);
        }
    }
    let (tokens, strs) = match (&req.prompt, &req.messages) {
        (Some(p), None) => {
            let mut strs = Vec::new();
            tokenizer::token_strs_into(p, &mut strs);
            (tokenizer::tokenize(p), strs)
        }
        (None, Some(m)) => (tokenizer::chat_tokens(m), tokenizer::chat_token_strs(m)),
        _ => return bad_request(&pod, "exactly one of `prompt` and `messages` is required"),
    };
    let mut out = json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN, "tokens": tokens});
    if req.return_token_strs.unwrap_or(false) {
        out["token_strs"] = json!(strs);
    }
    axum::Json(out).into_response()
}

fn render_one(req: &GenRequest, pod: &Pod, tokens: Vec<u32>, n: usize, chat: bool) -> Value {
    let max_tokens = if chat {
        req.max_completion_tokens.or(req.max_tokens)
    } else {
        req.max_tokens.or(req.max_completion_tokens)
    };
    json!({
        "request_id": req.request_id.clone().unwrap_or_else(|| format!("render-{}-{n}", pod.name)),
        "token_ids": tokens,
        "features": null,
        "sampling_params": {"max_tokens": max_tokens.unwrap_or(pod.knobs().default_max_tokens)},
        "model": req.model.clone().unwrap_or_else(|| pod.model.clone()),
        "stream": req.stream.unwrap_or(false),
        "stream_options": req.stream_options.as_ref().map(|o| json!({"include_usage": o.include_usage.unwrap_or(true)})),
        "cache_salt": req.cache_salt,
        "priority": req.priority.unwrap_or(0),
        "kv_transfer_params": req.kv_transfer_params,
    })
}

async fn render_chat(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: GenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    let Some(m) = &req.messages else {
        return bad_request(&pod, "field `messages` is required");
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
    }
    pod.vocab
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .learn_chat(m);
    let tokens = tokenizer::chat_tokens(m);
    let n = pod.next_request_id() as usize;
    axum::Json(render_one(&req, &pod, tokens, n, true)).into_response()
}

async fn render_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: GenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    let Some(p) = &req.prompt else {
        return bad_request(&pod, "field `prompt` is required");
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
    }
    {
        let mut vocab = pod.vocab.lock().unwrap_or_else(|e| e.into_inner());
        match p {
            Prompt::Text(t) => vocab.learn_text(t),
            Prompt::Texts(ts) => ts.iter().for_each(|t| vocab.learn_text(t)),
            Prompt::Ids(_) | Prompt::IdLists(_) => {}
        }
    }
    let n = pod.next_request_id() as usize;
    let out: Vec<Value> = tokenizer::prompt_list(p)
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let mut v = render_one(&req, &pod, t, n, false);
            if req.request_id.is_none() {
                v["request_id"] = json!(format!("render-{}-{n}-{i}", pod.name));
            }
            v
        })
        .collect();
    axum::Json(out).into_response()
}

#[derive(Debug, Deserialize)]
struct LoraRequest {
    lora_name: String,
    #[serde(default)]
    lora_path: Option<String>,
}

fn lora_error(e: &LoraError) -> Response {
    let status = match e {
        LoraError::NotFound(_) => StatusCode::NOT_FOUND,
        _ => StatusCode::BAD_REQUEST,
    };
    let kind = match e {
        LoraError::NotFound(_) => "NotFoundError",
        _ => "InvalidUserInput",
    };
    error_response(status, kind, &e.to_string())
}

async fn load_lora(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: LoraRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    match pod.load_adapter(&req.lora_name, req.lora_path.as_deref().unwrap_or("")) {
        Ok(()) => format!(
            "Success: LoRA adapter '{}' added successfully.",
            req.lora_name
        )
        .into_response(),
        Err(e) => lora_error(&e),
    }
}

async fn unload_lora(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: LoraRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    match pod.unload_adapter(&req.lora_name) {
        Ok(()) => format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        )
        .into_response(),
        Err(e) => lora_error(&e),
    }
}

async fn models(State(pod): State<Arc<Pod>>) -> Response {
    let created = now_secs();
    let mut data = vec![json!({
        "id": pod.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": pod.model,
        "parent": null,
        "max_model_len": MAX_MODEL_LEN,
    })];
    for a in pod.adapters() {
        data.push(json!({
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": a.path,
            "parent": pod.model,
            "max_model_len": MAX_MODEL_LEN,
        }));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub(crate) const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn metrics(State(pod): State<Arc<Pod>>) -> Response {
    let (knobs, _) = pod.metrics_inputs();
    if knobs.metrics_delay_ms > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(knobs.metrics_delay_ms / 1000.0)).await;
    }
    match knobs.metrics_fault {
        MetricsFault::None => {}
        MetricsFault::Error => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error").into_response();
        }
        MetricsFault::Garbage => {
            return (
                [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
                "\u{0}\u{1}not prometheus {{{ at all\nvllm:num_requests_running{ = =\n",
            )
                .into_response();
        }
        MetricsFault::Hang => {
            // Hold the request until the fault is lifted (or the server stops).
            while pod.knobs().metrics_fault == MetricsFault::Hang {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Read again: the state moved on during a delay or a hang.
    let (knobs, key) = pod.metrics_inputs();
    let text = exposition(&pod, &knobs, key);
    ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], text).into_response()
}

/// The pod's exposition for `key` (from [`Pod::metrics_inputs`]): the cached bytes while nothing it
/// shows changed, else a fresh render that replaces the cache. Cloning `Bytes` shares the buffer.
pub(crate) fn exposition(pod: &Pod, knobs: &PodKnobs, key: crate::metrics::CacheKey) -> Bytes {
    let mut cache = pod.metrics_cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = cache.as_ref()
        && c.key == key
    {
        return c.text.clone();
    }
    let text = Bytes::from(crate::metrics::render_with_lora(
        &pod.model,
        knobs,
        &key.stats,
        &pod.lora_info(),
    ));
    *cache = Some(crate::metrics::Cached {
        key,
        text: text.clone(),
    });
    text
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
        if let Some(role) = &p.role {
            out.push_str(&format!("      llm-d.ai/role: {role}\n"));
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

async fn admin_pods(State(fleet): State<Arc<Fleet>>) -> Response {
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

async fn admin_yaml(State(fleet): State<Arc<Fleet>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/yaml")],
        pods_yaml(&fleet.pods),
    )
        .into_response()
}

fn no_such_pod() -> Response {
    error_response(StatusCode::NOT_FOUND, "NotFoundError", "no such pod")
}

fn parse_patch(body: &[u8]) -> Result<KnobsPatch, String> {
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

async fn admin_get_knobs(State(fleet): State<Arc<Fleet>>, Path(idx): Path<usize>) -> Response {
    match fleet.pods.get(idx) {
        Some(pod) => axum::Json(pod.knobs()).into_response(),
        None => no_such_pod(),
    }
}

async fn admin_knobs(
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

async fn admin_all_knobs(State(fleet): State<Arc<Fleet>>, body: Bytes) -> Response {
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

async fn admin_crash(State(fleet): State<Arc<Fleet>>, Path(idx): Path<usize>) -> Response {
    match fleet.crash(idx).await {
        Ok(()) => axum::Json(json!({"pod": idx, "up": false})).into_response(),
        Err(_) => no_such_pod(),
    }
}

async fn admin_restart(State(fleet): State<Arc<Fleet>>, Path(idx): Path<usize>) -> Response {
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

async fn admin_reset(State(fleet): State<Arc<Fleet>>) -> Response {
    let dropped: usize = fleet.pods.iter().map(|p| p.reset_prefix_cache()).sum();
    axum::Json(json!({"dropped_blocks": dropped})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embedding(&[1, 2, 3], 16);
        assert_eq!(a, embedding(&[1, 2, 3], 16));
        assert_ne!(a, embedding(&[1, 2, 4], 16));
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4);
    }

    #[test]
    fn pd_leg_reads_transfer_params() {
        assert_eq!(pd_leg(None), PdLeg::None);
        assert_eq!(
            pd_leg(Some(&json!({"do_remote_decode": true}))),
            PdLeg::Prefill
        );
        assert_eq!(
            pd_leg(Some(
                &json!({"do_remote_prefill": true, "remote_block_ids": [1]})
            )),
            PdLeg::Decode
        );
    }
}

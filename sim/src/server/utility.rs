//! The utility endpoints: tokenize, detokenize, count tokens, render, embeddings, LoRA adapters,
//! models and metrics.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{self, LoraError, Pod};
use crate::knobs::{MetricsFault, PodKnobs};
use crate::tokenizer::{ChatMessage, Content, Prompt};

use super::job::*;
use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct DetokenizeRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    pub(super) tokens: Vec<u32>,
}

/// `POST /detokenize {model, tokens}` → `{prompt}` (see [`tokenizer::Vocab`] for what it can
/// recover).
pub(super) async fn detokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: DetokenizeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&pod, &format!("invalid request body: {e}")),
    };
    if let Err(msg) = resolve_model(&pod, req.model.as_deref()) {
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &msg);
    }
    let prompt = pod.tokenizer.detokenize(&req.tokens, &pod.vocab);
    axum::Json(json!({ "prompt": prompt })).into_response()
}

#[derive(Debug, Deserialize)]
pub(super) struct CountTokensRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub(super) system: Option<Content>,
}

/// `POST /v1/messages/count_tokens` (Anthropic): `{input_tokens}` of a Messages request.
pub(super) async fn count_tokens(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
    let n = match messages_tokens(&pod.tokenizer, req.system.as_ref(), msgs) {
        Ok(t) => t.len(),
        Err(e) => return bad(&e),
    };
    axum::Json(json!({ "input_tokens": n })).into_response()
}

#[derive(Debug, Deserialize)]
pub(super) struct EmbeddingRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    pub(super) input: Prompt,
    #[serde(default)]
    pub(super) encoding_format: Option<String>,
    #[serde(default)]
    pub(super) dimensions: Option<usize>,
}

/// Default embedding width.
pub(super) const EMBEDDING_DIM: usize = 32;

/// A deterministic unit vector for `tokens`.
pub(super) fn embedding(tokens: &[u32], dim: usize) -> Vec<f32> {
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

pub(super) fn base64(bytes: &[u8]) -> String {
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

pub(super) async fn embeddings(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
    let inputs = pod.tokenizer.prompt_list(&req.input);
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
        let mut run = match pod.admit_lora(tokens, 0, &knobs, lora.clone(), None).await {
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
pub(super) struct TokenizeRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) prompt: Option<String>,
    #[serde(default)]
    pub(super) messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub(super) return_token_strs: Option<bool>,
}

pub(super) async fn tokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
        (Some(p), None) => pod.tokenizer.text_strs(p),
        (None, Some(m)) => match pod.tokenizer.chat_strs(m) {
            Ok(t) => t,
            Err(e) => return bad_request(&pod, &e),
        },
        _ => return bad_request(&pod, "exactly one of `prompt` and `messages` is required"),
    };
    let mut out = json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN, "tokens": tokens});
    if req.return_token_strs.unwrap_or(false) {
        out["token_strs"] = json!(strs);
    }
    axum::Json(out).into_response()
}

pub(super) fn render_one(
    req: &GenRequest,
    pod: &Pod,
    tokens: Vec<u32>,
    n: usize,
    chat: bool,
) -> Value {
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

pub(super) async fn render_chat(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
    let tokens = match pod.tokenizer.chat(m) {
        Ok(t) => t,
        Err(e) => return bad_request(&pod, &e),
    };
    let n = pod.next_request_id() as usize;
    axum::Json(render_one(&req, &pod, tokens, n, true)).into_response()
}

pub(super) async fn render_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
    let out: Vec<Value> = pod
        .tokenizer
        .prompt_list(p)
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
pub(super) struct LoraRequest {
    pub(super) lora_name: String,
    #[serde(default)]
    pub(super) lora_path: Option<String>,
}

pub(super) fn lora_error(e: &LoraError) -> Response {
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

pub(super) async fn load_lora(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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

pub(super) async fn unload_lora(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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

pub(super) async fn models(State(pod): State<Arc<Pod>>) -> Response {
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

pub(super) async fn metrics(State(pod): State<Arc<Pod>>) -> Response {
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
}

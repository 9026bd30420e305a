//! The OpenAI Responses API (`/v1/responses`, `GET /v1/responses/{id}`): stored responses and
//! `previous_response_id` continuations.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;

use crate::engine::{self, Pod};
use crate::tokenizer::{ChatMessage, Content, ContentPart};

use super::generate::*;
use super::job::*;
use super::stream::*;
use super::*;

/// `POST /v1/responses` body: the fields the simulator acts on (others are accepted and ignored).
#[derive(Debug, Deserialize)]
pub(super) struct ResponsesRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
    #[serde(default)]
    pub(super) input: Option<Value>,
    #[serde(default)]
    pub(super) instructions: Option<String>,
    #[serde(default)]
    pub(super) max_output_tokens: Option<u32>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) store: Option<bool>,
    #[serde(default)]
    pub(super) background: Option<bool>,
    #[serde(default)]
    pub(super) previous_response_id: Option<String>,
    #[serde(default)]
    pub(super) kv_transfer_params: Option<Value>,
}

/// Chat content of a Responses item: a string, or parts whose `text` carries the tokens.
pub(super) fn item_content(v: Option<&Value>) -> Result<Option<Content>, String> {
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
pub(super) fn response_input(input: &Value) -> Result<Vec<ChatMessage>, String> {
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

/// `POST /v1/responses`: a chat-like generation with vLLM's per-process response store, so a
/// follow-up naming `previous_response_id` only works on the pod that answered the first turn.
pub(super) async fn responses(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
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
    let tokens = match pod.tokenizer.chat(&convo) {
        Ok(t) => t,
        Err(e) => return bad_request(&pod, &e),
    };
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
        salt: req.cache_salt.filter(|s| !s.is_empty()),
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
        stream_response(job, false, false)
    } else {
        full_response(job).await
    }
}

/// `GET /v1/responses/{id}`: a stored response of this pod.
pub(super) async fn get_response(State(pod): State<Arc<Pod>>, Path(id): Path<String>) -> Response {
    match pod.stored_response(&id) {
        Some(r) => axum::Json(r.body).into_response(),
        None => error_response(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("Response with id '{id}' not found."),
        ),
    }
}

//! `/v1/chat/completions`, `/v1/completions` and `/v1/messages`: parse into a job, then answer
//! whole (this module) or as a stream (`stream`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::engine::{self, Pod};

use super::job::*;
use super::stream::*;
use super::*;

pub(super) async fn chat(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Chat, body).await
}

pub(super) async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Completion, body).await
}

pub(super) async fn messages(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, Kind::Messages, body).await
}

pub(super) async fn generate(pod: Arc<Pod>, kind: Kind, body: Bytes) -> Response {
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
            Some(m) => match pod.tokenizer.chat(m) {
                Ok(t) => vec![t],
                Err(e) => return reject(&pod, &e),
            },
            None => return reject(&pod, "field `messages` is required"),
        },
        Kind::Messages => match &req.messages {
            Some(m) => match messages_tokens(&pod.tokenizer, req.system.as_ref(), m) {
                Ok(t) => vec![t],
                Err(e) => return reject(&pod, &e),
            },
            None => return reject(&pod, "field `messages` is required"),
        },
        Kind::Completion => match &req.prompt {
            Some(p) => pod.tokenizer.prompt_list(p),
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
        salt: req.cache_salt.filter(|s| !s.is_empty()),
        pd,
        responses: None,
    };
    let priority = req.priority;
    let mut res = if stream {
        let (include_usage, continuous) = req.stream_options.map_or((false, false), |o| {
            (
                o.include_usage.unwrap_or(true),
                o.continuous_usage_stats.unwrap_or(false),
            )
        });
        stream_response(job, include_usage, continuous)
    } else {
        full_response(job).await
    };
    if let Some(p) = priority {
        res.headers_mut()
            .insert(super::RECEIVED_PRIORITY_HEADER, p.into());
    }
    res
}

pub(super) async fn full_response(job: Job) -> Response {
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

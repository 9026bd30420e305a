//! A generation request as the engine sees it: the request fields the simulator acts on, the
//! job (prompts as tokens, output length, LoRA, P/D leg), prefill and its usage accounting.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{self, Adapter, Pod, Running};
use crate::knobs::PodKnobs;
use crate::tokenizer::{self, ChatMessage, Content, Prompt, Tokenizer};

#[derive(Debug, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: Option<bool>,
    /// vLLM's extension: cumulative usage on every chunk.
    #[serde(default)]
    pub(super) continuous_usage_stats: Option<bool>,
}

/// The fields of a generation request the simulator acts on; everything else is accepted and ignored.
#[derive(Debug, Deserialize)]
pub(super) struct GenRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub(super) prompt: Option<Prompt>,
    /// Anthropic's top-level system prompt.
    #[serde(default)]
    pub(super) system: Option<Content>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub(super) kv_transfer_params: Option<Value>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
    #[serde(default)]
    pub(super) priority: Option<i64>,
    #[serde(default)]
    pub(super) request_id: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    Chat,
    Completion,
    /// Anthropic `/v1/messages`.
    Messages,
}

/// Prefill/decode disaggregation leg, from `kv_transfer_params`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum PdLeg {
    None,
    /// `do_remote_decode: true`: prefill here, hand the KV to a decode pod.
    Prefill,
    /// `do_remote_prefill: true`: the KV was computed elsewhere; skip the prefill cost.
    Decode,
}

pub(super) fn pd_leg(params: Option<&Value>) -> PdLeg {
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

pub(super) struct Job {
    pub(super) pod: Arc<Pod>,
    pub(super) knobs: PodKnobs,
    pub(super) kind: Kind,
    /// One entry per prompt (completions accept a batch).
    pub(super) prompts: Vec<Vec<u32>>,
    pub(super) output_tokens: u32,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) seed: u64,
    pub(super) lora: Option<Adapter>,
    /// vLLM's `cache_salt`: the prompt's blocks are its own (first block's extra keys).
    pub(super) salt: Option<String>,
    pub(super) pd: PdLeg,
    /// Set for `/v1/responses` (whose prompt is tokenized like a chat).
    pub(super) responses: Option<Box<RespCtx>>,
}

/// The `/v1/responses` side of a job.
pub(super) struct RespCtx {
    /// The conversation this answer continues (the previous response's history, then this input),
    /// without the instructions.
    pub(super) history: Vec<ChatMessage>,
    pub(super) instructions: Option<String>,
    pub(super) max_output_tokens: Option<u32>,
    pub(super) previous_response_id: Option<String>,
    pub(super) store: bool,
    /// Id of the output message item.
    pub(super) msg_id: String,
}

/// Resolves `model` to the base model (`Ok(None)`) or a registered adapter, as vLLM does; anything
/// else is a 404.
pub(super) fn resolve_model(pod: &Pod, model: Option<&str>) -> Result<Option<Adapter>, String> {
    match model {
        None => Ok(None),
        Some(m) if m == pod.model || m.is_empty() => Ok(None),
        Some(m) => match pod.adapter(m) {
            Some(a) => Ok(Some(a)),
            None => Err(format!("The model `{m}` does not exist.")),
        },
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Prompt tokens of an Anthropic request: the system prompt, then the messages.
pub(super) fn messages_tokens(
    tokenizer: &Tokenizer,
    system: Option<&Content>,
    msgs: &[ChatMessage],
) -> Result<Vec<u32>, String> {
    let mut all = Vec::with_capacity(msgs.len() + 1);
    if let Some(s) = system {
        all.push(ChatMessage {
            role: "system".into(),
            content: Some(s.clone()),
        });
    }
    all.extend(msgs.iter().cloned());
    tokenizer.chat(&all)
}

/// Sum over a job's prompts: (prompt tokens, cached tokens).
pub(super) fn usage(job: &Job, prompt: usize, cached: usize) -> Value {
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
pub(super) fn anthropic_usage(prompt: usize, cached: usize, output: u32) -> Value {
    json!({
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
}

pub(super) fn token_text(job: &Job, prompt: usize, i: u32) -> String {
    let w = tokenizer::output_word(job.seed ^ prompt as u64, i);
    if i == 0 {
        w.to_owned()
    } else {
        format!(" {w}")
    }
}

pub(super) fn finish_reason(job: &Job) -> &'static str {
    match (job.kind, job.pd) {
        (_, PdLeg::Prefill) => "remote_decode",
        (Kind::Messages, _) => "max_tokens",
        _ => "length",
    }
}

/// The `kv_transfer_params` a prefill leg returns for the decode pod.
pub(super) fn transfer_params(job: &Job, run: &Running) -> Value {
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

/// Admits `tokens`, computes the prompt (its KV transferred on a P/D decode leg; plus the adapter
/// swap-in when needed) and caches it.
pub(super) async fn prefill(job: &Job, tokens: &[u32]) -> Result<Running, engine::EngineClosed> {
    let mut run = job
        .pod
        .admit_lora(
            tokens,
            job.output_tokens,
            &job.knobs,
            job.lora.clone(),
            job.salt.clone(),
        )
        .await?;
    run.compute_prompt(&job.knobs, job.pd == PdLeg::Decode)
        .await?;
    run.prefilled();
    Ok(run)
}

/// One prompt served without streaming: (text, prompt tokens, cached tokens, transfer params).
pub(super) async fn run_prompt(
    job: &Job,
    idx: usize,
) -> Result<(String, usize, usize, Option<Value>), engine::EngineClosed> {
    let tokens = &job.prompts[idx];
    let mut run = prefill(job, tokens).await?;
    run.decode_rest(&job.knobs).await?;
    let cached = run.cached_tokens();
    let params = (job.pd == PdLeg::Prefill).then(|| transfer_params(job, &run));
    run.finish(job.output_tokens);
    let text: String = (0..job.output_tokens)
        .map(|i| token_text(job, idx, i))
        .collect();
    Ok((text, tokens.len(), cached, params))
}

/// `status` of a finished response: the simulator always writes the whole budget, so an explicit
/// `max_output_tokens` is what stopped it (`incomplete`), while without one it simply ended.
pub(super) fn final_status(job: &Job) -> &'static str {
    match &job.responses {
        Some(c) if c.max_output_tokens.is_some() => "incomplete",
        _ => "completed",
    }
}

pub(super) fn responses_usage(prompt: usize, cached: usize, output: u32) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt as u64 + u64::from(output),
    })
}

/// The Responses API object of `job` in `status`, with its output text once there is one.
pub(super) fn response_object(
    job: &Job,
    status: &str,
    text: Option<&str>,
    usage: Option<Value>,
) -> Value {
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
pub(super) fn remember_response(job: &Job, text: &str, body: &Value) {
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

#[cfg(test)]
mod tests {
    use super::*;

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

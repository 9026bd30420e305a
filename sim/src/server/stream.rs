//! Streaming answers: OpenAI chat/completion chunks and Anthropic message events over SSE,
//! token by token as the engine decodes.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::engine::{self, Running};

use super::job::*;

pub(super) enum Step {
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

pub(super) struct StreamState {
    pub(super) job: Job,
    pub(super) include_usage: bool,
    /// `stream_options.continuous_usage_stats`: cumulative usage on every chunk.
    pub(super) continuous_usage: bool,
    /// Output tokens generated so far.
    pub(super) generated: u64,
    /// Text of tokens generated but not yet sent (`stream_interval` > 1).
    pub(super) pending: String,
    pub(super) step: Step,
    pub(super) run: Option<Running>,
    pub(super) prompt_tokens: usize,
    pub(super) cached: usize,
    /// When the first token went out; token i is due at `first_token + i * inter_token`, so timer
    /// rounding does not accumulate over a long output.
    pub(super) first_token: tokio::time::Instant,
    /// `/v1/responses`: the next event's `sequence_number` and the text so far.
    pub(super) seq: u64,
    pub(super) text: String,
}

pub(super) fn sse_event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

impl StreamState {
    fn chunk(&self, choices: Value) -> String {
        let object = match self.job.kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        let mut v = json!({
            "id": self.job.id,
            "object": object,
            "created": self.job.created,
            "model": self.job.model,
            "choices": choices,
        });
        if self.continuous_usage {
            let prompt = self.prompt_tokens as u64;
            v["usage"] = json!({
                "prompt_tokens": prompt,
                "completion_tokens": self.generated,
                "total_tokens": prompt + self.generated,
                "prompt_tokens_details": { "cached_tokens": self.cached },
            });
        }
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
            // A chunk every `stream_interval` tokens, and with a prompt's last token.
            self.generated += 1;
            self.pending.push_str(&text);
            let interval = u64::from(self.job.knobs.stream_interval.max(1));
            if !self.generated.is_multiple_of(interval) && i + 1 < self.job.output_tokens {
                return String::new();
            }
            let text = std::mem::take(&mut self.pending);
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
                if let Some(run) = self.run.as_mut()
                    && let Err(e) = run.token(due).await
                {
                    return Some(self.error_event(&e.to_string()));
                }
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

pub(super) fn stream_response(job: Job, include_usage: bool, continuous_usage: bool) -> Response {
    let step = if job.responses.is_some() {
        Step::Begin
    } else {
        Step::Start(0)
    };
    let state = StreamState {
        job,
        include_usage,
        continuous_usage,
        generated: 0,
        pending: String::new(),
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
        loop {
            // A token held back for the next chunk (`stream_interval`) makes an empty piece.
            let piece = st.advance().await?;
            if !piece.is_empty() {
                return Some((Ok::<_, Infallible>(Bytes::from(piece)), st));
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

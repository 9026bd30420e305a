//! Request-body parsers, chosen by request path (llm-d's `openai-parser`, `anthropic-parser`,
//! `vllmhttp-parser`; `passthrough-parser` only when configured).
//!
//! A parser validates the body's shape and extracts what routing needs (model, streaming). It does
//! not re-serialise the body: the bytes Envoy sent are the bytes forwarded.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    ChatCompletions,
    Completions,
    Embeddings,
    AnthropicMessages,
    /// `/v1/messages/count_tokens`: routed like a message, generates nothing.
    AnthropicCountTokens,
    /// The OpenAI Responses API (`/v1/responses`).
    Responses,
    VllmGenerate,
    /// Any other path, only when `passthrough-parser` is configured.
    Passthrough,
}

impl ApiKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::ChatCompletions => "chat-completions",
            ApiKind::Completions => "completions",
            ApiKind::Embeddings => "embeddings",
            ApiKind::AnthropicMessages => "anthropic-messages",
            ApiKind::AnthropicCountTokens => "anthropic-count-tokens",
            ApiKind::Responses => "responses",
            ApiKind::VllmGenerate => "vllm-generate",
            ApiKind::Passthrough => "passthrough",
        }
    }
}

/// Which parser handles `path` (query string ignored). `None`: no parser claims it.
pub fn kind_for_path(path: &str, passthrough: bool) -> Option<ApiKind> {
    let path = path.split('?').next().unwrap_or("");
    let path = path.trim_end_matches('/');
    let kind = match path {
        "/v1/chat/completions" | "/chat/completions" => ApiKind::ChatCompletions,
        "/v1/completions" | "/completions" => ApiKind::Completions,
        "/v1/embeddings" | "/embeddings" => ApiKind::Embeddings,
        "/v1/messages" => ApiKind::AnthropicMessages,
        "/v1/messages/count_tokens" => ApiKind::AnthropicCountTokens,
        "/v1/responses" | "/responses" => ApiKind::Responses,
        "/inference/v1/generate" | "/generate" => ApiKind::VllmGenerate,
        _ if passthrough => ApiKind::Passthrough,
        _ => return None,
    };
    Some(kind)
}

/// The prompt as the prefix index sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Prompt {
    #[default]
    None,
    /// The serialized prompt text (chat: tools JSON, then each message's role and text).
    Text(Vec<u8>),
    /// A pre-tokenized prompt.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Estimated prompt tokens: the text's 4-byte pseudo-tokens, or the token ids.
    pub fn estimated_tokens(&self) -> u64 {
        let n = match self {
            Prompt::Text(t) => index::hashing::estimate_token_count(t.len()),
            Prompt::Tokens(t) => t.len(),
            Prompt::None => 0,
        };
        n as u64
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    /// `model` from the body; empty when absent (vLLM allows that).
    pub model: String,
    pub stream: bool,
    pub prompt: Prompt,
    /// vLLM's `cache_salt` (salts the prefix-cache hashes).
    pub cache_salt: Option<String>,
    /// A streaming OpenAI request's `stream_options` as the client sent them (`None` for other
    /// requests): what [`ParsedRequest::usage_edit`] must add for the response to report usage.
    pub stream_options: Option<StreamOptions>,
    /// The most output tokens the request asks for (`max_completion_tokens`, else `max_tokens`;
    /// 0 for embeddings, which generate nothing).
    pub max_output: Option<u64>,
    /// Hashes of the prompt's media parts — images, audio, video ([`media_hashes`]) — each once,
    /// in order; empty for a text-only prompt.
    pub media: Vec<u64>,
    /// A Responses-API follow-up's `previous_response_id`: the conversation's state lives on the
    /// pod that stored that response.
    pub previous_response_id: Option<String>,
}

/// A streaming OpenAI request's `stream_options`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOptions {
    /// No `stream_options` key.
    Absent,
    /// `"stream_options": null`, or not an object.
    Null,
    /// An object, with `include_usage` and `continuous_usage_stats` set to `true` or not.
    Present {
        include_usage: bool,
        continuous: bool,
    },
}

/// How to turn on usage reporting (`stream_options.include_usage`, and
/// `continuous_usage_stats` when asked) in a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageEdit {
    /// No `stream_options` key: append one before the closing brace (no re-serialization).
    Append { continuous: bool },
    /// `stream_options` is null or lacks what is wanted: re-serialize with it set.
    Rewrite { continuous: bool },
}

impl ParsedRequest {
    /// The edit that makes the response report usage — at its end, and on every chunk when
    /// `continuous` (vLLM's, SGLang's and TRT-LLM's `continuous_usage_stats`: a stream the client
    /// cuts is then billed exactly what was generated) — or `None` when the client asked already
    /// or the request does not stream OpenAI chunks.
    pub fn usage_edit(&self, continuous: bool) -> Option<UsageEdit> {
        match self.stream_options? {
            StreamOptions::Absent => Some(UsageEdit::Append { continuous }),
            StreamOptions::Null => Some(UsageEdit::Rewrite { continuous }),
            StreamOptions::Present {
                include_usage,
                continuous: has,
            } => (!include_usage || (continuous && !has))
                .then_some(UsageEdit::Rewrite { continuous }),
        }
    }
}

/// The JSON body with its `model` set to `model`; `None` if it is not a JSON object.
pub fn with_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), Value::String(model.to_string()));
    serde_json::to_vec(&v).ok()
}

/// The body with a top-level `priority` that vLLM's priority scheduling orders the way flow
/// control does: vLLM serves lower values first, llm-d's priorities are higher-first, so the
/// field is the request's priority negated (`None` if the body is not a JSON object).
pub fn with_priority(body: &[u8], priority: i32) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("priority".into(), Value::from(-i64::from(priority)));
    serde_json::to_vec(&v).ok()
}

/// The body with its output maximum set to `n` (the Responses API's `max_output_tokens`, else
/// the field the client used, else `max_tokens`); `None` if it is not a JSON object.
pub fn with_max_output(kind: ApiKind, body: &[u8], n: u64) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object_mut()?;
    let field = if kind == ApiKind::Responses {
        "max_output_tokens"
    } else if obj.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    obj.insert(field.into(), Value::from(n));
    serde_json::to_vec(&v).ok()
}

/// The body with `stream_options.include_usage: true` (and `continuous_usage_stats: true` when
/// the edit asks it); `None` if it cannot be edited safely.
pub fn with_usage_reporting(body: &[u8], edit: UsageEdit) -> Option<Vec<u8>> {
    match edit {
        UsageEdit::Append { continuous } => {
            let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
            if body[end] != b'}' {
                return None;
            }
            let field: &[u8] = if continuous {
                br#","stream_options":{"include_usage":true,"continuous_usage_stats":true}"#
            } else {
                br#","stream_options":{"include_usage":true}"#
            };
            let mut out = Vec::with_capacity(body.len() + field.len());
            out.extend_from_slice(&body[..end]);
            out.extend_from_slice(field);
            out.extend_from_slice(&body[end..]);
            Some(out)
        }
        UsageEdit::Rewrite { continuous } => {
            let mut v: Value = serde_json::from_slice(body).ok()?;
            let obj = v.as_object_mut()?;
            let opts = obj
                .entry("stream_options")
                .or_insert_with(|| Value::Object(serde_json::Map::new()));
            if !opts.is_object() {
                *opts = Value::Object(serde_json::Map::new());
            }
            let opts = opts.as_object_mut()?;
            opts.insert("include_usage".into(), Value::Bool(true));
            if continuous {
                opts.insert("continuous_usage_stats".into(), Value::Bool(true));
            }
            serde_json::to_vec(&v).ok()
        }
    }
}

/// Append the text of a chat `content` (a string, or an array of parts) to `out`.
fn push_content(out: &mut Vec<u8>, content: Option<&Value>) {
    match content {
        Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
        Some(Value::Array(parts)) => {
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(t) => out.extend_from_slice(t.as_bytes()),
                    // Non-text parts (images, audio, tool calls): their JSON stands in for them,
                    // so identical assets hash identically.
                    None => out.extend_from_slice(part.to_string().as_bytes()),
                }
            }
        }
        Some(Value::Null) | None => {}
        Some(other) => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

/// Serialize a chat conversation: tools first, then role and content of each message, so a later
/// turn's serialization extends an earlier turn's.
fn chat_prompt(obj: &serde_json::Map<String, Value>, system: Option<&Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    if let Some(tools) = obj.get("tools") {
        out.extend_from_slice(tools.to_string().as_bytes());
    }
    if let Some(sys) = system {
        out.extend_from_slice(b"system");
        push_content(&mut out, Some(sys));
    }
    if let Some(Value::Array(messages)) = obj.get("messages") {
        for m in messages {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                out.extend_from_slice(role.as_bytes());
            }
            push_content(&mut out, m.get("content"));
        }
    }
    out
}

/// Serialize a Responses request like a chat: tools, the instructions as the system turn, then
/// each input item — a message's role and content, any other item (function calls and their
/// outputs, reasoning) as its JSON. A string input is one user message.
fn responses_prompt(obj: &serde_json::Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    if let Some(tools) = obj.get("tools") {
        out.extend_from_slice(tools.to_string().as_bytes());
    }
    if let Some(Value::String(i)) = obj.get("instructions") {
        out.extend_from_slice(b"system");
        out.extend_from_slice(i.as_bytes());
    }
    match obj.get("input") {
        Some(Value::String(t)) => {
            out.extend_from_slice(b"user");
            out.extend_from_slice(t.as_bytes());
        }
        Some(Value::Array(items)) => {
            for item in items {
                match item.get("role").and_then(Value::as_str) {
                    Some(role) => {
                        out.extend_from_slice(role.as_bytes());
                        push_content(&mut out, item.get("content"));
                    }
                    None => out.extend_from_slice(item.to_string().as_bytes()),
                }
            }
        }
        _ => {}
    }
    out
}

/// A completions/embeddings prompt: a string, a list of strings (the first is used), token ids or a
/// list of token-id lists (the first is used).
fn text_or_tokens(v: Option<&Value>) -> Prompt {
    match v {
        Some(Value::String(s)) => Prompt::Text(s.as_bytes().to_vec()),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(s)) => Prompt::Text(s.as_bytes().to_vec()),
            Some(Value::Number(_)) => Prompt::Tokens(token_ids(items)),
            Some(Value::Array(inner)) => Prompt::Tokens(token_ids(inner)),
            _ => Prompt::None,
        },
        _ => Prompt::None,
    }
}

fn token_ids(items: &[Value]) -> Vec<u32> {
    items
        .iter()
        .filter_map(Value::as_u64)
        .map(|t| t.min(u64::from(u32::MAX)) as u32)
        .collect()
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ParseError {
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    #[error("request body must be a JSON object")]
    NotObject,
    #[error("field `{field}`: {message}")]
    Field {
        field: &'static str,
        message: &'static str,
    },
}

/// The longest model name a request may carry: it becomes a metric label, a rewrite rule's key,
/// and in tenant mode a key in replicated quota state. Model ids (`org/name`, LoRA adapter
/// names) are far shorter.
pub const MAX_MODEL_NAME_BYTES: usize = 256;
const MODEL_TOO_LONG: &str = "longer than 256 bytes";

fn field_err(field: &'static str, message: &'static str) -> ParseError {
    ParseError::Field { field, message }
}

/// Parse and validate a request body for `kind`.
pub fn parse(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, ParseError> {
    if kind == ApiKind::Passthrough {
        // Passthrough still reads `model` when the body happens to be a JSON object.
        let model = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v.get("model").and_then(Value::as_str).map(String::from))
            .unwrap_or_default();
        if model.len() > MAX_MODEL_NAME_BYTES {
            return Err(field_err("model", MODEL_TOO_LONG));
        }
        return Ok(ParsedRequest {
            kind,
            model,
            stream: false,
            prompt: Prompt::None,
            cache_salt: None,
            stream_options: None,
            max_output: None,
            media: Vec::new(),
            previous_response_id: None,
        });
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let obj = v.as_object().ok_or(ParseError::NotObject)?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) if s.len() > MAX_MODEL_NAME_BYTES => {
            return Err(field_err("model", MODEL_TOO_LONG));
        }
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(field_err("model", "must be a string")),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(field_err("stream", "must be a boolean")),
    };
    match kind {
        ApiKind::ChatCompletions => match obj.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => {
                if m.iter().any(|x| !x.is_object()) {
                    return Err(field_err("messages", "every message must be an object"));
                }
            }
            Some(Value::Array(_)) => return Err(field_err("messages", "must not be empty")),
            Some(_) => return Err(field_err("messages", "must be an array")),
            None => return Err(field_err("messages", "is required")),
        },
        ApiKind::Completions => match obj.get("prompt") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(_) => {
                return Err(field_err(
                    "prompt",
                    "must be a string, a list of strings or token ids",
                ));
            }
            None => return Err(field_err("prompt", "is required")),
        },
        ApiKind::Embeddings => match obj.get("input") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(_) => return Err(field_err("input", "must be a string or a list")),
            None => return Err(field_err("input", "is required")),
        },
        ApiKind::AnthropicMessages => {
            match obj.get("messages") {
                Some(Value::Array(_)) => {}
                Some(_) => return Err(field_err("messages", "must be an array")),
                None => return Err(field_err("messages", "is required")),
            }
            match obj.get("max_tokens") {
                Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n > 0) => {}
                Some(_) => return Err(field_err("max_tokens", "must be a positive integer")),
                None => return Err(field_err("max_tokens", "is required")),
            }
        }
        ApiKind::AnthropicCountTokens => match obj.get("messages") {
            Some(Value::Array(_)) => {}
            Some(_) => return Err(field_err("messages", "must be an array")),
            None => return Err(field_err("messages", "is required")),
        },
        ApiKind::Responses => {
            match obj.get("input") {
                Some(Value::String(_)) => {}
                Some(Value::Array(items)) if items.iter().all(Value::is_object) => {}
                Some(Value::Array(_)) => {
                    return Err(field_err("input", "every item must be an object"));
                }
                Some(_) => return Err(field_err("input", "must be a string or a list of items")),
                // A continuation may carry only its previous response.
                None if obj
                    .get("previous_response_id")
                    .is_some_and(Value::is_string) => {}
                None => return Err(field_err("input", "is required")),
            }
            for (f, what) in [
                ("instructions", "must be a string"),
                ("previous_response_id", "must be a string"),
            ] {
                if obj.get(f).is_some_and(|v| !v.is_string() && !v.is_null()) {
                    return Err(field_err(f, what));
                }
            }
            if obj
                .get("max_output_tokens")
                .is_some_and(|v| !v.is_null() && v.as_u64().is_none_or(|n| n == 0))
            {
                return Err(field_err("max_output_tokens", "must be a positive integer"));
            }
        }
        ApiKind::VllmGenerate => match obj.get("token_ids") {
            Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => {}
            Some(_) => return Err(field_err("token_ids", "must be a list of token ids")),
            None => return Err(field_err("token_ids", "is required")),
        },
        ApiKind::Passthrough => {}
    }
    let prompt = match kind {
        ApiKind::ChatCompletions => Prompt::Text(chat_prompt(obj, None)),
        ApiKind::AnthropicMessages | ApiKind::AnthropicCountTokens => {
            Prompt::Text(chat_prompt(obj, obj.get("system")))
        }
        ApiKind::Responses => Prompt::Text(responses_prompt(obj)),
        ApiKind::Completions => text_or_tokens(obj.get("prompt")),
        ApiKind::Embeddings => text_or_tokens(obj.get("input")),
        ApiKind::VllmGenerate => match obj.get("token_ids") {
            Some(Value::Array(ids)) => Prompt::Tokens(token_ids(ids)),
            _ => Prompt::None,
        },
        ApiKind::Passthrough => Prompt::None,
    };
    let cache_salt = obj
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(String::from);
    let stream_options = match (kind, stream, obj.get("stream_options")) {
        (ApiKind::ChatCompletions | ApiKind::Completions, true, opts) => Some(match opts {
            None => StreamOptions::Absent,
            Some(Value::Object(o)) => {
                let on = |k: &str| o.get(k) == Some(&Value::Bool(true));
                StreamOptions::Present {
                    include_usage: on("include_usage"),
                    continuous: on("continuous_usage_stats"),
                }
            }
            // `"stream_options": null` would be duplicated by appending: rewrite instead.
            Some(_) => StreamOptions::Null,
        }),
        _ => None,
    };
    let max_output = match kind {
        ApiKind::Embeddings | ApiKind::AnthropicCountTokens => Some(0),
        ApiKind::Responses => obj.get("max_output_tokens").and_then(Value::as_u64),
        _ => ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|f| obj.get(*f).and_then(Value::as_u64)),
    };
    let media = match kind {
        ApiKind::ChatCompletions | ApiKind::AnthropicMessages | ApiKind::AnthropicCountTokens => {
            media_hashes(obj.get("messages"))
        }
        ApiKind::Responses => media_hashes(obj.get("input")),
        _ => Vec::new(),
    };
    let previous_response_id = match kind {
        ApiKind::Responses => obj
            .get("previous_response_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .map(String::from),
        _ => None,
    };
    Ok(ParsedRequest {
        kind,
        model,
        stream,
        prompt,
        cache_salt,
        stream_options,
        max_output,
        media,
        previous_response_id,
    })
}

/// Content parts that are media (what llm-d's `always-disagg-multimodal-decider` reacts to):
/// OpenAI chat `image_url`, `video_url`, `input_audio`, `audio_url`; Anthropic `image` (also
/// inside a `tool_result`); Responses `input_image`, `input_audio`.
const MEDIA_PARTS: [&str; 6] = [
    "image_url",
    "video_url",
    "input_audio",
    "audio_url",
    "image",
    "input_image",
];

/// Most media parts hashed per request.
const MAX_MEDIA: usize = 256;

/// The media content parts of `messages` (or Responses items), hashed, each distinct asset once:
/// the hash of the asset itself — the part's value under its type (`image_url`, …), or an
/// Anthropic image's `source` — so the same image sent again hashes the same.
fn media_hashes(messages: Option<&Value>) -> Vec<u64> {
    fn collect(content: Option<&Value>, nested: bool, out: &mut Vec<u64>) {
        let Some(Value::Array(parts)) = content else {
            return;
        };
        for p in parts {
            match p.get("type").and_then(Value::as_str) {
                Some(t) if MEDIA_PARTS.contains(&t) => {
                    let asset = p.get(t).or_else(|| p.get("source")).unwrap_or(p);
                    let h = xxhash_rust::xxh3::xxh3_64(asset.to_string().as_bytes());
                    if !out.contains(&h) && out.len() < MAX_MEDIA {
                        out.push(h);
                    }
                }
                _ if !nested => collect(p.get("content"), true, out),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    if let Some(Value::Array(items)) = messages {
        for m in items {
            collect(m.get("content"), false, &mut out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_parts_make_a_request_multimodal() {
        let mm = |kind, body: &str| !parse(kind, body.as_bytes()).unwrap().media.is_empty();
        let chat = |part: &str| {
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"x"}},{part}]}}]}}"#
            )
        };
        for part in [
            r#"{"type":"image_url","image_url":{"url":"http://i/1.png"}}"#,
            r#"{"type":"input_audio","input_audio":{"data":"AAA","format":"wav"}}"#,
            r#"{"type":"video_url","video_url":{"url":"http://v/1.mp4"}}"#,
        ] {
            assert!(mm(ApiKind::ChatCompletions, &chat(part)), "{part}");
        }
        assert!(!mm(
            ApiKind::ChatCompletions,
            &chat(r#"{"type":"text","text":"y"}"#)
        ));
        assert!(!mm(
            ApiKind::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"image_url"}]}"#
        ));
        // Anthropic: an image block, or one inside a tool result.
        let image =
            r#"{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA"}}"#;
        assert!(mm(
            ApiKind::AnthropicMessages,
            &format!(r#"{{"max_tokens":5,"messages":[{{"role":"user","content":[{image}]}}]}}"#)
        ));
        assert!(mm(
            ApiKind::AnthropicMessages,
            &format!(
                r#"{{"max_tokens":5,"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":[{image}]}}]}}]}}"#
            )
        ));
        // Responses: an input_image part.
        assert!(mm(
            ApiKind::Responses,
            r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"http://i/2.png"}]}]}"#
        ));
        assert!(!mm(ApiKind::Responses, r#"{"input":"describe an image"}"#));
        assert!(!mm(ApiKind::Completions, r#"{"prompt":"image_url"}"#));
        // One hash per distinct asset, the same whatever surrounds it.
        let media = |body: &str| {
            parse(ApiKind::ChatCompletions, body.as_bytes())
                .unwrap()
                .media
        };
        let img = |u: &str| format!(r#"{{"type":"image_url","image_url":{{"url":"{u}"}}}}"#);
        let two = media(&format!(
            r#"{{"messages":[{{"role":"user","content":[{},{}]}},{{"role":"user","content":[{}]}}]}}"#,
            img("a"),
            img("b"),
            img("a")
        ));
        assert_eq!(two.len(), 2);
        let again = media(&format!(
            r#"{{"messages":[{{"role":"system","content":"s"}},{{"role":"user","content":[{{"type":"text","text":"t"}},{}]}}]}}"#,
            img("b")
        ));
        assert_eq!(again, vec![two[1]]);
    }

    #[test]
    fn paths() {
        assert_eq!(
            kind_for_path("/v1/chat/completions?x=1", false),
            Some(ApiKind::ChatCompletions)
        );
        assert_eq!(
            kind_for_path("/v1/messages", false),
            Some(ApiKind::AnthropicMessages)
        );
        assert_eq!(kind_for_path("/v1/nope", false), None);
        assert_eq!(kind_for_path("/v1/nope", true), Some(ApiKind::Passthrough));
    }

    #[test]
    fn output_maxima_are_read_and_rewritten_in_the_field_the_client_used() {
        let p = |kind, b: &str| parse(kind, b.as_bytes()).unwrap().max_output;
        let chat = r#"{"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(p(ApiKind::ChatCompletions, chat), None);
        let both = r#"{"max_completion_tokens":7,"max_tokens":9,"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(p(ApiKind::ChatCompletions, both), Some(7));
        assert_eq!(
            p(ApiKind::Completions, r#"{"prompt":"x","max_tokens":3}"#),
            Some(3)
        );
        assert_eq!(p(ApiKind::Embeddings, r#"{"input":"x"}"#), Some(0));
        let edited: Value = serde_json::from_slice(
            &with_max_output(ApiKind::ChatCompletions, both.as_bytes(), 4).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (
                edited["max_completion_tokens"].as_u64(),
                edited["max_tokens"].as_u64()
            ),
            (Some(4), Some(9))
        );
        let edited: Value = serde_json::from_slice(
            &with_max_output(ApiKind::ChatCompletions, chat.as_bytes(), 5).unwrap(),
        )
        .unwrap();
        assert_eq!(edited["max_tokens"], 5);
        assert!(with_max_output(ApiKind::ChatCompletions, b"[1]", 5).is_none());
        let resp = r#"{"input":"x","max_output_tokens":300}"#;
        assert_eq!(p(ApiKind::Responses, resp), Some(300));
        let edited: Value = serde_json::from_slice(
            &with_max_output(ApiKind::Responses, resp.as_bytes(), 64).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (
                edited["max_output_tokens"].as_u64(),
                edited.get("max_tokens")
            ),
            (Some(64), None)
        );
        assert_eq!(
            p(ApiKind::AnthropicCountTokens, r#"{"messages":[]}"#),
            Some(0),
            "count_tokens generates nothing"
        );
    }

    #[test]
    fn responses_requests_parse_like_a_chat() {
        assert_eq!(
            kind_for_path("/v1/responses", false),
            Some(ApiKind::Responses)
        );
        assert_eq!(
            kind_for_path("/v1/messages/count_tokens", false),
            Some(ApiKind::AnthropicCountTokens)
        );
        let p = |b: &str| parse(ApiKind::Responses, b.as_bytes());
        let text = |b: &str| match p(b).unwrap().prompt {
            Prompt::Text(t) => String::from_utf8(t).unwrap(),
            other => panic!("{other:?}"),
        };
        // A string input is one user turn; instructions are the system turn.
        assert_eq!(
            text(r#"{"model":"m","instructions":"be brief","input":"hi"}"#),
            "systembe briefuserhi"
        );
        // Items: messages by role and content (string or parts), other items as their JSON; a
        // later turn's serialization extends an earlier one's.
        let first = r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}]}"#;
        let later = r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call_output","call_id":"c","output":"42"},{"role":"user","content":"more"}],"stream":true}"#;
        assert!(text(later).starts_with(&text(first)), "{}", text(later));
        assert!(text(later).contains("function_call_output"));
        let r = p(later).unwrap();
        assert!(r.stream);
        assert_eq!(
            r.stream_options, None,
            "Responses streams report usage themselves"
        );
        // A continuation may carry only its previous response.
        assert!(p(r#"{"previous_response_id":"resp_1"}"#).is_ok());
        for (bad, field) in [
            (r#"{}"#, "input"),
            (r#"{"input":7}"#, "input"),
            (r#"{"input":["x"]}"#, "input"),
            (r#"{"input":"x","instructions":3}"#, "instructions"),
            (
                r#"{"input":"x","max_output_tokens":0}"#,
                "max_output_tokens",
            ),
            (
                r#"{"input":"x","previous_response_id":false}"#,
                "previous_response_id",
            ),
        ] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains(field), "{bad}: {e}");
        }
        let c = parse(
            ApiKind::AnthropicCountTokens,
            br#"{"model":"m","system":"s","messages":[{"role":"user","content":"q"}]}"#,
        )
        .unwrap();
        assert_eq!(c.prompt, Prompt::Text(b"systemsuserq".to_vec()));
        assert!(parse(ApiKind::AnthropicCountTokens, br#"{"model":"m"}"#).is_err());
        // Model names are bounded (metric labels, rewrite keys, replicated quota keys).
        for kind in [ApiKind::Completions, ApiKind::Passthrough] {
            let body = |n: usize| format!(r#"{{"model":"{}","prompt":"p"}}"#, "m".repeat(n));
            assert!(parse(kind, body(MAX_MODEL_NAME_BYTES).as_bytes()).is_ok());
            let err = parse(kind, body(MAX_MODEL_NAME_BYTES + 1).as_bytes()).unwrap_err();
            assert_eq!(err.to_string(), "field `model`: longer than 256 bytes");
        }
    }

    #[test]
    fn usage_reporting_is_added_to_streaming_openai_requests_only() {
        let p = |body: &str| parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap();
        let opts = |body: &[u8]| {
            let v: Value = serde_json::from_slice(body).unwrap();
            v["stream_options"].clone()
        };
        let plain = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}  "#;
        let edit = p(plain).usage_edit(false).unwrap();
        assert_eq!(edit, UsageEdit::Append { continuous: false });
        let out = with_usage_reporting(plain.as_bytes(), edit).unwrap();
        assert_eq!(opts(&out), serde_json::json!({"include_usage": true}));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["messages"][0]["content"], "hi");
        let edit = p(plain).usage_edit(true).unwrap();
        let out = with_usage_reporting(plain.as_bytes(), edit).unwrap();
        assert_eq!(
            opts(&out),
            serde_json::json!({"include_usage": true, "continuous_usage_stats": true})
        );
        // The client's other options stay; what it turned off is turned on.
        let other = r#"{"stream":true,"stream_options":{"continuous_usage_stats":true,"x":1},"messages":[{"role":"user","content":"x"}]}"#;
        let edit = p(other).usage_edit(true).unwrap();
        assert_eq!(edit, UsageEdit::Rewrite { continuous: true });
        let out = with_usage_reporting(other.as_bytes(), edit).unwrap();
        assert_eq!(
            opts(&out),
            serde_json::json!({"include_usage": true, "continuous_usage_stats": true, "x": 1})
        );
        let off = r#"{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false},"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(p(off).usage_edit(false), None);
        let edit = p(off).usage_edit(true).unwrap();
        let out = with_usage_reporting(off.as_bytes(), edit).unwrap();
        assert_eq!(opts(&out)["continuous_usage_stats"], Value::Bool(true));
        // `null` options are replaced (appending would make a duplicate key).
        let null =
            r#"{"stream":true,"stream_options":null,"messages":[{"role":"user","content":"x"}]}"#;
        let edit = p(null).usage_edit(false).unwrap();
        assert_eq!(edit, UsageEdit::Rewrite { continuous: false });
        let out = with_usage_reporting(null.as_bytes(), edit).unwrap();
        assert_eq!(opts(&out), serde_json::json!({"include_usage": true}));
        // Already asked, not streaming, other APIs: untouched.
        let asked = r#"{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(p(asked).usage_edit(true), None);
        assert_eq!(
            p(r#"{"stream":false,"messages":[{"role":"user","content":"x"}]}"#).usage_edit(true),
            None
        );
        let a = parse(
            ApiKind::AnthropicMessages,
            br#"{"stream":true,"max_tokens":5,"messages":[]}"#,
        )
        .unwrap();
        assert_eq!(a.usage_edit(true), None);
    }

    #[test]
    fn chat_ok_and_errors() {
        let p = parse(
            ApiKind::ChatCompletions,
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(p.model, "m");
        assert!(p.stream);
        assert!(matches!(
            parse(ApiKind::ChatCompletions, b"{not json"),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            parse(ApiKind::ChatCompletions, b"[1]"),
            Err(ParseError::NotObject)
        );
        assert!(parse(ApiKind::ChatCompletions, br#"{"model":"m"}"#).is_err());
        assert!(parse(ApiKind::ChatCompletions, br#"{"model":1,"messages":[{}]}"#).is_err());
    }

    #[test]
    fn chat_prompt_extends_across_turns() {
        let t1 = parse(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        let t2 = parse(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#,
        )
        .unwrap();
        let (Prompt::Text(a), Prompt::Text(b)) = (&t1.prompt, &t2.prompt) else {
            panic!("text prompts expected");
        };
        assert_eq!(a.as_slice(), b"systemSuserhi");
        assert!(b.starts_with(a));
    }

    #[test]
    fn prompts_of_other_kinds() {
        let p = parse(
            ApiKind::Completions,
            br#"{"prompt":[[5,6],[7]],"cache_salt":"s"}"#,
        )
        .unwrap();
        assert_eq!(p.prompt, Prompt::Tokens(vec![5, 6]));
        assert_eq!(p.cache_salt.as_deref(), Some("s"));
        let p = parse(ApiKind::Completions, br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(p.prompt, Prompt::Text(b"a".to_vec()));
        let p = parse(
            ApiKind::AnthropicMessages,
            br#"{"system":"be brief","messages":[{"role":"user","content":"q"}],"max_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(p.prompt, Prompt::Text(b"systembe briefuserq".to_vec()));
    }

    #[test]
    fn other_kinds() {
        assert!(parse(ApiKind::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).is_ok());
        assert!(parse(ApiKind::Completions, br#"{"model":"m","prompt":5}"#).is_err());
        assert!(parse(ApiKind::Embeddings, br#"{"model":"m","input":"x"}"#).is_ok());
        assert!(
            parse(
                ApiKind::AnthropicMessages,
                br#"{"model":"m","messages":[]}"#
            )
            .is_err()
        );
        assert!(
            parse(
                ApiKind::AnthropicMessages,
                br#"{"model":"m","messages":[],"max_tokens":5}"#
            )
            .is_ok()
        );
        assert!(parse(ApiKind::VllmGenerate, br#"{"token_ids":[1,2]}"#).is_ok());
        assert!(parse(ApiKind::VllmGenerate, br#"{"token_ids":["a"]}"#).is_err());
        assert_eq!(
            parse(ApiKind::Passthrough, b"binary\x00").unwrap().model,
            ""
        );
    }
}

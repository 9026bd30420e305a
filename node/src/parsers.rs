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
        "/inference/v1/generate" | "/generate" => ApiKind::VllmGenerate,
        _ if passthrough => ApiKind::Passthrough,
        _ => return None,
    };
    Some(kind)
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    /// `model` from the body; empty when absent (vLLM allows that).
    pub model: String,
    pub stream: bool,
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
        return Ok(ParsedRequest {
            kind,
            model,
            stream: false,
        });
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let obj = v.as_object().ok_or(ParseError::NotObject)?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => String::new(),
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
        ApiKind::VllmGenerate => match obj.get("token_ids") {
            Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => {}
            Some(_) => return Err(field_err("token_ids", "must be a list of token ids")),
            None => return Err(field_err("token_ids", "is required")),
        },
        ApiKind::Passthrough => {}
    }
    Ok(ParsedRequest {
        kind,
        model,
        stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

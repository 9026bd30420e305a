//! The request stage: from the bytes Envoy buffered to a request that may be scheduled.
//!
//! ```text
//! body ─► parse (parser chosen by path) ─► resolve: model rewrite → target model,
//!         metadata (fairness id, objective → priority, TTFT objective) ─► admission (a Gate)
//! ```
//! - [`parse`]: request-body parsers (OpenAI, Anthropic, vLLM) → [`parse::ParsedRequest`];
//! - [`rewrite`]: `InferenceModelRewrite` rules and the rewrite header → the target model;
//! - [`meta`]: [`meta::RequestMeta`] from headers and `InferenceObjective`s;
//! - [`admission`]: the [`admission::Gate`] trait — legacy controller, flow control on this
//!   replica; the cluster room implements it cluster-wide;
//! - [`tenant`], [`quota`]: tenant mode — the API key's tenant, its grants (fairness id,
//!   objective) instead of the client's control headers, and its quota (before admission);
//! - [`reject`]: every refusal as one HTTP status, error code and drop reason;
//! - [`Live`]: objectives and rewrites as the streams read them, replaced whole when their
//!   source (the Kubernetes watch) changes.
//!
//! This room knows nothing of Envoy's protocol: the data plane hands it headers and bytes and
//! turns its [`reject::Rejection`]s into immediate responses.

pub mod admission;
pub mod meta;
pub mod parse;
pub mod quota;
pub mod reject;
pub mod rewrite;
pub mod tenant;
pub mod tokens;

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use meta::{Objectives, RequestMeta};
use parse::{MAX_MODEL_NAME_BYTES, ParsedRequest, Prompt};
use reject::Rejection;
use rewrite::{ModelRewrites, REWRITE_ALIAS, REWRITE_HEADER};

/// A value every stream reads and a watcher replaces whole: a stream keeps the one it read.
#[derive(Debug, Default)]
pub struct Live<T>(RwLock<Arc<T>>);

impl<T> Live<T> {
    pub fn new(value: T) -> Self {
        Live(RwLock::new(Arc::new(value)))
    }

    pub fn get(&self) -> Arc<T> {
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    pub fn set(&self, value: T) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(value);
    }
}

/// What the routing filter sends for paths no parser handles.
const SUPPORTED_PATHS: &str = "/v1/chat/completions, /v1/completions, /v1/embeddings, \
     /v1/responses, /v1/messages, /v1/messages/count_tokens, /inference/v1/generate";

/// The request path as the proxy reports it (`:path`, else the original or forwarded path).
pub fn path(headers: &HashMap<String, String>) -> &str {
    headers
        .get(":path")
        .or_else(|| headers.get("x-original-path"))
        .or_else(|| headers.get("x-forwarded-path"))
        .map_or("", String::as_str)
}

/// Parse a request's body with the parser its path selects; `None` for a request without a body
/// (routed on scores alone). Unknown paths are 404 unless `passthrough`; bad bodies 400.
pub fn parse_body(
    path: &str,
    body: Option<&[u8]>,
    passthrough: bool,
) -> Result<Option<ParsedRequest>, Rejection> {
    let Some(body) = body else {
        return Ok(None);
    };
    let Some(kind) = parse::kind_for_path(path, passthrough) else {
        return Err(Rejection::not_found(format!(
            "no request parser handles path `{path}` (supported: {SUPPORTED_PATHS})"
        )));
    };
    parse::parse(kind, body)
        .map(Some)
        .map_err(|e| Rejection::bad_request(e.to_string()))
}

fn too_long(header: &str) -> Rejection {
    Rejection::bad_request(format!(
        "header {header}: longer than {MAX_MODEL_NAME_BYTES} bytes"
    ))
}

/// A parsed request with its target model and metadata: what admission and scheduling see.
#[derive(Debug)]
pub struct Request {
    /// `None` for a request without a body.
    pub parsed: Option<ParsedRequest>,
    /// The model the client asked for (empty without a body).
    pub model: String,
    /// The model the pods will serve (a rewrite's target, else `model`).
    pub target_model: String,
    pub meta: RequestMeta,
}

impl Request {
    /// Resolve the target model (a rule for the model, else the rewrite header, else unchanged)
    /// and the request's metadata. With a `tenant` (tenant mode) the client's control headers
    /// count for nothing: the metadata is what the tenant is granted. Refused (400): a rewrite
    /// target, fairness id or objective from the client longer than [`MAX_MODEL_NAME_BYTES`]
    /// (they become metric labels, flow keys, replicated state).
    pub fn resolve(
        parsed: Option<ParsedRequest>,
        headers: &HashMap<String, String>,
        objectives: &Objectives,
        agent: &meta::AgentIdentity,
        rewrites: &ModelRewrites,
        tenant: Option<&tenant::Tenant>,
    ) -> Result<Request, Rejection> {
        let model = parsed.as_ref().map_or("", |p| p.model.as_str());
        let rewrite_header = headers
            .get(REWRITE_HEADER)
            .or_else(|| headers.get(REWRITE_ALIAS))
            .map(String::as_str)
            .filter(|_| tenant.is_none());
        if rewrite_header.is_some_and(|v| v.len() > MAX_MODEL_NAME_BYTES) {
            return Err(too_long(REWRITE_HEADER));
        }
        let target = if parsed.is_some() && !model.is_empty() {
            rewrites.target(model, rewrite_header, &mut rand::rng())
        } else {
            model
        };
        let meta = match tenant {
            Some(t) => RequestMeta::granted(&t.fairness_id, t.objective.as_deref(), objectives),
            None => RequestMeta::from_headers(headers, objectives, agent),
        };
        if meta.fairness_id.len() > MAX_MODEL_NAME_BYTES {
            return Err(too_long(
                "x-llm-d-inference-fairness-id (or the session header standing for it)",
            ));
        }
        if meta
            .objective
            .as_ref()
            .is_some_and(|o| o.len() > MAX_MODEL_NAME_BYTES)
        {
            return Err(too_long(meta::OBJECTIVE_HEADER));
        }
        Ok(Request {
            model: model.to_string(),
            target_model: target.to_string(),
            meta,
            parsed,
        })
    }

    /// Whether the pods serve another model than the client named.
    pub fn rewritten(&self) -> bool {
        self.target_model != self.model
    }

    /// The prompt (nothing for a body-less request).
    pub fn prompt(&self) -> &Prompt {
        static NONE: Prompt = Prompt::None;
        self.parsed.as_ref().map_or(&NONE, |p| &p.prompt)
    }

    /// Hashes of the prompt's media parts (empty: text only).
    pub fn media(&self) -> &[u64] {
        self.parsed.as_ref().map_or(&[], |p| p.media.as_slice())
    }

    /// The stored response a Responses-API request continues.
    pub fn previous_response_id(&self) -> Option<&str> {
        self.parsed
            .as_ref()
            .and_then(|p| p.previous_response_id.as_deref())
    }

    pub fn cache_salt(&self) -> Option<&str> {
        self.parsed.as_ref().and_then(|p| p.cache_salt.as_deref())
    }

    /// The most output tokens the request asks for.
    pub fn max_output(&self) -> Option<u64> {
        self.parsed.as_ref().and_then(|p| p.max_output)
    }

    /// The body as the model server must receive it: the target model, the output maximum a
    /// tenant's quota allows (`max_output`, written when the client asked more or nothing), and —
    /// for a streaming OpenAI request whose body is streamed back by the data plane — usage
    /// reporting asked for, so token metrics, quotas and flow control see real counts (on every
    /// chunk when `continuous_usage`).
    pub fn upstream_body(
        &self,
        mut body: Vec<u8>,
        editable_usage: bool,
        continuous_usage: bool,
        max_output: Option<u64>,
        propagate_priority: bool,
    ) -> Vec<u8> {
        if self.rewritten()
            && let Some(edited) = parse::with_model(&body, &self.target_model)
        {
            body = edited;
        }
        if propagate_priority
            && editable_usage
            && let Some(edited) = parse::with_priority(&body, self.meta.priority)
        {
            body = edited;
        }
        if let Some(n) = max_output
            && let Some(p) = &self.parsed
            && p.max_output != Some(n)
            && let Some(edited) = parse::with_max_output(p.kind, &body, n)
        {
            body = edited;
        }
        if editable_usage
            && let Some(edit) = self
                .parsed
                .as_ref()
                .and_then(|p| p.usage_edit(continuous_usage))
            && let Some(edited) = parse::with_usage_reporting(&body, edit)
        {
            body = edited;
        }
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(headers: &[(&str, String)]) -> Result<Request, Rejection> {
        let headers: HashMap<String, String> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let parsed = parse::parse(
            parse::ApiKind::Completions,
            br#"{"model":"m","prompt":"p"}"#,
        );
        Request::resolve(
            Some(parsed.unwrap()),
            &headers,
            &Objectives::default(),
            &meta::AgentIdentity::default(),
            &ModelRewrites::default(),
            None,
        )
    }

    /// Client strings that become labels, flow keys or replicated state are bounded: a rewrite
    /// target, fairness id (or the session header standing for it) or objective over 256 bytes is
    /// a 400 that names the header.
    #[test]
    fn over_long_control_header_values_are_refused() {
        let ok = "x".repeat(MAX_MODEL_NAME_BYTES);
        let long = "x".repeat(MAX_MODEL_NAME_BYTES + 1);
        for h in [
            REWRITE_HEADER,
            meta::FAIRNESS_ID_HEADER,
            "x-session-affinity",
            meta::OBJECTIVE_HEADER,
        ] {
            assert!(resolve(&[(h, ok.clone())]).is_ok(), "{h}");
            let r = resolve(&[(h, long.clone())]).unwrap_err();
            assert_eq!(r.status, 400, "{h}");
            assert!(
                r.message.contains("longer than 256 bytes"),
                "{h}: {}",
                r.message
            );
        }
    }
}

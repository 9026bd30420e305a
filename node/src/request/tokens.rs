//! `token-producer`: the request's prompt as the engine tokenizes it.
//!
//! Backends:
//! - `estimate` (llm-d's default): no tokenizer; prefix producers hash the serialized prompt's
//!   4-byte pseudo-tokens. Nothing to do here.
//! - `vllm_http`: one call per request to vLLM's render endpoint (`POST /v1/chat/completions/render`
//!   or `/v1/completions/render`, the same body with the target model), which applies the model's
//!   chat template and tokenizer and answers the `token_ids` — on `renderUrl` (a render server,
//!   `vllm launch render <model>`) or, without one, on a pod of the pool chosen by the request's
//!   key. Bounded by `timeout`; on any failure the request goes on without engine tokens (the
//!   precise producer then matches nothing for it) and the failure is counted.

use std::time::Duration;

use serde::Deserialize;

use crate::config::{ConfigError, parse_duration};
use crate::datalayer::store::Candidate;
use crate::metrics::Metrics;
use crate::request::Request;
use crate::request::parse::ApiKind;

pub const TYPE: &str = "token-producer";
pub const ESTIMATE: &str = "estimate";
pub const VLLM_HTTP: &str = "vllm_http";

/// Largest render answer read (a 1M-token prompt's ids are ~8 MB of JSON).
const MAX_RENDER_BYTES: usize = 32 << 20;

/// `token-producer` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TokenProducerParams {
    #[serde(default = "estimate")]
    pub backend: String,
    /// `vllm_http`: the render server's base URL (`http://host:port`); none = a pod of the pool.
    #[serde(default)]
    pub render_url: Option<String>,
    /// `vllm_http`: the longest a render call may take (default 1s).
    #[serde(default)]
    pub timeout: Option<String>,
}

fn estimate() -> String {
    ESTIMATE.into()
}

impl Default for TokenProducerParams {
    fn default() -> Self {
        TokenProducerParams {
            backend: estimate(),
            render_url: None,
            timeout: None,
        }
    }
}

/// A configured `vllm_http` backend.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderConfig {
    pub url: Option<String>,
    pub timeout: Duration,
}

impl TokenProducerParams {
    /// The render backend, `None` for `estimate`.
    pub fn render(&self, path: &str) -> Result<Option<RenderConfig>, ConfigError> {
        let field = |f: &str, message: String| ConfigError::Field {
            path: format!("{path}.{f}"),
            message,
        };
        match self.backend.as_str() {
            ESTIMATE => Ok(None),
            VLLM_HTTP => {
                let timeout = match &self.timeout {
                    Some(t) => parse_duration(t).map_err(|e| field("timeout", e))?,
                    None => Duration::from_secs(1),
                };
                if timeout.is_zero() {
                    return Err(field("timeout", "must be positive".into()));
                }
                if let Some(u) = &self.render_url
                    && reqwest::Url::parse(u).is_err()
                {
                    return Err(field("renderUrl", format!("`{u}` is not a URL")));
                }
                Ok(Some(RenderConfig {
                    url: self.render_url.clone(),
                    timeout,
                }))
            }
            other => Err(field(
                "backend",
                format!("backend `{other}` is not supported (estimate, vllm_http)"),
            )),
        }
    }
}

/// The render backend at run time.
#[derive(Debug, Clone)]
pub struct Renderer {
    pub config: RenderConfig,
    pub client: reqwest::Client,
    pub metrics: std::sync::Arc<Metrics>,
}

#[derive(Deserialize)]
struct Rendered {
    token_ids: Vec<u32>,
}

impl Renderer {
    /// The engine tokens of a chat or completions request (`None` for other APIs, multi-prompt
    /// completions, or a failed call — counted in `token_producer_requests_total`).
    pub async fn tokens(
        &self,
        req: &Request,
        body: &[u8],
        key: &str,
        candidates: &[Candidate],
    ) -> Option<Vec<u32>> {
        let kind = req.parsed.as_ref()?.kind;
        let (model, target_model) = (req.model.as_str(), req.target_model.as_str());
        let metrics = &self.metrics;
        let path = match kind {
            ApiKind::ChatCompletions => "/v1/chat/completions/render",
            ApiKind::Completions => "/v1/completions/render",
            _ => return None,
        };
        let base = match &self.config.url {
            Some(u) => u.trim_end_matches('/').to_string(),
            None => {
                if candidates.is_empty() {
                    return None;
                }
                // Spread render calls over the pool by request key.
                let i =
                    (xxhash_rust::xxh3::xxh3_64(key.as_bytes()) % candidates.len() as u64) as usize;
                format!("http://{}", candidates[i].endpoint.hostport)
            }
        };
        // The pods serve the target model: render with its name.
        let body = if model == target_model {
            body.to_vec()
        } else {
            let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
            v.as_object_mut()?
                .insert("model".into(), serde_json::Value::from(target_model));
            serde_json::to_vec(&v).ok()?
        };
        let call = async {
            let resp = self
                .client
                .post(format!("{base}{path}"))
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await
                .map_err(|_| "error")?;
            if !resp.status().is_success() {
                return Err("error");
            }
            if resp
                .content_length()
                .is_some_and(|n| n > MAX_RENDER_BYTES as u64)
            {
                return Err("too-large");
            }
            let bytes = resp.bytes().await.map_err(|_| "error")?;
            if bytes.len() > MAX_RENDER_BYTES {
                return Err("too-large");
            }
            parse_render(kind, &bytes).ok_or("malformed")
        };
        let outcome = match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(tokens)) => {
                metrics.kv_events.token_call("ok");
                return Some(tokens);
            }
            Ok(Err(e)) => e,
            Err(_) => "timeout",
        };
        metrics.kv_events.token_call(outcome);
        tracing::debug!(outcome, %base, "render call failed: no engine tokens for this request");
        None
    }
}

/// Chat render answers one object; completions render an array (one per prompt: only a single
/// prompt has one token sequence to match).
fn parse_render(kind: ApiKind, bytes: &[u8]) -> Option<Vec<u32>> {
    match kind {
        ApiKind::Completions => {
            let mut all: Vec<Rendered> = serde_json::from_slice(bytes).ok()?;
            (all.len() == 1).then(|| all.remove(0).token_ids)
        }
        _ => serde_json::from_slice::<Rendered>(bytes)
            .ok()
            .map(|r| r.token_ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_and_their_parameters() {
        let p = |v: serde_json::Value| serde_json::from_value::<TokenProducerParams>(v).unwrap();
        assert_eq!(
            p(serde_json::json!({})).render("x").unwrap(),
            None,
            "estimate by default"
        );
        let r = p(serde_json::json!({"backend": "vllm_http", "timeout": "250ms"}))
            .render("x")
            .unwrap()
            .unwrap();
        assert_eq!(r.timeout, Duration::from_millis(250));
        assert_eq!(r.url, None);
        for bad in [
            serde_json::json!({"backend": "local"}),
            serde_json::json!({"backend": "vllm_http", "timeout": "0s"}),
            serde_json::json!({"backend": "vllm_http", "renderUrl": "not a url"}),
        ] {
            assert!(p(bad.clone()).render("x").is_err(), "{bad}");
        }
    }

    #[test]
    fn render_answers() {
        assert_eq!(
            parse_render(
                ApiKind::ChatCompletions,
                br#"{"token_ids":[1,2,3],"model":"m"}"#
            ),
            Some(vec![1, 2, 3])
        );
        assert_eq!(
            parse_render(ApiKind::Completions, br#"[{"token_ids":[4]}]"#),
            Some(vec![4])
        );
        assert_eq!(
            parse_render(
                ApiKind::Completions,
                br#"[{"token_ids":[4]},{"token_ids":[5]}]"#
            ),
            None
        );
        assert_eq!(parse_render(ApiKind::ChatCompletions, b"garbage"), None);
        assert_eq!(
            parse_render(ApiKind::ChatCompletions, br#"{"token_ids":[-1]}"#),
            None
        );
    }
}

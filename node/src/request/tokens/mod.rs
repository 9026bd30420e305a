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
//! - `local`: the model's Hugging Face tokenizer and chat template in-process ([`local`]).

pub mod local;

use std::collections::HashMap;
use std::sync::Arc;
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
pub const LOCAL: &str = "local";

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
    /// `local`: model → its tokenizer directory (or `tokenizer.json` path), loaded at start.
    #[serde(default)]
    pub model_tokenizer_map: HashMap<String, String>,
    /// `local`: models not in the map are looked for in `<tokenizersDir>/<model>`.
    #[serde(default)]
    pub tokenizers_dir: Option<String>,
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
            model_tokenizer_map: HashMap::new(),
            tokenizers_dir: None,
        }
    }
}

/// A configured `vllm_http` backend.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderConfig {
    pub url: Option<String>,
    pub timeout: Duration,
}

/// A configured backend that brings engine tokens.
#[derive(Debug, Clone)]
pub enum TokenBackend {
    Render(RenderConfig),
    Local(Arc<local::LocalTokenizers>),
}

impl TokenProducerParams {
    /// The backend, `None` for `estimate`.
    pub fn render(&self, path: &str) -> Result<Option<TokenBackend>, ConfigError> {
        let field = |f: &str, message: String| ConfigError::Field {
            path: format!("{path}.{f}"),
            message,
        };
        let only = |backend: &str, set: bool, f: &str| {
            if set && self.backend != backend {
                Err(field(f, format!("applies to the {backend} backend only")))
            } else {
                Ok(())
            }
        };
        only(VLLM_HTTP, self.render_url.is_some(), "renderUrl")?;
        only(VLLM_HTTP, self.timeout.is_some(), "timeout")?;
        only(
            LOCAL,
            !self.model_tokenizer_map.is_empty(),
            "modelTokenizerMap",
        )?;
        only(LOCAL, self.tokenizers_dir.is_some(), "tokenizersDir")?;
        match self.backend.as_str() {
            ESTIMATE => Ok(None),
            LOCAL => {
                if self.model_tokenizer_map.is_empty() && self.tokenizers_dir.is_none() {
                    return Err(field(
                        "backend",
                        "local needs modelTokenizerMap or tokenizersDir".into(),
                    ));
                }
                let dir = self.tokenizers_dir.as_ref().map(std::path::PathBuf::from);
                if let Some(d) = &dir
                    && !d.is_dir()
                {
                    return Err(field(
                        "tokenizersDir",
                        format!("`{}` is not a directory", d.display()),
                    ));
                }
                let t = local::LocalTokenizers::load(&self.model_tokenizer_map, dir)
                    .map_err(|e| field("modelTokenizerMap", e))?;
                Ok(Some(TokenBackend::Local(Arc::new(t))))
            }
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
                Ok(Some(TokenBackend::Render(RenderConfig {
                    url: self.render_url.clone(),
                    timeout,
                })))
            }
            other => Err(field(
                "backend",
                format!("backend `{other}` is not supported (estimate, vllm_http, local)"),
            )),
        }
    }
}

/// The token backend at run time.
#[derive(Debug, Clone)]
pub struct Renderer {
    pub backend: TokenBackend,
    pub client: reqwest::Client,
    pub metrics: Arc<Metrics>,
}

#[derive(Deserialize)]
struct Rendered {
    token_ids: Vec<u32>,
}

impl Renderer {
    /// The engine tokens of a chat or completions request (`None` for other APIs, multi-prompt
    /// completions, or a failure — counted in `token_producer_requests_total`).
    pub async fn tokens(
        &self,
        req: &Request,
        body: &[u8],
        key: &str,
        candidates: &[Candidate],
    ) -> Option<Vec<u32>> {
        match &self.backend {
            TokenBackend::Render(config) => self.render(config, req, body, key, candidates).await,
            TokenBackend::Local(local) => {
                let kind = req.parsed.as_ref()?.kind;
                if !matches!(kind, ApiKind::ChatCompletions | ApiKind::Completions) {
                    return None;
                }
                // Tokenizing a long prompt takes milliseconds (and a model's first request may
                // load its tokenizer): off the runtime's threads, one per core at a time.
                let _slot = local.slots.acquire().await.ok()?;
                let (tok, model, body) = (local.clone(), req.target_model.clone(), body.to_vec());
                let r = tokio::task::spawn_blocking(move || tok.tokens(&model, kind, &body))
                    .await
                    .unwrap_or(Err(local::Miss::Template));
                let outcome = match &r {
                    Ok(_) => "ok",
                    Err(m) => m.outcome(),
                };
                self.metrics.kv_events.token_call(LOCAL, outcome);
                r.ok()
            }
        }
    }

    /// One call to the render endpoint.
    async fn render(
        &self,
        config: &RenderConfig,
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
        let base = match &config.url {
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
        let outcome = match tokio::time::timeout(config.timeout, call).await {
            Ok(Ok(tokens)) => {
                metrics.kv_events.token_call(VLLM_HTTP, "ok");
                return Some(tokens);
            }
            Ok(Err(e)) => e,
            Err(_) => "timeout",
        };
        metrics.kv_events.token_call(VLLM_HTTP, outcome);
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
        assert!(
            p(serde_json::json!({})).render("x").unwrap().is_none(),
            "estimate by default"
        );
        let r = p(serde_json::json!({"backend": "vllm_http", "timeout": "250ms"}))
            .render("x")
            .unwrap();
        let Some(TokenBackend::Render(r)) = r else {
            panic!("{r:?}")
        };
        assert_eq!(r.timeout, Duration::from_millis(250));
        assert_eq!(r.url, None);
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().to_str().unwrap();
        let r = p(serde_json::json!({"backend": "local", "tokenizersDir": dir}))
            .render("x")
            .unwrap();
        assert!(matches!(r, Some(TokenBackend::Local(_))), "{r:?}");
        for bad in [
            serde_json::json!({"backend": "local"}),
            serde_json::json!({"backend": "local", "tokenizersDir": "/no/such/dir"}),
            serde_json::json!({"backend": "local", "modelTokenizerMap": {"m": dir}}),
            serde_json::json!({"backend": "local", "tokenizersDir": dir, "timeout": "1s"}),
            serde_json::json!({"backend": "estimate", "tokenizersDir": dir}),
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

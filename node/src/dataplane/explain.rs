//! The dry run behind `POST /debug/schedule` and `epp explain`: a request's journey up to the
//! pick — parse, identify (tenant mode), resolve, candidates, engine tokens, the scheduling
//! profiles — with nothing admitted, charged or recorded. The tenant's quota and flow control are
//! not consulted (a dry run waits for nothing); the token producer, when one is configured, is
//! called as routing would call it.

use std::collections::HashMap;
use std::time::Instant;

use serde::Deserialize;

use super::PickerContext;
use super::usage::new_request_key;
use crate::request::reject::Rejection;
use crate::request::{self, Request};
use crate::scheduling::SchedRequest;
use crate::scheduling::explain::Explanation;

/// What to explain: the request as Envoy would hand it over.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DryRun {
    /// The request's path.
    #[serde(default = "chat_path")]
    pub path: String,
    /// The request's headers (objective, fairness id, the tenant's key or token, …).
    #[serde(default)]
    pub headers: HashMap<String, String>,
    /// The body: a JSON value, or a string taken byte for byte.
    pub body: serde_json::Value,
}

fn chat_path() -> String {
    "/v1/chat/completions".to_string()
}

/// Run the journey for `run` as far as the scheduler's pick; a stage that would refuse the
/// request refuses the dry run the same way.
pub async fn dry_run(ctx: &PickerContext, run: DryRun) -> Result<Explanation, Rejection> {
    let body = match run.body {
        serde_json::Value::String(s) => s.into_bytes(),
        v => v.to_string().into_bytes(),
    };
    if body.len() > ctx.max_body_bytes {
        return Err(Rejection::too_large(ctx.max_body_bytes));
    }
    let mut headers: HashMap<String, String> = run
        .headers
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    headers.insert(":path".to_string(), run.path);
    let parsed = request::parse_body(request::path(&headers), Some(&body), ctx.passthrough)?;
    let tenant = match &ctx.quotas {
        Some(q) => Some(q.lookup(&headers)?),
        None => None,
    };
    let req = Request::resolve(
        parsed,
        &headers,
        &ctx.objectives.get(),
        &ctx.agent,
        &ctx.rewrites.get(),
        tenant.as_deref(),
    )?;
    let candidates = ctx.store.candidates(Instant::now());
    let key = new_request_key(ctx.node_id);
    let tokens = match &ctx.renderer {
        Some(r) => r.tokens(&req, &body, &key, &candidates).await,
        None => None,
    };
    let sched = SchedRequest {
        request_id: &key,
        model: &req.model,
        target_model: &req.target_model,
        prompt: req.prompt(),
        cache_salt: req.cache_salt(),
        priority: req.meta.priority,
        headers: &ctx.scheduler.granted_headers(&headers, tenant.is_some()),
        tokens: tokens.as_deref(),
        media: req.media(),
    };
    Ok(ctx.scheduler.explain(&sched, &candidates))
}

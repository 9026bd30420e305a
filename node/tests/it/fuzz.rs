//! Property-based fuzzing of what the EPP parses from the outside: request bodies (every API
//! path, raw bytes and generated JSON), the request's control headers, the response usage
//! scanner (JSON and SSE, cut at arbitrary points), a model server's `/metrics` text (every
//! engine dialect) and the route info header. The property is the same everywhere: no panic,
//! bounded output, and what comes out respects its bounds. (Peer messages are fuzzed beside
//! their decoders in `cluster::gossip`; the EPP reads no KV-event frames yet.)
//!
//! Bounded for CI by proptest's case counts below; `PROPTEST_CASES` raises them for a long run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use node::datalayer::endpoint::{EndpointMetrics, Engine, bounds};
use node::datalayer::extract::extract;
use node::dataplane::usage::{RouteInfo, UsageScanner};
use node::request::meta::Objectives;
use node::request::rewrite::ModelRewrites;
use node::request::tenant::Tenants;
use node::request::{Request, parse_body};
use proptest::prelude::*;
use serde_json::Value;

const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/inference/v1/generate",
    "/v1/unknown",
];

/// Arbitrary JSON, biased towards the keys request parsers look at.
fn json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("model".to_string()),
        Just("messages".to_string()),
        Just("prompt".to_string()),
        Just("input".to_string()),
        Just("content".to_string()),
        Just("role".to_string()),
        Just("stream".to_string()),
        Just("stream_options".to_string()),
        Just("tools".to_string()),
        Just("system".to_string()),
        Just("cache_salt".to_string()),
        Just("prompt_token_ids".to_string()),
        Just("usage".to_string()),
        "[a-z_]{1,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        ".{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn headers() -> impl Strategy<Value = HashMap<String, String>> {
    let name = prop_oneof![
        Just("x-gateway-inference-objective".to_string()),
        Just("x-gateway-inference-fairness-id".to_string()),
        Just("x-llm-d-inference-objective".to_string()),
        Just("x-gateway-model-name-rewrite".to_string()),
        Just("x-session-id".to_string()),
        Just("x-request-id".to_string()),
        Just("x-slo-ttft-ms".to_string()),
        Just("authorization".to_string()),
        Just("x-api-key".to_string()),
        "x-[a-z-]{1,20}",
    ];
    prop::collection::hash_map(name, ".{0,64}", 0..8)
}

/// Run one body through the request stage as the data plane does.
fn request_stage(path: &str, body: &[u8], headers: &HashMap<String, String>) {
    let (objectives, rewrites) = (Objectives::default(), ModelRewrites::default());
    // Tenant mode too: any header values, an anonymous tenant with an output cap.
    let tenants = Tenants::from_yaml(
        "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {name: anon}\nspec: {anonymous: true, limits: [{model: '*', maxTokensCap: 8}]}\n",
    )
    .unwrap();
    let tenant = tenants.identify(headers).ok();
    for passthrough in [false, true] {
        if let Ok(parsed) = parse_body(path, Some(body), passthrough) {
            let Ok(req) = Request::resolve(
                parsed,
                headers,
                &objectives,
                &node::request::meta::AgentIdentity::default(),
                &rewrites,
                tenant.as_deref(),
            ) else {
                continue;
            };
            let _ = req.prompt().estimated_tokens();
            let cap = tenant
                .as_ref()
                .and_then(|t| t.limits_for(&req.model)?.1.output_budget(req.max_output()));
            let _ = req.upstream_body(body.to_vec(), true, tenant.is_some(), cap, true);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn request_bodies_of_raw_bytes(
        path in prop::sample::select(PATHS),
        body in prop::collection::vec(any::<u8>(), 0..512),
        h in headers(),
    ) {
        request_stage(path, &body, &h);
    }

    #[test]
    fn request_bodies_of_generated_json(
        path in prop::sample::select(PATHS),
        v in json(),
        h in headers(),
    ) {
        request_stage(path, &serde_json::to_vec(&v).unwrap(), &h);
    }

    #[test]
    fn usage_scanner_over_cut_streams(
        sse in any::<bool>(),
        events in prop::collection::vec(json(), 0..6),
        junk in prop::collection::vec(any::<u8>(), 0..128),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut body = Vec::new();
        for e in &events {
            if sse {
                body.extend_from_slice(b"data: ");
            }
            body.extend_from_slice(&serde_json::to_vec(e).unwrap());
            body.extend_from_slice(b"\n\n");
        }
        body.extend_from_slice(&junk);
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
        at.sort_unstable();
        let ct = if sse { "text/event-stream" } else { "application/json" };
        let mut s = UsageScanner::new(Some(ct));
        let mut last = 0;
        for a in at.into_iter().chain(std::iter::once(body.len())) {
            s.feed(&body[last..a]);
            last = a;
        }
        let _ = s.finish();
    }

    #[test]
    fn metrics_text_in_every_dialect(
        lines in prop::collection::vec(metric_line(), 0..24),
        junk in ".{0,200}",
    ) {
        let text = format!("{}\n{junk}", lines.join("\n"));
        for engine in [Engine::Vllm, Engine::Sglang, Engine::TrtllmServe, Engine::TritonTrtllm] {
            let mut m = extract(engine, &text);
            // The hasher copes even with a block size nobody bounded.
            let raw = m.block_size.map_or(16, |b| usize::try_from(b).unwrap_or(usize::MAX));
            let h = index::hashing::BlockHasher::new("m", None, raw, 0);
            let _ = index::hashing::block_hashes_of_text(&h, text.as_bytes());
            m.sanitize(1_800_000_000_000);
            assert_bounded(&m);
        }
    }

    #[test]
    fn route_info_of_any_header(s in ".{0,200}", k in "[0-9a-f]{0,40}") {
        let _ = RouteInfo::decode(&s);
        if let Some(info) = RouteInfo::decode(&format!("k={k};{s}")) {
            // Ours: 32 hex digits, perhaps `-` and an owner's node id (at most 16 hex digits).
            assert!(info.key.is_empty() || (32..=49).contains(&info.key.len()));
        }
    }
}

/// A `/metrics` line an engine might send, with absurd values among the sane ones.
fn metric_line() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec![
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
        "trtllm_kv_cache_tokens_per_block",
        "trtllm_kv_cache_max_blocks",
        "nv_trt_llm_kv_cache_block_metrics",
        "nv_trt_llm_request_metrics",
        "process_start_time_seconds",
    ]);
    let number = prop_oneof![
        Just("NaN".to_string()),
        Just("+Inf".to_string()),
        Just("-1e308".to_string()),
        Just("4611686018427387904".to_string()),
        Just("1099511627776".to_string()),
        any::<f64>().prop_map(|v| v.to_string()),
        (0u32..100_000).prop_map(|v| v.to_string()),
    ];
    let label = prop::sample::select(vec![
        "block_size",
        "num_gpu_blocks",
        "page_size",
        "num_pages",
        "max_lora",
        "running_lora_adapters",
        "waiting_lora_adapters",
        "kv_cache_block_type",
        "request_type",
    ]);
    let value = prop_oneof![
        number.clone(),
        ".{0,30}".prop_map(|s| s.replace(['"', '\\'], ""))
    ];
    (name, prop::collection::vec((label, value), 0..4), number).prop_map(|(name, labels, v)| {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        format!("{name}{{{}}} {v}", labels.join(","))
    })
}

fn assert_bounded(m: &EndpointMetrics) {
    for v in [m.waiting_queue_size, m.running_requests]
        .into_iter()
        .flatten()
    {
        assert!(
            v.is_finite() && (0.0..=bounds::MAX_REQUESTS).contains(&v),
            "{m:?}"
        );
    }
    if let Some(kv) = m.kv_cache_usage {
        assert!((0.0..=1.0).contains(&kv), "{m:?}");
    }
    if let Some(b) = m.block_size {
        assert!((1..=bounds::MAX_BLOCK_TOKENS).contains(&b), "{m:?}");
    }
    if let Some(n) = m.num_gpu_blocks {
        let tokens = n.checked_mul(m.block_size.unwrap_or(1)).unwrap();
        assert!(tokens <= bounds::MAX_KV_TOKENS, "{m:?}");
    }
    assert!(m.active_models.len() <= bounds::MAX_MODEL_NAMES);
    assert!(m.waiting_models.len() <= bounds::MAX_MODEL_NAMES);
    assert!(
        m.started_ms
            .is_none_or(|t| t <= 1_800_000_000_000 + bounds::MAX_FUTURE_MS)
    );
}

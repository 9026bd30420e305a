//! `/v1/responses`, `/detokenize`, `/v1/messages/count_tokens`, and the `/metrics` + `/health`
//! fast path, against real pod servers on OS-chosen ports.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use sim::{KnobsPatch, PodKnobs, Sim, SimConfig};

fn fast() -> PodKnobs {
    PodKnobs {
        time_scale: 0.01,
        ..PodKnobs::default()
    }
}

async fn start(pods: usize) -> Sim {
    Sim::start(SimConfig {
        pods,
        knobs: fast(),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn url(sim: &Sim, pod: usize, path: &str) -> String {
    format!("http://{}{}", sim.pods()[pod].addr, path)
}

async fn post_raw(url: &str, body: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    post_raw(url, &body.to_string()).await
}

/// An OpenAI-style error of `kind` whose message mentions `needle`.
fn assert_openai_error(v: &Value, kind: &str, needle: &str) {
    assert_eq!(v["error"]["type"], kind, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
}

/// `(event name, data)` of every event of an SSE body.
fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_owned();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap();
                }
            }
            (name, data)
        })
        .collect()
}

#[tokio::test]
async fn responses_answers_in_the_responses_shape() {
    let sim = start(1).await;
    let u = url(&sim, 0, "/v1/responses");
    let (s, v) = post(
        &u,
        json!({"model": "sim-model", "input": "tell me about the sea", "instructions": "be brief"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["instructions"], "be brief");
    assert_eq!(v["store"], true);
    assert!(v["previous_response_id"].is_null());
    assert!(v["created_at"].as_u64().unwrap() > 0);
    let out = &v["output"][0];
    assert_eq!(out["type"], "message");
    assert_eq!(out["role"], "assistant");
    assert_eq!(out["status"], "completed");
    assert!(out["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(out["content"][0]["type"], "output_text");
    let text = out["content"][0]["text"].as_str().unwrap();
    // Default budget: 16 one-token words.
    assert_eq!(text.split(' ').count(), 16);
    let usage = &v["usage"];
    // system role + "be" "brie" "f"; user role + "tell" "me" "abou" "t" "the" "sea".
    assert_eq!(usage["input_tokens"], 4 + 7);
    assert_eq!(usage["output_tokens"], 16);
    assert_eq!(usage["total_tokens"], 27);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    assert_eq!(sim.stats(0).served, 1);

    // An explicit max_output_tokens is what stops the answer: "incomplete".
    let (s, v) = post(
        &u,
        json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
               "max_output_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert_eq!(v["usage"]["input_tokens"], 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn responses_chain_on_the_same_pod_only_and_reuse_the_prefix_cache() {
    let sim = start(2).await;
    let long = "word ".repeat(200);
    let (s, first) = post(
        &url(&sim, 0, "/v1/responses"),
        json!({"input": long, "instructions": "sys"}),
    )
    .await;
    assert_eq!(s, 200);
    let id = first["id"].as_str().unwrap();

    // Retrieval on the pod that answered.
    let r = reqwest::get(url(&sim, 0, &format!("/v1/responses/{id}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let got: Value = r.json().await.unwrap();
    assert_eq!(got, first);

    // The follow-up continues the stored conversation: its prompt is longer than the first and
    // starts with it, so the first turn's blocks are cache hits.
    let (s, second) = post(
        &url(&sim, 0, "/v1/responses"),
        json!({"input": "and then?", "instructions": "sys", "previous_response_id": id}),
    )
    .await;
    assert_eq!(s, 200, "{second}");
    assert_eq!(second["previous_response_id"], id);
    assert_ne!(second["id"], first["id"]);
    let (p1, p2) = (
        first["usage"]["input_tokens"].as_u64().unwrap(),
        second["usage"]["input_tokens"].as_u64().unwrap(),
    );
    // + the answer (role + 16 words) + the new turn (role + "and" "then" "?").
    assert_eq!(p2, p1 + (1 + 16) + (1 + 3), "{first} {second}");
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= p1 / 16 * 16 - 16, "cached {cached} of {p1}");

    // The store is per pod: the other pod does not know the id.
    let (s, v) = post(
        &url(&sim, 1, "/v1/responses"),
        json!({"input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(s, 404);
    assert_openai_error(&v, "NotFoundError", id);
    let r = reqwest::get(url(&sim, 1, &format!("/v1/responses/{id}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // store=false: answered, not kept.
    let (s, v) = post(
        &url(&sim, 0, "/v1/responses"),
        json!({"input": "x", "store": false}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["store"], false);
    let r = reqwest::get(url(
        &sim,
        0,
        &format!("/v1/responses/{}", v["id"].as_str().unwrap()),
    ))
    .await
    .unwrap();
    assert_eq!(r.status(), 404);

    // A crash loses the in-memory store.
    sim.restart(0).await.unwrap();
    let (s, _) = post(
        &url(&sim, 0, "/v1/responses"),
        json!({"input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(s, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn responses_stream_named_events_in_order() {
    let sim = start(1).await;
    let resp = reqwest::Client::new()
        .post(url(&sim, 0, "/v1/responses"))
        .json(&json!({"input": "stream me", "stream": true, "max_output_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let events = sse_events(&resp.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(events[8].1["text"], deltas);
    let last = &events[11].1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], deltas);
    assert_eq!(last["usage"]["output_tokens"], 4);
    assert_eq!(last["usage"]["input_tokens"], 1 + 3);
    // The streamed response is stored too.
    let id = last["id"].as_str().unwrap();
    let r = reqwest::get(url(&sim, 0, &format!("/v1/responses/{id}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    sim.shutdown().await;
}

#[tokio::test]
async fn responses_rejects_bad_requests_with_clear_errors() {
    let sim = start(1).await;
    let u = url(&sim, 0, "/v1/responses");
    let (s, v) = post_raw(&u, "{not json").await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "invalid request body");
    let (s, v) = post_raw(&u, r#"{"input": 5}"#).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "`input`");
    let (s, v) = post(&u, json!({"model": "sim-model"})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "`input` is required");
    let (s, v) = post(&u, json!({"input": []})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "must not be empty");
    let (s, v) = post(&u, json!({"input": [{"type": "mystery"}]})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "input[0]");
    let (s, v) = post(&u, json!({"input": [{"role": "user", "content": 7}]})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "content");
    let (s, v) = post(&u, json!({"input": "x", "max_output_tokens": 0})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "max_output_tokens");
    let (s, v) = post(&u, json!({"input": "x", "max_output_tokens": -1})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "invalid request body");
    let (s, v) = post(&u, json!({"input": "x", "background": true})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "background");
    let (s, v) = post(&u, json!({"input": "x", "model": "nope"})).await;
    assert_eq!(s, 404);
    assert_openai_error(&v, "NotFoundError", "nope");
    // Function-call items and their outputs are accepted as conversation turns.
    let (s, v) = post(
        &u,
        json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"x\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": []},
        ]}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["input_tokens"], 3 + 4 + 3);
    // Injected failures answer 500 like the other generation endpoints.
    sim.set_knobs(
        0,
        &KnobsPatch {
            error_rate: Some(1.0),
            ..KnobsPatch::default()
        },
    )
    .unwrap();
    let (s, v) = post(&u, json!({"input": "x"})).await;
    assert_eq!(s, 500);
    assert_openai_error(&v, "InternalServerError", "injected");
    sim.shutdown().await;
}

#[tokio::test]
async fn detokenize_inverts_tokenize() {
    let sim = start(2).await;
    let text = "the quick brown fox jumps over ünïcødé";
    let (s, v) = post(&url(&sim, 0, "/tokenize"), json!({"prompt": text})).await;
    assert_eq!(s, 200);
    let tokens = v["tokens"].clone();
    // The vocabulary is the sim's, not the pod's: another pod detokenizes it too.
    for pod in [0, 1] {
        let (s, v) = post(
            &url(&sim, pod, "/detokenize"),
            json!({"model": "sim-model", "tokens": tokens}),
        )
        .await;
        assert_eq!(s, 200);
        assert_eq!(v, json!({"prompt": text}));
    }
    // Chat tokenization: role markers come back as words.
    let (_, v) = post(
        &url(&sim, 0, "/tokenize"),
        json!({"messages": [{"role": "user", "content": "hi there"}]}),
    )
    .await;
    let (s, v) = post(&url(&sim, 0, "/detokenize"), json!({"tokens": v["tokens"]})).await;
    assert_eq!(s, 200);
    assert_eq!(v["prompt"], "<|user|> hi there");
    // Every u32 is a token of this tokenizer; ids never seen are marked, not refused.
    let (s, v) = post(&url(&sim, 0, "/detokenize"), json!({"tokens": [12345]})).await;
    assert_eq!(s, 200);
    assert_eq!(v["prompt"], "<|tok:12345|>");
    let (s, v) = post(&url(&sim, 0, "/detokenize"), json!({"tokens": []})).await;
    assert_eq!(s, 200);
    assert_eq!(v["prompt"], "");
    // Errors.
    let (s, v) = post_raw(&url(&sim, 0, "/detokenize"), "[1,2").await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "invalid request body");
    let (s, v) = post(&url(&sim, 0, "/detokenize"), json!({"model": "sim-model"})).await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "BadRequestError", "tokens");
    let (s, _) = post(&url(&sim, 0, "/detokenize"), json!({"tokens": [-1]})).await;
    assert_eq!(s, 400);
    let (s, _) = post(&url(&sim, 0, "/detokenize"), json!({"tokens": ["a"]})).await;
    assert_eq!(s, 400);
    let (s, v) = post(
        &url(&sim, 0, "/detokenize"),
        json!({"model": "nope", "tokens": [1]}),
    )
    .await;
    assert_eq!(s, 404);
    assert_openai_error(&v, "NotFoundError", "nope");
    sim.shutdown().await;
}

#[tokio::test]
async fn count_tokens_matches_messages_usage() {
    let sim = start(1).await;
    let body = json!({
        "model": "sim-model",
        "system": "you are terse",
        "messages": [{"role": "user", "content": "count these words please"}],
    });
    let (s, v) = post(&url(&sim, 0, "/v1/messages/count_tokens"), body.clone()).await;
    assert_eq!(s, 200);
    // system role + 4 pieces ("terse" is 2), user role + 8 pieces (every word is 2).
    assert_eq!(v, json!({"input_tokens": 1 + 4 + 1 + 8}));
    let mut msg = body;
    msg["max_tokens"] = json!(2);
    let (s, m) = post(&url(&sim, 0, "/v1/messages"), msg).await;
    assert_eq!(s, 200);
    assert_eq!(m["usage"]["input_tokens"], v["input_tokens"]);
    // Counting is not serving.
    assert_eq!(sim.stats(0).served, 1);

    let (s, v) = post_raw(&url(&sim, 0, "/v1/messages/count_tokens"), "{").await;
    assert_eq!(s, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (s, v) = post(
        &url(&sim, 0, "/v1/messages/count_tokens"),
        json!({"model": "sim-model"}),
    )
    .await;
    assert_eq!(s, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("messages"));
    let (s, v) = post(
        &url(&sim, 0, "/v1/messages/count_tokens"),
        json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["type"], "not_found_error");
    sim.shutdown().await;
}

/// The fast path and the router answer `/metrics` and `/health` identically.
#[tokio::test]
async fn metrics_and_health_fast_path_match_the_router() {
    let sim = start(1).await;
    let client = reqwest::Client::new();
    let (s, _) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": "a b c d", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    let get = |path: &'static str, dest: Option<&'static str>| {
        let mut req = client.get(url(&sim, 0, path));
        if let Some(d) = dest {
            req = req.header("x-gateway-destination-endpoint", d);
        }
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let mut headers: Vec<(String, String)> = r
                .headers()
                .iter()
                .filter(|(k, _)| *k != "date")
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
                .collect();
            headers.sort();
            (status, headers, r.text().await.unwrap())
        }
    };
    let port = sim.pods()[0].addr.port().to_string();
    let fast_metrics = get("/metrics", Some("10.0.0.1:8000")).await;
    let fast_health = get("/health", None).await;
    assert_eq!(fast_metrics.0, 200);
    assert!(
        fast_metrics
            .2
            .contains("vllm:request_success_total{model_name=\"sim-model\",engine=\"0\",finished_reason=\"length\"} 1.0")
    );
    for (k, v) in [
        ("content-type", "text/plain; version=0.0.4; charset=utf-8"),
        ("x-inference-pod", "sim-0"),
        ("x-inference-port", port.as_str()),
        ("x-sim-received-destination", "10.0.0.1:8000"),
    ] {
        assert!(
            fast_metrics.1.contains(&(k.to_owned(), v.to_owned())),
            "{k} in {:?}",
            fast_metrics.1
        );
    }
    assert_eq!(fast_health.0, 200);
    assert_eq!(fast_health.2, "");

    // A metrics delay sends /metrics through the router: same answer.
    sim.set_knobs(
        0,
        &KnobsPatch {
            metrics_delay_ms: Some(1.0),
            ..KnobsPatch::default()
        },
    )
    .unwrap();
    let routed = get("/metrics", Some("10.0.0.1:8000")).await;
    assert_eq!(routed, fast_metrics);

    // HEAD and other methods still go to the router.
    let r = client.head(url(&sim, 0, "/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client.post(url(&sim, 0, "/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    // The exposition follows the state: a new request changes it.
    sim.set_knobs(
        0,
        &KnobsPatch {
            metrics_delay_ms: Some(0.0),
            ..KnobsPatch::default()
        },
    )
    .unwrap();
    let (s, _) = post(&url(&sim, 0, "/v1/completions"), json!({"prompt": "z"})).await;
    assert_eq!(s, 200);
    let after = get("/metrics", None).await;
    assert!(after.2.contains("finished_reason=\"length\"} 2.0"));
    sim.shutdown().await;
}

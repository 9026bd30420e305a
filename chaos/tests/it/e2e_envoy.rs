//! End to end: Envoy → EPP → simulated vLLM pods, all real processes on loopback.
//!
//! These tests need Envoy (`deploy/local/install-envoy.sh` puts it in `.venv`) and the `epp` binary
//! (`cargo build --workspace --bins`); they fail, not skip, when either is missing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::wait;
use futures::StreamExt;
use serde_json::{Value, json};
use sim::{KnobsPatch, PodKnobs, SimConfig};

fn sim_config(pods: usize, knobs: PodKnobs) -> SimConfig {
    SimConfig {
        pods,
        knobs,
        ..SimConfig::default()
    }
}

fn chat(stream: bool, content: &str) -> Value {
    let mut v = json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
    });
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

async fn start(spec: ClusterSpec) -> LocalCluster {
    LocalCluster::start(spec).await.expect("cluster starts")
}

/// Wait until the EPP has scraped every pod at least once (its ready-endpoints gauge is set on
/// discovery; a first successful routed request proves the scrape path).
async fn warm(c: &LocalCluster) {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", c.envoy.url());
    wait::until("a first routed request", Duration::from_secs(20), || {
        let client = client.clone();
        let url = url.clone();
        async move {
            client
                .post(&url)
                .json(&json!({"model": "sim-model", "prompt": "warm up", "max_tokens": 1}))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_streaming_and_non_streaming_to_the_chosen_pod() {
    let c = start(ClusterSpec {
        sim: sim_config(4, PodKnobs::default()),
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let client = reqwest::Client::new();
    let pods: HashMap<String, String> = c
        .sim
        .pods()
        .into_iter()
        .map(|p| (p.name, p.addr.to_string()))
        .collect();
    for (path, stream) in [
        ("/v1/chat/completions", false),
        ("/v1/chat/completions", true),
        ("/v1/completions", false),
        ("/v1/completions", true),
        ("/v1/responses", false),
        ("/v1/responses", true),
        ("/v1/messages/count_tokens", false),
    ] {
        let body = match path {
            "/v1/chat/completions" => chat(stream, "hello there"),
            // The Responses API reports usage in its final object / `response.completed` event.
            "/v1/responses" => json!({"model": "sim-model", "instructions": "You are terse.",
                "input": "hello there", "max_output_tokens": 8, "stream": stream}),
            "/v1/messages/count_tokens" => json!({"model": "sim-model",
                "messages": [{"role": "user", "content": "how many tokens is this"}]}),
            // No stream_options: the EPP asks for usage itself (the client sees the extra chunk).
            _ => {
                json!({"model": "sim-model", "prompt": "once upon a time", "max_tokens": 8, "stream": stream})
            }
        };
        let resp = client
            .post(format!("{}{path}", c.envoy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path} stream={stream}");
        let pod = resp.headers()["x-inference-pod"]
            .to_str()
            .unwrap()
            .to_string();
        // The simulator echoes the destination header it received: the EPP's choice.
        let chosen = resp.headers()["x-sim-received-destination"]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(
            chosen, pods[&pod],
            "served by {pod} but the EPP chose {chosen}"
        );
        let text = resp.text().await.unwrap();
        match (path, stream) {
            ("/v1/responses", true) => {
                // Eight tokens of eight asked: `response.incomplete` (max_output_tokens) closes it.
                let last = text.trim_end().rsplit("\n\n").next().unwrap();
                let data: Value =
                    serde_json::from_str(last.split_once("data: ").unwrap().1).unwrap();
                assert_eq!(data["response"]["usage"]["output_tokens"], 8, "{text}");
            }
            ("/v1/responses", false) => {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["usage"]["output_tokens"], 8, "{v}");
            }
            ("/v1/messages/count_tokens", _) => {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert!(v["input_tokens"].as_u64().is_some_and(|n| n > 0), "{v}");
            }
            (_, true) => {
                assert!(text.contains("data: [DONE]"), "{text}");
                assert!(text.contains("\"usage\""), "usage chunk missing: {text}");
            }
            (_, false) => {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
            }
        }
    }
    // Usage from JSON and SSE bodies, seen by the observing stream, labelled by the routing one.
    let count = |m: &str, name: &str| -> f64 {
        let key = format!(
            "{name}_count{{model_name=\"sim-model\",target_model_name=\"sim-model\",fairness_id=\"default-flow\",priority=\"0\"}} "
        );
        m.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    // The observing stream records usage when each response ends, after the client has it.
    let _ = wait::until(
        "usage of every response recorded",
        Duration::from_secs(5),
        || async {
            let m = c.epps[0].metrics().await.unwrap_or_default();
            count(&m, "llm_d_epp_request_output_tokens") >= 7.0
        },
    )
    .await;
    let m = c.epps[0].metrics().await.unwrap();
    assert!(m.contains("llm_d_epp_request_total"), "{m}");
    assert!(
        m.contains("llm_d_epp_scheduler_e2e_duration_seconds_count"),
        "{m}"
    );
    // The default profile's prefix index: its size and the per-request hit ratio.
    let size = m
        .lines()
        .find_map(|l| l.strip_prefix("llm_d_epp_prefix_indexer_size{plugin_name=\"approx-prefix-cache-producer\",plugin_type=\"approx-prefix-cache-producer\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(
        size.is_some_and(|n| n > 0.0),
        "prefix index size: {size:?}\n{m}"
    );
    assert!(
        m.contains("llm_d_epp_prefix_indexer_hit_ratio_count"),
        "{m}"
    );
    for name in [
        "llm_d_epp_request_input_tokens",
        "llm_d_epp_request_output_tokens",
    ] {
        // The warm-up, four chat/completions and two Responses requests (count_tokens generates
        // nothing and reports no usage).
        assert_eq!(count(&m, name), 7.0, "{name}:\n{m}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avoids_the_pod_with_a_long_queue() {
    // Pod 0 is slow and has one slot, so its queue grows under load; round robin keeps feeding it.
    let knobs = PodKnobs {
        max_num_seqs: 4,
        decode_ms_per_token: 5.0,
        ..PodKnobs::default()
    };
    let c = start(ClusterSpec {
        sim: sim_config(4, knobs),
        ..Default::default()
    })
    .await;
    c.sim
        .set_knobs(
            0,
            &KnobsPatch {
                max_num_seqs: Some(1),
                decode_ms_per_token: Some(40.0),
                ..Default::default()
            },
        )
        .unwrap();
    warm(&c).await;

    async fn drive(url: String, total: usize, concurrency: usize) {
        let client = reqwest::Client::new();
        futures::stream::iter(0..total)
            .for_each_concurrent(concurrency, |i| {
                let client = client.clone();
                let url = url.clone();
                async move {
                    let r = client
                        .post(&url)
                        .json(&chat(false, &format!("question number {i}")))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                }
            })
            .await;
    }
    let served0 = |c: &LocalCluster| c.sim.stats(0).served;

    let before = served0(&c);
    drive(format!("{}/rr/v1/chat/completions", c.envoy.url()), 80, 12).await;
    let rr = served0(&c) - before;
    // Let pod 0's queue drain so both runs start equal.
    wait::until("pod 0 idle", Duration::from_secs(30), || async {
        let s = c.sim.stats(0);
        s.running == 0 && s.waiting == 0
    })
    .await
    .unwrap();
    let before = served0(&c);
    drive(format!("{}/v1/chat/completions", c.envoy.url()), 80, 12).await;
    let epp = served0(&c) - before;
    eprintln!("requests served by the slow pod: round robin {rr}, epp {epp}");
    assert!(rr >= 15, "round robin should give the slow pod ~1/4: {rr}");
    // Measured 6–11 vs 20: the queue is seen through 50 ms scrapes, so bursts between scrapes
    // still reach the slow pod; the EPP must send it at most three quarters of round robin's share.
    assert!(
        epp * 4 <= rr * 3,
        "epp sent {epp} to the slow pod, round robin {rr}"
    );
    c.shutdown().await;
}

async fn post_raw(
    url: &str,
    body: impl Into<reqwest::Body>,
) -> (u16, HashMap<String, String>, String) {
    let r = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    (status, headers, r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_have_clear_statuses() {
    let c = start(ClusterSpec {
        sim: sim_config(2, PodKnobs::default()),
        epp_args: vec!["--max-body-bytes".into(), "4096".into()],
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let base = c.envoy.url();

    let (s, _, body) = post_raw(
        &format!("{base}/v1/chat/completions"),
        "{\"model\": \"m\", ",
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert!(body.contains("inference error: BadRequest"), "{body}");

    let (s, _, body) = post_raw(&format!("{base}/v1/unknown/thing"), "{}").await;
    assert_eq!(s, 404, "{body}");
    assert!(
        body.contains("no request parser handles path `/v1/unknown/thing`"),
        "{body}"
    );

    let big = chat(false, &"word ".repeat(2000)).to_string();
    let (s, _, body) = post_raw(&format!("{base}/v1/chat/completions"), big).await;
    assert_eq!(s, 413, "{body}");

    // A chunked body (no Content-Length), as a streaming client sends it, still routes.
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = chat(false, "chunked hello")
        .to_string()
        .into_bytes()
        .chunks(7)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    let (s, _, body) = post_raw(
        &format!("{base}/v1/chat/completions"),
        reqwest::Body::wrap_stream(futures::stream::iter(chunks)),
    )
    .await;
    assert_eq!(s, 200, "{body}");

    // The replica is still healthy after all that.
    let (s, _, _) = post_raw(
        &format!("{base}/v1/chat/completions"),
        chat(false, "still ok").to_string(),
    )
    .await;
    assert_eq!(s, 200);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ready_pod_is_503_rejected_no_endpoints() {
    let c = start(ClusterSpec {
        sim: sim_config(1, PodKnobs::default()),
        no_pods: true,
        ..Default::default()
    })
    .await;
    let (s, h, body) = post_raw(
        &format!("{}/v1/chat/completions", c.envoy.url()),
        chat(false, "anyone?").to_string(),
    )
    .await;
    assert_eq!(s, 503, "{body}");
    assert_eq!(
        h.get("x-llm-d-request-dropped-reason").map(String::as_str),
        Some("rejected-no-endpoints")
    );

    // Adding the pod to the endpoints file brings it into rotation without a restart.
    std::fs::write(&c.endpoints_file, c.sim.pods_yaml()).unwrap();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    wait::until(
        "the reloaded endpoint to serve",
        Duration::from_secs(10),
        || {
            let url = url.clone();
            async move { post_raw(&url, chat(false, "now?").to_string()).await.0 == 200 }
        },
    )
    .await
    .unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epp_down_fail_closed_is_an_error_not_a_hang() {
    let mut c = start(ClusterSpec {
        sim: sim_config(2, PodKnobs::default()),
        ..Default::default()
    })
    .await;
    warm(&c).await;
    c.epps[0].kill9().await.unwrap();
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.envoy.url()))
        .timeout(Duration::from_secs(20))
        .json(&chat(false, "is anyone there"))
        .send()
        .await
        .expect("Envoy answers instead of hanging");
    assert!(r.status().is_server_error(), "status {}", r.status());
    eprintln!(
        "fail-closed answer {} after {:?}",
        r.status(),
        started.elapsed()
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_epp_mid_stream_does_not_cut_the_response() {
    let knobs = PodKnobs {
        decode_ms_per_token: 50.0,
        ..PodKnobs::default()
    };
    let mut c = start(ClusterSpec {
        sim: sim_config(2, knobs),
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let mut body = chat(true, "tell me a long story");
    body["max_tokens"] = json!(40);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.envoy.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    // Read until a few content chunks arrived, then kill the EPP.
    while text.matches("\"content\"").count() < 3 {
        let chunk = stream.next().await.expect("stream open").unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    c.epps[0].kill9().await.unwrap();
    while let Some(chunk) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.expect("stream not cut")));
    }
    assert!(text.contains("data: [DONE]"), "stream was cut: {text}");
    let usage_line = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["usage"].is_object())
        .expect("usage chunk");
    assert_eq!(usage_line["usage"]["completion_tokens"], 40);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_open_streams_then_exits() {
    let knobs = PodKnobs {
        decode_ms_per_token: 40.0,
        ..PodKnobs::default()
    };
    let mut c = start(ClusterSpec {
        sim: sim_config(1, knobs),
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let mut body = chat(true, "a slow answer please");
    body["max_tokens"] = json!(30);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.envoy.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.is_empty());

    c.epps[0].terminate().unwrap();
    // While the response streams, the replica reports not ready but keeps running.
    let admin = c.epps[0].addrs.admin;
    wait::until(
        "/readyz to report draining",
        Duration::from_secs(5),
        || async move {
            reqwest::get(format!("http://{admin}/readyz"))
                .await
                .is_ok_and(|r| r.status() == 503)
        },
    )
    .await
    .unwrap();
    let mut text = String::from_utf8_lossy(&first).into_owned();
    while let Some(chunk) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(text.contains("data: [DONE]"), "{text}");
    let status = c.epps[0].wait_exit(Duration::from_secs(20)).await.unwrap();
    assert!(status.success(), "{status}");
    c.shutdown().await;
}

/// Session affinity through Envoy. `session-affinity-filter` (encoded_endpoint_header): the first
/// response carries `x-session-token` = base64(`default/<pod>`) — written by the route from the
/// EPP's dynamic metadata — and every request echoing it goes to that pod; a token naming another
/// pod goes there; an undecodable one is ignored. `session-affinity-scorer` (session_id, weight 10
/// against a queue scorer): each `x-session-id` sticks to the pod its first request went to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_affinity_pins_sessions_to_their_pod() {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let client = reqwest::Client::new();
    let send = |c: &LocalCluster, headers: Vec<(&'static str, String)>| {
        let mut r = client
            .post(format!("{}/v1/chat/completions", c.envoy.url()))
            .json(&chat(false, "hello there"));
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.send()
    };
    let served_by = |r: &reqwest::Response| -> String {
        r.headers()["x-inference-pod"].to_str().unwrap().to_string()
    };

    let filter = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
- type: queue-scorer
- type: active-request-scorer
- type: random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-filter}, {pluginRef: queue-scorer}, {pluginRef: active-request-scorer}, {pluginRef: random-picker}]
";
    let c = start(ClusterSpec {
        sim: sim_config(4, PodKnobs::default()),
        epp_args: vec!["--config-text".into(), filter.into()],
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let first = send(&c, vec![]).await.unwrap();
    assert_eq!(first.status(), 200);
    let pod = served_by(&first);
    let token = first
        .headers()
        .get("x-session-token")
        .expect("the response carries the session token")
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        String::from_utf8(b64.decode(&token).unwrap()).unwrap(),
        format!("default/{pod}")
    );
    for _ in 0..12 {
        let r = send(&c, vec![("x-session-token", token.clone())])
            .await
            .unwrap();
        assert_eq!(served_by(&r), pod, "the session left its pod");
        assert_eq!(r.headers()["x-session-token"], token.as_str());
    }
    let other = c
        .sim
        .pods()
        .into_iter()
        .map(|p| p.name)
        .find(|n| *n != pod)
        .unwrap();
    let r = send(
        &c,
        vec![("x-session-token", b64.encode(format!("ns/{other}")))],
    )
    .await
    .unwrap();
    assert_eq!(served_by(&r), other);
    let r = send(&c, vec![("x-session-token", "%%%not-base64".into())])
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "an undecodable token is ignored");
    c.shutdown().await;

    let scorer = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: session-affinity-scorer, parameters: {strategy: session_id}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-scorer, weight: 10}, {pluginRef: queue-scorer}]
";
    let c = start(ClusterSpec {
        sim: sim_config(4, PodKnobs::default()),
        epp_args: vec!["--config-text".into(), scorer.into()],
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let mut homes = HashMap::new();
    for round in 0..6 {
        for s in ["s1", "s2", "s3"] {
            let r = send(&c, vec![("x-session-id", s.to_string())])
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert!(
                r.headers().get("x-session-token").is_none(),
                "session_id writes nothing back"
            );
            let home = homes.entry(s).or_insert_with(|| served_by(&r));
            assert_eq!(*home, served_by(&r), "session {s} moved in round {round}");
        }
    }
    c.shutdown().await;
}

/// Model rewrite through Envoy: an `InferenceModelRewrite` rule maps the alias `assistant` (which
/// the pods do not serve: 404 without the rule) to `sim-model`; the pod serves it and the client
/// sees `assistant` again in the response, streaming and not. The rewrite header does the same
/// for a request without a rule (a control header: removed before the pod).
/// `llm_d_epp_model_rewrite_decisions` counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewritten_models_are_served_and_restored_in_the_response() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rewrites.yaml");
    std::fs::write(
        &rules,
        "\
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: alias}
spec:
  rules:
  - matches: [{model: {type: Exact, value: assistant}}]
    targets: [{modelRewrite: sim-model, weight: 100}]
",
    )
    .unwrap();
    let c = start(ClusterSpec {
        sim: sim_config(2, PodKnobs::default()),
        epp_args: vec!["--model-rewrites-file".into(), rules.display().to_string()],
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let body = |model: &str, stream: bool| {
        let mut v = chat(stream, "hello there");
        v["model"] = json!(model);
        v
    };

    // Not streaming: served, and the model the client asked for comes back.
    let r = client
        .post(&url)
        .json(&body("assistant", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "assistant", "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    // Streaming: every event names the client's model.
    let r = client
        .post(&url)
        .json(&body("assistant", true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .collect();
    assert!(events.len() >= 2, "{text}");
    for e in &events {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        assert_eq!(v["model"], "assistant", "{e}");
    }
    assert!(text.contains("[DONE]"), "{text}");

    // The header rewrites a model no rule names.
    let r = client
        .post(&url)
        .header("x-llm-d-model-name-rewrite", "sim-model")
        .json(&body("other-alias", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], "other-alias", "{v}");

    // Without a rule or header the alias is unknown to the pods.
    let r = client
        .post(&url)
        .json(&body("other-alias", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let m = c.epps[0].metrics().await.unwrap();
    let rewrites: f64 = m
        .lines()
        .filter(|l| l.starts_with("llm_d_epp_model_rewrite_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(rewrites, 3.0, "{m}");
    c.shutdown().await;
}

/// Served-endpoint correction (GIE protocol v1.0), with Envoy's override_host load balancing (the
/// template's fallback variant): the EPP names a primary and a fallback (`maxNumOfEndpoints: 2`).
/// A conversation's pod dies; Envoy serves its next turn from the fallback and reports that pod
/// in `envoy.lb` metadata on the response path; the EPP records the prompt's blocks for the pod
/// that really served it, so the prefix index stops pointing only at the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_served_request_corrects_the_prefix_index() {
    let config = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: queue-scorer
- {type: max-score-picker, parameters: {maxNumOfEndpoints: 2}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
";
    let c = start(ClusterSpec {
        sim: sim_config(2, PodKnobs::default()),
        epp_args: vec!["--config-text".into(), config.into()],
        fallback_lb: true,
        ..Default::default()
    })
    .await;
    warm(&c).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let long = "the quick brown fox jumps over the lazy dog ".repeat(200);
    let turn = |n: usize| {
        let mut v = chat(false, &long);
        v["messages"][1]["content"] = json!(format!("{long} turn {n}"));
        v
    };
    let pods = c.sim.pods();
    let entries = |v: &Value, hostport: &str| -> u64 {
        v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pod"] == hostport)
            .and_then(|p| p["entries"].as_u64())
            .unwrap_or(0)
    };

    let r = client.post(&url).json(&turn(1)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let home = r.headers()["x-inference-pod"].to_str().unwrap().to_string();
    let home_idx = pods.iter().position(|p| p.name == home).unwrap();
    let other = pods[1 - home_idx].addr.to_string();
    let before = c.epps[0].prefix_index().await.unwrap();
    assert!(
        entries(&before, &pods[home_idx].addr.to_string()) > 0,
        "{before}"
    );
    let other_before = entries(&before, &other);

    // The conversation's pod dies; its next turn still names it first (its metrics are not
    // stale yet), Envoy falls back to the other pod.
    c.sim.crash(home_idx).await.unwrap();
    let r = client.post(&url).json(&turn(2)).send().await.unwrap();
    assert_eq!(r.status(), 200, "the fallback should serve it");
    assert_eq!(
        r.headers()["x-inference-pod"].to_str().unwrap(),
        pods[1 - home_idx].name
    );
    wait::until("the correction", Duration::from_secs(5), || async {
        c.epps[0]
            .prefix_index()
            .await
            .is_ok_and(|v| entries(&v, &other) > other_before + 10)
    })
    .await
    .unwrap();
    let m = c.epps[0].metrics().await.unwrap();
    assert!(
        m.lines()
            .any(|l| l == "llm_d_epp_served_by_fallback_endpoint_total 1"),
        "{m}"
    );
    c.shutdown().await;
}

//! End-to-end tests against real pod servers on OS-chosen ports.

// Helpers outside #[test] fns are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use sim::{KnobsPatch, PodKnobs, Sim, SimConfig, SimError};

async fn start(pods: usize, knobs: PodKnobs) -> Sim {
    Sim::start(SimConfig {
        pods,
        knobs,
        admin: Some(0),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn fast() -> PodKnobs {
    PodKnobs {
        time_scale: 0.01,
        ..PodKnobs::default()
    }
}

fn url(sim: &Sim, pod: usize, path: &str) -> String {
    format!("http://{}{}", sim.pods()[pod].addr, path)
}

fn words(prefix: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{prefix}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Polls `cond` until it holds or `timeout` passes.
async fn wait_for<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// Value of the first sample of `name` in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
}

struct Streamed {
    ttft: Duration,
    events: Vec<String>,
    headers: reqwest::header::HeaderMap,
}

async fn stream_chat(client: &reqwest::Client, url: &str, body: Value) -> Streamed {
    use futures::StreamExt;
    let start = Instant::now();
    let resp = client.post(url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    let mut s = resp.bytes_stream();
    let mut buf = String::new();
    let mut ttft = None;
    while let Some(c) = s.next().await {
        buf.push_str(std::str::from_utf8(&c.unwrap()).unwrap());
        if ttft.is_none() && buf.contains("\"content\":\"") && buf.matches("data: ").count() >= 2 {
            ttft = Some(start.elapsed());
        }
    }
    let events = buf
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap().to_owned())
        .collect();
    Streamed {
        ttft: ttft.unwrap(),
        events,
        headers,
    }
}

async fn chat(client: &reqwest::Client, url: &str, body: Value) -> Value {
    let resp = client.post(url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test]
async fn repeated_prompt_hits_the_cache_and_is_faster() {
    let sim = start(
        1,
        PodKnobs {
            prefill_overhead_ms: 0.0,
            prefill_us_per_token: 2000.0,
            time_scale: 0.05,
            ..PodKnobs::default()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let u = url(&sim, 0, "/v1/chat/completions");
    // ~1000 tokens: 100 ms of simulated prefill uncached, ~0 when cached.
    let body = json!({
        "messages": [{"role": "user", "content": words("prompt", 1000)}],
        "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true},
    });
    let first = stream_chat(&client, &u, body.clone()).await;
    let second = stream_chat(&client, &u, body).await;
    let usage = |s: &Streamed| -> Value {
        let v: Value = serde_json::from_str(&s.events[s.events.len() - 2]).unwrap();
        v["usage"].clone()
    };
    assert_eq!(usage(&first)["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = usage(&second)["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = usage(&second)["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt, "cached {cached} of {prompt}");
    assert!(
        second.ttft < first.ttft,
        "cached ttft {:?} should beat {:?}",
        second.ttft,
        first.ttft
    );

    let other = chat(
        &client,
        &u,
        json!({"messages": [{"role": "user", "content": words("other", 200)}]}),
    )
    .await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let s = sim.stats(0);
    assert_eq!(s.served, 3);
    assert_eq!(s.prefix_hits_tokens, cached);
    sim.shutdown().await;
}

#[tokio::test]
async fn one_slot_makes_requests_wait_and_metrics_show_it() {
    let sim = start(
        1,
        PodKnobs {
            max_num_seqs: 1,
            decode_ms_per_token: 50.0,
            ..PodKnobs::default()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let u = url(&sim, 0, "/v1/completions");
    let mut set = tokio::task::JoinSet::new();
    for i in 0..3 {
        let (client, u) = (client.clone(), u.clone());
        set.spawn(async move {
            let body = json!({"prompt": words(&format!("r{i}x"), 20), "max_tokens": 10});
            client.post(&u).json(&body).send().await.unwrap().status()
        });
    }
    assert!(
        wait_for(Duration::from_secs(5), || async {
            let s = sim.stats(0);
            s.running == 1 && s.waiting >= 1
        })
        .await,
        "never saw a queued request: {:?}",
        sim.stats(0)
    );
    let text = client
        .get(url(&sim, 0, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metric(&text, "vllm:num_requests_waiting") >= 1.0);
    assert_eq!(metric(&text, "vllm:num_requests_running"), 1.0);
    assert!(metric(&text, "vllm:kv_cache_usage_perc") > 0.0);
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    let s = sim.stats(0);
    assert_eq!((s.served, s.running, s.waiting, s.kv_usage), (3, 0, 0, 0.0));
    sim.shutdown().await;
}

#[tokio::test]
async fn metrics_text_matches_stats() {
    let sim = start(1, fast()).await;
    let client = reqwest::Client::new();
    let u = url(&sim, 0, "/v1/chat/completions");
    let body = json!({"messages": [{"role": "user", "content": words("m", 100)}], "max_tokens": 3});
    chat(&client, &u, body.clone()).await;
    chat(&client, &u, body).await;
    let text = client
        .get(url(&sim, 0, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let s = sim.stats(0);
    assert!(s.prefix_hits_tokens > 0);
    assert!(text.contains("# TYPE vllm:num_requests_running gauge"));
    assert!(text.contains("model_name=\"sim-model\",engine=\"0\""));
    assert_eq!(metric(&text, "vllm:num_requests_running"), s.running as f64);
    assert_eq!(metric(&text, "vllm:num_requests_waiting"), s.waiting as f64);
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), s.kv_usage);
    assert_eq!(
        metric(&text, "vllm:prefix_cache_queries_total"),
        s.prefix_queries_tokens as f64
    );
    assert_eq!(
        metric(&text, "vllm:prefix_cache_hits_total"),
        s.prefix_hits_tokens as f64
    );
    assert_eq!(
        metric(&text, "vllm:prompt_tokens_total"),
        s.prompt_tokens as f64
    );
    assert_eq!(metric(&text, "vllm:generation_tokens_total"), 6.0);
    assert_eq!(metric(&text, "vllm:request_success_total"), 2.0);
    assert_eq!(metric(&text, "vllm:cache_config_info"), 1.0);
    assert!(text.contains("block_size=\"16\"") && text.contains("num_gpu_blocks=\"4096\""));
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_and_non_streaming_shapes() {
    let sim = start(2, fast()).await;
    let client = reqwest::Client::new();
    let u = url(&sim, 1, "/v1/chat/completions");
    let s = stream_chat(
        &client,
        &u,
        json!({
            "model": "sim-model",
            "messages": [{"role": "system", "content": "hi you"},
                         {"role": "user", "content": [{"type": "text", "text": "what now"}]}],
            "max_completion_tokens": 4, "max_tokens": 9,
            "stream": true, "stream_options": {"include_usage": true},
        }),
    )
    .await;
    assert_eq!(s.headers["content-type"], "text/event-stream");
    assert_eq!(s.headers["x-inference-pod"], "sim-1");
    assert_eq!(
        s.headers["x-inference-port"],
        sim.pods()[1].addr.port().to_string().as_str()
    );
    let ev = &s.events;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // role chunk + 4 token chunks + finish chunk + usage chunk
    assert_eq!(chunks.len(), 7);
    let text: String = chunks[1..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text.split_whitespace().count(), 4);
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    let usage_chunk = &chunks[6];
    assert_eq!(usage_chunk["choices"], json!([]));
    // role + 2 words, role + 2 words
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], 6);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 4);
    assert_eq!(usage_chunk["usage"]["total_tokens"], 10);

    // No stream_options: no usage chunk.
    let s = stream_chat(
        &client,
        &u,
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": true}),
    )
    .await;
    assert!(s.events.iter().all(|e| !e.contains("\"usage\"")));
    assert_eq!(s.events.last().unwrap(), "[DONE]");

    let resp = client
        .post(url(&sim, 0, "/v1/completions"))
        .json(&json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-inference-pod"], "sim-0");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 8);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split(' ').count(),
        3
    );

    let v = chat(
        &client,
        &u,
        json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    let models: Value = client
        .get(url(&sim, 0, "/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "sim-model");
    let health = client.get(url(&sim, 0, "/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    sim.shutdown().await;
}

#[tokio::test]
async fn chunked_body_works_and_bad_requests_are_400() {
    let sim = start(1, fast()).await;
    let client = reqwest::Client::new();
    let u = url(&sim, 0, "/v1/chat/completions");
    let pieces: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from_static(br#"{"messages":[{"role":"user","#)),
        Ok(Bytes::from_static(br#""content":"abcd efgh ijkl"}],"#)),
        Ok(Bytes::from_static(br#""max_tokens":2}"#)),
    ];
    let resp = client
        .post(&u)
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(pieces)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 1 + 3);

    let resp = client.post(&u).body("{not json").send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["x-inference-pod"], "sim-0");
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("invalid"));
    assert_eq!(v["error"]["code"], 400);

    let resp = client
        .post(&u)
        .json(&json!({"messages": [], "stream": false, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = client
        .post(url(&sim, 0, "/v1/completions"))
        .json(&json!({"max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(sim.stats(0).errors, 3);
    assert_eq!(sim.stats(0).served, 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn error_rate_injects_500s() {
    let sim = start(
        1,
        PodKnobs {
            error_rate: 1.0,
            ..fast()
        },
    )
    .await;
    let resp = reqwest::Client::new()
        .post(url(&sim, 0, "/v1/completions"))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 500);
    assert_eq!(sim.stats(0).errors, 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn admin_api_and_knobs() {
    let sim = start(2, fast()).await;
    let client = reqwest::Client::new();
    let admin = format!("http://{}", sim.admin_addr().unwrap());
    let pods: Value = client
        .get(format!("{admin}/pods"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(pods.as_array().unwrap().len(), 2);
    assert_eq!(pods[1]["name"], "sim-1");
    assert_eq!(pods[1]["port"], sim.pods()[1].addr.port());
    assert_eq!(pods[0]["knobs"]["max_num_seqs"], 8);

    let resp = client
        .post(format!("{admin}/pods/1/knobs"))
        .json(&json!({"max_num_seqs": 2, "extra_latency_ms": 5.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(sim.knobs(1).unwrap().max_num_seqs, 2);
    assert_eq!(sim.knobs(0).unwrap().max_num_seqs, 8);
    let resp = client
        .post(format!("{admin}/pods/1/knobs"))
        .json(&json!({"block_size": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = client
        .post(format!("{admin}/pods/9/knobs"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    let yaml = client
        .get(format!("{admin}/pods.yaml"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(yaml, sim.pods_yaml());
    let p0 = sim.pods()[0].addr.port();
    assert!(yaml.starts_with(&format!(
        "pods:\n  - name: sim-0\n    address: 127.0.0.1\n    port: {p0}\n    labels:\n      llm-d.ai/engine-type: vllm\n  - name: sim-1\n"
    )));

    assert!(matches!(
        sim.set_knobs(5, &KnobsPatch::default()),
        Err(SimError::NoSuchPod { index: 5, pods: 2 })
    ));
    let bad = KnobsPatch {
        error_rate: Some(2.0),
        ..KnobsPatch::default()
    };
    assert!(matches!(
        sim.set_knobs(0, &bad),
        Err(SimError::InvalidKnob {
            field: "error_rate",
            ..
        })
    ));

    let addr = sim.pods()[0].addr;
    sim.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn small_kv_capacity_evicts_old_prompts() {
    let sim = start(
        1,
        PodKnobs {
            kv_blocks: 16,
            ..fast()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let u = url(&sim, 0, "/v1/completions");
    // Each prompt is 160 tokens = 10 blocks; 16 blocks hold only one of them.
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let a = json!({"prompt": words("a", 160), "max_tokens": 1});
    let b = json!({"prompt": words("b", 160), "max_tokens": 1});
    chat(&client, &u, a.clone()).await;
    assert_eq!(cached(&chat(&client, &u, a.clone()).await), 144);
    chat(&client, &u, b).await;
    // While b ran it held 11 blocks (10 prompt + 1 decode), leaving room for 5 of a's: a's tail
    // blocks were evicted first, so only its first 5 blocks still hit.
    assert_eq!(cached(&chat(&client, &u, a).await), 80);
    assert!(sim.stats(0).cached_blocks <= 16);
    sim.shutdown().await;
}

#[tokio::test]
async fn config_is_validated_before_binding() {
    let err = Sim::start(SimConfig {
        pods: 0,
        ..SimConfig::default()
    })
    .await
    .unwrap_err();
    assert!(matches!(err, SimError::InvalidConfig(_)));
}

#[tokio::test]
async fn pod_overrides_make_a_heterogeneous_pool() {
    let slow: sim::PodOverride = r#"1={"kv_blocks":512,"time_scale":1.0}"#.parse().unwrap();
    let sim = Sim::start(SimConfig {
        pods: 3,
        knobs: PodKnobs {
            time_scale: 0.1,
            ..PodKnobs::default()
        },
        pod_knobs: vec![slow],
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let mut ttft = Vec::new();
    for pod in 0..3 {
        let text = client
            .get(url(&sim, pod, "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let blocks = if pod == 1 { 512 } else { 4096 };
        assert!(
            text.contains(&format!("num_gpu_blocks=\"{blocks}\"")),
            "pod {pod} shows the wrong cache:\n{text}"
        );
        // The same cold prompt on each pod: the overridden pod is 10× slower
        // (~42 ms against ~4 ms of simulated prefill).
        let body = json!({"model": "sim-model", "prompt": words("het", 2000), "max_tokens": 1});
        let t = Instant::now();
        chat(&client, &url(&sim, pod, "/v1/completions"), body).await;
        ttft.push(t.elapsed());
    }
    assert!(
        ttft[1] > ttft[0] * 3 && ttft[1] > ttft[2] * 3,
        "pod 1 should be slower: {ttft:?}"
    );
    sim.shutdown().await;

    let err = Sim::start(SimConfig {
        pods: 2,
        pod_knobs: vec!["2={}".parse().unwrap()],
        ..SimConfig::default()
    })
    .await
    .unwrap_err();
    assert!(matches!(err, SimError::InvalidConfig(_)), "{err}");
    let err = Sim::start(SimConfig {
        pods: 2,
        pod_knobs: vec![r#"0={"max_num_seqs":0}"#.parse().unwrap()],
        ..SimConfig::default()
    })
    .await
    .unwrap_err();
    assert!(matches!(err, SimError::InvalidKnob { .. }), "{err}");
}

#[tokio::test]
async fn reset_prefix_cache_makes_a_repeat_cold_and_destination_is_echoed() {
    let sim = start(1, fast()).await;
    let client = reqwest::Client::new();
    let body = json!({"model": "sim-model", "prompt": words("reset", 200), "max_tokens": 1});
    chat(&client, &url(&sim, 0, "/v1/completions"), body.clone()).await;
    let warm = chat(&client, &url(&sim, 0, "/v1/completions"), body.clone()).await;
    assert!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    let r = client
        .post(url(&sim, 0, "/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cold = chat(&client, &url(&sim, 0, "/v1/completions"), body.clone()).await;
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // The library call does the same.
    sim.reset_prefix_caches();
    let cold = chat(&client, &url(&sim, 0, "/v1/completions"), body.clone()).await;
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let r = client
        .post(url(&sim, 0, "/v1/completions"))
        .header("x-gateway-destination-endpoint", "10.1.2.3:8000")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-sim-received-destination"], "10.1.2.3:8000");
    sim.shutdown().await;
}

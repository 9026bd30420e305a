//! The wider API surface (embeddings, Anthropic messages, tokenize/render, LoRA, P/D) and fault
//! injection, against real pod servers on OS-chosen ports.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use sim::{KnobsPatch, MetricsFault, PodKnobs, Sim, SimConfig};

fn fast() -> PodKnobs {
    PodKnobs {
        time_scale: 0.01,
        ..PodKnobs::default()
    }
}

async fn start_cfg(cfg: SimConfig) -> Sim {
    Sim::start(SimConfig {
        admin: Some(0),
        ..cfg
    })
    .await
    .unwrap()
}

async fn start(pods: usize, knobs: PodKnobs) -> Sim {
    start_cfg(SimConfig {
        pods,
        knobs,
        ..SimConfig::default()
    })
    .await
}

fn url(sim: &Sim, pod: usize, path: &str) -> String {
    format!("http://{}{}", sim.pods()[pod].addr, path)
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(url)
        .json(&body)
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

async fn get_text(url: &str) -> (u16, String) {
    let resp = reqwest::get(url).await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

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

fn words(prefix: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{prefix}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn embeddings_tokenize_render_and_batched_completions() {
    let sim = start(1, fast()).await;
    let (s, v) = post(
        &url(&sim, 0, "/v1/embeddings"),
        json!({"model": "sim-model", "input": ["hello world", "x"], "dimensions": 8}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][1]["index"], 1);
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 8);
    // "hell" "o" "worl" "d" + "x"
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    let (_, b) = post(
        &url(&sim, 0, "/v1/embeddings"),
        json!({"input": [[1, 2, 3]], "encoding_format": "base64", "dimensions": 4}),
    )
    .await;
    // 4 floats = 16 bytes = 24 base64 characters.
    assert_eq!(b["data"][0]["embedding"].as_str().unwrap().len(), 24);
    let (s, _) = post(&url(&sim, 0, "/v1/embeddings"), json!({"input": 5})).await;
    assert_eq!(s, 400);

    let msgs = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]);
    let (s, tok) = post(
        &url(&sim, 0, "/tokenize"),
        json!({"messages": msgs, "return_token_strs": true}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(tok["count"], 9);
    assert_eq!(tok["token_strs"][0], "<|system|>");
    assert_eq!(tok["max_model_len"], 131072);
    let (_, render) = post(
        &url(&sim, 0, "/v1/chat/completions/render"),
        json!({"model": "sim-model", "messages": msgs, "max_tokens": 7, "cache_salt": "s"}),
    )
    .await;
    assert_eq!(render["token_ids"], tok["tokens"]);
    assert_eq!(render["sampling_params"]["max_tokens"], 7);
    assert_eq!(render["cache_salt"], "s");
    let (_, tok_p) = post(&url(&sim, 0, "/tokenize"), json!({"prompt": "abc defgh"})).await;
    assert_eq!(tok_p["count"], 3);
    assert!(tok_p.get("token_strs").is_none());
    let (_, renders) = post(
        &url(&sim, 0, "/v1/completions/render"),
        json!({"prompt": ["abc defgh", "q"]}),
    )
    .await;
    assert_eq!(renders.as_array().unwrap().len(), 2);
    assert_eq!(renders[0]["token_ids"], tok_p["tokens"]);
    assert_ne!(renders[0]["request_id"], renders[1]["request_id"]);
    let (s, _) = post(&url(&sim, 0, "/tokenize"), json!({})).await;
    assert_eq!(s, 400);

    // A list prompt is a batch: one choice per prompt, usage summed.
    let (s, v) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": ["one two", "three"], "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["usage"]["prompt_tokens"], 2 + 2);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (s, v) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 1, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s, 200);
    let text = v.as_str().unwrap();
    assert!(text.contains("\"index\":1"));
    assert!(text.contains("\"prompt_tokens\":5"));
    assert!(text.ends_with("data: [DONE]\n\n"));
    // `continuous_usage_stats`: every chunk carries the usage so far.
    let usage_per_chunk = |max_tokens: u32| {
        let sim = &sim;
        async move {
            let (s, v) = post(
                &url(sim, 0, "/v1/chat/completions"),
                json!({"messages": [{"role": "user", "content": "a b c"}],
                       "max_tokens": max_tokens, "stream": true,
                       "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
            )
            .await;
            assert_eq!(s, 200);
            v.as_str()
                .unwrap()
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| {
                    let c: Value = serde_json::from_str(d).unwrap();
                    c["usage"]["completion_tokens"].as_u64().unwrap()
                })
                .collect::<Vec<u64>>()
        }
    };
    // The role chunk, three tokens, the finish chunk, the usage chunk.
    assert_eq!(usage_per_chunk(3).await, [0, 1, 2, 3, 3, 3]);
    // `stream_interval`: two tokens a chunk, and the last one alone.
    sim.set_knobs(
        0,
        &KnobsPatch {
            stream_interval: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(usage_per_chunk(5).await, [0, 2, 4, 5, 5, 5]);

    let (s, v) = post(
        &url(&sim, 0, "/v1/chat/completions"),
        json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(s, 404);
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
    let garbage = reqwest::Client::new()
        .post(url(&sim, 0, "/v1/embeddings"))
        .body(vec![0xffu8, 0, 1, 2])
        .send()
        .await
        .unwrap();
    assert_eq!(garbage.status(), 400);
    sim.shutdown().await;
}

#[tokio::test]
async fn anthropic_messages_answer_and_stream_in_order() {
    let sim = start(1, fast()).await;
    let u = url(&sim, 0, "/v1/messages");
    let body = json!({
        "model": "sim-model", "max_tokens": 3,
        "system": [{"type": "text", "text": words("sys", 40)}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
    });
    let (s, v) = post(&u, body.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(
        v["content"][0]["text"].as_str().unwrap().split(' ').count(),
        3
    );
    // system role token + 40 words (some are two pieces) + user role token + 2 words.
    let first_input = v["usage"]["input_tokens"].as_u64().unwrap();
    assert!(first_input > 44);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 0);
    assert_eq!(v["usage"]["output_tokens"], 3);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(&u)
        .json(&sbody)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (ev, data) = e.split_once('\n').unwrap();
            let name = ev.strip_prefix("event: ").unwrap().to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    // The repeat hits the prefix cache.
    let usage = &events[0].1["message"]["usage"];
    let cached = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached > 0);
    assert_eq!(
        usage["input_tokens"].as_u64().unwrap() + cached,
        first_input
    );
    assert_eq!(events[3].1["delta"]["type"], "text_delta");
    assert_eq!(events[7].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(events[7].1["usage"]["output_tokens"], 3);

    let (s, v) = post(&u, json!({"messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    sim.shutdown().await;
}

fn lora_series(metrics: &str) -> Vec<(String, String, String, f64)> {
    let label = |l: &str, name: &str| {
        let key = format!("{name}=\"");
        let start = l.find(&key).unwrap() + key.len();
        l[start..start + l[start..].find('"').unwrap()].to_owned()
    };
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .map(|l| {
            (
                label(l, "max_lora"),
                label(l, "running_lora_adapters"),
                label(l, "waiting_lora_adapters"),
                l.rsplit(' ').next().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

/// The newest series (largest timestamp), as a consumer reads it.
fn newest(metrics: &str) -> (String, String, String) {
    let s = lora_series(metrics);
    let best = s
        .iter()
        .max_by(|a, b| a.3.total_cmp(&b.3))
        .expect("no lora_requests_info");
    (best.0.clone(), best.1.clone(), best.2.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_slots_swap_cost_and_requests_info() {
    let sim = start_cfg(SimConfig {
        pods: 1,
        knobs: PodKnobs {
            max_loras: 1,
            lora_load_ms: 150.0,
            prefill_overhead_ms: 0.0,
            decode_ms_per_token: 10.0,
            ..PodKnobs::default()
        },
        lora_adapters: vec![("alpha".into(), "/a/alpha".into())],
        ..SimConfig::default()
    })
    .await;
    let models: Value = reqwest::get(url(&sim, 0, "/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][1]["id"], "alpha");
    assert_eq!(models["data"][1]["parent"], "sim-model");
    assert_eq!(models["data"][1]["root"], "/a/alpha");

    // Runtime load; duplicates and unknowns are refused like vLLM.
    let client = reqwest::Client::new();
    let load = |name: &str| {
        client
            .post(url(&sim, 0, "/v1/load_lora_adapter"))
            .json(&json!({"lora_name": name, "lora_path": format!("/a/{name}")}))
            .send()
    };
    let r = load("beta").await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("beta"));
    assert_eq!(load("beta").await.unwrap().status(), 400);
    let (s, _) = post(
        &url(&sim, 0, "/v1/unload_lora_adapter"),
        json!({"lora_name": "gamma"}),
    )
    .await;
    assert_eq!(s, 404);

    let (_, m) = get_text(&url(&sim, 0, "/metrics")).await;
    assert_eq!(newest(&m), ("1".into(), "".into(), "".into()));

    // First use of an adapter pays the swap-in cost; a resident one does not.
    let send_gen = |model: &'static str, max_tokens: u32| {
        let u = url(&sim, 0, "/v1/completions");
        async move {
            let t = Instant::now();
            let (s, _) = post(
                &u,
                json!({"model": model, "prompt": "a b c", "max_tokens": max_tokens}),
            )
            .await;
            assert_eq!(s, 200);
            t.elapsed()
        }
    };
    let cold = send_gen("alpha", 1).await;
    let warm = send_gen("alpha", 1).await;
    assert!(cold >= Duration::from_millis(150), "{cold:?}");
    assert!(warm < Duration::from_millis(150), "{warm:?}");
    assert_eq!(sim.stats(0).lora_loads, 1);

    // One slot: beta waits while alpha runs.
    let long = tokio::spawn(send_gen("alpha", 40));
    assert!(
        wait_for(Duration::from_secs(5), || async {
            sim.stats(0).lora_running == ["alpha"]
        })
        .await
    );
    let queued = tokio::spawn(send_gen("beta", 1));
    assert!(
        wait_for(Duration::from_secs(5), || async {
            sim.stats(0).lora_waiting == ["beta"]
        })
        .await,
        "{:?}",
        sim.stats(0)
    );
    let (_, m) = get_text(&url(&sim, 0, "/metrics")).await;
    assert_eq!(newest(&m), ("1".into(), "alpha".into(), "beta".into()));
    long.await.unwrap();
    queued.await.unwrap();
    let s = sim.stats(0);
    assert_eq!(s.lora_resident, ["beta"]);
    assert_eq!(s.lora_loads, 2);
    let (_, m) = get_text(&url(&sim, 0, "/metrics")).await;
    assert_eq!(newest(&m), ("1".into(), "".into(), "".into()));
    // Old combinations stay as separate series.
    assert!(lora_series(&m).len() >= 3);

    // Unloaded adapters are unknown models.
    let (s, _) = post(
        &url(&sim, 0, "/v1/unload_lora_adapter"),
        json!({"lora_name": "beta"}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"model": "beta", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, 404);
    assert!(sim.stats(0).lora_resident.is_empty());
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_and_metrics_faults_hit_one_pod_only() {
    let sim = start(2, fast()).await;
    let admin = format!("http://{}", sim.admin_addr().unwrap());
    let (s, _) = post(&format!("{admin}/pods/0/knobs"), json!({"stall": true})).await;
    assert_eq!(s, 200);
    let u = url(&sim, 0, "/v1/completions");
    let stalled = tokio::spawn(async move { post(&u, json!({"prompt": "x y z"})).await });
    assert!(
        wait_for(Duration::from_secs(5), || async {
            sim.stats(0).waiting == 1
        })
        .await,
        "stalled request should wait"
    );
    // The other pod serves; the stalled one still answers /metrics.
    let (s, _) = post(&url(&sim, 1, "/v1/completions"), json!({"prompt": "x"})).await;
    assert_eq!(s, 200);
    let (s, m) = get_text(&url(&sim, 0, "/metrics")).await;
    assert_eq!(s, 200);
    assert!(m.contains("vllm:num_requests_waiting{model_name=\"sim-model\",engine=\"0\"} 1.0"));
    assert!(!stalled.is_finished());
    sim.set_knobs(
        0,
        &KnobsPatch {
            stall: Some(false),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(stalled.await.unwrap().0, 200);

    for (fault, status) in [(MetricsFault::Error, 500), (MetricsFault::Garbage, 200)] {
        sim.set_knobs(
            1,
            &KnobsPatch {
                metrics_fault: Some(fault),
                ..Default::default()
            },
        )
        .unwrap();
        let (s, text) = get_text(&url(&sim, 1, "/metrics")).await;
        assert_eq!(s, status);
        assert!(!text.contains("vllm:num_requests_running{model_name"));
        let (s, text) = get_text(&url(&sim, 0, "/metrics")).await;
        assert_eq!(s, 200);
        assert!(text.contains("vllm:num_requests_running{model_name"));
    }
    // Hang: the scrape times out until the fault is lifted.
    let (s, _) = post(
        &format!("{admin}/pods/1/knobs"),
        json!({"metrics_fault": "hang"}),
    )
    .await;
    assert_eq!(s, 200);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    assert!(
        client
            .get(url(&sim, 1, "/metrics"))
            .send()
            .await
            .unwrap_err()
            .is_timeout()
    );
    // Slow: every pod at once through POST /knobs.
    let (s, v) = post(
        &format!("{admin}/knobs"),
        json!({"metrics_fault": "none", "metrics_delay_ms": 120.0}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["pods"], 2);
    let t = Instant::now();
    let (s, _) = get_text(&url(&sim, 1, "/metrics")).await;
    assert_eq!(s, 200);
    assert!(t.elapsed() >= Duration::from_millis(120));
    let (s, _) = post(&format!("{admin}/knobs"), json!({"error_rate": 3.0})).await;
    assert_eq!(s, 400);
    assert_eq!(sim.knobs(0).unwrap().error_rate, 0.0);
    let (s, _) = post(&format!("{admin}/knobs"), json!("garbage")).await;
    assert_eq!(s, 400);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_cuts_one_pod_and_restart_rebinds_the_same_port() {
    let sim = start(
        2,
        PodKnobs {
            decode_ms_per_token: 20.0,
            ..PodKnobs::default()
        },
    )
    .await;
    let admin = format!("http://{}", sim.admin_addr().unwrap());
    let (s, _) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": words("w", 40), "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(sim.stats(0).served, 1);

    // A stream is open when the pod crashes: the client sees the connection cut.
    let resp = reqwest::Client::new()
        .post(url(&sim, 0, "/v1/completions"))
        .json(&json!({"prompt": "long one", "max_tokens": 500, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    assert!(body.next().await.unwrap().is_ok());
    let (s, v) = post(&format!("{admin}/pods/0/crash"), json!({})).await;
    assert_eq!((s, &v["up"]), (200, &json!(false)));
    let mut cut = false;
    while let Some(chunk) = body.next().await {
        if chunk.is_err() {
            cut = true;
            break;
        }
    }
    assert!(cut, "the open stream must be cut, not finished");
    assert!(!sim.is_up(0));
    let addr = sim.pods()[0].addr;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    let (s, _) = post(&url(&sim, 1, "/v1/completions"), json!({"prompt": "x"})).await;
    assert_eq!(s, 200);
    assert_eq!(sim.stats(0).running, 0);

    let (s, v) = post(&format!("{admin}/pods/0/restart"), json!({})).await;
    assert_eq!((s, &v["up"]), (200, &json!(true)));
    assert!(sim.is_up(0));
    let fresh = sim.stats(0);
    assert_eq!(
        (fresh.served, fresh.cached_blocks, fresh.restarts),
        (0, 0, 1)
    );
    let (s, v) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": words("w", 40), "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    // The cache did not survive the crash.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Library API too, and unknown pods are 404.
    sim.restart(1).await.unwrap();
    assert_eq!(sim.stats(1).restarts, 1);
    let (s, _) = post(&format!("{admin}/pods/7/crash"), json!({})).await;
    assert_eq!(s, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn prefill_decode_roles_and_kv_transfer_params_round_trip() {
    let sim = start_cfg(SimConfig {
        pods: 3,
        prefill_pods: 1,
        decode_pods: 1,
        knobs: PodKnobs {
            prefill_overhead_ms: 0.0,
            prefill_us_per_token: 1000.0,
            ..PodKnobs::default()
        },
        ..SimConfig::default()
    })
    .await;
    let yaml = sim.pods_yaml();
    assert!(yaml.contains("name: sim-0\n    address: 127.0.0.1\n"));
    assert!(
        yaml.contains("llm-d.ai/engine-type: vllm\n      llm-d.ai/role: prefill\n  - name: sim-1")
    );
    assert!(yaml.contains("llm-d.ai/role: decode\n  - name: sim-2"));
    assert_eq!(yaml.matches("llm-d.ai/role").count(), 2);
    assert_eq!(yaml.matches("llm-d.ai/engine-type: vllm").count(), 3);

    let prompt = words("pd", 150);
    let (s, p) = post(
        &url(&sim, 0, "/v1/completions"),
        json!({"prompt": prompt, "max_tokens": 20, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(p["choices"][0]["finish_reason"], "remote_decode");
    assert_eq!(p["usage"]["completion_tokens"], 1);
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_port"], sim.pods()[0].addr.port());
    assert!(!params["remote_block_ids"].as_array().unwrap().is_empty());

    let timed = |pod: usize, body: Value| {
        let u = url(&sim, pod, "/v1/completions");
        async move {
            let t = Instant::now();
            let (s, v) = post(&u, body).await;
            assert_eq!(s, 200);
            (t.elapsed(), v)
        }
    };
    let (decode, d) = timed(
        1,
        json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(d["usage"]["completion_tokens"], 2);
    assert_eq!(d["choices"][0]["finish_reason"], "length");
    // Same cold prompt on a pod that must prefill it: ~200 ms of simulated prefill.
    let (full, _) = timed(2, json!({"prompt": prompt, "max_tokens": 2})).await;
    assert!(decode < full, "decode leg {decode:?} vs full {full:?}");
    assert!(full >= Duration::from_millis(150));
    sim.shutdown().await;
}

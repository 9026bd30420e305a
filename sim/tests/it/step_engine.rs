//! The step model (`engine: step`) through the pods' HTTP API: every request gets its tokens
//! while the batch is short of KV blocks, the pressure shows in `/metrics` as vLLM shows it, and
//! a client that leaves gives its blocks back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;
use sim::{EngineModel, PodKnobs, Sim, SimConfig};

async fn start(knobs: PodKnobs) -> Sim {
    Sim::start(SimConfig {
        pods: 1,
        knobs,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn words(prefix: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{prefix}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Value of the first sample of `name` in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
}

async fn scrape(client: &reqwest::Client, pod: std::net::SocketAddr) -> String {
    let resp = client.get(format!("http://{pod}/metrics")).send().await;
    resp.unwrap().text().await.unwrap()
}

/// The content chunks of one streamed chat completion.
async fn stream_tokens(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_tokens: u32,
) -> usize {
    let body = json!({"model": "sim-model", "stream": true, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": prompt}]});
    let resp = client.post(url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut s = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(c) = s.next().await {
        buf.push_str(std::str::from_utf8(&c.unwrap()).unwrap());
    }
    assert!(buf.contains("data: [DONE]"), "{buf}");
    buf.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count()
}

fn step_knobs() -> PodKnobs {
    PodKnobs {
        engine: EngineModel::Step,
        // 40 blocks of 16 tokens: a few of the prompts below at once, not all of them.
        kv_blocks: 40,
        max_num_seqs: 16,
        max_num_batched_tokens: 256,
        time_scale: 0.2,
        ..PodKnobs::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_its_tokens_while_kv_blocks_run_short() {
    let sim = start(step_knobs()).await;
    let client = reqwest::Client::new();
    let pod = sim.pods()[0].addr;
    let url = format!("http://{pod}/v1/chat/completions");
    let mut set = tokio::task::JoinSet::new();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for i in 0..10 {
        let (client, url, done) = (client.clone(), url.clone(), done.clone());
        set.spawn(async move {
            let n = stream_tokens(&client, &url, &words(&format!("r{i}w"), 60), 48).await;
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            n
        });
    }
    // The queue and the KV pressure as a scraper sees them.
    let (mut waited, mut full) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.load(std::sync::atomic::Ordering::Relaxed) < 10 && Instant::now() < deadline {
        let text = scrape(&client, pod).await;
        waited |= metric(&text, "vllm:num_requests_waiting") >= 1.0;
        full |= metric(&text, "vllm:kv_cache_usage_perc") >= 0.9;
        if waited && full {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while let Some(n) = set.join_next().await {
        assert_eq!(n.unwrap(), 48, "a request lost or repeated tokens");
    }
    assert!(waited, "no request ever waited for KV blocks");
    assert!(full, "the KV cache never filled");
    let text = scrape(&client, pod).await;
    assert!(
        metric(&text, "vllm:num_preemptions_total") >= 1.0,
        "decodes outgrew the blocks without a preemption"
    );
    // vLLM's histograms count every request (and every gap between two tokens).
    assert_eq!(
        metric(&text, "vllm:time_to_first_token_seconds_count"),
        10.0
    );
    assert_eq!(
        metric(&text, "vllm:inter_token_latency_seconds_count"),
        10.0 * 47.0
    );
    assert_eq!(
        metric(&text, "vllm:e2e_request_latency_seconds_count"),
        10.0
    );
    assert_eq!(
        metric(&text, "vllm:request_generation_tokens_sum"),
        10.0 * 48.0
    );
    assert_eq!(metric(&text, "vllm:request_queue_time_seconds_count"), 10.0);
    assert!(
        metric(&text, "vllm:request_queue_time_seconds_sum") > 0.0,
        "the requests that waited for blocks show no queue time"
    );
    let s = sim.stats(0);
    assert_eq!((s.served, s.running, s.waiting), (10, 0, 0));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_gives_its_blocks_back() {
    let sim = start(PodKnobs {
        kv_blocks: 4096,
        time_scale: 1.0,
        ..step_knobs()
    })
    .await;
    let client = reqwest::Client::new();
    let pod = sim.pods()[0].addr;
    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 5000,
                      "messages": [{"role": "user", "content": words("w", 100)}]});
    let resp = client
        .post(format!("http://{pod}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut s = resp.bytes_stream();
    for _ in 0..5 {
        s.next().await.unwrap().unwrap();
    }
    let busy = sim.stats(0);
    assert_eq!(busy.running, 1);
    assert!(busy.kv_usage > 0.0);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = sim.stats(0);
        if st.running == 0 && st.kv_usage == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the blocks stayed held: {st:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sim.shutdown().await;
}

//! End to end through Envoy: precise prefix-cache routing from the pods' own KV events.
//!
//! Eight simulated pods publish KV events (vLLM's wire format over ZMQ) and hold little KV cache,
//! so their engines evict while a multi-turn workload runs. The EPP (`precise-prefix-cache-producer`
//! with its default `vllm_http` token producer: the pods' render endpoints) predicts, per request,
//! how many prompt tokens the chosen pod has cached; the pods report what they actually had
//! (`usage.prompt_tokens_details.cached_tokens`). Acceptance: the predictions match within 2%
//! summed over the run, and the EPP's index holds, per pod, as many blocks as the pod's cache —
//! both checked from outside the EPP (the responses' usage, the simulator's own state). The same
//! workload through the approximate index shows its error for comparison (printed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::workloads;
use serde_json::Value;
use sim::SimConfig;
use sim::loadgen::{self, LoadConfig};

fn pods() -> SimConfig {
    workloads::kv_event_pods(8)
}

fn load() -> LoadConfig {
    LoadConfig {
        conversations: 24,
        turns: 5,
        system_prompt_words: 640,
        conversation_words: 1500,
        user_words: 32,
        max_tokens: 16,
        concurrency: 6,
        seed: 11,
        ..LoadConfig::default()
    }
}

fn config(producer: &str) -> String {
    workloads::llmd_prefix_config(producer)
}

/// A counter's value in a Prometheus text exposition (summed over its series).
fn counter(metrics: &str, name: &str) -> u64 {
    chaos::epp::metric_sum(metrics, name) as u64
}

#[derive(Debug)]
struct Run {
    report: loadgen::Report,
    predicted: u64,
    observed: u64,
    abs_error: u64,
}

impl Run {
    fn error(&self) -> f64 {
        self.abs_error as f64 / self.observed.max(1) as f64
    }
}

/// Every pod's KV-event stream subscribed and its first replay (from 0) done, so the workload's
/// first events are not raced by the subscriptions themselves.
async fn subscribed(c: &LocalCluster) {
    let pods: Vec<String> = c.sim.pods().iter().map(|p| p.addr.to_string()).collect();
    chaos::wait::until(
        "every pod's KV events subscribed",
        Duration::from_secs(10),
        || async {
            let Ok(v) = c.epp(0).unwrap().admin_json("/debug/kv-events").await else {
                return false;
            };
            let subs = &v["subscriptions"];
            pods.iter()
                .all(|p| subs[p].is_object() && subs[p]["replaying"] == false)
        },
    )
    .await
    .unwrap();
}

/// Per pod: gaps, resyncs and restarts of its KV-event stream (what explains a misprediction).
async fn recoveries(c: &LocalCluster) -> Vec<(String, u64, u64, u64)> {
    let v = c
        .epp(0)
        .unwrap()
        .admin_json("/debug/kv-events")
        .await
        .unwrap();
    let n = |p: &Value, k: &str| p[k].as_u64().unwrap_or(0);
    v["subscriptions"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, p)| (k.clone(), n(p, "gaps"), n(p, "resyncs"), n(p, "restarts")))
                .collect()
        })
        .unwrap_or_default()
}

async fn run(c: &LocalCluster) -> Run {
    c.wait_for_pods().await.unwrap();
    let report = loadgen::run(&load(), &c.envoy.url()).await.unwrap();
    // The observing stream counts each response as it ends, maybe just after the client saw it.
    let observed = || async {
        let m = c.epp(0).unwrap().metrics().await.unwrap();
        counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total") == report.cached_tokens
    };
    let _ = chaos::wait::until("every response observed", Duration::from_secs(5), observed).await;
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    Run {
        report,
        predicted: counter(&m, "llm_d_epp_prefix_cached_tokens_predicted_total"),
        observed: counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total"),
        abs_error: counter(&m, "llm_d_epp_prefix_cached_tokens_abs_error_total"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_cached_tokens_match_what_the_pods_report() {
    let c = LocalCluster::start(ClusterSpec {
        sim: pods(),
        epp_args: vec![
            "--config-text".into(),
            config("precise-prefix-cache-producer"),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    subscribed(&c).await;
    let precise = run(&c).await;
    // (pod, gaps, resyncs, restarts) of every stream: a resync loses what the pod held.
    let streams = recoveries(&c).await;
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    let removed = m
        .lines()
        .filter(|l| {
            l.starts_with("llm_d_epp_kv_events_blocks_total{") && l.contains("op=\"removed\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    let renders = counter(&m, "llm_d_epp_token_producer_requests_total");
    // The EPP's index against the pods' caches, pod by pod (from the simulator itself), once the
    // engines' last events (published at their last steps) have arrived.
    let mismatched = || async {
        let view = c
            .epp(0)
            .unwrap()
            .admin_json("/debug/kv-events")
            .await
            .unwrap();
        let mut out = Vec::new();
        for (i, pod) in c.sim.pods().iter().enumerate() {
            let held = view["pods"][pod.addr.to_string()]["blocks"]
                .as_u64()
                .unwrap_or(0);
            let cached = c.sim.stats(i).cached_blocks;
            if held != cached {
                out.push((pod.addr.to_string(), held, cached));
            }
        }
        out
    };
    let t0 = std::time::Instant::now();
    let equal = chaos::wait::until(
        "the index equal to the pods' caches",
        Duration::from_secs(5),
        || async { mismatched().await.is_empty() },
    )
    .await;
    let mismatched = mismatched().await;
    eprintln!(
        "index equal to the pods' caches: {:?} after the traffic",
        equal.as_ref().map(|_| t0.elapsed())
    );
    c.shutdown().await;

    let approx = {
        let c = LocalCluster::start(ClusterSpec {
            sim: pods(),
            epp_args: vec![
                "--config-text".into(),
                config("approx-prefix-cache-producer"),
            ],
            ..ClusterSpec::default()
        })
        .await
        .unwrap();
        let r = run(&c).await;
        c.shutdown().await;
        r
    };
    for (name, r) in [("precise", &precise), ("approximate", &approx)] {
        eprintln!(
            "{name}: predicted {} observed {} |error| {} ({:.2}%) | cached ratio {:.3} ttft p50 {:.1} p99 {:.1} ms pods {:?}",
            r.predicted,
            r.observed,
            r.abs_error,
            r.error() * 100.0,
            r.report.cached_ratio,
            r.report.ttft_p50_ms,
            r.report.ttft_p99_ms,
            r.report.pods
        );
    }
    eprintln!("engine evictions seen by the index: {removed} blocks; render calls {renders}");
    eprintln!("KV-event streams (pod, gaps, resyncs, restarts): {streams:?}");
    let r = &precise.report;
    assert_eq!((r.errors, r.requests), (0, 24 * 5), "{r:?}");
    assert!(
        removed > 0.0,
        "the pods must evict for the test to mean anything"
    );
    assert_eq!(renders, 24 * 5, "one render call per request");
    // What the observer counted is what the clients were told.
    assert_eq!(precise.observed, r.cached_tokens, "{precise:?}");
    assert!(
        precise.error() <= 0.02,
        "precise prediction error {:.2}% > 2%: {precise:?}; streams (pod, gaps, resyncs, \
         restarts): {streams:?}",
        precise.error() * 100.0
    );
    assert!(
        equal.is_ok(),
        "index blocks vs the pods' cached blocks (pod, index, pod): {mismatched:?}"
    );
}

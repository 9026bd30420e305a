//! End to end through Envoy: flow control protects a premium tenant from a best-effort burst.
//!
//! Four simulated pods with four decode slots each. A premium tenant (InferenceObjective `premium`,
//! priority 10) sends a steady 10 requests/s (60 of them: a p95 over enough samples); a
//! best-effort tenant (`batch`, priority 0) floods the pool at about 1.3× its capacity. With the `flowControl` gate on — a concurrency detector sized
//! to the slots and `priority-holdback-policy` capping the lower band at 75% of them — the batch
//! backlog waits in the EPP (its ext_proc streams held) instead of in the pods' queues, so premium
//! requests find a free slot. The same workload without flow control shows premium requests stuck
//! behind the batch in the pods' queues.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use sim::loadgen::{self, Arrival, LoadConfig, Report, TenantClass};
use sim::{PodKnobs, SimConfig};

const SCHEDULING: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: active-request-scorer
- {name: slots, type: concurrency-detector, parameters: {maxConcurrency: 4}}
- {name: holdback, type: priority-holdback-policy, parameters: {minCeiling: 0.75}}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: active-request-scorer, weight: 4}
";

const FLOW_CONTROL: &str = "\
featureGates: [flowControl]
flowControl:
  usageLimitPolicyPluginRef: holdback
  saturationDetector: {pluginRef: slots}
  priorityBands: [{priority: 10}, {priority: 0}]
";

/// The tests of this file measure latency: they run one at a time so neither's processes take the
/// other's CPU (the test harness runs a binary's tests in parallel).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn premium() -> TenantClass {
    TenantClass {
        name: "premium".into(),
        objective: Some("premium".into()),
        requests: 60,
        rate: 10.0,
        burst: 0,
        prompt_words: 200,
        max_tokens: 20,
        ..TenantClass::default()
    }
}

fn batch() -> TenantClass {
    TenantClass {
        name: "batch".into(),
        objective: Some("batch".into()),
        requests: 400,
        rate: 100.0,
        burst: 150,
        prompt_words: 200,
        max_tokens: 20,
        ..TenantClass::default()
    }
}

async fn cluster(dir: &std::path::Path, flow_control: bool) -> LocalCluster {
    let mut config = SCHEDULING.to_string();
    if flow_control {
        config.push_str(FLOW_CONTROL);
    }
    let knobs = PodKnobs {
        max_num_seqs: 4,
        prefill_us_per_token: 200.0,
        decode_ms_per_token: 5.0,
        ..PodKnobs::default()
    };
    start(dir, 4, knobs, &config, &[("premium", 10), ("batch", 0)]).await
}

/// `pods` simulated pods with `knobs`, one EPP with `config` and these `InferenceObjective`s,
/// Envoy; returns once the EPP has scraped every pod.
async fn start(
    dir: &std::path::Path,
    pods: usize,
    knobs: PodKnobs,
    config: &str,
    objectives: &[(&str, i32)],
) -> LocalCluster {
    let path = dir.join("objectives.yaml");
    std::fs::write(&path, chaos::workloads::objectives_yaml(objectives)).unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods,
            knobs,
            ..SimConfig::default()
        },
        epp_args: vec![
            "--config-text".into(),
            config.into(),
            "--objectives-file".into(),
            path.display().to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    c
}

async fn run(c: &LocalCluster, tenants: Vec<TenantClass>) -> Report {
    let load = LoadConfig {
        conversations: 0,
        turns: 0,
        arrival: Arrival::Poisson,
        tenants,
        ..LoadConfig::default()
    };
    loadgen::run(&load, &c.envoy.url()).await.unwrap()
}

fn p95(r: &Report, tenant: &str) -> f64 {
    r.tenants[tenant].ttft_p95_ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn premium_ttft_survives_a_best_effort_burst_only_with_flow_control() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();

    let fc = cluster(dir.path(), true).await;
    let alone = run(&fc, vec![premium()]).await;
    let burst = run(&fc, vec![premium(), batch()]).await;
    let metrics = fc.epps[0].metrics().await.unwrap();
    fc.shutdown().await;

    let plain = cluster(dir.path(), false).await;
    let plain_alone = run(&plain, vec![premium()]).await;
    let plain_burst = run(&plain, vec![premium(), batch()]).await;
    plain.shutdown().await;

    eprintln!(
        "{}",
        loadgen::render_table(&[
            ("fc alone".into(), alone.clone()),
            ("fc burst".into(), burst.clone()),
            ("no fc alone".into(), plain_alone.clone()),
            ("no fc burst".into(), plain_burst.clone()),
        ])
    );
    eprintln!(
        "premium ttft p95: flow control {:.1} → {:.1} ms under the burst; without {:.1} → {:.1} ms",
        p95(&alone, "premium"),
        p95(&burst, "premium"),
        p95(&plain_alone, "premium"),
        p95(&plain_burst, "premium"),
    );
    for r in [&alone, &burst, &plain_alone, &plain_burst] {
        assert_eq!(r.errors, 0, "{r:?}");
    }
    assert_eq!(burst.tenants["batch"].requests, 400);
    // The batch really waited in the EPP: flow control recorded dispatches after queueing.
    assert!(
        metrics.contains(
            "llm_d_epp_flow_control_requests_total{outcome=\"dispatched\",priority=\"0\""
        ),
        "no batch dispatches recorded:\n{metrics}"
    );
    assert!(
        p95(&burst, "premium") <= 1.25 * p95(&alone, "premium"),
        "with flow control premium p95 went {} → {} ms",
        p95(&alone, "premium"),
        p95(&burst, "premium")
    );
    assert!(
        p95(&plain_burst, "premium") >= 3.0 * p95(&plain_alone, "premium"),
        "without flow control premium p95 should degrade several times: {} → {} ms",
        p95(&plain_alone, "premium"),
        p95(&plain_burst, "premium")
    );
}

/// One pod, one slot, a 2 s TTL and a one-request band cap: a waiting request is cancelled when
/// its client goes away (its entry leaves the queue), then one expires with 429
/// `rejected-ttl-expired`, and one over the cap gets 429 `rejected-saturated` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_cancel_expire_and_overflow_with_llmd_reasons() {
    let _serial = SERIAL.lock().await;
    let config = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: one, type: concurrency-detector, parameters: {maxConcurrency: 1}}
flowControl:
  defaultRequestTTL: 2s
  saturationDetector: {pluginRef: one}
  priorityBands: [{priority: 0, maxRequests: 1}]
";
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 1,
            knobs: PodKnobs {
                max_num_seqs: 1,
                decode_ms_per_token: 5.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        epp_args: vec!["--config-text".into(), config.into()],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let body = |max_tokens: u32| {
        serde_json::json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
        })
        .to_string()
    };
    let client = reqwest::Client::new();
    let metric = |m: &str, needle: &str| -> Option<f64> {
        m.lines()
            .find(|l| l.starts_with(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    let send = |max_tokens: u32| {
        let request = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body(max_tokens));
        async move { request.send().await }
    };
    let queued = |what: &'static str| {
        chaos::wait::until(what, Duration::from_secs(5), || async {
            c.epps[0].metrics().await.is_ok_and(|m| {
                metric(&m, "llm_d_epp_flow_control_queue_size{priority=\"0\"") == Some(1.0)
            })
        })
    };

    // A holds the only slot for ~6 s (1200 tokens × 5 ms): longer than B's wait plus C's TTL.
    let long = tokio::spawn(send(1200));
    chaos::wait::until("A dispatched", Duration::from_secs(5), || async {
        c.epps[0].metrics().await.is_ok_and(|m| {
            metric(
                &m,
                "llm_d_epp_flow_control_inflight_requests{priority=\"0\"",
            ) == Some(1.0)
        })
    })
    .await
    .unwrap();

    // B waits, then its client gives up: the queue empties without a dispatch.
    let b = tokio::spawn(send(1));
    queued("B queued").await.unwrap();
    b.abort();
    assert!(
        b.await.is_err_and(|e| e.is_cancelled()),
        "B should have been waiting when its client went away"
    );
    chaos::wait::until("B cancelled", Duration::from_secs(5), || async {
        c.epps[0].metrics().await.is_ok_and(|m| {
            metric(
                &m,
                "llm_d_epp_flow_control_requests_total{outcome=\"rejected-context-cancelled\",priority=\"0\"",
            ) == Some(1.0)
                && metric(&m, "llm_d_epp_flow_control_queue_size{priority=\"0\"") == Some(0.0)
        })
    })
    .await
    .unwrap();

    // C waits past the TTL; D arrives while C occupies the band's only queue place.
    let c_req = tokio::spawn({
        let request = send(1);
        async move {
            let t = std::time::Instant::now();
            let r = request.await.unwrap();
            (
                r.status().as_u16(),
                r.headers()
                    .get("x-llm-d-request-dropped-reason")
                    .map(|v| v.to_str().unwrap().to_string()),
                t.elapsed(),
            )
        }
    });
    queued("C queued").await.unwrap();
    let d = send(1).await.unwrap();
    assert_eq!(d.status().as_u16(), 429);
    assert_eq!(
        d.headers()["x-llm-d-request-dropped-reason"],
        "rejected-saturated"
    );
    let (status, reason, waited) = c_req.await.unwrap();
    assert_eq!(
        (status, reason.as_deref()),
        (429, Some("rejected-ttl-expired"))
    );
    assert!(
        waited >= Duration::from_millis(1900),
        "C expired after {waited:?}, before its 2 s TTL"
    );
    assert_eq!(long.await.unwrap().unwrap().status().as_u16(), 200);
    c.shutdown().await;
}

/// Eviction (`enableEviction`) through the eviction filter of the Envoy template: one pod with two
/// slots holds two long sheddable requests (priority -1), the first streaming. A critical request
/// (priority 0) arrives: the newest sheddable one — not streaming yet — is evicted with 429
/// `evicted` (and its upstream request reset, so the pod stops working on it) and the critical one
/// is served at once. A second critical request evicts the streaming one, whose stream is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_are_evicted_for_critical_ones() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let config = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: two, type: concurrency-detector, parameters: {maxConcurrency: 2}}
flowControl:
  enableEviction: true
  saturationDetector: {pluginRef: two}
  priorityBands: [{priority: 0}, {priority: -1}]
";
    let knobs = PodKnobs {
        max_num_seqs: 2,
        decode_ms_per_token: 5.0,
        ..PodKnobs::default()
    };
    let c = start(
        dir.path(),
        1,
        knobs,
        config,
        &[("critical", 0), ("scavenger", -1)],
    )
    .await;
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let client = reqwest::Client::new();
    let send = |objective: &'static str, max_tokens: u32, stream: bool| {
        let body = serde_json::json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
        .to_string();
        client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-llm-d-inference-objective", objective)
            .body(body)
            .send()
    };
    let metric = |m: &str, needle: &str| -> Option<f64> {
        m.lines()
            .find(|l| l.starts_with(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    let sheddable_inflight = |n: f64| {
        let epp = &c.epps[0];
        async move {
            epp.metrics().await.is_ok_and(|m| {
                metric(
                    &m,
                    "llm_d_epp_flow_control_inflight_requests{priority=\"-1\"",
                ) == Some(n)
            })
        }
    };

    // S1 (streaming) then S2 (not streaming), each ~4 s of decode (800 tokens × 5 ms).
    let s1 = send("scavenger", 800, true).await.unwrap();
    assert_eq!(s1.status().as_u16(), 200);
    let mut s1 = s1.bytes_stream();
    use futures::StreamExt;
    let first = s1.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    let s2 = tokio::spawn(send("scavenger", 800, false));
    chaos::wait::until(
        "two sheddable requests in flight",
        Duration::from_secs(5),
        || sheddable_inflight(2.0),
    )
    .await
    .unwrap();
    chaos::wait::until(
        "both running on the pod",
        Duration::from_secs(5),
        || async { c.sim.stats(0).running == 2 },
    )
    .await
    .unwrap();

    // C1: S2 (the newest dispatch) is evicted with 429 `evicted`; C1 runs at once.
    let t = std::time::Instant::now();
    let c1 = send("critical", 5, false).await.unwrap();
    let c1_took = t.elapsed();
    assert_eq!(c1.status().as_u16(), 200, "{:?}", c1.text().await);
    let s2 = s2.await.unwrap().unwrap();
    assert_eq!(s2.status().as_u16(), 429);
    assert_eq!(s2.headers()["x-llm-d-request-dropped-reason"], "evicted");
    let text = s2.text().await.unwrap();
    assert!(text.contains("request evicted by flow control"), "{text}");
    eprintln!("critical request 1 served in {c1_took:?} (the pool was full of sheddable work)");
    assert!(
        c1_took < Duration::from_secs(2),
        "C1 took {c1_took:?}: it waited for a sheddable request to finish"
    );
    // The pod stopped working on S2: only S1 is left running.
    chaos::wait::until("the pod dropped S2", Duration::from_secs(3), || async {
        c.sim.stats(0).running == 1
    })
    .await
    .unwrap();

    // S1 and a long critical request (C2) fill the pool; C3 arrives: S1, streaming, is evicted
    // and its stream cut before its end.
    let c2 = tokio::spawn(send("critical", 400, false));
    chaos::wait::until("C2 in flight", Duration::from_secs(5), || async {
        c.sim.stats(0).running == 2
    })
    .await
    .unwrap();
    let t = std::time::Instant::now();
    let c3 = send("critical", 5, false).await.unwrap();
    let c3_took = t.elapsed();
    assert_eq!(c3.status().as_u16(), 200);
    let mut rest = Vec::new();
    let mut cut = false;
    while let Some(chunk) = s1.next().await {
        match chunk {
            Ok(b) => rest.extend_from_slice(&b),
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        cut || !rest.contains("[DONE]"),
        "the evicted stream ran to its end: {rest}"
    );
    eprintln!("critical request 3 served in {c3_took:?}; the streaming sheddable one was cut");
    assert!(c3_took < Duration::from_secs(3), "C3 took {c3_took:?}");
    assert_eq!(c2.await.unwrap().unwrap().status().as_u16(), 200);

    let m = c.epps[0].metrics().await.unwrap();
    assert_eq!(
        metric(
            &m,
            "llm_d_epp_flow_control_requests_total{outcome=\"evicted\",priority=\"-1\""
        ),
        Some(2.0),
        "{m}"
    );
    chaos::wait::until("ledger empty", Duration::from_secs(5), || async {
        c.epps[0].metrics().await.is_ok_and(|m| {
            metric(
                &m,
                "llm_d_epp_flow_control_inflight_requests{priority=\"-1\"",
            ) == Some(0.0)
                && metric(
                    &m,
                    "llm_d_epp_flow_control_inflight_requests{priority=\"0\"",
                ) == Some(0.0)
        })
    })
    .await
    .unwrap();
    c.shutdown().await;
}

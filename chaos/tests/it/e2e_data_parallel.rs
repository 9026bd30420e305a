//! End to end through Envoy: llm-d's `data-parallel-profile-handler`. The pool's endpoints are a
//! pod's data-parallel ranks (`ip:rankPort`, here simulated pods); the EPP sends each request to
//! the pod's primary port with the chosen rank in `x-data-parallel-host-port`, and a front
//! process on that port hands it to the rank (`chaos::dprouter`). Envoy routes with the override
//! host policy, so it reports the primary port as the served endpoint — which the EPP must map
//! back to the rank rather than take for a fallback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use chaos::dprouter::RankRouter;
use chaos::envoy::{EnvoyParams, EnvoyProcess};
use chaos::epp::{EppProcess, metric_sum};
use chaos::wait;
use serde_json::json;
use sim::{Sim, SimConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_the_chosen_rank_through_the_primary_port() {
    let sim = Sim::start(SimConfig {
        pods: 3,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let router = RankRouter::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    let config = format!(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: queue-scorer
- type: data-parallel-profile-handler
  parameters: {{primaryPort: {}}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: prefix-cache-scorer, weight: 3}}, {{pluginRef: queue-scorer}}]
",
        router.addr.port()
    );
    let epp = EppProcess::start(&endpoints, &["--config-text", &config])
        .await
        .unwrap();
    let mut pods: Vec<std::net::SocketAddr> = sim.pods().iter().map(|p| p.addr).collect();
    pods.push(router.addr);
    let envoy = EnvoyProcess::start_with(EnvoyParams {
        listen_port: 0,
        admin_port: 0,
        epp: vec![epp.addrs.ext_proc],
        pods,
        failure_mode_allow: false,
        observe_responses: true,
        fallback_lb: true,
        otlp: None,
    })
    .await
    .unwrap();
    let ranks: HashMap<String, String> = sim
        .pods()
        .into_iter()
        .map(|p| (p.name, p.addr.to_string()))
        .collect();
    wait::until(
        "the EPP to know every rank",
        Duration::from_secs(20),
        || async {
            epp.metrics()
                .await
                .is_ok_and(|m| metric_sum(&m, "llm_d_epp_pool_ready_endpoints") == 3.0)
        },
    )
    .await
    .unwrap();

    // Three conversations of three turns each, sent one at a time; turns alternate streaming.
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", envoy.url());
    let mut served_by: Vec<String> = Vec::new();
    let mut conversation_ranks: HashMap<usize, Vec<String>> = HashMap::new();
    for conv in 0..3 {
        let context = format!("conversation {conv}: ") + &"a long shared context ".repeat(120);
        for t in 0..3 {
            let body = json!({"model": "sim-model", "max_tokens": 4, "stream": t % 2 == 1,
                "messages": [{"role": "user", "content": format!("{context} turn {t}")}]});
            let r = client
                .post(&url)
                .header("x-data-parallel-host-port", "10.9.9.9:1") // a client's: replaced
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "conversation {conv} turn {t}");
            assert_eq!(
                r.headers()["x-sim-received-destination"].to_str().unwrap(),
                router.addr.to_string(),
                "the destination is the pod's primary port"
            );
            let pod = r.headers()["x-inference-pod"].to_str().unwrap().to_string();
            r.bytes().await.unwrap();
            let rank = ranks[&pod].clone();
            served_by.push(rank.clone());
            conversation_ranks.entry(conv).or_default().push(rank);
        }
    }
    // The front port handed each request to the rank the EPP chose, and that rank served it.
    let routed: Vec<String> = router
        .routed()
        .into_iter()
        .map(|r| r.expect("every request named its rank"))
        .collect();
    assert_eq!(routed, served_by);
    for (conv, ranks) in &conversation_ranks {
        assert!(
            ranks.windows(2).all(|w| w[0] == w[1]),
            "conversation {conv} changed rank: {ranks:?}"
        );
    }
    // Envoy reported the primary port as served: mapped back to the rank, not a fallback; the
    // prefix index knows ranks only.
    wait::until(
        "every response observed",
        Duration::from_secs(5),
        || async {
            epp.metrics()
                .await
                .is_ok_and(|m| metric_sum(&m, "llm_d_epp_request_output_tokens_count") >= 9.0)
        },
    )
    .await
    .unwrap();
    let m = epp.metrics().await.unwrap();
    assert_eq!(
        metric_sum(&m, "llm_d_epp_served_by_fallback_endpoint_total"),
        0.0,
        "the primary port was taken for a fallback"
    );
    let index = epp.prefix_index().await.unwrap();
    let names: Vec<String> = index["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pod"].as_str().unwrap().to_string())
        .collect();
    assert!(
        names.iter().all(|n| ranks.values().any(|r| r == n)),
        "{names:?}"
    );
    drop(envoy);
    drop(epp);
    sim.shutdown().await;
}

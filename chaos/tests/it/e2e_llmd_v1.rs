//! llm-d v1.0 features through real Envoy, an `epp serve` replica and simulated vLLM pods, seen
//! from the pod's side: `requestHandler.propagatePriority` puts the request's priority into the
//! forwarded body (vLLM's `priority`, lower first: the objective's priority negated).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chaos::cluster::{ClusterSpec, LocalCluster};
use sim::SimConfig;

/// `propagate`: the config's `requestHandler.propagatePriority`.
async fn start(dir: &std::path::Path, propagate: bool) -> LocalCluster {
    let objectives = dir.join("objectives.yaml");
    std::fs::write(
        &objectives,
        chaos::workloads::objectives_yaml(&[("premium", 10), ("batch", -10)]),
    )
    .unwrap();
    let config = format!(
        "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n\
         requestHandler: {{propagatePriority: {propagate}}}\n"
    );
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: vec![
            "--config-text".into(),
            config,
            "--objectives-file".into(),
            objectives.display().to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    c
}

/// The `priority` the pod found in the body of a request naming `objective` (none: absent).
async fn priority_at_the_pod(
    c: &LocalCluster,
    objective: Option<&str>,
    stream: bool,
) -> Option<String> {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/completions", c.envoy.url()))
        .json(&serde_json::json!({
            "model": "sim-model", "prompt": "hello there", "max_tokens": 2, "stream": stream,
        }));
    if let Some(o) = objective {
        req = req.header("x-llm-d-inference-objective", o);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200, "{objective:?}");
    r.headers()
        .get(sim::server::RECEIVED_PRIORITY_HEADER)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn propagate_priority_writes_the_objectives_priority_into_the_body() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(dir.path(), true).await;
    for stream in [false, true] {
        assert_eq!(
            priority_at_the_pod(&c, Some("premium"), stream)
                .await
                .as_deref(),
            Some("-10"),
            "premium (10) is served first by vLLM: -10"
        );
        assert_eq!(
            priority_at_the_pod(&c, Some("batch"), stream)
                .await
                .as_deref(),
            Some("10")
        );
        assert_eq!(
            priority_at_the_pod(&c, None, stream).await.as_deref(),
            Some("0"),
            "no objective: priority 0"
        );
    }
    c.shutdown().await;

    // Off (the default): the body goes as the client sent it.
    let c = start(dir.path(), false).await;
    assert_eq!(priority_at_the_pod(&c, Some("premium"), false).await, None);
    c.shutdown().await;
}

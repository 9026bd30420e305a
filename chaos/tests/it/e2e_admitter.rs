//! End to end through Envoy: llm-d's `probabilistic-admitter` sheds best-effort load with a
//! probability rising with the pool's saturation — a ramp of offered best-effort load meets a
//! rejected fraction that rises with it (not an all-or-nothing cut), while premium requests
//! sent alongside are never refused.
//!
//! Four simulated pods of four running slots (~100 requests/s together); no flow control, so
//! requests queue in the pods and their queue depth is the saturation the admitter reads. Each
//! level sends best-effort (`batch`, priority -10) requests at a Poisson rate for 3 s with premium
//! (priority 10) at 10 requests/s. The table is printed (docs/benchmarks.md records it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use sim::loadgen::{self, Arrival, LoadConfig, TenantClass};
use sim::{PodKnobs, SimConfig};

const CONFIG: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: probabilistic-admitter
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: kv-cache-utilization-scorer}]
";

/// Best-effort requests per second at each level.
const LEVELS: [f64; 5] = [20.0, 60.0, 100.0, 160.0, 240.0];
const SECONDS: f64 = 3.0;

fn class(name: &str, rate: f64) -> TenantClass {
    TenantClass {
        name: name.into(),
        objective: Some(name.into()),
        requests: (rate * SECONDS) as usize,
        rate,
        burst: 0,
        prompt_words: 200,
        max_tokens: 20,
        ..TenantClass::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_effort_shedding_rises_smoothly_with_load_and_spares_premium() {
    let dir = tempfile::tempdir().unwrap();
    let objectives = dir.path().join("objectives.yaml");
    std::fs::write(
        &objectives,
        chaos::workloads::objectives_yaml(&[("premium", 10), ("batch", -10)]),
    )
    .unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 4,
            knobs: PodKnobs {
                max_num_seqs: 4,
                prefill_us_per_token: 200.0,
                decode_ms_per_token: 5.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        epp_args: vec![
            "--config-text".into(),
            CONFIG.into(),
            "--objectives-file".into(),
            objectives.display().to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();

    let mut table = Vec::new();
    for rate in LEVELS {
        let load = LoadConfig {
            conversations: 0,
            turns: 0,
            arrival: Arrival::Poisson,
            tenants: vec![class("batch", rate), class("premium", 10.0)],
            ..LoadConfig::default()
        };
        let r = loadgen::run(&load, &c.envoy.url()).await.unwrap();
        let batch = &r.tenants["batch"];
        let premium = &r.tenants["premium"];
        let shed = |s: &sim::loadgen::Summary| s.statuses.get(&429).copied().unwrap_or(0);
        let fraction = shed(batch) as f64 / batch.requests.max(1) as f64;
        table.push((
            rate,
            batch.requests,
            fraction,
            premium.requests,
            shed(premium),
        ));
        assert_eq!(shed(premium), 0, "premium shed at {rate}/s: {premium:?}");
        assert_eq!(
            premium.errors, 0,
            "premium failed at {rate}/s: {:?}",
            premium.statuses
        );
        // Other than the admitter's 429s, everything was served.
        assert_eq!(
            batch.errors,
            shed(batch),
            "best-effort errors other than shedding at {rate}/s: {:?}",
            batch.statuses
        );
        // Let the pods drain before the next level.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eprintln!("best-effort rate/s | sent | shed fraction | premium sent | premium shed");
    for (rate, sent, fraction, p_sent, p_shed) in &table {
        eprintln!("{rate:>17} | {sent:>4} | {fraction:>13.3} | {p_sent:>12} | {p_shed:>12}");
    }
    let fractions: Vec<f64> = table.iter().map(|t| t.2).collect();
    // Below capacity almost nothing is shed; far above it, much is.
    assert!(fractions[0] < 0.05, "{fractions:?}");
    assert!(fractions[LEVELS.len() - 1] > 0.3, "{fractions:?}");
    // The rise is gradual: no level sheds markedly less than the one below it, and some level
    // sheds a partial share (not the all-or-nothing cut of a threshold).
    for w in fractions.windows(2) {
        assert!(w[1] >= w[0] - 0.05, "not rising: {fractions:?}");
    }
    assert!(
        fractions.iter().any(|f| *f > 0.05 && *f < 0.9),
        "no partial shedding: {fractions:?}"
    );
    c.shutdown().await;
}

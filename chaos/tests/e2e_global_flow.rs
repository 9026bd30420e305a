//! End to end, Active-Active flow control: one global queue for three replicas.
//!
//! Three EPP replicas in cluster mode, four simulated pods with four decode slots each (a
//! concurrency detector sized to them: capacity 16), and skewed arrival: tenant `a` reaches only
//! replica 1 (through its own Envoy), tenant `b` only replica 2 (through another). Both tenants run
//! closed loops of 24 clients, so both are backlogged all the time. Shares are counted from
//! completions in the steady window.
//!
//! * Cluster scope (the default): band 0 uses round-robin fairness → shares 50/50 ± 5%; band 5
//!   weights `a:b = 3:1` → 75/25 ± 5%. Throughout, the requests really running or waiting in the
//!   pods never exceed capacity + the credit slack (16 + 8; invariant I1).
//! * Per-replica scope (`--flow-control-scope replica`, what llm-d does): each replica admits up to
//!   the whole capacity for its own tenant — the weighted run comes out near 50/50 and the pods
//!   hold about twice the capacity. Both violations are asserted, so the comparison means
//!   something.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::envoy::EnvoyProcess;
use sim::{PodKnobs, SimConfig};

const OBJECTIVES: &str = "\
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: fair}
spec: {priority: 0, poolRef: {name: default-pool}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: weighted}
spec: {priority: 5, poolRef: {name: default-pool}}
";

const CONFIG: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: active-request-scorer
- {name: slots, type: concurrency-detector, parameters: {maxConcurrency: 4}}
- {name: rr, type: round-robin-fairness-policy}
- {name: w31, type: weighted-fairness-policy, parameters: {weights: {a: 3, b: 1}}}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: active-request-scorer, weight: 4}
flowControl:
  saturationDetector: {pluginRef: slots}
  priorityBands:
  - {priority: 5, fairnessPolicyRef: w31}
  - {priority: 0, fairnessPolicyRef: rr}
";

const CAPACITY: u64 = 16;
const SLACK: u64 = 8;
const CLIENTS: usize = 24;
const RUN: Duration = Duration::from_secs(12);
const WARMUP: Duration = Duration::from_secs(4);

struct Cluster {
    c: LocalCluster,
    /// Envoy in front of replica 1 only, and of replica 2 only.
    envoys: [EnvoyProcess; 2],
}

async fn start(dir: &std::path::Path, scope: &str) -> Cluster {
    let objectives = dir.join("objectives.yaml");
    std::fs::write(&objectives, OBJECTIVES).unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 4,
            knobs: PodKnobs {
                max_num_seqs: 4,
                prefill_us_per_token: 100.0,
                decode_ms_per_token: 5.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        replicas: 3,
        raft: true,
        epp_args: vec![
            "--config-text".into(),
            CONFIG.into(),
            "--objectives-file".into(),
            objectives.display().to_string(),
            "--flow-control-scope".into(),
            scope.into(),
            "--flow-credit-slack".into(),
            SLACK.to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let pods: Vec<_> = c.sim.pods().iter().map(|p| p.addr).collect();
    let mut envoys = Vec::new();
    for i in 0..2 {
        let ext_proc = c.epp(i).unwrap().addrs.ext_proc;
        envoys.push(
            EnvoyProcess::start(vec![ext_proc], pods.clone(), false, true)
                .await
                .unwrap(),
        );
    }
    if scope == "cluster" {
        // Every replica sees the replicated configuration, the pool and its credit.
        chaos::wait::until(
            "cluster flow control ready",
            Duration::from_secs(20),
            || async {
                let mut ok = true;
                for i in 0..3 {
                    let v = c.epp(i).unwrap().flow_view().await;
                    ok &= v.is_ok_and(|v| {
                        v["local"]["configured"] == true
                            && v["local"]["degraded"] == false
                            && v["global"]["pool_endpoints"] == 4
                            && v["local"]["credit"].as_u64().unwrap_or(0) > 0
                    });
                }
                ok
            },
        )
        .await
        .unwrap();
    }
    let [e1, e2]: [EnvoyProcess; 2] = envoys.try_into().unwrap();
    Cluster {
        c,
        envoys: [e1, e2],
    }
}

#[derive(Debug)]
struct Outcome {
    /// Completions per tenant in the steady window.
    done: BTreeMap<&'static str, u64>,
    errors: u64,
    /// Most requests running + waiting in the pods at once (sampled every 20 ms).
    peak_in_pods: u64,
}

impl Outcome {
    fn share(&self, tenant: &str) -> f64 {
        let total: u64 = self.done.values().sum();
        self.done.get(tenant).copied().unwrap_or(0) as f64 / total.max(1) as f64
    }
}

/// Closed loops of [`CLIENTS`] per tenant: `a` through Envoy 1, `b` through Envoy 2.
async fn drive(cl: &Cluster, objective: &str) -> Outcome {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (tenant, envoy) in [("a", &cl.envoys[0]), ("b", &cl.envoys[1])] {
        for k in 0..CLIENTS {
            let url = format!("{}/v1/chat/completions", envoy.url());
            let (client, stop, errors) = (client.clone(), stop.clone(), errors.clone());
            let objective = objective.to_string();
            tasks.push(tokio::spawn(async move {
                let mut done = 0u64;
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let body = serde_json::json!({
                        "model": "sim-model",
                        "messages": [{"role": "user", "content": format!("{tenant} {k} {i} hello there")}],
                        "max_tokens": 40,
                    });
                    let r = client
                        .post(&url)
                        .header("x-llm-d-inference-fairness-id", tenant)
                        .header("x-llm-d-inference-objective", &objective)
                        .json(&body)
                        .timeout(Duration::from_secs(30))
                        .send()
                        .await;
                    let ok = match r {
                        Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                        _ => false,
                    };
                    if !ok {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    } else if t0.elapsed() >= WARMUP && t0.elapsed() < RUN {
                        done += 1;
                    }
                }
                (tenant, done)
            }));
        }
    }
    let mut peak = 0;
    while t0.elapsed() < RUN {
        let n: u64 = (0..4)
            .map(|p| {
                let s = cl.c.sim.stats(p);
                s.running + s.waiting
            })
            .sum();
        peak = peak.max(n);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut done: BTreeMap<&'static str, u64> = BTreeMap::new();
    for t in tasks {
        let (tenant, n) = t.await.unwrap();
        *done.entry(tenant).or_default() += n;
    }
    // Let the last responses settle before the next run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Outcome {
        done,
        errors: errors.load(Ordering::Relaxed),
        peak_in_pods: peak,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_arrival_shares_hold_cluster_wide_and_not_per_replica() {
    let dir = tempfile::tempdir().unwrap();

    let cl = start(dir.path(), "cluster").await;
    let fair = drive(&cl, "fair").await;
    let weighted = drive(&cl, "weighted").await;
    let flow: Vec<serde_json::Value> = futures_join(&cl).await;
    cl.c.shutdown().await;

    let base = start(dir.path(), "replica").await;
    let base_weighted = drive(&base, "weighted").await;
    base.c.shutdown().await;

    eprintln!(
        "cluster scope: round-robin a={:.3} ({:?}), weighted 3:1 a={:.3} ({:?}), peak in pods {} / {}",
        fair.share("a"),
        fair.done,
        weighted.share("a"),
        weighted.done,
        fair.peak_in_pods.max(weighted.peak_in_pods),
        CAPACITY + SLACK,
    );
    eprintln!(
        "replica scope: weighted 3:1 a={:.3} ({:?}), peak in pods {}",
        base_weighted.share("a"),
        base_weighted.done,
        base_weighted.peak_in_pods
    );
    for (i, v) in flow.iter().enumerate() {
        eprintln!("replica {} /debug/flow local: {}", i + 1, v["local"]);
    }
    for o in [&fair, &weighted, &base_weighted] {
        assert_eq!(o.errors, 0, "{o:?}");
        assert!(
            o.done.values().sum::<u64>() >= 200,
            "too few samples: {o:?}"
        );
    }
    assert!(
        (fair.share("a") - 0.5).abs() <= 0.05,
        "round-robin across replicas: a's share {:.3}, want 0.50 ± 0.05",
        fair.share("a")
    );
    assert!(
        (weighted.share("a") - 0.75).abs() <= 0.05,
        "weighted 3:1 across replicas: a's share {:.3}, want 0.75 ± 0.05",
        weighted.share("a")
    );
    for o in [&fair, &weighted] {
        assert!(
            o.peak_in_pods <= CAPACITY + SLACK,
            "bounded admission: {} in the pods > capacity {CAPACITY} + slack {SLACK}",
            o.peak_in_pods
        );
    }
    // The baseline breaks both: per-replica queues cannot weigh tenants they never see, and
    // each replica fills the whole pool.
    assert!(
        base_weighted.share("a") < 0.65,
        "per-replica flow control should miss 75/25: a's share {:.3}",
        base_weighted.share("a")
    );
    assert!(
        base_weighted.peak_in_pods > CAPACITY + SLACK,
        "per-replica flow control should overfill the pool: peak {}",
        base_weighted.peak_in_pods
    );
    // The slow path really ran: requests waited in the global queue on both replicas.
    for v in &flow[..2] {
        assert!(v["local"]["slow_path"].as_u64().unwrap_or(0) > 0, "{v}");
    }
}

async fn futures_join(cl: &Cluster) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for i in 0..3 {
        out.push(cl.c.epp(i).unwrap().flow_view().await.unwrap());
    }
    out
}

//! The no-regret admission benchmark (`epp-bench no-regret`): a premium tenant's steady traffic,
//! alone and with a best-effort burst of 60 requests fired at once, through the shipped
//! flow-control example (`deploy/examples/flow-control.yaml`) on pods that batch 4 — with its
//! `maxConcurrency` as shipped (4) and raised to 8 (more than the pods batch: the trap the
//! detector now defuses by counting each pod at the batch it has shown). One replica, and three in
//! cluster mode with cluster-wide flow control. Reports the premium p95 TTFT ratio, and the most
//! requests the pods ever had waiting in their own queues.

use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sim::loadgen::{self, Arrival, LoadConfig, TenantClass};
use sim::{PodKnobs, SimConfig};

use crate::cluster::{ClusterSpec, LocalCluster};
use crate::locate::workspace_root;

fn premium() -> TenantClass {
    TenantClass {
        name: "premium".into(),
        objective: Some("interactive".into()),
        requests: 80,
        rate: 8.0,
        prompt_words: 200,
        max_tokens: 20,
        ..TenantClass::default()
    }
}

fn burst() -> TenantClass {
    TenantClass {
        name: "best-effort".into(),
        objective: Some("batch".into()),
        requests: 60,
        burst: 60,
        rate: 1.0,
        prompt_words: 200,
        max_tokens: 40,
        ..TenantClass::default()
    }
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub replicas: usize,
    pub max_concurrency: u64,
    pub premium_p95_alone_ms: f64,
    pub premium_p95_burst_ms: f64,
    pub ratio: f64,
    pub best_effort_served: u64,
    /// The most requests waiting in any pod's own queue during the burst run.
    pub pod_queue_peak: u64,
    pub errors: u64,
}

/// One phase: cold pods, prompts never sent before (`seed`), the pods' queues sampled.
async fn run_tenants(
    c: &LocalCluster,
    tenants: Vec<TenantClass>,
    seed: u64,
) -> anyhow::Result<(loadgen::Report, u64)> {
    let load = LoadConfig {
        conversations: 0,
        turns: 0,
        arrival: Arrival::Poisson,
        tenants,
        seed,
        ..LoadConfig::default()
    };
    c.sim.reset_prefix_caches();
    // Sample the pods' own waiting queues while the load runs.
    let sampler = c.sim.stats_sampler();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peak = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut peak = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(sampler().iter().map(|s| s.waiting).max().unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        }
    });
    let report = loadgen::run(&load, &c.envoy.url()).await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok((report, peak.await?))
}

/// Measure one configuration.
pub async fn measure(replicas: usize, max_concurrency: u64) -> anyhow::Result<Row> {
    let root = workspace_root();
    let config = std::fs::read_to_string(root.join("deploy/examples/flow-control.yaml"))?.replace(
        "parameters: {maxConcurrency: 4}",
        &format!("parameters: {{maxConcurrency: {max_concurrency}}}"),
    );
    let objectives = root.join("deploy/examples/objectives.yaml");
    let mut epp_args = vec![
        "--config-text".to_string(),
        config,
        "--objectives-file".into(),
        objectives.display().to_string(),
    ];
    if replicas > 1 {
        epp_args.extend(["--flow-control-scope".into(), "cluster".into()]);
    }
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
        replicas,
        raft: replicas > 1,
        epp_args,
        ..ClusterSpec::default()
    })
    .await
    .context("starting the cluster")?;
    c.wait_for_pods().await?;
    // Warm-up: one burst, so each pod has shown the batch it runs (the detector learns it).
    run_tenants(&c, vec![burst()], 1).await?;
    let (alone, _) = run_tenants(&c, vec![premium()], 2).await?;
    let (with, peak) = run_tenants(&c, vec![premium(), burst()], 3).await?;
    c.shutdown().await;
    let p95 = |r: &loadgen::Report| r.tenants.get("premium").map_or(f64::NAN, |s| s.ttft_p95_ms);
    Ok(Row {
        replicas,
        max_concurrency,
        premium_p95_alone_ms: p95(&alone),
        premium_p95_burst_ms: p95(&with),
        ratio: p95(&with) / p95(&alone),
        best_effort_served: with
            .tenants
            .get("best-effort")
            .map_or(0, |s| s.requests - s.errors),
        pod_queue_peak: peak,
        errors: alone.errors + with.errors,
    })
}

pub fn render(rows: &[Row]) -> String {
    let mut s = String::from(
        "| replicas | maxConcurrency | premium TTFT p95 alone ms | with the burst ms | **ratio** | best-effort served | pods' queue peak | errors |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {:.1} | {:.1} | **{:.2}** | {} | {} | {} |\n",
            r.replicas,
            r.max_concurrency,
            r.premium_p95_alone_ms,
            r.premium_p95_burst_ms,
            r.ratio,
            r.best_effort_served,
            r.pod_queue_peak,
            r.errors
        );
    }
    s
}

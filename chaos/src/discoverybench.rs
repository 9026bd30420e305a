//! `epp-bench discovery`: Kubernetes discovery of a large pool through a fake API server
//! (`sim::kubeapi`): the time from start to ready (the first full list of the pool's pods), the
//! time for one pod's readiness change to reach the endpoint set, the replica's cost of
//! recomputing the set, and its memory with the pool against the same replica serving an empty
//! pool.
//!
//! The pods sit on `127.1.x.y:8000`, loopback addresses where nothing listens: their scrapes fail
//! at once (the scrape interval is 1 s so that the failures cost little), which is not what is
//! measured.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use sim::kubeapi::FakeKube;

use crate::epp::EppProcess;

const NS: &str = "bench";

fn pod(i: usize, ready: bool) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("vllm-{i:05}"), "namespace": NS,
                     "labels": {"app": "vllm", "llm-d.ai/engine-type": "vllm"}},
        "status": {
            "phase": "Running",
            "podIP": format!("127.1.{}.{}", i / 250, 1 + i % 250),
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn pool(name: &str, app: &str) -> serde_json::Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": [{"number": 8000}]},
    })
}

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}

async fn ready(epp: &EppProcess) -> anyhow::Result<()> {
    let url = format!("http://{}/readyz", epp.addrs.admin);
    crate::wait::until("ready", Duration::from_secs(60), || async {
        reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await
}

async fn endpoint_count(epp: &EppProcess) -> usize {
    epp.admin_json("/debug/scrape")
        .await
        .ok()
        .and_then(|v| v["pods"].as_array().map(Vec::len))
        .unwrap_or(usize::MAX)
}

async fn start(kubeconfig: &std::path::Path, pool: &str) -> anyhow::Result<(EppProcess, Duration)> {
    let t = Instant::now();
    let epp = EppProcess::start_kube(
        kubeconfig,
        &[
            "--pool-name",
            pool,
            "--pool-namespace",
            NS,
            "--refresh-metrics-interval",
            "1s",
        ],
    )
    .await?;
    ready(&epp).await?;
    Ok((epp, t.elapsed()))
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs the benchmark and returns its report (Markdown).
pub async fn run(pods: usize, updates: usize) -> anyhow::Result<String> {
    let kube = FakeKube::start().await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS)?;
    kube.apply(pool("empty", "nothing"))?;
    kube.apply(pool("large", "vllm"))?;
    for i in 0..pods {
        kube.apply(pod(i, true))?;
    }
    let (empty, empty_start) = start(&kubeconfig, "empty").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let empty_rss = rss_kib(empty.pid_u32().context("pid")?)?;
    drop(empty);

    let (epp, large_start) = start(&kubeconfig, "large").await?;
    anyhow::ensure!(
        endpoint_count(&epp).await == pods,
        "ready without every pod"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let large_rss = rss_kib(epp.pid_u32().context("pid")?)?;

    // One pod's readiness flipped, then back: until the endpoint set shows it.
    let mut took = Vec::with_capacity(2 * updates);
    for u in 0..updates {
        let i = (u * 7919) % pods;
        for (is_ready, want) in [(false, pods - 1), (true, pods)] {
            let t = Instant::now();
            kube.apply(pod(i, is_ready))?;
            while endpoint_count(&epp).await != want {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(10),
                    "update {u} never arrived"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            took.push(t.elapsed());
        }
    }
    took.sort();
    let text = epp.metrics().await?;
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let recompute_ms = 1e3 * value("llm_d_epp_discovery_update_duration_seconds_sum")
        / value("llm_d_epp_discovery_update_duration_seconds_count");
    Ok(format!(
        "| measurement | {pods} pods | empty pool |\n|---|---|---|\n\
         | start to ready (first full list) | {:.0} ms | {:.0} ms |\n\
         | resident memory after 2 s | {:.1} MiB | {:.1} MiB (+{:.1} MiB, {:.1} KiB per pod) |\n\
         | one pod's readiness change to the endpoint set (p50 / p99 / max of {}) | {:.1} / {:.1} / {:.1} ms | |\n\
         | recomputing the endpoint set from the store (mean over {} updates) | {recompute_ms:.2} ms | |\n",
        large_start.as_secs_f64() * 1e3,
        empty_start.as_secs_f64() * 1e3,
        large_rss as f64 / 1024.0,
        empty_rss as f64 / 1024.0,
        (large_rss.saturating_sub(empty_rss)) as f64 / 1024.0,
        large_rss.saturating_sub(empty_rss) as f64 / pods as f64,
        took.len(),
        pct(&took, 0.5).as_secs_f64() * 1e3,
        pct(&took, 0.99).as_secs_f64() * 1e3,
        took[took.len() - 1].as_secs_f64() * 1e3,
        value("llm_d_epp_discovery_update_duration_seconds_count"),
    ))
}

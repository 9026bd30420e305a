//! What following a large pool's KV-event streams costs each replica (issue 17's benchmark):
//! three replicas in cluster mode with the precise prefix producer over `pods` simulated pods
//! publishing KV events, each pod's stream subscribed by `R` owners (`--scrape-owners R`, 0 = every
//! replica). The pods are driven through Envoy's round-robin route, which does not ask the EPP, so
//! a replica's CPU is its share of the streams (decoding, indexing, gossiping the changes to its
//! peers, applying theirs) on top of its idle cost (scraping its share of the pool once a second,
//! heartbeats), measured after the traffic over the same length of time.

use std::time::{Duration, Instant};

use anyhow::Context;
use sim::loadgen::{self, LoadConfig};

use crate::cluster::{ClusterSpec, LocalCluster};
use crate::epp::{metric_sum, proc_cpu_seconds};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    pub pods: usize,
    /// Subscribers per pod to compare (0 = every replica).
    pub owners: Vec<usize>,
    pub conversations: usize,
    pub seed: u64,
}

/// One owner count's figures.
#[derive(Debug, Clone)]
pub struct Row {
    pub owners: usize,
    pub subscriptions: Vec<usize>,
    /// Cores per replica while idle, then under the workload.
    pub idle_cores: Vec<f64>,
    pub busy_cores: Vec<f64>,
    /// Blocks named by the KV events the pods published (stored + removed).
    pub block_events: u64,
    pub seconds: f64,
    pub gossip_bytes: u64,
    pub requests: u64,
}

impl Row {
    /// Extra CPU of the streams, summed over the replicas, per 1000 block events (ms).
    pub fn cpu_ms_per_1k_events(&self) -> f64 {
        let extra: f64 = self
            .busy_cores
            .iter()
            .zip(&self.idle_cores)
            .map(|(b, i)| (b - i).max(0.0))
            .sum();
        extra * self.seconds * 1000.0 / (self.block_events.max(1) as f64 / 1000.0)
    }
}

fn precise_config() -> String {
    crate::workloads::llmd_prefix_config("precise-prefix-cache-producer")
}

fn cores(pids: &[u32], since: &[f64], seconds: f64) -> anyhow::Result<Vec<f64>> {
    pids.iter()
        .zip(since)
        .map(|(p, s)| Ok((proc_cpu_seconds(*p)? - s) / seconds))
        .collect()
}

fn cpu_now(pids: &[u32]) -> anyhow::Result<Vec<f64>> {
    pids.iter().map(|p| proc_cpu_seconds(*p)).collect()
}

/// Measures one owner count on a fresh cluster.
pub async fn measure(opts: &Options, owners: usize) -> anyhow::Result<Row> {
    let replicas = 3;
    let c = LocalCluster::start(ClusterSpec {
        sim: crate::workloads::kv_event_pods(opts.pods),
        replicas,
        raft: true,
        epp_args: vec![
            "--config-text".into(),
            precise_config(),
            "--scrape-owners".into(),
            owners.to_string(),
            // Scraping 200 pods every 50 ms costs a replica more than the streams do; scraped
            // once a second it stays out of the way of what is measured.
            "--refresh-metrics-interval".into(),
            "1s".into(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .context("starting the pods, three replicas and Envoy")?;
    c.wait_for_pods().await?;
    let want = opts.pods * if owners == 0 { replicas } else { owners };
    let subscriptions = || async {
        let mut n = Vec::new();
        for i in 0..replicas {
            let v = c.epp(i)?.admin_json("/debug/kv-events").await?;
            let subs = v["subscriptions"].as_object();
            n.push(subs.map_or(0, |s| {
                s.values().filter(|s| s["replaying"] == false).count()
            }));
        }
        anyhow::Ok(n)
    };
    // Every replica holding its share: right after start a replica that has not joined yet owns
    // nothing, and the others hold its pods.
    crate::wait::until(
        &format!("{want} live subscriptions, on every replica"),
        Duration::from_secs(60),
        || async {
            subscriptions()
                .await
                .is_ok_and(|n| n.iter().sum::<usize>() == want && n.iter().all(|&k| k > 0))
        },
    )
    .await?;
    let subscriptions = subscriptions().await?;
    let pids: Vec<u32> = (0..replicas)
        .map(|i| c.epp(i)?.pid_u32().context("a replica exited"))
        .collect::<anyhow::Result<_>>()?;
    let load = LoadConfig {
        conversations: opts.conversations,
        turns: 3,
        system_prompt_words: 64,
        conversation_words: 600,
        user_words: 24,
        max_tokens: 8,
        // Light enough that the machine is not saturated (its two cores are shared by the pods,
        // Envoy, the load generator and the replicas): a replica starved of CPU would look cheap.
        concurrency: 8,
        seed: opts.seed,
        ..LoadConfig::default()
    };
    let published =
        |c: &LocalCluster| -> u64 { (0..opts.pods).map(|i| c.sim.stats(i).kv_event_blocks).sum() };
    let events_before = (published(&c), gossip(&c, replicas).await?);
    let t0 = Instant::now();
    let cpu0 = cpu_now(&pids)?;
    let report = loadgen::run(&load, &format!("{}/rr", c.envoy.url())).await?;
    // The last events reach the owners and their peers just after the last response.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seconds = t0.elapsed().as_secs_f64();
    let busy_cores = cores(&pids, &cpu0, seconds)?;
    let block_events = published(&c) - events_before.0;
    let gossip_bytes = gossip(&c, replicas).await? - events_before.1;
    // Idle over as long, after the traffic (the pool and the index as the workload left them).
    let cpu1 = cpu_now(&pids)?;
    let t1 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let idle_cores = cores(&pids, &cpu1, t1.elapsed().as_secs_f64())?;
    c.shutdown().await;
    Ok(Row {
        owners,
        subscriptions,
        idle_cores,
        busy_cores,
        block_events,
        seconds,
        gossip_bytes,
        requests: report.requests,
    })
}

/// Gossip bytes the replicas sent, summed.
async fn gossip(c: &LocalCluster, replicas: usize) -> anyhow::Result<u64> {
    let mut bytes = 0.0;
    for i in 0..replicas {
        let m = c.epp(i)?.metrics().await?;
        bytes += metric_sum(
            &m,
            "llm_d_epp_prefix_gossip_bytes_total{direction=\"sent\"}",
        );
    }
    Ok(bytes as u64)
}

/// Every owner count, printed as a Markdown table.
pub async fn run(opts: &Options) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &owners in &opts.owners {
        eprintln!("{} pods, {owners} owner(s) per pod ...", opts.pods);
        rows.push(measure(opts, owners).await?);
    }
    println!(
        "| owners per pod | subscriptions per replica | requests | block events/s | \
         cores per replica idle | under the events | CPU ms per 1k events (all replicas) | \
         gossip bytes per event |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let f = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        println!(
            "| {} | {:?} | {} | {:.0} | {} | {} | {:.1} | {:.1} |",
            if r.owners == 0 {
                "all".to_string()
            } else {
                r.owners.to_string()
            },
            r.subscriptions,
            r.requests,
            r.block_events as f64 / r.seconds,
            f(&r.idle_cores),
            f(&r.busy_cores),
            r.cpu_ms_per_1k_events(),
            r.gossip_bytes as f64 / r.block_events.max(1) as f64,
        );
    }
    Ok(rows)
}

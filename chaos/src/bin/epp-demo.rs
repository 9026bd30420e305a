//! `epp-demo`: the local standalone cluster, end to end.
//!
//! Starts simulated vLLM pods, EPP replicas and Envoy on loopback, runs the same multi-turn workload
//! through the EPP route (`/`) and the round-robin route (`/rr/`), prints them side by side and stops
//! everything. Exits non-zero if any step fails, any request errs, or (cluster mode) the replicas'
//! prefix indexes still differ or requests are still in flight after the traffic.

use std::time::Duration;

use anyhow::{Context, bail};
use chaos::cluster::{ClusterSpec, LocalCluster};
use clap::Parser;
use sim::loadgen::{self, LoadConfig};

#[derive(Parser, Debug)]
#[command(about = "Run the local standalone cluster demo")]
struct Args {
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pods: usize,
    /// EPP replicas behind Envoy (more than one: cluster mode, Raft between them).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    #[arg(long, default_value_t = 4)]
    turns: usize,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Words of the system prompt shared by all conversations.
    #[arg(long, default_value_t = 512)]
    system_prompt_words: usize,
    /// The pods' engine model: `step` (continuous batching, calibrated to Llama-3.1-8B on an
    /// A100) or `simple` (each request sleeps its own prefill and decode; 4 at a time per pod).
    #[arg(long, default_value = "step", value_parser = chaos::workloads::parse_engine)]
    engine: sim::EngineModel,
    /// KV capacity of each pod, in 16-token blocks (default: 4096 with the step model, 2048 with
    /// the simple one).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Knobs for some pods only, `PODS=PATCH` as `vllm-sim --pod-knobs` takes them
    /// (`3={"time_scale":2}`: pod 3 is half as fast). Repeatable.
    #[arg(long = "pod-knobs")]
    pod_knobs: Vec<sim::PodOverride>,
    /// EndpointPickerConfig for the replicas.
    #[arg(long, default_value_os_t = chaos::locate::workspace_root().join("deploy/local/epp-config.yaml"))]
    config: std::path::PathBuf,
    /// Write the reports as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Turn llm-d's `flowControl` feature gate on (default settings: utilization detector, one
    /// band). With several replicas it runs cluster-wide; the demo prints how requests were
    /// admitted (local credit or the replicated queue).
    #[arg(long)]
    flow_control: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();

    let mut sim = chaos::workloads::bench_pool(args.pods, args.engine);
    if let Some(blocks) = args.kv_blocks {
        sim.knobs.kv_blocks = blocks;
    }
    sim.pod_knobs = args.pod_knobs.clone();
    let spec = ClusterSpec {
        sim,
        replicas: args.replicas,
        raft: args.replicas > 1,
        epp_args: epp_config_args(&args)?,
        ..ClusterSpec::default()
    };
    println!(
        "starting {} simulated pods ({} engine model), {} EPP replica(s) and Envoy ...",
        args.pods,
        match args.engine {
            sim::EngineModel::Step => "step: continuous batching",
            sim::EngineModel::Simple => "simple",
        },
        args.replicas
    );
    let cluster = LocalCluster::start(spec)
        .await
        .context("starting the cluster")?;
    println!(
        "gateway {}  (EPP route /, round-robin route /rr/)",
        cluster.envoy.url()
    );
    // The EPP needs a first scrape of every pod.
    cluster.wait_for_pods().await?;

    if let Some(raft) = &cluster.raft {
        let ids: Vec<u64> = (1..=args.replicas as u64).collect();
        chaos::wait::until(
            "the replicas to elect a leader",
            Duration::from_secs(20),
            || async { raft.agreed_leader(&ids).await.is_some() },
        )
        .await?;
        let v = raft.view(1).await?;
        let live = v["members"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["live"] == true).count());
        println!(
            "cluster mode: leader {}, term {}, {live} live members (epp cluster --admin http://{} status)",
            v["raft"]["metrics"]["leader"],
            v["raft"]["metrics"]["term"],
            raft.replica(1)?.addrs.admin
        );
    }

    let load = LoadConfig {
        conversations: args.conversations,
        turns: args.turns,
        concurrency: args.concurrency,
        system_prompt_words: args.system_prompt_words,
        ..LoadConfig::default()
    };
    let mut reports = Vec::new();
    // What went wrong besides a request failing (replicas that disagree, requests left in
    // flight): printed where it is seen, and the exit status at the end.
    let mut problems = Vec::new();
    for (name, prefix) in [("epp", ""), ("round-robin", "/rr")] {
        println!(
            "running {} conversations x {} turns through {name} ...",
            load.conversations, load.turns
        );
        // Both routes start from cold caches: the runs send identical content.
        cluster.sim.reset_prefix_caches();
        let target = format!("{}{prefix}", cluster.envoy.url());
        let report = loadgen::run(&load, &target)
            .await
            .with_context(|| format!("load against {name}"))?;
        reports.push((name.to_string(), report));
        if name == "epp" && args.replicas > 1 {
            problems.extend(print_prefix_replication(&cluster, args.replicas).await?);
            if args.flow_control {
                problems.extend(print_cluster_flow(&cluster, args.replicas).await?);
            }
        }
    }
    cluster.shutdown().await;

    println!();
    print!("{}", loadgen::render_table(&reports));
    if let Some(path) = &args.json {
        let obj: serde_json::Map<String, serde_json::Value> = reports
            .iter()
            .map(|(n, r)| Ok((n.clone(), serde_json::to_value(r)?)))
            .collect::<anyhow::Result<_>>()?;
        std::fs::write(path, serde_json::to_string_pretty(&obj)?)?;
    }
    let expected = (args.conversations * args.turns) as u64;
    for (name, r) in &reports {
        if r.errors > 0 || r.requests != expected {
            problems.push(format!(
                "{name}: {} of {expected} requests, {} errors",
                r.requests, r.errors
            ));
        }
    }
    verdict(&problems)?;
    println!("\nok: every request succeeded on both routes");
    Ok(())
}

/// The demo's exit status: an error naming every problem seen, if any.
fn verdict(problems: &[String]) -> anyhow::Result<()> {
    if problems.is_empty() {
        Ok(())
    } else {
        bail!("{}", problems.join("; "))
    }
}

/// A problem when the replicated ledger still held requests after the traffic.
fn drain_problem(still_inflight: Option<&serde_json::Value>) -> Option<String> {
    still_inflight
        .map(|n| format!("cluster flow control: still {n} in flight 5 s after the traffic"))
}

/// A problem when the replicas' prefix indexes still differed after the traffic.
fn divergence_problem(converged: bool) -> Option<String> {
    (!converged)
        .then(|| "prefix index: the replicas still differ 3 s after the traffic".to_string())
}

/// The replicas' config flags: the config file, or its text with the flow-control gate added.
fn epp_config_args(args: &Args) -> anyhow::Result<Vec<String>> {
    if !args.flow_control {
        return Ok(vec![
            "--config-file".into(),
            args.config.display().to_string(),
        ]);
    }
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    if text.contains("featureGates") || text.contains("flowControl") {
        bail!(
            "--flow-control: {} already configures flow control",
            args.config.display()
        );
    }
    Ok(vec![
        "--config-text".into(),
        format!("{text}\nfeatureGates: [flowControl]\nflowControl: {{}}\n"),
    ])
}

/// Cluster mode with flow control: how the replicas admitted the requests, and how soon the
/// replicated ledger was empty again after the traffic (a problem if it was not within 5 s).
async fn print_cluster_flow(
    cluster: &LocalCluster,
    replicas: usize,
) -> anyhow::Result<Option<String>> {
    let t0 = std::time::Instant::now();
    let drained = loop {
        let v = cluster.epp(0)?.flow_view().await?;
        if v["global"]["totals"]["inflight_requests"] == 0 {
            break Some(t0.elapsed());
        }
        if t0.elapsed() > Duration::from_secs(5) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let mut parts = Vec::new();
    let mut global = serde_json::Value::Null;
    for i in 0..replicas {
        let v = cluster.epp(i)?.flow_view().await?;
        parts.push(format!(
            "replica {}: {} on local credit, {} via the replicated queue (credit {})",
            i + 1,
            v["local"]["fast_path"],
            v["local"]["slow_path"],
            v["local"]["credit"]
        ));
        global = v["global"].clone();
    }
    println!("cluster flow control: {}", parts.join("; "));
    println!(
        "  replicated ledger: {} dispatched from the queue; {}",
        global["dispatched"],
        match drained {
            Some(t) => format!("empty {t:?} after the traffic"),
            None => format!(
                "still {} in flight 5 s after the traffic",
                global["totals"]["inflight_requests"]
            ),
        }
    );
    Ok(drain_problem(
        drained
            .is_none()
            .then_some(&global["totals"]["inflight_requests"]),
    ))
}

/// Cluster mode: whether the replicas' prefix indexes converged (they should within one gossip
/// round of the traffic stopping; a problem if not within 3 s) and what replicating them cost.
async fn print_prefix_replication(
    cluster: &LocalCluster,
    replicas: usize,
) -> anyhow::Result<Option<String>> {
    let t0 = std::time::Instant::now();
    let (views, took) = loop {
        let mut views = Vec::new();
        for i in 0..replicas {
            views.push(cluster.epp(i)?.prefix_index().await?);
        }
        let same = views.windows(2).all(|w| w[0]["pods"] == w[1]["pods"]);
        if same || t0.elapsed() > Duration::from_secs(3) {
            break (views, same.then(|| t0.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let mut sent = 0.0;
    for i in 0..replicas {
        let text = cluster.epp(i)?.metrics().await?;
        sent += text
            .lines()
            .filter(|l| l.starts_with("llm_d_epp_prefix_gossip_bytes_total{direction=\"sent\"}"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    match took {
        Some(t) => println!(
            "prefix index: identical on all {replicas} replicas {t:?} after the traffic ({} entries); \
             gossip sent {:.0} KB",
            views[0]["entries"],
            sent / 1000.0
        ),
        None => println!(
            "prefix index: replicas still differ 3 s after the traffic: {}",
            serde_json::to_string(&views)?
        ),
    }
    Ok(divergence_problem(took.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replicas that disagree or requests left in flight make the demo fail, like a failed
    /// request does.
    #[test]
    fn the_demo_fails_on_divergence_or_requests_left_in_flight() {
        assert!(verdict(&[]).is_ok());
        let diverged = divergence_problem(false);
        let stuck = drain_problem(Some(&serde_json::json!(3)));
        assert_eq!(divergence_problem(true), None);
        assert_eq!(drain_problem(None), None);
        for p in [diverged, stuck] {
            let p = p.expect("a problem");
            let err = verdict(std::slice::from_ref(&p)).unwrap_err().to_string();
            assert_eq!(err, p);
        }
        assert!(
            verdict(&["a".into(), "b".into()])
                .unwrap_err()
                .to_string()
                .contains("a; b")
        );
    }
}

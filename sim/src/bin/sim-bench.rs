//! `sim-bench`: benchmarks of the simulator and the load generator.
//!
//! - `metrics-cpu`: starts `vllm-sim` as a child process with N pods, scrapes every pod's `/metrics`
//!   every interval from this process (keep-alive connections), and reports the child's CPU from
//!   `/proc/<pid>/stat` (utime + stime) over the measured window.
//! - `workload`: the same child and scraping, plus a load-generator run spread over all pods
//!   (Poisson arrivals) for a fixed duration; reports requests, errors and both processes' CPU.
//! - `loadgen-max`: the load generator against a trivial in-process endpoint that streams a canned
//!   answer at once, to show the generator's own ceiling.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use sim::loadgen::{self, Arrival, LoadConfig};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, Parser)]
#[command(about = "Simulator and load-generator benchmarks")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    MetricsCpu {
        #[command(flatten)]
        fleet: FleetArgs,
    },
    Workload {
        #[command(flatten)]
        fleet: FleetArgs,
        /// Conversations started per second over the whole fleet.
        #[arg(long, default_value_t = 10.0)]
        rate: f64,
    },
    LoadgenMax {
        #[arg(long, default_value_t = 20_000)]
        requests: usize,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
    },
}

#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// The vllm-sim binary (default: next to this one).
    #[arg(long)]
    sim_bin: Option<PathBuf>,
    #[arg(long, default_value_t = 200)]
    pods: usize,
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Passed to vllm-sim --worker-threads.
    #[arg(long, default_value_t = 0)]
    sim_worker_threads: usize,
    /// Passed to vllm-sim --engine (`simple` or `step`).
    #[arg(long, default_value = "simple", value_parser = ["simple", "step"])]
    engine: String,
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces; fields after it are space separated.
    let rest = stat.rsplit_once(')').context("bad stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state is field 3 (index 0), utime field 14 (index 11), stime 15 (index 12).
    Ok(f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?)
}

/// Clock ticks per second; Linux reports CPU times in USER_HZ, 100 on every mainstream build.
const TICKS_PER_S: f64 = 100.0;

struct Child {
    child: tokio::process::Child,
    pods: Vec<String>,
}

async fn start_sim(fleet: &FleetArgs, extra: &[&str]) -> anyhow::Result<Child> {
    let bin = match &fleet.sim_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("exe dir")?
            .join("vllm-sim"),
    };
    let mut child = tokio::process::Command::new(&bin)
        .arg("--pods")
        .arg(fleet.pods.to_string())
        .arg("--worker-threads")
        .arg(fleet.sim_worker_threads.to_string())
        .arg("--engine")
        .arg(&fleet.engine)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("vllm-sim did not start")??
        .context("vllm-sim exited")?;
    let v: Value = serde_json::from_str(&line)?;
    let pods = v["pods"]
        .as_array()
        .context("pods")?
        .iter()
        .filter_map(|p| p["addr"].as_str().map(|a| format!("http://{a}")))
        .collect::<Vec<_>>();
    if pods.len() != fleet.pods {
        bail!("expected {} pods, got {}", fleet.pods, pods.len());
    }
    Ok(Child { child, pods })
}

/// Scrapes every pod every `interval` until `stop`; counts scrapes and failures.
fn scrape(
    pods: Vec<String>,
    interval: Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (tokio::task::JoinHandle<()>, Arc<AtomicU64>, Arc<AtomicU64>) {
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let (ok2, failed2) = (Arc::clone(&ok), Arc::clone(&failed));
    let task = tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .pool_max_idle_per_host(2)
            .build()
            .unwrap_or_default();
        let mut set = tokio::task::JoinSet::new();
        for pod in pods {
            let (client, ok, failed, mut stop) = (
                client.clone(),
                Arc::clone(&ok2),
                Arc::clone(&failed2),
                stop.clone(),
            );
            set.spawn(async move {
                let url = format!("{pod}/metrics");
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stop.changed() => return,
                    }
                    let good = match client.get(&url).send().await {
                        Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                        _ => false,
                    };
                    match good {
                        true => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        while set.join_next().await.is_some() {}
    });
    (task, ok, failed)
}

async fn fleet_run(fleet: &FleetArgs, workload_rate: Option<f64>) -> anyhow::Result<Value> {
    let extra: &[&str] = if workload_rate.is_some() {
        &["--time-scale", "1"]
    } else {
        &[]
    };
    let mut child = start_sim(fleet, extra).await?;
    let pid = child.child.id().context("child pid")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let interval = Duration::from_millis(fleet.interval_ms);
    let (task, ok, failed) = scrape(child.pods.clone(), interval, stop_rx);
    // Warm-up: connections open, first scrapes done.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ok0 = ok.load(Ordering::Relaxed);
    let sim0 = cpu_ticks(pid)?;
    let me0 = cpu_ticks(std::process::id())?;
    let t0 = Instant::now();
    let window = Duration::from_secs(fleet.seconds);
    let mut load = None;
    if let Some(rate) = workload_rate {
        // Spread a Poisson conversation workload over every pod for the window.
        let per_pod_rate = rate / fleet.pods as f64;
        let conversations = ((per_pod_rate * fleet.seconds as f64).ceil() as usize).max(1);
        let cfg = LoadConfig {
            conversations,
            turns: 3,
            think_time_ms: 500,
            system_prompt_words: 256,
            conversation_words: 128,
            user_words: 32,
            max_tokens: 32,
            arrival: Arrival::Poisson,
            rate: per_pod_rate,
            // Arrivals end inside the window instead of trailing off with the Poisson tail.
            window_ms: fleet.seconds * 1000,
            request_timeout_ms: 10_000,
            ..LoadConfig::default()
        };
        let runs = child.pods.iter().enumerate().map(|(i, p)| {
            let cfg = LoadConfig {
                seed: i as u64,
                ..cfg.clone()
            };
            let p = p.clone();
            async move { loadgen::run(&cfg, &p).await }
        });
        let reports = futures::future::join_all(runs).await;
        let mut req = 0;
        let mut err = 0;
        let mut cached = 0.0;
        let mut ttft = Vec::new();
        for r in reports {
            let r = r?;
            req += r.requests;
            err += r.errors;
            cached += r.cached_ratio;
            ttft.extend(r.ttft_samples_ms);
        }
        ttft.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            ttft.get(((p * ttft.len() as f64) as usize).min(ttft.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        load = Some(json!({
            "requests": req, "errors": err,
            "mean_cached_ratio": cached / fleet.pods as f64,
            "ttft_p50_ms": pct(0.5), "ttft_p99_ms": pct(0.99),
            "workload_s": t0.elapsed().as_secs_f64(),
        }));
    } else {
        tokio::time::sleep(window).await;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let sim1 = cpu_ticks(pid)?;
    let me1 = cpu_ticks(std::process::id())?;
    let scrapes = ok.load(Ordering::Relaxed) - ok0;
    let _ = stop_tx.send(true);
    let _ = task.await;
    child.child.kill().await.ok();
    let sim_cpu = (sim1 - sim0) as f64 / TICKS_PER_S;
    let me_cpu = (me1 - me0) as f64 / TICKS_PER_S;
    Ok(json!({
        "pods": fleet.pods,
        "interval_ms": fleet.interval_ms,
        "seconds": elapsed,
        "scrapes": scrapes,
        "scrapes_per_s": scrapes as f64 / elapsed,
        "failed_scrapes": failed.load(Ordering::Relaxed),
        "sim_cpu_s": sim_cpu,
        "sim_cores": sim_cpu / elapsed,
        "sim_cpu_us_per_scrape": if scrapes > 0 { sim_cpu * 1e6 / scrapes as f64 } else { 0.0 },
        "client_cores": me_cpu / elapsed,
        "workload": load,
    }))
}

async fn trivial_endpoint() -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    const BODY: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
        "data: [DONE]\n\n"
    );
    let router = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|| async { ([("content-type", "text/event-stream")], BODY) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok((addr, task))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let out = match args.cmd {
        Cmd::MetricsCpu { fleet } => fleet_run(&fleet, None).await?,
        Cmd::Workload { fleet, rate } => fleet_run(&fleet, Some(rate)).await?,
        Cmd::LoadgenMax {
            requests,
            concurrency,
        } => {
            let (addr, server) = trivial_endpoint().await?;
            let cfg = LoadConfig {
                conversations: 0,
                short_prompts: requests,
                short_prompt_words: 16,
                concurrency,
                ..LoadConfig::default()
            };
            let me0 = cpu_ticks(std::process::id())?;
            let r = loadgen::run(&cfg, &format!("http://{addr}")).await?;
            let me1 = cpu_ticks(std::process::id())?;
            server.abort();
            let cpu = (me1 - me0) as f64 / TICKS_PER_S;
            json!({
                "requests": r.requests, "errors": r.errors, "seconds": r.duration_s,
                "requests_per_s": r.requests_per_s,
                "process_cpu_s (loadgen + trivial server)": cpu,
                "e2e_p50_ms": r.e2e_p50_ms, "e2e_p99_ms": r.e2e_p99_ms,
            })
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

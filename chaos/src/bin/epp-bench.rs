//! `epp-bench`: the skeleton's benchmarks (run in release by `deploy/local/bench.sh`).
//!
//! - `added-latency`: Envoy+EPP versus Envoy routing straight to the pod, p50/p99 at several
//!   concurrencies, with a zero-latency simulated pod so only the gateway path is measured.
//! - `decisions`: EPP routing decisions per second per CPU core, driven by a synthetic ext_proc
//!   client (no Envoy) sending ~4k-token prompts; CPU is read from `/proc/<pid>/stat` of the epp
//!   process.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::epp::{EppProcess, proc_cpu_seconds};
use clap::{Parser, Subcommand};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use futures::StreamExt;
use sim::{PodKnobs, Sim, SimConfig};

#[derive(Parser, Debug)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    AddedLatency {
        /// Requests per route and concurrency level.
        #[arg(long, default_value_t = 4000)]
        requests: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        concurrency: Vec<usize>,
        /// Drop the response-observing ext_proc filter (llm-d's single-filter shape, minus the
        /// response phase) to show what the stream-survival design costs.
        #[arg(long)]
        no_observe: bool,
    },
    Decisions {
        #[arg(long, default_value_t = 20000)]
        requests: usize,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Simulated pods in the pool.
        #[arg(long, default_value_t = 16)]
        pods: usize,
        /// Prompt size in estimated tokens (4 bytes each).
        #[arg(long, default_value_t = 4096)]
        prompt_tokens: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().cmd {
        Cmd::AddedLatency {
            requests,
            concurrency,
            no_observe,
        } => added_latency(requests, &concurrency, !no_observe).await,
        Cmd::Decisions {
            requests,
            concurrency,
            pods,
            prompt_tokens,
        } => decisions(requests, concurrency, pods, prompt_tokens).await,
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn timed_requests(url: &str, n: usize, concurrency: usize) -> anyhow::Result<Vec<f64>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .tcp_nodelay(true)
        .build()?;
    let body = serde_json::json!({"model": "sim-model", "prompt": "Say hello in one word.", "max_tokens": 1})
        .to_string();
    let results: Vec<anyhow::Result<f64>> = futures::stream::iter(0..n)
        .map(|_| {
            let client = client.clone();
            let body = body.clone();
            async move {
                let t = Instant::now();
                let r = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                let status = r.status();
                r.bytes().await?;
                if !status.is_success() {
                    bail!("status {status}");
                }
                Ok(t.elapsed().as_secs_f64() * 1e3)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut v = results.into_iter().collect::<anyhow::Result<Vec<f64>>>()?;
    v.sort_by(f64::total_cmp);
    Ok(v)
}

async fn added_latency(requests: usize, levels: &[usize], observe: bool) -> anyhow::Result<()> {
    let cluster = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 1,
            knobs: PodKnobs {
                time_scale: 0.0,
                max_num_seqs: 1024,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        observe_responses: observe,
        ..ClusterSpec::default()
    })
    .await?;
    let base = cluster.envoy.url();
    let direct = format!("{base}/rr/v1/completions");
    let epp = format!("{base}/v1/completions");
    // Warm up connections and the EPP's first scrape.
    chaos::wait::until("a routed request", Duration::from_secs(20), || async {
        timed_requests(&epp, 1, 1).await.is_ok()
    })
    .await?;
    timed_requests(&direct, 200, 8).await?;
    timed_requests(&epp, 200, 8).await?;
    println!("| concurrency | route | p50 ms | p99 ms |");
    println!("|---|---|---|---|");
    for &c in levels {
        let d = timed_requests(&direct, requests, c).await?;
        let e = timed_requests(&epp, requests, c).await?;
        let (d50, d99, e50, e99) = (pct(&d, 0.5), pct(&d, 0.99), pct(&e, 0.5), pct(&e, 0.99));
        println!("| {c} | envoy → pod | {d50:.3} | {d99:.3} |");
        println!("| {c} | envoy → epp → pod | {e50:.3} | {e99:.3} |");
        println!(
            "| {c} | **added by the EPP** | {:.3} | {:.3} |",
            e50 - d50,
            e99 - d99
        );
    }
    cluster.shutdown().await;
    Ok(())
}

async fn one_decision(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    body: &[u8],
) -> anyhow::Result<()> {
    let msgs = chaos::extproc::chat_request(body, None);
    let mut responses = client.process(tokio_stream::iter(msgs)).await?.into_inner();
    // Read to the end of the stream, as Envoy does (dropping it early makes the client reset it).
    let (mut routed, mut body_done) = (false, false);
    while let Some(msg) = responses.message().await? {
        match msg.response {
            Some(Resp::RequestHeaders(_)) => routed = true,
            Some(Resp::RequestBody(b)) => {
                body_done |= b
                    .response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation)
                    .is_some_and(|m| matches!(m, Mutation::StreamedResponse(s) if s.end_of_stream));
            }
            Some(Resp::ImmediateResponse(i)) => bail!("refused: {:?}", i.status),
            _ => {}
        }
    }
    if !routed || !body_done {
        bail!("incomplete answer: routed={routed} body={body_done}");
    }
    Ok(())
}

async fn decisions(
    requests: usize,
    concurrency: usize,
    pods: usize,
    prompt_tokens: usize,
) -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig {
        pods,
        ..SimConfig::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml())?;
    let epp = EppProcess::start(&endpoints, &["--log-level", "warn"]).await?;
    let pid = epp.pid_u32().context("epp pid")?;
    // ~4 bytes per estimated token: a chat body of `prompt_tokens` tokens.
    let text: String = "lorem ipsum dolor sit amet ".repeat(prompt_tokens * 4 / 27 + 1);
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "Summarise."}],
        "max_tokens": 16,
    }))?;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", epp.addrs.ext_proc))?
            .tcp_nodelay(true)
            .connect()
            .await?;
    let client = ExternalProcessorClient::new(channel);
    // warm-up
    for _ in 0..200 {
        one_decision(&mut client.clone(), &body).await?;
    }
    // Background cost (scraping every pod every 50 ms) measured while idle, subtracted below.
    let idle0 = proc_cpu_seconds(pid)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rate = (proc_cpu_seconds(pid)? - idle0) / 3.0;
    let cpu0 = proc_cpu_seconds(pid)?;
    let t0 = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..requests)
        .map(|_| {
            let mut c = client.clone();
            let body = &body;
            async move { one_decision(&mut c, body).await }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = proc_cpu_seconds(pid)? - cpu0;
    let failed = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        bail!("{failed} decisions failed, first: {e:#}");
    }
    let net = (cpu - idle_rate * wall).max(1e-9);
    println!(
        "| prompt tokens | body bytes | pods | concurrency | decisions | wall s | decisions/s | epp CPU s | idle CPU s (scraping) | decisions per CPU-second (net of idle) | CPU µs per decision |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {prompt_tokens} | {} | {pods} | {concurrency} | {requests} | {wall:.2} | {:.0} | {cpu:.2} | {:.2} | {:.0} | {:.1} |",
        body.len(),
        requests as f64 / wall,
        idle_rate * wall,
        requests as f64 / net,
        net * 1e6 / requests as f64,
    );
    drop(epp);
    sim.shutdown().await;
    Ok(())
}

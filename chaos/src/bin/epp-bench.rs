//! `epp-bench`: the skeleton's benchmarks (run in release by `deploy/local/bench.sh`).
//!
//! - `added-latency`: Envoy+EPP versus Envoy routing straight to the pod, p50/p99 at several
//!   concurrencies, with a zero-latency simulated pod so only the gateway path is measured.
//! - `decisions`: EPP routing decisions per second per CPU core, driven by a synthetic ext_proc
//!   client (no Envoy) sending ~4k-token prompts; CPU is read from `/proc/<pid>/stat` of the epp
//!   process.
//! - `global-flow`: cluster-wide flow control on three replicas (synthetic ext_proc clients, each
//!   request routed on one replica and settled on the next, as the split data plane does): the
//!   fast-path admission time, decision latency against per-replica flow control, cluster-wide
//!   admissions per second and Raft entries per admission; then, with one slot and no credit,
//!   the time from a slot freeing (settlement sent to a third replica) to the waiting request's
//!   dispatch on another.
//! - `no-regret`: a premium tenant's p95 TTFT alone and under a best-effort burst of 60, through
//!   the flow-control example, with one and three replicas ([`chaos::noregret`]).
//! - `discovery`: Kubernetes discovery of a 1000-pod pool (fake API server): start to ready, a
//!   change to the endpoint set, recompute cost, memory ([`chaos::discoverybench`]).
//! - `peers`: the same seeded workloads through Envoy → EPP, Envoy round robin, `sglang-router`
//!   and `vllm-router` on one simulated pool ([`chaos::peerbench`]); Markdown tables, a JSON
//!   file and an SVG plot.
//! - `kv-fleet`: what following a large pool's KV-event streams costs each replica, with 1, 2 or
//!   every replica subscribed to each pod ([`chaos::kvfleet`]).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::epp::{EppProcess, histogram, histogram_quantile, pct, proc_cpu_seconds};
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
        /// Also run with tenant mode on (an API key per request, a tenant with request and
        /// token quotas) and print both rows: the quota stage's cost.
        #[arg(long)]
        tenants: bool,
        /// Also run with traces exported at 100% sampling (OTLP/gRPC to an in-process receiver)
        /// and print both rows: the cost of tracing.
        #[arg(long)]
        traces: bool,
    },
    Peers {
        /// Repetitions of every workload.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Only these workloads (shared-prompt, long-prefixes, agentic, bursty).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Without the PyPI routers (EPP and round robin only).
        #[arg(long)]
        no_peers: bool,
        /// The pods' engine model: `step` (continuous batching) or `simple`.
        #[arg(long, default_value = "step", value_parser = chaos::workloads::parse_engine)]
        engine: sim::EngineModel,
        /// Knobs for some pods only, `PODS=PATCH` as `vllm-sim --pod-knobs` takes them
        /// (`3={"time_scale":2}`: pod 3 is half as fast). Repeatable.
        #[arg(long = "pod-knobs")]
        pod_knobs: Vec<sim::PodOverride>,
        /// Where to write every report as JSON.
        #[arg(long, default_value = "target/peer-bench.json")]
        json: std::path::PathBuf,
        /// Where to write the plot.
        #[arg(long, default_value = "target/peer-bench.svg")]
        svg: std::path::PathBuf,
    },
    /// The default profile with the precise prefix index against the approximate one, on the
    /// peer benchmark's workloads (pods publishing KV events).
    Precise {
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Only these workloads (shared-prompt, long-prefixes, agentic, bursty).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        #[arg(long, default_value = "step", value_parser = chaos::workloads::parse_engine)]
        engine: sim::EngineModel,
        /// Knobs for some pods, `PODS=PATCH` (`*={"kv_blocks":1200}`: KV pressure). Repeatable.
        #[arg(long = "pod-knobs")]
        pod_knobs: Vec<sim::PodOverride>,
    },
    /// A fleet-scale run: `pods` simulated pods, `replicas` replicas in cluster mode with sharded
    /// scraping, open-loop decisions ([`chaos::fleet`]).
    Fleet {
        #[arg(long, default_value_t = 1000)]
        pods: usize,
        #[arg(long, default_value_t = 5)]
        replicas: usize,
        #[arg(long, default_value_t = 2)]
        scrape_owners: usize,
        #[arg(long, default_value_t = 50)]
        refresh_ms: u64,
        /// Decisions per second over all replicas.
        #[arg(long, default_value_t = 200.0)]
        rate: f64,
        #[arg(long, default_value_t = 20.0)]
        seconds: f64,
        #[arg(long, default_value_t = 500)]
        prefixes: usize,
    },
    /// CPU per replica following `pods` pods' KV-event streams with R owners per pod.
    KvFleet {
        #[arg(long, default_value_t = 200)]
        pods: usize,
        /// Owners per pod to compare (0 = every replica).
        #[arg(long, value_delimiter = ',', default_value = "1,2,0")]
        owners: Vec<usize>,
        /// Conversations (three turns each) driven through the pods.
        #[arg(long, default_value_t = 600)]
        conversations: usize,
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// Premium p95 TTFT alone and under a best-effort burst, through the flow-control example.
    NoRegret {
        #[arg(long, default_value_t = 1)]
        runs: usize,
        /// Replica counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,3")]
        replicas: Vec<usize>,
        /// `maxConcurrency` values to configure (the pods batch 4).
        #[arg(long, value_delimiter = ',', default_value = "4,8")]
        max_concurrency: Vec<u64>,
    },
    /// Agent loops on a saturated pool, the band ordered by turn priority against first come,
    /// first served ([`chaos::turnbench`]).
    Turns {
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long, default_value_t = 96)]
        programs: usize,
        #[arg(long, default_value_t = 12)]
        turns: usize,
        #[arg(long, default_value_t = 4_000)]
        window_ms: u64,
        #[arg(long, default_value = "simple", value_parser = chaos::workloads::parse_engine)]
        engine: sim::EngineModel,
        #[arg(long, default_value = "target/turn-bench.json")]
        json: std::path::PathBuf,
    },
    /// Premium requests arriving with a best-effort burst, in the same instant, with flow control
    /// (the shipped example) and without, side by side ([`chaos::burst`]).
    Burst {
        #[arg(long, default_value_t = 4)]
        pods: usize,
        /// Slots per pod (`max_num_seqs`, and the example's `maxConcurrency`).
        #[arg(long, default_value_t = 16)]
        slots: usize,
        /// Burst sizes as multiples of the pool's slots.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        times: Vec<usize>,
        /// Premium requests ahead of the burst.
        #[arg(long, default_value_t = 10)]
        premium_first: usize,
        /// A premium request after every this many best-effort ones (0: none).
        #[arg(long, default_value_t = 5)]
        premium_every: usize,
        /// Replica counts (more than one: cluster mode, cluster-wide flow control).
        #[arg(long, value_delimiter = ',', default_value = "1")]
        replicas: Vec<usize>,
        #[arg(long, default_value = "simple", value_parser = chaos::workloads::parse_engine)]
        engine: sim::EngineModel,
        /// Only with flow control (no side-by-side run without it).
        #[arg(long)]
        flow_control_only: bool,
        /// `flowControl.demandReserve`, the inside of a YAML flow mapping (`'factor: 0, settle:
        /// 0s'` turns it off; unset: the example's, i.e. the defaults).
        #[arg(long)]
        demand_reserve: Option<String>,
        /// Where to write the rows as JSON.
        #[arg(long, default_value = "target/burst-bench.json")]
        json: std::path::PathBuf,
    },
    /// Kubernetes discovery of a large pool through a fake API server ([`chaos::discoverybench`]).
    Discovery {
        #[arg(long, default_value_t = 1000)]
        pods: usize,
        /// Readiness flips measured (each one and back).
        #[arg(long, default_value_t = 50)]
        updates: usize,
    },
    GlobalFlow {
        #[arg(long, default_value_t = 20000)]
        requests: usize,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Slot hand-offs measured in the saturated phase.
        #[arg(long, default_value_t = 200)]
        handoffs: usize,
        /// `--flow-credit-slack` of the replicas (unset: `epp serve`'s default).
        #[arg(long)]
        credit_slack: Option<u32>,
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
            tenants,
            traces,
        } => decisions(requests, concurrency, pods, prompt_tokens, tenants, traces).await,
        Cmd::Discovery { pods, updates } => {
            print!("{}", chaos::discoverybench::run(pods, updates).await?);
            Ok(())
        }
        Cmd::GlobalFlow {
            requests,
            concurrency,
            handoffs,
            credit_slack,
        } => global_flow(requests, concurrency, handoffs, credit_slack).await,
        Cmd::Peers {
            runs,
            only,
            no_peers,
            engine,
            pod_knobs,
            json,
            svg,
        } => {
            let opts = chaos::peerbench::Options {
                runs,
                only,
                no_peers,
                engine,
                pod_knobs,
            };
            peers(&opts, &json, &svg).await
        }
        Cmd::Fleet {
            pods,
            replicas,
            scrape_owners,
            refresh_ms,
            rate,
            seconds,
            prefixes,
        } => {
            let opts = chaos::fleet::Options {
                pods,
                replicas,
                scrape_owners,
                refresh: Duration::from_millis(refresh_ms),
                rate,
                seconds,
                prefixes,
            };
            let report = chaos::fleet::run(&opts).await?;
            chaos::fleet::print(&opts, &report);
            Ok(())
        }
        Cmd::KvFleet {
            pods,
            owners,
            conversations,
            seed,
        } => {
            let opts = chaos::kvfleet::Options {
                pods,
                owners,
                conversations,
                seed,
            };
            chaos::kvfleet::run(&opts).await.map(|_| ())
        }
        Cmd::Precise {
            runs,
            only,
            engine,
            pod_knobs,
        } => {
            use chaos::peerbench;
            let opts = peerbench::Options {
                runs,
                only,
                no_peers: true,
                engine,
                pod_knobs,
            };
            let ms = peerbench::precise_vs_approx(&opts).await?;
            println!("\n## Medians over {runs} runs\n");
            print!("{}", peerbench::render(&peerbench::summarize(&ms), runs));
            Ok(())
        }
        Cmd::Turns {
            runs,
            programs,
            turns,
            window_ms,
            engine,
            json,
        } => {
            let opts = chaos::turnbench::Options {
                runs,
                programs,
                turns,
                window_ms,
                engine,
                ..Default::default()
            };
            turn_bench(&opts, &json).await
        }
        Cmd::Burst {
            pods,
            slots,
            times,
            premium_first,
            premium_every,
            replicas,
            engine,
            flow_control_only,
            demand_reserve,
            json,
        } => {
            let base = chaos::burst::Options {
                pods,
                slots,
                premium_first,
                premium_every,
                engine,
                demand_reserve,
                ..Default::default()
            };
            let rows = chaos::burst::sweep(&base, &times, &replicas, flow_control_only).await?;
            print!("{}", chaos::burst::render(&rows));
            write_json(&json, &rows)
        }
        Cmd::NoRegret {
            runs,
            replicas,
            max_concurrency,
        } => no_regret(runs, &replicas, &max_concurrency).await,
    }
}

/// `epp-bench turns`: the medians printed, every run's reports in `json`.
async fn turn_bench(
    opts: &chaos::turnbench::Options,
    json: &std::path::Path,
) -> anyhow::Result<()> {
    let ms = chaos::turnbench::run(opts).await?;
    println!("\n## Medians over {} runs\n", opts.runs);
    print!("{}", chaos::turnbench::render(&ms));
    write_json(json, &ms)
}

/// A benchmark's rows as pretty JSON in `path`.
fn write_json(path: &std::path::Path, rows: &impl serde::Serialize) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(rows)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// `epp-bench no-regret`: every (replicas, maxConcurrency) pair, `runs` times.
async fn no_regret(runs: usize, replicas: &[usize], max_concurrency: &[u64]) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for _ in 0..runs {
        for &r in replicas {
            for &mc in max_concurrency {
                eprintln!("replicas {r}, maxConcurrency {mc} ...");
                rows.push(chaos::noregret::measure(r, mc).await?);
            }
        }
    }
    print!("{}", chaos::noregret::render(&rows));
    Ok(())
}

async fn peers(
    opts: &chaos::peerbench::Options,
    json: &std::path::Path,
    svg: &std::path::Path,
) -> anyhow::Result<()> {
    use chaos::peerbench;
    let runs = opts.runs;
    let ms = peerbench::run(opts).await?;
    let summaries = peerbench::summarize(&ms);
    println!("\n## Medians over {runs} runs\n");
    print!("{}", peerbench::render(&summaries, runs));
    std::fs::write(json, serde_json::to_string_pretty(&ms)?)
        .with_context(|| format!("writing {}", json.display()))?;
    std::fs::write(svg, peerbench::svg(&summaries, runs))
        .with_context(|| format!("writing {}", svg.display()))?;
    println!("\nreports: {}  plot: {}", json.display(), svg.display());
    Ok(())
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
    api_key: Option<&str>,
) -> anyhow::Result<()> {
    let auth = api_key.map(|k| format!("Bearer {k}"));
    let extra: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let msgs = chaos::extproc::chat_request_with(body, &extra, None);
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
    tenants: bool,
    traces: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(!(tenants && traces), "--tenants or --traces, not both");
    let sim = Sim::start(SimConfig {
        pods,
        ..SimConfig::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml())?;
    // Tenant mode: one tenant whose quotas never bind (what is measured is the stage's cost).
    let tenants_file = dir.path().join("tenants.yaml");
    std::fs::write(
        &tenants_file,
        format!(
            "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: bench}}\nspec:\n  apiKeys: [{{sha256: {}}}]\n  limits: [{{model: '*', requestsPerMinute: 1000000000, tokensPerMinute: 1000000000000000}}]\n",
            ring::digest::digest(&ring::digest::SHA256, BENCH_KEY.as_bytes())
                .as_ref()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ),
    )?;
    println!(
        "| variant | prompt tokens | body bytes | pods | concurrency | decisions | wall s | decisions/s | epp CPU s | idle CPU s (scraping) | decisions per CPU-second (net of idle) | CPU µs per decision |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let tenants_arg = tenants_file.display().to_string();
    let (spans, otlp) = chaos::otlp::receiver().await?;
    let otlp = format!("http://{otlp}");
    let traced: Vec<(&str, &str)> = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_TRACES_SAMPLER", "always_on"),
    ];
    type Variant<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let variants: Vec<Variant> = if tenants {
        vec![
            ("quotas off", vec![], vec![]),
            (
                "quotas on",
                vec!["--tenants-file", tenants_arg.as_str()],
                vec![],
            ),
        ]
    } else if traces {
        vec![
            ("traces off", vec![], vec![]),
            ("traces on (100%)", vec![], traced),
        ]
    } else {
        vec![("", vec![], vec![])]
    };
    let mut net_us = Vec::new();
    for (label, extra, env) in variants {
        let mut args = vec!["--log-level", "warn"];
        args.extend(extra);
        let epp = EppProcess::start_with_env(&endpoints, &args, &env).await?;
        let r = decisions_once(&epp, requests, concurrency, prompt_tokens, tenants).await;
        drop(epp);
        let (line, us) = r?;
        println!("| {label} {line}");
        net_us.push(us);
    }
    if let [off, on] = net_us[..] {
        let what = if tenants {
            "tenant mode"
        } else {
            "tracing every request"
        };
        println!(
            "{what} costs {:.1} µs of CPU per decision ({:.3}× without)",
            on - off,
            on / off
        );
    }
    if traces {
        let received = spans.spans().len();
        println!("spans received: {received}");
        anyhow::ensure!(
            received >= requests,
            "traces on exported {received} spans for {requests} requests"
        );
    }
    sim.shutdown().await;
    Ok(())
}

const BENCH_KEY: &str = "bench-key";

/// One measured run against `epp`: the table row (after the first cell) and CPU µs per decision.
async fn decisions_once(
    epp: &EppProcess,
    requests: usize,
    concurrency: usize,
    prompt_tokens: usize,
    with_key: bool,
) -> anyhow::Result<(String, f64)> {
    let pid = epp.pid_u32().context("epp pid")?;
    // ~4 bytes per estimated token: a chat body of `prompt_tokens` tokens.
    let text: String = "lorem ipsum dolor sit amet ".repeat(prompt_tokens * 4 / 27 + 1);
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "Summarise."}],
        "max_tokens": 16,
    }))?;
    let key = with_key.then_some(BENCH_KEY);
    let client = chaos::extproc::connect(epp.addrs.ext_proc).await?;
    // warm-up
    for _ in 0..200 {
        one_decision(&mut client.clone(), &body, key).await?;
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
            async move { one_decision(&mut c, body, key).await }
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
    let us = net * 1e6 / requests as f64;
    Ok((
        format!(
            "| {prompt_tokens} | {} | - | {concurrency} | {requests} | {wall:.2} | {:.0} | {cpu:.2} | {:.2} | {:.0} | {us:.1} |",
            body.len(),
            requests as f64 / wall,
            idle_rate * wall,
            requests as f64 / net,
        ),
        us,
    ))
}

fn flow_config(max_concurrency: u64) -> String {
    format!(
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {{name: slots, type: concurrency-detector, parameters: {{maxConcurrency: {max_concurrency}}}}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: 1}}
flowControl:
  saturationDetector: {{pluginRef: slots}}
"
    )
}

async fn flow_cluster(
    endpoints: &std::path::Path,
    max_concurrency: u64,
    extra: &[&str],
) -> anyhow::Result<(
    chaos::raft::RaftCluster,
    Vec<ExternalProcessorClient<tonic::transport::Channel>>,
)> {
    let cfg = flow_config(max_concurrency);
    // The default compaction (the chaos harness snapshots every 20 entries to exercise joins).
    let mut args = vec![
        "--config-text",
        cfg.as_str(),
        "--log-level",
        "warn",
        "--raft-snapshot-logs",
        "10000",
    ];
    args.extend_from_slice(extra);
    let raft = chaos::raft::RaftCluster::start_with(3, endpoints, &args).await?;
    let global = extra
        .windows(2)
        .all(|w| w != ["--flow-control-scope", "replica"]);
    if global {
        chaos::wait::until(
            "cluster flow control ready",
            Duration::from_secs(30),
            || async {
                let mut ok = true;
                for id in 1..=3 {
                    let Ok(r) = raft.replica(id) else {
                        return false;
                    };
                    let v = r.flow_view().await;
                    ok &= v.is_ok_and(|v| {
                        v["local"]["configured"] == true
                            && v["local"]["degraded"] == false
                            && v["global"]["pool_endpoints"].as_u64().unwrap_or(0) > 0
                    });
                }
                ok
            },
        )
        .await?;
    }
    let mut clients = Vec::new();
    for id in 1..=3 {
        let addr = raft.replica(id)?.addrs.ext_proc;
        clients.push(chaos::extproc::connect(addr).await?);
    }
    Ok((raft, clients))
}

/// Route `rid` (a small chat request) and read the answer to its end; the time it took, ms, and
/// the route info the observing filter needs to settle it.
async fn route(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    body: &[u8],
    rid: &str,
) -> anyhow::Result<(f64, String)> {
    let t = Instant::now();
    let info = chaos::extproc::route(client, body, rid).await?;
    Ok((t.elapsed().as_secs_f64() * 1e3, info))
}

/// The response of the request routed with `route` ended, as the response-observing filter
/// reports it.
async fn settle(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    route: &str,
) -> anyhow::Result<()> {
    chaos::extproc::observe(client, route, None).await
}

fn counter(texts: &[String], needle: &str) -> f64 {
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| l.starts_with(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn leader_commit(raft: &chaos::raft::RaftCluster) -> anyhow::Result<u64> {
    let leader = raft
        .agreed_leader(&[1, 2, 3])
        .await
        .context("no agreed leader")?;
    Ok(raft.leader_and_commit(leader).await?.1)
}

async fn global_flow(
    requests: usize,
    concurrency: usize,
    handoffs: usize,
    credit_slack: Option<u32>,
) -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig {
        pods: 16,
        ..SimConfig::default()
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml())?;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Say hello in one word, please."}],
        "max_tokens": 4,
    }))?;
    let slack = credit_slack.map(|s| s.to_string());
    let slack_label = slack.clone().unwrap_or_else(|| "default".into());

    // Unsaturated: cluster scope (fast path on local credit) versus per-replica flow control.
    println!(
        "| flow control | credit slack | requests | concurrency | wall s | admissions/s | EPP CPU µs per request (3 replicas) | decision p50 ms | decision p99 ms | fast / credit-wait / slow path | fast admit p50 | fast admit p99 | Raft entries per admission |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for scope in ["cluster", "replica"] {
        let mut extra = vec!["--flow-control-scope", scope];
        if let Some(s) = &slack {
            extra.extend(["--flow-credit-slack", s.as_str()]);
        }
        let (raft, clients) = flow_cluster(&endpoints, 100_000, &extra).await?;
        let run = |n: usize, tag: &'static str| {
            let clients = clients.clone();
            let body = body.clone();
            async move {
                let results: Vec<anyhow::Result<f64>> = futures::stream::iter(0..n)
                    .map(|i| {
                        let mut c = clients[i % 3].clone();
                        let mut s = clients[(i + 1) % 3].clone();
                        let body = body.clone();
                        async move {
                            let rid = format!("{tag}-{i}");
                            let (ms, info) = route(&mut c, &body, &rid).await?;
                            settle(&mut s, &info).await?;
                            Ok(ms)
                        }
                    })
                    .buffer_unordered(concurrency)
                    .collect()
                    .await;
                results.into_iter().collect::<anyhow::Result<Vec<f64>>>()
            }
        };
        run(500, "warm").await?;
        let c0 = leader_commit(&raft).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let c1 = leader_commit(&raft).await?;
        let idle_per_s = (c1 - c0) as f64 / 2.0;
        let pids: Vec<u32> = (1..=3)
            .filter_map(|id| raft.replica(id).ok()?.pid_u32())
            .collect();
        let cpu = || {
            pids.iter()
                .map(|p| proc_cpu_seconds(*p).unwrap_or(0.0))
                .sum::<f64>()
        };
        let cpu0 = cpu();
        let t0 = Instant::now();
        let mut lat = run(requests, "run").await?;
        let wall = t0.elapsed().as_secs_f64();
        let cpu_us = (cpu() - cpu0) * 1e6 / requests as f64;
        let c2 = leader_commit(&raft).await?;
        lat.sort_by(f64::total_cmp);
        let mut texts = Vec::new();
        for id in 1..=3 {
            texts.push(raft.replica(id)?.metrics().await?);
        }
        if scope == "cluster" {
            let q = histogram(
                &texts,
                "llm_d_epp_flow_control_request_queue_duration_seconds",
            );
            let b = histogram(&texts, "llm_d_epp_cluster_flow_batch_duration_seconds");
            let n = histogram(&texts, "llm_d_epp_cluster_flow_batch_commands");
            eprintln!(
                "slow path wait (enqueue → verdict) p50 ≤ {:.1} ms, p99 ≤ {:.1} ms; batch commit p50 ≤ {:.1} ms, p99 ≤ {:.1} ms; commands per batch p50 ≤ {:.0}, p99 ≤ {:.0}",
                histogram_quantile(&q, 0.5) * 1e3,
                histogram_quantile(&q, 0.99) * 1e3,
                histogram_quantile(&b, 0.5) * 1e3,
                histogram_quantile(&b, 0.99) * 1e3,
                histogram_quantile(&n, 0.5),
                histogram_quantile(&n, 0.99),
            );
        }
        let (fast_slow, admit50, admit99, per_admission) = if scope == "cluster" {
            let fast = counter(
                &texts,
                "llm_d_epp_cluster_flow_admissions_total{path=\"fast\"}",
            );
            let slow = counter(
                &texts,
                "llm_d_epp_cluster_flow_admissions_total{path=\"slow\"}",
            );
            let wait = counter(
                &texts,
                "llm_d_epp_cluster_flow_admissions_total{path=\"credit-wait\"}",
            );
            let h = histogram(&texts, "llm_d_epp_cluster_flow_fast_admit_duration_seconds");
            let entries = (c2 - c1) as f64 - idle_per_s * wall;
            (
                format!("{fast:.0} / {wait:.0} / {slow:.0}"),
                format!("≤ {:.0} µs", histogram_quantile(&h, 0.5) * 1e6),
                format!("≤ {:.0} µs", histogram_quantile(&h, 0.99) * 1e6),
                format!("{:.3}", entries.max(0.0) / requests as f64),
            )
        } else {
            (
                "—".into(),
                "—".into(),
                "—".into(),
                "0 (none replicated)".into(),
            )
        };
        println!(
            "| {scope} | {slack_label} | {requests} | {concurrency} | {wall:.2} | {:.0} | {cpu_us:.0} | {:.3} | {:.3} | {fast_slow} | {admit50} | {admit99} | {per_admission} |",
            requests as f64 / wall,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
        );
        raft.shutdown().await;
    }

    // Saturated: one slot (one pod, one request), no credit. A holder on replica 1, a waiter on
    // replica 2; the holder's settlement goes to replica 3; measured: settlement sent → the
    // waiter's dispatch answer received.
    let one_pod = Sim::start(SimConfig {
        pods: 1,
        ..SimConfig::default()
    })
    .await?;
    let one = dir.path().join("one-pod.yaml");
    std::fs::write(&one, one_pod.pods_yaml())?;
    let (raft, clients) = flow_cluster(&one, 1, &["--flow-credit-slack", "0"]).await?;
    let mut lat = Vec::new();
    for k in 0..handoffs {
        let (mut c1, mut c2, mut c3) = (clients[0].clone(), clients[1].clone(), clients[2].clone());
        let holder = format!("h{k}");
        let waiter = format!("w{k}");
        let (_, holder) = route(&mut c1, &body, &holder).await?;
        let w = {
            let body = body.clone();
            let waiter = waiter.clone();
            tokio::spawn(async move {
                let (_, info) = route(&mut c2, &body, &waiter).await?;
                Ok::<(Instant, String), anyhow::Error>((Instant::now(), info))
            })
        };
        // Let the waiter's enqueue commit before the slot frees.
        chaos::wait::until("the waiter queued", Duration::from_secs(5), || async {
            match raft.replica(2) {
                Ok(r) => r
                    .flow_view()
                    .await
                    .is_ok_and(|v| v["global"]["totals"]["queued_requests"] == 1),
                Err(_) => false,
            }
        })
        .await?;
        let t = Instant::now();
        settle(&mut c3, &holder).await?;
        let (done, waiter) = w.await??;
        lat.push(done.duration_since(t).as_secs_f64() * 1e3);
        settle(&mut c3, &waiter).await?;
        chaos::wait::until("the slot free", Duration::from_secs(5), || async {
            match raft.replica(1) {
                Ok(r) => r
                    .flow_view()
                    .await
                    .is_ok_and(|v| v["global"]["totals"]["inflight_requests"] == 0),
                Err(_) => false,
            }
        })
        .await?;
    }
    lat.sort_by(f64::total_cmp);
    println!();
    println!("| hand-offs | slot freed → waiter dispatched p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|");
    println!(
        "| {handoffs} | {:.2} | {:.2} | {:.2} |",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    raft.shutdown().await;
    one_pod.shutdown().await;
    sim.shutdown().await;
    Ok(())
}

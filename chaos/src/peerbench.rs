//! The peer benchmark: one simulated pool, the same seeded workloads through Envoy → EPP (the
//! project's default profile), Envoy round robin, `sglang-router` and `vllm-router`
//! (`cache_aware`), side by side (`epp-bench peers`, `deploy/local/bench-peers.sh`).
//!
//! Every target starts each workload with cold pods (prefix caches reset) and content it has never
//! seen (a seed per run and workload), and the targets take turns going first from run to run.

use std::collections::BTreeMap;

use anyhow::Context;
use serde::Serialize;
use sim::loadgen::{self, Arrival, LoadConfig, Report, TenantClass};
use sim::{EngineModel, SimConfig};

use crate::cluster::{ClusterSpec, LocalCluster};
use crate::peers::{Peer, PeerRouter};
use crate::plot::{Panel, grouped_bars};

/// The workloads, by name.
pub fn workloads() -> Vec<(&'static str, LoadConfig)> {
    vec![
        // The demo's shape: every conversation opens with the same 512-word system prompt.
        (
            "shared-prompt",
            LoadConfig {
                conversations: 16,
                turns: 4,
                system_prompt_words: 512,
                conversation_words: 256,
                user_words: 32,
                max_tokens: 16,
                concurrency: 8,
                ..LoadConfig::default()
            },
        ),
        // Long private prefixes: ~2.7k tokens per conversation, 16 in flight.
        (
            "long-prefixes",
            LoadConfig {
                conversations: 64,
                turns: 6,
                system_prompt_words: 64,
                conversation_words: 2000,
                user_words: 32,
                max_tokens: 16,
                concurrency: 16,
                ..LoadConfig::default()
            },
        ),
        // Agents: a ~10k-token context (tools prompt + task) re-sent and grown every turn by a
        // tool result and a tool-call-sized answer.
        (
            "agentic",
            LoadConfig {
                conversations: 8,
                turns: 10,
                system_prompt_words: 600,
                conversation_words: 7000,
                user_words: 150,
                max_tokens: 48,
                concurrency: 8,
                ..LoadConfig::default()
            },
        ),
        // Open loop: conversations arriving as a Poisson process within 3 s, plus a burst of 32
        // one-shot requests at the start.
        (
            "bursty",
            LoadConfig {
                conversations: 48,
                turns: 3,
                system_prompt_words: 512,
                conversation_words: 300,
                user_words: 32,
                max_tokens: 16,
                arrival: Arrival::Poisson,
                window_ms: 3000,
                tenants: vec![TenantClass {
                    name: "burst".into(),
                    requests: 32,
                    burst: 32,
                    rate: 1.0,
                    prompt_words: 400,
                    max_tokens: 16,
                    ..TenantClass::default()
                }],
                ..LoadConfig::default()
            },
        ),
    ]
}

/// Options of one benchmark run.
#[derive(Debug, Clone)]
pub struct Options {
    pub runs: usize,
    /// Workload names to run (empty: all).
    pub only: Vec<String>,
    /// Skip the PyPI routers (when only the EPP and round robin are wanted).
    pub no_peers: bool,
    /// The pods' engine model.
    pub engine: EngineModel,
    /// Knobs for some pods only (a heterogeneous pool).
    pub pod_knobs: Vec<sim::PodOverride>,
}

/// One (run, workload, target) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub run: usize,
    pub workload: String,
    pub target: String,
    pub report: Report,
}

/// Run the benchmark; every report, in order.
pub async fn run(opts: &Options) -> anyhow::Result<Vec<Measurement>> {
    let cluster = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pod_knobs: opts.pod_knobs.clone(),
            ..crate::workloads::bench_pool(4, opts.engine)
        },
        ..ClusterSpec::default()
    })
    .await
    .context("starting pods, the EPP and Envoy")?;
    cluster.wait_for_pods().await?;
    let workers: Vec<String> = cluster
        .sim
        .pods()
        .iter()
        .map(|p| format!("http://{}", p.addr))
        .collect();
    let base = cluster.envoy.url();
    let mut targets: Vec<(String, String)> = vec![
        ("epp".into(), base.clone()),
        ("round-robin".into(), format!("{base}/rr")),
    ];
    let mut routers = Vec::new();
    if !opts.no_peers {
        for peer in [Peer::Sglang, Peer::Vllm] {
            let r = PeerRouter::start(peer, "cache_aware", &workers).await?;
            targets.push((format!("{} (cache_aware)", peer.name()), r.url()));
            routers.push(r);
        }
    }
    let mut out = Vec::new();
    for (run, name, load) in schedule(opts) {
        let mut reports = Vec::new();
        for k in 0..targets.len() {
            let (target, url) = &targets[(k + run) % targets.len()];
            cluster.sim.reset_prefix_caches();
            eprintln!("run {} · {name} · {target} ...", run + 1);
            let report = loadgen::run(&load, url)
                .await
                .with_context(|| format!("{name} through {target}"))?;
            if target == "epp" && std::env::var_os("PEER_BENCH_DEBUG").is_some() {
                let admin = cluster.epp(0)?.addrs.admin;
                for view in ["cost-model", "inflight", "scrape"] {
                    let v = reqwest::get(format!("http://{admin}/debug/{view}"))
                        .await?
                        .text()
                        .await?;
                    eprintln!("  /debug/{view}: {v}");
                }
            }
            reports.push((target.clone(), report));
        }
        let order: Vec<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
        keep(&mut out, run, name, reports, &order);
    }
    drop(routers);
    cluster.shutdown().await;
    Ok(out)
}

/// The project's default profile with the precise prefix producer instead of the approximate
/// one (the cost model reads either).
pub const PRECISE_PROFILE: &str = "\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
- type: cost-model-scorer
";

/// Precise against approximate prefix routing (`epp-bench precise`): the peer benchmark's
/// workloads through the default profile on a pool publishing KV events, once with the built-in
/// default (approximate index) and once with [`PRECISE_PROFILE`], each on a fresh cluster (cold
/// pods, fresh EPP) built from the same configuration, the arms alternating which goes first.
pub async fn precise_vs_approx(opts: &Options) -> anyhow::Result<Vec<Measurement>> {
    let arms: [(&str, Vec<String>); 2] = [
        ("epp (approximate)", Vec::new()),
        (
            "epp (precise)",
            vec!["--config-text".into(), PRECISE_PROFILE.into()],
        ),
    ];
    let mut out = Vec::new();
    for (run, name, load) in schedule(opts) {
        let mut reports = Vec::new();
        for k in 0..arms.len() {
            let (target, args) = &arms[(k + run) % arms.len()];
            let cluster = LocalCluster::start(ClusterSpec {
                sim: SimConfig {
                    pod_knobs: opts.pod_knobs.clone(),
                    kv_events: Some(sim::KvEventsConfig::default()),
                    ..crate::workloads::bench_pool(4, opts.engine)
                },
                epp_args: args.clone(),
                ..ClusterSpec::default()
            })
            .await
            .context("starting pods, the EPP and Envoy")?;
            cluster.wait_for_pods().await?;
            eprintln!("run {} · {name} · {target} ...", run + 1);
            let report = loadgen::run(&load, &cluster.envoy.url())
                .await
                .with_context(|| format!("{name} through {target}"))?;
            cluster.shutdown().await;
            reports.push((target.to_string(), report));
        }
        let order: Vec<&str> = arms.iter().map(|(n, _)| *n).collect();
        keep(&mut out, run, name, reports, &order);
    }
    Ok(out)
}

/// Every (run, workload, load seeded for that run and workload) a benchmark measures, in order.
fn schedule(opts: &Options) -> Vec<(usize, &'static str, LoadConfig)> {
    let mut out = Vec::new();
    for run in 0..opts.runs {
        for (w, (name, load)) in workloads().into_iter().enumerate() {
            if opts.only.is_empty() || opts.only.iter().any(|o| o == name) {
                let seed = 1_000 * (run as u64 + 1) + w as u64;
                out.push((run, name, LoadConfig { seed, ..load }));
            }
        }
    }
    out
}

/// Print one workload's reports (targets in `order`) and keep them.
fn keep(
    out: &mut Vec<Measurement>,
    run: usize,
    name: &str,
    mut reports: Vec<(String, Report)>,
    order: &[&str],
) {
    reports.sort_by_key(|(t, _)| order.iter().position(|n| n == t));
    println!("\n### run {} · {name}\n", run + 1);
    print!("{}", loadgen::render_table(&reports));
    for (target, report) in reports {
        out.push(Measurement {
            run: run + 1,
            workload: name.to_string(),
            target,
            report,
        });
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The figures the acceptance compares, per (workload, target): medians over the runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub requests_per_s: f64,
    pub cached_ratio: f64,
    pub pods_used: f64,
    pub errors: f64,
}

pub type Summaries = BTreeMap<String, Vec<(String, Summary)>>;

/// Medians over runs, keyed by workload, targets in their order.
pub fn summarize(ms: &[Measurement]) -> Summaries {
    let mut out: Summaries = BTreeMap::new();
    let mut keys: Vec<(String, String)> = Vec::new();
    for m in ms {
        let k = (m.workload.clone(), m.target.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (w, t) in keys {
        let of = |f: fn(&Report) -> f64| {
            median(
                ms.iter()
                    .filter(|m| m.workload == w && m.target == t)
                    .map(|m| f(&m.report))
                    .collect(),
            )
        };
        let s = Summary {
            ttft_p50_ms: of(|r| r.ttft_p50_ms),
            ttft_p90_ms: of(|r| r.ttft_p90_ms),
            ttft_p99_ms: of(|r| r.ttft_p99_ms),
            e2e_p50_ms: of(|r| r.e2e_p50_ms),
            e2e_p99_ms: of(|r| r.e2e_p99_ms),
            requests_per_s: of(|r| r.requests_per_s),
            cached_ratio: of(|r| r.cached_ratio),
            pods_used: of(|r| r.pods.len() as f64),
            errors: of(|r| r.errors as f64),
        };
        out.entry(w).or_default().push((t, s));
    }
    out
}

/// The medians as a Markdown table, with the acceptance verdict of the EPP per workload: TTFT p50
/// and p99 at most the best other target's, throughput at least the best's, cached-token ratio at
/// least the best's minus one point.
pub fn render(summaries: &Summaries, runs: usize) -> String {
    let mut s = String::from(
        "| workload | target | TTFT p50 / p90 / p99 ms | e2e p50 / p99 ms | req/s | cached | pods | errors |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut verdicts = String::new();
    for (w, rows) in summaries {
        for (t, m) in rows {
            s += &format!(
                "| {w} | {t} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.1} | {:.3} | {:.0} | {:.0} |\n",
                m.ttft_p50_ms,
                m.ttft_p90_ms,
                m.ttft_p99_ms,
                m.e2e_p50_ms,
                m.e2e_p99_ms,
                m.requests_per_s,
                m.cached_ratio,
                m.pods_used,
                m.errors
            );
        }
        let Some((_, epp)) = rows.iter().find(|(t, _)| t == "epp") else {
            continue;
        };
        let others: Vec<&Summary> = rows
            .iter()
            .filter(|(t, _)| t != "epp")
            .map(|(_, m)| m)
            .collect();
        let best = |f: fn(&Summary) -> f64, max: bool| {
            others
                .iter()
                .map(|m| f(m))
                .fold(if max { f64::MIN } else { f64::MAX }, |a, b| {
                    if max { a.max(b) } else { a.min(b) }
                })
        };
        let checks = [
            (
                "TTFT p50",
                epp.ttft_p50_ms <= best(|m| m.ttft_p50_ms, false),
            ),
            (
                "TTFT p99",
                epp.ttft_p99_ms <= best(|m| m.ttft_p99_ms, false),
            ),
            (
                "throughput",
                epp.requests_per_s >= best(|m| m.requests_per_s, true),
            ),
            (
                "cached ratio",
                epp.cached_ratio >= best(|m| m.cached_ratio, true) - 0.01,
            ),
        ];
        let line: Vec<String> = checks
            .iter()
            .map(|(k, ok)| format!("{k} {}", if *ok { "best" } else { "NOT best" }))
            .collect();
        verdicts += &format!("- {w}: {}\n", line.join(", "));
    }
    s + &format!("\nEPP against the best other target (medians of {runs} runs):\n") + &verdicts
}

/// TTFT p50 / p99 and throughput per workload and target (medians over runs) as an SVG.
pub fn svg(summaries: &Summaries, runs: usize) -> String {
    let groups: Vec<String> = summaries.keys().cloned().collect();
    let series: Vec<String> = summaries
        .values()
        .next()
        .map(|rows| rows.iter().map(|(t, _)| t.clone()).collect())
        .unwrap_or_default();
    let panel = |title: &str, unit: &str, f: fn(&Summary) -> f64| Panel {
        title: title.into(),
        unit: unit.into(),
        values: summaries
            .values()
            .map(|rows| {
                series
                    .iter()
                    .map(|t| {
                        rows.iter()
                            .find(|(n, _)| n == t)
                            .map_or(f64::NAN, |(_, m)| f(m))
                    })
                    .collect()
            })
            .collect(),
    };
    grouped_bars(
        &format!(
            "EPP vs round robin vs PyPI routers on one simulated pool (median of {runs} runs)"
        ),
        &groups,
        &series,
        &[
            panel("TTFT p50", "ms", |m| m.ttft_p50_ms),
            panel("TTFT p99", "ms", |m| m.ttft_p99_ms),
            panel("throughput", "requests/s", |m| m.requests_per_s),
        ],
    )
}

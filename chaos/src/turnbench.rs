//! Turn priority on agent traffic (`epp-bench turns`): long-context agent loops — each
//! conversation a program with its own fairness id, tool-call-sized answers, a tool result added
//! every turn — arriving over a window, so new programs start while old ones loop, on a pool kept
//! saturated by flow control (`maxConcurrency` = the pods' batch). The same seeded load through
//! the default profile with the band ordered by `program-aware-fairness` `strategy:
//! turn-priority`, and by llm-d's default fairness (`global-strict-fairness-policy`: first come,
//! first served across programs), each on a fresh cluster, the arms alternating which goes first.
//! The figure is TTFT (queueing included) of the loops' turns 5 and later against turns 1–4.
//!
//! (Not part of `epp-bench peers`: the PyPI routers and round robin do not queue, and turn
//! priority orders only what flow control holds back.)

use anyhow::Context;
use serde::Serialize;
use sim::EngineModel;
use sim::loadgen::{self, Arrival, LoadConfig, Report, TURN_BUCKETS};

use crate::cluster::{ClusterSpec, LocalCluster};

#[derive(Debug, Clone)]
pub struct Options {
    pub runs: usize,
    pub pods: usize,
    pub engine: EngineModel,
    /// Programs (agent loops) per run.
    pub programs: usize,
    pub turns: usize,
    /// The window the programs arrive in (Poisson), ms.
    pub window_ms: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            runs: 3,
            pods: 4,
            engine: EngineModel::Simple,
            programs: 96,
            turns: 12,
            window_ms: 4_000,
        }
    }
}

/// The flow-control configuration with band 0 ordered by `fairness` (a plugin type, with its
/// parameters inline).
pub fn config(fairness: &str, max_concurrency: usize) -> String {
    format!(
        "\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: cost-model-scorer
- {{name: slots, type: concurrency-detector, parameters: {{maxConcurrency: {max_concurrency}}}}}
- {{name: programs, {fairness}}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: cost-model-scorer}}
flowControl:
  defaultRequestTTL: 120s
  saturationDetector: {{pluginRef: slots}}
  priorityBands: [{{priority: 0, fairnessPolicyRef: programs}}]
"
    )
}

/// The arms: (name, fairness plugin).
pub const ARMS: [(&str, &str); 2] = [
    (
        "turn-priority",
        "type: program-aware-fairness, parameters: {strategy: turn-priority}",
    ),
    (
        "fcfs (llm-d default)",
        "type: global-strict-fairness-policy",
    ),
];

/// The agent loops: a ~2.5k-token context (tools prompt + task), a ~150-token tool result and a
/// 32-token tool call per turn.
pub fn load(opts: &Options, seed: u64) -> LoadConfig {
    LoadConfig {
        conversations: opts.programs,
        turns: opts.turns,
        system_prompt_words: 400,
        conversation_words: 1500,
        user_words: 100,
        max_tokens: 32,
        arrival: Arrival::Poisson,
        window_ms: opts.window_ms,
        program_ids: true,
        request_timeout_ms: 180_000,
        seed,
        ..LoadConfig::default()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub run: usize,
    pub arm: String,
    pub report: Report,
}

pub async fn run(opts: &Options) -> anyhow::Result<Vec<Measurement>> {
    let pool = crate::workloads::bench_pool(opts.pods, opts.engine);
    let slots = pool.knobs.max_num_seqs;
    let mut out = Vec::new();
    for run in 0..opts.runs {
        let load = load(opts, 7_000 + run as u64);
        for k in 0..ARMS.len() {
            let (arm, fairness) = ARMS[(k + run) % ARMS.len()];
            let cluster = LocalCluster::start(ClusterSpec {
                sim: pool.clone(),
                epp_args: vec!["--config-text".into(), config(fairness, slots)],
                ..ClusterSpec::default()
            })
            .await
            .context("starting pods, the EPP and Envoy")?;
            cluster.wait_for_pods().await?;
            eprintln!("run {} · {arm} ...", run + 1);
            let report = loadgen::run(&load, &cluster.envoy.url())
                .await
                .with_context(|| format!("agent loops through {arm}"))?;
            cluster.shutdown().await;
            out.push(Measurement {
                run: run + 1,
                arm: arm.to_string(),
                report,
            });
        }
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Per arm, medians over the runs: TTFT p50 / p99 of turns 5+ and of turns 1–4, all requests'
/// TTFT p50 / p99, throughput and errors; each run's figures below.
pub fn render(ms: &[Measurement]) -> String {
    let mut s = String::from(
        "| arm | turns 5+ TTFT p50 / p99 ms | turns 1-4 TTFT p50 / p99 ms | all TTFT p50 / p99 ms | req/s | cached | errors |\n|---|---|---|---|---|---|---|\n",
    );
    for (arm, _) in ARMS {
        let of = |f: &dyn Fn(&Report) -> f64| {
            median(
                ms.iter()
                    .filter(|m| m.arm == arm)
                    .map(|m| f(&m.report))
                    .collect(),
            )
        };
        let bucket = |i: usize, p99: bool| {
            move |r: &Report| {
                r.turns.get(TURN_BUCKETS[i]).map_or(f64::NAN, |b| {
                    if p99 { b.ttft_p99_ms } else { b.ttft_p50_ms }
                })
            }
        };
        s += &format!(
            "| {arm} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.1} | {:.3} | {:.0} |\n",
            of(&bucket(1, false)),
            of(&bucket(1, true)),
            of(&bucket(0, false)),
            of(&bucket(0, true)),
            of(&|r| r.ttft_p50_ms),
            of(&|r| r.ttft_p99_ms),
            of(&|r| r.requests_per_s),
            of(&|r| r.cached_ratio),
            of(&|r| r.errors as f64),
        );
    }
    s
}

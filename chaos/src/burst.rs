//! The burst benchmark (`epp-bench burst`): premium requests that arrive *with* a best-effort
//! burst, all in the same instant — `premium_first` premium (`interactive`) requests, then `n`
//! best-effort (`batch`) ones with a premium one after every `premium_every` of them — through Envoy
//! and the shipped flow-control example (`deploy/examples/flow-control.yaml`, its
//! `maxConcurrency` set to the pods' slots) against the same cluster without flow control.
//!
//! Each configuration runs twice on fresh pods: the premium requests alone, fired at once (the
//! no-burst baseline), then the whole burst. Latency is the client's, from sending to the last
//! byte of a non-streamed `/v1/completions` answer. The report: premium and best-effort p50/p95/p99,
//! the premium p95 over its no-burst p95, errors by status and dropped reason, best-effort
//! throughput (served per second from the burst's start to the last best-effort answer), and
//! requests that got no answer at all.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sim::loadgen::OBJECTIVE_HEADER;
use sim::{EngineModel, PodKnobs, SimConfig};

use crate::cluster::{ClusterSpec, LocalCluster};
use crate::epp::pct;
use crate::locate::workspace_root;

/// What one run looks like.
#[derive(Debug, Clone)]
pub struct Options {
    pub pods: usize,
    /// Slots per pod (the pods' `max_num_seqs`, the example's `maxConcurrency`).
    pub slots: usize,
    /// Best-effort requests in the burst.
    pub n: usize,
    /// Premium requests ahead of the burst.
    pub premium_first: usize,
    /// A premium request after every this many best-effort ones.
    pub premium_every: usize,
    pub replicas: usize,
    pub engine: EngineModel,
    /// Words per prompt.
    pub prompt_words: usize,
    pub max_tokens: u32,
    /// A request that has no answer after this long counts as hung.
    pub timeout: Duration,
    /// `flowControl.demandReserve` to set, as the inside of a YAML flow mapping
    /// (`factor: 0, settle: 0s`; unset: the example's).
    pub demand_reserve: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            pods: 4,
            slots: 16,
            n: 128,
            premium_first: 10,
            premium_every: 5,
            replicas: 1,
            engine: EngineModel::Simple,
            prompt_words: 600,
            max_tokens: 64,
            timeout: Duration::from_secs(120),
            demand_reserve: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Class {
    Premium,
    BestEffort,
}

/// The arrival order of one burst: `premium_first` premium, then `n` best-effort with a premium
/// after every `premium_every`.
pub fn arrivals(o: &Options) -> Vec<Class> {
    let mut v = vec![Class::Premium; o.premium_first];
    for i in 1..=o.n {
        v.push(Class::BestEffort);
        if o.premium_every > 0 && i % o.premium_every == 0 {
            v.push(Class::Premium);
        }
    }
    v
}

/// One request's fate as the client saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub class: Class,
    /// Place in the arrival order.
    pub index: usize,
    /// The pod that answered (its `x-inference-pod` header).
    pub pod: Option<String>,
    /// HTTP status, `None` when no answer came (transport error or timeout).
    pub status: Option<u16>,
    pub dropped_reason: Option<String>,
    pub latency: Duration,
    /// Since the burst's start, when the answer ended.
    pub done_at: Duration,
}

/// Percentiles of one class.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub served: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

fn latency(outcomes: &[Outcome], class: Class) -> Latency {
    let mut ms: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.class == class && o.status == Some(200))
        .map(|o| o.latency.as_secs_f64() * 1000.0)
        .collect();
    ms.sort_by(f64::total_cmp);
    Latency {
        served: ms.len(),
        p50_ms: pct(&ms, 0.5),
        p95_ms: pct(&ms, 0.95),
        p99_ms: pct(&ms, 0.99),
    }
}

/// One configuration's measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub flow_control: bool,
    pub replicas: usize,
    pub n: usize,
    pub premium_alone: Latency,
    pub premium: Latency,
    pub best_effort: Latency,
    /// Premium p95 with the burst over its p95 alone.
    pub ratio: f64,
    pub best_effort_per_s: f64,
    /// `status/reason` → count, over both classes of the burst run (`premium:`/`best-effort:`).
    pub errors: BTreeMap<String, usize>,
    /// Requests with no HTTP answer (lost or hung), both runs.
    pub unanswered: usize,
    /// Every request of the burst run.
    pub outcomes: Vec<Outcome>,
}

fn prompt(seq: u64, words: usize) -> String {
    // Unique from the first word, so no two requests share a prefix (no cache effects).
    const WORDS: [&str; 16] = [
        "river", "stone", "lamp", "orbit", "maple", "cobalt", "tide", "ember", "quartz", "meadow",
        "signal", "harbor", "violet", "copper", "thunder", "glacier",
    ];
    let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = format!("request {seq}:");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(' ');
        s.push_str(WORDS[(x % 16) as usize]);
    }
    s
}

/// Fires `classes` at once (each on its own connection) and waits for every answer.
async fn fire(
    url: &str,
    o: &Options,
    classes: &[Class],
    seq0: u64,
) -> anyhow::Result<Vec<Outcome>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(classes.len())
        .tcp_nodelay(true)
        .timeout(o.timeout)
        .build()?;
    // The bodies are built before the clock starts.
    let bodies: Vec<(Class, String)> = classes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let body = serde_json::json!({
                "model": "sim-model",
                "prompt": prompt(seq0 + i as u64, o.prompt_words),
                "max_tokens": o.max_tokens,
            });
            (c, body.to_string())
        })
        .collect();
    let start = Instant::now();
    let tasks = bodies
        .into_iter()
        .enumerate()
        .map(|(index, (class, body))| {
            let client = client.clone();
            let url = url.to_string();
            tokio::spawn(async move {
                let objective = match class {
                    Class::Premium => "interactive",
                    Class::BestEffort => "batch",
                };
                let sent = Instant::now();
                let r = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .header(OBJECTIVE_HEADER, objective)
                    .body(body)
                    .send()
                    .await;
                let (status, dropped_reason, pod) = match r {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let header = |name: &str| {
                            resp.headers()
                                .get(name)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        };
                        let reason = header("x-llm-d-request-dropped-reason");
                        let pod = header("x-inference-pod");
                        match resp.bytes().await {
                            Ok(_) => (Some(status), reason, pod),
                            Err(_) => (None, reason, pod),
                        }
                    }
                    Err(_) => (None, None, None),
                };
                Outcome {
                    class,
                    index,
                    pod,
                    status,
                    dropped_reason,
                    latency: sent.elapsed(),
                    done_at: start.elapsed(),
                }
            })
        });
    let mut out = Vec::new();
    for t in futures::future::join_all(tasks).await {
        out.push(t.context("a request task")?);
    }
    Ok(out)
}

fn flow_control_config(slots: usize, demand_reserve: Option<&str>) -> anyhow::Result<String> {
    let shipped =
        std::fs::read_to_string(workspace_root().join("deploy/examples/flow-control.yaml"))?;
    let from = "parameters: {maxConcurrency: 4}";
    anyhow::ensure!(
        shipped.contains(from),
        "deploy/examples/flow-control.yaml no longer sets `{from}`"
    );
    let mut config = shipped.replace(from, &format!("parameters: {{maxConcurrency: {slots}}}"));
    if let Some(r) = demand_reserve {
        anyhow::ensure!(
            config.contains("\nflowControl:\n") && !config.contains("\n  demandReserve:"),
            "deploy/examples/flow-control.yaml: no `flowControl:` block to add demandReserve to"
        );
        config = config.replace(
            "\nflowControl:\n",
            &format!("\nflowControl:\n  demandReserve: {{{r}}}\n"),
        );
    }
    Ok(config)
}

/// Measures one configuration: a fresh cluster, the premium requests alone, then the burst.
pub async fn measure(o: &Options, flow_control: bool) -> anyhow::Result<Row> {
    let mut epp_args = vec![
        "--objectives-file".to_string(),
        workspace_root()
            .join("deploy/examples/objectives.yaml")
            .display()
            .to_string(),
    ];
    if flow_control {
        epp_args.extend([
            "--config-text".into(),
            flow_control_config(o.slots, o.demand_reserve.as_deref())?,
        ]);
        if o.replicas > 1 {
            epp_args.extend(["--flow-control-scope".into(), "cluster".into()]);
        }
    }
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: o.pods,
            knobs: PodKnobs {
                max_num_seqs: o.slots,
                engine: o.engine,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        replicas: o.replicas,
        raft: o.replicas > 1,
        epp_args,
        ..ClusterSpec::default()
    })
    .await
    .context("starting the cluster")?;
    c.wait_for_pods().await?;
    let url = format!("{}/v1/completions", c.envoy.url());
    let burst = arrivals(o);
    let premium_only: Vec<Class> = burst
        .iter()
        .copied()
        .filter(|&c| c == Class::Premium)
        .collect();
    // Warm-up: connections and the pods' metrics, one request per slot at most.
    fire(&url, o, &vec![Class::BestEffort; o.pods], 1 << 40).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let alone = fire(&url, o, &premium_only, 0).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let with = fire(&url, o, &burst, 1 << 20).await?;
    c.shutdown().await;

    let mut errors = BTreeMap::new();
    for r in &with {
        if r.status != Some(200) {
            let class = match r.class {
                Class::Premium => "premium",
                Class::BestEffort => "best-effort",
            };
            let key = format!(
                "{class}: {} {}",
                r.status.map_or("no answer".into(), |s| s.to_string()),
                r.dropped_reason.as_deref().unwrap_or("")
            );
            *errors.entry(key.trim_end().to_string()).or_default() += 1;
        }
    }
    let premium_alone = latency(&alone, Class::Premium);
    let premium = latency(&with, Class::Premium);
    let best_effort = latency(&with, Class::BestEffort);
    let last_best_effort = with
        .iter()
        .filter(|r| r.class == Class::BestEffort && r.status == Some(200))
        .map(|r| r.done_at)
        .max()
        .unwrap_or_default();
    Ok(Row {
        flow_control,
        replicas: o.replicas,
        n: o.n,
        ratio: premium.p95_ms / premium_alone.p95_ms,
        best_effort_per_s: best_effort.served as f64 / last_best_effort.as_secs_f64().max(1e-9),
        premium_alone,
        premium,
        best_effort,
        errors,
        unanswered: alone
            .iter()
            .chain(&with)
            .filter(|r| r.status.is_none())
            .count(),
        outcomes: with,
    })
}

/// `base` at each replica count and burst size (`times` × the pool's slots), without flow control
/// (unless `flow_control_only`) and with it, one fresh cluster each.
pub async fn sweep(
    base: &Options,
    times: &[usize],
    replicas: &[usize],
    flow_control_only: bool,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &r in replicas {
        for &t in times {
            let o = Options {
                n: t * base.pods * base.slots,
                replicas: r,
                ..base.clone()
            };
            for fc in [false, true] {
                if !fc && flow_control_only {
                    continue;
                }
                eprintln!("replicas {r}, N = {}, flow control {fc} ...", o.n);
                rows.push(measure(&o, fc).await?);
            }
        }
    }
    Ok(rows)
}

/// The rows as a Markdown table; each flow-control row's best-effort throughput is also given as
/// a share of the no-flow-control row of the same replicas and N.
pub fn render(rows: &[Row]) -> String {
    let mut s = String::from(
        "| replicas | N | flow control | premium p95 alone ms | premium p50 / p95 / p99 ms | **premium p95 ratio** | best-effort p50 / p95 / p99 ms | best-effort/s (vs none) | errors | unanswered |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let base = rows
            .iter()
            .find(|b| !b.flow_control && b.replicas == r.replicas && b.n == r.n);
        let share = match base {
            Some(b) if r.flow_control => {
                format!(
                    " ({:.0}%)",
                    100.0 * r.best_effort_per_s / b.best_effort_per_s
                )
            }
            _ => String::new(),
        };
        let errors = if r.errors.is_empty() {
            "0".to_string()
        } else {
            r.errors
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s += &format!(
            "| {} | {} | {} | {:.0} | {:.0} / {:.0} / {:.0} | **{:.2}×** | {:.0} / {:.0} / {:.0} | {:.1}{} | {} | {} |\n",
            r.replicas,
            r.n,
            if r.flow_control { "on" } else { "off" },
            r.premium_alone.p95_ms,
            r.premium.p50_ms,
            r.premium.p95_ms,
            r.premium.p99_ms,
            r.ratio,
            r.best_effort.p50_ms,
            r.best_effort.p95_ms,
            r.best_effort.p99_ms,
            r.best_effort_per_s,
            share,
            errors,
            r.unanswered,
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_burst_interleaves_premium_after_every_fifth() {
        let o = Options {
            premium_first: 2,
            n: 10,
            ..Options::default()
        };
        let a = arrivals(&o);
        let p = Class::Premium;
        let b = Class::BestEffort;
        assert_eq!(a, vec![p, p, b, b, b, b, b, p, b, b, b, b, b, p]);
    }

    #[test]
    fn prompts_share_no_first_word_and_have_the_length_asked() {
        let a = prompt(1, 600);
        let b = prompt(2, 600);
        assert_ne!(a.split(' ').nth(1), b.split(' ').nth(1));
        assert_eq!(a.split(' ').count(), 602);
    }
}

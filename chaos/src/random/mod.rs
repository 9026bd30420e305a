//! The randomized chaos suite: a real cluster (replicas in cluster mode, Envoy, simulated pods)
//! under load while a seeded schedule breaks it, every request's outcome recorded, and the
//! architecture's invariants checked from outside after the run.
//!
//! - [`schedule`]: the faults a seed draws (kill -9, SIGSTOP, partitions, one-way cuts,
//!   latency, clock skew), with a majority kept healthy;
//! - [`load`]: closed-loop streaming clients for three tenants and the pods' occupancy;
//! - [`check`]: the invariant checks on what was observed.
//!
//! [`run`] does one seed and returns a [`Report`]; the `epp-chaos` binary runs seeds and prints
//! the reports, `deploy/local/chaos-soak.sh` runs it for half an hour, and `tests/chaos_random.rs`
//! runs a few short seeds in CI.
//!
//! Topology: replica `i`'s ext_proc port sits behind its own [`LinkProxy`], so Envoy (whose
//! ext_proc cluster is static) reaches a replica again after it restarts on a new port; peer links
//! are the [`RaftCluster`]'s proxies.

pub mod check;
pub mod load;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sim::{PodKnobs, Sim, SimConfig};

use crate::envoy::EnvoyProcess;
use crate::netproxy::LinkProxy;
use crate::raft::RaftCluster;
use check::{Check, Observed};
use load::{Load, Tenant};
use schedule::{Fault, Planned, Shape};

/// Pods and the decode slots the saturation detector gives each: capacity 16.
const PODS: usize = 4;
const SLOTS: u64 = 4;
/// `--flow-credit-slack`.
const SLACK: u64 = 8;

const CONFIG: &str = "\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: prefix-cache-scorer
- type: queue-scorer
- type: active-request-scorer
- {name: slots, type: concurrency-detector, parameters: {maxConcurrency: 4}}
- {name: rr, type: round-robin-fairness-policy}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: active-request-scorer, weight: 4}
flowControl:
  saturationDetector: {pluginRef: slots}
  priorityBands:
  - {priority: 5, fairnessPolicyRef: rr}
  - {priority: 0, fairnessPolicyRef: rr}
";

/// What to run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub seed: u64,
    pub replicas: u64,
    /// Length of the load (faults happen inside it).
    pub run: Duration,
}

/// One fault as it was applied.
#[derive(Debug, Clone, Serialize)]
pub struct Applied {
    pub at_s: f64,
    pub until_s: f64,
    pub kind: &'static str,
    pub fault: String,
}

/// One seed's result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub seed: u64,
    pub replicas: u64,
    pub run_s: f64,
    pub faults: Vec<Applied>,
    pub requests: usize,
    pub outcomes: BTreeMap<String, u64>,
    /// Complete responses per second.
    pub per_second: Vec<u32>,
    pub checks: Vec<Check>,
}

impl Report {
    /// The checks that failed.
    pub fn violations(&self) -> Vec<&Check> {
        self.checks.iter().filter(|c| !c.ok).collect()
    }

    /// A human-readable report.
    pub fn render(&self) -> String {
        let mut s = format!(
            "seed {} · {} replicas · {:.0} s · {} faults · {} requests\n",
            self.seed,
            self.replicas,
            self.run_s,
            self.faults.len(),
            self.requests
        );
        for f in &self.faults {
            s.push_str(&format!(
                "  {:>6.1}–{:<6.1} s  {}\n",
                f.at_s, f.until_s, f.fault
            ));
        }
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        s.push_str(&format!("  outcomes: {}\n", outcomes.join(", ")));
        let rate: Vec<String> = self.per_second.iter().map(u32::to_string).collect();
        s.push_str(&format!("  completions per second: {}\n", rate.join(" ")));
        for c in &self.checks {
            s.push_str(&format!(
                "  {} {:<3} {:<26} {}\n",
                if c.ok { "ok  " } else { "FAIL" },
                c.id,
                c.name,
                c.measured
            ));
        }
        s
    }
}

/// The schedule's bounds for a run of `run` on `replicas`.
pub fn shape(replicas: u64, run: Duration) -> Shape {
    Shape {
        replicas,
        run,
        margin: Duration::from_secs(4),
        gap: (Duration::from_millis(1500), Duration::from_secs(5)),
        hold: (Duration::from_secs(1), Duration::from_secs(5)),
    }
}

/// The longest tolerated gap between two responses: one fault's longest hold plus one failover.
/// Clients whose requests a paused replica holds wait out the pause (Envoy ejects the replica
/// only when its health checks time out), so a paused leader costs its pause plus the election;
/// the bound for one leader loss alone is enforced by the targeted failover tests
/// (`tests/raft_cluster.rs`, `tests/e2e_global_flow.rs`). A stuck cluster — like the leaked slots
/// the suite first found, 15 s without a response — fails it.
pub fn stall_limit(replicas: u64, run: Duration) -> Duration {
    shape(replicas, run).hold.1 + crate::raft::failover_hard_limit()
}

/// The cluster of a run.
struct Rig {
    sim: Sim,
    raft: RaftCluster,
    /// Replica id → the stable ext_proc address Envoy knows.
    ext_proc: BTreeMap<u64, LinkProxy>,
    envoy: EnvoyProcess,
    _dir: tempfile::TempDir,
}

impl Rig {
    async fn start(replicas: u64) -> anyhow::Result<Rig> {
        let sim = Sim::start(SimConfig {
            pods: PODS,
            knobs: PodKnobs {
                max_num_seqs: SLOTS as usize,
                prefill_us_per_token: 100.0,
                decode_ms_per_token: 20.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        })
        .await
        .context("starting the simulator")?;
        let dir = tempfile::tempdir()?;
        let endpoints = dir.path().join("endpoints.yaml");
        std::fs::write(&endpoints, sim.pods_yaml())?;
        let objectives = dir.path().join("objectives.yaml");
        std::fs::write(
            &objectives,
            crate::workloads::objectives_yaml(&[("standard", 0), ("critical", 5)]),
        )?;
        let objectives = objectives.display().to_string();
        let slack = SLACK.to_string();
        let raft = RaftCluster::start_with(
            replicas,
            &endpoints,
            &[
                "--config-text",
                CONFIG,
                "--objectives-file",
                &objectives,
                "--flow-credit-slack",
                &slack,
            ],
        )
        .await?;
        let mut ext_proc = BTreeMap::new();
        for id in 1..=replicas {
            let p = LinkProxy::start().await?;
            p.set_target(raft.replica(id)?.addrs.ext_proc);
            ext_proc.insert(id, p);
        }
        for id in 1..=replicas {
            flow_ready(&raft, id, Duration::from_secs(30)).await?;
        }
        let envoy = EnvoyProcess::start(
            ext_proc.values().map(LinkProxy::addr).collect(),
            sim.pods().iter().map(|p| p.addr).collect(),
            false,
            true,
        )
        .await?;
        Ok(Rig {
            sim,
            raft,
            ext_proc,
            envoy,
            _dir: dir,
        })
    }

    /// Point Envoy's address for `id` at the replica's current ext_proc port.
    fn retarget(&self, id: u64) -> anyhow::Result<()> {
        let addr = self.raft.replica(id)?.addrs.ext_proc;
        self.ext_proc
            .get(&id)
            .context("no ext_proc proxy")?
            .set_target(addr);
        Ok(())
    }

    async fn begin(&mut self, f: Fault) -> anyhow::Result<()> {
        match f {
            Fault::Kill { id } => self.raft.kill9(id).await,
            Fault::Pause { id } => self.raft.replica(id)?.pause(),
            Fault::Isolate { id } => {
                self.raft.isolate(id);
                Ok(())
            }
            Fault::OneWay { from, to } => {
                self.raft.link(from, to)?.partition();
                Ok(())
            }
            Fault::Latency { id, ms } => {
                self.raft.set_latency(id, Duration::from_millis(ms));
                Ok(())
            }
            Fault::Skew { id, offset_ms } => {
                self.raft
                    .set_own_args(id, vec![format!("--clock-offset-ms={offset_ms}")]);
                self.raft.kill9(id).await?;
                self.raft.restart(id).await?;
                self.retarget(id)
            }
        }
    }

    async fn end(&mut self, f: Fault) -> anyhow::Result<()> {
        match f {
            Fault::Kill { id } => {
                self.raft.restart(id).await?;
                self.retarget(id)
            }
            Fault::Pause { id } => self.raft.replica(id)?.resume(),
            Fault::Isolate { id } | Fault::Latency { id, .. } => {
                self.raft.heal(id);
                Ok(())
            }
            Fault::OneWay { from, to } => {
                self.raft.link(from, to)?.heal();
                Ok(())
            }
            Fault::Skew { .. } => Ok(()),
        }
    }

    fn served(&self) -> u64 {
        (0..PODS).map(|p| self.sim.stats(p).served).sum()
    }

    async fn shutdown(self) {
        drop(self.envoy);
        for (_, p) in self.ext_proc {
            p.shutdown().await;
        }
        self.raft.shutdown().await;
        self.sim.shutdown().await;
    }
}

/// Replica `id` has the replicated flow-control configuration, knows the pool and holds credit.
async fn flow_ready(raft: &RaftCluster, id: u64, limit: Duration) -> anyhow::Result<()> {
    crate::wait::until("cluster flow control ready", limit, || async {
        let Ok(r) = raft.replica(id) else {
            return false;
        };
        r.flow_view().await.is_ok_and(|v| {
            v["local"]["configured"] == true
                && v["local"]["degraded"] == false
                && v["global"]["pool_endpoints"] == PODS as u64
                && v["local"]["credit"].as_u64().unwrap_or(0) > 0
        })
    })
    .await
}

/// Wait until `probe` holds; how long it took, or the last `describe`.
async fn time_until<F, Fut>(limit: Duration, mut probe: F) -> Result<Duration, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let t0 = Instant::now();
    loop {
        match probe().await {
            Ok(()) => return Ok(t0.elapsed()),
            Err(e) if t0.elapsed() > limit => return Err(format!("after {limit:?}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Every replica's ledger totals (in flight, queued) are zero.
async fn ledgers_empty(raft: &RaftCluster, ids: &[u64]) -> Result<(), String> {
    let mut residue = Vec::new();
    for id in ids {
        let v = raft
            .replica(*id)
            .map_err(|e| e.to_string())?
            .flow_view()
            .await
            .map_err(|e| format!("replica {id}: {e}"))?;
        let t = &v["global"]["totals"];
        if t["inflight_requests"] != 0 || t["queued_requests"] != 0 {
            let g = &v["global"];
            let owners: BTreeMap<String, u64> = g["oldest_inflight"]
                .as_array()
                .into_iter()
                .flatten()
                .fold(BTreeMap::new(), |mut m, e| {
                    *m.entry(e[0].to_string()).or_insert(0) += 1;
                    m
                });
            if std::env::var_os("EPP_CHAOS_DUMP").is_some() {
                eprintln!("replica {id} /debug/flow: {v}");
            }
            residue.push(format!(
                "replica {id}: {t}; in flight by owner {owners:?}; saturation {}",
                g["saturation"]
            ));
        }
    }
    if residue.is_empty() {
        Ok(())
    } else {
        Err(residue.join("; "))
    }
}

/// Every replica's prefix index holds the same entries.
async fn indexes_equal(raft: &RaftCluster, ids: &[u64]) -> Result<(), String> {
    let mut views = Vec::new();
    for id in ids {
        let v = raft
            .replica(*id)
            .map_err(|e| e.to_string())?
            .prefix_index()
            .await
            .map_err(|e| format!("replica {id}: {e}"))?;
        views.push((id, v["pods"].clone()));
    }
    match views.windows(2).find(|w| w[0].1 != w[1].1) {
        None => Ok(()),
        Some(w) => Err(format!("replicas {} and {} differ", w[0].0, w[1].0)),
    }
}

/// Run one seed.
pub async fn run(spec: &RunSpec) -> anyhow::Result<Report> {
    let plan = schedule::plan(spec.seed, &shape(spec.replicas, spec.run));
    let mut rig = Rig::start(spec.replicas).await?;
    let served0 = rig.served();
    let occupancy = {
        let stats = rig.sim.stats_sampler();
        move || stats().iter().map(|s| s.running + s.waiting).sum::<u64>()
    };
    let load = Load::start(
        &rig.envoy.url(),
        &[
            Tenant {
                name: check::STANDARD[0],
                objective: "standard",
                clients: 8,
            },
            Tenant {
                name: check::STANDARD[1],
                objective: "standard",
                clients: 16,
            },
            Tenant {
                name: check::CRITICAL,
                objective: "critical",
                clients: 3,
            },
        ],
        occupancy,
    );
    let applied = drive(&mut rig, &load, &plan, spec.run).await;
    let (records, (peak, peak_at)) = load.finish().await;
    let ids: Vec<u64> = (1..=spec.replicas).collect();
    let ledger_limit = Duration::from_secs(5);
    let ledger_drained = time_until(ledger_limit * 2, || ledgers_empty(&rig.raft, &ids)).await;
    let indexes_converged =
        time_until(Duration::from_secs(10), || indexes_equal(&rig.raft, &ids)).await;
    let observed = Observed {
        peak_in_pods: peak,
        peak_at,
        admission_bound: PODS as u64 * SLOTS + SLACK,
        served_by_pods: rig.served() - served0,
        ledger_drained,
        ledger_limit,
        indexes_converged,
        stall_limit: stall_limit(spec.replicas, spec.run),
        records,
    };
    let report = Report {
        seed: spec.seed,
        replicas: spec.replicas,
        run_s: spec.run.as_secs_f64(),
        faults: applied?,
        requests: observed.records.len(),
        outcomes: check::outcomes(&observed.records),
        per_second: check::per_second(&observed.records),
        checks: check::checks(&observed),
    };
    rig.shutdown().await;
    Ok(report)
}

/// Apply the plan while the load runs, then heal whatever is left and wait out the run.
async fn drive(
    rig: &mut Rig,
    load: &Load,
    plan: &[Planned],
    run: Duration,
) -> anyhow::Result<Vec<Applied>> {
    // (time, is-start, index): ends before starts at the same instant.
    let mut events: Vec<(Duration, bool, usize)> = plan
        .iter()
        .enumerate()
        .flat_map(|(i, p)| [(p.at, true, i), (p.until, false, i)])
        .collect();
    events.sort();
    let mut applied: Vec<Applied> = Vec::new();
    let mut open: BTreeMap<usize, usize> = BTreeMap::new();
    for (at, start, i) in events {
        if let Some(wait) = at.checked_sub(load.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let p = plan[i];
        let now = load.elapsed().as_secs_f64();
        if start {
            tracing::info!(at = now, fault = %p.fault, "fault begins");
            rig.begin(p.fault)
                .await
                .with_context(|| format!("applying {}", p.fault))?;
            open.insert(i, applied.len());
            applied.push(Applied {
                at_s: now,
                until_s: now,
                kind: p.fault.kind(),
                fault: p.fault.to_string(),
            });
        } else {
            rig.end(p.fault)
                .await
                .with_context(|| format!("ending {}", p.fault))?;
            if let Some(a) = open.remove(&i).and_then(|k| applied.get_mut(k)) {
                a.until_s = load.elapsed().as_secs_f64();
            }
        }
    }
    if let Some(wait) = run.checked_sub(load.elapsed()) {
        tokio::time::sleep(wait).await;
    }
    Ok(applied)
}

/// Append `report` to `path` as one JSON line.
pub fn append_json(path: &Path, report: &Report) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{}", serde_json::to_string(report)?)?;
    Ok(())
}

//! A local standalone cluster: simulated pods + EPP replicas + Envoy.

use std::path::PathBuf;

use anyhow::Context;
use sim::{Sim, SimConfig};

use crate::envoy::EnvoyProcess;
use crate::epp::EppProcess;
use crate::raft::RaftCluster;

#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub sim: SimConfig,
    pub replicas: usize,
    /// Extra `epp serve` flags for every replica.
    pub epp_args: Vec<String>,
    /// Cluster mode: further flags for one replica (by id, from 1).
    pub replica_args: Vec<(u64, Vec<String>)>,
    /// Write an empty endpoints file instead of the simulator's pods.
    pub no_pods: bool,
    pub failure_mode_allow: bool,
    /// The observability-mode ext_proc filter for responses (on by default; see the template).
    pub observe_responses: bool,
    /// Run the replicas in cluster mode (Raft between them, peer links through proxies).
    pub raft: bool,
    /// Envoy routes to the pods with GIE's override_host policy (fallbacks, served endpoint).
    pub fallback_lb: bool,
    /// Extra environment for every replica (standalone mode), e.g. `OTEL_*`.
    pub epp_env: Vec<(String, String)>,
    /// Envoy traces too (its OpenTelemetry tracer), exporting to this OTLP/gRPC collector.
    pub envoy_otlp: Option<std::net::SocketAddr>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            sim: SimConfig::default(),
            replicas: 1,
            epp_args: vec![],
            replica_args: vec![],
            no_pods: false,
            failure_mode_allow: false,
            observe_responses: true,
            raft: false,
            fallback_lb: false,
            epp_env: vec![],
            envoy_otlp: None,
        }
    }
}

#[derive(Debug)]
pub struct LocalCluster {
    pub sim: Sim,
    /// The replicas (standalone mode; in cluster mode they live in `raft`).
    pub epps: Vec<EppProcess>,
    pub raft: Option<RaftCluster>,
    pub envoy: EnvoyProcess,
    pub endpoints_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl LocalCluster {
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<LocalCluster> {
        let sim = Sim::start(spec.sim.clone())
            .await
            .context("starting the simulator")?;
        let dir = tempfile::tempdir()?;
        let endpoints_file = dir.path().join("endpoints.yaml");
        let yaml = if spec.no_pods {
            "pods: []\n".to_string()
        } else {
            sim.pods_yaml()
        };
        std::fs::write(&endpoints_file, yaml)?;
        let args: Vec<&str> = spec.epp_args.iter().map(String::as_str).collect();
        let mut epps = Vec::new();
        let mut raft = None;
        if spec.raft {
            let own: Vec<(u64, Vec<&str>)> = spec
                .replica_args
                .iter()
                .map(|(id, a)| (*id, a.iter().map(String::as_str).collect()))
                .collect();
            let own: Vec<(u64, &[&str])> = own.iter().map(|(id, a)| (*id, a.as_slice())).collect();
            raft = Some(
                RaftCluster::start_with_each(spec.replicas as u64, &endpoints_file, &args, &own)
                    .await?,
            );
        } else {
            let env: Vec<(&str, &str)> = spec
                .epp_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            for _ in 0..spec.replicas {
                epps.push(EppProcess::start_with_env(&endpoints_file, &args, &env).await?);
            }
        }
        // Envoy health-checks the replicas: start it once they are ready (cluster flow control,
        // for one, keeps a replica NOT_SERVING until the replicated configuration applies).
        let admins: Vec<std::net::SocketAddr> = match &raft {
            Some(r) => r
                .replicas
                .values()
                .flatten()
                .map(|e| e.addrs.admin)
                .collect(),
            None => epps.iter().map(|e| e.addrs.admin).collect(),
        };
        if !spec.no_pods {
            crate::wait::until(
                "every replica ready (/readyz)",
                std::time::Duration::from_secs(30),
                || async {
                    for a in &admins {
                        let ok = reqwest::get(format!("http://{a}/readyz"))
                            .await
                            .is_ok_and(|r| r.status().is_success());
                        if !ok {
                            return false;
                        }
                    }
                    true
                },
            )
            .await?;
        }
        let ext_procs: Vec<std::net::SocketAddr> = match &raft {
            Some(r) => r
                .replicas
                .values()
                .flatten()
                .map(|e| e.addrs.ext_proc)
                .collect(),
            None => epps.iter().map(|e| e.addrs.ext_proc).collect(),
        };
        let envoy = EnvoyProcess::start_with(crate::envoy::EnvoyParams {
            listen_port: 0,
            admin_port: 0,
            epp: ext_procs,
            pods: sim.pods().iter().map(|p| p.addr).collect(),
            failure_mode_allow: spec.failure_mode_allow,
            observe_responses: spec.observe_responses,
            fallback_lb: spec.fallback_lb,
            otlp: spec.envoy_otlp,
        })
        .await?;
        Ok(LocalCluster {
            sim,
            epps,
            raft,
            envoy,
            endpoints_file,
            _dir: dir,
        })
    }

    /// Wait until replica 0 knows every simulated pod (its ready-endpoints gauge), which the
    /// scorers need before a comparison run means anything.
    pub async fn wait_for_pods(&self) -> anyhow::Result<()> {
        let want = format!(
            "llm_d_epp_pool_ready_endpoints{{name=\"default-pool\"}} {}",
            self.sim.pods().len()
        );
        crate::wait::until(
            "the EPP to know every pod",
            std::time::Duration::from_secs(20),
            || async {
                let Ok(epp) = self.epp(0) else {
                    return false;
                };
                epp.metrics().await.is_ok_and(|m| m.contains(&want))
            },
        )
        .await
    }

    /// Replica `i` (0-based) in either mode.
    pub fn epp(&self, i: usize) -> anyhow::Result<&EppProcess> {
        match &self.raft {
            Some(r) => r.replica(i as u64 + 1),
            None => self
                .epps
                .get(i)
                .ok_or_else(|| anyhow::anyhow!("no replica {i}")),
        }
    }

    /// Stop everything (Envoy and EPPs are also killed on drop).
    pub async fn shutdown(self) {
        drop(self.envoy);
        drop(self.epps);
        if let Some(r) = self.raft {
            r.shutdown().await;
        }
        self.sim.shutdown().await;
    }
}

//! A local standalone cluster: simulated pods + EPP replicas + Envoy.

use std::path::PathBuf;

use anyhow::Context;
use sim::{Sim, SimConfig};

use crate::envoy::EnvoyProcess;
use crate::epp::EppProcess;

#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub sim: SimConfig,
    pub replicas: usize,
    /// Extra `epp serve` flags for every replica.
    pub epp_args: Vec<String>,
    /// Write an empty endpoints file instead of the simulator's pods.
    pub no_pods: bool,
    pub failure_mode_allow: bool,
    /// The observability-mode ext_proc filter for responses (on by default; see the template).
    pub observe_responses: bool,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            sim: SimConfig::default(),
            replicas: 1,
            epp_args: vec![],
            no_pods: false,
            failure_mode_allow: false,
            observe_responses: true,
        }
    }
}

#[derive(Debug)]
pub struct LocalCluster {
    pub sim: Sim,
    pub epps: Vec<EppProcess>,
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
        for _ in 0..spec.replicas {
            epps.push(EppProcess::start(&endpoints_file, &args).await?);
        }
        let envoy = EnvoyProcess::start(
            epps.iter().map(|e| e.addrs.ext_proc).collect(),
            sim.pods().iter().map(|p| p.addr).collect(),
            spec.failure_mode_allow,
            spec.observe_responses,
        )
        .await?;
        Ok(LocalCluster {
            sim,
            epps,
            envoy,
            endpoints_file,
            _dir: dir,
        })
    }

    /// Stop everything (Envoy and EPPs are also killed on drop).
    pub async fn shutdown(self) {
        drop(self.envoy);
        drop(self.epps);
        self.sim.shutdown().await;
    }
}

//! `sim` owns the simulated inference fleet used to exercise the endpoint picker without GPUs, and the
//! load generator that measures it.
//!
//! A [`Sim`] hosts N simulated vLLM pods in one process, each an HTTP server on its own port with its
//! own state, plus an optional admin server. A request flows through one pod like this:
//!
//! 1. [`server`] parses the OpenAI request and turns the prompt into tokens with the deterministic
//!    [`tokenizer`];
//! 2. [`engine::Pod::admit`] queues it FIFO for one of `max_num_seqs` running slots, then looks its
//!    chained block hashes up in the pod's [`cache::PrefixCache`];
//! 3. the handler sleeps the simulated prefill (only uncached tokens cost time) and decode, streaming
//!    chunks or answering once, and the prompt's blocks enter the cache;
//! 4. gauges and counters in the pod state feed `/metrics` ([`metrics`]) and [`Sim::stats`].
//!
//! # Layout
//! - [`tokenizer`]: text → token ids (whitespace words, 4-byte pieces, xxh3).
//! - [`cache`]: chained block hashes and the pinned LRU block cache (pure, no IO).
//! - [`knobs`]: per-pod tunables and partial updates.
//! - [`engine`]: the pod state machine, running slots, latency model.
//! - [`metrics`]: vLLM-shaped Prometheus text.
//! - [`server`]: axum routers for pods and the admin API.
//! - [`loadgen`]: multi-turn conversation workload and report.

pub mod cache;
pub mod engine;
pub mod knobs;
pub mod loadgen;
pub mod metrics;
pub mod server;
pub mod tokenizer;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use engine::PodStats;
pub use knobs::{KnobsPatch, PodKnobs};

use engine::Pod;

/// How long [`Sim::shutdown`] lets in-flight responses finish before cutting connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Errors of the simulator's public API.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("no pod {index} (the sim has {pods})")]
    NoSuchPod { index: usize, pods: usize },
    #[error("invalid knob {field}: {reason}")]
    InvalidKnob { field: &'static str, reason: String },
    #[error("invalid config: {0}")]
    InvalidConfig(String),
}

/// What to start.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub pods: usize,
    pub host: IpAddr,
    /// First pod port; pod i listens on `base_port + i`. 0 lets the OS choose every port.
    pub base_port: u16,
    pub model: String,
    /// Initial knobs of every pod.
    pub knobs: PodKnobs,
    /// Admin server port (0 = OS-chosen); `None` starts no admin server.
    pub admin: Option<u16>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            pods: 2,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 0,
            model: "sim-model".to_owned(),
            knobs: PodKnobs::default(),
            admin: None,
        }
    }
}

impl SimConfig {
    pub fn validate(&self) -> Result<(), SimError> {
        if self.pods == 0 {
            return Err(SimError::InvalidConfig("pods must be > 0".into()));
        }
        if self.model.is_empty() {
            return Err(SimError::InvalidConfig("model must not be empty".into()));
        }
        if self.base_port != 0
            && usize::from(self.base_port) + self.pods - 1 > usize::from(u16::MAX)
        {
            return Err(SimError::InvalidConfig(format!(
                "{} pods from port {} exceed 65535",
                self.pods, self.base_port
            )));
        }
        self.knobs.validate()
    }
}

/// Where a pod listens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodInfo {
    pub name: String,
    pub addr: SocketAddr,
}

/// A running fleet of simulated pods.
#[derive(Debug)]
pub struct Sim {
    pods: Arc<Vec<Arc<Pod>>>,
    admin_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, SimError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Bind { addr, source })
}

fn local_addr(listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, SimError> {
    listener
        .local_addr()
        .map_err(|source| SimError::Bind { addr, source })
}

impl Sim {
    /// Validates `cfg`, binds every port, then starts serving.
    pub async fn start(cfg: SimConfig) -> Result<Sim, SimError> {
        cfg.validate()?;
        let mut listeners = Vec::with_capacity(cfg.pods);
        let mut pods = Vec::with_capacity(cfg.pods);
        for i in 0..cfg.pods {
            let port = if cfg.base_port == 0 {
                0
            } else {
                // validate() guarantees this fits.
                u16::try_from(usize::from(cfg.base_port) + i).unwrap_or(u16::MAX)
            };
            let want = SocketAddr::new(cfg.host, port);
            let listener = bind(want).await?;
            let addr = local_addr(&listener, want)?;
            pods.push(Arc::new(Pod::new(
                i,
                addr,
                cfg.model.clone(),
                cfg.knobs.clone(),
            )));
            listeners.push(listener);
        }
        let pods = Arc::new(pods);
        let admin = match cfg.admin {
            Some(port) => {
                let want = SocketAddr::new(cfg.host, port);
                let listener = bind(want).await?;
                let addr = local_addr(&listener, want)?;
                Some((listener, addr))
            }
            None => None,
        };

        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::with_capacity(cfg.pods + 1);
        for (pod, listener) in pods.iter().zip(listeners) {
            let router = server::pod_router(Arc::clone(pod));
            tasks.push(tokio::spawn(server::serve(
                listener,
                router,
                stop_rx.clone(),
            )));
        }
        let admin_addr = match admin {
            Some((listener, addr)) => {
                let router = server::admin_router(Arc::clone(&pods));
                tasks.push(tokio::spawn(server::serve(
                    listener,
                    router,
                    stop_rx.clone(),
                )));
                Some(addr)
            }
            None => None,
        };
        tracing::info!(pods = cfg.pods, ?admin_addr, "sim started");
        Ok(Sim {
            pods,
            admin_addr,
            stop,
            tasks,
        })
    }

    pub fn pods(&self) -> Vec<PodInfo> {
        self.pods
            .iter()
            .map(|p| PodInfo {
                name: p.name.clone(),
                addr: p.addr,
            })
            .collect()
    }

    /// The admin server's address, when one was asked for.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    fn pod(&self, index: usize) -> Result<&Arc<Pod>, SimError> {
        self.pods.get(index).ok_or(SimError::NoSuchPod {
            index,
            pods: self.pods.len(),
        })
    }

    /// Stats of pod `pod`; an unknown index yields all-zero stats.
    pub fn stats(&self, pod: usize) -> PodStats {
        self.pod(pod).map(|p| p.stats()).unwrap_or_default()
    }

    pub fn try_stats(&self, pod: usize) -> Result<PodStats, SimError> {
        self.pod(pod).map(|p| p.stats())
    }

    pub fn knobs(&self, pod: usize) -> Result<PodKnobs, SimError> {
        self.pod(pod).map(|p| p.knobs())
    }

    pub fn set_knobs(&self, pod: usize, patch: &KnobsPatch) -> Result<(), SimError> {
        self.pod(pod)?.set_knobs(patch)
    }

    /// Drop every pod's unpinned prefix-cache blocks (between comparison runs).
    pub fn reset_prefix_caches(&self) {
        for p in self.pods.iter() {
            p.reset_prefix_cache();
        }
    }

    /// The discovery file for the EPP.
    pub fn pods_yaml(&self) -> String {
        server::pods_yaml(&self.pods)
    }

    /// Stops every server: queued requests fail at once, running ones get a short grace period.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for p in self.pods.iter() {
            p.close();
        }
        for mut task in std::mem::take(&mut self.tasks) {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
            {
                task.abort();
                let _ = task.await;
            }
        }
        tracing::info!("sim stopped");
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        // Dropped without shutdown(): don't leave servers running behind the owner's back.
        for task in &self.tasks {
            task.abort();
        }
    }
}

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
//! 4. gauges and counters in the pod state feed `/metrics` ([`metrics`]) and [`Sim::stats`];
//! 5. every engine step that changed the cache publishes a KV-event batch over ZMQ ([`kvevents`]),
//!    when [`SimConfig::kv_events`] is set.
//!
//! LoRA adapters (named in `model`) occupy `max_loras` slots; a request whose adapter is not
//! resident waits for a slot and pays `lora_load_ms`. Faults (error rate, added latency, stall,
//! slow or broken `/metrics`) are knobs; crash/restart of one pod is an action ([`Sim::crash`],
//! [`Sim::restart`], or the admin API).
//!
//! # Layout
//! - [`tokenizer`]: text → token ids (whitespace words, 4-byte pieces, xxh3).
//! - [`cache`]: chained block hashes and the pinned LRU block cache (pure, no IO).
//! - [`knobs`]: per-pod tunables and partial updates.
//! - [`engine`]: the pod state machine, running and LoRA slots, latency model (simple, or the
//!   step model's driver).
//! - [`step`]: the step model — continuous batching in virtual time (pure, no IO).
//! - [`kvevents`]: vLLM KV-cache events (msgpack, both encodings) on PUB + replay ROUTER sockets.
//! - [`metrics`]: vLLM-shaped Prometheus text.
//! - [`server`]: the HTTP routers for pods and the admin API.
//! - [`podsvc`]: a pod's connection service — `/metrics` and `/health` answered ahead of the router.
//! - [`fleet`]: pods and their server tasks (crash, restart, drain).
//! - [`loadgen`]: workloads (multi-turn conversations, tenant classes) and reports.
//! - [`kubeapi`]: a fake Kubernetes API server (list/watch over HTTP) for discovery tests.

pub mod cache;
pub mod engine;
pub mod fleet;
pub mod hftok;
pub mod knobs;
pub mod kubeapi;
pub mod kvevents;
pub mod loadgen;
pub mod metrics;
pub mod podsvc;
pub mod server;
pub mod step;
pub mod tokenizer;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use engine::PodStats;
pub use knobs::{EngineModel, KnobsPatch, MetricsFault, PodKnobs, PodOverride};
pub use kvevents::{Encoding, KvEndpoints, KvEventsConfig};

use engine::{Pod, PodOptions};
use fleet::Fleet;

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
    #[error("kv events: {0}")]
    KvEvents(#[from] kvevents::KvEventsError),
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
    /// Applied in order over `knobs` for the pods they name.
    pub pod_knobs: Vec<PodOverride>,
    /// Admin server port (0 = OS-chosen); `None` starts no admin server.
    pub admin: Option<u16>,
    /// LoRA adapters every pod has loaded at start: (name, path).
    pub lora_adapters: Vec<(String, String)>,
    /// Publish KV-cache events over ZMQ (one PUB + one replay ROUTER per pod, OS-chosen ports).
    pub kv_events: Option<KvEventsConfig>,
    /// The first `prefill_pods` pods are labelled `llm-d.ai/role: prefill`, the next `decode_pods`
    /// `decode`; the rest get no role.
    pub prefill_pods: usize,
    pub decode_pods: usize,
    /// A Hugging Face tokenizer directory (`tokenizer.json`, a chat template) the pods tokenize
    /// prompts with; `None` = the built-in hashing tokenizer ([`tokenizer`]).
    pub tokenizer: Option<std::path::PathBuf>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            pods: 2,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 0,
            model: "sim-model".to_owned(),
            knobs: PodKnobs::default(),
            pod_knobs: Vec::new(),
            admin: None,
            lora_adapters: Vec::new(),
            kv_events: None,
            prefill_pods: 0,
            decode_pods: 0,
            tokenizer: None,
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
        if self.prefill_pods + self.decode_pods > self.pods {
            return Err(SimError::InvalidConfig(
                "prefill_pods + decode_pods exceed pods".into(),
            ));
        }
        for (name, _) in &self.lora_adapters {
            if name.is_empty() || *name == self.model {
                return Err(SimError::InvalidConfig(format!(
                    "invalid LoRA adapter name {name:?}"
                )));
            }
        }
        for o in &self.pod_knobs {
            if let Some(&i) = o.pods.iter().find(|&&i| i >= self.pods) {
                return Err(SimError::InvalidConfig(format!(
                    "pod knobs for pod {i}, but there are {} pods",
                    self.pods
                )));
            }
        }
        for i in 0..self.pods {
            let knobs = self.knobs_of(i);
            if !self.lora_adapters.is_empty() && knobs.max_loras == 0 {
                return Err(SimError::InvalidConfig(format!(
                    "LoRA adapters given but pod {i} has max_loras 0"
                )));
            }
            knobs.validate()?;
        }
        Ok(())
    }

    /// Pod `i`'s initial knobs: `knobs` with every override naming it applied.
    pub fn knobs_of(&self, i: usize) -> PodKnobs {
        self.pod_knobs
            .iter()
            .filter(|o| o.pods.binary_search(&i).is_ok())
            .fold(self.knobs.clone(), |k, o| k.patched(&o.patch))
    }

    fn role(&self, i: usize) -> Option<String> {
        if i < self.prefill_pods {
            Some("prefill".into())
        } else if i < self.prefill_pods + self.decode_pods {
            Some("decode".into())
        } else {
            None
        }
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
    fleet: Arc<Fleet>,
    pods: Arc<Vec<Arc<Pod>>>,
    admin_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    admin_task: Option<JoinHandle<()>>,
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
            listeners.push((listener, addr));
        }
        let kv = match &cfg.kv_events {
            Some(kc) => {
                let topics = listeners
                    .iter()
                    .map(|(_, addr)| kvevents::topic(*addr, &cfg.model))
                    .collect();
                Some(kvevents::Publisher::start(kc, cfg.host, topics)?)
            }
            None => None,
        };
        let vocab = Arc::new(std::sync::Mutex::new(tokenizer::Vocab::default()));
        let tok = match &cfg.tokenizer {
            Some(dir) => tokenizer::Tokenizer::Hf(Arc::new(
                hftok::HfTokenizer::load(dir).map_err(SimError::InvalidConfig)?,
            )),
            None => tokenizer::Tokenizer::Builtin,
        };
        let mut pods = Vec::with_capacity(cfg.pods);
        for (i, (_, addr)) in listeners.iter().enumerate() {
            pods.push(Arc::new(Pod::with_options(
                i,
                *addr,
                cfg.model.clone(),
                cfg.knobs_of(i),
                PodOptions {
                    adapters: cfg.lora_adapters.clone(),
                    kv_events: kv.as_ref().and_then(|k| k.sender()),
                    role: cfg.role(i),
                    vocab: Some(Arc::clone(&vocab)),
                    tokenizer: tok.clone(),
                },
            )));
        }
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
        let fleet = Arc::new(Fleet::new(pods.clone(), stop_rx.clone(), kv));
        for (i, (listener, _)) in listeners.into_iter().enumerate() {
            fleet.launch(i, listener).await?;
        }
        let (admin_addr, admin_task) = match admin {
            Some((listener, addr)) => {
                let router = server::admin_router(Arc::clone(&fleet));
                let task = tokio::spawn(server::serve(listener, router, stop_rx.clone()));
                (Some(addr), Some(task))
            }
            None => (None, None),
        };
        tracing::info!(pods = cfg.pods, ?admin_addr, "sim started");
        Ok(Sim {
            fleet,
            pods: Arc::new(pods),
            admin_addr,
            stop,
            admin_task,
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

    /// Every pod's live counters, as a handle that outlives this borrow (for samplers running in
    /// their own task).
    pub fn stats_sampler(&self) -> impl Fn() -> Vec<PodStats> + Send + Sync + 'static {
        let pods = self.pods.clone();
        move || pods.iter().map(|p| p.stats()).collect()
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
        server::pods_yaml(&self.fleet)
    }

    /// Keys of every block in pod `pod`'s prefix cache, sorted (what KV-event subscribers should
    /// have reconstructed).
    pub fn cached_block_hashes(&self, pod: usize) -> Result<Vec<u64>, SimError> {
        self.pod(pod).map(|p| p.cached_block_hashes())
    }

    /// Every `vllm:lora_requests_info` series of pod `pod`, oldest first.
    pub fn lora_info(&self, pod: usize) -> Result<Vec<engine::LoraInfoSeries>, SimError> {
        self.pod(pod).map(|p| p.lora_info())
    }

    /// Where pod `pod` publishes KV events (`None` when events are off or no such pod).
    pub fn kv_endpoints(&self, pod: usize) -> Option<KvEndpoints> {
        self.fleet.kv_endpoints(pod)
    }

    /// Simulated crash of one pod: its listener closes and its open connections are cut; the other
    /// pods keep serving. Returns once the pod's server is gone.
    pub async fn crash(&self, pod: usize) -> Result<(), SimError> {
        self.fleet.crash(pod).await
    }

    /// Restarts one pod on the same port with fresh engine state (empty cache, zeroed counters,
    /// start-up adapters, KV-event sequence from 0), crashing it first when it is up.
    pub async fn restart(&self, pod: usize) -> Result<(), SimError> {
        self.fleet.restart(pod).await
    }

    /// Whether the pod's server is running.
    pub fn is_up(&self, pod: usize) -> bool {
        self.fleet.is_up(pod)
    }

    /// Stops every server: queued requests fail at once, running ones get a short grace period.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for p in self.pods.iter() {
            p.close();
        }
        self.fleet.drain(SHUTDOWN_GRACE).await;
        if let Some(mut task) = self.admin_task.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
        {
            task.abort();
            let _ = task.await;
        }
        tracing::info!("sim stopped");
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        // Dropped without shutdown(): don't leave servers running behind the owner's back.
        self.fleet.abort_all();
        if let Some(task) = &self.admin_task {
            task.abort();
        }
    }
}

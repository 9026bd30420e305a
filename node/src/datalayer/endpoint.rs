//! An endpoint (one model-server pod) and the metrics the scheduler reads from it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// Label that selects the metric dialect, with llm-d's fallback key.
pub const ENGINE_LABEL: &str = "llm-d.ai/engine-type";
pub const ENGINE_LABEL_FALLBACK: &str = "inference.networking.k8s.io/engine-type";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    TrtllmServe,
    TritonTrtllm,
}

impl Engine {
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Engine {
        let value = labels
            .get(ENGINE_LABEL)
            .or_else(|| labels.get(ENGINE_LABEL_FALLBACK))
            .map(String::as_str)
            .unwrap_or("vllm");
        match value {
            "sglang" => Engine::Sglang,
            "trtllm" | "trtllm-serve" | "trt-llm" => Engine::TrtllmServe,
            "triton" | "triton-trtllm" => Engine::TritonTrtllm,
            _ => Engine::Vllm,
        }
    }
}

/// What one scrape of a model server told us. Missing values stay `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndpointMetrics {
    pub waiting_queue_size: Option<f64>,
    pub running_requests: Option<f64>,
    /// KV-cache usage as a fraction in [0, 1].
    pub kv_cache_usage: Option<f64>,
    pub block_size: Option<u64>,
    pub num_gpu_blocks: Option<u64>,
    pub max_active_models: Option<u64>,
    pub active_models: Vec<String>,
    pub waiting_models: Vec<String>,
    /// `process_start_time_seconds` (Prometheus' process collector, exported by vLLM and SGLang)
    /// in milliseconds: the server's incarnation. Every replica scraping the pod reads the same
    /// value, so it identifies a recreated pod at the same address without Kubernetes.
    pub started_ms: Option<u64>,
}

/// The metrics together with when they were scraped.
#[derive(Debug, Clone)]
pub struct MetricsSample {
    pub metrics: EndpointMetrics,
    pub scraped_at: Instant,
}

/// One model-server pod. Shared by the datastore, its scraper and in-flight requests.
#[derive(Debug)]
pub struct Endpoint {
    pub name: String,
    pub addr: SocketAddr,
    /// `ip:port`, the exact string sent to Envoy.
    pub hostport: String,
    pub labels: BTreeMap<String, String>,
    pub engine: Engine,
    sample: RwLock<Option<Arc<MetricsSample>>>,
}

impl Endpoint {
    pub fn new(name: String, addr: SocketAddr, labels: BTreeMap<String, String>) -> Self {
        let engine = Engine::from_labels(&labels);
        Endpoint {
            name,
            hostport: addr.to_string(),
            addr,
            labels,
            engine,
            sample: RwLock::new(None),
        }
    }

    pub fn set_metrics(&self, metrics: EndpointMetrics, scraped_at: Instant) {
        let sample = Arc::new(MetricsSample {
            metrics,
            scraped_at,
        });
        match self.sample.write() {
            Ok(mut guard) => *guard = Some(sample),
            Err(poisoned) => *poisoned.into_inner() = Some(sample),
        }
    }

    pub fn sample(&self) -> Option<Arc<MetricsSample>> {
        match self.sample.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

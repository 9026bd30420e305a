//! An endpoint (one model-server pod) and the metrics the scheduler reads from it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Largest batch limit believed (vLLM caps `max_num_seqs` far below this).
pub const MAX_BATCH: u64 = 65_536;

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
    /// The most requests seen running while others waited: the engine's batch limit (vLLM's
    /// `max_num_seqs`, or fewer when its KV cache filled first) as the pod itself shows it. 0 until
    /// the pod has been seen saturated; reset when the server restarts.
    batch_capacity: AtomicU64,
    /// `started_ms` of the incarnation `batch_capacity` belongs to.
    capacity_epoch: AtomicU64,
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
            batch_capacity: AtomicU64::new(0),
            capacity_epoch: AtomicU64::new(0),
        }
    }

    pub fn set_metrics(&self, metrics: EndpointMetrics, scraped_at: Instant) {
        self.learn_capacity(&metrics);
        let sample = Arc::new(MetricsSample {
            metrics,
            scraped_at,
        });
        match self.sample.write() {
            Ok(mut guard) => *guard = Some(sample),
            Err(poisoned) => *poisoned.into_inner() = Some(sample),
        }
    }

    /// Requests the engine runs at once, once it has been seen saturated (requests waiting while
    /// others run); `None` before.
    pub fn batch_capacity(&self) -> Option<u64> {
        match self.batch_capacity.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    fn learn_capacity(&self, m: &EndpointMetrics) {
        let epoch = m.started_ms.unwrap_or(0);
        if self.capacity_epoch.swap(epoch, Ordering::Relaxed) != epoch {
            self.batch_capacity.store(0, Ordering::Relaxed);
        }
        // Bounded: a garbage gauge must not make a pod look like it runs billions at once.
        let running = m.running_requests.unwrap_or(0.0);
        if !running.is_finite() || running < 1.0 || running > MAX_BATCH as f64 {
            return;
        }
        let running = running as u64;
        let known = self.batch_capacity.load(Ordering::Relaxed);
        let saturated = m
            .waiting_queue_size
            .is_some_and(|w| w.is_finite() && w >= 1.0);
        // Waiting requests mean the batch is full; more running than a known limit means the limit
        // was learned while the KV cache, not the batch, was the bound.
        if running > known && (saturated || known > 0) {
            self.batch_capacity.fetch_max(running, Ordering::Relaxed);
        }
    }

    pub fn sample(&self) -> Option<Arc<MetricsSample>> {
        match self.sample.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(running: f64, waiting: f64, started_ms: u64) -> EndpointMetrics {
        EndpointMetrics {
            running_requests: Some(running),
            waiting_queue_size: Some(waiting),
            started_ms: Some(started_ms),
            ..Default::default()
        }
    }

    #[test]
    fn batch_capacity_is_learned_when_the_pod_saturates() {
        let e = Endpoint::new(
            "p".into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        );
        let now = Instant::now();
        e.set_metrics(m(3.0, 0.0, 1), now);
        assert_eq!(e.batch_capacity(), None, "never saturated: unknown");
        e.set_metrics(m(4.0, 2.0, 1), now);
        assert_eq!(e.batch_capacity(), Some(4));
        e.set_metrics(m(2.0, 1.0, 1), now);
        assert_eq!(
            e.batch_capacity(),
            Some(4),
            "the largest saturated batch stays"
        );
        e.set_metrics(m(6.0, 0.0, 1), now);
        assert_eq!(
            e.batch_capacity(),
            Some(6),
            "more running than believed raises it"
        );
        e.set_metrics(m(f64::NAN, 3.0, 1), now);
        e.set_metrics(m(1e12, 3.0, 1), now);
        assert_eq!(e.batch_capacity(), Some(6), "garbage gauges are ignored");
        e.set_metrics(m(1.0, 0.0, 2), now);
        assert_eq!(
            e.batch_capacity(),
            None,
            "a restarted server is learned again"
        );
    }
}

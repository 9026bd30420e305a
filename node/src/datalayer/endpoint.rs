//! An endpoint (one model-server pod) and the metrics the scheduler reads from it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use super::inflight::InflightLoad;
use crate::metrics::Metrics;

/// Wall time as the rest of the data layer reads it (`consensus::clock`: the test offset, the
/// simulation's clock).
fn unix_ms() -> u64 {
    consensus::clock::now_ms()
}

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

    /// The engine's OpenAI server takes `stream_options.continuous_usage_stats` (cumulative
    /// usage on every streamed chunk): vLLM, SGLang and `trtllm-serve` do; Triton's frontend is
    /// not known to.
    pub fn streams_continuous_usage(self) -> bool {
        !matches!(self, Engine::TritonTrtllm)
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

/// Bounds on what a model server (or a peer relaying its scrape) may tell us. Engines report
/// small numbers: vLLM's blocks are 16–256 tokens, an 8-GPU node holds a few million KV tokens,
/// a queue of a million requests is already a broken pod. A value past its bound is garbage: it
/// is dropped (counts are clamped) and reported, so it cannot wrap arithmetic, size an
/// allocation, pin an incarnation or make a pod look infinitely large.
pub mod bounds {
    /// Queued or running requests one pod reports.
    pub const MAX_REQUESTS: f64 = 1e6;
    /// Tokens per engine KV block (SGLang's page size may be 1).
    pub const MAX_BLOCK_TOKENS: u64 = 4096;
    /// KV tokens one pod holds (`num_gpu_blocks × block_size`).
    pub const MAX_KV_TOKENS: u64 = 1 << 32;
    /// LoRA adapters one pod serves at once, and names listed.
    pub const MAX_MODELS: u64 = 4096;
    pub const MAX_MODEL_NAMES: usize = 256;
    pub const MAX_NAME_BYTES: usize = 256;
    /// How far in the future a server's start time may be (its clock or ours may be off).
    pub const MAX_FUTURE_MS: u64 = 3_600_000;
}

impl EndpointMetrics {
    /// Enforce [`bounds`] at wall time `now_ms`; returns the fields that were out of bounds.
    pub fn sanitize(&mut self, now_ms: u64) -> Vec<&'static str> {
        use bounds::*;
        let mut bad = Vec::new();
        for (field, v) in [
            ("waiting_queue_size", &mut self.waiting_queue_size),
            ("running_requests", &mut self.running_requests),
        ] {
            match *v {
                Some(x) if !x.is_finite() || x < 0.0 => {
                    *v = None;
                    bad.push(field);
                }
                Some(x) if x > MAX_REQUESTS => {
                    *v = Some(MAX_REQUESTS);
                    bad.push(field);
                }
                _ => {}
            }
        }
        if let Some(x) = self.kv_cache_usage {
            if !x.is_finite() {
                self.kv_cache_usage = None;
                bad.push("kv_cache_usage");
            } else if !(0.0..=1.0).contains(&x) {
                self.kv_cache_usage = Some(x.clamp(0.0, 1.0));
                bad.push("kv_cache_usage");
            }
        }
        if self
            .block_size
            .is_some_and(|b| b == 0 || b > MAX_BLOCK_TOKENS)
        {
            self.block_size = None;
            bad.push("block_size");
        }
        let block = self.block_size.unwrap_or(1);
        if self
            .num_gpu_blocks
            .is_some_and(|n| n.checked_mul(block).is_none_or(|t| t > MAX_KV_TOKENS))
        {
            self.num_gpu_blocks = None;
            bad.push("num_gpu_blocks");
        }
        if self.max_active_models.is_some_and(|n| n > MAX_MODELS) {
            self.max_active_models = None;
            bad.push("max_active_models");
        }
        for (field, names) in [
            ("active_models", &mut self.active_models),
            ("waiting_models", &mut self.waiting_models),
        ] {
            let before = names.len();
            names.truncate(MAX_MODEL_NAMES);
            names.retain(|n| n.len() <= MAX_NAME_BYTES);
            if names.len() != before {
                bad.push(field);
            }
        }
        if self
            .started_ms
            .is_some_and(|t| t > now_ms.saturating_add(MAX_FUTURE_MS))
        {
            self.started_ms = None;
            bad.push("started_ms");
        }
        bad
    }
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
    /// The most requests seen running while others waited, every running one past its prefill
    /// ([`Self::learn_capacity`]):
    /// the engine's batch limit (vLLM's `max_num_seqs`, or fewer when its KV cache filled first)
    /// as the pod itself shows it. 0 until the pod has been seen saturated; reset when the server
    /// restarts.
    batch_capacity: AtomicU64,
    /// `started_ms` of the incarnation `batch_capacity` belongs to.
    capacity_epoch: AtomicU64,
    /// The running count of the previous sample if it showed the pod saturated, else 0.
    saturated_at: AtomicU64,
    /// Samples in a row that showed requests waiting ([`Self::queueing`]).
    waiting_streak: AtomicU64,
    /// A value out of [`bounds`] was logged at `warn` (later ones are logged at `debug`).
    warned: AtomicBool,
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
            saturated_at: AtomicU64::new(0),
            waiting_streak: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Enforce [`bounds`] on metrics about this pod from `source` (`metrics`: its own scrape;
    /// `peer`: another replica's), counting and logging what was out of bounds.
    pub fn check(&self, m: &mut EndpointMetrics, source: &'static str, metrics: &Metrics) {
        let bad = m.sanitize(unix_ms());
        if bad.is_empty() {
            return;
        }
        for field in &bad {
            metrics.rejected_value(source, field);
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(endpoint = %self.name, source, fields = ?bad,
                "model-server metrics out of bounds, dropped or clamped (further ones logged at debug)");
        } else {
            tracing::debug!(endpoint = %self.name, source, fields = ?bad, "model-server metrics out of bounds");
        }
    }

    /// Store a fresh sample. `ledger`: the in-flight ledger's load on this pod, when there is a
    /// ledger (see [`Self::learn_capacity`]).
    pub fn set_metrics(
        &self,
        metrics: EndpointMetrics,
        scraped_at: Instant,
        ledger: Option<InflightLoad>,
    ) {
        self.learn_capacity(&metrics, ledger);
        if metrics
            .waiting_queue_size
            .is_some_and(|w| w.is_finite() && w >= 1.0)
        {
            self.waiting_streak.fetch_add(1, Ordering::Relaxed);
        } else {
            self.waiting_streak.store(0, Ordering::Relaxed);
        }
        let sample = Arc::new(MetricsSample {
            metrics,
            scraped_at,
        });
        match self.sample.write() {
            Ok(mut guard) => *guard = Some(sample),
            Err(poisoned) => *poisoned.into_inner() = Some(sample),
        }
    }

    /// Whether requests have waited in the pod in the last two samples. One sample showing a
    /// request waiting says little: a continuously batching engine counts a request as waiting
    /// from its arrival to the next step, and a scrape catches that often on a busy pod. Requests
    /// still waiting a scrape later do queue there.
    pub fn queueing(&self) -> bool {
        self.waiting_streak.load(Ordering::Relaxed) >= 2
    }

    /// Requests the engine runs at once, once it has been seen saturated (requests waiting while
    /// others run); `None` before.
    pub fn batch_capacity(&self) -> Option<u64> {
        match self.batch_capacity.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// Requests wait in a continuously batching engine for more reasons than a full batch
    /// (`max_num_seqs`) or a full KV cache: a request arriving mid-step waits for the step to end,
    /// and a long prompt being prefilled takes the step's token budget from the others — neither
    /// says what the pod can run at once. The pod counts as saturated at `running` when requests
    /// wait in two samples in a row with the same number running (a full batch admits a waiting
    /// request only as another ends; a step boundary or a prefill lets the waiting in and the
    /// count moves), and, when there is a ledger, every running request is past its prefill: the
    /// ledger knows every request on the pod (no traffic around this EPP) and its requests still
    /// without first bytes are no more than the pod's waiting ones.
    fn learn_capacity(&self, m: &EndpointMetrics, ledger: Option<InflightLoad>) {
        let epoch = m.started_ms.unwrap_or(0);
        if self.capacity_epoch.swap(epoch, Ordering::Relaxed) != epoch {
            self.batch_capacity.store(0, Ordering::Relaxed);
            self.saturated_at.store(0, Ordering::Relaxed);
        }
        // Bounded: a garbage gauge must not make a pod look like it runs billions at once.
        let running = m.running_requests.unwrap_or(0.0);
        if !running.is_finite() || running < 1.0 || running > MAX_BATCH as f64 {
            self.saturated_at.store(0, Ordering::Relaxed);
            return;
        }
        let running = running as u64;
        let waiting = m
            .waiting_queue_size
            .filter(|w| w.is_finite() && *w >= 1.0)
            .map_or(0, |w| w.min(MAX_BATCH as f64) as u64);
        let full = waiting > 0
            && ledger.is_none_or(|l| l.requests >= running + waiting && l.prefilling <= waiting);
        let before = self
            .saturated_at
            .swap(if full { running } else { 0 }, Ordering::Relaxed);
        let known = self.batch_capacity.load(Ordering::Relaxed);
        // More running than a known limit means the limit was learned while the KV cache, not the
        // batch, was the bound.
        if running > known && ((full && before == running) || known > 0) {
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
    fn a_pod_queues_when_requests_wait_in_two_samples_in_a_row() {
        let e = Endpoint::new(
            "p".into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        );
        let now = Instant::now();
        let waits = [0.0, 1.0, 0.0, 1.0, 3.0, f64::NAN, 2.0, 2.0, 2.0, 0.0];
        let want = [
            false, false, false, false, true, false, false, true, true, false,
        ];
        for (w, want) in waits.into_iter().zip(want) {
            e.set_metrics(m(2.0, w, 1), now, None);
            assert_eq!(e.queueing(), want, "after waiting = {w}");
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
        e.set_metrics(m(3.0, 0.0, 1), now, None);
        assert_eq!(e.batch_capacity(), None, "never saturated: unknown");
        e.set_metrics(m(4.0, 2.0, 1), now, None);
        assert_eq!(e.batch_capacity(), None, "one sample is not enough");
        e.set_metrics(m(4.0, 1.0, 1), now, None);
        assert_eq!(e.batch_capacity(), Some(4));
        e.set_metrics(m(2.0, 1.0, 1), now, None);
        assert_eq!(
            e.batch_capacity(),
            Some(4),
            "the largest saturated batch stays"
        );
        e.set_metrics(m(6.0, 0.0, 1), now, None);
        assert_eq!(
            e.batch_capacity(),
            Some(6),
            "more running than believed raises it"
        );
        e.set_metrics(m(f64::NAN, 3.0, 1), now, None);
        e.set_metrics(m(1e12, 3.0, 1), now, None);
        assert_eq!(e.batch_capacity(), Some(6), "garbage gauges are ignored");
        e.set_metrics(m(1.0, 0.0, 2), now, None);
        assert_eq!(
            e.batch_capacity(),
            None,
            "a restarted server is learned again"
        );
    }

    /// A continuously batching engine: requests wait behind a long prefill without any limit
    /// reached. Waiting counts as saturation only while every running request is past its
    /// prefill (the ledger knows every request, and its requests without first bytes are the
    /// waiting ones, no more).
    #[test]
    fn requests_waiting_behind_a_prefill_teach_no_limit() {
        let e = Endpoint::new(
            "p".into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        );
        let now = Instant::now();
        let ledger = |requests, prefilling| {
            Some(InflightLoad {
                requests,
                tokens: 0,
                prefilling,
            })
        };
        // One long prompt prefilling, one waiting behind it: both still without first bytes.
        e.set_metrics(m(1.0, 1.0, 1), now, ledger(2, 2));
        e.set_metrics(m(1.0, 1.0, 1), now, ledger(2, 2));
        // Two decoding, a third prefilling, a fourth waiting.
        e.set_metrics(m(3.0, 1.0, 1), now, ledger(4, 2));
        e.set_metrics(m(3.0, 1.0, 1), now, ledger(4, 2));
        // Requests the ledger does not know (traffic around this EPP): nothing can be told.
        e.set_metrics(m(5.0, 1.0, 1), now, ledger(2, 1));
        e.set_metrics(m(5.0, 1.0, 1), now, ledger(2, 1));
        // A request waiting for the step to end, then let in: the count moved.
        e.set_metrics(m(6.0, 1.0, 1), now, ledger(7, 1));
        e.set_metrics(m(7.0, 1.0, 1), now, ledger(8, 1));
        assert_eq!(e.batch_capacity(), None);
        // Eight decoding, two waiting (and nothing else without first bytes), twice: the batch
        // is full.
        e.set_metrics(m(8.0, 2.0, 1), now, ledger(10, 2));
        e.set_metrics(m(8.0, 1.0, 1), now, ledger(9, 1));
        assert_eq!(e.batch_capacity(), Some(8));
    }
}

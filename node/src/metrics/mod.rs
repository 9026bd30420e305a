//! The EPP's Prometheus metrics, with llm-d's `llm_d_epp_` names.
//!
//! One `prometheus-client` registry, built at start-up and passed down as `Arc<Metrics>`; served by
//! the admin server's `/metrics`. Model names and fairness ids are capped at 1000 distinct values per
//! label (further values become `other`), as llm-d does, so label cardinality stays bounded.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod cluster;
mod discovery;
mod kvevents;
mod registrar;
mod tenants;

pub use cluster::{ClusterMetrics, DirectionLabels, GossipMetrics, PathLabels, ResultLabels};
pub use discovery::DiscoveryMetrics;
pub use kvevents::KvEventMetrics;
pub use tenants::{
    ReloadLabels, TenantMetrics, TenantModel, TenantOutcome, TenantTokens, UnauthorizedLabels,
};

pub const PREFIX: &str = "llm_d_epp";
const MAX_LABEL_VALUES: usize = 1000;
/// Distinct label combinations per request-labelled family (queue duration, token histograms).
const MAX_SERIES: usize = 5000;
/// Distinct (model, target model) pairs of the request families (`request_total`, sizes,
/// latencies, errors): each label alone is capped at [`MAX_LABEL_VALUES`], but a client's rewrite
/// header could pair every model with every target.
const MAX_REQUEST_SERIES: usize = 1000;
const OTHER: &str = "other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model_name: String,
    pub target_model_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub model_name: String,
    pub target_model_name: String,
    pub error_code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source_type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub name: String,
}

/// `flow_control_request_queue_duration_seconds` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub fairness_id: String,
    pub priority: String,
    pub outcome: String,
    pub inference_pool: String,
    pub model_name: String,
    pub target_model_name: String,
}

/// `flow_control_requests_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
    pub priority: String,
    pub inference_pool: String,
}

/// Per-band gauges (`flow_control_queue_size`, `_queue_bytes`, `_capacity_utilization_requests`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BandLabels {
    pub priority: String,
    pub inference_pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SaturationLabels {
    pub inference_pool: String,
    pub stage: String,
}

/// Token histograms' labels (llm-d's request labels).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    pub model_name: String,
    pub target_model_name: String,
    pub fairness_id: String,
    pub priority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub plugin_name: String,
    pub plugin_type: String,
}

/// `response_affinity_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AffinityLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DisaggLabels {
    pub decision_type: String,
}

/// `request_refusals_total` labels: the status the EPP answered and why (the dropped reason, e.g.
/// `rejected-saturated`, `rejected-quota-tpm`, or the error code when there is none).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub status: u16,
    pub reason: &'static str,
}

/// `log_events_suppressed_total` labels: the log target (module path) held back.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub target: String,
}

/// `untrusted_values_rejected_total` labels: where the value came from and which field it was.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    pub source: &'static str,
    pub field: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub status: String,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
        10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0,
        1200.0, 1800.0, 2700.0, 3600.0,
    ]
}

fn scheduler_buckets() -> Vec<f64> {
    vec![
        0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
    ]
}

/// Caps the number of distinct values one label may take.
#[derive(Debug, Default)]
struct LabelCap {
    seen: Mutex<HashSet<String>>,
}

impl LabelCap {
    fn admit(&self, v: &str) -> String {
        let mut seen = match self.seen.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if seen.contains(v) {
            return v.to_string();
        }
        if seen.len() >= MAX_LABEL_VALUES {
            return OTHER.to_string();
        }
        seen.insert(v.to_string());
        v.to_string()
    }
}

/// Caps the number of distinct label combinations of one family: each label is capped on its
/// own, but 1000 fairness ids × 1000 models would still be a million series.
#[derive(Debug)]
struct SeriesCap {
    seen: Mutex<HashSet<u64>>,
    max: usize,
}

impl Default for SeriesCap {
    fn default() -> Self {
        SeriesCap::new(MAX_SERIES)
    }
}

impl SeriesCap {
    fn new(max: usize) -> Self {
        SeriesCap {
            seen: Mutex::default(),
            max,
        }
    }

    /// Whether the combination `values` may have its own series.
    fn admit(&self, values: &[&str]) -> bool {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for v in values {
            h.update(v.as_bytes());
            h.update(&[0xff]);
        }
        let key = h.digest();
        let mut seen = match self.seen.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if seen.contains(&key) {
            return true;
        }
        if seen.len() >= self.max {
            return false;
        }
        seen.insert(key);
        true
    }
}

pub struct Metrics {
    registry: Registry,
    /// Every series name the registry exposes (a family shows in the exposition only once it
    /// has a series).
    series: Vec<String>,
    pool_name: String,
    request_total: Family<RequestLabels, Counter>,
    request_error_total: Family<ErrorLabels, Counter>,
    request_duration: Family<RequestLabels, Histogram>,
    request_running: Family<RequestLabels, Gauge>,
    request_size: Family<RequestLabels, Histogram>,
    scheduler_e2e: Histogram,
    scheduler_attempts: Family<AttemptLabels, Counter>,
    poll_errors: Family<SourceLabels, Counter>,
    rejected_values: Family<RejectedLabels, Counter>,
    refusals: Family<RefusalLabels, Counter>,
    stale_endpoints: Gauge,
    log_suppressed: Family<TargetLabels, Counter>,
    ready_endpoints: Family<PoolLabels, Gauge>,
    streams_inflight: Gauge,
    streams_inflight_count: AtomicI64,
    buffered_body_bytes: Gauge,
    model_cap: LabelCap,
    fairness_cap: LabelCap,
    priority_cap: LabelCap,
    queue_series: SeriesCap,
    token_series: SeriesCap,
    request_series: SeriesCap,
    disagg_decisions: Family<DisaggLabels, Counter>,
    model_rewrites: Family<RequestLabels, Counter>,
    served_by_fallback: Counter,
    response_affinity: Family<AffinityLabels, Counter>,
    response_bindings: Gauge,
    prefix_size: Family<PluginLabels, Gauge>,
    prefix_hit_ratio: Family<PluginLabels, Histogram, fn() -> Histogram>,
    prefix_hit_bytes: Family<PluginLabels, Histogram, fn() -> Histogram>,
    input_tokens: Family<TokenLabels, Histogram, fn() -> Histogram>,
    output_tokens: Family<TokenLabels, Histogram, fn() -> Histogram>,
    cached_tokens: Family<TokenLabels, Histogram, fn() -> Histogram>,
    pub flow: FlowMetrics,
    pub cluster: ClusterMetrics,
    pub gossip: GossipMetrics,
    pub discovery: DiscoveryMetrics,
    pub kv_events: KvEventMetrics,
    pub tenants: TenantMetrics,
}

/// Flow-control metrics (llm-d's `flow_control_*`), updated by [`crate::request::admission::local::FlowGate`].
#[derive(Debug)]
pub struct FlowMetrics {
    pub queue_duration: Family<QueueLabels, Histogram, fn() -> Histogram>,
    pub requests: Family<OutcomeLabels, Counter>,
    pub queue_size: Family<BandLabels, Gauge>,
    pub queue_bytes: Family<BandLabels, Gauge>,
    pub inflight: Family<BandLabels, Gauge>,
    pub saturation: Family<SaturationLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Pods whose own batch limit is below the concurrency detector's `maxConcurrency`.
    pub pods_below_max_concurrency: Gauge,
}

/// llm-d's token buckets: powers of two, 1 … 1048576 (prompt) and 1 … 8192 (output).
fn prompt_token_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1.0, 2.0, 21,
    ))
}

fn output_token_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1.0, 2.0, 14,
    ))
}

fn ratio_histogram() -> Histogram {
    Histogram::new((0..=10).map(|i| f64::from(i) / 10.0))
}

fn bytes_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        256.0, 4.0, 10,
    ))
}

fn queue_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(pool_name: &str) -> Self {
        let mut registry = registrar::Registrar::new(PREFIX);
        let request_total = Family::<RequestLabels, Counter>::default();
        registry.register(
            "request",
            "Requests received by the endpoint picker",
            request_total.clone(),
        );
        let request_error_total = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "request_error",
            "Requests answered with an error by the endpoint picker",
            request_error_total.clone(),
        );
        let request_duration = Family::<RequestLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "request_duration_seconds",
            "End-to-end request duration seen by the endpoint picker",
            request_duration.clone(),
        );
        let request_running = Family::<RequestLabels, Gauge>::default();
        registry.register(
            "request_running",
            "Requests currently being processed",
            request_running.clone(),
        );
        let request_size = Family::<RequestLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                64.0, 4.0, 12,
            ))
        });
        registry.register(
            "request_size_bytes",
            "Request body size in bytes",
            request_size.clone(),
        );
        let scheduler_e2e = Histogram::new(scheduler_buckets());
        registry.register(
            "scheduler_e2e_duration_seconds",
            "Time to run the scheduler for one request",
            scheduler_e2e.clone(),
        );
        let scheduler_attempts = Family::<AttemptLabels, Counter>::default();
        registry.register(
            "scheduler_attempts",
            "Scheduling attempts by outcome",
            scheduler_attempts.clone(),
        );
        let poll_errors = Family::<SourceLabels, Counter>::default();
        registry.register(
            "datalayer_poll_errors",
            "Failed model-server metric scrapes",
            poll_errors.clone(),
        );
        let rejected_values = Family::<RejectedLabels, Counter>::default();
        registry.register(
            "untrusted_values_rejected",
            "Values from model servers, peers or clients outside their bounds, dropped or clamped, \
             by source and field",
            rejected_values.clone(),
        );
        let refusals = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "request_refusals",
            "Requests the endpoint picker answered itself, by HTTP status and reason",
            refusals.clone(),
        );
        let stale_endpoints = Gauge::default();
        registry.register(
            "datalayer_stale_endpoints",
            "Endpoints without a usable metrics sample (never scraped, or older than the \
             staleness threshold)",
            stale_endpoints.clone(),
        );
        let log_suppressed = Family::<TargetLabels, Counter>::default();
        registry.register(
            "log_events_suppressed",
            "Repeated warnings and errors of noisy libraries held back by the log rate limit, by \
             target",
            log_suppressed.clone(),
        );
        let ready_endpoints = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_ready_endpoints",
            "Endpoints currently known to the pool",
            ready_endpoints.clone(),
        );
        let streams_inflight = Gauge::default();
        registry.register(
            "extproc_streams_inflight",
            "Open ext_proc streams",
            streams_inflight.clone(),
        );
        let buffered_body_bytes = Gauge::default();
        registry.register(
            "buffered_body_bytes",
            "Request body bytes buffered across streams (bounded by --max-buffered-body-bytes)",
            buffered_body_bytes.clone(),
        );
        let flow = FlowMetrics {
            queue_duration: Family::new_with_constructor(queue_histogram as fn() -> Histogram),
            requests: Family::default(),
            queue_size: Family::default(),
            queue_bytes: Family::default(),
            inflight: Family::default(),
            saturation: Family::default(),
            pods_below_max_concurrency: Gauge::default(),
        };
        registry.register(
            "flow_control_request_queue_duration_seconds",
            "Time requests spent in the flow-control queue, by outcome",
            flow.queue_duration.clone(),
        );
        registry.register(
            "flow_control_requests",
            "Requests that left flow control, by outcome",
            flow.requests.clone(),
        );
        registry.register(
            "flow_control_queue_size",
            "Requests waiting in flow control, per priority band",
            flow.queue_size.clone(),
        );
        registry.register(
            "flow_control_queue_bytes",
            "Bytes of requests waiting in flow control, per priority band",
            flow.queue_bytes.clone(),
        );
        registry.register(
            "flow_control_inflight_requests",
            "Requests dispatched by flow control and not yet completed, per priority band",
            flow.inflight.clone(),
        );
        registry.register(
            "flow_control_pool_saturation",
            "Pool saturation as the flow-control dispatcher sees it",
            flow.saturation.clone(),
        );
        registry.register(
            "flow_control_pods_below_max_concurrency",
            "Pods that have shown a batch limit below the concurrency detector's maxConcurrency (the detector counts theirs)",
            flow.pods_below_max_concurrency.clone(),
        );
        let disagg_decisions = Family::<DisaggLabels, Counter>::default();
        registry.register(
            "disagg_decision",
            "Routing decisions by disaggregation type (decode-only, prefill-decode)",
            disagg_decisions.clone(),
        );
        let served_by_fallback = Counter::default();
        registry.register(
            "served_by_fallback_endpoint",
            "Requests the proxy served from a fallback endpoint (the prefix index and in-flight load were corrected)",
            served_by_fallback.clone(),
        );
        let response_affinity = Family::<AffinityLabels, Counter>::default();
        registry.register(
            "response_affinity",
            "Responses-API follow-ups naming previous_response_id, by outcome: hit (sent to the pod holding it), pod_gone (that pod left the pool), expired (bound longer ago than the TTL), unknown (never bound here, or evicted) — all but hit are scheduled normally",
            response_affinity.clone(),
        );
        let response_bindings = Gauge::default();
        registry.register(
            "response_bindings",
            "Responses-API response id to pod bindings held (all pods, replicated)",
            response_bindings.clone(),
        );
        let model_rewrites = Family::<RequestLabels, Counter>::default();
        registry.register(
            "model_rewrite_decisions",
            "Requests whose model was rewritten (header or InferenceModelRewrite rule), by model and target",
            model_rewrites.clone(),
        );
        let input_tokens: Family<TokenLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(prompt_token_histogram as fn() -> Histogram);
        registry.register(
            "request_input_tokens",
            "Prompt tokens per request, from the response's usage",
            input_tokens.clone(),
        );
        let output_tokens: Family<TokenLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(output_token_histogram as fn() -> Histogram);
        registry.register(
            "request_output_tokens",
            "Output tokens per request, from the response's usage",
            output_tokens.clone(),
        );
        let cached_tokens: Family<TokenLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(prompt_token_histogram as fn() -> Histogram);
        registry.register(
            "request_cached_tokens",
            "Prompt tokens served from the prefix cache per request, from the response's usage",
            cached_tokens.clone(),
        );
        let prefix_size = Family::<PluginLabels, Gauge>::default();
        registry.register(
            "prefix_indexer_size",
            "Entries in the approximate prefix index (all pods)",
            prefix_size.clone(),
        );
        let prefix_hit_ratio: Family<PluginLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(ratio_histogram as fn() -> Histogram);
        registry.register(
            "prefix_indexer_hit_ratio",
            "Share of the prompt's blocks the index matched on the chosen pod",
            prefix_hit_ratio.clone(),
        );
        let prefix_hit_bytes: Family<PluginLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(bytes_histogram as fn() -> Histogram);
        registry.register(
            "prefix_indexer_hit_bytes",
            "Prompt bytes the index matched on the chosen pod (blocks × block size × 4)",
            prefix_hit_bytes.clone(),
        );
        let cluster = ClusterMetrics::register(&mut registry);
        let gossip = GossipMetrics::register(&mut registry);
        let discovery = DiscoveryMetrics::register(&mut registry);
        let kv_events = KvEventMetrics::register(&mut registry);
        let tenants = TenantMetrics::register(&mut registry);
        Metrics {
            registry: registry.registry,
            series: registry.series,
            pool_name: pool_name.to_string(),
            request_total,
            request_error_total,
            request_duration,
            request_running,
            request_size,
            scheduler_e2e,
            scheduler_attempts,
            poll_errors,
            rejected_values,
            refusals,
            stale_endpoints,
            log_suppressed,
            ready_endpoints,
            streams_inflight,
            streams_inflight_count: AtomicI64::new(0),
            buffered_body_bytes,
            model_cap: LabelCap::default(),
            fairness_cap: LabelCap::default(),
            priority_cap: LabelCap::default(),
            queue_series: SeriesCap::default(),
            token_series: SeriesCap::default(),
            request_series: SeriesCap::new(MAX_REQUEST_SERIES),
            cluster,
            gossip,
            discovery,
            kv_events,
            tenants,
            disagg_decisions,
            model_rewrites,
            served_by_fallback,
            response_affinity,
            response_bindings,
            prefix_size,
            prefix_hit_ratio,
            prefix_hit_bytes,
            input_tokens,
            output_tokens,
            cached_tokens,
            flow,
        }
    }

    /// Record a response's token usage.
    pub fn usage(&self, labels: &TokenLabels, input: u64, output: u64, cached: u64) {
        self.input_tokens
            .get_or_create(labels)
            .observe(input as f64);
        self.output_tokens
            .get_or_create(labels)
            .observe(output as f64);
        self.cached_tokens
            .get_or_create(labels)
            .observe(cached as f64);
    }

    /// Token labels for a route, label values capped like request labels and combinations
    /// capped per family.
    pub fn token_labels(
        &self,
        model: &str,
        target: &str,
        fairness_id: &str,
        priority: i32,
    ) -> TokenLabels {
        let [model_name, target_model_name, fairness_id, priority] =
            self.capped(&self.token_series, model, target, fairness_id, priority);
        TokenLabels {
            model_name,
            target_model_name,
            fairness_id,
            priority,
        }
    }

    /// `flow_control_request_queue_duration_seconds` labels (outcome set when the wait ends).
    pub fn queue_labels(
        &self,
        model: &str,
        target: &str,
        fairness_id: &str,
        priority: i32,
    ) -> QueueLabels {
        let [model_name, target_model_name, fairness_id, priority] =
            self.capped(&self.queue_series, model, target, fairness_id, priority);
        QueueLabels {
            fairness_id,
            priority,
            outcome: String::new(),
            inference_pool: self.pool_name.clone(),
            model_name,
            target_model_name,
        }
    }

    /// Model, target, fairness id and priority as label values: each capped, and past the
    /// family's combination cap all `other`.
    fn capped(
        &self,
        series: &SeriesCap,
        model: &str,
        target: &str,
        fairness_id: &str,
        priority: i32,
    ) -> [String; 4] {
        let v = [
            self.model_cap.admit(model),
            self.model_cap.admit(target),
            self.fairness_cap.admit(fairness_id),
            self.priority_cap.admit(&priority.to_string()),
        ];
        if series.admit(&[&v[0], &v[1], &v[2], &v[3]]) {
            v
        } else {
            [OTHER, OTHER, OTHER, OTHER].map(String::from)
        }
    }

    fn prefix_labels() -> PluginLabels {
        PluginLabels {
            plugin_name: "approx-prefix-cache-producer".into(),
            plugin_type: "approx-prefix-cache-producer".into(),
        }
    }

    /// The chosen pod's prefix match: `matched` of `total` blocks of `block_size` tokens.
    pub fn prefix_hit(&self, matched: usize, total: usize, block_size: usize) {
        if total == 0 {
            return;
        }
        let l = Self::prefix_labels();
        self.prefix_hit_ratio
            .get_or_create(&l)
            .observe(matched as f64 / total as f64);
        self.prefix_hit_bytes
            .get_or_create(&l)
            .observe((matched * block_size * 4) as f64);
    }

    pub fn set_prefix_size(&self, entries: usize) {
        self.prefix_size
            .get_or_create(&Self::prefix_labels())
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    pub fn disagg_decision(&self, decision_type: &str) {
        self.disagg_decisions
            .get_or_create(&DisaggLabels {
                decision_type: decision_type.to_string(),
            })
            .inc();
    }

    pub fn served_by_fallback(&self) {
        self.served_by_fallback.inc();
    }

    /// A `previous_response_id` lookup's outcome (`hit`, `pod_gone`, `expired`, `unknown`).
    pub fn response_affinity(&self, outcome: &'static str) {
        self.response_affinity
            .get_or_create(&AffinityLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    pub fn set_response_bindings(&self, n: usize) {
        self.response_bindings.set(n as i64);
    }

    pub fn model_rewrite(&self, model: &str, target: &str) {
        self.model_rewrites
            .get_or_create(&self.request_labels(model, target))
            .inc();
    }

    pub fn pool_name(&self) -> &str {
        &self.pool_name
    }

    /// A request's (model, target) labels: each capped, and past the pair cap both `other`.
    pub fn request_labels(&self, model: &str, target: &str) -> RequestLabels {
        let (model_name, target_model_name) =
            (self.model_cap.admit(model), self.model_cap.admit(target));
        if self
            .request_series
            .admit(&[&model_name, &target_model_name])
        {
            RequestLabels {
                model_name,
                target_model_name,
            }
        } else {
            RequestLabels {
                model_name: OTHER.into(),
                target_model_name: OTHER.into(),
            }
        }
    }

    pub fn request_received(&self, l: &RequestLabels, body_bytes: usize) {
        self.request_total.get_or_create(l).inc();
        self.request_size
            .get_or_create(l)
            .observe(body_bytes as f64);
    }

    /// A request the EPP answered itself: llm-d's `request_error_total` (by error code) and
    /// `request_refusals_total` (by status and reason).
    pub fn refused(
        &self,
        l: &RequestLabels,
        code: &str,
        status: u16,
        reason: Option<&'static str>,
    ) {
        self.request_error(l, code);
        let reason = reason.unwrap_or(match status {
            400 => "bad-request",
            401 => "unauthorized",
            404 => "not-found",
            413 => "too-large",
            _ => "error",
        });
        self.refusals
            .get_or_create(&RefusalLabels { status, reason })
            .inc();
    }

    pub fn set_stale_endpoints(&self, n: usize) {
        self.stale_endpoints.set(n as i64);
    }

    pub fn request_error(&self, l: &RequestLabels, code: &str) {
        self.request_error_total
            .get_or_create(&ErrorLabels {
                model_name: l.model_name.clone(),
                target_model_name: l.target_model_name.clone(),
                error_code: code.to_string(),
            })
            .inc();
    }

    pub fn request_running(&self, l: &RequestLabels, delta: i64) {
        self.request_running.get_or_create(l).inc_by(delta);
    }

    pub fn request_done(&self, l: &RequestLabels, seconds: f64) {
        self.request_duration.get_or_create(l).observe(seconds);
    }

    pub fn scheduled(&self, seconds: f64, ok: bool) {
        self.scheduler_e2e.observe(seconds);
        self.scheduler_attempts
            .get_or_create(&AttemptLabels {
                status: if ok { "success" } else { "failure" }.into(),
            })
            .inc();
    }

    pub fn poll_error(&self) {
        self.poll_errors
            .get_or_create(&SourceLabels {
                source_type: "metrics-data-source".into(),
            })
            .inc();
    }

    /// A value from `source` (`metrics`, `peer`, `kv-events`, `client`) broke its bound.
    pub fn rejected_value(&self, source: &'static str, field: &'static str) {
        self.rejected_values
            .get_or_create(&RejectedLabels { source, field })
            .inc();
    }

    pub fn set_ready_endpoints(&self, n: usize) {
        self.ready_endpoints
            .get_or_create(&PoolLabels {
                name: self.pool_name.clone(),
            })
            .set(n as i64);
    }

    pub fn stream_opened(&self) {
        self.streams_inflight_count.fetch_add(1, Ordering::Relaxed);
        self.streams_inflight.inc();
    }

    pub fn stream_closed(&self) {
        self.streams_inflight_count.fetch_sub(1, Ordering::Relaxed);
        self.streams_inflight.dec();
    }

    pub fn set_buffered_body_bytes(&self, n: usize) {
        self.buffered_body_bytes
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn streams_inflight(&self) -> i64 {
        self.streams_inflight_count.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition of every metric.
    /// Every series name this registry can expose: a counter's `<name>_total`, a histogram's
    /// `_bucket`, `_sum` and `_count`, a gauge's name (dashboards and alert rules are checked
    /// against it).
    pub fn series_names(&self) -> &[String] {
        &self.series
    }

    pub fn encode(&self) -> String {
        for (target, n) in crate::telemetry::logs::suppressed() {
            registrar::follow(
                &self.log_suppressed.get_or_create(&TargetLabels { target }),
                n,
            );
        }
        let mut out = String::with_capacity(8192);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_have_llm_d_prefix() {
        let m = Metrics::new("pool");
        let l = m.request_labels("m", "m");
        m.request_received(&l, 10);
        m.request_error(&l, "BadRequest");
        m.scheduled(0.0001, true);
        let text = m.encode();
        assert!(
            text.contains("llm_d_epp_request_total{model_name=\"m\",target_model_name=\"m\"} 1"),
            "{text}"
        );
        assert!(text.contains("llm_d_epp_request_error_total{"), "{text}");
        assert!(
            text.contains("llm_d_epp_scheduler_e2e_duration_seconds_bucket"),
            "{text}"
        );
    }

    #[test]
    fn label_cap() {
        let cap = LabelCap::default();
        for i in 0..MAX_LABEL_VALUES {
            assert_eq!(cap.admit(&i.to_string()), i.to_string());
        }
        assert_eq!(cap.admit("new"), "other");
        assert_eq!(cap.admit("5"), "5");
    }

    #[test]
    fn request_labelled_families_have_a_bounded_number_of_series() {
        let m = Metrics::new("pool");
        // 100 fairness ids × 100 priorities: each label under its own cap, the product not.
        let mut other = 0;
        for f in 0..100 {
            for p in 0..100 {
                let q = m.queue_labels("m", "m", &format!("tenant-{f}"), p);
                let t = m.token_labels("m", "m", &format!("tenant-{f}"), p);
                assert_eq!(q.fairness_id, t.fairness_id);
                if q.fairness_id == OTHER {
                    assert_eq!((q.priority.as_str(), q.model_name.as_str()), (OTHER, OTHER));
                    other += 1;
                }
            }
        }
        assert_eq!(other, 100 * 100 - MAX_SERIES);
        // a combination seen before keeps its series
        assert_eq!(
            m.queue_labels("m", "m", "tenant-0", 0).fairness_id,
            "tenant-0"
        );
        // client-chosen priorities are capped like any label
        let m = Metrics::new("pool");
        for p in 0..(MAX_LABEL_VALUES as i32 + 5) {
            let q = m.queue_labels("m", "m", "t", p);
            assert_eq!(q.priority == OTHER, p >= MAX_LABEL_VALUES as i32, "{p}");
        }
        // (model, target) pairs: 100 models each rewritten to 100 targets — 10 000 pairs, each
        // label under its cap — keep their own series only up to the pair cap.
        let m = Metrics::new("pool");
        let mut own = 0;
        for model in 0..100 {
            for target in 0..100 {
                let l = m.request_labels(&format!("m{model}"), &format!("t{target}"));
                m.request_received(&l, 1);
                if l.model_name != OTHER {
                    own += 1;
                } else {
                    assert_eq!(l.target_model_name, OTHER);
                }
            }
        }
        assert_eq!(own, MAX_REQUEST_SERIES);
        let series = m
            .encode()
            .lines()
            .filter(|l| l.starts_with("llm_d_epp_request_total{"))
            .count();
        assert_eq!(series, MAX_REQUEST_SERIES + 1);
    }
}

//! Admission: what happens to a parsed request before it is scheduled.
//!
//! * **Request metadata** — fairness id (`x-llm-d-inference-fairness-id`, deprecated alias
//!   `x-gateway-inference-fairness-id`, else an agent session header — [`AGENT_SESSION_HEADERS`]
//!   — else `default-flow`), priority from the `InferenceObjective` named by
//!   `x-llm-d-inference-objective` (alias `x-gateway-inference-objective`; unknown or absent = 0),
//!   and the TTFT objective `x-llm-d-slo-ttft-ms` (alias `x-slo-ttft-ms`).
//! * **Legacy admission** (the `flowControl` gate off, llm-d's `LegacyAdmissionController`):
//!   sheddable requests (priority < 0) are refused with 429 while the saturation detector says the
//!   pool is saturated; nothing waits.
//! * **Flow control** (the gate on): [`FlowGate`] is the shell around `flowctl`'s pure state machine.
//!   A request is enqueued and its ext_proc stream simply waits for the verdict; dispatch happens
//!   when the detector reports headroom (a periodic pool observation) or a request completes (the
//!   response path, keyed by `x-request-id`, so the observing stream of the split data plane can
//!   settle it). A stream that goes away while queued cancels its entry.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowctl::{
    Command, ConcurrencyDetector, ControllerConfig, DropReason, EndpointLoad, EndpointSnapshot,
    EnqueueRequest, FlowController, FlowKey, Nanos, Outcome, SaturationDetector,
    UtilizationDetector,
};
use serde::Deserialize;
use tokio::sync::oneshot;

use crate::config::{ConfigError, decode_at};
use crate::datalayer::Datastore;
use crate::datalayer::store::Candidate;
use crate::metrics::{BandLabels, Metrics, OutcomeLabels, QueueLabels, SaturationLabels};
use crate::plugins::inflight::InflightTracker;

pub const FAIRNESS_ID_HEADER: &str = "x-llm-d-inference-fairness-id";
pub const FAIRNESS_ID_ALIAS: &str = "x-gateway-inference-fairness-id";
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
pub const OBJECTIVE_ALIAS: &str = "x-gateway-inference-objective";
pub const SLO_TTFT_HEADER: &str = "x-llm-d-slo-ttft-ms";
pub const SLO_TTFT_ALIAS: &str = "x-slo-ttft-ms";
pub const DEFAULT_FAIRNESS_ID: &str = "default-flow";
/// Agent identity (llm-d's `agent-identity`): an agent's session header is the fairness id of a
/// request that names none, so each agent session is its own flow.
pub const AGENT_SESSION_HEADERS: [&str; 4] = [
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
];

/// Headers a client must not be able to smuggle to the model server.
pub const CONTROL_HEADERS: [&str; 8] = [
    FAIRNESS_ID_HEADER,
    FAIRNESS_ID_ALIAS,
    OBJECTIVE_HEADER,
    OBJECTIVE_ALIAS,
    SLO_TTFT_HEADER,
    SLO_TTFT_ALIAS,
    crate::rewrite::REWRITE_HEADER,
    crate::rewrite::REWRITE_ALIAS,
];

// ----- InferenceObjective definitions -----

/// `InferenceObjective` name → priority. In Kubernetes these are CRDs (`llm-d.ai/v1alpha2`); a
/// standalone replica reads the same manifests from `--objectives-file`.
#[derive(Debug, Clone, Default)]
pub struct Objectives(HashMap<String, i32>);

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveDoc {
    api_version: String,
    kind: String,
    metadata: ObjectiveMeta,
    #[serde(default)]
    spec: ObjectiveSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveMeta {
    name: String,
    #[serde(default)]
    #[allow(dead_code)]
    namespace: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ObjectiveSpec {
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    #[allow(dead_code)]
    pool_ref: Option<serde_json::Value>,
}

impl Objectives {
    pub fn new(map: HashMap<String, i32>) -> Self {
        Objectives(map)
    }

    /// Parse one or more YAML documents of `kind: InferenceObjective` (`spec.priority`, default 0).
    pub fn from_yaml(text: &str) -> Result<Objectives, ConfigError> {
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        let mut map = HashMap::new();
        for (i, doc) in docs.iter().enumerate() {
            if doc.is_null() {
                continue;
            }
            let d: ObjectiveDoc = decode_at(doc, &format!("objectives[{i}]"))?;
            if d.kind != "InferenceObjective" {
                return Err(ConfigError::invalid(format!(
                    "objectives[{i}].kind: `{}` is not InferenceObjective",
                    d.kind
                )));
            }
            if !d.api_version.ends_with("/v1alpha2") && !d.api_version.ends_with("/v1alpha1") {
                tracing::warn!(api_version = %d.api_version, "unexpected InferenceObjective apiVersion");
            }
            if map
                .insert(d.metadata.name.clone(), d.spec.priority.unwrap_or(0))
                .is_some()
            {
                return Err(ConfigError::invalid(format!(
                    "objectives[{i}]: InferenceObjective `{}` defined twice",
                    d.metadata.name
                )));
            }
        }
        Ok(Objectives(map))
    }

    pub fn from_file(path: &Path) -> Result<Objectives, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Objectives::from_yaml(&text)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn priority(&self, name: &str) -> Option<i32> {
        self.0.get(name).copied()
    }
}

/// What admission needs to know about a request, from its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    pub fairness_id: String,
    pub objective: Option<String>,
    pub priority: i32,
    pub slo_ttft_ms: Option<u64>,
}

fn first_header<'a>(headers: &'a HashMap<String, String>, names: &[&str]) -> Option<&'a str> {
    names
        .iter()
        .filter_map(|n| headers.get(*n))
        .map(|v| v.trim())
        .find(|v| !v.is_empty())
}

impl RequestMeta {
    pub fn from_headers(headers: &HashMap<String, String>, objectives: &Objectives) -> Self {
        let fairness_id = first_header(headers, &[FAIRNESS_ID_HEADER, FAIRNESS_ID_ALIAS])
            .or_else(|| first_header(headers, &AGENT_SESSION_HEADERS))
            .unwrap_or(DEFAULT_FAIRNESS_ID)
            .to_string();
        let objective =
            first_header(headers, &[OBJECTIVE_HEADER, OBJECTIVE_ALIAS]).map(str::to_string);
        let priority = match &objective {
            Some(name) => objectives.priority(name).unwrap_or_else(|| {
                tracing::debug!(objective = %name, "unknown InferenceObjective: priority 0");
                0
            }),
            None => 0,
        };
        let slo_ttft_ms = first_header(headers, &[SLO_TTFT_HEADER, SLO_TTFT_ALIAS])
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v > 0.0)
            .map(|v| v.round() as u64);
        RequestMeta {
            fairness_id,
            objective,
            priority,
            slo_ttft_ms,
        }
    }
}

// ----- detectors over the datastore -----

fn nanos_since(epoch: Instant, t: Instant) -> Nanos {
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// The detector's view of one endpoint, sample times relative to `epoch`.
fn snapshot(epoch: Instant, c: &Candidate) -> EndpointSnapshot {
    snapshot_with(c, |t| nanos_since(epoch, t))
}

/// The detector's view of one endpoint; `clock` turns the sample's instant into state time.
pub(crate) fn snapshot_with(c: &Candidate, clock: impl Fn(Instant) -> Nanos) -> EndpointSnapshot {
    match &c.sample {
        Some(s) => EndpointSnapshot {
            waiting_queue: s.metrics.waiting_queue_size.unwrap_or(0.0).max(0.0) as u64,
            kv_cache_usage: s.metrics.kv_cache_usage.unwrap_or(0.0),
            // Never 0 for a real sample: 0 would read as "just taken" at the epoch.
            sampled_at: Some(clock(s.scraped_at).max(1)),
        },
        None => EndpointSnapshot::default(),
    }
}

/// llm-d's legacy admission controller (the `flowControl` gate off).
#[derive(Debug)]
pub struct LegacyAdmission {
    detector: SaturationDetector,
    /// The concurrency detector counts in-flight requests from the scheduler's ledger.
    inflight: Option<Arc<InflightTracker>>,
    epoch: Instant,
}

impl LegacyAdmission {
    pub fn new(
        detector: SaturationDetector,
        inflight: Option<Arc<InflightTracker>>,
    ) -> Result<Self, ConfigError> {
        if matches!(detector, SaturationDetector::Concurrency(_)) && inflight.is_none() {
            return Err(ConfigError::invalid(
                "saturationDetector: `concurrency-detector` without the flowControl gate needs the \
                 in-flight ledger; add `inflight-load-producer` (or a scorer that uses it) to the \
                 plugins",
            ));
        }
        Ok(LegacyAdmission {
            detector,
            inflight,
            epoch: Instant::now(),
        })
    }

    /// Pool saturation over the current candidates.
    pub fn saturation(&self, candidates: &[Candidate], now: Instant) -> f64 {
        match &self.detector {
            SaturationDetector::Utilization(d) => {
                utilization(d, self.epoch, candidates, nanos_since(self.epoch, now))
            }
            SaturationDetector::Concurrency(d) => {
                concurrency(d, self.inflight.as_deref(), candidates)
            }
        }
    }

    /// Whether the request must be refused (429, no dropped-reason header).
    pub fn check(&self, priority: i32, candidates: &[Candidate], now: Instant) -> bool {
        // Only sheddable requests are checked; skip the detector otherwise.
        priority < 0
            && flowctl::legacy_admission(priority, self.saturation(candidates, now))
                == flowctl::LegacyAdmission::Reject
    }
}

fn utilization(
    d: &UtilizationDetector,
    epoch: Instant,
    candidates: &[Candidate],
    now: Nanos,
) -> f64 {
    let snaps: Vec<EndpointSnapshot> = candidates.iter().map(|c| snapshot(epoch, c)).collect();
    d.saturation(&snaps, now)
}

fn concurrency(
    d: &ConcurrencyDetector,
    tracker: Option<&InflightTracker>,
    candidates: &[Candidate],
) -> f64 {
    let loads: Vec<EndpointLoad> = candidates
        .iter()
        .map(|c| {
            let l = tracker
                .map(|t| t.load(&c.endpoint.hostport))
                .unwrap_or_default();
            EndpointLoad {
                inflight_requests: l.requests,
                inflight_tokens: l.tokens,
            }
        })
        .collect();
    d.saturation(&loads)
}

// ----- flow control -----

/// The verdict for a queued request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go ahead; the ticket names the in-flight entry.
    Dispatched(Ticket),
    Rejected(DropReason),
}

/// An admitted request's handle in the in-flight ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(pub(crate) u64);

/// A request asking flow control for admission.
#[derive(Debug, Clone)]
pub struct AdmitRequest<'a> {
    pub request_id: &'a str,
    pub meta: &'a RequestMeta,
    pub bytes: u64,
    pub tokens: u64,
    pub model: &'a str,
    pub target_model: &'a str,
}

pub(crate) struct Waiter {
    pub(crate) tx: oneshot::Sender<Verdict>,
    pub(crate) request_id: String,
    pub(crate) enqueued: Instant,
    pub(crate) labels: QueueLabels,
}

impl Waiter {
    pub(crate) fn new(
        tx: oneshot::Sender<Verdict>,
        req: &AdmitRequest<'_>,
        metrics: &Metrics,
    ) -> Waiter {
        Waiter {
            tx,
            request_id: req.request_id.to_string(),
            enqueued: Instant::now(),
            labels: QueueLabels {
                fairness_id: metrics.fairness_label(&req.meta.fairness_id),
                priority: req.meta.priority.to_string(),
                outcome: String::new(),
                inference_pool: metrics.pool_name().to_string(),
                model_name: req.model.to_string(),
                target_model_name: req.target_model.to_string(),
            },
        }
    }

    /// Record the outcome (queue duration, requests by outcome) and deliver the verdict.
    pub(crate) fn resolve(self, metrics: &Metrics, verdict: Verdict) -> bool {
        let outcome = match verdict {
            Verdict::Dispatched(_) => "dispatched",
            Verdict::Rejected(r) => r.as_str(),
        };
        let mut labels = self.labels;
        labels.outcome = outcome.to_string();
        metrics
            .flow
            .queue_duration
            .get_or_create(&labels)
            .observe(self.enqueued.elapsed().as_secs_f64());
        metrics
            .flow
            .requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
                priority: labels.priority.clone(),
                inference_pool: labels.inference_pool.clone(),
            })
            .inc();
        self.tx.send(verdict).is_ok()
    }
}

struct Running {
    request_id: String,
    since: Instant,
    priority: String,
}

struct GateState {
    fc: FlowController,
    next_id: u64,
    waiting: HashMap<u64, Waiter>,
    running: HashMap<u64, Running>,
    /// `x-request-id` → in-flight ids (a client may reuse an id; the oldest completes first).
    by_request_id: HashMap<String, Vec<u64>>,
    /// In-flight ids whose eviction stream is attached: firing the sender aborts the request.
    evictors: HashMap<u64, oneshot::Sender<()>>,
    out: Vec<Outcome>,
}

/// The flow-control shell: one `FlowController` behind a mutex (every operation is a few µs),
/// waiters resolved through oneshot channels.
pub struct FlowGate {
    epoch: Instant,
    /// `flowControl.enableEviction`.
    pub evicts: bool,
    state: Mutex<GateState>,
    metrics: Arc<Metrics>,
    store: Arc<Datastore>,
}

impl std::fmt::Debug for FlowGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowGate").finish_non_exhaustive()
    }
}

/// How often the gate observes the pool (detector input, TTL expiry, gauges).
pub const OBSERVE_INTERVAL: Duration = Duration::from_millis(20);

impl FlowGate {
    pub fn new(
        config: ControllerConfig,
        store: Arc<Datastore>,
        metrics: Arc<Metrics>,
    ) -> Result<FlowGate, ConfigError> {
        Ok(FlowGate {
            epoch: Instant::now(),
            evicts: config.eviction.enabled,
            state: Mutex::new(GateState {
                fc: FlowController::new(config)?,
                next_id: 1,
                waiting: HashMap::new(),
                running: HashMap::new(),
                by_request_id: HashMap::new(),
                evictors: HashMap::new(),
                out: Vec::new(),
            }),
            metrics,
            store,
        })
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn now(&self) -> Nanos {
        nanos_since(self.epoch, Instant::now())
    }

    /// Enqueue a request; await [`Pending::wait`] for the verdict. Dropping the `Pending` before
    /// that cancels the request (queued → `rejected-context-cancelled`; dispatched → released).
    pub fn enqueue(self: &Arc<Self>, req: AdmitRequest<'_>) -> Pending {
        let (tx, rx) = oneshot::channel();
        let now = self.now();
        let mut st = self.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.waiting.insert(id, Waiter::new(tx, &req, &self.metrics));
        let cmd = Command::Enqueue(EnqueueRequest {
            id,
            flow: FlowKey::new(req.meta.fairness_id.clone(), req.meta.priority),
            bytes: req.bytes,
            tokens: req.tokens,
            ttl: None,
            slo_ttft: req.meta.slo_ttft_ms.map(|ms| ms.saturating_mul(1_000_000)),
        });
        self.apply(&mut st, now, cmd);
        drop(st);
        Pending {
            owner: Some(PendingOwner::Local(self.clone())),
            id,
            rx: Some(rx),
        }
    }

    /// The response of `request_id` ended: free its slot.
    pub fn complete(&self, request_id: &str, actual_tokens: Option<u64>) {
        let now = self.now();
        let mut st = self.lock();
        let id = match st.by_request_id.get_mut(request_id) {
            Some(ids) if !ids.is_empty() => ids.remove(0),
            _ => return,
        };
        self.forget_running(&mut st, id);
        self.apply(&mut st, now, Command::Complete { id, actual_tokens });
    }

    /// A dispatched request that will never reach a model server (e.g. scheduling failed).
    pub fn release(&self, ticket: Ticket) {
        self.cancel(ticket.0);
    }

    pub(crate) fn cancel(&self, id: u64) {
        let now = self.now();
        let mut st = self.lock();
        self.forget_running(&mut st, id);
        self.apply(&mut st, now, Command::Cancel { id });
    }

    /// The eviction stream of `request_id` (Envoy's response filter) attached: the request can
    /// now be evicted. The receiver fires when flow control evicts it; it errors (sender dropped)
    /// when the request ends otherwise. `None` when no sheddable request with that id is in flight
    /// on this replica.
    pub fn attach_evictor(&self, request_id: &str) -> Option<oneshot::Receiver<()>> {
        let now = self.now();
        let mut st = self.lock();
        let id = *st.by_request_id.get(request_id)?.last()?;
        if st.evictors.contains_key(&id) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        st.evictors.insert(id, tx);
        self.apply(
            &mut st,
            now,
            Command::SetEvictable {
                id,
                evictable: true,
            },
        );
        Some(rx)
    }

    /// The eviction stream of `request_id` ended without an eviction: the request can no longer
    /// be aborted, so flow control must not count on evicting it.
    pub fn detach_evictor(&self, request_id: &str) {
        let now = self.now();
        let mut st = self.lock();
        let Some(&id) = st.by_request_id.get(request_id).and_then(|ids| ids.last()) else {
            return;
        };
        if st.evictors.remove(&id).is_some() {
            self.apply(
                &mut st,
                now,
                Command::SetEvictable {
                    id,
                    evictable: false,
                },
            );
        }
    }

    fn forget_running(&self, st: &mut GateState, id: u64) {
        st.evictors.remove(&id);
        if let Some(r) = st.running.remove(&id)
            && let Some(ids) = st.by_request_id.get_mut(&r.request_id)
        {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                st.by_request_id.remove(&r.request_id);
            }
        }
    }

    /// Feed the pool's latest metrics (and the passage of time) to the controller; refresh gauges.
    pub fn observe(&self) {
        let candidates = self.store.candidates(Instant::now());
        let endpoints: Vec<EndpointSnapshot> =
            candidates.iter().map(|c| snapshot(self.epoch, c)).collect();
        let now = self.now();
        let mut st = self.lock();
        self.apply(&mut st, now, Command::ObservePool { endpoints });
        let pool = self.metrics.pool_name().to_string();
        let f = &self.metrics.flow;
        for b in st.fc.band_stats() {
            let l = BandLabels {
                priority: b.priority.to_string(),
                inference_pool: pool.clone(),
            };
            f.queue_size
                .get_or_create(&l)
                .set(i64::try_from(b.queued_requests).unwrap_or(i64::MAX));
            f.queue_bytes
                .get_or_create(&l)
                .set(i64::try_from(b.queued_bytes).unwrap_or(i64::MAX));
            f.inflight
                .get_or_create(&l)
                .set(i64::try_from(b.inflight_requests).unwrap_or(i64::MAX));
        }
        f.saturation
            .get_or_create(&SaturationLabels {
                inference_pool: pool,
                stage: "effective".to_string(),
            })
            .set(st.fc.saturation(now));
    }

    /// Reject everything queued and every later request with `rejected-shutting-down`.
    pub fn shutdown(&self) {
        let now = self.now();
        let mut st = self.lock();
        self.apply(&mut st, now, Command::Shutdown);
    }

    /// Complete in-flight entries older than `max_age` whose response was never observed.
    pub fn sweep(&self, max_age: Duration) -> usize {
        let now = self.now();
        let mut st = self.lock();
        let old: Vec<u64> = st
            .running
            .iter()
            .filter(|(_, r)| r.since.elapsed() > max_age)
            .map(|(id, _)| *id)
            .collect();
        for id in &old {
            self.forget_running(&mut st, *id);
            self.apply(
                &mut st,
                now,
                Command::Complete {
                    id: *id,
                    actual_tokens: None,
                },
            );
        }
        old.len()
    }

    /// (queued, in flight) right now.
    pub fn counts(&self) -> (u64, u64) {
        let t = self.lock().fc.totals();
        (t.queued_requests, t.inflight_requests)
    }

    /// Apply `cmd` and deliver every outcome it produced.
    fn apply(&self, st: &mut GateState, now: Nanos, cmd: Command) {
        let mut out = std::mem::take(&mut st.out);
        out.clear();
        st.fc.apply_into(now, cmd, &mut out);
        let mut orphans = Vec::new();
        for o in out.drain(..) {
            match o {
                Outcome::Dispatched { id } => {
                    let Some(w) = st.waiting.remove(&id) else {
                        continue;
                    };
                    st.by_request_id
                        .entry(w.request_id.clone())
                        .or_default()
                        .push(id);
                    st.running.insert(
                        id,
                        Running {
                            request_id: w.request_id.clone(),
                            since: Instant::now(),
                            priority: w.labels.priority.clone(),
                        },
                    );
                    if !w.resolve(&self.metrics, Verdict::Dispatched(Ticket(id))) {
                        // The stream left between enqueue and now.
                        orphans.push(id);
                    }
                }
                Outcome::Rejected { id, reason } => {
                    if let Some(w) = st.waiting.remove(&id) {
                        w.resolve(&self.metrics, Verdict::Rejected(reason));
                    }
                }
                Outcome::Evicted { id, reason } => {
                    // Only requests with an attached eviction stream are evictable: abort it
                    // there (429 `evicted`). The machine has already freed its slot.
                    let evictor = st.evictors.remove(&id);
                    let priority = st.running.get(&id).map(|r| r.priority.clone());
                    self.forget_running(st, id);
                    if evictor.is_none_or(|tx| tx.send(()).is_err()) {
                        tracing::warn!(id, "evicted a request whose eviction stream is gone");
                    }
                    self.metrics
                        .flow
                        .requests
                        .get_or_create(&OutcomeLabels {
                            outcome: reason.as_str().to_string(),
                            priority: priority.unwrap_or_default(),
                            inference_pool: self.metrics.pool_name().to_string(),
                        })
                        .inc();
                }
                Outcome::Ignored { id, why } => {
                    tracing::debug!(id, ?why, "flow-control command ignored");
                }
            }
        }
        st.out = out;
        for id in orphans {
            self.forget_running(st, id);
            self.apply(st, now, Command::Cancel { id });
        }
    }
}

/// Who cancels a pending request that is dropped before its verdict.
pub(crate) enum PendingOwner {
    Local(Arc<FlowGate>),
    Global(Arc<crate::global_gate::GlobalGate>),
}

/// A queued request's claim on its verdict.
pub struct Pending {
    pub(crate) owner: Option<PendingOwner>,
    pub(crate) id: u64,
    pub(crate) rx: Option<oneshot::Receiver<Verdict>>,
}

impl Pending {
    /// A verdict known at once (nothing to cancel).
    pub(crate) fn ready(v: Verdict) -> Pending {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(v);
        Pending {
            owner: None,
            id: 0,
            rx: Some(rx),
        }
    }

    /// Wait for dispatch or rejection.
    pub async fn wait(mut self) -> Verdict {
        let Some(rx) = self.rx.as_mut() else {
            return Verdict::Rejected(DropReason::RejectedShuttingDown);
        };
        let v = rx
            .await
            .unwrap_or(Verdict::Rejected(DropReason::RejectedShuttingDown));
        // Resolved: dropping `self` must not cancel.
        self.rx = None;
        v
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.rx.is_some() {
            match &self.owner {
                Some(PendingOwner::Local(g)) => g.cancel(self.id),
                Some(PendingOwner::Global(g)) => g.cancel(self.id),
                None => {}
            }
        }
    }
}

/// What a replica admits with: llm-d's legacy controller, flow control on this replica, or
/// cluster-wide flow control.
#[derive(Debug)]
pub enum Admission {
    Legacy(LegacyAdmission),
    Flow(Arc<FlowGate>),
    Global(Arc<crate::global_gate::GlobalGate>),
}

impl Admission {
    /// Whether flow control may evict in-flight sheddable requests (`enableEviction`).
    pub fn evicts(&self) -> bool {
        match self {
            Admission::Flow(g) => g.evicts,
            _ => false,
        }
    }

    /// See [`FlowGate::attach_evictor`].
    pub fn attach_evictor(&self, request_id: &str) -> Option<oneshot::Receiver<()>> {
        match self {
            Admission::Flow(g) => g.attach_evictor(request_id),
            _ => None,
        }
    }

    /// See [`FlowGate::detach_evictor`].
    pub fn detach_evictor(&self, request_id: &str) {
        if let Admission::Flow(g) = self {
            g.detach_evictor(request_id);
        }
    }

    /// Ask flow control (either scope) for admission; `None` for the legacy controller.
    pub async fn enqueue(&self, req: AdmitRequest<'_>) -> Option<Pending> {
        match self {
            Admission::Legacy(_) => None,
            Admission::Flow(g) => Some(g.enqueue(req)),
            Admission::Global(g) => Some(g.admit(req).await),
        }
    }

    /// An admitted request will never reach a model server: give its slot back.
    pub fn release(&self, ticket: Ticket) {
        match self {
            Admission::Legacy(_) => {}
            Admission::Flow(g) => g.release(ticket),
            Admission::Global(g) => g.release(ticket),
        }
    }

    /// The pod an admitted request was routed to (the cluster ledger's per-pod load).
    pub fn routed(&self, ticket: Ticket, pod: &str) {
        if let Admission::Global(g) = self {
            g.routed(ticket, pod);
        }
    }

    /// The response of `request_id` ended (observed here, whichever replica admitted it).
    pub fn complete(&self, request_id: &str, actual_tokens: Option<u64>) {
        match self {
            Admission::Legacy(_) => {}
            Admission::Flow(g) => g.complete(request_id, actual_tokens),
            Admission::Global(g) => g.complete(request_id, actual_tokens),
        }
    }
}

/// Resolve the configured saturation detector (`flowControl.saturationDetector`, or the deprecated
/// top-level `saturationDetector`; default `utilization-detector`) for the legacy controller.
pub fn legacy_detector(
    cfg: &crate::config::EndpointPickerConfig,
) -> Result<SaturationDetector, ConfigError> {
    let reference = cfg
        .flow_control
        .as_ref()
        .and_then(|fc| fc.get("saturationDetector"))
        .or(cfg.saturation_detector.as_ref());
    let Some(r) = reference else {
        return Ok(SaturationDetector::default());
    };
    let spec: crate::config::PluginRefSpec = decode_at(r, "flowControl.saturationDetector")?;
    let decls = plugin_decls(cfg);
    let (ty, params, path) = match decls
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == spec.plugin_ref)
    {
        Some((i, p)) => (
            p.type_name,
            p.parameters,
            format!("plugins[{i}].parameters"),
        ),
        None => (
            spec.plugin_ref.as_str(),
            None,
            "flowControl.saturationDetector".to_string(),
        ),
    };
    Ok(SaturationDetector::from_plugin(ty, params, &path)?)
}

/// The top-level plugins as flowctl sees them.
pub fn plugin_decls(cfg: &crate::config::EndpointPickerConfig) -> Vec<flowctl::PluginDecl<'_>> {
    cfg.plugins
        .iter()
        .map(|p| flowctl::PluginDecl {
            name: p.instance_name(),
            type_name: &p.type_name,
            parameters: p.parameters.as_ref(),
        })
        .collect()
}

/// The flow controller's configuration from the `flowControl` section (absent = all defaults).
pub fn controller_config(
    cfg: &crate::config::EndpointPickerConfig,
) -> Result<ControllerConfig, ConfigError> {
    let empty = serde_json::Value::Object(Default::default());
    let mut section = cfg.flow_control.clone().unwrap_or(empty);
    // The deprecated top-level location; the new field wins.
    if let (Some(obj), Some(old)) = (section.as_object_mut(), &cfg.saturation_detector) {
        obj.entry("saturationDetector").or_insert(old.clone());
    }
    let fc = flowctl::FlowControlConfig::from_value(&section)?;
    Ok(fc.resolve(&plugin_decls(cfg))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn meta_from_headers_with_aliases_and_defaults() {
        let obj = Objectives::new([("premium".to_string(), 10)].into_iter().collect());
        let m = RequestMeta::from_headers(&headers(&[]), &obj);
        assert_eq!(m.fairness_id, "default-flow");
        assert_eq!((m.priority, m.slo_ttft_ms), (0, None));
        let m = RequestMeta::from_headers(
            &headers(&[
                ("x-gateway-inference-fairness-id", "team-a"),
                ("x-gateway-inference-objective", "premium"),
                ("x-slo-ttft-ms", "250"),
            ]),
            &obj,
        );
        assert_eq!(m.fairness_id, "team-a");
        assert_eq!(
            (m.objective.as_deref(), m.priority, m.slo_ttft_ms),
            (Some("premium"), 10, Some(250))
        );
        // The current header wins over the alias; unknown objectives are priority 0.
        let m = RequestMeta::from_headers(
            &headers(&[
                ("x-llm-d-inference-fairness-id", "new"),
                ("x-gateway-inference-fairness-id", "old"),
                ("x-llm-d-inference-objective", "nope"),
                ("x-llm-d-slo-ttft-ms", "-3"),
            ]),
            &obj,
        );
        assert_eq!((m.fairness_id.as_str(), m.priority), ("new", 0));
        // agent identity: an agent's session header when no fairness id is given
        let agent = |pairs: &[(&str, &str)]| {
            RequestMeta::from_headers(&headers(pairs), &Objectives::default()).fairness_id
        };
        assert_eq!(agent(&[("x-claude-code-session-id", "cc-1")]), "cc-1");
        assert_eq!(
            agent(&[("session_id", "s"), ("x-session-affinity", "a")]),
            "a",
            "listed order decides"
        );
        assert_eq!(
            agent(&[("x-llm-d-inference-fairness-id", "t"), ("session-id", "s")]),
            "t",
            "an explicit fairness id wins"
        );
        assert_eq!(agent(&[("session-id", "  ")]), "default-flow");
        assert_eq!(m.slo_ttft_ms, None);
    }

    #[test]
    fn objectives_from_manifests() {
        let yaml = "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: premium}\nspec: {priority: 10, poolRef: {name: p}}\n---\napiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: batch}\nspec: {priority: -5}\n";
        let o = Objectives::from_yaml(yaml).unwrap();
        assert_eq!(
            (o.priority("premium"), o.priority("batch"), o.len()),
            (Some(10), Some(-5), 2)
        );
        let bad = "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: x}\nspec: {priorty: 1}\n";
        let e = Objectives::from_yaml(bad).unwrap_err().to_string();
        assert!(e.contains("priorty"), "{e}");
        let dup = format!("{yaml}---\n{}", yaml.split("---\n").next().unwrap());
        let e = Objectives::from_yaml(&dup).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn legacy_controller_sheds_only_sheddable_requests_when_saturated() {
        use crate::plugins::testutil::{cand, metrics};
        let legacy = LegacyAdmission::new(SaturationDetector::default(), None).unwrap();
        let now = Instant::now();
        // Waiting queues 10 and 6 against the default threshold 5: saturation (2 + 1.2)/2 ≥ 1.
        let busy = [
            cand("a", metrics(10.0, 0.0, 0.1), false),
            cand("b", metrics(6.0, 0.0, 0.1), false),
        ];
        assert!(legacy.check(-1, &busy, now));
        assert!(
            !legacy.check(0, &busy, now),
            "non-sheddable requests always pass"
        );
        let idle = [
            cand("a", metrics(1.0, 0.0, 0.1), false),
            cand("b", metrics(0.0, 0.0, 0.1), false),
        ];
        assert!(!legacy.check(-1, &idle, now));
        // No metrics at all counts as saturated (fail closed), as llm-d.
        assert!(legacy.check(-1, &[cand("a", None, false)], now));
        // The concurrency detector needs the in-flight ledger.
        let e = LegacyAdmission::new(
            SaturationDetector::Concurrency(ConcurrencyDetector::default()),
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("inflight-load-producer"), "{e}");
    }

    #[test]
    fn example_objectives_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/objectives.yaml");
        let o = Objectives::from_file(&path).unwrap();
        assert_eq!(
            (
                o.priority("interactive"),
                o.priority("standard"),
                o.priority("batch")
            ),
            (Some(10), Some(0), Some(-10))
        );
    }

    fn gate(cfg: ControllerConfig) -> Arc<FlowGate> {
        let store = Arc::new(Datastore::new(Duration::from_secs(2)));
        Arc::new(FlowGate::new(cfg, store, Arc::new(Metrics::new("pool"))).unwrap())
    }

    fn one_slot() -> ControllerConfig {
        ControllerConfig {
            detector: SaturationDetector::Concurrency(ConcurrencyDetector {
                max_concurrency: 1,
                ..ConcurrencyDetector::default()
            }),
            ..ControllerConfig::default()
        }
    }

    fn meta(priority: i32) -> RequestMeta {
        RequestMeta {
            fairness_id: "f".into(),
            objective: None,
            priority,
            slo_ttft_ms: None,
        }
    }

    fn admit<'a>(id: &'a str, m: &'a RequestMeta) -> AdmitRequest<'a> {
        AdmitRequest {
            request_id: id,
            meta: m,
            bytes: 10,
            tokens: 10,
            model: "m",
            target_model: "m",
        }
    }

    #[tokio::test]
    async fn queued_requests_wait_for_completion_and_cancel_frees_nothing_twice() {
        // One endpoint with one slot (concurrency detector).
        let store = Arc::new(Datastore::new(Duration::from_secs(2)));
        store.replace(vec![Arc::new(crate::datalayer::Endpoint::new(
            "p".into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        ))]);
        let g = Arc::new(FlowGate::new(one_slot(), store, Arc::new(Metrics::new("pool"))).unwrap());
        g.observe();
        let (hi, lo) = (meta(5), meta(0));
        let first = g.enqueue(admit("a", &lo)).wait().await;
        assert!(matches!(first, Verdict::Dispatched(_)));
        let low = g.enqueue(admit("b", &lo));
        let high = g.enqueue(admit("c", &hi));
        let cancelled = g.enqueue(admit("d", &lo));
        assert_eq!(g.counts(), (3, 1));
        drop(cancelled);
        assert_eq!(g.counts(), (2, 1));
        // The slot frees: the higher priority goes first.
        g.complete("a", None);
        assert!(matches!(high.wait().await, Verdict::Dispatched(_)));
        assert_eq!(g.counts(), (1, 1));
        g.complete("c", None);
        let Verdict::Dispatched(t) = low.wait().await else {
            panic!("low priority should dispatch once the slot frees")
        };
        // Scheduling failed after dispatch: the slot comes back.
        g.release(t);
        assert_eq!(g.counts(), (0, 0));
        g.complete("c", None); // unknown now: no effect
        g.shutdown();
        assert_eq!(
            g.enqueue(admit("e", &lo)).wait().await,
            Verdict::Rejected(DropReason::RejectedShuttingDown)
        );
    }

    /// Only a request whose eviction stream is attached is evicted; a detached one is not; the
    /// evicted one's receiver fires and its slot goes to the waiting higher priority.
    #[tokio::test]
    async fn only_attached_sheddable_requests_are_evicted() {
        let store = Arc::new(Datastore::new(Duration::from_secs(2)));
        store.replace(vec![Arc::new(crate::datalayer::Endpoint::new(
            "p".into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        ))]);
        let mut cfg = one_slot();
        cfg.eviction.enabled = true;
        cfg.eviction.grace = 0;
        if let SaturationDetector::Concurrency(d) = &mut cfg.detector {
            d.max_concurrency = 2;
        }
        let g = Arc::new(FlowGate::new(cfg, store, Arc::new(Metrics::new("pool"))).unwrap());
        assert!(g.evicts);
        g.observe();
        let (shed, crit) = (meta(-1), meta(0));
        for id in ["s1", "s2"] {
            assert!(matches!(
                g.enqueue(admit(id, &shed)).wait().await,
                Verdict::Dispatched(_)
            ));
        }
        assert!(g.attach_evictor("unknown").is_none());
        let s1 = g.attach_evictor("s1").unwrap();
        assert!(g.attach_evictor("s1").is_none(), "attached twice");
        let mut s2 = g.attach_evictor("s2").unwrap();
        // s2's stream ends without an eviction: it is no longer a candidate.
        g.detach_evictor("s2");
        assert!(s2.try_recv().is_err());
        let c = g.enqueue(admit("c", &crit));
        assert!(matches!(c.wait().await, Verdict::Dispatched(_)));
        assert_eq!(s1.await, Ok(()), "s1 is the only evictable request");
        assert_eq!(g.counts(), (0, 2));
        // The evicted request's late completion frees nothing twice.
        g.complete("s1", None);
        assert_eq!(g.counts(), (0, 2));
        // Nothing left to evict: the next critical request waits.
        let d = g.enqueue(admit("d", &crit));
        assert_eq!(g.counts(), (1, 2));
        drop(d);
    }

    #[tokio::test]
    async fn empty_pool_rejects_after_the_no_endpoint_ttl() {
        let g = gate(ControllerConfig {
            no_endpoint_request_ttl: 1_000_000,
            ..one_slot()
        });
        let m = meta(0);
        let p = g.enqueue(admit("a", &m));
        tokio::time::sleep(Duration::from_millis(5)).await;
        g.observe();
        assert_eq!(
            p.wait().await,
            Verdict::Rejected(DropReason::RejectedNoEndpoints)
        );
    }
}

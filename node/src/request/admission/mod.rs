//! Admission: whether a parsed request may go on to scheduling now, must wait, or is refused.
//!
//! One [`Gate`] per replica decides, chosen by the configuration:
//! * [`legacy::LegacyAdmission`] — the `flowControl` gate off, llm-d's `LegacyAdmissionController`:
//!   sheddable requests (priority < 0) are refused with 429 while the saturation detector says the
//!   pool is saturated; nothing waits.
//! * [`local::FlowGate`] — the gate on, one replica: the shell around `flowctl`'s pure state
//!   machine. A request is enqueued and its ext_proc stream simply waits for the verdict; dispatch
//!   happens when the detector reports headroom (a periodic pool observation) or a request
//!   completes (the response path, keyed by the EPP's request key, so the observing stream of
//!   the split data plane can settle it). A stream that goes away while queued cancels its entry.
//! * the cluster's gate (`crate::cluster::gate`), implementing the same trait over the
//!   replicated global queue.
//!
//! The data plane holds an `Arc<dyn Gate>`: it asks [`Gate::admit`], awaits a [`Pending`] when
//! told to wait (dropping it cancels), and reports what happens next — routed, released, settled.

pub mod config;
pub mod legacy;
pub mod local;

use std::sync::Arc;
use std::time::Instant;

use flowctl::{DropReason, EndpointSnapshot, Nanos};
use futures::future::BoxFuture;
use tokio::sync::oneshot;

use super::meta::RequestMeta;
use super::reject::Rejection;
use crate::datalayer::store::Candidate;
use crate::metrics::{Metrics, OutcomeLabels, QueueLabels};

pub use config::AdmissionConfig;

/// What admission decided for one request.
#[derive(Debug)]
pub enum Admit {
    /// Go on to scheduling now; the ticket names the flow-control in-flight entry (none under the
    /// legacy controller, which keeps no ledger).
    Now(Option<Ticket>),
    /// Queued: await [`Pending::wait`]; dropping the `Pending` first cancels the request.
    Queued(Pending),
    /// Refused at once.
    Refused(Rejection),
}

/// How a replica admits requests. Implemented by the legacy controller, flow control on this
/// replica and cluster-wide flow control.
pub trait Gate: Send + Sync + std::fmt::Debug {
    /// Ask for admission.
    fn admit<'a>(self: Arc<Self>, req: AdmitRequest<'a>) -> BoxFuture<'a, Admit>;

    /// An admitted request will never reach a model server: give its slot back.
    fn release(&self, _ticket: Ticket) {}

    /// The pod an admitted request was routed to (the cluster ledger's per-pod load).
    fn routed(&self, _ticket: Ticket, _pod: &str) {}

    /// The response of `request_id` ended (observed here, whichever replica admitted it). True
    /// when the gate accounted for it: it held the request, or it settles cluster-wide.
    fn complete(&self, _request_id: &str, _actual_tokens: Option<u64>) -> bool {
        false
    }

    /// A settlement another replica relayed here (`cluster::settle`): the response of a
    /// request this replica admitted ended there. True when the gate held it.
    fn settled_by_peer(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        self.complete(request_id, actual_tokens)
    }

    /// Whether flow control may evict in-flight sheddable requests (`enableEviction`).
    fn evicts(&self) -> bool {
        false
    }

    /// The eviction stream of `request_id` attached; see [`local::FlowGate::attach_evictor`].
    fn attach_evictor(&self, _request_id: &str) -> Option<oneshot::Receiver<()>> {
        None
    }

    /// The eviction stream of `request_id` ended without an eviction.
    fn detach_evictor(&self, _request_id: &str) {}

    /// Why the gate cannot admit normally yet (readiness), or `None` when it can.
    fn not_ready(&self) -> Option<&'static str> {
        None
    }

    /// Reject everything waiting and every later request with `rejected-shutting-down`; returns
    /// how many were waiting.
    fn shutdown(&self) -> u64 {
        0
    }

    /// `/debug/flow`: the gate's state as JSON, `None` when it has no queue to show.
    fn view(&self) -> BoxFuture<'_, Option<serde_json::Value>> {
        Box::pin(async { None })
    }
}

/// The verdict for a queued request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go ahead; the ticket names the in-flight entry.
    Dispatched(Ticket),
    Rejected(DropReason),
}

/// An admitted request's handle in the in-flight ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(pub u64);

/// A request asking for admission.
#[derive(Debug, Clone)]
pub struct AdmitRequest<'a> {
    pub request_id: &'a str,
    pub meta: &'a RequestMeta,
    pub bytes: u64,
    pub tokens: u64,
    pub model: &'a str,
    pub target_model: &'a str,
}

/// A queued request's stream, waiting for its verdict (the queue metrics ride along).
pub struct Waiter {
    tx: oneshot::Sender<Verdict>,
    pub request_id: String,
    enqueued: Instant,
    labels: QueueLabels,
}

impl Waiter {
    pub fn new(tx: oneshot::Sender<Verdict>, req: &AdmitRequest<'_>, metrics: &Metrics) -> Waiter {
        Waiter {
            tx,
            request_id: req.request_id.to_string(),
            enqueued: Instant::now(),
            labels: metrics.queue_labels(
                req.model,
                req.target_model,
                &req.meta.fairness_id,
                req.meta.priority,
            ),
        }
    }

    /// The request's priority label.
    pub fn priority(&self) -> &str {
        &self.labels.priority
    }

    /// Record the outcome (queue duration, requests by outcome) and deliver the verdict.
    pub fn resolve(self, metrics: &Metrics, verdict: Verdict) -> bool {
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

/// Who cancels a pending request that is dropped before its verdict.
pub trait Cancel: Send + Sync {
    fn cancel(&self, id: u64);
}

/// A queued request's claim on its verdict.
pub struct Pending {
    owner: Option<Arc<dyn Cancel>>,
    id: u64,
    rx: Option<oneshot::Receiver<Verdict>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("id", &self.id).finish()
    }
}

impl Pending {
    /// A queued request `id` of `owner`, whose verdict arrives on `rx`.
    pub fn queued(owner: Arc<dyn Cancel>, id: u64, rx: oneshot::Receiver<Verdict>) -> Pending {
        Pending {
            owner: Some(owner),
            id,
            rx: Some(rx),
        }
    }

    /// A verdict known at once (nothing to cancel).
    pub fn ready(v: Verdict) -> Pending {
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
        if self.rx.is_some()
            && let Some(owner) = &self.owner
        {
            owner.cancel(self.id);
        }
    }
}

// ----- the detectors' view of the pool -----

pub(crate) fn nanos_since(epoch: Instant, t: Instant) -> Nanos {
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// The detector's view of one endpoint, sample times relative to `epoch`.
pub(crate) fn snapshot(epoch: Instant, c: &Candidate) -> EndpointSnapshot {
    snapshot_with(c, |t| nanos_since(epoch, t))
}

/// The detector's view of one endpoint; `clock` turns the sample's instant into state time.
pub fn snapshot_with(c: &Candidate, clock: impl Fn(Instant) -> Nanos) -> EndpointSnapshot {
    match &c.sample {
        Some(s) => EndpointSnapshot {
            waiting_queue: s.metrics.waiting_queue_size.unwrap_or(0.0).max(0.0) as u64,
            kv_cache_usage: s.metrics.kv_cache_usage.unwrap_or(0.0),
            // Never 0 for a real sample: 0 would read as "just taken" at the epoch.
            sampled_at: Some(clock(s.scraped_at).max(1)),
            batch_capacity: c.endpoint.batch_capacity(),
        },
        None => EndpointSnapshot::default(),
    }
}

/// Checks the concurrency detector's `maxConcurrency` against what the pods show they run at once:
/// a limit above a pod's batch lets requests queue inside the pod, where priorities no longer
/// apply. The detector already counts the pod's own limit; this says so once per pod (a warning)
/// and keeps the count in `llm_d_epp_flow_control_pods_below_max_concurrency`.
#[derive(Debug, Default)]
pub struct CapacityCheck {
    warned: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl CapacityCheck {
    pub fn check(
        &self,
        detector: &flowctl::SaturationDetector,
        candidates: &[Candidate],
        metrics: &Metrics,
    ) {
        let flowctl::SaturationDetector::Concurrency(d) = detector else {
            return;
        };
        let mut below = 0i64;
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        for c in candidates {
            let Some(cap) = c.endpoint.batch_capacity() else {
                continue;
            };
            if cap >= d.max_concurrency {
                continue;
            }
            below += 1;
            if warned.len() < 4096 && warned.insert(c.endpoint.hostport.clone()) {
                tracing::warn!(
                    pod = %c.endpoint.hostport,
                    batch = cap,
                    max_concurrency = d.max_concurrency,
                    "flow control: this pod runs at most {cap} requests at once, below the \
                     concurrency detector's maxConcurrency; the detector counts {cap} for it \
                     (set maxConcurrency to what the pods batch)"
                );
            }
        }
        metrics.flow.pods_below_max_concurrency.set(below);
    }
}

//! Flow control on one replica: [`FlowGate`], the shell around `flowctl`'s pure state machine.
//!
//! A request is enqueued and its ext_proc stream waits for the verdict; dispatch happens when the
//! detector reports headroom (a periodic pool observation, [`FlowGate::run`]) or a request
//! completes (the response path, keyed by the EPP's request key, so the observing stream of the
//! split data plane can settle it). A stream that goes away while queued cancels its entry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowctl::{
    Command, ControllerConfig, EndpointSnapshot, EnqueueRequest, FlowController, FlowKey, Nanos,
    Outcome,
};
use futures::future::BoxFuture;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{
    Admit, AdmitRequest, Cancel, CapacityCheck, Gate, Pending, Ticket, Verdict, Waiter,
    nanos_since, snapshot,
};
use crate::config::ConfigError;
use crate::datalayer::Datastore;
use crate::metrics::{BandLabels, Metrics, OutcomeLabels, SaturationLabels};

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
    /// Request key → in-flight ids (keys are unique; a duplicate completes the oldest first).
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
    detector: flowctl::SaturationDetector,
    capacity: CapacityCheck,
    /// Signalled when the machine asks for a timer ([`FlowController::next_wake`]: a burst's
    /// settling ends), so the dispatcher's clock wakes then instead of at its next observation.
    wake: tokio::sync::Notify,
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
            detector: config.detector.clone(),
            capacity: CapacityCheck::default(),
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
            wake: tokio::sync::Notify::new(),
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
        Pending::queued(self.clone(), id, rx)
    }

    /// The response of `request_id` ended: free its slot. False if this replica did not hold it.
    pub fn complete(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        let now = self.now();
        let mut st = self.lock();
        let id = match st.by_request_id.get_mut(request_id) {
            Some(ids) if !ids.is_empty() => ids.remove(0),
            _ => return false,
        };
        self.forget_running(&mut st, id);
        self.apply(&mut st, now, Command::Complete { id, actual_tokens });
        true
    }

    /// A dispatched request that will never reach a model server (e.g. scheduling failed).
    pub fn release(&self, ticket: Ticket) {
        self.cancel(ticket.0);
    }

    fn cancel(&self, id: u64) {
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
        self.capacity
            .check(&self.detector, &candidates, &self.metrics);
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

    /// The dispatcher's clock until `stop`: pool observations (detector input, TTL expiry, gauges)
    /// every [`OBSERVE_INTERVAL`], a `Tick` when the machine asked for one (the end of a burst's
    /// settling), and every 30 s the sweep of admissions whose response was never observed (an
    /// hour old).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(OBSERVE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            let wake_at = self.lock().fc.next_wake().map(|at| {
                let due = self.epoch + Duration::from_nanos(at);
                tokio::time::Instant::from_std(due)
            });
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep_until(wake_at.unwrap_or_else(tokio::time::Instant::now)),
                    if wake_at.is_some() => {
                    let now = self.now();
                    let mut st = self.lock();
                    self.apply(&mut st, now, Command::Tick);
                }
                _ = tick.tick() => {
                    self.observe();
                    if last_sweep.elapsed() >= Duration::from_secs(30) {
                        last_sweep = tokio::time::Instant::now();
                        let n = self.sweep(Duration::from_secs(3600));
                        if n > 0 {
                            tracing::warn!(expired = n, "flow-control admissions expired without a response");
                        }
                    }
                }
            }
        }
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
        if st.fc.next_wake().is_some() {
            self.wake.notify_one();
        }
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
                            priority: w.priority().to_string(),
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

impl Cancel for FlowGate {
    fn cancel(&self, id: u64) {
        FlowGate::cancel(self, id);
    }
}

impl Gate for FlowGate {
    fn admit<'a>(self: Arc<Self>, req: AdmitRequest<'a>) -> BoxFuture<'a, Admit> {
        Box::pin(std::future::ready(Admit::Queued(self.enqueue(req))))
    }

    fn release(&self, ticket: Ticket) {
        FlowGate::release(self, ticket);
    }

    fn complete(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        FlowGate::complete(self, request_id, actual_tokens)
    }

    fn evicts(&self) -> bool {
        self.evicts
    }

    fn attach_evictor(&self, request_id: &str) -> Option<oneshot::Receiver<()>> {
        FlowGate::attach_evictor(self, request_id)
    }

    fn detach_evictor(&self, request_id: &str) {
        FlowGate::detach_evictor(self, request_id);
    }

    fn shutdown(&self) -> u64 {
        let queued = self.counts().0;
        FlowGate::shutdown(self);
        queued
    }

    fn view(&self) -> BoxFuture<'_, Option<serde_json::Value>> {
        let (queued, inflight) = self.counts();
        Box::pin(std::future::ready(Some(serde_json::json!({
            "scope": "replica",
            "queued": queued,
            "inflight": inflight,
        }))))
    }
}

#[cfg(test)]
mod tests {
    use flowctl::{ConcurrencyDetector, DropReason, SaturationDetector};

    use super::*;
    use crate::request::meta::RequestMeta;

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

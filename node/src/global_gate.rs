//! Cluster-wide flow control on one replica: the shell around [`flowctl::global`].
//!
//! The replicated state (inside [`crate::cluster::Replicated`]) holds one global queue and
//! in-flight ledger for every replica. This gate turns a request into one of three paths:
//!
//! * **Fast path** — the applied state says the request would be dispatched at once and this
//!   replica's unreported local admissions are below its credit: admit now, report later
//!   ([`FlowCmd::Admitted`], batched). No consensus round trip (invariant I7).
//! * **Slow path** — otherwise propose [`FlowCmd::Enqueue`] and hold the stream until the applied
//!   state carries the verdict for this replica's key (the leader-independent, deterministic
//!   dispatch of the global queue).
//! * **Degraded** — the replica cannot commit (no quorum, or the applied state stopped moving for a
//!   lease): `local-share` admits while fewer than its last credit (at least one) of its own
//!   degraded admissions run *and* the others still hold its lease (so nobody has re-granted that
//!   credit); beyond that a request waits like a queued one (its enqueue is retried) for at most
//!   `--flow-degraded-wait` (3 s: an election ends well within it), then gets 429
//!   `rejected-saturated`.
//!   `fail-closed` answers 429 at once. Admission is never unbounded.
//!
//! Everything this replica says (admissions, enqueues, cancels, routed pods, settlements of
//! responses it observed — for any replica's request) goes through one outbox, proposed as one
//! log entry per batch by a single writer (a failed proposal is retried; the state ignores
//! sequence numbers it has already seen). A watcher follows the applied index: it delivers
//! verdicts, forgets reported admissions, tracks credit and degradation, and — on the leader —
//! proposes the pool's metrics and the flow configuration.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flowctl::cluster::{ClusterCommand, ClusterOutput};
use flowctl::global::{Ask, FlowCmd, GlobalParams, Verdict as GVerdict};
use flowctl::{ControllerConfig, DropReason, FlowKey, Nanos};
use serde::Serialize;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

use crate::admission::{
    AdmitRequest, Pending, PendingOwner, Ticket, Verdict, Waiter, snapshot_with,
};
use crate::cluster::ClusterMember;
use crate::config::ConfigError;
use crate::datalayer::Datastore;
use crate::metrics::{BandLabels, Metrics, SaturationLabels};
use crate::plugins::InflightLoad;
use crate::plugins::inflight::InflightTracker;

/// What a replica cut off from the quorum does with new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionMode {
    /// Admit while fewer than its last credit (≥ 1) of its own degraded admissions run.
    LocalShare,
    /// 429 `rejected-saturated` for every new request.
    FailClosed,
}

impl std::str::FromStr for PartitionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local-share" => Ok(PartitionMode::LocalShare),
            "fail-closed" => Ok(PartitionMode::FailClosed),
            other => Err(format!(
                "expected local-share or fail-closed, got `{other}`"
            )),
        }
    }
}

/// Settings of cluster-wide flow control.
#[derive(Debug, Clone)]
pub struct GlobalGateOptions {
    pub params: GlobalParams,
    pub partition: PartitionMode,
    /// Linger before proposing a batch of reports only (enqueues go at once).
    pub report_linger: Duration,
    /// How often the leader proposes the pool's metrics.
    pub pool_interval: Duration,
    /// Without quorum, how long a request beyond the local share waits for the cluster to
    /// recover (an election) before 429.
    pub degraded_wait: Duration,
}

impl Default for GlobalGateOptions {
    fn default() -> Self {
        GlobalGateOptions {
            params: GlobalParams::default(),
            partition: PartitionMode::LocalShare,
            report_linger: Duration::from_millis(2),
            pool_interval: Duration::from_millis(100),
            degraded_wait: Duration::from_secs(3),
        }
    }
}

/// Most commands kept while proposals fail (then the oldest are dropped and counted).
const OUTBOX_LIMIT: usize = 100_000;

/// An admission whose response was never observed anywhere is released after this long.
const ADMITTED_MAX_AGE: Duration = Duration::from_secs(3600);

struct GWaiter {
    waiter: Waiter,
    /// Local backstop: reject if no verdict arrives by then (TTL + two leases).
    deadline: Option<Instant>,
    /// Arrived while the replica could not commit: rejected (`rejected-saturated`) at this
    /// instant if it still cannot.
    degraded_deadline: Option<Instant>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    outbox: Vec<FlowCmd>,
    waiting: HashMap<u64, GWaiter>,
    /// Local admissions not yet in the applied state (sequence numbers, ascending).
    unreported: VecDeque<u64>,
    /// This replica's credit in the applied state.
    credit: u32,
    /// The applied state's answer to "would a request of this priority be dispatched now?" for
    /// every priority seen here, and this replica's last applied sequence number — refreshed by
    /// the watcher on every apply, so the fast path takes no lock on the state machine.
    open_by_priority: HashMap<i32, bool>,
    applied_last_seq: u64,
    /// The applied state has cluster flow control configured.
    configured: bool,
    /// Admitted requests of this replica (fast, slow or degraded) → when; pruned of those the
    /// state no longer holds, and given up after [`ADMITTED_MAX_AGE`] (response never observed).
    admitted: BTreeMap<u64, (Instant, String)>,
    /// Degraded-mode admissions still running here, by `x-request-id`.
    degraded_running: HashMap<String, u32>,
    degraded: bool,
    shutting_down: bool,
    fast: u64,
    slow: u64,
    degraded_admits: u64,
    degraded_rejects: u64,
    dropped_cmds: u64,
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The cluster-wide flow gate of one replica. See the module docs.
pub struct GlobalGate {
    node_id: u64,
    config: ControllerConfig,
    opts: GlobalGateOptions,
    metrics: Arc<Metrics>,
    store: Arc<Datastore>,
    /// The scorers' in-flight ledger: fed the other replicas' load, and told when this replica's
    /// requests were settled elsewhere.
    tracker: Option<Arc<InflightTracker>>,
    member: OnceLock<Arc<ClusterMember>>,
    state: Mutex<State>,
    wake: Notify,
}

impl std::fmt::Debug for GlobalGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalGate")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl GlobalGate {
    pub fn new(
        node_id: u64,
        config: ControllerConfig,
        opts: GlobalGateOptions,
        store: Arc<Datastore>,
        metrics: Arc<Metrics>,
        tracker: Option<Arc<InflightTracker>>,
    ) -> Result<GlobalGate, ConfigError> {
        if config.eviction.enabled {
            return Err(ConfigError::invalid(
                "flowControl.enableEviction is supported with `--flow-control-scope replica` (or \
                 a single replica), not yet with cluster-wide flow control",
            ));
        }
        config.validate()?;
        Ok(GlobalGate {
            node_id,
            config,
            opts,
            metrics,
            store,
            tracker,
            member: OnceLock::new(),
            state: Mutex::new(State {
                next_seq: 1,
                ..State::default()
            }),
            wake: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn push(&self, st: &mut State, cmd: FlowCmd) {
        if st.outbox.len() >= OUTBOX_LIMIT {
            st.outbox.remove(0);
            st.dropped_cmds += 1;
        }
        st.outbox.push(cmd);
    }

    /// Admission for one request (fast path, slow path or degraded; see the module docs).
    pub async fn admit(self: &Arc<Self>, req: AdmitRequest<'_>) -> Pending {
        let t0 = Instant::now();
        let priority = req.meta.priority;
        let me = self.node_id;
        // The replicated view: may this replica admit on credit, and what has it reported?
        let cached = {
            let st = self.lock();
            st.configured
                .then(|| st.open_by_priority.get(&priority).copied())
                .flatten()
                .map(|open| (open, st.applied_last_seq))
        };
        let view = match (cached, self.member.get()) {
            (Some(v), _) => Some(v),
            // A priority not seen before: ask the state once (the watcher keeps it fresh after).
            (None, Some(m)) => {
                let v = m
                    .node
                    .local_read(|s| {
                        s.0.flow().map(|f| {
                            let mf = f.member(me);
                            (f.fast_path_open(me, priority), mf.map_or(0, |m| m.last_seq))
                        })
                    })
                    .await
                    .0;
                if let Some((open, _)) = v {
                    self.lock().open_by_priority.insert(priority, open);
                }
                v
            }
            (None, None) => None,
        };
        let ask = Ask {
            flow: FlowKey::new(req.meta.fairness_id.clone(), priority),
            bytes: req.bytes,
            tokens: req.tokens,
            ttl: None,
            slo_ttft: req.meta.slo_ttft_ms.map(|ms| ms.saturating_mul(1_000_000)),
        };
        let mut st = self.lock();
        if st.shutting_down {
            return Pending::ready(Verdict::Rejected(DropReason::RejectedShuttingDown));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let degraded = st.degraded || view.is_none();
        if degraded && let Some(p) = self.admit_degraded(&mut st, seq, req.request_id, &ask) {
            return p;
        }
        let (open, last_seq) = view.unwrap_or_default();
        while st.unreported.front().is_some_and(|s| *s <= last_seq) {
            st.unreported.pop_front();
        }
        if !degraded && open && st.unreported.len() < st.credit as usize {
            st.unreported.push_back(seq);
            st.admitted
                .insert(seq, (Instant::now(), req.request_id.to_string()));
            st.fast += 1;
            self.metrics.cluster.flow_admission("fast");
            self.push(
                &mut st,
                FlowCmd::Admitted {
                    seq,
                    request_id: req.request_id.to_string(),
                    ask,
                    pod: None,
                },
            );
            drop(st);
            self.wake.notify_one();
            self.metrics.cluster.fast_admit(t0.elapsed());
            return Pending::ready(Verdict::Dispatched(Ticket(seq)));
        }
        st.slow += 1;
        self.metrics.cluster.flow_admission("slow");
        let (tx, rx) = oneshot::channel();
        let ttl: Nanos = self.config.default_request_ttl;
        let deadline = (ttl > 0).then(|| {
            Instant::now()
                + Duration::from_nanos(ttl)
                + 2 * Duration::from_millis(self.opts.params.lease_ms)
        });
        // Without quorum it waits (the enqueue is retried until it commits), but not for long.
        let degraded_deadline = degraded.then(|| Instant::now() + self.opts.degraded_wait);
        st.waiting.insert(
            seq,
            GWaiter {
                waiter: Waiter::new(tx, &req, &self.metrics),
                deadline,
                degraded_deadline,
            },
        );
        self.push(
            &mut st,
            FlowCmd::Enqueue {
                seq,
                request_id: req.request_id.to_string(),
                ask,
            },
        );
        drop(st);
        self.wake.notify_one();
        Pending {
            owner: Some(PendingOwner::Global(self.clone())),
            id: seq,
            rx: Some(rx),
        }
    }

    /// Admission without quorum: `Some` = decided here (admitted on the local share, or 429 when
    /// failing closed); `None` = wait like a queued request, for at most `degraded_wait`.
    fn admit_degraded(
        &self,
        st: &mut State,
        seq: u64,
        request_id: &str,
        ask: &Ask,
    ) -> Option<Pending> {
        if self.opts.partition == PartitionMode::FailClosed {
            st.degraded_rejects += 1;
            self.metrics.cluster.flow_admission("degraded-reject");
            return Some(Pending::ready(Verdict::Rejected(
                DropReason::RejectedSaturated,
            )));
        }
        // The local share is this replica's credit, usable only while the others still hold its
        // lease (so they cannot have re-granted that credit).
        let share = st.credit.max(1) as usize;
        let running: u32 = st.degraded_running.values().sum();
        let leased = self.member.get().is_some_and(|m| m.lease_valid());
        if !leased || running as usize >= share {
            return None;
        }
        st.degraded_admits += 1;
        self.metrics.cluster.flow_admission("degraded-admit");
        *st.degraded_running
            .entry(request_id.to_string())
            .or_default() += 1;
        // Reported once the replica can commit again, so the ledger learns of it.
        st.unreported.push_back(seq);
        st.admitted
            .insert(seq, (Instant::now(), request_id.to_string()));
        self.push(
            st,
            FlowCmd::Admitted {
                seq,
                request_id: request_id.to_string(),
                ask: ask.clone(),
                pod: None,
            },
        );
        Some(Pending::ready(Verdict::Dispatched(Ticket(seq))))
    }

    /// A pending request was dropped (client gone) or an admitted one goes nowhere.
    pub(crate) fn cancel(&self, seq: u64) {
        let mut st = self.lock();
        if let Some(w) = st.waiting.remove(&seq) {
            w.waiter.resolve(
                &self.metrics,
                Verdict::Rejected(DropReason::RejectedContextCancelled),
            );
        }
        self.push(&mut st, FlowCmd::Cancel { seq });
        drop(st);
        self.wake.notify_one();
    }

    pub fn release(&self, ticket: Ticket) {
        self.cancel(ticket.0);
    }

    /// The pod `ticket` was routed to: folded into its unsent admission report when possible.
    pub fn routed(&self, ticket: Ticket, pod: &str) {
        let mut st = self.lock();
        let seq = ticket.0;
        let unsent = st.outbox.iter_mut().rev().find_map(|c| match c {
            FlowCmd::Admitted { seq: s, pod, .. } if *s == seq => Some(pod),
            _ => None,
        });
        match unsent {
            Some(p) => *p = Some(pod.to_string()),
            None => self.push(
                &mut st,
                FlowCmd::Routed {
                    seq,
                    pod: pod.to_string(),
                },
            ),
        }
    }

    /// The response of `request_id` ended here (whichever replica admitted it).
    pub fn complete(&self, request_id: &str, actual_tokens: Option<u64>) {
        let mut st = self.lock();
        if let Some(n) = st.degraded_running.get_mut(request_id) {
            *n -= 1;
            if *n == 0 {
                st.degraded_running.remove(request_id);
            }
        }
        self.push(
            &mut st,
            FlowCmd::Settle {
                request_id: request_id.to_string(),
                actual_tokens,
            },
        );
        drop(st);
        self.wake.notify_one();
    }

    /// Reject everything waiting here and every later request with `rejected-shutting-down`.
    pub fn shutdown(&self) {
        let mut st = self.lock();
        st.shutting_down = true;
        let waiting: Vec<(u64, GWaiter)> = st.waiting.drain().collect();
        for (seq, w) in waiting {
            w.waiter.resolve(
                &self.metrics,
                Verdict::Rejected(DropReason::RejectedShuttingDown),
            );
            self.push(&mut st, FlowCmd::Cancel { seq });
        }
        drop(st);
        self.wake.notify_one();
    }

    /// Whether this replica can admit normally: the replicated configuration is applied and it
    /// can commit. (`epp serve` reports NOT_SERVING to Envoy until the first time.)
    pub fn is_ready(&self) -> bool {
        let st = self.lock();
        st.configured && !st.degraded
    }

    /// Requests waiting here for a verdict.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Start the writer and the watcher (cluster mode, once the consensus node runs).
    pub async fn run(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let _ = self.member.set(member.clone());
        let writer = tokio::spawn(self.clone().writer(member.clone(), stop.clone()));
        self.watcher(member, stop).await;
        let _ = writer.await;
    }

    /// Propose the outbox, one batch (one log entry) at a time.
    async fn writer(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let lease = Duration::from_millis(self.opts.params.lease_ms);
        let incarnation = member.incarnation();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            let urgent = {
                let st = self.lock();
                if st.outbox.is_empty() {
                    continue;
                }
                st.outbox
                    .iter()
                    .any(|c| matches!(c, FlowCmd::Enqueue { .. } | FlowCmd::Cancel { .. }))
            };
            if !urgent {
                tokio::time::sleep(self.opts.report_linger).await;
            }
            let cmds = std::mem::take(&mut self.lock().outbox);
            let t0 = Instant::now();
            let res = tokio::time::timeout(
                lease,
                member.node.propose(ClusterCommand::Flow {
                    node: self.node_id,
                    incarnation,
                    now_us: wall_us(),
                    cmds: cmds.clone(),
                }),
            )
            .await;
            match res {
                Ok(Ok(out)) => {
                    self.metrics.cluster.flow_batch(cmds.len(), t0.elapsed());
                    // Enqueues dispatched (or refused) as the batch applied: release them now,
                    // without waiting for this replica to apply the entry.
                    if let ClusterOutput::Flow(res) = out
                        && !res.decided.is_empty()
                    {
                        let mut st = self.lock();
                        self.deliver(&mut st, res.decided);
                    }
                }
                _ => {
                    // Retry (the state ignores what it has already applied), oldest first.
                    {
                        let mut st = self.lock();
                        let newer = std::mem::take(&mut st.outbox);
                        st.outbox = cmds;
                        for c in newer {
                            self.push(&mut st, c);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    self.wake.notify_one();
                }
            }
        }
    }

    /// Follow the applied state: verdicts, credit, degradation, leader duties, gauges.
    async fn watcher(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let me = self.node_id;
        let lease = Duration::from_millis(self.opts.params.lease_ms);
        let mut applied = member.node.watch();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_progress = Instant::now();
        let mut last_config = Instant::now() - Duration::from_secs(1);
        let mut last_gauges = Instant::now();
        // Proposals of its own (configuration, pool metrics) run beside the watcher, which must
        // never wait for a commit while verdicts are due.
        let duties = Arc::new(Notify::new());
        let duty_task = tokio::spawn(self.clone().duties(
            member.clone(),
            duties.clone(),
            stop.clone(),
        ));
        let _abort = AbortOnDrop(duty_task);
        let mut last_prune = Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = applied.changed() => {
                    if r.is_err() {
                        return;
                    }
                    last_progress = Instant::now();
                }
                _ = tick.tick() => {}
            }
            let (keys, priorities): (Vec<u64>, Vec<i32>) = {
                let st = self.lock();
                (
                    st.waiting.keys().copied().collect(),
                    st.open_by_priority.keys().copied().collect(),
                )
            };
            let (view, _) = member
                .node
                .local_read(|s| {
                    let f = s.0.flow()?;
                    let verdicts: Vec<(u64, GVerdict)> = keys
                        .iter()
                        .filter_map(|k| f.verdict((me, *k)).map(|v| (*k, v)))
                        .collect();
                    let open: Vec<(i32, bool)> = priorities
                        .iter()
                        .map(|p| (*p, f.fast_path_open(me, *p)))
                        .collect();
                    let mf = f.member(me);
                    let same_config = f.config() == &self.config && f.params() == self.opts.params;
                    Some((
                        verdicts,
                        open,
                        mf.map_or(0, |m| m.credit),
                        mf.map_or(0, |m| m.last_seq),
                        same_config,
                    ))
                })
                .await;
            let degraded = !member.has_quorum() || last_progress.elapsed() > lease;
            let reconfigure;
            {
                let mut st = self.lock();
                if st.degraded != degraded {
                    tracing::warn!(degraded, "cluster flow control: degraded mode changed");
                    // Whoever waits now waits for the cluster to recover, but not for long.
                    let until = degraded.then(|| Instant::now() + self.opts.degraded_wait);
                    for w in st.waiting.values_mut() {
                        w.degraded_deadline = until;
                    }
                    if !degraded {
                        st.degraded_running.clear();
                    }
                    st.degraded = degraded;
                }
                match view {
                    Some((verdicts, open, credit, last_seq, same_config)) => {
                        st.configured = true;
                        st.credit = credit;
                        st.applied_last_seq = last_seq;
                        st.open_by_priority.extend(open);
                        while st.unreported.front().is_some_and(|s| *s <= last_seq) {
                            st.unreported.pop_front();
                        }
                        self.deliver(&mut st, verdicts);
                        reconfigure = !same_config;
                    }
                    None => {
                        st.configured = false;
                        reconfigure = true;
                    }
                }
                // Backstops: nobody waits past its TTL (plus two leases) for a verdict, nor more
                // than a lease while this replica cannot commit.
                let now = Instant::now();
                let late: Vec<(u64, DropReason)> = st
                    .waiting
                    .iter()
                    .filter_map(|(s, w)| {
                        if w.deadline.is_some_and(|d| d <= now) {
                            Some((*s, DropReason::RejectedTtlExpired))
                        } else if degraded && w.degraded_deadline.is_some_and(|d| d <= now) {
                            Some((*s, DropReason::RejectedSaturated))
                        } else {
                            None
                        }
                    })
                    .collect();
                for (seq, reason) in late {
                    if let Some(w) = st.waiting.remove(&seq) {
                        if reason == DropReason::RejectedSaturated {
                            st.degraded_rejects += 1;
                            self.metrics.cluster.flow_admission("degraded-reject");
                        }
                        w.waiter.resolve(&self.metrics, Verdict::Rejected(reason));
                        self.push(&mut st, FlowCmd::Cancel { seq });
                    }
                }
            }
            if degraded {
                continue;
            }
            if last_prune.elapsed() >= Duration::from_secs(1) {
                last_prune = Instant::now();
                self.prune_admitted(&member).await;
            }
            if reconfigure && last_config.elapsed() >= Duration::from_secs(1) {
                last_config = Instant::now();
                duties.notify_one();
            }
            if last_gauges.elapsed() >= Duration::from_millis(100) {
                last_gauges = Instant::now();
                self.gauges(&member).await;
            }
        }
    }

    /// The configuration proposal (when the watcher asks) and, on the leader, the pool metrics
    /// every `pool_interval`.
    async fn duties(
        self: Arc<Self>,
        member: Arc<ClusterMember>,
        configure: Arc<Notify>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.opts.pool_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warned = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = configure.notified() => {
                    let out = member
                        .node
                        .propose(ClusterCommand::ConfigureFlow {
                            config: Box::new(self.config.clone()),
                            params: self.opts.params,
                        })
                        .await;
                    if matches!(out, Ok(ClusterOutput::Configured(false))) && !warned {
                        warned = true;
                        tracing::warn!(
                            "cluster flow control runs another replica's flowControl \
                             configuration (it is busy); every replica should run the same one"
                        );
                    }
                }
                _ = tick.tick() => {
                    if member.is_leader().await {
                        self.propose_pool(&member).await;
                    }
                }
            }
        }
    }

    /// Hand verdicts to the requests still waiting for them (the writer's batch result and the
    /// watcher may both carry one: the first wins).
    fn deliver(&self, st: &mut State, verdicts: Vec<(u64, GVerdict)>) {
        for (seq, v) in verdicts {
            let Some(w) = st.waiting.remove(&seq) else {
                continue;
            };
            let verdict = match v {
                GVerdict::Dispatched => {
                    let rid = w.waiter.request_id.clone();
                    st.admitted.insert(seq, (Instant::now(), rid));
                    Verdict::Dispatched(Ticket(seq))
                }
                GVerdict::Rejected(r) => Verdict::Rejected(r),
            };
            if !w.waiter.resolve(&self.metrics, verdict) && matches!(v, GVerdict::Dispatched) {
                // The stream left just before its dispatch.
                self.push(st, FlowCmd::Cancel { seq });
            }
        }
    }

    /// Forget admissions the state no longer holds (settled anywhere, reclaimed); release those
    /// whose response nobody observed for [`ADMITTED_MAX_AGE`].
    async fn prune_admitted(&self, member: &ClusterMember) {
        let me = self.node_id;
        let seqs: Vec<u64> = self.lock().admitted.keys().copied().collect();
        let (held, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    seqs.iter()
                        .map(|seq| f.holds((me, *seq)))
                        .collect::<Vec<bool>>()
                })
            })
            .await;
        let Some(held) = held else {
            return;
        };
        let mut st = self.lock();
        let unreported_from = st.unreported.front().copied().unwrap_or(u64::MAX);
        let mut expired = Vec::new();
        for (seq, held) in seqs.into_iter().zip(held) {
            if seq >= unreported_from {
                continue;
            }
            match st.admitted.get(&seq) {
                _ if !held => {
                    // Settled (perhaps observed by another replica) or reclaimed: this replica's
                    // own scoring ledger forgets it too.
                    if let (Some((_, rid)), Some(t)) = (st.admitted.remove(&seq), &self.tracker) {
                        t.finish(&rid);
                    }
                }
                Some((at, _)) if at.elapsed() > ADMITTED_MAX_AGE => {
                    st.admitted.remove(&seq);
                    expired.push(seq);
                }
                _ => {}
            }
        }
        if !expired.is_empty() {
            tracing::warn!(
                expired = expired.len(),
                "cluster flow-control admissions released without an observed response"
            );
        }
        for seq in expired {
            self.push(&mut st, FlowCmd::Cancel { seq });
        }
    }

    /// The leader proposes the pool's endpoint metrics (sample times on the wall clock) and what
    /// each pod with fresh metrics reports running + waiting (the ledger's reconciliation).
    async fn propose_pool(&self, member: &ClusterMember) {
        let now = Instant::now();
        let wall_ns = wall_us().saturating_mul(1000);
        let candidates = self.store.candidates(now);
        let observed = candidates
            .iter()
            .filter_map(|c| {
                let m = c.metrics()?;
                let n = m.running_requests? + m.waiting_queue_size.unwrap_or(0.0);
                Some((c.endpoint.hostport.clone(), n.max(0.0) as u64))
            })
            .collect();
        let endpoints = candidates
            .iter()
            .map(|c| {
                snapshot_with(c, |t| {
                    let age = now.saturating_duration_since(t).as_nanos();
                    wall_ns.saturating_sub(u64::try_from(age).unwrap_or(u64::MAX))
                })
            })
            .collect();
        let _ = tokio::time::timeout(
            Duration::from_millis(self.opts.params.lease_ms),
            member.node.propose(ClusterCommand::ObservePool {
                now_us: wall_us(),
                endpoints,
                observed,
            }),
        )
        .await;
    }

    /// Flow-control gauges from the replicated state (cluster-wide queue and in-flight), and the
    /// other replicas' per-pod load for the scorers.
    async fn gauges(&self, member: &ClusterMember) {
        let now_ns = wall_us().saturating_mul(1000);
        let me = self.node_id;
        let (stats, _) = member
            .node
            .local_read(|s| {
                s.0.flow().map(|f| {
                    let others: HashMap<String, InflightLoad> = f
                        .others_load(me)
                        .into_iter()
                        .map(|(pod, l)| {
                            let load = InflightLoad {
                                requests: l.requests,
                                tokens: l.tokens,
                            };
                            (pod.to_string(), load)
                        })
                        .collect();
                    (
                        f.controller().band_stats(),
                        f.controller().saturation(now_ns),
                        others,
                    )
                })
            })
            .await;
        let Some((bands, saturation, others)) = stats else {
            return;
        };
        if let Some(t) = &self.tracker {
            t.set_remote(others);
        }
        let pool = self.metrics.pool_name().to_string();
        let f = &self.metrics.flow;
        for b in bands {
            let l = BandLabels {
                priority: b.priority.to_string(),
                inference_pool: pool.clone(),
            };
            let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            f.queue_size.get_or_create(&l).set(i(b.queued_requests));
            f.queue_bytes.get_or_create(&l).set(i(b.queued_bytes));
            f.inflight.get_or_create(&l).set(i(b.inflight_requests));
        }
        f.saturation
            .get_or_create(&SaturationLabels {
                inference_pool: pool,
                stage: "effective".to_string(),
            })
            .set(saturation);
        let st = self.lock();
        self.metrics.cluster.flow_local(
            st.credit,
            st.unreported.len(),
            st.waiting.len(),
            st.degraded,
        );
    }

    /// `/debug/flow`: this replica's side and the replicated global state.
    pub async fn view(&self) -> FlowView {
        let local = {
            let st = self.lock();
            LocalView {
                node_id: self.node_id,
                configured: st.configured,
                degraded: st.degraded,
                partition: self.opts.partition,
                credit: st.credit,
                unreported: st.unreported.len(),
                waiting: st.waiting.len(),
                outbox: st.outbox.len(),
                fast_path: st.fast,
                slow_path: st.slow,
                degraded_admits: st.degraded_admits,
                degraded_rejects: st.degraded_rejects,
                dropped_commands: st.dropped_cmds,
            }
        };
        let global = match self.member.get() {
            Some(m) => {
                m.node
                    .local_read(|s| s.0.flow().map(GlobalView::of))
                    .await
                    .0
            }
            None => None,
        };
        FlowView { local, global }
    }
}

#[derive(Debug, Serialize)]
pub struct FlowView {
    pub local: LocalView,
    /// `None` until the first replica's configuration is committed.
    pub global: Option<GlobalView>,
}

#[derive(Debug, Serialize)]
pub struct LocalView {
    pub node_id: u64,
    pub configured: bool,
    pub degraded: bool,
    pub partition: PartitionMode,
    pub credit: u32,
    pub unreported: usize,
    pub waiting: usize,
    pub outbox: usize,
    pub fast_path: u64,
    pub slow_path: u64,
    pub degraded_admits: u64,
    pub degraded_rejects: u64,
    pub dropped_commands: u64,
}

#[derive(Debug, Serialize)]
pub struct GlobalView {
    pub now_us: u64,
    pub params: GlobalParams,
    pub pool_endpoints: u64,
    pub saturation: f64,
    pub totals: flowctl::Totals,
    pub dispatched: u64,
    pub reclaimed: u64,
    /// Entries released because their pod reported fewer requests (settlement lost).
    pub reconciled: u64,
    pub rebalances: u64,
    pub members: BTreeMap<u64, flowctl::global::MemberFlow>,
    pub bands: Vec<flowctl::BandStats>,
    pub flows: Vec<FlowRow>,
    /// Per-pod in-flight load from the ledger.
    pub pods: BTreeMap<String, flowctl::global::PodLoad>,
    /// The oldest ledger entries in flight (at most 100): `[owner, seq, x-request-id, pod]`.
    pub oldest_inflight: Vec<(u64, u64, String, Option<String>)>,
}

#[derive(Debug, Serialize)]
pub struct FlowRow {
    pub fairness_id: String,
    pub priority: i32,
    pub queued: usize,
    pub inflight: u32,
}

impl GlobalView {
    fn of(f: &flowctl::global::GlobalFlow) -> GlobalView {
        GlobalView {
            now_us: f.now_us(),
            params: f.params(),
            pool_endpoints: f.controller().pool_endpoints(),
            saturation: f.controller().saturation(f.now_us().saturating_mul(1000)),
            totals: f.totals(),
            dispatched: f.dispatched(),
            reclaimed: f.reclaimed(),
            reconciled: f.reconciled(),
            rebalances: f.rebalances(),
            members: f.members().clone(),
            bands: f.controller().band_stats(),
            flows: f
                .controller()
                .flow_stats()
                .map(|s| FlowRow {
                    fairness_id: s.fairness_id.to_string(),
                    priority: s.priority,
                    queued: s.queued_requests,
                    inflight: s.inflight_requests,
                })
                .collect(),
            pods: f.pods().clone(),
            oldest_inflight: f
                .inflight_entries()
                .take(100)
                .map(|((m, seq), rid, pod)| (m, seq, rid.to_string(), pod.map(str::to_string)))
                .collect(),
        }
    }
}

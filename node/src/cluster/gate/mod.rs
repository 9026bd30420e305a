//! Cluster-wide flow control on one replica: the shell around [`flowctl::global`].
//!
//! The replicated state (inside [`super::member::Replicated`]) holds one global queue and
//! in-flight ledger for every replica. This gate turns a request into one of these paths:
//!
//! * **Fast path** — the applied state says the request would be dispatched at once and this
//!   replica's unreported local admissions are below its credit: admit now, report later. No
//!   consensus round trip (invariant I7). Such requests are this replica's to count: it holds
//!   them per (flow, pod) and reports the counts that changed ([`FlowCmd::Held`], batched) —
//!   not a command per request. Their responses settle here; one observed on another replica
//!   reaches this one through the settlement relay (the request key names its maker).
//! * **Credit wait** — the fast path is open but the credit is spent on admissions the pending
//!   report counts: hold the stream until that report applies and take the credit it frees (at
//!   most half the credit's worth of requests wait, for at most `credit_wait`; then the queue).
//!   An enqueue instead would be a log entry of its own, committed only after that report.
//! * **Slow path** — otherwise propose [`FlowCmd::Enqueue`] and hold the stream until the applied
//!   state carries the verdict for this replica's key (the leader-independent, deterministic
//!   dispatch of the global queue).
//! * **Degraded** — the replica cannot commit (no quorum, or the applied state stopped moving for a
//!   lease): `local-share` admits while its own degraded admissions still running, plus what it
//!   had admitted unreported when it lost the quorum, are fewer than its last credit *and* the
//!   others still hold its lease (so nobody has re-granted that credit); beyond that a request waits like a queued one (its enqueue is retried) for at most
//!   `--flow-degraded-wait` (3 s: an election ends well within it), then gets 429
//!   `rejected-saturated`.
//!   `fail-closed` answers 429 at once. Admission is never unbounded.
//!
//! Everything else this replica says (enqueues, cancels, routed pods and settlements of requests
//! in the replicated ledger, degraded-mode admissions) goes through one outbox, proposed with the
//! changed counts as one log entry per batch by a single writer (a failed proposal is retried;
//! the state ignores sequence numbers and count versions it has already seen). A watcher
//! follows the applied index: it delivers verdicts, forgets reported admissions, tracks credit
//! and degradation, and — on the leader — proposes the pool's metrics and the flow
//! configuration ([`run`]).
//!
//! Layout: this module admits and takes reports; [`run`] holds the writer, the watcher and the
//! leader's duties; [`view`] is `/debug/flow`.

mod run;
pub mod view;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use flowctl::global::{Ask, FlowCmd, GlobalParams, HeldRow, ServedRow};
use flowctl::{ControllerConfig, DropReason, FlowKey, Nanos};
use futures::future::BoxFuture;
use tokio::sync::{Notify, oneshot};

use super::member::ClusterMember;
use super::options::PartitionMode;
use crate::cluster::settle::Settlement;
use crate::config::ConfigError;
use crate::datalayer::Datastore;
use crate::datalayer::inflight::RemoteLoadFeed;
use crate::dataplane::usage::request_key_owner;
use crate::metrics::Metrics;
use crate::request::admission::{
    Admit, AdmitRequest, Cancel, CapacityCheck, Gate, Pending, Ticket, Verdict, Waiter,
};

/// Settings of cluster-wide flow control.
#[derive(Debug, Clone)]
pub struct GlobalGateOptions {
    pub params: GlobalParams,
    pub partition: PartitionMode,
    /// Linger before proposing a batch of reports only (enqueues and cancels go at once) when
    /// they matter now (see `run::reports_due`).
    pub report_linger: Duration,
    /// Longest linger of the count reports otherwise: below saturation they only keep the
    /// ledger's figures current, and every log entry costs each replica a round of consensus.
    pub report_linger_max: Duration,
    /// Longest wait of a request that found the fast path open but this replica's credit spent
    /// on admissions its pending report counts (then it takes the global queue).
    pub credit_wait: Duration,
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
            report_linger_max: Duration::from_millis(25),
            credit_wait: Duration::from_millis(50),
            pool_interval: Duration::from_millis(100),
            degraded_wait: Duration::from_secs(3),
        }
    }
}

/// Most commands kept while proposals fail (then the oldest are dropped and counted).
const OUTBOX_LIMIT: usize = 100_000;

/// An admission whose response was never observed anywhere is released after this long.
pub(super) const ADMITTED_MAX_AGE: Duration = Duration::from_secs(3600);

struct GWaiter {
    waiter: Waiter,
    /// Local backstop: reject if no verdict arrives by then (TTL + two leases).
    deadline: Option<Instant>,
    /// Arrived while the replica could not commit: rejected (`rejected-saturated`) at this
    /// instant if it still cannot.
    degraded_deadline: Option<Instant>,
}

/// A request admitted here on credit and still running (counted in [`Held`]).
struct Own {
    request_id: String,
    flow: FlowKey,
    pod: Option<String>,
    tokens: u64,
    at: Instant,
}

/// A request that found the fast path open but this replica's credit spent on admissions the
/// applied state has not counted yet: it waits (its stream held, like a queued one) for the report
/// that counts them to apply, then takes the credit that frees — instead of an enqueue, a log
/// entry of its own, that could only commit after that report anyway (one writer). If the fast
/// path closes meanwhile, or the credit does not come within `credit_wait`, it takes the queue.
struct Parked {
    seq: u64,
    request_id: String,
    ask: Ask,
    at: Instant,
}

/// This replica's credit admissions, held in bulk: each running one, their counts per (flow,
/// pod), and what the last report proposed.
#[derive(Default)]
struct Held {
    own: HashMap<u64, Own>,
    by_key: HashMap<String, u64>,
    rows: BTreeMap<(FlowKey, Option<String>), (u64, u64)>,
    /// The counts the last proposed report carried.
    reported: BTreeMap<(FlowKey, Option<String>), (u64, u64)>,
    /// Completions since the last report, per flow: (requests, charged, actual tokens).
    served: BTreeMap<FlowKey, (u64, u64, u64)>,
    /// Credit admissions of this life so far, and as many as the applied state has seen.
    admitted: u64,
    applied_admitted: u64,
    /// As many as this replica's last committed report counted.
    committed_admitted: u64,
    version: u64,
    /// Something changed since the last report.
    dirty: bool,
    /// A report was lost (dropped from a full outbox): the next one carries every row.
    whole: bool,
    /// Pods reporting fewer requests than the ledger holds for them: since when
    /// (`run::reconcile_held`).
    excess: HashMap<String, Instant>,
}

impl Held {
    fn add(&mut self, flow: &FlowKey, pod: &Option<String>, requests: i64, tokens: i64) {
        let key = (flow.clone(), pod.clone());
        let row = self.rows.entry(key.clone()).or_default();
        row.0 = row.0.saturating_add_signed(requests);
        row.1 = row.1.saturating_add_signed(tokens);
        if row.0 == 0 {
            self.rows.remove(&key);
        }
        self.dirty = true;
    }

    fn admit(&mut self, seq: u64, request_id: &str, flow: FlowKey, tokens: u64) {
        self.add(&flow, &None, 1, tokens as i64);
        self.admitted += 1;
        self.by_key.insert(request_id.to_string(), seq);
        self.own.insert(
            seq,
            Own {
                request_id: request_id.to_string(),
                flow,
                pod: None,
                tokens,
                at: Instant::now(),
            },
        );
    }

    fn routed(&mut self, seq: u64, pod: &str) -> bool {
        let Some(o) = self.own.get_mut(&seq) else {
            return false;
        };
        let (flow, old, tokens) = (o.flow.clone(), o.pod.take(), o.tokens as i64);
        o.pod = Some(pod.to_string());
        self.add(&flow, &old, -1, -tokens);
        self.add(&flow, &Some(pod.to_string()), 1, tokens);
        true
    }

    /// The response of one of ours ended (`actual` tokens when known); false if not ours.
    fn complete(&mut self, request_id: &str, actual: Option<u64>) -> bool {
        let Some(seq) = self.by_key.remove(request_id) else {
            return false;
        };
        self.end(seq, actual);
        true
    }

    fn end(&mut self, seq: u64, actual: Option<u64>) -> Option<Own> {
        let o = self.own.remove(&seq)?;
        self.by_key.remove(&o.request_id);
        self.add(&o.flow, &o.pod, -1, -(o.tokens as i64));
        if let Some(actual) = actual {
            let s = self.served.entry(o.flow.clone()).or_default();
            s.0 += 1;
            s.1 += o.tokens;
            s.2 += actual;
        }
        Some(o)
    }

    /// Credit admissions the applied state has not seen yet.
    fn unreported(&self) -> usize {
        usize::try_from(self.admitted.saturating_sub(self.applied_admitted)).unwrap_or(usize::MAX)
    }

    /// Credit admissions no committed report counts yet.
    fn uncommitted(&self) -> usize {
        let seen = self.applied_admitted.max(self.committed_admitted);
        usize::try_from(self.admitted.saturating_sub(seen)).unwrap_or(usize::MAX)
    }

    /// The report of what changed since the last one (`None`: nothing did).
    fn report(&mut self) -> Option<FlowCmd> {
        if !self.dirty && !self.whole {
            return None;
        }
        self.dirty = false;
        let full = std::mem::take(&mut self.whole);
        if full {
            self.reported.clear();
        }
        let mut rows: Vec<HeldRow> = self
            .rows
            .iter()
            .filter(|(k, v)| self.reported.get(*k) != Some(*v))
            .map(|((flow, pod), (n, t))| HeldRow {
                flow: flow.clone(),
                pod: pod.clone(),
                requests: *n,
                tokens: *t,
            })
            .collect();
        rows.extend(
            self.reported
                .keys()
                .filter(|k| !self.rows.contains_key(*k))
                .map(|(flow, pod)| HeldRow {
                    flow: flow.clone(),
                    pod: pod.clone(),
                    requests: 0,
                    tokens: 0,
                }),
        );
        self.reported = self.rows.clone();
        let served = std::mem::take(&mut self.served)
            .into_iter()
            .map(|(flow, (requests, charged, actual))| ServedRow {
                flow,
                requests,
                charged,
                actual,
            })
            .collect();
        self.version += 1;
        Some(FlowCmd::Held {
            version: self.version,
            full,
            admitted: self.admitted,
            rows,
            served,
        })
    }
}

#[derive(Default)]
struct State {
    next_seq: u64,
    /// Commands to propose, oldest first (a deque: past the bound the oldest is dropped in O(1)).
    outbox: VecDeque<FlowCmd>,
    waiting: HashMap<u64, GWaiter>,
    /// Requests waiting for credit (also in `waiting`), oldest first: their sequence numbers are
    /// below any later request's, so every path that proposes a sequence number enqueues them
    /// first (the state ignores a number at or below the last it saw from this replica).
    parked: VecDeque<Parked>,
    /// Admissions reported one by one (degraded mode, or without `bulk`) not yet in the applied
    /// state (sequence numbers, ascending).
    unreported: VecDeque<u64>,
    /// Credit admissions, held in bulk.
    held: Held,
    /// This replica's credit in the applied state, and the applied index it was read at.
    credit: u32,
    credit_index: u64,
    /// The applied state's answer to "would a request of this priority be dispatched now?" for
    /// every priority seen here, and this replica's last applied sequence number — refreshed by
    /// the watcher on every apply, so the fast path takes no lock on the state machine.
    open_by_priority: HashMap<i32, bool>,
    applied_last_seq: u64,
    /// The applied state has cluster flow control configured.
    configured: bool,
    /// Members the applied state counts live (lease held): a settlement of another's key goes
    /// to it only while it is one of them (a dead maker's requests are settled in the ledger).
    live: Vec<u64>,
    /// The applied state counts this replica's lease ended.
    expired: bool,
    /// Every live member applies count reports (`flowctl::cluster::FEATURE_HELD`): credit
    /// admissions are counted in bulk; otherwise (an older build in the cluster, as in a rolling
    /// upgrade) each is reported on its own (`FlowCmd::Admitted`).
    bulk: bool,
    /// Settlements of live members' keys observed here, for the writer to sort: those the
    /// ledger holds are settled in it, the others relayed to their maker.
    foreign: Vec<Settlement>,
    /// Admitted requests of this replica in the replicated ledger (slow path, degraded mode,
    /// or credit admissions without `bulk`) → when;
    /// pruned of those the state no longer holds, and given up after [`ADMITTED_MAX_AGE`]
    /// (response never observed).
    admitted: BTreeMap<u64, (Instant, String)>,
    /// Degraded-mode admissions still running here, by request key.
    degraded_running: HashMap<String, u32>,
    /// Local admissions unreported when degraded mode began (they may still run, and they
    /// spent the same credit).
    degraded_base: usize,
    degraded: bool,
    shutting_down: bool,
    fast: u64,
    slow: u64,
    credit_waits: u64,
    degraded_admits: u64,
    degraded_rejects: u64,
    dropped_cmds: u64,
}

impl State {
    /// Local admissions the applied state has not seen: credit spent unreported.
    fn unreported(&self) -> usize {
        self.unreported.len() + self.held.unreported()
    }

    /// Queue a command for the next proposal; past [`OUTBOX_LIMIT`] the oldest is dropped (a
    /// count report so dropped makes the next one whole).
    fn push(&mut self, cmd: FlowCmd) {
        if self.outbox.len() >= OUTBOX_LIMIT {
            if let Some(FlowCmd::Held { .. }) = self.outbox.pop_front() {
                self.held.whole = true;
            }
            self.dropped_cmds += 1;
        }
        self.outbox.push_back(cmd);
    }
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
    /// Publishes the other replicas' load, and which of this replica's requests were settled
    /// elsewhere, to the in-flight ledger the scorers read.
    load_feed: Option<RemoteLoadFeed>,
    member: OnceLock<Arc<ClusterMember>>,
    /// Where settlements of other replicas' credit admissions go (to the replica that made
    /// the key; see [`run`]).
    relay: OnceLock<tokio::sync::mpsc::Sender<Settlement>>,
    state: Mutex<State>,
    wake: Notify,
    capacity: CapacityCheck,
}

impl std::fmt::Debug for GlobalGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalGate")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// This replica's wall clock (with the test offset). Proposals carry it; the replicated state
/// re-times them by its leaders' stamps, so members' clocks need not agree.
fn wall_us() -> u64 {
    consensus::clock::now_us()
}

impl GlobalGate {
    pub fn new(
        node_id: u64,
        config: ControllerConfig,
        opts: GlobalGateOptions,
        store: Arc<Datastore>,
        metrics: Arc<Metrics>,
        load_feed: Option<RemoteLoadFeed>,
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
            load_feed,
            member: OnceLock::new(),
            relay: OnceLock::new(),
            state: Mutex::new(State {
                next_seq: 1,
                ..State::default()
            }),
            wake: Notify::new(),
            capacity: CapacityCheck::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
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
                            let mf = f.member_as(me, m.incarnation());
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
            // A band's own budget travels with the request (members need not read it from the
            // replicated configuration); the default stays implicit.
            ttl: self.config.band_settings(priority).request_ttl,
            slo_ttft: req.meta.slo_ttft_ms.map(|ms| ms.saturating_mul(1_000_000)),
        };
        let mut st = self.lock();
        if st.shutting_down {
            return Pending::ready(Verdict::Rejected(DropReason::RejectedShuttingDown));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let degraded = st.degraded || view.is_none();
        // Those waiting for credit go first: credit freed meanwhile is theirs (and without
        // quorum they take the queue, before this request's number is proposed).
        if degraded {
            self.enqueue_parked(&mut st, true);
        } else {
            self.unpark(&mut st);
        }
        if degraded && let Some(p) = self.admit_degraded(&mut st, seq, req.request_id, &ask) {
            return p;
        }
        let (open, last_seq) = view.unwrap_or_default();
        while st.unreported.front().is_some_and(|s| *s <= last_seq) {
            st.unreported.pop_front();
        }
        let leased = self.credit_spendable(&mut st);
        let spendable = !degraded && open && leased;
        if spendable && st.parked.is_empty() && st.unreported() < st.credit as usize {
            if st.bulk {
                st.held.admit(seq, req.request_id, ask.flow, ask.tokens);
            } else {
                st.unreported.push_back(seq);
                st.admitted
                    .insert(seq, (Instant::now(), req.request_id.to_string()));
                st.push(FlowCmd::Admitted {
                    seq,
                    request_id: req.request_id.to_string(),
                    ask,
                    pod: None,
                });
            }
            st.fast += 1;
            self.admitted_by("fast");
            drop(st);
            self.wake.notify_one();
            self.metrics.cluster.fast_admit(t0.elapsed());
            return Pending::ready(Verdict::Dispatched(Ticket(seq)));
        }
        // Credit spent on admissions the pending report counts: wait for it — as many as the
        // report is sure to free (it goes once half the credit is spent), beyond that the rate
        // needs more than the credit and the queue serves it sooner.
        if spendable
            && st.bulk
            && st.held.unreported() > 0
            && st.parked.len() < st.credit as usize / 2
        {
            st.credit_waits += 1;
            self.admitted_by("credit-wait");
            let rx = self.hold(&mut st, seq, &req, false);
            st.parked.push_back(Parked {
                seq,
                request_id: req.request_id.to_string(),
                ask,
                at: Instant::now(),
            });
            drop(st);
            self.wake.notify_one();
            return Pending::queued(self.clone(), seq, rx);
        }
        st.slow += 1;
        self.admitted_by("slow");
        let rx = self.hold(&mut st, seq, &req, degraded);
        self.enqueue_parked(&mut st, true);
        st.push(FlowCmd::Enqueue {
            seq,
            request_id: req.request_id.to_string(),
            ask,
        });
        drop(st);
        self.wake.notify_one();
        Pending::queued(self.clone(), seq, rx)
    }

    /// Hold a request's stream until its verdict (`waiting`), with its backstops.
    fn hold(
        &self,
        st: &mut State,
        seq: u64,
        req: &AdmitRequest<'_>,
        degraded: bool,
    ) -> oneshot::Receiver<Verdict> {
        let (tx, rx) = oneshot::channel();
        let ttl: Nanos = self.config.request_ttl(req.meta.priority);
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
                waiter: Waiter::new(tx, req, &self.metrics),
                deadline,
                degraded_deadline,
            },
        );
        rx
    }

    /// Requests waiting for credit, oldest first: admitted on the credit the applied state has
    /// freed; sent to the queue once the fast path closed (or credit waits are off: degraded,
    /// per-request reports, stopping), nothing this replica admitted awaits a report, or they
    /// waited `credit_wait`.
    fn unpark(&self, st: &mut State) {
        while let Some((priority, at)) = st.parked.front().map(|p| (p.ask.flow.priority, p.at)) {
            let usable = st.bulk && !st.degraded && st.configured && !st.shutting_down;
            let open = usable && st.open_by_priority.get(&priority) == Some(&true);
            if open && st.unreported() < st.credit as usize && self.credit_spendable(st) {
                let Some(p) = st.parked.pop_front() else {
                    break;
                };
                let Some(w) = st.waiting.remove(&p.seq) else {
                    continue;
                };
                st.held
                    .admit(p.seq, &p.request_id, p.ask.flow, p.ask.tokens);
                st.fast += 1;
                if !w
                    .waiter
                    .resolve(&self.metrics, Verdict::Dispatched(Ticket(p.seq)))
                {
                    // The stream left meanwhile.
                    st.held.end(p.seq, None);
                }
                continue;
            }
            let worth_waiting = open
                && st.credit > 0
                && st.held.unreported() > 0
                && at.elapsed() < self.opts.credit_wait;
            if worth_waiting {
                break;
            }
            self.enqueue_parked(st, false);
        }
    }

    /// The oldest request waiting for credit (`all`: every one) takes the queue.
    fn enqueue_parked(&self, st: &mut State, all: bool) {
        while let Some(p) = st.parked.pop_front() {
            if st.waiting.contains_key(&p.seq) {
                st.slow += 1;
                st.push(FlowCmd::Enqueue {
                    seq: p.seq,
                    request_id: p.request_id,
                    ask: p.ask,
                });
            }
            if !all {
                break;
            }
        }
    }

    /// Whether this replica may spend its credit now. Only while the cluster still counts it as
    /// live: once its lease may have ended, the leader may have re-granted the credit. Checked at
    /// admission, not only by the watcher's 20 ms tick — a replica resuming from a pause must not
    /// spend its old credit before the watcher sees the state. And only credit read from a state
    /// that already knew the current lease: after a partition the local state can still show the
    /// credit the leader has since re-granted. Otherwise the credit is void until the watcher
    /// reads what the state grants now.
    fn credit_spendable(&self, st: &mut State) -> bool {
        let credit_index = st.credit_index;
        let ok = self
            .member
            .get()
            .and_then(|m| m.lease_index())
            .is_some_and(|i| credit_index >= i);
        if !ok {
            st.credit = 0;
        }
        ok
    }

    /// Count how a request was admitted, and say so on its admission span (when traced).
    fn admitted_by(&self, path: &'static str) {
        self.metrics.cluster.flow_admission(path);
        tracing::Span::current().record("epp.admission.path", path);
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
            self.admitted_by("degraded-reject");
            return Some(Pending::ready(Verdict::Rejected(
                DropReason::RejectedSaturated,
            )));
        }
        // The local share is this replica's credit, usable only while the others still hold its
        // lease (so they cannot have re-granted that credit), and never beyond it: what the
        // others cannot see must fit in the credit they hold back (I1).
        let share = st.credit as usize;
        let running: u32 = st.degraded_running.values().sum();
        // (`degraded_base` counts what was unreported when the quorum went, credit admissions
        // included; those still count as running here.)
        let leased = self.credit_spendable(st);
        if !leased || running as usize + st.degraded_base >= share {
            return None;
        }
        st.degraded_admits += 1;
        self.admitted_by("degraded-admit");
        *st.degraded_running
            .entry(request_id.to_string())
            .or_default() += 1;
        // Reported once the replica can commit again, so the ledger learns of it.
        st.unreported.push_back(seq);
        st.admitted
            .insert(seq, (Instant::now(), request_id.to_string()));
        st.push(FlowCmd::Admitted {
            seq,
            request_id: request_id.to_string(),
            ask: ask.clone(),
            pod: None,
        });
        Some(Pending::ready(Verdict::Dispatched(Ticket(seq))))
    }

    /// A pending request was dropped (client gone) or an admitted one goes nowhere.
    fn cancel(&self, seq: u64) {
        let mut st = self.lock();
        if st.held.end(seq, None).is_some() {
            return;
        }
        // Waiting for credit: nothing proposed yet.
        if let Some(i) = st.parked.iter().position(|p| p.seq == seq) {
            st.parked.remove(i);
            if let Some(w) = st.waiting.remove(&seq) {
                w.waiter.resolve(
                    &self.metrics,
                    Verdict::Rejected(DropReason::RejectedContextCancelled),
                );
            }
            return;
        }
        if let Some(w) = st.waiting.remove(&seq) {
            w.waiter.resolve(
                &self.metrics,
                Verdict::Rejected(DropReason::RejectedContextCancelled),
            );
        }
        st.push(FlowCmd::Cancel { seq });
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
        if st.held.routed(seq, pod) {
            return;
        }
        let unsent = st.outbox.iter_mut().rev().find_map(|c| match c {
            FlowCmd::Admitted { seq: s, pod, .. } if *s == seq => Some(pod),
            _ => None,
        });
        match unsent {
            Some(p) => *p = Some(pod.to_string()),
            None => st.push(FlowCmd::Routed {
                seq,
                pod: pod.to_string(),
            }),
        }
    }

    /// The response of `request_id` ended here (whichever replica admitted it): one of this
    /// replica's credit admissions leaves its counts; another replica's key goes to that
    /// replica (its credit admissions are its own to count); anything else is settled in the
    /// replicated ledger.
    pub fn complete(&self, request_id: &str, actual_tokens: Option<u64>) {
        let mut st = self.lock();
        if st.held.complete(request_id, actual_tokens) {
            return;
        }
        if let Some(owner) = request_key_owner(request_id)
            && owner != self.node_id
            && st.live.contains(&owner)
            && self.relay.get().is_some()
        {
            st.foreign.push((request_id.to_string(), actual_tokens));
            drop(st);
            self.wake.notify_one();
            return;
        }
        self.settle_in_ledger(&mut st, request_id, actual_tokens);
    }

    /// A settlement another replica relayed here (the key names this replica): one of its
    /// credit admissions, or — admitted through the ledger — settled there. False if it names
    /// nothing this replica made.
    pub fn settled_by_peer(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        let mut st = self.lock();
        if st.held.complete(request_id, actual_tokens) {
            return true;
        }
        if request_key_owner(request_id) != Some(self.node_id) {
            return false;
        }
        self.settle_in_ledger(&mut st, request_id, actual_tokens);
        true
    }

    /// Where the settlements of other replicas' keys go (`cluster::settle`).
    pub fn set_relay(&self, relay: tokio::sync::mpsc::Sender<Settlement>) {
        let _ = self.relay.set(relay);
    }

    fn settle_in_ledger(
        &self,
        st: &mut MutexGuard<'_, State>,
        request_id: &str,
        actual_tokens: Option<u64>,
    ) {
        if let Some(n) = st.degraded_running.get_mut(request_id) {
            *n -= 1;
            if *n == 0 {
                st.degraded_running.remove(request_id);
            }
        }
        st.push(FlowCmd::Settle {
            request_id: request_id.to_string(),
            actual_tokens,
        });
        self.wake.notify_one();
    }

    /// Reject everything waiting here and every later request with `rejected-shutting-down`.
    pub fn shutdown(&self) {
        let mut st = self.lock();
        st.shutting_down = true;
        st.parked.clear();
        let waiting: Vec<(u64, GWaiter)> = st.waiting.drain().collect();
        for (seq, w) in waiting {
            w.waiter.resolve(
                &self.metrics,
                Verdict::Rejected(DropReason::RejectedShuttingDown),
            );
            st.push(FlowCmd::Cancel { seq });
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
}

impl Cancel for GlobalGate {
    fn cancel(&self, seq: u64) {
        GlobalGate::cancel(self, seq);
    }
}

impl Gate for GlobalGate {
    fn admit<'a>(self: Arc<Self>, req: AdmitRequest<'a>) -> BoxFuture<'a, Admit> {
        Box::pin(async move { Admit::Queued(GlobalGate::admit(&self, req).await) })
    }

    fn release(&self, ticket: Ticket) {
        GlobalGate::release(self, ticket);
    }

    fn routed(&self, ticket: Ticket, pod: &str) {
        GlobalGate::routed(self, ticket, pod);
    }

    fn complete(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        GlobalGate::complete(self, request_id, actual_tokens);
        true // counted here, relayed to its maker, or settled in the replicated ledger
    }

    fn settled_by_peer(&self, request_id: &str, actual_tokens: Option<u64>) -> bool {
        GlobalGate::settled_by_peer(self, request_id, actual_tokens)
    }

    fn not_ready(&self) -> Option<&'static str> {
        (!self.is_ready())
            .then_some("cluster flow control not ready (no quorum or configuration not applied)")
    }

    fn shutdown(&self) -> u64 {
        let queued = self.waiting() as u64;
        GlobalGate::shutdown(self);
        queued
    }

    fn view(&self) -> BoxFuture<'_, Option<serde_json::Value>> {
        Box::pin(async move { serde_json::to_value(GlobalGate::view(self).await).ok() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report's rows as (fairness id, pod, requests).
    type Rows = Vec<(String, Option<String>, u64)>;

    /// A count report as (full, admitted, rows, corrections).
    fn rows(cmd: Option<FlowCmd>) -> (bool, u64, Rows, usize) {
        match cmd {
            Some(FlowCmd::Held {
                full,
                admitted,
                rows,
                served,
                ..
            }) => (
                full,
                admitted,
                rows.into_iter()
                    .map(|r| (r.flow.fairness_id, r.pod, r.requests))
                    .collect(),
                served.len(),
            ),
            other => panic!("not a count report: {other:?}"),
        }
    }

    #[test]
    fn count_reports_carry_what_changed_and_a_lost_one_makes_the_next_whole() {
        let mut h = Held::default();
        let a = FlowKey::new("a", 0);
        h.admit(1, "k1", a.clone(), 10);
        h.admit(2, "k2", a.clone(), 10);
        assert_eq!(rows(h.report()), (false, 2, vec![("a".into(), None, 2)], 0));
        assert!(h.report().is_none(), "nothing changed");
        assert!(h.routed(1, "p"));
        assert!(!h.routed(9, "p"), "not a credit admission of ours");
        let (_, _, r, _) = rows(h.report());
        assert_eq!(
            r,
            vec![("a".into(), None, 1), ("a".into(), Some("p".into()), 1)]
        );
        // One ends with its token count (a correction), one without.
        assert!(h.complete("k1", Some(40)));
        assert!(!h.complete("k1", Some(40)), "once");
        assert!(h.end(2, None).is_some());
        let (_, admitted, r, served) = rows(h.report());
        assert_eq!(admitted, 2);
        assert_eq!(
            r,
            vec![("a".into(), None, 0), ("a".into(), Some("p".into()), 0)]
        );
        assert_eq!(served, 1);
        assert_eq!(h.unreported(), 2, "the applied state has seen none yet");
        h.applied_admitted = 2;
        assert_eq!(h.unreported(), 0);
        // A dropped report: the next one lists every row and says so.
        h.admit(3, "k3", a, 10);
        let _ = h.report();
        h.whole = true;
        assert_eq!(rows(h.report()), (true, 3, vec![("a".into(), None, 1)], 0));
    }

    #[test]
    fn a_full_outbox_drops_its_oldest_commands_and_counts_them() {
        let mut st = State::default();
        for seq in 0..(OUTBOX_LIMIT as u64 + 3) {
            st.push(FlowCmd::Cancel { seq });
        }
        assert_eq!(st.outbox.len(), OUTBOX_LIMIT);
        assert_eq!(st.dropped_cmds, 3);
        assert!(matches!(
            st.outbox.front(),
            Some(FlowCmd::Cancel { seq: 3 })
        ));
        let last = OUTBOX_LIMIT as u64 + 2;
        assert!(matches!(st.outbox.back(), Some(FlowCmd::Cancel { seq }) if *seq == last));
    }
}

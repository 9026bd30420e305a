//! Cluster-wide flow control: one global queue and in-flight ledger for all replicas.
//!
//! [`GlobalFlow`] is replicated through the consensus log (it lives inside
//! [`crate::cluster::ClusterState`]); every replica applies the same commands and computes the
//! same dispatches. It wraps one [`FlowController`] — bands, fairness, ordering, caps, TTLs and
//! the saturation detector work exactly as on a single replica — and adds what a cluster needs:
//!
//! * **Owners.** A request is named by its owner replica and the owner's sequence number
//!   ([`Key`]); the state assigns the controller's id. Sequence numbers of one owner only grow, so
//!   a retried batch is recognised and ignored.
//! * **Credit (the fast path).** While the replicated state says a request would be dispatched at
//!   once ([`FlowController::admits_now`]) a replica may admit up to its credit *locally*, without
//!   a consensus round trip, and report those admissions later — counted in bulk per (flow, pod)
//!   ([`FlowCmd::Held`]: one controller record per row, [`Command::Hold`]; their settlements are
//!   the member's own), or one by one ([`FlowCmd::Admitted`], degraded mode). The
//!   cluster's total credit (`credit_slack`) is split between live members in proportion to their
//!   recent demand, every `rebalance_ms`. In-flight can therefore exceed what the detector allows
//!   by at most the total credit (invariant I1).
//! * **The slow path.** Otherwise the owner proposes [`FlowCmd::Enqueue`] and holds the stream;
//!   the controller dispatches across all owners' entries by band → fairness → ordering as
//!   capacity frees, and the owner releases the stream when it sees the [`Verdict`] for its key.
//! * **The ledger.** Every admitted request is in flight until a [`FlowCmd::Settle`] naming its
//!   request key (the EPP's own, random per request — never a client's `x-request-id`) arrives
//!   from any replica (the response may be observed elsewhere), with the
//!   pod it was routed to ([`FlowCmd::Routed`]) so scorers can read per-pod in-flight load.
//! * **Leases.** A member whose heartbeat lease ends (or that restarts) loses everything it held:
//!   its queued entries are rejected (`rejected-saturated`, retryable) and its reservations return
//!   to the pool, at the same log position on every replica (invariant I4).
//! * **Quarantine.** What it may have forwarded without reporting stays booked: its credit (spent
//!   on admissions it never got to report, which now run in the pods unseen by the ledger) stays
//!   counted as held, and its dispatched reservations with no pod reported stay in the ledger as
//!   *orphans*. Both are eased down to the requests the pods report beyond the ledger (a lost
//!   life's admissions end like any others; a member that comes back reports its own), or after
//!   [`QUARANTINE_MAX_MS`], so nobody else is granted them meanwhile (I1). An orphan released so
//!   turns its verdict into a rejection: an owner back from a partition must not forward it then.
//!
//! Time is the state's (`ClusterState` passes its log clock — the leaders' stamps — once entries
//! carry them, else the largest proposer wall clock seen), µs precision, clamped monotone.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::machine::{Command, EnqueueRequest, FlowController, FlowKey, Outcome, RequestId, pairs};
use crate::outcome::DropReason;
use crate::saturation::EndpointSnapshot;
use crate::units::Nanos;
use crate::{ConfigError, ControllerConfig, Totals};

mod held;
mod quarantine;

use held::Holdings;
pub use held::{HeldRow, ServedRow};
use quarantine::Quarantine;
pub use quarantine::{QUARANTINE_MAX_MS, QUARANTINE_MIN_AGE_MS, QUARANTINE_WINDOW_MS};

/// A replica's id (its Raft node id).
pub type MemberId = u64;

/// A request's cluster-wide name: (owner replica, owner's sequence number).
pub type Key = (MemberId, u64);

/// How long a decided verdict stays readable for its owner.
pub const VERDICT_RETENTION_MS: u64 = 60_000;

/// Most settlements kept waiting for the admission they settle.
pub const MAX_EARLY: usize = 65_536;

/// Reconciliation with the pods: a pod must report fewer requests than the ledger holds for it
/// this long before the difference is released…
pub const RECONCILE_PERSIST_MS: u64 = 1_000;
/// …and only entries at least this old are released (younger ones may not have reached the pod
/// or its latest scrape yet).
pub const RECONCILE_MIN_AGE_MS: u64 = 2_000;

/// Cluster parameters of the global flow state (identical on every replica).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalParams {
    /// A member without a heartbeat for this long loses its credit, queue entries and reservations.
    pub lease_ms: u64,
    /// Requests the whole cluster may admit on local credit beyond what the replicated state has
    /// seen (split between live members by demand). 0 = every admission goes through the log.
    pub credit_slack: u32,
    /// How often credit is re-split by demand.
    pub rebalance_ms: u64,
}

impl Default for GlobalParams {
    fn default() -> Self {
        GlobalParams {
            lease_ms: 1500,
            credit_slack: 256,
            rebalance_ms: 1000,
        }
    }
}

/// What a request asks of flow control (the replicated part of an enqueue).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ask {
    pub flow: FlowKey,
    pub bytes: u64,
    pub tokens: u64,
    /// Queue TTL: `None` = `defaultRequestTTL`; `Some(0)` = none.
    pub ttl: Option<Nanos>,
    pub slo_ttft: Option<Nanos>,
}

/// One flow-control command of a member (carried in batches through the log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FlowCmd {
    /// Queue `seq` in the global queue; the owner waits for its verdict.
    Enqueue {
        seq: u64,
        request_id: String,
        ask: Ask,
    },
    /// `seq` was admitted on local credit and is already forwarded (to `pod`, if known).
    Admitted {
        seq: u64,
        request_id: String,
        ask: Ask,
        pod: Option<String>,
    },
    /// The pod a dispatched request was routed to.
    Routed { seq: u64, pod: String },
    /// The owner gives `seq` up: queued → `rejected-context-cancelled`; in flight → released.
    Cancel { seq: u64 },
    /// The response of `request_id` ended (observed by any replica); `actual_tokens` from usage.
    Settle {
        request_id: String,
        actual_tokens: Option<u64>,
    },
    /// The member's last batch before a graceful exit: everything it admitted is reported (in
    /// this batch or before) and it admits nothing more, so its credit returns at once, without
    /// quarantine.
    Retire,
    /// The member's requests admitted on local credit and still running, held in bulk: one row
    /// per (flow, pod) instead of an `Admitted` and a `Settle` per request. `rows` are absolute
    /// counts of the rows that changed since the member's previous `Held` (`full`: every row it
    /// holds; any other row of its is zero); `version` only grows within a life (an older or
    /// repeated report is ignored); `admitted` counts the life's credit admissions so far (its
    /// demand, and how much of its credit the state has seen spent); `served` corrects the
    /// flows' charges for requests that ended since the previous report.
    Held {
        version: u64,
        full: bool,
        admitted: u64,
        rows: Vec<HeldRow>,
        served: Vec<ServedRow>,
    },
}

/// The decision about a queued request, as its owner reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    Dispatched,
    Rejected(DropReason),
}

/// What applying a batch did (returned to the proposer).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchResult {
    pub applied: u32,
    /// Duplicates (a retried batch), unknown keys, settlements of nothing.
    pub ignored: u32,
    /// The proposer's waiting requests decided while this batch applied (typically enqueues
    /// dispatched at once): it can release them without waiting for its own replica to apply
    /// the entry.
    pub decided: Vec<(u64, Verdict)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    key: Key,
    request_id: String,
    tokens: u64,
    pod: Option<String>,
    /// Dispatched or admitted (in the ledger); otherwise queued.
    inflight: bool,
    /// When it entered the state (µs).
    since_us: u64,
    /// Dispatched, no pod reported, and its owner's life ended (µs): see the module docs.
    #[serde(default)]
    orphaned_us: Option<u64>,
}

/// Per-member flow bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemberFlow {
    /// The member's incarnation (its start time); a new one voids the old one's entries.
    pub incarnation: u64,
    /// Highest sequence number applied.
    pub last_seq: u64,
    /// Admissions + enqueues since the last rebalance (decayed by half each time).
    pub demand: u64,
    /// Requests it may admit on local credit.
    pub credit: u32,
    /// Its lease ended and its resources were returned.
    pub expired: bool,
    /// This life retired ([`FlowCmd::Retire`]): it holds no credit again.
    #[serde(default)]
    pub retired: bool,
    pub admitted_local: u64,
    pub enqueued: u64,
    /// The last [`FlowCmd::Held`] applied (its version) and the credit admissions it counted.
    #[serde(default)]
    pub held_version: u64,
    #[serde(default)]
    pub held_admitted: u64,
}

/// Per-pod in-flight load from the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PodLoad {
    pub requests: u64,
    pub tokens: u64,
}

/// The global queue, credit and in-flight ledger. See the module docs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GlobalFlow {
    params: GlobalParams,
    fc: FlowController,
    now_us: u64,
    next_id: RequestId,
    last_rebalance_us: u64,
    #[serde(with = "pairs")]
    entries: BTreeMap<RequestId, Entry>,
    #[serde(with = "pairs")]
    by_key: BTreeMap<Key, RequestId>,
    /// In-flight ids by request key (keys are unique; a duplicate settles the oldest first).
    by_request: BTreeMap<String, Vec<RequestId>>,
    #[serde(with = "pairs")]
    members: BTreeMap<MemberId, MemberFlow>,
    pods: BTreeMap<String, PodLoad>,
    /// The same per (pod, owner), so a replica can tell the others' load from its own.
    #[serde(with = "pairs")]
    pod_owner: BTreeMap<(String, MemberId), PodLoad>,
    #[serde(with = "pairs")]
    verdicts: BTreeMap<Key, Verdict>,
    verdict_times: BTreeSet<(u64, MemberId, u64)>,
    /// Settlements that arrived before the admission they settle (the response was observed on
    /// another replica before the owner's report committed): request key → (time µs, tokens); at most
    /// [`MAX_EARLY`], the oldest forgotten first. A settlement of a request already settled (a
    /// retried batch) lands here too and expires: it settles nothing else.
    early: BTreeMap<String, (u64, Option<u64>)>,
    early_times: BTreeSet<(u64, String)>,
    /// Pods reporting fewer requests than the ledger holds for them: since when (µs).
    excess_since: BTreeMap<String, u64>,
    /// Credit of members' lives whose lease ended or that restarted, by (member, incarnation):
    /// still held (see the module docs).
    #[serde(with = "pairs", default)]
    quarantine: BTreeMap<(MemberId, u64), Quarantine>,
    /// Since when (µs) the pods' reports are being watched to ease the quarantine, and the most
    /// requests beyond the ledger they showed since.
    #[serde(default)]
    unaccounted_window: Option<(u64, u64)>,
    /// Credit taken from live members by a rebalance, by (member, incarnation): (credit, until
    /// µs). A member may spend what it had until it has seen the change — at the latest when the
    /// lease it held then ends — so nobody else is granted it before.
    #[serde(with = "pairs", default)]
    shrunk: BTreeMap<(MemberId, u64), (u32, u64)>,
    /// Members' bulk holdings ([`FlowCmd::Held`]), by life (member, incarnation).
    #[serde(with = "pairs", default)]
    held: BTreeMap<(MemberId, u64), Holdings>,
    /// Lives whose holdings nobody reports any more (lease ended, or restarted): since when (µs).
    /// Their routed rows are eased by the pods' reports like settlement-less entries
    /// ([`GlobalFlow::reconcile`]); unrouted ones are released after [`QUARANTINE_MAX_MS`]. A
    /// life back from a partition holds its rows again.
    #[serde(with = "pairs", default)]
    held_lost: BTreeMap<(MemberId, u64), u64>,
    reconciled: u64,
    dispatched: u64,
    reclaimed: u64,
    rebalances: u64,
    /// Verdicts decided during the current `apply_batch` (not state: rebuilt on every batch).
    #[serde(skip)]
    decided_now: Vec<(Key, Verdict)>,
}

impl GlobalFlow {
    pub fn new(config: ControllerConfig, params: GlobalParams) -> Result<GlobalFlow, ConfigError> {
        Ok(GlobalFlow {
            params,
            fc: FlowController::new(config)?,
            now_us: 0,
            next_id: 1,
            last_rebalance_us: 0,
            entries: BTreeMap::new(),
            by_key: BTreeMap::new(),
            by_request: BTreeMap::new(),
            members: BTreeMap::new(),
            pods: BTreeMap::new(),
            pod_owner: BTreeMap::new(),
            verdicts: BTreeMap::new(),
            verdict_times: BTreeSet::new(),
            early: BTreeMap::new(),
            early_times: BTreeSet::new(),
            excess_since: BTreeMap::new(),
            quarantine: BTreeMap::new(),
            unaccounted_window: None,
            shrunk: BTreeMap::new(),
            held: BTreeMap::new(),
            held_lost: BTreeMap::new(),
            reconciled: 0,
            dispatched: 0,
            reclaimed: 0,
            rebalances: 0,
            decided_now: Vec::new(),
        })
    }

    pub fn config(&self) -> &ControllerConfig {
        self.fc.config()
    }

    pub fn params(&self) -> GlobalParams {
        self.params
    }

    fn now_ns(&self) -> Nanos {
        self.now_us.saturating_mul(1000)
    }

    /// Advance time to `now_us`: expire queued requests, end the leases of members not in `live`,
    /// rebalance credit.
    pub fn advance(&mut self, now_us: u64, live: &BTreeSet<MemberId>) {
        self.now_us = self.now_us.max(now_us);
        self.run(Command::Tick);
        let expired: Vec<MemberId> = self
            .members
            .iter()
            .filter(|(id, m)| !m.expired && !live.contains(id))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.reclaim(id, false);
            self.quarantine_credit(id);
            if let Some(m) = self.members.get_mut(&id) {
                m.expired = true;
                let life = (id, m.incarnation);
                self.held_lost.insert(life, self.now_us);
            }
        }
        self.release_unrouted_lost();
        let now = self.now_us;
        self.shrunk.retain(|_, (_, until)| *until > now);
        if self.now_us.saturating_sub(self.last_rebalance_us) >= self.params.rebalance_ms * 1000 {
            self.last_rebalance_us = self.now_us;
            self.rebalance(live);
        }
        self.prune_verdicts();
    }

    /// A member is alive (heartbeat): it may hold credit again after an expiry.
    pub fn member_alive(&mut self, member: MemberId, incarnation: u64, live: &BTreeSet<MemberId>) {
        let fresh = !self.members.contains_key(&member);
        self.incarnation(member, incarnation);
        let revived = self.members.get(&member).is_some_and(|m| m.expired);
        if let Some(m) = self.members.get_mut(&member) {
            m.expired = false;
        }
        if revived {
            self.held_lost.remove(&(member, incarnation));
            // Back in the same life before the quarantine released them: its unrouted dispatches
            // are its own to report again (it may forward them at any moment now), no longer
            // orphans to release while the pods do not show them yet.
            let ids: Vec<RequestId> = self
                .by_key
                .range((member, 0)..=(member, u64::MAX))
                .map(|(_, id)| *id)
                .collect();
            for id in ids {
                if let Some(e) = self.entries.get_mut(&id) {
                    e.orphaned_us = None;
                }
            }
        }
        if fresh || revived {
            self.rebalance(live);
        }
    }

    /// The pool's latest endpoint metrics (proposed by the leader).
    pub fn observe_pool(&mut self, endpoints: Vec<EndpointSnapshot>) {
        self.run(Command::ObservePool { endpoints });
    }

    /// Reconcile the ledger with what the pods report running or waiting (`observed`: pod →
    /// requests, from fresh metrics). A settlement can be lost for good — the response-observing
    /// stream failed, or its replica died mid-response — and such an entry would hold capacity
    /// forever. When a pod has reported fewer requests than the ledger holds for it for
    /// [`RECONCILE_PERSIST_MS`], the difference is released, oldest entries first, among those
    /// older than [`RECONCILE_MIN_AGE_MS`]. Returns how many were released.
    pub fn reconcile(&mut self, now_us: u64, observed: &[(String, u64)]) -> u64 {
        self.now_us = self.now_us.max(now_us);
        let now = self.now_us;
        // A pod without fresh metrics may run anything: no easing on an incomplete report.
        let unaccounted: u64 = if (observed.len() as u64) < self.fc.pool_endpoints() {
            u64::MAX
        } else {
            observed
                .iter()
                .map(|(pod, seen)| {
                    seen.saturating_sub(self.pods.get(pod).map_or(0, |l| l.requests))
                })
                .sum()
        };
        self.ease_quarantine(unaccounted);
        let mut release: Vec<RequestId> = Vec::new();
        let mut eased_rows = 0;
        for (pod, seen) in observed {
            let held = self.pods.get(pod).map_or(0, |l| l.requests);
            if held <= *seen {
                self.excess_since.remove(pod);
                continue;
            }
            let since = *self.excess_since.entry(pod.clone()).or_insert(now);
            if now.saturating_sub(since) < RECONCILE_PERSIST_MS * 1000 {
                continue;
            }
            let old_enough = now.saturating_sub(RECONCILE_MIN_AGE_MS * 1000);
            let before = release.len();
            release.extend(
                self.entries
                    .iter()
                    .filter(|(_, e)| {
                        e.inflight && e.since_us <= old_enough && e.pod.as_deref() == Some(pod)
                    })
                    .map(|(id, _)| *id)
                    .take((held - seen) as usize),
            );
            let rest = (held - seen).saturating_sub((release.len() - before) as u64);
            if rest > 0 {
                eased_rows += self.ease_lost_rows(pod, rest);
            }
            self.excess_since.remove(pod);
        }
        for &id in &release {
            self.run(Command::Complete {
                id,
                actual_tokens: None,
            });
            self.forget(id);
        }
        let released = release.len() as u64 + eased_rows;
        self.reconciled += released;
        released
    }

    /// Apply one member's batch at `now_us`.
    pub fn apply_batch(
        &mut self,
        now_us: u64,
        member: MemberId,
        incarnation: u64,
        cmds: Vec<FlowCmd>,
    ) -> BatchResult {
        self.now_us = self.now_us.max(now_us);
        self.incarnation(member, incarnation);
        self.decided_now.clear();
        let mut res = BatchResult::default();
        for cmd in cmds {
            if self.apply_one(member, cmd) {
                res.applied += 1;
            } else {
                res.ignored += 1;
            }
        }
        res.decided = self
            .decided_now
            .drain(..)
            .filter(|(k, _)| k.0 == member)
            .map(|(k, v)| (k.1, v))
            .collect();
        res
    }

    fn incarnation(&mut self, member: MemberId, incarnation: u64) {
        let m = self.members.entry(member).or_default();
        if m.incarnation != incarnation {
            let old = m.incarnation;
            if old != 0 {
                self.reclaim(member, true);
                self.quarantine_credit(member);
                let now = self.now_us;
                self.held_lost.entry((member, old)).or_insert(now);
                // Nobody waits for the old life's verdicts, and its sequence numbers come again.
                let stale: Vec<(u64, MemberId, u64)> = self
                    .verdict_times
                    .iter()
                    .filter(|(_, m, _)| *m == member)
                    .copied()
                    .collect();
                for t in stale {
                    self.verdict_times.remove(&t);
                    self.verdicts.remove(&(t.1, t.2));
                }
            }
            self.members.insert(
                member,
                MemberFlow {
                    incarnation,
                    ..MemberFlow::default()
                },
            );
        }
    }

    fn apply_one(&mut self, member: MemberId, cmd: FlowCmd) -> bool {
        match cmd {
            FlowCmd::Enqueue {
                seq,
                request_id,
                ask,
            } => self.add(member, seq, request_id, ask, None, false),
            FlowCmd::Admitted {
                seq,
                request_id,
                ask,
                pod,
            } => self.add(member, seq, request_id, ask, pod, true),
            FlowCmd::Routed { seq, pod } => {
                let Some(&id) = self.by_key.get(&(member, seq)) else {
                    return false;
                };
                let Some(e) = self.entries.get_mut(&id) else {
                    return false;
                };
                if !e.inflight || e.pod.is_some() {
                    return false;
                }
                for load in [
                    self.pods.entry(pod.clone()).or_default(),
                    self.pod_owner.entry((pod.clone(), member)).or_default(),
                ] {
                    load.requests += 1;
                    load.tokens += e.tokens;
                }
                e.pod = Some(pod);
                e.orphaned_us = None;
                true
            }
            FlowCmd::Cancel { seq } => {
                let Some(&id) = self.by_key.get(&(member, seq)) else {
                    return false;
                };
                self.run(Command::Cancel { id });
                self.forget(id);
                true
            }
            FlowCmd::Settle {
                request_id,
                actual_tokens,
            } => {
                let Some(id) = self
                    .by_request
                    .get(&request_id)
                    .and_then(|v| v.first())
                    .copied()
                else {
                    // Perhaps its owner has not reported it yet: keep it for a while.
                    if let Some((at, _)) = self.early.remove(&request_id) {
                        self.early_times.remove(&(at, request_id.clone()));
                    }
                    self.early_times.insert((self.now_us, request_id.clone()));
                    self.early.insert(request_id, (self.now_us, actual_tokens));
                    while self.early.len() > MAX_EARLY
                        && let Some((_, old)) = self.early_times.pop_first()
                    {
                        self.early.remove(&old);
                    }
                    return false;
                };
                self.run(Command::Complete { id, actual_tokens });
                self.forget(id);
                true
            }
            FlowCmd::Held {
                version,
                full,
                admitted,
                rows,
                served,
            } => self.held(member, version, full, admitted, rows, served),
            FlowCmd::Retire => {
                let Some(m) = self.members.get_mut(&member) else {
                    return false;
                };
                m.credit = 0;
                m.retired = true;
                self.shrunk.remove(&(member, m.incarnation));
                true
            }
        }
    }

    fn add(
        &mut self,
        member: MemberId,
        seq: u64,
        request_id: String,
        ask: Ask,
        pod: Option<String>,
        admitted: bool,
    ) -> bool {
        let Some(m) = self.members.get_mut(&member) else {
            return false;
        };
        if seq <= m.last_seq {
            return false;
        }
        m.last_seq = seq;
        m.demand += 1;
        if admitted {
            m.admitted_local += 1;
        } else {
            m.enqueued += 1;
        }
        let id = self.next_id;
        self.next_id += 1;
        let req = EnqueueRequest {
            id,
            flow: ask.flow,
            bytes: ask.bytes,
            tokens: ask.tokens,
            ttl: ask.ttl,
            slo_ttft: ask.slo_ttft,
        };
        let key = (member, seq);
        let settled = if admitted {
            self.early.remove(&request_id).map(|(at, tokens)| {
                self.early_times.remove(&(at, request_id.clone()));
                tokens
            })
        } else {
            None
        };
        self.entries.insert(
            id,
            Entry {
                key,
                request_id,
                tokens: ask.tokens,
                pod: None,
                // An admitted request never waits: no verdict for it.
                inflight: admitted,
                since_us: self.now_us,
                orphaned_us: None,
            },
        );
        self.by_key.insert(key, id);
        if admitted {
            self.run(Command::Admit(req));
            if let Some(actual_tokens) = settled {
                // Its settlement came first: admitted and done.
                self.run(Command::Complete { id, actual_tokens });
                self.forget(id);
            } else if let Some(pod) = pod {
                self.apply_one(member, FlowCmd::Routed { seq, pod });
            }
        } else {
            self.run(Command::Enqueue(req));
        }
        true
    }

    /// Run a controller command and book its outcomes.
    fn run(&mut self, cmd: Command) {
        let now = self.now_ns();
        for o in self.fc.apply(now, cmd) {
            match o {
                Outcome::Dispatched { id } => {
                    let Some(e) = self.entries.get_mut(&id) else {
                        continue;
                    };
                    let waited = !e.inflight;
                    e.inflight = true;
                    self.by_request
                        .entry(e.request_id.clone())
                        .or_default()
                        .push(id);
                    if waited {
                        self.dispatched += 1;
                        let key = e.key;
                        self.decide(key, Verdict::Dispatched);
                    }
                }
                Outcome::Rejected { id, reason } => {
                    if let Some(key) = self.entries.get(&id).map(|e| e.key) {
                        self.decide(key, Verdict::Rejected(reason));
                    }
                    self.forget(id);
                }
                Outcome::Evicted { id, .. } => self.forget(id),
                Outcome::Ignored { .. } => {}
            }
        }
    }

    /// Record the verdict on a request that waited (its owner reads it).
    fn decide(&mut self, key: Key, v: Verdict) {
        self.verdicts.insert(key, v);
        self.verdict_times.insert((self.now_us, key.0, key.1));
        self.decided_now.push((key, v));
    }

    fn prune_verdicts(&mut self) {
        let horizon = self.now_us.saturating_sub(VERDICT_RETENTION_MS * 1000);
        while let Some((at, _)) = self.early_times.first() {
            if *at >= horizon {
                break;
            }
            if let Some((_, rid)) = self.early_times.pop_first() {
                self.early.remove(&rid);
            }
        }
        while let Some(&(at, m, s)) = self.verdict_times.first() {
            if at >= horizon {
                break;
            }
            self.verdict_times.pop_first();
            self.verdicts.remove(&(m, s));
        }
    }

    /// Drop every index of `id` (after the controller released or rejected it).
    fn forget(&mut self, id: RequestId) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        // A restarted owner's new request may hold the same key by now.
        if self.by_key.get(&e.key) == Some(&id) {
            self.by_key.remove(&e.key);
        }
        if let Some(ids) = self.by_request.get_mut(&e.request_id) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.by_request.remove(&e.request_id);
            }
        }
        if let Some(pod) = e.pod {
            if let Some(load) = self.pods.get_mut(&pod) {
                load.requests = load.requests.saturating_sub(1);
                load.tokens = load.tokens.saturating_sub(e.tokens);
                if load.requests == 0 {
                    self.pods.remove(&pod);
                }
            }
            let k = (pod, e.key.0);
            if let Some(load) = self.pod_owner.get_mut(&k) {
                load.requests = load.requests.saturating_sub(1);
                load.tokens = load.tokens.saturating_sub(e.tokens);
                if load.requests == 0 {
                    self.pod_owner.remove(&k);
                }
            }
        }
    }

    /// Return what `member` holds (its lease ended, or `new_life`: it restarted): queued
    /// entries are rejected. Its reservations stay booked: a routed one's response may be
    /// streaming from its pod whatever became of the owner (Envoy keeps it going, I9), and an
    /// unrouted one may have been forwarded before the owner could report its pod. Routed ones
    /// end when any replica settles them or when their pod reports fewer requests than the ledger
    /// holds ([`GlobalFlow::reconcile`]); unrouted ones become orphans (see the module docs). A
    /// new life numbers its requests from 1 again, so its predecessor's kept entries leave the
    /// sequence index.
    fn reclaim(&mut self, member: MemberId, new_life: bool) {
        let ids: Vec<(Key, RequestId)> = self
            .by_key
            .range((member, 0)..=(member, u64::MAX))
            .map(|(k, id)| (*k, *id))
            .collect();
        // Queued entries first, so that releasing its reservations cannot dispatch them.
        let (queued, inflight): (Vec<_>, Vec<_>) =
            ids.into_iter().partition(|(_, id)| self.fc.is_queued(*id));
        let now = self.now_us;
        for (key, id) in queued {
            // Cancelling may free capacity: `run` books what it dispatches to others.
            self.run(Command::Cancel { id });
            self.decide(key, Verdict::Rejected(DropReason::RejectedSaturated));
            self.forget(id);
            self.reclaimed += 1;
        }
        for (key, id) in inflight {
            if let Some(e) = self.entries.get_mut(&id)
                && e.pod.is_none()
            {
                e.orphaned_us.get_or_insert(now);
            }
            if new_life {
                self.by_key.remove(&key);
            }
        }
    }

    /// Re-split `credit_slack` between live members: the target is one each (while it lasts)
    /// plus the rest by demand (largest remainder), but credit moves so that the credit members
    /// may still be using never sums above the slack. A member may admit up to its old credit
    /// until it sees this rebalance — a cut-off one until its lease ends — so what shrinking
    /// takes stays held for a lease (then, if the member expired, in quarantine), and growing
    /// only spends what nobody holds.
    fn rebalance(&mut self, live: &BTreeSet<MemberId>) {
        let ids: Vec<MemberId> = self
            .members
            .keys()
            .copied()
            .filter(|id| live.contains(id) && self.members.get(id).is_some_and(|m| !m.retired))
            .collect();
        let total = self.slack(ids.len() as u64);
        // What quarantine holds is nobody's to target: the live members share the rest.
        let slack = total.saturating_sub(self.quarantined_credit());
        let mut target: BTreeMap<MemberId, u64> = BTreeMap::new();
        if !ids.is_empty() && slack > 0 {
            let n = ids.len() as u64;
            let base = (slack / n).min(1);
            let rest = slack - base * n;
            let demand: Vec<u64> = ids
                .iter()
                .map(|id| self.members.get(id).map_or(0, |m| m.demand) + 1)
                .collect();
            let total: u64 = demand.iter().sum();
            let mut shares: Vec<(u64, u64)> = demand
                .iter()
                .map(|d| (rest * d / total, rest * d % total))
                .collect();
            let mut left = rest - shares.iter().map(|s| s.0).sum::<u64>();
            let mut order: Vec<usize> = (0..shares.len()).collect();
            order.sort_by(|&a, &b| shares[b].1.cmp(&shares[a].1).then(a.cmp(&b)));
            for i in order {
                if left == 0 {
                    break;
                }
                shares[i].0 += 1;
                left -= 1;
            }
            for (i, id) in ids.iter().enumerate() {
                target.insert(*id, base + shares[i].0);
            }
        }
        let held = self.credit_held();
        let mut budget = total.saturating_sub(held);
        let until = self.now_us.saturating_add(self.params.lease_ms * 1000);
        for (id, m) in self.members.iter_mut() {
            let cur = u64::from(m.credit);
            let want = target.get(id).copied().unwrap_or(0);
            let new = if want <= cur {
                if want < cur {
                    let s = self.shrunk.entry((*id, m.incarnation)).or_default();
                    s.0 =
                        s.0.saturating_add(u32::try_from(cur - want).unwrap_or(u32::MAX));
                    s.1 = until;
                }
                want
            } else {
                let grant = (want - cur).min(budget);
                budget -= grant;
                cur + grant
            };
            m.credit = u32::try_from(new).unwrap_or(u32::MAX);
            m.demand /= 2;
        }
        self.rebalances += 1;
    }

    /// The credit the live members may hold between them: `credit_slack`, but no more than a
    /// quarter of the pool's request capacity (at least one per live member) when the detector
    /// counts requests — credit spent and not yet reported is load the pods see before the
    /// ledger does, and on a small pool the configured slack could be a second pool's worth.
    fn slack(&self, live_members: u64) -> u64 {
        let slack = u64::from(self.params.credit_slack);
        match self.fc.request_capacity(self.now_ns()) {
            Some(cap) => slack.min((cap / 4).max(live_members)),
            None => slack,
        }
    }

    // ----- reads -----

    /// The verdict on `key` if it waited in the queue and was decided (kept for a minute), as
    /// its owner's `incarnation` asks for it: a restarted member numbers its requests from 1
    /// again, so until the state has seen the new incarnation (which drops the old one's
    /// verdicts) no verdict is its.
    pub fn verdict(&self, key: Key, incarnation: u64) -> Option<Verdict> {
        if self.members.get(&key.0).map(|m| m.incarnation) != Some(incarnation) {
            return None;
        }
        self.verdicts.get(&key).copied()
    }

    /// Whether `key` is queued or in flight.
    pub fn holds(&self, key: Key) -> bool {
        self.by_key.contains_key(&key)
    }

    /// Whether the ledger holds a request in flight under `request_id` (its settlement goes
    /// through the log; bulk holdings are their members' to settle).
    pub fn holds_request(&self, request_id: &str) -> bool {
        self.by_request.contains_key(request_id)
    }

    /// Whether `member` may admit a request of `priority` on local credit now (its credit is
    /// [`GlobalFlow::member`]`.credit`): a live member and a state that would dispatch at once
    /// even if every member had spent all its credit unreported — so that, with a detector that
    /// counts requests, what members admit on credit cannot take the pool past its capacity
    /// (near it, requests wait in the global queue, in priority order, not in the pods).
    pub fn fast_path_open(&self, member: MemberId, priority: i32) -> bool {
        self.members
            .get(&member)
            .is_some_and(|m| !m.expired && !m.retired && m.credit > 0)
            && self
                .fc
                .admits_now_with_margin(priority, self.now_ns(), self.credit_held())
    }

    pub fn member(&self, member: MemberId) -> Option<&MemberFlow> {
        self.members.get(&member)
    }

    /// [`GlobalFlow::member`] if the state's incarnation of it is `incarnation` (a restarted
    /// member must not take its previous life's credit or reported sequence for its own).
    pub fn member_as(&self, member: MemberId, incarnation: u64) -> Option<&MemberFlow> {
        self.members
            .get(&member)
            .filter(|m| m.incarnation == incarnation)
    }

    pub fn members(&self) -> &BTreeMap<MemberId, MemberFlow> {
        &self.members
    }

    /// Ledger entries in flight: (owner key, request key, pod), oldest id first.
    pub fn inflight_entries(&self) -> impl Iterator<Item = (Key, &str, Option<&str>)> + '_ {
        self.entries
            .values()
            .filter(|e| e.inflight)
            .map(|e| (e.key, e.request_id.as_str(), e.pod.as_deref()))
    }

    /// Per-pod in-flight requests/tokens (routed entries and bulk holdings).
    pub fn pods(&self) -> &BTreeMap<String, PodLoad> {
        &self.pods
    }

    /// Per-pod in-flight load of every replica but `me` (what `me` cannot see locally).
    pub fn others_load(&self, me: MemberId) -> BTreeMap<&str, PodLoad> {
        let mut out: BTreeMap<&str, PodLoad> = BTreeMap::new();
        for ((pod, owner), load) in &self.pod_owner {
            if *owner != me {
                let o = out.entry(pod.as_str()).or_default();
                o.requests += load.requests;
                o.tokens += load.tokens;
            }
        }
        out
    }

    pub fn controller(&self) -> &FlowController {
        &self.fc
    }

    pub fn totals(&self) -> Totals {
        self.fc.totals()
    }

    /// State time (µs).
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Requests dispatched from the global queue so far.
    pub fn dispatched(&self) -> u64 {
        self.dispatched
    }

    /// Settlements waiting for the admission they settle.
    pub fn early_settlements(&self) -> usize {
        self.early.len()
    }

    /// Ledger entries released by reconciliation with the pods so far.
    pub fn reconciled(&self) -> u64 {
        self.reconciled
    }

    /// Credit re-splits so far.
    pub fn rebalances(&self) -> u64 {
        self.rebalances
    }

    /// Entries returned by lease expiry or restart so far.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed
    }
}

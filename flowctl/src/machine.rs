//! The flow-control state machine: [`FlowController::apply`] turns a [`Command`] at time `now` into
//! [`Outcome`]s. Deterministic (ordered maps only, no clock, no randomness) and serializable as a
//! whole, so a consensus layer can replicate the command log and snapshot the state.
//!
//! # Data structures (costs are per operation, Q = queued requests, F = flows in a band)
//!
//! * `queued: id → Queued` and `inflight: id → InFlight` — the ledger; O(log Q).
//! * Flows live in a slab (`flows`, stable `u32` indexes, free list) found by `flow_index: FlowKey →
//!   u32`. A flow's queue is `(ordering key, seq) → id`; the ordering key is the arrival sequence
//!   (FCFS), the TTL deadline (EDF) or the SLO deadline, so "pick the request" is `first()`.
//! * Each band keeps a scheduler index over its *non-empty* flows only, so empty flows cost nothing:
//!   global-strict = ordered set of flow heads; round-robin = fairness-id-sorted map + cursor;
//!   weighted = ordered set of `(pass, flow)`. Picking a flow is O(log F).
//! * `deadlines: (deadline, id)` and `arrivals: (enqueued_at, id)` make TTL / no-endpoint expiry
//!   O(expired · log Q).
//! * `evictable: (priority, newest-first, id)` holds in-flight sheddable requests the data plane
//!   can abort ([`Command::SetEvictable`]), the candidates for eviction.
//!
//! # One `apply`
//! 1. `now` is clamped to be monotone (an older `now` is treated as the last one seen).
//! 2. Expiry: queued requests with `deadline <= now` are rejected (`rejected-ttl-expired`, or
//!    `rejected-no-endpoints` while the pool is empty); while the pool is empty, so are requests that
//!    waited `noEndpointRequestTTL`.
//! 3. The command.
//! 4. Dispatch while the usage limit allows the current saturation: highest non-empty band →
//!    fairness picks a flow → ordering picks its first request. Then, if eviction is on, the pool is
//!    saturated and a request waits above some in-flight sheddable one, evict up to
//!    `max_per_decision` (lowest priority, newest dispatch first) and dispatch again.

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use crate::config::{BandSettings, ConfigError, ControllerConfig};
use crate::outcome::DropReason;
use crate::policy::{Charge, FairnessPolicy, OrderingPolicy};
use crate::saturation::{ConcurrencyDetector, EndpointSnapshot, SaturationDetector};
use crate::units::Nanos;

/// Request identifier: an opaque `u64` chosen by the caller, unique among requests that are queued
/// or in flight (the node maps `x-request-id` to a counter; a replicated setup packs
/// `(replica, sequence)` into it). Reusing an id after its request ended is allowed.
pub type RequestId = u64;

/// "No deadline" (TTL of 0 or no SLO).
pub const NO_DEADLINE: Nanos = Nanos::MAX;

/// Bytes of index payload one queued request occupies (ledger entry, flow-queue entry, deadline and
/// arrival index entries), before B-tree node overhead; the benchmark reports the resident figure.
pub const QUEUED_PAYLOAD_BYTES: usize = std::mem::size_of::<(RequestId, Queued)>()
    + std::mem::size_of::<(OrdKey, RequestId)>()
    + 2 * std::mem::size_of::<(Nanos, RequestId)>();

/// A flow: the requests of one fairness id at one priority.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FlowKey {
    pub fairness_id: String,
    pub priority: i32,
}

impl FlowKey {
    pub fn new(fairness_id: impl Into<String>, priority: i32) -> Self {
        FlowKey {
            fairness_id: fairness_id.into(),
            priority,
        }
    }
}

/// A request asking to be admitted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnqueueRequest {
    pub id: RequestId,
    pub flow: FlowKey,
    /// Request body size, counted against the byte caps.
    pub bytes: u64,
    /// Prompt + expected output tokens (charged by token-weighted fairness and counted by the
    /// token concurrency detector until completion).
    pub tokens: u64,
    /// Queue TTL: `None` = `defaultRequestTTL`; `Some(0)` = no TTL.
    pub ttl: Option<Nanos>,
    /// TTFT objective (`x-llm-d-slo-ttft-ms`, in ns) for `slo-deadline-ordering-policy`.
    pub slo_ttft: Option<Nanos>,
}

/// Inputs of the state machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Enqueue(EnqueueRequest),
    /// A request admitted outside the queue (a replica's local credit in cluster mode): it is
    /// already forwarded, so it goes straight into the in-flight ledger — whatever the caps,
    /// saturation or shutdown say — and charges its flow like a dispatch. `Dispatched` (or
    /// `Ignored` for a duplicate id).
    Admit(EnqueueRequest),
    /// The client went away. Queued → `Rejected(rejected-context-cancelled)`; in flight → released
    /// like `Complete` with its estimate, no outcome.
    Cancel {
        id: RequestId,
    },
    /// An in-flight request finished (capacity frees). `actual_tokens` corrects token charging.
    Complete {
        id: RequestId,
        actual_tokens: Option<u64>,
    },
    /// Whether the data plane can abort in-flight request `id` (its eviction stream is attached,
    /// or no longer): a sheddable (priority < 0) request is a candidate for eviction only while
    /// `evictable`, so an eviction always ends a real request. `Ignored` if not in flight.
    SetEvictable {
        id: RequestId,
        evictable: bool,
    },
    /// Nothing new; let time pass (expire, dispatch).
    Tick,
    /// Latest endpoint metrics; the configured detector computes saturation from them (the
    /// concurrency detector uses only their count plus the in-flight ledger).
    ObservePool {
        endpoints: Vec<EndpointSnapshot>,
    },
    /// A detector output computed outside (e.g. by the leader), overriding the configured detector
    /// until the next `ObservePool`. `endpoints` = pool size (0 = no endpoints).
    SetSaturation {
        saturation: f64,
        endpoints: u32,
    },
    /// Reject everything queued and every later enqueue with `rejected-shutting-down`.
    Shutdown,
}

/// Why a command was ignored (the request it names is unaffected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IgnoredReason {
    /// `Enqueue` with an id that is already queued or in flight.
    DuplicateId,
    /// `Cancel`/`Complete` of an id that is neither queued nor (for `Cancel`) in flight.
    UnknownId,
}

/// Outputs of the state machine. Per request: `Rejected`, or `Dispatched` optionally followed by
/// `Evicted`; in between it is queued, after `Dispatched` it is in flight until `Complete`/`Cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Admitted: forward it now.
    Dispatched { id: RequestId },
    /// Never dispatched; answer with `reason.http()`.
    Rejected { id: RequestId, reason: DropReason },
    /// Was in flight and is revoked (`DropReason::Evicted`); the node aborts it.
    Evicted { id: RequestId, reason: DropReason },
    /// The command had no effect.
    Ignored { id: RequestId, why: IgnoredReason },
}

/// Queue/in-flight figures of one band (metrics input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BandStats {
    pub priority: i32,
    pub queued_requests: u64,
    pub queued_bytes: u64,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub max_requests: u64,
    pub max_bytes: u64,
}

/// Queue figures of one flow (metrics input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FlowStats<'a> {
    pub fairness_id: &'a str,
    pub priority: i32,
    pub queued_requests: usize,
    pub queued_bytes: u64,
    pub inflight_requests: u32,
}

/// Pool-wide totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Totals {
    pub queued_requests: u64,
    pub queued_bytes: u64,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
}

/// f64 with a total order, for the weighted scheduler's (pass, flow) set.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
struct Pass(f64);

impl PartialEq for Pass {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pass {}
impl PartialOrd for Pass {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pass {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// `BTreeMap` as a sequence of pairs, so non-string keys survive JSON.
pub(crate) mod pairs {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer, K: Serialize, V: Serialize>(
        map: &BTreeMap<K, V>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.iter())
    }

    pub fn deserialize<'de, D, K, V>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        D: Deserializer<'de>,
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
    {
        let v: Vec<(K, V)> = Vec::deserialize(d)?;
        Ok(v.into_iter().collect())
    }
}

type OrdKey = (u64, u64);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Queued {
    flow: u32,
    key: OrdKey,
    bytes: u64,
    tokens: u64,
    deadline: Nanos,
    enqueued_at: Nanos,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct InFlight {
    flow: u32,
    priority: i32,
    tokens: u64,
    dispatch_seq: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Flow {
    fairness_id: String,
    priority: i32,
    band: u32,
    #[serde(with = "pairs")]
    queue: BTreeMap<OrdKey, RequestId>,
    queued_bytes: u64,
    inflight: u32,
    weight: f64,
    pass: f64,
}

impl Flow {
    fn head(&self) -> Option<OrdKey> {
        self.queue.first_key_value().map(|(k, _)| *k)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Sched {
    GlobalStrict {
        heads: BTreeSet<(u64, u64, u32)>,
    },
    RoundRobin {
        #[serde(with = "pairs")]
        active: BTreeMap<String, u32>,
        cursor: Option<String>,
    },
    Weighted {
        active: BTreeSet<(Pass, u32)>,
        vtime: f64,
        charge: Charge,
    },
}

impl Sched {
    fn new(policy: &FairnessPolicy) -> Sched {
        match policy {
            FairnessPolicy::GlobalStrict => Sched::GlobalStrict {
                heads: BTreeSet::new(),
            },
            FairnessPolicy::RoundRobin => Sched::RoundRobin {
                active: BTreeMap::new(),
                cursor: None,
            },
            FairnessPolicy::Weighted(p) => Sched::Weighted {
                active: BTreeSet::new(),
                vtime: 0.0,
                charge: p.charge,
            },
        }
    }

    /// Keep the index in step with a flow whose head went from `old` to `new`.
    fn head_changed(&mut self, flow: &mut Flow, fi: u32, old: Option<OrdKey>, new: Option<OrdKey>) {
        match self {
            Sched::GlobalStrict { heads } => {
                if old != new {
                    if let Some(o) = old {
                        heads.remove(&(o.0, o.1, fi));
                    }
                    if let Some(n) = new {
                        heads.insert((n.0, n.1, fi));
                    }
                }
            }
            Sched::RoundRobin { active, .. } => match (old, new) {
                (None, Some(_)) => {
                    active.insert(flow.fairness_id.clone(), fi);
                }
                (Some(_), None) => {
                    active.remove(&flow.fairness_id);
                }
                _ => {}
            },
            Sched::Weighted { active, vtime, .. } => match (old, new) {
                (None, Some(_)) => {
                    // Idle time earns no credit.
                    flow.pass = flow.pass.max(*vtime);
                    active.insert((Pass(flow.pass), fi));
                }
                (Some(_), None) => {
                    active.remove(&(Pass(flow.pass), fi));
                }
                _ => {}
            },
        }
    }

    /// The flow to serve next (the band has at least one non-empty flow).
    fn pick(&mut self) -> Option<u32> {
        match self {
            Sched::GlobalStrict { heads } => heads.first().map(|h| h.2),
            Sched::RoundRobin { active, cursor } => {
                let next = match cursor.as_deref() {
                    Some(c) => active
                        .range::<str, _>((Bound::Excluded(c), Bound::Unbounded))
                        .next()
                        .or_else(|| active.iter().next()),
                    None => active.iter().next(),
                };
                let (id, fi) = next?;
                match cursor {
                    Some(c) => {
                        c.clear();
                        c.push_str(id);
                    }
                    None => *cursor = Some(id.clone()),
                }
                Some(*fi)
            }
            Sched::Weighted { active, .. } => active.first().map(|a| a.1),
        }
    }

    /// Charge a dispatch to an active flow (weighted only), before its head changes.
    fn charge(&mut self, flow: &mut Flow, fi: u32, tokens: u64) {
        if let Sched::Weighted {
            active,
            vtime,
            charge,
        } = self
        {
            let cost = match charge {
                Charge::Requests => 1.0,
                Charge::Tokens => tokens.max(1) as f64,
            };
            active.remove(&(Pass(flow.pass), fi));
            *vtime = vtime.max(flow.pass);
            flow.pass += cost / flow.weight;
            active.insert((Pass(flow.pass), fi));
        }
    }

    /// Correct a token charge once the actual count is known.
    fn settle(&mut self, flow: &mut Flow, fi: u32, charged: u64, actual: u64) {
        if let Sched::Weighted {
            active,
            charge: Charge::Tokens,
            ..
        } = self
        {
            let delta = (actual.max(1) as f64 - charged.max(1) as f64) / flow.weight;
            let was_active = active.remove(&(Pass(flow.pass), fi));
            flow.pass += delta;
            if was_active {
                active.insert((Pass(flow.pass), fi));
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Band {
    priority: i32,
    settings: BandSettings,
    sched: Sched,
    queued: u64,
    queued_bytes: u64,
    inflight: u64,
    inflight_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Pool {
    Endpoints(Vec<EndpointSnapshot>),
    Fixed { saturation: f64, endpoints: u32 },
}

impl Pool {
    fn is_empty(&self) -> bool {
        match self {
            Pool::Endpoints(v) => v.is_empty(),
            Pool::Fixed { endpoints, .. } => *endpoints == 0,
        }
    }
}

/// Saturation for one dispatch run: constant, or recomputed from the in-flight ledger.
enum Probe {
    Const(f64),
    Concurrency(ConcurrencyDetector, u64),
}

impl Probe {
    fn eval(&self, totals: &Totals) -> f64 {
        match self {
            Probe::Const(v) => *v,
            Probe::Concurrency(d, n) => {
                d.saturation_from_totals(*n, totals.inflight_requests, totals.inflight_tokens)
            }
        }
    }
}

/// Keep metric inputs finite (serializable, comparable): NaN counts as saturated, ±∞ is clamped.
fn sanitize(v: f64) -> f64 {
    if v.is_nan() { 1.0 } else { v.clamp(0.0, 1e12) }
}

/// The flow controller. See the module docs for the structure and [`FlowController::apply`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FlowController {
    config: ControllerConfig,
    now: Nanos,
    next_seq: u64,
    shutting_down: bool,
    last_eviction: Option<Nanos>,
    pool: Pool,
    totals: Totals,
    /// Bands in creation order (indexes are stable); `band_order` sorts them by priority, highest first.
    bands: Vec<Band>,
    band_order: Vec<u32>,
    flows: Vec<Option<Flow>>,
    free_flows: Vec<u32>,
    #[serde(with = "pairs")]
    flow_index: BTreeMap<FlowKey, u32>,
    #[serde(with = "pairs")]
    queued: BTreeMap<RequestId, Queued>,
    #[serde(with = "pairs")]
    inflight: BTreeMap<RequestId, InFlight>,
    deadlines: BTreeSet<(Nanos, RequestId)>,
    arrivals: BTreeSet<(Nanos, RequestId)>,
    /// In-flight sheddable requests: (priority, MAX - dispatch seq, id) — lowest priority, then newest.
    evictable: BTreeSet<(i32, u64, RequestId)>,
}

impl FlowController {
    /// A controller with the configured bands and an empty pool (saturation 1.0 until the first
    /// `ObservePool`/`SetSaturation`).
    pub fn new(config: ControllerConfig) -> Result<FlowController, ConfigError> {
        config.validate()?;
        let mut fc = FlowController {
            config,
            now: 0,
            next_seq: 0,
            shutting_down: false,
            last_eviction: None,
            pool: Pool::Endpoints(Vec::new()),
            totals: Totals::default(),
            bands: Vec::new(),
            band_order: Vec::new(),
            flows: Vec::new(),
            free_flows: Vec::new(),
            flow_index: BTreeMap::new(),
            queued: BTreeMap::new(),
            inflight: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            arrivals: BTreeSet::new(),
            evictable: BTreeSet::new(),
        };
        let priorities: Vec<i32> = fc.config.bands.iter().map(|b| b.priority).collect();
        for p in priorities {
            fc.band_index(p);
        }
        Ok(fc)
    }

    /// Apply one command at time `now` (nanoseconds, any epoch, monotone).
    pub fn apply(&mut self, now: Nanos, command: Command) -> Vec<Outcome> {
        let mut out = Vec::new();
        self.apply_into(now, command, &mut out);
        out
    }

    /// [`FlowController::apply`] appending to a caller-owned buffer (no allocation on hot paths).
    pub fn apply_into(&mut self, now: Nanos, command: Command, out: &mut Vec<Outcome>) {
        let now = now.max(self.now);
        self.now = now;
        self.expire(now, out);
        match command {
            Command::Enqueue(req) => self.enqueue(now, req, out),
            Command::Admit(req) => self.admit(req, out),
            Command::Cancel { id } => {
                if self.remove_queued(id).is_some() {
                    out.push(Outcome::Rejected {
                        id,
                        reason: DropReason::RejectedContextCancelled,
                    });
                } else if !self.release(id, None) {
                    out.push(Outcome::Ignored {
                        id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::Complete { id, actual_tokens } => {
                if !self.release(id, actual_tokens) {
                    out.push(Outcome::Ignored {
                        id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::SetEvictable { id, evictable } => match self.inflight.get(&id) {
                Some(r) => {
                    let key = (r.priority, u64::MAX - r.dispatch_seq, id);
                    if !evictable {
                        self.evictable.remove(&key);
                    } else if r.priority < 0 {
                        self.evictable.insert(key);
                    }
                }
                None => out.push(Outcome::Ignored {
                    id,
                    why: IgnoredReason::UnknownId,
                }),
            },
            Command::Tick => {}
            Command::ObservePool { mut endpoints } => {
                for e in &mut endpoints {
                    e.kv_cache_usage = sanitize(e.kv_cache_usage);
                }
                self.pool = Pool::Endpoints(endpoints)
            }
            Command::SetSaturation {
                saturation,
                endpoints,
            } => {
                self.pool = Pool::Fixed {
                    saturation: sanitize(saturation),
                    endpoints,
                }
            }
            Command::Shutdown => {
                self.shutting_down = true;
                let ids: Vec<RequestId> = self.queued.keys().copied().collect();
                for id in ids {
                    if self.remove_queued(id).is_some() {
                        out.push(Outcome::Rejected {
                            id,
                            reason: DropReason::RejectedShuttingDown,
                        });
                    }
                }
            }
        }
        self.dispatch(now, out);
    }

    // ----- read-only views (metrics inputs) -----

    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// The last `now` seen.
    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Endpoints in the pool as last observed (0 = none: everything waits, then 503).
    pub fn pool_endpoints(&self) -> u64 {
        match &self.pool {
            Pool::Endpoints(v) => v.len() as u64,
            Pool::Fixed { endpoints, .. } => u64::from(*endpoints),
        }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    pub fn is_queued(&self, id: RequestId) -> bool {
        self.queued.contains_key(&id)
    }

    pub fn is_in_flight(&self, id: RequestId) -> bool {
        self.inflight.contains_key(&id)
    }

    /// Whether a request of `priority` arriving at `now` would be dispatched at once: nothing
    /// waits anywhere, the pool has endpoints and its saturation is below the band's ceiling.
    /// (The cluster's local-credit fast path asks this of the replicated state.)
    pub fn admits_now(&self, priority: i32, now: Nanos) -> bool {
        if self.shutting_down || self.totals.queued_requests > 0 || self.pool.is_empty() {
            return false;
        }
        let probe = self.probe(now.max(self.now));
        probe.eval(&self.totals) < self.ceiling_for(priority)
    }

    /// Pool saturation as the dispatcher sees it at `now` (`flow_control_pool_saturation`).
    pub fn saturation(&self, now: Nanos) -> f64 {
        self.probe(now).eval(&self.totals)
    }

    /// Per band, highest priority first (`flow_control_queue_size`/`_bytes`, in-flight per priority,
    /// capacity utilization).
    pub fn band_stats(&self) -> Vec<BandStats> {
        self.band_order
            .iter()
            .filter_map(|&b| self.bands.get(b as usize))
            .map(|b| BandStats {
                priority: b.priority,
                queued_requests: b.queued,
                queued_bytes: b.queued_bytes,
                inflight_requests: b.inflight,
                inflight_tokens: b.inflight_tokens,
                max_requests: b.settings.max_requests,
                max_bytes: b.settings.max_bytes,
            })
            .collect()
    }

    /// Every live flow (queued or in flight), ordered by (fairness id, priority).
    pub fn flow_stats(&self) -> impl Iterator<Item = FlowStats<'_>> + '_ {
        self.flow_index.values().filter_map(move |&fi| {
            self.flows
                .get(fi as usize)
                .and_then(Option::as_ref)
                .map(|f| FlowStats {
                    fairness_id: &f.fairness_id,
                    priority: f.priority,
                    queued_requests: f.queue.len(),
                    queued_bytes: f.queued_bytes,
                    inflight_requests: f.inflight,
                })
        })
    }

    // ----- internals -----

    fn probe(&self, now: Nanos) -> Probe {
        if self.pool.is_empty() {
            return Probe::Const(1.0);
        }
        match (&self.pool, &self.config.detector) {
            (Pool::Fixed { saturation, .. }, _) => Probe::Const(*saturation),
            (Pool::Endpoints(eps), SaturationDetector::Utilization(d)) => {
                Probe::Const(d.saturation(eps, now))
            }
            (Pool::Endpoints(eps), SaturationDetector::Concurrency(d)) => {
                Probe::Concurrency(*d, eps.len() as u64)
            }
        }
    }

    /// Index of the band for `priority`, created from the configured band or template if needed.
    fn band_index(&mut self, priority: i32) -> u32 {
        let pos = self.band_order.binary_search_by(|&b| {
            let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
            priority.cmp(&p) // descending order
        });
        match pos {
            Ok(i) => self.band_order[i],
            Err(i) => {
                let settings = self.config.band_settings(priority).clone();
                let idx = self.bands.len() as u32;
                self.bands.push(Band {
                    priority,
                    sched: Sched::new(&settings.fairness),
                    settings,
                    queued: 0,
                    queued_bytes: 0,
                    inflight: 0,
                    inflight_tokens: 0,
                });
                self.band_order.insert(i, idx);
                idx
            }
        }
    }

    fn find_band(&self, priority: i32) -> Option<&Band> {
        self.band_order
            .binary_search_by(|&b| {
                let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
                priority.cmp(&p)
            })
            .ok()
            .and_then(|i| self.bands.get(self.band_order[i] as usize))
    }

    fn over_caps(&self, priority: i32, bytes: u64) -> bool {
        let cfg = &self.config;
        let t = &self.totals;
        if cfg.max_requests > 0 && t.queued_requests + 1 > cfg.max_requests {
            return true;
        }
        if cfg.max_bytes > 0 && t.queued_bytes.saturating_add(bytes) > cfg.max_bytes {
            return true;
        }
        let (queued, queued_bytes, settings) = match self.find_band(priority) {
            Some(b) => (b.queued, b.queued_bytes, &b.settings),
            None => (0, 0, cfg.band_settings(priority)),
        };
        (settings.max_requests > 0 && queued + 1 > settings.max_requests)
            || (settings.max_bytes > 0 && queued_bytes.saturating_add(bytes) > settings.max_bytes)
    }

    fn enqueue(&mut self, now: Nanos, req: EnqueueRequest, out: &mut Vec<Outcome>) {
        let id = req.id;
        if self.shutting_down {
            out.push(Outcome::Rejected {
                id,
                reason: DropReason::RejectedShuttingDown,
            });
            return;
        }
        if self.queued.contains_key(&id) || self.inflight.contains_key(&id) {
            out.push(Outcome::Ignored {
                id,
                why: IgnoredReason::DuplicateId,
            });
            return;
        }
        if self.over_caps(req.flow.priority, req.bytes) {
            out.push(Outcome::Rejected {
                id,
                reason: DropReason::RejectedSaturated,
            });
            return;
        }
        let band_idx = self.band_index(req.flow.priority);
        let fi = self.flow_for(req.flow, band_idx);
        let ttl = req.ttl.unwrap_or(self.config.default_request_ttl);
        let deadline = if ttl == 0 {
            NO_DEADLINE
        } else {
            now.saturating_add(ttl)
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let Some(band) = self.bands.get_mut(band_idx as usize) else {
            return;
        };
        let ord = match band.settings.ordering {
            OrderingPolicy::Fcfs => seq,
            OrderingPolicy::Edf => deadline,
            OrderingPolicy::SloDeadline => {
                req.slo_ttft.map_or(NO_DEADLINE, |s| now.saturating_add(s))
            }
        };
        let key = (ord, seq);
        let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return;
        };
        let old = flow.head();
        flow.queue.insert(key, id);
        flow.queued_bytes += req.bytes;
        let new = flow.head();
        band.sched.head_changed(flow, fi, old, new);
        band.queued += 1;
        band.queued_bytes += req.bytes;
        self.totals.queued_requests += 1;
        self.totals.queued_bytes += req.bytes;
        if deadline != NO_DEADLINE {
            self.deadlines.insert((deadline, id));
        }
        self.arrivals.insert((now, id));
        self.queued.insert(
            id,
            Queued {
                flow: fi,
                key,
                bytes: req.bytes,
                tokens: req.tokens,
                deadline,
                enqueued_at: now,
            },
        );
    }

    fn flow_for(&mut self, key: FlowKey, band_idx: u32) -> u32 {
        if let Some(&fi) = self.flow_index.get(&key) {
            return fi;
        }
        let weight = match self
            .bands
            .get(band_idx as usize)
            .map(|b| &b.settings.fairness)
        {
            Some(FairnessPolicy::Weighted(p)) => p.weight_of(&key.fairness_id),
            _ => 1.0,
        };
        let flow = Flow {
            fairness_id: key.fairness_id.clone(),
            priority: key.priority,
            band: band_idx,
            queue: BTreeMap::new(),
            queued_bytes: 0,
            inflight: 0,
            weight,
            pass: 0.0,
        };
        let fi = match self.free_flows.pop() {
            Some(fi) => {
                if let Some(slot) = self.flows.get_mut(fi as usize) {
                    *slot = Some(flow);
                }
                fi
            }
            None => {
                self.flows.push(Some(flow));
                (self.flows.len() - 1) as u32
            }
        };
        self.flow_index.insert(key, fi);
        fi
    }

    /// Drop a flow that has nothing queued and nothing in flight (bounded memory for many ids).
    fn maybe_gc_flow(&mut self, fi: u32) {
        let Some(slot) = self.flows.get_mut(fi as usize) else {
            return;
        };
        let idle = slot
            .as_ref()
            .is_some_and(|f| f.queue.is_empty() && f.inflight == 0);
        if idle && let Some(f) = slot.take() {
            self.flow_index.remove(&FlowKey {
                fairness_id: f.fairness_id,
                priority: f.priority,
            });
            self.free_flows.push(fi);
        }
    }

    /// Remove a queued request from every index; `None` if it is not queued.
    fn remove_queued(&mut self, id: RequestId) -> Option<Queued> {
        let q = self.queued.remove(&id)?;
        if q.deadline != NO_DEADLINE {
            self.deadlines.remove(&(q.deadline, id));
        }
        self.arrivals.remove(&(q.enqueued_at, id));
        if let Some(flow) = self.flows.get_mut(q.flow as usize).and_then(Option::as_mut) {
            let old = flow.head();
            flow.queue.remove(&q.key);
            flow.queued_bytes -= q.bytes;
            let new = flow.head();
            if let Some(band) = self.bands.get_mut(flow.band as usize) {
                band.sched.head_changed(flow, q.flow, old, new);
                band.queued -= 1;
                band.queued_bytes -= q.bytes;
            }
        }
        self.totals.queued_requests -= 1;
        self.totals.queued_bytes -= q.bytes;
        self.maybe_gc_flow(q.flow);
        Some(q)
    }

    /// Release an in-flight request (completion, cancel after dispatch, eviction).
    fn release(&mut self, id: RequestId, actual_tokens: Option<u64>) -> bool {
        let Some(r) = self.inflight.remove(&id) else {
            return false;
        };
        if r.priority < 0 {
            self.evictable
                .remove(&(r.priority, u64::MAX - r.dispatch_seq, id));
        }
        if let Some(flow) = self.flows.get_mut(r.flow as usize).and_then(Option::as_mut) {
            flow.inflight -= 1;
            if let Some(band) = self.bands.get_mut(flow.band as usize) {
                if let Some(actual) = actual_tokens {
                    band.sched.settle(flow, r.flow, r.tokens, actual);
                }
                band.inflight -= 1;
                band.inflight_tokens -= r.tokens;
            }
        }
        self.totals.inflight_requests -= 1;
        self.totals.inflight_tokens -= r.tokens;
        self.maybe_gc_flow(r.flow);
        true
    }

    fn expire(&mut self, now: Nanos, out: &mut Vec<Outcome>) {
        let no_endpoints = self.pool.is_empty();
        let ttl_reason = if no_endpoints {
            DropReason::RejectedNoEndpoints
        } else {
            DropReason::RejectedTtlExpired
        };
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.remove_queued(id);
            out.push(Outcome::Rejected {
                id,
                reason: ttl_reason,
            });
        }
        if no_endpoints {
            let ttl = self.config.no_endpoint_request_ttl;
            while let Some(&(at, id)) = self.arrivals.first() {
                if at.saturating_add(ttl) > now {
                    break;
                }
                self.remove_queued(id);
                out.push(Outcome::Rejected {
                    id,
                    reason: DropReason::RejectedNoEndpoints,
                });
            }
        }
    }

    fn top_waiting_band(&self) -> Option<u32> {
        self.band_order
            .iter()
            .copied()
            .find(|&b| self.bands.get(b as usize).is_some_and(|b| b.queued > 0))
    }

    fn dispatch(&mut self, now: Nanos, out: &mut Vec<Outcome>) {
        if self.totals.queued_requests == 0 {
            return;
        }
        let probe = self.probe(now);
        self.dispatch_loop(&probe, out);
        if self.evict(now, &probe, out) {
            self.dispatch_loop(&probe, out);
        }
    }

    /// The usage-limit ceiling of band `b` (see [`UsageLimit::ceiling`]).
    fn ceiling(&self, b: u32) -> f64 {
        let n = self.band_order.len();
        let rank = self.band_order.iter().position(|&x| x == b).unwrap_or(0);
        let prio = |i: Option<&u32>| {
            i.and_then(|&x| self.bands.get(x as usize))
                .map_or(0, |band| band.priority)
        };
        let highest = prio(self.band_order.first());
        let lowest = prio(self.band_order.last());
        let priority = self.bands.get(b as usize).map_or(0, |band| band.priority);
        self.config
            .usage_limit
            .ceiling(rank, n, priority, lowest, highest)
    }

    /// The ceiling a band of `priority` has or would have (ranked among the existing bands).
    fn ceiling_for(&self, priority: i32) -> f64 {
        let pos = self.band_order.binary_search_by(|&b| {
            let p = self.bands.get(b as usize).map_or(i32::MIN, |b| b.priority);
            priority.cmp(&p)
        });
        let (rank, n) = match pos {
            Ok(i) => (i, self.band_order.len()),
            Err(i) => (i, self.band_order.len() + 1),
        };
        let prio = |i: Option<&u32>| {
            i.and_then(|&x| self.bands.get(x as usize))
                .map(|b| b.priority)
        };
        let highest = prio(self.band_order.first()).map_or(priority, |p| p.max(priority));
        let lowest = prio(self.band_order.last()).map_or(priority, |p| p.min(priority));
        self.config
            .usage_limit
            .ceiling(rank, n, priority, lowest, highest)
    }

    /// Whether the highest waiting band is gated at the current saturation (`None`: nothing waits).
    fn top_band_gated(&self, probe: &Probe) -> Option<(u32, bool)> {
        let b = self.top_waiting_band()?;
        Some((b, probe.eval(&self.totals) >= self.ceiling(b)))
    }

    fn dispatch_loop(&mut self, probe: &Probe, out: &mut Vec<Outcome>) {
        while self.totals.queued_requests > 0 {
            let Some((b, false)) = self.top_band_gated(probe) else {
                return;
            };
            if !self.dispatch_one(b, out) {
                // Index inconsistency: never spin.
                debug_assert!(false, "band {b} has queued requests but no pickable flow");
                return;
            }
        }
    }

    fn dispatch_one(&mut self, b: u32, out: &mut Vec<Outcome>) -> bool {
        let Some(band) = self.bands.get_mut(b as usize) else {
            return false;
        };
        let Some(fi) = band.sched.pick() else {
            return false;
        };
        let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) else {
            return false;
        };
        let Some((&key, &id)) = flow.queue.first_key_value() else {
            return false;
        };
        let Some(q) = self.queued.remove(&id) else {
            return false;
        };
        band.sched.charge(flow, fi, q.tokens);
        flow.queue.remove(&key);
        flow.queued_bytes -= q.bytes;
        let new = flow.head();
        band.sched.head_changed(flow, fi, Some(key), new);
        band.queued -= 1;
        band.queued_bytes -= q.bytes;
        if q.deadline != NO_DEADLINE {
            self.deadlines.remove(&(q.deadline, id));
        }
        self.arrivals.remove(&(q.enqueued_at, id));
        self.totals.queued_requests -= 1;
        self.totals.queued_bytes -= q.bytes;
        self.start_inflight(b, fi, id, q.tokens);
        out.push(Outcome::Dispatched { id });
        true
    }

    /// Count `id` in flight on flow `fi` of band `b` (the flow was charged by the caller).
    fn start_inflight(&mut self, b: u32, fi: u32, id: RequestId, tokens: u64) {
        let Some(band) = self.bands.get_mut(b as usize) else {
            return;
        };
        if let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut) {
            flow.inflight += 1;
        }
        band.inflight += 1;
        band.inflight_tokens += tokens;
        let priority = band.priority;
        self.totals.inflight_requests += 1;
        self.totals.inflight_tokens += tokens;
        let dispatch_seq = self.next_seq;
        self.next_seq += 1;
        self.inflight.insert(
            id,
            InFlight {
                flow: fi,
                priority,
                tokens,
                dispatch_seq,
            },
        );
    }

    /// [`Command::Admit`]: straight into the ledger, charged to its flow.
    fn admit(&mut self, req: EnqueueRequest, out: &mut Vec<Outcome>) {
        let id = req.id;
        if self.queued.contains_key(&id) || self.inflight.contains_key(&id) {
            out.push(Outcome::Ignored {
                id,
                why: IgnoredReason::DuplicateId,
            });
            return;
        }
        let b = self.band_index(req.flow.priority);
        let fi = self.flow_for(req.flow, b);
        if let Some(band) = self.bands.get_mut(b as usize)
            && let Some(flow) = self.flows.get_mut(fi as usize).and_then(Option::as_mut)
        {
            // An idle flow joins the weighted schedule at the current virtual time first, so a
            // burst of local admissions is charged from "now", not from its old pass.
            if flow.queue.is_empty() {
                band.sched.head_changed(flow, fi, None, Some((0, 0)));
                band.sched.charge(flow, fi, req.tokens);
                band.sched.head_changed(flow, fi, Some((0, 0)), None);
            } else {
                band.sched.charge(flow, fi, req.tokens);
            }
        }
        self.start_inflight(b, fi, id, req.tokens);
        out.push(Outcome::Dispatched { id });
    }

    /// One eviction decision; true if anything was evicted.
    fn evict(&mut self, now: Nanos, probe: &Probe, out: &mut Vec<Outcome>) -> bool {
        let ev = self.config.eviction;
        if !ev.enabled || self.totals.queued_requests == 0 || self.pool.is_empty() {
            return false;
        }
        let Some((top_band, true)) = self.top_band_gated(probe) else {
            return false;
        };
        if let Some(last) = self.last_eviction
            && now < last.saturating_add(ev.grace)
        {
            return false;
        }
        let Some(top) = self.bands.get(top_band as usize).map(|b| b.priority) else {
            return false;
        };
        let mut evicted = 0;
        // Re-check before each revocation: evict only while still saturated.
        while evicted < ev.max_per_decision && probe.eval(&self.totals) >= self.ceiling(top_band) {
            let Some(&(priority, _, id)) = self.evictable.first() else {
                break;
            };
            if priority >= top {
                break;
            }
            self.release(id, None);
            out.push(Outcome::Evicted {
                id,
                reason: DropReason::Evicted,
            });
            evicted += 1;
        }
        if evicted > 0 {
            self.last_eviction = Some(now);
        }
        evicted > 0
    }
}

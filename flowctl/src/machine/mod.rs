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
//! 4. Dispatch while the usage limit allows the current saturation — counting the demand reserve
//!    of the bands above as in flight, and holding a lower band that would fill the pool while a
//!    burst arrives (`reserve`) —: highest non-empty band → fairness picks a flow → ordering
//!    picks its first request. Then, if eviction is on, the pool is
//!    saturated and a request waits above some in-flight sheddable one, evict up to
//!    `max_per_decision` (lowest priority, newest dispatch first) and dispatch again.
//!
//! # Layout
//! This module holds the commands, outcomes, statistics and the controller's public face;
//! `state` the inner structures (entries, flows, fairness schedulers, bands); `dispatch` what
//! an `apply` does inside (enqueue, release, expiry, dispatch, eviction); `reserve` the demand
//! reserve and burst settling.

mod dispatch;
mod reserve;
mod state;

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use crate::config::{ConfigError, ControllerConfig};
use crate::outcome::DropReason;
use crate::policy::FairnessPolicy;
use crate::saturation::EndpointSnapshot;
use crate::units::Nanos;
use dispatch::sanitize;
use state::{Band, Flow, InFlight, OrdKey, Pool, Queued};

/// Request identifier: an opaque `u64` chosen by the caller, unique among requests that are queued
/// or in flight (the node maps its request key to a counter; a replicated setup packs
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
    /// A replica's requests of `flow` admitted on local credit and still running, as one bulk
    /// record `id` (absolute: `requests` requests of `tokens` tokens between them). An increase
    /// charges the flow like that many admissions, a decrease releases like completions; 0
    /// removes it. Like `Admit`, whatever the caps or saturation say; no outcome. Never evictable.
    Hold {
        id: RequestId,
        flow: FlowKey,
        requests: u64,
        tokens: u64,
    },
    /// `requests` requests of `flow` held in bulk ended, estimated at `charged` tokens and
    /// using `actual`: token charging is corrected and the program's service credited, as
    /// `Complete` does for one request (their count leaves with the holding's next `Hold`).
    Served {
        flow: FlowKey,
        requests: u64,
        charged: u64,
        actual: u64,
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
    /// `soft-reflective-ceiling-policy`: its cycle tick, and whether the current dispatch cycle
    /// is an open one.
    #[serde(default)]
    reflect_tick: u64,
    #[serde(default)]
    reflect_open: bool,
    /// Average service time (dispatch → completion) in ns, 0 before the first completion; the
    /// demand reserve's horizon.
    #[serde(default)]
    service_ns: f64,
    /// The current burst of arrivals, for settling.
    #[serde(default)]
    burst: reserve::Burst,
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
            reflect_tick: 0,
            reflect_open: false,
            service_ns: 0.0,
            burst: Default::default(),
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
                if let Some(at) = self.inflight.get(&id).and_then(|r| r.dispatched_at) {
                    self.note_service(at);
                }
                if !self.release(id, actual_tokens) {
                    out.push(Outcome::Ignored {
                        id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::Hold {
                id,
                flow,
                requests,
                tokens,
            } => self.hold(id, flow, requests, tokens),
            Command::Served {
                flow,
                requests,
                charged,
                actual,
            } => self.served(&flow, requests, charged, actual),
            Command::SetEvictable { id, evictable } => match self.inflight.get(&id) {
                Some(r) if r.requests == 1 => {
                    let key = (r.priority, u64::MAX - r.dispatch_seq, id);
                    if !evictable {
                        self.evictable.remove(&key);
                    } else if r.priority < 0 {
                        self.evictable.insert(key);
                    }
                }
                // A bulk holding stands for requests nobody here can abort one by one.
                _ => out.push(Outcome::Ignored {
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

    /// `program-aware-fairness`: every known program's attained service (tokens, decayed), as
    /// (band priority, fairness id, service).
    pub fn attained_service(&self) -> Vec<(i32, &str, f64)> {
        self.bands
            .iter()
            .flat_map(|b| {
                b.sched
                    .attained()
                    .into_iter()
                    .map(move |(id, s)| (b.priority, id, s))
            })
            .collect()
    }

    /// The last `now` seen.
    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// The pool's endpoint samples as last observed (none for a fixed pool).
    pub fn pool_samples(&self) -> &[EndpointSnapshot] {
        match &self.pool {
            Pool::Endpoints(v) => v,
            Pool::Fixed { .. } => &[],
        }
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
        self.admits_now_with_margin(priority, now, 0)
    }

    /// [`Self::admits_now`] as if `margin` more requests were in flight than the ledger holds —
    /// admissions others may have made and not reported yet (a cluster's outstanding credit). A
    /// detector that does not count requests (the utilization detector reads the pods' own
    /// gauges) ignores it. The demand reserve of the bands above `priority` counts as in flight,
    /// and a lower band's request that would fill the pool while a burst arrives is not admitted
    /// at once (it takes the queue).
    pub fn admits_now_with_margin(&self, priority: i32, now: Nanos, margin: u64) -> bool {
        if self.shutting_down || self.totals.queued_requests > 0 || self.pool.is_empty() {
            return false;
        }
        let now = now.max(self.now);
        let probe = self.probe(now);
        let totals = Totals {
            inflight_requests: self.totals.inflight_requests.saturating_add(margin),
            ..self.totals
        };
        let reserve = self.reserve_above_priority(priority, now);
        let sat = probe.eval_reserving(&totals, reserve);
        sat < self.ceiling_for(priority, sat) && !self.settles_at(priority, now, &totals, reserve)
    }

    /// The pool's request capacity when the detector counts requests (the concurrency detector
    /// with `maxConcurrency`); `None` otherwise.
    pub fn request_capacity(&self, now: Nanos) -> Option<u64> {
        match self.probe(now.max(self.now)) {
            dispatch::Probe::Concurrency(d, _, cap) if d.max_concurrency > 0 => Some(cap),
            _ => None,
        }
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
}

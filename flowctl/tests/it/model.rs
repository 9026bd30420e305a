//! Model-based property test: random configurations and command sequences (enqueues over several
//! bands and flows, completions, cancels, saturation and pool changes, clock advances, shutdown)
//! checked step by step against a simple reference model.
//!
//! The model predicts exactly: which requests expire (and with which reason, in which order), what
//! an enqueue/cancel/complete/shutdown answers. For dispatches and evictions, whose choice depends on
//! the fairness policy, it checks the invariants: strict priority, TTL, the saturation gate, no
//! double dispatch, eviction order. After every step: caps hold, the machine's counters equal the
//! model's, nothing expirable is still queued, and the queue is empty unless the pool is saturated.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::MS;
use flowctl::{
    BandConfig, BandSettings, Charge, Command, ConcurrencyDetector, ControllerConfig, DropReason,
    EndpointSnapshot, EnqueueRequest, EvictionConfig, FairnessPolicy, FlowController, FlowKey,
    IgnoredReason, Nanos, OrderingPolicy, Outcome, SaturationDetector, StaticUsageLimitParams,
    UsageLimit, UtilizationDetector, WeightedFairnessParams,
};
use proptest::prelude::*;
use std::collections::BTreeMap;

const PRIORITIES: [i32; 4] = [5, 0, -1, -3]; // -3 has no configured band (template)
const FAIRNESS: [&str; 3] = ["a", "b", "c"];

#[derive(Debug, Clone)]
enum Op {
    Enqueue {
        prio: usize,
        fairness: usize,
        bytes: u64,
        tokens: u64,
        ttl: Option<Nanos>,
        slo: Option<Nanos>,
        reuse: Option<usize>,
    },
    /// Admitted outside the queue (a replica's local credit).
    Admit {
        prio: usize,
        fairness: usize,
        tokens: u64,
    },
    Cancel(usize),
    Complete(usize, Option<u64>),
    /// The data plane can (or can no longer) abort this request.
    SetEvictable(usize, bool),
    Advance(Nanos),
    SetSaturation(f64, u32),
    Observe(Vec<(u64, f64)>),
    Tick,
    Shutdown,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0..4usize, 0..3usize, 1..400u64, 1..2000u64,
               prop::option::of(prop_oneof![Just(0u64), (1..60u64).prop_map(|v| v * MS)]),
               prop::option::of((1..50u64).prop_map(|v| v * MS)),
               prop::option::weighted(0.1, 0..64usize))
            .prop_map(|(prio, fairness, bytes, tokens, ttl, slo, reuse)| Op::Enqueue {
                prio, fairness, bytes, tokens, ttl, slo, reuse
            }),
        2 => (0..4usize, 0..3usize, 1..2000u64)
            .prop_map(|(prio, fairness, tokens)| Op::Admit { prio, fairness, tokens }),
        2 => (0..64usize).prop_map(Op::Cancel),
        3 => (0..64usize, prop::bool::weighted(0.8)).prop_map(|(i, e)| Op::SetEvictable(i, e)),
        4 => (0..64usize, prop::option::of(1..3000u64)).prop_map(|(i, t)| Op::Complete(i, t)),
        4 => prop_oneof![
            (0..20u64).prop_map(|v| v * MS),
            (0..20u64).prop_map(|v| v * MS + v),
            Just(1u64),
        ]
        .prop_map(Op::Advance),
        2 => (prop::sample::select(vec![0.0, 0.5, 0.85, 0.99, 1.0, 1.5]), 0..3u32)
            .prop_map(|(s, n)| Op::SetSaturation(s, n)),
        2 => prop::collection::vec((0..8u64, 0.0..1.0f64), 0..3).prop_map(Op::Observe),
        1 => Just(Op::Tick),
        1 => prop::bool::weighted(0.05).prop_map(|b| if b { Op::Shutdown } else { Op::Tick }),
    ]
}

fn fairness_policy() -> impl Strategy<Value = FairnessPolicy> {
    prop_oneof![
        Just(FairnessPolicy::GlobalStrict),
        Just(FairnessPolicy::RoundRobin),
        (1..4u32, prop::bool::ANY).prop_map(|(w, tokens)| {
            FairnessPolicy::Weighted(WeightedFairnessParams {
                weights: [("a".to_string(), f64::from(w))].into(),
                default_weight: 1.0,
                charge: if tokens {
                    Charge::Tokens
                } else {
                    Charge::Requests
                },
            })
        }),
    ]
}

fn ordering_policy() -> impl Strategy<Value = OrderingPolicy> {
    prop_oneof![
        Just(OrderingPolicy::Fcfs),
        Just(OrderingPolicy::Edf),
        Just(OrderingPolicy::SloDeadline),
    ]
}

fn band_settings() -> impl Strategy<Value = BandSettings> {
    (
        1..7u64,
        300..2000u64,
        fairness_policy(),
        ordering_policy(),
        prop_oneof![Just(None), (5..60u64).prop_map(|ms| Some(ms * MS))],
    )
        .prop_map(
            |(max_requests, max_bytes, fairness, ordering, request_ttl)| BandSettings {
                max_requests,
                max_bytes,
                fairness,
                ordering,
                request_ttl,
            },
        )
}

fn config() -> impl Strategy<Value = ControllerConfig> {
    (
        prop::collection::vec(band_settings(), 3),
        band_settings(),
        prop_oneof![Just(0u64), 3..12u64],
        prop_oneof![Just(0u64), 500..3000u64],
        prop_oneof![
            (1..4u64).prop_map(|m| SaturationDetector::Concurrency(ConcurrencyDetector {
                max_concurrency: m,
                ..ConcurrencyDetector::default()
            })),
            Just(SaturationDetector::Utilization(
                UtilizationDetector::default()
            )),
        ],
        prop::sample::select(vec![0.8, 1.0]),
        prop::bool::ANY,
    )
        .prop_map(
            |(bands, template, max_requests, max_bytes, detector, threshold, evict)| {
                ControllerConfig {
                    max_requests,
                    max_bytes,
                    default_request_ttl: 40 * MS,
                    no_endpoint_request_ttl: 15 * MS,
                    bands: bands
                        .into_iter()
                        .zip(PRIORITIES)
                        .map(|(settings, priority)| BandConfig { priority, settings })
                        .collect(),
                    default_band: template.clone(),
                    default_negative_band: template,
                    usage_limit: StaticUsageLimitParams { threshold }.into(),
                    detector,
                    eviction: EvictionConfig {
                        enabled: evict,
                        max_per_decision: 2,
                        grace: 5 * MS,
                    },
                    // The reference model has no demand reserve (tests/it/reserve.rs covers it).
                    demand_reserve: flowctl::DemandReserve::OFF,
                }
            },
        )
}

#[derive(Debug, Clone)]
struct MReq {
    priority: i32,
    bytes: u64,
    tokens: u64,
    deadline: Option<Nanos>,
    enqueued_at: Nanos,
}

#[derive(Debug, Clone)]
enum MPool {
    Fixed(f64, u32),
    Endpoints(Vec<EndpointSnapshot>),
}

struct Model {
    cfg: ControllerConfig,
    now: Nanos,
    pool: MPool,
    shutting_down: bool,
    queued: BTreeMap<u64, MReq>,
    /// id → (request, dispatch order)
    inflight: BTreeMap<u64, (MReq, u64)>,
    /// In-flight ids the data plane can abort (`Command::Evictable`).
    abortable: std::collections::BTreeSet<u64>,
    dispatch_counter: u64,
    last_eviction: Option<Nanos>,
}

impl Model {
    fn pool_empty(&self) -> bool {
        match &self.pool {
            MPool::Fixed(_, n) => *n == 0,
            MPool::Endpoints(v) => v.is_empty(),
        }
    }

    fn saturation(&self) -> f64 {
        if self.pool_empty() {
            return 1.0;
        }
        match (&self.pool, &self.cfg.detector) {
            (MPool::Fixed(s, _), _) => *s,
            (MPool::Endpoints(v), SaturationDetector::Utilization(d)) => d.saturation(v, self.now),
            (MPool::Endpoints(v), SaturationDetector::Concurrency(d)) => {
                self.inflight.len() as f64 / (d.max_concurrency as f64 * v.len() as f64)
            }
        }
    }

    fn threshold(&self) -> f64 {
        match self.cfg.usage_limit {
            UsageLimit::Static(p) => p.threshold,
            other => panic!("the model covers the static usage limit only, not {other:?}"),
        }
    }

    fn allows_dispatch(&self) -> bool {
        self.saturation() < self.threshold()
    }

    fn band_totals(&self, priority: i32) -> (u64, u64) {
        self.queued
            .values()
            .filter(|r| r.priority == priority)
            .fold((0, 0), |(n, b), r| (n + 1, b + r.bytes))
    }

    fn would_exceed_caps(&self, priority: i32, bytes: u64) -> bool {
        let n = self.queued.len() as u64;
        let b: u64 = self.queued.values().map(|r| r.bytes).sum();
        if self.cfg.max_requests > 0 && n + 1 > self.cfg.max_requests {
            return true;
        }
        if self.cfg.max_bytes > 0 && b + bytes > self.cfg.max_bytes {
            return true;
        }
        let s = self.cfg.band_settings(priority);
        let (bn, bb) = self.band_totals(priority);
        bn + 1 > s.max_requests || bb + bytes > s.max_bytes
    }

    /// Requests that must expire at `now`, in the machine's documented order.
    fn expected_expiry(&self) -> Vec<Outcome> {
        let empty = self.pool_empty();
        let mut by_deadline: Vec<(Nanos, u64)> = self
            .queued
            .iter()
            .filter_map(|(id, r)| r.deadline.filter(|d| *d <= self.now).map(|d| (d, *id)))
            .collect();
        by_deadline.sort();
        let reason = if empty {
            DropReason::RejectedNoEndpoints
        } else {
            DropReason::RejectedTtlExpired
        };
        let mut out: Vec<Outcome> = by_deadline
            .iter()
            .map(|(_, id)| Outcome::Rejected { id: *id, reason })
            .collect();
        if empty {
            let mut by_arrival: Vec<(Nanos, u64)> = self
                .queued
                .iter()
                .filter(|(id, r)| {
                    r.enqueued_at + self.cfg.no_endpoint_request_ttl <= self.now
                        && !by_deadline.iter().any(|(_, d)| d == *id)
                })
                .map(|(id, r)| (r.enqueued_at, *id))
                .collect();
            by_arrival.sort();
            out.extend(by_arrival.into_iter().map(|(_, id)| Outcome::Rejected {
                id,
                reason: DropReason::RejectedNoEndpoints,
            }));
        }
        out
    }
}

fn check_views(fc: &FlowController, m: &Model, ids: &[u64]) -> Result<(), TestCaseError> {
    let t = fc.totals();
    prop_assert_eq!(t.queued_requests, m.queued.len() as u64);
    prop_assert_eq!(
        t.queued_bytes,
        m.queued.values().map(|r| r.bytes).sum::<u64>()
    );
    prop_assert_eq!(t.inflight_requests, m.inflight.len() as u64);
    prop_assert_eq!(
        t.inflight_tokens,
        m.inflight.values().map(|(r, _)| r.tokens).sum::<u64>()
    );
    for b in fc.band_stats() {
        let (n, bytes) = m.band_totals(b.priority);
        prop_assert_eq!((b.queued_requests, b.queued_bytes), (n, bytes));
        // Caps never exceeded.
        prop_assert!(n <= b.max_requests && bytes <= b.max_bytes);
        let inflight = m
            .inflight
            .values()
            .filter(|(r, _)| r.priority == b.priority)
            .count() as u64;
        prop_assert_eq!(b.inflight_requests, inflight);
    }
    if m.cfg.max_requests > 0 {
        prop_assert!(t.queued_requests <= m.cfg.max_requests);
    }
    if m.cfg.max_bytes > 0 {
        prop_assert!(t.queued_bytes <= m.cfg.max_bytes);
    }
    let flow_total: usize = fc.flow_stats().map(|f| f.queued_requests).sum();
    prop_assert_eq!(flow_total as u64, t.queued_requests);
    for id in ids {
        prop_assert_eq!(
            fc.is_queued(*id),
            m.queued.contains_key(id),
            "queued {}",
            id
        );
        prop_assert_eq!(
            fc.is_in_flight(*id),
            m.inflight.contains_key(id),
            "inflight {}",
            id
        );
    }
    Ok(())
}

fn run(cfg: ControllerConfig, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut fc =
        FlowController::new(cfg.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut m = Model {
        cfg,
        now: 0,
        pool: MPool::Endpoints(vec![]),
        shutting_down: false,
        queued: BTreeMap::new(),
        inflight: BTreeMap::new(),
        dispatch_counter: 0,
        last_eviction: None,
        abortable: Default::default(),
    };
    let mut ids: Vec<u64> = Vec::new();
    let mut now: Nanos = 0;
    for op in ops {
        let pick = |i: usize| ids.get(i % ids.len().max(1)).copied().unwrap_or(9999);
        let cmd = match &op {
            Op::Enqueue {
                prio,
                fairness,
                bytes,
                tokens,
                ttl,
                slo,
                reuse,
            } => {
                let id = match reuse {
                    Some(i) if !ids.is_empty() => pick(*i),
                    _ => ids.len() as u64 + 1,
                };
                Command::Enqueue(EnqueueRequest {
                    id,
                    flow: FlowKey::new(FAIRNESS[*fairness], PRIORITIES[*prio]),
                    bytes: *bytes,
                    tokens: *tokens,
                    ttl: *ttl,
                    slo_ttft: *slo,
                })
            }
            Op::Admit {
                prio,
                fairness,
                tokens,
            } => Command::Admit(EnqueueRequest {
                id: ids.len() as u64 + 1,
                flow: FlowKey::new(FAIRNESS[*fairness], PRIORITIES[*prio]),
                bytes: 0,
                tokens: *tokens,
                ttl: None,
                slo_ttft: None,
            }),
            Op::Cancel(i) => Command::Cancel { id: pick(*i) },
            Op::SetEvictable(i, e) => Command::SetEvictable {
                id: pick(*i),
                evictable: *e,
            },
            Op::Complete(i, t) => Command::Complete {
                id: pick(*i),
                actual_tokens: *t,
            },
            Op::Advance(dt) => {
                now += dt;
                Command::Tick
            }
            Op::SetSaturation(s, n) => Command::SetSaturation {
                saturation: *s,
                endpoints: *n,
            },
            Op::Observe(eps) => Command::ObservePool {
                endpoints: eps
                    .iter()
                    .map(|(q, kv)| EndpointSnapshot {
                        waiting_queue: *q,
                        kv_cache_usage: *kv,
                        sampled_at: Some(now),
                        batch_capacity: None,
                    })
                    .collect(),
            },
            Op::Tick => Command::Tick,
            Op::Shutdown => Command::Shutdown,
        };
        if let Command::Enqueue(r) | Command::Admit(r) = &cmd
            && !ids.contains(&r.id)
        {
            ids.push(r.id);
        }
        let out = fc.apply(now, cmd.clone());
        m.now = now;
        let mut rest = &out[..];

        // Phase 1: expiry, predicted exactly.
        let expired = m.expected_expiry();
        prop_assert!(
            rest.len() >= expired.len(),
            "missing expiries {:?} in {:?}",
            expired,
            out
        );
        prop_assert_eq!(
            &rest[..expired.len()],
            &expired[..],
            "expiry at {} for {:?}",
            now,
            cmd
        );
        for o in &expired {
            if let Outcome::Rejected { id, .. } = o {
                m.queued.remove(id);
            }
        }
        rest = &rest[expired.len()..];

        // Phase 2: the command's own answer.
        let mut expect = Vec::new();
        match &cmd {
            Command::Enqueue(r) => {
                let id = r.id;
                if m.shutting_down {
                    expect.push(Outcome::Rejected {
                        id,
                        reason: DropReason::RejectedShuttingDown,
                    });
                } else if m.queued.contains_key(&id) || m.inflight.contains_key(&id) {
                    expect.push(Outcome::Ignored {
                        id,
                        why: IgnoredReason::DuplicateId,
                    });
                } else if m.would_exceed_caps(r.flow.priority, r.bytes) {
                    expect.push(Outcome::Rejected {
                        id,
                        reason: DropReason::RejectedSaturated,
                    });
                } else {
                    // The request's own, else its band's (or its template's), else the default.
                    let ttl = r
                        .ttl
                        .or(m.cfg.band_settings(r.flow.priority).request_ttl)
                        .unwrap_or(m.cfg.default_request_ttl);
                    m.queued.insert(
                        id,
                        MReq {
                            priority: r.flow.priority,
                            bytes: r.bytes,
                            tokens: r.tokens,
                            deadline: (ttl > 0).then_some(now + ttl),
                            enqueued_at: now,
                        },
                    );
                }
            }
            Command::Admit(r) => {
                let id = r.id;
                if m.queued.contains_key(&id) || m.inflight.contains_key(&id) {
                    expect.push(Outcome::Ignored {
                        id,
                        why: IgnoredReason::DuplicateId,
                    });
                } else {
                    // Admitted whatever the caps, saturation or shutdown say.
                    m.dispatch_counter += 1;
                    let req = MReq {
                        priority: r.flow.priority,
                        bytes: r.bytes,
                        tokens: r.tokens,
                        deadline: None,
                        enqueued_at: now,
                    };
                    m.inflight.insert(id, (req, m.dispatch_counter));
                    expect.push(Outcome::Dispatched { id });
                }
            }
            Command::Cancel { id } => {
                if m.queued.remove(id).is_some() {
                    expect.push(Outcome::Rejected {
                        id: *id,
                        reason: DropReason::RejectedContextCancelled,
                    });
                } else if m.inflight.remove(id).is_none() {
                    expect.push(Outcome::Ignored {
                        id: *id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::SetEvictable { id, evictable } => {
                if m.inflight.contains_key(id) {
                    if *evictable {
                        m.abortable.insert(*id);
                    } else {
                        m.abortable.remove(id);
                    }
                } else {
                    expect.push(Outcome::Ignored {
                        id: *id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::Complete { id, .. } => {
                if m.inflight.remove(id).is_none() {
                    expect.push(Outcome::Ignored {
                        id: *id,
                        why: IgnoredReason::UnknownId,
                    });
                }
            }
            Command::SetSaturation {
                saturation,
                endpoints,
            } => {
                m.pool = MPool::Fixed(*saturation, *endpoints);
            }
            Command::ObservePool { endpoints } => m.pool = MPool::Endpoints(endpoints.clone()),
            Command::Shutdown => {
                m.shutting_down = true;
                for id in std::mem::take(&mut m.queued).into_keys() {
                    expect.push(Outcome::Rejected {
                        id,
                        reason: DropReason::RejectedShuttingDown,
                    });
                }
            }
            Command::Tick => {}
            // Bulk holdings are a cluster's (tests/bulk.rs); the model never issues them.
            Command::Hold { .. } | Command::Served { .. } => {
                prop_assert!(false, "not generated: {:?}", cmd)
            }
        }
        prop_assert!(
            rest.len() >= expect.len(),
            "missing {:?} in {:?}",
            expect,
            out
        );
        prop_assert_eq!(&rest[..expect.len()], &expect[..], "answer to {:?}", cmd);
        rest = &rest[expect.len()..];

        // Phase 3: dispatches and evictions, checked against the invariants.
        let mut evictions = 0;
        for o in rest {
            match o {
                Outcome::Dispatched { id } => {
                    let r = m.queued.remove(id);
                    prop_assert!(
                        r.is_some(),
                        "dispatched {} which is not queued (double/lost)",
                        id
                    );
                    let Some(r) = r else { unreachable!() };
                    prop_assert!(
                        m.queued.values().all(|o| o.priority <= r.priority),
                        "strict priority violated by {} (p{})",
                        id,
                        r.priority
                    );
                    prop_assert!(
                        r.deadline.is_none_or(|d| now < d),
                        "dispatched {} past deadline",
                        id
                    );
                    prop_assert!(
                        m.allows_dispatch(),
                        "dispatched {} while saturated ({})",
                        id,
                        m.saturation()
                    );
                    m.dispatch_counter += 1;
                    m.inflight.insert(*id, (r, m.dispatch_counter));
                }
                Outcome::Evicted { id, reason } => {
                    prop_assert_eq!(*reason, DropReason::Evicted);
                    prop_assert!(m.cfg.eviction.enabled);
                    prop_assert!(!m.allows_dispatch(), "evicted while not saturated");
                    prop_assert!(
                        m.last_eviction
                            .is_none_or(|t| now >= t + m.cfg.eviction.grace)
                            || evictions > 0
                    );
                    evictions += 1;
                    prop_assert!(evictions <= 2);
                    // Lowest priority, then newest dispatch, among sheddable in-flight requests
                    // the data plane can abort.
                    let best = m
                        .inflight
                        .iter()
                        .filter(|(i, (r, _))| r.priority < 0 && m.abortable.contains(*i))
                        .min_by_key(|(_, (r, order))| (r.priority, std::cmp::Reverse(*order)))
                        .map(|(i, _)| *i);
                    prop_assert_eq!(best, Some(*id));
                    let Some((r, _)) = m.inflight.remove(id) else {
                        unreachable!()
                    };
                    let top = m.queued.values().map(|q| q.priority).max();
                    prop_assert!(
                        top.is_some_and(|t| t > r.priority),
                        "evicted {} without a higher waiter",
                        id
                    );
                    m.last_eviction = Some(now);
                }
                other => prop_assert!(false, "unexpected outcome {:?} after {:?}", other, cmd),
            }
        }

        // After the step. An id may be reused once it has left: forget what it was.
        let inflight = &m.inflight;
        m.abortable.retain(|i| inflight.contains_key(i));
        prop_assert!(
            m.queued.is_empty() || !m.allows_dispatch(),
            "work-conserving: {} queued while saturation {} < {}",
            m.queued.len(),
            m.saturation(),
            m.threshold()
        );
        prop_assert!(
            m.queued
                .values()
                .all(|r| r.deadline.is_none_or(|d| d > now))
        );
        check_views(&fc, &m, &ids)?;
    }
    // Every request is accounted for: the machine knows exactly the model's queued/in-flight ids.
    check_views(&fc, &m, &ids)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn state_machine_matches_model(cfg in config(), ops in prop::collection::vec(op(), 1..160)) {
        run(cfg, ops)?;
    }
}

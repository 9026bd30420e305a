//! The controller's inner structures: queued and in-flight entries, flows, the per-band fairness
//! schedulers, bands and the pool's last observation.

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use super::{RequestId, pairs};
use crate::config::BandSettings;
use crate::policy::{Charge, FairnessPolicy, ProgramAwareParams};
use crate::saturation::EndpointSnapshot;
use crate::units::Nanos;

/// f64 with a total order, for the weighted scheduler's (pass, flow) set.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
pub(super) struct Pass(f64);

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

pub(super) type OrdKey = (u64, u64);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Queued {
    pub(super) flow: u32,
    pub(super) key: OrdKey,
    pub(super) bytes: u64,
    pub(super) tokens: u64,
    pub(super) deadline: Nanos,
    pub(super) enqueued_at: Nanos,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct InFlight {
    pub(super) flow: u32,
    pub(super) priority: i32,
    pub(super) tokens: u64,
    pub(super) dispatch_seq: u64,
    /// Requests the record stands for: 1, or a replica's bulk holding ([`super::Command::Hold`]).
    #[serde(default = "one")]
    pub(super) requests: u64,
    /// When it was dispatched (one request; not a bulk holding), for the service time.
    #[serde(default)]
    pub(super) dispatched_at: Option<Nanos>,
}

fn one() -> u64 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Flow {
    pub(super) fairness_id: String,
    pub(super) priority: i32,
    pub(super) band: u32,
    #[serde(with = "pairs")]
    pub(super) queue: BTreeMap<OrdKey, RequestId>,
    pub(super) queued_bytes: u64,
    pub(super) inflight: u32,
    pub(super) weight: f64,
    pub(super) pass: f64,
}

impl Flow {
    pub(super) fn head(&self) -> Option<OrdKey> {
        self.queue.first_key_value().map(|(k, _)| *k)
    }
}

/// A program's standing under `program-aware-fairness`: its attained service (tokens of its
/// completed requests, decayed while it is idle) and whether it is active.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct Program {
    pub(super) service: f64,
    /// When `service` was last accrued or decayed (the half-life's anchor).
    pub(super) anchor: Nanos,
    pub(super) last_completion: Nanos,
    /// Its flow in the band has queued requests.
    pub(super) waiting: bool,
    pub(super) inflight: u32,
    /// `turn-priority`: requests dispatched since the program (re)started; its turn is one more.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(super) turns: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum Sched {
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
    /// `program-aware-fairness`: the non-empty flows, and every known program's standing by
    /// fairness id.
    Las {
        active: BTreeSet<u32>,
        #[serde(with = "pairs")]
        programs: BTreeMap<String, Program>,
        params: ProgramAwareParams,
    },
}

/// `(v − lo) / (hi − lo)`, 0.5 when every value is equal (llm-d's `rangeNormalize`).
fn range_normalize(v: f64, lo: f64, hi: f64) -> f64 {
    if hi == lo { 0.5 } else { (v - lo) / (hi - lo) }
}

impl Sched {
    pub(super) fn new(policy: &FairnessPolicy) -> Sched {
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
            FairnessPolicy::ProgramAware(p) => Sched::Las {
                active: BTreeSet::new(),
                programs: BTreeMap::new(),
                params: p.clone(),
            },
        }
    }

    /// Keep the index in step with a flow whose head went from `old` to `new`.
    pub(super) fn head_changed(
        &mut self,
        flow: &mut Flow,
        fi: u32,
        old: Option<OrdKey>,
        new: Option<OrdKey>,
    ) {
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
            Sched::Las {
                active, programs, ..
            } => match (old, new) {
                (None, Some(_)) => {
                    active.insert(fi);
                    programs
                        .entry(flow.fairness_id.clone())
                        .or_default()
                        .waiting = true;
                }
                (Some(_), None) => {
                    active.remove(&fi);
                    if let Some(p) = programs.get_mut(&flow.fairness_id) {
                        p.waiting = false;
                    }
                }
                _ => {}
            },
        }
    }

    /// The flow to serve next (the band has at least one non-empty flow); `flows` and `queued`
    /// are the controller's, `now` its clock.
    pub(super) fn pick(
        &mut self,
        flows: &[Option<Flow>],
        queued: &BTreeMap<RequestId, Queued>,
        now: Nanos,
    ) -> Option<u32> {
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
            Sched::Las {
                active,
                programs,
                params,
            } => las_pick(active, programs, params, flows, queued, now),
        }
    }

    /// `program-aware-fairness`: each known program's attained service (none for other policies).
    pub(super) fn attained(&self) -> Vec<(&str, f64)> {
        match self {
            Sched::Las { programs, .. } => programs
                .iter()
                .map(|(id, p)| (id.as_str(), p.service))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `n` in-flight requests of `flow` ended; `actual`: their tokens, when they completed.
    pub(super) fn released(&mut self, flow: &Flow, n: u64, actual: Option<u64>, now: Nanos) {
        if let Sched::Las { programs, .. } = self
            && let Some(p) = programs.get_mut(&flow.fairness_id)
        {
            p.inflight = p
                .inflight
                .saturating_sub(u32::try_from(n).unwrap_or(u32::MAX));
            if let Some(tokens) = actual {
                p.service += tokens as f64;
                p.anchor = now;
                p.last_completion = now;
            }
        }
    }

    /// Charge a dispatch to an active flow (weighted; program-aware counts it in flight), before
    /// its head changes.
    pub(super) fn charge(&mut self, flow: &mut Flow, fi: u32, tokens: u64) {
        self.charge_n(flow, fi, 1, tokens);
    }

    /// [`Sched::charge`] for `n` requests of `tokens` between them (a bulk holding).
    pub(super) fn charge_n(&mut self, flow: &mut Flow, fi: u32, n: u64, tokens: u64) {
        if let Sched::Las {
            programs, params, ..
        } = self
        {
            let p = programs.entry(flow.fairness_id.clone()).or_default();
            p.inflight = p
                .inflight
                .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
            if params.turn_priority() {
                p.turns = p.turns.saturating_add(n);
            }
            return;
        }
        if let Sched::Weighted {
            active,
            vtime,
            charge,
        } = self
        {
            let cost = match charge {
                Charge::Requests => n as f64,
                Charge::Tokens => tokens.max(n) as f64,
            };
            active.remove(&(Pass(flow.pass), fi));
            *vtime = vtime.max(flow.pass);
            flow.pass += cost / flow.weight;
            active.insert((Pass(flow.pass), fi));
        }
    }

    /// Credit a program's attained service with `actual` tokens its requests used
    /// (`program-aware-fairness`; requests that ended as part of a bulk holding).
    pub(super) fn served(&mut self, fairness_id: &str, actual: u64, now: Nanos) {
        if let Sched::Las { programs, .. } = self
            && let Some(p) = programs.get_mut(fairness_id)
        {
            p.service += actual as f64;
            p.anchor = now;
            p.last_completion = now;
        }
    }

    /// Correct a token charge once the actual count is known.
    pub(super) fn settle(&mut self, flow: &mut Flow, fi: u32, charged: u64, actual: u64) {
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

/// `program-aware-fairness`'s pick: idle programs lose service (and long-idle ones are
/// forgotten), then the waiting flow with the best score wins — `las`: `wS · (1 −
/// norm(service)) + wW · norm(head wait)`; `turn-priority`: `turn + w · head wait (s)`, after
/// programs inactive for long enough restart at turn 1. Ties go to the lowest flow index
/// (deterministic).
fn las_pick(
    active: &BTreeSet<u32>,
    programs: &mut BTreeMap<String, Program>,
    params: &ProgramAwareParams,
    flows: &[Option<Flow>],
    queued: &BTreeMap<RequestId, Queued>,
    now: Nanos,
) -> Option<u32> {
    let ttl = (params.eviction_ttl_seconds * 1e9) as Nanos;
    programs.retain(|_, p| {
        if p.waiting || p.inflight > 0 {
            return true;
        }
        if params.las_half_life_seconds > 0.0 {
            let elapsed = now.saturating_sub(p.anchor) as f64 / 1e9;
            if elapsed > 0.0 {
                p.service *= 0.5f64.powf(elapsed / params.las_half_life_seconds);
                p.anchor = now;
            }
        } else {
            p.service *= params.las_decay_factor;
        }
        ttl == 0 || now.saturating_sub(p.last_completion) < ttl
    });
    if params.turn_priority() {
        return turn_pick(active, programs, params, flows, queued, now);
    }
    let mut entries = Vec::with_capacity(active.len());
    for &fi in active {
        let Some(flow) = flows.get(fi as usize).and_then(Option::as_ref) else {
            continue;
        };
        let service = programs.get(&flow.fairness_id).map_or(0.0, |p| p.service);
        entries.push((fi, service, head_wait(flow, queued, now) as f64));
    }
    let bounds = |f: fn(&(u32, f64, f64)) -> f64| {
        entries
            .iter()
            .map(f)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            })
    };
    let (s_lo, s_hi) = bounds(|e| e.1);
    let (w_lo, w_hi) = bounds(|e| e.2);
    let mut best: Option<(u32, f64)> = None;
    for &(fi, service, wait) in &entries {
        let score = params.las_weight_service * (1.0 - range_normalize(service, s_lo, s_hi))
            + params.las_weight_head_wait * range_normalize(wait, w_lo, w_hi);
        if best.is_none_or(|(_, b)| score > b) {
            best = Some((fi, score));
        }
    }
    best.map(|b| b.0)
}

/// How long `flow`'s head request has waited.
fn head_wait(flow: &Flow, queued: &BTreeMap<RequestId, Queued>, now: Nanos) -> Nanos {
    let head_at = flow
        .queue
        .first_key_value()
        .and_then(|(_, id)| queued.get(id))
        .map_or(now, |q| q.enqueued_at);
    now.saturating_sub(head_at)
}

/// `turn-priority`'s pick (see [`las_pick`]).
fn turn_pick(
    active: &BTreeSet<u32>,
    programs: &mut BTreeMap<String, Program>,
    params: &ProgramAwareParams,
    flows: &[Option<Flow>],
    queued: &BTreeMap<RequestId, Queued>,
    now: Nanos,
) -> Option<u32> {
    let inactivity = (params.turn_priority_inactivity_seconds * 1e9) as Nanos;
    if inactivity > 0 {
        for p in programs.values_mut() {
            if p.inflight == 0 && now.saturating_sub(p.last_completion) > inactivity {
                p.turns = 0;
            }
        }
    }
    let mut best: Option<(u32, f64)> = None;
    for &fi in active {
        let Some(flow) = flows.get(fi as usize).and_then(Option::as_ref) else {
            continue;
        };
        let turns = programs.get(&flow.fairness_id).map_or(0, |p| p.turns);
        let wait = head_wait(flow, queued, now) as f64 / 1e9;
        let score = (turns + 1) as f64 + params.turn_priority_time_weight * wait;
        if best.is_none_or(|(_, b)| score > b) {
            best = Some((fi, score));
        }
    }
    best.map(|b| b.0)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Band {
    pub(super) priority: i32,
    pub(super) settings: BandSettings,
    pub(super) sched: Sched,
    pub(super) queued: u64,
    pub(super) queued_bytes: u64,
    pub(super) inflight: u64,
    pub(super) inflight_tokens: u64,
    /// Recent arrivals, for the demand reserve of the bands below.
    #[serde(default)]
    pub(super) recent: super::reserve::Recent,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) enum Pool {
    Endpoints(Vec<EndpointSnapshot>),
    Fixed { saturation: f64, endpoints: u32 },
}

impl Pool {
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Pool::Endpoints(v) => v.is_empty(),
            Pool::Fixed { endpoints, .. } => *endpoints == 0,
        }
    }
}

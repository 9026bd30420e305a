//! The controller's inner structures: queued and in-flight entries, flows, the per-band fairness
//! schedulers, bands and the pool's last observation.

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use super::{RequestId, pairs};
use crate::config::BandSettings;
use crate::policy::{Charge, FairnessPolicy};
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
        }
    }

    /// The flow to serve next (the band has at least one non-empty flow).
    pub(super) fn pick(&mut self) -> Option<u32> {
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
    pub(super) fn charge(&mut self, flow: &mut Flow, fi: u32, tokens: u64) {
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Band {
    pub(super) priority: i32,
    pub(super) settings: BandSettings,
    pub(super) sched: Sched,
    pub(super) queued: u64,
    pub(super) queued_bytes: u64,
    pub(super) inflight: u64,
    pub(super) inflight_tokens: u64,
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

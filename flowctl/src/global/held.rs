//! Bulk holdings ([`super::FlowCmd::Held`]): a member's credit admissions as counts per (flow, pod),
//! one controller record per row; a lost life's rows kept until the pods vouch for them.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{GlobalFlow, MemberId, QUARANTINE_MAX_MS, RECONCILE_MIN_AGE_MS};
use crate::machine::{Command, FlowKey, RequestId, pairs};

/// A member's requests of one flow on one pod (`None`: not routed yet) admitted on local credit
/// and still running, as it counts them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRow {
    pub flow: FlowKey,
    pub pod: Option<String>,
    pub requests: u64,
    pub tokens: u64,
}

/// Requests of one flow held in bulk that ended since the member's previous report: estimated
/// at `charged` tokens, using `actual`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedRow {
    pub flow: FlowKey,
    pub requests: u64,
    pub charged: u64,
    pub actual: u64,
}

/// A bulk holding: its controller record and counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Holding {
    id: RequestId,
    requests: u64,
    tokens: u64,
}

/// One member life's bulk holdings, by (flow, pod).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub(super) struct Holdings {
    #[serde(with = "pairs")]
    pub(super) rows: BTreeMap<(FlowKey, Option<String>), Holding>,
}

impl GlobalFlow {
    /// Members' bulk holdings: (member, incarnation, flow, pod, requests, tokens).
    pub fn holdings(
        &self,
    ) -> impl Iterator<Item = (MemberId, u64, &FlowKey, Option<&str>, u64, u64)> + '_ {
        self.held.iter().flat_map(|((m, life), h)| {
            h.rows.iter().map(move |((flow, pod), r)| {
                (*m, *life, flow, pod.as_deref(), r.requests, r.tokens)
            })
        })
    }

    /// [`super::FlowCmd::Held`]: set the member's changed rows, credit its demand, correct charges.
    pub(super) fn held(
        &mut self,
        member: MemberId,
        version: u64,
        full: bool,
        admitted: u64,
        rows: Vec<HeldRow>,
        served: Vec<ServedRow>,
    ) -> bool {
        let Some(m) = self.members.get_mut(&member) else {
            return false;
        };
        if version <= m.held_version {
            return false;
        }
        m.held_version = version;
        let new = admitted.saturating_sub(m.held_admitted);
        m.held_admitted = m.held_admitted.max(admitted);
        m.demand = m.demand.saturating_add(new);
        m.admitted_local = m.admitted_local.saturating_add(new);
        let life = m.incarnation;
        for s in served {
            self.run(Command::Served {
                flow: s.flow,
                requests: s.requests,
                charged: s.charged,
                actual: s.actual,
            });
        }
        let life = (member, life);
        if full {
            let listed: BTreeSet<(&FlowKey, &Option<String>)> =
                rows.iter().map(|r| (&r.flow, &r.pod)).collect();
            let gone: Vec<(FlowKey, Option<String>)> = self
                .held
                .get(&life)
                .into_iter()
                .flat_map(|h| h.rows.keys())
                .filter(|(f, p)| !listed.contains(&(f, p)))
                .cloned()
                .collect();
            for row in gone {
                self.set_holding(life, row, 0, 0);
            }
        }
        for r in rows {
            self.set_holding(life, (r.flow, r.pod), r.requests, r.tokens);
        }
        true
    }

    /// Set one holding (0 requests removes it): the controller's record, the pods' load.
    fn set_holding(
        &mut self,
        life: (MemberId, u64),
        row: (FlowKey, Option<String>),
        requests: u64,
        tokens: u64,
    ) {
        let old = self.held.get(&life).and_then(|h| h.rows.get(&row)).copied();
        let (id, old_n, old_t) = match old {
            Some(h) => (h.id, h.requests, h.tokens),
            None if requests == 0 => return,
            None => {
                let id = self.next_id;
                self.next_id += 1;
                (id, 0, 0)
            }
        };
        if (old_n, old_t) == (requests, tokens) {
            return;
        }
        let (member, (flow, pod)) = (&life.0, &row);
        self.run(Command::Hold {
            id,
            flow: flow.clone(),
            requests,
            tokens,
        });
        if let Some(pod) = pod {
            let owner = (pod.clone(), *member);
            for load in [
                self.pods.entry(pod.clone()).or_default(),
                self.pod_owner.entry(owner.clone()).or_default(),
            ] {
                load.requests = load.requests.saturating_sub(old_n).saturating_add(requests);
                load.tokens = load.tokens.saturating_sub(old_t).saturating_add(tokens);
            }
            if self.pods.get(pod).is_some_and(|l| l.requests == 0) {
                self.pods.remove(pod);
            }
            if self.pod_owner.get(&owner).is_some_and(|l| l.requests == 0) {
                self.pod_owner.remove(&owner);
            }
        }
        if requests == 0 {
            if let Some(h) = self.held.get_mut(&life) {
                h.rows.remove(&row);
                if h.rows.is_empty() {
                    self.held.remove(&life);
                }
            }
        } else {
            self.held.entry(life).or_default().rows.insert(
                row,
                Holding {
                    id,
                    requests,
                    tokens,
                },
            );
        }
    }

    /// Lost lives' unrouted rows, [`QUARANTINE_MAX_MS`] after the life ended: nothing tells
    /// where they run, so the pods cannot vouch for them; released like unreported credit.
    pub(super) fn release_unrouted_lost(&mut self) {
        let horizon = self.now_us.saturating_sub(QUARANTINE_MAX_MS * 1000);
        let lives: Vec<(MemberId, u64)> = self
            .held_lost
            .iter()
            .filter(|(_, at)| **at <= horizon)
            .map(|(life, _)| *life)
            .collect();
        for life in lives {
            let unrouted: Vec<(FlowKey, Option<String>)> = self
                .held
                .get(&life)
                .into_iter()
                .flat_map(|h| h.rows.keys())
                .filter(|(_, pod)| pod.is_none())
                .cloned()
                .collect();
            for row in unrouted {
                self.set_holding(life, row, 0, 0);
            }
            if !self.held.contains_key(&life) {
                self.held_lost.remove(&life);
            }
        }
    }

    /// Release up to `n` requests of lost lives' rows on `pod` whose life ended at least
    /// [`RECONCILE_MIN_AGE_MS`] ago (oldest life first); returns how many.
    pub(super) fn ease_lost_rows(&mut self, pod: &str, n: u64) -> u64 {
        let old_enough = self.now_us.saturating_sub(RECONCILE_MIN_AGE_MS * 1000);
        let mut lives: Vec<(u64, (MemberId, u64))> = self
            .held_lost
            .iter()
            .filter(|(_, at)| **at <= old_enough)
            .map(|(life, at)| (*at, *life))
            .collect();
        lives.sort_unstable();
        let mut left = n;
        for (_, life) in lives {
            let rows: Vec<((FlowKey, Option<String>), Holding)> = self
                .held
                .get(&life)
                .into_iter()
                .flat_map(|h| h.rows.iter())
                .filter(|((_, p), _)| p.as_deref() == Some(pod))
                .map(|(k, h)| (k.clone(), *h))
                .collect();
            for (row, h) in rows {
                if left == 0 {
                    break;
                }
                let take = h.requests.min(left);
                let keep = h.requests - take;
                // Tokens leave in proportion (the rows do not know each request's).
                let tokens = h.tokens.saturating_mul(keep) / h.requests.max(1);
                self.set_holding(life, row, keep, tokens);
                left -= take;
            }
            if !self.held.contains_key(&life) {
                self.held_lost.remove(&life);
            }
        }
        n - left
    }
}

//! `/debug/flow` in cluster mode: this replica's side of cluster-wide flow control and the
//! replicated global state (queue, credit, ledger).

use std::collections::BTreeMap;

use flowctl::global::GlobalParams;
use serde::Serialize;

use super::GlobalGate;
use crate::cluster::options::PartitionMode;

impl GlobalGate {
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
                unreported: st.unreported(),
                held: st.held.own.len(),
                waiting: st.waiting.len(),
                credit_wait: st.parked.len(),
                outbox: st.outbox.len(),
                fast_path: st.fast,
                slow_path: st.slow,
                credit_waits: st.credit_waits,
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
    /// Credit admissions running here, counted in bulk.
    pub held: usize,
    /// Requests held for a verdict (the queue's, or credit; `credit_wait` of them wait for
    /// credit).
    pub waiting: usize,
    pub credit_wait: usize,
    pub outbox: usize,
    /// Admissions by path (a request that waited for credit counts once it got it, or the
    /// queue); `credit_waits` requests waited for credit.
    pub fast_path: u64,
    pub slow_path: u64,
    pub credit_waits: u64,
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
    /// Credit of lives whose lease ended or that restarted, still held (see `flowctl::global`).
    pub quarantined_credit: u64,
    pub members: BTreeMap<u64, flowctl::global::MemberFlow>,
    pub bands: Vec<flowctl::BandStats>,
    pub flows: Vec<FlowRow>,
    /// Per-pod in-flight load from the ledger.
    pub pods: BTreeMap<String, flowctl::global::PodLoad>,
    /// The oldest ledger entries in flight (at most 100): `[owner, seq, request key, pod]`.
    pub oldest_inflight: Vec<(u64, u64, String, Option<String>)>,
    /// Members' credit admissions held in bulk (at most 1000 rows).
    pub held: Vec<HeldView>,
}

#[derive(Debug, Serialize)]
pub struct HeldView {
    pub member: u64,
    pub incarnation: u64,
    pub fairness_id: String,
    pub priority: i32,
    pub pod: Option<String>,
    pub requests: u64,
    pub tokens: u64,
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
            quarantined_credit: f.quarantined_credit(),
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
            held: f
                .holdings()
                .take(1000)
                .map(
                    |(member, incarnation, flow, pod, requests, tokens)| HeldView {
                        member,
                        incarnation,
                        fairness_id: flow.fairness_id.clone(),
                        priority: flow.priority,
                        pod: pod.map(str::to_string),
                        requests,
                        tokens,
                    },
                )
                .collect(),
        }
    }
}

//! A replicated cluster state driven by hand: members, heartbeats, batches, pool reports.

use std::collections::BTreeMap;

use flowctl::cluster::{ClusterCommand, ClusterOutput, ClusterState, FEATURE_HELD};
use flowctl::global::{Ask, FlowCmd, GlobalParams, Verdict};
use flowctl::{EndpointSnapshot, FlowKey};

use super::slots_config;

pub const US_PER_MS: u64 = 1000;

pub struct Cluster {
    pub s: ClusterState,
    pub now_ms: u64,
    pub seq: BTreeMap<u64, u64>,
    /// Members' incarnations (7 until they restart).
    pub inc: BTreeMap<u64, u64>,
}

pub fn ask(tenant: &str, priority: i32) -> Ask {
    Ask {
        flow: FlowKey::new(tenant, priority),
        bytes: 100,
        tokens: 10,
        ttl: Some(0),
        slo_ttft: None,
    }
}

impl Cluster {
    /// `members` replicas, `endpoints` endpoints of `slots` requests each, the given bands.
    pub fn new(
        members: &[u64],
        slots: u64,
        endpoints: usize,
        bands: Vec<flowctl::BandConfig>,
        params: GlobalParams,
    ) -> Cluster {
        let mut c = Cluster {
            s: ClusterState::default(),
            now_ms: 1_000,
            seq: BTreeMap::new(),
            inc: BTreeMap::new(),
        };
        c.heartbeat(members);
        let out = c.s.apply(ClusterCommand::ConfigureFlow {
            config: Box::new(slots_config(slots, bands)),
            params,
        });
        assert_eq!(out, ClusterOutput::Configured(true));
        c.s.apply(ClusterCommand::ObservePool {
            now_us: c.now_ms * US_PER_MS,
            endpoints: vec![EndpointSnapshot::default(); endpoints],
            observed: vec![],
        });
        c
    }

    pub fn heartbeat(&mut self, members: &[u64]) {
        for &m in members {
            self.s.apply(ClusterCommand::Heartbeat {
                node: m,
                now_ms: self.now_ms,
                ext_proc: String::new(),
                admin: String::new(),
                started_ms: self.incarnation(m),
                features: FEATURE_HELD,
            });
        }
    }

    pub fn incarnation(&self, node: u64) -> u64 {
        self.inc.get(&node).copied().unwrap_or(7)
    }

    /// `node` restarts: a new incarnation numbering its requests from 1 again.
    pub fn restart(&mut self, node: u64) {
        *self.inc.entry(node).or_insert(7) += 1;
        self.seq.remove(&node);
        self.heartbeat(&[node]);
    }

    /// The leader's pool report: `endpoints` endpoints, `observed` requests on each pod.
    pub fn observe(&mut self, endpoints: usize, observed: &[(&str, u64)]) {
        self.s.apply(ClusterCommand::ObservePool {
            now_us: self.now_ms * US_PER_MS,
            endpoints: vec![EndpointSnapshot::default(); endpoints],
            observed: observed.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
        });
    }

    /// `ms` pass with the pods (`endpoints` of them) reporting just what the ledger routed to them,
    /// `up` heartbeating: orphans and quarantined credit are eased.
    pub fn quiet_pods(&mut self, endpoints: usize, up: &[u64], ms: u64) {
        for _ in 0..ms / 100 {
            self.now_ms += 100;
            self.heartbeat(up);
            let mut seen: Vec<(String, u64)> = (self.s.flow().unwrap().pods().iter())
                .map(|(p, l)| (p.clone(), l.requests))
                .collect();
            for i in seen.len()..endpoints {
                seen.push((format!("idle-{i}"), 0));
            }
            self.s.apply(ClusterCommand::ObservePool {
                now_us: self.now_ms * US_PER_MS,
                endpoints: vec![EndpointSnapshot::default(); endpoints],
                observed: seen,
            });
        }
    }

    pub fn credit(&self, node: u64) -> u32 {
        self.s.flow().unwrap().member(node).map_or(0, |m| m.credit)
    }

    pub fn quarantined(&self) -> u64 {
        self.s.flow().unwrap().quarantined_credit()
    }

    pub fn batch(&mut self, node: u64, cmds: Vec<FlowCmd>) -> ClusterOutput {
        self.batch_as(node, self.incarnation(node), cmds)
    }

    pub fn batch_as(&mut self, node: u64, incarnation: u64, cmds: Vec<FlowCmd>) -> ClusterOutput {
        self.s.apply(ClusterCommand::Flow {
            node,
            incarnation,
            now_us: self.now_ms * US_PER_MS,
            cmds,
        })
    }

    pub fn next_seq(&mut self, node: u64) -> u64 {
        let s = self.seq.entry(node).or_default();
        *s += 1;
        *s
    }

    /// Enqueue one request of `tenant` at `node`; returns its key.
    pub fn enqueue(&mut self, node: u64, tenant: &str, priority: i32, rid: &str) -> (u64, u64) {
        let seq = self.next_seq(node);
        self.batch(
            node,
            vec![FlowCmd::Enqueue {
                seq,
                request_id: rid.to_string(),
                ask: ask(tenant, priority),
            }],
        );
        (node, seq)
    }

    pub fn settle(&mut self, node: u64, rid: &str) -> ClusterOutput {
        self.batch(
            node,
            vec![FlowCmd::Settle {
                request_id: rid.to_string(),
                actual_tokens: None,
            }],
        )
    }

    pub fn verdict(&self, key: (u64, u64)) -> Option<Verdict> {
        self.s.flow().unwrap().verdict(key, self.incarnation(key.0))
    }

    pub fn inflight(&self) -> u64 {
        self.s.flow().unwrap().totals().inflight_requests
    }
}

//! Cluster-wide flow control (`flowctl::global` inside `flowctl::cluster::ClusterState`): fairness
//! and strict priority across owners, the local-credit fast path and its bound (I1), lease expiry
//! and restarts returning everything (I4), settlement from any replica, retried batches,
//! determinism.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

mod common;

use common::*;
use flowctl::cluster::{ClusterCommand, ClusterOutput, ClusterState};
use flowctl::global::{Ask, FlowCmd, GlobalParams, Verdict};
use flowctl::{
    DropReason, EndpointSnapshot, FairnessPolicy, FlowKey, OrderingPolicy, WeightedFairnessParams,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, VecDeque};

const US_PER_MS: u64 = 1000;

struct Cluster {
    s: ClusterState,
    now_ms: u64,
    seq: BTreeMap<u64, u64>,
    /// Members' incarnations (7 until they restart).
    inc: BTreeMap<u64, u64>,
}

fn ask(tenant: &str, priority: i32) -> Ask {
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
    fn new(
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

    fn heartbeat(&mut self, members: &[u64]) {
        for &m in members {
            self.s.apply(ClusterCommand::Heartbeat {
                node: m,
                now_ms: self.now_ms,
                ext_proc: String::new(),
                admin: String::new(),
                started_ms: self.incarnation(m),
            });
        }
    }

    fn incarnation(&self, node: u64) -> u64 {
        self.inc.get(&node).copied().unwrap_or(7)
    }

    /// `node` restarts: a new incarnation numbering its requests from 1 again.
    fn restart(&mut self, node: u64) {
        *self.inc.entry(node).or_insert(7) += 1;
        self.seq.remove(&node);
        self.heartbeat(&[node]);
    }

    /// The leader's pool report: `endpoints` endpoints, `observed` requests on each pod.
    fn observe(&mut self, endpoints: usize, observed: &[(&str, u64)]) {
        self.s.apply(ClusterCommand::ObservePool {
            now_us: self.now_ms * US_PER_MS,
            endpoints: vec![EndpointSnapshot::default(); endpoints],
            observed: observed.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
        });
    }

    /// `ms` pass with the pods (`endpoints` of them) reporting just what the ledger routed to them,
    /// `up` heartbeating: orphans and quarantined credit are eased.
    fn quiet_pods(&mut self, endpoints: usize, up: &[u64], ms: u64) {
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

    fn credit(&self, node: u64) -> u32 {
        self.s.flow().unwrap().member(node).map_or(0, |m| m.credit)
    }

    fn quarantined(&self) -> u64 {
        self.s.flow().unwrap().quarantined_credit()
    }

    fn batch(&mut self, node: u64, cmds: Vec<FlowCmd>) -> ClusterOutput {
        self.batch_as(node, self.incarnation(node), cmds)
    }

    fn batch_as(&mut self, node: u64, incarnation: u64, cmds: Vec<FlowCmd>) -> ClusterOutput {
        self.s.apply(ClusterCommand::Flow {
            node,
            incarnation,
            now_us: self.now_ms * US_PER_MS,
            cmds,
        })
    }

    fn next_seq(&mut self, node: u64) -> u64 {
        let s = self.seq.entry(node).or_default();
        *s += 1;
        *s
    }

    /// Enqueue one request of `tenant` at `node`; returns its key.
    fn enqueue(&mut self, node: u64, tenant: &str, priority: i32, rid: &str) -> (u64, u64) {
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

    fn settle(&mut self, node: u64, rid: &str) -> ClusterOutput {
        self.batch(
            node,
            vec![FlowCmd::Settle {
                request_id: rid.to_string(),
                actual_tokens: None,
            }],
        )
    }

    fn verdict(&self, key: (u64, u64)) -> Option<Verdict> {
        self.s.flow().unwrap().verdict(key, self.incarnation(key.0))
    }

    fn inflight(&self) -> u64 {
        self.s.flow().unwrap().totals().inflight_requests
    }
}

/// Tenant A's requests reach only replica 1, B's only replica 2, both backlogged; one slot frees
/// per step (settled by replica 3, which saw the response). Returns A's dispatch share.
fn skewed_share(fairness: FairnessPolicy) -> f64 {
    let mut c = Cluster::new(
        &[1, 2, 3],
        4,
        1,
        vec![band(0, fairness, OrderingPolicy::Fcfs)],
        GlobalParams {
            credit_slack: 0,
            ..GlobalParams::default()
        },
    );
    let mut waiting: BTreeMap<(u64, u64), (&str, String)> = BTreeMap::new();
    let mut running: VecDeque<(String, &str)> = VecDeque::new();
    let mut count: BTreeMap<&str, u32> = BTreeMap::new();
    let mut rid = 0;
    for step in 0..1200 {
        c.now_ms += 1;
        if step % 100 == 0 {
            c.heartbeat(&[1, 2, 3]);
        }
        for (node, tenant) in [(1, "a"), (2, "b")] {
            // Replica 1 sees four times B's arrival rate: both stay backlogged.
            let backlog = if node == 1 { 40 } else { 10 };
            while waiting.values().filter(|(t, _)| *t == tenant).count() < backlog {
                rid += 1;
                let r = format!("r{rid}");
                let key = c.enqueue(node, tenant, 0, &r);
                waiting.insert(key, (tenant, r));
            }
        }
        if let Some((r, _)) = running.pop_front() {
            c.settle(3, &r);
        }
        let decided: Vec<(u64, u64)> = waiting
            .keys()
            .copied()
            .filter(|k| c.verdict(*k).is_some())
            .collect();
        for k in decided {
            assert_eq!(c.verdict(k), Some(Verdict::Dispatched));
            let (tenant, r) = waiting.remove(&k).unwrap();
            running.push_back((r, tenant));
            if step >= 200 {
                *count.entry(tenant).or_default() += 1;
            }
        }
        assert!(c.inflight() <= 4, "capacity 4, credit 0");
    }
    let a = f64::from(count["a"]);
    let b = f64::from(count["b"]);
    a / (a + b)
}

#[test]
fn round_robin_shares_hold_across_replicas() {
    let share = skewed_share(FairnessPolicy::RoundRobin);
    assert!(
        (share - 0.5).abs() <= 0.05,
        "A's share {share:.3}, want 0.50 ± 0.05"
    );
}

#[test]
fn weighted_shares_hold_across_replicas() {
    let share = skewed_share(FairnessPolicy::Weighted(WeightedFairnessParams {
        weights: [("a".to_string(), 1.0), ("b".to_string(), 3.0)].into(),
        default_weight: 1.0,
        charge: flowctl::Charge::Requests,
    }));
    assert!(
        (share - 0.25).abs() <= 0.05,
        "A's share {share:.3}, want 0.25 ± 0.05 (weights 1:3)"
    );
}

#[test]
fn strict_priority_across_replicas() {
    let mut c = Cluster::new(
        &[1, 2],
        1,
        1,
        vec![
            band(10, FairnessPolicy::RoundRobin, OrderingPolicy::Fcfs),
            band(0, FairnessPolicy::RoundRobin, OrderingPolicy::Fcfs),
        ],
        GlobalParams {
            credit_slack: 0,
            ..GlobalParams::default()
        },
    );
    let first = c.enqueue(1, "low", 0, "l0");
    assert_eq!(c.verdict(first), Some(Verdict::Dispatched), "pool idle");
    let lows: Vec<_> = (1..4)
        .map(|i| c.enqueue(1, "low", 0, &format!("l{i}")))
        .collect();
    let high = c.enqueue(2, "high", 10, "h0");
    assert_eq!(c.verdict(high), None, "the one slot is taken");
    c.settle(2, "l0");
    assert_eq!(c.verdict(high), Some(Verdict::Dispatched), "high first");
    assert!(lows.iter().all(|k| c.verdict(*k).is_none()));
    c.settle(1, "h0");
    assert_eq!(c.verdict(lows[0]), Some(Verdict::Dispatched));
}

#[test]
fn fast_path_admits_within_credit_then_queues() {
    let mut c = Cluster::new(
        &[1, 2],
        2,
        2,
        vec![],
        GlobalParams {
            credit_slack: 4,
            ..GlobalParams::default()
        },
    );
    // Replica 1 joined first and held all the credit: what replica 2's arrival took from it
    // stays held for a lease (replica 1 may have spent it), then replica 2 gets it.
    assert_eq!((c.credit(1), c.credit(2)), (2, 0));
    for _ in 0..3 {
        c.now_ms += 1000;
        c.heartbeat(&[1, 2]);
    }
    assert_eq!((c.credit(1), c.credit(2)), (2, 2));
    let f = c.s.flow().unwrap();
    assert!(f.fast_path_open(1, 0));
    // Replica 1 admits three on credit and reports them with their pods.
    let cmds = (1..=3)
        .map(|seq| FlowCmd::Admitted {
            seq,
            request_id: format!("f{seq}"),
            ask: ask("t", 0),
            pod: Some("10.0.0.1:8000".into()),
        })
        .collect();
    c.seq.insert(1, 3);
    assert!(matches!(c.batch(1, cmds), ClusterOutput::Flow(r) if r.applied == 3));
    let f = c.s.flow().unwrap();
    assert_eq!(f.totals().inflight_requests, 3);
    assert_eq!(f.pods()["10.0.0.1:8000"].requests, 3);
    assert_eq!(f.others_load(2)["10.0.0.1:8000"].requests, 3);
    assert!(
        f.others_load(1).is_empty(),
        "replica 1's own load is not 'others'"
    );
    assert!(f.fast_path_open(2, 0), "3 of 4 slots used");
    c.enqueue(2, "t", 0, "q1");
    let f = c.s.flow().unwrap();
    assert!(!f.fast_path_open(1, 0), "saturated: fast path closed");
    let queued = c.enqueue(2, "t", 0, "q2");
    assert_eq!(c.verdict(queued), None);
    c.settle(2, "f1");
    assert_eq!(c.verdict(queued), Some(Verdict::Dispatched));
    assert_eq!(c.s.flow().unwrap().pods()["10.0.0.1:8000"].requests, 2);
}

#[test]
fn expired_lease_returns_reservations_and_queue_entries() {
    let mut c = Cluster::new(
        &[1, 2],
        1,
        2,
        vec![],
        GlobalParams {
            credit_slack: 0,
            lease_ms: 300,
            ..GlobalParams::default()
        },
    );
    let a = c.enqueue(1, "t", 0, "a");
    let b = c.enqueue(1, "t", 0, "b");
    let waiting1 = c.enqueue(1, "t", 0, "c");
    let waiting2 = c.enqueue(2, "t", 0, "d");
    assert_eq!(c.verdict(a), Some(Verdict::Dispatched));
    assert_eq!(c.verdict(b), Some(Verdict::Dispatched));
    assert_eq!(c.inflight(), 2);
    // Replica 1 goes silent; replica 2 keeps heartbeating past the lease.
    for _ in 0..4 {
        c.now_ms += 100;
        c.heartbeat(&[2]);
    }
    assert_eq!(
        c.verdict(waiting1),
        Some(Verdict::Rejected(DropReason::RejectedSaturated))
    );
    // Replica 1 may have forwarded its two dispatches before it could report their pod.
    assert_eq!(
        c.verdict(waiting2),
        None,
        "replica 1's orphans hold the slots"
    );
    assert_eq!((c.inflight(), c.s.flow().unwrap().reclaimed()), (2, 1));
    // The pods run nothing beyond the ledger: the orphans were never forwarded.
    c.quiet_pods(2, &[2], 2500);
    assert_eq!(
        c.verdict(waiting2),
        Some(Verdict::Dispatched),
        "replica 1's slots returned to the pool"
    );
    assert_eq!(c.inflight(), 1);
    assert_eq!(c.s.flow().unwrap().reclaimed(), 3);
    assert_eq!(
        c.verdict(a),
        Some(Verdict::Rejected(DropReason::RejectedSaturated)),
        "replica 1, back from its partition, must not forward a released orphan"
    );
    // A late settlement of a reclaimed request is ignored, not double-counted.
    assert!(matches!(c.settle(2, "a"), ClusterOutput::Flow(r) if r.ignored == 1));
    assert_eq!(c.inflight(), 1);
}

#[test]
fn restart_voids_the_old_incarnation_and_retried_batches_are_ignored() {
    let mut c = Cluster::new(
        &[1, 2],
        4,
        1,
        vec![],
        GlobalParams {
            credit_slack: 0,
            ..GlobalParams::default()
        },
    );
    let cmd = vec![FlowCmd::Enqueue {
        seq: 1,
        request_id: "x".into(),
        ask: ask("t", 0),
    }];
    assert!(matches!(c.batch(1, cmd.clone()), ClusterOutput::Flow(r) if r.applied == 1));
    assert!(matches!(c.batch(1, cmd.clone()), ClusterOutput::Flow(r) if r.ignored == 1));
    assert_eq!(c.inflight(), 1);
    // Replica 1 restarts (new incarnation) and reuses sequence 1.
    assert!(matches!(c.batch_as(1, 8, cmd), ClusterOutput::Flow(r) if r.applied == 1));
    assert_eq!(
        c.inflight(),
        2,
        "the old life may have forwarded its dispatch"
    );
    c.inc.insert(1, 8);
    c.quiet_pods(1, &[1, 2], 2500);
    assert_eq!(c.inflight(), 1, "the old incarnation's reservation is gone");
    assert_eq!(c.s.flow().unwrap().reclaimed(), 1);
    assert_eq!(
        c.verdict((1, 1)),
        Some(Verdict::Dispatched),
        "the new life's verdict is left alone"
    );
}

/// A restarted member numbers its requests from 1 again: the verdicts its previous life got
/// (kept a minute for late readers) must not answer the new life's requests of the same number.
/// Found by the randomized chaos suite: a new request took its predecessor's "dispatched" (or the
/// reclaim's "rejected"), so the real entry, dispatched later, was never routed nor cancelled —
/// a slot leaked for good, and after a few restarts the pool was full of them.
#[test]
fn a_restarted_member_never_reads_its_previous_life_s_verdicts() {
    let mut c = Cluster::new(
        &[1, 2],
        1,
        1,
        vec![],
        GlobalParams {
            credit_slack: 0,
            ..GlobalParams::default()
        },
    );
    let enqueue = |seq: u64, rid: &str| FlowCmd::Enqueue {
        seq,
        request_id: rid.into(),
        ask: ask("t", 0),
    };
    // Life 7: seq 1 dispatched (the one slot), seq 2 queued behind it.
    c.batch(1, vec![enqueue(1, "old-1"), enqueue(2, "old-2")]);
    assert_eq!(c.verdict((1, 1)), Some(Verdict::Dispatched));
    let flow = |c: &Cluster| c.s.flow().unwrap().clone();
    // Life 8 has not reached the log yet: nothing is its.
    assert_eq!(flow(&c).verdict((1, 1), 8), None);
    assert!(flow(&c).member_as(1, 8).is_none());
    // Replica 2 takes the slot the reclaim frees; life 8's seq 1 and 2 must wait.
    c.batch_as(
        1,
        8,
        vec![FlowCmd::Cancel { seq: 0 }], // a batch that only announces the new life
    );
    assert_eq!(
        c.inflight(),
        1,
        "an orphan until the pods show it was not forwarded"
    );
    c.inc.insert(1, 8);
    c.quiet_pods(1, &[1, 2], 2500);
    assert_eq!(c.inflight(), 0, "the old life's reservation is reclaimed");
    c.enqueue(2, "t", 0, "other");
    c.batch_as(1, 8, vec![enqueue(1, "new-1"), enqueue(2, "new-2")]);
    let f = flow(&c);
    assert_eq!(
        f.verdict((1, 1), 8),
        None,
        "new seq 1 is queued, not the old dispatch"
    );
    assert_eq!(
        f.verdict((1, 2), 8),
        None,
        "new seq 2 is queued, not the reclaim's refusal"
    );
    assert!(f.member_as(1, 8).is_some() && f.member_as(1, 7).is_none());
    // Once the slot frees, the new seq 1 gets its own verdict.
    c.settle(2, "other");
    assert_eq!(flow(&c).verdict((1, 1), 8), Some(Verdict::Dispatched));
    assert_eq!(flow(&c).verdict((1, 2), 8), None);
}

#[test]
fn same_commands_same_state_and_snapshots_round_trip() {
    let run = || {
        let mut c = Cluster::new(
            &[1, 2, 3],
            2,
            1,
            vec![],
            GlobalParams {
                credit_slack: 3,
                ..GlobalParams::default()
            },
        );
        for i in 0..20 {
            c.now_ms += 7;
            c.enqueue(
                1 + i % 3,
                &format!("t{}", i % 4),
                i as i32 % 2,
                &format!("r{i}"),
            );
            if i % 3 == 0 {
                c.settle(2, &format!("r{}", i / 2));
            }
        }
        c.s
    };
    let a = serde_json::to_string(&run()).unwrap();
    let b = serde_json::to_string(&run()).unwrap();
    assert_eq!(a, b);
    let restored: ClusterState = serde_json::from_str(&a).unwrap();
    assert_eq!(serde_json::to_string(&restored).unwrap(), a);
}

/// What happens in [`admission_is_bounded_by_capacity_plus_slack`].
#[derive(Debug, Clone)]
enum Life {
    /// A request of tenant `.1` reaches member `.0`.
    Arrive(u8, u8),
    /// A member reports its local admissions.
    Flush(u8),
    /// The oldest running request completes (settled by a member that can reach the log).
    Complete(u8),
    /// Time passes: members that can reach the log report and heartbeat.
    Tick(u16),
    /// The leader proposes what the pods run.
    Observe,
    /// kill -9 and restart: what it admitted but never reported runs on, unseen by the ledger.
    Crash(u8),
    /// Cut off from the log: no heartbeats, no reports, verdicts unseen; it admits on the
    /// credit it last saw while its lease lasts.
    Cut(u8),
    Heal(u8),
}

fn life() -> impl Strategy<Value = Life> {
    prop_oneof![
        6 => (0u8..3, 0u8..3).prop_map(|(m, t)| Life::Arrive(m, t)),
        2 => (0u8..3).prop_map(Life::Flush),
        4 => (0u8..3).prop_map(Life::Complete),
        3 => (1u16..700).prop_map(Life::Tick),
        2 => Just(Life::Observe),
        1 => (0u8..3).prop_map(Life::Crash),
        1 => (0u8..3).prop_map(Life::Cut),
        1 => (0u8..3).prop_map(Life::Heal),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// I1 with the real protocol: members admit locally only while the replicated state says
    /// "would dispatch now" and their unreported admissions are below their credit; everything
    /// else queues. Whatever the interleaving, the requests actually running never exceed
    /// capacity + the credit slack, and nothing is dispatched twice — also when members die or
    /// are cut off with admissions they never reported (the randomized chaos suite saw 27 run
    /// against a bound of 24). A member admits on credit while its lease lasts whatever the
    /// others decided meanwhile, so neither the credit a rebalance takes from it nor what it
    /// held when its lease ended (or it restarted) may be granted to others while the pods may
    /// still run what it spent.
    #[test]
    fn admission_is_bounded_by_capacity_plus_slack(ops in proptest::collection::vec(life(), 1..400)) {
        const CAPACITY: u64 = 6;
        const SLACK: u32 = 5;
        const LEASE_MS: u64 = 1500;
        let mut c = Cluster::new(
            &[1, 2, 3],
            3,
            2,
            vec![],
            GlobalParams { credit_slack: SLACK, rebalance_ms: 200, lease_ms: LEASE_MS },
        );
        let members = [1u64, 2, 3];
        let mut unreported: BTreeMap<u64, Vec<FlowCmd>> = BTreeMap::new();
        let mut waiting: BTreeMap<(u64, u64), String> = BTreeMap::new();
        let mut running: VecDeque<String> = VecDeque::new();
        // Cut-off member → (when its lease began, the credit it last saw).
        let mut cut: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
        let mut last_heartbeat: BTreeMap<u64, u64> = members.iter().map(|m| (*m, c.now_ms)).collect();
        let mut seen = std::collections::BTreeSet::new();
        let mut rid = 0u64;
        for op in ops {
            match op {
                Life::Arrive(m, t) => {
                    let m = u64::from(m) + 1;
                    rid += 1;
                    let r = format!("r{rid}");
                    let pending = unreported.get(&m).map_or(0, Vec::len);
                    let local = match cut.get(&m) {
                        // Degraded: its last credit while its lease lasts, else a 429.
                        Some((from, credit)) => c.now_ms < from + LEASE_MS && pending < *credit as usize,
                        None => {
                            c.s.flow().unwrap().fast_path_open(m, 0) && pending < c.credit(m) as usize
                        }
                    };
                    let seq = c.next_seq(m);
                    if local {
                        unreported.entry(m).or_default().push(FlowCmd::Admitted {
                            seq,
                            request_id: r.clone(),
                            ask: ask(&format!("t{t}"), 0),
                            pod: Some("p".into()),
                        });
                        running.push_back(r);
                    } else if !cut.contains_key(&m) {
                        let mut cmds = unreported.remove(&m).unwrap_or_default();
                        cmds.push(FlowCmd::Enqueue { seq, request_id: r.clone(), ask: ask(&format!("t{t}"), 0) });
                        c.batch(m, cmds);
                        waiting.insert((m, seq), r);
                    }
                }
                Life::Flush(m) => {
                    let m = u64::from(m) + 1;
                    if !cut.contains_key(&m) && let Some(cmds) = unreported.remove(&m) {
                        c.batch(m, cmds);
                    }
                }
                Life::Complete(m) => {
                    let by = (0..3u64).map(|i| (u64::from(m) + i) % 3 + 1).find(|x| !cut.contains_key(x));
                    if let (Some(by), Some(r)) = (by, running.pop_front()) {
                        c.settle(by, &r);
                    }
                }
                Life::Tick(ms) => {
                    for m in members {
                        if !cut.contains_key(&m) && let Some(cmds) = unreported.remove(&m) {
                            c.batch(m, cmds);
                        }
                    }
                    c.now_ms += u64::from(ms);
                    let up: Vec<u64> = members.iter().copied().filter(|m| !cut.contains_key(m)).collect();
                    c.heartbeat(&up);
                    for m in up {
                        last_heartbeat.insert(m, c.now_ms);
                    }
                }
                Life::Observe => {
                    let n = running.len() as u64;
                    c.observe(2, &[("p", n), ("q", 0)]);
                }
                Life::Crash(m) => {
                    let m = u64::from(m) + 1;
                    cut.remove(&m);
                    unreported.remove(&m);
                    waiting.retain(|k, _| k.0 != m);
                    c.restart(m);
                    last_heartbeat.insert(m, c.now_ms);
                }
                Life::Cut(m) => {
                    let m = u64::from(m) + 1;
                    if cut.is_empty() {
                        cut.insert(m, (last_heartbeat[&m], c.credit(m)));
                    }
                }
                Life::Heal(m) => {
                    let m = u64::from(m) + 1;
                    if cut.remove(&m).is_some() {
                        if let Some(cmds) = unreported.remove(&m) {
                            c.batch(m, cmds);
                        }
                        c.heartbeat(&[m]);
                        last_heartbeat.insert(m, c.now_ms);
                    }
                }
            }
            // Owners that can read the state act on their verdicts: forward and report the pod.
            let decided: Vec<((u64, u64), Verdict)> = waiting
                .keys()
                .filter(|k| !cut.contains_key(&k.0))
                .filter_map(|k| c.verdict(*k).map(|v| (*k, v)))
                .collect();
            for (k, v) in decided {
                let r = waiting.remove(&k).unwrap();
                if v == Verdict::Dispatched {
                    prop_assert!(seen.insert(r.clone()), "dispatched twice: {}", r);
                    running.push_back(r);
                    c.batch(k.0, vec![FlowCmd::Routed { seq: k.1, pod: "p".into() }]);
                }
            }
            prop_assert!(
                running.len() as u64 <= CAPACITY + u64::from(SLACK),
                "{} running > capacity {} + slack {}", running.len(), CAPACITY, SLACK
            );
            prop_assert!(members.map(|m| c.credit(m)).iter().sum::<u32>() <= SLACK);
        }
        // Heal, let everything finish: the ledger and the credit come back whole (I4).
        for (m, _) in std::mem::take(&mut cut) {
            if let Some(cmds) = unreported.remove(&m) {
                c.batch(m, cmds);
            }
        }
        for _ in 0..2000 {
            for (m, cmds) in std::mem::take(&mut unreported) {
                c.batch(m, cmds);
            }
            let decided: Vec<((u64, u64), Verdict)> = waiting
                .keys()
                .filter_map(|k| c.verdict(*k).map(|v| (*k, v)))
                .collect();
            for (k, v) in decided {
                let r = waiting.remove(&k).unwrap();
                if v == Verdict::Dispatched {
                    running.push_back(r);
                    c.batch(k.0, vec![FlowCmd::Routed { seq: k.1, pod: "p".into() }]);
                }
            }
            if let Some(r) = running.pop_front() {
                c.settle(1, &r);
            } else if waiting.is_empty() {
                break;
            } else {
                c.now_ms += 100;
                c.heartbeat(&members);
                c.observe(2, &[("p", 0), ("q", 0)]);
            }
        }
        prop_assert!(waiting.is_empty() && running.is_empty());
        for _ in 0..50 {
            c.now_ms += 100;
            c.heartbeat(&members);
            c.observe(2, &[("p", 0), ("q", 0)]);
        }
        prop_assert_eq!(c.inflight(), 0);
        prop_assert_eq!(c.quarantined(), 0);
        prop_assert_eq!(members.map(|m| c.credit(m)).iter().sum::<u32>(), SLACK);
    }
}

/// Three members, two endpoints of ten slots, a slack of 6 settled at two credits each.
fn three_with_two_credits_each() -> Cluster {
    let mut c = Cluster::new(
        &[1, 2, 3],
        10,
        2,
        vec![],
        GlobalParams {
            credit_slack: 6,
            ..GlobalParams::default()
        },
    );
    c.quiet_pods(2, &[1, 2, 3], 3000);
    c
}

/// The quarantine of a lost life's credit (see `admission_is_bounded_by_capacity_plus_slack`)
/// is eased only by what the pods report: not while a pod has no fresh metrics, not below what
/// they run beyond the ledger — and whatever they report, not for longer than five minutes.
#[test]
fn a_lost_life_s_credit_returns_as_the_pods_vouch_for_it() {
    let mut c = three_with_two_credits_each();
    assert_eq!([1, 2, 3].map(|m| c.credit(m)), [2, 2, 2]);
    // Replica 3 admits two on credit, forwards them and dies before reporting them.
    c.restart(3);
    assert_eq!(c.quarantined(), 2);
    let step = |c: &mut Cluster, observed: &[(&str, u64)]| {
        c.now_ms += 100;
        c.heartbeat(&[1, 2, 3]);
        c.observe(2, observed);
    };
    let granted = |c: &Cluster| [1, 2, 3].map(|m| c.credit(m)).iter().sum::<u32>();
    // One pod without metrics: nothing is known, nothing eased.
    for _ in 0..100 {
        step(&mut c, &[("p", 0)]);
    }
    assert_eq!((c.quarantined(), granted(&c)), (2, 4));
    // Both pods report; one runs the two requests nobody reported.
    for _ in 0..100 {
        step(&mut c, &[("p", 2), ("q", 0)]);
    }
    assert_eq!((c.quarantined(), granted(&c)), (2, 4));
    // One of them ends: one credit returns (a rebalance later), the other stays.
    for _ in 0..40 {
        step(&mut c, &[("p", 1), ("q", 0)]);
    }
    assert_eq!((c.quarantined(), granted(&c)), (1, 5));
    // Traffic from outside the cluster keeps the pods above the ledger: five minutes at most.
    for _ in 0..2960 {
        step(&mut c, &[("p", 7), ("q", 0)]);
    }
    assert_eq!(c.quarantined(), 0);
    for _ in 0..20 {
        step(&mut c, &[("p", 7), ("q", 0)]);
    }
    assert_eq!(granted(&c), 6);
}

/// A graceful exit reports everything with its last batch ([`FlowCmd::Retire`]): its credit
/// returns to the others without quarantine (a rolling restart costs no credit), and the
/// retired life is granted none again while its heartbeats last.
#[test]
fn a_retired_member_s_credit_returns_at_once() {
    let mut c = three_with_two_credits_each();
    assert_eq!(c.credit(3), 2);
    let admitted = |seq: u64| FlowCmd::Admitted {
        seq,
        request_id: format!("last-{seq}"),
        ask: ask("t", 0),
        pod: Some("p".into()),
    };
    c.batch(3, vec![admitted(1), admitted(2), FlowCmd::Retire]);
    assert_eq!((c.credit(3), c.inflight()), (0, 2));
    assert!(!c.s.flow().unwrap().fast_path_open(3, 0));
    // Its heartbeats go on for a moment, then it leaves.
    for _ in 0..5 {
        c.now_ms += 300;
        c.heartbeat(&[1, 2, 3]);
    }
    assert_eq!(c.credit(3), 0, "a retired life is granted nothing");
    c.s.apply(ClusterCommand::Leave { node: 3 });
    c.now_ms += 100;
    c.heartbeat(&[1, 2]);
    assert_eq!(c.quarantined(), 0);
    assert_eq!(c.credit(1) + c.credit(2), 6);
}

#[test]
fn settlements_are_idempotent_and_early_ones_bounded() {
    let mut c = Cluster::new(&[1, 2], 4, 1, vec![], GlobalParams::default());
    let a = c.enqueue(1, "t", 0, "key-a");
    let b = c.enqueue(1, "t", 0, "key-b");
    assert_eq!(c.verdict(a), Some(Verdict::Dispatched));
    assert_eq!(c.verdict(b), Some(Verdict::Dispatched));
    assert_eq!(c.inflight(), 2);
    // The batch carrying a settlement is retried (its first proposal committed after all).
    c.settle(2, "key-a");
    c.settle(2, "key-a");
    assert_eq!(c.inflight(), 1, "a retried settlement settles nothing else");
    // A flood of settlements of nothing (a broken or hostile replica) stays bounded, the oldest
    // forgotten first.
    let n = flowctl::global::MAX_EARLY + 100;
    let cmds: Vec<FlowCmd> = (0..n)
        .map(|i| FlowCmd::Settle {
            request_id: format!("ghost-{i:06}"),
            actual_tokens: None,
        })
        .collect();
    c.batch(2, cmds);
    let f = c.s.flow().unwrap();
    assert_eq!(f.early_settlements(), flowctl::global::MAX_EARLY);
    assert_eq!(c.inflight(), 1);
}

#[test]
fn a_member_back_from_expiry_leaves_no_stale_entries() {
    let mut c = Cluster::new(
        &[1, 2],
        2,
        2,
        vec![],
        GlobalParams {
            credit_slack: 2,
            lease_ms: 300,
            ..GlobalParams::default()
        },
    );
    let a = c.enqueue(2, "t", 0, "a");
    let b = c.enqueue(2, "t", 0, "b");
    assert_eq!(c.verdict(a), Some(Verdict::Dispatched));
    assert_eq!(c.verdict(b), Some(Verdict::Dispatched));
    // Replica 2 is cut off for a second while replica 1 heartbeats: its lease ends.
    for _ in 0..10 {
        c.now_ms += 100;
        c.heartbeat(&[1]);
    }
    assert!(c.s.flow().unwrap().member(2).unwrap().expired);
    // Replica 2's retried batch: the settlements of its two requests and a new enqueue.
    let seq = c.next_seq(2);
    c.batch(
        2,
        vec![
            FlowCmd::Settle {
                request_id: "a".into(),
                actual_tokens: None,
            },
            FlowCmd::Settle {
                request_id: "b".into(),
                actual_tokens: None,
            },
            FlowCmd::Enqueue {
                seq,
                request_id: "c".into(),
                ask: ask("t", 0),
            },
        ],
    );
    c.heartbeat(&[2]);
    let f = c.s.flow().unwrap();
    let live: Vec<_> = f
        .inflight_entries()
        .map(|(k, r, _)| (k, r.to_string()))
        .collect();
    assert_eq!(live, vec![((2, seq), "c".to_string())], "{live:?}");
}

#[test]
fn entries_whose_settlement_is_lost_are_reconciled_with_the_pods() {
    let mut c = Cluster::new(
        &[1],
        4,
        1,
        vec![],
        GlobalParams {
            credit_slack: 0,
            ..GlobalParams::default()
        },
    );
    for r in ["a", "b", "c"] {
        let key = c.enqueue(1, "t", 0, r);
        assert_eq!(c.verdict(key), Some(Verdict::Dispatched));
        c.batch(
            1,
            vec![FlowCmd::Routed {
                seq: key.1,
                pod: "p".into(),
            }],
        );
    }
    let observe = |c: &mut Cluster, seen: u64| {
        c.heartbeat(&[1]);
        c.s.apply(ClusterCommand::ObservePool {
            now_us: c.now_ms * US_PER_MS,
            endpoints: vec![EndpointSnapshot::default()],
            observed: vec![("p".into(), seen)],
        });
    };
    // The pod runs two of them: one settlement was lost. Young entries are never released.
    observe(&mut c, 2);
    c.now_ms += 1500;
    observe(&mut c, 2);
    assert_eq!(c.inflight(), 3, "entries younger than the minimum age stay");
    // Still short after the age and the persistence: the oldest one goes.
    c.now_ms += 1000;
    observe(&mut c, 2);
    c.now_ms += 1100;
    observe(&mut c, 2);
    assert_eq!(c.inflight(), 2);
    assert_eq!(c.s.flow().unwrap().reconciled(), 1);
    let left: Vec<String> =
        c.s.flow()
            .unwrap()
            .inflight_entries()
            .map(|(_, r, _)| r.to_string())
            .collect();
    assert_eq!(left, vec!["b", "c"]);
    // A pod that reports as many as the ledger holds (or more) is left alone.
    c.now_ms += 5000;
    observe(&mut c, 7);
    c.now_ms += 5000;
    observe(&mut c, 2);
    assert_eq!(c.inflight(), 2);
}

#[test]
fn a_stalled_log_does_not_expire_the_survivors() {
    let mut c = Cluster::new(
        &[1, 2],
        2,
        1,
        vec![],
        GlobalParams {
            credit_slack: 0,
            lease_ms: 300,
            ..GlobalParams::default()
        },
    );
    let a = c.enqueue(2, "t", 0, "a");
    assert_eq!(c.verdict(a), Some(Verdict::Dispatched));
    // No command for 1.2 s (an election), then replica 1 first.
    c.now_ms += 1200;
    c.heartbeat(&[1]);
    assert!(!c.s.flow().unwrap().member(2).unwrap().expired);
    assert_eq!(c.inflight(), 1, "replica 2's request survives the stall");
    // A replica that stays silent after the log resumes expires one lease later.
    for _ in 0..4 {
        c.now_ms += 100;
        c.heartbeat(&[1]);
    }
    assert!(c.s.flow().unwrap().member(2).unwrap().expired);
    c.quiet_pods(1, &[1], 2500);
    assert_eq!(c.inflight(), 0);
}

/// A routed request outlives its owner's lease and its owner's restart: Envoy keeps streaming it
/// from the pod (I9), so its capacity stays booked (I1) until it is settled — by any replica —
/// or the pod reports it gone. Found by the randomized chaos suite: with half-second responses,
/// releasing them when the owner's lease ended let the pods run 27 requests against a bound of
/// 24. Unrouted reservations and queued entries are still returned at once (I4).
#[test]
fn routed_requests_outlive_their_owner_until_settled_or_reconciled() {
    let mut c = Cluster::new(
        &[1, 2],
        3,
        1,
        vec![],
        GlobalParams {
            credit_slack: 0,
            lease_ms: 300,
            ..GlobalParams::default()
        },
    );
    let routed = c.enqueue(1, "t", 0, "routed");
    let streaming = c.enqueue(1, "t", 0, "streaming");
    let unrouted = c.enqueue(1, "t", 0, "unrouted");
    let queued = c.enqueue(1, "t", 0, "queued");
    for k in [routed, streaming, unrouted] {
        assert_eq!(c.verdict(k), Some(Verdict::Dispatched));
    }
    let route = |seq: u64| FlowCmd::Routed {
        seq,
        pod: "p".into(),
    };
    c.batch(1, vec![route(routed.1), route(streaming.1)]);
    // Replica 1 goes silent past its lease.
    for _ in 0..4 {
        c.now_ms += 100;
        c.heartbeat(&[2]);
    }
    assert!(c.s.flow().unwrap().member(1).unwrap().expired);
    assert_eq!(
        c.verdict(queued),
        Some(Verdict::Rejected(DropReason::RejectedSaturated))
    );
    assert_eq!(
        c.inflight(),
        3,
        "the two routed requests still run, the unrouted one may"
    );
    assert_eq!(c.s.flow().unwrap().reclaimed(), 1);
    // Replica 2 observed one response end: it settles it.
    assert!(matches!(c.settle(2, "routed"), ClusterOutput::Flow(r) if r.applied == 1));
    assert_eq!(c.inflight(), 2);
    // Replica 1 restarts and numbers from 1 again: its new seq 2 must not touch the old one.
    let new = |seq: u64, rid: &str| FlowCmd::Enqueue {
        seq,
        request_id: rid.into(),
        ask: ask("t", 0),
    };
    let new_life = |c: &mut Cluster| {
        c.s.apply(ClusterCommand::Heartbeat {
            node: 1,
            now_ms: c.now_ms,
            ext_proc: String::new(),
            admin: String::new(),
            started_ms: 8,
        })
    };
    new_life(&mut c);
    c.batch_as(1, 8, vec![new(1, "new-1"), new(2, "new-2")]);
    c.batch_as(1, 8, vec![FlowCmd::Cancel { seq: 2 }]);
    let left: Vec<String> =
        c.s.flow()
            .unwrap()
            .inflight_entries()
            .map(|(_, r, _)| r.to_string())
            .collect();
    assert_eq!(left, vec!["streaming", "unrouted", "new-1"]);
    // The pod reports none of the old life's: reconciliation returns the routed one, the
    // quarantine the orphan.
    for _ in 0..4 {
        c.now_ms += 1000;
        c.heartbeat(&[2]);
        new_life(&mut c);
        c.s.apply(ClusterCommand::ObservePool {
            now_us: c.now_ms * US_PER_MS,
            endpoints: vec![EndpointSnapshot::default()],
            observed: vec![("p".into(), 0)],
        });
    }
    let left: Vec<String> =
        c.s.flow()
            .unwrap()
            .inflight_entries()
            .map(|(_, r, _)| r.to_string())
            .collect();
    assert_eq!(
        left,
        vec!["new-1"],
        "new-1 is not routed: the pods cannot vouch for it"
    );
}

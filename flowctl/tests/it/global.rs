//! Cluster-wide flow control (`flowctl::global` inside `flowctl::cluster::ClusterState`): fairness
//! and strict priority across owners, the local-credit fast path, settlement from any replica,
//! reconciliation with the pods, retried batches, determinism. Members' lives (leases, restarts,
//! partitions, the I1 bound under them, quarantine): `global_lives.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::cluster::*;
use crate::common::*;
use flowctl::cluster::{ClusterCommand, ClusterOutput, ClusterState};
use flowctl::global::{FlowCmd, GlobalParams, Verdict};
use flowctl::{EndpointSnapshot, FairnessPolicy, OrderingPolicy, WeightedFairnessParams};
use std::collections::{BTreeMap, VecDeque};

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

/// Sixteen slots (two endpoints of eight), a slack of four: members admit on credit while the
/// state would dispatch at once even if all the credit were spent unreported; within that much of
/// the capacity requests go through the global queue, which dispatches up to the capacity.
#[test]
fn fast_path_admits_within_credit_then_queues() {
    let mut c = Cluster::new(
        &[1, 2],
        8,
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
    // Replica 1 admits eleven on credit (in batches its credit allows) and reports them.
    let admitted = |seq: u64| FlowCmd::Admitted {
        seq,
        request_id: format!("f{seq}"),
        ask: ask("t", 0),
        pod: Some("10.0.0.1:8000".into()),
    };
    c.seq.insert(1, 11);
    let out = c.batch(1, (1..=11).map(admitted).collect());
    assert!(matches!(out, ClusterOutput::Flow(r) if r.applied == 11));
    let f = c.s.flow().unwrap();
    assert_eq!(f.totals().inflight_requests, 11);
    assert_eq!(f.pods()["10.0.0.1:8000"].requests, 11);
    assert_eq!(f.others_load(2)["10.0.0.1:8000"].requests, 11);
    assert!(
        f.others_load(1).is_empty(),
        "replica 1's own load is not 'others'"
    );
    assert!(f.fast_path_open(2, 0), "11 + 4 of credit < 16 slots");
    c.seq.insert(1, 12);
    c.batch(1, vec![admitted(12)]);
    let f = c.s.flow().unwrap();
    assert!(
        !f.fast_path_open(1, 0) && !f.fast_path_open(2, 0),
        "12 + 4 of credit: what members could admit unreported would fill the pool"
    );
    // The global queue still dispatches up to the capacity…
    let queued: Vec<_> = (0..5)
        .map(|i| c.enqueue(2, "t", 0, &format!("q{i}")))
        .collect();
    for q in &queued[..4] {
        assert_eq!(c.verdict(*q), Some(Verdict::Dispatched));
    }
    // …and no further: the fifth waits for a slot.
    assert_eq!(c.verdict(queued[4]), None);
    c.settle(2, "f1");
    assert_eq!(c.verdict(queued[4]), Some(Verdict::Dispatched));
    assert_eq!(c.s.flow().unwrap().pods()["10.0.0.1:8000"].requests, 11);
}

/// On a small pool the credit is at most a quarter of its request capacity (at least one per
/// live member): a slack of 16 over 16 slots would otherwise let unreported admissions run a
/// second pool's worth of requests into the pods.
#[test]
fn credit_is_bounded_by_a_quarter_of_the_pool() {
    let params = GlobalParams {
        credit_slack: 16,
        ..GlobalParams::default()
    };
    let settled = |slots: u64, members: &[u64]| {
        let mut c = Cluster::new(members, slots, 4, vec![], params);
        for _ in 0..3 {
            c.now_ms += 1000;
            c.heartbeat(members);
        }
        members.iter().map(|m| c.credit(*m)).sum::<u32>()
    };
    assert_eq!(settled(4, &[1, 2, 3]), 4, "16 slots: a quarter");
    assert_eq!(settled(1, &[1, 2, 3, 4, 5]), 5, "4 slots: one per member");
    assert_eq!(
        settled(100, &[1, 2, 3]),
        16,
        "400 slots: the configured slack"
    );
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

//! Bulk holdings (`Command::Hold`, `Command::Served`): a replica's requests admitted on local
//! credit, held as one record per flow, weigh exactly like the same requests admitted one by one —
//! on the totals the detector reads, on the band figures, and on the fairness that decides what a
//! queue dispatches next.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::*;
use flowctl::{
    Charge, Command, EnqueueRequest, FairnessPolicy, FlowController, FlowKey, OrderingPolicy,
    Outcome, ProgramAwareParams, WeightedFairnessParams,
};

fn controller(fairness: FairnessPolicy) -> FlowController {
    let mut fc = FlowController::new(slots_config(
        6,
        vec![band(0, fairness, OrderingPolicy::Fcfs)],
    ))
    .unwrap();
    fc.apply(0, one_endpoint());
    fc
}

fn weighted() -> FairnessPolicy {
    FairnessPolicy::Weighted(WeightedFairnessParams {
        weights: [("gold".to_string(), 3.0)].into(),
        default_weight: 1.0,
        charge: Charge::Tokens,
    })
}

fn admit(id: u64, fairness: &str, tokens: u64) -> Command {
    Command::Admit(EnqueueRequest {
        id,
        flow: FlowKey::new(fairness, 0),
        bytes: 100,
        tokens,
        ttl: None,
        slo_ttft: None,
    })
}

fn hold(id: u64, fairness: &str, requests: u64, tokens: u64) -> Command {
    Command::Hold {
        id,
        flow: FlowKey::new(fairness, 0),
        requests,
        tokens,
    }
}

/// One by one (`a`) and in bulk (`b`), then the same queue: the same dispatches in the same
/// order, the same figures all along.
fn same_as_one_by_one(fairness: FairnessPolicy) {
    let mut a = controller(fairness.clone());
    let mut b = controller(fairness);
    let mut now = MS;
    // gold: 3 requests of 10 tokens, silver: 1 of 40, admitted on credit.
    for (id, f, t) in [
        (1, "gold", 10),
        (2, "gold", 10),
        (3, "gold", 10),
        (4, "silver", 40),
    ] {
        assert_eq!(dispatched(&a.apply(now, admit(id, f, t))), vec![id]);
    }
    assert!(b.apply(now, hold(100, "gold", 3, 30)).is_empty());
    assert!(b.apply(now, hold(101, "silver", 1, 40)).is_empty());
    assert_eq!(a.totals(), b.totals());
    assert_eq!(a.band_stats(), b.band_stats());
    assert!(b.is_in_flight(100));
    // Two of gold's requests end having used 50 tokens each; so does silver's one.
    now += MS;
    for (id, actual) in [(1, 50), (2, 50), (4, 50)] {
        a.apply(
            now,
            Command::Complete {
                id,
                actual_tokens: Some(actual),
            },
        );
    }
    for cmd in [
        Command::Served {
            flow: FlowKey::new("gold", 0),
            requests: 2,
            charged: 20,
            actual: 100,
        },
        Command::Served {
            flow: FlowKey::new("silver", 0),
            requests: 1,
            charged: 40,
            actual: 50,
        },
        hold(100, "gold", 1, 10),
        hold(101, "silver", 0, 0),
    ] {
        b.apply(now, cmd);
    }
    assert_eq!(a.totals(), b.totals());
    assert_eq!(a.band_stats(), b.band_stats());
    assert_eq!(a.attained_service(), b.attained_service());
    // One in flight, five slots free: a queue of both tenants forms and the slots go in the
    // order the charges (corrected by the actual tokens) say.
    let mut order_a = Vec::new();
    let mut order_b = Vec::new();
    for i in 0..6u64 {
        now += MS;
        for (fc, order) in [(&mut a, &mut order_a), (&mut b, &mut order_b)] {
            order.extend(dispatched(
                &fc.apply(now, enq_with(10 + 2 * i, "gold", 0, 10, None)),
            ));
            order.extend(dispatched(
                &fc.apply(now, enq_with(11 + 2 * i, "silver", 0, 10, None)),
            ));
        }
    }
    assert_eq!(order_a.len(), 5);
    assert_eq!(order_a, order_b);
    assert_eq!(a.totals(), b.totals());
    // The rest of the queue drains in the same order.
    let mut rest_a = Vec::new();
    let mut rest_b = Vec::new();
    for id in &order_a {
        now += MS;
        rest_a.extend(dispatched(&a.apply(now, complete(*id))));
        rest_b.extend(dispatched(&b.apply(now, complete(*id))));
    }
    assert_eq!(rest_a, rest_b);
    assert!(!b.is_in_flight(101), "a holding set to zero is gone");
}

#[test]
fn a_bulk_holding_weighs_like_its_requests_under_weighted_fairness() {
    same_as_one_by_one(weighted());
}

#[test]
fn a_bulk_holding_weighs_like_its_requests_under_program_aware_fairness() {
    same_as_one_by_one(FairnessPolicy::ProgramAware(ProgramAwareParams::default()));
}

#[test]
fn holdings_go_up_and_down_and_away() {
    let mut fc = controller(weighted());
    fc.apply(MS, hold(7, "gold", 5, 50));
    assert_eq!(fc.totals().inflight_requests, 5);
    assert_eq!(fc.totals().inflight_tokens, 50);
    fc.apply(2 * MS, hold(7, "gold", 2, 20));
    assert_eq!(fc.totals().inflight_requests, 2);
    // Unchanged: nothing happens; a holding is never evictable.
    fc.apply(3 * MS, hold(7, "gold", 2, 20));
    let out = fc.apply(
        3 * MS,
        Command::SetEvictable {
            id: 7,
            evictable: true,
        },
    );
    assert!(matches!(out.as_slice(), [Outcome::Ignored { id: 7, .. }]));
    fc.apply(4 * MS, hold(7, "gold", 0, 0));
    assert_eq!(fc.totals().inflight_requests, 0);
    assert_eq!(fc.totals().inflight_tokens, 0);
    assert!(!fc.is_in_flight(7));
    assert_eq!(fc.flow_stats().count(), 0, "the idle flow is dropped");
    // A holding's id cannot take over a queued request.
    fc.apply(5 * MS, hold(8, "gold", 6, 60));
    fc.apply(5 * MS, enq(9, "gold", 0));
    fc.apply(5 * MS, hold(9, "gold", 3, 30));
    assert_eq!(fc.totals().inflight_requests, 6);
    assert_eq!(fc.totals().queued_requests, 1);
}

//! A scripted timeline: one slot frees per tick, three bands (10 global-strict, 0 round-robin over
//! fairness ids `a` and `b`, -1 with a 2-request cap and 3 s TTLs). Every command's outcomes are
//! asserted exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::*;
use flowctl::{
    BandConfig, BandSettings, Command, DropReason, FairnessPolicy, FlowController, Nanos,
    OrderingPolicy, Outcome,
};

const H1: u64 = 1;
const H2: u64 = 2;
const L1: u64 = 11;
const L2: u64 = 12;
const L3: u64 = 13;
const L4: u64 = 14;
const L5: u64 = 15;
const L6: u64 = 16;
const L7: u64 = 17;
const A1: u64 = 21;
const A2: u64 = 22;
const A3: u64 = 23;
const B1: u64 = 31;
const B2: u64 = 32;
const B3: u64 = 33;

fn d(id: u64) -> Outcome {
    Outcome::Dispatched { id }
}
fn rej(id: u64, reason: DropReason) -> Outcome {
    Outcome::Rejected { id, reason }
}

#[test]
fn three_bands_one_slot_per_tick() {
    let cfg = slots_config(
        2,
        vec![
            band(10, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs),
            band(0, FairnessPolicy::RoundRobin, OrderingPolicy::Fcfs),
            BandConfig {
                priority: -1,
                settings: BandSettings {
                    max_requests: 2,
                    ..BandSettings::default()
                },
            },
        ],
    );
    let mut fc = FlowController::new(cfg).unwrap();
    let low = |id| enq_with(id, "batch", -1, 10, Some(3 * SEC));
    let script: Vec<(Nanos, Command, Vec<Outcome>)> = vec![
        (0, one_endpoint(), vec![]),
        // Unsaturated: admitted at once (work-conserving), whatever the band.
        (0, enq(H1, "x", 10), vec![d(H1)]),
        (0, low(L1), vec![d(L1)]), // 2/2 slots: saturated from here
        (0, enq(A1, "a", 0), vec![]),
        (0, enq(A2, "a", 0), vec![]),
        (0, enq(A3, "a", 0), vec![]),
        (0, enq(B1, "b", 0), vec![]),
        (0, enq(B2, "b", 0), vec![]),
        (0, enq(B3, "b", 0), vec![]),
        (0, low(L2), vec![]),
        (0, low(L3), vec![]),
        (0, low(L4), vec![rej(L4, DropReason::RejectedSaturated)]), // band cap 2
        (0, enq(H2, "x", 10), vec![]),
        // t=1: the high band goes first.
        (SEC, complete(H1), vec![d(H2)]),
        // t=2: middle band, round-robin starts at the smallest fairness id.
        (2 * SEC, complete(L1), vec![d(A1)]),
        (
            2 * SEC + 500 * MS,
            Command::Cancel { id: B3 },
            vec![rej(B3, DropReason::RejectedContextCancelled)],
        ),
        // 1 ns before L2/L3's deadline: nothing expires.
        (3 * SEC - 1, Command::Tick, vec![]),
        // t=3: L2 and L3 expire at the first command at their deadline, before dispatching.
        (
            3 * SEC,
            complete(H2),
            vec![
                rej(L2, DropReason::RejectedTtlExpired),
                rej(L3, DropReason::RejectedTtlExpired),
                d(B1),
            ],
        ),
        // t=4: the low band has room again (2 of 2), a third is refused.
        (
            4 * SEC,
            enq_with(L5, "batch", -1, 10, Some(4 * SEC)),
            vec![],
        ),
        (4 * SEC, low(L6), vec![]),
        (
            4 * SEC,
            low(L7),
            vec![rej(L7, DropReason::RejectedSaturated)],
        ),
        (4 * SEC, complete(A1), vec![d(A2)]),
        (5 * SEC, complete(B1), vec![d(B2)]),
        (6 * SEC, complete(A2), vec![d(A3)]),
        (7 * SEC - 1, Command::Tick, vec![]),
        // t=7: middle band empty; L6 (deadline 7 s) expires, L5 (deadline 8 s) is dispatched.
        (
            7 * SEC,
            complete(B2),
            vec![rej(L6, DropReason::RejectedTtlExpired), d(L5)],
        ),
        (8 * SEC, complete(A3), vec![]),
    ];
    for (step, (now, cmd, expected)) in script.into_iter().enumerate() {
        let got = fc.apply(now, cmd.clone());
        assert_eq!(got, expected, "step {step} at {now} ns: {cmd:?}");
    }
    let t = fc.totals();
    assert_eq!(
        (t.queued_requests, t.queued_bytes, t.inflight_requests),
        (0, 0, 1)
    );
    assert!(fc.is_in_flight(L5));
    // Only the batch flow (L5 in flight) is still tracked; emptied flows were collected.
    let flows: Vec<_> = fc
        .flow_stats()
        .map(|f| (f.fairness_id.to_string(), f.inflight_requests))
        .collect();
    assert_eq!(flows, vec![("batch".to_string(), 1)]);
    let bands: Vec<_> = fc
        .band_stats()
        .iter()
        .map(|b| (b.priority, b.inflight_requests))
        .collect();
    assert_eq!(bands, vec![(10, 0), (0, 0), (-1, 1)]);
    // What the client sees for the two 429s.
    let sat = DropReason::RejectedSaturated.http();
    assert_eq!(
        (sat.status, sat.dropped_reason),
        (429, Some("rejected-saturated"))
    );
    let ttl = DropReason::RejectedTtlExpired.http();
    assert_eq!(
        (ttl.status, ttl.dropped_reason),
        (429, Some("rejected-ttl-expired"))
    );
}

#[test]
fn no_endpoints_shutdown_and_eviction() {
    let mut cfg = slots_config(1, vec![]);
    cfg.no_endpoint_request_ttl = 2 * SEC;
    cfg.eviction.enabled = true;
    let mut fc = FlowController::new(cfg).unwrap();
    // Empty pool: requests wait noEndpointRequestTTL, then 503 rejected-no-endpoints.
    assert_eq!(fc.saturation(0), 1.0);
    assert_eq!(fc.apply(0, enq(1, "x", 0)), vec![]);
    assert_eq!(fc.apply(2 * SEC - 1, Command::Tick), vec![]);
    assert_eq!(
        fc.apply(2 * SEC, Command::Tick),
        vec![rej(1, DropReason::RejectedNoEndpoints)]
    );
    assert_eq!(DropReason::RejectedNoEndpoints.http().status, 503);
    // With endpoints: a sheddable request takes the only slot; a critical one arrives. Nothing
    // is evicted until the data plane can abort the sheddable one; then it is evicted and the
    // critical one dispatched in the same decision.
    let t = 3 * SEC;
    assert_eq!(fc.apply(t, one_endpoint()), vec![]);
    assert_eq!(fc.apply(t, enq(2, "bg", -1)), vec![d(2)]);
    assert_eq!(fc.apply(t, enq(3, "bg", -2)), vec![]);
    assert_eq!(fc.apply(t, enq(4, "fg", 0)), vec![]);
    assert!(matches!(
        fc.apply(
            t,
            Command::SetEvictable {
                id: 99,
                evictable: true
            }
        )[..],
        [Outcome::Ignored { id: 99, .. }]
    ));
    assert_eq!(
        fc.apply(
            t,
            Command::SetEvictable {
                id: 2,
                evictable: true
            }
        ),
        vec![
            Outcome::Evicted {
                id: 2,
                reason: DropReason::Evicted
            },
            d(4)
        ]
    );
    assert_eq!(DropReason::Evicted.http().status, 429);
    // Completing the evicted one later is a no-op for the ledger.
    assert!(matches!(
        fc.apply(t, complete(2))[..],
        [Outcome::Ignored { id: 2, .. }]
    ));
    // Shutdown: queued → 503 rejected-shutting-down, later enqueues too; in-flight stays.
    assert_eq!(
        fc.apply(t, Command::Shutdown),
        vec![rej(3, DropReason::RejectedShuttingDown)]
    );
    assert_eq!(
        fc.apply(t, enq(5, "fg", 0)),
        vec![rej(5, DropReason::RejectedShuttingDown)]
    );
    assert!(fc.is_in_flight(4));
    assert_eq!(DropReason::RejectedShuttingDown.http().status, 503);
}

#[test]
fn edf_and_slo_ordering() {
    let mut fc = FlowController::new(slots_config(
        1,
        vec![
            band(1, FairnessPolicy::GlobalStrict, OrderingPolicy::Edf),
            band(0, FairnessPolicy::GlobalStrict, OrderingPolicy::SloDeadline),
        ],
    ))
    .unwrap();
    fc.apply(0, one_endpoint());
    assert_eq!(fc.apply(0, enq(100, "x", 5)), vec![d(100)]); // occupy the slot
    // EDF: deadline = enqueue + TTL; no TTL (0) = last; across flows (global strict).
    fc.apply(0, enq_with(1, "a", 1, 1, Some(0)));
    fc.apply(0, enq_with(2, "b", 1, 1, Some(9 * SEC)));
    fc.apply(SEC, enq_with(3, "a", 1, 1, Some(5 * SEC)));
    // SLO: deadline = received + slo_ttft; none = last.
    let slo = |id, at_ms: u64| {
        Command::Enqueue(flowctl::EnqueueRequest {
            id,
            flow: flowctl::FlowKey::new("s", 0),
            bytes: 1,
            tokens: 1,
            ttl: None,
            slo_ttft: (at_ms > 0).then_some(at_ms * MS),
        })
    };
    fc.apply(SEC, slo(10, 0));
    fc.apply(SEC, slo(11, 500));
    fc.apply(SEC, slo(12, 100));
    let mut order = vec![];
    let mut running = 100;
    for i in 0..6 {
        let out = fc.apply(2 * SEC + i, complete(running));
        let [Outcome::Dispatched { id }] = out[..] else {
            panic!("{out:?}")
        };
        order.push(id);
        running = id;
    }
    assert_eq!(order, vec![3, 2, 1, 12, 11, 10]);
}

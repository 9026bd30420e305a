//! The demand reserve: a lower band may not take the capacity a higher band is predicted to need
//! within the next service time, and waits while a burst is still arriving — yet gets the whole
//! pool when it is alone, and loses nothing to a higher band that only holds what it uses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use flowctl::{
    Command, DEFAULT_DEMAND_RESERVE, DemandReserve, FairnessPolicy, FlowController, Nanos,
    OrderingPolicy,
};

const HIGH: i32 = 10;
const LOW: i32 = -10;

/// Four slots (one endpoint), two bands, the reserve with `factor` and settling as given.
fn controller(factor: f64, settle: Nanos) -> FlowController {
    let mut cfg = slots_config(
        4,
        vec![
            band(HIGH, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs),
            band(LOW, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs),
        ],
    );
    cfg.demand_reserve = DemandReserve {
        factor,
        settle,
        max_settle: 100 * MS,
    };
    let mut fc = FlowController::new(cfg).unwrap();
    fc.apply(0, one_endpoint());
    fc
}

/// Teach the machine a 100 ms service time: one request dispatched at `t` completes at `t + 100 ms`.
fn learn_service(fc: &mut FlowController, t: Nanos) {
    assert_eq!(dispatched(&fc.apply(t, enq(900, "warm", LOW))), vec![900]);
    fc.apply(t + 100 * MS, complete(900));
}

#[test]
fn a_lower_band_alone_gets_the_whole_pool() {
    let mut fc = controller(8.0, 0);
    learn_service(&mut fc, 0);
    let t = SEC;
    let got: Vec<u64> = (1..=4)
        .flat_map(|id| dispatched(&fc.apply(t, enq(id, "batch", LOW))))
        .collect();
    assert_eq!(got, vec![1, 2, 3, 4]);
}

#[test]
fn a_burst_of_higher_arrivals_keeps_their_predicted_need_free() {
    let mut fc = controller(8.0, 0);
    learn_service(&mut fc, 0);
    let t = SEC;
    // One premium arrival: predicted 8 more over the next service time (less the 1 in flight)
    // — the whole pool, so the best-effort request that arrives with it waits.
    assert_eq!(dispatched(&fc.apply(t, enq(1, "p", HIGH))), vec![1]);
    assert!(dispatched(&fc.apply(t, enq(2, "b", LOW))).is_empty());
    // The premium request that arrives next still finds a free slot.
    assert_eq!(dispatched(&fc.apply(t + MS, enq(3, "p", HIGH))), vec![3]);
    // Once premium went quiet for a few of its time constants (100 ms / 8), the reserve is gone
    // and best-effort gets the slots that are free.
    assert_eq!(dispatched(&fc.apply(t + 80 * MS, Command::Tick)), vec![2]);
}

#[test]
fn without_the_reserve_the_burst_takes_the_slots_first() {
    let mut fc = controller(0.0, 0);
    learn_service(&mut fc, 0);
    let t = SEC;
    assert_eq!(dispatched(&fc.apply(t, enq(1, "p", HIGH))), vec![1]);
    assert_eq!(dispatched(&fc.apply(t, enq(2, "b", LOW))), vec![2]);
    assert_eq!(dispatched(&fc.apply(t, enq(3, "b", LOW))), vec![3]);
    assert_eq!(dispatched(&fc.apply(t, enq(4, "b", LOW))), vec![4]);
    // The premium request that arrived with the burst waits for a completion.
    assert!(dispatched(&fc.apply(t + MS, enq(5, "p", HIGH))).is_empty());
}

#[test]
fn a_higher_band_that_went_quiet_reserves_nothing() {
    let mut fc = controller(8.0, 0);
    learn_service(&mut fc, 0);
    // Premium arrives once a service time and holds one slot; 60 ms (about five time constants)
    // after its last arrival its predicted need is below the one request it holds.
    let mut t = SEC;
    for id in 1..=5u64 {
        assert_eq!(dispatched(&fc.apply(t, enq(id, "p", HIGH))), vec![id]);
        fc.apply(t + 99 * MS, complete(id));
        t += 100 * MS;
    }
    let t = t - 40 * MS;
    let got: Vec<u64> = (11..=13)
        .flat_map(|id| dispatched(&fc.apply(t, enq(id, "b", LOW))))
        .collect();
    assert_eq!(got, vec![11, 12, 13]);
}

#[test]
fn a_burst_settles_before_the_lower_band_fills_the_pool() {
    // Settling alone (no reserve): while arrivals keep coming less than 5 ms apart, best-effort
    // that would fill the pool — with the arrivals the burst's rate predicts — waits, and the
    // premium of the same burst goes first.
    let mut fc = controller(0.0, 5 * MS);
    learn_service(&mut fc, 0);
    let t = SEC;
    let mut low = vec![];
    for (i, id) in (1..=4u64).enumerate() {
        low.extend(dispatched(
            &fc.apply(t + i as Nanos * MS, enq(id, "b", LOW)),
        ));
    }
    // The first arrived alone and went; from the second on, two arrivals in 1 ms predict ten
    // more within the next 5 ms: the pool would fill, so best-effort waits.
    assert_eq!(low, vec![1]);
    assert_eq!(fc.next_wake(), Some(t + 3 * MS + 5 * MS));
    assert_eq!(
        dispatched(&fc.apply(t + 4 * MS, enq(5, "p", HIGH))),
        vec![5]
    );
    // The burst is over 5 ms after its last arrival: the machine asked to be woken then.
    assert_eq!(fc.next_wake(), Some(t + 9 * MS));
    assert!(dispatched(&fc.apply(t + 8 * MS, Command::Tick)).is_empty());
    assert_eq!(dispatched(&fc.apply(t + 9 * MS, Command::Tick)), vec![2, 3]);
    assert_eq!(fc.next_wake(), None);
}

#[test]
fn a_request_arriving_on_its_own_is_never_held() {
    let mut fc = controller(0.0, 5 * MS);
    learn_service(&mut fc, 0);
    // Three slots taken 10 ms apart (no burst), then the fourth request, alone: it fills the
    // pool, and nothing else is arriving.
    for (i, id) in (1..=4u64).enumerate() {
        let now = SEC + i as Nanos * 10 * MS;
        assert_eq!(dispatched(&fc.apply(now, enq(id, "b", LOW))), vec![id]);
    }
}

#[test]
fn settling_is_bounded_by_max_settle() {
    let mut fc = controller(0.0, 5 * MS);
    learn_service(&mut fc, 0);
    let t = SEC;
    for id in 1..=3u64 {
        fc.apply(t, enq(id, "b", LOW));
    }
    // A best-effort stream every 2 ms keeps the burst going; the fourth slot opens when the
    // burst is 100 ms old, however it goes on.
    let mut when = None;
    for k in 0..80u64 {
        let now = t + k * 2 * MS;
        if !dispatched(&fc.apply(now, enq(10 + k, "b", LOW))).is_empty() {
            when = Some(now);
            break;
        }
    }
    assert_eq!(when, Some(t + 100 * MS));
}

#[test]
fn the_configuration_file_turns_the_reserve_on_by_default() {
    let plain = flowctl::FlowControlConfig::from_value(&serde_json::json!({})).unwrap();
    assert_eq!(
        plain.resolve(&[]).unwrap().demand_reserve,
        DEFAULT_DEMAND_RESERVE
    );
    let off = flowctl::FlowControlConfig::from_value(
        &serde_json::json!({"demandReserve": {"factor": 0, "settle": "0s"}}),
    )
    .unwrap();
    assert!(!off.resolve(&[]).unwrap().demand_reserve.enabled());
    let bad = flowctl::FlowControlConfig::from_value(
        &serde_json::json!({"demandReserve": {"factor": -1}}),
    )
    .unwrap();
    let err = bad.resolve(&[]).unwrap_err().to_string();
    assert!(err.contains("flowControl.demandReserve.factor"), "{err}");
    for bad in [
        serde_json::json!({"demandReserve": {"maxSettle": "1h"}}),
        serde_json::json!({"demandReserve": {"settle": "200ms", "maxSettle": "100ms"}}),
    ] {
        let err = flowctl::FlowControlConfig::from_value(&bad)
            .unwrap()
            .resolve(&[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("flowControl.demandReserve"), "{err}");
    }
    let unknown =
        flowctl::FlowControlConfig::from_value(&serde_json::json!({"demandReserve": {"factr": 8}}));
    assert!(unknown.unwrap_err().to_string().contains("factr"));
}

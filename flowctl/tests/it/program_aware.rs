//! `program-aware-fairness` (least attained service), hand-computed: one slot, programs
//! competing for it; the score is `0.8 · (1 − norm(service)) + 0.2 · norm(head wait)`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::*;
use flowctl::{Command, FairnessPolicy, FlowController, OrderingPolicy, ProgramAwareParams};

/// One endpoint of `slots` slots.
fn controller(params: ProgramAwareParams, slots: u64) -> FlowController {
    let mut fc = FlowController::new(slots_config(
        slots,
        vec![band(
            0,
            FairnessPolicy::ProgramAware(params),
            OrderingPolicy::Fcfs,
        )],
    ))
    .unwrap();
    fc.apply(0, one_endpoint());
    fc
}

fn done(id: u64, tokens: u64) -> Command {
    Command::Complete {
        id,
        actual_tokens: Some(tokens),
    }
}

fn service(fc: &FlowController, program: &str) -> Option<f64> {
    fc.attained_service()
        .into_iter()
        .find(|(_, id, _)| *id == program)
        .map(|(_, _, s)| s)
}

#[test]
fn the_least_served_program_goes_first_even_when_it_came_later() {
    let mut fc = controller(ProgramAwareParams::default(), 1);
    assert_eq!(dispatched(&fc.apply(MS, enq(1, "heavy", 0))), vec![1]);
    fc.apply(2 * MS, done(1, 1000));
    assert_eq!(dispatched(&fc.apply(3 * MS, enq(2, "heavy", 0))), vec![2]);
    // The slot is taken: heavy queues first, light 10 ms later.
    assert!(dispatched(&fc.apply(10 * MS, enq(3, "heavy", 0))).is_empty());
    assert!(dispatched(&fc.apply(20 * MS, enq(4, "light", 0))).is_empty());
    // Heavy: service 1010 → 0.8·0 + 0.2·1 = 0.2; light: service 0 → 0.8·1 + 0.2·0 = 0.8.
    assert_eq!(dispatched(&fc.apply(30 * MS, done(2, 10))), vec![4]);
    assert_eq!(
        service(&fc, "heavy"),
        Some(1010.0),
        "no decay while waiting"
    );
    assert_eq!(dispatched(&fc.apply(40 * MS, done(4, 5))), vec![3]);
}

#[test]
fn equal_service_falls_back_to_the_oldest_head() {
    for (first, second) in [("a", "b"), ("b", "a")] {
        let mut fc = controller(ProgramAwareParams::default(), 1);
        assert_eq!(dispatched(&fc.apply(MS, enq(1, "x", 0))), vec![1]);
        fc.apply(2 * MS, enq(2, first, 0));
        fc.apply(3 * MS, enq(3, second, 0));
        // Both at service 0 (0.5 each → 0.4); the older head gets the wait term's 0.2.
        assert_eq!(dispatched(&fc.apply(4 * MS, done(1, 0))), vec![2]);
    }
}

#[test]
fn idle_programs_lose_service_by_half_life_and_are_forgotten() {
    let mut fc = controller(
        ProgramAwareParams {
            las_half_life_seconds: 1.0,
            eviction_ttl_seconds: 10.0,
            ..ProgramAwareParams::default()
        },
        2,
    );
    fc.apply(MS, enq(1, "heavy", 0));
    fc.apply(2 * MS, done(1, 1000));
    assert_eq!(service(&fc, "heavy"), Some(1000.0));
    // One second later another program's pick decays the idle one by half.
    assert_eq!(dispatched(&fc.apply(2 * MS + SEC, enq(2, "x", 0))), vec![2]);
    let s = service(&fc, "heavy").unwrap();
    assert!((s - 500.0).abs() < 1e-6, "{s}");
    // In flight: no decay (its completion is still to be added) — a pick two seconds later
    // leaves it alone.
    assert_eq!(
        dispatched(&fc.apply(3 * MS + SEC, enq(3, "heavy", 0))),
        vec![3]
    );
    fc.apply(3 * MS + 3 * SEC, done(2, 0));
    assert_eq!(
        dispatched(&fc.apply(3 * MS + 3 * SEC, enq(4, "y", 0))),
        vec![4]
    );
    assert_eq!(service(&fc, "heavy"), Some(s), "decayed while in flight");
    fc.apply(4 * MS + 3 * SEC, done(3, 100));
    assert!((service(&fc, "heavy").unwrap() - (s + 100.0)).abs() < 1e-6);
    // No completion for longer than the TTL: forgotten at the next pick.
    assert_eq!(dispatched(&fc.apply(20 * SEC, enq(5, "x", 0))), vec![5]);
    assert_eq!(service(&fc, "heavy"), None);
}

#[test]
fn without_a_half_life_each_pick_decays_idle_programs_by_the_factor() {
    let mut fc = controller(
        ProgramAwareParams {
            las_decay_factor: 0.5,
            ..ProgramAwareParams::default()
        },
        1,
    );
    fc.apply(MS, enq(1, "heavy", 0));
    fc.apply(2 * MS, done(1, 1000));
    fc.apply(3 * MS, enq(2, "x", 0));
    fc.apply(4 * MS, done(2, 0));
    fc.apply(5 * MS, enq(3, "x", 0));
    assert_eq!(service(&fc, "heavy"), Some(250.0));
}

#[test]
fn llm_ds_parameters_and_refusals() {
    let p = FairnessPolicy::from_plugin(
        "program-aware-fairness",
        Some(
            &serde_json::json!({"strategy": "las", "lasWeightService": 0.7,
            "lasWeightHeadWait": 0.3, "lasHalfLifeSeconds": 60}),
        ),
        "plugins[0].parameters",
    )
    .unwrap();
    let FairnessPolicy::ProgramAware(p) = p else {
        panic!("{p:?}")
    };
    assert_eq!(
        (
            p.las_weight_service,
            p.las_weight_head_wait,
            p.las_half_life_seconds
        ),
        (0.7, 0.3, 60.0)
    );
    assert_eq!(p.eviction_ttl_seconds, 3600.0);
    for (bad, field) in [
        (serde_json::json!({"strategy": "wfq"}), "strategy"),
        (
            serde_json::json!({"evictionTtlSeconds": -1}),
            "evictionTtlSeconds",
        ),
        (
            serde_json::json!({"evictionSweepSeconds": 0}),
            "evictionSweepSeconds",
        ),
        (
            serde_json::json!({"lasWeightService": -0.1}),
            "lasWeightService",
        ),
        (serde_json::json!({"lasDecayFactor": 1.5}), "lasDecayFactor"),
        (serde_json::json!({"lasDecayFactor": 0}), "lasDecayFactor"),
        (
            serde_json::json!({"lasHalfLifeSeconds": -1}),
            "lasHalfLifeSeconds",
        ),
        (serde_json::json!({"lasWeight": 1}), "lasWeight"),
    ] {
        let e = FairnessPolicy::from_plugin("program-aware-fairness", Some(&bad), "p")
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{bad}: {e}");
    }
}

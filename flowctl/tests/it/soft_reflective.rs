//! `soft-reflective-ceiling-policy`: lower bands reach their reflective ceiling
//! `1 − rank·sat/(n − 1)` as saturation rises, then dispatch on one cycle in
//! `round(sat / (1 − sat))`; the top band is gated only at saturation 1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use crate::common::{band, enq, one_endpoint, slots_config};
use flowctl::{BandPosition, FairnessPolicy, FlowController, OrderingPolicy, Outcome, UsageLimit};

fn at(rank: usize, n: usize) -> BandPosition {
    BandPosition {
        rank,
        n,
        priority: 0,
        lowest: 0,
        highest: 0,
    }
}

#[test]
fn ceilings_open_below_the_reflection_then_alternate() {
    let p = UsageLimit::SoftReflective;
    for open in [false, true] {
        // Three bands at saturation 0.3: reflections 0.85 and 0.7, both above it — open.
        assert_eq!(p.ceiling(at(1, 3), 0.3, open), 1.0);
        assert_eq!(p.ceiling(at(2, 3), 0.3, open), 1.0);
        // At 0.6 the middle band (0.7) is still open; the lowest (0.4) follows the cycle.
        assert_eq!(p.ceiling(at(1, 3), 0.6, open), 1.0);
        assert_eq!(p.ceiling(at(2, 3), 0.6, open), if open { 1.0 } else { 0.0 });
        // Saturation 1 closes every band below the top, which stays open; so does a lone band.
        assert_eq!(p.ceiling(at(1, 3), 1.0, open), 0.0);
        assert_eq!(p.ceiling(at(0, 3), 1.0, open), 1.0);
        assert_eq!(p.ceiling(at(0, 1), 0.9, open), 1.0);
    }
}

#[test]
fn the_cycle_opens_one_call_in_round_sat_over_one_minus_sat() {
    let cycle = |sat: f64, calls: usize| {
        let mut tick = 0;
        let opens = (0..calls)
            .filter(|_| flowctl::policy::soft_reflective_cycle(&mut tick, sat))
            .count();
        (opens, tick)
    };
    assert_eq!(cycle(0.75, 30), (10, 30), "period 3");
    assert_eq!(cycle(0.9, 90), (10, 90), "period 9");
    assert_eq!(cycle(0.5, 7), (7, 7), "period 1");
    // Below the lowest band's reflection nothing alternates and the tick stands still.
    assert_eq!(cycle(0.4, 10), (0, 0));
    assert_eq!(cycle(1.0, 10), (0, 0));
}

/// Two bands, four slots (saturation = in flight / 4). The sheddable band dispatches freely up to
/// its reflection (1 − sat = sat at 0.5), then on one dispatch cycle in three at 0.75; premium
/// traffic is never held below saturation 1.
#[test]
fn the_sheddable_band_is_throttled_by_the_cycle() {
    let mut cfg = slots_config(
        4,
        [10, -10]
            .into_iter()
            .map(|p| band(p, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs))
            .collect(),
    );
    cfg.usage_limit = UsageLimit::SoftReflective;
    let mut fc = FlowController::new(cfg).unwrap();
    fc.apply(0, one_endpoint());
    let dispatched = |out: Vec<Outcome>| -> Vec<u64> {
        out.into_iter()
            .filter_map(|o| match o {
                Outcome::Dispatched { id } => Some(id),
                _ => None,
            })
            .collect()
    };
    let mut got = Vec::new();
    for id in 1..=5 {
        got.push(dispatched(fc.apply(id, enq(id, "batch", -10))));
    }
    // 0 and 0.25: below the reflection; 0.5: period 1, open; 0.75: period 3 — closed on the
    // cycle of id 4 (tick 2), open on the next (tick 3), which then reaches saturation 1.
    assert_eq!(got, vec![vec![1], vec![2], vec![3], vec![], vec![4]]);
    // Premium is served at 1.0 only when a slot frees; the sheddable id 5 waits behind it.
    assert!(dispatched(fc.apply(6, enq(6, "premium", 10))).is_empty());
    assert_eq!(dispatched(fc.apply(7, common::complete(1))), vec![6]);
}

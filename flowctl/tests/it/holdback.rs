//! `priority-holdback-policy`: lower bands stop dispatching at lower pool saturation, keeping
//! headroom for the higher ones.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{band, complete, dispatched, enq, one_endpoint, slots_config};
use flowctl::{
    FairnessPolicy, FlowControlConfig, FlowController, HoldbackDomain, HoldbackShape,
    OrderingPolicy, PluginDecl, PriorityHoldbackParams, UsageLimit,
};

fn bands3() -> Vec<flowctl::BandConfig> {
    [10, 0, -10]
        .into_iter()
        .map(|p| band(p, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs))
        .collect()
}

fn at(rank: usize, n: usize, priority: i32, lowest: i32, highest: i32) -> flowctl::BandPosition {
    flowctl::BandPosition {
        rank,
        n,
        priority,
        lowest,
        highest,
    }
}

#[test]
fn rank_ceilings_interpolate_between_max_and_min() {
    let limit = UsageLimit::PriorityHoldback(PriorityHoldbackParams {
        shape: HoldbackShape::Linear,
        domain: HoldbackDomain::Rank,
        min_ceiling: 0.5,
        max_ceiling: 1.0,
    });
    assert_eq!(limit.ceiling(at(0, 3, 10, -10, 10), 0.0, false), 1.0);
    assert_eq!(limit.ceiling(at(1, 3, 0, -10, 10), 0.0, false), 0.75);
    assert_eq!(limit.ceiling(at(2, 3, -10, -10, 10), 0.0, false), 0.5);
    // One band: the maximum.
    assert_eq!(limit.ceiling(at(0, 1, 7, 7, 7), 0.0, false), 1.0);
    let by_value = UsageLimit::PriorityHoldback(PriorityHoldbackParams {
        domain: HoldbackDomain::Value,
        ..match limit {
            UsageLimit::PriorityHoldback(p) => p,
            _ => unreachable!(),
        }
    });
    // Priorities 100, 90, 0: by value the middle band sits near the top.
    assert_eq!(by_value.ceiling(at(1, 3, 90, 0, 100), 0.0, false), 0.95);
    assert_eq!(by_value.ceiling(at(2, 3, 0, 0, 100), 0.0, false), 0.5);
}

/// Four slots on one endpoint; ceilings 1.0 / 0.75 / 0.5 for priorities 10 / 0 / -10. The
/// sheddable band may fill only two slots, the default band three, the top band all four.
#[test]
fn lower_bands_leave_headroom_for_higher_ones() {
    let mut cfg = slots_config(4, bands3());
    cfg.usage_limit = UsageLimit::PriorityHoldback(PriorityHoldbackParams {
        shape: HoldbackShape::Linear,
        domain: HoldbackDomain::Rank,
        min_ceiling: 0.5,
        max_ceiling: 1.0,
    });
    let mut fc = FlowController::new(cfg).unwrap();
    fc.apply(0, one_endpoint());
    let mut got = Vec::new();
    for id in 1..=4 {
        got.extend(dispatched(&fc.apply(1, enq(id, "batch", -10))));
    }
    assert_eq!(got, vec![1, 2], "sheddable stops at saturation 0.5");
    assert_eq!(dispatched(&fc.apply(2, enq(5, "web", 0))), vec![5]);
    assert!(dispatched(&fc.apply(3, enq(6, "web", 0))).is_empty());
    assert_eq!(dispatched(&fc.apply(4, enq(7, "premium", 10))), vec![7]);
    // A free slot goes to the highest waiting band that is not gated: saturation 3/4 gates the
    // default band (ceiling 0.75), so the freed slot stays free for premium traffic.
    assert!(dispatched(&fc.apply(5, complete(7))).is_empty());
    // Down to 2/4: the default band (ceiling 0.75) dispatches, then 3/4 stops everything but the
    // top band; the sheddable band waits.
    assert_eq!(dispatched(&fc.apply(6, complete(5))), vec![6]);
    assert_eq!(fc.totals().queued_requests, 2);
}

#[test]
fn decodes_from_llmd_yaml() {
    let fc: serde_json::Value = serde_json::json!({
        "usageLimitPolicyPluginRef": "holdback",
        "priorityBands": [{"priority": 10}, {"priority": -10}]
    });
    let params = serde_json::json!({"minCeiling": 0.6, "domain": "value"});
    let plugins = [PluginDecl {
        name: "holdback",
        type_name: "priority-holdback-policy",
        parameters: Some(&params),
    }];
    let cfg = FlowControlConfig::from_value(&fc)
        .unwrap()
        .resolve(&plugins)
        .unwrap();
    assert_eq!(
        cfg.usage_limit,
        UsageLimit::PriorityHoldback(PriorityHoldbackParams {
            shape: HoldbackShape::Linear,
            domain: HoldbackDomain::Value,
            min_ceiling: 0.6,
            max_ceiling: 1.0,
        })
    );
    let bad = serde_json::json!({"maxCeiling": 0.9});
    let plugins = [PluginDecl {
        name: "holdback",
        type_name: "priority-holdback-policy",
        parameters: Some(&bad),
    }];
    let err = FlowControlConfig::from_value(&fc)
        .unwrap()
        .resolve(&plugins)
        .unwrap_err()
        .to_string();
    assert!(err.contains("minCeiling"), "{err}");
}

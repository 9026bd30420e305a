//! Determinism: the same command log applied to fresh machines gives identical outcomes and
//! byte-identical serialized state, also across a snapshot (serialize → deserialize) taken midway.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::MS;
use flowctl::{
    BandConfig, BandSettings, Charge, Command, ConcurrencyDetector, ControllerConfig,
    EndpointSnapshot, EnqueueRequest, FairnessPolicy, FlowController, FlowKey, Nanos,
    OrderingPolicy, Outcome, SaturationDetector, WeightedFairnessParams,
};
use proptest::prelude::*;

fn config(detector_slots: u64) -> ControllerConfig {
    let band = |priority, fairness, ordering| BandConfig {
        priority,
        settings: BandSettings {
            max_requests: 20,
            max_bytes: 20_000,
            fairness,
            ordering,
            request_ttl: None,
        },
    };
    ControllerConfig {
        default_request_ttl: 30 * MS,
        no_endpoint_request_ttl: 10 * MS,
        bands: vec![
            band(2, FairnessPolicy::RoundRobin, OrderingPolicy::Edf),
            band(
                0,
                FairnessPolicy::Weighted(WeightedFairnessParams {
                    weights: [("a".into(), 2.5), ("b".into(), 0.7)].into(),
                    default_weight: 1.0,
                    charge: Charge::Tokens,
                }),
                OrderingPolicy::Fcfs,
            ),
            band(
                -1,
                FairnessPolicy::GlobalStrict,
                OrderingPolicy::SloDeadline,
            ),
        ],
        detector: SaturationDetector::Concurrency(ConcurrencyDetector {
            max_concurrency: detector_slots,
            ..ConcurrencyDetector::default()
        }),
        eviction: flowctl::EvictionConfig {
            enabled: true,
            ..Default::default()
        },
        // Its float state (service time, recent arrivals) must replay and snapshot exactly too.
        demand_reserve: flowctl::DEFAULT_DEMAND_RESERVE,
        ..ControllerConfig::default()
    }
}

fn log() -> impl Strategy<Value = Vec<(Nanos, Command)>> {
    let cmd = prop_oneof![
        6 => (1..60u64, 0..4usize, prop::sample::select(vec![-2, -1, 0, 2, 7]), 1..5000u64, 1..3000u64,
              prop::option::of(0..40u64), prop::option::of(1..40u64))
            .prop_map(|(id, f, p, bytes, tokens, ttl, slo)| Command::Enqueue(EnqueueRequest {
                id,
                flow: FlowKey::new(["a", "b", "c", "d"][f], p),
                bytes,
                tokens,
                ttl: ttl.map(|t| t * MS),
                slo_ttft: slo.map(|t| t * MS),
            })),
        3 => (1..60u64, prop::option::of(1..4000u64))
            .prop_map(|(id, t)| Command::Complete { id, actual_tokens: t }),
        1 => (1..60u64).prop_map(|id| Command::Cancel { id }),
        1 => (0..3usize).prop_map(|n| Command::ObservePool { endpoints: vec![EndpointSnapshot::default(); n] }),
        1 => Just(Command::Tick),
    ];
    prop::collection::vec((0..5 * MS, cmd), 1..200).prop_map(|steps| {
        let mut now = 0;
        steps
            .into_iter()
            .map(|(dt, c)| {
                now += dt;
                (now, c)
            })
            .collect()
    })
}

fn run(fc: &mut FlowController, log: &[(Nanos, Command)]) -> Vec<Outcome> {
    log.iter()
        .flat_map(|(now, c)| fc.apply(*now, c.clone()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn same_log_same_outcomes_and_state(log in log(), slots in 1..6u64, split in 0..200usize) {
        let mut a = FlowController::new(config(slots)).unwrap();
        let mut b = FlowController::new(config(slots)).unwrap();
        let out_a = run(&mut a, &log);
        let out_b = run(&mut b, &log);
        prop_assert_eq!(&out_a, &out_b);
        let state_a = serde_json::to_string(&a).unwrap();
        prop_assert_eq!(&state_a, &serde_json::to_string(&b).unwrap());

        // Snapshot midway: serialize, restore into a new machine, continue with the rest.
        let split = split.min(log.len());
        let mut c = FlowController::new(config(slots)).unwrap();
        let mut out_c = run(&mut c, &log[..split]);
        let snapshot = serde_json::to_string(&c).unwrap();
        let mut restored: FlowController = serde_json::from_str(&snapshot).unwrap();
        prop_assert_eq!(&serde_json::to_string(&restored).unwrap(), &snapshot);
        out_c.extend(run(&mut restored, &log[split..]));
        prop_assert_eq!(&out_c, &out_a);
        prop_assert_eq!(serde_json::to_string(&restored).unwrap(), state_a);
    }
}

#[test]
fn commands_and_outcomes_are_serializable() {
    let cmds = vec![
        Command::Enqueue(EnqueueRequest {
            id: 7,
            flow: FlowKey::new("t", -1),
            bytes: 10,
            tokens: 20,
            ttl: Some(5),
            slo_ttft: None,
        }),
        Command::Complete {
            id: 7,
            actual_tokens: Some(3),
        },
        Command::SetSaturation {
            saturation: 0.5,
            endpoints: 2,
        },
        Command::Shutdown,
    ];
    let json = serde_json::to_string(&cmds).unwrap();
    let back: Vec<Command> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cmds);
    let outs = vec![
        Outcome::Dispatched { id: 1 },
        Outcome::Rejected {
            id: 2,
            reason: flowctl::DropReason::RejectedTtlExpired,
        },
    ];
    let json = serde_json::to_string(&outs).unwrap();
    assert!(json.contains("rejected-ttl-expired"), "{json}");
    let back: Vec<Outcome> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, outs);
}

//! `program-aware-fairness` with `strategy: turn-priority` (llm-d v1.0): a program's turn is its
//! dispatched count plus one; the waiting flow with the highest `turn + w · head wait (s)` goes
//! first; a program with nothing in flight and no completion for the inactivity window restarts
//! at turn 1. Hand-computed cases, then the controller against a reference model on random
//! schedules.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use std::collections::{BTreeMap, VecDeque};

use crate::common::*;
use flowctl::{Command, FairnessPolicy, FlowController, OrderingPolicy, ProgramAwareParams};
use proptest::prelude::*;

fn turn_priority(time_weight: f64, inactivity_s: f64) -> ProgramAwareParams {
    serde_json::from_value(serde_json::json!({
        "strategy": "turn-priority",
        "turnPriorityTimeWeight": time_weight,
        "turnPriorityInactivitySeconds": inactivity_s,
    }))
    .unwrap()
}

/// One endpoint of `slots` slots, one band of turn priority, no queue TTL (waits here run to
/// minutes).
fn controller(params: ProgramAwareParams, slots: u64) -> FlowController {
    let mut cfg = slots_config(
        slots,
        vec![band(
            0,
            FairnessPolicy::ProgramAware(params),
            OrderingPolicy::Fcfs,
        )],
    );
    cfg.default_request_ttl = 0;
    let mut fc = FlowController::new(cfg).unwrap();
    fc.apply(0, one_endpoint());
    fc
}

fn done(id: u64) -> Command {
    Command::Complete {
        id,
        actual_tokens: Some(10),
    }
}

#[test]
fn an_agent_on_its_seventh_turn_goes_before_a_new_programs_first() {
    let mut fc = controller(turn_priority(0.05, 120.0), 1);
    // The agent's six turns, one at a time.
    let mut t = 0;
    for id in 1..=6 {
        t += 100 * MS;
        assert_eq!(dispatched(&fc.apply(t, enq(id, "agent", 0))), vec![id]);
        t += 100 * MS;
        fc.apply(t, done(id));
    }
    // A filler holds the slot; a new program queues first, the agent's 7th turn a second later.
    t += MS;
    assert_eq!(dispatched(&fc.apply(t, enq(10, "filler", 0))), vec![10]);
    fc.apply(t + MS, enq(11, "newcomer", 0));
    fc.apply(t + SEC, enq(7, "agent", 0));
    // newcomer: 1 + 0.05 · 2 = 1.1; agent: 7 + 0.05 · 1 = 7.05.
    assert_eq!(dispatched(&fc.apply(t + 2 * SEC, done(10))), vec![7]);
    assert_eq!(dispatched(&fc.apply(t + 3 * SEC, done(7))), vec![11]);
}

#[test]
fn a_long_wait_wins_in_the_end() {
    let mut fc = controller(turn_priority(0.05, 120.0), 1);
    let mut t = 0;
    for id in 1..=3 {
        t += MS;
        fc.apply(t, enq(id, "agent", 0));
        t += MS;
        fc.apply(t, done(id));
    }
    t += MS;
    fc.apply(t, enq(10, "filler", 0));
    fc.apply(t + MS, enq(11, "newcomer", 0));
    // After 100 s the newcomer scores 1 + 5 = 6; the agent's fresh 4th turn 4 + ~0 = 4.
    fc.apply(t + 100 * SEC, enq(4, "agent", 0));
    assert_eq!(
        dispatched(&fc.apply(t + 100 * SEC + MS, done(10))),
        vec![11]
    );
}

#[test]
fn an_inactive_program_starts_again_at_turn_one() {
    let mut fc = controller(turn_priority(0.0, 1.0), 1);
    let mut t = 0;
    for id in 1..=5 {
        t += MS;
        fc.apply(t, enq(id, "old", 0));
        t += MS;
        fc.apply(t, done(id));
    }
    // `other` has taken 2 turns (its last just completed); `old` has been idle for 3 s.
    t += 3 * SEC;
    for id in 20..=21 {
        fc.apply(t, enq(id, "other", 0));
        t += MS;
        fc.apply(t, done(id));
    }
    fc.apply(t, enq(30, "filler", 0));
    fc.apply(t + MS, enq(6, "old", 0));
    fc.apply(t + 2 * MS, enq(22, "other", 0));
    // old: reset, turn 1; other: turn 3 (no weight on the wait).
    assert_eq!(dispatched(&fc.apply(t + 3 * MS, done(30))), vec![22]);
    assert_eq!(dispatched(&fc.apply(t + 4 * MS, done(22))), vec![6]);
}

#[test]
fn parameters_defaults_and_refusals() {
    let p = FairnessPolicy::from_plugin(
        "program-aware-fairness",
        Some(&serde_json::json!({"strategy": "turn-priority"})),
        "plugins[0].parameters",
    )
    .unwrap();
    let FairnessPolicy::ProgramAware(p) = p else {
        panic!("{p:?}")
    };
    assert!(p.turn_priority());
    assert_eq!(
        (
            p.turn_priority_time_weight,
            p.turn_priority_inactivity_seconds
        ),
        (0.05, 120.0)
    );
    for bad in [
        serde_json::json!({"strategy": "turn-priority", "turnPriorityTimeWeight": -1}),
        serde_json::json!({"strategy": "turn-priority", "turnPriorityInactivitySeconds": -5}),
        serde_json::json!({"strategy": "turns"}),
    ] {
        assert!(
            FairnessPolicy::from_plugin("program-aware-fairness", Some(&bad), "p").is_err(),
            "{bad}"
        );
    }
    // A `las` configuration serializes as before turn priority existed (replicated state).
    let las = serde_json::to_value(ProgramAwareParams::default()).unwrap();
    assert!(las.get("turnPriorityTimeWeight").is_none(), "{las}");
}

/// The reference: per program, its turns, in-flight count, last completion and FIFO queue.
#[derive(Default)]
struct Model {
    programs: BTreeMap<String, MProgram>,
    free: u64,
}

#[derive(Default)]
struct MProgram {
    turns: u64,
    inflight: u64,
    last_completion: u64,
    queue: VecDeque<(u64, u64)>,
    /// Order of first arrival among the programs with a queue (the controller's flow index
    /// breaks ties; score ties are made improbable by the schedule).
    first_seen: u64,
}

impl Model {
    fn dispatch(&mut self, now: u64, w: f64, inactivity: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while self.free > 0 {
            for p in self.programs.values_mut() {
                if inactivity > 0
                    && p.inflight == 0
                    && now.saturating_sub(p.last_completion) > inactivity
                {
                    p.turns = 0;
                }
            }
            let best = self
                .programs
                .iter()
                .filter_map(|(name, p)| {
                    let (_, at) = p.queue.front()?;
                    let score = (p.turns + 1) as f64 + w * ((now - at) as f64 / 1e9);
                    Some((score, std::cmp::Reverse(p.first_seen), name.clone()))
                })
                .max_by(|a, b| a.partial_cmp(b).unwrap());
            let Some((_, _, name)) = best else { break };
            let p = self.programs.get_mut(&name).unwrap();
            let (id, _) = p.queue.pop_front().unwrap();
            p.turns += 1;
            p.inflight += 1;
            self.free -= 1;
            out.push(id);
        }
        out
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A request of program `p` arrives.
    Arrive(usize),
    /// The oldest in-flight request completes.
    Complete,
}

fn ops() -> impl Strategy<Value = Vec<(Op, u64)>> {
    prop::collection::vec(
        (
            prop_oneof![3 => (0..4usize).prop_map(Op::Arrive), 2 => Just(Op::Complete)],
            // Gaps of 1 ms to 3 s, odd microseconds (no two waits alike).
            (1..3000u64).prop_map(|ms| ms * MS + 7_777),
        ),
        1..120,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn the_controller_dispatches_as_the_reference_model(
        ops in ops(),
        slots in 1..3u64,
        // (Not 0: equal turns would tie, and ties go by the controller's flow index.)
        w in prop_oneof![Just(0.05), Just(1.0)],
        inactivity_s in prop_oneof![Just(0u64), Just(2), Just(5)],
    ) {
        let mut fc = controller(turn_priority(w, inactivity_s as f64), slots);
        let mut model = Model { free: slots, ..Model::default() };
        let inactivity = inactivity_s * SEC;
        let mut now = 0;
        let mut next_id = 1;
        let mut seen = 0;
        let mut running: VecDeque<(u64, String)> = VecDeque::new();
        let mut owner: BTreeMap<u64, String> = BTreeMap::new();
        for (op, gap) in ops {
            now += gap;
            let (out, expected) = match op {
                Op::Arrive(p) => {
                    let name = format!("p{p}");
                    let id = next_id;
                    next_id += 1;
                    owner.insert(id, name.clone());
                    let prog = model.programs.entry(name.clone()).or_default();
                    if prog.queue.is_empty() {
                        seen += 1;
                        prog.first_seen = seen;
                    }
                    prog.queue.push_back((id, now));
                    (fc.apply(now, enq(id, &name, 0)), model.dispatch(now, w, inactivity))
                }
                Op::Complete => {
                    let Some((id, name)) = running.pop_front() else { continue };
                    let prog = model.programs.get_mut(&name).unwrap();
                    prog.inflight -= 1;
                    prog.last_completion = now;
                    model.free += 1;
                    (fc.apply(now, done(id)), model.dispatch(now, w, inactivity))
                }
            };
            let got = dispatched(&out);
            prop_assert_eq!(&got, &expected, "at {} ms", now / MS);
            for id in got {
                running.push_back((id, owner[&id].clone()));
            }
        }
    }
}

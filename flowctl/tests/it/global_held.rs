//! Bulk holdings in cluster-wide flow control (`FlowCmd::Held`): a member's credit admissions
//! reported as absolute counts per (flow, pod) instead of a command per request — booked like
//! admissions (totals, pods, the others' load), retried or stale reports ignored, capacity they
//! free dispatched to the global queue, and a lost life's rows held until the pods vouch for
//! them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use crate::common::cluster::*;
use crate::common::*;
use flowctl::global::{FlowCmd, GlobalParams, HeldRow, QUARANTINE_MAX_MS, ServedRow, Verdict};
use flowctl::{FairnessPolicy, FlowKey, OrderingPolicy};

fn row(tenant: &str, pod: Option<&str>, requests: u64) -> HeldRow {
    HeldRow {
        flow: FlowKey::new(tenant, 0),
        pod: pod.map(str::to_string),
        requests,
        tokens: 10 * requests,
    }
}

fn held(version: u64, full: bool, admitted: u64, rows: Vec<HeldRow>) -> FlowCmd {
    FlowCmd::Held {
        version,
        full,
        admitted,
        rows,
        served: vec![],
    }
}

fn cluster(slots: u64) -> Cluster {
    Cluster::new(
        &[1, 2],
        slots,
        1,
        vec![band(0, FairnessPolicy::RoundRobin, OrderingPolicy::Fcfs)],
        GlobalParams {
            credit_slack: 0,
            lease_ms: 300,
            ..GlobalParams::default()
        },
    )
}

fn pod_requests(c: &Cluster, pod: &str) -> u64 {
    c.s.flow()
        .unwrap()
        .pods()
        .get(pod)
        .map_or(0, |l| l.requests)
}

#[test]
fn rows_book_load_like_admissions_and_stale_reports_are_ignored() {
    let mut c = cluster(8);
    c.batch(
        1,
        vec![held(
            1,
            false,
            3,
            vec![row("a", Some("p"), 2), row("a", None, 1)],
        )],
    );
    assert_eq!(c.inflight(), 3);
    assert_eq!(c.s.flow().unwrap().totals().inflight_tokens, 30);
    assert_eq!(pod_requests(&c, "p"), 2);
    let f = c.s.flow().unwrap();
    assert_eq!(f.others_load(2).get("p").map(|l| l.requests), Some(2));
    assert!(
        f.others_load(1).is_empty(),
        "its own load is not the others'"
    );
    assert_eq!(f.member(1).unwrap().held_admitted, 3);
    // A repeated (retried) or older report changes nothing.
    c.batch(1, vec![held(1, true, 9, vec![])]);
    assert_eq!(c.inflight(), 3);
    // The unrouted one is routed; one on p ends.
    c.batch(
        1,
        vec![held(
            2,
            false,
            3,
            vec![
                row("a", Some("p"), 1),
                row("a", None, 0),
                row("a", Some("q"), 1),
            ],
        )],
    );
    assert_eq!(c.inflight(), 2);
    assert_eq!((pod_requests(&c, "p"), pod_requests(&c, "q")), (1, 1));
    // A full report: every row not listed is zero.
    c.batch(1, vec![held(3, true, 4, vec![row("b", Some("q"), 1)])]);
    assert_eq!(c.inflight(), 1);
    assert_eq!((pod_requests(&c, "p"), pod_requests(&c, "q")), (0, 1));
    assert_eq!(c.s.flow().unwrap().member(1).unwrap().held_admitted, 4);
    // Corrections of the charges ride along (and alone change no count).
    c.batch(
        1,
        vec![FlowCmd::Held {
            version: 4,
            full: false,
            admitted: 4,
            rows: vec![],
            served: vec![ServedRow {
                flow: FlowKey::new("b", 0),
                requests: 1,
                charged: 10,
                actual: 90,
            }],
        }],
    );
    assert_eq!(c.inflight(), 1);
}

#[test]
fn capacity_a_holding_frees_goes_to_the_global_queue() {
    let mut c = cluster(2);
    c.batch(1, vec![held(1, false, 2, vec![row("a", Some("p"), 2)])]);
    let waiting = c.enqueue(2, "b", 0, "b1");
    assert_eq!(c.verdict(waiting), None, "two slots, both held");
    c.batch(1, vec![held(2, false, 2, vec![row("a", Some("p"), 1)])]);
    assert_eq!(c.verdict(waiting), Some(Verdict::Dispatched));
    assert_eq!(c.inflight(), 2);
}

#[test]
fn a_lost_lives_rows_stay_booked_until_the_pods_vouch_for_them() {
    let mut c = cluster(8);
    c.batch(
        1,
        vec![held(
            1,
            false,
            4,
            vec![row("a", Some("p"), 3), row("a", None, 1)],
        )],
    );
    // Replica 1 restarts: its old life's requests may still run in the pods.
    c.restart(1);
    assert_eq!(c.inflight(), 4);
    let step = |c: &mut Cluster, observed: &[(&str, u64)]| {
        c.now_ms += 100;
        c.heartbeat(&[1, 2]);
        c.observe(1, observed);
    };
    // The pod still runs all three: nothing eased.
    for _ in 0..50 {
        step(&mut c, &[("p", 3)]);
    }
    assert_eq!(c.inflight(), 4);
    // Two of them end: after the reports persist, two are released; the unrouted one stays.
    for _ in 0..30 {
        step(&mut c, &[("p", 1)]);
    }
    assert_eq!(pod_requests(&c, "p"), 1);
    assert_eq!(c.inflight(), 2);
    // Nothing tells where the unrouted one runs: it goes after the quarantine's bound.
    c.now_ms += QUARANTINE_MAX_MS;
    step(&mut c, &[("p", 1)]);
    assert_eq!(c.inflight(), 1);
    // The new life's reports are its own: the old life's rows are not touched by them.
    c.batch(1, vec![held(1, true, 1, vec![row("a", Some("p"), 1)])]);
    assert_eq!(c.inflight(), 2);
    assert_eq!(pod_requests(&c, "p"), 2);
}

#[test]
fn a_life_back_from_a_partition_holds_its_rows_again() {
    let mut c = cluster(8);
    c.batch(1, vec![held(1, false, 2, vec![row("a", Some("p"), 2)])]);
    // Replica 1 is cut off past its lease; the pods show nothing running for a while.
    for _ in 0..10 {
        c.now_ms += 100;
        c.heartbeat(&[2]);
        c.observe(1, &[("p", 2)]);
    }
    assert!(c.s.flow().unwrap().member(1).unwrap().expired);
    // Back before the pods' reports could ease them: its rows are its own again.
    c.heartbeat(&[1, 2]);
    assert!(!c.s.flow().unwrap().member(1).unwrap().expired);
    for _ in 0..50 {
        c.now_ms += 100;
        c.heartbeat(&[1, 2]);
        c.observe(1, &[("p", 0)]);
    }
    assert_eq!(
        pod_requests(&c, "p"),
        2,
        "a live member's rows follow its reports"
    );
    c.batch(1, vec![held(2, false, 2, vec![row("a", Some("p"), 0)])]);
    assert_eq!(c.inflight(), 0);
}

#[test]
fn bulk_counts_need_every_live_member_to_speak_them() {
    use flowctl::cluster::{ClusterCommand, FEATURE_HELD};
    let mut c = cluster(8);
    assert!(c.s.live_members_speak(FEATURE_HELD));
    // Replica 2 restarts on an older build: its heartbeats carry no features.
    let old = |c: &mut Cluster| {
        let now_ms = c.now_ms;
        c.s.apply(ClusterCommand::Heartbeat {
            node: 2,
            now_ms,
            ext_proc: String::new(),
            admin: String::new(),
            started_ms: 99,
            features: 0,
        });
    };
    old(&mut c);
    assert!(!c.s.live_members_speak(FEATURE_HELD));
    // Its lease ends (it was replaced by a new build under another id, say): bulk again.
    for _ in 0..5 {
        c.now_ms += 100;
        c.heartbeat(&[1]);
    }
    assert!(c.s.live_members_speak(FEATURE_HELD));
    // An older build's heartbeat, as it encodes it (no `features` field), reads as none.
    let encoded = r#"{"Heartbeat":{"node":3,"now_ms":1,"ext_proc":"","admin":"","started_ms":5}}"#;
    let decoded: ClusterCommand = serde_json::from_str(encoded).unwrap();
    assert!(matches!(
        decoded,
        ClusterCommand::Heartbeat { features: 0, .. }
    ));
}

#[test]
fn absurd_counts_saturate_and_leave_no_trace_once_withdrawn() {
    let mut c = cluster(8);
    let huge = HeldRow {
        flow: FlowKey::new("a", 0),
        pod: Some("p".into()),
        requests: u64::MAX,
        tokens: u64::MAX,
    };
    c.batch(
        1,
        vec![held(1, false, u64::MAX, vec![huge, row("b", Some("p"), 2)])],
    );
    c.batch(
        2,
        vec![held(1, false, u64::MAX, vec![row("c", Some("p"), 3)])],
    );
    assert_eq!(c.inflight(), u64::MAX, "saturated, not wrapped");
    assert_eq!(pod_requests(&c, "p"), u64::MAX);
    c.batch(1, vec![held(2, true, u64::MAX, vec![])]);
    c.batch(2, vec![held(2, true, u64::MAX, vec![])]);
    assert_eq!(c.inflight(), 0);
    assert_eq!(pod_requests(&c, "p"), 0);
}

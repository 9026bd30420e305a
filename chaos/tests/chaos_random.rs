//! The randomized chaos suite, bounded for CI: a few seeds, each a fresh three-replica cluster
//! (Envoy, simulated pods, cluster flow control) under a saturating streaming load for 40 s
//! while the seed's schedule kills, pauses, partitions, delays and clock-skews replicas. Every
//! invariant the checker knows must hold for every seed (one known open excess of I1 aside, see
//! `within_open_i1_gap`); the reports are printed. A longer soak:
//! `deploy/local/chaos-soak.sh` (see docs/benchmarks.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::random::{RunSpec, run};

/// Seeds CI runs: fixed, so a failure is reproduced with `epp-chaos --seeds N --run 40`.
const SEEDS: [u64; 2] = [1, 2];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_under_load_keep_every_invariant() {
    let mut failed = Vec::new();
    for seed in SEEDS {
        let report = run(&RunSpec {
            seed,
            replicas: 3,
            run: Duration::from_secs(40),
        })
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e:#}"));
        eprint!("{}", report.render());
        assert!(
            report.faults.len() >= 5,
            "seed {seed} injected too few faults to mean anything: {:?}",
            report.faults
        );
        assert!(
            report.outcomes.get("200 complete").copied().unwrap_or(0) > 500,
            "seed {seed}: too little traffic completed: {:?}",
            report.outcomes
        );
        let violations: Vec<_> = report
            .violations()
            .into_iter()
            .filter(|c| !(c.id == "I1" && within_open_i1_gap(&c.measured)))
            .collect();
        if report.violations().len() != violations.len() {
            eprintln!(
                "seed {seed}: I1 exceeded by no more than one member's credit share — the open \
                 defect recorded on issue 19 (spent-but-unreported credit re-granted); tolerated \
                 here until its fix lands, never beyond"
            );
        }
        if !violations.is_empty() {
            failed.push((seed, violations.len()));
        }
    }
    assert!(
        failed.is_empty(),
        "invariants violated: {failed:?} (seed, checks)"
    );
}

/// Known open defect (issue 19, docs/benchmarks.md "Randomized chaos soak"): when a member's lease
/// ends between spending credit and reporting it, the leader re-grants that credit, so the pods
/// can briefly hold up to one member's share (3 of the slack of 8 with three replicas) above the
/// bound of 24. The soak and the report keep the strict bound; CI tolerates exactly that excess
/// until the fix lands, and fails beyond it.
fn within_open_i1_gap(measured: &str) -> bool {
    const BOUND: u64 = 24;
    const ONE_SHARE: u64 = 3;
    measured
        .strip_prefix("peak ")
        .and_then(|m| m.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|peak| peak <= BOUND + ONE_SHARE)
}

//! The randomized chaos suite, bounded for CI: a few seeds, each a fresh three-replica cluster
//! (Envoy, simulated pods, cluster flow control) under a saturating streaming load for 40 s
//! while the seed's schedule kills, pauses, partitions, delays and clock-skews replicas. Every
//! invariant the checker knows must hold for every seed; the reports are printed. A longer soak:
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
        let violations = report.violations();
        if !violations.is_empty() {
            failed.push((seed, violations.len()));
        }
    }
    assert!(
        failed.is_empty(),
        "invariants violated: {failed:?} (seed, checks)"
    );
}

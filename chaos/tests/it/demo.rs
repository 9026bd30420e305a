//! The demo binary runs a whole local cluster to completion, and fails loudly when a step fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// Run the demo with small settings plus `extra`; assert it succeeded; return its stdout.
fn run_demo(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_epp-demo"))
        .args([
            "--pods",
            "2",
            "--conversations",
            "4",
            "--turns",
            "2",
            "--concurrency",
            "2",
        ])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok: every request succeeded"), "{stdout}");
    stdout
}

#[test]
fn demo_runs_to_completion() {
    let stdout = run_demo(&[]);
    assert!(stdout.contains("round-robin"), "{stdout}");
    assert!(stdout.contains("cached ratio"), "{stdout}");
}

/// Three replicas: cluster mode (Raft between them, Envoy spreading streams over all three).
#[test]
fn demo_runs_three_replicas_in_cluster_mode() {
    let stdout = run_demo(&["--replicas", "3"]);
    assert!(stdout.contains("cluster mode: leader"), "{stdout}");
    assert!(stdout.contains("3 live members"), "{stdout}");
}

#[test]
fn demo_fails_when_a_step_fails() {
    let out = Command::new(env!("CARGO_BIN_EXE_epp-demo"))
        .args(["--pods", "2", "--config", "/nonexistent/epp-config.yaml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("starting the cluster"), "{stderr}");
}

//! The load generator against a live 2-pod sim.

// Helpers outside #[test] fns are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use sim::loadgen::{self, LoadConfig};
use sim::{PodKnobs, Sim, SimConfig};

#[tokio::test]
async fn loadgen_runs_every_turn_without_errors() {
    let sim = Sim::start(SimConfig {
        pods: 2,
        knobs: PodKnobs {
            time_scale: 0.01,
            ..PodKnobs::default()
        },
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let cfg = LoadConfig {
        conversations: 4,
        turns: 3,
        system_prompt_words: 64,
        conversation_words: 64,
        user_words: 16,
        max_tokens: 4,
        concurrency: 2,
        headers: vec![("x-test".into(), "1".into())],
        ..LoadConfig::default()
    };
    let mut reports = Vec::new();
    for pod in sim.pods() {
        let r = loadgen::run(&cfg, &format!("http://{}", pod.addr))
            .await
            .unwrap();
        assert_eq!(r.requests, 12);
        assert_eq!(r.errors, 0, "{r:?}");
        assert_eq!(r.pods.get(&pod.name), Some(&12));
        assert_eq!(r.statuses.get(&200), Some(&12));
        // Later turns re-send the history and conversations share the system prompt.
        assert!(r.cached_ratio > 0.3, "{r:?}");
        assert!(r.ttft_p50_ms > 0.0 && r.e2e_p99_ms >= r.e2e_p50_ms);
        reports.push((pod.name.clone(), r));
    }
    // Same seeded schedule against both pods: same prompt token totals.
    assert_eq!(reports[0].1.prompt_tokens, reports[1].1.prompt_tokens);
    assert_eq!(sim.stats(0).served, 12);
    assert_eq!(sim.stats(1).served, 12);
    let table = loadgen::render_table(&reports);
    assert!(table.contains("sim-0") && table.contains("sim-1"));

    // An unreachable target is all transport errors, not a panic.
    let addr = sim.pods()[0].addr;
    sim.shutdown().await;
    let small = LoadConfig {
        conversations: 1,
        turns: 2,
        ..cfg
    };
    let r = loadgen::run(&small, &format!("http://{addr}"))
        .await
        .unwrap();
    assert_eq!((r.requests, r.errors, r.transport_errors), (2, 2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_tenants_and_short_prompts_are_reported_per_tenant() {
    use sim::loadgen::{Arrival, TenantClass};
    let sim = Sim::start(SimConfig {
        pods: 1,
        knobs: PodKnobs {
            time_scale: 0.01,
            ..PodKnobs::default()
        },
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let cfg = LoadConfig {
        conversations: 3,
        turns: 2,
        system_prompt_words: 32,
        conversation_words: 16,
        user_words: 8,
        max_tokens: 3,
        think_time_ms: 5,
        arrival: Arrival::Poisson,
        rate: 100.0,
        short_prompts: 4,
        tenants: vec![
            TenantClass {
                name: "gold".into(),
                objective: Some("premium".into()),
                requests: 6,
                burst: 2,
                rate: 200.0,
                max_tokens: 2,
                ..TenantClass::default()
            },
            TenantClass {
                name: "free".into(),
                requests: 3,
                rate: 200.0,
                ..TenantClass::default()
            },
        ],
        ..LoadConfig::default()
    };
    assert_eq!(cfg.total_requests(), 6 + 4 + 9);
    let target = format!("http://{}", sim.pods()[0].addr);
    let r = loadgen::run(&cfg, &target).await.unwrap();
    assert_eq!(r.requests, 19);
    assert_eq!(r.errors, 0, "{r:?}");
    assert_eq!(
        r.tenants.keys().collect::<Vec<_>>(),
        ["default", "free", "gold"]
    );
    assert_eq!(r.tenants["gold"].requests, 6);
    assert_eq!(r.tenants["gold"].output_tokens, 12);
    assert_eq!(r.tenants["default"].requests, 10);
    assert!(r.ttft_p90_ms >= r.ttft_p50_ms && r.ttft_p99_ms >= r.ttft_p90_ms);
    assert_eq!(r.ttft_samples_ms.len(), 19);
    assert_eq!(sim.stats(0).served, 19);
    let table = loadgen::render_table(&[("sim".into(), r.clone())]);
    assert!(table.contains("tenant gold") && table.contains("ttft p90 ms"));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["tenants"]["free"]["requests"], 3);
    // Same seed, same schedule: a second run sends the same prompt tokens.
    let again = loadgen::run(&cfg, &target).await.unwrap();
    assert_eq!(again.prompt_tokens, r.prompt_tokens);
    sim.shutdown().await;
}

//! End to end through Envoy: the cost model (the default profile) learns each pod's speed from the
//! responses and routes by it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chaos::cluster::{ClusterSpec, LocalCluster};
use sim::KnobsPatch;
use sim::loadgen::{self, LoadConfig};

/// One pod four times slower than the other three (its time scale: prefill and decode). Round robin
/// gives it a quarter of the requests; the default profile learns its speed within its first
/// responses and gives it much less — at most half the others' mean share (the proportional share
/// is a quarter of theirs) — while no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_pod_gets_proportionally_less() {
    let c = LocalCluster::start(ClusterSpec {
        sim: chaos::workloads::bench_pool(4, sim::EngineModel::Step),
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.sim
        .set_knobs(
            0,
            &KnobsPatch {
                time_scale: Some(4.0),
                ..KnobsPatch::default()
            },
        )
        .unwrap();
    c.wait_for_pods().await.unwrap();
    let slow = c.sim.pods()[0].name.clone();
    // 160 independent requests (no shared prefix: affinity plays no part), 8 at a time.
    let load = LoadConfig {
        conversations: 160,
        turns: 1,
        system_prompt_words: 0,
        conversation_words: 300,
        user_words: 32,
        max_tokens: 16,
        concurrency: 8,
        ..LoadConfig::default()
    };
    let base = c.envoy.url();
    let epp = loadgen::run(&load, &base).await.unwrap();
    let rr = loadgen::run(&load, &format!("{base}/rr")).await.unwrap();
    let share = |r: &loadgen::Report| {
        let total: u64 = r.pods.values().sum();
        let mine = r.pods.get(&slow).copied().unwrap_or(0);
        let others = (total - mine) as f64 / 3.0;
        (mine, mine as f64 / others.max(1.0))
    };
    let (epp_slow, epp_ratio) = share(&epp);
    let (rr_slow, rr_ratio) = share(&rr);
    eprintln!(
        "slow pod {slow}: epp {epp_slow} requests ({epp_ratio:.2} of the others' mean), ttft p50 {:.1} p99 {:.1} ms | round robin {rr_slow} ({rr_ratio:.2}), ttft p50 {:.1} p99 {:.1} ms | epp pods {:?}",
        epp.ttft_p50_ms, epp.ttft_p99_ms, rr.ttft_p50_ms, rr.ttft_p99_ms, epp.pods
    );
    assert_eq!((epp.errors, rr.errors), (0, 0), "{epp:?} {rr:?}");
    assert!(
        rr_ratio > 0.8,
        "round robin spreads evenly, slow or not: {:?}",
        rr.pods
    );
    assert!(
        epp_ratio <= 0.5,
        "the slow pod got {epp_ratio:.2} of the others' mean share: {:?}",
        epp.pods
    );
    // What the model learned, from the admin endpoint: the slow pod's prefill is the slowest.
    let admin = c.epp(0).unwrap().addrs.admin;
    let view: serde_json::Value = reqwest::get(format!("http://{admin}/debug/cost-model"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let slow_addr = c.sim.pods()[0].addr.to_string();
    let per_token = |pod: &str| {
        view["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p[0] == pod)
            .map(|p| p[1]["fit"]["ms_per_token"].as_f64().unwrap())
    };
    let slow_ms = per_token(&slow_addr).expect("the slow pod was observed");
    for p in &c.sim.pods()[1..] {
        if let Some(ms) = per_token(&p.addr.to_string()) {
            assert!(
                slow_ms > ms,
                "learned ms per token: slow {slow_ms} vs {} {ms}; {view}",
                p.addr
            );
        }
    }
    c.shutdown().await;
}

//! llm-d v1.0 features through real Envoy, `epp serve` replicas and simulated vLLM pods, seen
//! from outside: `requestHandler.propagatePriority` puts the request's priority into the
//! forwarded body (vLLM's `priority`, lower first: the objective's priority negated), checked at
//! the pod; `program-aware-fairness` with `strategy: turn-priority` serves an agent on a later
//! turn before a new program's first, and forgets an inactive program's turns — on one replica
//! and on three in cluster mode (the turns counted in the replicated flow state, whichever
//! replica Envoy sends each turn to).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use sim::{PodKnobs, SimConfig};

/// `propagate`: the config's `requestHandler.propagatePriority`.
async fn start(dir: &std::path::Path, propagate: bool) -> LocalCluster {
    let objectives = dir.join("objectives.yaml");
    std::fs::write(
        &objectives,
        chaos::workloads::objectives_yaml(&[("premium", 10), ("batch", -10)]),
    )
    .unwrap();
    let config = format!(
        "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n\
         requestHandler: {{propagatePriority: {propagate}}}\n"
    );
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: vec![
            "--config-text".into(),
            config,
            "--objectives-file".into(),
            objectives.display().to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    c
}

/// The `priority` the pod found in the body of a request naming `objective` (none: absent).
async fn priority_at_the_pod(
    c: &LocalCluster,
    objective: Option<&str>,
    stream: bool,
) -> Option<String> {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/completions", c.envoy.url()))
        .json(&serde_json::json!({
            "model": "sim-model", "prompt": "hello there", "max_tokens": 2, "stream": stream,
        }));
    if let Some(o) = objective {
        req = req.header("x-llm-d-inference-objective", o);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200, "{objective:?}");
    r.headers()
        .get(sim::server::RECEIVED_PRIORITY_HEADER)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn propagate_priority_writes_the_objectives_priority_into_the_body() {
    let dir = tempfile::tempdir().unwrap();
    let c = start(dir.path(), true).await;
    for stream in [false, true] {
        assert_eq!(
            priority_at_the_pod(&c, Some("premium"), stream)
                .await
                .as_deref(),
            Some("-10"),
            "premium (10) is served first by vLLM: -10"
        );
        assert_eq!(
            priority_at_the_pod(&c, Some("batch"), stream)
                .await
                .as_deref(),
            Some("10")
        );
        assert_eq!(
            priority_at_the_pod(&c, None, stream).await.as_deref(),
            Some("0"),
            "no objective: priority 0"
        );
    }
    c.shutdown().await;

    // Off (the default): the body goes as the client sent it.
    let c = start(dir.path(), false).await;
    assert_eq!(priority_at_the_pod(&c, Some("premium"), false).await, None);
    c.shutdown().await;
}

/// One pod, one request at a time (`maxConcurrency: 1`), one band ordered by turn priority;
/// a program idle for 5 s starts again at turn 1 (well past the time a filler holds the slot).
const TURNS: &str = "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: turns, type: program-aware-fairness, parameters: {strategy: turn-priority, turnPriorityInactivitySeconds: 5}}
- {name: one, type: concurrency-detector, parameters: {maxConcurrency: 1}}
flowControl:
  saturationDetector: {pluginRef: one}
  priorityBands: [{priority: 0, fairnessPolicyRef: turns}]
";

async fn turns_cluster(replicas: usize) -> LocalCluster {
    let c = turns_cluster_with(replicas, vec![]).await;
    if replicas > 1 {
        flow_configured(&c, replicas).await;
    }
    c
}

/// `replica_args`: further flags for one replica (by node id, from 1).
async fn turns_cluster_with(
    replicas: usize,
    replica_args: Vec<(u64, Vec<String>)>,
) -> LocalCluster {
    let mut epp_args = vec!["--config-text".to_string(), TURNS.to_string()];
    if replicas > 1 {
        epp_args.extend(["--flow-control-scope".into(), "cluster".into()]);
    }
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 1,
            knobs: PodKnobs {
                decode_ms_per_token: 2.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        replicas,
        raft: replicas > 1,
        epp_args,
        replica_args,
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    c
}

/// Whether replica `i` runs the replicated flow configuration.
async fn configured(c: &LocalCluster, i: usize) -> bool {
    c.epp(i)
        .unwrap()
        .flow_view()
        .await
        .is_ok_and(|v| v["local"]["configured"] == true && v["global"]["pool_endpoints"] == 1)
}

async fn flow_configured(c: &LocalCluster, replicas: usize) {
    chaos::wait::until(
        "cluster flow control ready",
        Duration::from_secs(20),
        || async {
            let mut ok = true;
            for i in 0..replicas {
                ok &= configured(c, i).await;
            }
            ok
        },
    )
    .await
    .unwrap();
}

/// One turn of `program` (its fairness id) generating `tokens`; when it finished.
async fn turn(url: String, program: &'static str, tokens: u32) -> Instant {
    let r = reqwest::Client::new()
        .post(url)
        .header("x-llm-d-inference-fairness-id", program)
        .json(&serde_json::json!({
            "model": "sim-model", "messages": [{"role": "user", "content": "next step"}],
            "max_tokens": tokens,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{program}");
    r.bytes().await.unwrap();
    Instant::now()
}

/// A flow-control gauge of the (single) band, as replica 0 reports it (cluster mode: the
/// cluster's value).
async fn gauge(c: &LocalCluster, name: &str) -> Option<f64> {
    let m = c.epp(0).unwrap().metrics().await.ok()?;
    let needle = format!("llm_d_epp_flow_control_{name}{{priority=\"0\"");
    m.lines()
        .find(|l| l.starts_with(&needle))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Once nothing is in flight, a filler holds the only slot (~2 s); `first`'s turn queues, then
/// `second`'s: which of the two the controller served first (the slot takes one at a time: the
/// first served finishes first).
async fn contend(c: &LocalCluster, first: &'static str, second: &'static str) -> &'static str {
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let until = |what: &'static str, name: &'static str, v: f64| {
        chaos::wait::until(what, Duration::from_secs(10), move || async move {
            gauge(c, name).await == Some(v)
        })
    };
    until("nothing in flight", "inflight_requests", 0.0)
        .await
        .unwrap();
    let filler = tokio::spawn(turn(url.clone(), "filler", 1000));
    until("the filler dispatched", "inflight_requests", 1.0)
        .await
        .unwrap();
    let a = tokio::spawn(turn(url.clone(), first, 1));
    until("the first turn queued", "queue_size", 1.0)
        .await
        .unwrap();
    let b = tokio::spawn(turn(url, second, 1));
    until("the second turn queued", "queue_size", 2.0)
        .await
        .unwrap();
    filler.await.unwrap();
    let (ta, tb) = (a.await.unwrap(), b.await.unwrap());
    if ta < tb { first } else { second }
}

/// An agent on its 7th turn goes before a newcomer's first (which queued earlier); after 5 s of
/// quiet both start again at turn 1, so the newcomer — now on its 3rd — goes before the agent.
async fn agent_loop_is_served_by_turn(c: &LocalCluster) {
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    for _ in 0..6 {
        turn(url.clone(), "agent", 1).await;
    }
    assert_eq!(
        contend(c, "newcomer", "agent").await,
        "agent",
        "turn 7 before turn 1"
    );
    tokio::time::sleep(Duration::from_millis(5500)).await;
    for _ in 0..2 {
        turn(url.clone(), "newcomer", 1).await;
    }
    assert_eq!(
        contend(c, "agent", "newcomer").await,
        "newcomer",
        "the inactive agent restarts at turn 1; the newcomer is on turn 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_priority_serves_later_turns_first_and_resets_inactive_programs() {
    let c = turns_cluster(1).await;
    agent_loop_is_served_by_turn(&c).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_priority_holds_cluster_wide_across_three_replicas() {
    let c = turns_cluster(3).await;
    agent_loop_is_served_by_turn(&c).await;
    c.shutdown().await;
}

/// A rolling upgrade: while replica 3 runs a build that does not speak turn priority (standing
/// in: it advertises only the older feature), no replica proposes the configuration — an older
/// build would run least attained service in its place and the replicas' states would part;
/// once replica 3 runs this build, the cluster configures it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_priority_waits_for_every_replica_to_speak_it() {
    let sim = sim::Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    let old: &[&str] = &["--cluster-features", "1"];
    let mut c = chaos::raft::RaftCluster::start_with_each(
        3,
        &endpoints,
        &["--config-text", TURNS, "--flow-control-scope", "cluster"],
        &[(3, old)],
    )
    .await
    .unwrap();
    chaos::wait::until("a leader", Duration::from_secs(15), || async {
        c.agreed_leader(&[1, 2, 3]).await.is_some()
    })
    .await
    .unwrap();
    async fn configured(c: &chaos::raft::RaftCluster, id: u64) -> bool {
        let v = c.replica(id).unwrap().flow_view().await;
        v.is_ok_and(|v| v["local"]["configured"] == true)
    }
    // Every replica heartbeats every 500 ms: after 3 s all three have said what they speak.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in 1..=3 {
        assert!(
            !configured(&c, id).await,
            "replica {id} runs turn priority beside an older build"
        );
    }
    // Replica 3 upgraded.
    c.kill9(3).await.unwrap();
    c.set_own_args(3, Vec::new());
    c.restart(3).await.unwrap();
    chaos::wait::until(
        "configured once all speak it",
        Duration::from_secs(15),
        || async { configured(&c, 1).await && configured(&c, 2).await && configured(&c, 3).await },
    )
    .await
    .unwrap();
    c.shutdown().await;
    sim.shutdown().await;
}

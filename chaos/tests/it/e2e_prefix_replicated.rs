//! End to end through Envoy, Active-Active: three EPP replicas share one approximate prefix index.
//!
//! The multi-turn workload of `e2e_prefix` (64 conversations × 6 turns, ~8k-token contexts, 4 pods
//! whose KV capacity holds the working set only when each conversation sticks to its pod) runs
//! three times:
//! 1. one replica — the reference;
//! 2. three replicas in cluster mode behind one Envoy, whose ext_proc cluster spreads the streams
//!    over all three (`LEAST_REQUEST`), so a conversation's turns reach different replicas — with
//!    prefix replication (CRDT deltas between replicas) the cached-token ratio must stay within 2
//!    points of (1), and after the traffic stops the three indexes must be identical;
//! 3. the same three replicas with `--prefix-replication off` (what llm-d does in Active-Active):
//!    each replica only knows the turns it routed, and the ratio drops markedly.
//!
//! A second test cuts a replica off for 30 s under traffic and adds a fourth one mid-run: both
//! must catch up (anti-entropy) within a few seconds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::locate::workspace_root;
use chaos::workloads;
use sim::loadgen::{self, LoadConfig, Report};

fn spec(replicas: usize, extra: &[&str]) -> ClusterSpec {
    let mut epp_args = vec![
        "--config-file".to_string(),
        workspace_root()
            .join("deploy/examples/llm-d-affinity.yaml")
            .display()
            .to_string(),
    ];
    epp_args.extend(extra.iter().map(|s| s.to_string()));
    ClusterSpec {
        sim: workloads::prefix_affinity_pods(),
        replicas,
        raft: replicas > 1,
        epp_args,
        ..ClusterSpec::default()
    }
}

/// Requests each replica answered (`llm_d_epp_request_total`, summed over labels).
async fn requests_per_replica(c: &LocalCluster, n: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..n {
        let text = c.epp(i).unwrap().metrics().await.unwrap();
        let total: f64 = text
            .lines()
            .filter(|l| l.starts_with("llm_d_epp_request_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        out.push(total);
    }
    out
}

async fn run(c: &LocalCluster) -> Report {
    c.wait_for_pods().await.unwrap();
    let r = loadgen::run(&workloads::multi_turn(), &c.envoy.url())
        .await
        .unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    assert_eq!(r.requests, 64 * 6);
    r
}

/// Wait until every replica reports the same per-pod index content; returns how long it took.
async fn converged(c: &LocalCluster, n: usize, limit: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    loop {
        let mut views = Vec::new();
        for i in 0..n {
            views.push(c.epp(i).unwrap().prefix_index().await.unwrap()["pods"].clone());
        }
        if views.windows(2).all(|w| w[0] == w[1]) {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > limit {
            return Err(format!("indexes differ after {limit:?}: {views:#?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The tests of this file measure: one at a time (the harness runs a binary's tests in parallel).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_route_like_one_only_with_prefix_replication() {
    let _serial = SERIAL.lock().await;
    let single = LocalCluster::start(spec(1, &[])).await.unwrap();
    let one = run(&single).await;
    single.shutdown().await;

    let replicated = LocalCluster::start(spec(3, &[])).await.unwrap();
    let on = run(&replicated).await;
    let spread = requests_per_replica(&replicated, 3).await;
    let took = converged(&replicated, 3, Duration::from_secs(2)).await;
    let index = replicated.epp(0).unwrap().prefix_index().await.unwrap();
    let mut gossip = Vec::new();
    for i in 0..3 {
        gossip.push(replicated.epp(i).unwrap().metrics().await.unwrap());
    }
    replicated.shutdown().await;

    let isolated = LocalCluster::start(spec(3, &["--prefix-replication", "off"]))
        .await
        .unwrap();
    let off = run(&isolated).await;
    isolated.shutdown().await;

    eprintln!(
        "{}",
        loadgen::render_table(&[
            ("1 replica".into(), one.clone()),
            ("3, replicated".into(), on.clone()),
            ("3, per replica".into(), off.clone()),
        ])
    );
    eprintln!("requests per replica (replicated run): {spread:?}");
    eprintln!("indexes identical {took:?} after the traffic stopped; replica 1's index: {index}");
    for l in gossip[0]
        .lines()
        .filter(|l| l.starts_with("llm_d_epp_prefix_gossip"))
    {
        eprintln!("replica 1: {l}");
    }
    let sum = |name: &str| -> f64 {
        gossip
            .iter()
            .flat_map(|m| m.lines())
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let sent = sum("llm_d_epp_prefix_gossip_bytes_total{direction=\"sent\"}");
    eprintln!(
        "gossip: {sent} bytes sent by the 3 replicas = {:.0} bytes per routed request",
        sent / (64.0 * 6.0)
    );
    eprintln!(
        "cached ratio: 1 replica {:.3}, 3 replicated {:.3}, 3 per replica {:.3}",
        one.cached_ratio, on.cached_ratio, off.cached_ratio
    );

    // Envoy really spread the streams: every replica routed a good share.
    for (i, n) in spread.iter().enumerate() {
        assert!(
            *n >= 0.15 * (64.0 * 6.0),
            "replica {i} routed only {n} requests: {spread:?}"
        );
    }
    // Invariant I8: identical indexes once traffic stops. (One gossip round is 5 ms; the bound
    // leaves room for the admin round trips of a loaded 2-core machine.)
    took.unwrap();
    assert!(index["entries"].as_u64().unwrap() > 0, "{index}");
    assert!(
        on.cached_ratio >= one.cached_ratio - 0.02,
        "replicated: {:.3} vs one replica {:.3}",
        on.cached_ratio,
        one.cached_ratio
    );
    assert!(
        off.cached_ratio <= one.cached_ratio - 0.10,
        "without replication the ratio should drop markedly: {:.3} vs one replica {:.3}",
        off.cached_ratio,
        one.cached_ratio
    );
}

fn light(seed: u64) -> LoadConfig {
    LoadConfig {
        conversations: 8,
        turns: 3,
        system_prompt_words: 200,
        conversation_words: 400,
        user_words: 16,
        max_tokens: 4,
        concurrency: 3,
        seed,
        ..LoadConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_and_a_new_one_catch_up() {
    let _serial = SERIAL.lock().await;
    let mut c = LocalCluster::start(spec(3, &[])).await.unwrap();
    c.wait_for_pods().await.unwrap();
    let url = c.envoy.url();
    let r = loadgen::run(&light(1), &url).await.unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    converged(&c, 3, Duration::from_secs(2)).await.unwrap();

    // 30 s cut off under traffic: replica 3 keeps routing on what it knows, the others too.
    c.raft.as_ref().unwrap().isolate(3);
    let t0 = Instant::now();
    let mut seed = 2;
    while t0.elapsed() < Duration::from_secs(30) {
        let r = loadgen::run(&light(seed), &url).await.unwrap();
        assert_eq!(r.errors, 0, "routing must go on during a partition: {r:?}");
        seed += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        converged(&c, 3, Duration::from_millis(300)).await.is_err(),
        "a partitioned replica cannot have learned the others' decisions"
    );
    c.raft.as_ref().unwrap().heal_all();
    let healed = converged(&c, 3, Duration::from_secs(10)).await.unwrap();

    // A fourth replica joins while traffic flows and catches up by snapshot (anti-entropy
    // against an empty index).
    let raft = c.raft.as_mut().unwrap();
    raft.start_joiner(4).await.unwrap();
    let addr4 = raft.public_addr(4).unwrap();
    let admin = c.epp(0).unwrap().addrs.admin;
    let traffic = tokio::spawn({
        let url = url.clone();
        async move { loadgen::run(&light(1000), &url).await.unwrap() }
    });
    let t_join = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("http://{admin}/debug/cluster/add-learner"))
        .json(&serde_json::json!({"id": 4, "addr": addr4}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "add-learner: {}", resp.status());
    let r = traffic.await.unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    let joined = converged(&c, 4, Duration::from_secs(10)).await.unwrap();
    let index = c.epp(3).unwrap().prefix_index().await.unwrap();
    eprintln!(
        "partitioned 30 s: identical {healed:?} after healing; joiner identical {joined:?} after \
         the traffic (joined {:?} before) with {} entries",
        t_join.elapsed(),
        index["entries"]
    );
    assert!(index["entries"].as_u64().unwrap() > 0, "{index}");
    assert!(
        healed <= Duration::from_secs(5),
        "healed replica converged only after {healed:?}"
    );
    assert!(
        joined <= Duration::from_secs(5),
        "joiner converged only after {joined:?}"
    );
    c.shutdown().await;
}

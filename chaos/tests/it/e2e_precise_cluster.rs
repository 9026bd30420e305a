//! End to end through Envoy, Active-Active: three replicas share one precise prefix index while
//! each pod's KV-event stream is subscribed by its two scrape owners only (`--scrape-owners 2`,
//! the default).
//!
//! Eight simulated pods with small KV caches and a CPU offload tier (vLLM's native offloading:
//! hash-only `BlockStored` events with medium "CPU") publish KV events. Checked from outside the
//! EPP:
//! every pod is subscribed by exactly two replicas; with Envoy spreading the streams over the
//! three replicas, the cached tokens each replica predicted for the pod it chose match what the
//! pods reported within 5%; once traffic stops every replica's index equals every pod's GPU cache
//! and CPU tier (the simulator's own counts), subscribed or mirrored, tier by tier; after `kill -9` of a replica the survivors
//! take its subscriptions over (replaying the streams) and converge again; a replica cut off from
//! its peers for 30 s converges after healing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::workloads;
use sim::loadgen::{self, LoadConfig};

fn spec() -> ClusterSpec {
    let mut sim = workloads::kv_event_pods(8);
    // Half the GPU cache of the one-replica test's pods: the engines evict, and load back from
    // their CPU tier, in every run.
    sim.knobs.kv_blocks = 300;
    sim.knobs.cpu_offload_blocks = 1200;
    ClusterSpec {
        sim,
        replicas: 3,
        raft: true,
        epp_args: vec![
            "--config-text".into(),
            workloads::llmd_prefix_config("precise-prefix-cache-producer"),
        ],
        ..ClusterSpec::default()
    }
}

fn load(seed: u64, conversations: usize) -> LoadConfig {
    LoadConfig {
        conversations,
        turns: 4,
        system_prompt_words: 640,
        conversation_words: 1500,
        user_words: 32,
        max_tokens: 16,
        concurrency: 6,
        seed,
        ..LoadConfig::default()
    }
}

fn counter(metrics: &str, name: &str) -> u64 {
    chaos::epp::metric_sum(metrics, name) as u64
}

/// Replica `i`'s `/debug/kv-events`.
async fn view(c: &LocalCluster, i: usize) -> serde_json::Value {
    c.epp(i)
        .unwrap()
        .admin_json("/debug/kv-events")
        .await
        .unwrap()
}

/// How many of replicas `live` subscribe to each pod.
async fn subscribers(c: &LocalCluster, live: &[usize]) -> BTreeMap<String, usize> {
    let mut out: BTreeMap<String, usize> = BTreeMap::new();
    for &i in live {
        if let Some(subs) = view(c, i).await["subscriptions"].as_object() {
            for pod in subs.keys() {
                *out.entry(pod.clone()).or_default() += 1;
            }
        }
    }
    out
}

/// Subscriptions of replicas `live` still replaying their stream (not yet following it live).
async fn replaying(c: &LocalCluster, live: &[usize]) -> usize {
    let mut n = 0;
    for &i in live {
        if let Some(subs) = view(c, i).await["subscriptions"].as_object() {
            n += subs.values().filter(|s| s["replaying"] != false).count();
        }
    }
    n
}

/// Per replica and pod: gaps, resyncs and restarts of its KV-event stream (what explains a
/// misprediction).
async fn recoveries(c: &LocalCluster, live: &[usize]) -> Vec<(usize, String, u64, u64, u64)> {
    let mut out = Vec::new();
    for &i in live {
        if let Some(subs) = view(c, i).await["subscriptions"].as_object() {
            let n = |p: &serde_json::Value, k: &str| p[k].as_u64().unwrap_or(0);
            for (pod, p) in subs {
                out.push((
                    i,
                    pod.clone(),
                    n(p, "gaps"),
                    n(p, "resyncs"),
                    n(p, "restarts"),
                ));
            }
        }
    }
    out
}

/// Every pod's blocks on the GPU and in the CPU tier, from the simulator.
fn truth(c: &LocalCluster) -> BTreeMap<String, (u64, u64)> {
    c.sim
        .pods()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let s = c.sim.stats(i);
            (p.addr.to_string(), (s.cached_blocks, s.offloaded_blocks))
        })
        .collect()
}

/// Wait until replicas `live` hold identical indexes equal to the pods' caches; how long it took.
async fn converged(c: &LocalCluster, live: &[usize], limit: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    loop {
        let want = truth(c);
        let mut views = Vec::new();
        for &i in live {
            views.push(view(c, i).await["pods"].clone());
        }
        let blocks = |v: &serde_json::Value| -> BTreeMap<String, (u64, u64)> {
            let n = |pod: &str, t: &str| v[pod]["tiers"][t].as_u64().unwrap_or(0);
            want.keys()
                .map(|pod| (pod.clone(), (n(pod, "gpu"), n(pod, "cpu"))))
                .collect()
        };
        if views.windows(2).all(|w| w[0] == w[1]) && blocks(&views[0]) == want {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > limit {
            let got: Vec<_> = views.iter().map(blocks).collect();
            return Err(format!(
                "not converged after {limit:?}: pods {want:?}, replicas {got:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Ownership settles once the replicas hear each other (fan-out every 50 ms): exactly two
/// subscribers per pod, each following its stream live (a subscription moved while ownership
/// settled replays it first; traffic during the replay would be predicted from a partial view).
async fn settle(c: &LocalCluster) {
    let settled = chaos::wait::until(
        "two live subscribers per pod",
        Duration::from_secs(10),
        || async {
            let s = subscribers(c, &[0, 1, 2]).await;
            s.len() == 8 && s.values().all(|n| *n == 2) && replaying(c, &[0, 1, 2]).await == 0
        },
    )
    .await;
    let before = subscribers(c, &[0, 1, 2]).await;
    settled.unwrap_or_else(|e| panic!("{e}: {before:?}"));
}

/// Waits (≤ 5 s) until the replicas observed every response (the observing stream may end just
/// after the client's): `cached` tokens in all.
async fn all_observed(c: &LocalCluster, cached: u64) {
    let observed_all = || async {
        let mut sum = 0;
        for i in 0..3 {
            let m = c.epp(i).unwrap().metrics().await.unwrap();
            sum += counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total");
        }
        sum == cached
    };
    let _ = chaos::wait::until(
        "every response observed",
        Duration::from_secs(5),
        observed_all,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_one_precise_index_from_sharded_subscriptions() {
    let mut c = LocalCluster::start(spec()).await.unwrap();
    c.wait_for_pods().await.unwrap();
    let url = c.envoy.url();
    settle(&c).await;
    let r = loadgen::run(&load(1, 24), &url).await.unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    all_observed(&c, r.cached_tokens).await;

    // Still exactly two subscribers per pod.
    let subscribers_after = subscribers(&c, &[0, 1, 2]).await;
    // Accuracy over the three replicas' routing decisions.
    let (mut predicted, mut observed, mut err, mut routed) = (0, 0, 0, Vec::new());
    let (mut gossip_bytes, mut changes) = (0, 0);
    for i in 0..3 {
        let m = c.epp(i).unwrap().metrics().await.unwrap();
        predicted += counter(&m, "llm_d_epp_prefix_cached_tokens_predicted_total");
        observed += counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total");
        err += counter(&m, "llm_d_epp_prefix_cached_tokens_abs_error_total");
        routed.push(counter(&m, "llm_d_epp_request_total"));
        gossip_bytes += counter(
            &m,
            "llm_d_epp_prefix_gossip_bytes_total{direction=\"sent\"}",
        );
        changes += counter(&m, "llm_d_epp_kv_events_blocks_total");
    }
    let took = converged(&c, &[0, 1, 2], Duration::from_secs(3)).await;
    // Each block event is applied by the pod's two owners, each of which sends it to two peers.
    eprintln!(
        "gossip: {gossip_bytes} bytes sent for {changes} block events applied by the owners: \
         {:.1} bytes per event applied",
        gossip_bytes as f64 / changes.max(1) as f64
    );
    eprintln!(
        "subscribers per pod {subscribers_after:?}; requests per replica {routed:?}; predicted {predicted} \
         observed {observed} |error| {err} ({:.2}%); cached ratio {:.3}; converged {took:?} after \
         the traffic",
        err as f64 * 100.0 / observed.max(1) as f64,
        r.cached_ratio
    );
    assert_eq!(subscribers_after.len(), 8, "{subscribers_after:?}");
    assert!(
        subscribers_after.values().all(|n| *n == 2),
        "{subscribers_after:?}"
    );
    assert!(routed.iter().all(|n| *n > 0), "Envoy spreads: {routed:?}");
    assert_eq!(observed, r.cached_tokens);
    let loaded: u64 = (0..8).map(|i| c.sim.stats(i).offload_hits_tokens).sum();
    eprintln!("prompt tokens the pods loaded back from their CPU tier: {loaded}");
    assert!(
        loaded > 0,
        "the CPU tier must be used for the tiers' replication to be tested"
    );
    // Not exact even with every stream followed live: conversations share a 640-word system
    // prompt and start six at a time, so two first turns can reach a pod together — the second
    // is predicted from the index before the first's blocks are stored, and finds them computed
    // (or not) depending on the engine's timing. Measured over 12 runs (2026-12-04): 8 exact,
    // 2 at 0.44%, 2 at 2.4% and 4.1% (the bound was 2% until then); 2026-12-06, the pods with a
    // CPU tier: 10 of 10 exact (and 4 of 4 in centralized mode below).
    assert!(
        err as f64 <= 0.05 * observed as f64,
        "prediction error {err} of {observed}; streams' (replica, pod, gaps, resyncs, restarts): {:?}",
        recoveries(&c, &[0, 1, 2]).await
    );
    took.unwrap();

    // kill -9 replica 2 under traffic: once it is missed (2 s without a word), its
    // subscriptions move to the survivors, which replay the streams.
    let t_kill = Instant::now();
    c.raft.as_mut().unwrap().kill9(2).await.unwrap();
    let traffic = tokio::spawn({
        let url = url.clone();
        async move { loadgen::run(&load(2, 16), &url).await.unwrap() }
    });
    let mut moved = None;
    while t_kill.elapsed() < Duration::from_secs(10) {
        let s = subscribers(&c, &[0, 2]).await;
        if s.len() == 8 && s.values().all(|n| *n == 2) {
            moved = Some(t_kill.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = traffic.await.unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    let after_kill = converged(&c, &[0, 2], Duration::from_secs(10)).await;
    eprintln!(
        "after kill -9: every pod subscribed twice again {moved:?} after the kill; indexes \
         converged {after_kill:?} after the traffic ({:?} after the kill)",
        t_kill.elapsed()
    );
    assert!(
        moved.is_some(),
        "the dead replica's subscriptions did not move"
    );
    after_kill.unwrap();
    c.raft.as_mut().unwrap().restart(2).await.unwrap();
    converged(&c, &[0, 1, 2], Duration::from_secs(10))
        .await
        .unwrap();

    // Replica 3 cut off from its peers for 30 s under traffic, then healed.
    c.raft.as_ref().unwrap().isolate(3);
    let t0 = Instant::now();
    let mut seed = 3;
    while t0.elapsed() < Duration::from_secs(30) {
        let r = loadgen::run(&load(seed, 4), &url).await.unwrap();
        assert_eq!(r.errors, 0, "routing goes on during a partition: {r:?}");
        seed += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    c.raft.as_ref().unwrap().heal_all();
    let healed = converged(&c, &[0, 1, 2], Duration::from_secs(10))
        .await
        .unwrap();
    eprintln!("partitioned 30 s: converged {healed:?} after healing");
    c.shutdown().await;
}

/// llm-d's centralized mode with three replicas: every replica binds its own `zmqEndpoint`, and
/// each pod's publisher connects to one of them (as through a Service), the pods spread over
/// the three. The replica a pod publishes to forwards its messages to the pod's owners over the
/// peer port. Checked from outside the EPP: every pod followed by exactly two replicas; the
/// predictions match what the pods report within 5%; once traffic stops every replica's index
/// equals every pod's GPU cache and CPU tier — including on replicas no pod publishes to
/// directly for the pods they own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn centralized_mode_across_replicas_forwards_to_the_owners() {
    // Ports the replicas bind, given to the pods before the replicas start.
    let endpoints: Vec<String> = (0..3)
        .map(|_| {
            format!(
                "tcp://127.0.0.1:{}",
                chaos::ports::for_later_bind().unwrap()
            )
        })
        .collect();
    let mut spec = spec();
    spec.epp_args.clear();
    if let Some(kv) = spec.sim.kv_events.as_mut() {
        kv.connect = Some(endpoints.join(","));
    }
    spec.replica_args = endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let cfg = workloads::llmd_prefix_config("precise-prefix-cache-producer").replacen(
                "- type: precise-prefix-cache-producer\n",
                &format!(
                    "- type: precise-prefix-cache-producer\n  parameters:\n    kvEventsConfig:\n      \
                     discoverPods: false\n      zmqEndpoint: \"{e}\"\n"
                ),
                1,
            );
            (i as u64 + 1, vec!["--config-text".to_string(), cfg])
        })
        .collect();
    let c = LocalCluster::start(spec).await.unwrap();
    c.wait_for_pods().await.unwrap();
    settle(&c).await;
    for (i, e) in endpoints.iter().enumerate() {
        assert_eq!(view(&c, i).await["central_endpoint"], e.as_str());
    }
    let r = loadgen::run(&load(1, 24), &c.envoy.url()).await.unwrap();
    assert_eq!(r.errors, 0, "{r:?}");
    all_observed(&c, r.cached_tokens).await;
    let (mut predicted, mut observed, mut err, mut forwarded) = (0, 0, 0, 0);
    for i in 0..3 {
        let m = c.epp(i).unwrap().metrics().await.unwrap();
        predicted += counter(&m, "llm_d_epp_prefix_cached_tokens_predicted_total");
        observed += counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total");
        err += counter(&m, "llm_d_epp_prefix_cached_tokens_abs_error_total");
        forwarded += m
            .lines()
            .filter(|l| {
                l.starts_with("llm_d_epp_kv_events_messages_total{")
                    && l.contains("outcome=\"forwarded\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64;
    }
    let took = converged(&c, &[0, 1, 2], Duration::from_secs(5)).await;
    let streams = recoveries(&c, &[0, 1, 2]).await;
    eprintln!(
        "centralized, 3 replicas: predicted {predicted} observed {observed} |error| {err} \
         ({:.2}%); {forwarded} messages forwarded; converged {took:?} after the traffic; streams \
         (replica, pod, gaps, resyncs, restarts): {streams:?}",
        err as f64 * 100.0 / observed.max(1) as f64
    );
    assert_eq!(observed, r.cached_tokens);
    assert!(observed > 0);
    assert!(forwarded > 0, "the replicas forward to the owners");
    // As in the test above (two first turns sharing the system prompt can race).
    assert!(
        err as f64 <= 0.05 * observed as f64,
        "prediction error {err} of {observed}; streams {streams:?}"
    );
    took.unwrap();
    c.shutdown().await;
}

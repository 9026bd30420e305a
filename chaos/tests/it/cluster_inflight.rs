//! In-flight load across replicas (over the real ext_proc protocol, a synthetic Envoy against a
//! cluster): a request routed by replica 1 whose response replica 2 observes is released on
//! replica 1 — its in-flight charge, with `--flow-control-scope replica` its flow-control slot,
//! and with cluster-wide flow control its credit admission, which replica 1 counts in bulk in the
//! replicated ledger — instead of lingering until the sweep; and each replica's scorers see the
//! other's in-flight requests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::extproc;
use chaos::raft::RaftCluster;
use sim::{Sim, SimConfig};

const BODY: &[u8] = extproc::SMALL_CHAT;

async fn client(c: &RaftCluster, id: u64) -> extproc::Client {
    let addr = c.replica(id).unwrap().addrs.ext_proc;
    extproc::Client::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

async fn get_json(c: &RaftCluster, id: u64, path: &str) -> serde_json::Value {
    c.replica(id).unwrap().admin_json(path).await.unwrap()
}

async fn cluster(sim: &Sim, dir: &std::path::Path, extra: &[&str]) -> RaftCluster {
    cluster_of(2, sim, dir, extra).await
}

async fn cluster_of(n: u64, sim: &Sim, dir: &std::path::Path, extra: &[&str]) -> RaftCluster {
    cluster_each(n, sim, dir, extra, &[]).await
}

async fn cluster_each(
    n: u64,
    sim: &Sim,
    dir: &std::path::Path,
    extra: &[&str],
    own: &[(u64, &[&str])],
) -> RaftCluster {
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    let c = RaftCluster::start_with_each(n, &endpoints, extra, own)
        .await
        .unwrap();
    let ids: Vec<u64> = (1..=n).collect();
    chaos::wait::until("a leader", Duration::from_secs(15), || async {
        c.agreed_leader(&ids).await.is_some()
    })
    .await
    .unwrap();
    c
}

/// Relayed settlements of `outcome` a replica counted.
async fn relayed(c: &RaftCluster, id: u64, outcome: &str) -> f64 {
    let text = c.replica(id).unwrap().metrics().await.unwrap();
    let series = format!("llm_d_epp_cluster_settlements_relayed_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
        .sum()
}

/// Three replicas: the key names replica 1 as its maker, so replica 2 relays the settlement to
/// replica 1 only — replica 3 receives nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_observed_elsewhere_releases_the_routing_replicas_charge() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = cluster_of(3, &sim, dir.path(), &[]).await;
    let info = extproc::route(&mut client(&c, 1).await, BODY, "r")
        .await
        .unwrap();
    let tracked = |id| {
        let c = &c;
        async move { get_json(c, id, "/debug/inflight").await["tracked_requests"].clone() }
    };
    assert_eq!(tracked(1).await, 1);
    extproc::observe(&mut client(&c, 2).await, &info, None)
        .await
        .unwrap();
    chaos::wait::until("replica 1 released it", Duration::from_secs(5), || async {
        tracked(1).await == 0
    })
    .await
    .unwrap();
    assert_eq!(tracked(2).await, 0);
    assert_eq!(tracked(3).await, 0);
    assert_eq!(relayed(&c, 2, "sent").await, 1.0);
    assert_eq!(relayed(&c, 1, "released").await, 1.0);
    // Nothing went to replica 3 (were it sent there, it would count it as not held: give a
    // stray batch a while to land: it would have left with replica 1's).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(relayed(&c, 3, "not_held").await, 0.0);
    assert_eq!(relayed(&c, 3, "released").await, 0.0);
    c.shutdown().await;
    sim.shutdown().await;
}

/// Three replicas with cluster-wide flow control, replica 1 admitting on credit: warm-up
/// requests (each settled where it was routed) until one takes the fast path — a replica's
/// first request of a priority asks the state whether the fast path is open, and until the pool
/// is known the credit granted may exceed what the pool's capacity allows, so the fast path
/// opens a rebalance and a lease after the leader first reports the pool.
async fn credit_cluster(sim: &Sim, dir: &std::path::Path) -> RaftCluster {
    credit_cluster_each(sim, dir, &[]).await
}

async fn credit_cluster_each(
    sim: &Sim,
    dir: &std::path::Path,
    own: &[(u64, &[&str])],
) -> RaftCluster {
    let config = chaos::workloads::flow_control_config(64);
    let c = cluster_each(3, sim, dir, &["--config-text", &config], own).await;
    chaos::wait::until("credit on replica 1", Duration::from_secs(15), || async {
        let f = get_json(&c, 1, "/debug/flow").await;
        f["local"]["configured"] == true && f["local"]["credit"].as_u64().unwrap_or(0) > 0
    })
    .await
    .unwrap();
    let mut n = 0;
    chaos::wait::until("a fast-path admission", Duration::from_secs(15), || {
        n += 1;
        let rid = format!("warm-{n}");
        let c = &c;
        async move {
            let warm = extproc::route(&mut client(c, 1).await, BODY, &rid)
                .await
                .unwrap();
            extproc::observe(&mut client(c, 1).await, &warm, None)
                .await
                .unwrap();
            chaos::wait::until("the warm-up settled", Duration::from_secs(5), || async {
                get_json(c, 1, "/debug/flow").await["global"]["totals"]["inflight_requests"] == 0
            })
            .await
            .unwrap();
            get_json(c, 1, "/debug/flow").await["local"]["fast_path"] != 0
        }
    })
    .await
    .unwrap();
    c
}

/// Requests replica 1 holds in bulk on a pod, as the replicated ledger shows them.
fn on_pod(f: &serde_json::Value) -> u64 {
    f["global"]["held"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["member"] == 1 && r["pod"].is_string())
        .map(|r| r["requests"].as_u64().unwrap_or(0))
        .sum()
}

/// Cluster-wide flow control: replica 1 admits on credit and counts the request in its bulk
/// holding (every replica's ledger shows it on the pod); replica 2 observes the response and
/// relays it to replica 1, whose next report takes it out of every replica's ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_admission_settled_elsewhere_leaves_every_replicas_ledger() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = credit_cluster(&sim, dir.path()).await;
    let flow = |id| {
        let c = &c;
        async move { get_json(c, id, "/debug/flow").await }
    };
    let fast = flow(1).await["local"]["fast_path"].as_u64().unwrap();
    let info = extproc::route(&mut client(&c, 1).await, BODY, "r")
        .await
        .unwrap();
    let f = flow(1).await;
    assert_eq!(f["local"]["fast_path"], fast + 1, "{f}");
    assert_eq!(f["local"]["held"], 1, "{f}");
    for id in 1..=3 {
        chaos::wait::until("the holding replicated", Duration::from_secs(5), || async {
            let f = flow(id).await;
            on_pod(&f) == 1 && f["global"]["totals"]["inflight_requests"] == 1
        })
        .await
        .unwrap();
    }
    assert!(
        flow(1).await["global"]["oldest_inflight"]
            .as_array()
            .is_some_and(|a| a.is_empty()),
        "no per-request ledger entry for a credit admission"
    );
    extproc::observe(&mut client(&c, 2).await, &info, None)
        .await
        .unwrap();
    for id in 1..=3 {
        chaos::wait::until("the ledger empty", Duration::from_secs(5), || async {
            let f = flow(id).await;
            on_pod(&f) == 0 && f["global"]["totals"]["inflight_requests"] == 0
        })
        .await
        .unwrap();
    }
    assert_eq!(flow(1).await["local"]["held"], 0);
    assert_eq!(relayed(&c, 2, "sent").await, 1.0);
    assert_eq!(relayed(&c, 1, "released").await, 1.0);
    assert_eq!(relayed(&c, 3, "not_held").await, 0.0);
    c.shutdown().await;
    sim.shutdown().await;
}

/// A credit admission whose response nobody observes (the synthetic Envoy never sends it to the
/// pod, which reports nothing running): its maker releases it once the pod has reported fewer
/// requests than the ledger holds for a second and it is two seconds old — every replica's ledger
/// empties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_admission_whose_settlement_is_lost_is_reconciled_by_its_maker() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = credit_cluster(&sim, dir.path()).await;
    extproc::route(&mut client(&c, 1).await, BODY, "lost")
        .await
        .unwrap();
    chaos::wait::until("the holding replicated", Duration::from_secs(5), || async {
        on_pod(&get_json(&c, 3, "/debug/flow").await) == 1
    })
    .await
    .unwrap();
    for id in 1..=3 {
        chaos::wait::until("the ledger reconciled", Duration::from_secs(15), || async {
            let f = get_json(&c, id, "/debug/flow").await;
            on_pod(&f) == 0 && f["global"]["totals"]["inflight_requests"] == 0
        })
        .await
        .unwrap();
    }
    assert_eq!(get_json(&c, 1, "/debug/flow").await["local"]["held"], 0);
    c.shutdown().await;
    sim.shutdown().await;
}

/// A rolling upgrade: while replica 3 runs a build without count reports (standing in: it
/// advertises no cluster features), replica 1 reports its credit admission on its own — a
/// per-request ledger entry, settled through the log from replica 2 — since replica 3 could not
/// decode a count report; once replica 3 runs the new build, replica 1 counts in bulk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_admissions_are_counted_in_bulk_only_once_every_replica_can_apply_it() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let old: &[&str] = &["--cluster-features", "0"];
    let mut c = credit_cluster_each(&sim, dir.path(), &[(3, old)]).await;
    let entries = |f: &serde_json::Value| {
        f["global"]["oldest_inflight"]
            .as_array()
            .map_or(0, Vec::len)
    };
    let send = |c: &RaftCluster, tag: &'static str| {
        let c1 = c.replica(1).unwrap().addrs.ext_proc;
        let c2 = c.replica(2).unwrap().addrs.ext_proc;
        async move {
            let mut r = extproc::Client::connect(format!("http://{c1}"))
                .await
                .unwrap();
            let info = extproc::route(&mut r, BODY, tag).await.unwrap();
            (info, c2)
        }
    };
    let (info, observer) = send(&c, "mixed").await;
    chaos::wait::until("a per-request entry", Duration::from_secs(5), || async {
        let f = get_json(&c, 3, "/debug/flow").await;
        entries(&f) == 1 && on_pod(&f) == 0
    })
    .await
    .unwrap();
    let mut o = extproc::Client::connect(format!("http://{observer}"))
        .await
        .unwrap();
    extproc::observe(&mut o, &info, None).await.unwrap();
    chaos::wait::until(
        "settled through the log",
        Duration::from_secs(5),
        || async {
            get_json(&c, 3, "/debug/flow").await["global"]["totals"]["inflight_requests"] == 0
        },
    )
    .await
    .unwrap();
    // Replica 3 upgraded.
    c.kill9(3).await.unwrap();
    c.set_own_args(3, Vec::new());
    c.restart(3).await.unwrap();
    let mut tries = 0;
    loop {
        tries += 1;
        let (info, observer) = send(&c, "upgraded").await;
        let f = get_json(&c, 1, "/debug/flow").await;
        let bulk = f["local"]["held"] == 1;
        let mut o = extproc::Client::connect(format!("http://{observer}"))
            .await
            .unwrap();
        extproc::observe(&mut o, &info, None).await.unwrap();
        if bulk {
            break;
        }
        assert!(tries < 100, "never counted in bulk after the upgrade: {f}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in 1..=3 {
        chaos::wait::until("the ledger empty", Duration::from_secs(10), || async {
            let f = get_json(&c, id, "/debug/flow").await;
            on_pod(&f) == 0 && entries(&f) == 0 && f["global"]["totals"]["inflight_requests"] == 0
        })
        .await
        .unwrap();
    }
    c.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_scope_slot_is_freed_by_another_replicas_observation() {
    let sim = Sim::start(SimConfig {
        pods: 1,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = chaos::workloads::flow_control_config(1);
    let c = cluster(
        &sim,
        dir.path(),
        &["--config-text", &config, "--flow-control-scope", "replica"],
    )
    .await;
    let first = extproc::route(&mut client(&c, 1).await, BODY, "first")
        .await
        .unwrap();
    // The second request on replica 1 waits for the one slot.
    let mut c1 = client(&c, 1).await;
    let second = tokio::spawn(async move { extproc::route(&mut c1, BODY, "second").await });
    chaos::wait::until(
        "the second request queued",
        Duration::from_secs(10),
        || async { get_json(&c, 1, "/debug/flow").await["queued"] == 1 },
    )
    .await
    .unwrap();
    // Replica 2 sees the first response end: replica 1's slot frees, the second goes.
    extproc::observe(&mut client(&c, 2).await, &first, None)
        .await
        .unwrap();
    let info = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("dispatched once replica 2 observed the first response")
        .unwrap()
        .unwrap();
    extproc::observe(&mut client(&c, 2).await, &info, None)
        .await
        .unwrap();
    chaos::wait::until("replica 1 idle", Duration::from_secs(5), || async {
        let f = get_json(&c, 1, "/debug/flow").await;
        f["queued"] == 0 && f["inflight"] == 0
    })
    .await
    .unwrap();
    c.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_replica_routes_on_the_clusters_in_flight_load() {
    let sim = Sim::start(SimConfig {
        pods: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(&sim, dir.path(), &[]).await;
    // Six requests routed by replica 1 and still running (their responses not observed).
    let mut c1 = client(&c, 1).await;
    for i in 0..6 {
        extproc::route(&mut c1, BODY, &format!("r1-{i}"))
            .await
            .unwrap();
    }
    let own1 = get_json(&c, 1, "/debug/inflight").await["own"].clone();
    let per_pod: Vec<u64> = own1
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1]["requests"].as_u64().unwrap())
        .collect();
    assert_eq!(per_pod.iter().sum::<u64>(), 6, "{own1}");
    chaos::wait::until(
        "replica 2 sees replica 1's load",
        Duration::from_secs(5),
        || async { get_json(&c, 2, "/debug/inflight").await["others"] == own1 },
    )
    .await
    .unwrap();
    // Replica 2's own ledger is empty, yet its cost model counts the requests running on the
    // pod it picks: replica 1's there.
    let info = extproc::route(&mut client(&c, 2).await, BODY, "r2")
        .await
        .unwrap();
    let running: u64 = info
        .split(';')
        .find_map(|kv| kv.strip_prefix("c="))
        .and_then(|c| c.split(',').nth(4))
        .and_then(|r| r.parse().ok())
        .expect("a cost-model prediction in the route info");
    assert!(
        running >= 1 && per_pod.contains(&running),
        "per pod on replica 1: {per_pod:?}; route info {info}"
    );
    c.shutdown().await;
    sim.shutdown().await;
}

/// A burst beyond replica 1's credit (a slack of 6 between three replicas): requests that find
/// its credit spent on admissions its pending report counts wait for that report
/// (`credit-wait`) instead of proposing an enqueue each, and take the credit it frees; every one
/// is admitted and counted once by path, and the ledger empties once their responses end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_credit_waits_for_the_pending_report() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let slack: &[&str] = &["--flow-credit-slack", "6"];
    let c = credit_cluster_each(&sim, dir.path(), &[(1, slack), (2, slack), (3, slack)]).await;
    let before = get_json(&c, 1, "/debug/flow").await["local"].clone();
    let count = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    const BURST: u64 = 30;
    let addr = c.replica(1).unwrap().addrs.ext_proc;
    let routed: Vec<String> = futures::future::join_all((0..BURST).map(|i| async move {
        let mut r = extproc::Client::connect(format!("http://{addr}"))
            .await
            .unwrap();
        extproc::route(&mut r, BODY, &format!("burst-{i}"))
            .await
            .unwrap()
    }))
    .await;
    let after = get_json(&c, 1, "/debug/flow").await["local"].clone();
    let path = |k: &str| count(&after, k) - count(&before, k);
    assert_eq!(path("fast_path") + path("slow_path"), BURST, "{after}");
    assert!(
        path("credit_waits") >= 1,
        "nobody waited for credit: {after}"
    );
    assert_eq!(after["credit_wait"], 0, "{after}");
    let text = c.replica(1).unwrap().metrics().await.unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("llm_d_epp_cluster_flow_admissions_total{path=\"credit-wait\"}")),
        "{text}"
    );
    let mut o = client(&c, 2).await;
    for info in &routed {
        extproc::observe(&mut o, info, None).await.unwrap();
    }
    for id in 1..=3 {
        chaos::wait::until("the ledger empty", Duration::from_secs(10), || async {
            get_json(&c, id, "/debug/flow").await["global"]["totals"]["inflight_requests"] == 0
        })
        .await
        .unwrap();
    }
    c.shutdown().await;
    sim.shutdown().await;
}

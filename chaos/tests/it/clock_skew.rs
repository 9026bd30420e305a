//! Replicated time does not depend on synchronized clocks: three replicas with cluster-wide flow
//! control, replica 2's wall clock 2 s behind and replica 3's 2 s ahead (`--clock-offset-ms`),
//! route a steady stream of requests (a synthetic Envoy, each response observed on another
//! replica). No member loses its lease, nothing is reclaimed, every request is dispatched and
//! the ledger empties — the state keeps time by its leaders' stamps, and pool samples and
//! fanned-out scrapes keep their age rather than their senders' timestamps.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chaos::extproc;
use chaos::raft::RaftCluster;
use futures::StreamExt;
use sim::{Sim, SimConfig};

const BODY: &[u8] = extproc::SMALL_CHAT;

async fn get_json(c: &RaftCluster, id: u64, path: &str) -> serde_json::Value {
    c.replica(id).unwrap().admin_json(path).await.unwrap()
}

async fn client(c: &RaftCluster, id: u64) -> extproc::Client {
    let addr = c.replica(id).unwrap().addrs.ext_proc;
    extproc::Client::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_clocks_keep_leases_and_flow_control_working() {
    let sim = Sim::start(SimConfig {
        pods: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    let config = chaos::workloads::flow_control_config(4);
    let c = RaftCluster::start_with_each(
        3,
        &endpoints,
        &["--config-text", &config],
        &[
            (2, &["--clock-offset-ms", "-2000"]),
            (3, &["--clock-offset-ms", "2000"]),
        ],
    )
    .await
    .unwrap();
    chaos::wait::until(
        "flow control configured",
        Duration::from_secs(20),
        || async {
            let mut ok = c.agreed_leader(&[1, 2, 3]).await.is_some();
            for id in 1..=3 {
                ok &= get_json(&c, id, "/debug/flow").await["local"]["configured"] == true;
            }
            ok
        },
    )
    .await
    .unwrap();

    // Five seconds of requests — over three leases — from every replica, settled on the next.
    let t0 = Instant::now();
    let mut routed = 0usize;
    while t0.elapsed() < Duration::from_secs(5) {
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..12u64)
            .map(|i| {
                let c = &c;
                async move {
                    let (from, to) = (1 + i % 3, 1 + (i + 1) % 3);
                    let info = extproc::route(&mut client(c, from).await, BODY, "r").await?;
                    extproc::observe(&mut client(c, to).await, &info, None).await
                }
            })
            .buffer_unordered(4)
            .collect()
            .await;
        for r in results {
            r.expect("every request is dispatched");
            routed += 1;
        }
    }
    eprintln!("{routed} requests routed and settled in 5 s");

    for id in 1..=3 {
        let view = get_json(&c, id, "/debug/cluster").await;
        let live: Vec<u64> = view["members"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["live"] == true)
            .map(|m| m["id"].as_u64().unwrap())
            .collect();
        assert_eq!(live, vec![1, 2, 3], "replica {id}'s view: {view}");
    }
    let flow = get_json(&c, 1, "/debug/flow").await;
    assert_eq!(flow["global"]["reclaimed"], 0, "{flow}");
    chaos::wait::until("the ledger empty", Duration::from_secs(10), || async {
        get_json(&c, 1, "/debug/flow").await["global"]["totals"]["inflight_requests"] == 0
    })
    .await
    .unwrap();
    c.shutdown().await;
    sim.shutdown().await;
}

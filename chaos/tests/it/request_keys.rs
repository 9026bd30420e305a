//! Requests are accounted under the EPP's own key, never the client's `x-request-id` (over the
//! real ext_proc protocol, a synthetic Envoy against `epp serve`): two requests with one id are
//! two in-flight requests; an observing stream carrying a client's made-up route info settles
//! nothing; a retried settlement settles nothing else; and with flow control a client reusing
//! another's id cannot free that request's slot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use chaos::epp::EppProcess;
use chaos::extproc;
use sim::{Sim, SimConfig};

async fn client(addr: SocketAddr) -> extproc::Client {
    extproc::Client::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// Route one chat request with this `x-request-id`; the route info the EPP set.
async fn route(addr: SocketAddr, request_id: &str) -> String {
    extproc::route(&mut client(addr).await, extproc::SMALL_CHAT, request_id)
        .await
        .unwrap()
}

/// The observing filter reports the end of the response routed with `info`.
async fn observe(addr: SocketAddr, info: &str) {
    observe_as(addr, info, None).await;
}

/// [`observe`], the request also carrying the client's `x-request-id`.
async fn observe_as(addr: SocketAddr, info: &str, request_id: Option<&str>) {
    extproc::observe(&mut client(addr).await, info, request_id)
        .await
        .unwrap();
}

async fn get_json(epp: &EppProcess, path: &str) -> serde_json::Value {
    epp.admin_json(path).await.unwrap()
}

/// Requests tracked by the in-flight ledger.
async fn tracked(epp: &EppProcess) -> u64 {
    get_json(epp, "/debug/inflight").await["tracked_requests"]
        .as_u64()
        .unwrap()
}

async fn pool(pods: usize) -> (Sim, tempfile::TempDir, std::path::PathBuf) {
    let sim = Sim::start(SimConfig {
        pods,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    (sim, dir, endpoints)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_files_requests_under_its_own_keys() {
    let (sim, _dir, endpoints) = pool(1).await;
    let epp = EppProcess::start(&endpoints, &[]).await.unwrap();
    let addr = epp.addrs.ext_proc;
    let a = route(addr, "same").await;
    let b = route(addr, "same").await;
    assert_ne!(a, b);
    assert_eq!(tracked(&epp).await, 2, "one client id, two requests");
    // A client's own route info, with its id or a well-formed key of its invention.
    observe_as(addr, "k=same;m=sim-model;p=0", Some("same")).await;
    observe_as(
        addr,
        &format!("k={};m=sim-model;p=0", "0".repeat(32)),
        Some("same"),
    )
    .await;
    assert_eq!(tracked(&epp).await, 2, "made-up route info settles nothing");
    observe(addr, &a).await;
    assert_eq!(tracked(&epp).await, 1);
    observe(addr, &a).await;
    assert_eq!(
        tracked(&epp).await,
        1,
        "settling twice settles nothing else"
    );
    observe(addr, &b).await;
    assert_eq!(tracked(&epp).await, 0);
    drop(epp);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_request_id_cannot_free_another_requests_slot() {
    let (sim, _dir, endpoints) = pool(1).await;
    let config = chaos::workloads::flow_control_config(1);
    let epp = EppProcess::start(&endpoints, &["--config-text", &config])
        .await
        .unwrap();
    let addr = epp.addrs.ext_proc;
    let victim = route(addr, "victim").await;
    // The attacker's request waits for the victim's slot.
    let attacker = tokio::spawn(async move { route(addr, "victim").await });
    chaos::wait::until("the second request queued", Duration::from_secs(10), || {
        let epp = &epp;
        async move { get_json(epp, "/debug/flow").await["queued"] == 1 }
    })
    .await
    .unwrap();
    // An observing stream naming the victim's client id (all a client knows): nothing frees.
    observe_as(addr, "k=victim;m=sim-model;p=0", Some("victim")).await;
    let flow = get_json(&epp, "/debug/flow").await;
    assert_eq!(
        (flow["queued"].as_u64(), flow["inflight"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(!attacker.is_finished());
    // The victim's own response ends: now the second request goes.
    observe(addr, &victim).await;
    let second = tokio::time::timeout(Duration::from_secs(10), attacker)
        .await
        .expect("dispatched once the slot freed")
        .unwrap();
    observe(addr, &second).await;
    chaos::wait::until("the queue empty", Duration::from_secs(10), || {
        let epp = &epp;
        async move {
            let f = get_json(epp, "/debug/flow").await;
            f["queued"] == 0 && f["inflight"] == 0
        }
    })
    .await
    .unwrap();
    drop(epp);
    sim.shutdown().await;
}

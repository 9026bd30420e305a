//! `epp serve --pool-name` against a fake Kubernetes API server (`sim::kubeapi`, the real
//! list/watch protocol; the real `kube::Client` in the EPP, pointed at it by `KUBECONFIG`).
//! Each simulated pod has its own loopback IP and the pool's one target port, as pods do. Every
//! change — a pod becoming ready or unready, deleted, a new pod reusing an IP, the pool's selector
//! edited, watches dropped, history compacted (410 Gone), the API server down then back — shows
//! in what the EPP routes to within a second, and an outage keeps the last view.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;
use std::time::Instant;

use chaos::epp::EppProcess;
use chaos::extproc::pick;
use serde_json::Value;
use serde_json::json;
use sim::kubeapi::FakeKube;
use sim::{Sim, SimConfig};

const NS: &str = "serving";

fn pod(name: &str, ip: &str, app: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn pool(app: &str, port: u16) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llm", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    })
}

/// One simulated pod per loopback IP (127.0.0.2..), all on one port.
async fn pods_on_one_port(n: usize) -> (Vec<Sim>, u16) {
    'attempt: for _ in 0..10 {
        let host = |i: usize| IpAddr::from([127, 0, 0, 2 + i as u8]);
        let first = Sim::start(SimConfig {
            pods: 1,
            host: host(0),
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let port = first.pods()[0].addr.port();
        let mut sims = vec![first];
        for i in 1..n {
            match Sim::start(SimConfig {
                pods: 1,
                host: host(i),
                base_port: port,
                ..SimConfig::default()
            })
            .await
            {
                Ok(s) => sims.push(s),
                Err(_) => continue 'attempt, // the port is taken on that address: another one
            }
        }
        return (sims, port);
    }
    panic!("no port free on 127.0.0.2..127.0.0.{}", 1 + n);
}

/// Routes requests until every destination seen for a second is in `want` and all of `want`
/// were seen (or `within` passes: a failure naming both sets).
async fn routes_exactly(epp: &EppProcess, want: &[&str], within: Duration, what: &str) {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    let deadline = Instant::now() + within;
    loop {
        let mut seen = BTreeSet::new();
        let mut other = None;
        for _ in 0..(4 * want.len().max(1)) {
            match pick(epp.addrs.ext_proc, None).await {
                Ok(d) => {
                    seen.insert(d);
                }
                Err(e) => other = Some(e),
            }
        }
        if seen == want && (other.is_none() || want.is_empty()) {
            return;
        }
        if Instant::now() > deadline {
            panic!("{what}: routed to {seen:?} (last error {other:?}), want {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metric(epp: &EppProcess, name: &str) -> f64 {
    let text = epp.metrics().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_come_from_the_inference_pool_and_changes_reach_routing() {
    let (_sims, port) = pods_on_one_port(4).await;
    let at = |ip: &str| format!("{ip}:{port}");
    let (a, b, c, x) = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5");
    let kube = FakeKube::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS).unwrap();
    kube.apply(pool("vllm", port)).unwrap();
    kube.apply(pod("vllm-a", a, "vllm", true)).unwrap();
    kube.apply(pod("vllm-b", b, "vllm", true)).unwrap();
    kube.apply(pod("vllm-c", c, "vllm", false)).unwrap();
    kube.apply(pod("other-x", x, "other", true)).unwrap();

    let epp = EppProcess::start_kube(&kubeconfig, &["--pool-name", "llm", "--pool-namespace", NS])
        .await
        .unwrap();
    let ready = format!("http://{}/readyz", epp.addrs.admin);
    chaos::wait::until(
        "ready after the first sync",
        Duration::from_secs(10),
        || async {
            reqwest::get(&ready)
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap();
    let second = Duration::from_secs(1);
    routes_exactly(&epp, &[&at(a), &at(b)], second, "the ready selected pods").await;

    kube.apply(pod("vllm-c", c, "vllm", true)).unwrap();
    routes_exactly(&epp, &[&at(a), &at(b), &at(c)], second, "c became ready").await;
    kube.apply(pod("vllm-a", a, "vllm", false)).unwrap();
    routes_exactly(&epp, &[&at(b), &at(c)], second, "a became unready").await;
    kube.delete("v1", "Pod", NS, "vllm-b");
    routes_exactly(&epp, &[&at(c)], second, "b deleted").await;
    // A new pod on b's old address is a new endpoint.
    kube.apply(pod("vllm-d", b, "vllm", true)).unwrap();
    routes_exactly(&epp, &[&at(b), &at(c)], second, "d reuses b's IP").await;

    // Watches dropped: the EPP resumes from its last version.
    kube.drop_watches();
    kube.apply(pod("vllm-a", a, "vllm", true)).unwrap();
    routes_exactly(
        &epp,
        &[&at(a), &at(b), &at(c)],
        second,
        "after a dropped watch",
    )
    .await;
    // A change while the watches are cut, then the history compacted past the EPP's last
    // version: its resumed watch gets 410 Gone, it relists and misses nothing.
    kube.set_down(true);
    kube.apply(pod("vllm-a", a, "vllm", false)).unwrap();
    kube.compact();
    kube.set_down(false);
    routes_exactly(&epp, &[&at(b), &at(c)], second, "after 410 Gone").await;
    let relists = kube
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/namespaces/serving/pods?") && !r.contains("watch="))
        .count();
    assert!(relists >= 2, "no relist after 410: {:?}", kube.requests());

    // The pool's selector edited: another set of pods.
    kube.apply(pool("other", port)).unwrap();
    routes_exactly(&epp, &[&at(x)], second, "the selector changed").await;

    // The API server down: the last view stays (and is marked stale), changes made while it
    // was down arrive once it is back.
    kube.set_down(true);
    let down_since = Instant::now();
    let marked = chaos::wait::until("marked stale", Duration::from_secs(5), || async {
        metric(&epp, "llm_d_epp_discovery_stale").await == 1.0
    })
    .await;
    let requests = kube.requests();
    assert!(
        marked.is_ok(),
        "not marked stale: {:?}, last requests {:?}",
        metric(&epp, "llm_d_epp_discovery_stale").await,
        &requests[requests.len().saturating_sub(6)..]
    );
    while down_since.elapsed() < Duration::from_secs(10) {
        routes_exactly(&epp, &[&at(x)], second, "while the API server is down").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    kube.apply(pod("other-y", a, "other", true)).unwrap();
    kube.set_down(false);
    routes_exactly(&epp, &[&at(a), &at(x)], second, "after the outage").await;
    assert_eq!(metric(&epp, "llm_d_epp_discovery_stale").await, 0.0);
    assert!(metric(&epp, "llm_d_epp_discovery_errors_total{resource=\"pod\"}").await >= 1.0);

    // The pool deleted: nothing to route to (503 rejected-no-endpoints).
    kube.delete("inference.networking.k8s.io/v1", "InferencePool", NS, "llm");
    chaos::wait::until("no endpoints without the pool", second, || async {
        matches!(pick(epp.addrs.ext_proc, None).await, Err((503, _)))
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_pool_is_not_ready_until_it_appears() {
    let (_sims, port) = pods_on_one_port(1).await;
    let kube = FakeKube::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS).unwrap();
    kube.apply(pod("vllm-a", "127.0.0.2", "vllm", true))
        .unwrap();
    let epp = EppProcess::start_kube(&kubeconfig, &["--pool-name", "llm", "--pool-namespace", NS])
        .await
        .unwrap();
    let ready = format!("http://{}/readyz", epp.addrs.admin);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = reqwest::get(&ready).await.unwrap();
    assert_eq!(r.status(), 503, "ready without a pool");
    kube.apply(pool("vllm", port)).unwrap();
    chaos::wait::until(
        "ready once the pool exists",
        Duration::from_secs(5),
        || async {
            reqwest::get(&ready)
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap();
    routes_exactly(
        &epp,
        &[&format!("127.0.0.2:{port}")],
        Duration::from_secs(1),
        "the pool's one pod",
    )
    .await;
}

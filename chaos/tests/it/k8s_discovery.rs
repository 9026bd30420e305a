//! `epp serve --pool-name` against a fake Kubernetes API server (`sim::kubeapi`, the real
//! list/watch protocol; the real `kube::Client` in the EPP, pointed at it by `KUBECONFIG`).
//! Each simulated pod has its own loopback IP and the pool's one target port, as pods do. Every
//! change — a pod becoming ready or unready, deleted, a new pod reusing an IP, the pool's selector
//! edited, watches dropped, history compacted (410 Gone), the API server down then back — shows
//! in what the EPP routes to (the issue asks for a second; the tests allow five on a loaded
//! machine and print how long each object change took), and an outage keeps the last view. The
//! pool's `InferenceObjective`s and `InferenceModelRewrite`s apply live: an edited priority is the
//! next request's band, edited weights its model.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;
use std::time::Instant;

use chaos::epp::EppProcess;
use chaos::extproc::{pick, pick_for};
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
    // A pod still in the pool can go unpicked in one round, so a removal counts only after
    // two rounds in a row, each of distinct prompts, saw exactly `want`.
    let mut agreed = 0;
    let mut round = 0u64;
    loop {
        round += 1;
        let mut seen = BTreeSet::new();
        let mut other = None;
        for i in 0..(6 * want.len().max(1)) {
            let prompt = format!("{what} round {round} request {i}");
            match pick_for(epp.addrs.ext_proc, None, &prompt).await {
                Ok(d) => {
                    seen.insert(d);
                }
                Err(e) => other = Some(e),
            }
        }
        if seen == want && (other.is_none() || want.is_empty()) {
            agreed += 1;
            if agreed == 2 {
                return;
            }
            continue;
        }
        agreed = 0;
        if Instant::now() > deadline {
            panic!("{what}: routed to {seen:?} (last error {other:?}), want {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A profile that picks uniformly among every routable pod.
const RANDOM_PICKS: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: random-picker}]
";

/// Until the EPP's `/readyz` answers 200 (or a failure naming `what`).
async fn ready(epp: &EppProcess, what: &str, within: Duration) {
    let url = format!("http://{}/readyz", epp.addrs.admin);
    chaos::wait::until(what, within, || async {
        reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await
    .unwrap();
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

    // The picks here never see a response, so each stays in flight: with the default, load-aware
    // profile a pod joining late would draw every pick until it held as many as the others (CI
    // saw a pod that joined after ~10 s of picks unpicked for a whole second). What is tested is
    // what the EPP routes among, so a random picker.
    let epp = EppProcess::start_kube(
        &kubeconfig,
        &[
            "--pool-name",
            "llm",
            "--pool-namespace",
            NS,
            "--config-text",
            RANDOM_PICKS,
        ],
    )
    .await
    .unwrap();
    ready(&epp, "ready after the first sync", Duration::from_secs(10)).await;
    let within = APPLIED_WITHIN;
    routes_exactly(&epp, &[&at(a), &at(b)], within, "the ready selected pods").await;

    kube.apply(pod("vllm-c", c, "vllm", true)).unwrap();
    routes_exactly(&epp, &[&at(a), &at(b), &at(c)], within, "c became ready").await;
    kube.apply(pod("vllm-a", a, "vllm", false)).unwrap();
    routes_exactly(&epp, &[&at(b), &at(c)], within, "a became unready").await;
    kube.delete("v1", "Pod", NS, "vllm-b");
    routes_exactly(&epp, &[&at(c)], within, "b deleted").await;
    // A new pod on b's old address is a new endpoint.
    kube.apply(pod("vllm-d", b, "vllm", true)).unwrap();
    routes_exactly(&epp, &[&at(b), &at(c)], within, "d reuses b's IP").await;

    // Watches dropped: the EPP resumes from its last version.
    kube.drop_watches();
    kube.apply(pod("vllm-a", a, "vllm", true)).unwrap();
    routes_exactly(
        &epp,
        &[&at(a), &at(b), &at(c)],
        within,
        "after a dropped watch",
    )
    .await;
    // A change while the watches are cut, then the history compacted past the EPP's last
    // version: its resumed watch gets 410 Gone, it relists and misses nothing.
    kube.set_down(true);
    kube.apply(pod("vllm-a", a, "vllm", false)).unwrap();
    kube.compact();
    kube.set_down(false);
    let lists = || {
        kube.requests()
            .iter()
            .filter(|r| {
                r.starts_with("GET /api/v1/namespaces/serving/pods?") && !r.contains("watch=")
            })
            .count()
    };
    let relisted = chaos::wait::until("a relist after 410", Duration::from_secs(5), || async {
        lists() >= 2
    })
    .await;
    assert!(
        relisted.is_ok(),
        "no relist after 410: {:?}",
        kube.requests()
    );
    routes_exactly(&epp, &[&at(b), &at(c)], within, "after 410 Gone").await;

    // The pool's selector edited: another set of pods.
    kube.apply(pool("other", port)).unwrap();
    routes_exactly(&epp, &[&at(x)], within, "the selector changed").await;

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
        routes_exactly(&epp, &[&at(x)], within, "while the API server is down").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    kube.apply(pod("other-y", a, "other", true)).unwrap();
    kube.set_down(false);
    routes_exactly(&epp, &[&at(a), &at(x)], within, "after the outage").await;
    applied("no longer marked stale", || async {
        metric(&epp, "llm_d_epp_discovery_stale").await == 0.0
    })
    .await;
    assert!(metric(&epp, "llm_d_epp_discovery_errors_total{resource=\"pod\"}").await >= 1.0);

    // The pool deleted: nothing to route to (503 rejected-no-endpoints).
    kube.delete("inference.networking.k8s.io/v1", "InferencePool", NS, "llm");
    chaos::wait::until("no endpoints without the pool", within, || async {
        matches!(pick(epp.addrs.ext_proc, None).await, Err((503, _)))
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_pool_is_not_ready_until_it_appears_and_llmd_crds_are_optional() {
    let (_sims, port) = pods_on_one_port(1).await;
    let kube = FakeKube::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS).unwrap();
    kube.apply(pod("vllm-a", "127.0.0.2", "vllm", true))
        .unwrap();
    // A cluster with GIE but without llm-d's CRDs: the objectives' watches fail, routing not.
    kube.uninstall("llm-d.ai/v1alpha2", "InferenceObjective");
    kube.uninstall("llm-d.ai/v1alpha2", "InferenceModelRewrite");
    let epp = EppProcess::start_kube(&kubeconfig, &["--pool-name", "llm", "--pool-namespace", NS])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = reqwest::get(format!("http://{}/readyz", epp.addrs.admin))
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "ready without a pool");
    kube.apply(pool("vllm", port)).unwrap();
    ready(&epp, "ready once the pool exists", Duration::from_secs(5)).await;
    routes_exactly(
        &epp,
        &[&format!("127.0.0.2:{port}")],
        Duration::from_secs(1),
        "the pool's one pod",
    )
    .await;
    let text = epp.metrics().await.unwrap();
    for resource in ["inferenceobjective", "inferencemodelrewrite"] {
        let failed = format!("llm_d_epp_discovery_errors_total{{resource=\"{resource}\"}}");
        assert!(text.contains(&failed), "{resource}: no watch error counted");
    }
}

fn objective(name: &str, pool: &str, priority: i32) -> Value {
    json!({
        "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"priority": priority, "poolRef": {"name": pool}},
    })
}

fn rewrite(name: &str, model: &str, targets: &[(&str, u32)]) -> Value {
    let targets: Vec<Value> = targets
        .iter()
        .map(|(m, w)| json!({"modelRewrite": m, "weight": w}))
        .collect();
    json!({
        "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "poolRef": {"group": "inference.networking.k8s.io", "name": "llm"},
            "rules": [{"matches": [{"model": {"type": "Exact", "value": model}}], "targets": targets}],
        },
    })
}

/// Flow-control requests the EPP counted in priority band `priority`.
async fn in_band(epp: &EppProcess, priority: i32) -> f64 {
    let text = epp.metrics().await.unwrap_or_default();
    let band = format!("priority=\"{priority}\"");
    text.lines()
        .filter(|l| l.starts_with("llm_d_epp_flow_control_requests_total{") && l.contains(&band))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The model of the body Envoy would forward for a request naming `model` and `objective`.
async fn served_model(epp: &EppProcess, model: &str, objective: &str) -> String {
    let body = serde_json::to_vec(&json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }))
    .unwrap();
    let headers: &[(&str, &str)] = if objective.is_empty() {
        &[]
    } else {
        &[("x-llm-d-inference-objective", objective)]
    };
    let msgs = chaos::extproc::chat_request_with(&body, headers, None);
    let routed = chaos::extproc::answer(epp.addrs.ext_proc, msgs)
        .await
        .unwrap();
    match routed.body {
        Some(b) => serde_json::from_slice::<Value>(&b).unwrap()["model"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        None => model.to_string(),
    }
}

/// Until `check` holds, or a failure after [`APPLIED_WITHIN`]; prints how long it took (the
/// issue asks for a second: a measurement, not an assertion a loaded CI machine could trip).
async fn applied<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    let ok = chaos::wait::until(what, APPLIED_WITHIN, &mut check).await;
    assert!(ok.is_ok(), "{what}: not applied within {APPLIED_WITHIN:?}");
    eprintln!("{what}: applied in {:?}", t0.elapsed());
}

/// How long a change on the API server may take to reach the picks (a second is the goal, see
/// [`applied`]).
const APPLIED_WITHIN: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_and_rewrites_from_the_api_server_apply_live() {
    let (_sims, port) = pods_on_one_port(1).await;
    let kube = FakeKube::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS).unwrap();
    kube.apply(pool("vllm", port)).unwrap();
    kube.apply(pod("vllm-a", "127.0.0.2", "vllm", true))
        .unwrap();
    kube.apply(objective("premium", "llm", 10)).unwrap();
    // Another pool's objective of the same name space: not this pool's.
    kube.apply(objective("elsewhere", "other", 7)).unwrap();
    kube.apply(rewrite("canary", "assistant", &[("assistant-v1", 100)]))
        .unwrap();
    // Flow control counts requests by band; these requests never finish (no response phase),
    // so the pod's limit is high.
    let flow = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n\
                featureGates: [flowControl]\nplugins:\n\
                - {name: slots, type: concurrency-detector, parameters: {maxConcurrency: 1000}}\n\
                flowControl: {saturationDetector: {pluginRef: slots}}\n";
    let epp = EppProcess::start_kube(
        &kubeconfig,
        &[
            "--pool-name",
            "llm",
            "--pool-namespace",
            NS,
            "--config-text",
            flow,
        ],
    )
    .await
    .unwrap();
    ready(&epp, "ready", Duration::from_secs(10)).await;
    chaos::wait::until("objectives listed", Duration::from_secs(5), || async {
        let text = epp.metrics().await.unwrap_or_default();
        text.contains(
            "llm_d_epp_discovery_objects{resource=\"inferenceobjective\",state=\"applied\"} 1",
        )
    })
    .await
    .unwrap();

    // The objective names the band; another pool's objective is unknown here (band 0).
    assert_eq!(
        served_model(&epp, "assistant", "premium").await,
        "assistant-v1"
    );
    assert_eq!(in_band(&epp, 10).await, 1.0);
    served_model(&epp, "m", "elsewhere").await;
    assert_eq!(
        in_band(&epp, 7).await,
        0.0,
        "another pool's objective applied"
    );
    assert_eq!(in_band(&epp, 0).await, 1.0);

    // Priority edited, an objective added: the next requests use them.
    kube.apply(objective("premium", "llm", 5)).unwrap();
    kube.apply(objective("batch", "llm", -1)).unwrap();
    applied("the edited priority", || async {
        served_model(&epp, "m", "premium").await;
        served_model(&epp, "m", "batch").await;
        in_band(&epp, 5).await >= 1.0 && in_band(&epp, -1).await >= 1.0
    })
    .await;

    // Weights edited: the other target; an invalid rewrite is refused, the rest apply.
    kube.apply(rewrite(
        "canary",
        "assistant",
        &[("assistant-v1", 0), ("assistant-v2", 100)],
    ))
    .unwrap();
    kube.apply(rewrite("broken", "other", &[("other-v1", 0)]))
        .unwrap();
    applied("the edited weights", || async {
        served_model(&epp, "assistant", "").await == "assistant-v2"
    })
    .await;
    // The broken rewrite was applied after the canary: it may land a moment later.
    applied("the broken rewrite counted as refused", || async {
        epp.metrics().await.is_ok_and(|text| {
            text.contains(
                "llm_d_epp_discovery_objects{resource=\"inferencemodelrewrite\",state=\"refused\"} 1",
            )
        })
    })
    .await;
    assert_eq!(served_model(&epp, "other", "").await, "other");

    // Deleted: the model is served as asked.
    kube.delete("llm-d.ai/v1alpha2", "InferenceModelRewrite", NS, "canary");
    applied("the rewrite deleted", || async {
        served_model(&epp, "assistant", "").await == "assistant"
    })
    .await;
}

fn tenant_quota(name: &str, keys: &[&str]) -> Value {
    let keys: Vec<Value> = keys
        .iter()
        .map(|k| json!({"sha256": node::request::tenant::hash_key(k)}))
        .collect();
    json!({
        "apiVersion": "epp.dev/v1alpha1", "kind": "TenantQuota",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"apiKeys": keys, "limits": [{"model": "*", "concurrency": 100}]},
    })
}

/// The status of the EPP's answer to a request carrying API key `key` (200: routed).
async fn with_key(epp: &EppProcess, key: Option<&str>) -> i32 {
    let body = serde_json::to_vec(&json!({
        "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
    }))
    .unwrap();
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let msgs = chaos::extproc::chat_request_with(&body, &headers, None);
    match chaos::extproc::answer(epp.addrs.ext_proc, msgs).await {
        Ok(_) => 200,
        Err((status, _)) => status,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_quotas_from_the_api_server_apply_live() {
    let (_sims, port) = pods_on_one_port(1).await;
    let kube = FakeKube::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    kube.write_kubeconfig(&kubeconfig, NS).unwrap();
    kube.apply(pool("vllm", port)).unwrap();
    kube.apply(pod("vllm-a", "127.0.0.2", "vllm", true))
        .unwrap();
    let epp = EppProcess::start_kube(
        &kubeconfig,
        &[
            "--pool-name",
            "llm",
            "--pool-namespace",
            NS,
            "--watch-tenants",
        ],
    )
    .await
    .unwrap();
    ready(&epp, "ready", Duration::from_secs(10)).await;
    // Tenant mode with no tenants yet: nobody gets in.
    assert_eq!(with_key(&epp, Some("k1")).await, 401);
    kube.apply(tenant_quota("team", &["k1"])).unwrap();
    applied("the tenant's key accepted", || async {
        with_key(&epp, Some("k1")).await == 200
    })
    .await;
    assert_eq!(
        with_key(&epp, None).await,
        401,
        "no key, no anonymous tenant"
    );
    // The key rotated in the object; an invalid object refused, the others apply.
    kube.apply(tenant_quota("team", &["k2"])).unwrap();
    let mut broken = tenant_quota("broken", &[]);
    broken["spec"]["apiKeys"] = json!([{"sha256": "not-a-hash"}]);
    kube.apply(broken).unwrap();
    applied("the rotated key", || async {
        with_key(&epp, Some("k2")).await == 200 && with_key(&epp, Some("k1")).await == 401
    })
    .await;
    applied("the broken TenantQuota counted as refused", || async {
        epp.metrics().await.is_ok_and(|text| {
            text.contains(
                "llm_d_epp_discovery_objects{resource=\"tenantquota\",state=\"refused\"} 1",
            )
        })
    })
    .await;
    // Deleted: its key is unknown again.
    kube.delete("epp.dev/v1alpha1", "TenantQuota", NS, "team");
    applied("the tenant deleted", || async {
        with_key(&epp, Some("k2")).await == 401
    })
    .await;
}

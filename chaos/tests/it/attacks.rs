//! The attack suite (issue 51): what a hostile client or a compromised neighbour tries, attempted
//! from outside against real processes (Envoy, EPP replicas, simulated pods), asserting the refusal
//! or the bound as seen from outside — what the pods served, what Envoy answered, what a canary
//! listener received.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use serde_json::json;
use sim::SimConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A listener that no request may ever reach: it counts the connections it accepts (and answers
/// each with a 200, so that a connection that does come looks like success to its sender).
struct Canary {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Canary {
    async fn start() -> Canary {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = sock.read(&mut buf).await;
                    let _ = sock
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                });
            }
        });
        Canary {
            addr,
            connections,
            task,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn served(c: &LocalCluster) -> u64 {
    (0..c.sim.pods().len()).map(|i| c.sim.stats(i).served).sum()
}

/// Requests that name the canary as their destination, the ways a client can: one address, a
/// list (the EPP's fallback form), and with the served-endpoint header Envoy's override_host
/// writes back. Returns the statuses Envoy answered.
async fn steer(c: &LocalCluster, canary: &Canary) -> Vec<u16> {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", c.envoy.url());
    let target = canary.addr.to_string();
    let mut statuses = Vec::new();
    for destination in [target.clone(), format!("{target},{target}")] {
        for _ in 0..3 {
            let r = client
                .post(&url)
                .header("x-gateway-destination-endpoint", &destination)
                .header("x-gateway-destination-endpoint-served", &destination)
                .header("x-llm-d-response-filter", "1")
                .json(&json!({"model": "sim-model", "prompt": "where do I go", "max_tokens": 2}))
                .timeout(Duration::from_secs(20))
                .send()
                .await
                .expect("Envoy answers");
            statuses.push(r.status().as_u16());
        }
    }
    statuses
}

/// A client's `x-gateway-destination-endpoint` never picks the upstream: with the EPP up (it
/// names a pod), and with the EPP down — failing open (Envoy balances over the pool's pods) and
/// failing closed (503) — in both data-plane variants (ORIGINAL_DST, GIE's override_host). Before
/// the header was removed ahead of every filter, a fail-open Envoy forwarded the request to
/// whatever address the client named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_pick_the_upstream_whether_the_epp_is_up_fails_open_or_fails_closed() {
    for (failure_mode_allow, fallback_lb) in [(true, false), (false, false), (true, true)] {
        let what = format!("failure_mode_allow={failure_mode_allow} override_host={fallback_lb}");
        let canary = Canary::start().await;
        let mut c = LocalCluster::start(ClusterSpec {
            sim: SimConfig {
                pods: 2,
                ..SimConfig::default()
            },
            failure_mode_allow,
            fallback_lb,
            ..ClusterSpec::default()
        })
        .await
        .unwrap();
        c.wait_for_pods().await.unwrap();

        let before = served(&c);
        let statuses = steer(&c, &canary).await;
        assert!(
            statuses.iter().all(|s| *s == 200),
            "{what}, EPP up: {statuses:?}"
        );
        assert_eq!(
            served(&c) - before,
            statuses.len() as u64,
            "{what}, EPP up: every request served by a pod"
        );
        assert_eq!(
            canary.connections(),
            0,
            "{what}, EPP up: the canary reached"
        );

        // The EPP gone: Envoy's ext_proc calls fail (connection refused, then no healthy host).
        c.epps.clear();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = served(&c);
        let statuses = steer(&c, &canary).await;
        assert_eq!(
            canary.connections(),
            0,
            "{what}, EPP down: the canary reached ({statuses:?})"
        );
        if failure_mode_allow {
            assert!(
                statuses.iter().all(|s| *s == 200),
                "{what}, EPP down: fail-open serves from the pool: {statuses:?}"
            );
            assert_eq!(
                served(&c) - before,
                statuses.len() as u64,
                "{what}, EPP down: every request served by a pod"
            );
        } else {
            assert!(
                statuses.iter().all(|s| *s == 503),
                "{what}, EPP down: fail-closed answers 503: {statuses:?}"
            );
            assert_eq!(
                served(&c),
                before,
                "{what}, EPP down: nothing reached a pod"
            );
        }
        c.shutdown().await;
    }
}

/// The headers a client may send to steer the EPP, each with a value that would change what
/// happens if it counted: a profile no configuration has (refused when honoured), SLOs no pod
/// meets, another tenant's objective and fairness id, a model rewrite.
const CONTROL: [(&str, &str); 9] = [
    ("x-profile", "nowhere"),
    ("x-llm-d-slo-ttft-ms", "1"),
    ("x-slo-ttft-ms", "1"),
    ("x-llm-d-slo-tpot-ms", "1"),
    ("x-slo-tpot-ms", "1"),
    ("x-llm-d-inference-objective", "critical"),
    ("x-llm-d-inference-fairness-id", "someone-else"),
    ("x-gateway-inference-fairness-id", "someone-else"),
    ("x-llm-d-model-name-rewrite", "sim-model"),
];

const PROFILES: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: header-profile-handler, parameters: {headerName: X-Profile, defaultProfile: a}}
- type: queue-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- {name: a, plugins: [{pluginRef: queue-scorer}, {pluginRef: prefix-cache-scorer}]}
- {name: b, plugins: [{pluginRef: queue-scorer}]}
";

/// Tenant mode: the client's control headers count for nothing — not the scheduling profile, not
/// the SLOs, not the objective or fairness id — and none of them reaches the pod. Without tenant
/// mode the same profile header is honoured (a profile that does not exist is refused), which
/// shows the request would have been steered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_mode_ignores_the_clients_control_headers_and_strips_them_before_the_pod() {
    const KEY: &str = "key-of-the-tenant";
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("profiles.yaml");
    std::fs::write(&config, PROFILES).unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(
        &tenants,
        format!(
            "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: team}}\n\
             spec:\n  apiKeys: [{{sha256: {}}}]\n  limits: [{{model: '*', concurrency: 4}}]\n",
            node::request::tenant::hash_key(KEY)
        ),
    )
    .unwrap();
    let config_args = vec!["--config-file".to_string(), config.display().to_string()];
    let body = json!({"model": "sim-model", "prompt": "steer me", "max_tokens": 2});

    // Without tenant mode the profile header counts: the unknown profile is refused.
    let open = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: config_args.clone(),
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    open.wait_for_pods().await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", open.envoy.url());
    let r = client
        .post(&url)
        .header("x-profile", "nowhere")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("no scheduling profile"), "{text}");
    open.shutdown().await;

    let mut args = config_args;
    args.extend(["--tenants-file".to_string(), tenants.display().to_string()]);
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: args,
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let url = format!("{}/v1/completions", c.envoy.url());
    for _ in 0..4 {
        let mut req = client.post(&url).bearer_auth(KEY).json(&body);
        for (k, v) in CONTROL {
            req = req.header(k, v);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let received = r
            .headers()
            .get(sim::server::RECEIVED_HEADERS_HEADER)
            .map(|v| v.to_str().unwrap().to_string());
        let text = r.text().await.unwrap();
        assert_eq!(
            status, 200,
            "the tenant's request, served as granted: {text}"
        );
        let received = received.expect("the pod echoes the x- headers it received");
        for (k, _) in CONTROL {
            assert!(
                !received.split(',').any(|h| h == k),
                "{k} reached the pod: {received}"
            );
        }
    }
    c.shutdown().await;
}

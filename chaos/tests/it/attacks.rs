//! The attack suite (issue 51): what a hostile client or a compromised neighbour tries, attempted
//! from outside against real processes (Envoy, EPP replicas, simulated pods), asserting the refusal
//! or the bound as seen from outside — what the pods served, what Envoy answered, what a canary
//! listener received.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use futures::StreamExt;
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
        // A request whose ext_proc stream breaks after its body went out cannot fail open (the
        // body was handed over): Envoy answers it 503. Wait until Envoy knows the EPP is down.
        c.epps.clear();
        let expect = if failure_mode_allow { 200 } else { 503 };
        let client = reqwest::Client::new();
        let url = format!("{}/v1/completions", c.envoy.url());
        chaos::wait::until("Envoy to see the EPP gone", Duration::from_secs(10), || {
            let (client, url) = (client.clone(), url.clone());
            async move {
                client
                    .post(&url)
                    .json(&json!({"model": "sim-model", "prompt": "probe", "max_tokens": 1}))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().as_u16() == expect)
            }
        })
        .await
        .unwrap();
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

/// Tenant mode: a request without a key is refused at its headers (before its body is buffered);
/// the client's control headers count for nothing — not the scheduling profile, not the SLOs,
/// not the objective or fairness id — and none of them reaches the pod. Without tenant
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
    // Identity comes from the headers: a request without a key is refused before its body is
    // buffered — here a body that never ends (one chunk, then nothing) still gets its 401.
    let stalled = futures::stream::once(async {
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"{\"model\":"))
    })
    .chain(futures::stream::pending());
    let r = client
        .post(&url)
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stalled))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("answered although the body never ends");
    assert_eq!(r.status().as_u16(), 401);
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

/// Resident memory of a process (kB), from /proc.
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The distinct values of `label` across an exposition, and its series count.
fn label_values(text: &str, label: &str) -> (std::collections::HashSet<String>, usize) {
    let key = format!("{label}=\"");
    let mut values = std::collections::HashSet::new();
    let mut series = 0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        series += 1;
        let mut rest = line;
        while let Some(i) = rest.find(&key) {
            rest = &rest[i + key.len()..];
            let end = rest.find('"').unwrap_or(rest.len());
            values.insert(rest[..end].to_string());
        }
    }
    (values, series)
}

/// Client strings are bounded: a 1 MiB model name is refused (400, with the reason) before it
/// becomes a label or a key; 10 000 distinct 200-byte model names (each under the bound) and as
/// many rewrite targets leave at most 1000 values of each model label (+ `other`) in `/metrics`,
/// at most 60 000 series, and the replica's resident memory within 96 MiB of where it started.
/// Every request is answered. Most of that memory is not the names: Envoy keeps each observing
/// stream open after its request (`deferred_close_timeout`, 1 s in our bootstraps; ~20 KB per
/// open stream in the EPP, ~2 000 of them at this test's rate) — measured +51 MB; +230 MB with
/// Envoy's default 5 s and unboxed stream replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_model_names_leave_metrics_and_memory_bounded() {
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let epp = c.epp(0).unwrap();
    let pid = epp.pid_u32().unwrap();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", c.envoy.url());

    let huge = "m".repeat(1 << 20);
    let r = client
        .post(&url)
        .json(&json!({"model": huge, "prompt": "p", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 400, "{}", &text[..text.len().min(300)]);
    assert!(text.contains("longer than 256 bytes"), "{text}");

    let before = rss_kb(pid);
    let sent = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..32)
        .map(|w| {
            let (client, url) = (client.clone(), url.clone());
            let (sent, answered) = (sent.clone(), answered.clone());
            tokio::spawn(async move {
                loop {
                    let i = sent.fetch_add(1, Ordering::SeqCst);
                    if i >= 10_000 {
                        break;
                    }
                    let name = format!("{i:0>200}");
                    let r = client
                        .post(&url)
                        .header("x-llm-d-model-name-rewrite", format!("{w}{name}"))
                        .json(&json!({"model": name, "prompt": "p", "max_tokens": 1}))
                        .send()
                        .await;
                    if r.is_ok_and(|r| r.status().as_u16() > 0) {
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(
        answered.load(Ordering::SeqCst),
        10_000,
        "every request answered"
    );
    let after = rss_kb(pid);
    let text = epp.metrics().await.unwrap();
    let (models, series) = label_values(&text, "model_name");
    let (targets, _) = label_values(&text, "target_model_name");
    eprintln!(
        "model_name values {} target_model_name values {} series {series} exposition {} KiB \
         rss {before} → {after} kB",
        models.len(),
        targets.len(),
        text.len() / 1024
    );
    assert!(models.len() <= 1001, "{} model_name values", models.len());
    assert!(targets.len() <= 1001, "{} target values", targets.len());
    assert!(models.contains("other"), "past the cap, `other`");
    assert!(series <= 60_000, "{series} series");
    assert!(
        after <= before + 96 * 1024,
        "rss grew from {before} kB to {after} kB"
    );
    c.shutdown().await;
}

/// Request bodies buffered across streams are bounded by one budget: 24 clients each stream a
/// 6 MiB body slowly (64 KiB every 5 ms, so that all are mid-body at once) at a replica whose
/// budget is 32 MiB — 144 MiB offered. Every stream is answered: served, or a retryable 503
/// `body-buffer-budget`; the replica's resident memory stays within the budget's reach
/// (baseline + 4 × budget: the budget bounds what waits; parsing a routed body and streaming it
/// back take up to twice its size again, briefly). `deploy/local/attack-soak.sh` runs it at
/// production sizes through the same knobs (`EPP_ATTACK_CLIENTS=300`, `EPP_ATTACK_BODY_MIB=60`,
/// `EPP_ATTACK_BUDGET_MIB=1024`: the default budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_bodies_stay_within_the_body_budget() {
    let knob = |name: &str, default: usize| {
        std::env::var(name).map_or(default, |v| v.parse().expect(name))
    };
    let clients = knob("EPP_ATTACK_CLIENTS", 24);
    let body_bytes = knob("EPP_ATTACK_BODY_MIB", 6) << 20;
    let budget = knob("EPP_ATTACK_BUDGET_MIB", 32) << 20;
    const CHUNK: usize = 64 << 10;
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: vec![
            "--max-body-bytes".into(),
            (body_bytes + (2 << 20)).to_string(),
            "--max-buffered-body-bytes".into(),
            budget.to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let epp = c.epp(0).unwrap();
    let pid = epp.pid_u32().unwrap();
    let baseline = rss_kb(pid);
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampling = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kb(pid), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let url = format!("{}/v1/completions", c.envoy.url());
    // A valid completion whose size is a field the pods ignore, made as it is sent (300
    // clients' 60 MiB each are not held in memory at once).
    let head = bytes::Bytes::from_static(
        br#"{"model":"sim-model","prompt":"hi","max_tokens":1,"padding":""#,
    );
    let tail = bytes::Bytes::from_static(b"\"}");
    let filler = bytes::Bytes::from(vec![b'a'; CHUNK]);
    let fill = body_bytes - head.len() - tail.len();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let url = url.clone();
            let mut chunks = vec![head.clone()];
            chunks.extend((0..fill / CHUNK).map(|_| filler.clone()));
            chunks.push(filler.slice(..fill % CHUNK));
            chunks.push(tail.clone());
            tokio::spawn(async move {
                let stream = futures::stream::iter(chunks).then(|c| async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok::<_, std::io::Error>(c)
                });
                let r = reqwest::Client::new()
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(reqwest::Body::wrap_stream(stream))
                    .timeout(Duration::from_secs(120))
                    .send()
                    .await;
                match r {
                    Ok(r) => {
                        let reason = r
                            .headers()
                            .get("x-llm-d-request-dropped-reason")
                            .map(|v| v.to_str().unwrap().to_string());
                        (Some(r.status().as_u16()), reason)
                    }
                    // Envoy may answer the refusal and reset the upload before it is all sent.
                    Err(e) => {
                        eprintln!("client: {e:#}");
                        (None, None)
                    }
                }
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    sampling.abort();
    let peak = peak.load(Ordering::SeqCst);
    let served = outcomes.iter().filter(|o| o.0 == Some(200)).count();
    let refused = outcomes
        .iter()
        .filter(|o| o.0 == Some(503) && o.1.as_deref() == Some("body-buffer-budget"))
        .count();
    eprintln!(
        "served {served} refused {refused} of {clients}; rss baseline {baseline} kB peak {peak} kB; \
         {outcomes:?}"
    );
    assert_eq!(
        served + refused,
        clients,
        "every stream answered: {outcomes:?}"
    );
    assert!(served >= 1 && refused >= 1, "{outcomes:?}");
    assert!(
        peak <= baseline + 4 * (budget as u64 >> 10),
        "rss peaked at {peak} kB from {baseline} kB"
    );
    let metrics = epp.metrics().await.unwrap();
    assert_eq!(
        chaos::epp::metric_sum(&metrics, "llm_d_epp_buffered_body_bytes"),
        0.0,
        "every reservation returned"
    );
    c.shutdown().await;
}

/// Pod churn does not grow the replica's memory: a pod that leaves the pool has its prefix-index
/// entries dropped once it has been gone for `--forget-departed-after` (1 s here; 60 s by
/// default, so a pod back within a minute is still warm) — within 3 s of leaving here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_pods_prefix_entries_are_forgotten() {
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        epp_args: vec!["--forget-departed-after".into(), "1s".into()],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let epp = c.epp(0).unwrap();
    let url = format!("{}/v1/completions", c.envoy.url());
    let client = reqwest::Client::new();
    let pods_held = || async {
        let v = epp.prefix_index().await.unwrap();
        v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["entries"].as_u64() > Some(0))
            .map(|p| p["pod"].as_str().unwrap().to_string())
            .collect::<std::collections::BTreeSet<_>>()
    };
    // Concurrent requests with distinct prompts until both pods hold entries.
    let mut n = 0;
    chaos::wait::until("entries for both pods", Duration::from_secs(20), || {
        n += 8;
        let (client, url) = (client.clone(), url.clone());
        let first = n;
        async move {
            let sends = (first..first + 8).map(|i| {
                client
                    .post(&url)
                    .json(&json!({"model": "sim-model", "prompt": format!("{i} {}", "w ".repeat(300)), "max_tokens": 1}))
                    .send()
            });
            futures::future::join_all(sends).await;
            true
        }
    })
    .await
    .unwrap();
    chaos::wait::until("entries for both pods", Duration::from_secs(20), || async {
        pods_held().await.len() == 2
    })
    .await
    .unwrap();

    // Pod 1 leaves the pool.
    let gone = c.sim.pods()[1].addr.to_string();
    let gone_port = format!("port: {}\n", c.sim.pods()[1].addr.port());
    let yaml = c.sim.pods_yaml();
    let mut out = String::from("pods:\n");
    for entry in yaml.split("  - name: ").skip(1) {
        if !entry.contains(&gone_port) {
            out.push_str("  - name: ");
            out.push_str(entry);
        }
    }
    std::fs::write(&c.endpoints_file, out).unwrap();
    let left = std::time::Instant::now();
    chaos::wait::until(
        "the departed pod forgotten",
        Duration::from_secs(3),
        || async { !pods_held().await.contains(&gone) },
    )
    .await
    .unwrap();
    eprintln!("forgotten {:?} after it left", left.elapsed());
    assert_eq!(
        pods_held().await.len(),
        1,
        "the other pod keeps its entries"
    );
    c.shutdown().await;
}

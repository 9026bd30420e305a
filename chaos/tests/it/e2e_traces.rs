//! Traces end to end: Envoy → EPP → a simulated pod, the EPP exporting over OTLP/gRPC (the
//! standard `OTEL_*` environment) to an in-process receiver built on the OTLP protobuf types.
//! Envoy traces too (its OpenTelemetry tracer, as `deploy/local/envoy.template.yaml` configures it
//! with a collector). A client request carrying a W3C `traceparent` yields the span tree: the
//! client's span → Envoy's → `epp.request` (through the ext_proc call's gRPC metadata) →
//! `epp.parse`, `epp.admission`, `epp.schedule`, and `epp.response` (linked to `epp.request`) with
//! the GenAI attributes; a request that waited in flow control says so on its
//! admission span; a refused one carries its status. Told `OTEL_TRACES_EXPORTER=none`, it sends
//! nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::otlp::receiver;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;
use sim::{PodKnobs, SimConfig};

/// `(service.name, span)` of every span received.
fn pairs(rx: &chaos::otlp::Receiver) -> Vec<(String, Span)> {
    rx.spans()
        .into_iter()
        .map(|r| (r.service, r.span))
        .collect()
}

fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a Any> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn int(s: &Span, key: &str) -> Option<i64> {
    match attr(s, key)? {
        Any::IntValue(i) => Some(*i),
        _ => None,
    }
}

fn string(s: &Span, key: &str) -> Option<String> {
    match attr(s, key)? {
        Any::StringValue(v) => Some(v.clone()),
        _ => None,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Flow control with one slot on one pod: a second request waits for the first.
const CONFIG: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: slots, type: concurrency-detector, parameters: {maxConcurrency: 1}}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer}
flowControl:
  saturationDetector: {pluginRef: slots}
";

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_envoy_leave_their_span_tree() {
    let (rx, addr) = receiver().await.unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 1,
            knobs: PodKnobs {
                decode_ms_per_token: 20.0,
                ..PodKnobs::default()
            },
            ..SimConfig::default()
        },
        epp_args: vec!["--config-text".into(), CONFIG.into()],
        epp_env: vec![
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
                format!("http://{addr}"),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
            ("OTEL_SERVICE_NAME".into(), "epp-under-test".into()),
        ],
        envoy_otlp: Some(addr),
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let client = reqwest::Client::new();
    let chat = |content: &str, max_tokens: u32| {
        json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    // A: traced by the client, long enough to hold the only slot; B arrives meanwhile and waits.
    let a = client
        .post(&url)
        .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN}-01"))
        .json(&chat("first", 40))
        .send();
    let b = async {
        // Once A holds the slot (running on the pod), not after a guess of how long that takes.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while c.sim.stats(0).running == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(c.sim.stats(0).running, 1, "A running on the pod");
        client.post(&url).json(&chat("second", 4)).send().await
    };
    let (a, b) = tokio::join!(a, b);
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    // What the pod received: its work continues the client's trace.
    let pod_parent = a
        .headers()
        .get(sim::server::RECEIVED_TRACEPARENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(String::from)
        .expect("the pod received a traceparent");
    let (a, b) = (a.text().await.unwrap(), b.text().await.unwrap());
    assert!(a.contains("[DONE]") && b.contains("[DONE]"));
    // C: refused (malformed body).
    let refused = client
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);

    // Wait for the EPP's batches (100 ms schedule delay) and Envoy's (flushed every 5 s).
    chaos::wait::until("the spans", Duration::from_secs(30), || {
        let rx = rx.clone();
        async move {
            let spans = pairs(&rx);
            let count = |name: &str| spans.iter().filter(|(_, s)| s.name == name).count();
            let envoy = spans
                .iter()
                .any(|(svc, s)| svc == "envoy-gateway" && hex(&s.parent_span_id) == CLIENT_SPAN);
            count("epp.request") >= 3 && count("epp.response") >= 2 && envoy
        }
    })
    .await
    .unwrap();
    let spans = pairs(&rx);
    assert!(
        spans
            .iter()
            .all(|(svc, _)| svc == "epp-under-test" || svc == "envoy-gateway")
    );
    // Only routed requests have a response span (C's local reply has none).
    assert_eq!(
        spans
            .iter()
            .filter(|(_, s)| s.name == "epp.response")
            .count(),
        2
    );
    let children = |parent: &Span| -> Vec<&Span> {
        spans
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s.parent_span_id == parent.span_id && s.trace_id == parent.trace_id)
            .collect()
    };
    let requests: Vec<&Span> = spans
        .iter()
        .filter(|(svc, s)| svc == "epp-under-test" && s.name == "epp.request")
        .map(|(_, s)| s)
        .collect();
    assert_eq!(requests.len(), 3);
    let find = |what: &str, f: &dyn Fn(&Span) -> bool| {
        *requests
            .iter()
            .find(|s| f(s))
            .unwrap_or_else(|| panic!("no epp.request span for {what}"))
    };
    let ra = find("A", &|s| hex(&s.trace_id) == TRACE_ID);
    let rb = find("B", &|s| {
        hex(&s.trace_id) != TRACE_ID && string(s, "epp.outcome").as_deref() == Some("routed")
    });
    let rc = find("C", &|s| int(s, "http.response.status_code") == Some(400));
    let envoy_span = |id: &[u8]| {
        spans
            .iter()
            .find(|(svc, s)| svc == "envoy-gateway" && s.span_id == id)
            .map(|(_, s)| s)
    };

    // A: in the client's trace, a child of Envoy's span for the ext_proc call, which descends
    // from Envoy's span for the request, a child of the client's span; its stages as children.
    let mut up = envoy_span(&ra.parent_span_id).expect("A's parent is Envoy's span");
    let mut hops = 0;
    while hex(&up.parent_span_id) != CLIENT_SPAN {
        up = envoy_span(&up.parent_span_id).expect("Envoy's spans lead to the client's");
        hops += 1;
        assert!(hops < 5);
    }
    assert_eq!(hex(&up.trace_id), TRACE_ID);
    // The pod's traceparent: the same trace, naming the routing span or one of Envoy's.
    let parts: Vec<&str> = pod_parent.split('-').collect();
    assert_eq!(parts[1], TRACE_ID, "{pod_parent}");
    let pod_parent_id = parts[2].to_string();
    let named = hex(&ra.span_id) == pod_parent_id
        || spans
            .iter()
            .any(|(svc, s)| svc == "envoy-gateway" && hex(&s.span_id) == pod_parent_id);
    assert!(
        named,
        "the pod's parent {pod_parent} is no span of the trace"
    );
    println!(
        "the pod's parent span is {}",
        if hex(&ra.span_id) == pod_parent_id {
            "epp.request"
        } else {
            "Envoy's"
        }
    );
    assert_eq!(
        string(ra, "gen_ai.request.model").as_deref(),
        Some("sim-model")
    );
    let pod = c.sim.pods()[0].addr.to_string();
    assert_eq!(string(ra, "epp.pod").as_deref(), Some(pod.as_str()));
    assert_eq!(string(ra, "epp.outcome").as_deref(), Some("routed"));
    let names: Vec<&str> = children(ra).iter().map(|s| s.name.as_str()).collect();
    for stage in ["epp.parse", "epp.admission", "epp.schedule"] {
        assert!(names.contains(&stage), "A's children {names:?}");
    }
    let schedule = children(ra)
        .into_iter()
        .find(|s| s.name == "epp.schedule")
        .unwrap();
    assert_eq!(string(schedule, "epp.pod").as_deref(), Some(pod.as_str()));
    assert_eq!(int(schedule, "epp.candidates"), Some(1));
    assert!(
        int(schedule, "epp.default.scorer.queue-scorer.us").is_some(),
        "{:?}",
        schedule.attributes
    );
    // Its response: the same trace, linked to the routing span, with the usage.
    let resp_a = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "epp.response" && s.links.iter().any(|l| l.span_id == ra.span_id))
        .expect("A's response span, linked to its routing span");
    assert_eq!(resp_a.trace_id, ra.trace_id);
    // The observing filter sees the request as routed: its `traceparent` is the routing span.
    assert_eq!(resp_a.parent_span_id, ra.span_id);
    assert_eq!(int(resp_a, "gen_ai.usage.output_tokens"), Some(40));
    assert!(int(resp_a, "gen_ai.usage.input_tokens").is_some_and(|n| n > 0));
    assert_eq!(string(resp_a, "epp.outcome").as_deref(), Some("completed"));
    assert_eq!(int(resp_a, "http.response.status_code"), Some(200));

    // B waited for A's slot: its admission span says so.
    assert_ne!(hex(&rb.trace_id), TRACE_ID, "B started its own trace");
    let admission = children(rb)
        .into_iter()
        .find(|s| s.name == "epp.admission")
        .unwrap();
    assert!(matches!(
        attr(admission, "epp.admission.queued"),
        Some(Any::BoolValue(true))
    ));
    let waited = match attr(admission, "epp.admission.wait_ms") {
        Some(Any::DoubleValue(ms)) => *ms,
        other => panic!("wait_ms {other:?}"),
    };
    assert!(waited > 100.0, "B waited {waited} ms");
    let queued = admission.end_time_unix_nano - admission.start_time_unix_nano;
    assert!(queued as f64 >= waited * 0.9e6, "the span covers the wait");

    // C: refused with its status, no schedule.
    assert_eq!(int(rc, "http.response.status_code"), Some(400));
    assert_eq!(
        rc.status.as_ref().map(|s| s.code),
        Some(opentelemetry_proto::tonic::trace::v1::status::StatusCode::Error as i32)
    );
    assert!(children(rc).iter().all(|s| s.name != "epp.schedule"));

    // The same replica told `OTEL_TRACES_EXPORTER=none` sends nothing.
    let (quiet, addr) = receiver().await.unwrap();
    let epp = chaos::epp::EppProcess::start_with_env(
        &c.endpoints_file,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{addr}")),
            ("OTEL_TRACES_EXPORTER", "none"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await
    .unwrap();
    chaos::wait::until("a pick", Duration::from_secs(20), || async {
        chaos::extproc::pick(epp.addrs.ext_proc, None).await.is_ok()
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(quiet.spans().is_empty());
    drop(epp);
    c.shutdown().await;
}

/// Two replicas behind Envoy (not tracing itself): the observing stream of a request lands on
/// either replica (about half the time on the other one); its response span still links to the
/// routing span, named by the route info; the pod's request carries the routing span as parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_span_links_to_the_routing_span_across_replicas() {
    let (rx, addr) = receiver().await.unwrap();
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 2,
            ..SimConfig::default()
        },
        replicas: 2,
        epp_env: vec![
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
                format!("http://{addr}"),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    let url = format!("{}/v1/chat/completions", c.envoy.url());
    let client = reqwest::Client::new();
    let mut pod_parents = Vec::new();
    for i in 0..20 {
        let r = client
            .post(&url)
            .json(&json!({
                "model": "sim-model",
                "messages": [{"role": "user", "content": format!("question {i}")}],
                "max_tokens": 4,
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let parent = r
            .headers()
            .get(sim::server::RECEIVED_TRACEPARENT_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .expect("the pod received a traceparent");
        pod_parents.push(parent);
        r.text().await.unwrap();
    }
    chaos::wait::until("the spans", Duration::from_secs(20), || {
        let rx = rx.clone();
        async move {
            let spans = rx.spans();
            // Routing and response spans travel in different batches: wait for all of both.
            let count = |name: &str| spans.iter().filter(|r| r.span.name == name).count();
            count("epp.request") >= 20 && count("epp.response") >= 20
        }
    })
    .await
    .unwrap();
    let spans = rx.spans();
    let instances: std::collections::BTreeSet<&str> =
        spans.iter().map(|r| r.instance.as_str()).collect();
    assert_eq!(instances.len(), 2, "two replicas export: {instances:?}");
    let mut across = 0;
    for resp in spans.iter().filter(|r| r.span.name == "epp.response") {
        let link = resp
            .span
            .links
            .first()
            .expect("every response span links to its routing span");
        let routing = spans
            .iter()
            .find(|r| r.span.name == "epp.request" && r.span.span_id == link.span_id)
            .expect("the linked routing span was exported");
        assert_eq!(routing.span.trace_id, resp.span.trace_id);
        if routing.instance != resp.instance {
            across += 1;
        }
    }
    println!("{across} of 20 responses observed on the other replica");
    assert!(across > 0, "no response was observed on the other replica");
    // Without a tracing Envoy the pod's request names the routing span itself.
    for tp in &pod_parents {
        let id = tp.split('-').nth(2).unwrap_or_default();
        assert!(
            spans
                .iter()
                .any(|r| r.span.name == "epp.request" && hex(&r.span.span_id) == id),
            "the pod's traceparent {tp} is no routing span"
        );
    }
    c.shutdown().await;
}

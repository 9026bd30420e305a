//! The subset hint over the real ext_proc protocol (a synthetic Envoy client against `epp serve`):
//! `metadata_context.filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`
//! restricts the candidates by IP. The simulated pods all listen on 127.0.0.1, so a hint naming it
//! allows every pod and a hint naming another address allows none (503 `rejected-no-endpoints`);
//! `--disable-endpoint-subset-filter` ignores the hint. Also: a response-filter stream for a
//! request with nothing to do here is let through and closed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chaos::epp::EppProcess;
use chaos::extproc::pick as route;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use sim::{Sim, SimConfig};

fn hint(entries: &[&str]) -> Metadata {
    let list = Kind::ListValue(ListValue {
        values: entries
            .iter()
            .map(|e| Value {
                kind: Some(Kind::StringValue((*e).into())),
            })
            .collect(),
    });
    let mut s = Struct::default();
    s.fields.insert(
        "x-gateway-destination-endpoint-subset".into(),
        Value { kind: Some(list) },
    );
    let mut md = Metadata::default();
    md.filter_metadata.insert("envoy.lb.subset_hint".into(), s);
    md
}

/// The endpoints file is read after the ports are bound: wait until it is loaded (`/readyz`).
async fn ready(epp: &EppProcess) {
    let admin = epp.addrs.admin;
    chaos::wait::until(
        "the replica ready",
        std::time::Duration::from_secs(10),
        || async move {
            reqwest::get(format!("http://{admin}/readyz"))
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_candidates_by_ip() {
    let sim = Sim::start(SimConfig {
        pods: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, sim.pods_yaml()).unwrap();
    let pods: Vec<String> = sim.pods().iter().map(|p| p.addr.to_string()).collect();

    let epp = EppProcess::start(&endpoints, &[]).await.unwrap();
    let addr = epp.addrs.ext_proc;
    // The endpoints file is read after the ports are bound: ready once it is loaded.
    let admin = epp.addrs.admin;
    chaos::wait::until(
        "the replica ready",
        std::time::Duration::from_secs(10),
        || async move {
            reqwest::get(format!("http://{admin}/readyz"))
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap();
    let routed = route(addr, None).await.unwrap();
    assert!(pods.contains(&routed), "{routed} not in {pods:?}");
    // A hint naming the pods' IP (any port: matched by IP) allows them.
    let routed = route(addr, Some(hint(&["127.0.0.1:1"]))).await.unwrap();
    assert!(pods.contains(&routed), "{routed}");
    // A hint naming another address, or an empty one, leaves no candidate: 503.
    let refused = (503, "rejected-no-endpoints".to_string());
    assert_eq!(
        route(addr, Some(hint(&["10.9.9.9:8000"]))).await,
        Err(refused.clone())
    );
    assert_eq!(route(addr, Some(hint(&[]))).await, Err(refused));
    drop(epp);

    let epp = EppProcess::start(&endpoints, &["--disable-endpoint-subset-filter"])
        .await
        .unwrap();
    ready(&epp).await;
    let routed = route(epp.addrs.ext_proc, Some(hint(&["10.9.9.9:8000"])))
        .await
        .unwrap();
    assert!(
        pods.contains(&routed),
        "the hint is ignored when disabled: {routed}"
    );
    drop(epp);
    sim.shutdown().await;
}

/// A response-filter stream (gRPC metadata `x-llm-d-ext-proc-role: response`) for a request this
/// replica has nothing to do for — here flow control is off and nothing was rewritten — lets the
/// request through and closes its side, so Envoy proceeds without it; the stream is not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_stream_for_an_unknown_request_lets_it_through() {
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};

    let dir = tempfile::tempdir().unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let epp = EppProcess::start(&endpoints, &[]).await.unwrap();
    let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.addrs.ext_proc))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(ProcessingRequest {
        request: Some(Req::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    chaos::extproc::header(":path", "/v1/chat/completions"),
                    chaos::extproc::header("x-request-id", "not-here"),
                    chaos::extproc::header("x-llm-d-response-filter", "evict"),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("x-llm-d-ext-proc-role", "response".parse().unwrap());
    let mut responses = client.process(req).await.unwrap().into_inner();
    let first = responses.message().await.unwrap().unwrap();
    assert!(
        matches!(first.response, Some(Resp::RequestHeaders(_))),
        "{first:?}"
    );
    // Our side stays open (`tx` alive); the EPP ends the stream by itself.
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), responses.message())
        .await
        .expect("the response stream stayed open");
    assert!(matches!(end, Ok(None)), "{end:?}");
    drop(tx);
    drop(epp);
}

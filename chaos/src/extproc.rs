//! A synthetic Envoy for the ext_proc protocol: the messages Envoy sends for one request, so tests
//! and benchmarks can talk to `epp serve` without Envoy.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};

/// A header as Envoy sends it (value in `raw_value`).
pub fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    }
}

/// A header's value, whichever field carries it.
pub fn header_value(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// Request headers of a JSON `POST /v1/chat/completions` (with `metadata` as the request's
/// metadata context), then the whole body with end of stream.
pub fn chat_request(body: &[u8], metadata: Option<Metadata>) -> Vec<ProcessingRequest> {
    vec![
        ProcessingRequest {
            request: Some(Req::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", "/v1/chat/completions"),
                        header("content-type", "application/json"),
                    ],
                }),
                end_of_stream: false,
                ..Default::default()
            })),
            metadata_context: metadata,
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Req::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        },
    ]
}

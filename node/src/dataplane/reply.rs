//! The shapes of what the EPP says to Envoy: header mutations, the routed answer with its
//! `envoy.lb` dynamic metadata, streamed body chunks and immediate responses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::common_response::ResponseStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, body_mutation,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value};

use crate::request::reject::{DROPPED_REASON_HEADER, Rejection};

/// What a stream's task sends Envoy. Boxed: a channel allocates its slots 32 at a time, and 32
/// unboxed responses made every open stream hold ~27 KB more (Envoy keeps each observing stream
/// open for a while after its request: thousands at once under load).
pub(crate) type Tx = tokio::sync::mpsc::Sender<Box<ProcessingResponse>>;

/// A boxed reply as tonic streams it.
pub(crate) fn unbox(r: Box<ProcessingResponse>) -> Result<ProcessingResponse, tonic::Status> {
    Ok(*r)
}

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The prefill pod of a disaggregated request (`ip:port`), for the decode pod's sidecar.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The data-parallel rank (`ip:port`) a request sent to the pod's primary port is for.
pub const DATA_PARALLEL_HEADER: &str = "x-data-parallel-host-port";
pub const ENVOY_LB_NAMESPACE: &str = "envoy.lb";
/// Largest body chunk streamed back to Envoy (llm-d uses the same bound).
pub const BODY_CHUNK: usize = 62_000;

/// Set (overwrite) one request header.
pub fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// One header of an ext_proc header map (`raw_value` when set, else `value`).
pub fn header_value<'a>(
    map: Option<&'a HeaderMap>,
    key: &str,
) -> Option<std::borrow::Cow<'a, str>> {
    map?.headers.iter().find(|h| h.key == key).map(|h| {
        if h.raw_value.is_empty() {
            std::borrow::Cow::Borrowed(h.value.as_str())
        } else {
            String::from_utf8_lossy(&h.raw_value)
        }
    })
}

/// One chunk of a body streamed back (`FULL_DUPLEX_STREAMED`).
pub fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

/// The routed answer: continue with these header mutations, the route cache cleared (the
/// destination header selects the route), and the destination (plus `extra` entries, e.g.
/// session tokens) in `envoy.lb` dynamic metadata. On the request-headers message in
/// `FULL_DUPLEX_STREAMED` mode (and for body-less requests), else on the body message.
pub fn routed(
    destination: &str,
    set_headers: Vec<HeaderValueOption>,
    remove_headers: Vec<String>,
    extra_metadata: &[(String, String)],
    on_headers: bool,
) -> ProcessingResponse {
    let common = CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers,
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let response = if on_headers {
        Resp::RequestHeaders(HeadersResponse {
            response: Some(common),
        })
    } else {
        Resp::RequestBody(BodyResponse {
            response: Some(common),
        })
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(destination_metadata(destination, extra_metadata)),
        ..Default::default()
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port[,ip:port...]>", <extra>...}}`
fn destination_metadata(destination: &str, extra: &[(String, String)]) -> Struct {
    let string = |v: &str| Value {
        kind: Some(value::Kind::StringValue(v.to_string())),
    };
    let inner = Struct {
        fields: std::iter::once((DESTINATION_HEADER.to_string(), string(destination)))
            .chain(extra.iter().map(|(k, v)| (k.clone(), string(v))))
            .collect(),
    };
    Struct {
        fields: [(
            ENVOY_LB_NAMESPACE.to_string(),
            Value {
                kind: Some(value::Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// The ext_proc immediate response that delivers a refusal: its status, llm-d's body
/// (`inference error: <Code> - <message>`) and, where llm-d has one, the drop reason header.
pub fn immediate(r: &Rejection) -> ImmediateResponse {
    let mut set_headers = vec![header("content-type", "text/plain; charset=utf-8")];
    if let Some(reason) = r.reason {
        set_headers.push(header(DROPPED_REASON_HEADER, reason));
    }
    set_headers.extend(r.headers.iter().map(|(k, v)| header(k, v)));
    ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(r.status),
        }),
        headers: Some(HeaderMutation {
            set_headers,
            remove_headers: vec![],
        }),
        body: r.body().into_bytes(),
        grpc_status: None,
        details: format!("llm_d_epp_{}", r.code),
    }
}

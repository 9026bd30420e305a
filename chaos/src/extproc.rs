//! A synthetic Envoy for the ext_proc protocol: the messages Envoy sends for one request, so tests
//! and benchmarks can talk to `epp serve` without Envoy.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};

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
    chat_request_with(body, &[], metadata)
}

/// [`chat_request`] with extra request headers (e.g. `x-request-id`, a fairness id).
pub fn chat_request_with(
    body: &[u8],
    extra: &[(&str, &str)],
    metadata: Option<Metadata>,
) -> Vec<ProcessingRequest> {
    let mut headers = vec![
        header(":method", "POST"),
        header(":path", "/v1/chat/completions"),
        header("content-type", "application/json"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    vec![
        ProcessingRequest {
            request: Some(Req::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
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

/// The route info header (`x-llm-d-epp-route`) the EPP set on a routed request, from one of
/// its answers: what Envoy passes on to the filter that observes the response.
pub fn route_info(resp: &ProcessingResponse) -> Option<String> {
    let common = match resp.response.as_ref()? {
        Resp::RequestHeaders(h) => h.response.as_ref()?,
        Resp::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == ROUTE_INFO_HEADER)
        .map(header_value)
}

/// Header carrying the routing stream's decision to the observing stream.
pub const ROUTE_INFO_HEADER: &str = "x-llm-d-epp-route";

/// What the response-observing filter (observability mode) sends for the request routed with
/// `route` (its [`route_info`]) whose JSON response `body` ended: its request headers, the
/// response headers, the body with end of stream. The EPP settles the request when it sees the
/// end.
pub fn observed_response(route: &str, body: &[u8]) -> Vec<ProcessingRequest> {
    let observe = |request| ProcessingRequest {
        request: Some(request),
        observability_mode: true,
        ..Default::default()
    };
    vec![
        observe(Req::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/chat/completions"),
                    header(ROUTE_INFO_HEADER, route),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        observe(Req::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", "200"),
                    header("content-type", "application/json"),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        observe(Req::ResponseBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
    ]
}

/// A small chat request body for the simulator's model.
pub const SMALL_CHAT: &[u8] =
    br#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;

/// An ext_proc client of `epp serve`.
pub type Client = envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient<
    tonic::transport::Channel,
>;

/// An ext_proc client of the EPP listening on `addr` (Nagle off, as Envoy's gRPC client).
pub async fn connect(addr: std::net::SocketAddr) -> anyhow::Result<Client> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    Ok(Client::new(channel))
}

/// Route one chat request `body` carrying `x-request-id: request_id` and read the answer to its
/// end; the route info the EPP set (what the observing filter needs to settle it).
pub async fn route(client: &mut Client, body: &[u8], request_id: &str) -> anyhow::Result<String> {
    let msgs = chat_request_with(body, &[("x-request-id", request_id)], None);
    let mut responses = client.process(tokio_stream::iter(msgs)).await?.into_inner();
    let mut route = None;
    while let Some(msg) = responses.message().await? {
        if let Some(Resp::ImmediateResponse(i)) = &msg.response {
            anyhow::bail!("refused: {:?}", i.status);
        }
        route = route.or_else(|| route_info(&msg));
    }
    route.ok_or_else(|| anyhow::anyhow!("not routed"))
}

/// The observing filter reports the end of the response routed with route info `route` (and,
/// when given, the client's `x-request-id`).
pub async fn observe(
    client: &mut Client,
    route: &str,
    request_id: Option<&str>,
) -> anyhow::Result<()> {
    let mut msgs = observed_response(route, br#"{"choices":[]}"#);
    if let (Some(id), Some(Req::RequestHeaders(h))) = (request_id, msgs[0].request.as_mut()) {
        h.headers
            .get_or_insert_default()
            .headers
            .push(header("x-request-id", id));
    }
    let mut responses = client.process(tokio_stream::iter(msgs)).await?.into_inner();
    while responses.message().await?.is_some() {}
    Ok(())
}

/// Routes one small chat request carrying `metadata` over a new ext_proc stream to the EPP at
/// `addr`: `Ok(destination)` or `Err((status, dropped reason))` for an immediate response.
pub async fn pick(
    addr: std::net::SocketAddr,
    metadata: Option<Metadata>,
) -> Result<String, (i32, String)> {
    pick_for(addr, metadata, "hello").await
}

/// [`pick`] for a request whose user message is `content` (distinct prompts keep prefix
/// affinity from steering every pick to the same pods).
pub async fn pick_for(
    addr: std::net::SocketAddr,
    metadata: Option<Metadata>,
    content: &str,
) -> Result<String, (i32, String)> {
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    }))
    .unwrap_or_default();
    answer(addr, chat_request(&body, metadata))
        .await
        .map(|r| r.destination)
}

/// What the EPP answered for a routed request.
#[derive(Debug, Clone)]
pub struct Routed {
    pub destination: String,
    /// The body Envoy would forward, when the EPP replaced it (e.g. a rewritten model).
    pub body: Option<Vec<u8>>,
}

/// Sends `msgs` (one request) over a new ext_proc stream to the EPP at `addr`: what it routed,
/// or `Err((status, dropped reason))` for an immediate response.
pub async fn answer(
    addr: std::net::SocketAddr,
    msgs: Vec<ProcessingRequest>,
) -> Result<Routed, (i32, String)> {
    let mut client = Client::connect(format!("http://{addr}"))
        .await
        .map_err(|e| (0, format!("connect: {e}")))?;
    let mut responses = client
        .process(tokio_stream::iter(msgs))
        .await
        .map_err(|e| (0, format!("process: {e}")))?
        .into_inner();
    let mut destination = None;
    let mut body: Option<Vec<u8>> = None;
    while let Some(msg) = responses
        .message()
        .await
        .map_err(|e| (0, format!("stream: {e}")))?
    {
        match msg.response {
            Some(Resp::ImmediateResponse(i)) => {
                let reason = i
                    .headers
                    .iter()
                    .flat_map(|h| &h.set_headers)
                    .filter_map(|o| o.header.as_ref())
                    .find(|h| h.key == "x-llm-d-request-dropped-reason")
                    .map(header_value)
                    .unwrap_or_default();
                return Err((i.status.map_or(0, |s| s.code), reason));
            }
            Some(r) => {
                if let Resp::RequestBody(b) = &r
                    && let Some(m) = b.response.as_ref().and_then(|c| c.body_mutation.as_ref())
                {
                    match &m.mutation {
                        Some(Mutation::StreamedResponse(s)) => {
                            body.get_or_insert_default().extend_from_slice(&s.body);
                        }
                        Some(Mutation::Body(b)) => body = Some(b.clone()),
                        _ => {}
                    }
                }
                destination = destination.or_else(|| destination_of(&r));
            }
            None => {}
        }
    }
    let destination = destination.ok_or((0, "no destination in the answer".to_string()))?;
    Ok(Routed { destination, body })
}

fn destination_of(r: &Resp) -> Option<String> {
    let common = match r {
        Resp::RequestHeaders(h) => h.response.as_ref(),
        Resp::RequestBody(b) => b.response.as_ref(),
        _ => None,
    }?;
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")
        .map(header_value)
}

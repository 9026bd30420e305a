//! The per-stream state machine: one ext_proc stream, one HTTP request.
//!
//! Request-phase messages fill the stream's state (headers, body chunks up to the cap); at the
//! end of the body — or of the headers, for a body-less request — the request takes its journey
//! ([`route`]). Response-phase messages are passed through or observed ([`observe`]), which
//! settles the request once its response ends.

mod observe;
mod route;
pub(super) mod trace;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeadersResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use tonic::Streaming;

use super::context::PickerContext;
use super::reply::{self, BODY_CHUNK, streamed_body};
use super::usage::{RouteInfo, UsageScanner};
use crate::metrics::RequestLabels;
use crate::request::reject::Rejection;

const REQUEST_ID_HEADER: &str = "x-request-id";
/// `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

use crate::dataplane::reply::Tx;

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for request headers / body.
    Request,
    /// The request was routed (or refused); only response-phase messages are expected.
    Routed,
    /// An immediate response was sent; nothing more to do.
    Done,
}

struct StreamState {
    ctx: Arc<PickerContext>,
    tx: Tx,
    phase: Phase,
    started: Instant,
    headers: HashMap<String, String>,
    /// The client's `x-request-id` (or one generated for it): for logs and the model server.
    request_id: String,
    generated_request_id: bool,
    /// The EPP's key for the request (see [`RouteInfo::key`]): set when the routing stream
    /// routes, decoded from the route info by an observing stream; empty until then.
    key: String,
    body: Vec<u8>,
    /// At least one request-body message arrived (the request has a body, maybe empty).
    body_started: bool,
    request_body_mode: i32,
    response_body_mode: i32,
    observability: bool,
    labels: Option<RequestLabels>,
    running: bool,
    /// This stream sees the response, so it settles the request's in-flight charge.
    settles: bool,
    /// When the first response bytes arrived.
    first_byte_at: Option<Instant>,
    /// The endpoint the proxy reports serving the request (a fallback, perhaps).
    served: Option<String>,
    /// Set by the routing stream; decoded from the request headers by an observing stream.
    route_info: Option<RouteInfo>,
    usage: Option<UsageScanner>,
    /// The Responses-API response this stream observed is bound to its pod already.
    response_bound: bool,
    /// What this stream holds of the replica's budget for buffered request bodies.
    reservation: super::budget::Reservation,
    /// Tenant mode: the tenant the request headers identified (before any body is buffered).
    tenant: Option<Arc<crate::request::tenant::Tenant>>,
    /// The proxy's subset hint (allowed endpoint IPs), from any request-phase message's metadata.
    subset: Option<Vec<std::net::IpAddr>>,
    /// The pod this stream routed the request to (`ip:port`), when it routed it.
    primary: Option<String>,
    /// The ext_proc call's trace context (gRPC metadata; empty when traces are off).
    trace_parent: HashMap<String, String>,
    /// The routing span (disabled when traces are off or this stream did not route).
    span: tracing::Span,
    /// The routing span's context once it ended (the response span's parent).
    routed_cx: Option<opentelemetry::Context>,
    /// The response span, between the first response message and the settlement.
    response_span: tracing::Span,
}

pub async fn run(
    ctx: Arc<PickerContext>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: Tx,
    trace_parent: HashMap<String, String>,
) {
    ctx.metrics.stream_opened();
    let mut st = StreamState {
        ctx: ctx.clone(),
        tx,
        phase: Phase::Request,
        started: Instant::now(),
        headers: HashMap::new(),
        request_id: String::new(),
        generated_request_id: false,
        key: String::new(),
        body: Vec::new(),
        body_started: false,
        request_body_mode: FULL_DUPLEX,
        response_body_mode: FULL_DUPLEX,
        observability: false,
        labels: None,
        running: false,
        settles: false,
        first_byte_at: None,
        served: None,
        route_info: None,
        usage: None,
        response_bound: false,
        reservation: super::budget::Reservation::new(ctx.body_budget.clone()),
        tenant: None,
        subset: None,
        primary: None,
        trace_parent,
        span: tracing::Span::none(),
        routed_cx: None,
        response_span: tracing::Span::none(),
    };
    loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(%status, "ext_proc stream ended with an error");
                break;
            }
        };
        if st.handle(msg).await.is_err() {
            // Envoy stopped reading our responses: the stream is gone.
            break;
        }
    }
    st.finish();
    ctx.metrics.stream_closed();
}

impl StreamState {
    async fn send(&self, resp: Resp) -> Result<(), ()> {
        self.send_full(ProcessingResponse {
            response: Some(resp),
            ..Default::default()
        })
        .await
    }

    async fn send_full(&self, resp: ProcessingResponse) -> Result<(), ()> {
        self.tx.send(Box::new(resp)).await.map_err(|_| ())
    }

    async fn handle(&mut self, msg: ProcessingRequest) -> Result<(), ()> {
        if let Some(pc) = &msg.protocol_config {
            self.request_body_mode = pc.request_body_mode;
            self.response_body_mode = pc.response_body_mode;
        }
        self.observability = msg.observability_mode;
        if let Some(hint) = msg
            .metadata_context
            .as_ref()
            .and_then(super::subset::subset_hint)
        {
            self.subset = Some(hint);
        }
        if let Some(Req::ResponseHeaders(_)) = &msg.request
            && let Some(served) = msg
                .metadata_context
                .as_ref()
                .and_then(observe::served_endpoint)
        {
            self.on_served(&served);
        }
        let Some(req) = msg.request else {
            return Ok(());
        };
        match req {
            Req::RequestHeaders(h) => self.on_request_headers(h).await,
            Req::RequestBody(b) => self.on_request_body(b).await,
            Req::RequestTrailers(_) => {
                if self.phase == Phase::Request && !self.observability {
                    self.route().await?;
                }
                if self.observability || self.phase == Phase::Done {
                    return Ok(());
                }
                self.send(Resp::RequestTrailers(TrailersResponse::default()))
                    .await
            }
            Req::ResponseHeaders(h) => self.on_response_headers(h).await,
            Req::ResponseBody(b) => self.on_response_body(b).await,
            Req::ResponseTrailers(_) => self.on_response_trailers().await,
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders) -> Result<(), ()> {
        if let Some(map) = &h.headers {
            for hv in &map.headers {
                let v = if hv.raw_value.is_empty() {
                    hv.value.clone()
                } else {
                    String::from_utf8_lossy(&hv.raw_value).into_owned()
                };
                self.headers.insert(hv.key.to_ascii_lowercase(), v);
            }
        }
        match self.headers.get(REQUEST_ID_HEADER) {
            Some(id) if !id.is_empty() => self.request_id = id.clone(),
            _ => {
                self.request_id = uuid::Uuid::new_v4().to_string();
                self.generated_request_id = true;
            }
        }
        if self.observability {
            // The response-observing filter: nothing to route.
            self.phase = Phase::Routed;
            return Ok(());
        }
        // Tenant mode: who is asking is known from the headers — a request without a valid
        // key is refused before a byte of its body is buffered.
        if let Some(q) = &self.ctx.quotas {
            match q.identify(&self.headers) {
                Ok(t) => self.tenant = Some(t),
                Err(r) => return self.reject(r).await,
            }
        }
        if h.end_of_stream {
            // No body (e.g. GET /v1/models): route now, on scores alone.
            return self.route().await;
        }
        if self.request_body_mode != FULL_DUPLEX {
            // Envoy waits for this answer before sending a buffered/streamed body; the
            // destination is set on the body response instead.
            return self
                .send(Resp::RequestHeaders(HeadersResponse::default()))
                .await;
        }
        Ok(())
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Result<(), ()> {
        if self.phase != Phase::Request || self.observability {
            return Ok(());
        }
        if self.body.len() + b.body.len() > self.ctx.max_body_bytes {
            self.body = Vec::new();
            return self
                .reject(Rejection::too_large(self.ctx.max_body_bytes))
                .await;
        }
        // The budget counts what the buffer holds (its capacity), grown by doubling up to the
        // body limit.
        let need = self.body.len() + b.body.len();
        let whole = self.body.is_empty() && b.end_of_stream;
        let capacity = if whole {
            b.body.capacity()
        } else if need > self.body.capacity() {
            need.max(self.body.capacity() * 2)
                .min(self.ctx.max_body_bytes)
        } else {
            self.body.capacity()
        };
        if !self
            .reservation
            .grow(capacity.saturating_sub(self.body.capacity()))
        {
            return self
                .reject(Rejection::body_budget(self.ctx.body_budget.limit()))
                .await;
        }
        self.body_started = true;
        if whole {
            self.body = b.body;
        } else {
            self.body.reserve_exact(capacity - self.body.len());
            self.body.extend_from_slice(&b.body);
        }
        if b.end_of_stream {
            self.route().await?;
        }
        Ok(())
    }

    async fn stream_body_back(&self, body: Vec<u8>) -> Result<(), ()> {
        if body.is_empty() {
            return self
                .send(Resp::RequestBody(streamed_body(Vec::new(), true)))
                .await;
        }
        let n = body.len().div_ceil(BODY_CHUNK);
        for (i, chunk) in body.chunks(BODY_CHUNK).enumerate() {
            self.send(Resp::RequestBody(streamed_body(chunk.to_vec(), i + 1 == n)))
                .await?;
        }
        Ok(())
    }

    async fn reject(&mut self, r: Rejection) -> Result<(), ()> {
        let labels = match &self.labels {
            Some(l) => l.clone(),
            None => {
                let l = self.ctx.metrics.request_labels("", "");
                self.ctx.metrics.request_received(&l, self.body.len());
                l
            }
        };
        self.ctx
            .metrics
            .refused(&labels, r.code, r.status, r.reason);
        self.labels = Some(labels);
        self.span_refused(&r);
        tracing::debug!(request_id = %self.request_id, status = r.status, message = %r.message, "request refused");
        self.phase = Phase::Done;
        self.body = Vec::new();
        self.reservation.release();
        self.send(Resp::ImmediateResponse(reply::immediate(&r)))
            .await
    }
}

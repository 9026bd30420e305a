//! The per-stream state machine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::common_response::ResponseStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
    body_mutation,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::PickerContext;
use super::reject::Rejection;
use super::response::{EVICT, RESPONSE_FILTER_HEADER, Restore};
use super::usage::{ROUTE_INFO_HEADER, RouteInfo, UsageScanner};
use crate::admission::{Admission, AdmitRequest, CONTROL_HEADERS, RequestMeta, Verdict};
use crate::metrics::RequestLabels;
use crate::parsers::{self, ParsedRequest, Prompt};
use crate::plugins::scheduler::Handler;
use crate::plugins::{SchedError, SchedRequest};
use crate::rewrite::{REWRITE_ALIAS, REWRITE_HEADER};

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The prefill pod of a disaggregated request (`ip:port`), for the decode pod's sidecar.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
pub const ENVOY_LB_NAMESPACE: &str = "envoy.lb";
/// The endpoint that served the request, as the proxy reports it in `envoy.lb` metadata.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
const REQUEST_ID_HEADER: &str = "x-request-id";
/// Largest body chunk streamed back to Envoy (llm-d uses the same bound).
const BODY_CHUNK: usize = 62_000;
/// `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

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
    request_id: String,
    generated_request_id: bool,
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
    first_response_byte: bool,
    /// Set by the routing stream; decoded from the request headers by an observing stream.
    route_info: Option<RouteInfo>,
    usage: Option<UsageScanner>,
    /// The proxy's subset hint (allowed endpoint IPs), from any request-phase message's metadata.
    subset: Option<Vec<std::net::IpAddr>>,
    /// The pod this stream routed the request to (`ip:port`), when it routed it.
    primary: Option<String>,
}

pub async fn run(ctx: Arc<PickerContext>, mut inbound: Streaming<ProcessingRequest>, tx: Tx) {
    ctx.metrics.stream_opened();
    let mut st = StreamState {
        ctx: ctx.clone(),
        tx,
        phase: Phase::Request,
        started: Instant::now(),
        headers: HashMap::new(),
        request_id: String::new(),
        generated_request_id: false,
        body: Vec::new(),
        body_started: false,
        request_body_mode: FULL_DUPLEX,
        response_body_mode: FULL_DUPLEX,
        observability: false,
        labels: None,
        running: false,
        settles: false,
        first_response_byte: false,
        route_info: None,
        usage: None,
        subset: None,
        primary: None,
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
        self.tx.send(Ok(resp)).await.map_err(|_| ())
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
            && let Some(served) = msg.metadata_context.as_ref().and_then(served_endpoint)
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
            Req::ResponseHeaders(h) => {
                self.settles = true;
                if self.route_info.is_none() {
                    self.route_info = self
                        .headers
                        .get(ROUTE_INFO_HEADER)
                        .and_then(|v| RouteInfo::decode(v));
                }
                if self.route_info.is_some() {
                    let ct = header_value(h.headers.as_ref(), "content-type");
                    self.usage = Some(UsageScanner::new(ct.as_deref()));
                }
                if h.end_of_stream {
                    self.settle();
                }
                if self.phase == Phase::Done || self.observability {
                    return Ok(());
                }
                self.phase = Phase::Routed;
                let status = header_value(h.headers.as_ref(), ":status");
                if let (Some(s), Some(l)) = (status, &self.labels)
                    && s != "200"
                {
                    self.ctx.metrics.request_error(l, "ModelServerError");
                }
                self.send(Resp::ResponseHeaders(HeadersResponse::default()))
                    .await?;
                if h.end_of_stream {
                    self.complete();
                }
                Ok(())
            }
            Req::ResponseBody(b) => {
                let eos = b.end_of_stream;
                self.settles = true;
                if let Some(u) = &mut self.usage {
                    u.feed(&b.body);
                }
                if !self.first_response_byte && !b.body.is_empty() {
                    // Prefill is over once bytes flow: release the prompt tokens.
                    self.first_response_byte = true;
                    if let Some(t) = &self.ctx.inflight {
                        t.release_tokens(&self.request_id);
                    }
                }
                if eos {
                    self.settle();
                }
                let result = if self.phase == Phase::Done || self.observability {
                    Ok(())
                } else if self.response_body_mode == FULL_DUPLEX {
                    self.send(Resp::ResponseBody(streamed_body(b.body, eos)))
                        .await
                } else {
                    self.send(Resp::ResponseBody(BodyResponse::default())).await
                };
                if eos {
                    self.complete();
                }
                result
            }
            Req::ResponseTrailers(_) => {
                self.settles = true;
                self.settle();
                self.complete();
                if self.phase == Phase::Done || self.observability {
                    return Ok(());
                }
                self.send(Resp::ResponseTrailers(TrailersResponse::default()))
                    .await
            }
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
        self.body_started = true;
        if self.body.is_empty() && b.end_of_stream {
            self.body = b.body;
        } else {
            self.body.extend_from_slice(&b.body);
        }
        if b.end_of_stream {
            self.route().await?;
        }
        Ok(())
    }

    /// Parse, schedule and answer the request phase.
    async fn route(&mut self) -> Result<(), ()> {
        let path = self
            .headers
            .get(":path")
            .or_else(|| self.headers.get("x-original-path"))
            .or_else(|| self.headers.get("x-forwarded-path"))
            .cloned()
            .unwrap_or_default();
        let has_body = self.body_started;
        let parsed = if has_body {
            let Some(kind) = parsers::kind_for_path(&path, self.ctx.passthrough) else {
                return self
                    .reject(Rejection::not_found(format!(
                        "no request parser handles path `{path}` (supported: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/messages, /inference/v1/generate)"
                    )))
                    .await;
            };
            match parsers::parse(kind, &self.body) {
                Ok(p) => Some(p),
                Err(e) => {
                    let labels = self.ctx.metrics.request_labels("", "");
                    self.ctx.metrics.request_received(&labels, self.body.len());
                    self.labels = Some(labels);
                    return self.reject(Rejection::bad_request(e.to_string())).await;
                }
            }
        } else {
            None
        };
        let model = parsed
            .as_ref()
            .map(|p: &ParsedRequest| p.model.as_str())
            .unwrap_or("");
        // Model rewrite: a rule for the model, else the rewrite header, else unchanged.
        let rewrite_header = self
            .headers
            .get(REWRITE_HEADER)
            .or_else(|| self.headers.get(REWRITE_ALIAS))
            .map(String::as_str);
        let target = self
            .ctx
            .rewrites
            .target(model, rewrite_header, &mut rand::rng())
            .to_string();
        let rewritten = has_body && !model.is_empty() && target != model;
        let target_model = if rewritten { target.as_str() } else { model };
        if rewritten {
            self.ctx.metrics.model_rewrite(model, target_model);
        }
        let labels = self.ctx.metrics.request_labels(model, target_model);
        self.ctx.metrics.request_received(&labels, self.body.len());
        self.ctx.metrics.request_running(&labels, 1);
        self.running = true;
        self.labels = Some(labels);

        let meta = RequestMeta::from_headers(&self.headers, &self.ctx.objectives);
        let mut ticket = None;
        match &self.ctx.admission {
            // Only sheddable requests are checked: skip the snapshot for the others.
            Admission::Legacy(legacy) if meta.priority < 0 => {
                let now = Instant::now();
                if legacy.check(meta.priority, &self.ctx.store.candidates(now), now) {
                    return self.reject(Rejection::sheddable_saturated()).await;
                }
            }
            Admission::Legacy(_) => {}
            admission @ (Admission::Flow(_) | Admission::Global(_)) => {
                let pending = admission
                    .enqueue(AdmitRequest {
                        request_id: &self.request_id,
                        meta: &meta,
                        bytes: self.body.len() as u64,
                        tokens: parsed.as_ref().map_or(0, |p| p.prompt.estimated_tokens()),
                        model,
                        target_model,
                    })
                    .await;
                // Hold the stream until the verdict; if Envoy goes away meanwhile (the client
                // disconnected) dropping `pending` cancels the queued request.
                if let Some(pending) = pending {
                    let verdict = tokio::select! {
                        v = pending.wait() => v,
                        _ = self.tx.closed() => return Err(()),
                    };
                    match verdict {
                        Verdict::Dispatched(t) => ticket = Some(t),
                        Verdict::Rejected(reason) => {
                            return self.reject(Rejection::dropped(reason)).await;
                        }
                    }
                }
            }
        }

        let t0 = Instant::now();
        let mut candidates = self.ctx.store.candidates(t0);
        if let Some(allowed) = self.subset.as_ref().filter(|_| self.ctx.subset_filter) {
            // Matched by IP, as llm-d does; an empty hint leaves nothing (503).
            candidates.retain(|c| allowed.contains(&c.endpoint.addr.ip()));
        }
        let no_prompt = Prompt::None;
        let req = SchedRequest {
            request_id: &self.request_id,
            model,
            target_model,
            prompt: parsed.as_ref().map_or(&no_prompt, |p| &p.prompt),
            cache_salt: parsed.as_ref().and_then(|p| p.cache_salt.as_deref()),
            headers: &self.headers,
        };
        let decision = self
            .ctx
            .scheduler
            .schedule(&req, &candidates, &mut rand::rng());
        self.ctx
            .metrics
            .scheduled(t0.elapsed().as_secs_f64(), decision.is_ok());
        let decision = match decision {
            Ok(d) => d,
            Err(e) => {
                if let Some(t) = ticket {
                    // Admitted but going nowhere: give the slot back.
                    self.ctx.admission.release(t);
                }
                return match e {
                    SchedError::NoCandidates => self.reject(Rejection::no_endpoints()).await,
                    SchedError::AllFiltered => {
                        self.reject(Rejection::saturated("every endpoint was filtered out"))
                            .await
                    }
                };
            }
        };
        let destination = decision
            .picked
            .iter()
            .map(|i| candidates[*i].endpoint.hostport.as_str())
            .collect::<Vec<_>>()
            .join(",");
        tracing::debug!(request_id = %self.request_id, %destination, model, "routed");
        self.primary = decision
            .picked
            .first()
            .map(|i| candidates[*i].endpoint.hostport.clone());
        if let (Some(t), Some(&primary)) = (ticket, decision.picked.first()) {
            self.ctx
                .admission
                .routed(t, candidates[primary].endpoint.hostport.as_str());
        }
        if let (Some(p), Some(&primary)) = (&decision.data.prefix, decision.picked.first()) {
            let matched = p.matched.get(primary).copied().unwrap_or(0);
            self.ctx
                .metrics
                .prefix_hit(matched, p.total_blocks, p.block_size);
        }

        let info = RouteInfo {
            model: model.to_string(),
            target_model: target_model.to_string(),
            fairness_id: meta.fairness_id.clone(),
            priority: meta.priority,
        };
        let mut set_headers = vec![
            header(DESTINATION_HEADER, &destination),
            header(ROUTE_INFO_HEADER, &info.encode()),
        ];
        self.route_info = Some(info);
        // The response filter (see `response`) handles requests flow control may evict and
        // rewritten requests, whose response must show the client's model again.
        let evictable = ticket.is_some() && meta.priority < 0 && self.ctx.admission.evicts();
        let mut response_work = Vec::new();
        if evictable {
            response_work.push(EVICT.to_string());
        }
        if rewritten {
            let r = Restore {
                target: target_model.to_string(),
                incoming: model.to_string(),
            };
            response_work.push(r.header_item());
        }
        if !response_work.is_empty() {
            set_headers.push(header(RESPONSE_FILTER_HEADER, &response_work.join(",")));
        }
        if self.generated_request_id {
            set_headers.push(header(REQUEST_ID_HEADER, &self.request_id));
        }
        let prefiller = decision
            .prefill
            .and_then(|i| candidates.get(i))
            .map(|c| c.endpoint.hostport.as_str());
        if let Some(p) = prefiller {
            set_headers.push(header(PREFILLER_HEADER, p));
        }
        if matches!(self.ctx.scheduler.handler, Handler::Disagg { .. }) {
            self.ctx.metrics.disagg_decision(if prefiller.is_some() {
                "prefill-decode"
            } else {
                "decode-only"
            });
        }
        // Client-supplied control headers are for the EPP, not the model server.
        let remove_headers = CONTROL_HEADERS
            .iter()
            .chain(prefiller.is_none().then_some(&PREFILLER_HEADER))
            .chain(response_work.is_empty().then_some(&RESPONSE_FILTER_HEADER))
            .filter(|h| self.headers.contains_key(**h))
            .map(|h| h.to_string())
            .collect();
        let common = CommonResponse {
            status: ResponseStatus::Continue as i32,
            header_mutation: Some(HeaderMutation {
                set_headers,
                remove_headers,
            }),
            clear_route_cache: true,
            ..Default::default()
        };
        // Session tokens (session affinity, encoded strategy) ride in the same namespace; the
        // route writes them on the response (`response_headers_to_add` from this metadata).
        let tokens = self.ctx.scheduler.session_tokens(&decision, &candidates);
        let metadata = destination_metadata(&destination, &tokens);
        self.phase = Phase::Routed;
        let mut body = std::mem::take(&mut self.body);
        if rewritten && let Some(edited) = parsers::with_model(&body, target_model) {
            body = edited;
        }
        if self.request_body_mode == FULL_DUPLEX
            && let Some(edit) = parsed.as_ref().and_then(|p| p.usage_edit)
            && let Some(edited) = parsers::with_include_usage(&body, edit)
        {
            // Streaming OpenAI requests report usage only when asked: ask, so token metrics
            // and flow control's token accounting see real counts.
            body = edited;
        }
        // In FULL_DUPLEX_STREAMED mode (and for body-less requests) the destination rides on the
        // request-headers answer and the body follows; in BUFFERED/STREAMED mode Envoy already
        // had its header answer, so the destination rides on the body answer.
        let on_headers = self.request_body_mode == FULL_DUPLEX || !has_body;
        let response = if on_headers {
            Resp::RequestHeaders(HeadersResponse {
                response: Some(common),
            })
        } else {
            Resp::RequestBody(BodyResponse {
                response: Some(common),
            })
        };
        self.send_full(ProcessingResponse {
            response: Some(response),
            dynamic_metadata: Some(metadata),
            ..Default::default()
        })
        .await?;
        if on_headers && has_body {
            self.stream_body_back(body).await?;
        }
        // Record the decision after answering, off the latency path.
        self.ctx.scheduler.pre_request(&req, &decision, &candidates);
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
        self.ctx.metrics.request_error(&labels, r.code);
        self.labels = Some(labels);
        tracing::debug!(request_id = %self.request_id, status = r.status, message = %r.message, "request refused");
        self.phase = Phase::Done;
        self.send(Resp::ImmediateResponse(r.immediate_response()))
            .await
    }

    /// Envoy reports the endpoint that served the request (override-host load balancing with
    /// fallbacks). If it is not the one the routing decision charged, correct what this replica
    /// recorded: the prefix index learns the served pod holds the prompt, the in-flight load
    /// moves there.
    fn on_served(&mut self, served: &str) {
        // The routing stream knows its pick; an observing stream reads it from the request
        // headers the routing filter set.
        let Some(primary) = self.primary.clone().or_else(|| {
            let d = self.headers.get(DESTINATION_HEADER)?;
            d.split(',').next().map(|p| p.trim().to_string())
        }) else {
            return;
        };
        let primary = primary.as_str();
        let corrected = match &self.ctx.scheduler.prefix_index {
            Some(ix) => {
                let candidates = self.ctx.store.candidates(Instant::now());
                ix.served(&self.request_id, primary, served, &candidates)
            }
            None => false,
        };
        if primary != served {
            if let Some(t) = &self.ctx.inflight {
                t.moved(&self.request_id, served);
            }
            tracing::debug!(request_id = %self.request_id, primary, served, corrected, "served by a fallback endpoint");
            self.ctx.metrics.served_by_fallback();
        }
    }

    /// The response has ended: record its duration once.
    fn complete(&mut self) {
        if let Some(l) = &self.labels
            && self.running
        {
            self.ctx
                .metrics
                .request_done(l, self.started.elapsed().as_secs_f64());
        }
        self.finish();
    }

    /// The response ended (or its stream did): settle the in-flight charge once.
    fn settle(&mut self) {
        if self.settles {
            self.settles = false;
            let usage = self.usage.take().and_then(|mut u| u.finish());
            if let (Some(u), Some(info)) = (usage, &self.route_info) {
                let labels = self.ctx.metrics.token_labels(
                    &info.model,
                    &info.target_model,
                    &info.fairness_id,
                    info.priority,
                );
                self.ctx.metrics.usage(&labels, u.input, u.output, u.cached);
            }
            if let Some(t) = &self.ctx.inflight {
                t.finish(&self.request_id);
            }
            self.ctx
                .admission
                .complete(&self.request_id, usage.map(|u| u.input + u.output));
        }
    }

    fn finish(&mut self) {
        // A stream that saw the response but ended without its end (client gone, EPP shutdown):
        // nothing more will come for this request.
        self.settle();
        if self.running {
            self.running = false;
            if let Some(l) = &self.labels {
                self.ctx.metrics.request_running(l, -1);
            }
        }
    }
}

pub(super) fn header(key: &str, value: &str) -> HeaderValueOption {
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

pub(super) fn header_value<'a>(
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

fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
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

/// `metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]`: the endpoint Envoy's
/// load balancer used (GIE protocol v1.0).
fn served_endpoint(md: &envoy_types::pb::envoy::config::core::v3::Metadata) -> Option<String> {
    let lb = md.filter_metadata.get(ENVOY_LB_NAMESPACE)?;
    match &lb.fields.get(SERVED_HEADER)?.kind {
        Some(value::Kind::StringValue(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
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

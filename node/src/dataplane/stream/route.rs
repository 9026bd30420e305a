//! The request's journey once its body is complete (or its headers ended it). Each stage is one
//! call into the room that owns it, handing a typed value to the next:
//!
//! ```text
//! parse_body ─► [identify] ─► Request::resolve ─► [quota] ─► admit ─► candidates ─► schedule ─► record ─► answer
//! (request)     (request:     (request: rewrite,   (request:  (request: (datalayer    (scheduling) (scheduling (reply)
//!  Option<       tenant mode:  metadata — the       Quotas:    Gate)     snapshot ∩    Decision     producers)
//!  ParsedRequest> API key)     tenant's grants)     pre-debit) ticket    subset hint)
//! ```
//! Any stage may refuse: its [`Rejection`] becomes an immediate response and the journey ends.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;

use super::{FULL_DUPLEX, Phase, REQUEST_ID_HEADER, StreamState};
use crate::datalayer::responses::Binding;
use crate::datalayer::store::Candidate;
use crate::dataplane::reply::{
    self, DATA_PARALLEL_HEADER, DESTINATION_HEADER, PREFILLER_HEADER, header,
};
use crate::dataplane::response::{EVICT, RESPONSE_FILTER_HEADER, Restore};
use crate::dataplane::usage::{ROUTE_INFO_HEADER, RouteInfo, new_request_key};
use crate::request::admission::{Admit, AdmitRequest, Ticket, Verdict};
use crate::request::meta::CONTROL_HEADERS;
use crate::request::quota::Admitted;
use crate::request::reject::Rejection;
use crate::request::{self, Request};
use crate::scheduling::scheduler::{Decision, Handler};
use crate::scheduling::{SchedError, SchedRequest};
use crate::telemetry::TARGET;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The routed answer and what the stream keeps of it for the response phase.
struct Answer {
    response: ProcessingResponse,
    /// The destination rides on the request-headers answer (the body follows it).
    on_headers: bool,
    info: RouteInfo,
    primary: Option<String>,
    /// The primary pod's engine streams cumulative usage on every chunk when asked.
    continuous_usage: bool,
}

impl StreamState {
    /// Parse, admit, schedule and answer the request phase (in the routing span, which ends
    /// with the answer).
    pub(super) async fn route(&mut self) -> Result<(), ()> {
        let span = self.open_request_span();
        let routed = self.route_in(&span).await;
        if !span.is_disabled() {
            self.routed_cx = Some(span.context());
        }
        self.span = Span::none();
        routed
    }

    async fn route_in(&mut self, span: &Span) -> Result<(), ()> {
        let ctx = self.ctx.clone();
        let body = self.body_started.then_some(self.body.as_slice());
        let parsed = tracing::info_span!(target: TARGET, parent: span, "epp.parse")
            .in_scope(|| request::parse_body(request::path(&self.headers), body, ctx.passthrough));
        let parsed = match parsed {
            Ok(p) => p,
            Err(r) => return self.reject(r).await,
        };
        // Tenant mode: identified at the request headers.
        let tenant = self.tenant.clone();
        let req = match Request::resolve(
            parsed,
            &self.headers,
            &ctx.objectives.get(),
            &ctx.agent,
            &ctx.rewrites.get(),
            tenant.as_deref(),
        ) {
            Ok(r) => r,
            Err(r) => return self.reject(r).await,
        };
        self.received(&req);
        self.key = new_request_key(ctx.node_id);
        if !span.is_disabled() {
            span.set_attribute("gen_ai.request.model", req.model.clone());
            span.set_attribute("epp.target_model", req.target_model.clone());
            span.set_attribute("epp.priority", req.meta.priority as i64);
            if let Some(t) = &tenant {
                span.set_attribute("epp.tenant", t.name.clone());
            }
        }
        // A tenant's quota comes before flow control and scheduling: its 429 costs no GPU.
        let quota = match (&ctx.quotas, tenant.as_deref()) {
            (Some(q), Some(t)) => {
                let input = req.prompt().estimated_tokens();
                match q
                    .admit(&self.key, t, &req.model, input, req.max_output())
                    .instrument(tracing::info_span!(target: TARGET, parent: span, "epp.quota"))
                    .await
                {
                    Ok(a) => Some(a),
                    Err(r) => return self.reject(r).await,
                }
            }
            _ => None,
        };
        let admission = tracing::info_span!(
            target: TARGET,
            parent: span,
            "epp.admission",
            epp.admission.queued = tracing::field::Empty,
            epp.admission.path = tracing::field::Empty,
            epp.admission.wait_ms = tracing::field::Empty,
        );
        let ticket = match self.admit(&req).instrument(admission).await {
            Ok(Ok(t)) => t,
            Ok(Err(r)) => {
                self.release_quota();
                return self.reject(r).await;
            }
            Err(()) => {
                self.release_quota();
                return Err(());
            }
        };
        // A Responses-API follow-up: where its conversation lives (waiting briefly for a
        // binding still on its way).
        let binding = match req.previous_response_id() {
            Some(id) => Some((
                id,
                ctx.responses
                    .lookup_within(id, crate::datalayer::responses::BINDING_GRACE)
                    .await,
            )),
            None => None,
        };
        let t0 = Instant::now();
        let candidates = self.candidates(binding, t0);
        // Engine tokens, when a token producer with the model's tokenizer is configured.
        let tokens = match &ctx.renderer {
            Some(r) => r.tokens(&req, &self.body, &self.key, &candidates).await,
            None => None,
        };
        // Tenant mode: the client's scheduling controls (SLOs, profile) count for nothing — the
        // tenant's grants hold none.
        let headers = ctx
            .scheduler
            .granted_headers(&self.headers, tenant.is_some());
        let sched = SchedRequest {
            request_id: &self.key,
            model: &req.model,
            target_model: &req.target_model,
            prompt: req.prompt(),
            cache_salt: req.cache_salt(),
            priority: req.meta.priority,
            headers: &headers,
            tokens: tokens.as_deref(),
            media: req.media(),
        };
        let decision = match self.schedule(&sched, &candidates, ticket, t0) {
            Ok(d) => d,
            Err(r) => {
                self.release_quota();
                return self.reject(r).await;
            }
        };
        let answer = self.answer(&req, ticket, &decision, &candidates, quota.as_ref());
        self.route_info = Some(answer.info);
        self.primary = answer.primary;
        self.phase = Phase::Routed;
        // Record the decision (in-flight charge, prefix blocks) before answering: decisions
        // taken meanwhile on other streams must see this one (recorded after the answer and the
        // body streamed back, a burst of long prompts arriving together all saw an idle pool and
        // piled onto the same pods).
        ctx.scheduler.pre_request(&sched, &decision, &candidates);
        let body = std::mem::take(&mut self.body);
        let editable = self.request_body_mode == FULL_DUPLEX;
        // Tenant mode bills a stream the client cuts what was generated: exact when the engine
        // reports usage on every chunk.
        let continuous = quota.is_some() && answer.continuous_usage;
        let max_output = quota.and_then(|q| q.output_budget).filter(|_| editable);
        let body = req.upstream_body(
            body,
            editable,
            continuous,
            max_output,
            ctx.propagate_priority,
        );
        let mut sent = self.send_full(answer.response).await;
        if sent.is_ok() && answer.on_headers && self.body_started {
            sent = self.stream_body_back(body).await;
        }
        self.reservation.release();
        if sent.is_err() {
            // Envoy is gone: the request reaches no pod, its charge goes back.
            if let Some(t) = &ctx.inflight {
                t.finish(&self.key);
            }
            self.release_quota();
        }
        sent
    }

    /// An admitted request goes nowhere: its tenant's quota gets it back.
    fn release_quota(&self) {
        if let Some(q) = &self.ctx.quotas {
            q.release(&self.key);
        }
    }

    /// The request counts from here: its labels, received and running.
    fn received(&mut self, req: &Request) {
        let m = &self.ctx.metrics;
        if req.rewritten() {
            m.model_rewrite(&req.model, &req.target_model);
        }
        let labels = m.request_labels(&req.model, &req.target_model);
        m.request_received(&labels, self.body.len());
        m.request_running(&labels, 1);
        self.running = true;
        self.labels = Some(labels);
    }

    /// Admission: `Ok(Ok(ticket))` goes on (with a flow-control ticket unless the legacy
    /// controller admitted it), `Ok(Err(_))` is refused, `Err(())` means the stream went away
    /// while the request was queued.
    async fn admit(&self, req: &Request) -> Result<Result<Option<Ticket>, Rejection>, ()> {
        let ask = AdmitRequest {
            request_id: &self.key,
            meta: &req.meta,
            bytes: self.body.len() as u64,
            tokens: req.prompt().estimated_tokens(),
            model: &req.model,
            target_model: &req.target_model,
        };
        let asked = Instant::now();
        let admit = self.ctx.gate.clone().admit(ask).await;
        let here = Span::current();
        here.record("epp.admission.queued", matches!(admit, Admit::Queued(_)));
        let pending = match admit {
            Admit::Now(ticket) => return Ok(Ok(ticket)),
            Admit::Refused(r) => return Ok(Err(r)),
            Admit::Queued(pending) => pending,
        };
        // Hold the stream until the verdict; if Envoy goes away meanwhile (the client
        // disconnected) dropping `pending` cancels the queued request.
        let verdict = tokio::select! {
            v = pending.wait() => v,
            _ = self.tx.closed() => return Err(()),
        };
        here.record(
            "epp.admission.wait_ms",
            asked.elapsed().as_secs_f64() * 1000.0,
        );
        Ok(match verdict {
            Verdict::Dispatched(t) => Ok(Some(t)),
            Verdict::Rejected(reason) => Err(Rejection::dropped(reason)),
        })
    }

    /// The datastore's endpoints with their last metrics (the shared snapshot), within the
    /// proxy's subset hint; only the pod holding the conversation for a Responses-API follow-up.
    fn candidates(&self, binding: Option<(&str, Binding)>, now: Instant) -> Arc<Vec<Candidate>> {
        let all = self.ctx.store.snapshot(now);
        let hint = self.subset.as_ref().filter(|_| self.ctx.subset_filter);
        if hint.is_none() && binding.is_none() {
            return all;
        }
        let mut candidates: Vec<Candidate> = match hint {
            // Matched by IP, as llm-d does; an empty hint leaves nothing (503). A long hint
            // (a fleet's worth of IPs) through a set: not pods × hint comparisons.
            Some(allowed) if allowed.len() > 16 => {
                let allowed: foldhash::HashSet<_> = allowed.iter().collect();
                all.iter()
                    .filter(|c| allowed.contains(&c.endpoint.addr.ip()))
                    .cloned()
                    .collect()
            }
            Some(allowed) => all
                .iter()
                .filter(|c| allowed.contains(&c.endpoint.addr.ip()))
                .cloned()
                .collect(),
            None => all.to_vec(),
        };
        if let Some((id, binding)) = binding {
            self.pin_to_response(id, binding, &mut candidates);
        }
        Arc::new(candidates)
    }

    /// A follow-up naming `previous_response_id`: the engine keeps the conversation in the
    /// memory of the pod that stored that response, and any other pod answers 404 — so the pod
    /// is the only candidate while it is in the pool (the same incarnation, among the
    /// candidates). Otherwise the request is scheduled as any other and the outcome counted.
    fn pin_to_response(&self, id: &str, binding: Binding, candidates: &mut Vec<Candidate>) {
        let outcome = match binding {
            Binding::Pod { hostport, epoch } => {
                let alive = candidates.iter().position(|c| {
                    c.endpoint.hostport == hostport
                        && c.sample
                            .as_ref()
                            .and_then(|s| s.metrics.started_ms)
                            .is_none_or(|started| epoch == 0 || started <= epoch)
                });
                match alive {
                    Some(i) => {
                        let pinned = candidates.swap_remove(i);
                        candidates.clear();
                        candidates.push(pinned);
                        "hit"
                    }
                    None => "pod_gone",
                }
            }
            Binding::Expired => "expired",
            Binding::Unknown => "unknown",
        };
        tracing::debug!(request_id = %self.request_id, previous_response_id = id, outcome, "response affinity");
        self.ctx.metrics.response_affinity(outcome);
    }

    /// Run the scheduler; tell admission where an admitted request goes, or give its slot back
    /// when it goes nowhere.
    fn schedule(
        &self,
        sched: &SchedRequest<'_>,
        candidates: &[Candidate],
        ticket: Option<Ticket>,
        t0: Instant,
    ) -> Result<Decision, Rejection> {
        let ctx = &self.ctx;
        let traced = tracing::info_span!(target: TARGET, parent: &self.span, "epp.schedule");
        let decision = if traced.is_disabled() {
            ctx.scheduler.schedule(sched, candidates, &mut rand::rng())
        } else {
            let mut steps = super::trace::StepTimes::new();
            let d = ctx
                .scheduler
                .schedule_traced(sched, candidates, &mut rand::rng(), &mut steps);
            steps.record(&traced);
            traced.set_attribute("epp.candidates", candidates.len() as i64);
            if let Ok(d) = &d {
                super::trace::record_decision(&traced, d, candidates);
            }
            d
        };
        ctx.metrics
            .scheduled(t0.elapsed().as_secs_f64(), decision.is_ok());
        let decision = match decision {
            Ok(d) => d,
            Err(e) => {
                if let Some(t) = ticket {
                    // Admitted but going nowhere: give the slot back.
                    ctx.gate.release(t);
                }
                return Err(match e {
                    SchedError::NoCandidates => Rejection::no_endpoints(),
                    SchedError::AllFiltered => {
                        Rejection::saturated("every endpoint was filtered out")
                    }
                    SchedError::NotAdmitted(by) => Rejection::saturated(format!(
                        "shed by {by}: the pool is saturated and the request is sheddable"
                    )),
                    // llm-d answers 429 too (its scheduler fails); the message says why.
                    SchedError::NoProfile(name) => Rejection::saturated(format!(
                        "no scheduling profile `{name}` (header-profile-handler)"
                    )),
                });
            }
        };
        if let Some(&primary) = decision.picked.first() {
            if let Some(t) = ticket {
                ctx.gate
                    .routed(t, candidates[primary].endpoint.hostport.as_str());
            }
            if let Some(p) = &decision.data.prefix {
                let matched = p.matched.get(primary).copied().unwrap_or(0);
                ctx.metrics
                    .prefix_hit(matched, p.total_blocks, p.block_size);
            }
        }
        Ok(decision)
    }

    /// The routed answer: the destination (+ fallbacks) as header and `envoy.lb` metadata, the
    /// route info the observing stream reads, the response filter's work, the prefill pod, and
    /// the client's control headers removed.
    fn answer(
        &self,
        req: &Request,
        ticket: Option<Ticket>,
        decision: &Decision,
        candidates: &[Candidate],
        quota: Option<&Admitted>,
    ) -> Answer {
        let ctx = &self.ctx;
        let destination = match ctx.scheduler.rank_port {
            // Data-parallel ranks: each pick's pod at its primary port (a pod's ranks share it).
            Some(port) => {
                let mut pods: Vec<String> = Vec::with_capacity(decision.picked.len());
                for i in &decision.picked {
                    let pod = rank_pod(candidates[*i].endpoint.addr, port);
                    if !pods.contains(&pod) {
                        pods.push(pod);
                    }
                }
                pods.join(",")
            }
            None => decision
                .picked
                .iter()
                .map(|i| candidates[*i].endpoint.hostport.as_str())
                .collect::<Vec<_>>()
                .join(","),
        };
        tracing::debug!(request_id = %self.request_id, key = %self.key, %destination, model = %req.model, "routed");
        let primary = decision.picked.first().copied();
        // The pod's request continues the routing span's trace (the observing stream links to it).
        let trace = crate::telemetry::inject(&self.span);
        let info = RouteInfo {
            key: self.key.clone(),
            model: req.model.clone(),
            target_model: req.target_model.clone(),
            fairness_id: req.meta.fairness_id.clone(),
            priority: req.meta.priority,
            cost: primary.and_then(|i| decision.data.predicted.get(i).copied()),
            cached: primary.and_then(|i| {
                let p = decision.data.prefix.as_ref()?;
                let matched = p.matched.get(i).copied()? * p.block_size;
                Some(matched.min(decision.data.prompt_tokens) as u64)
            }),
            trace: trace
                .iter()
                .find(|(k, _)| k == crate::telemetry::TRACEPARENT)
                .map(|(_, v)| v.clone()),
        };
        let mut set_headers = vec![
            header(DESTINATION_HEADER, &destination),
            header(ROUTE_INFO_HEADER, &info.encode()),
        ];
        set_headers.extend(trace.iter().map(|(k, v)| header(k, v)));
        if !self.span.is_disabled() {
            self.span.set_attribute("epp.pod", destination.clone());
            self.span.set_attribute("epp.outcome", "routed");
        }
        // The response filter (see `response`) handles requests flow control may evict and
        // rewritten requests, whose response must show the client's model again.
        let evictable = ticket.is_some() && req.meta.priority < 0 && ctx.gate.evicts();
        let mut response_work = Vec::new();
        if evictable {
            response_work.push(EVICT.to_string());
        }
        if req.rewritten() {
            let r = Restore {
                target: req.target_model.clone(),
                incoming: req.model.clone(),
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
        // The rank the primary port hands the request to.
        let rank = primary
            .filter(|_| ctx.scheduler.rank_port.is_some())
            .map(|i| candidates[i].endpoint.hostport.as_str());
        if let Some(r) = rank {
            set_headers.push(header(DATA_PARALLEL_HEADER, r));
        }
        if matches!(ctx.scheduler.handler, Handler::Disagg { .. }) {
            ctx.metrics.disagg_decision(if prefiller.is_some() {
                "prefill-decode"
            } else {
                "decode-only"
            });
        }
        // Client-supplied control headers are for the EPP, not the model server.
        let remove_headers = CONTROL_HEADERS
            .into_iter()
            .chain(ctx.scheduler.control_headers())
            .chain(prefiller.is_none().then_some(PREFILLER_HEADER))
            .chain(rank.is_none().then_some(DATA_PARALLEL_HEADER))
            .chain(response_work.is_empty().then_some(RESPONSE_FILTER_HEADER))
            .filter(|h| self.headers.contains_key(*h))
            .map(str::to_string)
            .collect();
        // Session tokens (session affinity, encoded strategy) ride in the same namespace; the
        // route writes them on the response (`response_headers_to_add` from this metadata).
        let mut tokens = ctx.scheduler.session_tokens(decision, candidates);
        // The tenant's rate-limit state, which the route writes on the response the same way.
        if let Some(q) = quota {
            tokens.extend(q.headers.iter().cloned());
        }
        // In FULL_DUPLEX_STREAMED mode (and for body-less requests) the destination rides on the
        // request-headers answer and the body follows; in BUFFERED/STREAMED mode Envoy already
        // had its header answer, so the destination rides on the body answer.
        let on_headers = self.request_body_mode == FULL_DUPLEX || !self.body_started;
        Answer {
            response: reply::routed(
                &destination,
                set_headers,
                remove_headers,
                &tokens,
                on_headers,
            ),
            on_headers,
            info,
            primary: primary.map(|i| candidates[i].endpoint.hostport.clone()),
            continuous_usage: primary
                .is_some_and(|i| candidates[i].endpoint.engine.streams_continuous_usage()),
        }
    }
}

/// A data-parallel rank's pod at its primary port.
fn rank_pod(rank: std::net::SocketAddr, port: u16) -> String {
    std::net::SocketAddr::new(rank.ip(), port).to_string()
}

//! The request's spans, when traces are exported (see `crate::telemetry`):
//!
//! ```text
//! epp.request            the routing stream's journey — child of the gateway's span
//! ├─ epp.parse
//! ├─ epp.quota           tenant mode
//! ├─ epp.admission       queued or not, the cluster path (fast / slow / degraded), wait
//! └─ epp.schedule        every filter's and scorer's time, the pick
//! epp.response           the observing stream (whichever replica): TTFT, usage, outcome —
//!                        linked to epp.request (its context rides in the route info)
//! ```
//! The pod's request carries `traceparent` = epp.request, so the model server's spans join the
//! trace. Attribute names follow OpenTelemetry's GenAI conventions where they have one
//! (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, …), `epp.*` otherwise.

use std::collections::HashMap;

use opentelemetry::KeyValue;
use opentelemetry::trace::Status;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::StreamState;
use crate::dataplane::usage::Usage;
use crate::request::reject::Rejection;
use crate::scheduling::scheduler::{Trace, WeightedScorer};
use crate::scheduling::{Filter, RequestData};
use crate::telemetry::{self, TARGET};

/// The gateway's trace context of an ext_proc call: `traceparent`/`tracestate` from its gRPC
/// metadata (Envoy's span for the call), empty when traces are off.
pub fn grpc_context(md: &tonic::metadata::MetadataMap) -> HashMap<String, String> {
    let mut out = HashMap::new();
    if !telemetry::traces_on() {
        return out;
    }
    for key in [telemetry::TRACEPARENT, telemetry::TRACESTATE] {
        if let Some(v) = md.get(key).and_then(|v| v.to_str().ok()) {
            out.insert(key.to_string(), v.to_string());
        }
    }
    out
}

impl StreamState {
    /// Open the routing span (a disabled span when traces are off): a child of the ext_proc
    /// call's trace context, else of the client's `traceparent`.
    pub(super) fn open_request_span(&mut self) -> Span {
        let span = tracing::info_span!(target: TARGET, "epp.request");
        if !span.is_disabled() {
            let parent = if self.trace_parent.contains_key(telemetry::TRACEPARENT) {
                telemetry::extract(&self.trace_parent)
            } else {
                telemetry::extract(&self.headers)
            };
            let _ = span.set_parent(parent);
            span.set_attribute("http.request.id", self.request_id.clone());
            if let Some(p) = self.headers.get(":path") {
                span.set_attribute("url.path", p.clone());
            }
        }
        self.span = span.clone();
        span
    }

    /// The refusal the client gets, on the routing span.
    pub(super) fn span_refused(&self, r: &Rejection) {
        if self.span.is_disabled() {
            return;
        }
        self.span
            .set_attribute("http.response.status_code", r.status as i64);
        self.span
            .set_attribute("epp.outcome", r.reason.unwrap_or(r.code));
        self.span.set_status(Status::error(r.message.clone()));
    }

    /// Open the response span on the first response message (a disabled span when traces are
    /// off): a child of the request's span — ours on the routing stream, the routing stream's
    /// `traceparent` on an observing one — linked to the routing span named in the route info.
    pub(super) fn open_response_span(&mut self, status: Option<&str>) {
        // Only a request this EPP routed has a response to trace (not a refusal's local reply).
        if !self.response_span.is_disabled() || !telemetry::traces_on() || self.route_info.is_none()
        {
            return;
        }
        let span = tracing::info_span!(target: TARGET, "epp.response");
        if span.is_disabled() {
            return;
        }
        let routing = self
            .route_info
            .as_ref()
            .and_then(|i| i.trace.as_deref())
            .and_then(telemetry::span_context);
        if let Some(cx) = &self.routed_cx {
            let _ = span.set_parent(cx.clone());
        } else if self.headers.contains_key(telemetry::TRACEPARENT) {
            let _ = span.set_parent(telemetry::extract(&self.headers));
        }
        if let Some(sc) = routing {
            span.add_link(sc);
        }
        if let Some(s) = status.and_then(|s| s.parse::<i64>().ok()) {
            span.set_attribute("http.response.status_code", s);
        }
        if let Some(info) = &self.route_info {
            span.set_attribute("gen_ai.request.model", info.model.clone());
        }
        if let Some(p) = self.served.as_ref().or(self.primary.as_ref()) {
            span.set_attribute("epp.pod", p.clone());
        }
        self.response_span = span;
    }

    /// Close the response span with what the response took (`epp.ttft_ms`: from this stream's
    /// start — the request's arrival on the routing stream, its forwarding on an observing one —
    /// to the first response bytes).
    pub(super) fn close_response_span(&mut self, usage: Option<Usage>, ended: bool) {
        let span = std::mem::replace(&mut self.response_span, Span::none());
        if span.is_disabled() {
            return;
        }
        if let Some(first) = self.first_byte_at {
            let ttft = first.saturating_duration_since(self.started).as_secs_f64() * 1000.0;
            span.set_attribute("epp.ttft_ms", ttft);
        }
        if let Some(u) = usage {
            span.set_attribute("gen_ai.usage.input_tokens", u.input as i64);
            span.set_attribute("gen_ai.usage.output_tokens", u.output as i64);
            span.set_attribute("epp.usage.cached_tokens", u.cached as i64);
        }
        span.set_attribute(
            "epp.outcome",
            if ended { "completed" } else { "disconnected" },
        );
        if !ended {
            span.set_status(Status::error("the response did not reach its end"));
        }
    }
}

/// Times each step of a scheduling run, for the schedule span.
pub(super) struct StepTimes {
    last: std::time::Instant,
    profile: String,
    attrs: Vec<KeyValue>,
}

impl StepTimes {
    pub(super) fn new() -> Self {
        StepTimes {
            last: std::time::Instant::now(),
            profile: String::new(),
            attrs: Vec::new(),
        }
    }

    fn lap(&mut self) -> i64 {
        let now = std::time::Instant::now();
        let us = now.saturating_duration_since(self.last).as_micros() as i64;
        self.last = now;
        us
    }

    /// Write the times on `span`.
    pub(super) fn record(self, span: &Span) {
        for kv in self.attrs {
            span.set_attribute(kv.key, kv.value);
        }
    }
}

impl Trace for StepTimes {
    fn produced(&mut self, data: &RequestData) {
        let us = self.lap();
        self.attrs.push(KeyValue::new("epp.producers.us", us));
        self.attrs.push(KeyValue::new(
            "epp.prompt_tokens",
            data.prompt_tokens as i64,
        ));
    }

    fn profile(&mut self, profile: &crate::scheduling::scheduler::Profile) {
        self.lap();
        self.profile = profile.name.clone();
    }

    fn filtered(&mut self, filter: &dyn Filter, keep: &[usize]) {
        let us = self.lap();
        let p = &self.profile;
        let t = filter.type_name();
        self.attrs
            .push(KeyValue::new(format!("epp.{p}.filter.{t}.us"), us));
        self.attrs.push(KeyValue::new(
            format!("epp.{p}.filter.{t}.kept"),
            keep.len() as i64,
        ));
    }

    fn scored(&mut self, scorer: &WeightedScorer, _keep: &[usize], _raw: &[f64]) {
        let us = self.lap();
        let key = format!("epp.{}.scorer.{}.us", self.profile, scorer.name);
        self.attrs.push(KeyValue::new(key, us));
    }

    fn picked(&mut self, _picked: &[usize]) {
        let us = self.lap();
        let key = format!("epp.{}.picker.us", self.profile);
        self.attrs.push(KeyValue::new(key, us));
    }
}

/// The pick on the schedule span: the pod, its prefix match and the cost model's prediction.
pub(super) fn record_decision(
    span: &Span,
    d: &crate::scheduling::scheduler::Decision,
    candidates: &[crate::datalayer::store::Candidate],
) {
    let Some(&i) = d.picked.first() else {
        return;
    };
    span.set_attribute("epp.pod", candidates[i].endpoint.hostport.clone());
    span.set_attribute("epp.score", d.scores.get(i).copied().unwrap_or(0.0));
    if let Some(p) = &d.data.prefix {
        span.set_attribute(
            "epp.prefix.matched_blocks",
            p.matched.get(i).copied().unwrap_or(0) as i64,
        );
        span.set_attribute("epp.prefix.total_blocks", p.total_blocks as i64);
    }
    if let Some(p) = d.data.predicted.get(i) {
        span.set_attribute("epp.predicted_ttft_ms", p.ttft_ms);
    }
    if let Some(p) = d.prefill {
        span.set_attribute("epp.prefill_pod", candidates[p].endpoint.hostport.clone());
    }
}

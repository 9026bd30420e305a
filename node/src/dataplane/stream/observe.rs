//! The response phase of the routing and observing streams: pass the response through (or only
//! observe it), scan it for usage, correct the record when a fallback endpoint served it, and
//! settle — the in-flight charge, the flow-control slot and the token metrics — once it ends.

use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HeadersResponse, HttpBody, HttpHeaders, TrailersResponse,
};
use envoy_types::pb::google::protobuf::value;

use super::{FULL_DUPLEX, Phase, StreamState};
use crate::dataplane::reply::{
    DATA_PARALLEL_HEADER, DESTINATION_HEADER, ENVOY_LB_NAMESPACE, header_value, streamed_body,
};
use crate::dataplane::usage::{ROUTE_INFO_HEADER, RouteInfo, Usage, UsageScanner};
use crate::request::quota::Reported;
use crate::scheduling::Observation;

/// The endpoint that served the request, as the proxy reports it in `envoy.lb` metadata.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";

/// `metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]`: the endpoint Envoy's
/// load balancer used (GIE protocol v1.0).
pub(super) fn served_endpoint(md: &Metadata) -> Option<String> {
    let lb = md.filter_metadata.get(ENVOY_LB_NAMESPACE)?;
    match &lb.fields.get(SERVED_HEADER)?.kind {
        Some(value::Kind::StringValue(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
    }
}

impl StreamState {
    /// An observing stream learns the routing stream's decision from the route info in the
    /// request headers (the routing filter set it). A routing stream never does: the request
    /// headers it saw are the client's, and the client's route info means nothing.
    fn learn_route(&mut self) {
        if self.route_info.is_some() || !self.observability {
            return;
        }
        self.route_info = self
            .headers
            .get(ROUTE_INFO_HEADER)
            .and_then(|v| RouteInfo::decode(v));
        if let Some(info) = &self.route_info {
            self.key = info.key.clone();
        }
    }

    pub(super) async fn on_response_headers(&mut self, h: HttpHeaders) -> Result<(), ()> {
        self.settles = true;
        self.learn_route();
        self.open_response_span(header_value(h.headers.as_ref(), ":status").as_deref());
        if self.route_info.is_some() {
            let ct = header_value(h.headers.as_ref(), "content-type");
            self.usage = Some(UsageScanner::new(ct.as_deref()));
        }
        if h.end_of_stream {
            self.settle(true);
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

    pub(super) async fn on_response_body(&mut self, b: HttpBody) -> Result<(), ()> {
        let eos = b.end_of_stream;
        self.settles = true;
        let streamed_id = self.usage.as_mut().and_then(|u| {
            u.feed(&b.body);
            u.response_id().filter(|_| u.is_sse()).map(String::from)
        });
        if let Some(id) = streamed_id.filter(|_| !self.response_bound) {
            // A stream names its response in its first event: bound at once, the follow-up
            // may come as soon as the client has read the end.
            self.bind_response(&id);
        }
        if self.first_byte_at.is_none() && !b.body.is_empty() {
            // Prefill is over once bytes flow: release the prompt tokens.
            self.first_byte_at = Some(Instant::now());
            if let Some(t) = self.ctx.inflight.as_ref().filter(|_| !self.key.is_empty()) {
                t.release_tokens(&self.key);
            }
        }
        if eos {
            self.settle(true);
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

    pub(super) async fn on_response_trailers(&mut self) -> Result<(), ()> {
        self.settles = true;
        self.settle(true);
        self.complete();
        if self.phase == Phase::Done || self.observability {
            return Ok(());
        }
        self.send(Resp::ResponseTrailers(TrailersResponse::default()))
            .await
    }

    /// Envoy reports the endpoint that served the request (override-host load balancing with
    /// fallbacks). If it is not the one the routing decision charged, correct what this replica
    /// recorded: the prefix index learns the served pod holds the prompt, the in-flight load
    /// moves there.
    pub(super) fn on_served(&mut self, served: &str) {
        self.learn_route();
        if self.key.is_empty() {
            return; // not a request this EPP routed
        }
        // The routing stream knows its pick; an observing stream reads it from the request
        // headers the routing filter set.
        let Some(primary) = self.primary.clone().or_else(|| self.routed_primary()) else {
            return;
        };
        // Data-parallel ranks: Envoy reports the pod's primary port; the rank is the one the
        // request was for when the pod is the primary's.
        let served = match self.ctx.scheduler.rank_port {
            Some(port) => same_pod(served, &primary, port).unwrap_or(served),
            None => served,
        };
        self.served = Some(served.to_string());
        let primary = primary.as_str();
        let corrected = match &self.ctx.scheduler.prefix_index {
            Some(ix) => {
                let target = self.ctx.store.candidate(served, Instant::now());
                ix.served(&self.key, primary, served, target.as_slice())
            }
            None => false,
        };
        if primary != served {
            if let Some(t) = &self.ctx.inflight {
                t.moved(&self.key, served);
            }
            tracing::debug!(request_id = %self.request_id, primary, served, corrected, "served by a fallback endpoint");
            self.ctx.metrics.served_by_fallback();
        }
    }

    /// The response has ended: record its duration once.
    pub(super) fn complete(&mut self) {
        if let Some(l) = &self.labels
            && self.running
        {
            self.ctx
                .metrics
                .request_done(l, self.started.elapsed().as_secs_f64());
        }
        self.finish();
    }

    /// The response ended (`ended`), or its stream did: settle the in-flight charge once. Only a
    /// response seen to its end teaches the scheduler what it took.
    fn settle(&mut self, ended: bool) {
        if self.settles {
            self.settles = false;
            let streamed = self.usage.as_ref().is_some_and(UsageScanner::is_sse);
            let events = self.usage.as_ref().map_or(0, UsageScanner::events);
            let mut scanner = self.usage.take();
            let usage = scanner.as_mut().and_then(UsageScanner::finish);
            if ended {
                self.observed(usage, streamed);
                if let Some(id) = scanner.as_ref().and_then(UsageScanner::response_id)
                    && !self.response_bound
                {
                    self.bind_response(id);
                }
            }
            self.close_response_span(usage, ended);
            if let (Some(u), Some(info)) = (usage, &self.route_info) {
                let labels = self.ctx.metrics.token_labels(
                    &info.model,
                    &info.target_model,
                    &info.fairness_id,
                    info.priority,
                );
                self.ctx.metrics.usage(&labels, u.input, u.output, u.cached);
            }
            if self.key.is_empty() {
                return; // nothing of ours to settle
            }
            if let Some(q) = &self.ctx.quotas {
                q.settle(
                    &self.key,
                    Reported {
                        input: usage.map(|u| u.input),
                        output: usage.map(|u| u.output),
                        cached: usage.map_or(0, |u| u.cached),
                        events,
                        ended,
                    },
                );
            }
            let tokens = usage.map(|u| u.input + u.output);
            let held = self
                .ctx
                .inflight
                .as_ref()
                .is_some_and(|t| t.finish(&self.key));
            let slot = self.ctx.gate.complete(&self.key, tokens);
            if !held
                && !slot
                && let Some(relay) = &self.ctx.relay
            {
                // Routed (and charged) by another replica: tell the peers.
                if relay.try_send((self.key.clone(), tokens)).is_err() {
                    self.ctx.metrics.gossip.dropped_batch();
                }
            }
        }
    }

    /// The pod that served the response: as Envoy reported it, else the routing decision's
    /// primary (this stream's, or the one the routing filter wrote in the request headers).
    fn serving_pod(&self) -> Option<String> {
        self.served
            .clone()
            .or_else(|| self.primary.clone())
            .or_else(|| self.routed_primary())
    }

    /// The routing decision's primary as the routing filter wrote it in the request headers:
    /// the data-parallel rank, else the first destination.
    fn routed_primary(&self) -> Option<String> {
        if self.ctx.scheduler.rank_port.is_some()
            && let Some(rank) = self.headers.get(DATA_PARALLEL_HEADER)
        {
            return Some(rank.trim().to_string());
        }
        let d = self.headers.get(DESTINATION_HEADER)?;
        d.split(',').next().map(|p| p.trim().to_string())
    }

    /// A Responses-API response was stored on the pod that served it: bind its id there (every
    /// replica learns it through the gossip), so a follow-up naming it goes back.
    fn bind_response(&mut self, id: &str) {
        self.response_bound = true;
        let Some(pod) = self.serving_pod() else {
            return;
        };
        let endpoints = self.ctx.store.endpoints();
        if let Some(ep) = endpoints.iter().find(|e| e.hostport == pod) {
            self.ctx.responses.bind(id, ep);
        }
    }

    /// Tell the scheduler what the response took (producers that learn from outcomes).
    fn observed(&self, usage: Option<Usage>, streamed: bool) {
        // Only complete responses of routed requests teach anything.
        let (Some(info), Some(first)) = (&self.route_info, self.first_byte_at) else {
            return;
        };
        let Some(pod) = self.serving_pod() else {
            return;
        };
        if let (Some(predicted), Some(u)) = (info.cached, usage) {
            self.ctx
                .metrics
                .kv_events
                .cached_prediction(predicted, u.cached);
        }
        let ms = |t: Instant| t.saturating_duration_since(self.started).as_secs_f64() * 1000.0;
        self.ctx.scheduler.observed(&Observation {
            pod: &pod,
            ttft_ms: streamed.then(|| ms(first)),
            e2e_ms: ms(Instant::now()),
            prompt_tokens: usage.map(|u| u.input),
            cached_tokens: usage.map(|u| u.cached),
            output_tokens: usage.map(|u| u.output),
            predicted: info.cost,
        });
    }

    pub(super) fn finish(&mut self) {
        // A stream that saw the response but ended without its end (client gone, EPP shutdown):
        // nothing more will come for this request.
        self.settle(false);
        if self.running {
            self.running = false;
            if let Some(l) = &self.labels {
                self.ctx.metrics.request_running(l, -1);
            }
        }
    }
}

/// `rank` when `served` is its pod's primary port (`ip:port` with the rank's IP).
fn same_pod<'a>(served: &str, rank: &'a str, port: u16) -> Option<&'a str> {
    let served: std::net::SocketAddr = served.parse().ok()?;
    let r: std::net::SocketAddr = rank.parse().ok()?;
    (served.port() == port && served.ip() == r.ip()).then_some(rank)
}

#[cfg(test)]
mod tests {
    use super::same_pod;

    #[test]
    fn a_primary_port_maps_back_to_the_rank_on_the_same_pod() {
        assert_eq!(
            same_pod("10.0.0.1:8000", "10.0.0.1:8002", 8000),
            Some("10.0.0.1:8002")
        );
        assert_eq!(same_pod("10.0.0.2:8000", "10.0.0.1:8002", 8000), None);
        assert_eq!(same_pod("10.0.0.1:8001", "10.0.0.1:8002", 8000), None);
        assert_eq!(same_pod("garbage", "10.0.0.1:8002", 8000), None);
    }
}

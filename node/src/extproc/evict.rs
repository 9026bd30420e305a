//! The eviction stream: how flow control aborts an in-flight sheddable request.
//!
//! The routing filter answers the request phase only, and responses are merely observed, so that
//! a dying EPP replica never cuts a response (I9). Nothing on that path can stop a request once it
//! is forwarded. With `flowControl.enableEviction`, the routing stream marks sheddable requests
//! (priority < 0) with [`EVICTABLE_HEADER`]; Envoy's route for that header enables a third ext_proc
//! filter (the eviction filter, gRPC initial metadata [`ROLE_METADATA`]` = evict`) whose stream
//! stays open for the life of the request. Here that stream attaches to the request's in-flight
//! entry (only then does flow control count the request as evictable) and waits. When flow
//! control evicts it, the stream sends an immediate response — 429, `x-llm-d-request-dropped-reason:
//! evicted` — which Envoy delivers to the client (or, once response bytes have flowed, turns into a
//! reset) while resetting the upstream request, so the model server stops working on it.
//!
//! The price, documented in the operations guide: evictable requests depend on the replica that
//! holds their eviction stream, so they give up I9.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::{mpsc, oneshot};
use tonic::{Status, Streaming};

use super::PickerContext;
use super::reject::Rejection;

/// Request header the routing stream sets on requests flow control may evict (Envoy's route for
/// it enables the eviction filter; the route removes it before the model server).
pub const EVICTABLE_HEADER: &str = "x-llm-d-evictable";
/// gRPC initial metadata naming the ext_proc filter a stream belongs to (`evict`; absent for the
/// routing and observing filters).
pub const ROLE_METADATA: &str = "x-llm-d-ext-proc-role";

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Serve one eviction stream until the request ends or is evicted.
pub async fn run(ctx: Arc<PickerContext>, mut inbound: Streaming<ProcessingRequest>, tx: Tx) {
    let request_id = loop {
        match inbound.message().await {
            Ok(Some(ProcessingRequest {
                request: Some(Req::RequestHeaders(h)),
                ..
            })) => {
                let id = super::stream::header_value(h.headers.as_ref(), "x-request-id");
                break id.map(|v| v.into_owned()).unwrap_or_default();
            }
            Ok(Some(_)) => continue,
            _ => return,
        }
    };
    let Some(evicted) = ctx.admission.attach_evictor(&request_id) else {
        // Not an evictable request of this replica (another replica admitted it, or it already
        // ended): let it through and close our side — Envoy then proceeds without us.
        tracing::debug!(%request_id, "eviction stream for a request not evictable here");
        let _ = send(&tx, Resp::RequestHeaders(HeadersResponse::default())).await;
        return;
    };
    if !hold(&ctx, &mut inbound, &tx, &request_id, evicted).await {
        // The stream ended without an eviction (the response is over, or Envoy gave up on us):
        // the request can no longer be aborted, so flow control must stop counting on it.
        ctx.admission.detach_evictor(&request_id);
    }
}

/// Answer the request's remaining ext_proc messages until it ends; true if it was evicted.
async fn hold(
    ctx: &PickerContext,
    inbound: &mut Streaming<ProcessingRequest>,
    tx: &Tx,
    request_id: &str,
    mut evicted: oneshot::Receiver<()>,
) -> bool {
    if send(tx, Resp::RequestHeaders(HeadersResponse::default()))
        .await
        .is_err()
    {
        return false;
    }
    loop {
        tokio::select! {
            fired = &mut evicted => {
                if fired.is_ok() {
                    evict(ctx, tx, request_id).await;
                    return true;
                }
                // The request ended on its own.
                return false;
            }
            msg = inbound.message() => {
                // Envoy keeps this stream open only while a phase is pending: the response
                // headers, then every response body chunk (answered at once, unchanged).
                let answer = match msg {
                    Ok(Some(ProcessingRequest { request: Some(Req::ResponseHeaders(_)), .. })) => {
                        Resp::ResponseHeaders(HeadersResponse::default())
                    }
                    Ok(Some(ProcessingRequest { request: Some(Req::ResponseBody(_)), .. })) => {
                        Resp::ResponseBody(BodyResponse::default())
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => return false,
                };
                if send(tx, answer).await.is_err() {
                    return false;
                }
            }
        }
    }
}

async fn evict(ctx: &PickerContext, tx: &Tx, request_id: &str) {
    tracing::info!(%request_id, "request evicted by flow control");
    let r = Rejection::dropped(flowctl::DropReason::Evicted);
    let labels = ctx.metrics.request_labels("", "");
    ctx.metrics.request_error(&labels, r.code);
    let _ = send(tx, Resp::ImmediateResponse(r.immediate_response())).await;
}

async fn send(tx: &Tx, resp: Resp) -> Result<(), ()> {
    tx.send(Ok(ProcessingResponse {
        response: Some(resp),
        ..Default::default()
    }))
    .await
    .map_err(|_| ())
}

/// Whether a stream belongs to the eviction filter.
pub fn is_eviction_stream(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata
        .get(ROLE_METADATA)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "evict")
}

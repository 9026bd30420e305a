//! The data plane: Envoy's ext_proc gRPC service, one bidirectional stream per HTTP request — where
//! a request enters the EPP and where its answer and its settlement leave.
//!
//! - `stream`: the per-stream state machine — headers kept, body buffered to end of stream
//!   (bounded; over the cap → 413); its `route` part is the request's journey once the body is
//!   complete (parse → resolve → admit → candidates → schedule → answer → record, each stage one
//!   call into its room), its `observe` part the response phase of the routing and observing
//!   streams (usage scanning, the served-endpoint correction, settlement of the in-flight charge
//!   and the flow-control slot);
//! - [`reply`]: the wire shapes — the routed answer (destination header + `envoy.lb` dynamic
//!   metadata, the body streamed back in ≤ 62000-byte chunks), immediate responses;
//! - [`response`]: the response filter (eviction, model restore) for the few requests that need it;
//! - [`subset`] and [`usage`]: the proxy's subset hint, and usage parsing of responses.
//!
//! `FULL_DUPLEX_STREAMED` is the main mode; `BUFFERED`/`STREAMED` are also understood (the
//! destination then rides on the body response). Response phase: passed through untouched, or
//! only observed when Envoy runs the filter in `observability_mode` (the split data plane of
//! `deploy/local/envoy.yaml`, which keeps responses alive when a replica dies).

mod budget;
mod context;
pub mod explain;
pub mod reply;
pub mod response;
mod stream;
pub mod subset;
pub mod usage;

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub use reply::{DESTINATION_HEADER, ENVOY_LB_NAMESPACE};

pub use budget::BodyBudget;
pub use context::PickerContext;

#[derive(Debug, Clone)]
pub struct ExtProcService {
    ctx: Arc<PickerContext>,
}

impl ExtProcService {
    pub fn new(ctx: Arc<PickerContext>) -> Self {
        ExtProcService { ctx }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = futures::stream::Map<
        ReceiverStream<Box<ProcessingResponse>>,
        fn(Box<ProcessingResponse>) -> Result<ProcessingResponse, Status>,
    >;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let response = response::is_response_stream(request.metadata());
        let trace_parent = stream::trace::grpc_context(request.metadata());
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let ctx = self.ctx.clone();
        // The task lives exactly as long as the stream: it ends when Envoy closes its side or
        // stops reading ours.
        if response {
            tokio::spawn(response::run(ctx, inbound, tx));
        } else {
            tokio::spawn(stream::run(ctx, inbound, tx, trace_parent));
        }
        Ok(Response::new(futures::StreamExt::map(
            ReceiverStream::new(rx),
            reply::unbox as fn(_) -> _,
        )))
    }
}

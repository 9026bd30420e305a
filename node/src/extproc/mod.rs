//! The ext_proc gRPC service: one bidirectional stream per HTTP request.
//!
//! Request phase (routing filter, `FULL_DUPLEX_STREAMED`): keep the headers, buffer body chunks to
//! end of stream (bounded; over the cap → 413), parse with the parser chosen by path, schedule, then
//! answer with the request-headers response (destination header + `envoy.lb` dynamic metadata) and
//! stream the body back in ≤ 62000-byte chunks. `BUFFERED`/`STREAMED` modes are also understood (the
//! destination then rides on the body response). Response phase: passed through untouched, or only
//! observed when Envoy runs the filter in `observability_mode` (the split data plane of
//! `deploy/local/envoy.yaml`, which keeps responses alive when a replica dies).

mod reject;
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

pub use reject::{DROPPED_REASON_HEADER, Rejection};
pub use stream::{DESTINATION_HEADER, ENVOY_LB_NAMESPACE};

use crate::admission::{Admission, Objectives};
use crate::datalayer::Datastore;
use crate::metrics::Metrics;
use crate::plugins::Scheduler;

/// Everything a stream needs, shared by all streams.
#[derive(Debug)]
pub struct PickerContext {
    pub store: Arc<Datastore>,
    pub scheduler: Scheduler,
    /// The in-flight ledger the response path settles into (when a plugin uses one).
    pub inflight: Option<Arc<crate::plugins::inflight::InflightTracker>>,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    /// `passthrough-parser` configured: unknown paths are routed instead of refused.
    pub passthrough: bool,
    pub draining: std::sync::atomic::AtomicBool,
    /// Legacy admission or flow control.
    pub admission: Admission,
    /// `InferenceObjective` name → priority.
    pub objectives: Objectives,
    /// Cluster mode: this replica's Raft membership.
    pub cluster: Option<Arc<crate::cluster::ClusterMember>>,
    /// Honour the proxy's subset hint (`--disable-endpoint-subset-filter` turns it off).
    pub subset_filter: bool,
    /// `InferenceModelRewrite` rules (`--model-rewrites-file`).
    pub rewrites: crate::rewrite::ModelRewrites,
}

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
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let response = response::is_response_stream(request.metadata());
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let ctx = self.ctx.clone();
        // The task lives exactly as long as the stream: it ends when Envoy closes its side or
        // stops reading ours.
        if response {
            tokio::spawn(response::run(ctx, inbound, tx));
        } else {
            tokio::spawn(stream::run(ctx, inbound, tx));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

//! What every stream shares: the rooms a request passes through, as this replica built them.

use std::sync::Arc;

use crate::datalayer::Datastore;
use crate::datalayer::inflight::InflightTracker;
use crate::metrics::Metrics;
use crate::request::Live;
use crate::request::admission::Gate;
use crate::request::meta::Objectives;
use crate::request::rewrite::ModelRewrites;
use crate::scheduling::Scheduler;

/// Everything a stream needs, shared by all streams.
#[derive(Debug)]
pub struct PickerContext {
    pub store: Arc<Datastore>,
    pub scheduler: Scheduler,
    /// The in-flight ledger the response path settles into (when a plugin uses one).
    pub inflight: Option<Arc<InflightTracker>>,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    /// What all streams together may buffer of request bodies (`--max-buffered-body-bytes`).
    pub body_budget: Arc<super::budget::BodyBudget>,
    /// `passthrough-parser` configured: unknown paths are routed instead of refused.
    pub passthrough: bool,
    /// `requestHandler.propagatePriority`: the forwarded body carries the request's priority.
    pub propagate_priority: bool,
    pub draining: std::sync::atomic::AtomicBool,
    /// Legacy admission, flow control on this replica, or cluster-wide flow control.
    pub gate: Arc<dyn Gate>,
    /// `InferenceObjective` name → priority (`--objectives-file`, or watched from Kubernetes).
    pub objectives: Arc<Live<Objectives>>,
    /// Where an agent's session id is read (`agent-identity`): the fairness id of a request that
    /// names none.
    pub agent: crate::request::meta::AgentIdentity,
    /// Honour the proxy's subset hint (`--disable-endpoint-subset-filter` turns it off).
    pub subset_filter: bool,
    /// Which pod holds each stored Responses-API response: a follow-up naming it goes there.
    pub responses: Arc<crate::datalayer::responses::ResponseBindings>,
    /// `InferenceModelRewrite` rules (`--model-rewrites-file`, or watched from Kubernetes).
    pub rewrites: Arc<Live<ModelRewrites>>,
    /// Cluster mode: where the settlements of requests this replica observed but did not hold go
    /// (the replica that made the key; `cluster::settle`). With cluster-wide flow control the
    /// gate hands them over itself.
    pub relay: Option<tokio::sync::mpsc::Sender<(String, Option<u64>)>>,
    /// This replica's node id in cluster mode: its request keys name it, so a response observed
    /// on another replica is relayed here only.
    pub node_id: Option<u64>,
    /// Tenant mode (`--tenants-file`): identity, grants and quotas.
    pub quotas: Option<Arc<crate::request::quota::Quotas>>,
    /// The `vllm_http` token producer: engine tokens for each request before scheduling.
    pub renderer: Option<crate::request::tokens::Renderer>,
}

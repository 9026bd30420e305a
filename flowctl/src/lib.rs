//! Flow control for the endpoint picker, as a pure, deterministic state machine.
//!
//! `flowctl` owns the *semantics* of llm-d's flow control: which request is admitted (dispatched)
//! when, which waits, and which is turned away with which HTTP status and
//! `x-llm-d-request-dropped-reason`. It has no clock, no IO, no async runtime and no randomness:
//! time is an argument of every call and all state lives in one serializable value, so the
//! `consensus` crate can replicate the command log through Raft and snapshot the state, and every
//! replica computes the same outcomes. The `node` crate is the shell: it turns an ext_proc request
//! into a [`Command::Enqueue`], holds the stream until it sees [`Outcome::Dispatched`] (or answers
//! with [`DropReason::http`]), and feeds completions, cancellations, pool metrics and ticks.
//!
//! # Layout
//!
//! * [`cluster`] — the replicated cluster state: member liveness leases (heartbeats through Raft)
//!   and, when configured, the [`global`] flow state.
//! * [`global`] — cluster-wide flow control: one global queue and in-flight ledger for all
//!   replicas, local credit for the unsaturated fast path, lease-based reclamation.
//! * [`config`] — llm-d's `flowControl` YAML section ([`FlowControlConfig`], strict decoding with
//!   key paths, llm-d's defaults) and its resolution into the plain [`ControllerConfig`].
//! * [`units`] — Kubernetes quantities (`1Gi`, `1k`) and Go durations (`1m30s`); [`Nanos`].
//! * [`policy`] — fairness (`global-strict`, `round-robin`, `weighted`), ordering (`fcfs`, `edf`,
//!   `slo-deadline`) and usage-limit (`static`) plugins with their typed parameters.
//! * [`saturation`] — the `utilization-detector` and `concurrency-detector` as pure functions over
//!   endpoint snapshots / in-flight counts (also usable as scheduling filters).
//! * [`machine`] — [`FlowController`]: bands, flows, queues, the in-flight ledger, dispatch,
//!   expiry, eviction, and read-only views for metrics.
//! * [`quota`] — tenant quotas: per tenant × model request and token buckets and concurrency,
//!   pre-debit at admission, settlement on usage, the usage ledger ([`quota::QuotaBook`]).
//! * [`outcome`] — [`DropReason`] → (HTTP status, dropped-reason header) as llm-d maps them, and the
//!   legacy admission controller ([`legacy_admission`]) used when the `flowControl` gate is off.
//!
//! # Data flow
//!
//! ```text
//!  YAML flowControl ─► FlowControlConfig ─resolve(plugins)─► ControllerConfig ─► FlowController::new
//!
//!  (now, Command) ─► FlowController::apply ─► Vec<Outcome>
//!     Enqueue / Cancel / Complete / Tick / ObservePool / SetSaturation / Shutdown
//!        1. expire queued requests past their TTL (or noEndpointRequestTTL on an empty pool)
//!        2. apply the command (caps checked at enqueue: rejected-saturated)
//!        3. dispatch while saturation < usage limit: highest band → fairness picks a flow →
//!           ordering picks the request; optionally evict in-flight sheddable requests
//!     Outcomes: Dispatched | Rejected{reason} | Evicted{reason} | Ignored
//! ```
//!
//! Same configuration + same command log ⇒ same outcomes and byte-identical serialized state.

pub mod cluster;
pub mod config;
pub mod global;
pub mod machine;
pub mod outcome;
pub mod policy;
pub mod quota;
pub mod saturation;
pub mod units;

pub use config::{
    BandConfig, BandSettings, ConfigError, ControllerConfig, DEFAULT_DEMAND_RESERVE, DemandReserve,
    EvictionConfig, FlowControlConfig, PluginDecl, STRICT_BAND_SELECTION,
};
pub use machine::{
    BandStats, Command, EnqueueRequest, FlowController, FlowKey, FlowStats, IgnoredReason,
    NO_DEADLINE, Outcome, RequestId, Totals,
};
pub use outcome::{
    DROPPED_REASON_HEADER, DropReason, DropResponse, LegacyAdmission, legacy_admission,
};
pub use policy::{
    BandPosition, Charge, FairnessPolicy, HoldbackDomain, HoldbackShape, OrderingPolicy,
    PriorityHoldbackParams, ProgramAwareParams, StaticUsageLimitParams, UsageLimit,
    WeightedFairnessParams,
};
pub use policy::{
    EDF_ORDERING, FCFS_ORDERING, GLOBAL_STRICT_FAIRNESS, PRIORITY_HOLDBACK,
    PRIORITY_THEN_TIME_EVICTION_ORDER, PROGRAM_AWARE_FAIRNESS, ROUND_ROBIN_FAIRNESS,
    SHEDDABLE_EVICTION_FILTER, SLO_DEADLINE_ORDERING, SOFT_REFLECTIVE_CEILING, STATIC_USAGE_LIMIT,
    WEIGHTED_FAIRNESS,
};
pub use saturation::{CONCURRENCY_DETECTOR, UTILIZATION_DETECTOR};
pub use saturation::{
    ConcurrencyDetector, ConcurrencyMode, EndpointLoad, EndpointSnapshot, SaturationDetector,
    UtilizationDetector,
};
pub use units::{GoDuration, Nanos, Quantity, UnitError};

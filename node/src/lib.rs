//! `node`: the `epp` binary's library — the request path and the process around it.
//!
//! This crate is the only composer in the workspace: it wires configuration, the data layer,
//! admission, scheduling plugins, the cluster and the ext_proc server into a running replica.
//!
//! # Layout: one room per stage of a request's journey
//! - [`dataplane`]: Envoy's ext_proc service — where a request enters (headers, buffered body),
//!   where its answer leaves (destination header + `envoy.lb` metadata, the body streamed back)
//!   and where its response is observed and settled;
//! - [`request`]: parse the body, resolve the target model (rewrite) and the request's metadata
//!   (fairness id, objective → priority), and admit it through a [`request::admission::Gate`]
//!   (legacy controller, or flow control on this replica);
//! - [`scheduling`]: plugins (producers, filters, scorers, pickers), profiles and the registry
//!   that builds them from an `EndpointPickerConfig`;
//! - [`datalayer`]: the pods — discovery, `/metrics` scrapers, the datastore the request path
//!   reads, sharded collection, and the in-flight ledger;
//! - [`k8s`]: Kubernetes — the pool's pods from its `InferencePool` (feeding the data layer's
//!   endpoint set) and the custom resources' types;
//! - [`cluster`]: what replicas share — Raft membership, cluster-wide flow control (a `Gate`),
//!   prefix-index gossip and the scrape fan-out;
//! - [`config`]: the llm-d `EndpointPickerConfig` YAML, decoded strictly;
//! - [`metrics`]: the `llm_d_epp_*` Prometheus registry;
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/debug/...`;
//! - [`serve`]: start-up (validate, then bind), wiring, drain and shutdown;
//! - [`telemetry`]: logs (rate-limited where libraries are noisy) and OpenTelemetry traces.
//!
//! # The journey of one request
//! ```text
//! dataplane ─► request ─────────────────────► scheduling ─────► dataplane ──────► dataplane
//!  headers,    parse → resolve → admit (Gate)   producers,        reply: the        response observed:
//!  body        ParsedRequest   Request  ticket  filters, scorers, destination,      usage, served
//!                                               picker: Decision  body back         endpoint → settle
//! ```
//! Data flows one way. A lower room never calls a higher one: the cluster room plugs into the
//! others through small traits and feeds they own — it implements the request room's `Gate`, it
//! receives the prefix producer's deltas through scheduling's `DeltaSink`, and it publishes the
//! other replicas' load into the data layer's in-flight ledger through a `RemoteLoadFeed` that
//! the ledger reads. `node/tests/it/rooms.rs` checks that no two modules import each other, directly
//! or through others.

pub mod admin;
pub mod cluster;
pub mod config;
pub mod datalayer;
pub mod dataplane;
pub mod k8s;
pub mod metrics;
pub mod request;
pub mod scheduling;
pub mod serve;
pub mod telemetry;

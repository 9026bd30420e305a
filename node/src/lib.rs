//! `node`: the `epp` binary's library — the request path and the process around it.
//!
//! This crate is the only composer in the workspace: it wires configuration, the data layer,
//! scheduling plugins and the ext_proc server into a running replica.
//!
//! # Layout
//! - [`config`]: the llm-d `EndpointPickerConfig` YAML, decoded strictly;
//! - [`plugins`]: scorers, pickers, the profile runner and the registry keyed by llm-d type names;
//! - [`datalayer`]: endpoints from discovery, and the `/metrics` scrapers that keep their state fresh;
//! - [`parsers`]: request-body parsers chosen by path (OpenAI, Anthropic, vLLM);
//! - [`extproc`]: the Envoy ext_proc service, one state machine per stream;
//! - [`admission`]: request metadata (fairness id, objective → priority), llm-d's legacy admission
//!   and flow control (the ext_proc stream waits while its request is queued);
//! - [`cluster`]: cluster mode — this replica as a Raft member (`consensus`) replicating
//!   `flowctl`'s cluster state (liveness leases), `/debug/cluster`, membership operations;
//! - [`gossip`]: cluster mode — the prefix index replicated between replicas (CRDT deltas and
//!   anti-entropy on the peer port);
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/debug/cluster`;
//! - [`metrics`]: the `llm_d_epp_*` Prometheus registry;
//! - [`serve`]: start-up (validate, then bind), drain and shutdown.
//!
//! # Data flow for one request
//! Envoy opens a stream → headers kept → body buffered to end of stream → parsed → admitted
//! (legacy check, or queued by flow control until dispatched) → the datastore
//! snapshot gives candidates with their last metrics → scorers × weights → picker → the answer
//! carries `x-gateway-destination-endpoint` as a header and as `envoy.lb` dynamic metadata, and the
//! body is streamed back unchanged.

pub mod admin;
pub mod admission;
pub mod cluster;
pub mod config;
pub mod datalayer;
pub mod extproc;
pub mod global_gate;
pub mod gossip;
pub mod metrics;
pub mod parsers;
pub mod plugins;
pub mod rewrite;
pub mod serve;

//! Raft consensus core for the replicated flow-control state.
//!
//! This crate replicates any deterministic [`StateMachine`] across the EPP replicas with
//! [openraft] 0.9: the log, vote and snapshots live in [sled], peers talk over tonic gRPC.
//! `flowctl`'s cluster state plugs in as the state machine; `node` composes it.
//!
//! # Data flow
//!
//! ```text
//! propose(cmd) ─► batcher (mpsc, drains everything pending into one Batch)
//!     ├─ leader:   raft.client_write_ff(batch) ─► log append (sled, flushed) ─► replicate
//!     │            ─► commit ─► StateMachine::apply for each command ─► outputs to callers
//!     └─ follower: ClientWrite RPC to the leader (same path there)
//! linearizable_read(f) ─► read index (leader: ensure_linearizable; follower: ReadIndex RPC)
//!     ─► wait until applied ≥ read index ─► f(&state)
//! ```
//!
//! # Layout
//!
//! - [`state_machine`]: the [`StateMachine`] trait and the [`Batch`] log payload.
//! - [`types`]: the openraft type configuration.
//! - [`storage`]: sled-backed `RaftLogStorage` / `RaftStateMachine` (durability notes there).
//! - [`network`]: the peer gRPC service and the openraft network client.
//! - [`config`]: [`ConsensusConfig`] with defaults and `validate()`.
//! - [`node`]: [`ConsensusNode`], the handle the rest of the system uses.
//! - [`runtime`]: openraft's runtime (tokio, with a seedable generator for simulations).
//! - [`testkit`]: a small append-log state machine for tests and benchmarks.

pub mod clock;
pub mod codec;
pub mod config;
pub mod error;
pub mod network;
pub mod node;
pub mod runtime;
pub mod state_machine;
pub mod storage;
pub mod testkit;
pub mod types;

pub use config::ConsensusConfig;
pub use config::TlsConfig;
pub use error::ConsensusError;
pub use node::ClusterStatus;
pub use node::ConsensusMetrics;
pub use node::ConsensusNode;
pub use state_machine::Batch;
pub use state_machine::BatchOutput;
pub use state_machine::StateMachine;
pub use types::NodeId;
pub use types::TypeConfig;

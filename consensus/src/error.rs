//! Errors of the [`ConsensusNode`](crate::ConsensusNode) API.

use std::time::Duration;

use crate::codec::CodecError;
use crate::config::ConfigError;
use crate::storage::OpenError;
use crate::types::NodeId;

impl From<Box<openraft::ConfigError>> for ConsensusError {
    fn from(source: Box<openraft::ConfigError>) -> Self {
        Self::RaftConfig { source }
    }
}

/// An error from starting, using or stopping a consensus node.
#[derive(Debug, thiserror::Error)]
pub enum ConsensusError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// openraft rejected the derived configuration.
    #[error("openraft config: {source}")]
    RaftConfig {
        /// Underlying error.
        source: Box<openraft::ConfigError>,
    },
    /// The storage could not be opened.
    #[error(transparent)]
    Storage(#[from] OpenError),
    /// Local IO (data directory, listener) failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The peer gRPC server could not be configured.
    #[error("peer server: {source}")]
    Server {
        /// Underlying error.
        source: tonic::transport::Error,
    },
    /// TLS material could not be loaded or applied.
    #[error("tls: {reason}")]
    Tls {
        /// What failed.
        reason: String,
    },
    /// Raft could not be created or initialized.
    #[error("raft {op}: {reason}")]
    Raft {
        /// The operation that failed.
        op: &'static str,
        /// openraft's error text.
        reason: String,
    },
    /// The Raft core stopped (shutdown or storage failure).
    #[error("raft stopped: {reason}")]
    Stopped {
        /// Why.
        reason: String,
    },
    /// No leader became known within the deadline.
    #[error("no leader known after waiting {waited:?}")]
    NoLeader {
        /// How long we waited.
        waited: Duration,
    },
    /// The request was rejected by the leader (e.g. an invalid membership change, or a read
    /// while the leader could not reach a quorum). Nothing was applied.
    #[error("rejected by node {node_id}: {reason}")]
    Rejected {
        /// The node that rejected it.
        node_id: NodeId,
        /// Why.
        reason: String,
    },
    /// A peer RPC failed. For writes the outcome is unknown: the command may still commit.
    #[error("rpc {method} to node {target} ({addr}): {status}")]
    Rpc {
        /// RPC method name.
        method: &'static str,
        /// Target node id.
        target: NodeId,
        /// Target address.
        addr: String,
        /// gRPC status.
        status: Box<tonic::Status>,
    },
    /// The operation did not finish in time. For writes the outcome is unknown.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The write was accepted by a leader that lost leadership (or stopped) before answering:
    /// it may or may not be committed.
    #[error("outcome unknown: {reason}")]
    Indeterminate {
        /// What happened.
        reason: String,
    },
    /// The proposal is larger than a log entry may be ([`crate::ConsensusConfig::max_entry_bytes`]).
    /// Nothing was proposed.
    #[error("proposal of {bytes} bytes exceeds the {limit}-byte log entry limit")]
    TooLarge {
        /// The proposal's encoded size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A message could not be encoded or decoded.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The node is shutting down.
    #[error("consensus node is shutting down")]
    Shutdown,
}

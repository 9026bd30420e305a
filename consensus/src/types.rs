//! The openraft type configuration.
//!
//! `openraft::declare_raft_types!` only declares non-generic configs, but this crate is generic
//! over the application [`StateMachine`], so [`TypeConfig`] implements [`RaftTypeConfig`] by hand
//! with the same choices the macro's defaults make: `u64` node ids, [`BasicNode`] (the peer's
//! gRPC address), `Cursor<Vec<u8>>` snapshots and the tokio runtime (with a seedable election
//! timeout generator: [`crate::runtime`]).

use std::cmp::Ordering;
use std::fmt;
use std::io::Cursor;
use std::marker::PhantomData;

use openraft::BasicNode;
use openraft::RaftTypeConfig;
use openraft::impls::OneshotResponder;

use crate::state_machine::Batch;
use crate::state_machine::BatchOutput;
use crate::state_machine::StateMachine;

/// Raft node id.
pub type NodeId = u64;

/// Raft type configuration for a state machine `S`.
///
/// A zero-sized marker; `fn() -> S` keeps it `Send + Sync + Copy` whatever `S` is.
pub struct TypeConfig<S>(PhantomData<fn() -> S>);

impl<S> Clone for TypeConfig<S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for TypeConfig<S> {}
impl<S> Default for TypeConfig<S> {
    fn default() -> Self {
        Self(PhantomData)
    }
}
impl<S> fmt::Debug for TypeConfig<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TypeConfig")
    }
}
impl<S> PartialEq for TypeConfig<S> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<S> Eq for TypeConfig<S> {}
impl<S> PartialOrd for TypeConfig<S> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<S> Ord for TypeConfig<S> {
    fn cmp(&self, _: &Self) -> Ordering {
        Ordering::Equal
    }
}

impl<S: StateMachine> RaftTypeConfig for TypeConfig<S> {
    type D = Batch<S::Command>;
    type R = BatchOutput<S::Output>;
    type NodeId = NodeId;
    type Node = BasicNode;
    type Entry = openraft::Entry<Self>;
    type SnapshotData = Cursor<Vec<u8>>;
    type AsyncRuntime = crate::runtime::Runtime;
    type Responder = OneshotResponder<Self>;
}

/// The openraft handle for state machine `S`.
pub type Raft<S> = openraft::Raft<TypeConfig<S>>;
/// A log id (term, leader, index).
pub type LogId = openraft::LogId<NodeId>;
/// Stored membership with peer addresses.
pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;
/// Snapshot metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
/// openraft metrics for this config.
pub type RaftMetrics = openraft::RaftMetrics<NodeId, BasicNode>;
/// Storage error type.
pub type StorageError = openraft::StorageError<NodeId>;
/// A Raft vote (term and the leader or candidate it is for).
pub type Vote = openraft::Vote<NodeId>;

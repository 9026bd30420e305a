//! Bodies of the forwarding and admin RPCs (MessagePack in `Frame.data`).

use std::collections::BTreeSet;

use openraft::BasicNode;
use openraft::TryAsRef;
use openraft::error::ForwardToLeader;
use openraft::error::RaftError;
use serde::Deserialize;
use serde::Serialize;

use crate::types::LogId;
use crate::types::NodeId;

/// Why a leader-only request was not executed by the node that received it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteError {
    /// The receiver is not the leader; retry at the given leader if known. Nothing was done.
    ForwardToLeader {
        /// Current leader, if known.
        leader_id: Option<NodeId>,
        /// Its peer address, if known.
        leader_addr: Option<String>,
    },
    /// The leader rejected the request; nothing was applied.
    Rejected {
        /// Why.
        reason: String,
    },
    /// The receiver's Raft core stopped.
    Stopped {
        /// Why.
        reason: String,
    },
    /// The request was accepted but its outcome is unknown (leadership lost before commit).
    Indeterminate {
        /// What happened.
        reason: String,
    },
}

impl RemoteError {
    /// Classifies an openraft error.
    pub fn from_raft<E>(e: RaftError<NodeId, E>) -> Self
    where
        E: std::error::Error + TryAsRef<ForwardToLeader<NodeId, BasicNode>>,
    {
        if let Some(f) = e.forward_to_leader() {
            return Self::ForwardToLeader {
                leader_id: f.leader_id,
                leader_addr: f.leader_node.as_ref().map(|n| n.addr.clone()),
            };
        }
        match e {
            RaftError::Fatal(f) => Self::Stopped {
                reason: f.to_string(),
            },
            RaftError::APIError(api) => Self::Rejected {
                reason: api.to_string(),
            },
        }
    }
}

/// `ClientWrite` reply: the outputs of the forwarded batch.
pub type WriteReply<O> = Result<Vec<O>, RemoteError>;

/// `ReadIndex` reply: the log id a linearizable read must wait for.
pub type ReadIndexReply = Result<Option<LogId>, RemoteError>;

/// `AddLearner` request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AddLearnerRequest {
    /// The new node's id.
    pub node_id: NodeId,
    /// Its peer address.
    pub addr: String,
    /// Wait until the learner has caught up with the leader's log.
    pub blocking: bool,
}

/// `ChangeMembership` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    /// Turn an existing learner into a voter.
    Promote(NodeId),
    /// Remove a node (voter or learner) from the cluster entirely.
    Remove(NodeId),
    /// Turn a voter into a learner (it keeps receiving the log, it no longer votes).
    Demote(NodeId),
    /// Replace the voter set (all ids must already be members).
    ReplaceVoters(BTreeSet<NodeId>),
}

/// Reply of the admin RPCs: the log id of the membership entry.
pub type AdminReply = Result<Option<LogId>, RemoteError>;

//! What a node reports about itself: its Raft progress ([`ConsensusMetrics`]) and the cluster
//! as it sees it ([`ClusterStatus`], `/debug/cluster`).

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use openraft::ServerState;
use serde::Deserialize;
use serde::Serialize;

use super::Inner;
use crate::network::tls::PeerTlsStats;
use crate::state_machine::StateMachine;
use crate::types::NodeId;

/// A point-in-time view of this node's Raft progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsensusMetrics {
    /// This node.
    pub node_id: NodeId,
    /// `Leader`, `Follower`, `Candidate`, `Learner` or `Shutdown`.
    pub state: String,
    /// Current term.
    pub term: u64,
    /// Known leader.
    pub leader: Option<NodeId>,
    /// Index of the last entry in the local log.
    pub last_log_index: Option<u64>,
    /// Index of the last entry this node knows to be committed.
    pub commit_index: Option<u64>,
    /// Index of the last entry applied to the local state machine.
    pub last_applied: Option<u64>,
    /// `commit_index - last_applied` (entries committed but not yet applied here).
    pub apply_lag: u64,
    /// Last log index covered by the local snapshot.
    pub snapshot_index: Option<u64>,
    /// Last purged log index.
    pub purged_index: Option<u64>,
    /// Voter ids of the effective membership.
    pub voters: Vec<NodeId>,
    /// Learner ids of the effective membership.
    pub learners: Vec<NodeId>,
    /// Leader only: milliseconds since a quorum last acknowledged it.
    pub millis_since_quorum_ack: Option<u64>,
    /// The peer port's authentication counters (`None`: plaintext).
    #[serde(default)]
    pub peer_tls: Option<PeerTlsStats>,
}

/// One member as seen by this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatus {
    /// Node id.
    pub node_id: NodeId,
    /// Peer address.
    pub addr: String,
    /// Voter (true) or learner (false).
    pub voter: bool,
    /// Leader view only: last log index known to be replicated to this member.
    pub matched_index: Option<u64>,
}

/// JSON-serializable cluster view for `/debug/cluster`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// This node's peer address.
    pub addr: String,
    /// This node's progress.
    pub metrics: ConsensusMetrics,
    /// All members of the effective membership.
    pub members: Vec<MemberStatus>,
}

impl<S: StateMachine> Inner<S> {
    pub(crate) async fn metrics(&self) -> ConsensusMetrics {
        let m = self.metrics_now();
        let commit_index = self
            .raft
            .with_raft_state(|st| st.committed.as_ref().map(|l| l.index))
            .await
            .ok()
            .flatten();
        let membership = m.membership_config.membership();
        let last_applied = m.last_applied.as_ref().map(|l| l.index);
        ConsensusMetrics {
            node_id: self.id,
            state: format!("{:?}", m.state),
            term: m.current_term,
            leader: m.current_leader,
            last_log_index: m.last_log_index,
            commit_index,
            last_applied,
            apply_lag: commit_index
                .unwrap_or(0)
                .saturating_sub(last_applied.unwrap_or(0)),
            snapshot_index: m.snapshot.as_ref().map(|l| l.index),
            purged_index: m.purged.as_ref().map(|l| l.index),
            voters: membership.voter_ids().collect(),
            learners: membership.learner_ids().collect(),
            millis_since_quorum_ack: m.millis_since_quorum_ack,
            peer_tls: self.tls.as_ref().map(|t| t.stats()),
        }
    }

    pub(crate) async fn status(&self) -> ClusterStatus {
        let metrics = self.metrics().await;
        let m = self.metrics_now();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let matched: BTreeMap<NodeId, Option<u64>> = match (&m.replication, m.state) {
            (Some(repl), ServerState::Leader) => repl
                .iter()
                .map(|(id, l)| (*id, l.as_ref().map(|l| l.index)))
                .collect(),
            _ => BTreeMap::new(),
        };
        let members = membership
            .nodes()
            .map(|(id, node)| MemberStatus {
                node_id: *id,
                addr: node.addr.clone(),
                voter: voters.contains(id),
                matched_index: matched.get(id).copied().flatten(),
            })
            .collect();
        ClusterStatus {
            addr: self.addr.clone(),
            metrics,
            members,
        }
    }
}

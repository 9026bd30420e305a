//! The replicated cluster state: which replicas are alive (liveness leases).
//!
//! Every replica proposes a [`ClusterCommand::Heartbeat`] through the consensus log every few
//! hundred milliseconds; a replica whose last heartbeat is older than the lease TTL is dead to
//! everyone, at the same log position. This is the first piece of the Active-Active flow-control
//! state (credit, the global queue and the in-flight ledger hang off member leases); like the rest
//! of `flowctl` it is pure: time comes in the commands, and every replica computes the same state.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A replica's Raft node id.
pub type MemberId = u64;

/// What the cluster knows about one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The replica's ext_proc address (what Envoy connects to).
    pub ext_proc: String,
    /// The replica's admin HTTP address.
    pub admin: String,
    /// Wall-clock milliseconds of the proposer when it started (a restart changes it).
    pub started_ms: u64,
    /// Wall-clock milliseconds of its last heartbeat.
    pub last_seen_ms: u64,
    pub heartbeats: u64,
}

/// Commands of the cluster state machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClusterCommand {
    /// `node` is alive at `now_ms` (the proposer's wall clock).
    Heartbeat {
        node: MemberId,
        now_ms: u64,
        ext_proc: String,
        admin: String,
        started_ms: u64,
    },
    /// `node` leaves (graceful shutdown): its lease ends now.
    Leave { node: MemberId },
}

/// What applying a command did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClusterOutput {
    /// The member's heartbeat count after this command (0 after `Leave`).
    Heartbeats(u64),
    /// The member was restarted (new `started_ms`): its old lease's resources are void.
    Restarted,
    UnknownMember,
}

/// Replicated membership with liveness leases.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    members: BTreeMap<MemberId, Member>,
    /// Highest `now_ms` seen in any command: the state's notion of "now" (monotone).
    now_ms: u64,
}

impl ClusterState {
    pub fn apply(&mut self, cmd: ClusterCommand) -> ClusterOutput {
        match cmd {
            ClusterCommand::Heartbeat {
                node,
                now_ms,
                ext_proc,
                admin,
                started_ms,
            } => {
                self.now_ms = self.now_ms.max(now_ms);
                match self.members.get_mut(&node) {
                    Some(m) if m.started_ms == started_ms => {
                        m.last_seen_ms = m.last_seen_ms.max(now_ms);
                        m.heartbeats += 1;
                        m.ext_proc = ext_proc;
                        m.admin = admin;
                        ClusterOutput::Heartbeats(m.heartbeats)
                    }
                    existing => {
                        let restarted = existing.is_some();
                        self.members.insert(
                            node,
                            Member {
                                ext_proc,
                                admin,
                                started_ms,
                                last_seen_ms: now_ms,
                                heartbeats: 1,
                            },
                        );
                        if restarted {
                            ClusterOutput::Restarted
                        } else {
                            ClusterOutput::Heartbeats(1)
                        }
                    }
                }
            }
            ClusterCommand::Leave { node } => match self.members.remove(&node) {
                Some(_) => ClusterOutput::Heartbeats(0),
                None => ClusterOutput::UnknownMember,
            },
        }
    }

    pub fn members(&self) -> &BTreeMap<MemberId, Member> {
        &self.members
    }

    /// The latest time any heartbeat carried.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Whether `node`'s lease is valid at `now_ms` with lease length `ttl_ms`.
    pub fn is_live(&self, node: MemberId, now_ms: u64, ttl_ms: u64) -> bool {
        self.members
            .get(&node)
            .is_some_and(|m| now_ms.saturating_sub(m.last_seen_ms) < ttl_ms)
    }

    /// Members whose lease is valid at `now_ms`.
    pub fn live(&self, now_ms: u64, ttl_ms: u64) -> impl Iterator<Item = (MemberId, &Member)> {
        self.members
            .iter()
            .filter(move |(_, m)| now_ms.saturating_sub(m.last_seen_ms) < ttl_ms)
            .map(|(id, m)| (*id, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(node: MemberId, now_ms: u64, started_ms: u64) -> ClusterCommand {
        ClusterCommand::Heartbeat {
            node,
            now_ms,
            ext_proc: format!("127.0.0.1:{node}"),
            admin: String::new(),
            started_ms,
        }
    }

    #[test]
    fn leases_expire_restart_and_leave() {
        let mut s = ClusterState::default();
        assert_eq!(s.apply(hb(1, 1000, 1)), ClusterOutput::Heartbeats(1));
        assert_eq!(s.apply(hb(2, 1100, 5)), ClusterOutput::Heartbeats(1));
        assert_eq!(s.apply(hb(1, 1500, 1)), ClusterOutput::Heartbeats(2));
        // A late (reordered) heartbeat never moves a lease backwards.
        s.apply(hb(1, 1200, 1));
        assert_eq!(s.members()[&1].last_seen_ms, 1500);
        let live: Vec<MemberId> = s.live(2150, 1000).map(|(id, _)| id).collect();
        assert_eq!(live, vec![1], "node 2's lease (last 1100) ended at 2100");
        assert!(!s.is_live(2, 2150, 1000));
        assert_eq!(s.apply(hb(2, 3000, 9)), ClusterOutput::Restarted);
        assert_eq!(s.members()[&2].heartbeats, 1);
        assert_eq!(
            s.apply(ClusterCommand::Leave { node: 1 }),
            ClusterOutput::Heartbeats(0)
        );
        assert_eq!(
            s.apply(ClusterCommand::Leave { node: 1 }),
            ClusterOutput::UnknownMember
        );
        assert_eq!(s.now_ms(), 3000);
    }

    #[test]
    fn same_commands_same_state() {
        let cmds = vec![
            hb(3, 10, 1),
            hb(1, 20, 2),
            hb(3, 30, 1),
            ClusterCommand::Leave { node: 1 },
        ];
        let (mut a, mut b) = (ClusterState::default(), ClusterState::default());
        for c in &cmds {
            a.apply(c.clone());
            b.apply(c.clone());
        }
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
    }
}

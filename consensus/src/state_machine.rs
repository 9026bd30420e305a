//! The replicated state machine contract.
//!
//! The consensus layer is generic over the application state: anything that can apply a command
//! deterministically and be serialized as a whole (the snapshot) can be replicated. `flowctl`'s
//! cluster state plugs in here; the tests use [`crate::testkit::LogMachine`].

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A deterministic state machine replicated by Raft.
///
/// Every replica applies the same commands in the same log order, so `apply` must be a pure
/// function of the current state and the command: no clocks, randomness or IO (pass time in the
/// command). The whole state is serialized to build a snapshot and deserialized to install one.
pub trait StateMachine: Default + Serialize + DeserializeOwned + Send + Sync + 'static {
    /// A command proposed by a client and stored in the Raft log.
    type Command: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// The result of applying one command, returned to the proposer.
    type Output: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;

    /// Applies one committed command and returns its output.
    fn apply(&mut self, cmd: Self::Command) -> Self::Output;

    /// The member `cmd` acts for, when it names one (its heartbeat, its flow-control reports).
    /// With peer identities checked, a write forwarded over the peer port is refused unless the
    /// certificate that sent it is that member's: a member cannot speak for another.
    fn acting_for(_cmd: &Self::Command) -> Option<crate::types::NodeId> {
        None
    }

    /// Before an entry's commands: the time its leader stamped it with as it appended it
    /// (µs since the UNIX epoch on the leader's clock; see [`Batch::stamp_us`]). The same on every
    /// replica, so a state may take its time from it instead of from its proposers' clocks.
    fn stamp(&mut self, _stamp_us: u64) {}
}

/// The application payload of one Raft log entry: proposals that arrived together are coalesced
/// into one entry and applied in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Batch<C> {
    /// Commands in proposal order.
    pub commands: Vec<C>,
    /// The leader's wall clock when it appended the entry (µs since the UNIX epoch; 0 in entries
    /// written before stamps existed). Set by the leader, whatever the proposer sent.
    #[serde(default)]
    pub stamp_us: u64,
}

impl<C> Batch<C> {
    pub fn new(commands: Vec<C>) -> Batch<C> {
        Batch {
            commands,
            stamp_us: 0,
        }
    }

    /// Stamped by the leader appending it now.
    pub(crate) fn stamped(mut self) -> Batch<C> {
        self.stamp_us = crate::clock::now_us();
        self
    }
}

/// The response to one log entry: one output per command of the [`Batch`], in the same order.
/// Blank and membership entries produce an empty output list.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchOutput<O> {
    /// Outputs in command order.
    pub outputs: Vec<O>,
}

impl<O> Default for BatchOutput<O> {
    fn default() -> Self {
        Self {
            outputs: Vec::new(),
        }
    }
}

//! A small state machine for tests, examples and benchmarks.
//!
//! [`LogMachine`] appends every command to an ordered log and keeps a key/value map, so a test can
//! compare replicas entry by entry: if two replicas' logs are equal, they applied the same
//! commands in the same order.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::Serialize;

use crate::state_machine::StateMachine;

/// A command for [`LogMachine`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogCommand {
    /// Append `value` to the log (and set `key` to it when given).
    Append {
        /// Optional key to set.
        key: Option<String>,
        /// Value appended to the log.
        value: String,
    },
    /// Do nothing except bump the applied count; used by benchmarks.
    Noop,
    /// Append `value` on behalf of member `node` (its [`StateMachine::acting_for`]).
    AppendAs {
        node: crate::types::NodeId,
        value: String,
    },
}

/// Ordered append log plus a key/value map.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogMachine {
    /// Every appended value, in apply order.
    pub log: Vec<String>,
    /// Last value per key.
    pub kv: BTreeMap<String, String>,
    /// Number of commands applied (including no-ops).
    pub applied: u64,
}

impl StateMachine for LogMachine {
    type Command = LogCommand;
    /// The position of the command among all commands applied (1-based).
    type Output = u64;

    fn apply(&mut self, cmd: LogCommand) -> u64 {
        self.applied += 1;
        match cmd {
            LogCommand::Append { key, value } => {
                if let Some(key) = key {
                    self.kv.insert(key, value.clone());
                }
                self.log.push(value);
            }
            LogCommand::Noop => {}
            LogCommand::AppendAs { value, .. } => self.log.push(value),
        }
        self.applied
    }

    fn acting_for(cmd: &LogCommand) -> Option<crate::types::NodeId> {
        match cmd {
            LogCommand::AppendAs { node, .. } => Some(*node),
            _ => None,
        }
    }
}

impl LogCommand {
    /// An `Append` without key.
    pub fn append(value: impl Into<String>) -> Self {
        Self::Append {
            key: None,
            value: value.into(),
        }
    }
}

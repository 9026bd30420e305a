//! sled-backed openraft storage (v2 traits).
//!
//! One sled database per node (`<data_dir>/raft.sled`) holds four trees:
//!
//! | tree       | key                        | value                                   |
//! |------------|----------------------------|-----------------------------------------|
//! | `logs`     | log index, big-endian u64  | encoded `openraft::Entry`               |
//! | `meta`     | `vote`, `committed`, `last_purged` | encoded `Vote` / `LogId`        |
//! | `snapshot` | `meta`, `data`             | encoded `SnapshotMeta`, raw state bytes |
//!
//! Durability: [`LogStore`] calls openraft's `LogFlushed` callback only after
//! `sled::Db::flush_async` returned, so an acknowledged append survives a crash; votes, truncation
//! and purges are flushed before returning. `committed` is written without an explicit flush (it
//! is an optimisation: losing it only means re-applying less on restart).
//!
//! State machine persistence: the applied state lives in memory and is **rebuilt on restart from
//! the last snapshot plus the log**. Snapshots (built by policy or installed from the leader) are
//! persisted and flushed; on open [`StateMachineStore`] loads the latest one, reports its last log
//! id as `applied_state`, and openraft re-applies the committed entries after it (it reads the
//! persisted `committed` id). Logs are only purged up to the last snapshot, so the replay range is
//! always present. This keeps each apply free of IO; the snapshot policy bounds replay time.

mod log_store;
mod sm_store;

use std::path::Path;

pub use log_store::LogStore;
pub use sm_store::SnapshotBuilder;
pub use sm_store::StateMachineStore;
pub use sm_store::StateReader;

use crate::state_machine::StateMachine;

/// Opening the sled database failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// sled could not open or create the database.
    #[error("open sled database at {path}: {source}")]
    Sled {
        /// Database directory.
        path: String,
        /// Underlying error.
        source: sled::Error,
    },
    /// A persisted record (snapshot, vote, ...) could not be read back.
    #[error("read persisted {what}: {source}")]
    Corrupt {
        /// What was being read.
        what: &'static str,
        /// Underlying error.
        source: crate::codec::CodecError,
    },
}

/// The two halves of a node's storage plus whether the database already held data.
pub struct Storage<S: StateMachine> {
    /// Raft log, vote and committed id.
    pub log: LogStore<S>,
    /// Applied state, membership and snapshots.
    pub state_machine: StateMachineStore<S>,
    /// True when the database existed before this open (the node is restarting).
    pub recovered: bool,
}

/// Opens (or creates) the storage under `dir`.
pub fn open<S: StateMachine>(dir: &Path) -> Result<Storage<S>, OpenError> {
    open_with(dir, false)
}

/// [`open`], flushing on the calling thread when `inline_flush` (see
/// `ConsensusConfig::inline_flush`).
pub fn open_with<S: StateMachine>(dir: &Path, inline_flush: bool) -> Result<Storage<S>, OpenError> {
    let path = dir.join("raft.sled");
    let db = sled::Config::new()
        .path(&path)
        .mode(sled::Mode::HighThroughput)
        // Every acknowledged write is flushed explicitly; sled's own background flusher
        // (default cadence) is redundant but harmless.
        .cache_capacity(64 * 1024 * 1024)
        .open()
        .map_err(|source| OpenError::Sled {
            path: path.display().to_string(),
            source,
        })?;
    let recovered = db.was_recovered();
    let sled_err = |source| OpenError::Sled {
        path: path.display().to_string(),
        source,
    };
    let log = LogStore::new(db.clone(), inline_flush).map_err(sled_err)?;
    let state_machine = StateMachineStore::open(db, inline_flush)?;
    Ok(Storage {
        log,
        state_machine,
        recovered,
    })
}

pub(crate) fn sled_io(e: impl std::error::Error + 'static) -> openraft::AnyError {
    openraft::AnyError::new(&e)
}

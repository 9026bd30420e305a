//! The applied state machine, its membership and its snapshots.

use std::io::Cursor;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use openraft::EntryPayload;
use openraft::RaftSnapshotBuilder;
use openraft::Snapshot;
use openraft::StorageIOError;
use openraft::storage::RaftStateMachine;
use tokio::sync::RwLock;
use tokio::sync::watch;

use super::OpenError;
use super::sled_io;
use crate::codec;
use crate::state_machine::BatchOutput;
use crate::state_machine::StateMachine;
use crate::types::LogId;
use crate::types::SnapshotMeta;
use crate::types::StorageError;
use crate::types::StoredMembership;
use crate::types::TypeConfig;

const KEY_SNAPSHOT_META: &[u8] = b"meta";
const KEY_SNAPSHOT_DATA: &[u8] = b"data";

type Entry<S> = openraft::Entry<TypeConfig<S>>;

/// The in-memory applied state.
struct Applied<S> {
    last_applied: Option<LogId>,
    last_membership: StoredMembership,
    state: S,
}

struct Shared<S> {
    applied: RwLock<Applied<S>>,
    /// Index of the last applied entry (0 before anything was applied), for waiters.
    applied_index: watch::Sender<u64>,
    db: sled::Db,
    snapshots: sled::Tree,
    /// Distinguishes snapshots built at the same log id.
    snapshot_seq: AtomicU64,
    /// Flush on the calling thread (see `ConsensusConfig::inline_flush`).
    inline_flush: bool,
}

/// The openraft state machine store. Cloning shares the same state.
pub struct StateMachineStore<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for StateMachineStore<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Read access to the applied state, for queries outside openraft.
pub struct StateReader<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for StateReader<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: StateMachine> StateReader<S> {
    /// Runs `f` on the current applied state (no consistency guarantee by itself; see
    /// `ConsensusNode::linearizable_read`). Returns the result and the last applied index.
    pub async fn read<R>(&self, f: impl FnOnce(&S) -> R) -> (R, u64) {
        let guard = self.shared.applied.read().await;
        let index = guard.last_applied.as_ref().map_or(0, |l| l.index);
        (f(&guard.state), index)
    }

    /// A receiver of the last applied log index.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.applied_index.subscribe()
    }
}

fn persisted_snapshot(tree: &sled::Tree) -> Result<Option<(SnapshotMeta, Vec<u8>)>, OpenError> {
    let corrupt = |source| OpenError::Corrupt {
        what: "snapshot",
        source,
    };
    let read = |key: &[u8]| {
        tree.get(key).map_err(|source| OpenError::Sled {
            path: "snapshot tree".into(),
            source,
        })
    };
    match (read(KEY_SNAPSHOT_META)?, read(KEY_SNAPSHOT_DATA)?) {
        (Some(meta), Some(data)) => {
            let meta: SnapshotMeta = codec::decode(&meta).map_err(corrupt)?;
            Ok(Some((meta, data.to_vec())))
        }
        _ => Ok(None),
    }
}

impl<S: StateMachine> StateMachineStore<S> {
    pub(crate) fn open(db: sled::Db, inline_flush: bool) -> Result<Self, OpenError> {
        let snapshots = db.open_tree("snapshot").map_err(|source| OpenError::Sled {
            path: "snapshot tree".into(),
            source,
        })?;
        let applied = match persisted_snapshot(&snapshots)? {
            Some((meta, data)) => {
                let state: S = codec::decode(&data).map_err(|source| OpenError::Corrupt {
                    what: "snapshot state",
                    source,
                })?;
                tracing::info!(snapshot = %meta, "state machine restored from snapshot");
                Applied {
                    last_applied: meta.last_log_id,
                    last_membership: meta.last_membership,
                    state,
                }
            }
            None => Applied {
                last_applied: None,
                last_membership: StoredMembership::default(),
                state: S::default(),
            },
        };
        let index = applied.last_applied.as_ref().map_or(0, |l| l.index);
        let (applied_index, _) = watch::channel(index);
        Ok(Self {
            shared: Arc::new(Shared {
                applied: RwLock::new(applied),
                applied_index,
                db,
                snapshots,
                snapshot_seq: AtomicU64::new(0),
                inline_flush,
            }),
        })
    }

    /// A read handle on the applied state.
    pub fn reader(&self) -> StateReader<S> {
        StateReader {
            shared: Arc::clone(&self.shared),
        }
    }

    async fn persist_snapshot(&self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        let signature = Some(meta.signature());
        let meta_bytes = codec::encode(meta)
            .map_err(|e| StorageIOError::write_snapshot(signature.clone(), sled_io(e)))?;
        let mut batch = sled::Batch::default();
        batch.insert(KEY_SNAPSHOT_META, meta_bytes);
        batch.insert(KEY_SNAPSHOT_DATA, data);
        self.shared
            .snapshots
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_snapshot(signature.clone(), sled_io(e)))?;
        let db = &self.shared.db;
        let flushed = if self.shared.inline_flush {
            db.flush()
        } else {
            db.flush_async().await
        };
        flushed.map_err(|e| StorageIOError::write_snapshot(signature, sled_io(e)))?;
        Ok(())
    }
}

/// Builds a snapshot from the state captured when openraft asked for a builder.
///
/// The state is serialized in `get_snapshot_builder` (a consistent point: the state machine
/// worker is not applying meanwhile); `build_snapshot` runs concurrently with later applies and
/// only persists the captured bytes.
pub struct SnapshotBuilder<S> {
    store: StateMachineStore<S>,
    captured: Result<(Option<LogId>, StoredMembership, Vec<u8>), codec::CodecError>,
}

impl<S: StateMachine> RaftSnapshotBuilder<TypeConfig<S>> for SnapshotBuilder<S> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig<S>>, StorageError> {
        let (last_log_id, last_membership, data) = match &self.captured {
            Ok(c) => c.clone(),
            Err(e) => {
                return Err(
                    StorageIOError::read_state_machine(openraft::AnyError::error(e)).into(),
                );
            }
        };
        let seq = self
            .store
            .shared
            .snapshot_seq
            .fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match &last_log_id {
            Some(l) => format!("{}-{}-{seq}", l.leader_id, l.index),
            None => format!("none-{seq}"),
        };
        let meta = SnapshotMeta {
            last_log_id,
            last_membership,
            snapshot_id,
        };
        self.store.persist_snapshot(&meta, &data).await?;
        tracing::info!(snapshot = %meta, bytes = data.len(), "snapshot built");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl<S: StateMachine> RaftStateMachine<TypeConfig<S>> for StateMachineStore<S> {
    type SnapshotBuilder = SnapshotBuilder<S>;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.shared.applied.read().await;
        Ok((applied.last_applied, applied.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchOutput<S::Output>>, StorageError>
    where
        I: IntoIterator<Item = Entry<S>> + Send,
        I::IntoIter: Send,
    {
        let mut applied = self.shared.applied.write().await;
        let mut responses = Vec::new();
        for entry in entries {
            let log_id = entry.log_id;
            match entry.payload {
                EntryPayload::Blank => responses.push(BatchOutput::default()),
                EntryPayload::Normal(batch) => {
                    if batch.stamp_us > 0 {
                        applied.state.stamp(batch.stamp_us);
                    }
                    let outputs = batch
                        .commands
                        .into_iter()
                        .map(|cmd| applied.state.apply(cmd))
                        .collect();
                    responses.push(BatchOutput { outputs });
                }
                EntryPayload::Membership(membership) => {
                    applied.last_membership = StoredMembership::new(Some(log_id), membership);
                    responses.push(BatchOutput::default());
                }
            }
            applied.last_applied = Some(log_id);
        }
        let index = applied.last_applied.as_ref().map_or(0, |l| l.index);
        drop(applied);
        self.shared.applied_index.send_replace(index);
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        let applied = self.shared.applied.read().await;
        let captured = codec::encode(&applied.state)
            .map(|data| (applied.last_applied, applied.last_membership.clone(), data));
        SnapshotBuilder {
            store: self.clone(),
            captured,
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let state: S = codec::decode(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), sled_io(e)))?;
        // Persist first: once installed, openraft may purge the log up to this snapshot.
        self.persist_snapshot(meta, &data).await?;
        let mut applied = self.shared.applied.write().await;
        applied.state = state;
        applied.last_applied = meta.last_log_id;
        applied.last_membership = meta.last_membership.clone();
        let index = applied.last_applied.as_ref().map_or(0, |l| l.index);
        drop(applied);
        self.shared.applied_index.send_replace(index);
        tracing::info!(snapshot = %meta, bytes = data.len(), "snapshot installed");
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig<S>>>, StorageError> {
        let found = persisted_snapshot(&self.shared.snapshots)
            .map_err(|e| StorageIOError::read_snapshot(None, openraft::AnyError::error(e)))?;
        Ok(found.map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}

//! Raft log, vote and committed id in sled.

// openraft's trait-mandated `StorageError` is large; helpers return it as-is.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::Bound;
use std::ops::RangeBounds;

use openraft::LogState;
use openraft::RaftLogReader;
use openraft::StorageIOError;
use openraft::Vote;
use openraft::storage::LogFlushed;
use openraft::storage::RaftLogStorage;

use super::sled_io;
use crate::codec;
use crate::state_machine::StateMachine;
use crate::types::LogId;
use crate::types::NodeId;
use crate::types::StorageError;
use crate::types::TypeConfig;

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_LAST_PURGED: &[u8] = b"last_purged";

type Entry<S> = openraft::Entry<TypeConfig<S>>;

/// The Raft log store. Cloning is cheap (sled trees are reference counted); a clone is also the
/// log reader handed to replication tasks.
pub struct LogStore<S> {
    db: sled::Db,
    logs: sled::Tree,
    meta: sled::Tree,
    inline_flush: bool,
    _state: PhantomData<fn() -> S>,
}

impl<S> Clone for LogStore<S> {
    fn clone(&self) -> Self {
        Self {
            db: self.db.clone(),
            logs: self.logs.clone(),
            meta: self.meta.clone(),
            inline_flush: self.inline_flush,
            _state: PhantomData,
        }
    }
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

impl<S: StateMachine> LogStore<S> {
    pub(crate) fn new(db: sled::Db, inline_flush: bool) -> Result<Self, sled::Error> {
        let logs = db.open_tree("logs")?;
        let meta = db.open_tree("meta")?;
        Ok(Self {
            db,
            logs,
            meta,
            inline_flush,
            _state: PhantomData,
        })
    }

    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, StorageError> {
        let raw = self
            .meta
            .get(key)
            .map_err(|e| StorageIOError::read(sled_io(e)))?;
        match raw {
            None => Ok(None),
            Some(bytes) => codec::decode(&bytes)
                .map(Some)
                .map_err(|e| StorageIOError::read(sled_io(e)).into()),
        }
    }

    fn write_meta<T: serde::Serialize>(&self, key: &[u8], value: &T) -> Result<(), StorageError> {
        let bytes = codec::encode(value).map_err(|e| StorageIOError::write(sled_io(e)))?;
        self.meta
            .insert(key, bytes)
            .map_err(|e| StorageIOError::write(sled_io(e)))?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), sled::Error> {
        if self.inline_flush {
            return self.db.flush().map(|_| ());
        }
        self.db.flush_async().await.map(|_| ())
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId>, StorageError> {
        let last = self
            .logs
            .last()
            .map_err(|e| StorageIOError::read_logs(sled_io(e)))?;
        match last {
            None => Ok(None),
            Some((_, bytes)) => {
                let entry: Entry<S> =
                    codec::decode(&bytes).map_err(|e| StorageIOError::read_logs(sled_io(e)))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}

impl<S: StateMachine> RaftLogReader<TypeConfig<S>> for LogStore<S> {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<S>>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(index_key(*i)),
            Bound::Excluded(i) => Bound::Excluded(index_key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let mut out = Vec::new();
        for item in self.logs.range((Bound::Included(index_key(start)), end)) {
            let (_, bytes) = item.map_err(|e| StorageIOError::read_logs(sled_io(e)))?;
            let entry: Entry<S> =
                codec::decode(&bytes).map_err(|e| StorageIOError::read_logs(sled_io(e)))?;
            out.push(entry);
        }
        Ok(out)
    }
}

impl<S: StateMachine> RaftLogStorage<TypeConfig<S>> for LogStore<S> {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig<S>>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.read_meta(KEY_LAST_PURGED)?;
        // `max`: after a crash in the middle of a purge, entries below the purge point may remain.
        let last_log_id = std::cmp::max(self.last_entry_log_id()?, last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.write_meta(KEY_VOTE, vote)
            .map_err(|e| StorageIOError::write_vote(sled_io(e)))?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_vote(sled_io(e)))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.write_meta(KEY_COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig<S>>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<S>> + Send,
        I::IntoIter: Send,
    {
        let mut batch = sled::Batch::default();
        for entry in entries {
            let bytes = codec::encode(&entry)
                .map_err(|e| StorageIOError::write_log_entry(entry.log_id, sled_io(e)))?;
            batch.insert(&index_key(entry.log_id.index), bytes);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        // Acknowledge only once the entries are on disk.
        let flushed = self.flush().await.map_err(std::io::Error::other);
        callback.log_io_completed(flushed);
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncate log since");
        let mut batch = sled::Batch::default();
        for item in self.logs.range(index_key(log_id.index)..) {
            let (key, _) = item.map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
            batch.remove(key);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "purge log upto");
        // Record the purge point first: if we crash halfway, get_log_state still reports a
        // consistent `last_purged_log_id` and the leftover entries are below it.
        self.write_meta(KEY_LAST_PURGED, &log_id)?;
        let mut batch = sled::Batch::default();
        for item in self.logs.range(..=index_key(log_id.index)) {
            let (key, _) = item.map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
            batch.remove(key);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        Ok(())
    }
}

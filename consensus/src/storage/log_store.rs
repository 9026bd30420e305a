//! Raft log, vote and committed id in sled.

// openraft's trait-mandated `StorageError` is large; helpers return it as-is.
#![allow(clippy::result_large_err)]

use std::collections::VecDeque;
use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::Mutex;

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

/// Most recent entries kept decoded in memory.
const RECENT_ENTRIES: usize = 1024;

/// The newest appended entries, decoded, with contiguous indexes: the leader reads each new entry
/// once per follower to replicate it and every node once more to apply it — from here, instead of
/// decoding it from sled each time (decoding was ~15% of a busy cluster's CPU). The log on disk
/// stays the truth: a range not wholly here is read from sled.
struct Recent<S: StateMachine>(VecDeque<Entry<S>>);

impl<S: StateMachine> Recent<S> {
    fn first_index(&self) -> Option<u64> {
        self.0.front().map(|e| e.log_id.index)
    }

    fn push(&mut self, entry: Entry<S>) {
        let next = self.0.back().map(|e| e.log_id.index + 1);
        if next.is_some_and(|n| n != entry.log_id.index) {
            self.0.clear();
        }
        if self.0.len() == RECENT_ENTRIES {
            self.0.pop_front();
        }
        self.0.push_back(entry);
    }

    /// Entries `start..end` (`end` exclusive, `None` = to the last), if all are here.
    fn get(&self, start: u64, end: Option<u64>) -> Option<Vec<Entry<S>>> {
        let first = self.first_index()?;
        let last = self.0.back()?.log_id.index;
        let end = end.unwrap_or(last + 1);
        if start < first || end > last + 1 {
            return None;
        }
        if start >= end {
            return Some(Vec::new());
        }
        let from = (start - first) as usize;
        Some(
            self.0
                .range(from..from + (end - start) as usize)
                .cloned()
                .collect(),
        )
    }

    /// Entries from `index` on are gone.
    fn truncate(&mut self, index: u64) {
        while self.0.back().is_some_and(|e| e.log_id.index >= index) {
            self.0.pop_back();
        }
    }

    /// Entries up to `index` are gone.
    fn purge(&mut self, index: u64) {
        while self.0.front().is_some_and(|e| e.log_id.index <= index) {
            self.0.pop_front();
        }
    }
}

/// The Raft log store. Cloning is cheap (sled trees are reference counted); a clone is also the
/// log reader handed to replication tasks.
pub struct LogStore<S: StateMachine> {
    db: sled::Db,
    logs: sled::Tree,
    meta: sled::Tree,
    inline_flush: bool,
    recent: Arc<Mutex<Recent<S>>>,
    _state: PhantomData<fn() -> S>,
}

impl<S: StateMachine> Clone for LogStore<S> {
    fn clone(&self) -> Self {
        Self {
            db: self.db.clone(),
            logs: self.logs.clone(),
            meta: self.meta.clone(),
            inline_flush: self.inline_flush,
            recent: self.recent.clone(),
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
            recent: Arc::new(Mutex::new(Recent(VecDeque::new()))),
            _state: PhantomData,
        })
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent<S>> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
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
        let end_index = match range.end_bound() {
            Bound::Included(i) => Some(i.saturating_add(1)),
            Bound::Excluded(i) => Some(*i),
            Bound::Unbounded => None,
        };
        if let Some(hit) = self.recent().get(start, end_index) {
            return Ok(hit);
        }
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
        let mut appended = Vec::new();
        for entry in entries {
            let bytes = codec::encode(&entry)
                .map_err(|e| StorageIOError::write_log_entry(entry.log_id, sled_io(e)))?;
            batch.insert(&index_key(entry.log_id.index), bytes);
            appended.push(entry);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(sled_io(e)))?;
        {
            let mut recent = self.recent();
            for entry in appended {
                recent.push(entry);
            }
        }
        // Acknowledge only once the entries are on disk.
        let flushed = self.flush().await.map_err(std::io::Error::other);
        callback.log_io_completed(flushed);
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncate log since");
        self.recent().truncate(log_id.index);
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
        self.recent().purge(log_id.index);
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

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;
    use crate::testkit::LogMachine;

    fn entry(index: u64) -> Entry<LogMachine> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
            payload: EntryPayload::Blank,
        }
    }

    fn indexes(v: Option<Vec<Entry<LogMachine>>>) -> Option<Vec<u64>> {
        v.map(|v| v.iter().map(|e| e.log_id.index).collect())
    }

    #[test]
    fn recent_entries_serve_only_ranges_they_hold_whole() {
        let mut r: Recent<LogMachine> = Recent(VecDeque::new());
        assert_eq!(indexes(r.get(0, None)), None);
        for i in 5..10 {
            r.push(entry(i));
        }
        assert_eq!(indexes(r.get(6, Some(8))), Some(vec![6, 7]));
        assert_eq!(indexes(r.get(5, None)), Some(vec![5, 6, 7, 8, 9]));
        assert_eq!(indexes(r.get(9, Some(9))), Some(vec![]));
        // Partly below or above the window: the disk answers.
        assert_eq!(indexes(r.get(4, Some(7))), None);
        assert_eq!(indexes(r.get(8, Some(11))), None);
        // A conflicting suffix truncated, then rewritten.
        r.truncate(8);
        assert_eq!(indexes(r.get(5, None)), Some(vec![5, 6, 7]));
        r.push(entry(8));
        assert_eq!(indexes(r.get(7, None)), Some(vec![7, 8]));
        r.purge(6);
        assert_eq!(indexes(r.get(6, None)), None);
        assert_eq!(indexes(r.get(7, None)), Some(vec![7, 8]));
        // A gap (a snapshot installed past the log): only the new run is kept.
        r.push(entry(20));
        assert_eq!(indexes(r.get(20, None)), Some(vec![20]));
        assert_eq!(indexes(r.get(8, Some(9))), None);
        // Bounded.
        for i in 21..21 + RECENT_ENTRIES as u64 {
            r.push(entry(i));
        }
        assert_eq!(r.0.len(), RECENT_ENTRIES);
        assert_eq!(r.first_index(), Some(21));
    }
}

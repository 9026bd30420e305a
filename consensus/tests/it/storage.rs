//! Storage layer: openraft's conformance suite plus persistence across reopen.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use consensus::Batch;
use consensus::TypeConfig;
use consensus::storage;
use consensus::storage::LogStore;
use consensus::storage::StateMachineStore;
use consensus::testkit::LogCommand;
use consensus::testkit::LogMachine;
use openraft::BasicNode;
use openraft::CommittedLeaderId;
use openraft::Entry;
use openraft::EntryPayload;
use openraft::LogId;
use openraft::Membership;
use openraft::RaftLogReader;
use openraft::RaftSnapshotBuilder;
use openraft::StorageError;
use openraft::Vote;
use openraft::storage::RaftLogStorage;
use openraft::storage::RaftLogStorageExt;
use openraft::storage::RaftStateMachine;
use openraft::testing::StoreBuilder;
use openraft::testing::Suite;
use tempfile::TempDir;

type C = TypeConfig<LogMachine>;

struct SledBuilder;

impl StoreBuilder<C, LogStore<LogMachine>, StateMachineStore<LogMachine>, TempDir> for SledBuilder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore<LogMachine>, StateMachineStore<LogMachine>), StorageError<u64>>
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = storage::open::<LogMachine>(dir.path()).expect("open sled storage");
        Ok((dir, s.log, s.state_machine))
    }
}

#[test]
fn sled_storage_passes_openraft_suite() {
    Suite::test_all(SledBuilder).expect("openraft storage suite");
}

fn log_id(term: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, 1), index)
}

fn normal(term: u64, index: u64, value: &str) -> Entry<C> {
    Entry {
        log_id: log_id(term, index),
        payload: EntryPayload::Normal(Batch::new(vec![LogCommand::append(value)])),
    }
}

#[tokio::test]
async fn log_vote_and_snapshot_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = storage::open::<LogMachine>(dir.path()).unwrap();
        assert!(!s.recovered);
        let mut log = s.log;
        let mut sm = s.state_machine;
        let membership = Entry::<C> {
            log_id: log_id(1, 1),
            payload: EntryPayload::Membership(Membership::new(
                vec![BTreeSet::from([1, 2, 3])],
                None,
            )),
        };
        let entries = vec![
            membership,
            normal(1, 2, "a"),
            normal(1, 3, "b"),
            normal(1, 4, "c"),
        ];
        log.blocking_append(entries.clone()).await.unwrap();
        log.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
        log.save_committed(Some(log_id(1, 4))).await.unwrap();
        // Apply the first three and snapshot there; entry 4 stays only in the log.
        let outputs = sm.apply(entries[..3].to_vec()).await.unwrap();
        assert_eq!(outputs[2].outputs, vec![2]);
        let snap = sm
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();
        assert_eq!(snap.meta.last_log_id, Some(log_id(1, 3)));
        log.purge(log_id(1, 2)).await.unwrap();
    }
    let s = storage::open::<LogMachine>(dir.path()).unwrap();
    assert!(s.recovered);
    let mut log = s.log;
    let mut sm = s.state_machine;
    assert_eq!(
        log.read_vote().await.unwrap(),
        Some(Vote::new_committed(1, 1))
    );
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(1, 4)));
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id, Some(log_id(1, 2)));
    assert_eq!(state.last_log_id, Some(log_id(1, 4)));
    let remaining = log.try_get_log_entries(0..10).await.unwrap();
    assert_eq!(
        remaining.iter().map(|e| e.log_id.index).collect::<Vec<_>>(),
        vec![3, 4]
    );
    // The state machine restarts from the snapshot: applied up to 3, with the membership.
    let (applied, membership) = sm.applied_state().await.unwrap();
    assert_eq!(applied, Some(log_id(1, 3)));
    assert_eq!(membership.log_id(), &Some(log_id(1, 1)));
    let (log_values, index) = sm.reader().read(|s| s.log.clone()).await;
    assert_eq!(index, 3);
    assert_eq!(log_values, vec!["a", "b"]);
    // openraft re-applies the committed tail (entry 4) from the log on startup.
    sm.apply(remaining[1..].to_vec()).await.unwrap();
    assert_eq!(
        sm.reader().read(|s| s.log.clone()).await.0,
        vec!["a", "b", "c"]
    );
    let current = sm
        .get_current_snapshot()
        .await
        .unwrap()
        .expect("snapshot persisted");
    assert_eq!(current.meta.last_log_id, Some(log_id(1, 3)));
    let _ = BasicNode::default();
}

#[tokio::test]
async fn installed_snapshot_replaces_state_and_persists() {
    let leader_dir = tempfile::tempdir().unwrap();
    let follower_dir = tempfile::tempdir().unwrap();
    let mut leader = storage::open::<LogMachine>(leader_dir.path())
        .unwrap()
        .state_machine;
    leader
        .apply(vec![normal(2, 1, "x"), normal(2, 2, "y")])
        .await
        .unwrap();
    let snap = leader
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    {
        let mut follower = storage::open::<LogMachine>(follower_dir.path())
            .unwrap()
            .state_machine;
        follower.apply(vec![normal(1, 1, "stale")]).await.unwrap();
        let mut watch = follower.reader().subscribe();
        follower
            .install_snapshot(&snap.meta, snap.snapshot)
            .await
            .unwrap();
        assert_eq!(*watch.borrow_and_update(), 2);
        assert_eq!(
            follower.reader().read(|s| s.log.clone()).await.0,
            vec!["x", "y"]
        );
    }
    let reopened = reopen(follower_dir.path()).await.state_machine;
    assert_eq!(
        reopened.reader().read(|s| s.log.clone()).await.0,
        vec!["x", "y"]
    );
}

/// Open storage whose previous handle was just dropped: sled's background flusher may hold the
/// directory's lock for a moment after the last handle goes (a new process never sees that).
/// Waits for the lock (at most 5 s); any other error fails at once.
async fn reopen(dir: &std::path::Path) -> storage::Storage<LogMachine> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match storage::open::<LogMachine>(dir) {
            Ok(s) => return s,
            Err(e)
                if e.to_string().contains("acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("reopening {}: {e}", dir.display()),
        }
    }
}

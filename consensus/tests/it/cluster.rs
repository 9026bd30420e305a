//! Multi-node behaviour over real tonic on 127.0.0.1 (OS-chosen ports, one tempdir per node).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use crate::common::Cluster;
use crate::common::ELECTION_MAX;
use crate::common::HEARTBEAT;
use crate::common::SERIAL;
use crate::common::wait_watch;
use crate::common::within;
use consensus::ConsensusConfig;
use consensus::testkit::LogCommand;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);

/// Proposes `values` concurrently, round-robin over `proposers`; returns the outputs.
async fn propose_all(cluster: &Cluster, proposers: &[u64], values: Vec<String>) -> Vec<u64> {
    let mut futs = FuturesUnordered::new();
    for (i, v) in values.into_iter().enumerate() {
        let node = cluster.node(proposers[i % proposers.len()]);
        futs.push(async move { node.propose(LogCommand::append(v)).await });
    }
    let mut outputs = Vec::new();
    while let Some(r) = futs.next().await {
        outputs.push(r.unwrap());
    }
    outputs
}

async fn leader_applied(cluster: &Cluster, leader: u64) -> u64 {
    cluster.node(leader).local_read(|_| ()).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_elect_leader_and_apply_1000_proposals_in_the_same_order() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader(WAIT).await;
    let m = cluster.node(leader).metrics().await;
    assert_eq!(m.voters, vec![1, 2, 3]);
    assert_eq!(m.state, "Leader");

    // Proposals from all three nodes: followers forward to the leader.
    let values: Vec<String> = (0..1000).map(|i| format!("v{i}")).collect();
    let started = Instant::now();
    let outputs = within(
        WAIT,
        "1000 proposals",
        propose_all(&cluster, &[1, 2, 3], values.clone()),
    )
    .await;
    let elapsed = started.elapsed();
    // Every command got a distinct position 1..=1000: each was applied exactly once.
    let positions: BTreeSet<u64> = outputs.iter().copied().collect();
    assert_eq!(positions, (1..=1000).collect::<BTreeSet<u64>>());

    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    let reference = &logs[&leader];
    assert_eq!(reference.len(), 1000);
    for (id, log) in &logs {
        assert_eq!(log, reference, "node {id} applied a different sequence");
    }
    let applied: BTreeSet<&String> = reference.iter().collect();
    assert_eq!(applied, values.iter().collect::<BTreeSet<_>>());
    // Batching: far fewer log entries than commands.
    let m = cluster.node(leader).metrics().await;
    eprintln!(
        "1000 proposals in {elapsed:?}; leader last_log_index={:?} commit={:?}",
        m.last_log_index, m.commit_index
    );
    assert!(m.last_log_index.unwrap() < 1000, "{m:?}");
    assert_eq!(m.apply_lag, 0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_propose_is_forwarded_and_follower_reads_are_linearizable() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader(WAIT).await;
    let follower = cluster.follower(leader);

    let out = cluster
        .node(follower)
        .propose(LogCommand::Append {
            key: Some("k".into()),
            value: "from-follower".into(),
        })
        .await
        .unwrap();
    assert_eq!(out, 1);
    // The leader applied it (it answered the forwarded write).
    let on_leader = cluster
        .node(leader)
        .local_read(|s| s.kv.get("k").cloned())
        .await
        .0;
    assert_eq!(on_leader.as_deref(), Some("from-follower"));

    // A write through the leader is visible to a linearizable read on every follower at once.
    cluster
        .node(leader)
        .propose(LogCommand::Append {
            key: Some("k".into()),
            value: "second".into(),
        })
        .await
        .unwrap();
    for id in cluster.nodes.keys() {
        let v = cluster
            .node(*id)
            .linearizable_read(|s| s.kv.get("k").cloned())
            .await
            .unwrap();
        assert_eq!(v.as_deref(), Some("second"), "node {id}");
    }

    // Status is JSON-serializable and reports every member; the leader sees replication.
    let status = cluster.node(leader).status().await;
    let json = serde_json::to_value(&status).unwrap();
    assert_eq!(json["metrics"]["leader"], leader);
    assert_eq!(status.members.len(), 3);
    assert!(
        status
            .members
            .iter()
            .all(|m| m.voter && m.matched_index.is_some())
    );
    let remote = cluster
        .node(follower)
        .remote_status(leader, &cluster.addrs[&leader])
        .await
        .unwrap();
    assert_eq!(remote.metrics.node_id, leader);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_loss_elects_new_leader_within_two_election_timeouts_without_losing_commits() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(3).await;
    let old = cluster.wait_leader(WAIT).await;
    let values: Vec<String> = (0..200).map(|i| format!("before-{i}")).collect();
    propose_all(&cluster, &[1, 2, 3], values.clone()).await;

    cluster.stop(old).await;
    let stopped = Instant::now();
    let deadline = stopped + WAIT;
    let mut rx = cluster.nodes.values().next().unwrap().raft().metrics();
    let new = wait_watch(&mut rx, deadline, |m| {
        m.current_leader.filter(|l| *l != old)
    })
    .await;
    let failover = stopped.elapsed();
    eprintln!("failover took {failover:?} (election timeout max {ELECTION_MAX:?})");
    assert_ne!(new, old);
    // openraft 0.9: a follower that knew a leader waits its leader lease (= election timeout
    // max) plus a randomized election timeout (<= max) before campaigning, checked on a tick of
    // 1.5 heartbeats. So "two election timeouts" is lease + timeout, plus at most one tick.
    // That is the target, printed; a split vote adds a round (seen once on CI: 856 ms), so the
    // test enforces twice the target — the same policy as the multi-process test in `chaos`.
    let target = 2 * ELECTION_MAX + HEARTBEAT * 3 / 2;
    eprintln!(
        "failover target {target:?}: {}",
        if failover <= target { "met" } else { "MISSED" }
    );
    assert!(
        failover <= 2 * target,
        "new leader after {failover:?}, more than twice the target ({target:?})"
    );
    let agreed = cluster.wait_leader(WAIT).await;
    assert_eq!(agreed, new);

    // The two survivors keep committing, and every entry committed before is still there.
    let after: Vec<String> = (0..50).map(|i| format!("after-{i}")).collect();
    let survivors: Vec<u64> = cluster.nodes.keys().copied().collect();
    propose_all(&cluster, &survivors, after.clone()).await;
    let index = leader_applied(&cluster, new).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    for (id, log) in &logs {
        assert_eq!(log.len(), 250, "node {id}");
        let set: BTreeSet<&String> = log.iter().collect();
        for v in values.iter().chain(after.iter()) {
            assert!(set.contains(v), "node {id} lost {v}");
        }
    }
    assert_eq!(logs[&survivors[0]], logs[&survivors[1]]);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_node_reopens_its_data_and_catches_up() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader(WAIT).await;
    let follower = cluster.follower(leader);
    propose_all(
        &cluster,
        &[leader],
        (0..100).map(|i| format!("a{i}")).collect(),
    )
    .await;
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;

    cluster.stop(follower).await;
    propose_all(
        &cluster,
        &[leader],
        (0..300).map(|i| format!("b{i}")).collect(),
    )
    .await;
    cluster.restart(follower).await;
    // Restart did not bootstrap a new cluster: same voters, same leader.
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    assert_eq!(logs[&follower].len(), 400);
    assert_eq!(logs[&follower], logs[&leader]);
    let m = cluster.node(follower).metrics().await;
    assert_eq!(m.voters, vec![1, 2, 3]);
    assert_eq!(m.leader, Some(leader));
    cluster.shutdown().await;
}

/// The lowest member — the one that bootstraps a new cluster — back with an empty data dir
/// while the others run: it finds the running cluster, does not bootstrap a rival one (no vote
/// for itself, no election disturbing the leader) and the leader brings it up to date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lowest_member_back_with_an_empty_log_rejoins_without_an_election() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(3).await;
    let mut leader = cluster.wait_leader(WAIT).await;
    if leader == 1 {
        cluster.stop(1).await;
        cluster.wait_leader(WAIT).await;
        cluster.restart(1).await;
        leader = cluster.wait_leader(WAIT).await;
    }
    assert_ne!(leader, 1);
    propose_all(
        &cluster,
        &[leader],
        (0..100).map(|i| format!("a{i}")).collect(),
    )
    .await;
    let term = cluster.node(leader).metrics().await.term;

    cluster.stop(1).await;
    cluster.dirs.insert(1, tempfile::tempdir().unwrap());
    cluster.restart(1).await;
    // Watch node 1 from its start: did it bootstrap, or ever vote for itself?
    let mut rx = cluster.node(1).raft().metrics();
    let self_votes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let watcher = tokio::spawn({
        let seen = self_votes.clone();
        async move {
            loop {
                let (vote, membership, leader) = {
                    let m = rx.borrow_and_update();
                    (m.vote, *m.membership_config.log_id(), m.current_leader)
                };
                if vote.leader_id().voted_for() == Some(1) {
                    seen.lock().unwrap().push(format!("vote {vote}"));
                }
                // A bootstrap writes a membership before any leader is heard of; joining, the
                // membership comes with the leader's log.
                if membership.is_some() && leader.is_none() {
                    seen.lock()
                        .unwrap()
                        .push(format!("membership {membership:?} without a leader"));
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }
    });
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    assert_eq!(logs[&1], logs[&leader]);
    assert_eq!(logs[&1].len(), 100);
    let m = cluster.node(1).metrics().await;
    assert_eq!((m.leader, m.voters.clone()), (Some(leader), vec![1, 2, 3]));
    // A second more for a late campaign.
    tokio::time::sleep(Duration::from_secs(1)).await;
    watcher.abort();
    assert_eq!(
        *self_votes.lock().unwrap(),
        Vec::<String>::new(),
        "node 1 bootstrapped or campaigned"
    );
    assert_eq!(
        cluster.node(leader).metrics().await.term,
        term,
        "the leader was disturbed"
    );
    cluster.shutdown().await;
}

fn compact_often(cfg: &mut ConsensusConfig) {
    cfg.snapshot.logs_since_last = 50;
    cfg.snapshot.keep_logs_after_snapshot = 0;
    // Force a multi-chunk snapshot transfer.
    cfg.snapshot.chunk_bytes = 1024;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_node_joins_as_learner_via_snapshot_after_compaction_and_is_promoted() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start_with(3, compact_often).await;
    let leader = cluster.wait_leader(WAIT).await;
    // One proposal at a time so each is its own log entry and the log really grows.
    for i in 0..150 {
        cluster
            .node(leader)
            .propose(LogCommand::append(format!(
                "entry-with-some-padding-{i:04}"
            )))
            .await
            .unwrap();
    }
    // Wait until the leader compacted: its log no longer starts at 1.
    let deadline = Instant::now() + WAIT;
    let mut rx = cluster.node(leader).raft().metrics();
    let purged = wait_watch(&mut rx, deadline, |m| {
        m.purged.filter(|p| p.index >= 100).map(|p| p.index)
    })
    .await;
    eprintln!("leader purged up to {purged}");

    cluster.start_joiner(4).await;
    let addr = cluster.addrs[&4].clone();
    within(
        WAIT,
        "add_learner",
        cluster.node(leader).add_learner(4, addr, true),
    )
    .await
    .unwrap();
    let index = leader_applied(&cluster, leader).await;
    cluster.node(4).wait_applied(index, WAIT).await.unwrap();
    let m4 = cluster.node(4).metrics().await;
    assert!(
        m4.snapshot_index.is_some_and(|s| s >= purged),
        "learner must have received a snapshot: {m4:?}"
    );
    assert_eq!(m4.learners, vec![4]);

    // Promote through a follower: the admin request is forwarded to the leader.
    let follower = cluster.follower(leader);
    within(WAIT, "promote", cluster.node(follower).promote(4))
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut rx = cluster.node(4).raft().metrics();
    wait_watch(&mut rx, deadline, |m| {
        m.membership_config
            .membership()
            .voter_ids()
            .any(|v| v == 4)
            .then_some(())
    })
    .await;

    // The new voter takes part in commits and holds the same sequence.
    cluster
        .node(4)
        .propose(LogCommand::append("after-join"))
        .await
        .unwrap();
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    assert_eq!(logs[&4].len(), 151);
    assert_eq!(logs[&4], logs[&leader]);

    // And it can be removed again.
    within(WAIT, "remove", cluster.node(leader).remove(4))
        .await
        .unwrap();
    let m = cluster.node(leader).metrics().await;
    assert_eq!(m.voters, vec![1, 2, 3]);
    assert!(m.learners.is_empty());
    cluster.shutdown().await;
}

/// Log entries are bounded by the peer message limit and appends are split by size: one
/// proposal over the entry bound is refused (`TooLarge`, nothing proposed, from the leader or a
/// follower), and entries that together exceed the limit reach the followers over several
/// appends — every one commits on every node, replication goes on. (Here a 1 MiB message
/// limit, 20 concurrent values of 200 KiB: entries of up to 4 values, each append split.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_proposal_is_refused_and_appends_are_split_by_size() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start_with(3, |c| c.max_message_bytes = 1 << 20).await;
    let leader = cluster.wait_leader(WAIT).await;
    let limit = cluster.node(leader).max_entry_bytes();
    assert_eq!(limit, (1 << 20) - (64 << 10));
    for node in [leader, cluster.follower(leader)] {
        let err = cluster
            .node(node)
            .propose(LogCommand::append("x".repeat(limit + 1)))
            .await
            .unwrap_err();
        assert!(
            matches!(err, consensus::ConsensusError::TooLarge { limit: l, .. } if l == limit),
            "{err}"
        );
    }
    let values: Vec<String> = (0..20)
        .map(|i| format!("{i:0>2}{}", "v".repeat(204_798)))
        .collect();
    let outputs = within(
        WAIT,
        "20 proposals of 200 KiB",
        propose_all(&cluster, &[1, 2, 3], values.clone()),
    )
    .await;
    assert_eq!(outputs.len(), 20);
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    let logs = cluster.logs().await;
    for (id, log) in &logs {
        assert_eq!(log.len(), 20, "node {id}");
        assert!(log.iter().all(|v| v.len() == 204_800), "node {id}");
    }
    // After all that, small proposals still commit everywhere.
    let outputs = within(
        WAIT,
        "small proposals",
        propose_all(&cluster, &[1, 2, 3], vec!["a".into(), "b".into()]),
    )
    .await;
    assert_eq!(outputs.len(), 2);
    let index = leader_applied(&cluster, leader).await;
    cluster.wait_all_applied(index, WAIT).await;
    cluster.shutdown().await;
}

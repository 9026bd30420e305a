//! Test harness: several consensus nodes in one process over real tonic on 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use consensus::ConsensusConfig;
use consensus::ConsensusNode;
use consensus::NodeId;
use consensus::config::SnapshotConfig;
use consensus::testkit::LogMachine;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::time::Instant;

pub type Node = ConsensusNode<LogMachine>;

pub const ELECTION_MIN: Duration = Duration::from_millis(150);
pub const ELECTION_MAX: Duration = Duration::from_millis(300);
pub const HEARTBEAT: Duration = Duration::from_millis(50);

/// Cluster tests run one at a time: on a 2-core machine several clusters fsyncing in parallel
/// starve each other's timers and make elections flap.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

pub fn config(id: NodeId, dir: &TempDir, members: &BTreeMap<NodeId, String>) -> ConsensusConfig {
    ConsensusConfig {
        node_id: id,
        data_dir: dir.path().to_path_buf(),
        initial_members: members.clone(),
        election_timeout_min: ELECTION_MIN,
        election_timeout_max: ELECTION_MAX,
        heartbeat_interval: HEARTBEAT,
        rpc_timeout: Duration::from_secs(2),
        propose_timeout: Duration::from_secs(5),
        snapshot: SnapshotConfig {
            logs_since_last: 100_000,
            keep_logs_after_snapshot: 0,
            chunk_bytes: 64 * 1024,
            chunk_timeout: Duration::from_secs(2),
        },
        ..ConsensusConfig::default()
    }
}

pub struct Cluster {
    pub nodes: BTreeMap<NodeId, Node>,
    pub dirs: BTreeMap<NodeId, TempDir>,
    pub addrs: BTreeMap<NodeId, String>,
    pub members: BTreeMap<NodeId, String>,
    pub tweak: fn(&mut ConsensusConfig),
}

fn no_tweak(_: &mut ConsensusConfig) {}

impl Cluster {
    /// Starts `n` voters (ids 1..=n) and waits for a leader.
    pub async fn start(n: u64) -> Self {
        Self::start_with(n, no_tweak).await
    }

    pub async fn start_with(n: u64, tweak: fn(&mut ConsensusConfig)) -> Self {
        init_tracing();
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for id in 1..=n {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            addrs.insert(id, l.local_addr().unwrap().to_string());
            listeners.insert(id, l);
        }
        let mut cluster = Cluster {
            nodes: BTreeMap::new(),
            dirs: BTreeMap::new(),
            addrs: addrs.clone(),
            members: addrs,
            tweak,
        };
        for (id, listener) in listeners {
            let dir = tempfile::tempdir().unwrap();
            let mut cfg = config(id, &dir, &cluster.members);
            (cluster.tweak)(&mut cfg);
            let node = Node::start(cfg, listener).await.unwrap();
            cluster.nodes.insert(id, node);
            cluster.dirs.insert(id, dir);
        }
        cluster.wait_leader(Duration::from_secs(10)).await;
        cluster
    }

    /// Starts a node that is not in the initial membership (to be added as a learner).
    pub async fn start_joiner(&mut self, id: NodeId) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addrs
            .insert(id, listener.local_addr().unwrap().to_string());
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(id, &dir, &BTreeMap::new());
        (self.tweak)(&mut cfg);
        let node = Node::start(cfg, listener).await.unwrap();
        self.nodes.insert(id, node);
        self.dirs.insert(id, dir);
    }

    /// Shuts a node down (its data dir is kept).
    pub async fn stop(&mut self, id: NodeId) {
        let node = self.nodes.remove(&id).unwrap();
        node.shutdown().await.unwrap();
    }

    /// Restarts a stopped node from its data dir on its old address.
    /// The store's file lock may outlive the stopped node by a moment: retried for 5 s.
    pub async fn restart(&mut self, id: NodeId) {
        let addr = self.addrs[&id].clone();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let listener = TcpListener::bind(&addr).await.unwrap();
            let mut cfg = config(id, &self.dirs[&id], &self.members);
            (self.tweak)(&mut cfg);
            match Node::start(cfg, listener).await {
                Ok(node) => {
                    self.nodes.insert(id, node);
                    return;
                }
                Err(e) if Instant::now() < deadline && e.to_string().contains("lock") => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("node {id} did not restart: {e}"),
            }
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[&id]
    }

    /// Waits until every running voter agrees on one running leader; returns it.
    pub async fn wait_leader(&self, timeout: Duration) -> NodeId {
        let deadline = Instant::now() + timeout;
        loop {
            let leaders: Vec<Option<NodeId>> = self
                .nodes
                .values()
                .map(|n| n.raft().metrics().borrow().current_leader)
                .collect();
            if let Some(Some(leader)) = leaders.first().copied()
                && leaders.iter().all(|l| *l == Some(leader))
                && self.nodes.get(&leader).is_some_and(|n| {
                    n.raft().metrics().borrow().state == openraft::ServerState::Leader
                })
            {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "no agreed leader within {timeout:?}: {leaders:?}"
            );
            // Wait for the next metrics change on any node instead of spinning.
            let mut rxs: Vec<_> = self.nodes.values().map(|n| n.raft().metrics()).collect();
            let changes = rxs.iter_mut().map(|rx| Box::pin(rx.changed()));
            let _ = tokio::time::timeout_at(deadline, futures::future::select_all(changes)).await;
        }
    }

    pub fn follower(&self, leader: NodeId) -> NodeId {
        *self.nodes.keys().find(|id| **id != leader).unwrap()
    }

    /// Waits until every running node has applied at least `index`.
    pub async fn wait_all_applied(&self, index: u64, timeout: Duration) {
        for (id, node) in &self.nodes {
            node.wait_applied(index, timeout)
                .await
                .unwrap_or_else(|e| panic!("node {id} did not apply {index}: {e}"));
        }
    }

    pub async fn logs(&self) -> BTreeMap<NodeId, Vec<String>> {
        let mut out = BTreeMap::new();
        for (id, node) in &self.nodes {
            out.insert(*id, node.local_read(|s| s.log.clone()).await.0);
        }
        out
    }

    pub async fn shutdown(self) {
        for (_, node) in self.nodes {
            node.shutdown().await.unwrap();
        }
    }
}

/// Waits until `f` returns `Some` for the watched value, panicking at `deadline`.
pub async fn wait_watch<T: Clone, R>(
    rx: &mut tokio::sync::watch::Receiver<T>,
    deadline: Instant,
    mut f: impl FnMut(&T) -> Option<R>,
) -> R {
    loop {
        if let Some(r) = f(&rx.borrow_and_update()) {
            return r;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("watch closed"),
            Err(_) => panic!("condition not met before deadline"),
        }
    }
}

/// Runs `fut` with a deadline, panicking with `what` on timeout.
pub async fn within<T>(d: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(d, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {d:?}"))
}

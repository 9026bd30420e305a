//! The settings of cluster mode (`epp serve --peers/--join …`): membership, the peer exchange
//! and cluster-wide flow control.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use consensus::ConsensusConfig;
use serde::Serialize;

/// `epp serve` flags of cluster mode.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub node_id: u64,
    /// Where the peer gRPC server binds (port 0 = OS-chosen).
    pub peer_addr: std::net::SocketAddr,
    /// Address peers use for this replica; default: the bound peer address.
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    /// Initial voters (`id → host:port`) for the one-time bootstrap; empty to join later.
    pub peers: BTreeMap<u64, String>,
    /// Local dialing overrides (advertised address → address dialed).
    pub peer_routes: BTreeMap<String, String>,
    pub election_timeout: (Duration, Duration),
    pub raft_heartbeat: Duration,
    /// Liveness heartbeat period; the lease lasts three of them.
    pub heartbeat: Duration,
    /// Snapshot (and compact the log) after this many entries; `None` = the consensus default.
    pub snapshot_logs: Option<u64>,
    /// Peer TLS (PEM files); mutual when a CA is given.
    pub tls: Option<consensus::TlsConfig>,
    /// Peer exchange settings (prefix-index deltas, scrape fan-out).
    pub gossip: GossipOptions,
    /// Replicate the approximate prefix index to the other replicas (off: each replica keeps its
    /// own, as llm-d does).
    pub prefix_replication: bool,
    /// Replicas scraping each pod (rendezvous owners); 0 = every replica scrapes every pod.
    pub scrape_owners: usize,
    /// Flow control (when the `flowControl` gate is on) for the whole cluster — one global queue
    /// and ledger — or per replica as llm-d does (`--flow-control-scope replica`).
    pub global_flow: bool,
    /// Requests the cluster may admit on local credit beyond the replicated ledger.
    pub flow_credit_slack: u32,
    /// What a replica without quorum does with new requests.
    pub flow_partition: PartitionMode,
    /// Without quorum, how long a request beyond the local share waits before 429.
    pub flow_degraded_wait: Duration,
    /// Not a member some seconds after start: ask `peers` to add this replica (a voter while
    /// the cluster has fewer than [`MAX_VOTERS`], else a learner).
    pub auto_join: bool,
    /// Remove a member that is not in `peers` once it has been dead this long (a StatefulSet
    /// scaled down); `None`: never.
    pub remove_departed_after: Option<Duration>,
    /// The cluster features this replica's heartbeats advertise (`flowctl::cluster::FEATURE_*`):
    /// all this build speaks, or — in tests — fewer, standing in for an older build.
    pub features: u32,
}

/// Voters a self-joining replica makes the cluster grow to; beyond, joiners stay learners.
pub const MAX_VOTERS: usize = 5;

impl ClusterOptions {
    pub(super) fn consensus_config(&self) -> ConsensusConfig {
        let mut snapshot = consensus::config::SnapshotConfig::default();
        if let Some(n) = self.snapshot_logs {
            snapshot.logs_since_last = n;
            snapshot.keep_logs_after_snapshot = n / 10;
        }
        ConsensusConfig {
            snapshot,
            node_id: self.node_id,
            advertise_addr: self.advertise.clone().unwrap_or_default(),
            data_dir: self.data_dir.clone(),
            initial_members: self.peers.clone(),
            cluster_name: "epp".into(),
            election_timeout_min: self.election_timeout.0,
            election_timeout_max: self.election_timeout.1,
            heartbeat_interval: self.raft_heartbeat,
            peer_routes: self.peer_routes.clone(),
            tls: self.tls.clone(),
            ..ConsensusConfig::default()
        }
    }

    pub fn lease_ms(&self) -> u64 {
        (self.heartbeat * 3).as_millis() as u64
    }
}

/// Prefix-index replication settings (`epp serve --prefix-gossip-*`).
#[derive(Debug, Clone)]
pub struct GossipOptions {
    /// How often the outbox is flushed to the peers.
    pub interval: Duration,
    /// Anti-entropy period per peer.
    pub anti_entropy: Duration,
    /// Delta batches queued per peer before batches are dropped (and anti-entropy repairs).
    pub peer_queue: usize,
    /// Entries the outbox holds before it overflows (dropped; anti-entropy repairs).
    pub max_outbox_entries: usize,
    /// Entries one anti-entropy message carries at most (the rest follows in later rounds).
    pub max_sync_entries: usize,
    /// Time limit of one push or sync call.
    pub rpc_timeout: Duration,
    /// How often owned pods' samples are fanned out.
    pub samples_interval: Duration,
}

impl Default for GossipOptions {
    fn default() -> Self {
        GossipOptions {
            interval: Duration::from_millis(5),
            anti_entropy: Duration::from_secs(1),
            peer_queue: 256,
            max_outbox_entries: 1 << 20,
            max_sync_entries: 1 << 18,
            rpc_timeout: Duration::from_secs(2),
            samples_interval: Duration::from_millis(50),
        }
    }
}

/// What a replica cut off from the quorum does with new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionMode {
    /// Admit while its own degraded admissions running (plus what it had admitted unreported
    /// when it lost the quorum) are fewer than its last credit.
    LocalShare,
    /// 429 `rejected-saturated` for every new request.
    FailClosed,
}

impl std::str::FromStr for PartitionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local-share" => Ok(PartitionMode::LocalShare),
            "fail-closed" => Ok(PartitionMode::FailClosed),
            other => Err(format!(
                "expected local-share or fail-closed, got `{other}`"
            )),
        }
    }
}

/// Parse `1=host:port,2=host:port`.
pub fn parse_peers(s: &str) -> Result<BTreeMap<u64, String>, String> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("peer `{part}`: expected <id>=<host:port>"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("peer `{part}`: id must be a number"))?;
        if !addr.contains(':') {
            return Err(format!("peer `{part}`: address needs a port"));
        }
        if out.insert(id, addr.trim().to_string()).is_some() {
            return Err(format!("peer id {id} given twice"));
        }
    }
    Ok(out)
}

/// Parse `advertised=dialed,...` routes.
pub fn parse_routes(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (from, to) = part
            .split_once('=')
            .ok_or_else(|| format!("route `{part}`: expected <advertised>=<dialed>"))?;
        out.insert(from.trim().to_string(), to.trim().to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_lists() {
        let p = parse_peers("1=127.0.0.1:7001, 2=10.0.0.2:7001").unwrap();
        assert_eq!(p[&2], "10.0.0.2:7001");
        assert!(parse_peers("1=a:1,1=b:2").unwrap_err().contains("twice"));
        assert!(parse_peers("x=a:1").unwrap_err().contains("number"));
        assert!(parse_peers("1=nohost").unwrap_err().contains("port"));
        let r = parse_routes("127.0.0.1:1=127.0.0.1:2").unwrap();
        assert_eq!(r["127.0.0.1:1"], "127.0.0.1:2");
    }
}

//! Configuration of a consensus node: typed, defaults in one place, `validate()` before binding.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde::Serialize;

use crate::types::NodeId;

/// What an AppendEntries of one entry carries besides it (vote, log ids, framing), bounded
/// generously.
pub(crate) const APPEND_ENVELOPE_BYTES: usize = 64 * 1024;
/// The smallest entry bound a configuration may leave.
const MIN_ENTRY_BYTES: usize = 1024;

/// Configuration of one consensus node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsensusConfig {
    /// This node's Raft id; stable across restarts.
    pub node_id: NodeId,
    /// Address (`host:port`) peers use to reach this node's peer gRPC server. Empty: the local
    /// address of the listener passed to `ConsensusNode::start`.
    pub advertise_addr: String,
    /// Directory of the sled database; created if missing.
    pub data_dir: PathBuf,
    /// Initial voters (`id -> host:port`, including this node) used to bootstrap a new cluster.
    /// Only the lowest id bootstraps, and only when its data directory is empty; restarted
    /// nodes reopen their data and ignore this. Leave empty for a node that will join an
    /// existing cluster via `add_learner`.
    pub initial_members: BTreeMap<NodeId, String>,
    /// Cluster name (appears in openraft's tracing spans).
    pub cluster_name: String,
    /// Minimum election timeout.
    #[serde(with = "millis")]
    pub election_timeout_min: Duration,
    /// Maximum election timeout.
    #[serde(with = "millis")]
    pub election_timeout_max: Duration,
    /// Leader heartbeat interval; well below `election_timeout_min`. openraft 0.9 also uses it
    /// as the AppendEntries RPC timeout, so it must exceed a follower's p99 append latency
    /// (network round trip + fsync of the batch), or replication times out and retries.
    #[serde(with = "millis")]
    pub heartbeat_interval: Duration,
    /// Snapshot and log compaction policy.
    pub snapshot: SnapshotConfig,
    /// Timeout of forwarded proposals, reads and admin RPCs (replication RPC timeouts are
    /// derived by openraft from the heartbeat interval).
    #[serde(with = "millis")]
    pub rpc_timeout: Duration,
    /// TCP connect timeout to peers.
    #[serde(with = "millis")]
    pub connect_timeout: Duration,
    /// Upper bound of a `propose` call, including waiting for a leader.
    #[serde(with = "millis")]
    pub propose_timeout: Duration,
    /// Maximum commands coalesced into one log entry.
    pub max_batch: usize,
    /// Maximum proposal batches in flight at once (pipelining).
    pub max_in_flight_batches: usize,
    /// Maximum log entries per AppendEntries RPC.
    pub max_payload_entries: u64,
    /// Maximum gRPC message size (encode and decode), bytes.
    pub max_message_bytes: usize,
    /// Optional TLS for the peer gRPC server and clients.
    pub tls: Option<TlsConfig>,
    /// Local dialing overrides: advertised peer address (`host:port`, as in the membership) →
    /// the address this node actually dials (a local proxy, a NAT mapping). Test harnesses use it
    /// to put a controllable proxy on each directed link.
    pub peer_routes: BTreeMap<String, String>,
    /// Flush the log on the calling thread (blocking it) instead of on sled's flusher thread: for
    /// single-threaded simulations (`chaos/tests/it/dst.rs`), where a flush completing on another
    /// thread would tie the run to real time. Never for a deployment.
    #[serde(default)]
    pub inline_flush: bool,
}

/// When to snapshot and how much log to keep.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotConfig {
    /// Build a snapshot after this many log entries since the last one.
    pub logs_since_last: u64,
    /// Log entries kept after a snapshot (helps slightly lagging followers avoid a snapshot).
    pub keep_logs_after_snapshot: u64,
    /// Snapshot transfer chunk size, bytes (one InstallSnapshot RPC per chunk).
    pub chunk_bytes: u64,
    /// Timeout of one snapshot chunk RPC.
    #[serde(with = "millis")]
    pub chunk_timeout: Duration,
}

/// TLS for peer gRPC (mutual TLS when `ca_file` is set). PEM files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// This node's certificate chain.
    pub cert_file: PathBuf,
    /// This node's private key.
    pub key_file: PathBuf,
    /// CA bundle used to verify peers (server: client certificates; client: server
    /// certificates). Without it clients use no custom roots and servers do not require client
    /// certificates.
    pub ca_file: Option<PathBuf>,
    /// Server name clients expect in peer certificates (SNI / verification) when dialing a
    /// peer whose node id is not bound by `identity`. Defaults to the host part of the peer
    /// address.
    pub server_name: Option<String>,
    /// Node identity bound to certificates: a DNS-name template with `{id}` (e.g.
    /// `epp-node-{id}`) or `{ordinal}` (the id minus one: a StatefulSet pod's ordinal, for
    /// certificates named after pods, e.g. `epp-{ordinal}`). Set (needs `ca_file`), a peer's certificate must carry the name of
    /// the node id it acts as — the leader or candidate in Raft RPCs, a current member in
    /// forwarded writes and membership changes, the joining node in its own `add_learner` —
    /// and a node dialing peer `N` expects `N`'s name in the server certificate. `None`: any
    /// certificate the CA signed may act as any node.
    #[serde(default)]
    pub identity: Option<String>,
    /// How often the certificate, key and CA files are re-read; changed material is used for
    /// new connections (existing ones keep their session). Zero: never.
    #[serde(default = "default_reload", with = "millis")]
    pub reload_interval: Duration,
}

fn default_reload() -> Duration {
    Duration::from_secs(10)
}

impl TlsConfig {
    /// TLS from PEM files, no identity binding, reloaded every 10 s.
    pub fn new(cert_file: PathBuf, key_file: PathBuf, ca_file: Option<PathBuf>) -> Self {
        Self {
            cert_file,
            key_file,
            ca_file,
            server_name: None,
            identity: None,
            reload_interval: default_reload(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let Some(template) = &self.identity else {
            return Ok(());
        };
        if template.matches("{id}").count() + template.matches("{ordinal}").count() != 1 {
            return Err(invalid(
                "tls.identity",
                format!("`{template}` must contain `{{id}}` or `{{ordinal}}` exactly once"),
            ));
        }
        if self.ca_file.is_none() {
            return Err(invalid(
                "tls.identity",
                "binding node ids to certificates needs `ca_file` (mutual TLS)",
            ));
        }
        let name = identity_name(template, 1);
        if crate::network::tls::dns_name(&name).is_none() {
            return Err(invalid(
                "tls.identity",
                format!("`{template}` does not make DNS names (`{name}`)"),
            ));
        }
        Ok(())
    }

    /// The name `identity` gives node `id`, if identities are bound.
    pub fn identity_of(&self, id: NodeId) -> Option<String> {
        self.identity.as_deref().map(|t| identity_name(t, id))
    }
}

/// Node `id`'s name under an identity `template`: `{id}` is the id, `{ordinal}` the id minus
/// one (node ids from StatefulSet pod names are the ordinal plus one; a configuration with
/// `{ordinal}` and node 0 is refused).
pub fn identity_name(template: &str, id: NodeId) -> String {
    let ordinal = i128::from(id) - 1;
    template
        .replace("{id}", &id.to_string())
        .replace("{ordinal}", &ordinal.to_string())
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        Self {
            logs_since_last: 10_000,
            keep_logs_after_snapshot: 1_000,
            chunk_bytes: 1024 * 1024,
            chunk_timeout: Duration::from_secs(5),
        }
    }
}

impl Default for ConsensusConfig {
    fn default() -> Self {
        Self {
            node_id: 0,
            advertise_addr: String::new(),
            data_dir: PathBuf::new(),
            initial_members: BTreeMap::new(),
            cluster_name: "epp".to_string(),
            election_timeout_min: Duration::from_millis(750),
            election_timeout_max: Duration::from_millis(1500),
            heartbeat_interval: Duration::from_millis(150),
            snapshot: SnapshotConfig::default(),
            rpc_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_millis(500),
            propose_timeout: Duration::from_secs(5),
            max_batch: 1024,
            max_in_flight_batches: 4,
            max_payload_entries: 300,
            max_message_bytes: 16 * 1024 * 1024,
            tls: None,
            peer_routes: BTreeMap::new(),
            inline_flush: false,
        }
    }
}

/// A configuration value is out of range or inconsistent.
#[derive(Debug, thiserror::Error)]
#[error("invalid consensus config `{field}`: {reason}")]
pub struct ConfigError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        reason: reason.into(),
    }
}

impl ConsensusConfig {
    /// Checks the configuration; call before binding anything.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must be set"));
        }
        if self.election_timeout_min.is_zero()
            || self.election_timeout_min >= self.election_timeout_max
        {
            return Err(invalid(
                "election_timeout_min",
                format!(
                    "must be > 0 and < election_timeout_max ({:?} vs {:?})",
                    self.election_timeout_min, self.election_timeout_max
                ),
            ));
        }
        if self.heartbeat_interval.is_zero() || self.heartbeat_interval >= self.election_timeout_min
        {
            return Err(invalid(
                "heartbeat_interval",
                "must be > 0 and < election_timeout_min",
            ));
        }
        if !self.initial_members.is_empty() && !self.initial_members.contains_key(&self.node_id) {
            return Err(invalid(
                "initial_members",
                format!(
                    "must include this node ({}) when set; leave empty to join later",
                    self.node_id
                ),
            ));
        }
        if self.initial_members.values().any(|a| a.is_empty()) {
            return Err(invalid("initial_members", "addresses must not be empty"));
        }
        for (field, d) in [
            ("rpc_timeout", self.rpc_timeout),
            ("connect_timeout", self.connect_timeout),
            ("propose_timeout", self.propose_timeout),
            ("snapshot.chunk_timeout", self.snapshot.chunk_timeout),
        ] {
            if d.is_zero() {
                return Err(invalid(field, "must be > 0"));
            }
        }
        if let Some(tls) = &self.tls {
            tls.validate()?;
            let ordinals = tls
                .identity
                .as_ref()
                .is_some_and(|t| t.contains("{ordinal}"));
            if ordinals && (self.node_id == 0 || self.initial_members.contains_key(&0)) {
                return Err(invalid(
                    "tls.identity",
                    "`{ordinal}` is the node id minus one: node ids start at 1",
                ));
            }
        }
        if self.max_batch == 0 {
            return Err(invalid("max_batch", "must be >= 1"));
        }
        if self.max_in_flight_batches == 0 {
            return Err(invalid("max_in_flight_batches", "must be >= 1"));
        }
        if self.max_payload_entries == 0 {
            return Err(invalid("max_payload_entries", "must be >= 1"));
        }
        if self.max_entry_bytes() < MIN_ENTRY_BYTES {
            return Err(invalid(
                "max_message_bytes",
                "must leave room for log entries of 1 KiB beside an append's envelope (64 KiB)",
            ));
        }
        if self.snapshot.logs_since_last == 0 {
            return Err(invalid("snapshot.logs_since_last", "must be >= 1"));
        }
        if self.snapshot.chunk_bytes == 0
            || self.snapshot.chunk_bytes as usize + 4096 > self.max_message_bytes
        {
            return Err(invalid(
                "snapshot.chunk_bytes",
                "must be > 0 and leave room under max_message_bytes",
            ));
        }
        Ok(())
    }

    /// The largest log entry (a batch of commands, encoded) a proposal may make: one entry with
    /// an append's envelope fits `max_message_bytes`. Appends of several entries are split by
    /// size to fit it too (the network layer sends the prefix that fits and reports a partial
    /// success), so no entry can stall replication by being too large to send.
    pub fn max_entry_bytes(&self) -> usize {
        self.max_message_bytes.saturating_sub(APPEND_ENVELOPE_BYTES)
    }

    /// The openraft configuration derived from this one.
    pub(crate) fn raft_config(&self) -> Result<openraft::Config, Box<openraft::ConfigError>> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        openraft::Config {
            cluster_name: self.cluster_name.clone(),
            election_timeout_min: ms(self.election_timeout_min),
            election_timeout_max: ms(self.election_timeout_max),
            heartbeat_interval: ms(self.heartbeat_interval),
            install_snapshot_timeout: ms(self.snapshot.chunk_timeout),
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot.logs_since_last),
            max_in_snapshot_log_to_keep: self.snapshot.keep_logs_after_snapshot,
            snapshot_max_chunk_size: self.snapshot.chunk_bytes,
            max_payload_entries: self.max_payload_entries,
            ..openraft::Config::default()
        }
        .validate()
        .map_err(Box::new)
    }
}

mod millis {
    use std::time::Duration;

    use serde::Deserialize;
    use serde::Deserializer;
    use serde::Serializer;

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn valid() -> ConsensusConfig {
        ConsensusConfig {
            node_id: 1,
            data_dir: "/tmp/x".into(),
            initial_members: BTreeMap::from([(1, "127.0.0.1:1".to_string())]),
            ..ConsensusConfig::default()
        }
    }

    #[test]
    fn defaults_with_data_dir_are_valid_and_map_to_openraft() {
        let c = valid();
        c.validate().unwrap();
        let rc = c.raft_config().unwrap();
        assert_eq!(rc.heartbeat_interval, 150);
        assert_eq!(rc.snapshot_max_chunk_size, 1024 * 1024);
    }

    #[test]
    fn rejects_inconsistent_values() {
        let mut c = valid();
        c.heartbeat_interval = c.election_timeout_min;
        assert_eq!(c.validate().unwrap_err().field, "heartbeat_interval");

        let mut c = valid();
        c.initial_members = BTreeMap::from([(2, "127.0.0.1:2".to_string())]);
        assert_eq!(c.validate().unwrap_err().field, "initial_members");

        let mut c = valid();
        c.data_dir = PathBuf::new();
        assert_eq!(c.validate().unwrap_err().field, "data_dir");
    }

    #[test]
    fn strict_decoding_rejects_unknown_fields() {
        let err =
            serde_json::from_str::<ConsensusConfig>(r#"{"node_id": 1, "bogus": 2}"#).unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
        let c: ConsensusConfig =
            serde_json::from_str(r#"{"node_id": 3, "heartbeat_interval": 50}"#).unwrap();
        assert_eq!(c.heartbeat_interval, Duration::from_millis(50));
        assert_eq!(c.max_batch, 1024);
    }

    #[test]
    fn identity_templates_name_nodes_by_id_or_ordinal() {
        let tls = |identity: &str| TlsConfig {
            identity: Some(identity.into()),
            ..TlsConfig::new("c".into(), "k".into(), Some("ca".into()))
        };
        assert_eq!(tls("epp-node-{id}").identity_of(3).unwrap(), "epp-node-3");
        assert_eq!(
            tls("epp-{ordinal}.peers").identity_of(3).unwrap(),
            "epp-2.peers"
        );
        tls("epp-{ordinal}").validate().unwrap();
        let mut c = valid();
        c.tls = Some(tls("epp-{ordinal}"));
        c.validate().unwrap();
        // Node 0 has no ordinal.
        c.node_id = 0;
        c.initial_members = BTreeMap::from([(0, "127.0.0.1:1".to_string())]);
        assert_eq!(c.validate().unwrap_err().field, "tls.identity");
        for bad in ["epp", "epp-{id}-{ordinal}", "{id}{id}", "bad name {id}"] {
            assert_eq!(
                tls(bad).validate().unwrap_err().field,
                "tls.identity",
                "{bad}"
            );
        }
    }
}

//! Cluster-mode metrics: Raft progress and cluster flow control (`llm_d_epp_cluster_*`), prefix
//! replication and scrape fan-out between replicas (`llm_d_epp_prefix_gossip_*`,
//! `llm_d_epp_datalayer_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::registrar::follow;
use super::scheduler_buckets;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    /// `sent` or `received`.
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Prefix-index replication between replicas (`llm_d_epp_prefix_gossip_*`), updated by
/// [`crate::cluster::gossip`].
#[derive(Debug)]
pub struct GossipMetrics {
    bytes: Family<DirectionLabels, Counter>,
    entries: Family<DirectionLabels, Counter>,
    dropped_batches: Counter,
    syncs: Family<ResultLabels, Counter>,
    pushes_failed: Counter,
    lag: Histogram,
    peers: Gauge,
    sample_bytes: Family<DirectionLabels, Counter>,
    samples_applied: Counter,
    owned: Gauge,
    relayed: Family<OutcomeLabels, Counter>,
}

impl GossipMetrics {
    pub(super) fn register(registry: &mut super::registrar::Registrar) -> GossipMetrics {
        let m = GossipMetrics {
            bytes: Family::default(),
            entries: Family::default(),
            dropped_batches: Counter::default(),
            syncs: Family::default(),
            pushes_failed: Counter::default(),
            lag: Histogram::new([
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
            ]),
            peers: Gauge::default(),
            sample_bytes: Family::default(),
            samples_applied: Counter::default(),
            owned: Gauge::default(),
            relayed: Family::default(),
        };
        registry.register(
            "cluster_settlements_relayed",
            "Settlements of responses observed on one replica for requests another routed: \
             `sent` (keys sent to peers), `released` (received, and this replica held the \
             request), `not_held` (received, nothing held here)",
            m.relayed.clone(),
        );
        registry.register(
            "datalayer_fanout_bytes",
            "Encoded scrape fan-out bytes between replicas, by direction",
            m.sample_bytes.clone(),
        );
        registry.register(
            "datalayer_fanout_samples_applied",
            "Peers' samples newer than this replica's, applied",
            m.samples_applied.clone(),
        );
        registry.register(
            "datalayer_owned_endpoints",
            "Endpoints this replica scrapes (cluster mode: it owns them)",
            m.owned.clone(),
        );
        registry.register(
            "prefix_gossip_bytes",
            "Encoded prefix-index gossip bytes, by direction (deltas and anti-entropy)",
            m.bytes.clone(),
        );
        registry.register(
            "prefix_gossip_entries",
            "Prefix-index entries carried by gossip, by direction",
            m.entries.clone(),
        );
        registry.register(
            "prefix_gossip_dropped_batches",
            "Delta batches not queued for a slow or unreachable peer (anti-entropy repairs them)",
            m.dropped_batches.clone(),
        );
        registry.register(
            "prefix_gossip_push_failures",
            "Pushes to a peer that failed, index deltas or scrape fan-out (peer down, partitioned or slow)",
            m.pushes_failed.clone(),
        );
        registry.register(
            "prefix_gossip_syncs",
            "Anti-entropy rounds with a peer, by result",
            m.syncs.clone(),
        );
        registry.register(
            "prefix_gossip_delta_lag_seconds",
            "Received delta age: receive time minus the newest entry's hybrid-logical-clock time",
            m.lag.clone(),
        );
        registry.register(
            "prefix_gossip_peers",
            "Replicas this one exchanges prefix-index state with",
            m.peers.clone(),
        );
        m
    }

    pub fn sent(&self, bytes: usize, entries: usize) {
        let l = DirectionLabels { direction: "sent" };
        self.bytes.get_or_create(&l).inc_by(bytes as u64);
        self.entries.get_or_create(&l).inc_by(entries as u64);
    }

    pub fn received(&self, bytes: usize, entries: usize) {
        let l = DirectionLabels {
            direction: "received",
        };
        self.bytes.get_or_create(&l).inc_by(bytes as u64);
        self.entries.get_or_create(&l).inc_by(entries as u64);
    }

    pub fn samples_sent(&self, bytes: usize) {
        let l = DirectionLabels { direction: "sent" };
        self.sample_bytes.get_or_create(&l).inc_by(bytes as u64);
    }

    pub fn samples_received(&self, bytes: usize, applied: usize) {
        let l = DirectionLabels {
            direction: "received",
        };
        self.sample_bytes.get_or_create(&l).inc_by(bytes as u64);
        self.samples_applied.inc_by(applied as u64);
    }

    pub fn set_owned(&self, n: usize) {
        self.owned.set(n as i64);
    }

    /// `n` relayed settlements, by outcome (`sent`, `released`, `not_held`).
    pub fn relayed(&self, outcome: &'static str, n: usize) {
        self.relayed
            .get_or_create(&OutcomeLabels { outcome })
            .inc_by(n as u64);
    }

    pub fn dropped_batch(&self) {
        self.dropped_batches.inc();
    }

    pub fn push_failed(&self) {
        self.pushes_failed.inc();
    }

    pub fn sync(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.syncs.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn lag(&self, seconds: f64) {
        self.lag.observe(seconds.max(0.0));
    }

    pub fn set_peers(&self, n: usize) {
        self.peers.set(n as i64);
    }
}

/// Raft progress of this replica (cluster mode), `llm_d_epp_cluster_*`.
#[derive(Debug)]
pub struct ClusterMetrics {
    term: Gauge,
    /// The leader's node id; -1 when none is known.
    leader: Gauge,
    is_leader: Gauge,
    commit_index: Gauge,
    last_applied: Gauge,
    apply_lag: Gauge,
    quorum: Gauge,
    proposal_seconds: Histogram,
    flow_admissions: Family<PathLabels, Counter>,
    flow_admit_seconds: Histogram,
    flow_batch_commands: Histogram,
    flow_batch_seconds: Histogram,
    flow_credit: Gauge,
    flow_quarantined: Gauge,
    flow_unreported: Gauge,
    flow_waiting: Gauge,
    flow_degraded: Gauge,
    peer_handshake_failures: Counter,
    peer_refused: Family<ServiceLabels, Counter>,
    peer_tls_reloads: Family<ResultLabels, Counter>,
}

/// Which peer-port service refused a message (`raft`, `gossip`, `samples`, `settle`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    pub service: &'static str,
}

/// How cluster flow control admitted a request: `fast` (local credit), `slow` (global queue),
/// `credit-wait` (waited for the replica's report to free credit; then credit or the queue),
/// `degraded-admit` / `degraded-reject` (no quorum).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabels {
    pub path: &'static str,
}

impl ClusterMetrics {
    pub(super) fn register(registry: &mut super::registrar::Registrar) -> ClusterMetrics {
        let m = ClusterMetrics {
            term: Gauge::default(),
            leader: Gauge::default(),
            is_leader: Gauge::default(),
            commit_index: Gauge::default(),
            last_applied: Gauge::default(),
            apply_lag: Gauge::default(),
            quorum: Gauge::default(),
            proposal_seconds: Histogram::new(
                scheduler_buckets().into_iter().chain([0.2, 0.5, 1.0, 2.0]),
            ),
            flow_admissions: Family::default(),
            flow_admit_seconds: Histogram::new([
                1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
            ]),
            flow_batch_commands: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(1.0, 2.0, 14),
            ),
            flow_batch_seconds: Histogram::new(
                scheduler_buckets().into_iter().chain([0.2, 0.5, 1.0, 2.0]),
            ),
            flow_credit: Gauge::default(),
            flow_quarantined: Gauge::default(),
            flow_unreported: Gauge::default(),
            flow_waiting: Gauge::default(),
            flow_degraded: Gauge::default(),
            peer_handshake_failures: Counter::default(),
            peer_refused: Family::default(),
            peer_tls_reloads: Family::default(),
        };
        registry.register(
            "cluster_peer_tls_handshake_failures",
            "Connections to the peer port whose TLS handshake failed or timed out (no or an \
             untrusted client certificate, not TLS)",
            m.peer_handshake_failures.clone(),
        );
        registry.register(
            "cluster_peer_refused",
            "Peer messages refused because the certificate was not the one of the node they \
             came from (--peer-tls-identity), by service",
            m.peer_refused.clone(),
        );
        registry.register(
            "cluster_peer_tls_reloads",
            "Changed peer TLS files loaded (ok) or refused, keeping the previous material (error)",
            m.peer_tls_reloads.clone(),
        );
        registry.register(
            "cluster_flow_admissions",
            "Requests admitted by cluster flow control, by path (fast: local credit, no consensus \
             round trip; slow: global queue; degraded-admit/-reject: no quorum)",
            m.flow_admissions.clone(),
        );
        registry.register(
            "cluster_flow_fast_admit_duration_seconds",
            "Time to admit a request on local credit (the unsaturated fast path; no consensus)",
            m.flow_admit_seconds.clone(),
        );
        registry.register(
            "cluster_flow_batch_commands",
            "Flow-control commands per proposed log entry",
            m.flow_batch_commands.clone(),
        );
        registry.register(
            "cluster_flow_batch_duration_seconds",
            "Time to commit one flow-control batch",
            m.flow_batch_seconds.clone(),
        );
        registry.register(
            "cluster_flow_credit",
            "Requests this replica may admit on local credit (replicated state)",
            m.flow_credit.clone(),
        );
        registry.register(
            "cluster_flow_quarantined_credit",
            "Credit of replicas whose lease ended or that restarted, kept from the others while \
             the pods may still run what they admitted unreported (replicated state)",
            m.flow_quarantined.clone(),
        );
        registry.register(
            "cluster_flow_unreported",
            "Local admissions not yet in the replicated ledger",
            m.flow_unreported.clone(),
        );
        registry.register(
            "cluster_flow_waiting",
            "Requests held here waiting for a dispatch from the global queue",
            m.flow_waiting.clone(),
        );
        registry.register(
            "cluster_flow_degraded",
            "1 while this replica cannot commit and admits on its local share (or fails closed)",
            m.flow_degraded.clone(),
        );
        registry.register("cluster_raft_term", "Current Raft term", m.term.clone());
        registry.register(
            "cluster_raft_leader",
            "Node id of the known Raft leader (-1: none)",
            m.leader.clone(),
        );
        registry.register(
            "cluster_raft_is_leader",
            "1 when this replica leads",
            m.is_leader.clone(),
        );
        registry.register(
            "cluster_raft_commit_index",
            "Last committed log index known here",
            m.commit_index.clone(),
        );
        registry.register(
            "cluster_raft_last_applied",
            "Last log index applied here",
            m.last_applied.clone(),
        );
        registry.register(
            "cluster_raft_apply_lag",
            "Committed entries not yet applied here",
            m.apply_lag.clone(),
        );
        registry.register(
            "cluster_quorum",
            "1 when this replica's last heartbeat committed (0: degraded, routing on local state)",
            m.quorum.clone(),
        );
        registry.register(
            "cluster_proposal_duration_seconds",
            "Time to commit one heartbeat proposal",
            m.proposal_seconds.clone(),
        );
        m
    }

    pub fn flow_admission(&self, path: &'static str) {
        self.flow_admissions
            .get_or_create(&PathLabels { path })
            .inc();
    }

    pub fn fast_admit(&self, took: std::time::Duration) {
        self.flow_admit_seconds.observe(took.as_secs_f64());
    }

    pub fn flow_batch(&self, commands: usize, took: std::time::Duration) {
        self.flow_batch_commands.observe(commands as f64);
        self.flow_batch_seconds.observe(took.as_secs_f64());
    }

    pub fn flow_local(&self, credit: u32, unreported: usize, waiting: usize, degraded: bool) {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.flow_credit.set(i64::from(credit));
        self.flow_unreported.set(i(unreported));
        self.flow_waiting.set(i(waiting));
        self.flow_degraded.set(i64::from(degraded));
    }

    pub fn flow_quarantined(&self, credit: u64) {
        self.flow_quarantined
            .set(i64::try_from(credit).unwrap_or(i64::MAX));
    }

    pub fn peer_refused(&self, service: &'static str) {
        self.peer_refused
            .get_or_create(&ServiceLabels { service })
            .inc();
    }

    pub fn proposal(&self, seconds: f64) {
        self.proposal_seconds.observe(seconds);
    }

    pub fn observe(&self, m: &consensus::ConsensusMetrics, quorum: bool) {
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.term.set(i(m.term));
        self.leader.set(m.leader.map_or(-1, i));
        self.is_leader.set(i64::from(m.leader == Some(m.node_id)));
        self.commit_index.set(i(m.commit_index.unwrap_or(0)));
        self.last_applied.set(i(m.last_applied.unwrap_or(0)));
        self.apply_lag.set(i(m.apply_lag));
        self.quorum.set(i64::from(quorum));
        if let Some(tls) = &m.peer_tls {
            follow(&self.peer_handshake_failures, tls.handshake_failures);
            follow(
                &self
                    .peer_refused
                    .get_or_create(&ServiceLabels { service: "raft" }),
                tls.refused,
            );
            let reloads = |result| {
                self.peer_tls_reloads
                    .get_or_create(&ResultLabels { result })
            };
            follow(&reloads("ok"), tls.reloads);
            follow(&reloads("error"), tls.reload_failures);
        }
    }
}

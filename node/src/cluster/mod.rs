//! Cluster mode: what this replica shares with the others.
//!
//! - [`member`]: this replica as a Raft member (`consensus`) replicating `flowctl`'s cluster
//!   state — liveness leases, membership operations, probes, `/debug/cluster`;
//! - [`gate`]: cluster-wide flow control — the request stage's [`crate::request::admission::Gate`]
//!   over the replicated global queue and in-flight ledger; it publishes the other replicas'
//!   load to the in-flight ledger ([`crate::datalayer::inflight::RemoteLoadFeed`]);
//! - [`gossip`]: the peer exchange — prefix-index deltas and anti-entropy (the prefix producer
//!   hands its deltas to the gossip outbox through [`crate::scheduling::prefix::DeltaSink`]),
//!   and the scrape fan-out of sharded collection;
//! - [`quota`]: tenant quotas for the whole cluster — the request stage's
//!   [`crate::request::quota::QuotaLedger`] over the replicated quota book, admitting within
//!   this replica's slices of the buckets;
//! - [`settle`]: settlements of requests observed here but routed (and charged) elsewhere,
//!   relayed to the replica that made the request key;
//! - [`options`]: the flags of cluster mode.
//!
//! Nothing here is on a request's way unless the gate is: routing reads only local state, which
//! the peers' data flows into.

pub mod gate;
pub mod gossip;
pub mod member;
pub mod options;
pub mod quota;
pub mod settle;

pub use member::ClusterMember;

/// The peer port's application services (gossip, scrape fan-out, settlements): with node
/// identities bound to certificates (`--peer-tls-identity`), a message claiming to come from
/// node `from` must arrive with `from`'s certificate — a replica cannot speak for another.
pub(crate) fn authorize_peer<T>(
    identity: Option<&consensus::network::tls::PeerIdentity>,
    req: &tonic::Request<T>,
    from: u64,
    metrics: &crate::metrics::Metrics,
    service: &'static str,
) -> Result<(), tonic::Status> {
    let Some(identity) = identity else {
        return Ok(());
    };
    let certs = req.peer_certs();
    identity
        .check(
            certs.as_deref().map(Vec::as_slice),
            [from],
            &format!("{service} from node {from}"),
        )
        .inspect_err(|e| {
            metrics.cluster.peer_refused(service);
            tracing::debug!(reason = e.message(), "peer message refused");
        })
}
pub use options::{ClusterOptions, GossipOptions, PartitionMode, parse_peers, parse_routes};

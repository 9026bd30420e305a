//! What a replicated index offers the replicas' exchange (the node's gossip): its pod states'
//! digests and full states for anti-entropy, a join for what peers send, and a sink for the
//! delta of every local insert. The prefix index and the response bindings both replicate this
//! way, each in its own space of the exchange.

use std::fmt::Debug;
use std::sync::Arc;

use crate::approx::{PodDigest, PodState};

/// Where an index hands the delta of every insert once replicated. Pushing must not block:
/// routing never waits for a peer.
pub trait DeltaSink: Send + Sync + Debug {
    fn push(&self, delta: PodState);
}

/// An index of per-pod [`PodState`]s that replicas converge by exchanging states.
pub trait Replicated: Send + Sync + Debug {
    /// From now on every insert's delta also goes to `sink`. False if a sink is already set.
    fn replicate_into(&self, sink: Arc<dyn DeltaSink>) -> bool;
    /// Join peers' deltas or pod states (idempotent, any order): the entries that changed and
    /// the newest timestamp seen.
    fn merge(&self, states: &[PodState]) -> (usize, u64);
    /// Per-pod digests, for anti-entropy.
    fn digests(&self) -> Vec<PodDigest>;
    /// The full state of the named pods that are known.
    fn export(&self, pods: &[String]) -> Vec<PodState>;
}

//! Raft consensus core (openraft + sled + tonic) for the replicated flow-control state — not built yet (issue: consensus core).

//! What replicas exchange about a pod: its state (or a delta of it) and the digest anti-entropy
//! compares, with the order-independent mix the digest sums.

/// A pod's replicated state, or a delta of it (a delta is just a small state).
///
/// Normalized form (what [`ApproxIndex::export_pod`] returns and [`PodState::normalize`] makes):
/// entries sorted by hash, one per hash. [`ApproxIndex::merge_pod`] accepts any form (duplicate
/// hashes: the max timestamp counts).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodState {
    pub name: String,
    pub epoch: u64,
    /// (hash, timestamp).
    pub entries: Vec<(u64, u64)>,
}

impl PodState {
    /// Sort by hash and keep the max timestamp of each hash.
    pub fn normalize(&mut self) {
        self.entries
            .sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        self.entries.dedup_by_key(|e| e.0);
    }

    /// Keep the `k` greatest (timestamp, hash) pairs (the eviction order); leaves the entries
    /// normalized.
    pub fn truncate(&mut self, k: usize) {
        self.normalize();
        if self.entries.len() > k {
            self.entries
                .sort_unstable_by_key(|e| std::cmp::Reverse((e.1, e.0)));
            self.entries.truncate(k);
            self.entries.sort_unstable_by_key(|e| e.0);
        }
    }

    /// The greatest timestamp carried (for [`crate::Hlc::observe`]).
    pub fn max_ts(&self) -> Option<u64> {
        self.entries.iter().map(|e| e.1).max()
    }
}

/// A pod's state summary for anti-entropy: equal pod states have equal digests (and unequal ones
/// almost surely differ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodDigest {
    pub name: String,
    pub epoch: u64,
    pub len: u64,
    /// Wrapping sum over the entries of a 64-bit mix of (hash, ts).
    pub digest: u64,
}

/// splitmix64's finalizer (a bijection on u64).
pub(super) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One entry's contribution to its pod's digest.
pub(super) fn entry_mix(hash: u64, ts: u64) -> u64 {
    mix64(hash ^ mix64(ts ^ 0x9E37_79B9_7F4A_7C15))
}

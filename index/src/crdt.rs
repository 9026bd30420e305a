//! [`PodState`] as `crdts::CvRDT` values: the reference join that [`ApproxIndex::merge_pod`]
//! implements in place.
//!
//! - [`PodState`] itself: the unbounded join (higher epoch wins entirely; equal epochs take the
//!   per-hash max timestamp). Use it to coalesce deltas before sending: bounding commutes with
//!   joining, so joining the coalesced delta into a bounded pod equals joining each delta.
//! - [`BoundedPodState`]: the same join, then keep the K greatest (timestamp, hash) pairs — the
//!   pod state an [`ApproxIndex`] of capacity K holds.
//!
//! An empty name is the bottom's name: merging adopts the other side's. States of two different
//! (non-empty) names do not merge: [`CvRDT::validate_merge`] reports [`NameMismatch`] and
//! [`CvRDT::merge`] leaves the state unchanged.
//!
//! [`ApproxIndex`]: crate::ApproxIndex
//! [`ApproxIndex::merge_pod`]: crate::ApproxIndex::merge_pod

use std::cmp::Ordering;
use std::fmt;

use crdts::CvRDT;

use crate::approx::PodState;

/// Merging states of two different pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameMismatch {
    pub ours: String,
    pub theirs: String,
}

impl fmt::Display for NameMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot merge the state of pod {:?} into pod {:?}",
            self.theirs, self.ours
        )
    }
}

impl std::error::Error for NameMismatch {}

fn check_names(ours: &str, theirs: &str) -> Result<(), NameMismatch> {
    if ours == theirs || ours.is_empty() || theirs.is_empty() {
        Ok(())
    } else {
        Err(NameMismatch {
            ours: ours.to_string(),
            theirs: theirs.to_string(),
        })
    }
}

impl CvRDT for PodState {
    type Validation = NameMismatch;

    fn validate_merge(&self, other: &Self) -> Result<(), NameMismatch> {
        check_names(&self.name, &other.name)
    }

    fn merge(&mut self, mut other: Self) {
        if self.validate_merge(&other).is_err() {
            return;
        }
        if self.name.is_empty() {
            self.name = std::mem::take(&mut other.name);
        }
        match other.epoch.cmp(&self.epoch) {
            Ordering::Greater => {
                self.epoch = other.epoch;
                self.entries = other.entries;
            }
            Ordering::Less => {}
            Ordering::Equal => self.entries.append(&mut other.entries),
        }
        self.normalize();
    }
}

/// A pod state bounded to its K greatest (timestamp, hash) pairs; K is the replica's capacity for
/// the pod, not part of the state (merges keep `self`'s K).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedPodState {
    k: usize,
    state: PodState,
}

impl BoundedPodState {
    /// `state` normalized and bounded to `k` (≥ 1, as pod capacities are).
    pub fn new(k: usize, mut state: PodState) -> Self {
        let k = k.max(1);
        state.truncate(k);
        BoundedPodState { k, state }
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Normalized: entries sorted by hash, at most K.
    pub fn state(&self) -> &PodState {
        &self.state
    }

    pub fn into_state(self) -> PodState {
        self.state
    }
}

impl CvRDT for BoundedPodState {
    type Validation = NameMismatch;

    fn validate_merge(&self, other: &Self) -> Result<(), NameMismatch> {
        self.state.validate_merge(&other.state)
    }

    fn merge(&mut self, other: Self) {
        self.state.merge(other.state);
        self.state.truncate(self.k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(name: &str, epoch: u64, entries: &[(u64, u64)]) -> PodState {
        PodState {
            name: name.to_string(),
            epoch,
            entries: entries.to_vec(),
        }
    }

    #[test]
    fn bounded_join_keeps_k_newest_ties_by_hash() {
        let mut a = BoundedPodState::new(3, st("p", 0, &[(1, 5), (2, 1), (3, 1)]));
        a.merge(BoundedPodState::new(
            3,
            st("p", 0, &[(2, 4), (4, 1), (1, 2)]),
        ));
        // (5,1) (4,2) then the (1, h) tie: 4 > 3 kept
        assert_eq!(a.state(), &st("p", 0, &[(1, 5), (2, 4), (4, 1)]));
    }

    #[test]
    fn higher_epoch_wins_and_names_must_match() {
        let mut a = PodState::default();
        a.merge(st("p", 0, &[(1, 9)]));
        assert_eq!(a, st("p", 0, &[(1, 9)]));
        a.merge(st("p", 1, &[(2, 1)]));
        assert_eq!(a, st("p", 1, &[(2, 1)]));
        a.merge(st("p", 0, &[(3, 100)]));
        assert_eq!(a, st("p", 1, &[(2, 1)]));
        let q = st("q", 5, &[(7, 7)]);
        assert!(a.validate_merge(&q).is_err());
        a.merge(q);
        assert_eq!(a, st("p", 1, &[(2, 1)]));
    }
}

//! Replication: the journal of a pod's distinct (key, tier) changes for the peers, the digest
//! they compare, and mirrors — pods whose events another replica applies.

use crate::hashing::MAX_BLOCK_SIZE;

use super::tiers::{GPU, Tier};
use super::{EngineMap, PodId, PreciseIndex};

/// One change of a pod's distinct (key, tier) pairs (see [`PreciseIndex::journal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub pod: PodId,
    pub tier: Tier,
    pub key: u64,
    pub added: bool,
}

/// A pod's distinct keys by tier (GPU first), for a peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodKeys {
    pub block_size: u32,
    pub gpu: Vec<u64>,
    /// Offload tiers by medium name (lowercase), sorted by name.
    pub offload: Vec<(String, Vec<u64>)>,
}

impl PreciseIndex {
    /// Record every change of a pod's distinct (key, tier) pairs from now on (for replication).
    pub fn journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since the last call, in order.
    pub fn take_journal(&mut self) -> Vec<Change> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Pod `id`'s distinct (key, tier) pairs held and their digest (wrapping sum, keys mixed
    /// with their tier's name): equal sets give equal digests, whichever events built them.
    pub fn digest(&self, id: PodId) -> (u64, u64) {
        self.slot(id).map_or((0, 0), |p| (p.distinct, p.digest))
    }

    /// A mirrored pod (its events are applied on another replica): take that replica's changes
    /// of its distinct keys in tier `tier`. Idempotent per key (adding a held key, removing an
    /// absent one: no-op).
    pub fn mirror(
        &mut self,
        id: PodId,
        tier: Tier,
        block_size: u32,
        adds: &[u64],
        removes: &[u64],
    ) {
        if self.slot(id).is_none() {
            return;
        }
        for k in removes {
            if self.pods[id as usize].map_mut(tier).remove(k).is_some() {
                self.unhold(*k, id, tier);
            }
        }
        for k in adds {
            if self.full(id) {
                break;
            }
            if self.pods[id as usize]
                .map_mut(tier)
                .insert(*k, *k)
                .is_none()
            {
                self.hold(*k, id, tier);
            }
        }
        if block_size > 0 && block_size as usize <= MAX_BLOCK_SIZE {
            self.pods[id as usize].block_size = block_size;
        }
    }

    /// A mirrored pod's whole state, replacing what it held.
    pub fn replace_mirror(&mut self, id: PodId, state: &PodKeys) {
        self.clear_pod(id);
        self.mirror(id, GPU, state.block_size, &state.gpu, &[]);
        for (medium, keys) in &state.offload {
            if let Some(t) = self.tier(Some(medium)).filter(|t| *t != GPU) {
                self.mirror(id, t, 0, keys, &[]);
            }
        }
    }

    /// Pod `id`'s distinct keys by tier and its block size (its state for a peer).
    pub fn pod_state(&self, id: PodId) -> PodKeys {
        let Some(p) = self.slot(id) else {
            return PodKeys::default();
        };
        let keys = |m: &EngineMap| {
            let mut v: Vec<u64> = m.values().copied().collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut offload: Vec<(String, Vec<u64>)> = p
            .offload
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.is_empty())
            .filter_map(|(i, m)| Some((self.tiers.get(i)?.name.clone(), keys(m))))
            .collect();
        offload.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        PodKeys {
            block_size: p.block_size,
            gpu: keys(&p.engine),
            offload,
        }
    }
}

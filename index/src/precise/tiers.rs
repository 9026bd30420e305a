//! Tiers of a pod's KV cache: the GPU pool and the offload tiers (CPU memory, storage) named by
//! the events' `medium`, registered as they first appear; how a holder carries its tier; the
//! tiers' scoring weights and digest mixes.

use super::{PodId, PreciseIndex};

/// A tier of a pod's KV cache: [`GPU`], or an offload tier named by the events' `medium`.
pub type Tier = u8;
/// The GPU pool (`medium` "GPU", or none given).
pub const GPU: Tier = 0;
/// Tiers told apart: the GPU and six offload tiers. A holder keeps its tier in its top three
/// bits, and tier 7 would collide with the holder markers (`NONE`, `SPILLED`); an eighth medium
/// is not indexed.
pub const MAX_TIERS: usize = 7;
const TIER_SHIFT: u32 = 29;
pub(super) const POD_MASK: u32 = (1 << TIER_SHIFT) - 1;

/// A holder: pod `pod`'s tier `tier`.
pub(super) fn holder(pod: PodId, tier: Tier) -> PodId {
    pod | (PodId::from(tier) << TIER_SHIFT)
}

pub(super) fn pod_of(holder: PodId) -> PodId {
    holder & POD_MASK
}

pub(super) fn tier_of(holder: PodId) -> Tier {
    (holder >> TIER_SHIFT) as Tier
}

/// Longest `medium` name taken as a tier (longer ones are not indexed).
const MAX_MEDIUM_LEN: usize = 32;

#[derive(Debug)]
pub(super) struct TierInfo {
    pub(super) name: String,
    /// XORed into the tier's keys in a pod's digest: from the name, so that replicas which
    /// numbered their tiers in another order compare equal.
    pub(super) mix: u64,
    pub(super) weight: f32,
}

impl PreciseIndex {
    /// Scoring weights by medium name (case-insensitive: llm-d's `kvCacheBackendConfigs`; the
    /// GPU's is `gpu`'s). A medium not named weighs 1, as in llm-d. The named tiers are
    /// registered now, so that engines publishing stray mediums cannot use up their slots.
    pub fn set_tier_weights(&mut self, weights: &[(String, f32)]) {
        self.weights = weights
            .iter()
            .map(|(n, w)| (n.to_ascii_lowercase(), *w))
            .collect();
        for i in 0..self.tiers.len() {
            self.tiers[i].weight = self.weight_of(&self.tiers[i].name.clone());
        }
        self.gpu_weight = Some(self.weight_of("gpu"));
        for (name, _) in weights {
            self.tier(Some(name));
        }
    }

    pub(super) fn weight_of(&self, name: &str) -> f32 {
        self.weights
            .iter()
            .find(|(n, _)| n == name)
            .map_or(1.0, |(_, w)| *w)
    }

    /// The scoring weight of tier `t`'s blocks.
    pub(super) fn tier_weight(&self, t: Tier) -> f32 {
        match t {
            GPU => self.gpu_weight.unwrap_or(1.0),
            t => self.tiers.get(usize::from(t) - 1).map_or(1.0, |i| i.weight),
        }
    }

    /// The tier of `medium` (`None` or "GPU": [`GPU`]), registered when new; `None` past
    /// [`MAX_TIERS`] or for a name longer than any medium in use.
    pub fn tier(&mut self, medium: Option<&str>) -> Option<Tier> {
        if let Some(t) = self.known_tier(medium) {
            return Some(t);
        }
        let name = medium?.to_ascii_lowercase();
        if self.tiers.len() + 1 >= MAX_TIERS || name.len() > MAX_MEDIUM_LEN {
            return None;
        }
        let weight = self.weight_of(&name);
        let mix = xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | 1;
        self.tiers.push(TierInfo { name, mix, weight });
        Some(self.tiers.len() as Tier)
    }

    /// The tier of `medium` if it is known.
    pub fn known_tier(&self, medium: Option<&str>) -> Option<Tier> {
        match medium {
            None => Some(GPU),
            Some(m) if m.eq_ignore_ascii_case("gpu") => Some(GPU),
            Some(m) => self
                .tiers
                .iter()
                .position(|t| t.name.eq_ignore_ascii_case(m))
                .map(|i| (i + 1) as Tier),
        }
    }

    /// Tier `t`'s medium name, lowercase ("gpu" for [`GPU`]).
    pub fn tier_name(&self, t: Tier) -> Option<&str> {
        match t {
            GPU => Some("gpu"),
            t => self.tiers.get(usize::from(t) - 1).map(|i| i.name.as_str()),
        }
    }

    pub(super) fn mix(&self, key: u64, tier: Tier) -> u64 {
        match tier {
            GPU => key,
            t => key ^ self.tiers.get(usize::from(t) - 1).map_or(0, |i| i.mix),
        }
    }
}

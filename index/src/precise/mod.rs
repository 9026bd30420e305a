//! The precise prefix index: which KV blocks each pod's engine holds right now, rebuilt from the
//! engine's own KV events ([`crate::kvevents`]) rather than guessed from routing decisions.
//!
//! Engines name blocks by their own hashes (vLLM: SHA-256 over pickled tuples with a per-process
//! seed), which a router cannot reproduce. So, as llm-d's indexer does, every block is keyed by
//! *our* chained hash over its token ids ([`chain_full_blocks`]: full blocks only, seeded by the
//! model — the LoRA adapter's name for adapter blocks — and the cache salt), and each pod keeps the map from its
//! engine's hashes to our keys, learnt from `BlockStored` (which carries the tokens and the parent's
//! engine hash). A request's tokens hash to the same keys, and [`PreciseIndex::match_prefix`] gives
//! every pod its run of leading blocks held.
//!
//! Layout, for compactness (~50 B per held block at hash tables' average load, see
//! `approx_heap_bytes`):
//! - `blocks`: our key → the pods holding it, two inline (a 16-byte slot) before spilling to an
//!   arena; a holder is a pod id with its tier in the top bits;
//! - per pod and tier, engine hash → our key.
//!
//! Tiers: the GPU pool is tier 0 ([`GPU`]); offload tiers (`medium` "CPU", "STORAGE", ... in the
//! events) get their own ids as they first appear, up to [`MAX_TIERS`]. Offload connectors often
//! publish *hash-only* `BlockStored` events (no tokens): their keys are resolved through the
//! engine hashes the pod already mapped (the block was on the GPU first). A pod's run over a
//! request's keys continues while any of its tiers holds the next key, and each block scores the
//! weight of the best tier holding it ([`PreciseIndex::set_tier_weights`]; llm-d's default is GPU
//! 1.0, CPU 0.8).
//!
//! A pod appears in a key's holders once per engine block mapped to that key (a multiset): two
//! engine blocks can map to one key when the engine hashes something we do not (multimodal
//! identifiers, salts in old formats), and removing one of them must not forget the other.

use crate::hashing::MAX_BLOCK_SIZE;
use crate::idhash::IdMap;
use crate::kvevents::{BlockStored, KvEvent};

/// A pod's slot in the index.
pub type PodId = u32;

/// The key chain of `tokens`' full blocks of `block_size`, continuing from `prev` (the model's
/// seed, [`crate::BlockHasher`]'s, for a chain from token 0, or the parent block's key), appended
/// to `out`. One hash per block: XXH3
/// of the block's tokens (little-endian bytes) seeded with the previous key.
pub fn chain_full_blocks(prev: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return;
    }
    // One block's bytes at a time, filled in place (the loop vectorises; the buffer stays in L1).
    let mut buf = vec![0u8; block_size * 4];
    let mut prev = prev;
    out.reserve(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        for (b, t) in buf.chunks_exact_mut(4).zip(block) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        prev = xxhash_rust::xxh3::xxh3_64_with_seed(&buf, prev);
        out.push(prev);
    }
}

/// A tier of a pod's KV cache: [`GPU`], or an offload tier named by the events' `medium`.
pub type Tier = u8;
/// The GPU pool (`medium` "GPU", or none given).
pub const GPU: Tier = 0;
/// Tiers told apart: the GPU and six offload tiers. A holder keeps its tier in its top three
/// bits, and tier 7 would collide with the markers below; an eighth medium is not indexed.
pub const MAX_TIERS: usize = 7;
const TIER_SHIFT: u32 = 29;
const POD_MASK: u32 = (1 << TIER_SHIFT) - 1;

/// No pod in this slot.
const NONE: PodId = PodId::MAX;
/// First slot of a key held by more than two pods: the second slot indexes `spill`.
const SPILLED: PodId = PodId::MAX - 1;
/// Pod ids fit below the tier bits.
const MAX_PODS: usize = POD_MASK as usize;

/// A holder: pod `pod`'s tier `tier`.
fn holder(pod: PodId, tier: Tier) -> PodId {
    pod | (PodId::from(tier) << TIER_SHIFT)
}

fn pod_of(holder: PodId) -> PodId {
    holder & POD_MASK
}

fn tier_of(holder: PodId) -> Tier {
    (holder >> TIER_SHIFT) as Tier
}

/// Longest `medium` name taken as a tier (longer ones are not indexed).
const MAX_MEDIUM_LEN: usize = 32;
/// Blocks one pod may hold in the index (16M blocks: 256M tokens at 16 per block, far beyond any
/// engine's KV cache). An engine or a peer claiming more is not believed: further stores are
/// skipped (and counted) until removals make room.
pub const MAX_POD_BLOCKS: usize = 1 << 24;
/// Speculative entries kept at most (the oldest are dropped first).
pub const MAX_SPECULATIVE: usize = 1 << 20;

/// The holders of one key, as a multiset (see the module doc): up to two inline — 8 bytes, so a
/// `blocks` slot is 16 — else all of them in the index's spill arena.
#[derive(Debug, Clone, Copy)]
struct Holders([PodId; 2]);

impl Holders {
    fn one(pod: PodId) -> Self {
        Holders([pod, NONE])
    }
}

/// The holders of a key as a slice.
fn holders<'a>(spill: &'a [Vec<PodId>], h: &'a Holders) -> &'a [PodId] {
    match h.0 {
        [SPILLED, i] => spill.get(i as usize).map_or(&[], Vec::as_slice),
        [_, NONE] => &h.0[..1],
        _ => &h.0,
    }
}

/// Engine hashes are the engine's (untrusted, and not always well mixed: small integers from old
/// formats): hashed with a per-process seed, not used as their own hash.
type EngineMap = std::collections::HashMap<u64, u64, foldhash::fast::RandomState>;

#[derive(Debug, Default)]
struct Pod {
    name: String,
    /// Engine block hash → our key (a mirrored pod: key → key), GPU tier.
    engine: EngineMap,
    /// The same for the offload tiers, tier `t` at `t - 1` (empty for a GPU-only pod).
    offload: Vec<EngineMap>,
    /// Distinct (key, tier) pairs held, and their wrapping sum (keys mixed with their tier's
    /// name): the digest replicas compare.
    distinct: u64,
    digest: u64,
    /// Tokens per block in this pod's last `BlockStored` (0 until one arrived).
    block_size: u32,
    /// False once removed; the slot is reused by the next new pod.
    live: bool,
}

/// What applying one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks added to the pod.
    pub stored: u64,
    /// Blocks the pod no longer holds.
    pub removed: u64,
    /// Blocks of a `BlockStored` whose parent block this pod is not known to hold, or of a
    /// hash-only one that the pod never keyed (an event was lost): their keys cannot be
    /// computed, so they are not indexed.
    pub orphaned: u64,
    /// Events (or blocks past the pod's limit) not indexed on purpose: another attention kind,
    /// an adapter known only by id, malformed token spans, a medium past [`MAX_TIERS`].
    pub skipped: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
}

impl std::ops::AddAssign for Applied {
    fn add_assign(&mut self, o: Applied) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.orphaned += o.orphaned;
        self.skipped += o.skipped;
        self.cleared += o.cleared;
    }
}

impl Pod {
    fn map(&self, tier: Tier) -> Option<&EngineMap> {
        match tier {
            GPU => Some(&self.engine),
            t => self.offload.get(usize::from(t) - 1),
        }
    }

    fn map_mut(&mut self, tier: Tier) -> &mut EngineMap {
        match tier {
            GPU => &mut self.engine,
            t => {
                let i = usize::from(t) - 1;
                if self.offload.len() <= i {
                    self.offload.resize_with(i + 1, EngineMap::default);
                }
                &mut self.offload[i]
            }
        }
    }

    /// (engine block, tier) pairs held.
    fn held(&self) -> usize {
        self.engine.len() + self.offload.iter().map(EngineMap::len).sum::<usize>()
    }

    /// Our key for engine block `eh`: as tier `tier` maps it, else as any other tier does (an
    /// offloaded block was on the GPU first; a hash-only event names it by its engine hash).
    fn resolve(&self, tier: Tier, eh: u64) -> Option<u64> {
        self.map(tier)
            .and_then(|m| m.get(&eh))
            .or_else(|| self.engine.get(&eh))
            .or_else(|| self.offload.iter().find_map(|m| m.get(&eh)))
            .copied()
    }
}

/// One pod's run of leading blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreciseMatch {
    pub pod: PodId,
    /// Leading blocks held in any tier.
    pub blocks: usize,
    /// The same blocks, each weighted by the best tier holding it (`blocks` when all are on
    /// the GPU at weight 1).
    pub score: f32,
}

/// Holder lists up to this long are searched pod by pod when matching; longer ones are marked.
const LINEAR_HOLDERS: usize = 8;

/// The runs `out[..active]` whose pod `holds` block `i` (at the weight returned) grow to `i + 1`
/// blocks; the others end (swapped behind). Returns how many still run.
fn extend_runs(
    out: &mut [PreciseMatch],
    mut active: usize,
    i: usize,
    holds: impl Fn(PodId) -> Option<f32>,
) -> usize {
    let mut j = 0;
    while j < active {
        if let Some(w) = holds(out[j].pod) {
            out[j].blocks = i + 1;
            out[j].score += w;
            j += 1;
        } else {
            active -= 1;
            out.swap(j, active);
        }
    }
    active
}

/// One change of a pod's distinct (key, tier) pairs (see [`PreciseIndex::journal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub pod: PodId,
    pub tier: Tier,
    pub key: u64,
    pub added: bool,
}

#[derive(Debug)]
struct TierInfo {
    name: String,
    /// XORed into the tier's keys in a pod's digest: from the name, so that replicas which
    /// numbered their tiers in another order compare equal.
    mix: u64,
    weight: f32,
}

/// A pod's distinct keys by tier (GPU first), for a peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodKeys {
    pub block_size: u32,
    pub gpu: Vec<u64>,
    /// Offload tiers by medium name (lowercase), sorted by name.
    pub offload: Vec<(String, Vec<u64>)>,
}

#[derive(Debug, Default)]
pub struct PreciseIndex {
    pods: Vec<Pod>,
    /// Looked up once per candidate per decision: a fast hasher.
    by_name: foldhash::HashMap<String, PodId>,
    blocks: IdMap<u64, Holders>,
    /// Holder lists of keys held by more than two pods, and the free slots among them.
    spill: Vec<Vec<PodId>>,
    spill_free: Vec<PodId>,
    /// When on: every change of a pod's distinct keys, in order (see [`Self::take_journal`]).
    journal: Option<Vec<Change>>,
    /// Offload tiers' names (tier `t` at `t - 1`), their digest mixes and scoring weights.
    tiers: Vec<TierInfo>,
    /// Scoring weight by lowercased medium name (a medium not named there: 1).
    weights: Vec<(String, f32)>,
    /// Speculative entries: key → (pod, expiry), and the same in expiry order for the sweep.
    speculative: IdMap<u64, Vec<(PodId, u64)>>,
    spec_queue: std::collections::VecDeque<(u64, u64, PodId)>,
    /// Blocks one pod may hold ([`MAX_POD_BLOCKS`]; 0 from `Default` means the same).
    pod_limit: usize,
    /// (pod, engine block) pairs held.
    entries: usize,
}

impl PreciseIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index holding at most `limit` blocks per pod (tests; the default is [`MAX_POD_BLOCKS`]).
    pub fn with_pod_limit(limit: usize) -> Self {
        PreciseIndex {
            pod_limit: limit,
            ..Self::default()
        }
    }

    fn full(&self, id: PodId) -> bool {
        let limit = if self.pod_limit == 0 {
            MAX_POD_BLOCKS
        } else {
            self.pod_limit
        };
        self.pods[id as usize].held() >= limit
    }

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
        for (name, _) in weights {
            self.tier(Some(name));
        }
    }

    fn weight_of(&self, name: &str) -> f32 {
        self.weights
            .iter()
            .find(|(n, _)| n == name)
            .map_or(1.0, |(_, w)| *w)
    }

    /// The scoring weight of tier `t`'s blocks.
    fn tier_weight(&self, t: Tier) -> f32 {
        match t {
            GPU => self.weight_of("gpu"),
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

    fn mix(&self, key: u64, tier: Tier) -> u64 {
        match tier {
            GPU => key,
            t => key ^ self.tiers.get(usize::from(t) - 1).map_or(0, |i| i.mix),
        }
    }

    /// The slot of pod `name`, created empty if new.
    pub fn pod(&mut self, name: &str) -> PodId {
        if let Some(id) = self.by_name.get(name) {
            return *id;
        }
        let slot = Pod {
            name: name.to_string(),
            live: true,
            ..Pod::default()
        };
        let id = match self.pods.iter().position(|p| !p.live) {
            Some(i) => {
                self.pods[i] = slot;
                i
            }
            None => {
                self.pods.push(slot);
                self.pods.len() - 1
            }
        };
        // More pods than ids below the markers cannot exist in a pool; saturate rather than wrap.
        let id = id.min(MAX_PODS - 1) as PodId;
        self.by_name.insert(name.to_string(), id);
        id
    }

    pub fn pod_id(&self, name: &str) -> Option<PodId> {
        self.by_name.get(name).copied()
    }

    /// One more than the largest pod id in use: a table indexed by [`PodId`] has this length.
    pub fn pod_slots(&self) -> usize {
        self.pods.len()
    }

    pub fn pod_name(&self, id: PodId) -> Option<&str> {
        self.slot(id).map(|p| p.name.as_str())
    }

    fn slot(&self, id: PodId) -> Option<&Pod> {
        self.pods.get(id as usize).filter(|p| p.live)
    }

    /// Names of the pods in the index.
    pub fn pod_names(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|p| p.live)
            .map(|p| p.name.clone())
            .collect()
    }

    /// Blocks pod `id` holds, in all tiers.
    pub fn pod_len(&self, id: PodId) -> usize {
        self.slot(id).map_or(0, Pod::held)
    }

    /// Blocks pod `id` holds in tier `tier`.
    pub fn tier_len(&self, id: PodId, tier: Tier) -> usize {
        self.slot(id)
            .and_then(|p| p.map(tier))
            .map_or(0, EngineMap::len)
    }

    /// Blocks pod `id` holds by tier name, the tiers holding any.
    pub fn tier_lens(&self, id: PodId) -> Vec<(&str, usize)> {
        (0..=self.tiers.len())
            .map(|t| t as Tier)
            .filter_map(|t| Some((self.tier_name(t)?, self.tier_len(id, t))))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The block size of pod `id`'s events (None before its first `BlockStored`).
    pub fn block_size(&self, id: PodId) -> Option<usize> {
        self.slot(id)
            .map(|p| p.block_size as usize)
            .filter(|b| *b > 0)
    }

    /// (pod, block) pairs held over all pods.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Distinct keys held by any pod.
    pub fn distinct_keys(&self) -> usize {
        self.blocks.len()
    }

    fn unhold(&mut self, key: u64, pod: PodId, tier: Tier) {
        let (id, pod) = (pod, holder(pod, tier));
        let Some(h) = self.blocks.get_mut(&key) else {
            return;
        };
        match h.0 {
            [SPILLED, i] => {
                let Some(v) = self.spill.get_mut(i as usize) else {
                    return;
                };
                let Some(at) = v.iter().position(|p| *p == pod) else {
                    return;
                };
                v.swap_remove(at);
                if v.len() <= 2 {
                    // Back inline.
                    *h = Holders([v[0], v.get(1).copied().unwrap_or(NONE)]);
                    v.clear();
                    v.shrink_to_fit();
                    self.spill_free.push(i);
                }
            }
            [a, b] if a == pod => {
                if b == NONE {
                    self.blocks.remove(&key);
                } else {
                    h.0 = [b, NONE];
                }
            }
            [_, b] if b == pod => h.0[1] = NONE,
            _ => return,
        }
        self.entries -= 1;
        let still = self
            .blocks
            .get(&key)
            .is_some_and(|h| holders(&self.spill, h).contains(&pod));
        if !still {
            self.distinct_change(id, tier, key, false);
        }
    }

    /// Pod `pod` started or stopped holding `key` in tier `tier` at all.
    fn distinct_change(&mut self, pod: PodId, tier: Tier, key: u64, added: bool) {
        let mixed = self.mix(key, tier);
        if let Some(p) = self.pods.get_mut(pod as usize) {
            if added {
                p.distinct += 1;
                p.digest = p.digest.wrapping_add(mixed);
            } else {
                p.distinct -= 1;
                p.digest = p.digest.wrapping_sub(mixed);
            }
        }
        if let Some(j) = &mut self.journal {
            j.push(Change {
                pod,
                tier,
                key,
                added,
            });
        }
    }

    fn hold(&mut self, key: u64, pod: PodId, tier: Tier) {
        let (id, pod) = (pod, holder(pod, tier));
        self.entries += 1;
        let Some(h) = self.blocks.get_mut(&key) else {
            self.blocks.insert(key, Holders::one(pod));
            self.distinct_change(id, tier, key, true);
            return;
        };
        if !holders(&self.spill, h).contains(&pod) {
            self.distinct_change(id, tier, key, true);
        }
        let Some(h) = self.blocks.get_mut(&key) else {
            return;
        };
        match h.0 {
            [SPILLED, i] => {
                if let Some(v) = self.spill.get_mut(i as usize) {
                    v.push(pod);
                }
            }
            [a, NONE] => h.0 = [a, pod],
            [a, b] => {
                let list = vec![a, b, pod];
                let i = crate::slots::place(&mut self.spill, &mut self.spill_free, list);
                h.0 = [SPILLED, i];
            }
        }
    }

    /// Forget everything pod `id` holds (its engine cleared its cache, restarted, or events
    /// were lost beyond repair). Returns the blocks dropped.
    pub fn clear_pod(&mut self, id: PodId) -> u64 {
        let Some(p) = self.pods.get_mut(id as usize).filter(|p| p.live) else {
            return 0;
        };
        let engine = std::mem::take(&mut p.engine);
        let offload = std::mem::take(&mut p.offload);
        let mut n = 0;
        for (t, map) in std::iter::once(engine).chain(offload).enumerate() {
            n += map.len() as u64;
            for key in map.into_values() {
                self.unhold(key, id, t as Tier);
            }
        }
        n
    }

    /// Remove pod `name` altogether.
    pub fn remove_pod(&mut self, name: &str) {
        if let Some(id) = self.by_name.remove(name) {
            self.clear_pod(id);
            // Its slot will be reused: no speculation may carry over to the next pod.
            self.speculative.retain(|_, v| {
                v.retain(|e| e.0 != id);
                !v.is_empty()
            });
            self.spec_queue.retain(|e| e.2 != id);
            if let Some(p) = self.pods.get_mut(id as usize) {
                *p = Pod::default();
            }
        }
    }

    /// Apply one batch of pod `id`'s events, in order. `model` is the model its topic names (the
    /// key space of its base-model blocks); `root` derives a chain's first parent key from the
    /// effective model (the adapter's name for LoRA blocks), followed by the cache salt for a
    /// salted chain — the same seed requests use ([`crate::BlockHasher`]).
    pub fn apply(
        &mut self,
        id: PodId,
        model: &str,
        events: &[KvEvent],
        root: &dyn Fn(&str) -> u64,
    ) -> Applied {
        let mut out = Applied::default();
        if self.slot(id).is_none() {
            return out;
        }
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => out += self.stored(id, model, s, root),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    // A medium never stored holds nothing to remove.
                    let Some(tier) = self.known_tier(medium.as_deref()) else {
                        continue;
                    };
                    for h in block_hashes {
                        let key = self.pods[id as usize].map_mut(tier).remove(h);
                        if let Some(key) = key {
                            self.unhold(key, id, tier);
                            out.removed += 1;
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    out.removed += self.clear_pod(id);
                    out.cleared += 1;
                }
            }
        }
        out
    }

    fn stored(
        &mut self,
        id: PodId,
        model: &str,
        s: &BlockStored,
        root: &dyn Fn(&str) -> u64,
    ) -> Applied {
        let mut out = Applied::default();
        let bs = s.block_size as usize;
        let n = s.block_hashes.len();
        let spec_ok = s
            .kv_cache_spec_kind
            .as_deref()
            .is_none_or(|k| k.contains("full"));
        let tier = self.tier(s.medium.as_deref());
        let (Some(tier), true) = (tier, spec_ok && bs > 0 && bs <= MAX_BLOCK_SIZE && n > 0) else {
            out.skipped += 1;
            return out;
        };
        if s.token_ids.is_empty() {
            // Hash-only (offload connectors): blocks this pod already mapped, now in `tier`.
            for eh in &s.block_hashes {
                match self.pods[id as usize].resolve(tier, *eh) {
                    Some(key) => self.insert(id, tier, *eh, key, &mut out),
                    None => out.orphaned += 1,
                }
            }
            if out.stored > 0 {
                self.pods[id as usize].block_size = s.block_size;
            }
            return out;
        }
        let effective = match (&s.lora_name, s.lora_id) {
            (Some(name), _) if !name.is_empty() => Some(name.as_str()),
            (_, Some(id)) if id > 0 => None, // an adapter we cannot name
            _ => Some(model),
        };
        let Some(effective) = effective.filter(|_| s.token_ids.len() == n * bs) else {
            out.skipped += 1;
            return out;
        };
        let parent = match s.parent_block_hash {
            // A salted prompt's chain starts from the model and the salt, as the request's does.
            None => match &s.cache_salt {
                Some(salt) => root(&format!("{effective}{salt}")),
                None => root(effective),
            },
            Some(h) => match self.pods[id as usize].resolve(tier, h) {
                Some(k) => k,
                None => {
                    out.orphaned += n as u64;
                    return out;
                }
            },
        };
        let mut keys = Vec::with_capacity(n);
        chain_full_blocks(parent, &s.token_ids, bs, &mut keys);
        self.pods[id as usize].block_size = s.block_size;
        for (eh, key) in s.block_hashes.iter().zip(keys) {
            self.insert(id, tier, *eh, key, &mut out);
        }
        out
    }

    /// Pod `id`'s engine block `eh` is `key`, in tier `tier`.
    fn insert(&mut self, id: PodId, tier: Tier, eh: u64, key: u64, out: &mut Applied) {
        let known = self.pods[id as usize]
            .map(tier)
            .is_some_and(|m| m.contains_key(&eh));
        if !known && self.full(id) {
            out.skipped += 1;
            return;
        }
        let old = self.pods[id as usize].map_mut(tier).insert(eh, key);
        match old {
            Some(old) if old == key => return, // stored twice (replay overlap)
            Some(old) => self.unhold(old, id, tier),
            None => {}
        }
        self.hold(key, id, tier);
        out.stored += 1;
    }

    /// Each pod's run of leading `keys` it holds (pods with a run of 0 are left out), into `out`.
    pub fn match_prefix(&self, keys: &[u64], out: &mut Vec<PreciseMatch>) {
        self.match_prefix_at(keys, None, out);
    }

    /// [`Self::match_prefix`], counting also the speculative entries still alive at `now`
    /// ([`Self::speculate`]) when `now` is given. A speculative entry scores as a GPU block.
    pub fn match_prefix_at(&self, keys: &[u64], now: Option<u64>, out: &mut Vec<PreciseMatch>) {
        out.clear();
        let empty: &[(PodId, u64)] = &[];
        let spec = |key: &u64| match now {
            Some(_) if !self.speculative.is_empty() => {
                self.speculative.get(key).map_or(empty, Vec::as_slice)
            }
            _ => empty,
        };
        let alive = move |e: &(PodId, u64)| now.is_some_and(|t| e.1 > t);
        let held = |key: &u64| {
            self.blocks
                .get(key)
                .map_or(&[][..], |h| holders(&self.spill, h))
        };
        // Weight by tier (holders carry theirs in the top bits).
        let mut weights = [1.0f32; MAX_TIERS + 1];
        for (t, w) in weights.iter_mut().enumerate().take(self.tiers.len() + 1) {
            *w = self.tier_weight(t as Tier);
        }
        let gpu = weights[GPU as usize];
        let weight = |h: PodId| weights[tier_of(h) as usize];
        let Some(first) = keys.first() else { return };
        let spec_first = spec(first);
        let firsts = held(first)
            .iter()
            .map(|h| (pod_of(*h), weight(*h)))
            .chain(spec_first.iter().filter(|e| alive(e)).map(|e| (e.0, gpu)));
        out.extend(firsts.map(|(pod, score)| PreciseMatch {
            pod,
            blocks: 1,
            score,
        }));
        // A pod may hold the first block in several tiers (or twice), and be speculated to: one
        // run each, at its best tier.
        if out.len() > 1 {
            out.sort_unstable_by_key(|m| m.pod);
            out.dedup_by(|later, kept| {
                let same = later.pod == kept.pod;
                if same {
                    kept.score = kept.score.max(later.score);
                }
                same
            });
        }
        // By pod id: the last block (1-based) seen held by that pod, and its best weight there.
        // A block every pod holds (a system prompt) has a holder list as long as the pool:
        // asking it pod by pod would be quadratic, so long lists are marked here once and each
        // run checks its mark.
        let mut mark: Vec<(u32, f32)> = Vec::new();
        // `out[..active]` are still running; finished runs are swapped behind them.
        let mut active = out.len();
        for (i, key) in keys.iter().enumerate().skip(1) {
            if active == 0 {
                break;
            }
            let (h, sp) = (held(key), spec(key));
            if h.is_empty() && sp.is_empty() {
                break;
            }
            let marked = h.len() + sp.len() > LINEAR_HOLDERS && active > LINEAR_HOLDERS;
            if marked {
                if mark.is_empty() {
                    mark = vec![(0, 0.0); self.pods.len()];
                }
                let pods = h
                    .iter()
                    .map(|h| (pod_of(*h), weight(*h)))
                    .chain(sp.iter().filter(|e| alive(e)).map(|e| (e.0, gpu)));
                for (pod, w) in pods {
                    if let Some(m) = mark.get_mut(pod as usize) {
                        *m = if m.0 == i as u32 {
                            (m.0, m.1.max(w))
                        } else {
                            (i as u32, w)
                        };
                    }
                }
            }
            active = if marked {
                extend_runs(out, active, i, |pod| {
                    mark.get(pod as usize)
                        .filter(|m| m.0 == i as u32)
                        .map(|m| m.1)
                })
            } else {
                extend_runs(out, active, i, |pod| {
                    let tiers = h.iter().filter(|x| pod_of(**x) == pod).map(|x| weight(*x));
                    let spec = sp.iter().filter(|e| e.0 == pod && alive(e)).map(|_| gpu);
                    tiers.chain(spec).reduce(f32::max)
                })
            };
        }
    }

    /// Speculative indexing: pod `id` is about to hold `keys` (a request was just routed there),
    /// until `expires` — before its engine's events say so. Entries past their time are swept
    /// here, oldest first (every call passes the same time-to-live, so the queue is in expiry
    /// order); at most [`MAX_SPECULATIVE`] are kept.
    pub fn speculate(&mut self, id: PodId, keys: &[u64], now: u64, expires: u64) {
        while let Some(&(exp, key, pod)) = self.spec_queue.front() {
            if exp > now && self.spec_queue.len() + keys.len() <= MAX_SPECULATIVE {
                break;
            }
            self.spec_queue.pop_front();
            self.unspeculate(key, pod, exp);
        }
        if self.slot(id).is_none() {
            return;
        }
        for &key in keys.iter().take(MAX_SPECULATIVE) {
            let v = self.speculative.entry(key).or_default();
            match v.iter_mut().find(|e| e.0 == id) {
                Some(e) => e.1 = expires,
                None => v.push((id, expires)),
            }
            self.spec_queue.push_back((expires, key, id));
        }
    }

    /// Drops `pod`'s speculative entry of `key` if it still expires at `exp` (not renewed).
    fn unspeculate(&mut self, key: u64, pod: PodId, exp: u64) {
        if let Some(v) = self.speculative.get_mut(&key) {
            v.retain(|e| !(e.0 == pod && e.1 <= exp));
            if v.is_empty() {
                self.speculative.remove(&key);
            }
        }
    }

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

    /// Heap bytes held (hash tables at their capacity, spilled holder lists, names), for the
    /// memory-per-entry figure.
    pub fn approx_heap_bytes(&self) -> usize {
        use crate::approx::map_heap_bytes;
        let mut n = map_heap_bytes::<u64, Holders>(self.blocks.capacity())
            + self.spill.capacity() * std::mem::size_of::<Vec<PodId>>()
            + self
                .spill
                .iter()
                .map(|v| v.capacity() * std::mem::size_of::<PodId>())
                .sum::<usize>()
            + self.spill_free.capacity() * std::mem::size_of::<PodId>();
        for p in &self.pods {
            n += map_heap_bytes::<u64, u64>(p.engine.capacity()) + p.name.capacity();
            n += p
                .offload
                .iter()
                .map(|m| {
                    map_heap_bytes::<u64, u64>(m.capacity()) + std::mem::size_of::<EngineMap>()
                })
                .sum::<usize>();
        }
        n + self.pods.capacity() * std::mem::size_of::<Pod>()
    }

    /// Pod `id`'s keys held in its GPU tier, sorted (for tests comparing indexes).
    pub fn held_keys(&self, id: PodId) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .slot(id)
            .map(|p| p.engine.values().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests;

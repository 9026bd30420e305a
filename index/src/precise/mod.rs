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

mod matching;
mod replica;
mod tiers;

pub use matching::PreciseMatch;
pub use replica::{Change, PodKeys};
pub use tiers::{GPU, MAX_TIERS, Tier};
use tiers::{POD_MASK, TierInfo, holder};

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

/// No pod in this slot.
const NONE: PodId = PodId::MAX;
/// First slot of a key held by more than two pods: the second slot indexes `spill`.
const SPILLED: PodId = PodId::MAX - 1;
/// Pod ids fit below the tier bits.
const MAX_PODS: usize = POD_MASK as usize;

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
    /// Scoring weight by lowercased medium name (a medium not named there: 1), and the GPU's
    /// (looked up per decision; `None`: 1).
    weights: Vec<(String, f32)>,
    gpu_weight: Option<f32>,
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

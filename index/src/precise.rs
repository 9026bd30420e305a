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
//!   arena;
//! - per pod, engine hash → our key.
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

/// No pod in this slot.
const NONE: PodId = PodId::MAX;
/// First slot of a key held by more than two pods: the second slot indexes `spill`.
const SPILLED: PodId = PodId::MAX - 1;
/// Pod ids stay below the markers.
const MAX_PODS: usize = (PodId::MAX - 1) as usize;
/// Blocks one pod may hold in the index (16M blocks: 256M tokens at 16 per block, far beyond any
/// engine's KV cache). An engine or a peer claiming more is not believed: further stores are
/// skipped (and counted) until removals make room.
pub const MAX_POD_BLOCKS: usize = 1 << 24;
/// Speculative entries kept at most (the oldest are dropped first).
pub const MAX_SPECULATIVE: usize = 1 << 20;

/// The pods holding one key, as a multiset (see the module doc): up to two inline — 8 bytes, so a
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
    /// Engine block hash → our key (a mirrored pod: key → key).
    engine: EngineMap,
    /// Distinct keys held, and their wrapping sum: the digest replicas compare.
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
    /// Blocks of a `BlockStored` whose parent block this pod is not known to hold (an event was
    /// lost): their keys cannot be computed, so they are not indexed.
    pub orphaned: u64,
    /// Events not indexed on purpose: hash-only or non-GPU stores, another attention kind, an
    /// adapter known only by id, malformed token spans.
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

/// One pod's run of leading blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreciseMatch {
    pub pod: PodId,
    pub blocks: usize,
}

/// Holder lists up to this long are searched pod by pod when matching; longer ones are marked.
const LINEAR_HOLDERS: usize = 8;

/// The runs `out[..active]` whose pod `holds` block `i` grow to `i + 1` blocks; the others end
/// (swapped behind). Returns how many still run.
fn extend_runs(
    out: &mut [PreciseMatch],
    mut active: usize,
    i: usize,
    holds: impl Fn(PodId) -> bool,
) -> usize {
    let mut j = 0;
    while j < active {
        if holds(out[j].pod) {
            out[j].blocks = i + 1;
            j += 1;
        } else {
            active -= 1;
            out.swap(j, active);
        }
    }
    active
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
    journal: Option<Vec<(PodId, u64, bool)>>,
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
        self.pods[id as usize].engine.len() >= limit
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

    /// Blocks pod `id` holds.
    pub fn pod_len(&self, id: PodId) -> usize {
        self.slot(id).map_or(0, |p| p.engine.len())
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

    fn unhold(&mut self, key: u64, pod: PodId) {
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
            self.distinct_change(pod, key, false);
        }
    }

    /// Pod `pod` started or stopped holding `key` at all.
    fn distinct_change(&mut self, pod: PodId, key: u64, added: bool) {
        if let Some(p) = self.pods.get_mut(pod as usize) {
            if added {
                p.distinct += 1;
                p.digest = p.digest.wrapping_add(key);
            } else {
                p.distinct -= 1;
                p.digest = p.digest.wrapping_sub(key);
            }
        }
        if let Some(j) = &mut self.journal {
            j.push((pod, key, added));
        }
    }

    fn hold(&mut self, key: u64, pod: PodId) {
        self.entries += 1;
        let Some(h) = self.blocks.get_mut(&key) else {
            self.blocks.insert(key, Holders::one(pod));
            self.distinct_change(pod, key, true);
            return;
        };
        if !holders(&self.spill, h).contains(&pod) {
            self.distinct_change(pod, key, true);
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
        let n = engine.len() as u64;
        for key in engine.into_values() {
            self.unhold(key, id);
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
                    if !is_gpu(medium.as_deref()) {
                        out.skipped += 1;
                        continue;
                    }
                    for h in block_hashes {
                        let key = self.pods[id as usize].engine.remove(h);
                        if let Some(key) = key {
                            self.unhold(key, id);
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
        let effective = match (&s.lora_name, s.lora_id) {
            (Some(name), _) if !name.is_empty() => Some(name.as_str()),
            (_, Some(id)) if id > 0 => None, // an adapter we cannot name
            _ => Some(model),
        };
        let Some(effective) = effective.filter(|_| {
            spec_ok
                && is_gpu(s.medium.as_deref())
                && bs > 0
                && bs <= MAX_BLOCK_SIZE
                && n > 0
                && s.token_ids.len() == n * bs
        }) else {
            out.skipped += 1;
            return out;
        };
        let parent = match s.parent_block_hash {
            // A salted prompt's chain starts from the model and the salt, as the request's does.
            None => match &s.cache_salt {
                Some(salt) => root(&format!("{effective}{salt}")),
                None => root(effective),
            },
            Some(h) => match self.pods[id as usize].engine.get(&h) {
                Some(k) => *k,
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
            if self.full(id) && !self.pods[id as usize].engine.contains_key(eh) {
                out.skipped += 1;
                continue;
            }
            let old = self.pods[id as usize].engine.insert(*eh, key);
            match old {
                Some(old) if old == key => continue, // stored twice (replay overlap)
                Some(old) => self.unhold(old, id),
                None => {}
            }
            self.hold(key, id);
            out.stored += 1;
        }
        out
    }

    /// Each pod's run of leading `keys` it holds (pods with a run of 0 are left out), into `out`.
    pub fn match_prefix(&self, keys: &[u64], out: &mut Vec<PreciseMatch>) {
        self.match_prefix_at(keys, None, out);
    }

    /// [`Self::match_prefix`], counting also the speculative entries still alive at `now`
    /// ([`Self::speculate`]) when `now` is given.
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
        let Some(first) = keys.first() else { return };
        let spec_first = spec(first);
        let firsts = held(first)
            .iter()
            .copied()
            .chain(spec_first.iter().filter(|e| alive(e)).map(|e| e.0));
        // A pod may hold the first block and be speculated to: one run each.
        out.extend(firsts.map(|pod| PreciseMatch { pod, blocks: 1 }));
        if !spec_first.is_empty() {
            out.sort_unstable_by_key(|m| m.pod);
            out.dedup_by_key(|m| m.pod);
        }
        // By pod id: the last block (1-based) seen held by that pod. A block every pod holds (a
        // system prompt) has a holder list as long as the pool: asking it pod by pod would be
        // quadratic, so long lists are marked here once and each run checks its mark.
        let mut mark: Vec<u32> = Vec::new();
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
                    mark = vec![0; self.pods.len()];
                }
                let pods = h
                    .iter()
                    .copied()
                    .chain(sp.iter().filter(|e| alive(e)).map(|e| e.0));
                for pod in pods {
                    if let Some(m) = mark.get_mut(pod as usize) {
                        *m = i as u32;
                    }
                }
            }
            active = if marked {
                extend_runs(out, active, i, |pod| {
                    mark.get(pod as usize) == Some(&(i as u32))
                })
            } else {
                extend_runs(out, active, i, |pod| {
                    h.contains(&pod) || sp.iter().any(|e| e.0 == pod && alive(e))
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

    /// Record every change of a pod's distinct keys from now on (for replication).
    pub fn journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since the last call: (pod, key, added), in order.
    pub fn take_journal(&mut self) -> Vec<(PodId, u64, bool)> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Pod `id`'s distinct keys held and their digest (wrapping sum): equal sets give equal
    /// digests, whichever events built them.
    pub fn digest(&self, id: PodId) -> (u64, u64) {
        self.slot(id).map_or((0, 0), |p| (p.distinct, p.digest))
    }

    /// A mirrored pod (its events are applied on another replica): take that replica's changes
    /// of its distinct keys. Idempotent per key (adding a held key, removing an absent one: no-op).
    pub fn mirror(&mut self, id: PodId, block_size: u32, adds: &[u64], removes: &[u64]) {
        if self.slot(id).is_none() {
            return;
        }
        for k in removes {
            if self.pods[id as usize].engine.remove(k).is_some() {
                self.unhold(*k, id);
            }
        }
        for k in adds {
            if self.full(id) {
                break;
            }
            if self.pods[id as usize].engine.insert(*k, *k).is_none() {
                self.hold(*k, id);
            }
        }
        if block_size > 0 && block_size as usize <= MAX_BLOCK_SIZE {
            self.pods[id as usize].block_size = block_size;
        }
    }

    /// A mirrored pod's whole state, replacing what it held.
    pub fn replace_mirror(&mut self, id: PodId, block_size: u32, keys: &[u64]) {
        self.clear_pod(id);
        self.mirror(id, block_size, keys, &[]);
    }

    /// Pod `id`'s distinct keys (its state for a peer) and block size.
    pub fn pod_state(&self, id: PodId) -> (u32, Vec<u64>) {
        let mut keys = self.held_keys(id);
        keys.dedup();
        (self.slot(id).map_or(0, |p| p.block_size), keys)
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
        }
        n + self.pods.capacity() * std::mem::size_of::<Pod>()
    }

    /// Every pod's held keys, sorted (for tests comparing indexes).
    pub fn held_keys(&self, id: PodId) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .slot(id)
            .map(|p| p.engine.values().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }
}

/// GPU blocks are the ones that make a prefill cheap; CPU and storage tiers (offload) are left to
/// a later tier-aware score.
fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockHasher;

    #[test]
    fn speculative_entries_match_until_they_expire() {
        let mut ix = PreciseIndex::new();
        let a = ix.pod("a");
        let b = ix.pod("b");
        let t = toks(12, 5);
        let k = keys("m", &t);
        // b's engine holds the first block; a was just sent the whole prompt.
        ix.apply(b, "m", &[stored(&[1], None, &t[..4])], &root);
        ix.speculate(a, &k, 100, 2100);
        let mut out = Vec::new();
        ix.match_prefix_at(&k, Some(1000), &mut out);
        out.sort_by_key(|m| m.pod);
        assert_eq!(
            out,
            vec![
                PreciseMatch { pod: a, blocks: 3 },
                PreciseMatch { pod: b, blocks: 1 }
            ]
        );
        // Without speculation, or once expired: only what the engines reported.
        ix.match_prefix(&k, &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: b, blocks: 1 }]);
        ix.match_prefix_at(&k, Some(2100), &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: b, blocks: 1 }]);
        // A later call sweeps the expired entries; a renewed one survives its old expiry.
        ix.speculate(b, &k[..1], 2200, 4200);
        assert!(!ix.speculative.contains_key(&k[1]));
        ix.speculate(b, &k[..1], 3000, 5000);
        ix.speculate(b, &[], 4300, 6300);
        ix.match_prefix_at(&k, Some(4300), &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: b, blocks: 1 }]);
        assert_eq!(ix.speculative.get(&k[0]).map(Vec::len), Some(1));
        // A removed pod's speculation goes with it.
        ix.remove_pod("b");
        assert!(ix.speculative.is_empty() && ix.spec_queue.is_empty());
    }

    #[test]
    fn a_pod_claiming_more_blocks_than_any_cache_is_not_believed() {
        let mut ix = PreciseIndex::with_pod_limit(2);
        let a = ix.pod("a");
        let t = toks(16, 1);
        let r = ix.apply(a, "m", &[stored(&[1, 2, 3, 4], None, &t)], &root);
        assert_eq!((r.stored, r.skipped, ix.pod_len(a)), (2, 2, 2));
        // A removal makes room again; a peer's mirror is bounded alike.
        ix.apply(
            a,
            "m",
            &[KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: None,
                group_idx: None,
            }],
            &root,
        );
        assert_eq!(ix.pod_len(a), 1);
        let b = ix.pod("b");
        ix.mirror(b, 4, &[10, 11, 12], &[]);
        assert_eq!(ix.pod_len(b), 2);
    }

    #[test]
    fn holders_stay_small() {
        assert_eq!(std::mem::size_of::<(u64, Holders)>(), 16);
    }

    fn root(model: &str) -> u64 {
        BlockHasher::new(model, None, 16, 0).seed
    }

    fn toks(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 4,
            ..BlockStored::default()
        })
    }

    fn keys(model: &str, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::new();
        chain_full_blocks(root(model), tokens, 4, &mut out);
        out
    }

    #[test]
    fn stored_blocks_match_the_requests_tokens_and_removals_cut_the_run() {
        let mut ix = PreciseIndex::new();
        let a = ix.pod("a");
        let b = ix.pod("b");
        let t = toks(16, 1);
        // a stores 4 blocks in two events (the second chained from the first's last hash).
        let r = ix.apply(a, "m", &[stored(&[11, 12], None, &t[..8])], &root);
        assert_eq!(r.stored, 2);
        ix.apply(a, "m", &[stored(&[13, 14], Some(12), &t[8..])], &root);
        // b stores only the first block.
        ix.apply(b, "m", &[stored(&[91], None, &t[..4])], &root);
        let mut out = Vec::new();
        // A request of 18 tokens: 4 full blocks (the partial tail is never cached).
        let mut req = t.clone();
        req.extend([5, 5]);
        ix.match_prefix(&keys("m", &req), &mut out);
        out.sort_by_key(|m| m.pod);
        assert_eq!(
            out,
            vec![
                PreciseMatch { pod: a, blocks: 4 },
                PreciseMatch { pod: b, blocks: 1 }
            ]
        );
        // Another model's key space does not match.
        ix.match_prefix(&keys("other", &req), &mut out);
        assert!(out.is_empty());
        // a evicts its second block: its run stops at 1.
        let r = ix.apply(
            a,
            "m",
            &[KvEvent::BlockRemoved {
                block_hashes: vec![12, 999],
                medium: None,
                group_idx: None,
            }],
            &root,
        );
        assert_eq!(r.removed, 1);
        ix.match_prefix(&keys("m", &req), &mut out);
        assert!(out.iter().all(|m| m.blocks == 1), "{out:?}");
        assert_eq!((ix.len(), ix.pod_len(a), ix.pod_len(b)), (4, 3, 1));
        // Cleared: a holds nothing.
        ix.apply(a, "m", &[KvEvent::AllBlocksCleared], &root);
        ix.match_prefix(&keys("m", &req), &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: b, blocks: 1 }]);
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn an_unknown_parent_is_an_orphan_and_odd_events_are_skipped() {
        let mut ix = PreciseIndex::new();
        let a = ix.pod("a");
        let t = toks(8, 3);
        let r = ix.apply(a, "m", &[stored(&[2], Some(777), &t[4..])], &root);
        assert_eq!((r.stored, r.orphaned), (0, 1));
        // Tokens that do not cover the blocks, hash-only, CPU tier, an unnamed adapter, a
        // sliding-window group: not indexed.
        let mut cpu = BlockStored {
            block_hashes: vec![1],
            token_ids: t[..4].to_vec(),
            block_size: 4,
            medium: Some("CPU".into()),
            ..BlockStored::default()
        };
        let mut odd = vec![stored(&[1, 2], None, &t[..5]), stored(&[1], None, &[])];
        odd.push(KvEvent::BlockStored(cpu.clone()));
        cpu.medium = None;
        cpu.lora_id = Some(3);
        odd.push(KvEvent::BlockStored(cpu.clone()));
        cpu.lora_id = None;
        cpu.kv_cache_spec_kind = Some("sliding_window".into());
        odd.push(KvEvent::BlockStored(cpu.clone()));
        let r = ix.apply(a, "m", &odd, &root);
        assert_eq!((r.stored, r.skipped), (0, 5));
        assert!(ix.is_empty());
        // A named adapter's blocks live in the adapter's key space.
        cpu.kv_cache_spec_kind = Some("full_attention".into());
        cpu.lora_id = Some(3);
        cpu.lora_name = Some("sql".into());
        ix.apply(a, "m", &[KvEvent::BlockStored(cpu)], &root);
        let mut out = Vec::new();
        ix.match_prefix(&keys("sql", &t), &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: a, blocks: 1 }]);
        ix.match_prefix(&keys("m", &t), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_key_held_twice_by_one_pod_survives_one_removal() {
        let mut ix = PreciseIndex::new();
        let a = ix.pod("a");
        let t = toks(4, 9);
        ix.apply(
            a,
            "m",
            &[stored(&[1], None, &t), stored(&[2], None, &t)],
            &root,
        );
        assert_eq!(ix.len(), 2);
        ix.apply(
            a,
            "m",
            &[KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Some("GPU".into()),
                group_idx: None,
            }],
            &root,
        );
        let mut out = Vec::new();
        ix.match_prefix(&keys("m", &t), &mut out);
        assert_eq!(out, vec![PreciseMatch { pod: a, blocks: 1 }]);
        // The same engine block stored again (a replay overlapping the live stream) counts once.
        let r = ix.apply(a, "m", &[stored(&[2], None, &t)], &root);
        assert_eq!((r.stored, ix.len()), (0, 1));
    }

    #[test]
    fn many_holders_spill_and_removed_pods_free_their_slot() {
        let mut ix = PreciseIndex::new();
        let t = toks(4, 2);
        for i in 0..6 {
            let p = ix.pod(&format!("p{i}"));
            ix.apply(p, "m", &[stored(&[i], None, &t)], &root);
        }
        let mut out = Vec::new();
        ix.match_prefix(&keys("m", &t), &mut out);
        assert_eq!(out.len(), 6);
        ix.remove_pod("p2");
        ix.match_prefix(&keys("m", &t), &mut out);
        assert_eq!(out.len(), 5);
        assert_eq!(ix.pod_id("p2"), None);
        assert_eq!(ix.pod("new"), 2, "the freed slot is reused");
        assert_eq!(ix.pod_len(2), 0);
        assert!(ix.approx_heap_bytes() > 0);
    }
}

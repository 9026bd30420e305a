//! The precise prefix index: which KV blocks each pod's engine holds right now, rebuilt from the
//! engine's own KV events ([`crate::kvevents`]) rather than guessed from routing decisions.
//!
//! Engines name blocks by their own hashes (vLLM: SHA-256 over pickled tuples with a per-process
//! seed), which a router cannot reproduce. So, as llm-d's indexer does, every block is keyed by
//! *our* chained hash over its token ids ([`chain_full_blocks`]: the same chain as
//! [`crate::hashing::block_hashes_of_tokens`], full blocks only, seeded by the model — the LoRA
//! adapter's name for adapter blocks — and the cache salt), and each pod keeps the map from its
//! engine's hashes to our keys, learnt from `BlockStored` (which carries the tokens and the parent's
//! engine hash). A request's tokens hash to the same keys, and [`PreciseIndex::match_prefix`] gives
//! every pod its run of leading blocks held.
//!
//! Layout, for compactness (about 50–60 B per held block, see `approx_heap_bytes`):
//! - `blocks`: our key → the pods holding it, three inline before spilling to the heap;
//! - per pod, engine hash → our key.
//!
//! A pod appears in a key's holders once per engine block mapped to that key (a multiset): two
//! engine blocks can map to one key when the engine hashes something we do not (multimodal
//! identifiers, salts in old formats), and removing one of them must not forget the other.

use std::collections::HashMap;

use crate::hashing::MAX_BLOCK_SIZE;
use crate::idhash::IdMap;
use crate::kvevents::{BlockStored, KvEvent};

/// A pod's slot in the index.
pub type PodId = u32;

/// The key chain of `tokens`' full blocks of `block_size`, continuing from `prev` (a root from
/// [`crate::BlockHasher`]'s seed, or the parent block's key), appended to `out`.
pub fn chain_full_blocks(prev: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return;
    }
    let mut prev = prev;
    let mut buf = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        prev = crate::hashing::chain(prev, xxhash_rust::xxh64::xxh64(&buf, 0));
        out.push(prev);
    }
}

/// The pods holding one key, as a multiset (see the module doc).
#[derive(Debug, Clone)]
enum Holders {
    Few {
        len: u8,
        ids: [PodId; 3],
    },
    // Boxed: a thin pointer keeps the enum at 16 bytes (a `Vec` is 24, a `Box<[_]>` 16 plus the
    // tag); the spill is rare (a block on four or more pods).
    #[allow(clippy::box_collection)]
    Many(Box<Vec<PodId>>),
}

impl Holders {
    fn one(pod: PodId) -> Self {
        Holders::Few {
            len: 1,
            ids: [pod, 0, 0],
        }
    }

    fn as_slice(&self) -> &[PodId] {
        match self {
            Holders::Few { len, ids } => &ids[..usize::from(*len)],
            Holders::Many(v) => v,
        }
    }

    fn push(&mut self, pod: PodId) {
        match self {
            Holders::Few { len, ids } if usize::from(*len) < ids.len() => {
                ids[usize::from(*len)] = pod;
                *len += 1;
            }
            Holders::Few { ids, .. } => {
                let mut v = ids.to_vec();
                v.push(pod);
                *self = Holders::Many(Box::new(v));
            }
            Holders::Many(v) => v.push(pod),
        }
    }

    /// Removes one occurrence of `pod`; true if there was one.
    fn remove_one(&mut self, pod: PodId) -> bool {
        match self {
            Holders::Few { len, ids } => {
                let n = usize::from(*len);
                let Some(i) = ids[..n].iter().position(|p| *p == pod) else {
                    return false;
                };
                ids.copy_within(i + 1..n, i);
                *len -= 1;
                true
            }
            Holders::Many(v) => {
                let Some(i) = v.iter().position(|p| *p == pod) else {
                    return false;
                };
                v.swap_remove(i);
                true
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn contains(&self, pod: PodId) -> bool {
        self.as_slice().contains(&pod)
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Holders::Few { .. } => 0,
            Holders::Many(v) => 24 + v.capacity() * std::mem::size_of::<PodId>(),
        }
    }
}

#[derive(Debug, Default)]
struct Pod {
    name: String,
    /// Engine block hash → our key.
    engine: IdMap<u64, u64>,
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

#[derive(Debug, Default)]
pub struct PreciseIndex {
    pods: Vec<Pod>,
    by_name: HashMap<String, PodId>,
    blocks: IdMap<u64, Holders>,
    /// (pod, engine block) pairs held.
    entries: usize,
}

impl PreciseIndex {
    pub fn new() -> Self {
        Self::default()
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
        let id = PodId::try_from(id).unwrap_or(PodId::MAX);
        self.by_name.insert(name.to_string(), id);
        id
    }

    pub fn pod_id(&self, name: &str) -> Option<PodId> {
        self.by_name.get(name).copied()
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
        if let Some(h) = self.blocks.get_mut(&key)
            && h.remove_one(pod)
        {
            self.entries -= 1;
            if h.is_empty() {
                self.blocks.remove(&key);
            }
        }
    }

    fn hold(&mut self, key: u64, pod: PodId) {
        self.entries += 1;
        match self.blocks.get_mut(&key) {
            Some(h) => h.push(pod),
            None => {
                self.blocks.insert(key, Holders::one(pod));
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
            if let Some(p) = self.pods.get_mut(id as usize) {
                *p = Pod::default();
            }
        }
    }

    /// Apply one batch of pod `id`'s events, in order. `model` is the model its topic names (the
    /// key space of its base-model blocks); `root` derives a chain's first parent key from the
    /// effective model (the adapter's name for LoRA blocks) — the same seed requests use.
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
            None => root(effective),
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
        out.clear();
        let Some(first) = keys.first().and_then(|k| self.blocks.get(k)) else {
            return;
        };
        for &pod in first.as_slice() {
            if !out.iter().any(|m| m.pod == pod) {
                out.push(PreciseMatch { pod, blocks: 1 });
            }
        }
        // `out[..active]` are still running; finished runs are swapped behind them.
        let mut active = out.len();
        for (i, key) in keys.iter().enumerate().skip(1) {
            let Some(h) = self.blocks.get(key) else { break };
            let mut j = 0;
            while j < active {
                if h.contains(out[j].pod) {
                    out[j].blocks = i + 1;
                    j += 1;
                } else {
                    active -= 1;
                    out.swap(j, active);
                }
            }
            if active == 0 {
                break;
            }
        }
    }

    /// Heap bytes held (hash tables at their capacity, spilled holder lists, names), for the
    /// memory-per-entry figure.
    pub fn approx_heap_bytes(&self) -> usize {
        // hashbrown: one slot of (K, V) plus one control byte per bucket.
        let table = |cap: usize, slot: usize| cap * (slot + 1);
        let mut n = table(
            self.blocks.capacity(),
            std::mem::size_of::<(u64, Holders)>(),
        );
        n += self.blocks.values().map(Holders::heap_bytes).sum::<usize>();
        for p in &self.pods {
            n += table(p.engine.capacity(), 16) + p.name.capacity();
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
    fn holders_stay_small() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
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

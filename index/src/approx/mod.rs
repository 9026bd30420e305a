//! The approximate prefix index.
//!
//! Per pod: block hash → the timestamp of the last time a request carrying that block was routed to
//! the pod, bounded to the pod's capacity K by dropping the smallest (timestamp, hash) pairs (the
//! oldest entries, ties broken by the smaller hash). A reverse map hash → (pod, node) makes matching
//! a walk over the request's chain and is the only map: each pod keeps its entries as nodes of a
//! list in eviction order (O(1) to refresh, append or evict), found through the reverse map —
//! 47 bytes per entry at llm-d's default capacity where a per-pod map plus an ordered set took 124.
//!
//! Matching follows the chain: a pod's match is the number of leading blocks it holds
//! consecutively from block 0 (hashes are chained, so holding block *i* means the pod was sent the
//! whole prefix up to *i*; a hole left by eviction ends the run).
//!
//! # Replication
//! A pod's state — (epoch, ≤ K entries (hash, ts), one ts per hash) — is a state-based CRDT whose
//! join is: the higher epoch wins entirely (a pod recreated under the same address starts empty);
//! equal epochs take the per-hash max timestamp, then keep the K greatest (ts, hash) pairs — the
//! eviction order, so [`ApproxIndex::merge_pod`] is exactly insert-then-evict. K is per-replica
//! configuration, not state. [`PodState`] is both a full state ([`ApproxIndex::export_pod`]) and a
//! delta ([`ApproxIndex::insert_delta`] returns the entries an insert actually changed); joining the
//! delta elsewhere reproduces the insert. [`crate::crdt`] has the same join as `crdts::CvRDT`
//! values. Each pod keeps an order-independent digest (wrapping sum of a 64-bit mix of each (hash,
//! ts)), updated in O(1) per change, so anti-entropy compares [`ApproxIndex::digests`] and ships
//! full states only for pods that differ.

mod entries;
mod holders;
mod state;
#[cfg(test)]
mod tests;

use foldhash::HashMap;

use entries::{Node, PodEntries};
use holders::{Holder, Holders};
pub use state::{PodDigest, PodState};

/// Interned pod identifier (dense, reused after removal).
pub type PodId = u32;

/// How many leading blocks of a request a pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodMatch {
    pub pod: PodId,
    pub blocks: usize,
}

/// Heap bytes of a std (hashbrown) map of this capacity: buckets = the power of two whose 7/8 load
/// (all of it minus one below 8 buckets) is the capacity; one (K, V) slot and one control byte per
/// bucket plus a 16-byte control group.
pub(crate) fn map_heap_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (size_of::<(K, V)>() + 1) + 16
}

/// Holder lists up to this long are searched pod by pod when matching; longer ones are marked.
const LINEAR_HOLDERS: usize = 8;

/// The runs `out[..active]` whose pod `holds` the next block grow by one; the others end (swapped
/// behind). Returns how many still run.
fn extend_runs(out: &mut [PodMatch], mut active: usize, holds: impl Fn(PodId) -> bool) -> usize {
    let mut i = 0;
    while i < active {
        if holds(out[i].pod) {
            out[i].blocks += 1;
            i += 1;
        } else {
            active -= 1;
            out.swap(i, active);
        }
    }
    active
}

#[derive(Debug)]
pub struct ApproxIndex {
    default_capacity: usize,
    pods: Vec<Option<PodEntries>>,
    /// Looked up once per candidate per decision (1000 lookups at 1000 pods): a fast hasher.
    names: HashMap<String, PodId>,
    free: Vec<PodId>,
    rev: Holders,
    /// Reused by updates: the nodes they changed, to link.
    pending: Vec<u32>,
    /// Reused by [`ApproxIndex::merge_pod`]: the (hash, ts) a merge changed.
    scratch: Vec<(u64, u64)>,
}

impl ApproxIndex {
    /// `default_capacity`: entries kept per pod unless [`ApproxIndex::set_capacity`] says otherwise.
    pub fn new(default_capacity: usize) -> Self {
        ApproxIndex {
            default_capacity: default_capacity.max(1),
            pods: Vec::new(),
            names: HashMap::default(),
            free: Vec::new(),
            rev: Holders::default(),
            pending: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The id of pod `name`, creating an empty entry set (epoch 0) for it if needed.
    pub fn pod(&mut self, name: &str) -> PodId {
        if let Some(id) = self.names.get(name) {
            return *id;
        }
        self.create(name, 0)
    }

    /// Like [`ApproxIndex::pod`], for incarnation `epoch` of the pod: a new pod takes that epoch; an
    /// existing pod with a lower epoch is emptied and takes it; one with a higher epoch is returned
    /// unchanged (inserts then go to the newer incarnation).
    pub fn pod_with_epoch(&mut self, name: &str, epoch: u64) -> PodId {
        let Some(&id) = self.names.get(name) else {
            return self.create(name, epoch);
        };
        if let Some(Some(p)) = self.pods.get_mut(id as usize)
            && p.epoch < epoch
        {
            p.clear(&mut self.rev, id);
            p.epoch = epoch;
        }
        id
    }

    /// Ids are dense (freed ids are reused), so they stay far below [`SPILLED`].
    fn create(&mut self, name: &str, epoch: u64) -> PodId {
        let entries = PodEntries::new(name, epoch, self.default_capacity);
        let id = match self.free.pop() {
            Some(id) => {
                self.pods[id as usize] = Some(entries);
                id
            }
            None => {
                self.pods.push(Some(entries));
                (self.pods.len() - 1) as PodId
            }
        };
        self.names.insert(name.to_string(), id);
        id
    }

    fn entries(&self, id: PodId) -> Option<&PodEntries> {
        self.pods.get(id as usize).and_then(|p| p.as_ref())
    }

    pub fn pod_id(&self, name: &str) -> Option<PodId> {
        self.names.get(name).copied()
    }

    /// One more than the largest pod id in use: a table indexed by [`PodId`] has this length.
    pub fn pod_slots(&self) -> usize {
        self.pods.len()
    }

    pub fn pod_name(&self, id: PodId) -> Option<&str> {
        self.entries(id).map(|p| p.name.as_str())
    }

    /// Names of the pods held, sorted.
    pub fn pod_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.names.keys().cloned().collect();
        v.sort_unstable();
        v
    }

    /// The incarnation of pod `id`.
    pub fn epoch(&self, id: PodId) -> Option<u64> {
        self.entries(id).map(|p| p.epoch)
    }

    /// Bound pod `id` to `capacity` entries (e.g. its `num_gpu_blocks`), evicting if it shrinks.
    pub fn set_capacity(&mut self, id: PodId, capacity: usize) {
        let Some(Some(p)) = self.pods.get_mut(id as usize) else {
            return;
        };
        if p.capacity == capacity.max(1) {
            return;
        }
        p.capacity = capacity.max(1);
        p.evict(&mut self.rev, id);
    }

    /// Record that a request with these block hashes was routed to `pod` at time `ts`.
    pub fn insert(&mut self, pod: PodId, hashes: &[u64], ts: u64) {
        let Some(Some(p)) = self.pods.get_mut(pod as usize) else {
            return;
        };
        for &h in hashes {
            p.upsert(&mut self.rev, pod, h, ts, &mut self.pending);
        }
        p.link_pending(&mut self.pending);
        p.evict(&mut self.rev, pod);
    }

    /// [`ApproxIndex::insert`], returning the delta to disseminate: the pod's name and epoch and the
    /// (hash, ts) entries the insert changed and kept (in `hashes` order; hashes already held at ≥
    /// `ts` are skipped), or `None` if the pod's state did not change.
    pub fn insert_delta(&mut self, pod: PodId, hashes: &[u64], ts: u64) -> Option<PodState> {
        let p = self.pods.get_mut(pod as usize)?.as_mut()?;
        let mut entries = Vec::with_capacity(hashes.len());
        for &h in hashes {
            if p.upsert(&mut self.rev, pod, h, ts, &mut self.pending) {
                entries.push((h, ts));
            }
        }
        p.link_pending(&mut self.pending);
        if p.evict(&mut self.rev, pod) > 0 {
            // Changed entries evicted at once are no news (and if all were, neither was the insert:
            // the K survivors would all have been held before).
            let rev = &self.rev;
            entries.retain(|&(h, t)| p.ts_of(rev, pod, h) == Some(t));
        }
        if entries.is_empty() {
            return None;
        }
        Some(PodState {
            name: p.name.clone(),
            epoch: p.epoch,
            entries,
        })
    }

    /// Join `delta` (a delta or a full state) into the local pod `delta.name`, creating it (default
    /// capacity, epoch 0) if unknown: a higher epoch empties the pod first, a lower one is ignored;
    /// then per-hash max timestamp and eviction to the pod's capacity, exactly as
    /// [`ApproxIndex::insert`].
    ///
    /// Returns how many entries changed and stayed (inserted or timestamp raised); on an epoch bump,
    /// plus the entries dropped, and at least 1. 0 ⇔ the local state did not change (the delta was
    /// known or is dominated): don't forward it.
    pub fn merge_pod(&mut self, delta: &PodState) -> usize {
        let id = self.pod(&delta.name);
        let Some(Some(p)) = self.pods.get_mut(id as usize) else {
            return 0;
        };
        if delta.epoch < p.epoch {
            return 0;
        }
        let mut changed = 0;
        let bumped = delta.epoch > p.epoch;
        if bumped {
            changed += p.clear(&mut self.rev, id);
            p.epoch = delta.epoch;
        }
        let scratch = &mut self.scratch;
        scratch.clear();
        for &(h, ts) in &delta.entries {
            if p.upsert(&mut self.rev, id, h, ts, &mut self.pending) {
                scratch.push((h, ts));
            }
        }
        p.link_pending(&mut self.pending);
        p.evict(&mut self.rev, id);
        // Evicted, or superseded by a later duplicate of the same hash in the delta: not a change.
        let rev = &self.rev;
        changed += scratch
            .iter()
            .filter(|&&(h, t)| p.ts_of(rev, id, h) == Some(t))
            .count();
        if bumped { changed.max(1) } else { changed }
    }

    /// The full state of pod `name`, entries sorted by hash.
    pub fn export_pod(&self, name: &str) -> Option<PodState> {
        let p = self.entries(*self.names.get(name)?)?;
        let mut entries: Vec<(u64, u64)> = p.iter().collect();
        entries.sort_unstable();
        Some(PodState {
            name: p.name.clone(),
            epoch: p.epoch,
            entries,
        })
    }

    /// The full states of the named pods that are known.
    pub fn export_pods(&self, names: &[String]) -> Vec<PodState> {
        names.iter().filter_map(|n| self.export_pod(n)).collect()
    }

    /// Join several pod states ([`Self::merge_pod`] each): the entries that changed and the
    /// newest timestamp carried (for the caller's clock).
    pub fn merge_pods(&mut self, states: &[PodState]) -> (usize, u64) {
        let mut changed = 0;
        let mut newest = 0;
        for p in states {
            newest = newest.max(p.max_ts().unwrap_or(0));
            changed += self.merge_pod(p);
        }
        (changed, newest)
    }

    /// Every pod's digest, sorted by name.
    pub fn digests(&self) -> Vec<PodDigest> {
        let mut v: Vec<PodDigest> = self
            .pods
            .iter()
            .flatten()
            .map(|p| PodDigest {
                name: p.name.clone(),
                epoch: p.epoch,
                len: p.len as u64,
                digest: p.digest,
            })
            .collect();
        v.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Forget a pod (it left the pool); its id may be reused.
    pub fn remove_pod(&mut self, name: &str) {
        let Some(id) = self.names.remove(name) else {
            return;
        };
        if let Some(slot) = self.pods.get_mut(id as usize)
            && let Some(mut p) = slot.take()
        {
            p.clear(&mut self.rev, id);
        }
        self.free.push(id);
    }

    /// Each pod's run of leading blocks (pods holding block 0 only; others have no match).
    pub fn match_prefix(&self, hashes: &[u64], out: &mut Vec<PodMatch>) {
        out.clear();
        let Some(first) = hashes.first().and_then(|h| self.rev.map.get(h)) else {
            return;
        };
        out.extend(
            self.rev
                .pairs(first)
                .iter()
                .map(|&(pod, _)| PodMatch { pod, blocks: 1 }),
        );
        // `active` = prefix of `out` whose runs continue; finished runs are swapped behind it.
        let mut active = out.len();
        // By pod id: the last block (1-based) seen held by that pod. A block every pod holds (a
        // system prompt) has a holder list as long as the pool: asking it pod by pod would be
        // quadratic, so long lists are marked here once and each run checks its mark.
        let mut mark: Vec<u32> = Vec::new();
        for (k, h) in hashes.iter().enumerate().skip(1) {
            if active == 0 {
                break;
            }
            let Some(holder) = self.rev.map.get(h) else {
                break;
            };
            let pairs = self.rev.pairs(holder);
            let marked = pairs.len() > LINEAR_HOLDERS && active > LINEAR_HOLDERS;
            if marked {
                if mark.is_empty() {
                    mark = vec![0; self.pods.len()];
                }
                for &(pod, _) in pairs {
                    if let Some(m) = mark.get_mut(pod as usize) {
                        *m = k as u32;
                    }
                }
            }
            active = if marked {
                extend_runs(out, active, |pod| {
                    mark.get(pod as usize) == Some(&(k as u32))
                })
            } else {
                extend_runs(out, active, |pod| self.rev.holds(holder, pod))
            };
        }
    }

    /// Entries held for `pod`.
    pub fn pod_len(&self, pod: PodId) -> usize {
        self.entries(pod).map_or(0, |p| p.len)
    }

    /// Entries held over all pods.
    pub fn len(&self) -> usize {
        self.pods.iter().flatten().map(|p| p.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Distinct hashes known (keys of the reverse map).
    pub fn distinct_hashes(&self) -> usize {
        self.rev.map.len()
    }

    /// Timestamp of `hash` on `pod`, if held.
    pub fn timestamp(&self, pod: PodId, hash: u64) -> Option<u64> {
        self.entries(pod)
            .and_then(|p| p.ts_of(&self.rev, pod, hash))
    }

    /// Estimated heap bytes held by the index, O(pods).
    ///
    /// Capacity-based, not measured: the reverse map counts its buckets (the power of two that
    /// its `capacity()` is 7/8 of) × (8-byte key + 8-byte holder + 1 control byte) + 16; spilled
    /// holder lists their capacity (tracked as they grow); each pod its node slab's capacity (24
    /// bytes a node); vectors and strings their capacity. Allocator overhead is not counted.
    pub fn approx_heap_bytes(&self) -> usize {
        let mut total = self.pods.capacity() * size_of::<Option<PodEntries>>()
            + self.free.capacity() * size_of::<PodId>()
            + self.pending.capacity() * size_of::<u32>()
            + self.scratch.capacity() * size_of::<(u64, u64)>()
            + map_heap_bytes::<String, PodId>(self.names.capacity())
            + self.names.keys().map(String::capacity).sum::<usize>()
            + map_heap_bytes::<u64, Holder>(self.rev.map.capacity())
            + self.rev.spill.capacity() * size_of::<Vec<(PodId, u32)>>()
            + self.rev.spill_free.capacity() * size_of::<u32>()
            + self.rev.spill_bytes;
        for p in self.pods.iter().flatten() {
            total += p.name.capacity() + p.nodes.capacity() * size_of::<Node>();
        }
        total
    }
}

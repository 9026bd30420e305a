//! The approximate prefix index.
//!
//! Per pod: block hash → the timestamp of the last time a request carrying that block was routed to
//! the pod, bounded to the pod's capacity K by dropping the smallest (timestamp, hash) pairs (the
//! oldest entries, ties broken by the smaller hash). A reverse map hash → (pod, node) makes matching
//! a walk over the request's chain and is the only map: each pod keeps its entries as nodes of a
//! list in eviction order (O(1) to refresh, append or evict), found through the reverse map —
//! about 40 bytes per entry where a per-pod map plus an ordered set took 125–140.
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

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use crate::idhash::IdMap;

/// Interned pod identifier (dense, reused after removal).
pub type PodId = u32;

/// How many leading blocks of a request a pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodMatch {
    pub pod: PodId,
    pub blocks: usize,
}

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
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One entry's contribution to its pod's digest.
fn entry_mix(hash: u64, ts: u64) -> u64 {
    mix64(hash ^ mix64(ts ^ 0x9E37_79B9_7F4A_7C15))
}

/// End of a pod's order list / of its free-node chain.
const NIL: u32 = u32::MAX;
/// `prev` of a node that is not in its pod's order list: new or re-timestamped during an update,
/// linked at its place once the update's entries are all known.
const UNLINKED: u32 = u32::MAX - 1;

/// One entry of a pod: a node of the pod's order list, (timestamp, hash) ascending.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    ts: u64,
    prev: u32,
    next: u32,
}

/// A pod's entries: a slab of nodes threaded into a doubly linked list in eviction order (oldest
/// first), so the oldest entry is the head, a local insert (the newest timestamp) links at the
/// tail in O(1), and a refresh unlinks and relinks in O(1). Which node holds a hash is found
/// through the reverse map ([`Holders`]), so the pod needs no map of its own.
#[derive(Debug)]
struct PodEntries {
    name: String,
    epoch: u64,
    capacity: usize,
    nodes: Vec<Node>,
    /// Head of the chain of free nodes (through `next`).
    free: u32,
    /// Oldest and newest linked nodes.
    head: u32,
    tail: u32,
    len: usize,
    /// Wrapping sum of [`entry_mix`] over the entries.
    digest: u64,
}

impl PodEntries {
    fn new(name: &str, epoch: u64, capacity: usize) -> Self {
        PodEntries {
            name: name.to_string(),
            epoch,
            capacity,
            nodes: Vec::new(),
            free: NIL,
            head: NIL,
            tail: NIL,
            len: 0,
            digest: 0,
        }
    }

    fn key(&self, n: u32) -> (u64, u64) {
        let node = &self.nodes[n as usize];
        (node.ts, node.hash)
    }

    /// Timestamp of `hash` on this pod (`pod` is its id in `rev`).
    fn ts_of(&self, rev: &Holders, pod: PodId, hash: u64) -> Option<u64> {
        rev.node(hash, pod).map(|n| self.nodes[n as usize].ts)
    }

    /// A free node holding (hash, ts), not linked. The slab grows by an eighth at a time: a pod
    /// fills to its capacity and stays there, so doubling would leave up to half of it unused.
    fn alloc(&mut self, hash: u64, ts: u64) -> u32 {
        let node = Node {
            hash,
            ts,
            prev: UNLINKED,
            next: NIL,
        };
        if self.free != NIL {
            let n = self.free;
            self.free = self.nodes[n as usize].next;
            self.nodes[n as usize] = node;
            return n;
        }
        if self.nodes.len() == self.nodes.capacity() {
            self.nodes.reserve_exact((self.nodes.len() / 8).max(16));
        }
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }

    fn unlink(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        self.nodes[n as usize].prev = UNLINKED;
    }

    fn link_after(&mut self, after: u32, n: u32) {
        let next = if after == NIL {
            self.head
        } else {
            self.nodes[after as usize].next
        };
        self.nodes[n as usize].prev = after;
        self.nodes[n as usize].next = next;
        if after == NIL {
            self.head = n;
        } else {
            self.nodes[after as usize].next = n;
        }
        if next == NIL {
            self.tail = n;
        } else {
            self.nodes[next as usize].prev = n;
        }
    }

    /// Insert `hash` at `ts` or raise its timestamp; true if the state changed. A changed node is
    /// left unlinked and pushed to `pending` for [`PodEntries::link_pending`].
    fn upsert(
        &mut self,
        rev: &mut Holders,
        pod: PodId,
        hash: u64,
        ts: u64,
        pending: &mut Vec<u32>,
    ) -> bool {
        match rev.node(hash, pod) {
            Some(n) => {
                let old = self.nodes[n as usize].ts;
                if ts <= old {
                    return false;
                }
                if self.nodes[n as usize].prev != UNLINKED {
                    self.unlink(n);
                    pending.push(n);
                }
                self.nodes[n as usize].ts = ts;
                self.digest = self
                    .digest
                    .wrapping_sub(entry_mix(hash, old))
                    .wrapping_add(entry_mix(hash, ts));
            }
            None => {
                let n = self.alloc(hash, ts);
                pending.push(n);
                rev.add(hash, pod, n);
                self.len += 1;
                self.digest = self.digest.wrapping_add(entry_mix(hash, ts));
            }
        }
        true
    }

    /// Link the pending nodes at their places: sorted, then one walk back from the tail to the
    /// first one's place and forward from there — O(1) per node when they are the newest (local
    /// inserts), O(n + m log m) at worst (a full state merged into a full pod).
    fn link_pending(&mut self, pending: &mut Vec<u32>) {
        pending.sort_unstable_by_key(|&n| self.key(n));
        let Some(&first) = pending.first() else {
            return;
        };
        let first = self.key(first);
        let mut after = self.tail;
        while after != NIL && self.key(after) > first {
            after = self.nodes[after as usize].prev;
        }
        for &n in pending.iter() {
            let k = self.key(n);
            loop {
                let next = if after == NIL {
                    self.head
                } else {
                    self.nodes[after as usize].next
                };
                if next != NIL && self.key(next) < k {
                    after = next;
                } else {
                    break;
                }
            }
            self.link_after(after, n);
            after = n;
        }
        pending.clear();
    }

    /// Drop the oldest entries down to the capacity; how many were dropped.
    fn evict(&mut self, rev: &mut Holders, pod: PodId) -> usize {
        let mut dropped = 0;
        while self.len > self.capacity && self.head != NIL {
            let n = self.head;
            self.unlink(n);
            let Node { hash, ts, .. } = self.nodes[n as usize];
            rev.remove(hash, pod);
            self.digest = self.digest.wrapping_sub(entry_mix(hash, ts));
            self.nodes[n as usize].next = self.free;
            self.free = n;
            self.len -= 1;
            dropped += 1;
        }
        dropped
    }

    /// Drop every entry; how many there were.
    fn clear(&mut self, rev: &mut Holders, pod: PodId) -> usize {
        let dropped = self.len;
        let mut n = self.head;
        while n != NIL {
            let node = self.nodes[n as usize];
            rev.remove(node.hash, pod);
            n = node.next;
        }
        self.nodes.clear();
        self.free = NIL;
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
        self.digest = 0;
        dropped
    }

    /// (hash, ts) of every entry, oldest first.
    fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut n = self.head;
        std::iter::from_fn(move || {
            if n == NIL {
                return None;
            }
            let node = &self.nodes[n as usize];
            n = node.next;
            Some((node.hash, node.ts))
        })
    }
}

/// `(pod, node)` of the one pod holding a hash, or `(SPILLED, i)`: the holders are `spill[i]`.
#[derive(Debug, Clone, Copy)]
struct Holder((PodId, u32));

const SPILLED: u32 = u32::MAX;

/// The reverse map hash → (pod, node) of every pod holding it: one pair inline (16 bytes a slot
/// with the key), more spilled to a side vector.
#[derive(Debug, Default)]
struct Holders {
    map: IdMap<u64, Holder>,
    spill: Vec<Vec<(PodId, u32)>>,
    spill_free: Vec<u32>,
    /// Heap bytes of the spilled vectors' elements.
    spill_bytes: usize,
}

impl Holders {
    fn pairs<'a>(&'a self, h: &'a Holder) -> &'a [(PodId, u32)] {
        match h.0 {
            (SPILLED, i) => self.spill.get(i as usize).map_or(&[], Vec::as_slice),
            _ => std::slice::from_ref(&h.0),
        }
    }

    fn holds(&self, h: &Holder, pod: PodId) -> bool {
        match h.0 {
            (SPILLED, i) => self
                .spill
                .get(i as usize)
                .is_some_and(|v| v.iter().any(|e| e.0 == pod)),
            (p, _) => p == pod,
        }
    }

    /// The node of `hash` on `pod`.
    fn node(&self, hash: u64, pod: PodId) -> Option<u32> {
        let h = self.map.get(&hash)?;
        match h.0 {
            (SPILLED, i) => self
                .spill
                .get(i as usize)?
                .iter()
                .find(|e| e.0 == pod)
                .map(|e| e.1),
            (p, n) => (p == pod).then_some(n),
        }
    }

    /// Record that `pod` holds `hash` in `node` (it did not before).
    fn add(&mut self, hash: u64, pod: PodId, node: u32) {
        match self.map.entry(hash) {
            Entry::Vacant(e) => {
                e.insert(Holder((pod, node)));
            }
            Entry::Occupied(mut e) => match e.get().0 {
                (SPILLED, i) => {
                    let v = &mut self.spill[i as usize];
                    let before = v.capacity();
                    v.push((pod, node));
                    self.spill_bytes += (v.capacity() - before) * size_of::<(PodId, u32)>();
                }
                (p, n) => {
                    let mut v = Vec::with_capacity(2);
                    v.extend([(p, n), (pod, node)]);
                    self.spill_bytes += v.capacity() * size_of::<(PodId, u32)>();
                    let i = match self.spill_free.pop() {
                        Some(i) => {
                            self.spill[i as usize] = v;
                            i
                        }
                        None => {
                            self.spill.push(v);
                            (self.spill.len() - 1) as u32
                        }
                    };
                    e.insert(Holder((SPILLED, i)));
                }
            },
        }
    }

    fn remove(&mut self, hash: u64, pod: PodId) {
        let Entry::Occupied(mut e) = self.map.entry(hash) else {
            return;
        };
        match e.get().0 {
            (SPILLED, i) => {
                let v = &mut self.spill[i as usize];
                v.retain(|x| x.0 != pod);
                if v.len() <= 1 {
                    self.spill_bytes -= v.capacity() * size_of::<(PodId, u32)>();
                    let last = std::mem::take(v).pop();
                    self.spill_free.push(i);
                    match last {
                        Some((p, n)) => {
                            e.insert(Holder((p, n)));
                        }
                        None => {
                            e.remove();
                        }
                    }
                }
            }
            (p, _) => {
                if p == pod {
                    e.remove();
                }
            }
        }
    }
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

#[derive(Debug)]
pub struct ApproxIndex {
    default_capacity: usize,
    pods: Vec<Option<PodEntries>>,
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
            names: HashMap::new(),
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
        for h in &hashes[1..] {
            if active == 0 {
                break;
            }
            let Some(holder) = self.rev.map.get(h) else {
                break;
            };
            let mut i = 0;
            while i < active {
                if self.rev.holds(holder, out[i].pod) {
                    out[i].blocks += 1;
                    i += 1;
                } else {
                    active -= 1;
                    out.swap(i, active);
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(ix: &ApproxIndex, hashes: &[u64]) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        ix.match_prefix(hashes, &mut out);
        let mut v: Vec<_> = out
            .iter()
            .map(|m| (ix.pod_name(m.pod).unwrap().to_string(), m.blocks))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn longest_leading_run_per_pod() {
        let mut ix = ApproxIndex::new(100);
        let a = ix.pod("a");
        let b = ix.pod("b");
        ix.insert(a, &[1, 2, 3, 4], 10);
        ix.insert(b, &[1, 2, 9], 11);
        assert_eq!(
            matches(&ix, &[1, 2, 3, 4, 5]),
            vec![("a".into(), 4), ("b".into(), 2)]
        );
        assert_eq!(matches(&ix, &[7, 1, 2]), vec![]);
        assert_eq!(matches(&ix, &[]), vec![]);
        // A hole ends a pod's run even if later blocks are held.
        let c = ix.pod("c");
        ix.insert(c, &[1, 3], 12);
        assert_eq!(
            matches(&ix, &[1, 2, 3]),
            vec![("a".into(), 3), ("b".into(), 2), ("c".into(), 1)]
        );
    }

    #[test]
    fn bounded_lru_evicts_oldest_then_smaller_hash() {
        let mut ix = ApproxIndex::new(3);
        let a = ix.pod("a");
        ix.insert(a, &[10, 20], 1);
        ix.insert(a, &[30], 2);
        ix.insert(a, &[10], 3); // refresh 10
        ix.insert(a, &[40], 4); // evicts the oldest: 20 (ts 1)
        assert_eq!(ix.pod_len(a), 3);
        assert_eq!(ix.timestamp(a, 20), None);
        assert_eq!(ix.timestamp(a, 10), Some(3));
        // tie at the same timestamp: the smaller hash goes first
        let mut ix = ApproxIndex::new(2);
        let a = ix.pod("a");
        ix.insert(a, &[9, 5, 7], 1);
        assert_eq!(ix.timestamp(a, 5), None);
        assert_eq!(ix.pod_len(a), 2);
        assert_eq!(ix.distinct_hashes(), 2);
    }

    #[test]
    fn older_timestamp_does_not_regress() {
        let mut ix = ApproxIndex::new(10);
        let a = ix.pod("a");
        ix.insert(a, &[1], 5);
        ix.insert(a, &[1], 3);
        assert_eq!(ix.timestamp(a, 1), Some(5));
    }

    #[test]
    fn capacity_and_removal() {
        let mut ix = ApproxIndex::new(10);
        let a = ix.pod("a");
        let b = ix.pod("b");
        ix.insert(a, &[1, 2, 3, 4], 1);
        ix.insert(b, &[1, 2], 1);
        ix.set_capacity(a, 2);
        assert_eq!(ix.pod_len(a), 2);
        ix.remove_pod("b");
        assert_eq!(ix.pod_id("b"), None);
        assert_eq!(ix.len(), 2);
        // the id is reused, and starts empty
        let c = ix.pod("c");
        assert_eq!(c, b);
        assert_eq!(ix.pod_len(c), 0);
        assert!(matches(&ix, &[1]).iter().all(|(n, _)| n != "c"));
    }
    #[test]
    fn pod_with_epoch_clears_older_incarnations_only() {
        let mut ix = ApproxIndex::new(10);
        let a = ix.pod_with_epoch("a", 3);
        assert_eq!(ix.epoch(a), Some(3));
        ix.insert(a, &[1, 2], 1);
        // same or older: unchanged
        assert_eq!(ix.pod_with_epoch("a", 3), a);
        assert_eq!(ix.pod_with_epoch("a", 1), a);
        assert_eq!(ix.pod("a"), a);
        assert_eq!((ix.epoch(a), ix.pod_len(a)), (Some(3), 2));
        // newer: emptied, reverse map too
        assert_eq!(ix.pod_with_epoch("a", 4), a);
        assert_eq!((ix.epoch(a), ix.pod_len(a)), (Some(4), 0));
        assert_eq!(matches(&ix, &[1]), vec![]);
        assert_eq!(ix.distinct_hashes(), 0);
        assert_eq!(ix.digests()[0].digest, 0);
    }

    #[test]
    fn digests_track_state_and_sort_by_name() {
        let mut ix = ApproxIndex::new(2);
        let b = ix.pod("b");
        let a = ix.pod("a");
        ix.insert(b, &[1, 2], 5);
        ix.insert(a, &[1, 2], 5);
        let d = ix.digests();
        assert_eq!(d[0].name, "a");
        assert_eq!((d[0].len, d[0].digest), (d[1].len, d[1].digest));
        // refresh then evict on a: differs from b until b follows the same steps
        ix.insert(a, &[1], 6);
        ix.insert(a, &[3], 7);
        assert_ne!(ix.digests()[0].digest, ix.digests()[1].digest);
        ix.insert(b, &[3, 1], 7);
        assert_ne!(ix.digests()[0].digest, ix.digests()[1].digest); // (1,7) vs (1,6)
        ix.insert(a, &[1], 7);
        assert_eq!(ix.digests()[0].digest, ix.digests()[1].digest);
        assert_eq!(ix.export_pod("a").unwrap().entries, vec![(1, 7), (3, 7)]);
        assert_eq!(ix.pod_names(), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn insert_delta_reports_changed_kept_entries() {
        let mut ix = ApproxIndex::new(3);
        let a = ix.pod("a");
        let d = ix.insert_delta(a, &[1, 2], 5).unwrap();
        assert_eq!(
            (d.name.as_str(), d.epoch, d.entries),
            ("a", 0, vec![(1, 5), (2, 5)])
        );
        // already held at >= ts
        assert_eq!(ix.insert_delta(a, &[1, 2], 5), None);
        assert_eq!(ix.insert_delta(a, &[2], 4), None);
        // older than everything held, evicted at once: no news
        ix.insert(a, &[3], 6);
        assert_eq!(ix.insert_delta(a, &[9], 1), None);
        assert_eq!(ix.timestamp(a, 9), None);
        // more hashes than capacity: only the kept ones (at equal ts the greater hashes stay)
        let d = ix.insert_delta(a, &[5, 6, 7, 8], 10).unwrap();
        assert_eq!(d.entries, vec![(6, 10), (7, 10), (8, 10)]);
    }

    #[test]
    fn heap_estimate_grows_with_entries() {
        let mut ix = ApproxIndex::new(100_000);
        let empty = ix.approx_heap_bytes();
        let a = ix.pod("a");
        let b = ix.pod("b");
        let hashes: Vec<u64> = (0..10_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        ix.insert(a, &hashes, 1);
        let per_entry = (ix.approx_heap_bytes() - empty) / hashes.len();
        // node 24 (slab grown by eighths), reverse slot 16+1 at a load factor in (7/16, 7/8]
        assert!((40..70).contains(&per_entry), "{per_entry} bytes/entry");
        // a second holder of each hash spills both to a side vector
        ix.insert(b, &hashes, 2);
        assert!(ix.rev.spill_bytes >= 2 * hashes.len() * 8);
        ix.remove_pod("b");
        assert_eq!(ix.rev.spill_bytes, 0);
        assert_eq!(ix.distinct_hashes(), hashes.len());
        ix.remove_pod("a");
        assert_eq!((ix.rev.spill_bytes, ix.distinct_hashes()), (0, 0));
    }

    /// The index against a plain model (per pod: hash → ts, evict the smallest (ts, hash)) under
    /// random inserts, merges with old and new timestamps, capacity changes and removals, pods
    /// sharing hashes: same entries, digests and matches after every step.
    #[test]
    fn agrees_with_a_plain_model() {
        use std::collections::BTreeMap;
        type Model = BTreeMap<String, BTreeMap<u64, u64>>;
        fn evict(m: &mut BTreeMap<u64, u64>, k: usize) {
            while m.len() > k {
                let (&h, _) = m.iter().min_by_key(|(h, t)| (**t, **h)).unwrap();
                m.remove(&h);
            }
        }
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let names = ["a", "b", "c", "d"];
        let mut ix = ApproxIndex::new(6);
        let mut model: Model = BTreeMap::new();
        let mut caps: BTreeMap<String, usize> = BTreeMap::new();
        let mut clock = 100;
        for step in 0..4000 {
            let name = names[next(4) as usize];
            let cap = *caps.get(name).unwrap_or(&6);
            match next(10) {
                0..=4 => {
                    clock += 1;
                    let hashes: Vec<u64> = (0..next(8)).map(|_| next(24)).collect();
                    let id = ix.pod(name);
                    ix.insert(id, &hashes, clock);
                    let m = model.entry(name.to_string()).or_default();
                    for h in hashes {
                        let t = m.entry(h).or_insert(clock);
                        *t = (*t).max(clock);
                    }
                    evict(m, cap);
                }
                5..=7 => {
                    // a peer's delta: timestamps around and well before the clock, duplicates
                    let entries: Vec<(u64, u64)> = (0..next(10))
                        .map(|_| (next(24), clock.saturating_sub(next(40))))
                        .collect();
                    let delta = PodState {
                        name: name.into(),
                        epoch: 0,
                        entries,
                    };
                    ix.merge_pod(&delta);
                    let m = model.entry(name.to_string()).or_default();
                    for (h, t) in delta.entries {
                        let e = m.entry(h).or_insert(t);
                        *e = (*e).max(t);
                    }
                    evict(m, cap);
                }
                8 => {
                    let id = ix.pod(name);
                    let k = 1 + next(8) as usize;
                    ix.set_capacity(id, k);
                    caps.insert(name.to_string(), k);
                    evict(model.entry(name.to_string()).or_default(), k);
                }
                _ => {
                    ix.remove_pod(name);
                    model.remove(name);
                    caps.remove(name);
                }
            }
            for (name, m) in &model {
                let got = ix.export_pod(name).unwrap();
                let want: Vec<(u64, u64)> = m.iter().map(|(h, t)| (*h, *t)).collect();
                assert_eq!(got.entries, want, "step {step}, pod {name}");
                let digest = m
                    .iter()
                    .fold(0u64, |d, (h, t)| d.wrapping_add(entry_mix(*h, *t)));
                let id = ix.pod_id(name).unwrap();
                assert_eq!(ix.pod_len(id), m.len());
                let got = ix.digests().into_iter().find(|d| &d.name == name).unwrap();
                assert_eq!(got.digest, digest, "step {step}, pod {name}");
            }
            let chain: Vec<u64> = (0..4).map(|_| next(24)).collect();
            let mut want: Vec<(String, usize)> = model
                .iter()
                .map(|(n, m)| {
                    (
                        n.clone(),
                        chain.iter().take_while(|h| m.contains_key(h)).count(),
                    )
                })
                .filter(|(_, k)| *k > 0)
                .collect();
            want.sort();
            assert_eq!(matches(&ix, &chain), want, "step {step}");
            assert_eq!(ix.len(), model.values().map(BTreeMap::len).sum::<usize>());
        }
    }
}

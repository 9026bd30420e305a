//! The approximate prefix index.
//!
//! Per pod: block hash → the timestamp of the last time a request carrying that block was routed to
//! the pod, bounded to the pod's capacity by dropping the oldest entries (ties broken by the smaller
//! hash). A reverse map hash → pods makes matching a walk over the request's chain.
//!
//! Matching follows the chain: a pod's match is the number of leading blocks it holds
//! consecutively from block 0 (hashes are chained, so holding block *i* means the pod was sent the
//! whole prefix up to *i*; a hole left by eviction ends the run).

use std::collections::{BTreeSet, HashMap};

use crate::idhash::IdMap;

/// Interned pod identifier (dense, reused after removal).
pub type PodId = u32;

/// How many leading blocks of a request a pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodMatch {
    pub pod: PodId,
    pub blocks: usize,
}

#[derive(Debug)]
struct PodEntries {
    name: String,
    capacity: usize,
    entries: IdMap<u64, u64>,
    /// (timestamp, hash), oldest first: the eviction order.
    order: BTreeSet<(u64, u64)>,
}

#[derive(Debug)]
pub struct ApproxIndex {
    default_capacity: usize,
    pods: Vec<Option<PodEntries>>,
    names: HashMap<String, PodId>,
    free: Vec<PodId>,
    hash_to_pods: IdMap<u64, Vec<PodId>>,
}

impl ApproxIndex {
    /// `default_capacity`: entries kept per pod unless [`ApproxIndex::set_capacity`] says otherwise.
    pub fn new(default_capacity: usize) -> Self {
        ApproxIndex {
            default_capacity: default_capacity.max(1),
            pods: Vec::new(),
            names: HashMap::new(),
            free: Vec::new(),
            hash_to_pods: IdMap::default(),
        }
    }

    /// The id of pod `name`, creating an empty entry set for it if needed.
    pub fn pod(&mut self, name: &str) -> PodId {
        if let Some(id) = self.names.get(name) {
            return *id;
        }
        let entries = PodEntries {
            name: name.to_string(),
            capacity: self.default_capacity,
            entries: IdMap::default(),
            order: BTreeSet::new(),
        };
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

    pub fn pod_id(&self, name: &str) -> Option<PodId> {
        self.names.get(name).copied()
    }

    pub fn pod_name(&self, id: PodId) -> Option<&str> {
        self.pods
            .get(id as usize)
            .and_then(|p| p.as_ref())
            .map(|p| p.name.as_str())
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
        self.evict(id);
    }

    /// Record that a request with these block hashes was routed to `pod` at time `ts`.
    pub fn insert(&mut self, pod: PodId, hashes: &[u64], ts: u64) {
        let Some(Some(p)) = self.pods.get_mut(pod as usize) else {
            return;
        };
        for &h in hashes {
            match p.entries.get_mut(&h) {
                Some(old) => {
                    if ts > *old {
                        p.order.remove(&(*old, h));
                        p.order.insert((ts, h));
                        *old = ts;
                    }
                }
                None => {
                    p.entries.insert(h, ts);
                    p.order.insert((ts, h));
                    let set = self.hash_to_pods.entry(h).or_default();
                    if !set.contains(&pod) {
                        set.push(pod);
                    }
                }
            }
        }
        self.evict(pod);
    }

    fn evict(&mut self, pod: PodId) {
        let Some(Some(p)) = self.pods.get_mut(pod as usize) else {
            return;
        };
        while p.entries.len() > p.capacity {
            let Some((_, h)) = p.order.pop_first() else {
                break;
            };
            p.entries.remove(&h);
            if let Some(set) = self.hash_to_pods.get_mut(&h) {
                set.retain(|x| *x != pod);
                if set.is_empty() {
                    self.hash_to_pods.remove(&h);
                }
            }
        }
    }

    /// Forget a pod (it left the pool); its id may be reused.
    pub fn remove_pod(&mut self, name: &str) {
        let Some(id) = self.names.remove(name) else {
            return;
        };
        if let Some(slot) = self.pods.get_mut(id as usize)
            && let Some(p) = slot.take()
        {
            for h in p.entries.keys() {
                if let Some(set) = self.hash_to_pods.get_mut(h) {
                    set.retain(|x| *x != id);
                    if set.is_empty() {
                        self.hash_to_pods.remove(h);
                    }
                }
            }
        }
        self.free.push(id);
    }

    /// Each pod's run of leading blocks (pods holding block 0 only; others have no match).
    pub fn match_prefix(&self, hashes: &[u64], out: &mut Vec<PodMatch>) {
        out.clear();
        let Some(first) = hashes.first().and_then(|h| self.hash_to_pods.get(h)) else {
            return;
        };
        out.extend(first.iter().map(|&pod| PodMatch { pod, blocks: 1 }));
        // `active` = prefix of `out` whose runs continue; finished runs are swapped behind it.
        let mut active = out.len();
        for h in &hashes[1..] {
            if active == 0 {
                break;
            }
            let Some(pods) = self.hash_to_pods.get(h) else {
                break;
            };
            let mut i = 0;
            while i < active {
                if pods.contains(&out[i].pod) {
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
        self.pods
            .get(pod as usize)
            .and_then(|p| p.as_ref())
            .map_or(0, |p| p.entries.len())
    }

    /// Entries held over all pods.
    pub fn len(&self) -> usize {
        self.pods.iter().flatten().map(|p| p.entries.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Distinct hashes known (keys of the reverse map).
    pub fn distinct_hashes(&self) -> usize {
        self.hash_to_pods.len()
    }

    /// Timestamp of `hash` on `pod`, if held.
    pub fn timestamp(&self, pod: PodId, hash: u64) -> Option<u64> {
        self.pods
            .get(pod as usize)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.entries.get(&hash).copied())
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
}

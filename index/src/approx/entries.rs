//! One pod's entries in eviction order: a slab of nodes threaded into a doubly linked list.

use super::PodId;
use super::holders::Holders;
use super::state::entry_mix;

/// End of a pod's order list / of its free-node chain.
const NIL: u32 = u32::MAX;
/// `prev` of a node that is not in its pod's order list: new or re-timestamped during an update,
/// linked at its place once the update's entries are all known.
const UNLINKED: u32 = u32::MAX - 1;

/// One entry of a pod: a node of the pod's order list, (timestamp, hash) ascending.
#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
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
pub(super) struct PodEntries {
    pub(super) name: String,
    pub(super) epoch: u64,
    pub(super) capacity: usize,
    pub(super) nodes: Vec<Node>,
    /// Head of the chain of free nodes (through `next`).
    free: u32,
    /// Oldest and newest linked nodes.
    head: u32,
    tail: u32,
    pub(super) len: usize,
    /// Wrapping sum of [`entry_mix`] over the entries.
    pub(super) digest: u64,
}

impl PodEntries {
    pub(super) fn new(name: &str, epoch: u64, capacity: usize) -> Self {
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
    pub(super) fn ts_of(&self, rev: &Holders, pod: PodId, hash: u64) -> Option<u64> {
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
    pub(super) fn upsert(
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
    pub(super) fn link_pending(&mut self, pending: &mut Vec<u32>) {
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
    pub(super) fn evict(&mut self, rev: &mut Holders, pod: PodId) -> usize {
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
    pub(super) fn clear(&mut self, rev: &mut Holders, pod: PodId) -> usize {
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
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
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

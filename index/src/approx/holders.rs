//! The reverse map block hash → (pod, node) of every pod holding it.

use std::collections::hash_map::Entry;

use super::PodId;
use crate::idhash::IdMap;

/// `(pod, node)` of the one pod holding a hash, or `(SPILLED, i)`: the holders are `spill[i]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holder((PodId, u32));

pub(super) const SPILLED: u32 = u32::MAX;

/// The reverse map hash → (pod, node) of every pod holding it: one pair inline (16 bytes a slot
/// with the key), more spilled to a side vector.
#[derive(Debug, Default)]
pub(super) struct Holders {
    pub(super) map: IdMap<u64, Holder>,
    pub(super) spill: Vec<Vec<(PodId, u32)>>,
    pub(super) spill_free: Vec<u32>,
    /// Heap bytes of the spilled vectors' elements.
    pub(super) spill_bytes: usize,
}

impl Holders {
    pub(super) fn pairs<'a>(&'a self, h: &'a Holder) -> &'a [(PodId, u32)] {
        match h.0 {
            (SPILLED, i) => self.spill.get(i as usize).map_or(&[], Vec::as_slice),
            _ => std::slice::from_ref(&h.0),
        }
    }

    pub(super) fn holds(&self, h: &Holder, pod: PodId) -> bool {
        match h.0 {
            (SPILLED, i) => self
                .spill
                .get(i as usize)
                .is_some_and(|v| v.iter().any(|e| e.0 == pod)),
            (p, _) => p == pod,
        }
    }

    /// The node of `hash` on `pod`.
    pub(super) fn node(&self, hash: u64, pod: PodId) -> Option<u32> {
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
    pub(super) fn add(&mut self, hash: u64, pod: PodId, node: u32) {
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
                    let i = crate::slots::place(&mut self.spill, &mut self.spill_free, v);
                    e.insert(Holder((SPILLED, i)));
                }
            },
        }
    }

    pub(super) fn remove(&mut self, hash: u64, pod: PodId) {
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

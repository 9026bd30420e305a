//! What the prefix gossip puts on the wire: the outbox that coalesces local inserts between
//! flushes, pod states to and from their protobuf form (timestamps delta-coded), and the
//! chunking of anti-entropy pushes.

use std::collections::HashMap;
use std::sync::Mutex;

use index::{DeltaSink, PodDigest, PodState};
use tonic::Status;

use super::pb;

/// Deltas waiting for the next flush, coalesced: per pod, per hash the newest timestamp.
#[derive(Debug)]
pub struct Outbox {
    inner: Mutex<OutboxInner>,
    max_entries: usize,
}

#[derive(Debug, Default)]
struct OutboxInner {
    pods: HashMap<String, (u64, HashMap<u64, u64>)>,
    entries: usize,
    overflowed: bool,
}

impl DeltaSink for Outbox {
    fn push(&self, delta: PodState) {
        Outbox::push(self, delta);
    }
}

impl Outbox {
    pub fn new(max_entries: usize) -> Self {
        Outbox {
            inner: Mutex::new(OutboxInner::default()),
            max_entries: max_entries.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue one delta. Past the bound the delta is dropped and the next flush reports overflow.
    pub fn push(&self, delta: PodState) {
        let mut o = self.lock();
        if o.entries + delta.entries.len() > self.max_entries {
            o.overflowed = true;
            return;
        }
        let OutboxInner { pods, entries, .. } = &mut *o;
        let (epoch, map) = pods.entry(delta.name).or_default();
        if delta.epoch > *epoch {
            *entries -= map.len();
            map.clear();
            *epoch = delta.epoch;
        } else if delta.epoch < *epoch {
            return;
        }
        for (h, ts) in delta.entries {
            let slot = map.entry(h).or_insert_with(|| {
                *entries += 1;
                0
            });
            *slot = (*slot).max(ts);
        }
    }

    /// Everything queued, and whether deltas were dropped since the last take.
    pub fn take(&self) -> (Vec<PodState>, bool) {
        let mut o = self.lock();
        let overflowed = std::mem::take(&mut o.overflowed);
        o.entries = 0;
        let pods = std::mem::take(&mut o.pods)
            .into_iter()
            .map(|(name, (epoch, map))| PodState {
                name,
                epoch,
                entries: map.into_iter().collect(),
            })
            .collect();
        (pods, overflowed)
    }
}

pub(super) fn to_pb(mut p: PodState) -> pb::PodDelta {
    p.entries.sort_unstable_by_key(|&(h, ts)| (ts, h));
    let mut last = 0;
    let (hashes, ts_deltas) = p
        .entries
        .into_iter()
        .map(|(h, ts)| {
            let d = ts - last;
            last = ts;
            (h, d)
        })
        .unzip();
    pb::PodDelta {
        pod: p.name,
        epoch: p.epoch,
        hashes,
        ts_deltas,
    }
}

pub(super) fn from_pb(p: pb::PodDelta) -> Result<PodState, Status> {
    if p.hashes.len() != p.ts_deltas.len() {
        return Err(Status::invalid_argument(format!(
            "pod {}: {} hashes but {} timestamps",
            p.pod,
            p.hashes.len(),
            p.ts_deltas.len()
        )));
    }
    if p.pod.is_empty() {
        return Err(Status::invalid_argument("pod delta without a pod name"));
    }
    let mut ts = 0u64;
    let mut entries = Vec::with_capacity(p.hashes.len());
    for (h, d) in p.hashes.into_iter().zip(p.ts_deltas) {
        ts = ts.checked_add(d).ok_or_else(|| {
            Status::invalid_argument(format!("pod {}: timestamp overflow", p.pod))
        })?;
        entries.push((h, ts));
    }
    Ok(PodState {
        name: p.pod,
        epoch: p.epoch,
        entries,
    })
}

pub(super) fn from_pb_all(pods: Vec<pb::PodDelta>) -> Result<Vec<PodState>, Status> {
    pods.into_iter().map(from_pb).collect()
}

pub(super) fn digest_to_pb(d: PodDigest) -> pb::PodDigest {
    pb::PodDigest {
        pod: d.name,
        epoch: d.epoch,
        len: d.len,
        digest: d.digest,
    }
}

/// Split pod states into messages of at most `max` entries (a bigger pod goes alone).
pub(super) fn chunk(states: Vec<PodState>, max: usize) -> Vec<Vec<PodState>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut n = 0;
    for s in states {
        if n > 0 && n + s.entries.len() > max {
            out.push(std::mem::take(&mut cur));
            n = 0;
        }
        n += s.entries.len();
        cur.push(s);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

//! Matching a request's keys: each pod's run of leading blocks held in any tier, weighted by
//! the best tier per block, counting speculative entries (routing decisions not yet confirmed by
//! the engine) while they live.

use super::tiers::{GPU, MAX_TIERS, Tier, pod_of, tier_of};
use super::{MAX_SPECULATIVE, PodId, PreciseIndex, holders};

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
pub(super) const LINEAR_HOLDERS: usize = 8;

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

impl PreciseIndex {
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
}

//! `mm-embeddings-cache-producer` and `mm-embeddings-cache-scorer` (llm-d): send a request whose
//! prompt carries images, audio or video to a pod that encoded the same assets recently, so the
//! engine's encoder cache skips re-encoding them.
//!
//! The producer keeps, per pod, an LRU of the media hashes (see `request::parse`) of the requests
//! routed there, `cacheSizeInMBPerServer` / 2 MiB entries (2048 at the default 4096 MB): llm-d's
//! estimate of one embedding's size. For each candidate it counts the request's assets in that
//! pod's LRU (a lookup does not refresh them); after routing, the request's assets enter the
//! primary pod's LRU. Pods gone from the candidates for two minutes are forgotten. The scorer
//! gives the matched share of the request's assets, 0 for a text-only request.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::{Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const PRODUCER_TYPE: &str = "mm-embeddings-cache-producer";
pub const SCORER_TYPE: &str = "mm-embeddings-cache-scorer";

/// llm-d's size estimate of one cached embedding.
const ENTRY_BYTES: i64 = 2 << 20;
/// Pods not among the candidates this long are dropped.
const FORGET_AFTER: Duration = Duration::from_secs(120);

/// `mm-embeddings-cache-producer` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MmCacheParams {
    /// Encoder cache per pod, MB (not positive → 4096).
    #[serde(default = "d_cache_mb")]
    pub cache_size_in_mb_per_server: i64,
}

fn d_cache_mb() -> i64 {
    4096
}

impl Default for MmCacheParams {
    fn default() -> Self {
        MmCacheParams {
            cache_size_in_mb_per_server: d_cache_mb(),
        }
    }
}

/// `mm-embeddings-cache-scorer` parameters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MmScorerParams {
    /// llm-d reads the match of this producer instance; there is one per configuration here.
    #[serde(default)]
    pub producer_name: Option<String>,
}

/// One pod's assets, least recently routed first.
#[derive(Debug, Default)]
struct PodLru {
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    next: u64,
}

impl PodLru {
    fn touch(&mut self, hash: u64, capacity: usize) {
        if let Some(old) = self.stamp_of.insert(hash, self.next) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.next, hash);
        self.next += 1;
        while self.stamp_of.len() > capacity {
            let Some((_, oldest)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&oldest);
        }
    }
}

#[derive(Debug, Default)]
struct State {
    pods: HashMap<String, PodLru>,
    /// When each pod was last among the candidates.
    seen: HashMap<String, Instant>,
    last_sweep: Option<Instant>,
}

#[derive(Debug)]
pub struct MmCache {
    entries_per_pod: usize,
    state: Mutex<State>,
}

impl MmCache {
    pub fn new(p: &MmCacheParams) -> Self {
        let mb = if p.cache_size_in_mb_per_server > 0 {
            p.cache_size_in_mb_per_server
        } else {
            d_cache_mb()
        };
        MmCache {
            entries_per_pod: (mb.saturating_mul(1 << 20) / ENTRY_BYTES).max(1) as usize,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Producer for MmCache {
    fn type_name(&self) -> &'static str {
        PRODUCER_TYPE
    }

    fn produce(&self, req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        if req.media.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut st = self.lock();
        for c in candidates {
            st.seen.insert(c.endpoint.hostport.clone(), now);
        }
        if st
            .last_sweep
            .is_none_or(|t| now.duration_since(t) >= FORGET_AFTER)
        {
            let State { pods, seen, .. } = &mut *st;
            seen.retain(|_, t| now.duration_since(*t) < FORGET_AFTER);
            pods.retain(|pod, _| seen.contains_key(pod));
            st.last_sweep = Some(now);
        }
        data.media_matched = candidates
            .iter()
            .map(|c| {
                st.pods.get(&c.endpoint.hostport).map_or(0, |lru| {
                    req.media
                        .iter()
                        .filter(|h| lru.stamp_of.contains_key(h))
                        .count()
                })
            })
            .collect();
    }

    fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        _prefill: Option<usize>,
    ) {
        let Some(c) = candidates.get(primary).filter(|_| !req.media.is_empty()) else {
            return;
        };
        let mut st = self.lock();
        let lru = st.pods.entry(c.endpoint.hostport.clone()).or_default();
        for h in req.media {
            lru.touch(*h, self.entries_per_pod);
        }
    }
}

/// `mm-embeddings-cache-scorer`: the share of the request's media assets the pod holds.
#[derive(Debug, Default)]
pub struct MmCacheScorer;

impl Scorer for MmCacheScorer {
    fn type_name(&self) -> &'static str {
        SCORER_TYPE
    }

    fn score(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let total = req.media.len();
        for (slot, &i) in out.iter_mut().zip(idx) {
            *slot = match data.media_matched.get(i) {
                Some(&m) if total > 0 => m as f64 / total as f64,
                _ => 0.0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::*;

    fn cands() -> Vec<Candidate> {
        vec![
            cand_at("a", "10.0.0.1:8000", None, false, &[]),
            cand_at("b", "10.0.0.2:8000", None, false, &[]),
        ]
    }

    #[test]
    fn a_pod_that_encoded_the_assets_scores_their_share() {
        let p = MmCache::new(&MmCacheParams::default());
        assert_eq!(p.entries_per_pod, 2048);
        let cs = cands();
        let first = SchedRequest {
            media: &[1, 2],
            ..req()
        };
        let mut d = RequestData::default();
        p.produce(&first, &cs, &mut d);
        assert_eq!(d.media_matched, vec![0, 0]);
        p.pre_request(&first, &d, &cs, 1, None);
        // Three assets, two of them sent to b before.
        let next = SchedRequest {
            media: &[2, 3, 1],
            ..req()
        };
        let mut d = RequestData::default();
        p.produce(&next, &cs, &mut d);
        assert_eq!(d.media_matched, vec![0, 2]);
        let mut out = vec![-1.0; 2];
        MmCacheScorer.score(&next, &d, &cs, &[0, 1], &mut out);
        assert_eq!(out, vec![0.0, 2.0 / 3.0]);
        // A text-only request: no data, score 0.
        let mut d = RequestData::default();
        p.produce(&req(), &cs, &mut d);
        assert!(d.media_matched.is_empty());
        MmCacheScorer.score(&req(), &d, &cs, &[0, 1], &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
    }

    #[test]
    fn each_pod_keeps_its_most_recent_assets() {
        // 6 MB = 3 entries of 2 MiB.
        let p = MmCache::new(&MmCacheParams {
            cache_size_in_mb_per_server: 6,
        });
        assert_eq!(p.entries_per_pod, 3);
        let cs = cands();
        for media in [&[1u64, 2, 3][..], &[1], &[4]] {
            let r = SchedRequest { media, ..req() };
            p.pre_request(&r, &RequestData::default(), &cs, 0, None);
        }
        // 2 was the least recently routed when 4 arrived.
        let r = SchedRequest {
            media: &[1, 2, 3, 4],
            ..req()
        };
        let mut d = RequestData::default();
        p.produce(&r, &cs, &mut d);
        assert_eq!(d.media_matched, vec![3, 0]);
        // Non-positive sizes take the default.
        let p = MmCache::new(&MmCacheParams {
            cache_size_in_mb_per_server: 0,
        });
        assert_eq!(p.entries_per_pod, 2048);
    }
}

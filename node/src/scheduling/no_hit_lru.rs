//! `no-hit-lru-scorer` (llm-d): spreads *cold* requests — those no candidate holds any prefix of —
//! over the pods in least-recently-used order, so the KV caches they grow are spread too.
//!
//! A request is cold when the prefix match has no candidate with a matched block (or there is no
//! prefix data). Cold: pods that never received a cold request score highest, then the ones that
//! received one longest ago: with `n` candidates, rank `r` scores `1 − r / (n − 1)`, where a
//! never-used pod's rank is its place among the never-used ones and a used pod's is the number of
//! never-used candidates plus its position in the LRU (oldest first, over every pod tracked — as
//! llm-d computes it), floored at 0. Warm: 0.5 for every pod. After routing, a cold request moves
//! its primary pod (and its prefill pod, when disaggregated) to the LRU's newest end; the LRU
//! holds at most `lruSize` pods (1024).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use serde::Deserialize;

use super::{Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "no-hit-lru-scorer";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NoHitLruParams {
    /// llm-d reads the prefix state of this plugin; here there is one prefix match per request,
    /// whichever producer made it (accepted for compatibility).
    #[serde(default)]
    pub prefix_plugin_name: Option<String>,
    /// llm-d's prefill profile name; the scheduler's prefill pick is the one recorded.
    #[serde(default)]
    pub prefill_profile: Option<String>,
    /// Most pods tracked (not positive → 1024).
    #[serde(default = "d_lru_size")]
    pub lru_size: i64,
}

fn d_lru_size() -> i64 {
    1024
}

#[derive(Debug)]
pub struct NoHitLru {
    capacity: usize,
    /// Pod names, least recently used for a cold request first.
    lru: Mutex<VecDeque<String>>,
}

/// No candidate holds a block of the request's prefix.
fn is_cold(data: &RequestData) -> bool {
    data.prefix
        .as_ref()
        .is_none_or(|p| p.matched.iter().all(|m| *m == 0))
}

impl NoHitLru {
    pub fn new(p: &NoHitLruParams) -> Self {
        let capacity = if p.lru_size > 0 {
            p.lru_size as usize
        } else {
            d_lru_size() as usize
        };
        NoHitLru {
            capacity,
            lru: Mutex::new(VecDeque::new()),
        }
    }

    fn touch(&self, pod: &str) {
        let mut lru = self.lru.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = lru.iter().position(|p| p == pod) {
            lru.remove(at);
        } else if lru.len() >= self.capacity {
            lru.pop_front();
        }
        lru.push_back(pod.to_string());
    }
}

impl Scorer for NoHitLru {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        if !is_cold(data) {
            out.fill(0.5);
            return;
        }
        let n = idx.len();
        if n == 1 {
            out[0] = 1.0;
            return;
        }
        let lru = self.lru.lock().unwrap_or_else(PoisonError::into_inner);
        let position: HashMap<&str, usize> = lru
            .iter()
            .enumerate()
            .map(|(i, p)| (p.as_str(), i))
            .collect();
        let never_used = idx
            .iter()
            .filter(|&&i| !position.contains_key(candidates[i].endpoint.name.as_str()))
            .count();
        let mut next_never_used = 0;
        let span = (n - 1) as f64;
        for (slot, &i) in out.iter_mut().zip(idx) {
            let rank = match position.get(candidates[i].endpoint.name.as_str()) {
                Some(pos) => never_used + pos,
                None => {
                    next_never_used += 1;
                    next_never_used - 1
                }
            };
            *slot = (1.0 - rank as f64 / span).max(0.0);
        }
    }
}

impl Producer for NoHitLru {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn produce(&self, _req: &SchedRequest<'_>, _candidates: &[Candidate], _data: &mut RequestData) {
    }

    fn pre_request(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        prefill: Option<usize>,
    ) {
        if !is_cold(data) {
            return;
        }
        for i in std::iter::once(primary).chain(prefill) {
            if let Some(c) = candidates.get(i) {
                self.touch(&c.endpoint.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::PrefixMatchInfo;
    use crate::scheduling::testutil::*;

    fn lru(size: i64) -> NoHitLru {
        NoHitLru::new(&NoHitLruParams {
            prefix_plugin_name: None,
            prefill_profile: None,
            lru_size: size,
        })
    }

    fn matched(m: Vec<usize>) -> RequestData {
        RequestData {
            prefix: Some(PrefixMatchInfo {
                block_size: 16,
                total_blocks: 4,
                matched: m,
                hashes: vec![],
                weighted: Vec::new(),
            }),
            ..RequestData::default()
        }
    }

    #[test]
    fn cold_requests_go_round_the_pods_least_recently_used_first() {
        let s = lru(1024);
        let cs: Vec<_> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| cand(n, metrics(0.0, 0.0, 0.0), false))
            .collect();
        let cold = matched(vec![0, 0, 0, 0]);
        let r = |rank: f64| 1.0 - rank / 3.0;
        // Nothing used yet: never-used pods in candidate order, 1 − rank/3.
        assert_eq!(
            score_all(&s, &cold, &cs),
            vec![r(0.0), r(1.0), r(2.0), r(3.0)]
        );
        // c then a take cold requests: b and d are never used (ranks 0, 1), then c (2 + 0), a (2 + 1).
        s.pre_request(&req(), &cold, &cs, 2, None);
        s.pre_request(&req(), &cold, &cs, 0, None);
        assert_eq!(
            score_all(&s, &cold, &cs),
            vec![r(3.0), r(0.0), r(2.0), r(1.0)]
        );
        // A warm request scores 0.5 everywhere and does not move the LRU.
        let warm = matched(vec![0, 2, 0, 0]);
        assert_eq!(score_all(&s, &warm, &cs), vec![0.5; 4]);
        s.pre_request(&req(), &warm, &cs, 1, None);
        assert_eq!(score_all(&s, &cold, &cs)[1], 1.0);
        // Without prefix data the request counts as cold; the prefill pick is recorded too.
        s.pre_request(&req(), &RequestData::default(), &cs, 1, Some(3));
        // LRU (oldest first): c, a, b, d — no never-used pod left.
        assert_eq!(
            score_all(&s, &cold, &cs),
            vec![r(1.0), r(2.0), r(0.0), r(3.0)]
        );
    }

    #[test]
    fn one_candidate_and_a_bounded_lru() {
        let s = lru(2);
        let cs: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|n| cand(n, metrics(0.0, 0.0, 0.0), false))
            .collect();
        let cold = RequestData::default();
        for i in 0..3 {
            s.pre_request(&req(), &cold, &cs, i, None);
        }
        // `a` fell out of the two-pod LRU: it is never used again (rank 0); b (1 + 0), c (1 + 1).
        assert_eq!(score_all(&s, &cold, &cs), vec![1.0, 0.5, 0.0]);
        assert_eq!(score_all(&s, &cold, &cs[..1]), vec![1.0]);
    }
}

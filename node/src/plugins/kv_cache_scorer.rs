//! `kv-cache-utilization-scorer`: score = 1 - KV-cache usage (a fraction). Missing or stale
//! metrics score 0.

use super::{SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "kv-cache-utilization-scorer";

#[derive(Debug, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, _req: &SchedRequest<'_>, candidates: &[&Candidate], out: &mut [f64]) {
        for (slot, c) in out.iter_mut().zip(candidates) {
            *slot = c
                .metrics()
                .and_then(|m| m.kv_cache_usage)
                .map(|u| 1.0 - u.clamp(0.0, 1.0))
                .unwrap_or(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalayer::EndpointMetrics;
    use crate::plugins::queue_scorer::tests::{cand, req};

    fn kv(u: f64) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            kv_cache_usage: Some(u),
            ..Default::default()
        })
    }

    #[test]
    fn scores() {
        let cs = [
            cand("a", kv(0.25), false),
            cand("b", kv(1.0), false),
            cand("c", None, false),
            cand("d", kv(0.0), true),
            cand("e", Some(EndpointMetrics::default()), false),
        ];
        let refs: Vec<_> = cs.iter().collect();
        let mut out = vec![9.0; 5];
        KvCacheScorer.score(&req(), &refs, &mut out);
        assert_eq!(out, vec![0.75, 0.0, 0.0, 0.0, 0.0]);
    }
}

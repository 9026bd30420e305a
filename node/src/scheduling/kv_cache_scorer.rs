//! `kv-cache-utilization-scorer`: score = 1 - KV-cache usage (a fraction). Missing or stale
//! metrics score 0.

use super::{RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "kv-cache-utilization-scorer";

#[derive(Debug, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        for (slot, &i) in out.iter_mut().zip(idx) {
            *slot = candidates[i]
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
    use crate::scheduling::testutil::*;

    #[test]
    fn scores() {
        let cs = [
            cand("a", metrics(0.0, 0.0, 0.25), false),
            cand("b", metrics(0.0, 0.0, 1.0), false),
            cand("c", None, false),
            cand("d", metrics(0.0, 0.0, 0.0), true),
            cand("e", Some(EndpointMetrics::default()), false),
        ];
        assert_eq!(
            score_all(&KvCacheScorer, &RequestData::default(), &cs),
            vec![0.75, 0.0, 0.0, 0.0, 0.0]
        );
    }
}

//! `queue-scorer`: prefers endpoints with shorter waiting queues.
//!
//! score = (maxQ - q) / (maxQ - minQ) over the candidates (1.0 when all are equal). An endpoint whose
//! metrics are missing or stale scores 0: we do not send traffic to a pod we cannot see.

use super::{RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "queue-scorer";

#[derive(Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
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
        min_max_score(candidates, idx, out, |c| {
            c.metrics().and_then(|m| m.waiting_queue_size)
        });
    }
}

/// The min-max form shared by the queue and running-requests scorers; `None` scores 0.
pub(crate) fn min_max_score(
    candidates: &[Candidate],
    idx: &[usize],
    out: &mut [f64],
    value: impl Fn(&Candidate) -> Option<f64>,
) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for &i in idx {
        if let Some(v) = value(&candidates[i]) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    for (slot, &i) in out.iter_mut().zip(idx) {
        *slot = match value(&candidates[i]) {
            None => 0.0,
            Some(_) if hi <= lo => 1.0,
            Some(v) => (hi - v) / (hi - lo),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::*;

    #[test]
    fn min_max() {
        let cs = [
            cand("a", metrics(0.0, 0.0, 0.0), false),
            cand("b", metrics(5.0, 0.0, 0.0), false),
            cand("c", metrics(10.0, 0.0, 0.0), false),
        ];
        assert_eq!(
            score_all(&QueueScorer, &RequestData::default(), &cs),
            vec![1.0, 0.5, 0.0]
        );
    }

    #[test]
    fn ties_missing_and_stale() {
        let cs = [
            cand("a", metrics(3.0, 0.0, 0.0), false),
            cand("b", metrics(3.0, 0.0, 0.0), false),
            cand("c", None, false),
            cand("d", metrics(0.0, 0.0, 0.0), true),
        ];
        assert_eq!(
            score_all(&QueueScorer, &RequestData::default(), &cs),
            vec![1.0, 1.0, 0.0, 0.0]
        );
    }

    #[test]
    fn subset_is_normalised_over_the_subset() {
        let cs = [
            cand("a", metrics(0.0, 0.0, 0.0), false),
            cand("b", metrics(4.0, 0.0, 0.0), false),
            cand("c", metrics(8.0, 0.0, 0.0), false),
        ];
        let mut out = vec![0.0; 2];
        QueueScorer.score(&req(), &RequestData::default(), &cs, &[1, 2], &mut out);
        assert_eq!(out, vec![1.0, 0.0]);
    }

    #[test]
    fn empty() {
        assert!(score_all(&QueueScorer, &RequestData::default(), &[]).is_empty());
    }
}

//! `queue-scorer`: prefers endpoints with shorter waiting queues.
//!
//! score = (maxQ - q) / (maxQ - minQ) over the candidates (1.0 when all are equal). An endpoint whose
//! metrics are missing or stale scores 0: we do not send traffic to a pod we cannot see.

use super::{SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "queue-scorer";

#[derive(Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, _req: &SchedRequest<'_>, candidates: &[&Candidate], out: &mut [f64]) {
        min_max_score(candidates, out, |c| {
            c.metrics().and_then(|m| m.waiting_queue_size)
        });
    }
}

/// The min-max form shared by the queue and running-requests scorers.
pub(crate) fn min_max_score(
    candidates: &[&Candidate],
    out: &mut [f64],
    value: impl Fn(&Candidate) -> Option<f64>,
) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for c in candidates {
        if let Some(v) = value(c) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    for (slot, c) in out.iter_mut().zip(candidates) {
        *slot = match value(c) {
            None => 0.0,
            Some(_) if hi <= lo => 1.0,
            Some(v) => (hi - v) / (hi - lo),
        };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::datalayer::{Endpoint, EndpointMetrics};
    use std::sync::Arc;
    use std::time::Instant;

    pub(crate) fn cand(name: &str, m: Option<EndpointMetrics>, stale: bool) -> Candidate {
        let ep = Arc::new(Endpoint::new(
            name.into(),
            "127.0.0.1:1".parse().unwrap(),
            Default::default(),
        ));
        if let Some(m) = m {
            ep.set_metrics(m, Instant::now());
        }
        Candidate {
            sample: ep.sample(),
            endpoint: ep,
            stale,
        }
    }

    pub(crate) fn req() -> SchedRequest<'static> {
        SchedRequest {
            request_id: "r",
            model: "m",
            target_model: "m",
        }
    }

    fn q(n: f64) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            waiting_queue_size: Some(n),
            ..Default::default()
        })
    }

    #[test]
    fn min_max() {
        let cs = [
            cand("a", q(0.0), false),
            cand("b", q(5.0), false),
            cand("c", q(10.0), false),
        ];
        let refs: Vec<_> = cs.iter().collect();
        let mut out = vec![0.0; 3];
        QueueScorer.score(&req(), &refs, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 0.0]);
    }

    #[test]
    fn ties_missing_and_stale() {
        let cs = [
            cand("a", q(3.0), false),
            cand("b", q(3.0), false),
            cand("c", None, false),
            cand("d", q(0.0), true),
        ];
        let refs: Vec<_> = cs.iter().collect();
        let mut out = vec![9.0; 4];
        QueueScorer.score(&req(), &refs, &mut out);
        assert_eq!(out, vec![1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn empty() {
        let mut out: Vec<f64> = vec![];
        QueueScorer.score(&req(), &[], &mut out);
        assert!(out.is_empty());
    }
}

//! Runs the scheduling profile for one request: producers, filters, weighted scorers, picker.
//!
//! Aggregation follows llm-d: every scorer's per-endpoint score is clamped to [0, 1], multiplied by
//! its weight and summed (not normalised by the sum of weights). Filters run in order and stop the
//! profile when they leave nothing (→ 429 `rejected-saturated`).

use std::sync::Arc;

use super::{Filter, Picker, Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

#[derive(Debug, Clone)]
pub struct WeightedScorer {
    pub name: String,
    pub weight: f64,
    pub scorer: Arc<dyn Scorer>,
}

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: String,
    pub filters: Vec<Arc<dyn Filter>>,
    pub scorers: Vec<WeightedScorer>,
    pub picker: Arc<dyn Picker>,
}

/// The only profile handler in this build: run the single profile.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub producers: Vec<Arc<dyn Producer>>,
    pub profile: Profile,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SchedError {
    #[error("no candidate endpoints")]
    NoCandidates,
    #[error("all endpoints were filtered out")]
    AllFiltered,
}

/// The outcome: chosen candidate indices, best first, each candidate's total score (0 for
/// filtered-out candidates) and the data the producers computed.
#[derive(Debug, Clone)]
pub struct Decision {
    pub picked: Vec<usize>,
    pub scores: Vec<f64>,
    pub data: RequestData,
}

impl Scheduler {
    pub fn schedule(
        &self,
        req: &SchedRequest<'_>,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> Result<Decision, SchedError> {
        if candidates.is_empty() {
            return Err(SchedError::NoCandidates);
        }
        let mut data = RequestData {
            prompt_tokens: req.prompt.estimated_tokens() as usize,
            ..RequestData::default()
        };
        for p in &self.producers {
            p.produce(req, candidates, &mut data);
        }
        let mut keep: Vec<usize> = (0..candidates.len()).collect();
        for f in &self.profile.filters {
            f.filter(req, &data, candidates, &mut keep);
            if keep.is_empty() {
                return Err(SchedError::AllFiltered);
            }
        }
        let mut total = vec![0.0f64; keep.len()];
        let mut buf = vec![0.0f64; keep.len()];
        for ws in &self.profile.scorers {
            buf.iter_mut().for_each(|s| *s = 0.0);
            ws.scorer.score(req, &data, candidates, &keep, &mut buf);
            for (t, s) in total.iter_mut().zip(&buf) {
                let s = if s.is_finite() {
                    s.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                *t += s * ws.weight;
            }
        }
        let mut scored: Vec<(usize, f64)> = keep.iter().copied().zip(total).collect();
        let mut scores = vec![0.0; candidates.len()];
        for (i, s) in &scored {
            scores[*i] = *s;
        }
        let picked = self.profile.picker.pick(&mut scored, rng);
        if picked.is_empty() {
            return Err(SchedError::AllFiltered);
        }
        Ok(Decision {
            picked,
            scores,
            data,
        })
    }

    /// Let producers record the decision (prefix blocks → the chosen pod, in-flight load).
    pub fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        decision: &Decision,
        candidates: &[Candidate],
    ) {
        let Some(&primary) = decision.picked.first() else {
            return;
        };
        if primary >= candidates.len() {
            return;
        }
        for p in &self.producers {
            p.pre_request(req, &decision.data, candidates, primary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointPickerConfig;
    use crate::plugins::testutil::*;

    /// The built-in default profile on four pods: queue ×2 + kv-cache ×2 + prefix ×3, summed.
    #[test]
    fn four_pod_weighted_sum() {
        let built =
            crate::plugins::build(&EndpointPickerConfig::builtin_default().unwrap()).unwrap();
        let s = &built.scheduler;
        let cs = vec![
            cand_at("a", "10.0.0.1:8000", metrics(0.0, 1.0, 0.5), false, &[]),
            cand_at("b", "10.0.0.2:8000", metrics(2.0, 1.0, 0.25), false, &[]),
            cand_at("c", "10.0.0.3:8000", metrics(4.0, 1.0, 0.0), false, &[]),
            cand_at("d", "10.0.0.4:8000", None, false, &[]),
        ];
        // 1024 bytes = 256 estimate tokens = 4 blocks of 64; route it once to c so c holds it.
        let text: Vec<u8> = (0..1024u32).map(|i| b'a' + (i % 23) as u8).collect();
        let prompt = crate::parsers::Prompt::Text(text);
        let mut r = req();
        r.prompt = &prompt;
        let mut rng = rand::rng();
        let first = s.schedule(&r, &cs, &mut rng).unwrap();
        s.pre_request(
            &r,
            &Decision {
                picked: vec![2],
                ..first
            },
            &cs,
        );

        let d = s.schedule(&r, &cs, &mut rng).unwrap();
        // queue: (4-q)/4 → a 1, b 0.5, c 0, d 0 (no metrics)
        // kv:    1-u      → a 0.5, b 0.75, c 1, d 0
        // prefix: matched/total → c 4/4, others 0
        let want = [
            2.0 * 1.0 + 2.0 * 0.5,
            2.0 * 0.5 + 2.0 * 0.75,
            2.0 * 0.0 + 2.0 * 1.0 + 3.0 * 1.0,
            0.0,
        ];
        for (got, want) in d.scores.iter().zip(want) {
            assert!((got - want).abs() < 1e-9, "{:?} vs {want:?}", d.scores);
        }
        assert_eq!(d.picked, vec![2]);
        assert_eq!(d.data.prompt_tokens, 256);
    }

    #[test]
    fn filters_that_empty_the_set_are_429_and_no_candidates_503() {
        let cfg = EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: prefill-filter\n- type: queue-scorer\n",
        )
        .unwrap();
        let s = crate::plugins::build(&cfg).unwrap().scheduler;
        let cs = vec![cand("a", metrics(0.0, 0.0, 0.0), false)];
        let mut rng = rand::rng();
        assert_eq!(
            s.schedule(&req(), &cs, &mut rng).unwrap_err(),
            SchedError::AllFiltered
        );
        assert_eq!(
            s.schedule(&req(), &[], &mut rng).unwrap_err(),
            SchedError::NoCandidates
        );
    }
}

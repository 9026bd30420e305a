//! Runs the scheduling profile for one request: weighted scorers, then the picker.
//!
//! Aggregation follows llm-d: every scorer's per-endpoint score is clamped to [0, 1], multiplied by
//! its weight and summed (not normalised by the sum of weights).

use std::sync::Arc;

use super::{Picker, SchedRequest, Scorer};
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
    pub scorers: Vec<WeightedScorer>,
    pub picker: Arc<dyn Picker>,
}

/// The only profile handler in this slice: run the single profile.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub profile: Profile,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SchedError {
    #[error("no candidate endpoints")]
    NoCandidates,
    #[error("all endpoints were filtered out")]
    AllFiltered,
}

/// The outcome: chosen candidate indices, best first, and each candidate's total score.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub picked: Vec<usize>,
    pub scores: Vec<f64>,
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
        let refs: Vec<&Candidate> = candidates.iter().collect();
        let mut total = vec![0.0f64; refs.len()];
        let mut buf = vec![0.0f64; refs.len()];
        for ws in &self.profile.scorers {
            buf.iter_mut().for_each(|s| *s = 0.0);
            ws.scorer.score(req, &refs, &mut buf);
            for (t, s) in total.iter_mut().zip(&buf) {
                let s = if s.is_finite() {
                    s.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                *t += s * ws.weight;
            }
        }
        let mut scored: Vec<(usize, f64)> = total.iter().copied().enumerate().collect();
        let picked = self.profile.picker.pick(&mut scored, rng);
        if picked.is_empty() {
            return Err(SchedError::AllFiltered);
        }
        Ok(Decision {
            picked,
            scores: total,
        })
    }
}

//! `lora-affinity-scorer`: prefers pods where the requested adapter is already loaded.
//!
//! 1.0 if the target model is running on the pod; 0.8 if the pod has a free adapter slot
//! (running + waiting adapters < max); 0.6 if the adapter is waiting there; else 0. A pod without
//! LoRA information (no `vllm:lora_requests_info`) scores 0.8 when it has no limit reported — it can
//! serve any base-model request.

use super::{RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "lora-affinity-scorer";

#[derive(Debug, Default)]
pub struct LoraAffinityScorer;

impl Scorer for LoraAffinityScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(
        &self,
        req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let model = req.target_model;
        for (slot, &i) in out.iter_mut().zip(idx) {
            *slot = match candidates[i].metrics() {
                None => 0.0,
                Some(m) => {
                    let active = m.active_models.iter().any(|a| a == model);
                    let waiting = m.waiting_models.iter().any(|a| a == model);
                    let used = m.active_models.len() + m.waiting_models.len();
                    match m.max_active_models {
                        _ if active => 1.0,
                        Some(max) if (used as u64) < max => 0.8,
                        None => 0.8,
                        _ if waiting => 0.6,
                        _ => 0.0,
                    }
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalayer::EndpointMetrics;
    use crate::scheduling::testutil::*;

    fn lora(max: Option<u64>, active: &[&str], waiting: &[&str]) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            max_active_models: max,
            active_models: active.iter().map(|s| s.to_string()).collect(),
            waiting_models: waiting.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
    }

    #[test]
    fn tiers() {
        // the request's target model is "m"
        let cs = [
            cand("active", lora(Some(2), &["m", "x"], &[]), false),
            cand("free-slot", lora(Some(2), &["x"], &[]), false),
            cand("waiting", lora(Some(2), &["x"], &["m"]), false),
            cand("full", lora(Some(2), &["x", "y"], &[]), false),
            cand("no-info", lora(None, &[], &[]), false),
            cand("stale", lora(Some(2), &["m"], &[]), true),
        ];
        assert_eq!(
            score_all(&LoraAffinityScorer, &RequestData::default(), &cs),
            vec![1.0, 0.8, 0.6, 0.0, 0.8, 0.0]
        );
    }
}

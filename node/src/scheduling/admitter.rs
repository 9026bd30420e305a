//! Admitter plugins: after the data producers and before the profiles run, an admitter may turn
//! a request away (llm-d's `Admitter` interface). A request one refuses is answered 429
//! `rejected-saturated` (llm-d answers 500 "request cannot be admitted"; a shed request should be
//! retryable, and is said so).
//!
//! `probabilistic-admitter` (llm-d): requests of priority ≥ 0 always pass. A sheddable one
//! (priority < 0) is refused with probability `p = min(saturation^power × k, 1)`, where the
//! saturation is the mean over the candidates of `max(waiting queue / queueDepthThreshold,
//! KV usage / kvCacheUtilThreshold)` — a pod without fresh metrics counts as 1 — so shedding
//! starts gently and rises steeply with the load (defaults: ~2.3% at 0.15, all at ≈ 0.34) instead
//! of the saturation detector's all-or-nothing cut. No candidates: admitted (the scheduler
//! answers 503 then).

use serde::Deserialize;

use super::{RequestData, SchedRequest};
use crate::datalayer::store::Candidate;

pub const PROBABILISTIC_TYPE: &str = "probabilistic-admitter";

/// Turns requests away before scheduling.
pub trait Admitter: Send + Sync + std::fmt::Debug {
    fn type_name(&self) -> &'static str;
    /// Whether `req` may go on to scheduling (`data`: what the producers computed).
    fn admit(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> bool;
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProbabilisticParams {
    #[serde(default = "d_queue")]
    pub queue_depth_threshold: f64,
    #[serde(default = "d_kv")]
    pub kv_cache_util_threshold: f64,
    #[serde(default = "d_power")]
    pub power: f64,
    #[serde(default = "d_k")]
    pub k: f64,
}

fn d_queue() -> f64 {
    5.0
}
fn d_kv() -> f64 {
    0.8
}
fn d_power() -> f64 {
    5.0
}
fn d_k() -> f64 {
    300.0
}

impl ProbabilisticParams {
    /// Every parameter must be a positive finite number (the KV threshold at most 1).
    pub fn validate(&self, path: &str) -> Result<(), crate::config::ConfigError> {
        for (name, v, max) in [
            ("queueDepthThreshold", self.queue_depth_threshold, f64::MAX),
            ("kvCacheUtilThreshold", self.kv_cache_util_threshold, 1.0),
            ("power", self.power, f64::MAX),
            ("k", self.k, f64::MAX),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= max) {
                return Err(crate::config::ConfigError::Field {
                    path: format!("{path}.{name}"),
                    message: format!(
                        "must be a positive number{}",
                        if max == 1.0 { " ≤ 1" } else { "" }
                    ),
                });
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct ProbabilisticAdmitter {
    pub params: ProbabilisticParams,
}

impl ProbabilisticAdmitter {
    /// The candidates' mean roofline saturation.
    pub fn saturation(&self, candidates: &[Candidate]) -> f64 {
        if candidates.is_empty() {
            return 0.0;
        }
        let p = &self.params;
        let sum: f64 = candidates
            .iter()
            .map(|c| match c.metrics() {
                None => 1.0,
                Some(m) => (m.waiting_queue_size.unwrap_or(0.0) / p.queue_depth_threshold)
                    .max(m.kv_cache_usage.unwrap_or(0.0) / p.kv_cache_util_threshold),
            })
            .sum();
        sum / candidates.len() as f64
    }

    /// The probability that a sheddable request is refused at `saturation`.
    pub fn shed_probability(&self, saturation: f64) -> f64 {
        (saturation.max(0.0).powf(self.params.power) * self.params.k).min(1.0)
    }
}

impl Admitter for ProbabilisticAdmitter {
    fn type_name(&self) -> &'static str {
        PROBABILISTIC_TYPE
    }

    fn admit(
        &self,
        req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> bool {
        if req.priority >= 0 || candidates.is_empty() {
            return true;
        }
        let p = self.shed_probability(self.saturation(candidates));
        // A uniform draw in [0, 1): refused when it falls below p.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        u >= p
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::scheduling::testutil::*;

    fn admitter() -> ProbabilisticAdmitter {
        ProbabilisticAdmitter {
            params: serde_json::from_str("{}").unwrap(),
        }
    }

    #[test]
    fn saturation_is_the_mean_roofline_and_the_curve_is_llm_ds() {
        let a = admitter();
        // queue 1/5 = 0.2 vs KV 0.4/0.8 = 0.5 → 0.5; queue 0 and KV 0 → 0; no metrics → 1;
        // queue 10/5 = 2 → 2.
        let cs = [
            cand("a", metrics(1.0, 0.0, 0.4), false),
            cand("b", metrics(0.0, 0.0, 0.0), false),
            cand("c", None, false),
            cand("d", metrics(10.0, 0.0, 0.0), false),
        ];
        assert_eq!(a.saturation(&cs), (0.5 + 0.0 + 1.0 + 2.0) / 4.0);
        assert_eq!(a.saturation(&cs[1..2]), 0.0);
        // The documented points of the default curve.
        for (sat, want) in [(0.0, 0.0), (0.15, 0.0228), (0.2, 0.096), (0.3, 0.729)] {
            assert!((a.shed_probability(sat) - want).abs() < 1e-3, "{sat}");
        }
        assert_eq!(a.shed_probability(0.34), 1.0);
        assert_eq!(a.shed_probability(5.0), 1.0);
    }

    #[test]
    fn only_sheddable_requests_are_shed_at_the_curves_rate() {
        let a = admitter();
        // Saturation 0.25 (KV 0.2 of 0.8 everywhere): p = 0.25^5 × 300 ≈ 0.293.
        let cs: Vec<_> = ["a", "b"]
            .iter()
            .map(|n| cand(n, metrics(0.0, 0.0, 0.2), false))
            .collect();
        let p = a.shed_probability(a.saturation(&cs));
        assert!((p - 0.29297).abs() < 1e-4, "{p}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut r = req();
        let n = 20_000;
        r.priority = -1;
        let refused = (0..n)
            .filter(|_| !a.admit(&r, &RequestData::default(), &cs, &mut rng))
            .count();
        let rate = refused as f64 / n as f64;
        assert!((rate - p).abs() < 0.015, "refused {rate} vs p {p}");
        r.priority = 0;
        assert!((0..1000).all(|_| a.admit(&r, &RequestData::default(), &cs, &mut rng)));
        // Full saturation refuses every sheddable request; no candidates admit.
        let full = [cand("x", metrics(5.0, 0.0, 0.0), false)];
        r.priority = -5;
        assert!((0..100).all(|_| !a.admit(&r, &RequestData::default(), &full, &mut rng)));
        assert!(a.admit(&r, &RequestData::default(), &[], &mut rng));
    }
}

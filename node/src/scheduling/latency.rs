//! llm-d's latency-SLO plugins — `predicted-latency-producer`, `latency-scorer`,
//! `latency-slo-admitter` — backed by the cost model instead of llm-d's trained latency predictor
//! (a sidecar this project does not run).
//!
//! * The producer reads the request's SLOs (`x-llm-d-slo-ttft-ms`, `x-llm-d-slo-tpot-ms`; the
//!   older `x-slo-ttft-ms`, `x-slo-tpot-ms` too; absent = 0) and, per candidate, takes the cost
//!   model's TTFT prediction and — in `streamingMode`, except on pods whose `endpointRoleLabel`
//!   says `prefill` — its time per output token (`t0 + t1 · running`, learned from streamed
//!   responses). TTFT is valid below its SLO, headroom = SLO − prediction; TPOT is valid below
//!   `sloBufferFactor` × its SLO, headroom likewise. Not streaming, a prefill pod, or no TPOT
//!   learned yet: TPOT valid with headroom 0. (llm-d also caps the TPOT buffer by the tightest SLO
//!   of the requests running on the pod; not tracked here.)
//! * The scorer prefers pods meeting both SLOs — among them the least headroom (`least`, packing
//!   tight) or the most (`most`) — else an idle pod, else the pods missing only TPOT, only TTFT,
//!   then both, by least excess. Without predictions it falls back to a composite of KV room,
//!   queue and prefix match. Formulas as llm-d's.
//! * `slo-headroom-tier-filter` keeps the pods meeting both SLOs (headrooms ≥ 0) — or, with
//!   probability `epsilonExploreNeg` (0.01), the others instead, to keep learning about them; pods
//!   without a prediction count as missing; nobody predicted: all kept.
//! * The admitter lets every request of priority ≥ 0 and every request without an SLO through;
//!   a sheddable one with an SLO passes if some pod is predicted to meet it, or is idle, or has
//!   its KV cache nearly empty (< 2%). Refusals are 429 `rejected-saturated`, as for the other
//!   admitters.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::admitter::Admitter;
use super::cost_model::CostModel;
use super::{Filter, LatencyInfo, Producer, RequestData, SchedRequest, Scorer};
use crate::config::{ConfigError, parse_duration};
use crate::datalayer::store::Candidate;

pub const PRODUCER_TYPE: &str = "predicted-latency-producer";
pub const SCORER_TYPE: &str = "latency-scorer";
pub const ADMITTER_TYPE: &str = "latency-slo-admitter";
pub const TIER_FILTER_TYPE: &str = "slo-headroom-tier-filter";
/// The TTFT SLO (ms), current name first.
pub const TTFT_SLO_HEADERS: [&str; 2] = ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];
/// The TPOT SLO (ms).
pub const TPOT_SLO_HEADERS: [&str; 2] = ["x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"];
/// KV usage under which a pod counts as cold for the admitter.
const COLD_KV: f64 = 0.02;

/// `predicted-latency-producer` parameters (llm-d's; the predictor's own are accepted).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LatencyParams {
    #[serde(default = "d_one")]
    pub slo_buffer_factor: f64,
    /// How long llm-d keeps a request's prediction context (accepted; validated).
    #[serde(default, rename = "contextTTL")]
    pub context_ttl: Option<String>,
    #[serde(default)]
    pub streaming_mode: bool,
    #[serde(default)]
    pub endpoint_role_label: String,
    /// Accepted: predictions are always made when the producer runs.
    #[serde(default = "d_true")]
    pub predict_in_produce: bool,
    #[serde(default)]
    pub prefix_match_info_producer_name: Option<String>,
    #[serde(default)]
    pub in_flight_load_producer_name: Option<String>,
    #[serde(default)]
    pub encoder_cache_match_info_producer_name: Option<String>,
    /// Accepted: the cost model has no encoder features.
    #[serde(default)]
    pub use_encoder_cache_features: bool,
    /// Deprecated in llm-d and ignored there too.
    #[serde(default)]
    pub sampling_mean: Option<f64>,
    #[serde(default)]
    pub max_decode_token_samples_for_prediction: Option<i64>,
}

fn d_one() -> f64 {
    1.0
}
fn d_true() -> bool {
    true
}

impl Default for LatencyParams {
    fn default() -> Self {
        LatencyParams {
            slo_buffer_factor: 1.0,
            context_ttl: None,
            streaming_mode: false,
            endpoint_role_label: String::new(),
            predict_in_produce: true,
            prefix_match_info_producer_name: None,
            in_flight_load_producer_name: None,
            encoder_cache_match_info_producer_name: None,
            use_encoder_cache_features: false,
            sampling_mean: None,
            max_decode_token_samples_for_prediction: None,
        }
    }
}

impl LatencyParams {
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if !(self.slo_buffer_factor.is_finite() && self.slo_buffer_factor > 0.0) {
            return Err(ConfigError::Field {
                path: format!("{path}.sloBufferFactor"),
                message: format!("must be > 0, got {}", self.slo_buffer_factor),
            });
        }
        if let Some(t) = &self.context_ttl {
            parse_duration(t).map_err(|message| ConfigError::Field {
                path: format!("{path}.contextTTL"),
                message,
            })?;
        }
        Ok(())
    }
}

/// The request's SLO from the first of `names` that holds a positive number (0: none).
fn slo(headers: &HashMap<String, String>, names: &[&str]) -> f64 {
    names
        .iter()
        .find_map(|n| headers.get(*n))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .unwrap_or(0.0)
}

/// `predicted-latency-producer`: runs after the cost model and reads its predictions.
#[derive(Debug)]
pub struct PredictedLatency {
    pub params: LatencyParams,
    pub cost: Arc<CostModel>,
}

impl Producer for PredictedLatency {
    fn type_name(&self) -> &'static str {
        PRODUCER_TYPE
    }

    fn produce(&self, req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        if data.predicted.len() != candidates.len() {
            return;
        }
        let ttft_slo = slo(req.headers, &TTFT_SLO_HEADERS);
        let tpot_buffer = slo(req.headers, &TPOT_SLO_HEADERS) * self.params.slo_buffer_factor;
        let label = self.params.endpoint_role_label.as_str();
        data.latency = candidates
            .iter()
            .zip(&data.predicted)
            .enumerate()
            .map(|(i, (c, p))| {
                let prefill = !label.is_empty()
                    && c.endpoint.labels.get(label).map(String::as_str) == Some("prefill");
                let tpot = (self.params.streaming_mode && !prefill)
                    .then(|| self.cost.predict_tpot(p.running))
                    .flatten();
                LatencyInfo {
                    ttft_ms: p.ttft_ms,
                    tpot_ms: tpot,
                    ttft_valid: p.ttft_ms < ttft_slo,
                    ttft_headroom: ttft_slo - p.ttft_ms,
                    tpot_valid: tpot.is_none_or(|t| t < tpot_buffer),
                    tpot_headroom: tpot.map_or(0.0, |t| tpot_buffer - t),
                    dispatched: data.inflight.get(i).map_or(0, |l| l.requests),
                }
            })
            .collect();
    }

    fn pre_request(
        &self,
        _req: &SchedRequest<'_>,
        _data: &RequestData,
        _candidates: &[Candidate],
        _primary: usize,
        _prefill: Option<usize>,
    ) {
    }
}

/// `latency-scorer` parameters (llm-d's names and defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LatencyScorerParams {
    #[serde(default = "d_ttft_weight")]
    pub ttft_weight: f64,
    #[serde(default = "d_tpot_weight")]
    pub tpot_weight: f64,
    #[serde(default = "d_strategy")]
    pub headroom_selection_strategy: String,
    #[serde(default = "d_one", rename = "compositeKVWeight")]
    pub composite_kv_weight: f64,
    #[serde(default = "d_one")]
    pub composite_queue_weight: f64,
    #[serde(default = "d_one")]
    pub composite_prefix_weight: f64,
    #[serde(default)]
    pub latency_prediction_info_producer_name: Option<String>,
    #[serde(default)]
    pub prefix_match_info_producer_name: Option<String>,
}

fn d_ttft_weight() -> f64 {
    0.8
}
fn d_tpot_weight() -> f64 {
    0.2
}
fn d_strategy() -> String {
    "least".into()
}

/// `latency-scorer`.
#[derive(Debug)]
pub struct LatencyScorer {
    ttft_weight: f64,
    tpot_weight: f64,
    /// `most` (else `least`).
    most: bool,
    composite: [f64; 3],
}

impl LatencyScorer {
    pub fn new(p: &LatencyScorerParams, path: &str) -> Result<Self, ConfigError> {
        let most = match p.headroom_selection_strategy.as_str() {
            "least" => false,
            "most" => true,
            other => {
                return Err(ConfigError::Field {
                    path: format!("{path}.headroomSelectionStrategy"),
                    message: format!("must be `least` or `most`, got `{other}`"),
                });
            }
        };
        for (k, v) in [
            ("ttftWeight", p.ttft_weight),
            ("tpotWeight", p.tpot_weight),
            ("compositeKVWeight", p.composite_kv_weight),
            ("compositeQueueWeight", p.composite_queue_weight),
            ("compositePrefixWeight", p.composite_prefix_weight),
        ] {
            if !v.is_finite() {
                return Err(ConfigError::Field {
                    path: format!("{path}.{k}"),
                    message: format!("must be a number, got {v}"),
                });
            }
        }
        Ok(LatencyScorer {
            ttft_weight: p.ttft_weight,
            tpot_weight: p.tpot_weight,
            most,
            composite: [
                p.composite_kv_weight,
                p.composite_queue_weight,
                p.composite_prefix_weight,
            ],
        })
    }

    /// Scores `members` (candidate indices) by their headrooms' magnitudes.
    fn bucket(&self, lat: &[LatencyInfo], members: &[usize], most: bool) -> Vec<(usize, f64)> {
        let sum = self.ttft_weight + self.tpot_weight;
        let (mut a, mut b) = if sum > 0.0 {
            (self.ttft_weight / sum, self.tpot_weight / sum)
        } else {
            (1.0, 0.0)
        };
        let range = |f: fn(&LatencyInfo) -> f64| {
            let vals = members.iter().map(|&i| f(&lat[i]).abs());
            let lo = vals.clone().fold(f64::INFINITY, f64::min);
            let hi = vals.fold(f64::NEG_INFINITY, f64::max);
            (lo, hi - lo)
        };
        let (t_lo, t_range) = range(|l| l.ttft_headroom);
        let (p_lo, p_range) = range(|l| l.tpot_headroom);
        let flat = |r: f64| r <= 1e-9;
        if flat(t_range) && !flat(p_range) {
            (a, b) = (0.0, 1.0);
        } else if flat(p_range) && !flat(t_range) {
            (a, b) = (1.0, 0.0);
        }
        let norm = |v: f64, lo: f64, r: f64| if flat(r) { 0.5 } else { (v - lo) / r };
        members
            .iter()
            .map(|&i| {
                let l = &lat[i];
                let c = a * norm(l.ttft_headroom.abs(), t_lo, t_range)
                    + b * norm(l.tpot_headroom.abs(), p_lo, p_range);
                let s = if most { c } else { 1.0 - c };
                (i, ((s * 100.0) as i64 + 1) as f64 / 100.0)
            })
            .collect()
    }

    /// Without predictions: KV room, queue and prefix match, weighted (llm-d's fallback).
    fn composite(
        &self,
        data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let [mut wk, mut wq, mut wp] = self.composite.map(|w| w.max(0.0));
        let sum = wk + wq + wp;
        if sum > 0.0 {
            (wk, wq, wp) = (wk / sum, wq / sum, wp / sum);
        } else {
            (wk, wq, wp) = (1.0, 0.0, 0.0);
        }
        let queue = |i: usize| {
            candidates[i]
                .metrics()
                .and_then(|m| m.waiting_queue_size)
                .unwrap_or(0.0)
        };
        let max_q = idx.iter().map(|&i| queue(i)).fold(0.0, f64::max);
        for (slot, &i) in out.iter_mut().zip(idx) {
            let kv = candidates[i]
                .metrics()
                .and_then(|m| m.kv_cache_usage)
                .unwrap_or(0.0);
            let q = if max_q > 0.0 {
                (max_q - queue(i)) / max_q
            } else {
                1.0
            };
            let prefix = data.prefix.as_ref().map_or(0.0, |p| {
                if p.total_blocks > 0 {
                    p.effective(i) / p.total_blocks as f64
                } else {
                    0.0
                }
            });
            *slot = (100.0 * (wk * (1.0 - kv) + wq * q + wp * prefix)).round() / 100.0;
        }
    }
}

impl Scorer for LatencyScorer {
    fn type_name(&self) -> &'static str {
        SCORER_TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let lat = &data.latency;
        if lat.len() != candidates.len() {
            self.composite(data, candidates, idx, out);
            return;
        }
        let pick = |f: &dyn Fn(&LatencyInfo) -> bool| -> Vec<usize> {
            idx.iter().copied().filter(|&i| f(&lat[i])).collect()
        };
        let positive = pick(&|l| l.ttft_headroom >= 0.0 && l.tpot_headroom >= 0.0);
        let scored = if !positive.is_empty() {
            self.bucket(lat, &positive, self.most)
        } else {
            let idle = pick(&|l| l.dispatched == 0);
            let buckets = [
                idle,
                pick(&|l| l.tpot_headroom < 0.0 && l.ttft_headroom >= 0.0),
                pick(&|l| l.ttft_headroom < 0.0 && l.tpot_headroom >= 0.0),
                pick(&|l| l.ttft_headroom < 0.0 && l.tpot_headroom < 0.0),
            ];
            buckets
                .iter()
                .find(|b| !b.is_empty())
                .map_or_else(Vec::new, |b| self.bucket(lat, b, false))
        };
        out.iter_mut().for_each(|s| *s = 0.0);
        for (i, s) in scored {
            if let Some(k) = idx.iter().position(|&j| j == i) {
                out[k] = s;
            }
        }
    }
}

/// `slo-headroom-tier-filter` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TierParams {
    #[serde(default = "d_epsilon")]
    pub epsilon_explore_neg: f64,
    #[serde(default)]
    pub latency_prediction_info_producer_name: Option<String>,
}

fn d_epsilon() -> f64 {
    0.01
}

/// `slo-headroom-tier-filter`.
#[derive(Debug)]
pub struct SloHeadroomTierFilter {
    epsilon: f64,
}

impl SloHeadroomTierFilter {
    pub fn new(p: &TierParams, path: &str) -> Result<Self, ConfigError> {
        if !(0.0..=1.0).contains(&p.epsilon_explore_neg) {
            return Err(ConfigError::Field {
                path: format!("{path}.epsilonExploreNeg"),
                message: format!("must be in [0, 1], got {}", p.epsilon_explore_neg),
            });
        }
        Ok(SloHeadroomTierFilter {
            epsilon: p.epsilon_explore_neg,
        })
    }

    /// The tier to keep: `explore` draws whether to keep the missing tier when both exist.
    fn tier(&self, data: &RequestData, keep: &[usize], explore: f64) -> Option<Vec<usize>> {
        if keep.len() <= 1 || data.latency.is_empty() {
            return None;
        }
        let (positive, negative): (Vec<usize>, Vec<usize>) = keep.iter().partition(|&&i| {
            data.latency
                .get(i)
                .is_some_and(|l| l.ttft_headroom >= 0.0 && l.tpot_headroom >= 0.0)
        });
        match (positive.is_empty(), negative.is_empty()) {
            (false, false) if explore < self.epsilon => Some(negative),
            (false, _) => Some(positive),
            (true, _) => Some(negative),
        }
    }
}

impl Filter for SloHeadroomTierFilter {
    fn type_name(&self) -> &'static str {
        TIER_FILTER_TYPE
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        if let Some(tier) = self.tier(data, keep, rand::random::<f64>()) {
            *keep = tier;
        }
    }
}

/// `latency-slo-admitter` parameters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdmitterParams {
    #[serde(default)]
    pub latency_prediction_info_producer_name: Option<String>,
}

/// `latency-slo-admitter`.
#[derive(Debug, Default)]
pub struct LatencySloAdmitter;

impl Admitter for LatencySloAdmitter {
    fn type_name(&self) -> &'static str {
        ADMITTER_TYPE
    }

    fn admit(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        _rng: &mut dyn rand::RngCore,
    ) -> bool {
        let has_slo =
            slo(req.headers, &TTFT_SLO_HEADERS) > 0.0 || slo(req.headers, &TPOT_SLO_HEADERS) > 0.0;
        if req.priority >= 0 || !has_slo || data.latency.len() != candidates.len() {
            return true;
        }
        let gauge = |c: &Candidate, f: fn(&crate::datalayer::EndpointMetrics) -> Option<f64>| {
            c.metrics().and_then(f)
        };
        data.latency.iter().any(|l| l.ttft_valid && l.tpot_valid)
            || candidates
                .iter()
                .any(|c| gauge(c, |m| m.running_requests) == Some(0.0))
            || candidates
                .iter()
                .any(|c| gauge(c, |m| m.kv_cache_usage).is_some_and(|kv| kv < COLD_KV))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::*;

    fn info(ttft_h: f64, tpot_h: f64, dispatched: u64) -> LatencyInfo {
        LatencyInfo {
            ttft_ms: 0.0,
            tpot_ms: None,
            ttft_valid: ttft_h > 0.0,
            tpot_valid: tpot_h >= 0.0,
            ttft_headroom: ttft_h,
            tpot_headroom: tpot_h,
            dispatched,
        }
    }

    fn scorer(strategy: &str) -> LatencyScorer {
        let p: LatencyScorerParams =
            serde_json::from_value(serde_json::json!({"headroomSelectionStrategy": strategy}))
                .unwrap();
        LatencyScorer::new(&p, "p").unwrap()
    }

    fn four() -> Vec<Candidate> {
        (1..=4)
            .map(|i| {
                cand_at(
                    &format!("p{i}"),
                    &format!("10.0.0.{i}:8000"),
                    None,
                    false,
                    &[],
                )
            })
            .collect()
    }

    /// Hand-computed: among pods meeting both SLOs, `least` prefers the tightest headroom.
    #[test]
    fn the_scorer_packs_pods_that_meet_the_slos() {
        let cs = four();
        let data = RequestData {
            latency: vec![
                info(100.0, 10.0, 1),
                info(300.0, 30.0, 1),
                info(-50.0, 5.0, 0),
                info(200.0, 20.0, 2),
            ],
            ..Default::default()
        };
        let mut out = vec![-1.0; 4];
        scorer("least").score(&req(), &data, &cs, &[0, 1, 2, 3], &mut out);
        // Positive: 0, 1, 3. TTFT |h| 100..300 → n 0, 1, 0.5; TPOT 10..30 → 0, 1, 0.5;
        // c = 0.8 n + 0.2 n; least: int((1 − c)·100) + 1.
        assert_eq!(out, vec![1.01, 0.01, 0.0, 0.51]);
        scorer("most").score(&req(), &data, &cs, &[0, 1, 2, 3], &mut out);
        assert_eq!(out, vec![0.01, 1.01, 0.0, 0.51]);
    }

    /// Nobody meets the SLOs: an idle pod first; else TPOT-only misses before TTFT misses, the
    /// least excess best.
    #[test]
    fn the_scorer_falls_back_by_bucket() {
        let cs = four();
        let mut data = RequestData {
            latency: vec![
                info(-100.0, 5.0, 2),
                info(50.0, -3.0, 1),
                info(-10.0, -1.0, 0),
                info(20.0, -9.0, 3),
            ],
            ..Default::default()
        };
        let mut out = vec![-1.0; 4];
        let s = scorer("most");
        s.score(&req(), &data, &cs, &[0, 1, 2, 3], &mut out);
        // Only pod 2 is idle: it alone, one member (ranges 0: 0.5 each) → int(0.5·100)+1.
        assert_eq!(out, vec![0.0, 0.0, 0.51, 0.0]);
        data.latency[2].dispatched = 1;
        s.score(&req(), &data, &cs, &[0, 1, 2, 3], &mut out);
        // TPOT-only misses: pods 1 (|3|) and 3 (|9|); TTFT |h| 50, 20 → ranges both non-zero:
        // c(1) = 0.8·1 + 0.2·0 = 0.8 → int((1 − 0.8)·100) + 1 = 20 in floating point (19.99…,
        // as llm-d computes it); c(3) = 0.2 → 0.81 (least, forced).
        assert_eq!(out, vec![0.0, 0.2, 0.0, 0.81]);
    }

    #[test]
    fn without_predictions_the_scorer_is_a_composite() {
        let cs = vec![
            cand_at("a", "10.0.0.1:8000", metrics(4.0, 1.0, 0.5), false, &[]),
            cand_at("b", "10.0.0.2:8000", metrics(0.0, 1.0, 0.0), false, &[]),
        ];
        let data = RequestData {
            prefix: Some(crate::scheduling::PrefixMatchInfo {
                block_size: 64,
                total_blocks: 4,
                matched: vec![4, 0],
                hashes: vec![],
                weighted: Vec::new(),
            }),
            ..Default::default()
        };
        let mut out = vec![-1.0; 2];
        scorer("least").score(&req(), &data, &cs, &[0, 1], &mut out);
        // a: (0.5 + 0 + 1)/3 = 0.5; b: (1 + 1 + 0)/3 = 0.67.
        assert_eq!(out, vec![0.5, 0.67]);
    }

    #[test]
    fn the_admitter_sheds_only_sheddable_requests_nobody_can_serve_in_time() {
        let busy = |kv| cand_at("a", "10.0.0.1:8000", metrics(0.0, 3.0, kv), false, &[]);
        let cs = vec![busy(0.5), busy(0.6)];
        let slo = HashMap::from([("x-llm-d-slo-ttft-ms".to_string(), "200".to_string())]);
        let mut r = req();
        r.headers = &slo;
        r.priority = -1;
        let mut data = RequestData {
            latency: vec![info(-10.0, 0.0, 1), info(-20.0, 0.0, 1)],
            ..Default::default()
        };
        let a = LatencySloAdmitter;
        let rng = &mut rand::rng();
        assert!(!a.admit(&r, &data, &cs, rng));
        // Premium, or no SLO: always through.
        r.priority = 0;
        assert!(a.admit(&r, &data, &cs, rng));
        r.priority = -1;
        r.headers = &NO_HEADERS;
        assert!(a.admit(&r, &data, &cs, rng));
        r.headers = &slo;
        // A pod meeting it, an idle pod, or a cold one.
        data.latency[1] = info(5.0, 0.0, 1);
        assert!(a.admit(&r, &data, &cs, rng));
        data.latency[1] = info(-20.0, 0.0, 1);
        let idle = vec![
            busy(0.5),
            cand_at("b", "10.0.0.2:8000", metrics(0.0, 0.0, 0.5), false, &[]),
        ];
        assert!(a.admit(&r, &data, &idle, rng));
        assert!(a.admit(&r, &data, &[busy(0.5), busy(0.01)], rng));
    }

    #[test]
    fn the_tier_filter_keeps_the_pods_meeting_the_slos() {
        let f = SloHeadroomTierFilter::new(
            &TierParams {
                epsilon_explore_neg: 0.01,
                latency_prediction_info_producer_name: None,
            },
            "p",
        )
        .unwrap();
        let data = RequestData {
            latency: vec![
                info(10.0, 0.0, 1),
                info(-5.0, 0.0, 1),
                info(3.0, -1.0, 0),
                info(1.0, 2.0, 4),
            ],
            ..Default::default()
        };
        let all = [0, 1, 2, 3];
        assert_eq!(f.tier(&data, &all, 0.5), Some(vec![0, 3]));
        // The exploration draw below epsilon: the missing tier instead.
        assert_eq!(f.tier(&data, &all, 0.001), Some(vec![1, 2]));
        // Only missing pods: they stay; one pod or no predictions: untouched.
        assert_eq!(f.tier(&data, &[1, 2], 0.5), Some(vec![1, 2]));
        assert_eq!(f.tier(&data, &[1], 0.5), None);
        assert_eq!(f.tier(&RequestData::default(), &all, 0.5), None);
        let e = SloHeadroomTierFilter::new(
            &TierParams {
                epsilon_explore_neg: 1.5,
                latency_prediction_info_producer_name: None,
            },
            "p",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("epsilonExploreNeg"), "{e}");
    }

    #[test]
    fn slo_headers_are_read_current_name_first() {
        let h = HashMap::from([
            ("x-slo-ttft-ms".to_string(), "300".to_string()),
            ("x-llm-d-slo-tpot-ms".to_string(), " 40 ".to_string()),
            ("x-slo-tpot-ms".to_string(), "90".to_string()),
        ]);
        assert_eq!(slo(&h, &TTFT_SLO_HEADERS), 300.0);
        assert_eq!(slo(&h, &TPOT_SLO_HEADERS), 40.0);
        let bad = HashMap::from([("x-llm-d-slo-ttft-ms".to_string(), "-5".to_string())]);
        assert_eq!(slo(&bad, &TTFT_SLO_HEADERS), 0.0);
    }
}

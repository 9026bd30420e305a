//! Load scorers: `running-requests-size-scorer`, `token-load-scorer`, `active-request-scorer`,
//! `load-aware-scorer`.

use serde::Deserialize;

use super::queue_scorer::min_max_score;
use super::{RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const RUNNING_TYPE: &str = "running-requests-size-scorer";
pub const TOKEN_LOAD_TYPE: &str = "token-load-scorer";
pub const ACTIVE_REQUEST_TYPE: &str = "active-request-scorer";
pub const LOAD_AWARE_TYPE: &str = "load-aware-scorer";

/// Same min-max form as the queue scorer, on the running-requests gauge.
#[derive(Debug, Default)]
pub struct RunningRequestsScorer;

impl Scorer for RunningRequestsScorer {
    fn type_name(&self) -> &'static str {
        RUNNING_TYPE
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
            c.metrics().and_then(|m| m.running_requests)
        });
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TokenLoadParams {
    #[serde(default = "d_queue_tokens")]
    pub queue_threshold_tokens: f64,
    #[serde(default)]
    pub in_flight_load_producer_name: Option<String>,
}

fn d_queue_tokens() -> f64 {
    4_194_304.0
}

/// score = 1 − min(1, (in-flight tokens + this request's uncached tokens) / threshold).
#[derive(Debug)]
pub struct TokenLoadScorer {
    pub params: TokenLoadParams,
}

impl Scorer for TokenLoadScorer {
    fn type_name(&self) -> &'static str {
        TOKEN_LOAD_TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let threshold = self.params.queue_threshold_tokens.max(1.0);
        for (slot, &i) in out.iter_mut().zip(idx) {
            let inflight = data.inflight.get(i).map_or(0, |l| l.tokens) as f64;
            let load = inflight + data.uncached_tokens(i) as f64;
            *slot = 1.0 - (load / threshold).min(1.0);
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ActiveRequestParams {
    #[serde(default)]
    pub idle_threshold: u64,
    #[serde(default = "d_busy")]
    pub max_busy_score: f64,
    #[serde(default)]
    pub in_flight_load_producer_name: Option<String>,
}

fn d_busy() -> f64 {
    1.0
}

/// Endpoints with at most `idleThreshold` in-flight requests score 1.0; busier ones are scaled into
/// [0, `maxBusyScore`] by how far they are below the busiest candidate:
/// `maxBusyScore · (max − n) / (max − idleThreshold)` (the busiest scores 0).
#[derive(Debug)]
pub struct ActiveRequestScorer {
    pub params: ActiveRequestParams,
}

impl Scorer for ActiveRequestScorer {
    fn type_name(&self) -> &'static str {
        ACTIVE_REQUEST_TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let n = |i: usize| data.inflight.get(i).map_or(0, |l| l.requests);
        let idle = self.params.idle_threshold;
        let max = idx.iter().map(|&i| n(i)).max().unwrap_or(0);
        for (slot, &i) in out.iter_mut().zip(idx) {
            let r = n(i);
            *slot = if r <= idle {
                1.0
            } else if max <= idle {
                self.params.max_busy_score
            } else {
                self.params.max_busy_score * (max - r) as f64 / (max - idle) as f64
            };
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LoadAwareParams {
    /// Waiting requests at which a pod scores 0 (llm-d: 128; not positive → 128).
    #[serde(default = "d_load_threshold")]
    pub threshold: i64,
}

fn d_load_threshold() -> i64 {
    128
}

/// llm-d's `load-aware-scorer`: 0.5 for an empty waiting queue, else 0.5 × (1 − q / threshold)
/// (q capped at the threshold). A pod without fresh metrics scores 0, as in the queue scorer.
#[derive(Debug)]
pub struct LoadAwareScorer {
    threshold: f64,
}

impl LoadAwareScorer {
    pub fn new(p: &LoadAwareParams) -> Self {
        let threshold = if p.threshold > 0 {
            p.threshold
        } else {
            tracing::warn!(
                threshold = p.threshold,
                "load-aware-scorer: threshold must be positive, using 128"
            );
            d_load_threshold()
        };
        LoadAwareScorer {
            threshold: threshold as f64,
        }
    }
}

impl Scorer for LoadAwareScorer {
    fn type_name(&self) -> &'static str {
        LOAD_AWARE_TYPE
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
            *slot = match candidates[i].metrics().and_then(|m| m.waiting_queue_size) {
                None => 0.0,
                Some(q) if q <= 0.0 => 0.5,
                Some(q) => 0.5 * (1.0 - q.min(self.threshold) / self.threshold),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::*;
    use crate::scheduling::{InflightLoad, PrefixMatchInfo};

    #[test]
    fn running_min_max() {
        let cs = [
            cand("a", metrics(0.0, 2.0, 0.0), false),
            cand("b", metrics(0.0, 6.0, 0.0), false),
            cand("c", None, false),
        ];
        assert_eq!(
            score_all(&RunningRequestsScorer, &RequestData::default(), &cs),
            vec![1.0, 0.0, 0.0]
        );
    }

    #[test]
    fn load_aware_halves_and_caps_at_the_threshold() {
        let cs = [
            cand("a", metrics(0.0, 9.0, 0.0), false),
            cand("b", metrics(32.0, 0.0, 0.0), false),
            cand("c", metrics(200.0, 0.0, 0.0), false),
            cand("d", None, false),
            cand("e", metrics(0.0, 0.0, 0.0), true),
        ];
        let s = LoadAwareScorer::new(&LoadAwareParams { threshold: 128 });
        // 0.5; 0.5 × (1 − 32/128); capped: 0; no metrics; stale.
        assert_eq!(
            score_all(&s, &RequestData::default(), &cs),
            vec![0.5, 0.375, 0.0, 0.0, 0.0]
        );
        let s = LoadAwareScorer::new(&LoadAwareParams { threshold: -3 });
        assert_eq!(score_all(&s, &RequestData::default(), &cs)[1], 0.375);
    }

    #[test]
    fn token_load() {
        let cs = [cand("a", None, false), cand("b", None, false)];
        let s = TokenLoadScorer {
            params: TokenLoadParams {
                queue_threshold_tokens: 1000.0,
                in_flight_load_producer_name: None,
            },
        };
        let data = RequestData {
            prompt_tokens: 256,
            prefix: Some(PrefixMatchInfo {
                block_size: 64,
                total_blocks: 4,
                matched: vec![0, 4],
                hashes: vec![],
                weighted: Vec::new(),
            }),
            inflight: vec![
                InflightLoad {
                    requests: 1,
                    tokens: 244,
                    prefilling: 0,
                },
                InflightLoad {
                    requests: 9,
                    tokens: 2000,
                    prefilling: 0,
                },
            ],
            ..Default::default()
        };
        // a: (244 + 256)/1000 → 0.5; b: (2000 + 0)/1000 → capped at 1 → 0
        assert_eq!(score_all(&s, &data, &cs), vec![0.5, 0.0]);
    }

    #[test]
    fn active_requests() {
        let cs = [
            cand("a", None, false),
            cand("b", None, false),
            cand("c", None, false),
        ];
        let s = ActiveRequestScorer {
            params: ActiveRequestParams {
                idle_threshold: 1,
                max_busy_score: 0.5,
                in_flight_load_producer_name: None,
            },
        };
        let load = |r| InflightLoad {
            requests: r,
            tokens: 0,
            prefilling: 0,
        };
        let data = RequestData {
            inflight: vec![load(1), load(3), load(5)],
            ..RequestData::default()
        };
        // a idle → 1; b: 0.5·(5−3)/(5−1) = 0.25; c busiest → 0
        assert_eq!(score_all(&s, &data, &cs), vec![1.0, 0.25, 0.0]);
        // without in-flight data everyone is idle
        assert_eq!(score_all(&s, &RequestData::default(), &cs), vec![1.0; 3]);
    }
}

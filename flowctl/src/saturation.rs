//! Saturation detectors as pure functions over endpoint snapshots, plus their plugin parameters.
//!
//! * `utilization-detector` (llm-d's default): per endpoint `max(waiting / queueDepthThreshold,
//!   kvUsage / kvCacheUtilThreshold)`; pool saturation is the mean over endpoints. Metrics older than
//!   `metricsStalenessThreshold` (or missing) count as 1.0 — fail closed — and an empty pool is 1.0.
//! * `concurrency-detector`: in-flight work over capacity (`maxConcurrency` requests and/or
//!   `maxTokenConcurrency` tokens per endpoint). The state machine feeds it its own in-flight ledger.
//!
//! Both also work as scheduling filters ([`UtilizationDetector::filter`], [`ConcurrencyDetector::filter`]):
//! endpoints over their threshold × (1 + `headroom`) are dropped; if that drops everything, all are kept.

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, decode_params};
use crate::units::{GoDuration, Nanos};

pub const UTILIZATION_DETECTOR: &str = "utilization-detector";
pub const CONCURRENCY_DETECTOR: &str = "concurrency-detector";

/// One endpoint's last metrics sample, as the node's datastore holds it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EndpointSnapshot {
    /// Engine waiting-queue length (`vllm:num_requests_waiting`, ...).
    pub waiting_queue: u64,
    /// KV-cache usage in [0, 1].
    pub kv_cache_usage: f64,
    /// When the sample was taken; `None` = no sample yet (counts as saturated).
    pub sampled_at: Option<Nanos>,
    /// The requests the engine runs at once, as the pod has shown it (the most it ran while others
    /// waited); `None` until known. The concurrency detector never counts more than this per pod.
    #[serde(default)]
    pub batch_capacity: Option<u64>,
}

/// In-flight work on one endpoint, for the concurrency detector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EndpointLoad {
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
}

/// The configured detector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum SaturationDetector {
    Utilization(UtilizationDetector),
    Concurrency(ConcurrencyDetector),
}

impl Default for SaturationDetector {
    fn default() -> Self {
        SaturationDetector::Utilization(UtilizationDetector::default())
    }
}

impl SaturationDetector {
    /// The llm-d plugin type name.
    pub fn type_name(&self) -> &'static str {
        match self {
            SaturationDetector::Utilization(_) => UTILIZATION_DETECTOR,
            SaturationDetector::Concurrency(_) => CONCURRENCY_DETECTOR,
        }
    }

    pub fn from_plugin(
        type_name: &str,
        parameters: Option<&serde_json::Value>,
        path: &str,
    ) -> Result<SaturationDetector, ConfigError> {
        match type_name {
            UTILIZATION_DETECTOR => {
                let p: UtilizationDetector = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(SaturationDetector::Utilization(p))
            }
            CONCURRENCY_DETECTOR => {
                let p: ConcurrencyDetector = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(SaturationDetector::Concurrency(p))
            }
            other => Err(ConfigError::WrongPluginKind {
                path: path.to_string(),
                type_name: other.to_string(),
                expected: "saturation detector",
            }),
        }
    }
}

/// `utilization-detector` parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct UtilizationDetector {
    pub queue_depth_threshold: f64,
    pub kv_cache_util_threshold: f64,
    pub metrics_staleness_threshold: GoDuration,
    pub headroom: f64,
}

impl Default for UtilizationDetector {
    fn default() -> Self {
        UtilizationDetector {
            queue_depth_threshold: 5.0,
            kv_cache_util_threshold: 0.8,
            metrics_staleness_threshold: GoDuration::from_millis(200),
            headroom: 0.0,
        }
    }
}

impl UtilizationDetector {
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if !(self.queue_depth_threshold.is_finite() && self.queue_depth_threshold > 0.0) {
            return Err(ConfigError::invalid(
                format!("{path}.queueDepthThreshold"),
                "must be > 0",
            ));
        }
        if !(self.kv_cache_util_threshold > 0.0 && self.kv_cache_util_threshold <= 1.0) {
            return Err(ConfigError::invalid(
                format!("{path}.kvCacheUtilThreshold"),
                "must be in (0, 1]",
            ));
        }
        if !(self.headroom.is_finite() && self.headroom >= 0.0) {
            return Err(ConfigError::invalid(
                format!("{path}.headroom"),
                "must be >= 0",
            ));
        }
        Ok(())
    }

    fn is_fresh(&self, ep: &EndpointSnapshot, now: Nanos) -> bool {
        match ep.sampled_at {
            Some(t) => now.saturating_sub(t) <= self.metrics_staleness_threshold.nanos(),
            None => false,
        }
    }

    /// One endpoint's score; 1.0 when its metrics are stale or missing.
    pub fn endpoint_score(&self, ep: &EndpointSnapshot, now: Nanos) -> f64 {
        if !self.is_fresh(ep, now) {
            return 1.0;
        }
        let queue = ep.waiting_queue as f64 / self.queue_depth_threshold;
        let kv = ep.kv_cache_usage / self.kv_cache_util_threshold;
        queue.max(kv)
    }

    /// Pool saturation: mean endpoint score; 1.0 for an empty pool.
    pub fn saturation(&self, endpoints: &[EndpointSnapshot], now: Nanos) -> f64 {
        if endpoints.is_empty() {
            return 1.0;
        }
        let sum: f64 = endpoints.iter().map(|e| self.endpoint_score(e, now)).sum();
        sum / endpoints.len() as f64
    }

    /// Filter role: indexes of endpoints with fresh metrics, `waiting <= queueDepthThreshold ×
    /// (1 + headroom)` and `kv <= min(1, kvCacheUtilThreshold × (1 + headroom))`; all of them when
    /// that would leave none.
    pub fn filter(&self, endpoints: &[EndpointSnapshot], now: Nanos) -> Vec<usize> {
        let q_limit = self.queue_depth_threshold * (1.0 + self.headroom);
        let kv_limit = (self.kv_cache_util_threshold * (1.0 + self.headroom)).min(1.0);
        let kept: Vec<usize> = endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                self.is_fresh(e, now)
                    && e.waiting_queue as f64 <= q_limit
                    && e.kv_cache_usage <= kv_limit
            })
            .map(|(i, _)| i)
            .collect();
        if kept.is_empty() {
            (0..endpoints.len()).collect()
        } else {
            kept
        }
    }
}

/// `concurrencyMode` of the concurrency detector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ConcurrencyMode {
    #[default]
    Requests,
    Tokens,
    Hybrid,
}

/// `concurrency-detector` parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ConcurrencyDetector {
    pub concurrency_mode: ConcurrencyMode,
    pub max_concurrency: u64,
    pub max_token_concurrency: u64,
    pub headroom: f64,
}

impl Default for ConcurrencyDetector {
    fn default() -> Self {
        ConcurrencyDetector {
            concurrency_mode: ConcurrencyMode::Requests,
            max_concurrency: 100,
            max_token_concurrency: 1_000_000,
            headroom: 0.0,
        }
    }
}

impl ConcurrencyDetector {
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if self.max_concurrency == 0 {
            return Err(ConfigError::invalid(
                format!("{path}.maxConcurrency"),
                "must be > 0",
            ));
        }
        if self.max_token_concurrency == 0 {
            return Err(ConfigError::invalid(
                format!("{path}.maxTokenConcurrency"),
                "must be > 0",
            ));
        }
        if !(self.headroom.is_finite() && self.headroom >= 0.0) {
            return Err(ConfigError::invalid(
                format!("{path}.headroom"),
                "must be >= 0",
            ));
        }
        Ok(())
    }

    fn req_ratio(&self, requests: u64, endpoints: u64) -> f64 {
        requests as f64 / (self.max_concurrency as f64 * endpoints as f64)
    }

    fn tok_ratio(&self, tokens: u64, endpoints: u64) -> f64 {
        tokens as f64 / (self.max_token_concurrency as f64 * endpoints as f64)
    }

    /// Pool saturation from per-endpoint loads: total in-flight / total capacity (hybrid: mean of
    /// per-endpoint `max(request ratio, token ratio)`); 1.0 for an empty pool.
    pub fn saturation(&self, loads: &[EndpointLoad]) -> f64 {
        if loads.is_empty() {
            return 1.0;
        }
        let n = loads.len() as u64;
        match self.concurrency_mode {
            ConcurrencyMode::Requests => {
                self.req_ratio(loads.iter().map(|l| l.inflight_requests).sum(), n)
            }
            ConcurrencyMode::Tokens => {
                self.tok_ratio(loads.iter().map(|l| l.inflight_tokens).sum(), n)
            }
            ConcurrencyMode::Hybrid => {
                let sum: f64 = loads
                    .iter()
                    .map(|l| {
                        self.req_ratio(l.inflight_requests, 1)
                            .max(self.tok_ratio(l.inflight_tokens, 1))
                    })
                    .sum();
                sum / loads.len() as f64
            }
        }
    }

    /// Pool saturation from pool-wide totals, as the state machine knows them (it admits before an
    /// endpoint is picked, so it has no per-endpoint split). Hybrid assumes an even spread, which
    /// makes it `max(request ratio, token ratio)` of the totals. 1.0 for an empty pool.
    pub fn saturation_from_totals(
        &self,
        endpoints: u64,
        inflight_requests: u64,
        inflight_tokens: u64,
    ) -> f64 {
        self.saturation_with_capacity(
            endpoints,
            self.max_concurrency.saturating_mul(endpoints),
            inflight_requests,
            inflight_tokens,
        )
    }

    /// The pool's request capacity: per endpoint `maxConcurrency`, or the pod's own batch limit
    /// when it has shown a smaller one (a larger `maxConcurrency` would let requests queue inside
    /// the pods, where priorities no longer apply).
    pub fn request_capacity(&self, endpoints: &[EndpointSnapshot]) -> u64 {
        endpoints
            .iter()
            .map(|e| {
                e.batch_capacity
                    .filter(|c| *c > 0)
                    .map_or(self.max_concurrency, |c| c.min(self.max_concurrency))
            })
            .sum()
    }

    /// [`Self::saturation_from_totals`] against an explicit request capacity (see
    /// [`Self::request_capacity`]).
    pub fn saturation_with_capacity(
        &self,
        endpoints: u64,
        request_capacity: u64,
        inflight_requests: u64,
        inflight_tokens: u64,
    ) -> f64 {
        if endpoints == 0 || request_capacity == 0 {
            return 1.0;
        }
        let req = inflight_requests as f64 / request_capacity as f64;
        match self.concurrency_mode {
            ConcurrencyMode::Requests => req,
            ConcurrencyMode::Tokens => self.tok_ratio(inflight_tokens, endpoints),
            ConcurrencyMode::Hybrid => req.max(self.tok_ratio(inflight_tokens, endpoints)),
        }
    }

    /// Filter role: endpoints below capacity × (1 + headroom) in the configured mode; all when none is.
    pub fn filter(&self, loads: &[EndpointLoad]) -> Vec<usize> {
        let factor = 1.0 + self.headroom;
        let kept: Vec<usize> = loads
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                let r = (l.inflight_requests as f64) < self.max_concurrency as f64 * factor;
                let t = (l.inflight_tokens as f64) < self.max_token_concurrency as f64 * factor;
                match self.concurrency_mode {
                    ConcurrencyMode::Requests => r,
                    ConcurrencyMode::Tokens => t,
                    ConcurrencyMode::Hybrid => r && t,
                }
            })
            .map(|(i, _)| i)
            .collect();
        if kept.is_empty() {
            (0..loads.len()).collect()
        } else {
            kept
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::NANOS_PER_MILLI;

    fn ep(waiting: u64, kv: f64, at: Option<Nanos>) -> EndpointSnapshot {
        EndpointSnapshot {
            batch_capacity: None,
            waiting_queue: waiting,
            kv_cache_usage: kv,
            sampled_at: at,
        }
    }

    #[test]
    fn utilization_scores_by_hand() {
        let d = UtilizationDetector::default();
        let now = 1_000 * NANOS_PER_MILLI;
        // queue 2/5 = 0.4, kv 0.4/0.8 = 0.5 → 0.5
        assert!((d.endpoint_score(&ep(2, 0.4, Some(now)), now) - 0.5).abs() < 1e-12);
        // queue 10/5 = 2.0 dominates
        assert!((d.endpoint_score(&ep(10, 0.1, Some(now)), now) - 2.0).abs() < 1e-12);
        // 200 ms old is still fresh, 201 ms is stale → 1.0, missing → 1.0
        let fresh = ep(0, 0.0, Some(now - 200 * NANOS_PER_MILLI));
        assert_eq!(d.endpoint_score(&fresh, now), 0.0);
        let stale = ep(0, 0.0, Some(now - 201 * NANOS_PER_MILLI));
        assert_eq!(d.endpoint_score(&stale, now), 1.0);
        assert_eq!(d.endpoint_score(&ep(0, 0.0, None), now), 1.0);
        // mean of 0.5 and 1.0 (stale)
        let pool = [ep(2, 0.4, Some(now)), stale];
        assert!((d.saturation(&pool, now) - 0.75).abs() < 1e-12);
        assert_eq!(d.saturation(&[], now), 1.0);
    }

    #[test]
    fn utilization_filter_with_headroom() {
        let now = 0;
        let mut d = UtilizationDetector::default();
        let pool = [
            ep(5, 0.8, Some(0)),
            ep(6, 0.1, Some(0)),
            ep(0, 0.85, Some(0)),
        ];
        assert_eq!(d.filter(&pool, now), vec![0]);
        d.headroom = 0.2; // queue ≤ 6, kv ≤ 0.96
        assert_eq!(d.filter(&pool, now), vec![0, 1, 2]);
        let all_bad = [ep(50, 0.0, Some(0)), ep(0, 0.0, None)];
        assert_eq!(
            UtilizationDetector::default().filter(&all_bad, now),
            vec![0, 1]
        );
    }

    #[test]
    fn concurrency_modes() {
        let d = ConcurrencyDetector {
            max_concurrency: 10,
            max_token_concurrency: 1000,
            ..Default::default()
        };
        let loads = [
            EndpointLoad {
                inflight_requests: 5,
                inflight_tokens: 900,
            },
            EndpointLoad {
                inflight_requests: 10,
                inflight_tokens: 100,
            },
        ];
        assert!((d.saturation(&loads) - 0.75).abs() < 1e-12);
        let tok = ConcurrencyDetector {
            concurrency_mode: ConcurrencyMode::Tokens,
            ..d
        };
        assert!((tok.saturation(&loads) - 0.5).abs() < 1e-12);
        let hybrid = ConcurrencyDetector {
            concurrency_mode: ConcurrencyMode::Hybrid,
            ..d
        };
        // mean(max(0.5, 0.9), max(1.0, 0.1)) = 0.95
        assert!((hybrid.saturation(&loads) - 0.95).abs() < 1e-12);
        assert_eq!(d.saturation(&[]), 1.0);
        assert_eq!(d.saturation_from_totals(0, 0, 0), 1.0);
        assert!((d.saturation_from_totals(2, 15, 0) - 0.75).abs() < 1e-12);
        // Pods that have shown a batch limit below maxConcurrency count with theirs.
        let pods = [
            EndpointSnapshot {
                batch_capacity: Some(4),
                ..EndpointSnapshot::default()
            },
            EndpointSnapshot::default(),
            EndpointSnapshot {
                batch_capacity: Some(1_000),
                ..EndpointSnapshot::default()
            },
        ];
        let cap = d.request_capacity(&pods);
        assert_eq!(cap, 4 + d.max_concurrency * 2);
        assert_eq!(d.saturation_with_capacity(3, cap, cap, 0), 1.0);
        assert_eq!(d.filter(&loads), vec![0]);
        assert_eq!(hybrid.filter(&loads), vec![0]);
    }

    #[test]
    fn detector_params_decode() {
        let v = serde_json::json!({"concurrencyMode": "hybrid", "maxConcurrency": 8});
        let d = SaturationDetector::from_plugin(CONCURRENCY_DETECTOR, Some(&v), "p").unwrap();
        let SaturationDetector::Concurrency(c) = d else {
            panic!("wrong kind")
        };
        assert_eq!(c.concurrency_mode, ConcurrencyMode::Hybrid);
        assert_eq!(c.max_concurrency, 8);
        assert_eq!(c.max_token_concurrency, 1_000_000);
        let v = serde_json::json!({"metricsStalenessThreshold": "1s", "bogus": 1});
        let err = SaturationDetector::from_plugin(
            UTILIZATION_DETECTOR,
            Some(&v),
            "plugins[2].parameters",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("plugins[2].parameters.bogus"), "{err}");
    }
}

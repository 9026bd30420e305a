//! The cost model's parameters (`cost-model-producer`'s `parameters` block).

use serde::Deserialize;

/// `cost-model-producer` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CostModelParams {
    /// Prior prefill throughput of a pod, tokens/s (llm-d's `peakPrefillThroughput` default).
    #[serde(default = "d_tps")]
    pub prefill_tokens_per_second: f64,
    /// Prior mean time a request occupies a batch slot, ms.
    #[serde(default = "d_service")]
    pub service_time_ms: f64,
    /// Added to the prediction of a pod without fresh metrics, ms.
    #[serde(default = "d_stale")]
    pub stale_metrics_penalty_ms: f64,
    /// Learn from observed responses (off: the priors only).
    #[serde(default = "d_true")]
    pub learn: bool,
    /// Samples after which an observation's weight has decayed to 1/e.
    #[serde(default = "d_memory")]
    pub memory_samples: f64,
    /// Share of this request's prefill time each request running on the pod waits as well: an
    /// engine that batches continuously (vLLM, SGLang) runs a prefill's chunks in the steps that
    /// also produce the running requests' next tokens, so every one of them is slowed by it.
    /// 0 for an engine whose prefills do not stall its decodes.
    #[serde(default = "d_interference")]
    pub prefill_interference: f64,
    /// Share of the cached tokens a request evicts from a full pod cache that will be asked for
    /// again (what their re-prefill later costs counts against the pod); 0 = TTFT only.
    #[serde(default = "d_evict")]
    pub eviction_cost: f64,
    /// Share of a slot's time each request already on a pod with a known batch limit costs a new
    /// one (the later turns of the sessions placed there wait longer on a busier pod); breaks
    /// near-ties toward the less loaded pod.
    #[serde(default = "d_load")]
    pub load_cost: f64,
}

fn d_tps() -> f64 {
    15_928.0
}
fn d_service() -> f64 {
    1_000.0
}
fn d_stale() -> f64 {
    1_000.0
}
fn d_true() -> bool {
    true
}
fn d_memory() -> f64 {
    64.0
}
fn d_interference() -> f64 {
    1.0
}
fn d_evict() -> f64 {
    0.5
}
fn d_load() -> f64 {
    0.25
}

impl Default for CostModelParams {
    fn default() -> Self {
        CostModelParams {
            prefill_tokens_per_second: d_tps(),
            service_time_ms: d_service(),
            stale_metrics_penalty_ms: d_stale(),
            learn: true,
            memory_samples: d_memory(),
            prefill_interference: d_interference(),
            eviction_cost: d_evict(),
            load_cost: d_load(),
        }
    }
}

impl CostModelParams {
    pub fn validate(&self, path: &str) -> Result<(), crate::config::ConfigError> {
        let positive = |v: f64, k: &str| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(crate::config::ConfigError::Field {
                    path: format!("{path}.{k}"),
                    message: format!("must be a positive number, got {v}"),
                })
            }
        };
        positive(self.prefill_tokens_per_second, "prefillTokensPerSecond")?;
        positive(self.service_time_ms, "serviceTimeMs")?;
        positive(self.memory_samples, "memorySamples")?;
        for (v, k) in [
            (self.stale_metrics_penalty_ms, "staleMetricsPenaltyMs"),
            (self.prefill_interference, "prefillInterference"),
            (self.eviction_cost, "evictionCost"),
            (self.load_cost, "loadCost"),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(crate::config::ConfigError::Field {
                    path: format!("{path}.{k}"),
                    message: format!("must be a non-negative number, got {v}"),
                });
            }
        }
        Ok(())
    }
}

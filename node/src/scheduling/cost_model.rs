//! `cost-model-producer` and `cost-model-scorer`: route each request where it is predicted to get
//! its first token soonest. Our own plugin types (not llm-d's); the project's default profile.
//!
//! # The prediction
//! For candidate pod *i* and this request:
//!
//! ```text
//! TTFT_i = a_i + s_i · U_i                 prefill of this request's uncached tokens (prefix match;
//!                                          blocks an earlier request is still prefilling there
//!                                          count as uncached: a burst sharing a prompt spreads)
//!        + q_i · Q_i                       the prefill work Q_i routed there and not yet done (an
//!                                          engine that batches prefills shares its compute)
//!        + d_i · R_i                       decode contention: the R_i requests running beside it
//!        + W_i                             waiting for a slot when the batch is full:
//!                                          W_i = (N_i − C_i + 1) · S_i / C_i   if N_i ≥ C_i
//! ```
//! `N_i` is the requests on the pod — the in-flight ledger's count (cluster-wide with cluster-wide
//! flow control), or the pod's own running + waiting gauges when it queues requests the ledger
//! does not explain (or there is no ledger) — `Q_i` the ledger's unprefilled tokens, `C_i` the
//! pod's batch limit as the pod has shown it (the data layer learns it from the requests running
//! while others wait; unknown until then, when waiting requests themselves say the batch is
//! full), `S_i` the pod's mean service time. A pod without fresh metrics is penalised by
//! `staleMetricsPenaltyMs`.
//!
//! # Learning
//! Every response observed here (whichever replica routed it) is a sample: the route header
//! carries what was predicted; the response gives its TTFT, its duration and, from its usage,
//! the tokens that were really uncached. Samples routed to a pod with a free slot fit the
//! fleet's `(a, s, q, d)` by exponentially-forgetting least squares (memory `memorySamples`) —
//! so an engine whose concurrent prefills do not slow each other learns `q ≈ 0` — pulled toward
//! the prior (`prefillTokensPerSecond`, `serviceTimeMs`), so the model is sane before any data.
//! Each pod learns one speed factor against the fleet's prediction (least squares through the
//! origin, pulled toward 1), not a fit of its own: a slower GPU shows as its factor, while the
//! noise of identical pods' samples cannot make one of them look faster and draw every new
//! session. Durations less the predicted slot wait give `S`. A pod without samples relaxes back
//! to the fleet (it may get none because it looked slow); a sample far above its prediction
//! counts at a bound. Every learned value is clamped to a plausible range, so no sample can make
//! a pod look infinitely fast or slow.
//!
//! # Scoring
//! The cost of a candidate is its TTFT plus what the request costs the others: its prefill time
//! once more for every request running on the pod (`prefillInterference`: a continuously
//! batching engine runs prefill chunks in the steps that produce the running requests' tokens),
//! the re-prefill of running requests' KV it would push out of a full pod (`evictionCost`), and
//! its share of a busier batch (`loadCost`). `cost-model-scorer` gives `(c_min + 1) / (c_i + 1)`
//! (ms): 1 for the cheapest candidate. The `prefix-cache-affinity-filter` can use the TTFT
//! prediction as its penalty source (`ttftSource: costModel`).

use foldhash::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{MAX_SAMPLE_MS, Observation, Prediction, Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

pub const PRODUCER_TYPE: &str = "cost-model-producer";
pub const SCORER_TYPE: &str = "cost-model-scorer";

/// Pods whose fits are kept (beyond it, new pods use the fleet's fit).
const MAX_PODS: usize = 4096;
/// Most prompt tokens a sample may report (a larger usage report is not a sample).
const MAX_TOKENS: u64 = 1 << 24;

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

/// The fitted coefficients: TTFT = a + s · uncached + q · queued tokens + d · running (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    pub base_ms: f64,
    pub ms_per_token: f64,
    pub ms_per_queued_token: f64,
    pub ms_per_running: f64,
}

impl Fit {
    fn theta(&self) -> [f64; N] {
        [
            self.base_ms,
            self.ms_per_token,
            self.ms_per_queued_token,
            self.ms_per_running,
        ]
    }
}

/// Features: `[1, uncached tokens, queued tokens, running]`.
const N: usize = 4;
/// Typical feature magnitudes: a coefficient's prior pull is measured at these.
const SCALE: [f64; N] = [1.0, 1_000.0, 1_000.0, 4.0];
/// How many samples' worth the configured prior weighs in the fleet's fit.
const FLEET_PRIOR_SAMPLES: f64 = 0.02;

/// Exponentially-forgetting least squares over the features.
#[derive(Debug, Clone, Default)]
struct Lsq {
    xtx: [[f64; N]; N],
    xty: [f64; N],
    weight: f64,
}

impl Lsq {
    fn add(&mut self, x: [f64; N], y: f64, keep: f64) {
        for r in 0..N {
            self.xty[r] = self.xty[r] * keep + x[r] * y;
            for c in 0..N {
                self.xtx[r][c] = self.xtx[r][c] * keep + x[r] * x[c];
            }
        }
        self.weight = self.weight * keep + 1.0;
    }

    /// The ridge solution pulled toward `prior` (worth `strength` samples), clamped to `bounds`.
    fn solve(&self, prior: Fit, strength: f64, bounds: &Bounds) -> Fit {
        let p = prior.theta();
        let mut a = self.xtx;
        let mut b = self.xty;
        for j in 0..N {
            let w = strength * SCALE[j] * SCALE[j];
            a[j][j] += w;
            b[j] += w * p[j];
        }
        let t = solve(a, b).unwrap_or(p);
        Fit {
            base_ms: t[0].clamp(0.0, bounds.max_base_ms),
            ms_per_token: t[1].clamp(bounds.min_ms_per_token, bounds.max_ms_per_token),
            ms_per_queued_token: t[2].clamp(0.0, bounds.max_ms_per_token),
            ms_per_running: t[3].clamp(0.0, bounds.max_ms_per_running),
        }
    }
}

/// Gaussian elimination with partial pivoting; `None` if (numerically) singular.
fn solve<const K: usize>(mut a: [[f64; K]; K], mut b: [f64; K]) -> Option<[f64; K]> {
    for col in 0..K {
        let piv = (col..K).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        let pivot_row = a[col];
        for row in col + 1..K {
            let f = a[row][col] / pivot_row[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; K];
    for row in (0..K).rev() {
        let s: f64 = (row + 1..K).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// Longest time per output token a prediction or a sample may carry, ms.
const MAX_TPOT_MS: f64 = 10_000.0;
/// Samples (exponentially weighted) before the TPOT fit predicts anything.
const TPOT_MIN_SAMPLES: f64 = 4.0;

/// Time per output token after the first, `t0 + t1 · running`, fitted over the fleet's streamed
/// responses (forgotten like the TTFT fit); no prediction before [`TPOT_MIN_SAMPLES`].
#[derive(Debug, Clone, Default)]
struct Tpot {
    xtx: [[f64; 2]; 2],
    xty: [f64; 2],
    weight: f64,
    fit: Option<[f64; 2]>,
}

impl Tpot {
    fn add(&mut self, running: f64, y: f64, keep: f64) {
        let x = [1.0, running];
        for r in 0..2 {
            self.xty[r] = self.xty[r] * keep + x[r] * y;
            for c in 0..2 {
                self.xtx[r][c] = self.xtx[r][c] * keep + x[r] * x[c];
            }
        }
        self.weight = self.weight * keep + 1.0;
        if self.weight >= TPOT_MIN_SAMPLES {
            // A light ridge on the slope: samples all at one batch size still fit a level.
            let mut a = self.xtx;
            a[1][1] += 1e-3 * self.weight;
            self.fit = solve(a, self.xty)
                .map(|t| [t[0].clamp(0.0, MAX_TPOT_MS), t[1].clamp(0.0, MAX_TPOT_MS)]);
        }
    }

    fn predict(&self, running: u64) -> Option<f64> {
        self.fit
            .map(|[t0, t1]| (t0 + t1 * running as f64).min(MAX_TPOT_MS))
    }
}

/// Plausible ranges of the fitted values.
#[derive(Debug, Clone)]
struct Bounds {
    max_base_ms: f64,
    min_ms_per_token: f64,
    max_ms_per_token: f64,
    max_ms_per_running: f64,
}

/// What the fleet has learned: the shape of a TTFT (its coefficients, fitted to the samples of
/// every pod) and the mean slot time.
#[derive(Debug, Clone)]
struct Fleet {
    lsq: Lsq,
    fit: Fit,
    /// Mean slot occupancy, ms (EWMA); `None` before the first sample.
    service_ms: Option<f64>,
    samples: u64,
    tpot: Tpot,
}

/// What is learned about one pod: how much slower (> 1) or faster than the fleet's fit its
/// TTFTs are — one factor, not a fit of its own — and its mean slot time.
#[derive(Debug, Clone)]
struct Pod {
    /// The log of observed / fleet-predicted TTFT: Σ r, Σ r², Σ w, Σ w², exponentially forgotten.
    r1: f64,
    r2: f64,
    w1: f64,
    w2: f64,
    /// The factor predictions use ([`State::shrink_speeds`]).
    speed: f64,
    service_ms: Option<f64>,
    samples: u64,
    /// When the last sample arrived.
    updated: Option<Instant>,
}

impl Pod {
    fn new() -> Self {
        Pod {
            r1: 0.0,
            r2: 0.0,
            w1: 0.0,
            w2: 0.0,
            speed: 1.0,
            service_ms: None,
            samples: 0,
            updated: None,
        }
    }

    fn learn_speed(&mut self, observed: f64, fleet: f64, keep: f64) {
        let r = (observed.max(0.01) / fleet)
            .ln()
            .clamp(-MAX_LN_SPEED, MAX_LN_SPEED);
        self.r1 = self.r1 * keep + r;
        self.r2 = self.r2 * keep + r * r;
        self.w1 = self.w1 * keep + 1.0;
        self.w2 = self.w2 * keep * keep + 1.0;
    }

    /// The effective number of samples behind the mean (forgetting weights count less).
    fn n_eff(&self) -> f64 {
        if self.w2 > 0.0 {
            self.w1 * self.w1 / self.w2
        } else {
            0.0
        }
    }
}

/// A pod is at most e^3 ≈ 20 times slower (or faster) than the fleet's fit.
const MAX_LN_SPEED: f64 = 3.0;
/// The speed factors are re-estimated every `pods / SHRINK_PODS` observations (at least every
/// one): amortised, an observation walks at most this many pods.
const SHRINK_PODS: usize = 64;

impl State {
    /// Each pod's speed factor, shrunk toward the fleet by how much of its difference from the
    /// others its samples' noise can explain (empirical Bayes): with `m_i` the mean log ratio of
    /// its observed TTFTs to the fleet's predictions, `M` the pods' mean of those, `σ²` the
    /// samples' pooled variance around their pod's mean and `B` the variance of the `m_i` beyond
    /// what `σ²/n_i` explains, `k_i = exp(ρ_i · (m_i − M))` with `ρ_i = B / (B + σ²/n_i)`.
    /// Identical pods differ only by noise and misfit of the fleet's model (B ≈ 0): they keep
    /// `k = 1`; a slower GPU stands out of the noise and keeps its factor.
    fn shrink_speeds(&mut self) {
        let with = |p: &&Pod| p.n_eff() >= 1.0;
        let pods: Vec<&Pod> = self.pods.values().filter(with).collect();
        let n = pods.len() as f64;
        let (mut big_b, mut mean, mut pooled) = (0.0, 0.0, 0.0);
        if pods.len() >= 2 {
            let means: Vec<f64> = pods.iter().map(|p| p.r1 / p.w1).collect();
            mean = means.iter().sum::<f64>() / n;
            let (mut ss, mut ws) = (0.0, 0.0);
            for (p, m) in pods.iter().zip(&means) {
                ss += (p.r2 - p.r1 * m).max(0.0);
                ws += p.w1;
            }
            pooled = ss / ws.max(1.0);
            let spread = means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (n - 1.0);
            let noise = pods.iter().map(|p| pooled / p.n_eff()).sum::<f64>() / n;
            big_b = (spread - noise).max(0.0);
        }
        for p in self.pods.values_mut() {
            p.speed = if big_b > 0.0 && p.n_eff() >= 1.0 {
                let rho = big_b / (big_b + pooled / p.n_eff());
                (rho * (p.r1 / p.w1 - mean)).exp()
            } else {
                1.0
            };
        }
    }
}

/// A pod's own factor counts fully when fresh and relaxes toward the fleet's (1) with this time
/// constant when the pod gets no samples (it may get none *because* it looked slow: relaxing lets
/// it be tried again).
const RELAX: Duration = Duration::from_secs(10);

/// A sample far above its prediction (3× + 20 ms) is mostly queueing the model did not see: it
/// counts at that bound, so one stall cannot make a pod look slow for long.
fn clip(observed: f64, predicted: f64) -> f64 {
    observed.min(3.0 * predicted + 20.0)
}

#[derive(Debug)]
struct State {
    fleet: Fleet,
    pods: HashMap<String, Pod>,
}

/// The producer: predicts every candidate's TTFT and learns from observed responses.
#[derive(Debug)]
pub struct CostModel {
    params: CostModelParams,
    prior: Fit,
    bounds: Bounds,
    state: RwLock<State>,
}

/// `/debug/cost-model`: the fleet's fit and each pod's speed factor.
#[derive(Debug, Serialize)]
pub struct CostModelView {
    pub fleet: LearnedView,
    pub pods: Vec<(String, LearnedView)>,
    /// Time per output token, ms: `[t0, t1]` of `t0 + t1 · running` (none before samples).
    pub tpot: Option<[f64; 2]>,
}

#[derive(Debug, Serialize)]
pub struct LearnedView {
    /// The coefficients predictions use (a pod's: the fleet's times its speed factor).
    pub fit: Fit,
    /// Relative to the fleet's fit (the fleet: 1).
    pub speed: f64,
    /// `1000 / ms_per_token`.
    pub prefill_tokens_per_second: f64,
    pub service_ms: Option<f64>,
    pub samples: u64,
}

impl LearnedView {
    fn of(fit: Fit, speed: f64, service_ms: Option<f64>, samples: u64) -> Self {
        let fit = fit.scaled(speed);
        LearnedView {
            fit,
            speed,
            prefill_tokens_per_second: 1000.0 / fit.ms_per_token,
            service_ms,
            samples,
        }
    }
}

impl Fit {
    fn scaled(self, k: f64) -> Fit {
        Fit {
            base_ms: self.base_ms * k,
            ms_per_token: self.ms_per_token * k,
            ms_per_queued_token: self.ms_per_queued_token * k,
            ms_per_running: self.ms_per_running * k,
        }
    }

    fn predict(&self, x: [f64; N]) -> f64 {
        self.theta().iter().zip(x).map(|(t, x)| t * x).sum()
    }
}

impl CostModel {
    pub fn new(params: CostModelParams) -> Self {
        let ms_per_token = 1000.0 / params.prefill_tokens_per_second;
        let prior = Fit {
            base_ms: 0.0,
            ms_per_token,
            ms_per_queued_token: ms_per_token,
            ms_per_running: 0.0,
        };
        CostModel {
            bounds: Bounds {
                max_base_ms: 10_000.0,
                min_ms_per_token: ms_per_token / 100.0,
                max_ms_per_token: ms_per_token * 100.0,
                max_ms_per_running: 10_000.0,
            },
            prior,
            state: RwLock::new(State {
                fleet: Fleet {
                    lsq: Lsq::default(),
                    fit: prior,
                    service_ms: None,
                    samples: 0,
                    tpot: Tpot::default(),
                },
                pods: HashMap::default(),
            }),
            params,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The prediction for one candidate: `uncached` of this request's tokens are not cached there,
    /// `inflight` is the ledger's `(requests, unprefilled tokens)` on it, when there is a ledger.
    fn predict(
        &self,
        st: &State,
        now: Instant,
        c: &Candidate,
        uncached: u64,
        inflight: Option<(u64, u64)>,
    ) -> Prediction {
        let fleet_service = st.fleet.service_ms.unwrap_or(self.params.service_time_ms);
        let (speed, service) = match st.pods.get(&c.endpoint.hostport) {
            Some(pod) => {
                let age = pod
                    .updated
                    .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
                let w = (-age.as_secs_f64() / RELAX.as_secs_f64()).exp();
                let mix = |p: f64, f: f64| f + w * (p - f);
                (
                    mix(pod.speed, 1.0),
                    mix(pod.service_ms.unwrap_or(fleet_service), fleet_service),
                )
            }
            None => (1.0, fleet_service),
        };
        let fit = st.fleet.fit.scaled(speed);
        let gauge = |v: Option<f64>| {
            v.filter(|v| v.is_finite() && *v > 0.0).map_or(0, |v| {
                v.min(crate::datalayer::endpoint::MAX_BATCH as f64) as u64
            })
        };
        let m = c.metrics();
        let (running_m, waiting_m) = m.map_or((0, 0), |m| {
            (gauge(m.running_requests), gauge(m.waiting_queue_size))
        });
        // The ledger knows every routed request at once; the gauges are up to a scrape old (a slot
        // that just freed still shows busy) but see traffic the ledger does not: they count when
        // the pod queues requests.
        let ahead = match inflight {
            Some((n, _)) if waiting_m > 0 => n.max(running_m + waiting_m),
            Some((n, _)) => n,
            None => running_m + waiting_m,
        };
        let queued_tokens = inflight.map_or(0, |(_, t)| t);
        let capacity = c.endpoint.batch_capacity();
        let running = capacity.map_or(ahead, |cap| ahead.min(cap));
        let queue_ms = match capacity {
            Some(cap) if ahead >= cap => (ahead - cap + 1) as f64 * service / cap as f64,
            None if waiting_m > 0 => (waiting_m + 1) as f64 * service / running_m.max(1) as f64,
            _ => 0.0,
        };
        let mut ttft = fit.predict(features(uncached, queued_tokens, running)) + queue_ms;
        if m.is_none() {
            ttft += self.params.stale_metrics_penalty_ms;
        }
        let prefill_ms = fit.ms_per_token * uncached as f64;
        let evicted = m.map_or(0, |m| active_evicted(m, uncached + queued_tokens));
        let load = capacity.map_or(0.0, |cap| ahead as f64 * service / cap as f64);
        Prediction {
            ttft_ms: ttft.min(MAX_SAMPLE_MS),
            queue_ms: queue_ms.min(MAX_SAMPLE_MS),
            others_ms: (self.params.prefill_interference * running as f64 * prefill_ms
                + self.params.eviction_cost * fit.ms_per_token * evicted as f64
                + self.params.load_cost * load)
                .min(MAX_SAMPLE_MS),
            uncached_tokens: uncached,
            queued_tokens,
            running,
        }
    }

    /// Predicted time per output token with `running` requests beside it, ms (the fleet's fit;
    /// `None` before it has samples).
    pub fn predict_tpot(&self, running: u64) -> Option<f64> {
        self.read().fleet.tpot.predict(running)
    }

    /// Learn from one observed response.
    fn learn(&self, obs: &Observation<'_>) {
        let keep = (-1.0 / self.params.memory_samples).exp();
        let e2e = obs.e2e_ms;
        if !(e2e.is_finite() && (0.0..=MAX_SAMPLE_MS).contains(&e2e)) {
            return;
        }
        let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
        let State { fleet, pods } = &mut *st;
        if !pods.contains_key(obs.pod) && pods.len() >= MAX_PODS {
            // Bounded: beyond MAX_PODS pods only the fleet learns.
            self.update(fleet, None, obs, keep);
        } else {
            let pod = pods.entry(obs.pod.to_string()).or_insert_with(Pod::new);
            self.update(fleet, Some(pod), obs, keep);
        }
        let every = st.pods.len().div_ceil(SHRINK_PODS).max(1) as u64;
        if st.fleet.samples.is_multiple_of(every) {
            st.shrink_speeds();
        }
    }

    fn update(
        &self,
        fleet: &mut Fleet,
        mut pod: Option<&mut Pod>,
        obs: &Observation<'_>,
        keep: f64,
    ) {
        let queued = obs.predicted.map_or(0.0, |p| p.queue_ms);
        // The slot was held from admission to the end, less the predicted wait for it.
        let service = (obs.e2e_ms - queued).max(0.0);
        let alpha = 1.0 - keep;
        let ewma = |s: &mut Option<f64>| {
            *s = Some(s.map_or(service, |v| v + alpha * (clip(service, v) - v)));
        };
        ewma(&mut fleet.service_ms);
        fleet.samples += 1;
        // Time per output token: the decode after the first token, over the tokens after it.
        if let (Some(ttft), Some(out)) = (obs.ttft_ms, obs.output_tokens)
            && (2..=MAX_TOKENS).contains(&out)
            && obs.e2e_ms > ttft
        {
            let tpot = ((obs.e2e_ms - ttft) / (out - 1) as f64).min(MAX_TPOT_MS);
            let running = obs.predicted.map_or(0, |p| p.running) as f64;
            fleet.tpot.add(running, tpot, keep);
        }
        let sample = match (obs.ttft_ms, obs.predicted) {
            // Only requests that found a free slot: the fit is of the engine, not of its queue.
            (Some(ttft), Some(p)) if p.queue_ms == 0.0 && ttft.is_finite() => {
                let uncached = match (obs.prompt_tokens, obs.cached_tokens) {
                    (Some(n), Some(c)) => n.saturating_sub(c),
                    (Some(n), None) => n,
                    _ => p.uncached_tokens,
                };
                // Token counts beyond any context window are garbage, not a sample.
                (uncached <= MAX_TOKENS && p.queued_tokens <= MAX_TOKENS).then(|| {
                    let x = features(uncached, p.queued_tokens, p.running);
                    (x, clip(ttft.clamp(0.0, MAX_SAMPLE_MS), p.ttft_ms))
                })
            }
            _ => None,
        };
        if let Some((x, y)) = sample {
            // The pod's factor against the fleet's fit before this sample; the fleet's fit is of
            // every pod's samples (a new pod is predicted as the fleet's average).
            if let Some(pod) = pod.as_deref_mut() {
                let f = fleet.fit.predict(x);
                if f > 0.0 {
                    pod.learn_speed(y, f, keep);
                }
            }
            fleet.lsq.add(x, y, keep);
            fleet.fit = fleet
                .lsq
                .solve(self.prior, FLEET_PRIOR_SAMPLES, &self.bounds);
        }
        if let Some(pod) = pod {
            ewma(&mut pod.service_ms);
            pod.samples += 1;
            pod.updated = Some(Instant::now());
        }
    }

    pub fn view(&self) -> CostModelView {
        let st = self.read();
        let mut pods: Vec<(String, LearnedView)> = st
            .pods
            .iter()
            .map(|(k, p)| {
                let view = LearnedView::of(st.fleet.fit, p.speed, p.service_ms, p.samples);
                (k.clone(), view)
            })
            .collect();
        pods.sort_by(|a, b| a.0.cmp(&b.0));
        let f = &st.fleet;
        CostModelView {
            fleet: LearnedView::of(f.fit, 1.0, f.service_ms, f.samples),
            pods,
            tpot: f.tpot.fit,
        }
    }
}

fn features(uncached: u64, queued: u64, running: u64) -> [f64; N] {
    [1.0, uncached as f64, queued as f64, running as f64]
}

impl Producer for CostModel {
    fn type_name(&self) -> &'static str {
        PRODUCER_TYPE
    }

    fn produce(&self, _req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        let st = self.read();
        let now = Instant::now();
        data.predicted = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let load = data.inflight.get(i).map(|l| (l.requests, l.tokens));
                self.predict(&st, now, c, data.prefill_tokens(i) as u64, load)
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

    fn observed(&self, obs: &Observation<'_>) {
        if self.params.learn {
            self.learn(obs);
        }
    }
}

/// Tokens of running requests' KV a request needing `tokens` new blocks would push out of the
/// pod: its KV use (by running requests, as the pod reports it) plus these, beyond its capacity.
/// 0 when the pod does not say its capacity.
fn active_evicted(m: &crate::datalayer::EndpointMetrics, tokens: u64) -> u64 {
    let (Some(blocks), Some(block_size), Some(usage)) =
        (m.num_gpu_blocks, m.block_size, m.kv_cache_usage)
    else {
        return 0;
    };
    let capacity = blocks.saturating_mul(block_size);
    let used = (usage.clamp(0.0, 1.0) * capacity as f64) as u64;
    (used + tokens).saturating_sub(capacity)
}

/// `cost-model-scorer`: `(c_min + 1) / (c_i + 1)` over the predicted costs (TTFT plus eviction, ms).
#[derive(Debug, Default)]
pub struct CostModelScorer;

impl Scorer for CostModelScorer {
    fn type_name(&self) -> &'static str {
        SCORER_TYPE
    }

    fn score(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        _candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    ) {
        let t = |i: usize| data.predicted.get(i).map(Prediction::cost_ms);
        let best = idx
            .iter()
            .filter_map(|&i| t(i))
            .fold(f64::INFINITY, f64::min);
        for (slot, &i) in out.iter_mut().zip(idx) {
            *slot = match t(i) {
                Some(ti) if best.is_finite() => (best + 1.0) / (ti + 1.0),
                _ => 0.0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::datalayer::EndpointMetrics;
    use crate::scheduling::testutil::*;
    use crate::scheduling::{InflightLoad, PrefixMatchInfo};

    /// 1000 tokens/s prior (1 ms per token), 400 ms service time, no learning.
    fn model(learn: bool) -> CostModel {
        CostModel::new(CostModelParams {
            prefill_tokens_per_second: 1000.0,
            service_time_ms: 400.0,
            stale_metrics_penalty_ms: 5000.0,
            learn,
            memory_samples: 64.0,
            prefill_interference: 0.0,
            eviction_cost: 0.5,
            load_cost: 0.25,
        })
    }

    fn gauges(running: f64, waiting: f64) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            running_requests: Some(running),
            waiting_queue_size: Some(waiting),
            ..Default::default()
        })
    }

    /// A 1000-token prompt (16 blocks of 64 = 1024 > 1000: prompt_tokens = 1000), matched blocks per
    /// candidate, and ledger loads.
    fn data(matched: Vec<usize>, inflight: Vec<InflightLoad>) -> RequestData {
        RequestData {
            prompt_tokens: 1000,
            prefix: Some(PrefixMatchInfo {
                block_size: 64,
                total_blocks: 15,
                matched,
                hashes: vec![],
            }),
            inflight,
            ..RequestData::default()
        }
    }

    fn load(requests: u64, tokens: u64) -> InflightLoad {
        InflightLoad {
            requests,
            tokens,
            prefilling: 0,
        }
    }

    #[test]
    fn predictions_by_hand() {
        let m = model(false);
        let a = cand_at("a", "10.0.0.1:1", gauges(1.0, 0.0), false, &[]);
        let b = cand_at("b", "10.0.0.2:1", gauges(0.0, 0.0), false, &[]);
        // c has shown a batch of 2 with requests waiting (two samples): its batch limit is 2.
        let c = cand_at("c", "10.0.0.3:1", None, false, &[]);
        for _ in 0..2 {
            c.endpoint
                .set_metrics(gauges(2.0, 1.0).unwrap(), Instant::now(), None);
        }
        let c = Candidate {
            sample: c.endpoint.sample(),
            ..c
        };
        // d: requests waiting but no known limit; e: no metrics at all.
        let d = cand_at("d", "10.0.0.4:1", gauges(0.0, 2.0), false, &[]);
        let e = cand_at("e", "10.0.0.5:1", None, false, &[]);
        let cs = [a, b, c, d, e];
        let mut rd = data(
            vec![10, 0, 0, 0, 0],
            vec![
                load(1, 200),
                load(0, 0),
                load(3, 100),
                load(0, 0),
                load(0, 0),
            ],
        );
        m.produce(&req(), &cs, &mut rd);
        let t: Vec<f64> = rd.predicted.iter().map(|p| p.ttft_ms).collect();
        // a: 1000 − 10·64 = 360 uncached + 200 queued tokens at 1 ms each; one running, no slot wait.
        assert_eq!(t[0], 560.0);
        assert_eq!(
            (rd.predicted[0].running, rd.predicted[0].uncached_tokens),
            (1, 360)
        );
        // b: idle, nothing cached.
        assert_eq!(t[1], 1000.0);
        // c: 3 in flight ≥ limit 2 → wait (3 − 2 + 1) · 400 / 2 = 400 ms, on top of 1100 tokens.
        assert_eq!(rd.predicted[2].queue_ms, 400.0);
        assert_eq!((t[2], rd.predicted[2].running), (1500.0, 2));
        // …and its 3 requests cost a new one a quarter of their slot time: 0.25 · 3 · 400 / 2.
        assert_eq!(rd.predicted[2].others_ms, 150.0);
        // d: 2 waiting and none running (an engine still loading): no limit learned, the waiting
        // queue says full → (2 + 1) · 400 / 1 = 1200 ms.
        assert_eq!(t[3], 1000.0 + 1200.0);
        // e: never scraped → the stale penalty.
        assert_eq!(t[4], 1000.0 + 5000.0);

        let s = CostModelScorer;
        let scores = score_all(&s, &rd, &cs);
        let want = [
            1.0,
            561.0 / 1001.0,
            561.0 / 1651.0,
            561.0 / 2201.0,
            561.0 / 6001.0,
        ];
        for (got, want) in scores.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{scores:?}");
        }
    }

    /// An engine whose concurrent prefills do not slow each other (q = 0, as learned on such a
    /// pool): a pod matched only by blocks an earlier request is still prefilling is no cheaper
    /// than a cold one, so the request goes to an idle pod instead of queueing behind it.
    #[test]
    fn a_match_still_being_prefilled_is_not_a_cache_hit() {
        let m = model(false);
        m.state.write().unwrap().fleet.fit.ms_per_queued_token = 0.0;
        let a = cand_at("a", "10.0.0.1:1", gauges(1.0, 0.0), false, &[]);
        let b = cand_at("b", "10.0.0.2:1", gauges(0.0, 0.0), false, &[]);
        let cs = [a, b];
        let mut rd = data(vec![15, 0], vec![load(1, 1000), load(0, 0)]);
        m.produce(&req(), &cs, &mut rd);
        // Believed cached: 1000 − 15·64 = 40 uncached tokens on a, against 1000 on b.
        assert_eq!(rd.predicted[0].uncached_tokens, 40);
        assert!(rd.predicted[0].cost_ms() < rd.predicted[1].cost_ms());
        // 12 of the 15 matched blocks are still being prefilled on a: 40 + 12·64 = 808 to compute.
        rd.pending = vec![12, 0];
        m.produce(&req(), &cs, &mut rd);
        assert_eq!(rd.predicted[0].uncached_tokens, 808);
        // All of them: the whole prompt, and a is no cheaper than b (idle).
        rd.pending = vec![15, 0];
        m.produce(&req(), &cs, &mut rd);
        assert_eq!(rd.predicted[0].uncached_tokens, 1000);
        assert!(rd.predicted[0].cost_ms() >= rd.predicted[1].cost_ms());
    }

    /// Time per output token: nothing before samples; then `t0 + t1 · running` from streamed
    /// responses — here 10 ms alone plus 2 ms per request running beside it.
    #[test]
    fn learns_the_time_per_output_token() {
        let m = model(true);
        assert_eq!(m.predict_tpot(3), None);
        for i in 0..200u64 {
            let running = i % 5;
            let tpot = 10.0 + 2.0 * running as f64;
            let out = 33;
            m.observed(&Observation {
                pod: "10.0.0.1:1",
                ttft_ms: Some(50.0),
                e2e_ms: 50.0 + tpot * (out - 1) as f64,
                prompt_tokens: Some(100),
                cached_tokens: Some(0),
                output_tokens: Some(out),
                predicted: Some(Prediction {
                    ttft_ms: 50.0,
                    running,
                    ..Prediction::default()
                }),
            });
        }
        for running in [0, 4, 8] {
            let t = m.predict_tpot(running).unwrap();
            let want = 10.0 + 2.0 * running as f64;
            assert!((t - want).abs() < 0.1, "{running}: {t} vs {want}");
        }
        // Responses without a streamed first token, or with one output token, teach nothing.
        let m = model(true);
        for out in [Some(1), None] {
            m.observed(&Observation {
                pod: "10.0.0.1:1",
                ttft_ms: Some(50.0),
                e2e_ms: 500.0,
                prompt_tokens: None,
                cached_tokens: None,
                output_tokens: out,
                predicted: None,
            });
        }
        assert_eq!(m.view().tpot, None);
    }

    /// A pod whose KV is taken by running requests pays for what a request would push out of it:
    /// half the re-prefill of those tokens.
    #[test]
    fn a_full_pod_pays_for_what_it_evicts() {
        let m = model(false);
        // 1000 blocks of 16 = 16000 tokens; "full" runs requests holding 90% of them.
        let kv = |usage: f64| {
            Some(EndpointMetrics {
                running_requests: Some(1.0),
                waiting_queue_size: Some(0.0),
                kv_cache_usage: Some(usage),
                num_gpu_blocks: Some(1000),
                block_size: Some(16),
                ..Default::default()
            })
        };
        let cs = [
            cand_at("full", "10.0.0.1:1", kv(0.9), false, &[]),
            cand_at("roomy", "10.0.0.2:1", kv(0.1), false, &[]),
        ];
        let mut rd = data(vec![5, 0], vec![load(0, 0), load(0, 0)]);
        m.produce(&req(), &cs, &mut rd);
        // full: 1000 − 5·64 = 680 uncached; 14400 + 680 − 16000 < 0: nothing evicted yet.
        assert_eq!(
            (rd.predicted[0].ttft_ms, rd.predicted[0].others_ms),
            (680.0, 0.0)
        );
        // With 2000 tokens queued there, 14400 + 680 + 2000 − 16000 = 1080 are pushed out.
        let mut rd = data(vec![5, 0], vec![load(1, 2000), load(0, 0)]);
        m.produce(&req(), &cs, &mut rd);
        assert_eq!(rd.predicted[0].ttft_ms, 2680.0);
        assert_eq!(rd.predicted[0].others_ms, 540.0);
        assert_eq!(
            (rd.predicted[1].ttft_ms, rd.predicted[1].others_ms),
            (1000.0, 0.0)
        );
        let scores = score_all(&CostModelScorer, &rd, &cs);
        assert_eq!(scores[1], 1.0);
        assert!((scores[0] - 1001.0 / 3221.0).abs() < 1e-12, "{scores:?}");
    }

    /// Observations of a pod whose TTFT is 10 ms + 0.2 ms per uncached token + 0.05 ms per queued
    /// token + 3 ms per running request: the fit converges to it from a prior 5× off, and another
    /// pod borrows the fleet's.
    #[test]
    fn learns_a_pods_speed_from_its_responses() {
        let m = model(true);
        let truth = |uncached: u64, queued: u64, running: u64| {
            10.0 + 0.2 * uncached as f64 + 0.05 * queued as f64 + 3.0 * running as f64
        };
        for k in 0..400u64 {
            let uncached = 100 + (k * 37) % 2000;
            let queued = (k * 113) % 3000;
            let running = k % 5;
            // As if routed with a prediction in the right range (a sample far above its
            // prediction is clipped: see `clip`).
            let p = Prediction {
                ttft_ms: truth(uncached, queued, running),
                uncached_tokens: uncached + 50,
                queued_tokens: queued,
                running,
                ..Prediction::default()
            };
            m.observed(&Observation {
                pod: "10.0.0.1:1",
                ttft_ms: Some(truth(uncached, queued, running)),
                e2e_ms: 2000.0,
                // the usage says 50 of the predicted uncached tokens were cached after all
                prompt_tokens: Some(uncached + 500),
                cached_tokens: Some(500),
                output_tokens: None,
                predicted: Some(p),
            });
        }
        let v = m.view();
        let (pod, learned) = &v.pods[0];
        assert_eq!(pod, "10.0.0.1:1");
        let f = learned.fit;
        assert!((f.ms_per_token - 0.2).abs() < 0.005, "{f:?}");
        assert!((f.ms_per_queued_token - 0.05).abs() < 0.01, "{f:?}");
        assert!((f.base_ms - 10.0).abs() < 2.0, "{f:?}");
        assert!((f.ms_per_running - 3.0).abs() < 0.5, "{f:?}");
        assert!((learned.service_ms.unwrap() - 2000.0).abs() < 1e-6);
        // The fleet learned the same; a pod never observed predicts with it.
        assert!(
            (v.fleet.fit.ms_per_token - 0.2).abs() < 0.01,
            "{:?}",
            v.fleet
        );
        let cs = [cand_at("new", "10.0.0.9:1", gauges(0.0, 0.0), false, &[])];
        let mut rd = data(vec![0], vec![load(0, 0)]);
        m.produce(&req(), &cs, &mut rd);
        let want = truth(1000, 0, 0);
        assert!(
            (rd.predicted[0].ttft_ms - want).abs() < 0.05 * want,
            "{:?}",
            rd.predicted
        );
    }

    /// Four pods, the last `slow` times slower than the others. Each sample is off by up to
    /// ±30 % and the true TTFT is not linear in the queued tokens (the fleet's fit cannot match
    /// it everywhere).
    fn learn_pool(slow: f64) -> (CostModel, [&'static str; 4], impl Fn(u64, u64) -> f64) {
        let m = model(true);
        let truth = |uncached: u64, queued: u64| {
            let q = queued as f64;
            20.0 + 0.07 * uncached as f64 + 0.02 * q + 0.00002 * q * q
        };
        let pods = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"];
        let mut rng = 7u64;
        for k in 0..2000u64 {
            let pod = (k % 4) as usize;
            let uncached = 50 + (k * 37) % 3000;
            let queued = (k * 113) % 4000;
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = 0.7 + 0.6 * ((rng >> 33) as f64 / (1u64 << 31) as f64);
            let slow = if pod == 3 { slow } else { 1.0 };
            let y = truth(uncached, queued) * slow * noise;
            m.observed(&Observation {
                pod: pods[pod],
                ttft_ms: Some(y),
                e2e_ms: 500.0,
                prompt_tokens: Some(uncached),
                cached_tokens: Some(0),
                output_tokens: None,
                predicted: Some(Prediction {
                    ttft_ms: truth(uncached, queued) * slow,
                    uncached_tokens: uncached,
                    queued_tokens: queued,
                    ..Prediction::default()
                }),
            });
        }
        (m, pods, truth)
    }

    /// Identical pods keep the fleet's fit (`k` within a few percent of 1): neither noise nor the
    /// fit's misfit makes one of them look faster and draw every new session.
    #[test]
    fn identical_pods_keep_the_fleets_fit() {
        let (m, _, _) = learn_pool(1.0);
        let speed: Vec<f64> = m.view().pods.iter().map(|(_, l)| l.speed).collect();
        assert!(
            speed.iter().all(|k| (k - 1.0).abs() < 0.03),
            "identical pods drifted apart: {speed:?}"
        );
    }

    /// A pod three times slower than the other three stands out of the noise: its factor is
    /// three times theirs, the others' stay together, and predictions follow.
    #[test]
    fn a_slow_pod_gets_its_own_factor() {
        let (m, pods, truth) = learn_pool(3.0);
        let speed: Vec<f64> = m.view().pods.iter().map(|(_, l)| l.speed).collect();
        let fast = &speed[..3];
        let (lo, hi) = fast
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &s| (l.min(s), h.max(s)));
        assert!(hi / lo < 1.06, "identical pods drifted apart: {speed:?}");
        let mean = fast.iter().sum::<f64>() / 3.0;
        assert!((speed[3] / mean - 3.0).abs() < 0.3, "{speed:?}");
        // Predictions: 2000 uncached tokens on an idle pod.
        let cs = [
            cand_at("fast", pods[0], gauges(0.0, 0.0), false, &[]),
            cand_at("slow", pods[3], gauges(0.0, 0.0), false, &[]),
        ];
        let st = m.read();
        let now = Instant::now();
        let want = truth(2000, 0);
        let fast_ttft = m.predict(&st, now, &cs[0], 2000, None).ttft_ms;
        let slow_ttft = m.predict(&st, now, &cs[1], 2000, None).ttft_ms;
        assert!(
            (fast_ttft / want - 1.0).abs() < 0.15,
            "{fast_ttft} vs {want}"
        );
        assert!(
            (slow_ttft / want / 3.0 - 1.0).abs() < 0.15,
            "{slow_ttft} vs 3 × {want}"
        );
    }

    /// With continuous batching, every request running on a pod waits for a new request's prefill
    /// too: `prefillInterference · R_i · s_i · U_i` is added to its cost, so a cold prompt goes to
    /// the pod with fewer requests running even at the same TTFT, while a warm one stays home.
    #[test]
    fn a_prefill_costs_every_running_request() {
        let m = CostModel::new(CostModelParams {
            prefill_tokens_per_second: 1000.0,
            learn: false,
            prefill_interference: 1.0,
            ..CostModelParams::default()
        });
        let cs = [
            cand_at("busy", "10.0.0.1:1", gauges(3.0, 0.0), false, &[]),
            cand_at("quiet", "10.0.0.2:1", gauges(1.0, 0.0), false, &[]),
        ];
        // Cold everywhere: 1000 uncached tokens at 1 ms each on both; the ledger says 3 and 1
        // running (no tokens left to prefill).
        let mut rd = data(vec![0, 0], vec![load(3, 0), load(1, 0)]);
        m.produce(&req(), &cs, &mut rd);
        assert_eq!(rd.predicted[0].ttft_ms, rd.predicted[1].ttft_ms);
        assert_eq!(rd.predicted[0].others_ms, 3.0 * 1000.0);
        assert_eq!(rd.predicted[1].others_ms, 1000.0);
        let scores = score_all(&CostModelScorer, &rd, &cs);
        assert_eq!(scores[1], 1.0);
        assert!((scores[0] - 2001.0 / 4001.0).abs() < 1e-12, "{scores:?}");
        // Warm on the busy pod (14 of 15 blocks of 64: 1000 − 896 = 104 uncached): 104 + 3 · 104
        // = 416 there against 2000 on the quiet pod.
        let mut rd = data(vec![14, 0], vec![load(3, 0), load(1, 0)]);
        m.produce(&req(), &cs, &mut rd);
        assert_eq!(rd.predicted[0].cost_ms(), 416.0);
        assert_eq!(rd.predicted[1].cost_ms(), 2000.0);
    }

    /// A pod that looked slow and then got no traffic relaxes to the fleet's fit, so it is tried
    /// again; one sample far above its prediction moves the fit only up to the clip.
    #[test]
    fn an_unsampled_pod_relaxes_to_the_fleet() {
        let m = model(true);
        let obs = |pod, ttft| Observation {
            pod,
            ttft_ms: Some(ttft),
            e2e_ms: ttft + 100.0,
            prompt_tokens: Some(1000),
            cached_tokens: Some(0),
            output_tokens: None,
            predicted: Some(Prediction {
                ttft_ms: 1000.0,
                uncached_tokens: 1000,
                ..Prediction::default()
            }),
        };
        for _ in 0..50 {
            m.observed(&obs("10.0.0.1:1", 1000.0));
        }
        // One stall: 60 s observed, counted as 3 × 1000 + 20 ms.
        m.observed(&obs("10.0.0.2:1", 60_000.0));
        let cs = [cand_at("slow", "10.0.0.2:1", gauges(0.0, 0.0), false, &[])];
        let st = m.read();
        let now = Instant::now();
        let at = |t: Instant| m.predict(&st, t, &cs[0], 1000, None).ttft_ms;
        let fresh = at(now);
        assert!(fresh > 1200.0 && fresh < 3020.0, "{fresh}");
        let later = at(now + Duration::from_secs(120));
        let fleet = m
            .predict(
                &st,
                now,
                &cand_at("x", "10.9.9.9:1", gauges(0.0, 0.0), false, &[]),
                1000,
                None,
            )
            .ttft_ms;
        assert!(
            (later - fleet).abs() < 1.0,
            "relaxed {later} vs fleet {fleet}"
        );
    }

    #[test]
    fn garbage_samples_cannot_break_the_model() {
        let m = model(true);
        let p = Prediction::default();
        for (ttft, e2e) in [
            (Some(f64::NAN), 10.0),
            (Some(1e300), 10.0),
            (Some(-5.0), 10.0),
            (Some(5.0), f64::INFINITY),
            (Some(5.0), -1.0),
        ] {
            m.observed(&Observation {
                pod: "p",
                ttft_ms: ttft,
                e2e_ms: e2e,
                prompt_tokens: Some(u64::MAX),
                cached_tokens: Some(0),
                output_tokens: None,
                predicted: Some(p),
            });
        }
        let v = m.view();
        for l in std::iter::once(&v.fleet).chain(v.pods.iter().map(|(_, l)| l)) {
            let f = l.fit;
            assert!(
                f.base_ms.is_finite() && (0.0..=10_000.0).contains(&f.base_ms),
                "{f:?}"
            );
            assert!((0.01..=100.0).contains(&f.ms_per_token), "{f:?}");
            assert!(
                f.ms_per_running.is_finite() && f.ms_per_running >= 0.0,
                "{f:?}"
            );
        }
    }

    #[test]
    fn saturated_samples_teach_service_time_not_speed() {
        let m = model(true);
        for _ in 0..50 {
            m.observed(&Observation {
                pod: "p",
                ttft_ms: Some(5_000.0),
                e2e_ms: 5_300.0,
                prompt_tokens: Some(100),
                cached_tokens: Some(0),
                output_tokens: None,
                predicted: Some(Prediction {
                    queue_ms: 4_000.0,
                    ..Prediction::default()
                }),
            });
        }
        let v = m.view();
        assert_eq!(
            v.fleet.fit.ms_per_token, 1.0,
            "queued samples leave the fit at the prior"
        );
        assert!((v.pods[0].1.service_ms.unwrap() - 1_300.0).abs() < 1e-6);
    }

    #[test]
    fn prediction_codec() {
        let p = Prediction {
            ttft_ms: 1.25,
            queue_ms: 0.5,
            others_ms: 9.0,
            uncached_tokens: 7,
            queued_tokens: 0,
            running: 3,
        };
        // One decimal: 1.25 → "1.2" (round half to even) is fine for learning.
        let d = Prediction::decode(&p.encode()).unwrap();
        assert_eq!((d.uncached_tokens, d.running), (7, 3));
        assert!((d.ttft_ms - 1.25).abs() <= 0.051);
        assert_eq!(
            d.others_ms, 0.0,
            "the eviction estimate is the router's own"
        );
        assert_eq!(Prediction::decode(""), None);
        assert_eq!(Prediction::decode("1,2,3,4,x"), None);
        assert_eq!(Prediction::decode("1,2,3,4,99999999999999999"), None);
    }

    #[test]
    fn solve_matches_a_known_system() {
        // x + y + z = 6, 2y + 5z = −4, 2x + 5y − z = 27 → (5, 3, −2)
        let x = solve(
            [[1.0, 1.0, 1.0], [0.0, 2.0, 5.0], [2.0, 5.0, -1.0]],
            [6.0, -4.0, 27.0],
        )
        .unwrap();
        for (g, w) in x.iter().zip([5.0, 3.0, -2.0]) {
            assert!((g - w).abs() < 1e-9, "{x:?}");
        }
        assert_eq!(solve([[0.0; 3]; 3], [1.0; 3]), None);
    }
}

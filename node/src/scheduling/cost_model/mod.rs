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
//! while others wait; unknown until then, when requests still waiting a scrape later say the
//! batch is full — one sample catching a request between its arrival and the engine's next step
//! says nothing), `S_i` the pod's mean service time. A pod without fresh metrics is penalised by
//! `staleMetricsPenaltyMs`.
//!
//! # Learning
//! Every response observed here (whichever replica routed it) is a sample: the route header
//! carries what was predicted; the response gives its TTFT, its duration and, from its usage,
//! the tokens that were really uncached. Samples routed to a pod with a free slot fit the
//! fleet's `(a, s, q, d)` by exponentially-forgetting least squares (memory `memorySamples`) —
//! so an engine whose concurrent prefills do not slow each other learns `q ≈ 0`; `s ≥ q`, a
//! request's own tokens are prefilled no faster than those queued ahead of it — pulled toward
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

use serde::Serialize;

use super::{MAX_SAMPLE_MS, Observation, Prediction, Producer, RequestData, SchedRequest, Scorer};
use crate::datalayer::store::Candidate;

mod fit;
mod learned;
mod params;
#[cfg(test)]
mod tests;

pub use fit::Fit;
use fit::{Bounds, FLEET_PRIOR_SAMPLES, Lsq, MAX_TPOT_MS, Tpot, features};
use learned::{Fleet, Pod, SHRINK_PODS};
pub use params::CostModelParams;

pub const PRODUCER_TYPE: &str = "cost-model-producer";
pub const SCORER_TYPE: &str = "cost-model-scorer";

/// Pods whose fits are kept (beyond it, new pods use the fleet's fit).
const MAX_PODS: usize = 4096;
/// Most prompt tokens a sample may report (a larger usage report is not a sample).
const MAX_TOKENS: u64 = 1 << 24;

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
        // Waiting requests count once they have waited a scrape long (`Endpoint::queueing`):
        // one sample catching a request between its arrival and the engine's next step is no queue.
        let (running_m, waiting_m) = m.map_or((0, 0), |m| {
            let waiting = if c.endpoint.queueing() {
                gauge(m.waiting_queue_size)
            } else {
                0
            };
            (gauge(m.running_requests), waiting)
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

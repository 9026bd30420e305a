//! What the model has learned: the fleet's fit and slot time, and each pod's speed factor.

use std::time::Instant;

use super::State;
use super::fit::{Fit, Lsq, Tpot};

/// What the fleet has learned: the shape of a TTFT (its coefficients, fitted to the samples of
/// every pod) and the mean slot time.
#[derive(Debug, Clone)]
pub(super) struct Fleet {
    pub(super) lsq: Lsq,
    pub(super) fit: Fit,
    /// Mean slot occupancy, ms (EWMA); `None` before the first sample.
    pub(super) service_ms: Option<f64>,
    pub(super) samples: u64,
    pub(super) tpot: Tpot,
}

/// What is learned about one pod: how much slower (> 1) or faster than the fleet's fit its
/// TTFTs are — one factor, not a fit of its own — and its mean slot time.
#[derive(Debug, Clone)]
pub(super) struct Pod {
    /// The log of observed / fleet-predicted TTFT: Σ r, Σ r², Σ w, Σ w², exponentially forgotten.
    pub(super) r1: f64,
    pub(super) r2: f64,
    pub(super) w1: f64,
    pub(super) w2: f64,
    /// The factor predictions use ([`State::shrink_speeds`]).
    pub(super) speed: f64,
    pub(super) service_ms: Option<f64>,
    pub(super) samples: u64,
    /// When the last sample arrived.
    pub(super) updated: Option<Instant>,
}

impl Pod {
    pub(super) fn new() -> Self {
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

    pub(super) fn learn_speed(&mut self, observed: f64, fleet: f64, keep: f64) {
        let r = (observed.max(0.01) / fleet)
            .ln()
            .clamp(-MAX_LN_SPEED, MAX_LN_SPEED);
        self.r1 = self.r1 * keep + r;
        self.r2 = self.r2 * keep + r * r;
        self.w1 = self.w1 * keep + 1.0;
        self.w2 = self.w2 * keep * keep + 1.0;
    }

    /// The effective number of samples behind the mean (forgetting weights count less).
    pub(super) fn n_eff(&self) -> f64 {
        if self.w2 > 0.0 {
            self.w1 * self.w1 / self.w2
        } else {
            0.0
        }
    }
}

/// A pod is at most e^3 ≈ 20 times slower (or faster) than the fleet's fit.
pub(super) const MAX_LN_SPEED: f64 = 3.0;
/// The speed factors are re-estimated every `pods / SHRINK_PODS` observations (at least every
/// one): amortised, an observation walks at most this many pods.
pub(super) const SHRINK_PODS: usize = 64;

impl State {
    /// Each pod's speed factor, shrunk toward the fleet by how much of its difference from the
    /// others its samples' noise can explain (empirical Bayes): with `m_i` the mean log ratio of
    /// its observed TTFTs to the fleet's predictions, `M` the pods' mean of those, `σ²` the
    /// samples' pooled variance around their pod's mean and `B` the variance of the `m_i` beyond
    /// what `σ²/n_i` explains, `k_i = exp(ρ_i · (m_i − M))` with `ρ_i = B / (B + σ²/n_i)`.
    /// Identical pods differ only by noise and misfit of the fleet's model (B ≈ 0): they keep
    /// `k = 1`; a slower GPU stands out of the noise and keeps its factor.
    pub(super) fn shrink_speeds(&mut self) {
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

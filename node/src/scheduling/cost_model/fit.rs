//! The fitted TTFT coefficients: exponentially-forgetting least squares pulled toward a prior,
//! the time per output token, and the plausible ranges every fit is clamped to.

use serde::Serialize;

/// The fitted coefficients: TTFT = a + s · uncached + q · queued tokens + d · running (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    pub base_ms: f64,
    pub ms_per_token: f64,
    pub ms_per_queued_token: f64,
    pub ms_per_running: f64,
}

impl Fit {
    pub(super) fn theta(&self) -> [f64; N] {
        [
            self.base_ms,
            self.ms_per_token,
            self.ms_per_queued_token,
            self.ms_per_running,
        ]
    }
}

/// Features: `[1, uncached tokens, queued tokens, running]`.
pub(super) const N: usize = 4;
/// Typical feature magnitudes: a coefficient's prior pull is measured at these.
const SCALE: [f64; N] = [1.0, 1_000.0, 1_000.0, 4.0];
/// How many samples' worth the configured prior weighs in the fleet's fit.
pub(super) const FLEET_PRIOR_SAMPLES: f64 = 0.02;

/// Exponentially-forgetting least squares over the features.
#[derive(Debug, Clone, Default)]
pub(super) struct Lsq {
    xtx: [[f64; N]; N],
    xty: [f64; N],
    weight: f64,
}

impl Lsq {
    pub(super) fn add(&mut self, x: [f64; N], y: f64, keep: f64) {
        for r in 0..N {
            self.xty[r] = self.xty[r] * keep + x[r] * y;
            for c in 0..N {
                self.xtx[r][c] = self.xtx[r][c] * keep + x[r] * x[c];
            }
        }
        self.weight = self.weight * keep + 1.0;
    }

    /// The ridge solution pulled toward `prior` (worth `strength` samples), clamped to `bounds`.
    pub(super) fn solve(&self, prior: Fit, strength: f64, bounds: &Bounds) -> Fit {
        let p = prior.theta();
        let mut a = self.xtx;
        let mut b = self.xty;
        for j in 0..N {
            let w = strength * SCALE[j] * SCALE[j];
            a[j][j] += w;
            b[j] += w * p[j];
        }
        let mut t = solve(a, b).unwrap_or(p);
        // A request's own uncached tokens are prefilled no faster than the tokens queued ahead of
        // it (an engine that batches prefills runs both in the same steps; one that does not
        // leaves q ≈ 0): s ≥ q. A burst's samples break it — every request's prompt is about as
        // long, so `s` trades against the intercept, and later arrivals stretch earlier ones'
        // TTFT — and an `s` near 0 makes every cache hit look worthless. The fit under the
        // constraint lies on `s = q` then (a convex problem with one violated inequality).
        if t[1] < t[2] {
            t = tied(a, b).unwrap_or(t);
        }
        Fit {
            base_ms: t[0].clamp(0.0, bounds.max_base_ms),
            ms_per_token: t[1].clamp(bounds.min_ms_per_token, bounds.max_ms_per_token),
            ms_per_queued_token: t[2].clamp(0.0, bounds.max_ms_per_token),
            ms_per_running: t[3].clamp(0.0, bounds.max_ms_per_running),
        }
    }
}

/// The ridge system's solution with the uncached- and queued-token coefficients equal: the
/// normal equations over the features `[1, uncached + queued, running]`.
fn tied(a: [[f64; N]; N], b: [f64; N]) -> Option<[f64; N]> {
    const GROUP: [usize; N] = [0, 1, 1, 2];
    let mut ra = [[0.0; 3]; 3];
    let mut rb = [0.0; 3];
    for i in 0..N {
        rb[GROUP[i]] += b[i];
        for j in 0..N {
            ra[GROUP[i]][GROUP[j]] += a[i][j];
        }
    }
    let [base, per_token, per_running] = solve(ra, rb)?;
    Some([base, per_token, per_token, per_running])
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
pub(super) const MAX_TPOT_MS: f64 = 10_000.0;
/// Samples (exponentially weighted) before the TPOT fit predicts anything.
const TPOT_MIN_SAMPLES: f64 = 4.0;

/// Time per output token after the first, `t0 + t1 · running`, fitted over the fleet's streamed
/// responses (forgotten like the TTFT fit); no prediction before [`TPOT_MIN_SAMPLES`].
#[derive(Debug, Clone, Default)]
pub(super) struct Tpot {
    xtx: [[f64; 2]; 2],
    xty: [f64; 2],
    weight: f64,
    pub(super) fit: Option<[f64; 2]>,
}

impl Tpot {
    pub(super) fn add(&mut self, running: f64, y: f64, keep: f64) {
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

    pub(super) fn predict(&self, running: u64) -> Option<f64> {
        self.fit
            .map(|[t0, t1]| (t0 + t1 * running as f64).min(MAX_TPOT_MS))
    }
}

/// Plausible ranges of the fitted values.
#[derive(Debug, Clone)]
pub(super) struct Bounds {
    pub(super) max_base_ms: f64,
    pub(super) min_ms_per_token: f64,
    pub(super) max_ms_per_token: f64,
    pub(super) max_ms_per_running: f64,
}

impl Fit {
    pub(super) fn scaled(self, k: f64) -> Fit {
        Fit {
            base_ms: self.base_ms * k,
            ms_per_token: self.ms_per_token * k,
            ms_per_queued_token: self.ms_per_queued_token * k,
            ms_per_running: self.ms_per_running * k,
        }
    }

    pub(super) fn predict(&self, x: [f64; N]) -> f64 {
        self.theta().iter().zip(x).map(|(t, x)| t * x).sum()
    }
}

pub(super) fn features(uncached: u64, queued: u64, running: u64) -> [f64; N] {
    [1.0, uncached as f64, queued as f64, running as f64]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unbounded() -> Bounds {
        Bounds {
            max_base_ms: f64::MAX,
            min_ms_per_token: 0.0,
            max_ms_per_token: f64::MAX,
            max_ms_per_running: f64::MAX,
        }
    }

    const PRIOR: Fit = Fit {
        base_ms: 0.0,
        ms_per_token: 0.05,
        ms_per_queued_token: 0.05,
        ms_per_running: 0.0,
    };

    #[test]
    fn a_consistent_engine_is_fitted_exactly() {
        // TTFT = 10 + 0.07·U + 0.03·Q + 2·R, varied features: s > q, no constraint binds.
        let mut l = Lsq::default();
        for i in 0..64u64 {
            let (u, q, r) = ((i * 37) % 900 + 50, (i * 53) % 1500, i % 7);
            let y = 10.0 + 0.07 * u as f64 + 0.03 * q as f64 + 2.0 * r as f64;
            l.add(features(u, q, r), y, 1.0);
        }
        let f = l.solve(PRIOR, 1e-6, &unbounded());
        for (got, want) in f.theta().iter().zip([10.0, 0.07, 0.03, 2.0]) {
            assert!((got - want).abs() < 1e-3, "{f:?}");
        }
    }

    #[test]
    fn a_burst_cannot_fit_uncached_tokens_cheaper_than_queued_ones() {
        // A burst: every prompt ~600 tokens, TTFT driven by the work queued ahead and stretched
        // by later arrivals (+ noise the features do not see). The free fit puts the prompts'
        // cost into the intercept (s ≈ 0 < q); under s ≥ q the two are tied.
        let mut l = Lsq::default();
        for i in 0..16u64 {
            let (u, q, r) = (600 + i % 3, i * 600, i % 4);
            let y = 150.0 + 0.09 * q as f64 + [30.0, -20.0, 10.0, -5.0][i as usize % 4];
            l.add(features(u, q, r), y, 1.0);
        }
        let free = solve(
            {
                let mut a = l.xtx;
                for (j, row) in a.iter_mut().enumerate() {
                    row[j] += 1e-6 * SCALE[j] * SCALE[j];
                }
                a
            },
            l.xty,
        )
        .unwrap();
        assert!(
            free[1] < free[2],
            "the unconstrained fit breaks s ≥ q: {free:?}"
        );
        let f = l.solve(PRIOR, 1e-6, &unbounded());
        assert_eq!(f.ms_per_token, f.ms_per_queued_token, "{f:?}");
        assert!(f.ms_per_token > 0.05, "{f:?}");
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

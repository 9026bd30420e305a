//! The demand reserve: capacity a lower band may not take because a higher band is predicted to
//! need it within the next service time.
//!
//! Each band keeps its recent arrivals as a count that decays exponentially with time constant
//! `τ = S / K`, where `S` is the pool's service time (an average of dispatch → completion over
//! completed requests) and `K` the configured factor. `recent / τ` is the band's arrival rate, so
//! its predicted arrivals over the next service time are `K · recent`; what the band already has in
//! flight is subtracted (those slots are taken and free again within `S`). A band may dispatch only
//! while in-flight requests plus the reserves of every band above it stay under the usage limit.
//!
//! A burst of higher-priority arrivals reserves about `K` times its recent count, so the
//! lower-priority requests that arrive with it wait until it is dispatched; a steady
//! higher-priority stream reserves only what its rate predicts beyond what it holds (a few
//! requests, for a few time constants after each arrival); a lower band alone, or after the higher
//! one went quiet, gets the whole pool.
//!
//! Settling: while requests keep arriving less than `settle` apart (a burst, counted over every
//! band) a band below the top one does not dispatch if its queue, together with the burst's
//! arrivals still to come (predicted from its rate so far), would fill the pool — for at most
//! `max_settle` from the burst's first arrival — so that a burst's higher-priority requests,
//! whichever order they reach the queue in, are dispatched before its lower-priority ones.
//! [`FlowController::next_wake`] tells the driver when settling ends.
//!
//! Deterministic: plain arithmetic on the command times, part of the replicated state.

use serde::{Deserialize, Serialize};

use super::{FlowController, Totals};
use crate::units::Nanos;

/// Service time assumed before any request completed.
pub const DEFAULT_SERVICE: Nanos = 1_000_000_000;

/// Weight of one completion in the service-time average.
const SERVICE_WEIGHT: f64 = 1.0 / 16.0;

/// The current burst of arrivals (any band): its first and latest arrival, how many so far.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(super) struct Burst {
    first: Nanos,
    last: Option<Nanos>,
    #[serde(default)]
    count: u64,
}

/// A band's recent arrivals: a count decaying with time constant `S / K`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(super) struct Recent {
    count: f64,
    at: Nanos,
}

impl Recent {
    fn decayed(&self, now: Nanos, tau: f64) -> f64 {
        if self.count <= 0.0 || tau <= 0.0 {
            return 0.0;
        }
        let dt = now.saturating_sub(self.at) as f64;
        self.count * (-dt / tau).exp()
    }
}

impl FlowController {
    /// The service time the reserve assumes, in ns.
    fn service_ns(&self) -> f64 {
        if self.service_ns > 0.0 {
            self.service_ns
        } else {
            DEFAULT_SERVICE as f64
        }
    }

    fn reserve_tau(&self) -> f64 {
        self.service_ns() / self.config.demand_reserve.factor.max(f64::MIN_POSITIVE)
    }

    /// `n` arrivals in band `b` at the current time.
    pub(super) fn note_arrivals(&mut self, b: u32, n: u64) {
        let cfg = self.config.demand_reserve;
        if !cfg.enabled() || n == 0 {
            return;
        }
        let (now, tau) = (self.now, self.reserve_tau());
        if self
            .burst
            .last
            .is_none_or(|last| now.saturating_sub(last) >= cfg.settle)
        {
            self.burst.first = now;
            self.burst.count = 0;
        }
        self.burst.last = Some(now);
        self.burst.count = self.burst.count.saturating_add(n);
        if cfg.factor <= 0.0 {
            return;
        }
        if let Some(band) = self.bands.get_mut(b as usize) {
            band.recent = Recent {
                count: band.recent.decayed(now, tau) + n as f64,
                at: now,
            };
        }
    }

    /// A request dispatched at `dispatched_at` completed now.
    pub(super) fn note_service(&mut self, dispatched_at: Nanos) {
        let d = self.now.saturating_sub(dispatched_at) as f64;
        self.service_ns = if self.service_ns > 0.0 {
            self.service_ns + (d - self.service_ns) * SERVICE_WEIGHT
        } else {
            d.max(1.0)
        };
    }

    /// Whether a burst is still arriving and holds the lower bands back.
    fn settling(&self) -> bool {
        self.settling_at(self.now)
    }

    fn settling_at(&self, now: Nanos) -> bool {
        let cfg = self.config.demand_reserve;
        // One arrival is no burst.
        cfg.settle > 0
            && self.burst.count >= 2
            && self.burst.last.is_some_and(|last| {
                now.saturating_sub(last) < cfg.settle
                    && now.saturating_sub(self.burst.first) < cfg.max_settle
            })
    }

    /// Whether band `b`, below the top band, waits for the burst to settle: a burst is arriving
    /// and `b`'s queue would fill the pool (`extra` = the reserve above it).
    pub(super) fn settle_gated(&self, b: u32, probe: &super::dispatch::Probe, extra: f64) -> bool {
        if self.band_order.first() == Some(&b) || !self.settling() {
            return false;
        }
        let queued = self.bands.get(b as usize).map_or(0, |band| band.queued);
        let more = self.burst_to_come(self.now);
        let sat = probe.eval_reserving(&self.totals, extra + queued as f64 + more);
        sat >= self.ceiling(b, sat)
    }

    /// The current burst's arrivals still to come, predicted from its rate so far over the next
    /// `settle`: `count · settle / elapsed` (elapsed at least 1 ms). A request that arrives on
    /// its own is no burst and is never held.
    fn burst_to_come(&self, now: Nanos) -> f64 {
        let elapsed = now.saturating_sub(self.burst.first).max(1_000_000) as f64;
        (self.burst.count as f64 * self.config.demand_reserve.settle as f64 / elapsed).min(1e9)
    }

    /// When the driver should next `Tick` the machine even if nothing happens: the end of the
    /// current burst's settling, while requests wait for it. `None`: no timer needed.
    pub fn next_wake(&self) -> Option<Nanos> {
        if self.totals.queued_requests == 0 || !self.settling() {
            return None;
        }
        let cfg = self.config.demand_reserve;
        let last = self.burst.last?;
        Some(
            last.saturating_add(cfg.settle)
                .min(self.burst.first.saturating_add(cfg.max_settle)),
        )
    }

    /// Requests the bands above band `b` are predicted to need beyond what they have in flight.
    pub(super) fn reserve_above(&self, b: u32) -> f64 {
        let priority = self
            .bands
            .get(b as usize)
            .map_or(i32::MAX, |band| band.priority);
        self.reserve_above_priority(priority, self.now)
    }

    /// [`Self::reserve_above`] for a request of `priority` at `now` (its band may not exist yet).
    pub(super) fn reserve_above_priority(&self, priority: i32, now: Nanos) -> f64 {
        let k = self.config.demand_reserve.factor;
        if k <= 0.0 {
            return 0.0;
        }
        let tau = self.reserve_tau();
        self.band_order
            .iter()
            .filter_map(|&h| self.bands.get(h as usize))
            .take_while(|h| h.priority > priority)
            .map(|h| (k * h.recent.decayed(now, tau) - h.inflight as f64).max(0.0))
            .sum()
    }

    /// Whether a request of `priority`, below the top band, would wait for the current burst to
    /// settle if it arrived at `now` with the ledger `totals` and `reserve` (the local-credit fast
    /// path asks this with its credit outstanding counted in).
    pub(super) fn settles_at(
        &self,
        priority: i32,
        now: Nanos,
        totals: &Totals,
        reserve: f64,
    ) -> bool {
        let top = self
            .band_order
            .first()
            .and_then(|&b| self.bands.get(b as usize))
            .map_or(i32::MIN, |b| b.priority);
        if priority >= top || !self.settling_at(now) {
            return false;
        }
        let probe = self.probe(now);
        let sat = probe.eval_reserving(totals, reserve + 1.0 + self.burst_to_come(now));
        sat >= self.ceiling_for(priority, sat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_decays_by_e_per_time_constant() {
        let r = Recent { count: 8.0, at: 0 };
        assert_eq!(r.decayed(0, 10.0), 8.0);
        assert!((r.decayed(10, 10.0) - 8.0 / std::f64::consts::E).abs() < 1e-9);
        assert_eq!(Recent::default().decayed(5, 10.0), 0.0);
    }
}

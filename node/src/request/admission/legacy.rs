//! llm-d's legacy admission controller (the `flowControl` gate off): a sheddable request
//! (priority < 0) is refused with 429 while the saturation detector says the pool is saturated;
//! every other request passes; nothing waits.

use std::sync::Arc;
use std::time::Instant;

use flowctl::{
    ConcurrencyDetector, EndpointLoad, EndpointSnapshot, Nanos, SaturationDetector,
    UtilizationDetector,
};
use futures::future::BoxFuture;

use super::{Admit, AdmitRequest, Gate, nanos_since, snapshot};
use crate::config::ConfigError;
use crate::datalayer::Datastore;
use crate::datalayer::inflight::InflightTracker;
use crate::datalayer::store::Candidate;
use crate::request::reject::Rejection;

/// llm-d's legacy admission controller (the `flowControl` gate off).
#[derive(Debug)]
pub struct LegacyAdmission {
    detector: SaturationDetector,
    /// The concurrency detector counts in-flight requests from the in-flight ledger.
    inflight: Option<Arc<InflightTracker>>,
    store: Arc<Datastore>,
    epoch: Instant,
}

impl LegacyAdmission {
    pub fn new(
        detector: SaturationDetector,
        inflight: Option<Arc<InflightTracker>>,
        store: Arc<Datastore>,
    ) -> Result<Self, ConfigError> {
        if matches!(detector, SaturationDetector::Concurrency(_)) && inflight.is_none() {
            return Err(ConfigError::invalid(
                "saturationDetector: `concurrency-detector` without the flowControl gate needs the \
                 in-flight ledger; add `inflight-load-producer` (or a scorer that uses it) to the \
                 plugins",
            ));
        }
        Ok(LegacyAdmission {
            detector,
            inflight,
            store,
            epoch: Instant::now(),
        })
    }

    /// Pool saturation over the current candidates.
    pub fn saturation(&self, candidates: &[Candidate], now: Instant) -> f64 {
        match &self.detector {
            SaturationDetector::Utilization(d) => {
                utilization(d, self.epoch, candidates, nanos_since(self.epoch, now))
            }
            SaturationDetector::Concurrency(d) => {
                concurrency(d, self.inflight.as_deref(), candidates)
            }
        }
    }

    /// Whether the request must be refused (429, no dropped-reason header).
    pub fn check(&self, priority: i32, candidates: &[Candidate], now: Instant) -> bool {
        // Only sheddable requests are checked; skip the detector otherwise.
        priority < 0
            && flowctl::legacy_admission(priority, self.saturation(candidates, now))
                == flowctl::LegacyAdmission::Reject
    }
}

fn utilization(
    d: &UtilizationDetector,
    epoch: Instant,
    candidates: &[Candidate],
    now: Nanos,
) -> f64 {
    let snaps: Vec<EndpointSnapshot> = candidates.iter().map(|c| snapshot(epoch, c)).collect();
    d.saturation(&snaps, now)
}

fn concurrency(
    d: &ConcurrencyDetector,
    tracker: Option<&InflightTracker>,
    candidates: &[Candidate],
) -> f64 {
    let loads: Vec<EndpointLoad> = candidates
        .iter()
        .map(|c| {
            let l = tracker
                .map(|t| t.load(&c.endpoint.hostport))
                .unwrap_or_default();
            EndpointLoad {
                inflight_requests: l.requests,
                inflight_tokens: l.tokens,
            }
        })
        .collect();
    d.saturation(&loads)
}

impl Gate for LegacyAdmission {
    fn admit<'a>(self: Arc<Self>, req: AdmitRequest<'a>) -> BoxFuture<'a, Admit> {
        // Only sheddable requests are checked: skip the snapshot for the others.
        let refused = req.meta.priority < 0 && {
            let now = Instant::now();
            self.check(req.meta.priority, &self.store.candidates(now), now)
        };
        let admit = if refused {
            Admit::Refused(Rejection::sheddable_saturated())
        } else {
            Admit::Now(None)
        };
        Box::pin(std::future::ready(admit))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn legacy_controller_sheds_only_sheddable_requests_when_saturated() {
        use crate::datalayer::testutil::{cand, metrics};
        let store = || Arc::new(Datastore::new(Duration::from_secs(2)));
        let legacy = LegacyAdmission::new(SaturationDetector::default(), None, store()).unwrap();
        let now = Instant::now();
        // Waiting queues 10 and 6 against the default threshold 5: saturation (2 + 1.2)/2 ≥ 1.
        let busy = [
            cand("a", metrics(10.0, 0.0, 0.1), false),
            cand("b", metrics(6.0, 0.0, 0.1), false),
        ];
        assert!(legacy.check(-1, &busy, now));
        assert!(
            !legacy.check(0, &busy, now),
            "non-sheddable requests always pass"
        );
        let idle = [
            cand("a", metrics(1.0, 0.0, 0.1), false),
            cand("b", metrics(0.0, 0.0, 0.1), false),
        ];
        assert!(!legacy.check(-1, &idle, now));
        // No metrics at all counts as saturated (fail closed), as llm-d.
        assert!(legacy.check(-1, &[cand("a", None, false)], now));
        // The concurrency detector needs the in-flight ledger.
        let e = LegacyAdmission::new(
            SaturationDetector::Concurrency(ConcurrencyDetector::default()),
            None,
            store(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("inflight-load-producer"), "{e}");
    }
}

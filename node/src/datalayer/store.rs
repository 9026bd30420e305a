//! The datastore: the current endpoint set, swapped whole on every discovery change so the
//! request path takes one cheap snapshot (an `Arc` clone) and never contends with writers.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::endpoint::{Endpoint, EndpointMetrics, MetricsSample};

/// An endpoint with the metrics sample seen when the snapshot was taken.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub endpoint: Arc<Endpoint>,
    pub sample: Option<Arc<MetricsSample>>,
    /// No sample yet, or older than the staleness threshold.
    pub stale: bool,
}

impl Candidate {
    /// Metrics usable for scoring: `None` if never scraped or stale.
    pub fn metrics(&self) -> Option<&super::EndpointMetrics> {
        if self.stale {
            None
        } else {
            self.sample.as_ref().map(|s| &s.metrics)
        }
    }
}

#[derive(Debug)]
pub struct Datastore {
    endpoints: RwLock<Arc<Vec<Arc<Endpoint>>>>,
    /// Which pods this replica scrapes (all of them outside cluster mode).
    pub shard: Arc<super::shard::Shard>,
    staleness: Duration,
    synced: std::sync::atomic::AtomicBool,
    /// The in-flight ledger, when the scheduler keeps one: which requests routed to a pod have
    /// not had their first response bytes ([`Endpoint::set_metrics`] learns batch limits by it).
    ledger: std::sync::OnceLock<Arc<super::inflight::InflightTracker>>,
}

impl Datastore {
    pub fn new(staleness: Duration) -> Self {
        Datastore {
            endpoints: RwLock::new(Arc::new(Vec::new())),
            shard: Arc::default(),
            staleness,
            synced: std::sync::atomic::AtomicBool::new(false),
            ledger: std::sync::OnceLock::new(),
        }
    }

    /// Read the in-flight ledger from now on (once).
    pub fn set_ledger(&self, ledger: Arc<super::inflight::InflightTracker>) {
        let _ = self.ledger.set(ledger);
    }

    /// Store a fresh sample of `ep`'s metrics, with the ledger's load on it (see
    /// [`Endpoint::set_metrics`]).
    pub fn set_metrics(&self, ep: &Endpoint, metrics: EndpointMetrics, scraped_at: Instant) {
        let ledger = self.ledger.get().map(|l| l.load(&ep.hostport));
        ep.set_metrics(metrics, scraped_at, ledger);
    }

    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        match self.endpoints.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// The `ip:port` of every endpoint in the pool.
    pub fn hostports(&self) -> std::collections::HashSet<String> {
        self.endpoints()
            .iter()
            .map(|e| e.hostport.clone())
            .collect()
    }

    pub fn replace(&self, endpoints: Vec<Arc<Endpoint>>) {
        let new = Arc::new(endpoints);
        match self.endpoints.write() {
            Ok(mut g) => *g = new,
            Err(p) => *p.into_inner() = new,
        }
        self.synced
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// True once discovery has loaded an endpoint list at least once.
    pub fn synced(&self) -> bool {
        self.synced.load(std::sync::atomic::Ordering::Acquire)
    }

    /// All endpoints with their current metrics, marked stale by age.
    pub fn candidates(&self, now: Instant) -> Vec<Candidate> {
        self.endpoints()
            .iter()
            .map(|ep| {
                let sample = ep.sample();
                let stale = match &sample {
                    Some(s) => now.saturating_duration_since(s.scraped_at) > self.staleness,
                    None => true,
                };
                Candidate {
                    endpoint: ep.clone(),
                    sample,
                    stale,
                }
            })
            .collect()
    }
}

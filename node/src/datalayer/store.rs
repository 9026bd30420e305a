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

/// The endpoints by `ip:port`, built once per endpoint-set change: peers' samples, gossip and
/// KV-event bookkeeping look pods up by address many times a second, which must not rebuild a
/// set of the whole pool each time (1000 pods: a few ms per peer message).
pub type ByHostport = foldhash::HashMap<String, Arc<Endpoint>>;

/// How long the request path reuses one snapshot of the pool ([`Datastore::snapshot`]).
/// Samples are a scrape interval old already (50 ms by default); the in-flight ledger, which
/// moves with every decision, is read live.
pub const SNAPSHOT_TTL: Duration = Duration::from_millis(2);

/// The pool as the request path last saw it.
#[derive(Debug)]
struct Snapshot {
    taken: Instant,
    /// The endpoint list it was taken from: a new list (discovery) invalidates it.
    endpoints: Arc<Vec<Arc<Endpoint>>>,
    candidates: Arc<Vec<Candidate>>,
}

#[derive(Debug)]
pub struct Datastore {
    endpoints: RwLock<Arc<Vec<Arc<Endpoint>>>>,
    snapshot: RwLock<Option<Snapshot>>,
    by_hostport: RwLock<Arc<ByHostport>>,
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
            snapshot: RwLock::new(None),
            by_hostport: RwLock::new(Arc::default()),
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

    /// Every endpoint of the pool by its `ip:port` (a shared snapshot: cheap to take).
    pub fn by_hostport(&self) -> Arc<ByHostport> {
        match self.by_hostport.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    pub fn replace(&self, endpoints: Vec<Arc<Endpoint>>) {
        let index: ByHostport = endpoints
            .iter()
            .map(|e| (e.hostport.clone(), e.clone()))
            .collect();
        // The index first: a reader may see the new index with the old list for an instant
        // (pods just added are then known by address before they are candidates), never a
        // candidate unknown by address.
        match self.by_hostport.write() {
            Ok(mut g) => *g = Arc::new(index),
            Err(p) => *p.into_inner() = Arc::new(index),
        }
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
            .map(|ep| self.candidate_of(ep, now))
            .collect()
    }

    /// [`Self::candidates`] for the request path: one snapshot shared by the decisions of the
    /// next [`SNAPSHOT_TTL`] (or until the endpoint list changes) — at 1000 pods, taking it costs
    /// two reference counts per pod and a lock per sample, a quarter of a decision.
    pub fn snapshot(&self, now: Instant) -> Arc<Vec<Candidate>> {
        let endpoints = self.endpoints();
        {
            let guard = self.snapshot.read().unwrap_or_else(|p| p.into_inner());
            if let Some(s) = guard.as_ref()
                && Arc::ptr_eq(&s.endpoints, &endpoints)
                && now.saturating_duration_since(s.taken) < SNAPSHOT_TTL
            {
                return s.candidates.clone();
            }
        }
        let candidates: Arc<Vec<Candidate>> = Arc::new(
            endpoints
                .iter()
                .map(|ep| self.candidate_of(ep, now))
                .collect(),
        );
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Some(Snapshot {
            taken: now,
            endpoints,
            candidates: candidates.clone(),
        });
        candidates
    }

    /// The endpoint at `hostport` as [`Self::candidates`] shows it (one lookup, not a snapshot of
    /// the pool).
    pub fn candidate(&self, hostport: &str, now: Instant) -> Option<Candidate> {
        self.by_hostport()
            .get(hostport)
            .map(|ep| self.candidate_of(ep, now))
    }

    fn candidate_of(&self, ep: &Arc<Endpoint>, now: Instant) -> Candidate {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(port: u16) -> Arc<Endpoint> {
        Arc::new(Endpoint::new(
            format!("p{port}"),
            format!("127.0.0.1:{port}").parse().unwrap(),
            Default::default(),
        ))
    }

    #[test]
    fn the_snapshot_is_shared_for_its_ttl_and_until_the_pool_changes() {
        let store = Datastore::new(Duration::from_secs(1));
        store.replace(vec![endpoint(1), endpoint(2)]);
        let t0 = Instant::now();
        let a = store.snapshot(t0);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|c| c.stale), "never scraped");
        let b = store.snapshot(t0 + SNAPSHOT_TTL / 2);
        assert!(Arc::ptr_eq(&a, &b), "shared within the TTL");
        // A sample taken meanwhile shows in the next snapshot, not in the shared one.
        let m = EndpointMetrics {
            running_requests: Some(1.0),
            ..Default::default()
        };
        store.set_metrics(&a[0].endpoint, m, t0);
        let c = store.snapshot(t0 + SNAPSHOT_TTL);
        assert!(!Arc::ptr_eq(&a, &c), "taken again after the TTL");
        assert!(!c[0].stale && c[1].stale);
        // Discovery's new list invalidates it at once.
        store.replace(vec![endpoint(3)]);
        let d = store.snapshot(t0 + SNAPSHOT_TTL);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].endpoint.hostport, "127.0.0.1:3");
    }
}

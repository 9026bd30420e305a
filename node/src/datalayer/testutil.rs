//! Test helpers: candidates with given metrics.

use std::sync::Arc;
use std::time::Instant;

use super::store::Candidate;
use super::{Endpoint, EndpointMetrics};

pub fn cand(name: &str, m: Option<EndpointMetrics>, stale: bool) -> Candidate {
    cand_at(name, "127.0.0.1:1", m, stale, &[])
}

pub fn cand_at(
    name: &str,
    addr: &str,
    m: Option<EndpointMetrics>,
    stale: bool,
    labels: &[(&str, &str)],
) -> Candidate {
    let ep = Arc::new(Endpoint::new(
        name.into(),
        addr.parse().unwrap(),
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    ));
    if let Some(m) = m {
        ep.set_metrics(m, Instant::now(), None);
    }
    Candidate {
        sample: ep.sample(),
        endpoint: ep,
        stale,
    }
}

pub fn metrics(q: f64, running: f64, kv: f64) -> Option<EndpointMetrics> {
    Some(EndpointMetrics {
        waiting_queue_size: Some(q),
        running_requests: Some(running),
        kv_cache_usage: Some(kv),
        ..Default::default()
    })
}

/// `c` with its metrics scraped a second time: a pod whose requests still wait a scrape later
/// ([`Endpoint::queueing`]).
pub fn scraped_twice(c: Candidate) -> Candidate {
    if let Some(s) = &c.sample {
        c.endpoint
            .set_metrics(s.metrics.clone(), s.scraped_at, None);
    }
    Candidate {
        sample: c.endpoint.sample(),
        ..c
    }
}

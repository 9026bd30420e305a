//! Pods that left the pool: what the replica learned about them (prefix-index entries, response
//! bindings) is dropped once they have been gone for `--forget-departed-after`, so memory follows
//! the pool instead of every pod that ever was. A pod back within that time (a readiness flap, a
//! discovery hiccup) keeps its warm entries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::prefix::ApproxPrefixProducer;
use crate::datalayer::Datastore;
use crate::datalayer::responses::ResponseBindings;

/// When each pod that some index still holds was first seen missing from the pool.
#[derive(Debug, Default)]
pub struct Departures {
    missing_since: HashMap<String, Instant>,
}

impl Departures {
    /// Of the pods `held`, those absent from `live` for at least `grace` by `now` (forgotten
    /// here too); a pod back in `live` starts over.
    pub fn due(
        &mut self,
        held: &HashSet<String>,
        live: &HashSet<&str>,
        grace: Duration,
        now: Instant,
    ) -> Vec<String> {
        self.missing_since
            .retain(|pod, _| held.contains(pod) && !live.contains(pod.as_str()));
        let mut due = Vec::new();
        for pod in held.iter().filter(|p| !live.contains(p.as_str())) {
            let since = *self.missing_since.entry(pod.clone()).or_insert(now);
            if now.duration_since(since) >= grace {
                due.push(pod.clone());
            }
        }
        for pod in &due {
            self.missing_since.remove(pod);
        }
        due.sort_unstable();
        due
    }
}

/// Drop from the prefix index and the response bindings the pods that have been out of the pool
/// for `grace` (checked every quarter of it, 100 ms to 5 s), until `stop`.
pub async fn run(
    store: Arc<Datastore>,
    prefix: Option<Arc<ApproxPrefixProducer>>,
    responses: Arc<ResponseBindings>,
    grace: Duration,
    stop: CancellationToken,
) {
    let tick = (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut departures = Departures::default();
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        if !store.synced() {
            continue;
        }
        let endpoints = store.endpoints();
        let live: HashSet<&str> = endpoints.iter().map(|e| e.hostport.as_str()).collect();
        let mut held: HashSet<String> = responses.pods().into_iter().collect();
        if let Some(p) = &prefix {
            held.extend(p.pods());
        }
        let due = departures.due(&held, &live, grace, Instant::now());
        if due.is_empty() {
            continue;
        }
        tracing::info!(pods = ?due, "forgetting pods that left the pool");
        if let Some(p) = &prefix {
            p.forget(&due);
        }
        responses.forget(&due);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_forgotten_after_the_grace_and_not_if_it_comes_back() {
        let mut d = Departures::default();
        let held: HashSet<String> = ["a", "b"].into_iter().map(String::from).collect();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let live_a: HashSet<&str> = ["a"].into_iter().collect();
        let none: HashSet<&str> = HashSet::new();
        assert!(d.due(&held, &live_a, 10 * s, t0).is_empty(), "b just left");
        // a leaves too; b comes back before its grace is over, then leaves again.
        assert!(d.due(&held, &none, 10 * s, t0 + 5 * s).is_empty());
        let live_b: HashSet<&str> = ["b"].into_iter().collect();
        assert!(d.due(&held, &live_b, 10 * s, t0 + 9 * s).is_empty());
        assert_eq!(d.due(&held, &live_b, 10 * s, t0 + 15 * s), vec!["a"]);
        let held: HashSet<String> = ["b"].into_iter().map(String::from).collect();
        assert!(
            d.due(&held, &none, 10 * s, t0 + 16 * s).is_empty(),
            "b's clock restarted"
        );
        assert_eq!(d.due(&held, &none, 10 * s, t0 + 26 * s), vec!["b"]);
    }
}

//! Sharded collection (cluster mode): which replicas scrape which pod.
//!
//! A pod's owners are the `R` live members with the highest rendezvous score `xxh3(pod, member)`;
//! only they scrape it, and they fan what they scraped out to every other replica
//! (`crate::cluster::gossip`), which keeps the newest sample by its original scrape time. When members
//! come and go only the pods of the changed member move. Live = heard from within two seconds
//! (`crate::cluster::gossip`: every replica sends a fan-out batch to every peer every 50 ms, empty or
//! not). A replica always counts itself live: cut off from the others it owns, and scrapes, every
//! pod. `R = 0` (and standalone mode) means every replica scrapes every pod.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

use super::endpoint::EndpointMetrics;

#[derive(Debug, Default)]
struct Owners {
    me: u64,
    /// Live members, this replica included, sorted.
    members: Vec<u64>,
    /// Owners per pod; 0 = every replica.
    r: usize,
}

/// What this replica scrapes, and its scrapes waiting to be fanned out.
#[derive(Debug, Default)]
pub struct Shard {
    owners: RwLock<Owners>,
    /// pod → (latest sample, scrape time in µs since the UNIX epoch); only when fanning out.
    outbox: Mutex<Option<HashMap<String, (EndpointMetrics, u64)>>>,
}

fn score(pod: &str, member: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(pod.as_bytes(), member)
}

impl Shard {
    /// Cluster mode: this replica is `me`; each pod gets `r` owners (0 = every replica), and
    /// scrapes are queued for fan-out.
    pub fn configure(&self, me: u64, r: usize) {
        {
            let mut o = self.owners.write().unwrap_or_else(|p| p.into_inner());
            o.me = me;
            o.r = r;
            o.members = vec![me];
        }
        if r > 0 {
            *self.outbox.lock().unwrap_or_else(|p| p.into_inner()) = Some(HashMap::new());
        }
    }

    /// The live members (this replica is added if missing).
    pub fn set_members(&self, mut live: Vec<u64>) {
        let mut o = self.owners.write().unwrap_or_else(|p| p.into_inner());
        live.push(o.me);
        live.sort_unstable();
        live.dedup();
        o.members = live;
    }

    /// `(owners per pod, live members)`; 0 owners = every replica scrapes.
    pub fn layout(&self) -> (usize, Vec<u64>) {
        let o = self.owners.read().unwrap_or_else(|p| p.into_inner());
        (o.r, o.members.clone())
    }

    /// The members that scrape `pod`, highest score first.
    pub fn owners(&self, pod: &str) -> Vec<u64> {
        let o = self.owners.read().unwrap_or_else(|p| p.into_inner());
        let mut ranked: Vec<(u64, u64)> = o.members.iter().map(|m| (score(pod, *m), *m)).collect();
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        let n = if o.r == 0 { ranked.len() } else { o.r };
        ranked.into_iter().take(n).map(|(_, m)| m).collect()
    }

    /// Whether this replica scrapes `pod`.
    pub fn owns(&self, pod: &str) -> bool {
        let o = self.owners.read().unwrap_or_else(|p| p.into_inner());
        if o.r == 0 || o.members.len() <= o.r {
            return true;
        }
        let mine = score(pod, o.me);
        // Owned if fewer than r members outrank this one.
        let above = o
            .members
            .iter()
            .filter(|m| **m != o.me && (score(pod, **m), **m) > (mine, o.me))
            .count();
        above < o.r
    }

    /// Queue a scrape for the next fan-out (no-op unless fanning out).
    pub fn publish(&self, pod: &str, metrics: &EndpointMetrics, scraped_unix_us: u64) {
        let mut out = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = out.as_mut() {
            map.insert(pod.to_string(), (metrics.clone(), scraped_unix_us));
        }
    }

    /// Everything queued since the last call.
    pub fn take(&self) -> Vec<(String, EndpointMetrics, u64)> {
        let mut out = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
        match out.as_mut() {
            Some(map) => map.drain().map(|(k, (m, t))| (k, m, t)).collect(),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Vec<String> {
        (0..500)
            .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250))
            .collect()
    }

    fn shard(me: u64, r: usize, members: &[u64]) -> Shard {
        let s = Shard::default();
        s.configure(me, r);
        s.set_members(members.to_vec());
        s
    }

    #[test]
    fn every_pod_has_exactly_r_owners_and_owners_agree() {
        let members = [1, 2, 3, 4];
        let shards: Vec<Shard> = members.iter().map(|m| shard(*m, 2, &members)).collect();
        let mut per_member = [0usize; 4];
        for pod in pods() {
            let owning: Vec<u64> = shards
                .iter()
                .zip(members)
                .filter(|(s, _)| s.owns(&pod))
                .map(|(_, m)| m)
                .collect();
            assert_eq!(owning.len(), 2, "{pod}: {owning:?}");
            // every replica computes the same owner list, and it matches `owns`
            let mut listed = shards[0].owners(&pod);
            listed.sort_unstable();
            assert_eq!(listed, owning);
            for m in owning {
                per_member[(m - 1) as usize] += 1;
            }
        }
        // spread: each member owns about half of the 500 pods
        for n in per_member {
            assert!((180..=320).contains(&n), "{per_member:?}");
        }
    }

    #[test]
    fn a_leaving_member_moves_only_its_pods() {
        let before = shard(1, 1, &[1, 2, 3]);
        let after = shard(1, 1, &[1, 2]);
        for pod in pods() {
            let (b, a) = (before.owners(&pod), after.owners(&pod));
            if b[0] != 3 {
                assert_eq!(a, b, "{pod} moved without its owner leaving");
            }
            assert_ne!(a[0], 3);
        }
    }

    #[test]
    fn zero_owners_or_a_lone_replica_scrapes_everything() {
        assert!(pods().iter().all(|p| shard(1, 0, &[1, 2, 3]).owns(p)));
        // cut off: the others' leases look expired, so it owns everything
        assert!(pods().iter().all(|p| shard(2, 1, &[]).owns(p)));
        let standalone = Shard::default();
        assert!(standalone.owns("10.0.0.1:8000"));
        standalone.publish("10.0.0.1:8000", &EndpointMetrics::default(), 1);
        assert!(
            standalone.take().is_empty(),
            "standalone replicas do not fan out"
        );
        let s = shard(1, 2, &[1, 2, 3]);
        s.publish("a", &EndpointMetrics::default(), 1);
        s.publish("a", &EndpointMetrics::default(), 2);
        let taken = s.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].2, 2);
        assert!(s.take().is_empty());
    }
}

//! Where each stored response lives: affinity for the Responses API's server-side state.
//!
//! A `/v1/responses` request naming `previous_response_id` continues a conversation the engine
//! stored in one pod's memory; any other pod answers 404. The observing stream learns which pod
//! served each response (its `id`, from the body or the stream's `response.created` /
//! `response.completed` events) and binds the id to that pod here; the routing stream looks the
//! id up and pins the follow-up to the pod while it is in the pool.
//!
//! The bindings are an [`ApproxIndex`] keyed by a hash of the response id, so they replicate
//! exactly as the prefix index does (a state-based CRDT in the gossip's `responses` space): every
//! replica learns a binding whichever replica observed the response. Each pod keeps its
//! newest [`ResponseBindings::new`]`(_, per_pod)` bindings; a binding older than the TTL is
//! ignored (and eventually evicted by newer ones); a recreated pod (higher incarnation, from its
//! start time) drops its old bindings, as the engine lost them.

use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use index::{ApproxIndex, DeltaSink, Hlc, PodDigest, PodMatch, PodState, Replicated};

use super::Endpoint;
use super::scraper::unix_us;

/// Seeds the response-id hash (a key space apart from the prefix index's block hashes).
const KEY_SEED: u64 = 0x7265_7370_6f6e_7365; // "response"

/// Defaults of `--response-affinity-ttl` and `--response-affinity-per-pod`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
pub const DEFAULT_PER_POD: usize = 16_384;

/// How long a follow-up naming an unknown response waits for its binding: the client may have
/// read the response's end before the observing stream reported it, or before the replica that
/// observed it gossiped the binding (one flush interval).
pub const BINDING_GRACE: Duration = Duration::from_millis(250);

/// What the bindings know of a response id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// Served by this pod (`epoch`: the pod's incarnation then).
    Pod { hostport: String, epoch: u64 },
    /// Bound once, longer ago than the TTL.
    Expired,
    /// Never seen (or evicted): another EPP deployment, a response older than the bound, or a
    /// forged id.
    Unknown,
}

#[derive(Debug)]
struct Indexed {
    index: ApproxIndex,
    clock: Hlc,
}

/// The response id → pod bindings of the pool (see the module docs).
#[derive(Debug)]
pub struct ResponseBindings {
    state: RwLock<Indexed>,
    ttl: Duration,
    outbox: OnceLock<Arc<dyn DeltaSink>>,
    /// Signalled whenever bindings are added (locally or by a peer), for [`Self::lookup_within`].
    added: tokio::sync::Notify,
}

fn key(response_id: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(response_id.as_bytes(), KEY_SEED)
}

impl ResponseBindings {
    /// Bindings kept `ttl`, at most `per_pod` per pod (the newest).
    pub fn new(ttl: Duration, per_pod: usize) -> Self {
        ResponseBindings {
            state: RwLock::new(Indexed {
                index: ApproxIndex::new(per_pod.max(1)),
                clock: Hlc::default(),
            }),
            ttl,
            outbox: OnceLock::new(),
            added: tokio::sync::Notify::new(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Indexed> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Indexed> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// `pod` served the response `response_id` (replicated when gossip is on).
    pub fn bind(&self, response_id: &str, pod: &Endpoint) {
        if response_id.is_empty() {
            return;
        }
        let epoch = pod.sample().and_then(|s| s.metrics.started_ms).unwrap_or(0);
        let h = key(response_id);
        let mut st = self.write();
        let ts = st.clock.now(unix_us());
        let id = st.index.pod_with_epoch(&pod.hostport, epoch);
        match self.outbox.get() {
            Some(out) => {
                if let Some(delta) = st.index.insert_delta(id, &[h], ts) {
                    out.push(delta);
                }
            }
            None => st.index.insert(id, &[h], ts),
        }
        drop(st);
        self.added.notify_waiters();
    }

    /// [`Self::lookup`], waiting up to `grace` for an unknown id to be bound.
    pub async fn lookup_within(&self, response_id: &str, grace: Duration) -> Binding {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            match self.lookup(response_id) {
                Binding::Unknown if tokio::time::Instant::now() < deadline => {
                    if tokio::time::timeout_at(deadline, added).await.is_err() {
                        return self.lookup(response_id);
                    }
                }
                found => return found,
            }
        }
    }

    /// Where `response_id` lives: the pod that served it most recently (a hash collision or a
    /// re-bound id: the newest wins).
    pub fn lookup(&self, response_id: &str) -> Binding {
        let h = key(response_id);
        let st = self.read();
        let mut found: Vec<PodMatch> = Vec::new();
        st.index.match_prefix(&[h], &mut found);
        let newest = found
            .iter()
            .filter_map(|m| Some((st.index.timestamp(m.pod, h)?, m.pod)))
            .max();
        let Some((ts, pod)) = newest else {
            return Binding::Unknown;
        };
        if unix_us().saturating_sub(ts) > self.ttl.as_micros() as u64 {
            return Binding::Expired;
        }
        match (st.index.pod_name(pod), st.index.epoch(pod)) {
            (Some(name), Some(epoch)) => Binding::Pod {
                hostport: name.to_string(),
                epoch,
            },
            _ => Binding::Unknown,
        }
    }

    /// The pods holding bindings.
    pub fn pods(&self) -> Vec<String> {
        self.read().index.pod_names()
    }

    /// Drop every binding to `pods` (they left the pool).
    pub fn forget(&self, pods: &[String]) {
        let mut st = self.write();
        for p in pods {
            st.index.remove_pod(p);
        }
    }

    /// Bindings held over all pods (`epp_response_bindings`).
    pub fn len(&self) -> usize {
        self.read().index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Replicated in the gossip's `responses` space.
impl Replicated for ResponseBindings {
    fn replicate_into(&self, sink: Arc<dyn DeltaSink>) -> bool {
        self.outbox.set(sink).is_ok()
    }

    fn merge(&self, states: &[PodState]) -> (usize, u64) {
        let mut st = self.write();
        let (changed, newest) = st.index.merge_pods(states);
        st.clock.observe(newest);
        drop(st);
        if changed > 0 {
            self.added.notify_waiters();
        }
        (changed, newest)
    }

    fn digests(&self) -> Vec<PodDigest> {
        self.read().index.digests()
    }

    fn export(&self, pods: &[String]) -> Vec<PodState> {
        self.read().index.export_pods(pods)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalayer::store::Candidate;
    use crate::datalayer::testutil::cand_at;

    impl ResponseBindings {
        fn bind_test(&self, id: &str, pod: &Candidate) {
            self.bind(id, &pod.endpoint);
        }
    }

    fn pods(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| {
                cand_at(
                    &format!("p{i}"),
                    &format!("10.0.0.{i}:8000"),
                    None,
                    false,
                    &[],
                )
            })
            .collect()
    }

    #[test]
    fn a_bound_response_is_found_on_its_pod_and_expires() {
        let b = ResponseBindings::new(Duration::from_secs(3600), 4);
        let pods = pods(2);
        assert_eq!(b.lookup("resp_1"), Binding::Unknown);
        b.bind_test("resp_1", &pods[1]);
        b.bind_test("resp_2", &pods[0]);
        assert!(
            matches!(b.lookup("resp_1"), Binding::Pod { ref hostport, .. } if *hostport == pods[1].endpoint.hostport)
        );
        assert!(
            matches!(b.lookup("resp_2"), Binding::Pod { ref hostport, .. } if *hostport == pods[0].endpoint.hostport)
        );
        assert_eq!(b.lookup("resp_3"), Binding::Unknown);
        assert_eq!(b.len(), 2);

        let short = ResponseBindings::new(Duration::ZERO, 4);
        short.bind_test("resp_1", &pods[0]);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(short.lookup("resp_1"), Binding::Expired);
    }

    #[tokio::test]
    async fn a_follow_up_waits_the_grace_for_its_binding() {
        let b = Arc::new(ResponseBindings::new(DEFAULT_TTL, 8));
        let pods = pods(1);
        let binder = {
            let (b, pod) = (b.clone(), pods[0].clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                b.bind_test("resp_late", &pod);
            })
        };
        let t0 = std::time::Instant::now();
        let found = b.lookup_within("resp_late", Duration::from_secs(5)).await;
        assert!(matches!(found, Binding::Pod { .. }), "{found:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(4),
            "woken by the binding"
        );
        binder.await.unwrap();
        let t0 = std::time::Instant::now();
        let none = b
            .lookup_within("resp_never", Duration::from_millis(50))
            .await;
        assert_eq!(none, Binding::Unknown);
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn each_pod_keeps_its_newest_bindings() {
        let b = ResponseBindings::new(Duration::from_secs(3600), 3);
        let pods = pods(1);
        for i in 0..5 {
            b.bind_test(&format!("resp_{i}"), &pods[0]);
        }
        assert_eq!(b.len(), 3);
        assert_eq!(b.lookup("resp_0"), Binding::Unknown);
        assert_eq!(b.lookup("resp_1"), Binding::Unknown);
        assert!(matches!(b.lookup("resp_4"), Binding::Pod { .. }));
    }

    #[test]
    fn replicas_converge_by_exchanging_states() {
        let (a, b) = (
            ResponseBindings::new(DEFAULT_TTL, 8),
            ResponseBindings::new(DEFAULT_TTL, 8),
        );
        let pods = pods(2);
        a.bind_test("resp_a", &pods[0]);
        b.bind_test("resp_b", &pods[1]);
        let names: Vec<String> = pods.iter().map(|c| c.endpoint.hostport.clone()).collect();
        b.merge(&a.export(&names));
        a.merge(&b.export(&names));
        assert_eq!(a.digests(), b.digests());
        for r in [&a, &b] {
            assert!(
                matches!(r.lookup("resp_a"), Binding::Pod { ref hostport, .. } if *hostport == names[0])
            );
            assert!(
                matches!(r.lookup("resp_b"), Binding::Pod { ref hostport, .. } if *hostport == names[1])
            );
        }
    }
}

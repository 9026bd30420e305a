//! The in-flight ledger: requests and tokens this replica has sent to each endpoint and not yet
//! seen finish, plus — in cluster mode — the other replicas' load, read from what the cluster
//! room publishes.
//!
//! At routing time the chosen endpoint is charged one request and the request's uncached prompt
//! tokens (the `inflight-load-producer` decides how many). The tokens are released when the first
//! response chunk arrives (prefill is over) and the request when the response ends — both keyed
//! by the EPP's request key (`dataplane::usage::RouteInfo::key`), so the response may be observed on a different ext_proc stream than the one
//! that routed it. Entries whose response is never seen are dropped by [`InflightTracker::sweep`].
//!
//! The ledger also knows which prompt blocks are *being* prefilled: a request routed here records
//! the blocks it brings to its pod (its prompt past what the pod already held) until its first
//! response bytes. A later request whose prefix match on that pod ends in such blocks would not
//! find them cached yet — an engine caches blocks once computed — so
//! [`InflightTracker::pending_matches`] tells how much of each match is still only promised. (The
//! other replicas' pending blocks are not shared: their routing shows in the prefix index and in
//! their load.)
//!
//! Cluster mode: the other replicas' load comes from the replicated ledger with cluster-wide flow
//! control, else from what each replica reports of its own ledger with its scrape fan-out.
//! The cluster room publishes, through a [`RemoteLoadFeed`], the others' per-endpoint load and
//! the ids of this replica's requests that were settled elsewhere (their response was observed
//! by another replica). The tracker reads that feed ([`RemoteLoad`]) — it is the only writer of
//! its own state — so scorers see the cluster-wide load: this replica's own requests (including
//! those not yet reported) plus everyone else's.

// Every map here is read per candidate per decision (1000 lookups at 1000 pods): a fast hasher.
use foldhash::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

/// In-flight load of one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InflightLoad {
    pub requests: u64,
    /// Prompt tokens of those requests not yet prefilled.
    pub tokens: u64,
    /// Those requests whose first response bytes have not arrived yet (still prefilling, or
    /// waiting in the engine's queue).
    pub prefilling: u64,
}

impl InflightLoad {
    fn plus(self, other: InflightLoad) -> InflightLoad {
        InflightLoad {
            requests: self.requests + other.requests,
            tokens: self.tokens + other.tokens,
            prefilling: self.prefilling + other.prefilling,
        }
    }
}

/// Settlements of this replica's requests observed elsewhere that may wait to be applied.
const SETTLED_BACKLOG: usize = 65_536;

type OthersLoad = Arc<HashMap<String, InflightLoad>>;

/// The publishing side of the other replicas' load (held by the cluster room).
#[derive(Debug, Clone)]
pub struct RemoteLoadFeed {
    others: Arc<watch::Sender<OthersLoad>>,
    settled: mpsc::Sender<String>,
}

impl RemoteLoadFeed {
    /// Replace the other replicas' per-endpoint load (their requests count from routing until
    /// settlement — they do not release tokens at the first response byte as local ones do).
    pub fn publish_others(&self, others: impl IntoIterator<Item = (String, InflightLoad)>) {
        self.others
            .send_replace(Arc::new(others.into_iter().collect()));
    }

    /// This replica's request `request_id` no longer runs: another replica observed its end
    /// (or the cluster reclaimed it). False if the backlog is full (the entry then waits for the
    /// sweep).
    pub fn settled_elsewhere(&self, request_id: String) -> bool {
        self.settled.try_send(request_id).is_ok()
    }
}

/// The reading side, owned by the tracker.
#[derive(Debug)]
pub struct RemoteLoad {
    others: watch::Receiver<OthersLoad>,
    settled: Mutex<mpsc::Receiver<String>>,
}

/// A connected feed and view.
pub fn remote_load() -> (RemoteLoadFeed, RemoteLoad) {
    let (others_tx, others_rx) = watch::channel(OthersLoad::default());
    let (settled_tx, settled_rx) = mpsc::channel(SETTLED_BACKLOG);
    (
        RemoteLoadFeed {
            others: Arc::new(others_tx),
            settled: settled_tx,
        },
        RemoteLoad {
            others: others_rx,
            settled: Mutex::new(settled_rx),
        },
    )
}

/// Most blocks one request records as being prefilled (a longer prompt records its first ones).
const MAX_PENDING_BLOCKS: usize = 4096;

#[derive(Debug)]
struct Entry {
    endpoint: String,
    tokens: u64,
    tokens_released: bool,
    /// Blocks this request brings to its pod, until its first response bytes.
    blocks: Vec<u64>,
    at: Instant,
}

/// Per endpoint: blocks being prefilled there, with how many requests bring each.
type Pending = HashMap<String, HashMap<u64, u32>>;

#[derive(Debug, Default)]
struct State {
    by_request: HashMap<String, Entry>,
    per_endpoint: HashMap<String, InflightLoad>,
    pending: Pending,
}

fn add_pending(pending: &mut Pending, endpoint: &str, blocks: &[u64]) {
    if blocks.is_empty() {
        return;
    }
    let set = pending.entry(endpoint.to_string()).or_default();
    for &b in blocks {
        *set.entry(b).or_default() += 1;
    }
}

/// `blocks` are no longer brought to `endpoint` by one request; `computed`: that request was
/// prefilled, so they are cached there whoever else brings them too.
fn remove_pending(pending: &mut Pending, endpoint: &str, blocks: &[u64], computed: bool) {
    let Some(set) = pending.get_mut(endpoint) else {
        return;
    };
    for b in blocks {
        if let Some(n) = set.get_mut(b) {
            *n -= 1;
            if *n == 0 || computed {
                set.remove(b);
            }
        }
    }
    if set.is_empty() {
        pending.remove(endpoint);
    }
}

impl State {
    fn credit(&mut self, e: &Entry) {
        if let Some(load) = self.per_endpoint.get_mut(&e.endpoint) {
            load.requests = load.requests.saturating_sub(1);
            if !e.tokens_released {
                load.tokens = load.tokens.saturating_sub(e.tokens);
                load.prefilling = load.prefilling.saturating_sub(1);
            }
            if load.requests == 0 && load.tokens == 0 && load.prefilling == 0 {
                self.per_endpoint.remove(&e.endpoint);
            }
        }
        if !e.tokens_released {
            remove_pending(&mut self.pending, &e.endpoint, &e.blocks, false);
        }
    }

    /// How many of the `m` leading blocks of `hashes` matched on `ep` are still being prefilled
    /// there. The blocks a request brings form one run of its chain, so the first pending block
    /// is found by bisection.
    fn pending_run(&self, ep: &str, hashes: &[u64], m: usize) -> usize {
        let m = m.min(hashes.len());
        if m == 0 || self.pending.is_empty() {
            return 0;
        }
        let Some(set) = self.pending.get(ep) else {
            return 0;
        };
        if !set.contains_key(&hashes[m - 1]) {
            return 0;
        }
        // The first pending block: hashes[lo - 1] cached (or lo == 0), hashes[hi] pending.
        let (mut lo, mut hi) = (0, m - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if set.contains_key(&hashes[mid]) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        m - lo
    }

    fn finish(&mut self, request_id: &str) -> bool {
        match self.by_request.remove(request_id) {
            Some(e) => {
                self.credit(&e);
                true
            }
            None => false,
        }
    }
}

/// The ledger itself; shared by the in-flight producer, the admission detectors and the
/// response path.
#[derive(Debug, Default)]
pub struct InflightTracker {
    state: Mutex<State>,
    remote: OnceLock<RemoteLoad>,
}

impl InflightTracker {
    /// Lock the state, first applying settlements observed elsewhere.
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut st = match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(r) = self.remote.get() {
            let mut rx = r.settled.lock().unwrap_or_else(|p| p.into_inner());
            while let Ok(id) = rx.try_recv() {
                st.finish(&id);
            }
        }
        st
    }

    /// Read the other replicas' load from `remote` from now on. False if already connected.
    pub fn connect_remote(&self, remote: RemoteLoad) -> bool {
        self.remote.set(remote).is_ok()
    }

    pub fn reserve(&self, request_id: &str, endpoint: &str, tokens: u64) {
        self.reserve_prefill(request_id, endpoint, tokens, Vec::new());
    }

    /// [`Self::reserve`], recording `blocks` (the prompt's block hashes the pod did not hold) as
    /// being prefilled on `endpoint` until the first response bytes.
    pub fn reserve_prefill(
        &self,
        request_id: &str,
        endpoint: &str,
        tokens: u64,
        mut blocks: Vec<u64>,
    ) {
        let mut st = self.lock();
        if st.by_request.contains_key(request_id) {
            return; // a retry of the same request id: charged once
        }
        let load = st.per_endpoint.entry(endpoint.to_string()).or_default();
        load.requests += 1;
        load.tokens += tokens;
        load.prefilling += 1;
        blocks.truncate(MAX_PENDING_BLOCKS);
        add_pending(&mut st.pending, endpoint, &blocks);
        st.by_request.insert(
            request_id.to_string(),
            Entry {
                endpoint: endpoint.to_string(),
                tokens,
                tokens_released: false,
                blocks,
                at: Instant::now(),
            },
        );
    }

    /// The first response bytes arrived: the prompt has been prefilled.
    pub fn release_tokens(&self, request_id: &str) {
        let mut st = self.lock();
        let State {
            by_request,
            per_endpoint,
            pending,
        } = &mut *st;
        if let Some(e) = by_request.get_mut(request_id)
            && !e.tokens_released
        {
            e.tokens_released = true;
            if let Some(load) = per_endpoint.get_mut(&e.endpoint) {
                load.tokens = load.tokens.saturating_sub(e.tokens);
                load.prefilling = load.prefilling.saturating_sub(1);
            }
            remove_pending(pending, &e.endpoint, &std::mem::take(&mut e.blocks), true);
        }
    }

    /// The request was served by `endpoint`, not the pod it was charged to (Envoy used a
    /// fallback): move its charge there.
    pub fn moved(&self, request_id: &str, endpoint: &str) {
        let mut st = self.lock();
        let Some(mut e) = st.by_request.remove(request_id) else {
            return;
        };
        if e.endpoint != endpoint {
            st.credit(&e);
            let load = st.per_endpoint.entry(endpoint.to_string()).or_default();
            load.requests += 1;
            if !e.tokens_released {
                load.tokens += e.tokens;
                load.prefilling += 1;
                add_pending(&mut st.pending, endpoint, &e.blocks);
            }
            e.endpoint = endpoint.to_string();
        }
        st.by_request.insert(request_id.to_string(), e);
    }

    /// The response ended (or the request was abandoned); false if this replica did not hold it.
    pub fn finish(&self, request_id: &str) -> bool {
        self.lock().finish(request_id)
    }

    /// Drop entries older than `max_age` whose response was never seen; returns how many.
    pub fn sweep(&self, max_age: Duration) -> usize {
        let mut st = self.lock();
        let now = Instant::now();
        let old: Vec<String> = st
            .by_request
            .iter()
            .filter(|(_, e)| now.duration_since(e.at) > max_age)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &old {
            st.finish(k);
        }
        old.len()
    }

    /// This replica's in-flight load on `endpoint` plus the other replicas' (when known).
    pub fn load(&self, endpoint: &str) -> InflightLoad {
        self.loads([endpoint]).pop().unwrap_or_default()
    }

    /// [`Self::load`] of each endpoint, read at one instant.
    pub fn loads<'a>(&self, endpoints: impl IntoIterator<Item = &'a str>) -> Vec<InflightLoad> {
        self.loads_and_pending(endpoints, None).0
    }

    /// Per endpoint, how many of the `matched[i]` leading blocks of `hashes` matched there are
    /// still being prefilled by a request routed before (0: the whole match is cached).
    pub fn pending_matches<'a>(
        &self,
        endpoints: impl IntoIterator<Item = &'a str>,
        hashes: &[u64],
        matched: &[usize],
    ) -> Vec<usize> {
        self.loads_and_pending(endpoints, Some((hashes, matched))).1
    }

    /// [`Self::loads`] and, given a prefix match `(hashes, matched)`, [`Self::pending_matches`]
    /// (empty without), read at one instant in one pass (a decision over 1000 pods reads both).
    pub fn loads_and_pending<'a>(
        &self,
        endpoints: impl IntoIterator<Item = &'a str>,
        prefix: Option<(&[u64], &[usize])>,
    ) -> (Vec<InflightLoad>, Vec<usize>) {
        let st = self.lock();
        let others = self.remote.get().map(|r| r.others.borrow().clone());
        let others = others.as_deref().filter(|o| !o.is_empty());
        let endpoints = endpoints.into_iter();
        let mut loads = Vec::with_capacity(endpoints.size_hint().0);
        let mut pending = Vec::with_capacity(prefix.map_or(0, |(_, m)| m.len()));
        for (i, ep) in endpoints.enumerate() {
            let local = if st.per_endpoint.is_empty() {
                InflightLoad::default()
            } else {
                st.per_endpoint.get(ep).copied().unwrap_or_default()
            };
            loads.push(match others.and_then(|o| o.get(ep)) {
                Some(r) => local.plus(*r),
                None => local,
            });
            if let Some((hashes, matched)) = prefix
                && let Some(&m) = matched.get(i)
            {
                pending.push(st.pending_run(ep, hashes, m));
            }
        }
        (loads, pending)
    }

    /// This replica's own load per endpoint (what it shares with the other replicas).
    pub fn own_load(&self) -> Vec<(String, InflightLoad)> {
        self.lock()
            .per_endpoint
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    pub fn tracked_requests(&self) -> usize {
        self.lock().by_request.len()
    }

    /// `/debug/inflight`: this replica's own load per endpoint and the other replicas' (cluster
    /// mode), sorted by endpoint.
    pub fn view(&self) -> InflightView {
        let st = self.lock();
        let mut own: Vec<(String, InflightLoad)> = st
            .per_endpoint
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        own.sort_by(|a, b| a.0.cmp(&b.0));
        let mut others: Vec<(String, InflightLoad)> = self
            .remote
            .get()
            .map(|r| {
                r.others
                    .borrow()
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect()
            })
            .unwrap_or_default();
        others.sort_by(|a, b| a.0.cmp(&b.0));
        InflightView {
            tracked_requests: st.by_request.len(),
            own,
            others,
        }
    }
}

/// What `/debug/inflight` shows.
#[derive(Debug, serde::Serialize)]
pub struct InflightView {
    pub tracked_requests: usize,
    /// This replica's requests per endpoint (requests, unprefilled tokens).
    pub own: Vec<(String, InflightLoad)>,
    /// The other replicas' per endpoint, from the replicated ledger (cluster-wide flow control)
    /// or as they report it (the scrape fan-out).
    pub others: Vec<(String, InflightLoad)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_release_finish_sweep() {
        let t = InflightTracker::default();
        t.reserve("r1", "a", 100);
        t.reserve("r1", "a", 100); // same id: charged once
        t.reserve("r2", "a", 50);
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 2,
                tokens: 150,
                prefilling: 2,
            }
        );
        t.release_tokens("r1");
        t.release_tokens("r1");
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 2,
                tokens: 50,
                prefilling: 1,
            }
        );
        t.finish("r1");
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 1,
                tokens: 50,
                prefilling: 1,
            }
        );
        t.finish("unknown");
        assert_eq!(t.sweep(Duration::from_secs(3600)), 0);
        assert_eq!(t.sweep(Duration::ZERO), 1);
        assert_eq!(t.load("a"), InflightLoad::default());
        assert_eq!(t.tracked_requests(), 0);
    }

    #[test]
    fn blocks_being_prefilled_are_not_yet_a_match() {
        let t = InflightTracker::default();
        let chain: Vec<u64> = (1..=10).collect();
        // r1 brings blocks 4..10 to pod a (it matched 3 there).
        t.reserve_prefill("r1", "a", 448, chain[3..].to_vec());
        let eps = ["a", "b"];
        // A request matching 8 blocks on a (3 cached + 5 pending) and 2 on b.
        assert_eq!(t.pending_matches(eps, &chain, &[8, 2]), vec![5, 0]);
        // A match that ends in cached blocks is whole.
        assert_eq!(t.pending_matches(eps, &chain, &[3, 0]), vec![0, 0]);
        // A second request bringing the same blocks: they stay pending if r1 ends unprefilled…
        t.reserve_prefill("r2", "a", 448, chain[3..].to_vec());
        t.reserve_prefill("r3", "a", 448, chain[3..].to_vec());
        t.finish("r1");
        assert_eq!(t.pending_matches(eps, &chain, &[10, 0]), vec![7, 0]);
        // …and are cached once either is prefilled.
        t.release_tokens("r2");
        assert_eq!(t.pending_matches(eps, &chain, &[10, 0]), vec![0, 0]);
        // Moved to b by a fallback: pending there.
        t.moved("r3", "b");
        assert_eq!(t.pending_matches(eps, &chain, &[10, 10]), vec![0, 7]);
        t.finish("r3");
        t.finish("r2");
        assert_eq!(t.pending_matches(eps, &chain, &[10, 10]), vec![0, 0]);
        assert!(t.lock().pending.is_empty());
    }

    #[test]
    fn a_fallback_moves_the_charge() {
        let t = InflightTracker::default();
        t.reserve("r1", "a", 100);
        t.moved("r1", "b");
        assert_eq!(t.load("a"), InflightLoad::default());
        assert_eq!(
            t.load("b"),
            InflightLoad {
                requests: 1,
                tokens: 100,
                prefilling: 1,
            }
        );
        t.release_tokens("r1");
        t.moved("r1", "b"); // same pod: nothing changes
        t.moved("unknown", "a");
        assert_eq!(t.load("b").tokens, 0);
        t.finish("r1");
        assert_eq!(t.load("b"), InflightLoad::default());
        assert_eq!(t.tracked_requests(), 0);
    }

    #[test]
    fn other_replicas_load_adds_to_the_local_one() {
        let t = InflightTracker::default();
        let (feed, view) = remote_load();
        assert!(t.connect_remote(view));
        t.reserve("r1", "a", 100);
        feed.publish_others(std::collections::HashMap::from([
            (
                "a".to_string(),
                InflightLoad {
                    requests: 3,
                    tokens: 30,
                    prefilling: 2,
                },
            ),
            (
                "b".to_string(),
                InflightLoad {
                    requests: 1,
                    tokens: 5,
                    prefilling: 1,
                },
            ),
        ]));
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 4,
                tokens: 130,
                prefilling: 3,
            }
        );
        assert_eq!(t.load("b").requests, 1);
        // The remote view is replaced wholesale; local entries are untouched.
        feed.publish_others([]);
        assert_eq!(t.load("a").requests, 1);
        assert_eq!(t.load("b"), InflightLoad::default());
    }

    #[test]
    fn requests_settled_elsewhere_are_forgotten() {
        let t = InflightTracker::default();
        let (feed, view) = remote_load();
        t.connect_remote(view);
        t.reserve("r1", "a", 100);
        t.reserve("r2", "a", 10);
        assert!(feed.settled_elsewhere("r1".to_string()));
        assert!(feed.settled_elsewhere("unknown".to_string()));
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 1,
                tokens: 10,
                prefilling: 1,
            }
        );
        assert_eq!(t.tracked_requests(), 1);
    }
}

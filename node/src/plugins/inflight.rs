//! `inflight-load-producer`: requests and tokens this replica has in flight per endpoint.
//!
//! At routing time the chosen endpoint is charged one request and the request's uncached prompt
//! tokens (plus, optionally, an estimate of its output). The tokens are released when the first
//! response chunk arrives (prefill is over) and the request when the response ends — both keyed by
//! `x-request-id`, so the response may be observed on a different ext_proc stream than the one
//! that routed it. Entries whose response is never seen are dropped after `max_age`.
//! In cluster mode with cluster-wide flow control, the other replicas' load comes from the
//! replicated ledger ([`InflightTracker::set_remote`]), so every replica scores with the
//! cluster-wide per-endpoint load: its own (including what it has not reported yet) plus theirs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::{InflightLoad, Producer, RequestData, SchedRequest};
use crate::datalayer::store::Candidate;

pub const TYPE: &str = "inflight-load-producer";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InflightParams {
    #[serde(default)]
    pub add_estimated_output_tokens: bool,
    #[serde(default = "d_ratio")]
    pub output_ratio: f64,
    #[serde(default)]
    pub max_estimated_output_tokens: Option<u64>,
}

fn d_ratio() -> f64 {
    1.5
}

impl Default for InflightParams {
    fn default() -> Self {
        InflightParams {
            add_estimated_output_tokens: false,
            output_ratio: d_ratio(),
            max_estimated_output_tokens: None,
        }
    }
}

#[derive(Debug)]
struct Entry {
    endpoint: String,
    tokens: u64,
    tokens_released: bool,
    at: Instant,
}

#[derive(Debug, Default)]
struct State {
    by_request: HashMap<String, Entry>,
    per_endpoint: HashMap<String, InflightLoad>,
    /// Cluster mode with cluster-wide flow control: the other replicas' load per endpoint, from
    /// the replicated ledger (refreshed every 100 ms; their requests count from routing until
    /// settlement — they do not release tokens at the first response byte as local ones do).
    remote: HashMap<String, InflightLoad>,
}

impl State {
    fn total(&self, endpoint: &str) -> InflightLoad {
        let local = self.per_endpoint.get(endpoint).copied().unwrap_or_default();
        match self.remote.get(endpoint) {
            Some(r) => InflightLoad {
                requests: local.requests + r.requests,
                tokens: local.tokens + r.tokens,
            },
            None => local,
        }
    }
}

/// The ledger itself; shared by the producer and the response path.
#[derive(Debug, Default)]
pub struct InflightTracker {
    state: Mutex<State>,
}

impl InflightTracker {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub fn reserve(&self, request_id: &str, endpoint: &str, tokens: u64) {
        let mut st = self.lock();
        if st.by_request.contains_key(request_id) {
            return; // a retry of the same request id: charged once
        }
        let load = st.per_endpoint.entry(endpoint.to_string()).or_default();
        load.requests += 1;
        load.tokens += tokens;
        st.by_request.insert(
            request_id.to_string(),
            Entry {
                endpoint: endpoint.to_string(),
                tokens,
                tokens_released: false,
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
            ..
        } = &mut *st;
        if let Some(e) = by_request.get_mut(request_id)
            && !e.tokens_released
        {
            e.tokens_released = true;
            if let Some(load) = per_endpoint.get_mut(&e.endpoint) {
                load.tokens = load.tokens.saturating_sub(e.tokens);
            }
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
            Self::credit(&mut st, &e);
            let load = st.per_endpoint.entry(endpoint.to_string()).or_default();
            load.requests += 1;
            if !e.tokens_released {
                load.tokens += e.tokens;
            }
            e.endpoint = endpoint.to_string();
        }
        st.by_request.insert(request_id.to_string(), e);
    }

    /// The response ended (or the request was abandoned).
    pub fn finish(&self, request_id: &str) {
        let mut st = self.lock();
        if let Some(e) = st.by_request.remove(request_id) {
            Self::credit(&mut st, &e);
        }
    }

    fn credit(st: &mut State, e: &Entry) {
        if let Some(load) = st.per_endpoint.get_mut(&e.endpoint) {
            load.requests = load.requests.saturating_sub(1);
            if !e.tokens_released {
                load.tokens = load.tokens.saturating_sub(e.tokens);
            }
            if load.requests == 0 && load.tokens == 0 {
                st.per_endpoint.remove(&e.endpoint);
            }
        }
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
            if let Some(e) = st.by_request.remove(k) {
                Self::credit(&mut st, &e);
            }
        }
        old.len()
    }

    /// This replica's in-flight load on `endpoint` plus the other replicas' (when known).
    pub fn load(&self, endpoint: &str) -> InflightLoad {
        self.lock().total(endpoint)
    }

    /// Replace the other replicas' per-endpoint load (cluster-wide flow control's ledger).
    pub fn set_remote(&self, remote: HashMap<String, InflightLoad>) {
        self.lock().remote = remote;
    }

    pub fn tracked_requests(&self) -> usize {
        self.lock().by_request.len()
    }
}

#[derive(Debug)]
pub struct InflightProducer {
    pub params: InflightParams,
    pub tracker: Arc<InflightTracker>,
}

impl Producer for InflightProducer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn produce(&self, _req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData) {
        let st = self.tracker.lock();
        data.inflight = candidates
            .iter()
            .map(|c| st.total(&c.endpoint.hostport))
            .collect();
    }

    fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        _prefill: Option<usize>,
    ) {
        let uncached = data.uncached_tokens(primary) as u64;
        let mut tokens = uncached;
        if self.params.add_estimated_output_tokens {
            let mut out = (data.prompt_tokens as f64 * self.params.output_ratio) as u64;
            if let Some(cap) = self.params.max_estimated_output_tokens {
                out = out.min(cap);
            }
            tokens += out;
        }
        self.tracker.reserve(
            req.request_id,
            &candidates[primary].endpoint.hostport,
            tokens,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::PrefixMatchInfo;
    use crate::plugins::testutil::*;

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
                tokens: 150
            }
        );
        t.release_tokens("r1");
        t.release_tokens("r1");
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 2,
                tokens: 50
            }
        );
        t.finish("r1");
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 1,
                tokens: 50
            }
        );
        t.finish("unknown");
        assert_eq!(t.sweep(Duration::from_secs(3600)), 0);
        assert_eq!(t.sweep(Duration::ZERO), 1);
        assert_eq!(t.load("a"), InflightLoad::default());
        assert_eq!(t.tracked_requests(), 0);
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
                tokens: 100
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
        t.reserve("r1", "a", 100);
        t.set_remote(HashMap::from([
            (
                "a".to_string(),
                InflightLoad {
                    requests: 3,
                    tokens: 30,
                },
            ),
            (
                "b".to_string(),
                InflightLoad {
                    requests: 1,
                    tokens: 5,
                },
            ),
        ]));
        assert_eq!(
            t.load("a"),
            InflightLoad {
                requests: 4,
                tokens: 130
            }
        );
        assert_eq!(t.load("b").requests, 1);
        // The remote view is replaced wholesale; local entries are untouched.
        t.set_remote(HashMap::new());
        assert_eq!(t.load("a").requests, 1);
        assert_eq!(t.load("b"), InflightLoad::default());
    }

    #[test]
    fn producer_charges_uncached_tokens_of_the_primary() {
        let tracker = Arc::new(InflightTracker::default());
        let p = InflightProducer {
            params: InflightParams::default(),
            tracker: tracker.clone(),
        };
        let cs = [
            cand_at("a", "10.0.0.1:1", None, false, &[]),
            cand_at("b", "10.0.0.2:1", None, false, &[]),
        ];
        let data = RequestData {
            prompt_tokens: 1000,
            prefix: Some(PrefixMatchInfo {
                block_size: 64,
                total_blocks: 16,
                matched: vec![0, 10],
                hashes: vec![],
            }),
            inflight: vec![],
        };
        p.pre_request(&req(), &data, &cs, 1, None);
        assert_eq!(
            tracker.load("10.0.0.2:1"),
            InflightLoad {
                requests: 1,
                tokens: 360
            }
        );
        let mut d2 = RequestData::default();
        p.produce(&req(), &cs, &mut d2);
        assert_eq!(d2.inflight[1].requests, 1);
        assert_eq!(d2.inflight[0], InflightLoad::default());
    }
}

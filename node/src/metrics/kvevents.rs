//! KV-event subscription metrics (`llm_d_epp_kv_events_*`) and how well the prefix index predicts
//! what the pods report cached (`llm_d_epp_prefix_cached_tokens_*`). Series are per pod; a pod
//! that leaves the pool has its series removed, so cardinality follows the pool.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// `kv_events_messages_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MessageLabels {
    pub pod: String,
    /// `applied`, `replayed`, `duplicate`, `garbage`, `overflow`.
    pub outcome: &'static str,
}

/// `kv_events_blocks_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BlockLabels {
    pub pod: String,
    /// `stored`, `removed`, `orphaned`, `skipped`.
    pub op: &'static str,
}

/// `kv_events_recoveries_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RecoveryLabels {
    pub pod: String,
    /// `gap` (a sequence gap seen), `restart` (the publisher's sequence went back), `replayed`
    /// (a replay filled the gap), `resync` (it could not: the pod's entries were dropped).
    pub kind: &'static str,
}

/// `token_producer_requests_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `vllm_http` or `local`.
    pub backend: &'static str,
    /// `vllm_http`: `ok`, `error`, `timeout`, `too-large`, `malformed`; `local`: `ok`,
    /// `no-tokenizer` (none for the model), `template-error`, `unsupported` (a prompt shape with no
    /// single token sequence).
    pub outcome: &'static str,
}

#[derive(Debug)]
pub struct KvEventMetrics {
    token_calls: Family<OutcomeLabels, Counter>,
    messages: Family<MessageLabels, Counter>,
    blocks: Family<BlockLabels, Counter>,
    recoveries: Family<RecoveryLabels, Counter>,
    subscriptions: Gauge,
    index_blocks: Gauge,
    index_bytes: Gauge,
    predicted: Counter,
    observed: Counter,
    abs_error: Counter,
}

impl KvEventMetrics {
    pub(super) fn register(registry: &mut super::registrar::Registrar) -> KvEventMetrics {
        let m = KvEventMetrics {
            token_calls: Family::default(),
            messages: Family::default(),
            blocks: Family::default(),
            recoveries: Family::default(),
            subscriptions: Gauge::default(),
            index_blocks: Gauge::default(),
            index_bytes: Gauge::default(),
            predicted: Counter::default(),
            observed: Counter::default(),
            abs_error: Counter::default(),
        };
        registry.register(
            "token_producer_requests",
            "Requests tokenized by the token producer, by backend (vllm_http: a render call; \
             local: the in-process tokenizer) and outcome (anything but ok leaves the request \
             without engine tokens)",
            m.token_calls.clone(),
        );
        registry.register(
            "kv_events_messages",
            "KV-event messages from each pod by outcome: applied (live), replayed, duplicate \
             (already applied), garbage (not a KV-event message: dropped), overflow (dropped \
             while a replay's backlog was full)",
            m.messages.clone(),
        );
        registry.register(
            "kv_events_blocks",
            "KV blocks in applied events by operation: stored, removed, orphaned (parent block \
             unknown: not indexed), skipped (not indexable: hash-only, other tiers or attention \
             kinds, unnamed adapters, malformed spans)",
            m.blocks.clone(),
        );
        registry.register(
            "kv_events_recoveries",
            "Sequence gaps, publisher restarts, gaps filled by replay and pods resynced",
            m.recoveries.clone(),
        );
        registry.register(
            "kv_events_subscriptions",
            "Pods whose KV-event stream this replica subscribes to",
            m.subscriptions.clone(),
        );
        registry.register(
            "kv_events_index_blocks",
            "(pod, block) entries in the precise prefix index",
            m.index_blocks.clone(),
        );
        registry.register(
            "kv_events_index_bytes",
            "Heap bytes of the precise prefix index",
            m.index_bytes.clone(),
        );
        registry.register(
            "prefix_cached_tokens_predicted",
            "Prompt tokens the prefix index predicted cached on the pod a request went to, for \
             requests whose response reported cached tokens",
            m.predicted.clone(),
        );
        registry.register(
            "prefix_cached_tokens_observed",
            "Cached prompt tokens the pods reported (usage.prompt_tokens_details.cached_tokens) \
             for the same requests",
            m.observed.clone(),
        );
        registry.register(
            "prefix_cached_tokens_abs_error",
            "Sum over those requests of |predicted - observed| cached tokens",
            m.abs_error.clone(),
        );
        m
    }

    pub fn token_call(&self, backend: &'static str, outcome: &'static str) {
        self.token_calls
            .get_or_create(&OutcomeLabels { backend, outcome })
            .inc();
    }

    pub fn messages(&self, pod: &str, outcome: &'static str, n: u64) {
        if n > 0 {
            self.messages
                .get_or_create(&MessageLabels {
                    pod: pod.to_string(),
                    outcome,
                })
                .inc_by(n);
        }
    }

    pub fn blocks(&self, pod: &str, a: &index::precise::Applied) {
        for (op, n) in [
            ("stored", a.stored),
            ("removed", a.removed),
            ("orphaned", a.orphaned),
            ("skipped", a.skipped),
        ] {
            if n > 0 {
                self.blocks
                    .get_or_create(&BlockLabels {
                        pod: pod.to_string(),
                        op,
                    })
                    .inc_by(n);
            }
        }
    }

    pub fn recovery(&self, pod: &str, kind: &'static str) {
        self.recoveries
            .get_or_create(&RecoveryLabels {
                pod: pod.to_string(),
                kind,
            })
            .inc();
    }

    /// Drop a departed pod's series.
    pub fn forget_pod(&self, pod: &str) {
        let pod = pod.to_string();
        for outcome in ["applied", "replayed", "duplicate", "garbage", "overflow"] {
            self.messages.remove(&MessageLabels {
                pod: pod.clone(),
                outcome,
            });
        }
        for op in ["stored", "removed", "orphaned", "skipped"] {
            self.blocks.remove(&BlockLabels {
                pod: pod.clone(),
                op,
            });
        }
        for kind in ["gap", "restart", "replayed", "resync"] {
            self.recoveries.remove(&RecoveryLabels {
                pod: pod.clone(),
                kind,
            });
        }
    }

    pub fn set_index(&self, subscriptions: usize, blocks: usize, bytes: usize) {
        let g = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.subscriptions.set(g(subscriptions));
        self.index_blocks.set(g(blocks));
        self.index_bytes.set(g(bytes));
    }

    /// A response reported `observed` cached tokens where `predicted` were expected.
    pub fn cached_prediction(&self, predicted: u64, observed: u64) {
        self.predicted.inc_by(predicted);
        self.observed.inc_by(observed);
        self.abs_error.inc_by(predicted.abs_diff(observed));
    }
}

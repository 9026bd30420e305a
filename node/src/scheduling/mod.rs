//! Scheduling plugins and the registry that builds them from an `EndpointPickerConfig`.
//!
//! Each plugin is one module: an inert serde parameter struct decoded strictly from the YAML
//! `parameters`, a constructor, and the trait impl with unit tests. [`registry`] maps llm-d's type
//! names to constructors; [`build`] instantiates the configured plugins, injects llm-d's defaults
//! (including the data producers a consumer needs) and returns the [`Scheduler`].
//!
//! Per request: producers fill [`RequestData`] (prompt tokens, prefix matches, in-flight load) for
//! every candidate; the profile's filters narrow the candidate indices, scorers score them, the
//! picker orders them; after the answer is sent, producers record the decision (`pre_request`).

pub mod admitter;
pub mod cost_model;
pub mod departed;
pub mod explain;
pub mod filters;
pub mod inflight;
pub mod kv_cache_scorer;
pub mod latency;
pub mod load_scorers;
pub mod lora_affinity_scorer;
pub mod max_score_picker;
pub mod mm_cache;
pub mod no_hit_lru;
pub mod precise;
pub mod prefix;
pub mod queue_scorer;
pub mod random_picker;
pub mod registry;
pub mod scheduler;
pub mod session;
pub mod weighted_random_picker;

use std::collections::HashMap;
use std::fmt::Debug;

use serde::Serialize;

pub use crate::datalayer::inflight::InflightLoad;
use crate::datalayer::store::Candidate;
use crate::request::parse::Prompt;

pub use registry::build;
pub use scheduler::{SchedError, Scheduler};

/// What the scheduler knows about the request being routed.
#[derive(Debug, Clone, Copy)]
pub struct SchedRequest<'a> {
    pub request_id: &'a str,
    pub model: &'a str,
    pub target_model: &'a str,
    pub prompt: &'a Prompt,
    pub cache_salt: Option<&'a str>,
    /// The request's priority (its `InferenceObjective`'s; below 0 = sheddable).
    pub priority: i32,
    pub headers: &'a HashMap<String, String>,
    /// The prompt as the engine tokenizes it, when a token producer backend that has the model's
    /// tokenizer ran (`vllm_http`); `None` with the tokenizer-free `estimate` backend.
    pub tokens: Option<&'a [u32]>,
    /// Hashes of the prompt's media parts — images, audio, video (empty: text only).
    pub media: &'a [u64],
}

impl SchedRequest<'_> {
    /// The prompt carries images, audio or video.
    pub fn multimodal(&self) -> bool {
        !self.media.is_empty()
    }
}

/// Prefix-cache match of the request on every candidate (llm-d's `PrefixCacheMatchInfo`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixMatchInfo {
    pub block_size: usize,
    pub total_blocks: usize,
    /// Matched leading blocks, per candidate (aligned with the candidate list).
    pub matched: Vec<usize>,
    /// The request's block hashes (recorded for the chosen pod after routing).
    pub hashes: Vec<u64>,
    /// The matched blocks weighted by the tier holding each (the precise index with offload
    /// tiers: a CPU block counts 0.8 by default), per candidate; empty when every matched
    /// block counts 1.
    pub weighted: Vec<f64>,
}

impl PrefixMatchInfo {
    /// Candidate `i`'s matched blocks as worth to the request: tier-weighted when known (what
    /// the scorers and the latency models use; `matched` is what the engine will report).
    pub fn effective(&self, i: usize) -> f64 {
        match self.weighted.get(i) {
            Some(w) => *w,
            None => self.matched.get(i).copied().unwrap_or(0) as f64,
        }
    }
}

/// One candidate's prediction against the request's SLOs (llm-d's `LatencyPredictionInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyInfo {
    pub ttft_ms: f64,
    pub tpot_ms: Option<f64>,
    pub ttft_valid: bool,
    pub tpot_valid: bool,
    pub ttft_headroom: f64,
    pub tpot_headroom: f64,
    /// Requests this EPP has in flight on the pod.
    pub dispatched: u64,
}

/// Data produced for one request, aligned with the candidate list.
#[derive(Debug, Clone, Default)]
pub struct RequestData {
    /// Prompt length in (estimated) tokens.
    pub prompt_tokens: usize,
    pub prefix: Option<PrefixMatchInfo>,
    /// Empty unless an in-flight producer runs.
    pub inflight: Vec<InflightLoad>,
    /// Predicted time to first token per candidate; empty unless the cost-model producer runs.
    pub predicted: Vec<Prediction>,
    /// Of each candidate's matched blocks, those an earlier request is still prefilling there
    /// (empty unless the in-flight producer runs after a prefix producer).
    pub pending: Vec<usize>,
    /// Of the request's media assets, how many each candidate encoded recently (empty unless
    /// `mm-embeddings-cache-producer` runs and the request has media).
    pub media_matched: Vec<usize>,
    /// Each candidate's latency prediction against the request's SLOs (empty unless
    /// `predicted-latency-producer` runs).
    pub latency: Vec<LatencyInfo>,
}

impl RequestData {
    /// Prompt tokens not already cached on candidate `i` (all of them without prefix data).
    pub fn uncached_tokens(&self, i: usize) -> usize {
        match &self.prefix {
            Some(p) => self
                .prompt_tokens
                .saturating_sub((p.effective(i) * p.block_size as f64).round() as usize),
            None => self.prompt_tokens,
        }
    }

    /// The tokens this request would prefill on candidate `i`: [`Self::uncached_tokens`] plus
    /// the matched blocks not computed there yet (an earlier request is still prefilling them).
    pub fn prefill_tokens(&self, i: usize) -> usize {
        let pending = self.pending.get(i).copied().unwrap_or(0);
        match &self.prefix {
            Some(p) if pending > 0 => {
                (self.uncached_tokens(i) + pending * p.block_size).min(self.prompt_tokens)
            }
            _ => self.uncached_tokens(i),
        }
    }
}

/// Computes per-request data before filters and scorers run, and records routing decisions.
pub trait Producer: Send + Sync + Debug {
    fn type_name(&self) -> &'static str;
    fn produce(&self, req: &SchedRequest<'_>, candidates: &[Candidate], data: &mut RequestData);
    /// The request was routed to `candidates[primary]` (and prefilled on `candidates[prefill]`
    /// when disaggregated).
    fn pre_request(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        primary: usize,
        prefill: Option<usize>,
    );
    /// A response ended and was observed here (whichever replica routed it): what it took.
    fn observed(&self, _obs: &Observation<'_>) {}
}

/// What the data plane saw of one request's response, for producers that learn from outcomes.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// The pod that served it (`ip:port`).
    pub pod: &'a str,
    /// Request start to the first response bytes, for a streamed response.
    pub ttft_ms: Option<f64>,
    /// Request start to the end of the response.
    pub e2e_ms: f64,
    /// Prompt tokens and how many of them the pod had cached (from the response's usage).
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Output tokens (from the response's usage).
    pub output_tokens: Option<u64>,
    /// What the cost model predicted when the request was routed.
    pub predicted: Option<Prediction>,
}

/// Longest TTFT or duration a prediction or an observation may carry, ms.
pub const MAX_SAMPLE_MS: f64 = 600_000.0;

/// One candidate's prediction and what it was computed from. The chosen pod's rides to the
/// response's observer in the route header, so the model learns from its own predictions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Prediction {
    /// Predicted time to first token, ms.
    pub ttft_ms: f64,
    /// Of which: waiting for a slot in a full batch, ms.
    pub queue_ms: f64,
    /// Not part of the TTFT: what this request costs the others later, ms — re-prefilling what it
    /// pushes out of a full cache, and its share of the pod's batch (not carried in the route
    /// header).
    pub others_ms: f64,
    /// This request's prompt tokens not cached on the pod (prefix match).
    pub uncached_tokens: u64,
    /// Prefill tokens routed to the pod before it and not yet prefilled.
    pub queued_tokens: u64,
    /// Requests running beside it.
    pub running: u64,
}

impl Prediction {
    /// What the scorer minimises: the TTFT plus what it costs the others.
    pub fn cost_ms(&self) -> f64 {
        self.ttft_ms + self.others_ms
    }

    /// `ttft,queue,uncached,queued,running` (the route header's `c=` item).
    pub fn encode(&self) -> String {
        format!(
            "{:.1},{:.1},{},{},{}",
            self.ttft_ms, self.queue_ms, self.uncached_tokens, self.queued_tokens, self.running
        )
    }

    /// The inverse of [`Self::encode`]; `None` for anything malformed or implausible.
    pub fn decode(s: &str) -> Option<Prediction> {
        let mut it = s.split(',');
        let ms = |v: Option<&str>| {
            v?.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && (0.0..=MAX_SAMPLE_MS).contains(x))
        };
        let n = |v: Option<&str>| v?.trim().parse::<u64>().ok().filter(|x| *x <= 1 << 40);
        let p = Prediction {
            ttft_ms: ms(it.next())?,
            queue_ms: ms(it.next())?,
            others_ms: 0.0,
            uncached_tokens: n(it.next())?,
            queued_tokens: n(it.next())?,
            running: n(it.next())?,
        };
        it.next().is_none().then_some(p)
    }
}

/// Narrows the candidate set: `keep` holds candidate indices and is edited in place.
pub trait Filter: Send + Sync + Debug {
    fn type_name(&self) -> &'static str;
    fn filter(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    );
}

/// Scores candidates `idx` (indices into `candidates`); `out[k]` belongs to `candidates[idx[k]]`.
/// Scores are clamped to [0, 1] by the scheduler and multiplied by the scorer's weight.
pub trait Scorer: Send + Sync + Debug {
    fn type_name(&self) -> &'static str;
    fn score(
        &self,
        req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        idx: &[usize],
        out: &mut [f64],
    );
}

/// Picks the endpoints to use, best first, from `(candidate index, total score)` pairs.
pub trait Picker: Send + Sync + Debug {
    fn type_name(&self) -> &'static str;
    fn pick(&self, scored: &mut Vec<(usize, f64)>, rng: &mut dyn rand::RngCore) -> Vec<usize>;
}

/// The first `n` (at least one) candidate indices of an ordered list.
/// Each candidate's matched blocks from an index's runs `(pod id, blocks)`, the candidates found
/// by name (`pod_id`). Through a table by pod id (`slots` long): a system prompt every pod holds
/// makes a run per pod, and a search of the runs per candidate would be quadratic in the pool.
pub(crate) fn matched_by_candidate<T: Copy + Default>(
    candidates: &[Candidate],
    runs: impl IntoIterator<Item = (u32, T)>,
    slots: usize,
    pod_id: impl Fn(&str) -> Option<u32>,
) -> Vec<T> {
    let mut by_pod = vec![T::default(); slots];
    let mut any = false;
    for (pod, blocks) in runs {
        if let Some(b) = by_pod.get_mut(pod as usize) {
            *b = blocks;
            any = true;
        }
    }
    if !any {
        return vec![T::default(); candidates.len()];
    }
    candidates
        .iter()
        .map(|c| {
            pod_id(&c.endpoint.hostport)
                .and_then(|id| by_pod.get(id as usize).copied())
                .unwrap_or_default()
        })
        .collect()
}

pub(crate) fn first_n(ordered: &[(usize, f64)], n: usize) -> Vec<usize> {
    ordered.iter().take(n.max(1)).map(|(i, _)| *i).collect()
}

/// Decode a plugin's `parameters` strictly; an absent block decodes from `{}`.
pub(crate) fn params<T: serde::de::DeserializeOwned>(
    value: Option<&serde_json::Value>,
    path: &str,
) -> Result<T, crate::config::ConfigError> {
    let empty = serde_json::Value::Object(Default::default());
    let v = match value {
        Some(serde_json::Value::Null) | None => &empty,
        Some(v) => v,
    };
    crate::config::decode_at(v, path)
}

/// `maxNumOfEndpoints`, shared by every picker.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PickerParams {
    #[serde(default = "one")]
    pub max_num_of_endpoints: usize,
}

fn one() -> usize {
    1
}

/// An empty parameter block: any key is an error.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

#[cfg(test)]
pub(crate) mod testutil {
    use std::collections::HashMap;
    use std::sync::LazyLock;

    use super::*;
    pub use crate::datalayer::testutil::*;

    pub static NO_HEADERS: LazyLock<HashMap<String, String>> = LazyLock::new(HashMap::new);
    pub static NO_PROMPT: Prompt = Prompt::None;

    pub fn req() -> SchedRequest<'static> {
        SchedRequest {
            request_id: "r",
            model: "m",
            target_model: "m",
            prompt: &NO_PROMPT,
            cache_salt: None,
            priority: 0,
            headers: &NO_HEADERS,
            tokens: None,
            media: &[],
        }
    }

    /// Run a scorer over all candidates.
    pub fn score_all(s: &dyn Scorer, data: &RequestData, cs: &[Candidate]) -> Vec<f64> {
        let idx: Vec<usize> = (0..cs.len()).collect();
        let mut out = vec![-1.0; cs.len()];
        s.score(&req(), data, cs, &idx, &mut out);
        out
    }
}

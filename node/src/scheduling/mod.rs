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

pub mod filters;
pub mod inflight;
pub mod kv_cache_scorer;
pub mod load_scorers;
pub mod lora_affinity_scorer;
pub mod max_score_picker;
pub mod prefix;
pub mod queue_scorer;
pub mod random_picker;
pub mod registry;
pub mod scheduler;
pub mod session;
pub mod weighted_random_picker;

use std::collections::HashMap;
use std::fmt::Debug;

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
    pub headers: &'a HashMap<String, String>,
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
}

/// Data produced for one request, aligned with the candidate list.
#[derive(Debug, Clone, Default)]
pub struct RequestData {
    /// Prompt length in (estimated) tokens.
    pub prompt_tokens: usize,
    pub prefix: Option<PrefixMatchInfo>,
    /// Empty unless an in-flight producer runs.
    pub inflight: Vec<InflightLoad>,
}

impl RequestData {
    /// Prompt tokens not already cached on candidate `i` (all of them without prefix data).
    pub fn uncached_tokens(&self, i: usize) -> usize {
        match &self.prefix {
            Some(p) => self
                .prompt_tokens
                .saturating_sub(p.matched.get(i).copied().unwrap_or(0) * p.block_size),
            None => self.prompt_tokens,
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
            headers: &NO_HEADERS,
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

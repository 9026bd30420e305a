//! Scheduling plugins and the registry that builds them from an `EndpointPickerConfig`.
//!
//! Each plugin is one module: an inert serde parameter struct decoded strictly from the YAML
//! `parameters`, a constructor, and the trait impl with unit tests. [`registry`] maps llm-d's type
//! names to constructors; [`build`] instantiates the configured plugins, injects llm-d's defaults and
//! returns the [`Scheduler`] the request path runs.

pub mod kv_cache_scorer;
pub mod max_score_picker;
pub mod queue_scorer;
pub mod random_picker;
pub mod registry;
pub mod scheduler;

use std::fmt::Debug;

use crate::datalayer::store::Candidate;

pub use registry::build;
pub use scheduler::{SchedError, Scheduler};

/// What the scheduler knows about the request being routed.
#[derive(Debug, Clone, Copy)]
pub struct SchedRequest<'a> {
    pub request_id: &'a str,
    pub model: &'a str,
    pub target_model: &'a str,
}

/// Scores every candidate; scores are clamped to [0, 1] by the scheduler and multiplied by the
/// scorer's weight. `out[i]` belongs to `candidates[i]`.
pub trait Scorer: Send + Sync + Debug {
    fn type_name(&self) -> &'static str;
    fn score(&self, req: &SchedRequest<'_>, candidates: &[&Candidate], out: &mut [f64]);
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

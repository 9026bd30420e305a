//! The plugin registry: llm-d type name → constructor ([`construct`]); [`build`] instantiates a
//! whole `EndpointPickerConfig` with llm-d's default injection.

mod build;
#[cfg(test)]
mod tests;

pub use build::{Built, build};

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use crate::config::{ConfigError, EndpointPickerConfig, parse_duration};
use crate::datalayer::inflight::InflightTracker;
use crate::request::admission::AdmissionConfig;
use crate::request::meta::AgentIdentity;
use crate::request::tokens;
use crate::scheduling::admitter::{self, Admitter};
use crate::scheduling::cost_model;
use crate::scheduling::filters::{self, LabelSelectorFilter, UtilizationFilter};
use crate::scheduling::inflight::{self, InflightProducer};
use crate::scheduling::kv_cache_scorer::{self, KvCacheScorer};
use crate::scheduling::latency;
use crate::scheduling::load_scorers::{
    self, ActiveRequestScorer, RunningRequestsScorer, TokenLoadScorer,
};
use crate::scheduling::lora_affinity_scorer::{self, LoraAffinityScorer};
use crate::scheduling::max_score_picker::{self, MaxScorePicker};
use crate::scheduling::mm_cache;
use crate::scheduling::no_hit_lru;
use crate::scheduling::precise;
use crate::scheduling::prefix::{
    self, ApproxPrefixProducer, PrefixAffinityFilter, PrefixCacheScorer,
};
use crate::scheduling::queue_scorer::{self, QueueScorer};
use crate::scheduling::random_picker::{self, RandomPicker};
use crate::scheduling::scheduler::{
    ALWAYS_DISAGG_MULTIMODAL_DECIDER, ALWAYS_DISAGG_PD_DECIDER, Handler, PREFIX_BASED_PD_DECIDER,
    PdDecider, Profile, Scheduler, WeightedScorer,
};
use crate::scheduling::session;
use crate::scheduling::session::AGENT_IDENTITY;
use crate::scheduling::weighted_random_picker::{self, WeightedRandomPicker};
use crate::scheduling::{Filter, NoParams, Picker, PickerParams, Producer, Scorer, params};

pub const SINGLE_PROFILE_HANDLER: &str = "single-profile-handler";
pub const DISAGG_PROFILE_HANDLER: &str = "disagg-profile-handler";
pub const HEADER_PROFILE_HANDLER: &str = "header-profile-handler";
/// llm-d's deprecated P/D handler: a decode profile, then the prefill profile when the uncached
/// part of the prompt is at least `threshold` characters.
pub const PD_PROFILE_HANDLER: &str = "pd-profile-handler";
/// llm-d's deprecated plugins that wrote the prefill (and encode) pick into the request headers;
/// the P/D handler does it now.
pub const DEPRECATED_HEADER_HANDLERS: [&str; 2] =
    ["prefill-header-handler", "disagg-headers-handler"];
/// llm-d's cross-replica state syncer (`dataLayer.crossReplica.syncerPluginRef`): cluster mode
/// does that work here (`config::CrossReplicaSpec::explain`).
pub const LOCAL_SYNCER: &str = "local-syncer";
pub const METRICS_DATA_SOURCE: &str = "metrics-data-source";
pub const CORE_METRICS_EXTRACTOR: &str = "core-metrics-extractor";
pub const PARSERS: [&str; 4] = [
    "openai-parser",
    "anthropic-parser",
    "vllmhttp-parser",
    "passthrough-parser",
];

/// llm-d's data-parallel handler: one profile, whose pick (a DP rank's `ip:port`) is sent to the
/// pod's `primaryPort` with the rank in `x-data-parallel-host-port`.
pub const DATA_PARALLEL_PROFILE_HANDLER: &str = "data-parallel-profile-handler";

/// A constructed plugin instance.
#[derive(Debug, Clone)]
pub enum Plugin {
    Scorer(Arc<dyn Scorer>),
    Filter(Arc<dyn Filter>),
    /// `session-affinity-scorer` / `-filter` (a scorer or filter that also records decisions and
    /// may write a token back).
    Session(Arc<session::SessionAffinity>),
    Picker(Arc<dyn Picker>),
    PrefixProducer(Arc<ApproxPrefixProducer>),
    /// `cost-model-producer`.
    CostModel(Arc<cost_model::CostModel>),
    /// `mm-embeddings-cache-producer`.
    MmCache(Arc<mm_cache::MmCache>),
    /// `predicted-latency-producer` (built on the cost model once the configuration is read).
    PredictedLatency(latency::LatencyParams),
    /// `no-hit-lru-scorer` (a scorer that also records cold requests' picks).
    NoHitLru(Arc<no_hit_lru::NoHitLru>),
    InflightProducer(inflight::InflightParams),
    /// `token-producer`: `None` for the estimate backend, else the backend bringing engine tokens.
    TokenProducer(Option<crate::request::tokens::TokenBackend>),
    /// `precise-prefix-cache-producer`.
    PrecisePrefix(Arc<precise::PrecisePrefixProducer>),
    ProfileHandler(HandlerSpec),
    /// A P/D decider of `disagg-profile-handler`.
    Decider(PdDecider),
    MetricsSource(MetricsSourceParams),
    Extractor,
    Parser(&'static str),
    /// A flow-control policy or saturation detector: used through `flowControl` references, not by
    /// the scheduler. Its parameters are validated at construction.
    FlowControl,
    /// A plugin whose work something else does here: a deprecated header handler (the P/D
    /// handler does it; warned about), `local-syncer` (cluster mode). Validated, inert.
    Superseded,
    /// `agent-identity`: where agents' session ids are read.
    AgentIdentity(AgentIdentity),
    /// `session-id-producer`: the header or cookie a `session-id` session source reads.
    SessionIdProducer(session::SessionIdSource),
    /// An admitter (`probabilistic-admitter`): asked after the producers, before the profiles.
    Admitter(Arc<dyn Admitter>),
}

/// `agent-identity` parameters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentIdentityParams {
    /// Header names checked, in order, before the agents' own.
    #[serde(default)]
    pub additional_session_headers: Vec<String>,
}

impl Plugin {
    /// The plugin as a scheduling filter, if it is one.
    fn as_filter(&self) -> Option<Arc<dyn Filter>> {
        match self {
            Plugin::Filter(f) => Some(f.clone()),
            Plugin::Session(s) if s.is_filter() => Some(s.clone()),
            _ => None,
        }
    }

    /// The plugin as a scorer, if it is one.
    fn as_scorer(&self) -> Option<Arc<dyn Scorer>> {
        match self {
            Plugin::Scorer(s) => Some(s.clone()),
            Plugin::NoHitLru(s) => Some(s.clone()),
            Plugin::Session(s) if !s.is_filter() => Some(s.clone()),
            _ => None,
        }
    }
}

/// `metrics-data-source` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MetricsSourceParams {
    #[serde(default = "default_scheme")]
    pub scheme: String,
    #[serde(default = "default_path")]
    pub path: String,
    #[serde(default = "default_true")]
    pub insecure_skip_verify: bool,
    #[serde(default)]
    pub interval: Option<String>,
}

fn default_scheme() -> String {
    "http".into()
}
fn default_path() -> String {
    "/metrics".into()
}
fn default_true() -> bool {
    true
}

impl Default for MetricsSourceParams {
    fn default() -> Self {
        MetricsSourceParams {
            scheme: default_scheme(),
            path: default_path(),
            insecure_skip_verify: true,
            interval: None,
        }
    }
}

/// `core-metrics-extractor` parameters: the label that selects the engine dialect.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExtractorParams {
    #[serde(default)]
    pub engine_label_key: Option<String>,
}

/// Construct one plugin by llm-d type name. `path` locates its parameters for error messages.
pub fn construct(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Plugin, ConfigError> {
    type Kind = fn(&str, Option<&serde_json::Value>, &str) -> Result<Option<Plugin>, ConfigError>;
    let kinds: [Kind; 4] = [
        scheduling_plugin,
        producer_plugin,
        handler_plugin,
        other_plugin,
    ];
    for kind in kinds {
        if let Some(plugin) = kind(type_name, parameters, path)? {
            return Ok(plugin);
        }
    }
    Err(ConfigError::invalid(format!(
        "{path}: unknown plugin type `{type_name}`"
    )))
}

/// Scorers, filters and pickers (what the profiles run). `None`: not one of these types.
fn scheduling_plugin(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Option<Plugin>, ConfigError> {
    let plugin = match type_name {
        queue_scorer::TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(QueueScorer))
        }
        kv_cache_scorer::TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(KvCacheScorer))
        }
        prefix::SCORER_TYPE => Plugin::Scorer(Arc::new(PrefixCacheScorer {
            params: params(parameters, path)?,
        })),
        prefix::AFFINITY_FILTER_TYPE => {
            let p: prefix::AffinityParams = params(parameters, path)?;
            if !prefix::TTFT_SOURCES.contains(&p.ttft_source.as_str()) {
                return Err(ConfigError::Field {
                    path: format!("{path}.ttftSource"),
                    message: format!(
                        "ttftSource `{}` is not supported (only {})",
                        p.ttft_source,
                        prefix::TTFT_SOURCES.join(", ")
                    ),
                });
            }
            Plugin::Filter(Arc::new(PrefixAffinityFilter { params: p }))
        }
        cost_model::SCORER_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(cost_model::CostModelScorer))
        }
        load_scorers::RUNNING_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(RunningRequestsScorer))
        }
        load_scorers::TOKEN_LOAD_TYPE => Plugin::Scorer(Arc::new(TokenLoadScorer {
            params: params(parameters, path)?,
        })),
        load_scorers::ACTIVE_REQUEST_TYPE => Plugin::Scorer(Arc::new(ActiveRequestScorer {
            params: params(parameters, path)?,
        })),
        load_scorers::LOAD_AWARE_TYPE => {
            let p: load_scorers::LoadAwareParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(load_scorers::LoadAwareScorer::new(&p)))
        }
        no_hit_lru::TYPE => {
            let p: no_hit_lru::NoHitLruParams = params(parameters, path)?;
            Plugin::NoHitLru(Arc::new(no_hit_lru::NoHitLru::new(&p)))
        }
        lora_affinity_scorer::TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(LoraAffinityScorer))
        }
        t @ (session::SCORER_TYPE | session::FILTER_TYPE) => {
            let p: session::SessionParams = params(parameters, path)?;
            let type_name = if t == session::SCORER_TYPE {
                session::SCORER_TYPE
            } else {
                session::FILTER_TYPE
            };
            Plugin::Session(Arc::new(session::SessionAffinity::new(
                type_name, &p, path,
            )?))
        }
        filters::LABEL_SELECTOR_TYPE => Plugin::Filter(Arc::new(LabelSelectorFilter {
            params: params(parameters, path)?,
        })),
        filters::BY_LABEL_SELECTOR_TYPE => {
            tracing::warn!(
                "{path}: `{type_name}` is deprecated (llm-d); loaded as `{}`",
                filters::LABEL_SELECTOR_TYPE
            );
            Plugin::Filter(Arc::new(LabelSelectorFilter {
                params: params(parameters, path)?,
            }))
        }
        filters::BY_LABEL_TYPE => {
            tracing::warn!(
                "{path}: `{type_name}` is deprecated (llm-d): use `{}` or a role filter",
                filters::LABEL_SELECTOR_TYPE
            );
            Plugin::Filter(Arc::new(filters::ByLabelFilter::new(
                params(parameters, path)?,
                path,
            )?))
        }
        filters::DECODE_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(filters::decode_filter()))
        }
        filters::PREFILL_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(filters::prefill_filter()))
        }
        filters::ENCODE_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(filters::encode_filter()))
        }
        filters::UTILIZATION_TYPE => Plugin::Filter(Arc::new(UtilizationFilter {
            params: params(parameters, path)?,
        })),
        weighted_random_picker::TYPE => {
            let p: PickerParams = params(parameters, path)?;
            Plugin::Picker(Arc::new(WeightedRandomPicker {
                max_endpoints: p.max_num_of_endpoints,
            }))
        }
        max_score_picker::TYPE => {
            let p: PickerParams = params(parameters, path)?;
            Plugin::Picker(Arc::new(MaxScorePicker {
                max_endpoints: p.max_num_of_endpoints,
            }))
        }
        random_picker::TYPE => {
            let p: PickerParams = params(parameters, path)?;
            Plugin::Picker(Arc::new(RandomPicker {
                max_endpoints: p.max_num_of_endpoints,
            }))
        }
        latency::SCORER_TYPE => {
            let p: latency::LatencyScorerParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(latency::LatencyScorer::new(&p, path)?))
        }
        latency::TIER_FILTER_TYPE => {
            let p: latency::TierParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(latency::SloHeadroomTierFilter::new(&p, path)?))
        }
        mm_cache::SCORER_TYPE => {
            let _: mm_cache::MmScorerParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(mm_cache::MmCacheScorer))
        }
        _ => return Ok(None),
    };
    Ok(Some(plugin))
}

/// Data producers and the data layer's sources (what the profiles read). `None`: not one of these types.
fn producer_plugin(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Option<Plugin>, ConfigError> {
    let plugin = match type_name {
        prefix::PRODUCER_TYPE => Plugin::PrefixProducer(Arc::new(ApproxPrefixProducer::new(
            params(parameters, path)?,
        ))),
        cost_model::PRODUCER_TYPE => {
            let p: cost_model::CostModelParams = params(parameters, path)?;
            p.validate(path)?;
            Plugin::CostModel(Arc::new(cost_model::CostModel::new(p)))
        }
        inflight::TYPE => Plugin::InflightProducer(params(parameters, path)?),
        tokens::TYPE => {
            let p: tokens::TokenProducerParams = params(parameters, path)?;
            Plugin::TokenProducer(p.render(path)?)
        }
        precise::PRODUCER_TYPE => {
            let p: precise::PreciseParams = params(parameters, path)?;
            p.validate(path)?;
            Plugin::PrecisePrefix(Arc::new(precise::PrecisePrefixProducer::new(p)))
        }
        latency::PRODUCER_TYPE => {
            let p: latency::LatencyParams = params(parameters, path)?;
            p.validate(path)?;
            Plugin::PredictedLatency(p)
        }
        mm_cache::PRODUCER_TYPE => {
            let p: mm_cache::MmCacheParams = params(parameters, path)?;
            Plugin::MmCache(Arc::new(mm_cache::MmCache::new(&p)))
        }
        session::SESSION_ID_PRODUCER => {
            let p: session::SessionIdProducerParams = params(parameters, path)?;
            Plugin::SessionIdProducer(p.source(path)?)
        }
        AGENT_IDENTITY => {
            let p: AgentIdentityParams = params(parameters, path)?;
            for (k, h) in p.additional_session_headers.iter().enumerate() {
                if h.is_empty() || !h.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
                    return Err(ConfigError::Field {
                        path: format!("{path}.additionalSessionHeaders[{k}]"),
                        message: format!("`{h}` is not a header name"),
                    });
                }
            }
            Plugin::AgentIdentity(AgentIdentity::new(&p.additional_session_headers))
        }
        METRICS_DATA_SOURCE => {
            let p: MetricsSourceParams = params(parameters, path)?;
            if let Some(i) = &p.interval {
                parse_duration(i).map_err(|message| ConfigError::Field {
                    path: format!("{path}.interval"),
                    message,
                })?;
            }
            if p.scheme != "http" {
                return Err(ConfigError::Field {
                    path: format!("{path}.scheme"),
                    message: format!("scheme `{}` is not supported yet (only http)", p.scheme),
                });
            }
            Plugin::MetricsSource(p)
        }
        CORE_METRICS_EXTRACTOR => {
            let _: ExtractorParams = params(parameters, path)?;
            Plugin::Extractor
        }
        _ => return Ok(None),
    };
    Ok(Some(plugin))
}

/// Profile handlers and P/D deciders (which profiles run). `None`: not one of these types.
fn handler_plugin(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Option<Plugin>, ConfigError> {
    let plugin = match type_name {
        SINGLE_PROFILE_HANDLER => {
            let _: NoParams = params(parameters, path)?;
            Plugin::ProfileHandler(HandlerSpec::Single)
        }
        DISAGG_PROFILE_HANDLER => {
            Plugin::ProfileHandler(HandlerSpec::Disagg(params(parameters, path)?))
        }
        HEADER_PROFILE_HANDLER => {
            let p: HeaderProfileParams = params(parameters, path)?;
            if p.header_name.trim().is_empty() {
                return Err(ConfigError::Field {
                    path: format!("{path}.headerName"),
                    message: "must name a header".into(),
                });
            }
            Plugin::ProfileHandler(HandlerSpec::Header(p))
        }
        DATA_PARALLEL_PROFILE_HANDLER => {
            let p: DataParallelParams = params(parameters, path)?;
            Plugin::ProfileHandler(HandlerSpec::DataParallel(primary_port(
                p.primary_port,
                path,
            )?))
        }
        PD_PROFILE_HANDLER => {
            let p: PdProfileParams = params(parameters, path)?;
            let spec = p.into_spec(path)?;
            tracing::warn!(
                "{path}: `{PD_PROFILE_HANDLER}` is deprecated (llm-d); loaded as \
                 `{DISAGG_PROFILE_HANDLER}` with {}",
                match spec.decider {
                    PdDecider::Always => "every request disaggregated (threshold 0)".to_string(),
                    PdDecider::PrefixBased {
                        non_cached_tokens, ..
                    } => format!("a prefix-based decider at {non_cached_tokens} uncached tokens"),
                    PdDecider::Multimodal => ALWAYS_DISAGG_MULTIMODAL_DECIDER.to_string(),
                }
            );
            Plugin::ProfileHandler(HandlerSpec::Pd(spec))
        }
        t if DEPRECATED_HEADER_HANDLERS.contains(&t) => {
            let _: HeaderHandlerParams = params(parameters, path)?;
            tracing::warn!(
                "{path}: `{t}` is deprecated (llm-d): the P/D profile handler sets \
                 `x-prefiller-host-port` itself; the plugin is accepted and does nothing"
            );
            Plugin::Superseded
        }
        PREFIX_BASED_PD_DECIDER => {
            let p: PrefixDeciderParams = params(parameters, path)?;
            Plugin::Decider(PdDecider::PrefixBased {
                non_cached_tokens: p.non_cached_tokens,
                prompt_tokens: p.prompt_tokens,
            })
        }
        ALWAYS_DISAGG_PD_DECIDER => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Decider(PdDecider::Always)
        }
        ALWAYS_DISAGG_MULTIMODAL_DECIDER => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Decider(PdDecider::Multimodal)
        }
        _ => return Ok(None),
    };
    Ok(Some(plugin))
}

/// Admitters, parsers, flow-control policies and plugins whose work is done elsewhere. `None`: not one of these types.
fn other_plugin(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Option<Plugin>, ConfigError> {
    let plugin = match type_name {
        latency::ADMITTER_TYPE => {
            let _: latency::AdmitterParams = params(parameters, path)?;
            Plugin::Admitter(Arc::new(latency::LatencySloAdmitter))
        }
        admitter::PROBABILISTIC_TYPE => {
            let p: admitter::ProbabilisticParams = params(parameters, path)?;
            p.validate(path)?;
            Plugin::Admitter(Arc::new(admitter::ProbabilisticAdmitter { params: p }))
        }
        LOCAL_SYNCER => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Superseded
        }
        t if PARSERS.contains(&t) => {
            let _: NoParams = params(parameters, path)?;
            let name = PARSERS
                .iter()
                .find(|p| **p == t)
                .copied()
                .unwrap_or("openai-parser");
            Plugin::Parser(name)
        }
        flowctl::UTILIZATION_DETECTOR | flowctl::CONCURRENCY_DETECTOR => {
            flowctl::SaturationDetector::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::GLOBAL_STRICT_FAIRNESS
        | flowctl::ROUND_ROBIN_FAIRNESS
        | flowctl::WEIGHTED_FAIRNESS
        | flowctl::PROGRAM_AWARE_FAIRNESS => {
            flowctl::FairnessPolicy::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::FCFS_ORDERING | flowctl::EDF_ORDERING | flowctl::SLO_DEADLINE_ORDERING => {
            flowctl::OrderingPolicy::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::STATIC_USAGE_LIMIT
        | flowctl::PRIORITY_HOLDBACK
        | flowctl::SOFT_REFLECTIVE_CEILING => {
            flowctl::UsageLimit::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::SHEDDABLE_EVICTION_FILTER
        | flowctl::PRIORITY_THEN_TIME_EVICTION_ORDER
        | flowctl::STRICT_BAND_SELECTION => {
            let _: NoParams = params(parameters, path)?;
            Plugin::FlowControl
        }
        _ => return Ok(None),
    };
    Ok(Some(plugin))
}

/// A configured profile handler.
#[derive(Debug, Clone)]
pub enum HandlerSpec {
    Single,
    Disagg(DisaggParams),
    /// The deprecated `pd-profile-handler`, as a decode profile, an optional prefill profile and
    /// the decider its threshold amounts to.
    Pd(PdSpec),
    Header(HeaderProfileParams),
    /// `data-parallel-profile-handler`: the single profile, its picks rewritten to this port.
    DataParallel(u16),
}

/// `data-parallel-profile-handler` parameters (llm-d's name and default).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DataParallelParams {
    #[serde(default = "d_primary_port")]
    pub primary_port: i64,
}

fn d_primary_port() -> i64 {
    8000
}

/// A data-parallel primary port: a TCP port, 1–65535.
fn primary_port(port: i64, path: &str) -> Result<u16, ConfigError> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ConfigError::Field {
            path: format!("{path}.primaryPort"),
            message: format!("must be a TCP port (1-65535), got {port}"),
        })
}

/// `header-profile-handler` parameters (llm-d's names and defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderProfileParams {
    #[serde(default = "d_profile_header")]
    pub header_name: String,
    #[serde(default = "d_decode")]
    pub default_profile: String,
}

fn d_profile_header() -> String {
    "EPP-Profile".into()
}

#[derive(Debug, Clone)]
pub struct PdSpec {
    pub decode: String,
    pub prefill: String,
    pub decider: PdDecider,
    /// `primaryPort` (data-parallel ranks), when not 0.
    pub primary_port: Option<u16>,
}

/// `pd-profile-handler` parameters (llm-d's names and defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PdProfileParams {
    /// Uncached prompt characters from which a request is disaggregated (0: always).
    #[serde(default)]
    pub threshold: i64,
    #[serde(default = "d_decode")]
    pub decode_profile: String,
    #[serde(default = "d_prefill")]
    pub prefill_profile: String,
    /// Which prefix plugin's state to read: there is one prefix match per request here.
    #[serde(default)]
    pub prefix_plugin_type: Option<String>,
    #[serde(default)]
    pub prefix_plugin_name: Option<String>,
    /// llm-d converted prefix blocks to characters with it; our match is in tokens already.
    #[serde(default = "d_hash_block_size")]
    pub hash_block_size: i64,
    /// Data-parallel rank port (0: off).
    #[serde(default)]
    pub primary_port: i64,
}

fn d_decode() -> String {
    "decode".into()
}
fn d_prefill() -> String {
    "prefill".into()
}
fn d_hash_block_size() -> i64 {
    64
}

impl PdProfileParams {
    /// llm-d disaggregated when `(1 − hit share) × prompt characters ≥ threshold`; at its own
    /// estimate of 4 characters a token that is `uncached tokens ≥ ⌈threshold / 4⌉` — the
    /// prefix-based decider. A threshold of 0 disaggregated every request.
    fn into_spec(self, path: &str) -> Result<PdSpec, ConfigError> {
        let field = |k: &str, message: String| ConfigError::Field {
            path: format!("{path}.{k}"),
            message,
        };
        if self.threshold < 0 {
            return Err(field(
                "threshold",
                format!("must be >= 0, got {}", self.threshold),
            ));
        }
        if self.hash_block_size <= 0 {
            return Err(field(
                "hashBlockSize",
                format!("must be > 0, got {}", self.hash_block_size),
            ));
        }
        let primary_port = match self.primary_port {
            0 => None,
            p => Some(primary_port(p, path)?),
        };
        let decider = match self.threshold {
            0 => PdDecider::Always,
            t => PdDecider::PrefixBased {
                non_cached_tokens: (t as usize).div_ceil(4),
                prompt_tokens: 0,
            },
        };
        Ok(PdSpec {
            decode: self.decode_profile,
            prefill: self.prefill_profile,
            decider,
            primary_port,
        })
    }
}

/// `prefill-header-handler` / `disagg-headers-handler` parameters (accepted, unused).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderHandlerParams {
    #[serde(default)]
    pub prefill_profile: Option<String>,
    #[serde(default)]
    pub encode_profile: Option<String>,
}

/// `disagg-profile-handler` parameters (llm-d's names and defaults).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DisaggParams {
    #[serde(default)]
    pub profiles: DisaggProfiles,
    #[serde(default)]
    pub deciders: DisaggDeciders,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct DisaggProfiles {
    pub decode: String,
    pub prefill: String,
    pub encode: String,
}

impl Default for DisaggProfiles {
    fn default() -> Self {
        DisaggProfiles {
            decode: "decode".into(),
            prefill: "prefill".into(),
            encode: "encode".into(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DisaggDeciders {
    #[serde(default)]
    pub prefill: Option<String>,
    #[serde(default)]
    pub encode: Option<String>,
}

/// `prefix-based-pd-decider` parameters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrefixDeciderParams {
    #[serde(default)]
    pub non_cached_tokens: usize,
    #[serde(default)]
    pub prompt_tokens: usize,
}

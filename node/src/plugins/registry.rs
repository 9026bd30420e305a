//! The plugin registry: llm-d type name → constructor, and llm-d's default injection.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::filters::{self, LabelSelectorFilter, UtilizationFilter};
use super::inflight::{self, InflightProducer, InflightTracker};
use super::kv_cache_scorer::{self, KvCacheScorer};
use super::load_scorers::{self, ActiveRequestScorer, RunningRequestsScorer, TokenLoadScorer};
use super::lora_affinity_scorer::{self, LoraAffinityScorer};
use super::max_score_picker::{self, MaxScorePicker};
use super::prefix::{self, ApproxPrefixProducer, PrefixAffinityFilter, PrefixCacheScorer};
use super::queue_scorer::{self, QueueScorer};
use super::random_picker::{self, RandomPicker};
use super::scheduler::{
    ALWAYS_DISAGG_PD_DECIDER, Handler, PREFIX_BASED_PD_DECIDER, PdDecider, Profile, Scheduler,
    WeightedScorer,
};
use super::session;
use super::weighted_random_picker::{self, WeightedRandomPicker};
use super::{Filter, NoParams, Picker, PickerParams, Producer, Scorer, params};
use crate::config::{ConfigError, EndpointPickerConfig, parse_duration};

pub const SINGLE_PROFILE_HANDLER: &str = "single-profile-handler";
pub const DISAGG_PROFILE_HANDLER: &str = "disagg-profile-handler";
pub const METRICS_DATA_SOURCE: &str = "metrics-data-source";
pub const CORE_METRICS_EXTRACTOR: &str = "core-metrics-extractor";
pub const PARSERS: [&str; 4] = [
    "openai-parser",
    "anthropic-parser",
    "vllmhttp-parser",
    "passthrough-parser",
];

/// llm-d plugin types this build recognises but does not implement yet: a config naming one fails
/// with a message saying so, rather than "unknown type".
const NOT_YET: &[&str] = &[
    "precise-prefix-cache-producer",
    "load-aware-scorer",
    "no-hit-lru-scorer",
    "session-id-producer",
    "agent-identity",
    "encode-filter",
    "always-disagg-multimodal-decider",
    "data-parallel-profile-handler",
    "header-profile-handler",
    "latency-slo-admitter",
    "probabilistic-admitter",
    "predicted-latency-producer",
    "latency-scorer",
];

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
    InflightProducer(inflight::InflightParams),
    /// `token-producer` (estimate backend: the count comes from the prompt's estimate tokens).
    TokenProducer,
    ProfileHandler(HandlerSpec),
    /// A P/D decider of `disagg-profile-handler`.
    Decider(PdDecider),
    MetricsSource(MetricsSourceParams),
    Extractor,
    Parser(&'static str),
    /// A flow-control policy or saturation detector: used through `flowControl` references, not by
    /// the scheduler. Its parameters are validated at construction.
    FlowControl,
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
            Plugin::Session(s) if !s.is_filter() => Some(s.clone()),
            _ => None,
        }
    }
}

/// How requests are admitted, from `featureGates` and `flowControl`.
#[derive(Debug, Clone)]
pub enum AdmissionConfig {
    /// Gate off: llm-d's legacy controller with this detector.
    Legacy(flowctl::SaturationDetector),
    /// Gate on: flow control.
    FlowControl(Box<flowctl::ControllerConfig>),
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

/// `token-producer` parameters: only the tokenizer-free `estimate` backend exists here.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TokenProducerParams {
    #[serde(default = "estimate")]
    pub backend: String,
}

fn estimate() -> String {
    "estimate".into()
}

/// Construct one plugin by llm-d type name. `path` locates its parameters for error messages.
pub fn construct(
    type_name: &str,
    parameters: Option<&serde_json::Value>,
    path: &str,
) -> Result<Plugin, ConfigError> {
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
        prefix::PRODUCER_TYPE => Plugin::PrefixProducer(Arc::new(ApproxPrefixProducer::new(
            params(parameters, path)?,
        ))),
        prefix::AFFINITY_FILTER_TYPE => {
            let p: prefix::AffinityParams = params(parameters, path)?;
            if p.ttft_source != "prefillThroughput" {
                return Err(ConfigError::Field {
                    path: format!("{path}.ttftSource"),
                    message: format!(
                        "ttftSource `{}` is not supported (only prefillThroughput)",
                        p.ttft_source
                    ),
                });
            }
            Plugin::Filter(Arc::new(PrefixAffinityFilter { params: p }))
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
        lora_affinity_scorer::TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Scorer(Arc::new(LoraAffinityScorer))
        }
        inflight::TYPE => Plugin::InflightProducer(params(parameters, path)?),
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
        "token-producer" => {
            let p: TokenProducerParams = params(parameters, path)?;
            if p.backend != "estimate" {
                return Err(ConfigError::Field {
                    path: format!("{path}.backend"),
                    message: format!("backend `{}` is not supported (only estimate)", p.backend),
                });
            }
            Plugin::TokenProducer
        }
        filters::LABEL_SELECTOR_TYPE => Plugin::Filter(Arc::new(LabelSelectorFilter {
            params: params(parameters, path)?,
        })),
        filters::DECODE_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(filters::decode_filter()))
        }
        filters::PREFILL_TYPE => {
            let _: NoParams = params(parameters, path)?;
            Plugin::Filter(Arc::new(filters::prefill_filter()))
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
        SINGLE_PROFILE_HANDLER => {
            let _: NoParams = params(parameters, path)?;
            Plugin::ProfileHandler(HandlerSpec::Single)
        }
        DISAGG_PROFILE_HANDLER => {
            Plugin::ProfileHandler(HandlerSpec::Disagg(params(parameters, path)?))
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
        | flowctl::WEIGHTED_FAIRNESS => {
            flowctl::FairnessPolicy::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::FCFS_ORDERING | flowctl::EDF_ORDERING | flowctl::SLO_DEADLINE_ORDERING => {
            flowctl::OrderingPolicy::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        flowctl::STATIC_USAGE_LIMIT | flowctl::PRIORITY_HOLDBACK => {
            flowctl::UsageLimit::from_plugin(type_name, parameters, path)?;
            Plugin::FlowControl
        }
        t if NOT_YET.contains(&t) => {
            return Err(ConfigError::invalid(format!(
                "{path}: plugin type `{t}` is an llm-d plugin this build does not implement yet"
            )));
        }
        t => {
            return Err(ConfigError::invalid(format!(
                "{path}: unknown plugin type `{t}`"
            )));
        }
    };
    Ok(plugin)
}

fn describe_profile(profile: &Profile) -> String {
    format!(
        "profile={} filters=[{}] scorers=[{}] picker={}",
        profile.name,
        profile
            .filters
            .iter()
            .map(|f| f.type_name())
            .collect::<Vec<_>>()
            .join(", "),
        profile
            .scorers
            .iter()
            .map(|s| format!("{}({})*{}", s.name, s.scorer.type_name(), s.weight))
            .collect::<Vec<_>>()
            .join(", "),
        profile.picker.type_name(),
    )
}

/// Build configured profile `k` from its plugin references.
fn build_profile(
    k: usize,
    spec: &crate::config::ProfileSpec,
    instances: &[(String, String, Plugin)],
    by_name: &HashMap<String, usize>,
    default_picker: &Arc<dyn Picker>,
) -> Result<Profile, ConfigError> {
    let mut scorers = Vec::new();
    let mut filters = Vec::new();
    let mut picker = None;
    for (j, r) in spec.plugins.iter().enumerate() {
        let path = format!("schedulingProfiles[{k}].plugins[{j}].pluginRef");
        let idx = by_name
            .get(&r.plugin_ref)
            .ok_or_else(|| ConfigError::Field {
                path: path.clone(),
                message: format!("no plugin named `{}`", r.plugin_ref),
            })?;
        let (name, type_name, p) = &instances[*idx];
        if let Some(f) = p.as_filter() {
            filters.push(f);
            continue;
        }
        if let Some(scorer) = p.as_scorer() {
            let weight = r.weight.unwrap_or(1.0);
            if !weight.is_finite() || weight < 0.0 {
                return Err(ConfigError::Field {
                    path: format!("schedulingProfiles[{k}].plugins[{j}].weight"),
                    message: "weight must be a finite number >= 0".into(),
                });
            }
            scorers.push(WeightedScorer {
                name: name.clone(),
                weight,
                scorer,
            });
            continue;
        }
        match p {
            Plugin::Picker(p) => {
                if picker.is_some() {
                    return Err(ConfigError::Field {
                        path,
                        message: "a profile takes one picker".into(),
                    });
                }
                picker = Some(p.clone());
            }
            _ => {
                return Err(ConfigError::Field {
                    path,
                    message: format!(
                        "plugin `{name}` of type `{type_name}` cannot be used in a scheduling profile"
                    ),
                });
            }
        }
    }
    Ok(Profile {
        name: spec.name.clone(),
        filters,
        scorers,
        picker: picker.unwrap_or_else(|| default_picker.clone()),
    })
}

/// A configured profile handler.
#[derive(Debug, Clone)]
pub enum HandlerSpec {
    Single,
    Disagg(DisaggParams),
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

/// What the configuration builds: the scheduler and the data-layer settings.
#[derive(Debug, Clone)]
pub struct Built {
    pub scheduler: Scheduler,
    pub metrics_source: MetricsSourceParams,
    /// The in-flight ledger, when a plugin needs one (the response path releases into it).
    pub inflight: Option<Arc<InflightTracker>>,
    pub admission: AdmissionConfig,
    /// Effective configuration, for the start-up log line.
    pub summary: String,
}

/// Instantiate every plugin, apply llm-d's default injection and validate references.
pub fn build(cfg: &EndpointPickerConfig) -> Result<Built, ConfigError> {
    // Validate every other gate entry's syntax.
    for g in &cfg.feature_gates {
        let name = g.split_once('=').map_or(g.as_str(), |(n, _)| n);
        cfg.gate(name.trim())?;
    }

    let mut instances: Vec<(String, String, Plugin)> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for (i, spec) in cfg.plugins.iter().enumerate() {
        let path = format!("plugins[{i}].parameters");
        let name = spec.instance_name().to_string();
        if by_name.contains_key(&name) {
            return Err(ConfigError::Field {
                path: format!("plugins[{i}].name"),
                message: format!("duplicate plugin name `{name}`"),
            });
        }
        let plugin =
            construct(&spec.type_name, spec.parameters.as_ref(), &path).map_err(|e| match e {
                ConfigError::Invalid(m) => ConfigError::Invalid(
                    m.replace(&format!("{path}:"), &format!("plugins[{i}].type:")),
                ),
                other => other,
            })?;
        by_name.insert(name.clone(), instances.len());
        instances.push((name, spec.type_name.clone(), plugin));
    }

    // The profile handler: at most one, default single-profile-handler.
    let handlers: Vec<&HandlerSpec> = instances
        .iter()
        .filter_map(|(_, _, p)| match p {
            Plugin::ProfileHandler(h) => Some(h),
            _ => None,
        })
        .collect();
    if handlers.len() > 1 {
        return Err(ConfigError::invalid(
            "plugins: more than one profile handler configured",
        ));
    }
    let handler_spec = handlers
        .first()
        .copied()
        .cloned()
        .unwrap_or(HandlerSpec::Single);

    // First picker anywhere, or the default max-score-picker.
    let first_picker = instances.iter().find_map(|(_, _, p)| match p {
        Plugin::Picker(p) => Some(p.clone()),
        _ => None,
    });
    let default_picker: Arc<dyn Picker> =
        first_picker.unwrap_or_else(|| Arc::new(MaxScorePicker { max_endpoints: 1 }));

    let profiles: Vec<Profile> = if cfg.scheduling_profiles.is_empty() {
        // No profiles: one `default` profile with every filter/scorer/picker, weight 1.
        let mut scorers = Vec::new();
        let mut filters = Vec::new();
        let mut picker = None;
        for (name, _, p) in &instances {
            if let Some(f) = p.as_filter() {
                filters.push(f);
            } else if let Some(scorer) = p.as_scorer() {
                scorers.push(WeightedScorer {
                    name: name.clone(),
                    weight: 1.0,
                    scorer,
                });
            } else if let Plugin::Picker(p) = p
                && picker.is_none()
            {
                picker = Some(p.clone());
            }
        }
        vec![Profile {
            name: "default".into(),
            filters,
            scorers,
            picker: picker.unwrap_or(default_picker),
        }]
    } else {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for (k, spec) in cfg.scheduling_profiles.iter().enumerate() {
            if !seen.insert(spec.name.as_str()) {
                return Err(ConfigError::Field {
                    path: format!("schedulingProfiles[{k}].name"),
                    message: format!("duplicate profile name `{}`", spec.name),
                });
            }
            out.push(build_profile(
                k,
                spec,
                &instances,
                &by_name,
                &default_picker,
            )?);
        }
        out
    };

    let handler = match handler_spec {
        HandlerSpec::Single => {
            if profiles.len() > 1 {
                return Err(ConfigError::invalid(format!(
                    "schedulingProfiles: {} profiles need a multi-profile handler; `{SINGLE_PROFILE_HANDLER}` runs exactly one",
                    profiles.len()
                )));
            }
            match profiles.into_iter().next() {
                Some(p) => Handler::Single(p),
                None => return Err(ConfigError::invalid("schedulingProfiles: no profile")),
            }
        }
        HandlerSpec::Disagg(params) => {
            let find = |name: &str, key: &str| {
                profiles
                    .iter()
                    .find(|p| p.name == name)
                    .cloned()
                    .ok_or_else(|| {
                        ConfigError::invalid(format!(
                            "{DISAGG_PROFILE_HANDLER}: parameters.profiles.{key} names `{name}`, which is not a scheduling profile"
                        ))
                    })
            };
            let decode = find(&params.profiles.decode, "decode")?;
            if params.deciders.encode.is_some() {
                return Err(ConfigError::invalid(format!(
                    "{DISAGG_PROFILE_HANDLER}: parameters.deciders.encode: encode disaggregation is not implemented by this build yet"
                )));
            }
            let prefill = match &params.deciders.prefill {
                None => {
                    tracing::warn!(
                        "{DISAGG_PROFILE_HANDLER} without deciders.prefill: every request is decode-only"
                    );
                    None
                }
                Some(name) => {
                    let decider = by_name
                        .get(name)
                        .and_then(|i| match &instances[*i].2 {
                            Plugin::Decider(d) => Some(*d),
                            _ => None,
                        })
                        .ok_or_else(|| {
                            ConfigError::invalid(format!(
                                "{DISAGG_PROFILE_HANDLER}: parameters.deciders.prefill: `{name}` is not a P/D decider plugin"
                            ))
                        })?;
                    Some((find(&params.profiles.prefill, "prefill")?, decider))
                }
            };
            Handler::Disagg { decode, prefill }
        }
    };
    let has_decider = matches!(
        handler,
        Handler::Disagg {
            prefill: Some((_, PdDecider::PrefixBased { .. })),
            ..
        }
    );
    let scheduler_profiles: Vec<Profile> = match &handler {
        Handler::Single(p) => vec![p.clone()],
        Handler::Disagg { decode, prefill } => std::iter::once(decode.clone())
            .chain(prefill.as_ref().map(|(p, _)| p.clone()))
            .collect(),
    };

    // Data producers: the configured ones, plus llm-d's defaults for every consumer that needs one.
    let uses = |t: &[&str]| {
        scheduler_profiles.iter().any(|profile| {
            profile
                .scorers
                .iter()
                .any(|s| t.contains(&s.scorer.type_name()))
                || profile.filters.iter().any(|f| t.contains(&f.type_name()))
        })
    };
    let needs_prefix = has_decider || uses(&[prefix::SCORER_TYPE, prefix::AFFINITY_FILTER_TYPE]);
    let needs_inflight = uses(&[
        load_scorers::TOKEN_LOAD_TYPE,
        load_scorers::ACTIVE_REQUEST_TYPE,
        prefix::AFFINITY_FILTER_TYPE,
        filters::UTILIZATION_TYPE,
    ]);
    let mut producers: Vec<Arc<dyn Producer>> = Vec::new();
    let configured_prefix = instances.iter().find_map(|(_, _, p)| match p {
        Plugin::PrefixProducer(p) => Some(p.clone()),
        _ => None,
    });
    let prefix_index = match configured_prefix {
        Some(p) => Some(p),
        None if needs_prefix => Some(Arc::new(ApproxPrefixProducer::new(
            prefix::ProducerParams::default(),
        ))),
        None => None,
    };
    if let Some(p) = &prefix_index {
        producers.push(p.clone());
    }
    let configured_inflight = instances.iter().find_map(|(_, _, p)| match p {
        Plugin::InflightProducer(p) => Some(p.clone()),
        _ => None,
    });
    let inflight_params = match configured_inflight {
        Some(p) => Some(p),
        None if needs_inflight => Some(inflight::InflightParams::default()),
        None => None,
    };
    let inflight = inflight_params.map(|params| {
        let tracker = Arc::new(InflightTracker::default());
        producers.push(Arc::new(InflightProducer {
            params,
            tracker: tracker.clone(),
        }));
        tracker
    });

    // Data layer: metrics-data-source (+ core-metrics-extractor) unless injectDefaults: false.
    let mut metrics_source = None;
    if let Some(dl) = &cfg.data_layer {
        for (i, src) in dl.sources.iter().enumerate() {
            let idx = by_name
                .get(&src.plugin_ref)
                .ok_or_else(|| ConfigError::Field {
                    path: format!("dataLayer.sources[{i}].pluginRef"),
                    message: format!("no plugin named `{}`", src.plugin_ref),
                })?;
            match &instances[*idx].2 {
                Plugin::MetricsSource(p) => metrics_source = Some(p.clone()),
                _ => {
                    return Err(ConfigError::Field {
                        path: format!("dataLayer.sources[{i}].pluginRef"),
                        message: format!("`{}` is not a data source", src.plugin_ref),
                    });
                }
            }
            for (k, ex) in src.extractors.iter().enumerate() {
                let ok = by_name
                    .get(&ex.plugin_ref)
                    .is_some_and(|i| matches!(instances[*i].2, Plugin::Extractor));
                if !ok {
                    return Err(ConfigError::Field {
                        path: format!("dataLayer.sources[{i}].extractors[{k}].pluginRef"),
                        message: format!("`{}` is not a metrics extractor", ex.plugin_ref),
                    });
                }
            }
        }
        if dl.discovery.is_some() || dl.peer_discovery.is_some() {
            return Err(ConfigError::invalid(
                "dataLayer.discovery / peerDiscovery plugins are not implemented yet; use --endpoints-file",
            ));
        }
    }
    if metrics_source.is_none() {
        metrics_source = instances.iter().find_map(|(_, _, p)| match p {
            Plugin::MetricsSource(p) => Some(p.clone()),
            _ => None,
        });
    }
    let metrics_source = metrics_source.unwrap_or_default();

    if let Some(rh) = &cfg.request_handler {
        for (i, r) in rh.parsers.iter().enumerate() {
            let known = by_name
                .get(&r.plugin_ref)
                .is_some_and(|i| matches!(instances[*i].2, Plugin::Parser(_)))
                || PARSERS.contains(&r.plugin_ref.as_str());
            if !known {
                return Err(ConfigError::Field {
                    path: format!("requestHandler.parsers[{i}].pluginRef"),
                    message: format!("`{}` is not a parser", r.plugin_ref),
                });
            }
        }
    }
    let admission = if cfg.gate("flowControl")? == Some(true) {
        AdmissionConfig::FlowControl(Box::new(crate::admission::controller_config(cfg)?))
    } else {
        if cfg
            .flow_control
            .as_ref()
            .and_then(|v| v.as_object())
            .is_some_and(|o| o.keys().any(|k| k != "saturationDetector"))
        {
            tracing::warn!(
                "flowControl section present but the flowControl gate is off: only its saturationDetector is used"
            );
        }
        AdmissionConfig::Legacy(crate::admission::legacy_detector(cfg)?)
    };

    let profiles_summary = match &handler {
        Handler::Single(p) => describe_profile(p),
        Handler::Disagg { decode, prefill } => {
            let mut s = format!(
                "{DISAGG_PROFILE_HANDLER} decode: {}",
                describe_profile(decode)
            );
            match prefill {
                Some((p, d)) => {
                    s += &format!(" | prefill when {}: {}", d.type_name(), describe_profile(p))
                }
                None => s += " | no prefill decider",
            }
            s
        }
    };
    let summary = format!(
        "producers=[{}] {} metrics={}://<pod>{} every {}",
        producers
            .iter()
            .map(|p| p.type_name())
            .collect::<Vec<_>>()
            .join(", "),
        profiles_summary,
        metrics_source.scheme,
        metrics_source.path,
        metrics_source.interval.as_deref().unwrap_or("base tick"),
    ) + &match &admission {
        AdmissionConfig::Legacy(d) => format!(" admission=legacy({})", d.type_name()),
        AdmissionConfig::FlowControl(c) => format!(
            " admission=flow-control(bands=[{}] detector={} maxRequests={} ttl={}s)",
            c.bands
                .iter()
                .map(|b| b.priority.to_string())
                .collect::<Vec<_>>()
                .join(","),
            c.detector.type_name(),
            c.max_requests,
            c.default_request_ttl / 1_000_000_000,
        ),
    };
    // Session-affinity instances the profiles use: they record decisions and write tokens back.
    let sessions: Vec<Arc<session::SessionAffinity>> = instances
        .iter()
        .filter_map(|(_, _, p)| match p {
            Plugin::Session(s) => Some(s.clone()),
            _ => None,
        })
        .filter(|s| {
            let me = Arc::as_ptr(s) as *const ();
            scheduler_profiles.iter().any(|profile| {
                profile
                    .scorers
                    .iter()
                    .any(|w| Arc::as_ptr(&w.scorer) as *const () == me)
                    || profile
                        .filters
                        .iter()
                        .any(|f| Arc::as_ptr(f) as *const () == me)
            })
        })
        .collect();
    let prefill_profile = match &handler {
        Handler::Disagg {
            prefill: Some((p, _)),
            ..
        } => Some(p.name.clone()),
        _ => None,
    };
    Ok(Built {
        scheduler: Scheduler {
            producers,
            handler,
            prefix_index,
            sessions,
            prefill_profile,
        },
        metrics_source,
        inflight,
        admission,
        summary,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(yaml: &str) -> Result<Built, ConfigError> {
        build(&EndpointPickerConfig::from_yaml(yaml)?)
    }

    const SAMPLE: &str = r#"
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- name: picker
  type: max-score-picker
  parameters:
    maxNumOfEndpoints: 2
- type: single-profile-handler
- type: metrics-data-source
  parameters: {path: /metrics, interval: 50ms}
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"#;

    #[test]
    fn sample_config_loads() {
        let b = load(SAMPLE).unwrap();
        let p = b.scheduler.primary();
        assert_eq!(p.scorers.len(), 2);
        assert_eq!(p.scorers[0].weight, 2.0);
        assert_eq!(p.scorers[1].weight, 1.0);
        assert_eq!(p.picker.type_name(), "max-score-picker");
        assert_eq!(b.metrics_source.interval.as_deref(), Some("50ms"));
    }

    #[test]
    fn defaults_injected_without_profiles() {
        let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n").unwrap();
        let p = b.scheduler.primary();
        assert_eq!(p.name, "default");
        assert_eq!(p.scorers.len(), 1);
        assert_eq!(p.scorers[0].weight, 1.0);
        assert_eq!(p.picker.type_name(), "max-score-picker");
    }

    #[test]
    fn builtin_default_builds() {
        let b = build(&EndpointPickerConfig::builtin_default().unwrap()).unwrap();
        let p = b.scheduler.primary();
        let weights: Vec<_> = p
            .scorers
            .iter()
            .map(|s| (s.scorer.type_name(), s.weight))
            .collect();
        assert_eq!(
            weights,
            vec![
                ("queue-scorer", 2.0),
                ("kv-cache-utilization-scorer", 2.0),
                ("prefix-cache-scorer", 3.0)
            ]
        );
        // the prefix scorer's producer was injected
        let producers: Vec<_> = b
            .scheduler
            .producers
            .iter()
            .map(|p| p.type_name())
            .collect();
        assert_eq!(producers, vec!["approx-prefix-cache-producer"]);
        assert!(b.inflight.is_none());
    }

    #[test]
    fn unknown_plugin_type_named() {
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: fancy-scorer\n").unwrap_err().to_string();
        assert!(
            e.contains("fancy-scorer") && e.contains("unknown plugin type"),
            "{e}"
        );
        assert!(e.contains("plugins[0]"), "{e}");
    }

    #[test]
    fn not_yet_plugin_says_so() {
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: no-hit-lru-scorer\n").unwrap_err().to_string();
        assert!(e.contains("does not implement yet"), "{e}");
    }

    #[test]
    fn unknown_parameter_named() {
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoint: 2}\n").unwrap_err().to_string();
        assert!(
            e.contains("plugins[0].parameters") && e.contains("maxNumOfEndpoint"),
            "{e}"
        );
    }

    #[test]
    fn bad_profile_ref() {
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: x\n  plugins: [{pluginRef: nope}]\n").unwrap_err().to_string();
        assert!(
            e.contains("schedulingProfiles[0].plugins[0].pluginRef"),
            "{e}"
        );
    }

    #[test]
    fn flow_control_gate_builds_the_controller_config() {
        let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\nplugins:\n- {name: rr, type: round-robin-fairness-policy}\n- {name: conc, type: concurrency-detector, parameters: {maxConcurrency: 4}}\nflowControl:\n  maxRequests: 1k\n  defaultRequestTTL: 30s\n  priorityBands: [{priority: 10, fairnessPolicyRef: rr}, {priority: -1}]\n  saturationDetector: {pluginRef: conc}\n").unwrap();
        let AdmissionConfig::FlowControl(c) = b.admission else {
            panic!("gate on must build flow control")
        };
        assert_eq!(
            (c.max_requests, c.default_request_ttl),
            (1000, 30_000_000_000)
        );
        assert_eq!(c.bands.len(), 2);
        assert_eq!(
            c.bands[0].settings.fairness,
            flowctl::FairnessPolicy::RoundRobin
        );
        assert!(
            b.summary
                .contains("flow-control(bands=[10,-1] detector=concurrency-detector"),
            "{}",
            b.summary
        );
        // Bad references and parameters are named by path.
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\nflowControl:\n  priorityBands: [{priority: 1, fairnessPolicyRef: nope}]\n").unwrap_err().to_string();
        assert!(
            e.contains("flowControl.priorityBands[0].fairnessPolicyRef"),
            "{e}"
        );
        let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: utilization-detector, parameters: {queueDepthThreshhold: 3}}\n").unwrap_err().to_string();
        assert!(
            e.contains("plugins[0].parameters.queueDepthThreshhold"),
            "{e}"
        );
    }

    #[test]
    fn gate_off_uses_the_legacy_controller_with_the_configured_detector() {
        let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {name: u, type: utilization-detector, parameters: {queueDepthThreshold: 3}}\nflowControl:\n  saturationDetector: {pluginRef: u}\n").unwrap();
        let AdmissionConfig::Legacy(flowctl::SaturationDetector::Utilization(d)) = b.admission
        else {
            panic!("gate off must build the legacy controller")
        };
        assert_eq!(d.queue_depth_threshold, 3.0);
        // The deprecated top-level location still works.
        let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {name: c, type: concurrency-detector}\nsaturationDetector: {pluginRef: c}\n").unwrap();
        assert!(matches!(
            b.admission,
            AdmissionConfig::Legacy(flowctl::SaturationDetector::Concurrency(_))
        ));
    }
}

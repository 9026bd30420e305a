//! llm-d's `flowControl` YAML section ([`FlowControlConfig`]) and the resolved, plain-valued
//! [`ControllerConfig`] the state machine runs with.
//!
//! Decoding is strict (unknown keys fail with their path, through `serde_path_to_error` on a JSON
//! value, as the node's config loader does). Defaults live here and only here:
//!
//! | key | default |
//! |---|---|
//! | `maxBytes`, `maxRequests` (global) | 0 = unlimited |
//! | `defaultRequestTTL` | 60s (0 = default) |
//! | `noEndpointRequestTTL` | `defaultRequestTTL` |
//! | band `maxBytes` / `maxRequests` | 1G / 5000 (0 = default) |
//! | band `fairnessPolicyRef` / `orderingPolicyRef` | `global-strict-fairness-policy` / `fcfs-ordering-policy` |
//! | `defaultPriorityBand` | template for priorities without a configured band (the band defaults above) |
//! | `defaultNegativePriorityBand` | template for negative priorities (falls back to `defaultPriorityBand`) |
//! | `usageLimitPolicyPluginRef` | `static-usage-limit-policy` (threshold 1.0) |
//! | `saturationDetector.pluginRef` | `utilization-detector` |
//! | `enableEviction` | false |
//!
//! Policy references name plugin *instances* from the top-level `plugins` list; a reference that
//! names no instance but is a built-in type name resolves to that type with default parameters (llm-d
//! injects those plugins when absent).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::policy::{
    FCFS_ORDERING, FairnessPolicy, GLOBAL_STRICT_FAIRNESS, OrderingPolicy, STATIC_USAGE_LIMIT,
    UsageLimit,
};
use crate::saturation::{SaturationDetector, UTILIZATION_DETECTOR};
use crate::units::{GoDuration, NANOS_PER_MILLI, NANOS_PER_SEC, Nanos, Quantity};

pub const DEFAULT_REQUEST_TTL: Nanos = 60 * NANOS_PER_SEC;
pub const DEFAULT_BAND_MAX_BYTES: u64 = 1_000_000_000;
pub const DEFAULT_BAND_MAX_REQUESTS: u64 = 5_000;
/// llm-d controller default: at most 2 in-flight revocations per eviction decision.
pub const DEFAULT_EVICTIONS_PER_DECISION: u32 = 2;
/// llm-d controller default: eviction confirmation grace; we use it as the minimum spacing between
/// eviction decisions so a slow-moving saturation signal does not evict everything at once.
pub const DEFAULT_EVICTION_GRACE: Nanos = 500 * NANOS_PER_MILLI;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("config key `{path}`: {message}")]
    Field { path: String, message: String },
    #[error("config key `{path}`: {message}")]
    Invalid { path: String, message: String },
    #[error("config key `{path}`: no plugin named `{name}`")]
    UnknownPluginRef { path: String, name: String },
    #[error("config key `{path}`: plugin type `{type_name}` is not a {expected}")]
    WrongPluginKind {
        path: String,
        type_name: String,
        expected: &'static str,
    },
}

impl ConfigError {
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Decode `value` into `T`, reporting the failing key as `prefix.path` (same shape as the node's loader).
pub fn decode_at<T: DeserializeOwned>(value: &Value, prefix: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let inner = err.path().to_string();
        let path = match (prefix.is_empty(), inner.as_str()) {
            (true, _) => inner.clone(),
            (false, ".") => prefix.to_string(),
            (false, _) if inner.starts_with('[') => format!("{prefix}{inner}"),
            (false, _) => format!("{prefix}.{inner}"),
        };
        ConfigError::Field {
            path,
            message: err.into_inner().to_string(),
        }
    })
}

/// Decode a plugin's `parameters` (absent or null = `{}`, so struct defaults apply).
pub fn decode_params<T: DeserializeOwned>(
    parameters: Option<&Value>,
    path: &str,
) -> Result<T, ConfigError> {
    match parameters {
        None | Some(Value::Null) => decode_at(&Value::Object(Default::default()), path),
        Some(v) => decode_at(v, path),
    }
}

/// `flowControl` as written in the `EndpointPickerConfig`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FlowControlConfig {
    #[serde(default)]
    pub max_bytes: Option<Quantity>,
    #[serde(default)]
    pub max_requests: Option<Quantity>,
    #[serde(default, rename = "defaultRequestTTL")]
    pub default_request_ttl: Option<GoDuration>,
    #[serde(default, rename = "noEndpointRequestTTL")]
    pub no_endpoint_request_ttl: Option<GoDuration>,
    #[serde(default)]
    pub default_priority_band: Option<BandTemplateSpec>,
    #[serde(default)]
    pub default_negative_priority_band: Option<BandTemplateSpec>,
    #[serde(default)]
    pub priority_bands: Vec<PriorityBandSpec>,
    #[serde(default)]
    pub usage_limit_policy_plugin_ref: Option<String>,
    #[serde(default)]
    pub saturation_detector: Option<PluginRefSpec>,
    #[serde(default)]
    pub enable_eviction: Option<bool>,
    /// The order bands are offered capacity in each dispatch cycle: `strict-band-selection-policy`
    /// (highest priority first; llm-d v1.0's only one, and what the machine does).
    #[serde(default)]
    pub band_selection_policy_plugin_ref: Option<String>,
    /// Our extension: the demand reserve ([`DemandReserve`]); unset = on with its default factor.
    #[serde(default)]
    pub demand_reserve: Option<DemandReserveSpec>,
}

/// `flowControl.demandReserve` (our extension).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DemandReserveSpec {
    /// [`DemandReserve::factor`]; 0 turns the reserve off.
    #[serde(default)]
    pub factor: Option<f64>,
    /// [`DemandReserve::settle`] (a Go duration); 0 turns settling off.
    #[serde(default)]
    pub settle: Option<GoDuration>,
    /// [`DemandReserve::max_settle`].
    #[serde(default)]
    pub max_settle: Option<GoDuration>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginRefSpec {
    pub plugin_ref: String,
}

/// One entry of `priorityBands`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PriorityBandSpec {
    pub priority: i32,
    /// The band's own queue-wait budget (unset or 0: `flowControl.defaultRequestTTL`).
    #[serde(default, rename = "defaultRequestTTL")]
    pub default_request_ttl: Option<GoDuration>,
    #[serde(default)]
    pub max_bytes: Option<Quantity>,
    #[serde(default)]
    pub max_requests: Option<Quantity>,
    #[serde(default)]
    pub fairness_policy_ref: Option<String>,
    #[serde(default)]
    pub ordering_policy_ref: Option<String>,
}

/// `defaultPriorityBand` / `defaultNegativePriorityBand`: a band without its priority.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BandTemplateSpec {
    /// As [`PriorityBandSpec::default_request_ttl`], for the bands made from the template.
    #[serde(default, rename = "defaultRequestTTL")]
    pub default_request_ttl: Option<GoDuration>,
    #[serde(default)]
    pub max_bytes: Option<Quantity>,
    #[serde(default)]
    pub max_requests: Option<Quantity>,
    #[serde(default)]
    pub fairness_policy_ref: Option<String>,
    #[serde(default)]
    pub ordering_policy_ref: Option<String>,
}

/// A plugin instance from the top-level `plugins` list, as the node hands it over.
#[derive(Debug, Clone, Copy)]
pub struct PluginDecl<'a> {
    /// Instance name (`name`, or the type when absent).
    pub name: &'a str,
    pub type_name: &'a str,
    pub parameters: Option<&'a Value>,
}

/// Limits and policies of one band (also the shape of the dynamic-band templates).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandSettings {
    pub max_requests: u64,
    pub max_bytes: u64,
    pub fairness: FairnessPolicy,
    pub ordering: OrderingPolicy,
    /// The band's own queue-wait budget; `None`: [`ControllerConfig::default_request_ttl`].
    /// (Absent from the serialized state when unset: the replicated form is what older builds
    /// wrote. Cluster members state a band's budget on each request, so no member depends on
    /// another reading this field.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_ttl: Option<Nanos>,
}

impl Default for BandSettings {
    fn default() -> Self {
        BandSettings {
            max_requests: DEFAULT_BAND_MAX_REQUESTS,
            max_bytes: DEFAULT_BAND_MAX_BYTES,
            fairness: FairnessPolicy::GlobalStrict,
            ordering: OrderingPolicy::Fcfs,
            request_ttl: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandConfig {
    pub priority: i32,
    pub settings: BandSettings,
}

/// The demand reserve (`machine::reserve`): a lower band may use only the capacity that the bands
/// above it are neither using nor predicted to need within the next service time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DemandReserve {
    /// `K`: a band's arrivals are counted over the last `1/K` of a service time and predicted to
    /// recur `K` times over the next one. 0 = off.
    pub factor: f64,
    /// While requests keep arriving less than this apart (a burst), a lower band that would fill
    /// the pool waits, so the higher-priority requests arriving in the same burst are dispatched
    /// first. 0 = off.
    #[serde(default)]
    pub settle: Nanos,
    /// The longest a burst holds the lower bands back, from its first arrival.
    #[serde(default)]
    pub max_settle: Nanos,
}

/// What `flowControl` gets when the config does not say.
pub const DEFAULT_DEMAND_RESERVE: DemandReserve = DemandReserve {
    factor: 8.0,
    settle: 20_000_000,
    max_settle: 100_000_000,
};

impl DemandReserve {
    pub const OFF: DemandReserve = DemandReserve {
        factor: 0.0,
        settle: 0,
        max_settle: 0,
    };

    pub fn enabled(&self) -> bool {
        self.factor > 0.0 || self.settle > 0
    }
}

impl Default for DemandReserve {
    /// Off: a controller built in code gets exactly the policies it names (the configuration
    /// file's default is [`DEFAULT_DEMAND_RESERVE`]).
    fn default() -> Self {
        DemandReserve::OFF
    }
}

/// Eviction of in-flight sheddable requests (llm-d controller defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictionConfig {
    pub enabled: bool,
    pub max_per_decision: u32,
    /// Minimum time between two eviction decisions.
    pub grace: Nanos,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        EvictionConfig {
            enabled: false,
            max_per_decision: DEFAULT_EVICTIONS_PER_DECISION,
            grace: DEFAULT_EVICTION_GRACE,
        }
    }
}

/// Everything the state machine needs, with plain values. Part of the serialized state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerConfig {
    /// Global queued-request cap; 0 = unlimited.
    pub max_requests: u64,
    /// Global queued-bytes cap; 0 = unlimited.
    pub max_bytes: u64,
    pub default_request_ttl: Nanos,
    /// How long a request may wait while the pool has no endpoints (then 503 `rejected-no-endpoints`).
    pub no_endpoint_request_ttl: Nanos,
    /// Configured bands (any order; the machine sorts by priority).
    pub bands: Vec<BandConfig>,
    /// Template for a non-negative priority without a configured band.
    pub default_band: BandSettings,
    /// Template for a negative priority without a configured band.
    pub default_negative_band: BandSettings,
    pub usage_limit: UsageLimit,
    pub detector: SaturationDetector,
    pub eviction: EvictionConfig,
    #[serde(default)]
    pub demand_reserve: DemandReserve,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            max_requests: 0,
            max_bytes: 0,
            default_request_ttl: DEFAULT_REQUEST_TTL,
            no_endpoint_request_ttl: DEFAULT_REQUEST_TTL,
            bands: Vec::new(),
            default_band: BandSettings::default(),
            default_negative_band: BandSettings::default(),
            usage_limit: UsageLimit::default(),
            detector: SaturationDetector::default(),
            eviction: EvictionConfig::default(),
            demand_reserve: DemandReserve::default(),
        }
    }
}

impl ControllerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, b) in self.bands.iter().enumerate() {
            if !seen.insert(b.priority) {
                return Err(ConfigError::invalid(
                    format!("flowControl.priorityBands[{i}].priority"),
                    format!("duplicate priority {}", b.priority),
                ));
            }
        }
        self.usage_limit
            .validate("flowControl.usageLimitPolicyPluginRef")?;
        let k = self.demand_reserve.factor;
        if !(k.is_finite() && (0.0..=1000.0).contains(&k)) {
            return Err(ConfigError::invalid(
                "flowControl.demandReserve.factor",
                format!("{k} is not between 0 (off) and 1000"),
            ));
        }
        // Settling holds lower bands back: bounded, so no configuration can starve them.
        let r = self.demand_reserve;
        if r.max_settle > 10 * crate::units::NANOS_PER_SEC || r.settle > r.max_settle {
            return Err(ConfigError::invalid(
                "flowControl.demandReserve",
                "settle must not exceed maxSettle, and maxSettle must not exceed 10s".to_string(),
            ));
        }
        Ok(())
    }

    /// Settings for `priority`: its configured band, else the matching template.
    pub fn band_settings(&self, priority: i32) -> &BandSettings {
        match self.bands.iter().find(|b| b.priority == priority) {
            Some(b) => &b.settings,
            None if priority < 0 => &self.default_negative_band,
            None => &self.default_band,
        }
    }

    /// The cluster features ([`crate::cluster::FEATURE_TURN_PRIORITY`]…) every member must
    /// speak to run this configuration the same way.
    pub fn features(&self) -> u32 {
        let turns = self
            .bands
            .iter()
            .map(|b| &b.settings)
            .chain([&self.default_band, &self.default_negative_band])
            .any(|s| matches!(&s.fairness, FairnessPolicy::ProgramAware(p) if p.turn_priority()));
        if turns {
            crate::cluster::FEATURE_TURN_PRIORITY
        } else {
            0
        }
    }

    /// How long a request of `priority` may wait: its band's budget, else the default.
    pub fn request_ttl(&self, priority: i32) -> Nanos {
        self.band_settings(priority)
            .request_ttl
            .unwrap_or(self.default_request_ttl)
    }
}

/// llm-d v1.0's band selection policy: bands offered capacity strictly by priority, highest
/// first — the machine's order, and the only policy there is.
pub const STRICT_BAND_SELECTION: &str = "strict-band-selection-policy";

/// `strict-band-selection-policy` takes no parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoBandSelectionParams {}

/// A band's own TTL: unset and 0 both mean the default (llm-d: "0" = unset for band fields).
fn band_ttl(ttl: Option<GoDuration>) -> Option<Nanos> {
    ttl.map(|g| g.0).filter(|t| *t > 0)
}

fn nonzero_or(q: Option<Quantity>, default: u64) -> u64 {
    match q {
        Some(Quantity(0)) | None => default,
        Some(Quantity(v)) => v,
    }
}

fn find_plugin<'a>(plugins: &[PluginDecl<'a>], name: &str) -> Option<(usize, PluginDecl<'a>)> {
    plugins
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == name)
        .map(|(i, p)| (i, *p))
}

/// Resolve `name` to (type, parameters, path for parameter errors); built-in type names resolve to
/// themselves with default parameters when no instance carries that name.
fn lookup<'a>(
    plugins: &[PluginDecl<'a>],
    name: &'a str,
    ref_path: &str,
    builtin: &[&str],
) -> Result<(&'a str, Option<&'a Value>, String), ConfigError> {
    if let Some((i, p)) = find_plugin(plugins, name) {
        return Ok((
            p.type_name,
            p.parameters,
            format!("plugins[{i}].parameters"),
        ));
    }
    if builtin.contains(&name) {
        return Ok((name, None, ref_path.to_string()));
    }
    Err(ConfigError::UnknownPluginRef {
        path: ref_path.to_string(),
        name: name.to_string(),
    })
}

const FAIRNESS_TYPES: &[&str] = &[
    GLOBAL_STRICT_FAIRNESS,
    crate::policy::ROUND_ROBIN_FAIRNESS,
    crate::policy::WEIGHTED_FAIRNESS,
    crate::policy::PROGRAM_AWARE_FAIRNESS,
];
const ORDERING_TYPES: &[&str] = &[
    FCFS_ORDERING,
    crate::policy::EDF_ORDERING,
    crate::policy::SLO_DEADLINE_ORDERING,
];

fn resolve_band(
    plugins: &[PluginDecl<'_>],
    max_bytes: Option<Quantity>,
    max_requests: Option<Quantity>,
    fairness_ref: Option<&str>,
    ordering_ref: Option<&str>,
    path: &str,
    base: &BandSettings,
) -> Result<BandSettings, ConfigError> {
    let fairness = match fairness_ref {
        None => base.fairness.clone(),
        Some(name) => {
            let ref_path = format!("{path}.fairnessPolicyRef");
            let (ty, params, ppath) = lookup(plugins, name, &ref_path, FAIRNESS_TYPES)?;
            FairnessPolicy::from_plugin(ty, params, &ppath)?
        }
    };
    let ordering = match ordering_ref {
        None => base.ordering,
        Some(name) => {
            let ref_path = format!("{path}.orderingPolicyRef");
            let (ty, params, ppath) = lookup(plugins, name, &ref_path, ORDERING_TYPES)?;
            OrderingPolicy::from_plugin(ty, params, &ppath)?
        }
    };
    Ok(BandSettings {
        max_requests: nonzero_or(max_requests, base.max_requests),
        max_bytes: nonzero_or(max_bytes, base.max_bytes),
        fairness,
        ordering,
        request_ttl: None,
    })
}

impl FlowControlConfig {
    /// Strictly decode the `flowControl` value; errors carry paths prefixed with `flowControl`.
    pub fn from_value(value: &Value) -> Result<FlowControlConfig, ConfigError> {
        decode_at(value, "flowControl")
    }

    /// Apply defaults and resolve plugin references against the top-level `plugins` list.
    pub fn resolve(&self, plugins: &[PluginDecl<'_>]) -> Result<ControllerConfig, ConfigError> {
        let default_ttl = match self.default_request_ttl {
            Some(GoDuration(0)) | None => DEFAULT_REQUEST_TTL,
            Some(GoDuration(t)) => t,
        };
        let no_endpoint_ttl = match self.no_endpoint_request_ttl {
            Some(GoDuration(0)) | None => default_ttl,
            Some(GoDuration(t)) => t,
        };
        let builtin = BandSettings::default();
        let template = |t: &BandTemplateSpec, path: &str| -> Result<BandSettings, ConfigError> {
            Ok(BandSettings {
                request_ttl: band_ttl(t.default_request_ttl),
                ..resolve_band(
                    plugins,
                    t.max_bytes,
                    t.max_requests,
                    t.fairness_policy_ref.as_deref(),
                    t.ordering_policy_ref.as_deref(),
                    path,
                    &builtin,
                )?
            })
        };
        let default_band = match &self.default_priority_band {
            None => builtin.clone(),
            Some(t) => template(t, "flowControl.defaultPriorityBand")?,
        };
        let default_negative_band = match &self.default_negative_priority_band {
            None => default_band.clone(),
            Some(t) => template(t, "flowControl.defaultNegativePriorityBand")?,
        };
        let mut bands = Vec::with_capacity(self.priority_bands.len());
        for (i, b) in self.priority_bands.iter().enumerate() {
            let settings = resolve_band(
                plugins,
                b.max_bytes,
                b.max_requests,
                b.fairness_policy_ref.as_deref(),
                b.ordering_policy_ref.as_deref(),
                &format!("flowControl.priorityBands[{i}]"),
                &builtin,
            )?;
            bands.push(BandConfig {
                priority: b.priority,
                settings: BandSettings {
                    request_ttl: band_ttl(b.default_request_ttl),
                    ..settings
                },
            });
        }
        let usage_limit = match &self.usage_limit_policy_plugin_ref {
            None => UsageLimit::default(),
            Some(name) => {
                let (ty, params, ppath) = lookup(
                    plugins,
                    name,
                    "flowControl.usageLimitPolicyPluginRef",
                    &[
                        STATIC_USAGE_LIMIT,
                        crate::policy::PRIORITY_HOLDBACK,
                        crate::policy::SOFT_REFLECTIVE_CEILING,
                    ],
                )?;
                UsageLimit::from_plugin(ty, params, &ppath)?
            }
        };
        if let Some(name) = &self.band_selection_policy_plugin_ref {
            let path = "flowControl.bandSelectionPolicyPluginRef";
            let (ty, params, ppath) = lookup(plugins, name, path, &[STRICT_BAND_SELECTION])?;
            if ty != STRICT_BAND_SELECTION {
                return Err(ConfigError::invalid(
                    path,
                    format!(
                        "`{name}` is a `{ty}`, not a band selection policy ({STRICT_BAND_SELECTION})"
                    ),
                ));
            }
            decode_params::<NoBandSelectionParams>(params, &ppath)?;
        }
        let detector = match &self.saturation_detector {
            None => SaturationDetector::default(),
            Some(r) => {
                let (ty, params, ppath) = lookup(
                    plugins,
                    &r.plugin_ref,
                    "flowControl.saturationDetector.pluginRef",
                    &[
                        UTILIZATION_DETECTOR,
                        crate::saturation::CONCURRENCY_DETECTOR,
                    ],
                )?;
                SaturationDetector::from_plugin(ty, params, &ppath)?
            }
        };
        let cfg = ControllerConfig {
            max_requests: self.max_requests.map_or(0, Quantity::value),
            max_bytes: self.max_bytes.map_or(0, Quantity::value),
            default_request_ttl: default_ttl,
            no_endpoint_request_ttl: no_endpoint_ttl,
            bands,
            default_band,
            default_negative_band,
            usage_limit,
            detector,
            eviction: EvictionConfig {
                enabled: self.enable_eviction.unwrap_or(false),
                ..EvictionConfig::default()
            },
            demand_reserve: {
                let spec = self.demand_reserve.clone().unwrap_or_default();
                let d = DEFAULT_DEMAND_RESERVE;
                DemandReserve {
                    factor: spec.factor.unwrap_or(d.factor),
                    settle: spec.settle.map_or(d.settle, |g| g.0),
                    max_settle: spec.max_settle.map_or(d.max_settle, |g| g.0),
                }
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Charge, WeightedFairnessParams};
    use crate::saturation::ConcurrencyDetector;
    use serde_json::json;

    #[test]
    fn empty_section_gets_llmd_defaults() {
        let fc = FlowControlConfig::from_value(&json!({})).unwrap();
        let cfg = fc.resolve(&[]).unwrap();
        // llm-d's defaults, and our extension's.
        assert_eq!(
            cfg,
            ControllerConfig {
                demand_reserve: DEFAULT_DEMAND_RESERVE,
                ..ControllerConfig::default()
            }
        );
        assert_eq!(cfg.max_requests, 0);
        assert_eq!(cfg.default_request_ttl, 60 * NANOS_PER_SEC);
        assert_eq!(cfg.no_endpoint_request_ttl, 60 * NANOS_PER_SEC);
        assert_eq!(cfg.default_band.max_bytes, 1_000_000_000);
        assert_eq!(cfg.default_band.max_requests, 5000);
        assert_eq!(cfg.default_band.fairness, FairnessPolicy::GlobalStrict);
        assert_eq!(cfg.default_band.ordering, OrderingPolicy::Fcfs);
        assert_eq!(cfg.usage_limit, UsageLimit::default());
        assert!(matches!(cfg.detector, SaturationDetector::Utilization(_)));
        assert!(!cfg.eviction.enabled);
        assert_eq!(cfg.eviction.max_per_decision, 2);
    }

    #[test]
    fn quantities_durations_and_bands() {
        let fc = FlowControlConfig::from_value(&json!({
            "maxBytes": "1Gi",
            "maxRequests": "1k",
            "defaultRequestTTL": "1m30s",
            "priorityBands": [
                {"priority": 10, "maxBytes": "500M", "maxRequests": 7},
                {"priority": 0, "maxBytes": "0", "maxRequests": 0,
                 "fairnessPolicyRef": "round-robin-fairness-policy",
                 "orderingPolicyRef": "edf-ordering-policy"},
            ],
            "enableEviction": true,
        }))
        .unwrap();
        let cfg = fc.resolve(&[]).unwrap();
        assert_eq!(cfg.max_bytes, 1 << 30);
        assert_eq!(cfg.max_requests, 1000);
        assert_eq!(cfg.default_request_ttl, 90 * NANOS_PER_SEC);
        assert_eq!(
            cfg.no_endpoint_request_ttl,
            90 * NANOS_PER_SEC,
            "follows defaultRequestTTL"
        );
        assert_eq!(cfg.bands[0].priority, 10);
        assert_eq!(cfg.bands[0].settings.max_bytes, 500_000_000);
        assert_eq!(cfg.bands[0].settings.max_requests, 7);
        assert_eq!(
            cfg.bands[1].settings.max_bytes, DEFAULT_BAND_MAX_BYTES,
            "0 = default"
        );
        assert_eq!(
            cfg.bands[1].settings.max_requests,
            DEFAULT_BAND_MAX_REQUESTS
        );
        assert_eq!(cfg.bands[1].settings.fairness, FairnessPolicy::RoundRobin);
        assert_eq!(cfg.bands[1].settings.ordering, OrderingPolicy::Edf);
        assert!(cfg.eviction.enabled);
        assert_eq!(cfg.band_settings(10).max_requests, 7);
        assert_eq!(cfg.band_settings(3).max_requests, DEFAULT_BAND_MAX_REQUESTS);
    }

    #[test]
    fn plugin_refs_resolve_with_typed_parameters() {
        let weighted = json!({"weights": {"gold": 3.0}, "defaultWeight": 0.5, "charge": "tokens"});
        let conc = json!({"maxConcurrency": 4});
        let limit = json!({"threshold": 0.9});
        let plugins = [
            PluginDecl {
                name: "fair",
                type_name: "weighted-fairness-policy",
                parameters: Some(&weighted),
            },
            PluginDecl {
                name: "sat",
                type_name: "concurrency-detector",
                parameters: Some(&conc),
            },
            PluginDecl {
                name: "limit",
                type_name: "static-usage-limit-policy",
                parameters: Some(&limit),
            },
        ];
        let fc = FlowControlConfig::from_value(&json!({
            "noEndpointRequestTTL": "5s",
            "defaultNegativePriorityBand": {"maxRequests": 3, "orderingPolicyRef": "slo-deadline-ordering-policy"},
            "priorityBands": [{"priority": 1, "fairnessPolicyRef": "fair"}],
            "saturationDetector": {"pluginRef": "sat"},
            "usageLimitPolicyPluginRef": "limit",
        }))
        .unwrap();
        let cfg = fc.resolve(&plugins).unwrap();
        assert_eq!(cfg.no_endpoint_request_ttl, 5 * NANOS_PER_SEC);
        let FairnessPolicy::Weighted(w) = &cfg.bands[0].settings.fairness else {
            panic!("not weighted")
        };
        assert_eq!(
            w,
            &WeightedFairnessParams {
                weights: [("gold".to_string(), 3.0)].into(),
                default_weight: 0.5,
                charge: Charge::Tokens,
            }
        );
        assert_eq!(w.weight_of("gold"), 3.0);
        assert_eq!(w.weight_of("other"), 0.5);
        assert_eq!(
            cfg.detector,
            SaturationDetector::Concurrency(ConcurrencyDetector {
                max_concurrency: 4,
                ..Default::default()
            })
        );
        assert_eq!(
            cfg.usage_limit,
            UsageLimit::Static(crate::policy::StaticUsageLimitParams { threshold: 0.9 })
        );
        assert_eq!(cfg.band_settings(-3).max_requests, 3);
        assert_eq!(cfg.band_settings(-3).ordering, OrderingPolicy::SloDeadline);
        assert_eq!(cfg.band_settings(3).ordering, OrderingPolicy::Fcfs);
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        let err = FlowControlConfig::from_value(&json!({"maxBites": 1})).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Field { path, .. } if path == "flowControl.maxBites"),
            "{err}"
        );
        let err = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 1}, {"priority": 2, "fairness": "x"}]
        }))
        .unwrap_err();
        assert!(
            matches!(&err, ConfigError::Field { path, .. } if path == "flowControl.priorityBands[1].fairness"),
            "{err}"
        );
        let err = FlowControlConfig::from_value(
            &json!({"saturationDetector": {"pluginRef": "a", "x": 1}}),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("flowControl.saturationDetector.x"),
            "{err}"
        );
        let err = FlowControlConfig::from_value(&json!({"maxBytes": "12parsecs"})).unwrap_err();
        assert!(err.to_string().contains("flowControl.maxBytes"), "{err}");
        let err = FlowControlConfig::from_value(&json!({"defaultRequestTTL": "60"})).unwrap_err();
        assert!(
            err.to_string().contains("flowControl.defaultRequestTTL"),
            "{err}"
        );
        // Unknown policy parameter: the path points into the plugin list.
        let bad = json!({"weights": {}, "tilt": 2});
        let plugins = [PluginDecl {
            name: "fair",
            type_name: "weighted-fairness-policy",
            parameters: Some(&bad),
        }];
        let fc = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 0, "fairnessPolicyRef": "fair"}]
        }))
        .unwrap();
        let err = fc.resolve(&plugins).unwrap_err();
        assert!(
            err.to_string().contains("plugins[0].parameters.tilt"),
            "{err}"
        );
    }

    #[test]
    fn bad_references_and_values() {
        let fc = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 0, "fairnessPolicyRef": "nope"}]
        }))
        .unwrap();
        assert_eq!(
            fc.resolve(&[]).unwrap_err(),
            ConfigError::UnknownPluginRef {
                path: "flowControl.priorityBands[0].fairnessPolicyRef".into(),
                name: "nope".into()
            }
        );
        let fc = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 0, "orderingPolicyRef": "round-robin-fairness-policy"}]
        }))
        .unwrap();
        assert!(matches!(
            fc.resolve(&[]).unwrap_err(),
            ConfigError::UnknownPluginRef { .. }
        ));
        let fc = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 0}, {"priority": 0}]
        }))
        .unwrap();
        assert!(
            fc.resolve(&[])
                .unwrap_err()
                .to_string()
                .contains("duplicate")
        );
        let zero = json!({"threshold": 0.0});
        let plugins = [PluginDecl {
            name: "static-usage-limit-policy",
            type_name: "static-usage-limit-policy",
            parameters: Some(&zero),
        }];
        let fc = FlowControlConfig::from_value(
            &json!({"usageLimitPolicyPluginRef": "static-usage-limit-policy"}),
        )
        .unwrap();
        assert!(fc.resolve(&plugins).is_err());
        let neg = json!({"weights": {"a": -1.0}});
        let plugins = [PluginDecl {
            name: "w",
            type_name: "weighted-fairness-policy",
            parameters: Some(&neg),
        }];
        let fc = FlowControlConfig::from_value(&json!({
            "priorityBands": [{"priority": 0, "fairnessPolicyRef": "w"}]
        }))
        .unwrap();
        assert!(
            fc.resolve(&plugins)
                .unwrap_err()
                .to_string()
                .contains("weights.a")
        );
    }
}

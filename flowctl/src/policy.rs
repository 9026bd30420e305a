//! Fairness, ordering and usage-limit policy plugins: their llm-d type names, their typed
//! `parameters`, and the resolved values the state machine runs with.
//!
//! The *mechanics* of each policy live in [`crate::machine`] (they need the queue indexes); this module
//! is the plugin surface the node's registry constructs from YAML.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::config::{ConfigError, decode_params};

pub const GLOBAL_STRICT_FAIRNESS: &str = "global-strict-fairness-policy";
pub const ROUND_ROBIN_FAIRNESS: &str = "round-robin-fairness-policy";
pub const WEIGHTED_FAIRNESS: &str = "weighted-fairness-policy";
pub const PROGRAM_AWARE_FAIRNESS: &str = "program-aware-fairness";
pub const FCFS_ORDERING: &str = "fcfs-ordering-policy";
pub const EDF_ORDERING: &str = "edf-ordering-policy";
pub const SLO_DEADLINE_ORDERING: &str = "slo-deadline-ordering-policy";
pub const STATIC_USAGE_LIMIT: &str = "static-usage-limit-policy";
pub const PRIORITY_HOLDBACK: &str = "priority-holdback-policy";
pub const SOFT_REFLECTIVE_CEILING: &str = "soft-reflective-ceiling-policy";
/// llm-d's eviction plugins; the eviction this crate implements is exactly theirs (only
/// sheddable requests are revocable; lowest priority first, then the newest dispatch), so naming
/// them is accepted and changes nothing.
pub const SHEDDABLE_EVICTION_FILTER: &str = "sheddable-eviction-filter";
pub const PRIORITY_THEN_TIME_EVICTION_ORDER: &str = "priority-then-time-eviction-order-policy";

/// How a band picks the next flow to serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum FairnessPolicy {
    /// `global-strict-fairness-policy`: the flow whose head request is best by the band's ordering
    /// policy (no fairness; the band behaves as one queue).
    GlobalStrict,
    /// `round-robin-fairness-policy`: a cursor over the band's non-empty flows sorted by fairness id;
    /// one dispatch per turn.
    RoundRobin,
    /// `weighted-fairness-policy`: start-time fair queueing on virtual time (see [`WeightedFairnessParams`]).
    Weighted(WeightedFairnessParams),
    /// `program-aware-fairness` (llm-d): least attained service per fairness id (see
    /// [`ProgramAwareParams`]).
    ProgramAware(ProgramAwareParams),
}

impl FairnessPolicy {
    /// Build from a plugin type name and its `parameters` (path used in errors).
    pub fn from_plugin(
        type_name: &str,
        parameters: Option<&serde_json::Value>,
        path: &str,
    ) -> Result<FairnessPolicy, ConfigError> {
        match type_name {
            GLOBAL_STRICT_FAIRNESS => {
                decode_params::<NoParams>(parameters, path)?;
                Ok(FairnessPolicy::GlobalStrict)
            }
            ROUND_ROBIN_FAIRNESS => {
                decode_params::<NoParams>(parameters, path)?;
                Ok(FairnessPolicy::RoundRobin)
            }
            WEIGHTED_FAIRNESS => {
                let p: WeightedFairnessParams = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(FairnessPolicy::Weighted(p))
            }
            PROGRAM_AWARE_FAIRNESS => {
                let p: ProgramAwareParams = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(FairnessPolicy::ProgramAware(p))
            }
            other => Err(ConfigError::WrongPluginKind {
                path: path.to_string(),
                type_name: other.to_string(),
                expected: "fairness policy",
            }),
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            FairnessPolicy::GlobalStrict => GLOBAL_STRICT_FAIRNESS,
            FairnessPolicy::RoundRobin => ROUND_ROBIN_FAIRNESS,
            FairnessPolicy::Weighted(_) => WEIGHTED_FAIRNESS,
            FairnessPolicy::ProgramAware(_) => PROGRAM_AWARE_FAIRNESS,
        }
    }
}

/// `program-aware-fairness` parameters (llm-d's names and defaults).
///
/// `strategy: las` (the default), least attained service: each fairness id — a *program* — accumulates the tokens
/// its completed requests took (prompt + completion, as the ledger settles them; llm-d counts
/// completion tokens twice). Among the band's waiting flows the one with the highest
/// `lasWeightService · (1 − norm(service)) + lasWeightHeadWait · norm(head wait)` is served, each
/// term min–max normalized over the waiting flows (all equal: 0.5). A program with nothing queued
/// or in flight loses service: by `lasDecayFactor` per pick, or with the half-life
/// `lasHalfLifeSeconds` when that is set; one idle with no completion for `evictionTtlSeconds`
/// is forgotten (checked at every pick; `evictionSweepSeconds` is accepted).
///
/// `strategy: turn-priority` (llm-d v1.0), for agent loops: a program's *turn* is the number of
/// its requests dispatched so far plus one, and among the band's waiting flows the one with the
/// highest `turn + turnPriorityTimeWeight · head wait (s)` is served — a loop on its 7th turn
/// goes before a program's first, and a long wait still wins in the end. A program with nothing
/// in flight whose last completion is older than `turnPriorityInactivitySeconds` (0: never)
/// starts again at turn 1. Ties go to the lowest flow index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ProgramAwareParams {
    pub strategy: String,
    pub las_weight_service: f64,
    pub las_weight_head_wait: f64,
    pub las_decay_factor: f64,
    pub las_half_life_seconds: f64,
    pub eviction_ttl_seconds: f64,
    pub eviction_sweep_seconds: f64,
    /// (Left out of the serialized state at their defaults: the replicated form of a `las`
    /// configuration is what builds before turn priority wrote.)
    #[serde(skip_serializing_if = "is_default_time_weight")]
    pub turn_priority_time_weight: f64,
    #[serde(skip_serializing_if = "is_default_inactivity")]
    pub turn_priority_inactivity_seconds: f64,
}

/// `strategy: turn-priority`.
pub const TURN_PRIORITY: &str = "turn-priority";
const DEFAULT_TURN_TIME_WEIGHT: f64 = 0.05;
const DEFAULT_TURN_INACTIVITY_SECONDS: f64 = 120.0;

fn is_default_time_weight(v: &f64) -> bool {
    *v == DEFAULT_TURN_TIME_WEIGHT
}

fn is_default_inactivity(v: &f64) -> bool {
    *v == DEFAULT_TURN_INACTIVITY_SECONDS
}

impl Default for ProgramAwareParams {
    fn default() -> Self {
        ProgramAwareParams {
            strategy: "las".into(),
            las_weight_service: 0.8,
            las_weight_head_wait: 0.2,
            las_decay_factor: 0.99997,
            las_half_life_seconds: 0.0,
            eviction_ttl_seconds: 3600.0,
            eviction_sweep_seconds: 300.0,
            turn_priority_time_weight: DEFAULT_TURN_TIME_WEIGHT,
            turn_priority_inactivity_seconds: DEFAULT_TURN_INACTIVITY_SECONDS,
        }
    }
}

impl ProgramAwareParams {
    /// `strategy: turn-priority`.
    pub fn turn_priority(&self) -> bool {
        self.strategy == TURN_PRIORITY
    }

    /// llm-d's checks.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let field = |k: &str, m: &str| Err(ConfigError::invalid(format!("{path}.{k}"), m));
        if !matches!(self.strategy.as_str(), "" | "las" | TURN_PRIORITY) {
            return field("strategy", "must be `las` or `turn-priority`");
        }
        let finite = |v: f64| v.is_finite();
        for (k, v) in [
            ("lasWeightService", self.las_weight_service),
            ("lasWeightHeadWait", self.las_weight_head_wait),
            ("lasHalfLifeSeconds", self.las_half_life_seconds),
            ("evictionTtlSeconds", self.eviction_ttl_seconds),
            ("turnPriorityTimeWeight", self.turn_priority_time_weight),
            (
                "turnPriorityInactivitySeconds",
                self.turn_priority_inactivity_seconds,
            ),
        ] {
            if !finite(v) || v < 0.0 {
                return field(k, "must be a finite number >= 0");
            }
        }
        if !(finite(self.las_decay_factor)
            && self.las_decay_factor > 0.0
            && self.las_decay_factor <= 1.0)
        {
            return field("lasDecayFactor", "must be in (0, 1]");
        }
        if !finite(self.eviction_sweep_seconds) || self.eviction_sweep_seconds <= 0.0 {
            return field("evictionSweepSeconds", "must be > 0");
        }
        Ok(())
    }
}

/// How a flow orders its own requests. Every policy reduces to a `u64` key (smaller first), ties
/// broken by arrival order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OrderingPolicy {
    /// `fcfs-ordering-policy`: arrival order.
    Fcfs,
    /// `edf-ordering-policy`: earliest deadline first, deadline = enqueue time + effective TTL
    /// (no TTL = far future).
    Edf,
    /// `slo-deadline-ordering-policy`: deadline = received + `x-llm-d-slo-ttft-ms` (absent = far future).
    SloDeadline,
}

impl OrderingPolicy {
    pub fn from_plugin(
        type_name: &str,
        parameters: Option<&serde_json::Value>,
        path: &str,
    ) -> Result<OrderingPolicy, ConfigError> {
        let policy = match type_name {
            FCFS_ORDERING => OrderingPolicy::Fcfs,
            EDF_ORDERING => OrderingPolicy::Edf,
            SLO_DEADLINE_ORDERING => OrderingPolicy::SloDeadline,
            other => {
                return Err(ConfigError::WrongPluginKind {
                    path: path.to_string(),
                    type_name: other.to_string(),
                    expected: "ordering policy",
                });
            }
        };
        decode_params::<NoParams>(parameters, path)?;
        Ok(policy)
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            OrderingPolicy::Fcfs => FCFS_ORDERING,
            OrderingPolicy::Edf => EDF_ORDERING,
            OrderingPolicy::SloDeadline => SLO_DEADLINE_ORDERING,
        }
    }
}

/// Parameters of plugins that take none (an empty map or absent `parameters`).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// What a weighted flow is charged per dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Charge {
    /// One unit per request: dispatch counts follow the weights.
    #[default]
    Requests,
    /// Prompt + expected output tokens (the enqueue's `tokens`), corrected to the actual tokens on
    /// completion: token throughput follows the weights.
    Tokens,
}

/// `weighted-fairness-policy` parameters.
///
/// Mechanism (start-time fair queueing): each flow carries a virtual *pass*; the band dispatches from
/// the non-empty flow with the smallest pass and advances it by `charge / weight`. A flow that becomes
/// non-empty starts at `max(its pass, band virtual time)` (the pass of the last dispatch), so idle time
/// earns no credit and every waiting flow is reached within a bounded number of dispatches — nobody
/// starves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct WeightedFairnessParams {
    /// Weight per fairness id.
    pub weights: BTreeMap<String, f64>,
    /// Weight of fairness ids not listed (1.0).
    pub default_weight: f64,
    /// `requests` (default) or `tokens`.
    pub charge: Charge,
}

impl Default for WeightedFairnessParams {
    fn default() -> Self {
        WeightedFairnessParams {
            weights: BTreeMap::new(),
            default_weight: 1.0,
            charge: Charge::Requests,
        }
    }
}

impl WeightedFairnessParams {
    pub fn weight_of(&self, fairness_id: &str) -> f64 {
        self.weights
            .get(fairness_id)
            .copied()
            .unwrap_or(self.default_weight)
    }

    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let ok = |w: f64| w.is_finite() && w > 0.0;
        if !ok(self.default_weight) {
            return Err(ConfigError::invalid(
                format!("{path}.defaultWeight"),
                "must be a finite number > 0",
            ));
        }
        for (id, w) in &self.weights {
            if !ok(*w) {
                return Err(ConfigError::invalid(
                    format!("{path}.weights.{id}"),
                    "must be a finite number > 0",
                ));
            }
        }
        Ok(())
    }
}

/// The usage-limit policy: the pool saturation at or above which a band is *gated* (may not
/// dispatch). Gating is checked for the highest-priority band with waiting requests; ceilings never
/// rise as priority falls, so a gated top band means every lower band is gated too.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum UsageLimit {
    /// `static-usage-limit-policy`: one ceiling for every band.
    Static(StaticUsageLimitParams),
    /// `priority-holdback-policy`: lower bands get lower ceilings, keeping headroom for the higher
    /// ones.
    PriorityHoldback(PriorityHoldbackParams),
    /// `soft-reflective-ceiling-policy` (no parameters): band `i` of `n` (highest first) reaches
    /// its reflective ceiling `1 − i·sat/(n − 1)` as saturation rises; from there on every such
    /// band is open on one dispatch cycle in `round(sat / (1 − sat))` (a tick shared by all bands,
    /// so gating stays monotone in rank) and closed from saturation 1. The top band is never
    /// gated below saturation 1.
    SoftReflective,
}

/// Where a band stands among the bands: what its ceiling depends on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandPosition {
    /// 0 = highest priority.
    pub rank: usize,
    /// Bands in all.
    pub n: usize,
    pub priority: i32,
    /// The lowest and highest priorities among them.
    pub lowest: i32,
    pub highest: i32,
}

/// The soft-reflective policy's cycle state at saturation `sat`: whether this dispatch cycle is
/// one of the open ones. The tick advances only while some band alternates (`1 − sat ≤ sat < 1`).
pub fn soft_reflective_cycle(tick: &mut u64, sat: f64) -> bool {
    if !(sat >= 1.0 - sat && sat < 1.0) {
        return false;
    }
    // 1e-9 guards the division when saturation is very near 1.
    let period = (sat / (1.0 - sat + 1e-9)).round().max(1.0) as u64;
    *tick = tick.wrapping_add(1);
    (*tick).is_multiple_of(period)
}

impl Default for UsageLimit {
    fn default() -> Self {
        UsageLimit::Static(StaticUsageLimitParams::default())
    }
}

impl From<StaticUsageLimitParams> for UsageLimit {
    fn from(p: StaticUsageLimitParams) -> Self {
        UsageLimit::Static(p)
    }
}

impl UsageLimit {
    /// Build from a plugin type name and its `parameters` (path used in errors).
    pub fn from_plugin(
        type_name: &str,
        parameters: Option<&serde_json::Value>,
        path: &str,
    ) -> Result<UsageLimit, ConfigError> {
        match type_name {
            STATIC_USAGE_LIMIT => {
                let p: StaticUsageLimitParams = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(UsageLimit::Static(p))
            }
            PRIORITY_HOLDBACK => {
                let p: PriorityHoldbackParams = decode_params(parameters, path)?;
                p.validate(path)?;
                Ok(UsageLimit::PriorityHoldback(p))
            }
            SOFT_REFLECTIVE_CEILING => {
                decode_params::<NoParams>(parameters, path)?;
                Ok(UsageLimit::SoftReflective)
            }
            _ => Err(ConfigError::WrongPluginKind {
                path: path.to_string(),
                type_name: type_name.to_string(),
                expected: "usage limit policy (static-usage-limit-policy, priority-holdback-policy, \
                           soft-reflective-ceiling-policy)",
            }),
        }
    }

    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        match self {
            UsageLimit::Static(p) => p.validate(path),
            UsageLimit::PriorityHoldback(p) => p.validate(path),
            UsageLimit::SoftReflective => Ok(()),
        }
    }

    /// The ceiling of the band at `at` when the pool's saturation is `sat` and the soft-reflective
    /// cycle is `open` (see [`soft_reflective_cycle`]; the other policies ignore both): the band
    /// is gated while `sat >= ceiling`.
    pub fn ceiling(&self, at: BandPosition, sat: f64, open: bool) -> f64 {
        let BandPosition {
            rank,
            n,
            priority,
            lowest,
            highest,
        } = at;
        match self {
            UsageLimit::Static(p) => p.threshold,
            UsageLimit::SoftReflective => {
                if rank == 0 || n < 2 || sat < 1.0 - rank as f64 * sat / (n - 1) as f64 {
                    1.0
                } else if sat >= 1.0 || !open {
                    0.0
                } else {
                    1.0
                }
            }
            UsageLimit::PriorityHoldback(p) => {
                let span = p.max_ceiling - p.min_ceiling;
                let position = match p.domain {
                    HoldbackDomain::Rank if n > 1 => rank as f64 / (n - 1) as f64,
                    HoldbackDomain::Value if highest > lowest => {
                        f64::from(highest - priority) / (f64::from(highest) - f64::from(lowest))
                    }
                    _ => 0.0,
                };
                p.max_ceiling - position.clamp(0.0, 1.0) * span
            }
        }
    }
}

/// `static-usage-limit-policy`: every band is gated (may not dispatch) while pool saturation is
/// `>= threshold`. `threshold` in (0, 1], default 1.0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct StaticUsageLimitParams {
    pub threshold: f64,
}

impl Default for StaticUsageLimitParams {
    fn default() -> Self {
        StaticUsageLimitParams { threshold: 1.0 }
    }
}

impl StaticUsageLimitParams {
    fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            return Err(ConfigError::invalid(
                format!("{path}.threshold"),
                "must be in (0, 1]",
            ));
        }
        Ok(())
    }
}

/// How `priority-holdback-policy` places a band between `maxCeiling` (highest) and `minCeiling`
/// (lowest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldbackDomain {
    /// By the band's rank among the bands: `c_i = max - i * (max - min) / (N - 1)`.
    #[default]
    Rank,
    /// By the band's priority value, linearly between the lowest and highest priority.
    Value,
}

/// The only `shape` llm-d defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldbackShape {
    #[default]
    Linear,
}

/// `priority-holdback-policy` parameters (llm-d: `shape` linear, `domain` rank|value, `minCeiling`
/// required, `maxCeiling` 1.0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PriorityHoldbackParams {
    #[serde(default)]
    pub shape: HoldbackShape,
    #[serde(default)]
    pub domain: HoldbackDomain,
    pub min_ceiling: f64,
    #[serde(default = "one")]
    pub max_ceiling: f64,
}

fn one() -> f64 {
    1.0
}

impl PriorityHoldbackParams {
    fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if !(self.max_ceiling > 0.0 && self.max_ceiling <= 1.0) {
            return Err(ConfigError::invalid(
                format!("{path}.maxCeiling"),
                "must be in (0, 1]",
            ));
        }
        if !(self.min_ceiling > 0.0 && self.min_ceiling <= self.max_ceiling) {
            return Err(ConfigError::invalid(
                format!("{path}.minCeiling"),
                "must be in (0, maxCeiling]",
            ));
        }
        Ok(())
    }
}

//! Filters on endpoint labels and load: `label-selector-filter`, `decode-filter`, `prefill-filter`,
//! `utilization-filter`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{Filter, RequestData, SchedRequest};
use crate::datalayer::store::Candidate;

pub const LABEL_SELECTOR_TYPE: &str = "label-selector-filter";
pub const DECODE_TYPE: &str = "decode-filter";
pub const PREFILL_TYPE: &str = "prefill-filter";
pub const ENCODE_TYPE: &str = "encode-filter";
pub const UTILIZATION_TYPE: &str = "utilization-filter";
/// llm-d's deprecated names: `by-label-selector` is `label-selector-filter`; `by-label` keeps
/// endpoints whose label has one of some values (or, if allowed, no such label).
pub const BY_LABEL_SELECTOR_TYPE: &str = "by-label-selector";
pub const BY_LABEL_TYPE: &str = "by-label";
/// The P/D role label.
pub const ROLE_LABEL: &str = "llm-d.ai/role";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelSelectorParams {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub match_expressions: Vec<LabelExpression>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelExpression {
    pub key: String,
    pub operator: LabelOperator,
    #[serde(default)]
    pub values: Vec<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// Kubernetes label-selector semantics: every `matchLabels` pair and every expression must hold.
#[derive(Debug)]
pub struct LabelSelectorFilter {
    pub params: LabelSelectorParams,
}

impl LabelSelectorFilter {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.params
            .match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.params.match_expressions.iter().all(|e| {
                let v = labels.get(&e.key);
                match e.operator {
                    LabelOperator::In => v.is_some_and(|v| e.values.contains(v)),
                    LabelOperator::NotIn => !v.is_some_and(|v| e.values.contains(v)),
                    LabelOperator::Exists => v.is_some(),
                    LabelOperator::DoesNotExist => v.is_none(),
                }
            })
    }
}

impl Filter for LabelSelectorFilter {
    fn type_name(&self) -> &'static str {
        LABEL_SELECTOR_TYPE
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        keep.retain(|&i| self.matches(&candidates[i].endpoint.labels));
    }
}

/// Keeps endpoints whose `llm-d.ai/role` is one of `roles` (and unlabeled ones when asked).
#[derive(Debug)]
pub struct RoleFilter {
    pub type_name: &'static str,
    pub roles: &'static [&'static str],
    pub keep_unlabeled: bool,
}

/// `decode-filter`: decode-capable roles, and unlabeled pods.
pub fn decode_filter() -> RoleFilter {
    RoleFilter {
        type_name: DECODE_TYPE,
        roles: &["decode", "prefill-decode", "both", "encode-prefill-decode"],
        keep_unlabeled: true,
    }
}

/// `prefill-filter`: prefill-capable roles only.
pub fn prefill_filter() -> RoleFilter {
    RoleFilter {
        type_name: PREFILL_TYPE,
        roles: &[
            "prefill",
            "encode-prefill",
            "prefill-decode",
            "both",
            "encode-prefill-decode",
        ],
        keep_unlabeled: false,
    }
}

/// `encode-filter`: encode-capable roles only (multimodal encoders).
pub fn encode_filter() -> RoleFilter {
    RoleFilter {
        type_name: ENCODE_TYPE,
        roles: &["encode", "encode-prefill", "encode-prefill-decode"],
        keep_unlabeled: false,
    }
}

/// `by-label` parameters (llm-d's names).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ByLabelParams {
    #[serde(default)]
    pub label: String,
    #[serde(default)]
    pub valid_values: Vec<String>,
    #[serde(default)]
    pub allows_no_label: bool,
}

/// llm-d's deprecated `by-label`: keeps endpoints whose `label` is one of `valid_values`, and
/// those without it when `allows_no_label`.
#[derive(Debug)]
pub struct ByLabelFilter {
    pub params: ByLabelParams,
}

impl ByLabelFilter {
    /// llm-d's checks: a label, and something to keep.
    pub fn new(params: ByLabelParams, path: &str) -> Result<Self, crate::config::ConfigError> {
        let field = |k: &str, m: &str| crate::config::ConfigError::Field {
            path: format!("{path}.{k}"),
            message: m.to_string(),
        };
        if params.label.is_empty() {
            return Err(field("label", "must name a label"));
        }
        if params.valid_values.is_empty() && !params.allows_no_label {
            return Err(field(
                "validValues",
                "must not be empty unless allowsNoLabel is true",
            ));
        }
        Ok(ByLabelFilter { params })
    }
}

impl Filter for ByLabelFilter {
    fn type_name(&self) -> &'static str {
        BY_LABEL_TYPE
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        let p = &self.params;
        keep.retain(|&i| match candidates[i].endpoint.labels.get(&p.label) {
            Some(v) => p.valid_values.contains(v),
            None => p.allows_no_label,
        });
    }
}

impl Filter for RoleFilter {
    fn type_name(&self) -> &'static str {
        self.type_name
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        _data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        keep.retain(|&i| match candidates[i].endpoint.labels.get(ROLE_LABEL) {
            Some(role) => self.roles.contains(&role.as_str()),
            None => self.keep_unlabeled,
        });
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct UtilizationParams {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub fallback_on_empty: bool,
    #[serde(default)]
    pub in_flight_load_producer_name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Condition {
    pub metric: UtilMetric,
    pub max_value: f64,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum UtilMetric {
    ActiveRequests,
    RunningRequests,
    WaitingQueue,
    KvCacheUtilization,
}

/// Drops endpoints over any condition's `maxValue` (a missing metric counts as 0). If that leaves
/// nothing and `fallbackOnEmpty` is set, every endpoint is kept.
#[derive(Debug)]
pub struct UtilizationFilter {
    pub params: UtilizationParams,
}

impl UtilizationFilter {
    /// Whether the filter needs the in-flight producer.
    pub fn uses_inflight(&self) -> bool {
        self.params
            .conditions
            .iter()
            .any(|c| c.metric == UtilMetric::ActiveRequests)
    }
}

impl Filter for UtilizationFilter {
    fn type_name(&self) -> &'static str {
        UTILIZATION_TYPE
    }

    fn filter(
        &self,
        _req: &SchedRequest<'_>,
        data: &RequestData,
        candidates: &[Candidate],
        keep: &mut Vec<usize>,
    ) {
        let value = |i: usize, m: UtilMetric| -> f64 {
            let metrics = candidates[i].metrics();
            match m {
                UtilMetric::ActiveRequests => data.inflight.get(i).map_or(0, |l| l.requests) as f64,
                UtilMetric::RunningRequests => {
                    metrics.and_then(|m| m.running_requests).unwrap_or(0.0)
                }
                UtilMetric::WaitingQueue => {
                    metrics.and_then(|m| m.waiting_queue_size).unwrap_or(0.0)
                }
                UtilMetric::KvCacheUtilization => {
                    metrics.and_then(|m| m.kv_cache_usage).unwrap_or(0.0)
                }
            }
        };
        let kept: Vec<usize> = keep
            .iter()
            .copied()
            .filter(|&i| {
                self.params
                    .conditions
                    .iter()
                    .all(|c| value(i, c.metric) <= c.max_value)
            })
            .collect();
        if kept.is_empty() && self.params.fallback_on_empty {
            return;
        }
        *keep = kept;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::InflightLoad;
    use crate::scheduling::testutil::*;

    fn run(f: &dyn Filter, data: &RequestData, cs: &[Candidate]) -> Vec<usize> {
        let mut keep: Vec<usize> = (0..cs.len()).collect();
        f.filter(&req(), data, cs, &mut keep);
        keep
    }

    #[test]
    fn label_selector() {
        let cs = [
            cand_at(
                "a",
                "127.0.0.1:1",
                None,
                false,
                &[("zone", "a"), ("gpu", "h100")],
            ),
            cand_at(
                "b",
                "127.0.0.1:2",
                None,
                false,
                &[("zone", "b"), ("gpu", "h100")],
            ),
            cand_at("c", "127.0.0.1:3", None, false, &[("zone", "a")]),
        ];
        let params: LabelSelectorParams = serde_json::from_value(serde_json::json!({
            "matchLabels": {"zone": "a"},
            "matchExpressions": [{"key": "gpu", "operator": "Exists"}]
        }))
        .unwrap();
        assert_eq!(
            run(
                &LabelSelectorFilter { params },
                &RequestData::default(),
                &cs
            ),
            vec![0]
        );
        let params: LabelSelectorParams = serde_json::from_value(serde_json::json!({
            "matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]
        }))
        .unwrap();
        assert_eq!(
            run(
                &LabelSelectorFilter { params },
                &RequestData::default(),
                &cs
            ),
            vec![1]
        );
        assert!(
            serde_json::from_value::<LabelSelectorParams>(serde_json::json!({
                "matchExpressions": [{"key": "z", "operator": "Near"}]
            }))
            .is_err()
        );
    }

    #[test]
    fn roles() {
        let cs = [
            cand_at("p", "127.0.0.1:1", None, false, &[(ROLE_LABEL, "prefill")]),
            cand_at("d", "127.0.0.1:2", None, false, &[(ROLE_LABEL, "decode")]),
            cand_at("both", "127.0.0.1:3", None, false, &[(ROLE_LABEL, "both")]),
            cand_at("none", "127.0.0.1:4", None, false, &[]),
            cand_at("e", "127.0.0.1:5", None, false, &[(ROLE_LABEL, "encode")]),
            cand_at(
                "epd",
                "127.0.0.1:6",
                None,
                false,
                &[(ROLE_LABEL, "encode-prefill-decode")],
            ),
        ];
        let d = RequestData::default();
        assert_eq!(run(&decode_filter(), &d, &cs), vec![1, 2, 3, 5]);
        assert_eq!(run(&prefill_filter(), &d, &cs), vec![0, 2, 5]);
        assert_eq!(run(&encode_filter(), &d, &cs), vec![4, 5]);
    }

    #[test]
    fn utilization() {
        let cs = [
            cand("a", metrics(1.0, 0.0, 0.5), false),
            cand("b", metrics(9.0, 0.0, 0.2), false),
            cand("c", None, false),
        ];
        let params: UtilizationParams = serde_json::from_value(serde_json::json!({
            "conditions": [{"metric": "waiting-queue", "maxValue": 4}, {"metric": "active-requests", "maxValue": 2}]
        }))
        .unwrap();
        let f = UtilizationFilter { params };
        assert!(f.uses_inflight());
        let data = RequestData {
            inflight: vec![
                InflightLoad {
                    requests: 0,
                    tokens: 0,
                    prefilling: 0,
                },
                InflightLoad {
                    requests: 0,
                    tokens: 0,
                    prefilling: 0,
                },
                InflightLoad {
                    requests: 3,
                    tokens: 0,
                    prefilling: 0,
                },
            ],
            ..RequestData::default()
        };
        assert_eq!(run(&f, &data, &cs), vec![0]);
        let strict: UtilizationParams = serde_json::from_value(serde_json::json!({
            "conditions": [{"metric": "kv-cache-utilization", "maxValue": 0.1}]
        }))
        .unwrap();
        assert_eq!(
            run(
                &UtilizationFilter {
                    params: strict.clone()
                },
                &data,
                &cs
            ),
            vec![2]
        );
        let none: UtilizationParams = serde_json::from_value(serde_json::json!({
            "conditions": [{"metric": "running-requests", "maxValue": -1}], "fallbackOnEmpty": true
        }))
        .unwrap();
        assert_eq!(
            run(&UtilizationFilter { params: none }, &data, &cs),
            vec![0, 1, 2]
        );
    }
}

//! Request metadata: who is asking and how urgently — fairness id, `InferenceObjective` priority
//! and TTFT objective, all from headers (and the objectives the replica knows).
//!
//! Fairness id: `x-llm-d-inference-fairness-id` (deprecated alias
//! `x-gateway-inference-fairness-id`), else an agent session header ([`AGENT_SESSION_HEADERS`]),
//! else `default-flow`. Priority: the `InferenceObjective` named by `x-llm-d-inference-objective`
//! (alias `x-gateway-inference-objective`; unknown or absent = 0). TTFT objective:
//! `x-llm-d-slo-ttft-ms` (alias `x-slo-ttft-ms`).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::config::{ConfigError, decode_at, each_doc};

pub const FAIRNESS_ID_HEADER: &str = "x-llm-d-inference-fairness-id";
pub const FAIRNESS_ID_ALIAS: &str = "x-gateway-inference-fairness-id";
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
pub const OBJECTIVE_ALIAS: &str = "x-gateway-inference-objective";
pub const SLO_TTFT_HEADER: &str = "x-llm-d-slo-ttft-ms";
pub const SLO_TTFT_ALIAS: &str = "x-slo-ttft-ms";
pub const DEFAULT_FAIRNESS_ID: &str = "default-flow";
/// Agent identity (llm-d's `agent-identity`): an agent's session header is the fairness id of a
/// request that names none, so each agent session is its own flow.
pub const AGENT_SESSION_HEADERS: [&str; 4] = [
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
];

/// llm-d's `agent-identity`: the request's agent session id, from the operator's
/// `additionalSessionHeaders` first, then the agents' own headers ([`AGENT_SESSION_HEADERS`]).
/// It is the fairness id of a request that names none, and a session-affinity source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentIdentity {
    /// Lower-cased header names checked before the built-in ones.
    additional: Vec<String>,
}

impl AgentIdentity {
    pub fn new(additional: &[String]) -> Self {
        AgentIdentity {
            additional: additional.iter().map(|h| h.to_ascii_lowercase()).collect(),
        }
    }

    /// The first non-empty session header.
    pub fn session<'a>(&self, headers: &'a HashMap<String, String>) -> Option<&'a str> {
        self.additional
            .iter()
            .map(String::as_str)
            .chain(AGENT_SESSION_HEADERS)
            .filter_map(|n| headers.get(n))
            .map(|v| v.trim())
            .find(|v| !v.is_empty())
    }
}

/// Headers a client must not be able to smuggle to the model server.
pub const CONTROL_HEADERS: [&str; 8] = [
    FAIRNESS_ID_HEADER,
    FAIRNESS_ID_ALIAS,
    OBJECTIVE_HEADER,
    OBJECTIVE_ALIAS,
    SLO_TTFT_HEADER,
    SLO_TTFT_ALIAS,
    super::rewrite::REWRITE_HEADER,
    super::rewrite::REWRITE_ALIAS,
];

/// `InferenceObjective` name → priority. In Kubernetes these are CRDs (`llm-d.ai/v1alpha2`); a
/// standalone replica reads the same manifests from `--objectives-file`.
#[derive(Debug, Clone, Default)]
pub struct Objectives(HashMap<String, i32>);

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveDoc {
    api_version: String,
    kind: String,
    metadata: ObjectiveMeta,
    #[serde(default)]
    spec: ObjectiveSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveMeta {
    name: String,
    #[serde(default)]
    #[allow(dead_code)]
    namespace: Option<String>,
}

/// The spec of either version: `llm-d.ai/v1alpha2` binds the objective to one pool by
/// `poolRef`; `llm-d.ai/v1` (llm-d v1.0) to pools by `poolRefs` (1–16) or `poolSelector`, one of
/// them required. A standalone replica serves one pool: the binding is checked for shape only.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ObjectiveSpec {
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    pool_ref: Option<serde_json::Value>,
    #[serde(default)]
    pool_refs: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    pool_selector: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ObjectiveSpec {
    /// The pool binding's keys are the ones of `api_version`.
    fn check(&self, api_version: &str, at: &str) -> Result<(), ConfigError> {
        let bad = |msg: &str| Err(ConfigError::invalid(format!("{at}.spec: {msg}")));
        if api_version == "llm-d.ai/v1" {
            if self.pool_ref.is_some() {
                return bad(
                    "`poolRef` is v1alpha2's; llm-d.ai/v1 has `poolRefs` (a list) or `poolSelector`",
                );
            }
            match (&self.pool_refs, &self.pool_selector) {
                (Some(r), None) if (1..=16).contains(&r.len()) => Ok(()),
                (Some(_), None) => bad("`poolRefs` must name 1 to 16 pools"),
                (None, Some(s)) if !s.is_empty() => Ok(()),
                (None, Some(_)) => bad("`poolSelector` must not be empty"),
                (Some(_), Some(_)) => bad("`poolRefs` and `poolSelector` exclude each other"),
                (None, None) => bad("llm-d.ai/v1 needs `poolRefs` or `poolSelector`"),
            }
        } else if self.pool_refs.is_some() || self.pool_selector.is_some() {
            bad("`poolRefs` / `poolSelector` are llm-d.ai/v1's; this version has `poolRef`")
        } else {
            Ok(())
        }
    }
}

impl Objectives {
    pub fn new(map: HashMap<String, i32>) -> Self {
        Objectives(map)
    }

    /// Parse one or more YAML documents of `kind: InferenceObjective` (`spec.priority`, default 0).
    pub fn from_yaml(text: &str) -> Result<Objectives, ConfigError> {
        let mut out = Objectives::default();
        each_doc(text, "objectives", |doc, at| out.add(doc, at))?;
        Ok(out)
    }

    /// Adds one `InferenceObjective` document (a manifest, or an object from the API server);
    /// `at` names it in the error. Nothing is added when it is refused.
    pub fn add(&mut self, doc: &serde_json::Value, at: &str) -> Result<(), ConfigError> {
        let d: ObjectiveDoc = decode_at(doc, at)?;
        if d.kind != "InferenceObjective" {
            return Err(ConfigError::invalid(format!(
                "{at}.kind: `{}` is not InferenceObjective",
                d.kind
            )));
        }
        if !["/v1alpha2", "/v1alpha1", "llm-d.ai/v1"]
            .iter()
            .any(|v| d.api_version.ends_with(v))
        {
            tracing::warn!(api_version = %d.api_version, "unexpected InferenceObjective apiVersion");
        }
        d.spec.check(&d.api_version, at)?;
        if self.0.contains_key(&d.metadata.name) {
            return Err(ConfigError::invalid(format!(
                "{at}: InferenceObjective `{}` defined twice",
                d.metadata.name
            )));
        }
        self.0.insert(d.metadata.name, d.spec.priority.unwrap_or(0));
        Ok(())
    }

    pub fn from_file(path: &Path) -> Result<Objectives, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Objectives::from_yaml(&text)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn priority(&self, name: &str) -> Option<i32> {
        self.0.get(name).copied()
    }
}

/// What admission needs to know about a request, from its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    pub fairness_id: String,
    pub objective: Option<String>,
    pub priority: i32,
    pub slo_ttft_ms: Option<u64>,
}

fn first_header<'a>(headers: &'a HashMap<String, String>, names: &[&str]) -> Option<&'a str> {
    names
        .iter()
        .filter_map(|n| headers.get(*n))
        .map(|v| v.trim())
        .find(|v| !v.is_empty())
}

impl RequestMeta {
    /// A tenant's grants as the request's metadata (tenant mode: no header counts).
    pub fn granted(fairness_id: &str, objective: Option<&str>, objectives: &Objectives) -> Self {
        RequestMeta {
            fairness_id: fairness_id.to_string(),
            objective: objective.map(str::to_string),
            priority: objective.and_then(|o| objectives.priority(o)).unwrap_or(0),
            slo_ttft_ms: None,
        }
    }

    pub fn from_headers(
        headers: &HashMap<String, String>,
        objectives: &Objectives,
        agent: &AgentIdentity,
    ) -> Self {
        let fairness_id = first_header(headers, &[FAIRNESS_ID_HEADER, FAIRNESS_ID_ALIAS])
            .or_else(|| agent.session(headers))
            .unwrap_or(DEFAULT_FAIRNESS_ID)
            .to_string();
        let objective =
            first_header(headers, &[OBJECTIVE_HEADER, OBJECTIVE_ALIAS]).map(str::to_string);
        let priority = match &objective {
            Some(name) => objectives.priority(name).unwrap_or_else(|| {
                tracing::debug!(objective = %name, "unknown InferenceObjective: priority 0");
                0
            }),
            None => 0,
        };
        let slo_ttft_ms = first_header(headers, &[SLO_TTFT_HEADER, SLO_TTFT_ALIAS])
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v > 0.0)
            .map(|v| v.round() as u64);
        RequestMeta {
            fairness_id,
            objective,
            priority,
            slo_ttft_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn meta_from_headers_with_aliases_and_defaults() {
        let obj = Objectives::new([("premium".to_string(), 10)].into_iter().collect());
        let m = RequestMeta::from_headers(&headers(&[]), &obj, &AgentIdentity::default());
        assert_eq!(m.fairness_id, "default-flow");
        assert_eq!((m.priority, m.slo_ttft_ms), (0, None));
        let m = RequestMeta::from_headers(
            &headers(&[
                ("x-gateway-inference-fairness-id", "team-a"),
                ("x-gateway-inference-objective", "premium"),
                ("x-slo-ttft-ms", "250"),
            ]),
            &obj,
            &AgentIdentity::default(),
        );
        assert_eq!(m.fairness_id, "team-a");
        assert_eq!(
            (m.objective.as_deref(), m.priority, m.slo_ttft_ms),
            (Some("premium"), 10, Some(250))
        );
        // The current header wins over the alias; unknown objectives are priority 0.
        let m = RequestMeta::from_headers(
            &headers(&[
                ("x-llm-d-inference-fairness-id", "new"),
                ("x-gateway-inference-fairness-id", "old"),
                ("x-llm-d-inference-objective", "nope"),
                ("x-llm-d-slo-ttft-ms", "-3"),
            ]),
            &obj,
            &AgentIdentity::default(),
        );
        assert_eq!((m.fairness_id.as_str(), m.priority), ("new", 0));
        // agent identity: an agent's session header when no fairness id is given
        let agent = |pairs: &[(&str, &str)]| {
            RequestMeta::from_headers(
                &headers(pairs),
                &Objectives::default(),
                &AgentIdentity::default(),
            )
            .fairness_id
        };
        assert_eq!(agent(&[("x-claude-code-session-id", "cc-1")]), "cc-1");
        assert_eq!(
            agent(&[("session_id", "s"), ("x-session-affinity", "a")]),
            "a",
            "listed order decides"
        );
        assert_eq!(
            agent(&[("x-llm-d-inference-fairness-id", "t"), ("session-id", "s")]),
            "t",
            "an explicit fairness id wins"
        );
        assert_eq!(agent(&[("session-id", "  ")]), "default-flow");
        assert_eq!(m.slo_ttft_ms, None);
        // `additionalSessionHeaders` come before the built-in ones (names in any case).
        let extra = AgentIdentity::new(&["X-Conversation".to_string()]);
        let h = headers(&[("x-conversation", "conv-9"), ("session-id", "s")]);
        assert_eq!(
            RequestMeta::from_headers(&h, &Objectives::default(), &extra).fairness_id,
            "conv-9"
        );
        assert_eq!(
            extra.session(&headers(&[("session-id", "s")])),
            Some("s"),
            "the built-in headers still count"
        );
    }

    #[test]
    fn objectives_from_manifests() {
        let yaml = "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: premium}\nspec: {priority: 10, poolRef: {name: p}}\n---\napiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: batch}\nspec: {priority: -5}\n";
        let o = Objectives::from_yaml(yaml).unwrap();
        assert_eq!(
            (o.priority("premium"), o.priority("batch"), o.len()),
            (Some(10), Some(-5), 2)
        );
        let bad = "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: x}\nspec: {priorty: 1}\n";
        let e = Objectives::from_yaml(bad).unwrap_err().to_string();
        assert!(e.contains("priorty"), "{e}");
        let dup = format!("{yaml}---\n{}", yaml.split("---\n").next().unwrap());
        let e = Objectives::from_yaml(&dup).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    /// llm-d v1.0's `InferenceObjective` (`llm-d.ai/v1`): bound by `poolRefs` or
    /// `poolSelector`, loaded beside v1alpha2's; each version's binding keys only.
    #[test]
    fn v1_objectives_load_beside_v1alpha2() {
        let v1 = |spec: &str| {
            format!(
                "apiVersion: llm-d.ai/v1\nkind: InferenceObjective\nmetadata: {{name: o}}\nspec: {spec}\n"
            )
        };
        let o = Objectives::from_yaml(&format!(
            "{}---\napiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {{name: old}}\nspec: {{priority: -3, poolRef: {{name: p}}}}\n",
            v1("{priority: 7, poolRefs: [{name: p}, {name: q}]}")
        ))
        .unwrap();
        assert_eq!((o.priority("o"), o.priority("old")), (Some(7), Some(-3)));
        let o = Objectives::from_yaml(&v1(
            "{priority: 2, poolSelector: {matchLabels: {app: vllm}}}",
        ))
        .unwrap();
        assert_eq!(o.priority("o"), Some(2));
        for (spec, says) in [
            ("{priority: 1}", "needs `poolRefs` or `poolSelector`"),
            (
                "{priority: 1, poolRef: {name: p}}",
                "`poolRef` is v1alpha2's",
            ),
            ("{poolRefs: []}", "1 to 16"),
            ("{poolSelector: {}}", "must not be empty"),
            (
                "{poolRefs: [{name: p}], poolSelector: {matchLabels: {a: b}}}",
                "exclude each other",
            ),
        ] {
            let e = Objectives::from_yaml(&v1(spec)).unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
        let e = Objectives::from_yaml(
            "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: x}\nspec: {poolRefs: [{name: p}]}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("llm-d.ai/v1's"), "{e}");
    }

    #[test]
    fn example_objectives_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/objectives.yaml");
        let o = Objectives::from_file(&path).unwrap();
        assert_eq!(
            (
                o.priority("interactive"),
                o.priority("standard"),
                o.priority("batch")
            ),
            (Some(10), Some(0), Some(-10))
        );
    }
}

//! Model rewrite: the model a request asks for becomes the model it is served by.
//!
//! As llm-d: the header `x-llm-d-model-name-rewrite` (alias `x-gateway-model-name-rewrite`) names
//! a target model; an `InferenceModelRewrite` rule for the incoming model overrides it. Rules
//! (standalone: the manifests in `--model-rewrites-file`) match the body's `model` exactly; a rule
//! with no `matches` applies to every model no exact rule names. Targets are chosen at random in
//! proportion to their `weight` (canary splits). The body's `model` is rewritten when the target
//! differs, and the response's `model` is restored to the name the client used (see
//! `dataplane::response`).

use std::collections::HashMap;
use std::path::Path;

use rand::Rng;
use serde::Deserialize;

use crate::config::{ConfigError, decode_at, each_doc};

pub const REWRITE_HEADER: &str = "x-llm-d-model-name-rewrite";
pub const REWRITE_ALIAS: &str = "x-gateway-model-name-rewrite";

#[derive(Debug, Clone, PartialEq)]
struct Target {
    model: String,
    weight: u32,
}

/// The rules of every `InferenceModelRewrite`, in document order.
#[derive(Debug, Clone, Default)]
pub struct ModelRewrites {
    exact: HashMap<String, Vec<Target>>,
    /// The first rule without `matches`.
    fallback: Option<Vec<Target>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Doc {
    api_version: String,
    kind: String,
    metadata: Meta,
    spec: Spec,
}

#[derive(Deserialize)]
struct Meta {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Spec {
    #[serde(default)]
    #[allow(dead_code)]
    pool_ref: Option<serde_json::Value>,
    #[serde(default)]
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[serde(default)]
    matches: Vec<Match>,
    targets: Vec<TargetSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Match {
    model: ModelMatch,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelMatch {
    #[serde(default = "exact", rename = "type")]
    kind: String,
    value: String,
}

fn exact() -> String {
    "Exact".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TargetSpec {
    model_rewrite: String,
    #[serde(default)]
    weight: Option<u32>,
}

impl ModelRewrites {
    /// Parse YAML documents of `kind: InferenceModelRewrite`.
    pub fn from_yaml(text: &str) -> Result<ModelRewrites, ConfigError> {
        let mut out = ModelRewrites::default();
        each_doc(text, "rewrites", |doc, at| out.add(doc, at))?;
        Ok(out)
    }

    /// Adds the rules of one `InferenceModelRewrite` document (a manifest, or an object from
    /// the API server) after those added before it; `at` names it in the error. Nothing is
    /// added when it is refused.
    pub fn add(&mut self, doc: &serde_json::Value, at: &str) -> Result<(), ConfigError> {
        let d: Doc = decode_at(doc, at)?;
        if d.kind != "InferenceModelRewrite" {
            return Err(ConfigError::invalid(format!(
                "{at}.kind: `{}` is not InferenceModelRewrite",
                d.kind
            )));
        }
        if !d.api_version.ends_with("/v1alpha2") && !d.api_version.ends_with("/v1alpha1") {
            tracing::warn!(api_version = %d.api_version, name = %d.metadata.name, "unexpected InferenceModelRewrite apiVersion");
        }
        let mut rules = Vec::new();
        for (r, rule) in d.spec.rules.into_iter().enumerate() {
            let at = format!("{at}.spec.rules[{r}]");
            if rule.targets.is_empty() {
                return Err(ConfigError::invalid(format!("{at}.targets: empty")));
            }
            let mut targets = Vec::new();
            for (t, ts) in rule.targets.into_iter().enumerate() {
                if ts.model_rewrite.trim().is_empty() {
                    return Err(ConfigError::invalid(format!(
                        "{at}.targets[{t}].modelRewrite: empty"
                    )));
                }
                targets.push(Target {
                    model: ts.model_rewrite,
                    weight: ts.weight.unwrap_or(1),
                });
            }
            if targets.iter().all(|t| t.weight == 0) {
                return Err(ConfigError::invalid(format!(
                    "{at}.targets: every weight is 0"
                )));
            }
            for (m, mm) in rule.matches.iter().enumerate() {
                if mm.model.kind != "Exact" {
                    return Err(ConfigError::invalid(format!(
                        "{at}.matches[{m}].model.type: `{}` (only Exact)",
                        mm.model.kind
                    )));
                }
            }
            rules.push((rule.matches, targets));
        }
        for (matches, targets) in rules {
            if matches.is_empty() {
                self.fallback.get_or_insert(targets);
                continue;
            }
            for mm in matches {
                // The first rule naming a model wins (llm-d: oldest first).
                self.exact
                    .entry(mm.model.value)
                    .or_insert_with(|| targets.clone());
            }
        }
        Ok(())
    }

    pub fn from_file(path: &Path) -> Result<ModelRewrites, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        ModelRewrites::from_yaml(&text)
    }

    pub fn rules(&self) -> usize {
        self.exact.len() + usize::from(self.fallback.is_some())
    }

    /// The model to serve `incoming` with: a matching rule's weighted pick, else the header's
    /// target, else `incoming` itself.
    pub fn target<'a>(
        &'a self,
        incoming: &'a str,
        header: Option<&'a str>,
        rng: &mut impl Rng,
    ) -> &'a str {
        let rule = self.exact.get(incoming).or(self.fallback.as_ref());
        match rule {
            Some(targets) => pick(targets, rng),
            None => header
                .map(str::trim)
                .filter(|h| !h.is_empty())
                .unwrap_or(incoming),
        }
    }
}

fn pick<'a>(targets: &'a [Target], rng: &mut impl Rng) -> &'a str {
    let total: u64 = targets.iter().map(|t| u64::from(t.weight)).sum();
    let mut x = rng.random_range(0..total.max(1));
    for t in targets {
        let w = u64::from(t.weight);
        if x < w {
            return &t.model;
        }
        x -= w;
    }
    targets.last().map_or("", |t| t.model.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    const RULES: &str = "\
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: canary}
spec:
  poolRef: {group: inference.networking.k8s.io, name: pool}
  rules:
  - matches: [{model: {type: Exact, value: assistant}}]
    targets:
    - {modelRewrite: assistant-v1, weight: 90}
    - {modelRewrite: assistant-v2, weight: 10}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: catch-all}
spec:
  rules:
  - targets: [{modelRewrite: base}]
  - matches: [{model: {value: assistant}}]
    targets: [{modelRewrite: never}]
";

    #[test]
    fn rules_override_the_header_and_split_by_weight() {
        let r = ModelRewrites::from_yaml(RULES).unwrap();
        assert_eq!(r.rules(), 2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut v2 = 0;
        for _ in 0..10_000 {
            match r.target("assistant", Some("ignored"), &mut rng) {
                "assistant-v1" => {}
                "assistant-v2" => v2 += 1,
                other => panic!("{other}"),
            }
        }
        assert!((800..1200).contains(&v2), "v2 got {v2} of 10000");
        // No exact rule: the catch-all (first rule without matches) wins over the header.
        assert_eq!(r.target("other", Some("hdr"), &mut rng), "base");
        // Without rules: the header, else unchanged.
        let none = ModelRewrites::default();
        assert_eq!(none.target("m", Some(" t "), &mut rng), "t");
        assert_eq!(none.target("m", Some(""), &mut rng), "m");
        assert_eq!(none.target("m", None, &mut rng), "m");
    }

    #[test]
    fn example_file_loads() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/model-rewrites.yaml");
        let r = ModelRewrites::from_file(&path).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(
            r.target("llama-3", None, &mut rng),
            "meta-llama/Llama-3.1-8B-Instruct"
        );
        assert_eq!(
            r.target("anything", None, &mut rng),
            "meta-llama/Llama-3.1-8B-Instruct"
        );
        assert!(
            r.target("assistant", None, &mut rng)
                .starts_with("assistant-v")
        );
    }

    #[test]
    fn bad_manifests_say_what_is_wrong() {
        let err = |y: &str| ModelRewrites::from_yaml(y).unwrap_err().to_string();
        let base =
            "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceModelRewrite\nmetadata: {name: x}\n";
        assert!(err(&format!("{base}spec: {{rules: [{{targets: []}}]}}")).contains("empty"));
        assert!(err(&format!(
            "{base}spec: {{rules: [{{matches: [{{model: {{type: RegularExpression, value: a}}}}], targets: [{{modelRewrite: b}}]}}]}}"
        ))
        .contains("only Exact"));
        assert!(
            err(&format!(
                "{base}spec: {{rules: [{{targets: [{{modelRewrite: b, weight: 0}}]}}]}}"
            ))
            .contains("every weight is 0")
        );
        assert!(err(&format!("{base}spec: {{rulez: []}}")).contains("rulez"));
        assert!(
            err("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\nspec: {}\n")
                .contains("not InferenceModelRewrite")
        );
    }
}

//! The custom resources the EPP reads, as Rust types (kube's `CustomResource` derive); their CRD
//! manifests are generated from these types (`epp crds`) and checked in under `deploy/crds/`.
//!
//! - [`v1::InferencePool`] (`inference.networking.k8s.io/v1`, Gateway API Inference Extension):
//!   the pool's pod `selector.matchLabels` and `targetPorts`;
//! - [`v1alpha2::InferencePool`] (`inference.networking.x-k8s.io/v1alpha2`, the older API group
//!   llm-d still accepts with `--pool-group`): a flat `selector` and one `targetPortNumber`;
//! - [`llmd::InferenceObjective`] and [`llmd::InferenceModelRewrite`] (`llm-d.ai/v1alpha2`): a
//!   request's priority by objective name, and model rewrites (weighted canary splits), each
//!   bound to a pool by `poolRef`.
//! - [`tenancy::TenantQuota`] (`epp.dev/v1alpha1`, this project's group): a tenant's API-key
//!   hashes, grants and quotas (`--watch-tenants`; the same resource as the tenants file's).
//!
//! Only the fields the EPP uses are typed strictly; the rest of GIE's schema (status conditions,
//! the picker reference's details) is carried so a generated CRD accepts GIE's objects.

use std::collections::BTreeMap;

use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::Deserialize;
use serde::Serialize;

/// The pool as discovery needs it, whichever API group it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Pods of the pool carry all of these labels.
    pub match_labels: BTreeMap<String, String>,
    /// Each selected pod serves on each of these ports (one endpoint per pod × port).
    pub ports: Vec<u16>,
}

/// Why a pool object cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("the pool's selector is empty (it would select every pod in the namespace)")]
    EmptySelector,
    #[error("the pool has no target port")]
    NoPorts,
    #[error("target port {0} is not in 1..=65535")]
    BadPort(i64),
}

fn ports(numbers: impl IntoIterator<Item = i64>) -> Result<Vec<u16>, PoolError> {
    let mut out = Vec::new();
    for n in numbers {
        let port = u16::try_from(n)
            .ok()
            .filter(|p| *p > 0)
            .ok_or(PoolError::BadPort(n))?;
        if !out.contains(&port) {
            out.push(port);
        }
    }
    if out.is_empty() {
        return Err(PoolError::NoPorts);
    }
    Ok(out)
}

fn checked(match_labels: BTreeMap<String, String>, ports: Vec<u16>) -> Result<PoolSpec, PoolError> {
    if match_labels.is_empty() {
        return Err(PoolError::EmptySelector);
    }
    Ok(PoolSpec {
        match_labels,
        ports,
    })
}

/// A status condition (the shape of `metav1.Condition`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A reference to a parent (usually a Gateway) in a pool's status.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The pool's status as seen by one parent.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    pub parent_ref: ParentReference,
}

/// `status` of both pool versions (written by gateways, not by the EPP).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<ParentStatus>,
}

pub mod v1 {
    //! `inference.networking.k8s.io/v1`.
    use super::*;

    /// `InferencePool` spec: which pods, on which ports, and which picker serves them.
    #[derive(CustomResource, Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[kube(
        group = "inference.networking.k8s.io",
        version = "v1",
        kind = "InferencePool",
        namespaced,
        status = "InferencePoolStatus",
        shortname = "infpool"
    )]
    #[serde(rename_all = "camelCase")]
    pub struct InferencePoolSpec {
        /// Pods of the pool (same namespace) by label.
        pub selector: LabelSelector,
        /// The model servers' port(s); each selected pod is one endpoint per port.
        pub target_ports: Vec<Port>,
        /// The endpoint picker serving this pool.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub endpoint_picker_ref: Option<EndpointPickerRef>,
    }

    /// Equality-based pod selector.
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(rename_all = "camelCase")]
    pub struct LabelSelector {
        #[serde(default)]
        pub match_labels: BTreeMap<String, String>,
    }

    /// A port number.
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct Port {
        pub number: i64,
    }

    /// The endpoint picker extension (a Service, usually).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(rename_all = "camelCase")]
    pub struct EndpointPickerRef {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub group: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub kind: Option<String>,
        pub name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub port: Option<Port>,
        /// `FailOpen` or `FailClose`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub failure_mode: Option<String>,
    }

    impl InferencePool {
        /// What discovery uses, checked.
        pub fn pool_spec(&self) -> Result<PoolSpec, PoolError> {
            checked(
                self.spec.selector.match_labels.clone(),
                ports(self.spec.target_ports.iter().map(|p| p.number))?,
            )
        }
    }
}

pub mod v1alpha2 {
    //! `inference.networking.x-k8s.io/v1alpha2` (the group before GIE's v1).
    use super::*;

    /// `InferencePool` spec (v1alpha2): a flat selector and one port.
    #[derive(CustomResource, Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[kube(
        group = "inference.networking.x-k8s.io",
        version = "v1alpha2",
        kind = "InferencePool",
        namespaced,
        status = "InferencePoolStatus"
    )]
    #[serde(rename_all = "camelCase")]
    pub struct InferencePoolSpec {
        pub selector: BTreeMap<String, String>,
        pub target_port_number: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub extension_ref: Option<ExtensionRef>,
    }

    /// The endpoint picker extension (v1alpha2).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(rename_all = "camelCase")]
    pub struct ExtensionRef {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub group: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub kind: Option<String>,
        pub name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub port_number: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub failure_mode: Option<String>,
    }

    impl InferencePool {
        /// What discovery uses, checked.
        pub fn pool_spec(&self) -> Result<PoolSpec, PoolError> {
            checked(
                self.spec.selector.clone(),
                ports([self.spec.target_port_number])?,
            )
        }
    }
}

pub mod llmd {
    //! `llm-d.ai/v1alpha2`: objectives and model rewrites, bound to a pool by `poolRef`.
    use super::*;

    /// The pool an object applies to (`group` defaults to GIE's, `kind` to `InferencePool`).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct PoolObjectReference {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub group: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub kind: Option<String>,
        pub name: String,
    }

    impl PoolObjectReference {
        /// Names the pool `name` of API group `group` (an unset group is GIE's, either version).
        pub fn names(&self, name: &str, group: &str) -> bool {
            self.name == name
                && self.kind.as_deref().is_none_or(|k| k == "InferencePool")
                && self
                    .group
                    .as_deref()
                    .is_none_or(|g| g.is_empty() || g == group)
        }
    }

    /// `InferenceObjective` spec: the priority band of the requests naming it
    /// (`x-llm-d-inference-objective`).
    #[derive(CustomResource, Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[kube(
        group = "llm-d.ai",
        version = "v1alpha2",
        kind = "InferenceObjective",
        namespaced
    )]
    #[serde(rename_all = "camelCase")]
    pub struct InferenceObjectiveSpec {
        /// Higher is more important; below 0 is sheddable. Default 0.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub priority: Option<i32>,
        pub pool_ref: PoolObjectReference,
    }

    /// `InferenceModelRewrite` spec: the model a request asks for becomes a weighted pick of
    /// targets.
    #[derive(CustomResource, Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[kube(
        group = "llm-d.ai",
        version = "v1alpha2",
        kind = "InferenceModelRewrite",
        namespaced
    )]
    #[serde(rename_all = "camelCase")]
    pub struct InferenceModelRewriteSpec {
        pub pool_ref: PoolObjectReference,
        #[serde(default)]
        pub rules: Vec<RewriteRule>,
    }

    /// Requests whose model matches (no `matches`: any model no other rule names) go to the
    /// targets in proportion to their weights.
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct RewriteRule {
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub matches: Vec<RewriteMatch>,
        pub targets: Vec<RewriteTarget>,
    }

    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct RewriteMatch {
        pub model: ModelMatch,
    }

    /// `type: Exact` (the only type) and the model name.
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct ModelMatch {
        #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
        pub kind: Option<String>,
        pub value: String,
    }

    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(rename_all = "camelCase")]
    pub struct RewriteTarget {
        pub model_rewrite: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub weight: Option<u32>,
    }
}

pub mod tenancy {
    //! `epp.dev/v1alpha1`: tenants (the `--tenants-file` documents as Kubernetes objects).
    use super::*;

    /// `TenantQuota` spec: who the tenant is (API-key SHA-256 hashes, or the anonymous tenant),
    /// what it is granted, and its quotas per model (see docs/configuration.md).
    #[derive(
        CustomResource, Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq,
    )]
    #[kube(
        group = "epp.dev",
        version = "v1alpha1",
        kind = "TenantQuota",
        namespaced
    )]
    #[serde(rename_all = "camelCase")]
    pub struct TenantQuotaSpec {
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub api_keys: Vec<ApiKey>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub anonymous: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub fairness_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub objective: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub limits: Vec<TenantLimit>,
    }

    /// An API key, as the SHA-256 of the key in hex (the key itself is never stored).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    pub struct ApiKey {
        pub sha256: String,
    }

    /// Quotas for one model the client names (`*`: every model without its own entry).
    #[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(rename_all = "camelCase")]
    pub struct TenantLimit {
        pub model: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub requests_per_minute: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tokens_per_minute: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub concurrency: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub default_max_tokens: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_tokens_cap: Option<u64>,
    }
}

/// Every CRD the EPP reads, as one multi-document YAML (`epp crds`; checked in as
/// `deploy/crds/crds.yaml`).
pub fn crds_yaml() -> String {
    let crds = [
        v1::InferencePool::crd(),
        v1alpha2::InferencePool::crd(),
        llmd::InferenceObjective::crd(),
        llmd::InferenceModelRewrite::crd(),
        tenancy::TenantQuota::crd(),
    ];
    let mut out = String::from(
        "# Generated by `epp crds` from node/src/k8s/crd.rs; do not edit (a test fails on drift).\n",
    );
    for crd in crds {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd).unwrap_or_default());
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pools_of_both_groups_parse_into_one_spec() {
        let v1: v1::InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": 8000}, {"number": 8001}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002},
                                           "failureMode": "FailOpen"}},
        }))
        .unwrap();
        let spec = v1.pool_spec().unwrap();
        assert_eq!(spec.ports, vec![8000, 8001]);
        assert_eq!(spec.match_labels["app"], "vllm");
        let old: v1alpha2::InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
                     "extensionRef": {"name": "epp"}},
        }))
        .unwrap();
        assert_eq!(old.pool_spec().unwrap().ports, vec![8000]);
    }

    #[test]
    fn unusable_pools_are_named() {
        let pool = |labels: serde_json::Value, ports: serde_json::Value| {
            serde_json::from_value::<v1::InferencePool>(serde_json::json!({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "p"},
                "spec": {"selector": {"matchLabels": labels}, "targetPorts": ports},
            }))
            .unwrap()
            .pool_spec()
        };
        let p = serde_json::json!([{"number": 8000}]);
        assert_eq!(
            pool(serde_json::json!({}), p),
            Err(PoolError::EmptySelector)
        );
        let l = serde_json::json!({"app": "x"});
        assert_eq!(
            pool(l.clone(), serde_json::json!([])),
            Err(PoolError::NoPorts)
        );
        assert_eq!(
            pool(l, serde_json::json!([{"number": 70000}])),
            Err(PoolError::BadPort(70000))
        );
    }

    /// `deploy/crds/crds.yaml` is what `epp crds` prints (regenerate with
    /// `cargo run --bin epp -- crds > deploy/crds/crds.yaml`).
    #[test]
    fn checked_in_crds_match_the_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crds/crds.yaml");
        let checked_in = std::fs::read_to_string(path).unwrap();
        assert!(
            checked_in == crds_yaml(),
            "{path} drifted from node/src/k8s/crd.rs: regenerate it with \
             `cargo run --bin epp -- crds > deploy/crds/crds.yaml`"
        );
    }
}

//! The `llm-d.ai/v1` `EndpointPickerConfig`: what a file of any accepted version becomes, and
//! what `epp validate-config` prints.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An `EndpointPickerConfig` in its `llm-d.ai/v1` form: what a file of any accepted version
/// becomes ([`EndpointPickerConfig::from_yaml`]), and what `epp validate-config` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointPickerConfig {
    pub api_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feature_gates: Vec<String>,
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
    #[serde(default)]
    pub scheduling_profiles: Vec<ProfileSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_layer: Option<DataLayerSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_handler: Option<RequestHandlerSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(rename = "type")]
    pub type_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

impl PluginSpec {
    /// The instance name: `name`, or the type name when absent (as llm-d does).
    pub fn instance_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.type_name)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProfileSpec {
    pub name: String,
    #[serde(default)]
    pub plugins: Vec<ProfilePluginRef>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProfilePluginRef {
    pub plugin_ref: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DataLayerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inject_defaults: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<DataSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<DiscoverySpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_replica: Option<CrossReplicaSpec>,
}

/// `dataLayer.discovery`: where the pool's endpoints and the peer replicas come from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DiscoverySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<PluginRefSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<PluginRefSpec>,
}

/// `dataLayer.crossReplica`: llm-d's syncer of state between replicas. Ours is cluster mode
/// (Raft and gossip between the replicas, `--peers`): the keys are accepted and say nothing it
/// needs ([`CrossReplicaSpec::explain`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CrossReplicaSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syncer_plugin_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_interval: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_timeout: Option<String>,
}

impl CrossReplicaSpec {
    /// What the section maps to here, for the start-up log and `validate-config`.
    pub fn explain(&self) -> String {
        format!(
            "dataLayer.crossReplica (syncer {}): replicas share the prefix index, in-flight load, \
             flow control and quotas through cluster mode (--peers: Raft and gossip between the \
             replicas, every change pushed as it happens); syncInterval and publishTimeout have \
             no effect; without --peers each replica keeps its own state",
            self.syncer_plugin_ref.as_deref().unwrap_or("none")
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DataSourceSpec {
    pub plugin_ref: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extractors: Vec<PluginRefSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginRefSpec {
    pub plugin_ref: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RequestHandlerSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parsers: Vec<PluginRefSpec>,
    /// Write the request's resolved priority (its objective's) into the forwarded body's
    /// top-level `priority`, where vLLM's priority scheduling reads it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub propagate_priority: bool,
}

//! `llm-d.ai/v1alpha1` (and the Inference Extension's `inference.networking.x-k8s.io/v1alpha1`)
//! `EndpointPickerConfig`s, read strictly in their own shape and converted to `llm-d.ai/v1`.
//!
//! What moved in v1 ([`MOVED`]): `dataLayer.discovery.pluginRef` → `discovery.endpoints`,
//! `dataLayer.peerDiscovery` → `discovery.peers`, the flat `dataLayer.crossReplica*` keys →
//! `dataLayer.crossReplica.*`, and the older top-level `saturationDetector` / `parser` →
//! `flowControl.saturationDetector` / `requestHandler.parsers`. Everything else is the same; where
//! an old and a new location are both set, the new one wins (as in llm-d).

use serde::Deserialize;
use serde_json::Value;

use super::v1::{
    CrossReplicaSpec, DataLayerSpec, DataSourceSpec, DiscoverySpec, PluginRefSpec, PluginSpec,
    ProfileSpec, RequestHandlerSpec,
};

/// The keys v1 no longer has, and where they went: a v1 file using one is refused with this.
const MOVED: &[(&[&str], &str)] = &[
    (&["saturationDetector"], "flowControl.saturationDetector"),
    (&["parser"], "requestHandler.parsers (a list)"),
    (
        &["dataLayer", "discovery", "pluginRef"],
        "dataLayer.discovery.endpoints.pluginRef",
    ),
    (&["dataLayer", "peerDiscovery"], "dataLayer.discovery.peers"),
    (
        &["dataLayer", "crossReplicaSyncerPluginRef"],
        "dataLayer.crossReplica.syncerPluginRef",
    ),
    (
        &["dataLayer", "crossReplicaSyncInterval"],
        "dataLayer.crossReplica.syncInterval",
    ),
    (
        &["dataLayer", "crossReplicaPublishTimeout"],
        "dataLayer.crossReplica.publishTimeout",
    ),
];

/// The first key of a `llm-d.ai/v1` document that v1 moved, and where it goes now (strict
/// decoding would only call it unknown).
pub(super) fn moved_key(doc: &Value) -> Option<(String, &'static str)> {
    MOVED
        .iter()
        .find(|(path, _)| path.iter().try_fold(doc, |v, k| v.get(k)).is_some())
        .map(|(path, instead)| (path.join("."), *instead))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct EndpointPickerConfig {
    #[serde(rename = "apiVersion")]
    _api_version: String,
    kind: String,
    #[serde(default)]
    feature_gates: Vec<String>,
    #[serde(default)]
    plugins: Vec<PluginSpec>,
    #[serde(default)]
    scheduling_profiles: Vec<ProfileSpec>,
    #[serde(default)]
    data_layer: Option<DataLayer>,
    #[serde(default)]
    flow_control: Option<Value>,
    #[serde(default)]
    request_handler: Option<RequestHandlerSpec>,
    /// The older top-level location of `flowControl.saturationDetector`.
    #[serde(default)]
    saturation_detector: Option<Value>,
    /// The older top-level location of `requestHandler.parsers`: one parser or a list.
    #[serde(default)]
    parser: Option<Parsers>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Parsers {
    One(PluginRefSpec),
    List(Vec<PluginRefSpec>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct DataLayer {
    #[serde(default)]
    inject_defaults: Option<bool>,
    #[serde(default)]
    sources: Vec<DataSourceSpec>,
    #[serde(default)]
    discovery: Option<PluginRefSpec>,
    #[serde(default)]
    peer_discovery: Option<PluginRefSpec>,
    #[serde(default)]
    cross_replica_syncer_plugin_ref: Option<String>,
    #[serde(default)]
    cross_replica_sync_interval: Option<String>,
    #[serde(default)]
    cross_replica_publish_timeout: Option<String>,
}

impl DataLayer {
    fn into_v1(self) -> DataLayerSpec {
        let discovery = DiscoverySpec {
            endpoints: self.discovery,
            peers: self.peer_discovery,
        };
        let cross = CrossReplicaSpec {
            syncer_plugin_ref: self.cross_replica_syncer_plugin_ref,
            sync_interval: self.cross_replica_sync_interval,
            publish_timeout: self.cross_replica_publish_timeout,
        };
        DataLayerSpec {
            inject_defaults: self.inject_defaults,
            sources: self.sources,
            discovery: (discovery != DiscoverySpec::default()).then_some(discovery),
            cross_replica: (cross != CrossReplicaSpec::default()).then_some(cross),
        }
    }
}

impl EndpointPickerConfig {
    /// The same configuration in `llm-d.ai/v1`'s shape.
    pub(super) fn into_v1(self, api_version: &str) -> super::v1::EndpointPickerConfig {
        let mut flow_control = self.flow_control;
        if let Some(old) = self.saturation_detector {
            match flow_control.as_mut().and_then(Value::as_object_mut) {
                Some(fc) => {
                    fc.entry("saturationDetector").or_insert(old);
                }
                None => {
                    flow_control = Some(serde_json::json!({ "saturationDetector": old }));
                }
            }
        }
        let mut request_handler = self.request_handler;
        if let Some(old) = self.parser {
            let rh = request_handler.get_or_insert_with(RequestHandlerSpec::default);
            if rh.parsers.is_empty() {
                rh.parsers = match old {
                    Parsers::One(p) => vec![p],
                    Parsers::List(l) => l,
                };
            }
        }
        super::v1::EndpointPickerConfig {
            api_version: api_version.to_string(),
            kind: self.kind,
            feature_gates: self.feature_gates,
            plugins: self.plugins,
            scheduling_profiles: self.scheduling_profiles,
            data_layer: self.data_layer.map(DataLayer::into_v1),
            flow_control,
            request_handler,
        }
    }
}

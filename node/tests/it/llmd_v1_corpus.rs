//! llm-d v1.0's `EndpointPickerConfig` examples (written out from `shared/reference/llmd-v1.md`:
//! the api reference's layout, the router configuration and flow-control pages, the well-lit
//! paths' profiles), each in its `llm-d.ai/v1` form and in the `llm-d.ai/v1alpha1` form a v0.x
//! user has: both load, and to the same effective configuration — the same decoded v1 document,
//! the same built scheduler and admission. The v1 form printed by `validate-config` loads back
//! to itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use node::config::EndpointPickerConfig;

/// (what, v1, v1alpha1) — the v1alpha1 text uses the keys v1 moved where a form had them.
const CORPUS: &[(&str, &str, &str)] = &[
    (
        "llm-d's default plugins",
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
",
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
",
    ),
    (
        "data layer with the cross-replica syncer",
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
- type: core-metrics-extractor
- {name: sync, type: local-syncer}
- type: queue-scorer
dataLayer:
  injectDefaults: true
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
  crossReplica: {syncerPluginRef: sync, syncInterval: 500ms, publishTimeout: 2s}
",
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
- type: core-metrics-extractor
- {name: sync, type: local-syncer}
- type: queue-scorer
dataLayer:
  injectDefaults: true
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
  crossReplicaSyncerPluginRef: sync
  crossReplicaSyncInterval: 500ms
  crossReplicaPublishTimeout: 2s
",
    ),
    (
        "flow control: bands with their own TTLs, strict band selection, program-aware fairness",
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: programs, type: program-aware-fairness, parameters: {strategy: las, lasWeightService: 0.8, lasWeightHeadWait: 0.2, lasHalfLifeSeconds: 60}}
- type: strict-band-selection-policy
- {name: detector, type: utilization-detector, parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}}
flowControl:
  maxRequests: 5000
  defaultRequestTTL: 60s
  noEndpointRequestTTL: 10s
  bandSelectionPolicyPluginRef: strict-band-selection-policy
  priorityBands:
  - {priority: 10, defaultRequestTTL: 5s, fairnessPolicyRef: programs}
  - {priority: 0, maxRequests: 2000}
  - {priority: -10, defaultRequestTTL: 120s, orderingPolicyRef: fcfs-ordering-policy}
  defaultNegativePriorityBand: {defaultRequestTTL: 30s}
  saturationDetector: {pluginRef: detector}
",
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {name: programs, type: program-aware-fairness, parameters: {strategy: las, lasWeightService: 0.8, lasWeightHeadWait: 0.2, lasHalfLifeSeconds: 60}}
- type: strict-band-selection-policy
- {name: detector, type: utilization-detector, parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}}
saturationDetector: {pluginRef: detector}
flowControl:
  maxRequests: 5000
  defaultRequestTTL: 60s
  noEndpointRequestTTL: 10s
  bandSelectionPolicyPluginRef: strict-band-selection-policy
  priorityBands:
  - {priority: 10, defaultRequestTTL: 5s, fairnessPolicyRef: programs}
  - {priority: 0, maxRequests: 2000}
  - {priority: -10, defaultRequestTTL: 120s, orderingPolicyRef: fcfs-ordering-policy}
  defaultNegativePriorityBand: {defaultRequestTTL: 30s}
",
    ),
    (
        "request handler: parsers and priority propagation",
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: passthrough-parser
- type: active-request-scorer
requestHandler:
  parsers: [{pluginRef: passthrough-parser}]
  propagatePriority: true
",
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: passthrough-parser
- type: active-request-scorer
parser: {pluginRef: passthrough-parser}
requestHandler:
  propagatePriority: true
",
    ),
    (
        "sticky until saturated (the guides' default profile)",
        "apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.8, explorationProbability: 0, maxTTFTPenaltyMs: 18000, ttftSource: prefillThroughput, peakPrefillThroughput: 15928}
- type: token-load-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - {pluginRef: token-load-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - pluginRef: max-score-picker
",
        "apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.8, explorationProbability: 0, maxTTFTPenaltyMs: 18000, ttftSource: prefillThroughput, peakPrefillThroughput: 15928}
- type: token-load-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - {pluginRef: token-load-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - pluginRef: max-score-picker
",
    ),
];

fn examples() -> Vec<(String, String, String)> {
    let mut out: Vec<(String, String, String)> = CORPUS
        .iter()
        .map(|(w, a, b)| (w.to_string(), a.to_string(), b.to_string()))
        .collect();
    // The shipped examples (written as v1) and their v1alpha1 spelling: none uses a moved key.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    for f in ["flow-control.yaml", "pd.yaml", "llm-d-affinity.yaml"] {
        let v1 = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(v1.contains("apiVersion: llm-d.ai/v1\n"), "{f}");
        let old = v1.replace(
            "apiVersion: llm-d.ai/v1\n",
            "apiVersion: llm-d.ai/v1alpha1\n",
        );
        out.push((f.to_string(), v1, old));
    }
    out
}

#[test]
fn every_example_loads_in_both_versions_to_the_same_effective_config() {
    for (what, v1, old) in examples() {
        let a = EndpointPickerConfig::from_yaml(&v1).unwrap_or_else(|e| panic!("{what} (v1): {e}"));
        let b = EndpointPickerConfig::from_yaml(&old)
            .unwrap_or_else(|e| panic!("{what} (v1alpha1): {e}"));
        assert_eq!(a, b, "{what}: the two versions decode differently");
        assert_eq!(a.api_version, node::config::API_VERSION, "{what}");
        let built_a = node::scheduling::build(&a).unwrap_or_else(|e| panic!("{what}: {e}"));
        let built_b = node::scheduling::build(&b).unwrap();
        assert_eq!(built_a.summary, built_b.summary, "{what}");
        // What `validate-config` prints loads back to the same configuration.
        let printed = a.to_v1_yaml();
        let again = EndpointPickerConfig::from_yaml(&printed).unwrap_or_else(|e| {
            panic!("{what}: the printed v1 form does not load: {e}\n{printed}")
        });
        assert_eq!(again, a, "{what}: printed as\n{printed}");
    }
}

/// The corpus's flow-control example resolves the v1 additions: each band's own TTL (a band
/// made from a template inherits the template's), the band selection policy.
#[test]
fn band_ttls_resolve_per_band_and_per_template() {
    let (_, v1, _) = CORPUS[2];
    let cfg = EndpointPickerConfig::from_yaml(v1).unwrap();
    let c = node::request::admission::config::controller_config(&cfg).unwrap();
    let s = flowctl::units::NANOS_PER_SEC;
    assert_eq!(c.request_ttl(10), 5 * s);
    assert_eq!(c.request_ttl(0), 60 * s, "no TTL of its own: the default");
    assert_eq!(c.request_ttl(-10), 120 * s);
    assert_eq!(
        c.request_ttl(-3),
        30 * s,
        "a dynamic negative band: its template's"
    );
    assert_eq!(
        c.request_ttl(3),
        60 * s,
        "a dynamic band: the default template's (none)"
    );
    let bad = v1.replace(
        "bandSelectionPolicyPluginRef: strict-band-selection-policy",
        "bandSelectionPolicyPluginRef: programs",
    );
    let e = EndpointPickerConfig::from_yaml(&bad)
        .and_then(|c| node::request::admission::config::controller_config(&c).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a band selection policy"), "{e}");
}

/// A v1 file still using a key v1 moved is refused, naming the key and where it went.
#[test]
fn moved_keys_are_refused_in_v1_with_where_they_went() {
    for (key, snippet, instead) in [
        (
            "saturationDetector",
            "saturationDetector: {pluginRef: utilization-detector}\n",
            "flowControl.saturationDetector",
        ),
        (
            "parser",
            "parser: {pluginRef: openai-parser}\n",
            "requestHandler.parsers",
        ),
        (
            "dataLayer.discovery.pluginRef",
            "dataLayer: {discovery: {pluginRef: d}}\n",
            "dataLayer.discovery.endpoints.pluginRef",
        ),
        (
            "dataLayer.peerDiscovery",
            "dataLayer: {peerDiscovery: {pluginRef: p}}\n",
            "dataLayer.discovery.peers",
        ),
        (
            "dataLayer.crossReplicaSyncInterval",
            "dataLayer: {crossReplicaSyncInterval: 1s}\n",
            "dataLayer.crossReplica.syncInterval",
        ),
    ] {
        let text = format!("apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n{snippet}");
        let e = EndpointPickerConfig::from_yaml(&text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("`{key}`")) && e.contains(instead),
            "{key}: {e}"
        );
    }
    // Still strict: an unknown key is named, in either version.
    for v in ["llm-d.ai/v1", "llm-d.ai/v1alpha1"] {
        let text = format!(
            "apiVersion: {v}\nkind: EndpointPickerConfig\nrequestHandler: {{propagatePriorty: true}}\n"
        );
        let e = EndpointPickerConfig::from_yaml(&text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("propagatePriorty"), "{v}: {e}");
    }
    let e =
        EndpointPickerConfig::from_yaml("apiVersion: llm-d.ai/v2\nkind: EndpointPickerConfig\n")
            .unwrap_err()
            .to_string();
    assert!(e.contains("expected `llm-d.ai/v1`"), "{e}");
}

/// `discovery` plugins are refused with what to use instead; the syncer must be one.
#[test]
fn discovery_is_refused_and_the_syncer_must_be_a_local_syncer() {
    let e = node::scheduling::build(
        &EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n\
             dataLayer: {discovery: {peers: {pluginRef: k8s-peer-discovery}}}\n",
        )
        .unwrap(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("dataLayer.discovery.peers") && e.contains("--peers"),
        "{e}"
    );
    let e = node::scheduling::build(
        &EndpointPickerConfig::from_yaml(
            "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n\
             dataLayer: {crossReplica: {syncerPluginRef: queue-scorer}}\n",
        )
        .unwrap(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("not a `local-syncer`"), "{e}");
}

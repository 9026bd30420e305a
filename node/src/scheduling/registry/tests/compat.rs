//! llm-d compatibility: every llm-d v0.10 type name in one config, the deprecated aliases, and
//! the data-parallel handler's port rules.

use super::load;
use crate::scheduling::testutil::*;

#[test]
fn data_parallel_handler_loads_with_llm_ds_port_rules() {
    let head = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n";
    let dp = |params: &str| {
        load(&format!(
            "{head}- type: data-parallel-profile-handler\n  parameters: {params}\n"
        ))
    };
    assert_eq!(
        dp("{}").unwrap().scheduler.rank_port,
        Some(8000),
        "llm-d's default"
    );
    assert_eq!(
        dp("{primaryPort: 9000}").unwrap().scheduler.rank_port,
        Some(9000)
    );
    assert_eq!(dp("{primaryPort: 1}").unwrap().scheduler.rank_port, Some(1));
    for bad in [
        "{primaryPort: 0}",
        "{primaryPort: -1}",
        "{primaryPort: 65536}",
    ] {
        let e = dp(bad).unwrap_err().to_string();
        assert!(
            e.contains("primaryPort") && e.contains("1-65535"),
            "{bad}: {e}"
        );
    }
    assert!(
        dp("{primaryPort: 8000, port: 1}").is_err(),
        "unknown keys are refused"
    );
    // One profile only, as llm-d.
    let two = format!(
        "{head}- type: data-parallel-profile-handler\nschedulingProfiles:\n\
         - name: a\n  plugins: [{{pluginRef: queue-scorer}}]\n\
         - name: b\n  plugins: [{{pluginRef: queue-scorer}}]\n"
    );
    let e = load(&two).unwrap_err().to_string();
    assert!(e.contains("exactly one profile"), "{e}");
    // Without it, nothing is rewritten.
    assert_eq!(load(head).unwrap().scheduler.rank_port, None);
}

/// Every llm-d v0.10 plugin type name, but the profile handlers (a config has one).
const LLMD_TYPES: &[&str] = &[
    "approx-prefix-cache-producer",
    "prefix-cache-scorer",
    "prefix-cache-affinity-filter",
    "precise-prefix-cache-producer",
    "token-producer",
    "inflight-load-producer",
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "running-requests-size-scorer",
    "lora-affinity-scorer",
    "token-load-scorer",
    "active-request-scorer",
    "load-aware-scorer",
    "no-hit-lru-scorer",
    "session-affinity-scorer",
    "session-affinity-filter",
    "session-id-producer",
    "agent-identity",
    "utilization-filter",
    "label-selector-filter",
    "decode-filter",
    "prefill-filter",
    "encode-filter",
    "max-score-picker",
    "weighted-random-picker",
    "random-picker",
    "prefix-based-pd-decider",
    "always-disagg-pd-decider",
    "always-disagg-multimodal-decider",
    "predicted-latency-producer",
    "latency-scorer",
    "slo-headroom-tier-filter",
    "latency-slo-admitter",
    "probabilistic-admitter",
    "mm-embeddings-cache-producer",
    "mm-embeddings-cache-scorer",
    "metrics-data-source",
    "core-metrics-extractor",
    "openai-parser",
    "anthropic-parser",
    "vllmhttp-parser",
    "passthrough-parser",
    "utilization-detector",
    "concurrency-detector",
    "global-strict-fairness-policy",
    "round-robin-fairness-policy",
    "weighted-fairness-policy",
    "program-aware-fairness",
    "fcfs-ordering-policy",
    "edf-ordering-policy",
    "slo-deadline-ordering-policy",
    "static-usage-limit-policy",
    "priority-holdback-policy",
    "soft-reflective-ceiling-policy",
    "sheddable-eviction-filter",
    "priority-then-time-eviction-order-policy",
];

/// The profile handlers, current and deprecated, with what each needs.
const LLMD_HANDLERS: &[(&str, &str)] = &[
    ("single-profile-handler", "{}"),
    (
        "disagg-profile-handler",
        "{deciders: {prefill: prefix-based-pd-decider}}",
    ),
    ("header-profile-handler", "{}"),
    ("data-parallel-profile-handler", "{primaryPort: 8200}"),
    ("pd-profile-handler", "{threshold: 100}"),
];

#[test]
fn one_config_names_every_llm_d_type() {
    // One prefix producer per config (this build refuses two producing the same match): the
    // approximate one, then the precise one.
    for without in [
        "precise-prefix-cache-producer",
        "approx-prefix-cache-producer",
    ] {
        let mut plugins = String::new();
        for t in LLMD_TYPES.iter().filter(|t| **t != without) {
            let params = match *t {
                "session-affinity-scorer" | "session-affinity-filter" => {
                    "{strategy: session_id, sessionIdConfig: {sources: [{attribute: session-id, producer: session-id-producer}]}}"
                }
                "session-id-producer" => "{headerName: x-session-id}",
                "utilization-filter" => "{conditions: [{metric: waiting-queue, maxValue: 100}]}",
                "priority-holdback-policy" => "{minCeiling: 0.5}",
                _ => "{}",
            };
            plugins.push_str(&format!("- {{type: {t}, parameters: {params}}}\n"));
        }
        // The deprecated names, each loading as its replacement.
        plugins.push_str(
            "- {type: by-label-selector, parameters: {matchLabels: {tier: gold}}}\n\
             - {type: by-label, parameters: {label: llm-d.ai/role, validValues: [decode], allowsNoLabel: true}}\n\
             - {type: prefill-header-handler}\n- {type: disagg-headers-handler}\n",
        );
        for (handler, params) in LLMD_HANDLERS {
            let profiles = match *handler {
                "disagg-profile-handler" | "pd-profile-handler" => {
                    "- name: decode\n  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]\n\
                     - name: prefill\n  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]\n"
                }
                _ => {
                    "- name: decode\n  plugins: [{pluginRef: by-label}, {pluginRef: prefix-cache-scorer}, {pluginRef: latency-scorer}, {pluginRef: mm-embeddings-cache-scorer}, {pluginRef: max-score-picker}]\n"
                }
            };
            let yaml = format!(
                "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n{plugins}\
                 - {{type: {handler}, parameters: {params}}}\nschedulingProfiles:\n{profiles}"
            );
            let built = load(&yaml).unwrap_or_else(|e| panic!("{handler} without {without}: {e}"));
            assert_eq!(
                built.scheduler.rank_port,
                matches!(*handler, "data-parallel-profile-handler").then_some(8200),
                "{handler}"
            );
        }
    }
}

#[test]
fn deprecated_label_filters_keep_llm_ds_meaning() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: by-label, parameters: {label: tier, validValues: [gold, silver]}}\n- type: queue-scorer\n",
    )
    .unwrap();
    let cs = vec![
        crate::datalayer::testutil::cand_at(
            "a",
            "10.0.0.1:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("tier", "gold")],
        ),
        crate::datalayer::testutil::cand_at(
            "b",
            "10.0.0.2:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("tier", "bronze")],
        ),
        crate::datalayer::testutil::cand_at(
            "c",
            "10.0.0.3:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[],
        ),
    ];
    let r = req();
    let mut rng = rand::rng();
    for _ in 0..20 {
        assert_eq!(
            b.scheduler.schedule(&r, &cs, &mut rng).unwrap().picked,
            vec![0]
        );
    }
    for (params, what) in [
        ("{validValues: [a]}", "label"),
        ("{label: tier}", "validValues"),
    ] {
        let e = load(&format!(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {{type: by-label, parameters: {params}}}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains(what), "{params}: {e}");
    }
    // by-label-selector is label-selector-filter under its old name.
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: by-label-selector, parameters: {matchLabels: {tier: bronze}}}\n- type: queue-scorer\n",
    )
    .unwrap();
    assert_eq!(
        b.scheduler.schedule(&r, &cs, &mut rng).unwrap().picked,
        vec![1]
    );
}

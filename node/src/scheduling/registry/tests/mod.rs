//! The registry's builds, and the schedulers they make, run end to end on candidates.

use super::*;
use crate::config::EndpointPickerConfig;
use crate::scheduling::SchedError;
use crate::scheduling::scheduler::Decision;
use crate::scheduling::testutil::*;

mod compat;
mod pd;

pub(super) fn load(yaml: &str) -> Result<Built, ConfigError> {
    build(&EndpointPickerConfig::from_yaml(yaml)?)
}

const SAMPLE: &str = r#"
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- name: picker
  type: max-score-picker
  parameters:
    maxNumOfEndpoints: 2
- type: single-profile-handler
- type: metrics-data-source
  parameters: {path: /metrics, interval: 50ms}
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"#;

#[test]
fn sample_config_loads() {
    let b = load(SAMPLE).unwrap();
    let p = b.scheduler.primary();
    assert_eq!(p.scorers.len(), 2);
    assert_eq!(p.scorers[0].weight, 2.0);
    assert_eq!(p.scorers[1].weight, 1.0);
    assert_eq!(p.picker.type_name(), "max-score-picker");
    assert_eq!(b.metrics_source.interval.as_deref(), Some("50ms"));
}

#[test]
fn defaults_injected_without_profiles() {
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n").unwrap();
    let p = b.scheduler.primary();
    assert_eq!(p.name, "default");
    assert_eq!(p.scorers.len(), 1);
    assert_eq!(p.scorers[0].weight, 1.0);
    assert_eq!(p.picker.type_name(), "max-score-picker");
}

#[test]
fn llm_d_default_builds() {
    let b = build(&EndpointPickerConfig::llm_d_default().unwrap()).unwrap();
    let p = b.scheduler.primary();
    let weights: Vec<_> = p
        .scorers
        .iter()
        .map(|s| (s.scorer.type_name(), s.weight))
        .collect();
    assert_eq!(
        weights,
        vec![
            ("queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", 2.0),
            ("prefix-cache-scorer", 3.0)
        ]
    );
    // the prefix scorer's producer was injected
    let producers: Vec<_> = b
        .scheduler
        .producers
        .iter()
        .map(|p| p.type_name())
        .collect();
    assert_eq!(producers, vec!["approx-prefix-cache-producer"]);
    assert!(b.inflight.is_none());
}

#[test]
fn builtin_default_is_the_cost_model() {
    let b = build(&EndpointPickerConfig::builtin_default().unwrap()).unwrap();
    let p = b.scheduler.primary();
    let scorers: Vec<_> = p
        .scorers
        .iter()
        .map(|s| (s.scorer.type_name(), s.weight))
        .collect();
    assert_eq!(scorers, vec![("cost-model-scorer", 1.0)]);
    assert_eq!(p.picker.type_name(), "max-score-picker");
    // Its producers were injected, in the order it needs them.
    let producers: Vec<_> = b
        .scheduler
        .producers
        .iter()
        .map(|p| p.type_name())
        .collect();
    assert_eq!(
        producers,
        vec![
            "approx-prefix-cache-producer",
            "inflight-load-producer",
            "cost-model-producer"
        ]
    );
    assert!(b.inflight.is_some() && b.scheduler.cost_model.is_some());
}

/// Eight requests sharing a 2k-token prompt, routed at once (no response yet) to four idle pods:
/// the default profile spreads them two a pod, and it knows why — the pods that got one have not
/// computed the prompt's blocks yet: their match is pending. Once the first request's response
/// starts, its pod holds the prompt and the next request goes there.
#[test]
fn the_default_profile_spreads_a_burst_sharing_a_prompt() {
    let b = build(&EndpointPickerConfig::builtin_default().unwrap()).unwrap();
    let s = &b.scheduler;
    let cs: Vec<_> = (1..=4)
        .map(|i| {
            cand_at(
                &format!("p{i}"),
                &format!("10.0.0.{i}:8000"),
                metrics(0.0, 0.0, 0.0),
                false,
                &[],
            )
        })
        .collect();
    let text: Vec<u8> = (0..8192u32).map(|i| b'a' + (i % 23) as u8).collect();
    let prompt = crate::request::parse::Prompt::Text(text);
    let ids: Vec<String> = (0..9).map(|i| format!("burst-{i}")).collect();
    let mut per_pod = [0; 4];
    let mut first_pod = None;
    for id in &ids[..8] {
        let mut r = req();
        r.prompt = &prompt;
        r.request_id = id;
        let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
        // Every match this request sees is an earlier one's prefill still under way.
        let matched = &d.data.prefix.as_ref().unwrap().matched;
        assert_eq!(&d.data.pending, matched, "{id}");
        assert_eq!(d.data.prefill_tokens(d.picked[0]), 2048);
        s.pre_request(&r, &d, &cs);
        per_pod[d.picked[0]] += 1;
        first_pod.get_or_insert(d.picked[0]);
    }
    assert_eq!(per_pod, [2, 2, 2, 2], "the burst herded");
    assert_eq!(
        b.inflight.as_ref().unwrap().load("10.0.0.1:8000").tokens,
        2 * 2048
    );
    // The first request's response starts: its pod holds the prompt now.
    let tracker = b.inflight.as_ref().unwrap();
    tracker.release_tokens(&ids[0]);
    let mut r = req();
    r.prompt = &prompt;
    r.request_id = &ids[8];
    let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!(Some(d.picked[0]), first_pod, "{:?}", d.data.predicted);
    assert_eq!(d.data.pending[d.picked[0]], 0);
}

/// `header-profile-handler`: the header (its name in any case) names the profile, the default
/// profile runs without it, an unknown name is refused, and a single profile ignores it.
#[test]
fn the_header_profile_handler_runs_the_profile_the_request_names() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: header-profile-handler, parameters: {headerName: X-Profile, defaultProfile: small}}\n\
         - {name: small-pods, type: label-selector-filter, parameters: {matchLabels: {size: small}}}\n\
         - {name: big-pods, type: label-selector-filter, parameters: {matchLabels: {size: big}}}\n\
         - type: queue-scorer\n\
         schedulingProfiles:\n\
         - {name: small, plugins: [{pluginRef: small-pods}, {pluginRef: queue-scorer}]}\n\
         - {name: big, plugins: [{pluginRef: big-pods}, {pluginRef: queue-scorer}]}\n",
    )
    .unwrap();
    let s = &b.scheduler;
    let cs = vec![
        cand_at(
            "s",
            "10.0.0.1:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("size", "small")],
        ),
        cand_at(
            "b",
            "10.0.0.2:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("size", "big")],
        ),
    ];
    let pick = |headers: &[(&str, &str)]| {
        let h: std::collections::HashMap<String, String> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut r = req();
        r.headers = &h;
        s.schedule(&r, &cs, &mut rand::rng()).map(|d| d.picked[0])
    };
    assert_eq!(pick(&[]), Ok(0));
    assert_eq!(pick(&[("x-profile", " big ")]), Ok(1));
    assert_eq!(pick(&[("x-profile", "")]), Ok(0));
    assert_eq!(
        pick(&[("x-profile", "huge")]),
        Err(SchedError::NoProfile("huge".into()))
    );
    assert_eq!(s.primary().name, "small");
    // The header is a control header (removed before the pod; a tenant's is ignored), beside
    // the SLO headers.
    let control: Vec<&str> = s.control_headers().collect();
    for h in ["x-profile", "x-llm-d-slo-ttft-ms", "x-slo-tpot-ms"] {
        assert!(control.contains(&h), "{h}: {control:?}");
    }

    // One profile: whatever the header says.
    let one = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - type: header-profile-handler\n- type: queue-scorer\n",
    )
    .unwrap();
    let h = std::collections::HashMap::from([("epp-profile".to_string(), "nope".to_string())]);
    let mut r = req();
    r.headers = &h;
    assert!(one.scheduler.schedule(&r, &cs, &mut rand::rng()).is_ok());
    let e = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: header-profile-handler, parameters: {headerName: ' '}}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("headerName"), "{e}");
}

#[test]
fn affinity_filter_on_the_cost_model_injects_it() {
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: prefix-cache-affinity-filter, parameters: {ttftSource: costModel}}\n- type: queue-scorer\n").unwrap();
    assert!(b.scheduler.cost_model.is_some());
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: prefix-cache-affinity-filter, parameters: {ttftSource: oracle}}\n").unwrap_err().to_string();
    assert!(e.contains("ttftSource") && e.contains("costModel"), "{e}");
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: cost-model-producer, parameters: {prefillTokensPerSecond: 0}}\n").unwrap_err().to_string();
    assert!(e.contains("prefillTokensPerSecond"), "{e}");
}

#[test]
fn unknown_plugin_type_named() {
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: fancy-scorer\n").unwrap_err().to_string();
    assert!(
        e.contains("fancy-scorer") && e.contains("unknown plugin type"),
        "{e}"
    );
    assert!(e.contains("plugins[0]"), "{e}");
}

#[test]
fn llm_ds_load_aware_and_no_hit_lru_scorers_load() {
    // The shape of llm-d's inference-scheduling guide: the no-hit LRU scorer brings the prefix
    // producer it reads and records cold requests' picks.
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - type: queue-scorer\n- type: kv-cache-utilization-scorer\n- type: prefix-cache-scorer\n\
         - type: no-hit-lru-scorer\n  parameters: {lruSize: 64, prefillProfile: prefill}\n\
         - type: load-aware-scorer\n  parameters: {threshold: 10}\n\
         schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n    weight: 2\n\
         \x20 - pluginRef: kv-cache-utilization-scorer\n    weight: 2\n\
         \x20 - pluginRef: prefix-cache-scorer\n    weight: 3\n\
         \x20 - pluginRef: no-hit-lru-scorer\n    weight: 2\n\
         \x20 - pluginRef: load-aware-scorer\n",
    )
    .unwrap();
    assert!(
        b.summary
            .contains("producers=[approx-prefix-cache-producer, no-hit-lru-scorer]"),
        "{}",
        b.summary
    );
    assert!(
        b.summary.contains("no-hit-lru-scorer(no-hit-lru-scorer)*2")
            && b.summary.contains("load-aware-scorer(load-aware-scorer)*1"),
        "{}",
        b.summary
    );
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: load-aware-scorer\n  parameters: {queueThreshold: 3}\n").unwrap_err().to_string();
    assert!(e.contains("queueThreshold"), "{e}");
}

#[test]
fn unknown_parameter_named() {
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoint: 2}\n").unwrap_err().to_string();
    assert!(
        e.contains("plugins[0].parameters") && e.contains("maxNumOfEndpoint"),
        "{e}"
    );
}

#[test]
fn bad_profile_ref() {
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: x\n  plugins: [{pluginRef: nope}]\n").unwrap_err().to_string();
    assert!(
        e.contains("schedulingProfiles[0].plugins[0].pluginRef"),
        "{e}"
    );
}

#[test]
fn flow_control_gate_builds_the_controller_config() {
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\nplugins:\n- {name: rr, type: round-robin-fairness-policy}\n- {name: conc, type: concurrency-detector, parameters: {maxConcurrency: 4}}\nflowControl:\n  maxRequests: 1k\n  defaultRequestTTL: 30s\n  priorityBands: [{priority: 10, fairnessPolicyRef: rr}, {priority: -1}]\n  saturationDetector: {pluginRef: conc}\n").unwrap();
    let AdmissionConfig::FlowControl(c) = b.admission else {
        panic!("gate on must build flow control")
    };
    assert_eq!(
        (c.max_requests, c.default_request_ttl),
        (1000, 30_000_000_000)
    );
    assert_eq!(c.bands.len(), 2);
    assert_eq!(
        c.bands[0].settings.fairness,
        flowctl::FairnessPolicy::RoundRobin
    );
    assert!(
        b.summary
            .contains("flow-control(bands=[10,-1] detector=concurrency-detector"),
        "{}",
        b.summary
    );
    // Bad references and parameters are named by path.
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\nflowControl:\n  priorityBands: [{priority: 1, fairnessPolicyRef: nope}]\n").unwrap_err().to_string();
    assert!(
        e.contains("flowControl.priorityBands[0].fairnessPolicyRef"),
        "{e}"
    );
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: utilization-detector, parameters: {queueDepthThreshhold: 3}}\n").unwrap_err().to_string();
    assert!(
        e.contains("plugins[0].parameters.queueDepthThreshhold"),
        "{e}"
    );
}

#[test]
fn gate_off_uses_the_legacy_controller_with_the_configured_detector() {
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {name: u, type: utilization-detector, parameters: {queueDepthThreshold: 3}}\nflowControl:\n  saturationDetector: {pluginRef: u}\n").unwrap();
    let AdmissionConfig::Legacy(flowctl::SaturationDetector::Utilization(d)) = b.admission else {
        panic!("gate off must build the legacy controller")
    };
    assert_eq!(d.queue_depth_threshold, 3.0);
    // The deprecated top-level location still works.
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {name: c, type: concurrency-detector}\nsaturationDetector: {pluginRef: c}\n").unwrap();
    assert!(matches!(
        b.admission,
        AdmissionConfig::Legacy(flowctl::SaturationDetector::Concurrency(_))
    ));
}

/// llm-d's default profile on four pods: queue ×2 + kv-cache ×2 + prefix ×3, summed.
#[test]
fn four_pod_weighted_sum() {
    let built = crate::scheduling::build(&EndpointPickerConfig::llm_d_default().unwrap()).unwrap();
    let s = &built.scheduler;
    let cs = vec![
        cand_at("a", "10.0.0.1:8000", metrics(0.0, 1.0, 0.5), false, &[]),
        cand_at("b", "10.0.0.2:8000", metrics(2.0, 1.0, 0.25), false, &[]),
        cand_at("c", "10.0.0.3:8000", metrics(4.0, 1.0, 0.0), false, &[]),
        cand_at("d", "10.0.0.4:8000", None, false, &[]),
    ];
    // 1024 bytes = 256 estimate tokens = 4 blocks of 64; route it once to c so c holds it.
    let text: Vec<u8> = (0..1024u32).map(|i| b'a' + (i % 23) as u8).collect();
    let prompt = crate::request::parse::Prompt::Text(text);
    let mut r = req();
    r.prompt = &prompt;
    let mut rng = rand::rng();
    let first = s.schedule(&r, &cs, &mut rng).unwrap();
    s.pre_request(
        &r,
        &Decision {
            picked: vec![2],
            ..first
        },
        &cs,
    );

    let d = s.schedule(&r, &cs, &mut rng).unwrap();
    // queue: (4-q)/4 → a 1, b 0.5, c 0, d 0 (no metrics)
    // kv:    1-u      → a 0.5, b 0.75, c 1, d 0
    // prefix: matched/total → c 4/4, others 0
    let want = [
        2.0 * 1.0 + 2.0 * 0.5,
        2.0 * 0.5 + 2.0 * 0.75,
        2.0 * 0.0 + 2.0 * 1.0 + 3.0 * 1.0,
        0.0,
    ];
    for (got, want) in d.scores.iter().zip(want) {
        assert!((got - want).abs() < 1e-9, "{:?} vs {want:?}", d.scores);
    }
    assert_eq!(d.picked, vec![2]);
    assert_eq!(d.data.prompt_tokens, 256);
}

/// Session plugins the profiles use record decisions and write their token back; an
/// instance no profile uses does neither.
#[test]
fn session_plugins_in_profiles_write_tokens() {
    let cfg = EndpointPickerConfig::from_yaml(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- {name: unused, type: session-affinity-filter, parameters: {strategy: session_id}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-scorer, weight: 5}, {pluginRef: queue-scorer}]
",
    )
    .unwrap();
    let s = crate::scheduling::build(&cfg).unwrap().scheduler;
    assert_eq!(s.sessions.len(), 1);
    let cs = vec![
        cand("a", metrics(0.0, 0.0, 0.0), false),
        cand("b", metrics(3.0, 0.0, 0.0), false),
    ];
    let headers: std::collections::HashMap<String, String> = [(
        "x-session-token".to_string(),
        crate::scheduling::session::encode_token("b"),
    )]
    .into_iter()
    .collect();
    let mut r = req();
    r.headers = &headers;
    // b scores 5 (its session) plus its queue score, the idle a at most 1: b wins.
    let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!(d.picked, vec![1], "{:?}", d.scores);
    assert_eq!(
        s.session_tokens(&d, &cs),
        vec![(
            "x-session-token".to_string(),
            crate::scheduling::session::encode_token("b")
        )]
    );
}

/// `mm-embeddings-cache-scorer` alone: its producer is injected, and a request whose image a pod
/// encoded before goes to that pod although the other is less loaded.
#[test]
fn the_encoder_cache_scorer_brings_an_image_back_to_its_pod() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: mm-embeddings-cache-scorer, parameters: {producerName: mm-embeddings-cache-producer}}\n\
         - type: queue-scorer\n\
         schedulingProfiles:\n\
         - {name: default, plugins: [{pluginRef: mm-embeddings-cache-scorer, weight: 2}, {pluginRef: queue-scorer}]}\n",
    )
    .unwrap();
    let s = &b.scheduler;
    assert!(
        s.producers
            .iter()
            .any(|p| p.type_name() == "mm-embeddings-cache-producer")
    );
    let cs = vec![
        cand_at("a", "10.0.0.1:8000", metrics(1.0, 0.0, 0.0), false, &[]),
        cand_at("b", "10.0.0.2:8000", metrics(0.0, 0.0, 0.0), false, &[]),
    ];
    let mut r = req();
    r.media = &[42];
    let first = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!(first.picked, vec![1], "b is idle");
    // Route it to a instead (as a fallback would): a now holds the image.
    s.pre_request(
        &r,
        &Decision {
            picked: vec![0],
            ..first
        },
        &cs,
    );
    let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!(d.picked, vec![0], "{:?}", d.scores);
    assert_eq!(d.data.media_matched, vec![1, 0]);
    // Another image: the queue decides.
    r.media = &[43];
    assert_eq!(
        s.schedule(&r, &cs, &mut rand::rng()).unwrap().picked,
        vec![1]
    );
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: mm-embeddings-cache-producer, parameters: {cacheSize: 1}}\n").unwrap_err().to_string();
    assert!(e.contains("cacheSize"), "{e}");
}

/// a: 9 requests waiting beside 8 running, in two scrapes in a row (a real queue); b: nearly idle.
fn queue_on_a() -> Vec<crate::datalayer::store::Candidate> {
    vec![
        scraped_twice(cand_at(
            "a",
            "10.0.0.1:8000",
            metrics(9.0, 8.0, 0.5),
            false,
            &[],
        )),
        cand_at("b", "10.0.0.2:8000", metrics(0.0, 1.0, 0.5), false, &[]),
    ]
}

/// llm-d's latency plugins on the cost model: the scorer sends a request to the pod predicted to
/// meet its TTFT SLO; the admitter turns away a sheddable request no busy pod can serve in time;
/// `ttftSource: latencyPredictor` reads the same predictions.
#[test]
fn the_latency_plugins_route_by_slo_headroom() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n\
         - {type: predicted-latency-producer, parameters: {sloBufferFactor: 1.2, streamingMode: true, contextTTL: 5m}}\n\
         - {type: prefix-cache-affinity-filter, parameters: {ttftSource: latencyPredictor, maxTTFTPenaltyMs: 5000}}\n\
         - {type: latency-scorer, parameters: {headroomSelectionStrategy: least}}\n\
         - type: latency-slo-admitter\n",
    )
    .unwrap();
    let s = &b.scheduler;
    let producers: Vec<_> = s.producers.iter().map(|p| p.type_name()).collect();
    assert_eq!(
        producers,
        vec![
            "approx-prefix-cache-producer",
            "inflight-load-producer",
            "cost-model-producer",
            "predicted-latency-producer"
        ]
    );
    // a: 9 waiting beside 8 running (1.25 s of queue at the prior's 1 s slot); b: nearly idle.
    let cs = queue_on_a();
    let text: Vec<u8> = (0..1024u32).map(|i| b'a' + (i % 23) as u8).collect();
    let prompt = crate::request::parse::Prompt::Text(text);
    let slo = |ms: &str| {
        std::collections::HashMap::from([("x-llm-d-slo-ttft-ms".to_string(), ms.to_string())])
    };
    let h = slo("200");
    let mut r = req();
    r.prompt = &prompt;
    r.headers = &h;
    let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!(d.picked, vec![1], "{:?}", d.data.latency);
    assert!(!d.data.latency[0].ttft_valid && d.data.latency[1].ttft_valid);
    assert!(d.data.latency[1].ttft_headroom > 0.0);
    // No TPOT learned yet: valid, no headroom.
    assert_eq!(
        (d.data.latency[1].tpot_ms, d.data.latency[1].tpot_valid),
        (None, true)
    );
    // A sheddable request with a TTFT SLO neither pod meets: refused; with priority 0, routed.
    let h = slo("1");
    r.headers = &h;
    r.priority = -1;
    assert_eq!(
        s.schedule(&r, &cs, &mut rand::rng()).unwrap_err(),
        SchedError::NotAdmitted("latency-slo-admitter")
    );
    r.priority = 0;
    assert!(s.schedule(&r, &cs, &mut rand::rng()).is_ok());
    for (params, key) in [
        ("{sloBufferFactor: 0}", "sloBufferFactor"),
        ("{contextTTL: soon}", "contextTTL"),
    ] {
        let e = load(&format!("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {{type: predicted-latency-producer, parameters: {params}}}\n")).unwrap_err().to_string();
        assert!(e.contains(key), "{e}");
    }
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: latency-scorer, parameters: {headroomSelectionStrategy: random}}\n").unwrap_err().to_string();
    assert!(e.contains("least") && e.contains("most"), "{e}");
}

/// llm-d's Helm chart configuration with its latency predictor enabled (v0.10
/// `routerlib/_config.yaml`), verbatim: it loads — a producer named in the profile included —
/// and routes on the cost model's predictions.
#[test]
fn llm_ds_latency_predictor_chart_config_loads_and_routes() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters: {scheme: http, path: /metrics, insecureSkipVerify: true}
- type: core-metrics-extractor
- type: predicted-latency-producer
- name: strict-affinity-filter
  type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.99, ttftSource: latencyPredictor, maxTTFTPenaltyMs: 5000}
- name: loose-affinity-filter
  type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.80, ttftSource: latencyPredictor, maxTTFTPenaltyMs: 5000}
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-producer
  - pluginRef: strict-affinity-filter
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: loose-affinity-filter
  - pluginRef: latency-scorer
  - pluginRef: weighted-random-picker
",
    )
    .unwrap();
    let s = &b.scheduler;
    let filters: Vec<_> = s.primary().filters.iter().map(|f| f.type_name()).collect();
    assert_eq!(
        filters,
        vec![
            "prefix-cache-affinity-filter",
            "slo-headroom-tier-filter",
            "prefix-cache-affinity-filter"
        ]
    );
    assert_eq!(s.admitters.len(), 1);
    // A long queue on a: only b meets a 200 ms TTFT SLO, so the tier filter keeps b alone.
    let cs = queue_on_a();
    let h =
        std::collections::HashMap::from([("x-llm-d-slo-ttft-ms".to_string(), "200".to_string())]);
    let mut r = req();
    r.headers = &h;
    let to_b = (0..100)
        .filter(|_| s.schedule(&r, &cs, &mut rand::rng()).unwrap().picked[0] == 1)
        .count();
    // The tier filter explores the missing tier 1% of the time: a appears rarely (P(a ≥ 10 of
    // 100) < 10⁻¹²).
    assert!(to_b > 90, "{to_b} of 100 to b");
}

#[test]
fn filters_that_empty_the_set_are_429_and_no_candidates_503() {
    let cfg = EndpointPickerConfig::from_yaml(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: prefill-filter\n- type: queue-scorer\n",
    )
    .unwrap();
    let s = crate::scheduling::build(&cfg).unwrap().scheduler;
    let cs = vec![cand("a", metrics(0.0, 0.0, 0.0), false)];
    let mut rng = rand::rng();
    assert_eq!(
        s.schedule(&req(), &cs, &mut rng).unwrap_err(),
        SchedError::AllFiltered
    );
    assert_eq!(
        s.schedule(&req(), &[], &mut rng).unwrap_err(),
        SchedError::NoCandidates
    );
}

#[test]
fn the_precise_producer_replaces_the_approximate_one_and_brings_engine_tokens() {
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {type: precise-prefix-cache-producer, parameters: {tokenProcessorConfig: {blockSize: 16}}}\n- type: prefix-cache-scorer\n- type: queue-scorer\n").unwrap();
    let producers: Vec<_> = b
        .scheduler
        .producers
        .iter()
        .map(|p| p.type_name())
        .collect();
    assert_eq!(producers, vec!["precise-prefix-cache-producer"]);
    assert!(b.scheduler.precise.is_some() && b.scheduler.prefix_index.is_none());
    // No token producer configured: the render backend on the pods, 1 s.
    let render = |b: Built| match b.render {
        Some(crate::request::tokens::TokenBackend::Render(r)) => r,
        other => panic!("{other:?}"),
    };
    let r = render(b);
    assert_eq!(
        (r.url, r.timeout),
        (None, std::time::Duration::from_secs(1))
    );
    // A configured render server is used as given.
    let b = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: precise-prefix-cache-producer\n- {type: token-producer, parameters: {backend: vllm_http, renderUrl: 'http://render:8000', timeout: 300ms}}\n- type: prefix-cache-scorer\n").unwrap();
    assert_eq!(render(b).url.as_deref(), Some("http://render:8000"));
    // Two producers of the prefix match: refused.
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: precise-prefix-cache-producer\n- type: approx-prefix-cache-producer\n- type: prefix-cache-scorer\n").unwrap_err();
    assert!(e.to_string().contains("configure one"), "{e}");
}

/// `agent-identity` with `additionalSessionHeaders`: the operator's header is the agent session
/// (flow control's fairness id) and the session-affinity plugins' `agent-identity` source.
/// `session-id-producer`: the session id in a cookie binds the conversation (a `session-id`
/// source naming the producer); a source naming no such producer is refused, and so are
/// parameters that set both or neither of header and cookie.
#[test]
fn a_session_id_from_a_cookie_binds_the_session() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {name: sid, type: session-id-producer, parameters: {cookieName: conv}}
- type: session-affinity-filter
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{attribute: session-id, producer: sid}]}}
- type: queue-scorer
",
    )
    .unwrap();
    let s = b.scheduler;
    let with_cookie =
        |c: &str| std::collections::HashMap::from([("cookie".to_string(), c.to_string())]);
    let idle_b = vec![
        cand("a", metrics(3.0, 0.0, 0.0), false),
        cand("b", metrics(0.0, 0.0, 0.0), false),
    ];
    let busy_b = vec![
        cand("a", metrics(0.0, 0.0, 0.0), false),
        cand("b", metrics(9.0, 0.0, 0.0), false),
    ];
    let h = with_cookie("theme=dark; conv=c-42 ;x=1");
    let mut r = req();
    r.headers = &h;
    let d = s.schedule(&r, &idle_b, &mut rand::rng()).unwrap();
    assert_eq!(d.picked, vec![1]);
    s.pre_request(&r, &d, &idle_b);
    // Bound to b: kept there although b is busy now.
    assert_eq!(
        s.schedule(&r, &busy_b, &mut rand::rng()).unwrap().picked,
        vec![1]
    );
    // Another conversation, or a cookie of another name, is not bound.
    for other in ["conv=c-43", "xconv=c-42", "conv="] {
        let h = with_cookie(other);
        let mut r = req();
        r.headers = &h;
        assert_eq!(
            s.schedule(&r, &busy_b, &mut rand::rng()).unwrap().picked,
            vec![0],
            "{other}"
        );
    }
    let e = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{attribute: session-id}]}}
",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("session-id-producer"), "{e}");
    for params in ["{}", "{headerName: a, cookieName: b}", "{headerName: ' '}"] {
        let e = load(&format!(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- {{type: session-id-producer, parameters: {params}}}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("exactly one of headerName or cookieName"),
            "{params}: {e}"
        );
    }
}

#[test]
fn agent_identity_headers_reach_fairness_and_session_affinity() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: agent-identity
  parameters: {additionalSessionHeaders: [X-Conversation]}
- type: session-affinity-filter
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{attribute: agent-identity}]}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-filter}, {pluginRef: queue-scorer}]
",
    )
    .unwrap();
    let headers: std::collections::HashMap<String, String> =
        [("x-conversation".to_string(), "conv-1".to_string())]
            .into_iter()
            .collect();
    assert_eq!(b.agent.session(&headers), Some("conv-1"));
    let s = b.scheduler;
    let mut r = req();
    r.headers = &headers;
    // The first turn goes to the idle pod b and binds the conversation there; when b's queue
    // grows, the filter still keeps only b.
    let idle_b = vec![
        cand("a", metrics(3.0, 0.0, 0.0), false),
        cand("b", metrics(0.0, 0.0, 0.0), false),
    ];
    let d = s.schedule(&r, &idle_b, &mut rand::rng()).unwrap();
    assert_eq!(d.picked, vec![1]);
    s.pre_request(&r, &d, &idle_b);
    let busy_b = vec![
        cand("a", metrics(0.0, 0.0, 0.0), false),
        cand("b", metrics(9.0, 0.0, 0.0), false),
    ];
    assert_eq!(
        s.schedule(&r, &busy_b, &mut rand::rng()).unwrap().picked,
        vec![1]
    );
    // Without the plugin, the header means nothing: the conversation is not bound.
    let plain = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
  parameters: {strategy: session_id, sessionIdConfig: {sources: [{attribute: agent-identity}]}}
- type: queue-scorer
",
    )
    .unwrap();
    assert_eq!(plain.agent.session(&headers), None);
    let s = plain.scheduler;
    let d = s.schedule(&r, &idle_b, &mut rand::rng()).unwrap();
    s.pre_request(&r, &d, &idle_b);
    assert_eq!(
        s.schedule(&r, &busy_b, &mut rand::rng()).unwrap().picked,
        vec![0]
    );
    // Bad header names and a second instance are refused.
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: agent-identity\n  parameters: {additionalSessionHeaders: ['a b']}\n").unwrap_err().to_string();
    assert!(e.contains("additionalSessionHeaders[0]"), "{e}");
    let e = load("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: agent-identity\n- {name: again, type: agent-identity}\n").unwrap_err().to_string();
    assert!(e.contains("more than one"), "{e}");
}

/// `probabilistic-admitter`: loads with llm-d's parameters, refuses bad ones, and sheds only
/// sheddable requests — at full saturation every one, answered as `NotAdmitted`.
#[test]
fn probabilistic_admitter_sheds_sheddable_requests() {
    let b = load(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: probabilistic-admitter
  parameters: {queueDepthThreshold: 4, power: 3, k: 100}
- type: random-picker
- type: utilization-detector
  parameters: {queueDepthThreshold: 999999999, kvCacheUtilThreshold: 1.0}
saturationDetector:
  pluginRef: utilization-detector
",
    )
    .unwrap();
    assert!(
        b.summary.contains("admitters=[probabilistic-admitter]"),
        "{}",
        b.summary
    );
    let s = b.scheduler;
    let full = vec![cand("a", metrics(4.0, 0.0, 0.0), false)];
    let mut r = req();
    r.priority = -1;
    assert_eq!(
        s.schedule(&r, &full, &mut rand::rng()).unwrap_err(),
        SchedError::NotAdmitted("probabilistic-admitter")
    );
    r.priority = 0;
    assert_eq!(
        s.schedule(&r, &full, &mut rand::rng()).unwrap().picked,
        vec![0]
    );
    let idle = vec![cand("a", metrics(0.0, 0.0, 0.0), false)];
    r.priority = -1;
    assert!(s.schedule(&r, &idle, &mut rand::rng()).is_ok());
    for bad in [
        "{power: 0}",
        "{k: -1}",
        "{kvCacheUtilThreshold: 1.5}",
        "{shed: 1}",
    ] {
        let e = load(&format!(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: probabilistic-admitter\n  parameters: {bad}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("plugins[0].parameters"), "{bad}: {e}");
    }
}

/// llm-d's flow-control plugin types all load: the soft-reflective ceiling as the usage limit,
/// and the eviction filter and order (the eviction built in).
#[test]
fn llm_ds_ceiling_and_eviction_plugins_load() {
    let yaml = "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- {name: soft, type: soft-reflective-ceiling-policy}
- type: sheddable-eviction-filter
- type: priority-then-time-eviction-order-policy
- type: queue-scorer
flowControl:
  usageLimitPolicyPluginRef: soft
  enableEviction: true
";
    let b = load(yaml).unwrap();
    match &b.admission {
        crate::request::admission::AdmissionConfig::FlowControl(c) => {
            assert_eq!(c.usage_limit, flowctl::UsageLimit::SoftReflective);
            assert!(c.eviction.enabled);
        }
        other => panic!("{other:?}"),
    }
    let e = load(&yaml.replace(
        "{name: soft, type: soft-reflective-ceiling-policy}",
        "{name: soft, type: soft-reflective-ceiling-policy, parameters: {threshold: 0.5}}",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("threshold"), "{e}");
}

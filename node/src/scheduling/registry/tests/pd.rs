//! Disaggregated prefill/decode: the deciders, llm-d's deprecated P/D handler and the errors of
//! a P/D config, run on a pool of labelled pods.

use crate::config::EndpointPickerConfig;
use crate::datalayer::store::Candidate;
use crate::scheduling::testutil::*;

const PD_CONFIG: &str = "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: decode-filter
- type: prefill-filter
- type: prefix-cache-scorer
- type: queue-scorer
- {name: pd, type: prefix-based-pd-decider, parameters: {nonCachedTokens: 100}}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: pd}}}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 2}, {pluginRef: queue-scorer}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]
";

fn pd_pods() -> Vec<Candidate> {
    vec![
        cand_at(
            "d1",
            "10.0.0.1:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("llm-d.ai/role", "decode")],
        ),
        cand_at(
            "d2",
            "10.0.0.2:8000",
            metrics(1.0, 0.0, 0.0),
            false,
            &[("llm-d.ai/role", "decode")],
        ),
        cand_at(
            "p1",
            "10.0.0.3:8000",
            metrics(2.0, 0.0, 0.0),
            false,
            &[("llm-d.ai/role", "prefill")],
        ),
        cand_at(
            "p2",
            "10.0.0.4:8000",
            metrics(0.0, 0.0, 0.0),
            false,
            &[("llm-d.ai/role", "prefill")],
        ),
    ]
}

/// `always-disagg-multimodal-decider` as the prefill decider: a request with an image is
/// prefilled on a prefill pod; a text-only one stays decode-only however uncached it is.
#[test]
fn the_multimodal_decider_splits_only_requests_with_media() {
    let cfg = EndpointPickerConfig::from_yaml(&PD_CONFIG.replace(
        "{name: pd, type: prefix-based-pd-decider, parameters: {nonCachedTokens: 100}}",
        "{name: pd, type: always-disagg-multimodal-decider}",
    ))
    .unwrap();
    let s = crate::scheduling::build(&cfg).unwrap().scheduler;
    let cs = pd_pods();
    let text: Vec<u8> = (0..2048u32).map(|i| b'a' + (i % 19) as u8).collect();
    let prompt = crate::request::parse::Prompt::Text(text);
    let mut r = req();
    r.prompt = &prompt;
    assert_eq!(s.schedule(&r, &cs, &mut rand::rng()).unwrap().prefill, None);
    r.media = &[7];
    let d = s.schedule(&r, &cs, &mut rand::rng()).unwrap();
    assert_eq!((d.picked[0], d.prefill), (0, Some(3)));
}

/// A long uncached prompt is prefilled on the least-queued prefill pod and decoded on a decode
/// pod; the same prompt again is cached on that decode pod and stays decode-only.
#[test]
fn prefix_based_pd_decider_splits_only_uncached_prompts() {
    let cfg = EndpointPickerConfig::from_yaml(PD_CONFIG).unwrap();
    let s = crate::scheduling::build(&cfg).unwrap().scheduler;
    let cs = pd_pods();
    // 2048 bytes = 512 estimate tokens, all uncached at first.
    let text: Vec<u8> = (0..2048u32).map(|i| b'a' + (i % 19) as u8).collect();
    let prompt = crate::request::parse::Prompt::Text(text);
    let mut r = req();
    r.prompt = &prompt;
    let mut rng = rand::rng();
    let first = s.schedule(&r, &cs, &mut rng).unwrap();
    assert_eq!(first.picked, vec![0], "decode: d1 has the shorter queue");
    assert_eq!(first.prefill, Some(3), "prefill: p2 has the shorter queue");
    s.pre_request(&r, &first, &cs);
    let again = s.schedule(&r, &cs, &mut rng).unwrap();
    assert_eq!(again.picked, vec![0]);
    assert_eq!(again.prefill, None, "cached on d1: decode-only");
    // A short prompt (below nonCachedTokens) never splits.
    let short = crate::request::parse::Prompt::Text(b"hello there".to_vec());
    r.prompt = &short;
    assert_eq!(s.schedule(&r, &cs, &mut rng).unwrap().prefill, None);
}

/// llm-d's deprecated P/D configuration, as deployed guides still write it: `pd-profile-handler`
/// with a character threshold and `prefill-header-handler`, loaded as the disaggregating handler
/// with the prefix-based decider at ⌈threshold / 4⌉ uncached tokens.
#[test]
fn deprecated_pd_profile_handler_loads_as_the_disagg_handler() {
    const OLD: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: pd-profile-handler
  parameters: {threshold: 400, hashBlockSize: 5}
- type: prefill-header-handler
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 2}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
";
    let built = crate::scheduling::build(&EndpointPickerConfig::from_yaml(OLD).unwrap()).unwrap();
    assert!(
        built
            .summary
            .contains("disagg-profile-handler decode: profile=decode")
            && built
                .summary
                .contains("prefill when prefix-based-pd-decider: profile=prefill"),
        "{}",
        built.summary
    );
    let s = built.scheduler;
    let cs = pd_pods();
    let mut rng = rand::rng();
    let mut r = req();
    // 2048 bytes = 512 estimate tokens, uncached: ≥ 100 → prefilled on p2, decoded on d1.
    let long =
        crate::request::parse::Prompt::Text((0..2048u32).map(|i| b'a' + (i % 19) as u8).collect());
    r.prompt = &long;
    let d = s.schedule(&r, &cs, &mut rng).unwrap();
    assert_eq!((d.picked.clone(), d.prefill), (vec![0], Some(3)));
    // 96 bytes = 24 tokens < 100: decode only.
    let short = crate::request::parse::Prompt::Text(vec![b'q'; 96]);
    r.prompt = &short;
    assert_eq!(s.schedule(&r, &cs, &mut rng).unwrap().prefill, None);

    // Threshold 0 (llm-d's default): every request is disaggregated; without a prefill profile,
    // decode only.
    let always = OLD.replace("{threshold: 400, hashBlockSize: 5}", "{}");
    let s = crate::scheduling::build(&EndpointPickerConfig::from_yaml(&always).unwrap())
        .unwrap()
        .scheduler;
    assert_eq!(s.schedule(&r, &cs, &mut rng).unwrap().prefill, Some(3));
    let decode_only = OLD.replace("- name: prefill\n", "- name: unused\n");
    let built =
        crate::scheduling::build(&EndpointPickerConfig::from_yaml(&decode_only).unwrap()).unwrap();
    assert!(
        built.summary.contains("no prefill decider"),
        "{}",
        built.summary
    );
    let newer = OLD.replace(
        "- type: prefill-header-handler\n",
        "- type: disagg-headers-handler\n  parameters: {prefillProfile: prefill}\n",
    );
    assert!(crate::scheduling::build(&EndpointPickerConfig::from_yaml(&newer).unwrap()).is_ok());
    // Data-parallel ranks behind a primary port, as llm-d's handler did.
    let dp = OLD.replace("{threshold: 400, hashBlockSize: 5}", "{primaryPort: 8200}");
    let built = crate::scheduling::build(&EndpointPickerConfig::from_yaml(&dp).unwrap()).unwrap();
    assert_eq!(built.scheduler.rank_port, Some(8200));
    // llm-d's own refusals, with their reason.
    for (params, what) in [
        ("{threshold: -1}", "threshold"),
        ("{hashBlockSize: 0}", "hashBlockSize"),
        ("{primaryPort: 70000}", "primaryPort"),
        ("{thresold: 3}", "thresold"),
    ] {
        let e = crate::scheduling::build(
            &EndpointPickerConfig::from_yaml(
                &OLD.replace("{threshold: 400, hashBlockSize: 5}", params),
            )
            .unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(what), "{params}: {e}");
    }
}

#[test]
fn disagg_config_errors_are_clear() {
    let e = crate::scheduling::build(
        &EndpointPickerConfig::from_yaml(&PD_CONFIG.replace("name: decode\n", "name: dec\n"))
            .unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("profiles.decode") && e.contains("`decode`"),
        "{e}"
    );
    let e = crate::scheduling::build(
        &EndpointPickerConfig::from_yaml(
            &PD_CONFIG.replace("prefill: pd}", "prefill: queue-scorer}"),
        )
        .unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("not a P/D decider"), "{e}");
}

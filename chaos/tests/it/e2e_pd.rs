//! End to end through Envoy: prefill/decode disaggregation with `deploy/examples/pd.yaml`.
//!
//! Two prefill-labelled and two decode-labelled simulated pods. A long prompt nobody has cached is
//! sent to a decode pod with `x-prefiller-host-port` naming a prefill pod; the same prompt again is
//! cached on that decode pod and goes decode-only; a short prompt never splits. The simulator echoes
//! the headers it received, so the test checks what the pods actually got.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::locate::workspace_root;
use serde_json::json;
use sim::SimConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_uncached_prompts_get_a_prefill_pod_cached_ones_do_not() {
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 4,
            prefill_pods: 2,
            decode_pods: 2,
            ..SimConfig::default()
        },
        epp_args: vec![
            "--config-file".into(),
            workspace_root()
                .join("deploy/examples/pd.yaml")
                .display()
                .to_string(),
        ],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    // Pods 0-1 are prefill, 2-3 decode (the simulator's labelling order).
    let addr: Vec<String> = c.sim.pods().iter().map(|p| p.addr.to_string()).collect();
    let (prefill, decode) = (&addr[..2], &addr[2..]);
    let client = reqwest::Client::new();
    let ask = |text: String| {
        let client = client.clone();
        let url = format!("{}/v1/chat/completions", c.envoy.url());
        async move {
            let r = client
                .post(url)
                .json(&json!({"model": "sim-model", "max_tokens": 4,
                              "messages": [{"role": "user", "content": text}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let h: HashMap<String, String> = r
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
                .collect();
            r.text().await.unwrap();
            (
                h["x-sim-received-destination"].clone(),
                h.get("x-sim-received-prefiller").cloned(),
            )
        }
    };
    let long: String = (0..1500).map(|i| format!("word{} ", i % 97)).collect();

    let (dest, prefiller) = ask(long.clone()).await;
    assert!(decode.contains(&dest), "decode pod expected, got {dest}");
    let prefiller = prefiller.expect("a long uncached prompt must be disaggregated");
    assert!(
        prefill.contains(&prefiller),
        "prefill pod expected, got {prefiller}"
    );

    let (again, prefiller) = ask(long).await;
    assert_eq!(again, dest, "the cached prompt goes back to its decode pod");
    assert_eq!(prefiller, None, "cached on the decode pod: decode-only");

    let (short_dest, prefiller) = ask("hello there".into()).await;
    assert!(decode.contains(&short_dest));
    assert_eq!(prefiller, None, "short prompts are never split");

    let m = c.epps[0].metrics().await.unwrap();
    assert!(
        m.contains("llm_d_epp_disagg_decision_total{decision_type=\"prefill-decode\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("llm_d_epp_disagg_decision_total{decision_type=\"decode-only\"} 2"),
        "{m}"
    );
    c.shutdown().await;
}

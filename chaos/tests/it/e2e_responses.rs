//! End to end through Envoy, Active-Active: Responses-API conversations chained by
//! `previous_response_id` stay on the pod that stores them, whichever replica routes each turn.
//!
//! The simulator keeps responses in the memory of the pod that generated them, as vLLM does: a
//! follow-up reaching any other pod is answered 404. Three EPP replicas in cluster mode sit behind
//! one Envoy, whose ext_proc cluster spreads the streams over all three, so a conversation's turns
//! are routed by different replicas — which know where the previous response lives only through
//! the replicated bindings. Checked from outside: every turn is answered 200 by the pod of the
//! first turn. Then the pod of one conversation leaves the pool: its follow-up is scheduled on
//! another pod (which answers 404, the state being gone) and counted as `pod_gone`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::epp::metric_sum;
use chaos::wait;
use serde_json::{Value, json};
use sim::SimConfig;

const CONVERSATIONS: usize = 8;
const TURNS: usize = 6;

/// One turn: (status, serving pod, response id, (input, output) tokens reported to the client).
async fn turn(
    client: &reqwest::Client,
    url: &str,
    input: &str,
    previous: Option<&str>,
    stream: bool,
) -> (u16, String, Option<String>, (u64, u64)) {
    let mut body = json!({"model": "sim-model", "input": input, "max_output_tokens": 6,
        "stream": stream});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    let resp = client.post(url).json(&body).send().await.unwrap();
    let status = resp.status().as_u16();
    let pod = resp
        .headers()
        .get("x-inference-pod")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = resp.text().await.unwrap();
    if status != 200 {
        return (status, pod, None, (0, 0));
    }
    let object: Value = if stream {
        // The last event carrying the response object (`response.completed` / `.incomplete`).
        text.split("\n\n")
            .filter_map(|e| e.split_once("data: "))
            .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v.get("response").cloned())
            .last()
            .unwrap_or_else(|| panic!("no response object in the stream: {text}"))
    } else {
        serde_json::from_str(&text).unwrap()
    };
    let id = object["id"].as_str().map(String::from);
    let usage = &object["usage"];
    let tokens = |k: &str| usage[k].as_u64().unwrap_or(0);
    (
        status,
        pod,
        id,
        (tokens("input_tokens"), tokens("output_tokens")),
    )
}

async fn sum_over(c: &LocalCluster, n: usize, metric: &str) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..n {
        let text = c.epp(i).unwrap().metrics().await.unwrap();
        out.push(metric_sum(&text, metric));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_conversation_stays_on_its_pod_across_three_replicas() {
    let c = LocalCluster::start(ClusterSpec {
        sim: SimConfig {
            pods: 4,
            ..SimConfig::default()
        },
        replicas: 3,
        raft: true,
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    // The cluster formed: every replica exchanges with both others.
    wait::until(
        "every replica to gossip with both peers",
        Duration::from_secs(20),
        || async {
            sum_over(&c, 3, "llm_d_epp_prefix_gossip_peers")
                .await
                .iter()
                .all(|n| *n == 2.0)
        },
    )
    .await
    .unwrap();
    let url = format!("{}/v1/responses", c.envoy.url());
    let requests_before = sum_over(&c, 3, "llm_d_epp_request_total").await;

    // The conversations run concurrently; turns alternate between streamed and not, so the
    // binding is learned from both the stream's events and the JSON body.
    let mut tasks = Vec::new();
    for conv in 0..CONVERSATIONS {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut previous: Option<String> = None;
            let mut pods = Vec::new();
            let mut tokens = (0, 0);
            for t in 0..TURNS {
                let stream = (conv + t) % 2 == 0;
                let input = format!("conversation {conv}, turn {t}: go on");
                let (status, pod, id, (input, output)) =
                    turn(&client, &url, &input, previous.as_deref(), stream).await;
                assert_eq!(
                    status, 200,
                    "conversation {conv} turn {t} (previous {previous:?}) answered {status} by {pod}"
                );
                pods.push(pod);
                tokens.0 += input;
                tokens.1 += output;
                previous = Some(id.expect("a response id"));
            }
            (pods, previous.unwrap(), tokens)
        }));
    }
    let mut last = Vec::new();
    let mut client_tokens = (0, 0);
    let mut used_pods = HashSet::new();
    for t in tasks {
        let Ok((pods, id, tokens)) = t.await else {
            let hits = sum_over(&c, 3, "llm_d_epp_response_affinity_total").await;
            let bound = sum_over(&c, 3, "llm_d_epp_response_bindings").await;
            panic!("a conversation failed; lookups per replica {hits:?}, bindings {bound:?}");
        };
        assert!(
            pods.windows(2).all(|w| w[0] == w[1]),
            "a conversation moved: {pods:?}"
        );
        used_pods.insert(pods[0].clone());
        last.push((pods[0].clone(), id));
        client_tokens.0 += tokens.0;
        client_tokens.1 += tokens.1;
    }
    let follow_ups = (CONVERSATIONS * (TURNS - 1)) as f64;

    // Every replica routed some of it: follow-ups reached replicas that did not see the turn
    // before.
    let requests: Vec<f64> = sum_over(&c, 3, "llm_d_epp_request_total")
        .await
        .iter()
        .zip(&requests_before)
        .map(|(a, b)| a - b)
        .collect();
    eprintln!("requests per replica {requests:?}, pods used {used_pods:?}");
    assert!(
        requests.iter().all(|r| *r > 0.0),
        "a replica routed nothing: {requests:?}"
    );
    let hits = sum_over(&c, 3, "llm_d_epp_response_affinity_total{outcome=\"hit\"}").await;
    eprintln!("affinity hits per replica {hits:?}");
    assert_eq!(hits.iter().sum::<f64>(), follow_ups, "{hits:?}");
    assert!(
        hits.iter().filter(|h| **h > 0.0).count() >= 2,
        "follow-ups were pinned by one replica only: {hits:?}"
    );
    // The bindings converge: every replica holds every response's.
    let all = (CONVERSATIONS * TURNS) as f64;
    wait::until(
        "every replica to hold every binding",
        Duration::from_secs(10),
        || async {
            sum_over(&c, 3, "llm_d_epp_response_bindings")
                .await
                .iter()
                .all(|n| *n == all)
        },
    )
    .await
    .unwrap();
    // Accounting of streamed and JSON responses: the tokens the clients were told.
    wait::until(
        "the input and output tokens of every response recorded",
        Duration::from_secs(10),
        || async {
            let input = sum_over(&c, 3, "llm_d_epp_request_input_tokens_sum").await;
            let output = sum_over(&c, 3, "llm_d_epp_request_output_tokens_sum").await;
            input.iter().sum::<f64>() == client_tokens.0 as f64
                && output.iter().sum::<f64>() == client_tokens.1 as f64
        },
    )
    .await
    .unwrap();
    assert!(
        client_tokens.0 > 0 && client_tokens.1 > 0,
        "{client_tokens:?}"
    );

    // A conversation's pod leaves the pool: its follow-up is scheduled elsewhere, visibly.
    let (gone_pod, gone_id) = last[0].clone();
    let yaml = c.sim.pods_yaml();
    let mut out = String::from("pods:\n");
    for entry in yaml.split("  - name: ").skip(1) {
        if entry.lines().next() != Some(gone_pod.as_str()) {
            out.push_str("  - name: ");
            out.push_str(entry);
        }
    }
    std::fs::write(&c.endpoints_file, out).unwrap();
    wait::until(
        "every replica to drop the pod",
        Duration::from_secs(10),
        || async {
            sum_over(&c, 3, "llm_d_epp_pool_ready_endpoints")
                .await
                .iter()
                .all(|n| *n == 3.0)
        },
    )
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let (status, pod, _, _) = turn(&client, &url, "still there?", Some(&gone_id), false).await;
    assert_ne!(pod, gone_pod, "routed to a pod outside the pool");
    assert!(!pod.is_empty(), "no pod answered (status {status})");
    assert_eq!(status, 404, "the state went with its pod");
    let gone = sum_over(
        &c,
        3,
        "llm_d_epp_response_affinity_total{outcome=\"pod_gone\"}",
    )
    .await;
    assert_eq!(gone.iter().sum::<f64>(), 1.0, "{gone:?}");
    // An id no replica ever bound: scheduled normally after the grace, counted `unknown`.
    let (status, _, _, _) = turn(&client, &url, "hello?", Some("resp_forged"), false).await;
    assert_eq!(status, 404);
    let unknown = sum_over(
        &c,
        3,
        "llm_d_epp_response_affinity_total{outcome=\"unknown\"}",
    )
    .await;
    assert_eq!(unknown.iter().sum::<f64>(), 1.0, "{unknown:?}");
    c.shutdown().await;
}

//! End to end through Envoy: precise prefix-cache routing from the pods' own KV events.
//!
//! Eight simulated pods publish KV events (vLLM's wire format over ZMQ) and hold little KV cache,
//! so their engines evict while a multi-turn workload runs. The EPP (`precise-prefix-cache-producer`
//! with its default `vllm_http` token producer: the pods' render endpoints) predicts, per request,
//! how many prompt tokens the chosen pod has cached; the pods report what they actually had
//! (`usage.prompt_tokens_details.cached_tokens`). Acceptance: the predictions match within 2%
//! summed over the run, and the EPP's index holds, per pod, as many blocks as the pod's cache —
//! both checked from outside the EPP (the responses' usage, the simulator's own state). The same
//! workload through the approximate index shows its error for comparison (printed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::cluster::{ClusterSpec, LocalCluster};
use chaos::workloads;
use serde_json::Value;
use sim::loadgen::{self, LoadConfig};
use sim::{KvEventsConfig, SimConfig};

/// How far the index's predictions may be off the pods' counts. Not 0 even with every stream
/// followed live: conversations share a 640-word system prompt and start six at a time, so two
/// first turns can reach one pod together — the second is predicted from the index before the
/// first's blocks are stored, and finds them computed (or not) depending on the engine's timing.
/// Measured in the cluster variant (`e2e_precise_cluster.rs`): mostly exact, up to 4.1%.
const MAX_PREDICTION_ERROR: f64 = 0.05;

fn pods() -> SimConfig {
    workloads::kv_event_pods(8)
}

fn load() -> LoadConfig {
    LoadConfig {
        conversations: 24,
        turns: 5,
        system_prompt_words: 640,
        conversation_words: 1500,
        user_words: 32,
        max_tokens: 16,
        concurrency: 6,
        seed: 11,
        ..LoadConfig::default()
    }
}

fn config(producer: &str) -> String {
    workloads::llmd_prefix_config(producer)
}

/// The pods, one EPP with `config` and Envoy, the pods in the EPP's pool.
async fn start(sim: SimConfig, config: String) -> LocalCluster {
    let c = LocalCluster::start(ClusterSpec {
        sim,
        epp_args: vec!["--config-text".into(), config],
        ..ClusterSpec::default()
    })
    .await
    .unwrap();
    c.wait_for_pods().await.unwrap();
    c
}

/// A counter's value in a Prometheus text exposition (summed over its series).
fn counter(metrics: &str, name: &str) -> u64 {
    chaos::epp::metric_sum(metrics, name) as u64
}

#[derive(Debug)]
struct Run {
    report: loadgen::Report,
    predicted: u64,
    observed: u64,
    abs_error: u64,
}

impl Run {
    fn error(&self) -> f64 {
        self.abs_error as f64 / self.observed.max(1) as f64
    }
}

/// Every pod's KV-event stream subscribed and its first replay (from 0) done, so the workload's
/// first events are not raced by the subscriptions themselves.
async fn subscribed(c: &LocalCluster) {
    let pods: Vec<String> = c.sim.pods().iter().map(|p| p.addr.to_string()).collect();
    chaos::wait::until(
        "every pod's KV events subscribed",
        Duration::from_secs(10),
        || async {
            let Ok(v) = c.epp(0).unwrap().admin_json("/debug/kv-events").await else {
                return false;
            };
            let subs = &v["subscriptions"];
            pods.iter()
                .all(|p| subs[p].is_object() && subs[p]["replaying"] == false)
        },
    )
    .await
    .unwrap();
}

/// Per pod: gaps, resyncs and restarts of its KV-event stream (what explains a misprediction).
async fn recoveries(c: &LocalCluster) -> Vec<(String, u64, u64, u64)> {
    let v = c
        .epp(0)
        .unwrap()
        .admin_json("/debug/kv-events")
        .await
        .unwrap();
    let n = |p: &Value, k: &str| p[k].as_u64().unwrap_or(0);
    v["subscriptions"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, p)| (k.clone(), n(p, "gaps"), n(p, "resyncs"), n(p, "restarts")))
                .collect()
        })
        .unwrap_or_default()
}

/// Pods whose blocks in the EPP's index differ from their cache (the simulator's own state):
/// (pod, index, pod).
async fn mismatched(c: &LocalCluster) -> Vec<(String, u64, u64)> {
    let view = c
        .epp(0)
        .unwrap()
        .admin_json("/debug/kv-events")
        .await
        .unwrap();
    let mut out = Vec::new();
    for (i, pod) in c.sim.pods().iter().enumerate() {
        let held = view["pods"][pod.addr.to_string()]["blocks"]
            .as_u64()
            .unwrap_or(0);
        let cached = c.sim.stats(i).cached_blocks;
        if held != cached {
            out.push((pod.addr.to_string(), held, cached));
        }
    }
    out
}

/// Waits (≤ 5 s) until the index equals every pod's cache.
async fn index_equal(c: &LocalCluster) -> anyhow::Result<()> {
    chaos::wait::until(
        "the index equal to the pods' caches",
        Duration::from_secs(5),
        || async { mismatched(c).await.is_empty() },
    )
    .await
}

async fn run(c: &LocalCluster) -> Run {
    c.wait_for_pods().await.unwrap();
    let report = loadgen::run(&load(), &c.envoy.url()).await.unwrap();
    // The observing stream counts each response as it ends, maybe just after the client saw it.
    let observed = || async {
        let m = c.epp(0).unwrap().metrics().await.unwrap();
        counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total") == report.cached_tokens
    };
    let _ = chaos::wait::until("every response observed", Duration::from_secs(5), observed).await;
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    Run {
        report,
        predicted: counter(&m, "llm_d_epp_prefix_cached_tokens_predicted_total"),
        observed: counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total"),
        abs_error: counter(&m, "llm_d_epp_prefix_cached_tokens_abs_error_total"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_cached_tokens_match_what_the_pods_report() {
    let c = start(pods(), config("precise-prefix-cache-producer")).await;
    subscribed(&c).await;
    let precise = run(&c).await;
    // (pod, gaps, resyncs, restarts) of every stream: a resync loses what the pod held.
    let streams = recoveries(&c).await;
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    let removed = m
        .lines()
        .filter(|l| {
            l.starts_with("llm_d_epp_kv_events_blocks_total{") && l.contains("op=\"removed\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    let renders = counter(&m, "llm_d_epp_token_producer_requests_total");
    // The EPP's index against the pods' caches, once the engines' last events (published at
    // their last steps) have arrived.
    let t0 = std::time::Instant::now();
    let equal = index_equal(&c).await;
    let mismatched = mismatched(&c).await;
    eprintln!(
        "index equal to the pods' caches: {:?} after the traffic",
        equal.as_ref().map(|_| t0.elapsed())
    );
    c.shutdown().await;

    let approx = {
        let c = start(pods(), config("approx-prefix-cache-producer")).await;
        let r = run(&c).await;
        c.shutdown().await;
        r
    };
    for (name, r) in [("precise", &precise), ("approximate", &approx)] {
        eprintln!(
            "{name}: predicted {} observed {} |error| {} ({:.2}%) | cached ratio {:.3} ttft p50 {:.1} p99 {:.1} ms pods {:?}",
            r.predicted,
            r.observed,
            r.abs_error,
            r.error() * 100.0,
            r.report.cached_ratio,
            r.report.ttft_p50_ms,
            r.report.ttft_p99_ms,
            r.report.pods
        );
    }
    eprintln!("engine evictions seen by the index: {removed} blocks; render calls {renders}");
    eprintln!("KV-event streams (pod, gaps, resyncs, restarts): {streams:?}");
    let r = &precise.report;
    assert_eq!((r.errors, r.requests), (0, 24 * 5), "{r:?}");
    assert!(
        removed > 0.0,
        "the pods must evict for the test to mean anything"
    );
    assert_eq!(renders, 24 * 5, "one render call per request");
    // What the observer counted is what the clients were told.
    assert_eq!(precise.observed, r.cached_tokens, "{precise:?}");
    assert!(
        precise.error() <= MAX_PREDICTION_ERROR,
        "precise prediction error {:.2}% > 5%: {precise:?}; streams (pod, gaps, resyncs, \
         restarts): {streams:?}",
        precise.error() * 100.0
    );
    assert!(
        equal.is_ok(),
        "index blocks vs the pods' cached blocks (pod, index, pod): {mismatched:?}"
    );
}

/// llm-d's centralized mode through `epp serve`: the EPP binds `zmqEndpoint` and every pod's
/// publisher connects to it (vLLM given an endpoint that names the router); the replay sockets
/// come from the pods' labels. Each pod's stream is told apart by its topic, and the predictions
/// match what the pods report as closely as with a subscription per pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn centralized_mode_the_pods_publish_to_the_epp() {
    // A port for the EPP to bind (free, below the ephemeral range: nothing else takes it
    // meanwhile); the pods connect first (ZMQ retries until the EPP binds).
    let port = chaos::ports::for_later_bind().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let sim = SimConfig {
        kv_events: Some(KvEventsConfig {
            connect: Some(endpoint.clone()),
            ..KvEventsConfig::default()
        }),
        ..pods()
    };
    let cfg = config("precise-prefix-cache-producer").replacen(
        "- type: precise-prefix-cache-producer\n",
        &format!(
            "- type: precise-prefix-cache-producer\n  parameters:\n    kvEventsConfig:\n      \
             discoverPods: false\n      zmqEndpoint: \"{endpoint}\"\n"
        ),
        1,
    );
    let c = start(sim, cfg).await;
    subscribed(&c).await;
    let v = c
        .epp(0)
        .unwrap()
        .admin_json("/debug/kv-events")
        .await
        .unwrap();
    assert_eq!(v["central_endpoint"], endpoint.as_str(), "{v}");
    let r = run(&c).await;
    let streams = recoveries(&c).await;
    c.shutdown().await;
    eprintln!(
        "centralized: predicted {} observed {} |error| {} ({:.2}%) | cached ratio {:.3}; streams \
         (pod, gaps, resyncs, restarts): {streams:?}",
        r.predicted,
        r.observed,
        r.abs_error,
        r.error() * 100.0,
        r.report.cached_ratio
    );
    assert_eq!((r.report.errors, r.report.requests), (0, 24 * 5), "{r:?}");
    assert_eq!(r.observed, r.report.cached_tokens, "{r:?}");
    assert!(r.observed > 0, "{r:?}");
    assert!(
        r.error() <= MAX_PREDICTION_ERROR,
        "centralized prediction error {:.2}% > 5%: {r:?}",
        r.error() * 100.0
    );
}

/// vLLM's CPU offloading: every pod copies what its (small) GPU cache holds to a CPU tier and
/// publishes those copies as hash-only `BlockStored` events with medium "CPU"; a prompt whose
/// blocks the GPU evicted is loaded back from there and reported cached. The EPP resolves the
/// hash-only events through the blocks it already keyed, keeps the tiers apart, and predicts
/// what the pods report within 2% — while the pods do load from their CPU tier (their own
/// counters). Per pod, the index's blocks by tier equal the pod's GPU cache and CPU tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_blocks_are_predicted_from_the_cpu_tiers_events() {
    let mut sim = pods();
    sim.knobs.kv_blocks = 300;
    sim.knobs.cpu_offload_blocks = 1200;
    let c = start(sim, config("precise-prefix-cache-producer")).await;
    subscribed(&c).await;
    let r = run(&c).await;
    let streams = recoveries(&c).await;
    let loaded: u64 = (0..8).map(|i| c.sim.stats(i).offload_hits_tokens).sum();
    // Per pod: (pod, index gpu, index cpu, pod gpu, pod cpu), once the last events are in.
    let tiers = || async {
        let v = c
            .epp(0)
            .unwrap()
            .admin_json("/debug/kv-events")
            .await
            .unwrap();
        (0..8)
            .map(|i| {
                let addr = c.sim.pods()[i].addr.to_string();
                let t = &v["pods"][&addr]["tiers"];
                let n = |k: &str| t[k].as_u64().unwrap_or(0);
                let s = c.sim.stats(i);
                (
                    addr,
                    n("gpu"),
                    n("cpu"),
                    s.cached_blocks,
                    s.offloaded_blocks,
                )
            })
            .collect::<Vec<_>>()
    };
    let equal = chaos::wait::until(
        "the index's tiers equal the pods'",
        Duration::from_secs(5),
        || async { tiers().await.iter().all(|(_, a, b, c, d)| (a, b) == (c, d)) },
    )
    .await;
    let last = tiers().await;
    c.shutdown().await;
    eprintln!(
        "offload: predicted {} observed {} |error| {} ({:.2}%) | loaded from CPU {loaded} tokens |          cached ratio {:.3}; tiers (pod, index gpu/cpu, pod gpu/cpu): {last:?}; streams {streams:?}",
        r.predicted,
        r.observed,
        r.abs_error,
        r.error() * 100.0,
        r.report.cached_ratio
    );
    assert_eq!((r.report.errors, r.report.requests), (0, 24 * 5), "{r:?}");
    assert_eq!(r.observed, r.report.cached_tokens, "{r:?}");
    assert!(
        loaded > 0,
        "the pods must load from their CPU tier for the test to mean anything"
    );
    assert!(
        r.error() <= MAX_PREDICTION_ERROR,
        "offload prediction error {:.2}% > 5%: {r:?}; streams {streams:?}",
        r.error() * 100.0
    );
    assert!(
        equal.is_ok(),
        "index tiers vs the pods' (pod, index gpu, cpu, pod gpu, cpu): {last:?}"
    );
}

/// llm-d's precise profile with the `local` token producer: the tokenizer directory in-process.
fn local_config(tokenizer: &std::path::Path) -> String {
    config("precise-prefix-cache-producer").replacen(
        "plugins:\n",
        &format!(
            "plugins:\n- type: token-producer\n  parameters:\n    backend: local\n    \
             modelTokenizerMap:\n      sim-model: {}\n",
            tokenizer.display()
        ),
        1,
    )
}

/// The `local` token producer. The pods tokenize with a Hugging Face tokenizer directory (the
/// simulator's vocabulary exported as `tokenizer.json` with Llama 3's chat template), as vLLM pods
/// do with their model's; the EPP loads the same directory and renders and tokenizes in-process.
/// The precise index is keyed by the token ids in the pods' KV events, so the predictions match
/// what the pods report only if the EPP's ids are the engine's — with the estimate backend or the
/// built-in tokenizer nothing would match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_tokenizer_gives_the_engines_tokens_without_render_calls() {
    let dir = tempfile::tempdir().unwrap();
    sim::hftok::export(dir.path()).unwrap();
    let pods = SimConfig {
        tokenizer: Some(dir.path().to_path_buf()),
        ..pods()
    };
    let c = start(pods, local_config(dir.path())).await;
    // The pods really tokenize with the directory: Llama 3's header tokens in their own answer.
    let probe: Value = reqwest::Client::new()
        .post(format!("http://{}/tokenize", c.sim.pods()[0].addr))
        .json(
            &serde_json::json!({"messages": [{"role": "user", "content": "hello"}],
                                  "return_token_strs": true}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(probe["token_strs"][0], "<|begin_of_text|>", "{probe}");
    subscribed(&c).await;
    let r = run(&c).await;
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    let calls: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("llm_d_epp_token_producer_requests_total{"))
        .collect();
    let streams = recoveries(&c).await;
    c.shutdown().await;
    eprintln!(
        "local tokenizer: predicted {} observed {} |error| {} ({:.2}%) | prompt tokens {} cached \
         ratio {:.3} | {calls:?}",
        r.predicted,
        r.observed,
        r.abs_error,
        r.error() * 100.0,
        r.report.prompt_tokens,
        r.report.cached_ratio
    );
    assert_eq!((r.report.errors, r.report.requests), (0, 24 * 5), "{r:?}");
    assert_eq!(
        calls,
        ["llm_d_epp_token_producer_requests_total{backend=\"local\",outcome=\"ok\"} 120"],
        "every request tokenized in-process, none otherwise"
    );
    assert_eq!(r.observed, r.report.cached_tokens, "{r:?}");
    assert!(
        r.observed > r.report.prompt_tokens / 2,
        "the workload reuses most of its prompts: {r:?}"
    );
    assert!(
        r.error() <= MAX_PREDICTION_ERROR,
        "local-tokenizer prediction error {:.2}% > 5%: {r:?}; streams (pod, gaps, resyncs, \
         restarts): {streams:?}",
        r.error() * 100.0
    );
}

/// One chat request through Envoy: the serving pod, the prompt tokens and cached tokens it
/// reported.
async fn chat(c: &LocalCluster, salt: Option<&str>, text: &str) -> (String, u64, u64) {
    let mut body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "go"}],
        "max_tokens": 4,
    });
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.envoy.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap();
    let pod = resp
        .headers()
        .get("x-inference-pod")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let v: Value = resp.json().await.unwrap();
    let usage = &v["usage"];
    (
        pod,
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// Salted prompts (vLLM's `cache_salt`): an engine keeps a salted prompt's blocks apart from the
/// same text unsalted or salted otherwise, and says so in the first block's `extra_keys`. The
/// EPP must key them the same way: a tenant's repeat is predicted cached, the same text under
/// another salt or none is predicted uncached — checked against what the pods report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_prompts_are_predicted_in_their_own_key_space() {
    let c = start(pods(), config("precise-prefix-cache-producer")).await;
    subscribed(&c).await;
    let text = (0..300)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    // (salt, what the pod must report as cached): the first of each is cold.
    let steps: [(Option<&str>, bool); 6] = [
        (Some("tenant-a"), false),
        (Some("tenant-a"), true),
        (Some("tenant-b"), false),
        (None, false),
        (Some("tenant-b"), true),
        (None, true),
    ];
    let mut seen = Vec::new();
    for (salt, warm) in steps {
        let (pod, prompt, cached) = chat(&c, salt, &text).await;
        seen.push((salt, pod, prompt, cached));
        assert_eq!(cached > prompt / 2, warm, "{salt:?}: {seen:?}");
        // The pods' events for this prompt indexed before the next request.
        index_equal(&c).await.unwrap();
    }
    let m = c.epp(0).unwrap().metrics().await.unwrap();
    let predicted = counter(&m, "llm_d_epp_prefix_cached_tokens_predicted_total");
    let observed = counter(&m, "llm_d_epp_prefix_cached_tokens_observed_total");
    let abs_error = counter(&m, "llm_d_epp_prefix_cached_tokens_abs_error_total");
    c.shutdown().await;
    eprintln!("salted: {seen:?}; predicted {predicted} observed {observed} |error| {abs_error}");
    assert_eq!(
        observed,
        seen.iter().map(|s| s.3).sum::<u64>(),
        "the observer counted what the clients were told"
    );
    assert_eq!(
        abs_error, 0,
        "predicted {predicted} vs observed {observed}: {seen:?}"
    );
}

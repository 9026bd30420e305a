//! One full scheduling decision over 100 candidate pods, with llm-d's default profile plus LoRA
//! affinity (approximate prefix producer + prefix, queue, KV-cache and LoRA scorers + max-score
//! picker) and with the project's default (the cost model: prefix producer, in-flight ledger,
//! TTFT prediction + its scorer + max-score picker); and the default at fleet scale: 1000 pods, each
//! with a cached prompt, two requests in flight and a learned speed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use node::config::EndpointPickerConfig;
use node::datalayer::store::Candidate;
use node::datalayer::{Endpoint, EndpointMetrics};
use node::request::parse::Prompt;
use node::scheduling::SchedRequest;

const CONFIG: &str = r#"
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: lora-affinity-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: lora-affinity-scorer, weight: 1}
"#;

fn text(bytes: usize, seed: u32) -> Vec<u8> {
    (0..bytes as u32)
        .map(|i| b'a' + ((i.wrapping_mul(2_654_435_761) ^ seed) % 26) as u8)
        .collect()
}

fn candidates(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| {
            let ep = Arc::new(Endpoint::new(
                format!("pod-{i}"),
                format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
                    .parse()
                    .unwrap(),
                Default::default(),
            ));
            ep.set_metrics(
                EndpointMetrics {
                    waiting_queue_size: Some((i % 7) as f64),
                    running_requests: Some((i % 5) as f64),
                    kv_cache_usage: Some((i % 10) as f64 / 10.0),
                    block_size: Some(16),
                    num_gpu_blocks: Some(100_000),
                    max_active_models: Some(4),
                    active_models: vec!["adapter-a".into()],
                    waiting_models: vec![],
                    started_ms: Some(1_700_000_000_000),
                },
                Instant::now(),
                None,
            );
            Candidate {
                sample: ep.sample(),
                endpoint: ep,
                stale: false,
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for (profile, config) in [
        ("llm-d profile + LoRA", CONFIG),
        ("cost model (default)", node::config::BUILTIN_DEFAULT),
    ] {
        bench_profile(c, profile, config);
    }
    bench_fleet(c);
}

fn sched_req<'a>(
    id: &'a str,
    prompt: &'a Prompt,
    headers: &'a HashMap<String, String>,
) -> SchedRequest<'a> {
    SchedRequest {
        request_id: id,
        model: "m",
        target_model: "m",
        prompt,
        cache_salt: None,
        priority: 0,
        headers,
        tokens: None,
        media: &[],
    }
}

/// The default profile over 1000 pods: every pod served one other 4k-token prompt with the same
/// system prompt (pod 42 this one), has two requests in flight and a speed learned from its
/// responses — the maps a decision reads are as full as in a busy fleet, and every pod matches.
fn bench_fleet(c: &mut Criterion) {
    const PODS: usize = 1000;
    const TOKENS: usize = 4096;
    let config = EndpointPickerConfig::from_yaml(node::config::BUILTIN_DEFAULT).unwrap();
    let built = node::scheduling::build(&config).unwrap();
    let sched = built.scheduler;
    let inflight = built.inflight.expect("the default keeps a ledger");
    let cands = candidates(PODS);
    let headers = HashMap::new();
    let mut rng = rand::rng();
    let route = |id: &str, prompt: &Prompt, pod: usize, rng: &mut rand::rngs::ThreadRng| {
        let r = sched_req(id, prompt, &headers);
        let d = sched.schedule(&r, &cands, rng).unwrap();
        let predicted = d.data.predicted.get(pod).copied();
        let d = node::scheduling::scheduler::Decision {
            picked: vec![pod],
            ..d
        };
        sched.pre_request(&r, &d, &cands);
        predicted
    };
    // Every prompt opens with the same 1k-token system prompt: every pod holds it.
    let system = text(4096, 3);
    let with_system = |seed: u32| {
        let mut t = system.clone();
        t.extend(text((TOKENS - 1024) * 4, seed));
        Prompt::Text(t)
    };
    for (i, cand) in cands.iter().enumerate() {
        let id = format!("warm-{i}");
        let prompt = with_system(i as u32 + 1000);
        let predicted = route(&id, &prompt, i, &mut rng);
        inflight.finish(&id);
        let pod = cand.endpoint.hostport.clone();
        for k in 0..3 {
            sched.observed(&node::scheduling::Observation {
                pod: &pod,
                ttft_ms: Some(150.0 + (i % 13) as f64 * 10.0 + k as f64),
                e2e_ms: 2000.0,
                prompt_tokens: Some(TOKENS as u64),
                cached_tokens: Some(0),
                output_tokens: Some(200),
                predicted,
            });
        }
    }
    let short = Prompt::Text(text(1024, 5));
    for i in 0..PODS {
        for k in 0..2 {
            route(&format!("busy-{i}-{k}"), &short, i, &mut rng);
        }
    }
    let prompt = with_system(7);
    route("bench", &prompt, 42, &mut rng);
    inflight.finish("bench");
    let req = sched_req("bench", &prompt, &headers);
    let d = sched.schedule(&req, &cands, &mut rng).unwrap();
    assert_eq!(d.picked, vec![42], "the warm pod wins");
    let mut g = c.benchmark_group("decision, 1000 pods, cost model (default)");
    g.bench_function("4k-token prompt", |b| {
        b.iter(|| sched.schedule(&req, &cands, &mut rng).unwrap().picked[0])
    });
    // Over the datastore's snapshot, as the router schedules: taken for every decision (the
    // worst case: decisions further apart than its TTL), and shared as the request path shares
    // it (`Datastore::snapshot`: decisions within 2 ms of each other).
    let store = node::datalayer::store::Datastore::new(std::time::Duration::from_secs(10));
    store.replace(cands.iter().map(|c| c.endpoint.clone()).collect());
    g.bench_function("datastore snapshot + 4k-token prompt", |b| {
        b.iter(|| {
            let fresh = store.candidates(Instant::now());
            sched.schedule(&req, &fresh, &mut rng).unwrap().picked[0]
        })
    });
    g.bench_function("shared datastore snapshot + 4k-token prompt", |b| {
        b.iter(|| {
            let shared = store.snapshot(Instant::now());
            sched.schedule(&req, &shared, &mut rng).unwrap().picked[0]
        })
    });
    g.finish();
}

fn bench_profile(c: &mut Criterion, profile: &str, config: &str) {
    let built = node::scheduling::build(&EndpointPickerConfig::from_yaml(config).unwrap()).unwrap();
    let sched = built.scheduler;
    let inflight = built.inflight;
    let cands = candidates(100);
    let headers = HashMap::new();
    let mut rng = rand::rng();
    let mut g = c.benchmark_group(format!("decision, 100 pods, {profile}"));
    for (label, tokens) in [
        ("16k-token prompt", 16_384usize),
        ("100k-token prompt", 100_000),
    ] {
        // Warm the index: every pod has served 3 other prompts of this size; pod 42 served this one.
        for (i, _) in cands.iter().enumerate() {
            for k in 0..3u32 {
                let p = Prompt::Text(text(tokens * 4, (i as u32) * 3 + k + 1000));
                let r = SchedRequest {
                    request_id: "warm",
                    model: "m",
                    target_model: "m",
                    prompt: &p,
                    cache_salt: None,
                    priority: 0,
                    headers: &headers,
                    tokens: None,
                    media: &[],
                };
                let d = sched.schedule(&r, &cands, &mut rng).unwrap();
                sched.pre_request(
                    &r,
                    &node::scheduling::scheduler::Decision {
                        picked: vec![i],
                        ..d
                    },
                    &cands,
                );
            }
        }
        let prompt = Prompt::Text(text(tokens * 4, 7));
        let req = SchedRequest {
            request_id: "bench",
            model: "m",
            target_model: "m",
            prompt: &prompt,
            cache_salt: None,
            priority: 0,
            headers: &headers,
            tokens: None,
            media: &[],
        };
        let d = sched.schedule(&req, &cands, &mut rng).unwrap();
        sched.pre_request(
            &req,
            &node::scheduling::scheduler::Decision {
                picked: vec![42],
                ..d
            },
            &cands,
        );
        // Its response ended: pod 42 holds the prompt and nothing is in flight.
        if let Some(t) = &inflight {
            t.finish("bench");
            t.finish("warm");
        }
        let d = sched.schedule(&req, &cands, &mut rng).unwrap();
        assert_eq!(d.picked, vec![42], "the warm pod wins");
        g.bench_function(label, |b| {
            b.iter(|| sched.schedule(&req, &cands, &mut rng).unwrap().picked[0])
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

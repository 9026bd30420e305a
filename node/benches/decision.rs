//! One full scheduling decision over 100 candidate pods, with llm-d's default profile plus LoRA
//! affinity (approximate prefix producer + prefix, queue, KV-cache and LoRA scorers + max-score
//! picker) and with the project's default (the cost model: prefix producer, in-flight ledger,
//! TTFT prediction + its scorer + max-score picker).
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
apiVersion: llm-d.ai/v1alpha1
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

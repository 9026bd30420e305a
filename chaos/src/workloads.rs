//! Workloads shared by the tests, the benchmarks and the demo.

use sim::loadgen::LoadConfig;
use sim::{EngineModel, KvEventsConfig, PodKnobs, SimConfig};

/// `step` or `simple`, for the binaries' `--engine` flags.
pub fn parse_engine(s: &str) -> Result<EngineModel, String> {
    match s {
        "step" => Ok(EngineModel::Step),
        "simple" => Ok(EngineModel::Simple),
        _ => Err(format!("unknown engine model {s:?} (step or simple)")),
    }
}

/// The pool of the demo and the peer benchmark. `Step` (their default): continuously batching
/// engines with the step model's calibrated defaults (Llama-3.1-8B on one A100: 2048 batched
/// tokens a step, 256 sequences) and 4096 KV blocks of 16 tokens (64k tokens) each. `Simple`:
/// pods that each run 4 requests at once, 50 µs per uncached prompt token, 4 ms per output token,
/// 2048 blocks (what both ran before the step model).
pub fn bench_pool(pods: usize, engine: EngineModel) -> SimConfig {
    let knobs = match engine {
        EngineModel::Step => PodKnobs {
            engine,
            max_num_seqs: 256,
            kv_blocks: 4096,
            ..PodKnobs::default()
        },
        EngineModel::Simple => PodKnobs {
            engine,
            kv_blocks: 2048,
            max_num_seqs: 4,
            prefill_us_per_token: 50.0,
            decode_ms_per_token: 4.0,
            ..PodKnobs::default()
        },
    };
    SimConfig {
        pods,
        knobs,
        ..SimConfig::default()
    }
}

/// Four pods whose KV capacity (1600 blocks of 16 tokens) holds the [`multi_turn`] working set only
/// when each conversation sticks to one pod.
pub fn prefix_affinity_pods() -> SimConfig {
    SimConfig {
        pods: 4,
        knobs: PodKnobs {
            kv_blocks: 1600,
            max_num_seqs: 8,
            prefill_us_per_token: 50.0,
            decode_ms_per_token: 1.0,
            ..PodKnobs::default()
        },
        ..SimConfig::default()
    }
}

/// 64 conversations × 6 turns with ~8k-token contexts: a shared ~2.5k-token system prompt plus a
/// ~5.3k-token per-conversation preamble.
pub fn multi_turn() -> LoadConfig {
    LoadConfig {
        conversations: 64,
        turns: 6,
        system_prompt_words: 1600,
        conversation_words: 3400,
        user_words: 32,
        max_tokens: 16,
        // Not a multiple of the pod count: strict round robin would otherwise pin each
        // conversation to one pod by accident.
        concurrency: 7,
        ..LoadConfig::default()
    }
}

/// The scheduling-parity acceptance workload: 64 conversations × 8 turns with ~8k-token contexts
/// of which only ~1k is a prompt shared by all, 3 conversations in flight, on four pods of 700
/// KV blocks (~11k tokens: the context of one active conversation with some room, not two). Sticky
/// routing keeps each active conversation's context on its pod (ideal cached ratio ~0.89);
/// round robin finds a conversation's context only when its previous turn happened to land on the
/// same pod and nothing evicted it since.
pub fn affinity_acceptance() -> (SimConfig, LoadConfig) {
    let mut pods = prefix_affinity_pods();
    pods.knobs.kv_blocks = 700;
    let load = LoadConfig {
        conversations: 64,
        turns: 8,
        system_prompt_words: 640,
        conversation_words: 4500,
        user_words: 32,
        max_tokens: 16,
        concurrency: 3,
        ..LoadConfig::default()
    };
    (pods, load)
}

/// `InferenceObjective` manifests (name → priority) for `--objectives-file`.
pub fn objectives_yaml(objectives: &[(&str, i32)]) -> String {
    objectives
        .iter()
        .map(|(name, priority)| {
            format!(
                "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {{name: {name}}}\n\
                 spec: {{priority: {priority}, poolRef: {{name: default-pool}}}}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// An `EndpointPickerConfig` with flow control on: the cost model routes, a concurrency detector
/// allows `max_concurrency` requests per pod, requests wait up to 30 s.
pub fn flow_control_config(max_concurrency: u32) -> String {
    format!(
        "\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: cost-model-scorer
- name: slots
  type: concurrency-detector
  parameters: {{maxConcurrency: {max_concurrency}}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: cost-model-scorer}}
flowControl:
  defaultRequestTTL: 30s
  saturationDetector: {{pluginRef: slots}}
"
    )
}

/// Pods that publish KV events and hold little KV cache (600 blocks of 16 tokens: two ~4.5k-token
/// conversations), so their engines evict under a multi-turn workload: the precise index's tests.
pub fn kv_event_pods(pods: usize) -> SimConfig {
    SimConfig {
        pods,
        knobs: PodKnobs {
            kv_blocks: 600,
            max_num_seqs: 8,
            ..PodKnobs::default()
        },
        kv_events: Some(KvEventsConfig::default()),
        ..SimConfig::default()
    }
}

/// llm-d's precise-prefix guide profile (prefix 3, queue 2, KV utilization 2) with `producer`
/// (`precise-prefix-cache-producer` or `approx-prefix-cache-producer`) filling the prefix match.
pub fn llmd_prefix_config(producer: &str) -> String {
    format!(
        "\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: {producer}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
  - {{pluginRef: queue-scorer, weight: 2}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 2}}
"
    )
}

//! What a pod reports about itself (`Sim::stats`, the admin API, `/metrics`).

use serde::Serialize;

/// A snapshot of one pod's gauges and counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PodStats {
    /// Completed generation requests.
    pub served: u64,
    pub running: u64,
    pub waiting: u64,
    /// Blocks held by running requests / capacity, clamped to 1.
    pub kv_usage: f64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits_tokens: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries_tokens: u64,
    /// Requests answered with an error (injected 500s and rejected requests).
    pub errors: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Output tokens of completed requests.
    pub generation_tokens: u64,
    /// Blocks currently in the prefix cache (pinned or free).
    pub cached_blocks: u64,
    /// Blocks currently in the CPU offload tier.
    pub offloaded_blocks: u64,
    /// Prompt tokens loaded back from the CPU offload tier (counted in `cached_tokens` of the
    /// responses, not in `prefix_hits_tokens`).
    pub offload_hits_tokens: u64,
    /// Blocks named by the KV events published (stored + removed), since start.
    pub kv_event_blocks: u64,
    /// LoRA adapters in GPU slots, least recently used first.
    pub lora_resident: Vec<String>,
    /// Adapters with running requests (sorted).
    pub lora_running: Vec<String>,
    /// Adapters with waiting requests (sorted).
    pub lora_waiting: Vec<String>,
    /// Adapter swap-ins since start.
    pub lora_loads: u64,
    /// Server (re)starts after a simulated crash.
    pub restarts: u64,
    /// When the server last (re)started, UNIX seconds (`process_start_time_seconds`).
    pub started_s: f64,
    /// Sequences preempted (step model), since start.
    pub preemptions: u64,
    /// vLLM's request histograms (TTFT, inter-token, end to end, queue time, sizes).
    pub latencies: crate::metrics::Latencies,
}

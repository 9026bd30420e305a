//! Prometheus text exposition of one pod, shaped like vLLM's (`vllm:` names, `model_name` and
//! `engine` labels, counters with `_total`). Rendered straight into a `String`: the sim has a handful
//! of series and a scraper every few hundred ms, so a registry would only add allocations.

use std::fmt::Write;

use bytes::Bytes;

use crate::engine::{LoraInfoSeries, PodStats};
use crate::knobs::PodKnobs;

/// A rendered exposition and the inputs it came from: a scraper polling an idle pod every 50 ms gets
/// the cached bytes instead of a re-render.
#[derive(Debug)]
pub struct Cached {
    pub key: CacheKey,
    pub text: Bytes,
}

/// Everything the text depends on.
#[derive(Debug, PartialEq)]
pub struct CacheKey {
    pub stats: PodStats,
    pub block_size: usize,
    pub kv_blocks: usize,
    pub max_loras: usize,
    pub lora_stamp: (usize, f64),
}

pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
pub const PROCESS_START_TIME: &str = "process_start_time_seconds";

/// Prometheus label values escape backslash, quote and newline.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders the pod's metrics.
pub fn render(model: &str, knobs: &PodKnobs, stats: &PodStats) -> String {
    render_with_lora(model, knobs, stats, &[])
}

/// Renders the pod's metrics, with `vllm:lora_requests_info` when LoRA is enabled
/// (`knobs.max_loras > 0`): one series per label combination ever seen, valued with the unix time
/// of its last update, labels `max_lora`, `waiting_lora_adapters`, `running_lora_adapters` (adapter
/// names joined by "," without spaces) and no `model_name`/`engine`, as vLLM exposes it.
pub fn render_with_lora(
    model: &str,
    knobs: &PodKnobs,
    stats: &PodStats,
    lora: &[LoraInfoSeries],
) -> String {
    let mut out = String::with_capacity(2048);
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(model));
    let sample = |out: &mut String, name: &str, kind: &str, help: &str, extra: &str, v: f64| {
        family(out, name, kind, help);
        let _ = writeln!(out, "{name}{{{labels}{extra}}} {v:?}");
    };
    sample(
        &mut out,
        NUM_REQUESTS_RUNNING,
        "gauge",
        "Number of requests in model execution batches.",
        "",
        stats.running as f64,
    );
    sample(
        &mut out,
        NUM_REQUESTS_WAITING,
        "gauge",
        "Number of requests waiting to be processed.",
        "",
        stats.waiting as f64,
    );
    sample(
        &mut out,
        KV_CACHE_USAGE_PERC,
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        "",
        stats.kv_usage,
    );
    sample(
        &mut out,
        PREFIX_CACHE_QUERIES,
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        "",
        stats.prefix_queries_tokens as f64,
    );
    sample(
        &mut out,
        PREFIX_CACHE_HITS,
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        "",
        stats.prefix_hits_tokens as f64,
    );
    sample(
        &mut out,
        PROMPT_TOKENS,
        "counter",
        "Number of prefill tokens processed.",
        "",
        stats.prompt_tokens as f64,
    );
    sample(
        &mut out,
        GENERATION_TOKENS,
        "counter",
        "Number of generation tokens processed.",
        "",
        stats.generation_tokens as f64,
    );
    sample(
        &mut out,
        REQUEST_SUCCESS,
        "counter",
        "Count of successfully processed requests.",
        ",finished_reason=\"length\"",
        stats.served as f64,
    );
    sample(
        &mut out,
        NUM_PREEMPTIONS,
        "counter",
        "Cumulative number of preemption from the engine.",
        "",
        stats.preemptions as f64,
    );
    // Prometheus' process collector (vLLM exposes it): the server's incarnation.
    family(
        &mut out,
        PROCESS_START_TIME,
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    let _ = writeln!(out, "{PROCESS_START_TIME} {:?}", stats.started_s);
    // Info-style gauge: labels carry the cache config, no model_name (as in vLLM).
    family(
        &mut out,
        CACHE_CONFIG_INFO,
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    let _ = writeln!(
        out,
        "{CACHE_CONFIG_INFO}{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\"}} 1.0",
        knobs.block_size, knobs.kv_blocks
    );
    if knobs.max_loras > 0 {
        family(
            &mut out,
            LORA_REQUESTS_INFO,
            "gauge",
            "Running stats on lora requests.",
        );
        for s in lora {
            let _ = writeln!(
                out,
                "{LORA_REQUESTS_INFO}{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {:?}",
                knobs.max_loras,
                escape(&s.waiting),
                escape(&s.running),
                s.updated
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_values_and_types() {
        let stats = PodStats {
            running: 3,
            waiting: 2,
            kv_usage: 0.25,
            prefix_queries_tokens: 100,
            prefix_hits_tokens: 48,
            served: 7,
            ..PodStats::default()
        };
        let text = render("m\"x", &PodKnobs::default(), &stats);
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"m\\\"x\",engine=\"0\"} 3.0\n")
        );
        assert!(
            text.contains("vllm:num_requests_waiting{model_name=\"m\\\"x\",engine=\"0\"} 2.0\n")
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\",engine=\"0\"} 0.25\n")
        );
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(
            text.contains(
                "vllm:prefix_cache_hits_total{model_name=\"m\\\"x\",engine=\"0\"} 48.0\n"
            )
        );
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"4096\""));
        assert!(text.contains("finished_reason=\"length\"} 7.0"));
        // LoRA on by default (max_loras 1) but no series given.
        assert!(text.contains("# TYPE vllm:lora_requests_info gauge"));
        let series = [
            LoraInfoSeries {
                running: "a,b".into(),
                waiting: "".into(),
                updated: 1.5,
            },
            LoraInfoSeries {
                running: "".into(),
                waiting: "c".into(),
                updated: 2.5,
            },
        ];
        let text = render_with_lora("m", &PodKnobs::default(), &stats, &series);
        assert!(text.contains("vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"\",running_lora_adapters=\"a,b\"} 1.5\n"));
        assert!(text.contains("vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"c\",running_lora_adapters=\"\"} 2.5\n"));
        let off = PodKnobs {
            max_loras: 0,
            ..PodKnobs::default()
        };
        assert!(!render_with_lora("m", &off, &stats, &series).contains("lora"));
    }
}

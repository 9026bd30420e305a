//! Prometheus text exposition of one pod, shaped like vLLM's (`vllm:` names, `model_name` and
//! `engine` labels, counters with `_total`). Rendered straight into a `String`: the sim has a handful
//! of series and a scraper every few hundred ms, so a registry would only add allocations.

use std::fmt::Write;

use crate::engine::PodStats;
use crate::knobs::PodKnobs;

pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";

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
    }
}

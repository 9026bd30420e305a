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
pub const TTFT: &str = "vllm:time_to_first_token_seconds";
pub const ITL: &str = "vllm:inter_token_latency_seconds";
/// ITL's name before vLLM 0.11 (still exposed, deprecated).
pub const TPOT_OLD: &str = "vllm:time_per_output_token_seconds";
pub const E2E: &str = "vllm:e2e_request_latency_seconds";
pub const QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";

/// vLLM's buckets for the time to first token.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Inter-token latency.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// Whole-request durations (end to end, queue).
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// Token counts, 1-2-5 steps.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// A Prometheus histogram: per-bucket counts (not cumulative), sum and count.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Histogram {
    #[serde(skip)]
    bounds: &'static [f64],
    buckets: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|b| *b < v);
        self.buckets[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// Observations at most `le` (a bucket bound).
    pub fn cumulative(&self, le: f64) -> u64 {
        let n = self.bounds.partition_point(|b| *b <= le);
        self.buckets[..n].iter().sum()
    }
}

/// vLLM's per-request latency and size histograms.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Latencies {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
            prompt_tokens: Histogram::new(TOKEN_BUCKETS),
            generation_tokens: Histogram::new(TOKEN_BUCKETS),
        }
    }
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    family(out, name, "histogram", help);
    let mut acc = 0;
    for (b, n) in h.bounds.iter().zip(&h.buckets) {
        acc += n;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{b:?}\"}} {:?}",
            acc as f64
        );
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {:?}",
        h.count as f64
    );
    let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", h.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {:?}", h.count as f64);
}

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
    let l = &stats.latencies;
    for (name, help, h) in [
        (
            TTFT,
            "Histogram of time to first token in seconds.",
            &l.ttft,
        ),
        (ITL, "Histogram of inter-token latency in seconds.", &l.itl),
        (
            TPOT_OLD,
            "Histogram of time per output token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.",
            &l.itl,
        ),
        (E2E, "Histogram of e2e request latency in seconds.", &l.e2e),
        (
            QUEUE_TIME,
            "Histogram of time spent in WAITING phase for request.",
            &l.queue,
        ),
        (
            REQUEST_PROMPT_TOKENS,
            "Number of prefill tokens processed.",
            &l.prompt_tokens,
        ),
        (
            REQUEST_GENERATION_TOKENS,
            "Number of generation tokens processed.",
            &l.generation_tokens,
        ),
    ] {
        // (vLLM exposes them empty too; skipped until the first observation, an idle pod's text
        // stays as small as before — 200 pods scraped every 50 ms on two cores notice.)
        if h.count > 0 {
            histogram(&mut out, name, help, &labels, h);
        }
    }
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

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let mut stats = PodStats::default();
        for v in [0.003, 0.03, 0.03, 3000.0] {
            stats.latencies.ttft.observe(v);
        }
        assert_eq!(stats.latencies.ttft.cumulative(0.04), 3);
        let text = render("m", &PodKnobs::default(), &stats);
        let l = "model_name=\"m\",engine=\"0\"";
        assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram\n"));
        for line in [
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.001\"}} 0.0\n"),
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.005\"}} 1.0\n"),
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.04\"}} 3.0\n"),
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"2560.0\"}} 3.0\n"),
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"+Inf\"}} 4.0\n"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 4.0\n"),
        ] {
            assert!(text.contains(&line), "{line} missing in\n{text}");
        }
        // Families without an observation are left out.
        assert!(!text.contains("vllm:inter_token_latency_seconds"));
        stats.latencies.itl.observe(0.02);
        let text = render("m", &PodKnobs::default(), &stats);
        assert!(text.contains("vllm:inter_token_latency_seconds_count"));
        assert!(text.contains("vllm:time_per_output_token_seconds_count"));
    }
}

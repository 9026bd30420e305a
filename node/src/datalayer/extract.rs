//! Engine-specific extraction of the metrics the scheduler uses (llm-d's `core-metrics-extractor`).
//!
//! vLLM, SGLang, trtllm-serve and Triton TRT-LLM expose the same facts under different names; see
//! `docs/configuration.md`. When an engine exports several series for one gauge (e.g. one per DP
//! engine) the values are summed for queue/running counts and averaged for KV usage.

use super::endpoint::{EndpointMetrics, Engine};
use super::promtext::{Sample, samples};

#[derive(Default)]
struct Acc {
    waiting: Option<f64>,
    running: Option<f64>,
    kv_sum: f64,
    kv_n: u32,
    kv_fallback_sum: f64,
    kv_fallback_n: u32,
    lora_ts: f64,
}

fn add(slot: &mut Option<f64>, v: Option<f64>) {
    if let Some(v) = v.filter(|v| v.is_finite()) {
        *slot = Some(slot.unwrap_or(0.0) + v);
    }
}

fn parse_u64(s: Option<String>) -> Option<u64> {
    s.and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v as u64)
}

/// A sample's value as a count (negative → 0; unreadable → none).
fn count(s: &Sample<'_>) -> Option<u64> {
    s.value().map(|v| v.max(0.0) as u64)
}

fn split_list(s: Option<String>) -> Vec<String> {
    s.map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .map(String::from)
            .collect()
    })
    .unwrap_or_default()
}

/// Extract [`EndpointMetrics`] from a `/metrics` text for the given engine.
pub fn extract(engine: Engine, text: &str) -> EndpointMetrics {
    let mut out = EndpointMetrics::default();
    let mut acc = Acc::default();
    for s in samples(text) {
        if s.name == "process_start_time_seconds" {
            if let Some(v) = s.value().filter(|v| v.is_finite() && *v > 0.0) {
                out.started_ms = Some((v * 1000.0) as u64);
            }
            continue;
        }
        match engine {
            Engine::Vllm => vllm(&mut out, &mut acc, &s),
            Engine::Sglang => sglang(&mut out, &mut acc, &s),
            Engine::TrtllmServe => trtllm(&mut out, &mut acc, &s),
            Engine::TritonTrtllm => triton(&mut out, &mut acc, &s),
        }
    }
    out.waiting_queue_size = acc.waiting;
    out.running_requests = acc.running;
    out.kv_cache_usage = if acc.kv_n > 0 {
        Some(acc.kv_sum / f64::from(acc.kv_n))
    } else if acc.kv_fallback_n > 0 {
        Some(acc.kv_fallback_sum / f64::from(acc.kv_fallback_n))
    } else {
        None
    }
    .map(|v| v.clamp(0.0, 1.0));
    out
}

fn kv(acc: &mut Acc, v: Option<f64>) {
    if let Some(v) = v.filter(|v| v.is_finite()) {
        acc.kv_sum += v;
        acc.kv_n += 1;
    }
}

fn vllm(out: &mut EndpointMetrics, acc: &mut Acc, s: &Sample<'_>) {
    match s.name {
        "vllm:num_requests_waiting" => add(&mut acc.waiting, s.value()),
        "vllm:num_requests_running" => add(&mut acc.running, s.value()),
        "vllm:kv_cache_usage_perc" => kv(acc, s.value()),
        // removed in vLLM 0.12; read only when the new gauge is absent
        "vllm:gpu_cache_usage_perc" => {
            if let Some(v) = s.value().filter(|v| v.is_finite()) {
                acc.kv_fallback_sum += v;
                acc.kv_fallback_n += 1;
            }
        }
        "vllm:cache_config_info" if s.value().is_some() => {
            out.block_size = parse_u64(s.label("block_size")).or(out.block_size);
            out.num_gpu_blocks = parse_u64(s.label("num_gpu_blocks")).or(out.num_gpu_blocks);
        }
        // every label combination is its own series; the newest (largest timestamp) wins
        "vllm:lora_requests_info" => {
            let Some(ts) = s.value().filter(|ts| *ts >= acc.lora_ts) else {
                return;
            };
            acc.lora_ts = ts;
            out.max_active_models = parse_u64(s.label("max_lora"));
            out.active_models = split_list(s.label("running_lora_adapters"));
            out.waiting_models = split_list(s.label("waiting_lora_adapters"));
        }
        _ => {}
    }
}

fn sglang(out: &mut EndpointMetrics, acc: &mut Acc, s: &Sample<'_>) {
    match s.name {
        "sglang:num_queue_reqs" => add(&mut acc.waiting, s.value()),
        "sglang:num_running_reqs" => add(&mut acc.running, s.value()),
        "sglang:token_usage" => kv(acc, s.value()),
        "sglang:cache_config_info" if s.value().is_some() => {
            out.block_size = parse_u64(s.label("page_size")).or(out.block_size);
            out.num_gpu_blocks = parse_u64(s.label("num_pages")).or(out.num_gpu_blocks);
        }
        _ => {}
    }
}

fn trtllm(out: &mut EndpointMetrics, acc: &mut Acc, s: &Sample<'_>) {
    match s.name {
        "trtllm_num_requests_waiting" => add(&mut acc.waiting, s.value()),
        "trtllm_num_requests_running" => add(&mut acc.running, s.value()),
        "trtllm_kv_cache_utilization" => kv(acc, s.value()),
        "trtllm_kv_cache_tokens_per_block" => out.block_size = count(s).or(out.block_size),
        "trtllm_kv_cache_max_blocks" => out.num_gpu_blocks = count(s).or(out.num_gpu_blocks),
        _ => {}
    }
}

fn triton(out: &mut EndpointMetrics, acc: &mut Acc, s: &Sample<'_>) {
    match s.name {
        "nv_trt_llm_request_metrics" => match s.label("request_type").as_deref() {
            Some("waiting") => add(&mut acc.waiting, s.value()),
            Some("scheduled") => add(&mut acc.running, s.value()),
            _ => {}
        },
        "nv_trt_llm_kv_cache_block_metrics" => match s.label("kv_cache_block_type").as_deref() {
            Some("fraction") => kv(acc, s.value()),
            Some("tokens_per") => out.block_size = count(s).or(out.block_size),
            Some("max") => out.num_gpu_blocks = count(s).or(out.num_gpu_blocks),
            _ => {}
        },
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics() {
        let text = "vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 4\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 2\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\n\
            vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"8192\",engine=\"0\"} 1\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1700000001\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\",waiting_lora_adapters=\"c\"} 1700000000\n\
            process_start_time_seconds 1.7000000125e+09\n";
        let m = extract(Engine::Vllm, text);
        assert_eq!(m.started_ms, Some(1_700_000_012_500));
        assert_eq!(m.waiting_queue_size, Some(4.0));
        assert_eq!(m.running_requests, Some(2.0));
        assert_eq!(m.kv_cache_usage, Some(0.25));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(8192));
        assert_eq!(m.max_active_models, Some(4));
        assert_eq!(m.active_models, vec!["a", "b"]);
        assert!(m.waiting_models.is_empty());
    }

    #[test]
    fn vllm_fallback_kv_and_dp_sum() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"1\"} 2\n\
            vllm:gpu_cache_usage_perc 0.5\n";
        let m = extract(Engine::Vllm, text);
        assert_eq!(m.waiting_queue_size, Some(3.0));
        assert_eq!(m.kv_cache_usage, Some(0.5));
        assert_eq!(m.running_requests, None);
    }

    #[test]
    fn sglang_trtllm_triton() {
        let m = extract(
            Engine::Sglang,
            "sglang:num_queue_reqs 5\nsglang:num_running_reqs 1\nsglang:token_usage 0.5\n",
        );
        assert_eq!(
            (m.waiting_queue_size, m.running_requests, m.kv_cache_usage),
            (Some(5.0), Some(1.0), Some(0.5))
        );
        let m = extract(
            Engine::TrtllmServe,
            "trtllm_num_requests_waiting 2\ntrtllm_kv_cache_utilization 0.1\ntrtllm_kv_cache_tokens_per_block 32\n",
        );
        assert_eq!(m.waiting_queue_size, Some(2.0));
        assert_eq!(m.block_size, Some(32));
        let m = extract(
            Engine::TritonTrtllm,
            "nv_trt_llm_request_metrics{request_type=\"waiting\"} 7\nnv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"fraction\"} 0.3\n",
        );
        assert_eq!(m.waiting_queue_size, Some(7.0));
        assert_eq!(m.kv_cache_usage, Some(0.3));
    }

    #[test]
    fn garbage_yields_empty() {
        let m = extract(Engine::Vllm, "<html>not metrics</html>\n\u{0}\u{0}");
        assert_eq!(m, EndpointMetrics::default());
        // A wanted series with an unreadable value or label set is skipped, not read as 0.
        let m = extract(
            Engine::Vllm,
            "vllm:num_requests_waiting{a=\"b\"} many\nvllm:num_requests_waiting 2\n\
             vllm:cache_config_info{block_size=\"16\"} ?\nvllm:cache_config_info{block_size=\"32 1\n\
             vllm:num_requests_running{x=\"y\"}\n",
        );
        assert_eq!(m.waiting_queue_size, Some(2.0));
        assert_eq!((m.block_size, m.running_requests), (None, None));
    }
}

//! Per-pod tunables, changeable at runtime through [`crate::Sim::set_knobs`] or the admin API.

use serde::{Deserialize, Serialize};

use crate::SimError;

/// Behaviour of one simulated pod. Defaults live in [`Default`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PodKnobs {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in blocks.
    pub kv_blocks: usize,
    /// CPU offload tier in blocks (vLLM's native offloading, `--kv-offloading-size`): every
    /// block cached on the GPU is copied there too, least recently used dropped first; a
    /// prompt's blocks found there after the GPU's are loaded back instead of computed and
    /// count as cached. 0: no offload tier.
    pub cpu_offload_blocks: usize,
    /// Loading one token's KV back from the CPU tier, in µs (scaled by `time_scale`).
    pub cpu_load_us_per_token: f64,
    /// Running slots; further requests wait in a FIFO queue.
    pub max_num_seqs: usize,
    /// Fixed cost of a prefill, in ms.
    pub prefill_overhead_ms: f64,
    /// Prefill cost per uncached prompt token, in µs.
    pub prefill_us_per_token: f64,
    /// Cost of each output token after the first, in ms.
    pub decode_ms_per_token: f64,
    /// Multiplies every simulated latency.
    pub time_scale: f64,
    /// Output tokens when the request sets no limit.
    pub default_max_tokens: u32,
    /// Fraction (0..=1) of generation requests answered with a 500.
    pub error_rate: f64,
    /// Added to every request's time to first token, in ms.
    pub extra_latency_ms: f64,
    /// LoRA slots: adapters resident at once (vLLM `--max-loras`). 0 disables LoRA.
    pub max_loras: usize,
    /// Swap-in cost when a request's adapter is not resident, in ms (scaled by `time_scale`).
    pub lora_load_ms: f64,
    /// The engine stops making progress: new requests queue, running streams freeze, until cleared.
    /// `/metrics` and `/health` keep answering, as they do when a real engine hangs.
    pub stall: bool,
    /// Delay before every `/metrics` answer, in ms (not scaled).
    pub metrics_delay_ms: f64,
    /// How `/metrics` misbehaves.
    pub metrics_fault: MetricsFault,
    /// How requests take time: each on its own (`simple`: the prefill and decode knobs above)
    /// or in the batches of a continuously batching engine (`step`, [`crate::step`]).
    pub engine: EngineModel,
    /// Step model: tokens one step may process (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Step model: fixed cost of a step, in ms.
    pub step_base_ms: f64,
    /// Step model: cost per prefilled token, in µs.
    pub step_us_per_prefill_token: f64,
    /// Step model: cost per decoding sequence, in µs.
    pub step_us_per_decode_seq: f64,
    /// Step model: cost per token of context attended over, in ns.
    pub step_ns_per_context_token: f64,
    /// Output tokens per streamed OpenAI chunk (vLLM `--stream-interval`): a chunk goes out every
    /// this many tokens, and with the last.
    pub stream_interval: u32,
}

/// The latency model of a pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineModel {
    /// Every request sleeps its own prefill and decode time: requests do not slow each other.
    #[default]
    Simple,
    /// Continuous batching ([`crate::step`]): a step's cost grows with what it holds.
    Step,
}

/// Fault injected into `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsFault {
    #[default]
    None,
    /// Answer 500.
    Error,
    /// Answer 200 with text that is not Prometheus exposition.
    Garbage,
    /// Never answer (the scraper's timeout fires).
    Hang,
}

impl Default for PodKnobs {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_blocks: 4096,
            cpu_offload_blocks: 0,
            cpu_load_us_per_token: 2.0,
            max_num_seqs: 8,
            prefill_overhead_ms: 2.0,
            prefill_us_per_token: 20.0,
            decode_ms_per_token: 2.0,
            time_scale: 1.0,
            default_max_tokens: 16,
            error_rate: 0.0,
            extra_latency_ms: 0.0,
            max_loras: 1,
            lora_load_ms: 20.0,
            stall: false,
            metrics_delay_ms: 0.0,
            metrics_fault: MetricsFault::None,
            engine: EngineModel::Simple,
            // Llama-3.1-8B on one A100-80GB (docs/benchmarks.md, "The step model's calibration").
            max_num_batched_tokens: 2048,
            step_base_ms: 12.0,
            step_us_per_prefill_token: 70.0,
            step_us_per_decode_seq: 25.0,
            step_ns_per_context_token: 90.0,
            stream_interval: 1,
        }
    }
}

fn invalid(field: &'static str, reason: &str) -> SimError {
    SimError::InvalidKnob {
        field,
        reason: reason.to_owned(),
    }
}

fn non_negative(field: &'static str, v: f64) -> Result<(), SimError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(invalid(field, "must be a finite number >= 0"))
    }
}

impl PodKnobs {
    /// Rejects values the engine cannot run with.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.block_size == 0 {
            return Err(invalid("block_size", "must be > 0"));
        }
        if self.kv_blocks == 0 {
            return Err(invalid("kv_blocks", "must be > 0"));
        }
        if self.max_num_seqs == 0 {
            return Err(invalid("max_num_seqs", "must be > 0"));
        }
        if self.default_max_tokens == 0 {
            return Err(invalid("default_max_tokens", "must be > 0"));
        }
        if self.stream_interval == 0 {
            return Err(invalid("stream_interval", "must be > 0"));
        }
        non_negative("prefill_overhead_ms", self.prefill_overhead_ms)?;
        non_negative("prefill_us_per_token", self.prefill_us_per_token)?;
        non_negative("decode_ms_per_token", self.decode_ms_per_token)?;
        non_negative("time_scale", self.time_scale)?;
        non_negative("extra_latency_ms", self.extra_latency_ms)?;
        non_negative("lora_load_ms", self.lora_load_ms)?;
        non_negative("cpu_load_us_per_token", self.cpu_load_us_per_token)?;
        non_negative("metrics_delay_ms", self.metrics_delay_ms)?;
        if self.max_num_batched_tokens == 0 {
            return Err(invalid("max_num_batched_tokens", "must be > 0"));
        }
        non_negative("step_base_ms", self.step_base_ms)?;
        non_negative("step_us_per_prefill_token", self.step_us_per_prefill_token)?;
        non_negative("step_us_per_decode_seq", self.step_us_per_decode_seq)?;
        non_negative("step_ns_per_context_token", self.step_ns_per_context_token)?;
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(invalid("error_rate", "must be within 0..=1"));
        }
        Ok(())
    }

    /// A copy with every field that `patch` sets replaced.
    pub fn patched(&self, patch: &KnobsPatch) -> PodKnobs {
        let mut k = self.clone();
        macro_rules! apply {
            ($($f:ident),*) => { $( if let Some(v) = patch.$f { k.$f = v; } )* };
        }
        apply!(
            block_size,
            kv_blocks,
            cpu_offload_blocks,
            cpu_load_us_per_token,
            max_num_seqs,
            prefill_overhead_ms,
            prefill_us_per_token,
            decode_ms_per_token,
            time_scale,
            default_max_tokens,
            error_rate,
            extra_latency_ms,
            max_loras,
            lora_load_ms,
            stall,
            metrics_delay_ms,
            metrics_fault,
            engine,
            max_num_batched_tokens,
            step_base_ms,
            step_us_per_prefill_token,
            step_us_per_decode_seq,
            step_ns_per_context_token,
            stream_interval
        );
        k
    }

    /// The step model's configuration from these knobs.
    pub fn step_config(&self) -> crate::step::StepConfig {
        crate::step::StepConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            block_size: self.block_size,
            kv_blocks: self.kv_blocks,
            base_ms: self.step_base_ms,
            us_per_prefill_token: self.step_us_per_prefill_token,
            us_per_decode_seq: self.step_us_per_decode_seq,
            ns_per_context_token: self.step_ns_per_context_token,
        }
    }
}

/// A partial update of [`PodKnobs`]; unset fields keep their value.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnobsPatch {
    pub block_size: Option<usize>,
    pub kv_blocks: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub prefill_overhead_ms: Option<f64>,
    pub prefill_us_per_token: Option<f64>,
    pub decode_ms_per_token: Option<f64>,
    pub time_scale: Option<f64>,
    pub default_max_tokens: Option<u32>,
    pub error_rate: Option<f64>,
    pub extra_latency_ms: Option<f64>,
    #[serde(default)]
    pub max_loras: Option<usize>,
    #[serde(default)]
    pub lora_load_ms: Option<f64>,
    #[serde(default)]
    pub stall: Option<bool>,
    #[serde(default)]
    pub metrics_delay_ms: Option<f64>,
    #[serde(default)]
    pub metrics_fault: Option<MetricsFault>,
    #[serde(default)]
    pub engine: Option<EngineModel>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<usize>,
    #[serde(default)]
    pub step_base_ms: Option<f64>,
    #[serde(default)]
    pub step_us_per_prefill_token: Option<f64>,
    #[serde(default)]
    pub step_us_per_decode_seq: Option<f64>,
    #[serde(default)]
    pub step_ns_per_context_token: Option<f64>,
    #[serde(default)]
    pub stream_interval: Option<u32>,
    #[serde(default)]
    pub cpu_offload_blocks: Option<usize>,
    #[serde(default)]
    pub cpu_load_us_per_token: Option<f64>,
}

/// Knobs for some pods only: a heterogeneous pool from one process (a slower GPU, a smaller
/// cache). Written `PODS=PATCH`: `PODS` a comma-separated list of pod indices and inclusive
/// ranges (`3`, `0-1`, `0,2-3`), `PATCH` a [`KnobsPatch`] as JSON —
/// `2-3={"step_base_ms":24,"step_us_per_prefill_token":140}`.
#[derive(Clone, Debug)]
pub struct PodOverride {
    /// Sorted, without duplicates.
    pub pods: Vec<usize>,
    pub patch: KnobsPatch,
}

impl std::str::FromStr for PodOverride {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (sel, patch) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected PODS=PATCH, e.g. 3={{\"time_scale\":2}}"))?;
        let index = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("{t:?} is not a pod index"))
        };
        let mut pods = Vec::new();
        for part in sel.split(',') {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (index(a)?, index(b)?);
                    if a > b {
                        return Err(format!("pod range {part:?} is empty"));
                    }
                    pods.extend(a..=b);
                }
                None => pods.push(index(part)?),
            }
        }
        pods.sort_unstable();
        pods.dedup();
        let patch = serde_json::from_str(patch).map_err(|e| format!("knobs of {sel}: {e}"))?;
        Ok(PodOverride { pods, patch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_changes_only_set_fields() {
        let k = PodKnobs::default();
        let p: KnobsPatch = serde_json::from_str(r#"{"max_num_seqs":1,"time_scale":0.5}"#).unwrap();
        let n = k.patched(&p);
        assert_eq!(n.max_num_seqs, 1);
        assert_eq!(n.time_scale, 0.5);
        assert_eq!(n.block_size, k.block_size);
        assert!(serde_json::from_str::<KnobsPatch>(r#"{"nope":1}"#).is_err());
    }

    #[test]
    fn validate_rejects_bad_values() {
        assert!(PodKnobs::default().validate().is_ok());
        let bad = |p: &str| {
            let p: KnobsPatch = serde_json::from_str(p).unwrap();
            PodKnobs::default().patched(&p).validate().is_err()
        };
        assert!(bad(r#"{"block_size":0}"#));
        assert!(bad(r#"{"max_num_seqs":0}"#));
        assert!(bad(r#"{"error_rate":1.5}"#));
        assert!(bad(r#"{"time_scale":-1}"#));
    }

    #[test]
    fn pod_overrides_parse_indices_ranges_and_a_patch() {
        let o: PodOverride = r#"3,0-1,1={"time_scale":2.5,"kv_blocks":512}"#.parse().unwrap();
        assert_eq!(o.pods, vec![0, 1, 3]);
        let k = PodKnobs::default().patched(&o.patch);
        assert_eq!((k.time_scale, k.kv_blocks), (2.5, 512));
        for bad in [
            "3",
            "x={}",
            "2-1={}",
            "1=",
            r#"1={"nope":1}"#,
            r#"-1={"time_scale":2}"#,
        ] {
            assert!(bad.parse::<PodOverride>().is_err(), "{bad}");
        }
    }
}

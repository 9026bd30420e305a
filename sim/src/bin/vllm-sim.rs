//! `vllm-sim`: hosts N simulated vLLM pods until SIGINT/SIGTERM.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use sim::{Encoding, EngineModel, KvEventsConfig, PodKnobs, Sim, SimConfig};

#[derive(Debug, Parser)]
#[command(about = "Simulated vLLM pods for exercising the endpoint picker")]
struct Args {
    /// Number of pods.
    #[arg(long, default_value_t = 2)]
    pods: usize,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// First pod port (pod i gets base+i); 0 lets the OS pick every port.
    #[arg(long, default_value_t = 0)]
    base_port: u16,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Admin server port; 0 lets the OS pick.
    #[arg(long, default_value_t = 0)]
    admin_port: u16,
    /// Write the discovery YAML here once every port is bound.
    #[arg(long)]
    pods_file: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 4096)]
    kv_blocks: usize,
    #[arg(long, default_value_t = 8)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 2.0)]
    prefill_overhead_ms: f64,
    #[arg(long, default_value_t = 20.0)]
    prefill_us_per_token: f64,
    #[arg(long, default_value_t = 2.0)]
    decode_ms_per_token: f64,
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    /// Fraction of requests answered with a 500.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    #[arg(long, default_value_t = 0.0)]
    extra_latency_ms: f64,
    /// LoRA slots per pod (vLLM --max-loras); 0 disables LoRA.
    #[arg(long, default_value_t = 1)]
    max_loras: usize,
    /// Swap-in cost of a non-resident adapter, in ms.
    #[arg(long, default_value_t = 20.0)]
    lora_load_ms: f64,
    /// Adapter loaded at start, `name=path` (or just `name`); repeatable.
    #[arg(long = "lora-module")]
    lora_modules: Vec<String>,
    /// Publish vLLM KV-cache events over ZMQ (PUB + replay ROUTER per pod, ports in the JSON line).
    #[arg(long)]
    kv_events: bool,
    /// Encode events as legacy arrays (vLLM <= 0.25) instead of maps.
    #[arg(long)]
    kv_events_legacy_array: bool,
    /// Batches kept per pod for replay.
    #[arg(long, default_value_t = 10_000)]
    kv_events_buffer_steps: usize,
    /// Publish by connecting every pod's PUB socket to this endpoint (llm-d's centralized mode,
    /// e.g. `tcp://127.0.0.1:5557`) instead of binding one per pod; a comma-separated list
    /// spreads the pods over several (pod `i` to entry `i mod n`).
    #[arg(long)]
    kv_events_connect: Option<String>,
    /// Label the first N pods `llm-d.ai/role: prefill`.
    #[arg(long, default_value_t = 0)]
    prefill_pods: usize,
    /// Label the next N pods `llm-d.ai/role: decode`.
    #[arg(long, default_value_t = 0)]
    decode_pods: usize,
    /// Latency model: `simple` (each request sleeps its own prefill and decode) or `step`
    /// (continuous batching: steps of up to --max-num-batched-tokens, whose cost grows with
    /// what they hold; KV blocks allocated as needed, preemption when they run out).
    #[arg(long, default_value = "simple", value_parser = ["simple", "step"])]
    engine: String,
    /// Step model: tokens per step [default: the knobs' default, 2048].
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Step model: fixed cost of a step, in ms [default: calibrated, see docs/benchmarks.md].
    #[arg(long)]
    step_base_ms: Option<f64>,
    /// Step model: cost per prefilled token, in µs [default: calibrated].
    #[arg(long)]
    step_us_per_prefill_token: Option<f64>,
    /// Step model: cost per decoding sequence in a step, in µs [default: calibrated].
    #[arg(long)]
    step_us_per_decode_seq: Option<f64>,
    /// Step model: cost per token of context attended over, in ns [default: calibrated].
    #[arg(long)]
    step_ns_per_context_token: Option<f64>,
    /// Output tokens per streamed chunk (vLLM --stream-interval).
    #[arg(long, default_value_t = 1)]
    stream_interval: u32,
    /// Knobs for some pods only, `PODS=PATCH` (repeatable, applied in order): pod indices and
    /// inclusive ranges, then a JSON knobs patch — `--pod-knobs '3={"time_scale":2}'` makes pod 3 a
    /// GPU half as fast, `--pod-knobs '0-1={"kv_blocks":1024}'` gives pods 0 and 1 a smaller cache.
    #[arg(long = "pod-knobs")]
    pod_knobs: Vec<sim::PodOverride>,
    /// Tokio worker threads; 0 = one per core. 1 runs everything on a single thread, which avoids
    /// cross-thread wake-ups (the cheapest setting for many mostly-idle pods).
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Tokenize prompts with this Hugging Face tokenizer directory (`tokenizer.json` and a chat
    /// template in `tokenizer_config.json` or `chat_template.jinja`), as a vLLM pod does with its
    /// model's; default: the built-in hashing tokenizer.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// Write the simulator's own vocabulary as a Hugging Face tokenizer directory here (for the
    /// EPP's `local` token producer and `--tokenizer`), then exit.
    #[arg(long)]
    export_tokenizer: Option<std::path::PathBuf>,
}

impl Args {
    fn config(&self) -> SimConfig {
        let d = PodKnobs::default();
        SimConfig {
            pods: self.pods,
            host: self.host,
            base_port: self.base_port,
            model: self.model.clone(),
            admin: Some(self.admin_port),
            knobs: PodKnobs {
                block_size: self.block_size,
                kv_blocks: self.kv_blocks,
                max_num_seqs: self.max_num_seqs,
                prefill_overhead_ms: self.prefill_overhead_ms,
                prefill_us_per_token: self.prefill_us_per_token,
                decode_ms_per_token: self.decode_ms_per_token,
                time_scale: self.time_scale,
                default_max_tokens: self.default_max_tokens,
                error_rate: self.error_rate,
                extra_latency_ms: self.extra_latency_ms,
                max_loras: self.max_loras,
                lora_load_ms: self.lora_load_ms,
                engine: if self.engine == "step" {
                    EngineModel::Step
                } else {
                    EngineModel::Simple
                },
                max_num_batched_tokens: self
                    .max_num_batched_tokens
                    .unwrap_or(d.max_num_batched_tokens),
                step_base_ms: self.step_base_ms.unwrap_or(d.step_base_ms),
                step_us_per_prefill_token: self
                    .step_us_per_prefill_token
                    .unwrap_or(d.step_us_per_prefill_token),
                step_us_per_decode_seq: self
                    .step_us_per_decode_seq
                    .unwrap_or(d.step_us_per_decode_seq),
                step_ns_per_context_token: self
                    .step_ns_per_context_token
                    .unwrap_or(d.step_ns_per_context_token),
                stream_interval: self.stream_interval,
                ..d
            },
            pod_knobs: self.pod_knobs.clone(),
            lora_adapters: self
                .lora_modules
                .iter()
                .map(|m| match m.split_once('=') {
                    Some((n, p)) => (n.to_owned(), p.to_owned()),
                    None => (m.clone(), format!("/adapters/{m}")),
                })
                .collect(),
            kv_events: self.kv_events.then(|| KvEventsConfig {
                encoding: if self.kv_events_legacy_array {
                    Encoding::Array
                } else {
                    Encoding::Map
                },
                buffer_steps: self.kv_events_buffer_steps,
                connect: self.kv_events_connect.clone(),
                ..KvEventsConfig::default()
            }),
            prefill_pods: self.prefill_pods,
            decode_pods: self.decode_pods,
            tokenizer: self.tokenizer.clone(),
        }
    }
}

/// Writes `contents` next to `path` and renames it into place, so readers never see a partial file.
fn write_atomic(path: &Path, contents: &str) -> anyhow::Result<()> {
    let file_name = path
        .file_name()
        .context("pods file path has no file name")?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.export_tokenizer {
        sim::hftok::export(dir).with_context(|| format!("writing {}", dir.display()))?;
        println!("{}", dir.display());
        return Ok(());
    }
    let runtime = if args.worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if args.worker_threads > 1 {
            b.worker_threads(args.worker_threads);
        }
        b.enable_all().build()
    }
    .context("building the runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cfg = args.config();
    cfg.validate().context("invalid configuration")?;
    let sim = Sim::start(cfg).await.context("starting sim")?;
    if let Some(path) = &args.pods_file {
        write_atomic(path, &sim.pods_yaml())?;
    }
    let kv: Vec<_> = (0..sim.pods().len())
        .filter_map(|i| sim.kv_endpoints(i))
        .collect();
    let line = json!({
        "admin": sim.admin_addr().map(|a| a.to_string()),
        "pods": sim.pods(),
        "kv_events": kv,
    });
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    let waited = shutdown_signal().await;
    tracing::info!("shutting down");
    sim.shutdown().await;
    waited
}

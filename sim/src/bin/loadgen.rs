//! `loadgen`: runs a workload (multi-turn conversations, short prompts, tenant classes; closed or
//! open loop) against one or more targets on the same seeded schedule and compares them.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use sim::loadgen::{self, Arrival, LoadConfig, Report, TenantClass};

#[derive(Debug, Parser)]
#[command(about = "Multi-turn chat load generator; compares targets on the same seeded schedule")]
struct Args {
    /// NAME=URL (or just URL); repeat to compare targets one after another.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Words of the system prompt shared by all conversations.
    #[arg(long, default_value_t = 256)]
    system_prompt_words: usize,
    /// Words of each conversation's own preamble.
    #[arg(long, default_value_t = 256)]
    conversation_words: usize,
    #[arg(long, default_value_t = 32)]
    user_words: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Extra header `name:value`; repeatable.
    #[arg(long = "header")]
    headers: Vec<String>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 60_000)]
    request_timeout_ms: u64,
    /// Also write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Exit non-zero when any target had transport errors.
    #[arg(long)]
    fail_on_error: bool,
    /// Pause between a conversation's turns, in ms.
    #[arg(long, default_value_t = 0)]
    think_time_ms: u64,
    /// `closed` (fixed concurrency) or `poisson` (open loop at --rate arrivals/s).
    #[arg(long, default_value = "closed")]
    arrival: String,
    /// Conversation (and short-prompt) arrivals per second with --arrival poisson.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// With --arrival poisson: spread the arrivals as a Poisson process that ends within this many
    /// ms (--rate is then unused); 0 keeps the open-ended process.
    #[arg(long, default_value_t = 0)]
    window_ms: u64,
    /// Independent single-turn prompts besides the conversations.
    #[arg(long, default_value_t = 0)]
    short_prompts: usize,
    #[arg(long, default_value_t = 16)]
    short_prompt_words: usize,
    /// Tenant class `name=gold,requests=100,rate=20,burst=5,objective=premium,fairness=g,prompt_words=32,max_tokens=16`;
    /// repeatable. Sends x-llm-d-inference-fairness-id / -objective headers.
    #[arg(long = "tenant")]
    tenants: Vec<String>,
    /// Write an SVG plot of the TTFT distributions (one line per target) here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// POST this URL before each target's run (e.g. the sim admin's /reset_prefix_caches).
    #[arg(long)]
    reset_url: Option<String>,
    /// No progress bar (it is drawn only when stderr is a terminal anyway).
    #[arg(long)]
    no_progress: bool,
    /// Each conversation is a program (agent loop) with its own flow-control fairness id
    /// (`x-llm-d-inference-fairness-id: program-<n>`).
    #[arg(long)]
    program_ids: bool,
}

fn parse_tenant(spec: &str) -> anyhow::Result<TenantClass> {
    let mut t = TenantClass::default();
    for part in spec.split(',').filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            bail!("--tenant {spec:?}: {part:?} is not key=value");
        };
        let num = |v: &str| {
            v.parse::<f64>()
                .with_context(|| format!("--tenant {k}={v}"))
        };
        match k {
            "name" => t.name = v.to_owned(),
            "fairness" | "fairness_id" => t.fairness_id = Some(v.to_owned()),
            "objective" => t.objective = Some(v.to_owned()),
            "requests" => t.requests = num(v)? as usize,
            "rate" => t.rate = num(v)?,
            "burst" => t.burst = num(v)? as usize,
            "prompt_words" => t.prompt_words = num(v)? as usize,
            "max_tokens" => t.max_tokens = num(v)? as u32,
            other => bail!("--tenant: unknown key {other:?}"),
        }
    }
    Ok(t)
}

fn parse_target(s: &str) -> (String, String) {
    match s.split_once('=') {
        Some((name, url)) if !name.is_empty() && !name.contains('/') => {
            (name.to_owned(), url.to_owned())
        }
        _ => (s.to_owned(), s.to_owned()),
    }
}

fn config(args: &Args) -> anyhow::Result<LoadConfig> {
    let mut headers = Vec::new();
    for h in &args.headers {
        let Some((k, v)) = h.split_once(':') else {
            bail!("--header {h:?} is not name:value");
        };
        headers.push((k.trim().to_owned(), v.trim().to_owned()));
    }
    let cfg = LoadConfig {
        conversations: args.conversations,
        turns: args.turns,
        system_prompt_words: args.system_prompt_words,
        conversation_words: args.conversation_words,
        user_words: args.user_words,
        max_tokens: args.max_tokens,
        concurrency: args.concurrency,
        model: args.model.clone(),
        headers,
        seed: args.seed,
        request_timeout_ms: args.request_timeout_ms,
        think_time_ms: args.think_time_ms,
        arrival: match args.arrival.as_str() {
            "closed" => Arrival::Closed,
            "poisson" | "open" => Arrival::Poisson,
            other => bail!("--arrival {other:?}: use closed or poisson"),
        },
        rate: args.rate,
        window_ms: args.window_ms,
        short_prompts: args.short_prompts,
        short_prompt_words: args.short_prompt_words,
        tenants: args
            .tenants
            .iter()
            .map(|t| parse_tenant(t))
            .collect::<anyhow::Result<_>>()?,
        progress: !args.no_progress,
        program_ids: args.program_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let cfg = config(&args)?;
    let targets: Vec<(String, String)> = args.targets.iter().map(|t| parse_target(t)).collect();
    let mut reports: Vec<(String, Report)> = Vec::with_capacity(targets.len());
    for (name, url) in &targets {
        if let Some(reset) = &args.reset_url {
            let status = reqwest::Client::new()
                .post(reset)
                .send()
                .await
                .with_context(|| format!("POST {reset}"))?
                .status();
            if !status.is_success() {
                bail!("POST {reset}: {status}");
            }
        }
        tracing::info!(target_name = %name, %url, "running workload");
        let report = loadgen::run(&cfg, url)
            .await
            .with_context(|| format!("target {name}"))?;
        reports.push((name.clone(), report));
    }
    print!("{}", loadgen::render_table(&reports));
    if let Some(path) = &args.json {
        let map: serde_json::Map<String, serde_json::Value> = reports
            .iter()
            .map(|(n, r)| Ok((n.clone(), serde_json::to_value(r)?)))
            .collect::<Result<_, serde_json::Error>>()?;
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "config": cfg,
            "targets": map,
        }))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, loadgen::render_svg(&reports))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.fail_on_error && reports.iter().any(|(_, r)| r.transport_errors > 0) {
        eprintln!("transport errors occurred");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

//! Load generator: multi-turn conversations, independent short prompts and per-tenant traffic
//! classes, in closed loop (fixed concurrency) or open loop (Poisson arrivals).
//!
//! Every conversation starts with the same system prompt (a prefix all pods can share) followed by a
//! per-conversation preamble (a long prefix only that conversation uses), then runs `turns` streaming
//! chat completions, each carrying the whole history including the assistant text actually received,
//! with `think_time_ms` between turns. A router that keeps a conversation on one pod turns that
//! history into prefix-cache hits, which shows up as a high cached-token ratio and a low TTFT in the
//! [`Report`].
//!
//! Short prompts are single-turn requests with no shared prefix. Tenant classes ([`TenantClass`])
//! send single-turn requests with their own fairness-id / objective headers, rate, burst and sizes;
//! the report breaks every figure down per tenant.
//!
//! Content and arrival times depend only on the seed, so the same schedule can be replayed against
//! several targets and compared.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use xxhash_rust::xxh3::xxh3_64;

/// Header carrying the fairness id (llm-d flow control).
pub const FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";
/// Header naming the InferenceObjective (priority).
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Tenant name of requests that belong to no [`TenantClass`].
pub const DEFAULT_TENANT: &str = "default";

/// How requests of the conversation and short-prompt workloads arrive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Closed loop: at most `concurrency` conversations (or short prompts) in flight.
    #[default]
    Closed,
    /// Open loop: conversations (and short prompts) start at Poisson arrivals of `rate` per second,
    /// however many are still running.
    Poisson,
}

/// A tenant's traffic class: single-turn requests at a Poisson `rate`, the first `burst` of them
/// sent at once at the start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantClass {
    pub name: String,
    /// Sent as [`FAIRNESS_HEADER`]; defaults to `name`.
    pub fairness_id: Option<String>,
    /// Sent as [`OBJECTIVE_HEADER`] when set.
    pub objective: Option<String>,
    pub requests: usize,
    /// Requests per second after the burst.
    pub rate: f64,
    pub burst: usize,
    pub prompt_words: usize,
    pub max_tokens: u32,
}

impl Default for TenantClass {
    fn default() -> Self {
        Self {
            name: "tenant".into(),
            fairness_id: None,
            objective: None,
            requests: 10,
            rate: 10.0,
            burst: 0,
            prompt_words: 32,
            max_tokens: 16,
        }
    }
}

/// The workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadConfig {
    pub conversations: usize,
    pub turns: usize,
    /// Words of the system prompt shared by every conversation.
    pub system_prompt_words: usize,
    /// Words of the per-conversation preamble that follows the system prompt.
    pub conversation_words: usize,
    /// Words of each user message.
    pub user_words: usize,
    pub max_tokens: u32,
    /// Conversations in flight at once (closed loop).
    pub concurrency: usize,
    pub model: String,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    pub seed: u64,
    /// Per-request timeout, in ms.
    pub request_timeout_ms: u64,
    /// Pause between a conversation's turns, in ms.
    pub think_time_ms: u64,
    pub arrival: Arrival,
    /// Arrivals per second in [`Arrival::Poisson`] mode.
    pub rate: f64,
    /// Poisson mode: when > 0, the conversation (and short-prompt) arrivals are a Poisson process
    /// conditioned to fall within this many ms (see [`poisson_schedule_within`]), so the schedule
    /// ends on time however long the random tail would have been; `rate` is then unused.
    pub window_ms: u64,
    /// Independent single-turn prompts, sent besides the conversations.
    pub short_prompts: usize,
    pub short_prompt_words: usize,
    pub tenants: Vec<TenantClass>,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Each conversation is a program (an agent loop): its requests carry
    /// `x-llm-d-inference-fairness-id: program-<n>`, the flow-control fairness id.
    pub program_ids: bool,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            conversations: 16,
            turns: 4,
            system_prompt_words: 256,
            conversation_words: 256,
            user_words: 32,
            max_tokens: 16,
            concurrency: 8,
            model: "sim-model".to_owned(),
            headers: Vec::new(),
            seed: 42,
            request_timeout_ms: 60_000,
            think_time_ms: 0,
            arrival: Arrival::Closed,
            rate: 10.0,
            window_ms: 0,
            short_prompts: 0,
            short_prompt_words: 16,
            tenants: Vec::new(),
            progress: false,
            program_ids: false,
        }
    }
}

/// Errors that stop a run before it sends anything.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid load config: {0}")]
    InvalidConfig(String),
    #[error("invalid header {name:?}: {reason}")]
    InvalidHeader { name: String, reason: String },
    #[error("cannot build HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

fn header_map(pairs: &[(String, String)]) -> Result<HeaderMap, LoadError> {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        let bad = |reason: String| LoadError::InvalidHeader {
            name: k.clone(),
            reason,
        };
        let name = HeaderName::from_bytes(k.trim().as_bytes()).map_err(|e| bad(e.to_string()))?;
        let value = HeaderValue::from_str(v.trim()).map_err(|e| bad(e.to_string()))?;
        map.append(name, value);
    }
    Ok(map)
}

impl LoadConfig {
    pub fn validate(&self) -> Result<(), LoadError> {
        let invalid = |m: &str| Err(LoadError::InvalidConfig(m.into()));
        if self.conversations > 0 && self.turns == 0 {
            return invalid("turns must be > 0");
        }
        if self.conversations == 0 && self.short_prompts == 0 && self.tenants.is_empty() {
            return invalid(
                "conversations and turns must be > 0 (or give short prompts or tenants)",
            );
        }
        if self.concurrency == 0 {
            return invalid("concurrency must be > 0");
        }
        if self.max_tokens == 0 {
            return invalid("max_tokens must be > 0");
        }
        if self.arrival == Arrival::Poisson
            && self.window_ms == 0
            && !(self.rate.is_finite() && self.rate > 0.0)
        {
            return invalid("rate must be > 0 for Poisson arrivals");
        }
        for t in &self.tenants {
            if t.name.is_empty() {
                return invalid("tenant name must not be empty");
            }
            if t.burst < t.requests && !(t.rate.is_finite() && t.rate > 0.0) {
                return invalid("tenant rate must be > 0");
            }
            if t.max_tokens == 0 {
                return invalid("tenant max_tokens must be > 0");
            }
            header_map(&self.tenant_headers(t))?;
        }
        header_map(&self.headers)?;
        Ok(())
    }

    fn tenant_headers(&self, t: &TenantClass) -> Vec<(String, String)> {
        let mut h = vec![(
            FAIRNESS_HEADER.to_owned(),
            t.fairness_id.clone().unwrap_or_else(|| t.name.clone()),
        )];
        if let Some(o) = &t.objective {
            h.push((OBJECTIVE_HEADER.to_owned(), o.clone()));
        }
        h
    }

    /// Requests the whole workload sends.
    pub fn total_requests(&self) -> usize {
        self.conversations * self.turns
            + self.short_prompts
            + self.tenants.iter().map(|t| t.requests).sum::<usize>()
    }
}

/// Latency and cache figures of a set of requests.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    #[serde(default)]
    pub ttft_p95_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    /// Inter-token latency: per request, (e2e − TTFT) / (output tokens − 1); percentiles over the
    /// requests with more than one output token.
    #[serde(default)]
    pub itl_p50_ms: f64,
    #[serde(default)]
    pub itl_p99_ms: f64,
    pub cached_ratio: f64,
    pub output_tokens: u64,
    pub requests_per_s: f64,
    pub statuses: BTreeMap<u16, u64>,
    pub dropped: BTreeMap<String, u64>,
}

/// Results of one run against one target.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub target: String,
    pub requests: u64,
    /// Non-2xx answers, error events in the stream, and transport failures.
    pub errors: u64,
    /// Connection failures, timeouts and truncated streams.
    pub transport_errors: u64,
    pub ttft_p50_ms: f64,
    #[serde(default)]
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    #[serde(default)]
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    /// Inter-token latency ([`Summary::itl_p50_ms`]).
    #[serde(default)]
    pub itl_p50_ms: f64,
    #[serde(default)]
    pub itl_p99_ms: f64,
    /// Sum of cached prompt tokens / sum of prompt tokens, from the usage chunks.
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    pub requests_per_s: f64,
    #[serde(default)]
    pub output_tokens_per_s: f64,
    pub duration_s: f64,
    /// Requests per serving pod (`x-inference-pod`).
    pub pods: BTreeMap<String, u64>,
    /// Requests per `x-llm-d-request-dropped-reason`.
    pub dropped: BTreeMap<String, u64>,
    /// Requests per HTTP status.
    pub statuses: BTreeMap<u16, u64>,
    /// Failed requests per reason: `status:<code>`, `dropped:<reason>`, `transport`, `stream_error`.
    #[serde(default)]
    pub error_reasons: BTreeMap<String, u64>,
    /// The same figures per tenant ([`DEFAULT_TENANT`] for conversations and short prompts).
    #[serde(default)]
    pub tenants: BTreeMap<String, Summary>,
    /// The same figures per serving pod: imbalance shows as one pod's TTFT or ITL above the rest.
    #[serde(default)]
    pub per_pod: BTreeMap<String, Summary>,
    /// The same figures for the conversations' early and late turns ([`TURN_BUCKETS`]).
    #[serde(default)]
    pub turns: BTreeMap<String, Summary>,
    /// TTFT of every successful request, sorted, in ms (for plots; not serialized).
    #[serde(skip)]
    pub ttft_samples_ms: Vec<f64>,
}

#[derive(Debug, Default)]
struct Record {
    status: Option<u16>,
    error: bool,
    transport_error: bool,
    stream_error: bool,
    ttft: Option<Duration>,
    e2e: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    pod: Option<String>,
    dropped: Option<String>,
    tenant: Option<String>,
    /// A conversation's turn (0 = its first).
    turn: Option<usize>,
}

/// The keys of [`Report::turns`]: a conversation's turns 1 to 4, and 5 and later (an agent loop
/// well under way).
pub const TURN_BUCKETS: [&str; 2] = ["turns 1-4", "turns 5+"];

fn words(seed: u64, tag: &[u64], n: usize) -> String {
    let mut key = seed.to_le_bytes().to_vec();
    for t in tag {
        key.extend_from_slice(&t.to_le_bytes());
    }
    let mut rng = StdRng::seed_from_u64(xxh3_64(&key));
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        let len = rng.random_range(2..=8);
        for _ in 0..len {
            out.push(char::from(b'a' + rng.random_range(0..26u8)));
        }
    }
    out
}

/// The system message of conversation `conv`: the shared prompt, then the conversation's preamble.
pub fn system_message(cfg: &LoadConfig, conv: usize) -> String {
    let shared = words(cfg.seed, &[0], cfg.system_prompt_words);
    let own = words(cfg.seed, &[1, conv as u64], cfg.conversation_words);
    format!("{shared} {own}")
}

/// The user message of turn `turn` of conversation `conv`.
pub fn user_message(cfg: &LoadConfig, conv: usize, turn: usize) -> String {
    words(cfg.seed, &[2, conv as u64, turn as u64], cfg.user_words)
}

/// Arrival offsets of `n` events: the first `burst` at 0, then a Poisson process of `rate`/s, drawn
/// from `seed` (so every target sees the same schedule).
pub fn poisson_schedule(seed: u64, n: usize, burst: usize, rate: f64) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i >= burst && rate > 0.0 {
                // Exponential gap by inversion; 1 - u keeps ln's argument in (0, 1].
                let u: f64 = rng.random();
                t += -(1.0 - u).ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// `n` arrival offsets of a Poisson process conditioned to fall within `window`: the gaps are drawn
/// as in [`poisson_schedule`] for `n + 1` events, then scaled so the `(n + 1)`-th lands exactly at
/// `window`. That is the law of `n` sorted uniform points in the window — a Poisson process given
/// its count — so the last arrival is before `window` whatever the seed.
pub fn poisson_schedule_within(seed: u64, n: usize, window: Duration) -> Vec<Duration> {
    let raw = poisson_schedule(seed, n + 1, 0, 1.0);
    let end = raw.last().map_or(0.0, Duration::as_secs_f64);
    raw[..n]
        .iter()
        .map(|d| {
            if end > 0.0 {
                window.mul_f64(d.as_secs_f64() / end)
            } else {
                Duration::ZERO
            }
        })
        .collect()
}

/// Progress counter, drawn on stderr every 200 ms when enabled.
#[derive(Debug, Default)]
struct Progress {
    done: AtomicU64,
    errors: AtomicU64,
}

impl Progress {
    fn record(&self, rec: &Record) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if rec.error {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn draw(&self, total: usize, started: Instant, target: &str) {
        let done = self.done.load(Ordering::Relaxed);
        let frac = if total == 0 {
            1.0
        } else {
            (done as f64 / total as f64).min(1.0)
        };
        let width = 30;
        let filled = (frac * width as f64) as usize;
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{target} [{}{}] {done}/{total} req, {} errors, {:.1}s ",
            "#".repeat(filled),
            " ".repeat(width - filled),
            self.errors.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64()
        );
        let _ = err.flush();
    }
}

struct Ctx<'a> {
    cfg: &'a LoadConfig,
    client: reqwest::Client,
    url: String,
    progress: Arc<Progress>,
    started: Instant,
}

/// Runs the whole workload against `target` (a base URL such as `http://127.0.0.1:8080`).
pub async fn run(cfg: &LoadConfig, target: &str) -> Result<Report, LoadError> {
    cfg.validate()?;
    let client = reqwest::Client::builder()
        .default_headers(header_map(&cfg.headers)?)
        .timeout(Duration::from_millis(cfg.request_timeout_ms))
        .build()?;
    let started = Instant::now();
    let ctx = Ctx {
        cfg,
        client,
        url: format!("{}/v1/chat/completions", target.trim_end_matches('/')),
        progress: Arc::new(Progress::default()),
        started,
    };
    let total = cfg.total_requests();
    let draw = cfg.progress && std::io::stderr().is_terminal();
    let bar = draw.then(|| {
        let progress = Arc::clone(&ctx.progress);
        let target = target.to_owned();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                progress.draw(total, started, &target);
            }
        })
    });
    let (convs, shorts, tenants) = futures::join!(
        conversations(&ctx),
        short_prompts(&ctx),
        futures::future::join_all(
            cfg.tenants
                .iter()
                .enumerate()
                .map(|(i, t)| tenant(&ctx, i, t))
        ),
    );
    if let Some(bar) = bar {
        bar.abort();
        let _ = bar.await;
        ctx.progress.draw(total, started, target);
        eprintln!();
    }
    let mut records = convs;
    records.extend(shorts);
    records.extend(tenants.into_iter().flatten());
    Ok(summarize(target, &records, started.elapsed()))
}

/// Runs `job(i)` for `n` items: closed loop with `concurrency` in flight, or at Poisson arrivals.
async fn schedule<'a, F, Fut>(ctx: &Ctx<'a>, n: usize, salt: u64, job: F) -> Vec<Record>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Vec<Record>>,
{
    match ctx.cfg.arrival {
        Arrival::Closed => {
            futures::stream::iter(0..n)
                .map(&job)
                .buffer_unordered(ctx.cfg.concurrency)
                .flat_map(futures::stream::iter)
                .collect()
                .await
        }
        Arrival::Poisson => {
            let at = if ctx.cfg.window_ms > 0 {
                let window = Duration::from_millis(ctx.cfg.window_ms);
                poisson_schedule_within(ctx.cfg.seed ^ salt, n, window)
            } else {
                poisson_schedule(ctx.cfg.seed ^ salt, n, 0, ctx.cfg.rate)
            };
            let start = tokio::time::Instant::from_std(ctx.started);
            at.into_iter()
                .enumerate()
                .map(|(i, off)| {
                    let fut = job(i);
                    async move {
                        tokio::time::sleep_until(start + off).await;
                        fut.await
                    }
                })
                .collect::<futures::stream::FuturesUnordered<_>>()
                .flat_map(futures::stream::iter)
                .collect()
                .await
        }
    }
}

async fn conversations(ctx: &Ctx<'_>) -> Vec<Record> {
    schedule(ctx, ctx.cfg.conversations, 0x636f_6e76, |conv| {
        conversation(ctx, conv)
    })
    .await
}

async fn short_prompts(ctx: &Ctx<'_>) -> Vec<Record> {
    schedule(ctx, ctx.cfg.short_prompts, 0x7368_6f72, |i| async move {
        let msgs = [json!({"role": "user",
            "content": words(ctx.cfg.seed, &[3, i as u64], ctx.cfg.short_prompt_words)})];
        let (rec, _) = one_request(ctx, &msgs, ctx.cfg.max_tokens, &HeaderMap::new(), None).await;
        vec![rec]
    })
    .await
}

async fn tenant(ctx: &Ctx<'_>, idx: usize, t: &TenantClass) -> Vec<Record> {
    // validate() checked the headers.
    let headers = header_map(&ctx.cfg.tenant_headers(t)).unwrap_or_default();
    let at = poisson_schedule(
        ctx.cfg.seed ^ (idx as u64 + 1) << 20,
        t.requests,
        t.burst,
        t.rate,
    );
    let start = tokio::time::Instant::from_std(ctx.started);
    at.into_iter()
        .enumerate()
        .map(|(i, off)| {
            let headers = &headers;
            async move {
                tokio::time::sleep_until(start + off).await;
                let msgs = [json!({"role": "user",
                    "content": words(ctx.cfg.seed, &[4, idx as u64, i as u64], t.prompt_words)})];
                one_request(ctx, &msgs, t.max_tokens, headers, Some(&t.name))
                    .await
                    .0
            }
        })
        .collect::<futures::stream::FuturesUnordered<_>>()
        .collect()
        .await
}

async fn conversation(ctx: &Ctx<'_>, conv: usize) -> Vec<Record> {
    let mut messages = vec![json!({"role": "system", "content": system_message(ctx.cfg, conv)})];
    let mut records = Vec::with_capacity(ctx.cfg.turns);
    let mut program = HeaderMap::new();
    if ctx.cfg.program_ids
        && let Ok(v) = reqwest::header::HeaderValue::from_str(&format!("program-{conv}"))
    {
        program.insert("x-llm-d-inference-fairness-id", v);
    }
    for turn in 0..ctx.cfg.turns {
        if turn > 0 && ctx.cfg.think_time_ms > 0 {
            tokio::time::sleep(Duration::from_millis(ctx.cfg.think_time_ms)).await;
        }
        messages.push(json!({"role": "user", "content": user_message(ctx.cfg, conv, turn)}));
        let (mut record, text) =
            one_request(ctx, &messages, ctx.cfg.max_tokens, &program, None).await;
        record.turn = Some(turn);
        records.push(record);
        messages.push(json!({"role": "assistant", "content": text}));
    }
    records
}

fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn one_request(
    ctx: &Ctx<'_>,
    messages: &[Value],
    max_tokens: u32,
    headers: &HeaderMap,
    tenant: Option<&str>,
) -> (Record, String) {
    let (rec, text) = send(ctx, messages, max_tokens, headers, tenant).await;
    ctx.progress.record(&rec);
    (rec, text)
}

async fn send(
    ctx: &Ctx<'_>,
    messages: &[Value],
    max_tokens: u32,
    headers: &HeaderMap,
    tenant: Option<&str>,
) -> (Record, String) {
    let body = json!({
        "model": ctx.cfg.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut rec = Record {
        tenant: tenant.map(str::to_owned),
        ..Record::default()
    };
    let mut text = String::new();
    let req = ctx
        .client
        .post(&ctx.url)
        .headers(headers.clone())
        .json(&body);
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "request failed");
            rec.error = true;
            rec.transport_error = true;
            rec.e2e = start.elapsed();
            return (rec, text);
        }
    };
    rec.status = Some(resp.status().as_u16());
    rec.pod = header(&resp, "x-inference-pod");
    rec.dropped = header(&resp, "x-llm-d-request-dropped-reason");
    if !resp.status().is_success() {
        rec.error = true;
        // Drain so the connection can be reused.
        let _ = resp.bytes().await;
        rec.e2e = start.elapsed();
        return (rec, text);
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    let mut chunks = 0u64;
    let mut usage_completion = None;
    'read: while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "stream failed");
                break;
            }
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    break 'read;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    rec.error = true;
                    rec.stream_error = true;
                    continue;
                };
                if v.get("error").is_some() {
                    rec.error = true;
                    rec.stream_error = true;
                }
                if let Some(choices) = v.get("choices").and_then(Value::as_array) {
                    for c in choices {
                        let piece = c
                            .pointer("/delta/content")
                            .or_else(|| c.get("text"))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        if !piece.is_empty() {
                            if rec.ttft.is_none() {
                                rec.ttft = Some(start.elapsed());
                            }
                            chunks += 1;
                            text.push_str(piece);
                        }
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    rec.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
                    rec.cached_tokens = u
                        .pointer("/prompt_tokens_details/cached_tokens")
                        .and_then(Value::as_u64)
                        .unwrap_or(0);
                    usage_completion = u.get("completion_tokens").and_then(Value::as_u64);
                }
            }
        }
    }
    rec.output_tokens = usage_completion.unwrap_or(chunks);
    if !done {
        rec.error = true;
        rec.transport_error = true;
    }
    rec.e2e = start.elapsed();
    (rec, text)
}

/// Nearest-rank percentile of sorted values, in ms.
fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, sorted.len()) - 1;
    sorted[idx].as_secs_f64() * 1000.0
}

fn summary(records: &[&Record], elapsed: Duration) -> Summary {
    let mut s = Summary {
        requests: records.len() as u64,
        ..Summary::default()
    };
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut itl = Vec::new();
    let (mut prompt, mut cached) = (0u64, 0u64);
    for rec in records {
        if rec.error {
            s.errors += 1;
        } else {
            e2e.push(rec.e2e);
            ttft.extend(rec.ttft);
            if let Some(t) = rec.ttft
                && rec.output_tokens > 1
            {
                let gaps = u32::try_from(rec.output_tokens - 1).unwrap_or(u32::MAX);
                itl.push(rec.e2e.saturating_sub(t) / gaps);
            }
        }
        prompt += rec.prompt_tokens;
        cached += rec.cached_tokens;
        s.output_tokens += rec.output_tokens;
        if let Some(d) = &rec.dropped {
            *s.dropped.entry(d.clone()).or_default() += 1;
        }
        if let Some(st) = rec.status {
            *s.statuses.entry(st).or_default() += 1;
        }
    }
    ttft.sort();
    e2e.sort();
    itl.sort();
    s.itl_p50_ms = percentile_ms(&itl, 50.0);
    s.itl_p99_ms = percentile_ms(&itl, 99.0);
    s.ttft_p50_ms = percentile_ms(&ttft, 50.0);
    s.ttft_p90_ms = percentile_ms(&ttft, 90.0);
    s.ttft_p95_ms = percentile_ms(&ttft, 95.0);
    s.ttft_p99_ms = percentile_ms(&ttft, 99.0);
    s.e2e_p50_ms = percentile_ms(&e2e, 50.0);
    s.e2e_p90_ms = percentile_ms(&e2e, 90.0);
    s.e2e_p99_ms = percentile_ms(&e2e, 99.0);
    if prompt > 0 {
        s.cached_ratio = cached as f64 / prompt as f64;
    }
    if elapsed.as_secs_f64() > 0.0 {
        s.requests_per_s = s.requests as f64 / elapsed.as_secs_f64();
    }
    s
}

fn summarize(target: &str, records: &[Record], elapsed: Duration) -> Report {
    let all: Vec<&Record> = records.iter().collect();
    let s = summary(&all, elapsed);
    let mut r = Report {
        target: target.to_owned(),
        requests: s.requests,
        errors: s.errors,
        ttft_p50_ms: s.ttft_p50_ms,
        ttft_p90_ms: s.ttft_p90_ms,
        ttft_p99_ms: s.ttft_p99_ms,
        e2e_p50_ms: s.e2e_p50_ms,
        e2e_p90_ms: s.e2e_p90_ms,
        e2e_p99_ms: s.e2e_p99_ms,
        cached_ratio: s.cached_ratio,
        output_tokens: s.output_tokens,
        requests_per_s: s.requests_per_s,
        duration_s: elapsed.as_secs_f64(),
        dropped: s.dropped,
        statuses: s.statuses,
        ..Report::default()
    };
    let mut by_tenant: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    let mut by_pod: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    let mut by_turn: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for rec in records {
        if let Some(t) = rec.turn {
            let bucket = TURN_BUCKETS[usize::from(t >= 4)];
            by_turn.entry(bucket.to_owned()).or_default().push(rec);
        }
        if rec.transport_error {
            r.transport_errors += 1;
        }
        r.prompt_tokens += rec.prompt_tokens;
        r.cached_tokens += rec.cached_tokens;
        if let Some(p) = &rec.pod {
            *r.pods.entry(p.clone()).or_default() += 1;
            by_pod.entry(p.clone()).or_default().push(rec);
        }
        if rec.error {
            let reason = match (&rec.dropped, rec.status) {
                (Some(d), _) => format!("dropped:{d}"),
                (None, Some(st)) if !(200..300).contains(&st) => format!("status:{st}"),
                _ if rec.stream_error => "stream_error".to_owned(),
                _ => "transport".to_owned(),
            };
            *r.error_reasons.entry(reason).or_default() += 1;
        }
        if !rec.error
            && let Some(t) = rec.ttft
        {
            r.ttft_samples_ms.push(t.as_secs_f64() * 1000.0);
        }
        let tenant = rec.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        by_tenant.entry(tenant.to_owned()).or_default().push(rec);
    }
    r.ttft_samples_ms.sort_by(f64::total_cmp);
    if r.duration_s > 0.0 {
        r.output_tokens_per_s = r.output_tokens as f64 / r.duration_s;
    }
    r.tenants = by_tenant
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.per_pod = by_pod
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.turns = by_turn
        .into_iter()
        .map(|(k, v)| (k, summary(&v, elapsed)))
        .collect();
    r.itl_p50_ms = s.itl_p50_ms;
    r.itl_p99_ms = s.itl_p99_ms;
    r
}

/// A table row: label and how to format a report's cell.
type TableRow = (&'static str, fn(&Report) -> String);

fn table(header: &[String], rows: &[(String, Vec<String>)]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|n| n.len().max(10)).collect();
    for (_, cells) in rows {
        for (w, c) in widths.iter_mut().zip(cells) {
            *w = (*w).max(c.len());
        }
    }
    let label_w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut out = format!("{:label_w$}", "");
    for (name, w) in header.iter().zip(&widths) {
        out.push_str(&format!("  {name:>w$}"));
    }
    out.push('\n');
    for (label, cells) in rows {
        out.push_str(&format!("{label:label_w$}"));
        for (c, w) in cells.iter().zip(&widths) {
            out.push_str(&format!("  {c:>w$}"));
        }
        out.push('\n');
    }
    out
}

fn counts<K: std::fmt::Display>(m: &BTreeMap<K, u64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Side-by-side table of reports, one column per target; then one block per tenant when any
/// report has tenant classes.
pub fn render_table(reports: &[(String, Report)]) -> String {
    let fmt_rows: Vec<TableRow> = vec![
        ("requests", (|r| r.requests.to_string())),
        ("errors", (|r| r.errors.to_string())),
        ("transport errors", (|r| r.transport_errors.to_string())),
        ("ttft p50 ms", (|r| format!("{:.2}", r.ttft_p50_ms))),
        ("ttft p90 ms", (|r| format!("{:.2}", r.ttft_p90_ms))),
        ("ttft p99 ms", (|r| format!("{:.2}", r.ttft_p99_ms))),
        ("e2e p50 ms", (|r| format!("{:.2}", r.e2e_p50_ms))),
        ("e2e p90 ms", (|r| format!("{:.2}", r.e2e_p90_ms))),
        ("e2e p99 ms", (|r| format!("{:.2}", r.e2e_p99_ms))),
        ("itl p50 ms", (|r| format!("{:.2}", r.itl_p50_ms))),
        ("itl p99 ms", (|r| format!("{:.2}", r.itl_p99_ms))),
        ("cached ratio", (|r| format!("{:.3}", r.cached_ratio))),
        ("requests/s", (|r| format!("{:.1}", r.requests_per_s))),
        (
            "output tokens/s",
            (|r| format!("{:.1}", r.output_tokens_per_s)),
        ),
        ("pods used", (|r| r.pods.len().to_string())),
        ("errors by reason", (|r| counts(&r.error_reasons))),
    ];
    let header: Vec<String> = reports.iter().map(|(n, _)| n.clone()).collect();
    let rows: Vec<(String, Vec<String>)> = fmt_rows
        .iter()
        .map(|(l, f)| ((*l).to_owned(), reports.iter().map(|(_, r)| f(r)).collect()))
        .collect();
    let mut out = table(&header, &rows);
    let mut tenants: Vec<&String> = reports.iter().flat_map(|(_, r)| r.tenants.keys()).collect();
    tenants.sort();
    tenants.dedup();
    if tenants.len() > 1 || tenants.first().is_some_and(|t| *t != DEFAULT_TENANT) {
        type SummaryRow = (&'static str, fn(&Summary) -> String);
        let srows: Vec<SummaryRow> = vec![
            ("requests", (|s| s.requests.to_string())),
            ("errors", (|s| s.errors.to_string())),
            ("ttft p50 ms", (|s| format!("{:.2}", s.ttft_p50_ms))),
            ("ttft p90 ms", (|s| format!("{:.2}", s.ttft_p90_ms))),
            ("ttft p99 ms", (|s| format!("{:.2}", s.ttft_p99_ms))),
            ("e2e p90 ms", (|s| format!("{:.2}", s.e2e_p90_ms))),
            ("cached ratio", (|s| format!("{:.3}", s.cached_ratio))),
            ("requests/s", (|s| format!("{:.1}", s.requests_per_s))),
            ("statuses", (|s| counts(&s.statuses))),
        ];
        for t in tenants {
            out.push_str(&format!("\ntenant {t}\n"));
            let rows: Vec<(String, Vec<String>)> = srows
                .iter()
                .map(|(l, f)| {
                    (
                        (*l).to_owned(),
                        reports
                            .iter()
                            .map(|(_, r)| r.tenants.get(t).map(f).unwrap_or_else(|| "-".into()))
                            .collect(),
                    )
                })
                .collect();
            out.push_str(&table(&header, &rows));
        }
    }
    let mut pods: Vec<&String> = reports.iter().flat_map(|(_, r)| r.per_pod.keys()).collect();
    pods.sort();
    pods.dedup();
    if !pods.is_empty() {
        out.push_str("\nper pod: requests · TTFT p50 / p99 ms · ITL p50 ms\n");
        let rows: Vec<(String, Vec<String>)> = pods
            .iter()
            .map(|p| {
                let cells = reports
                    .iter()
                    .map(|(_, r)| {
                        r.per_pod.get(*p).map_or_else(
                            || "-".into(),
                            |s| {
                                format!(
                                    "{} · {:.0} / {:.0} · {:.1}",
                                    s.requests, s.ttft_p50_ms, s.ttft_p99_ms, s.itl_p50_ms
                                )
                            },
                        )
                    })
                    .collect();
                ((*p).clone(), cells)
            })
            .collect();
        out.push_str(&table(&header, &rows));
    }
    out
}

/// An SVG chart of each report's TTFT distribution (empirical CDF, log-scaled time axis), one
/// coloured line per target.
pub fn render_svg(reports: &[(String, Report)]) -> String {
    const W: f64 = 720.0;
    const H: f64 = 420.0;
    const L: f64 = 60.0;
    const R: f64 = 160.0;
    const T: f64 = 30.0;
    const B: f64 = 50.0;
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    ];
    let all = reports
        .iter()
        .flat_map(|(_, r)| r.ttft_samples_ms.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let lo = if lo.is_finite() { lo.max(0.01) } else { 0.1 };
    let hi = hi.max(lo * 10.0);
    let (llo, lhi) = (lo.log10().floor(), hi.log10().ceil());
    let x = |v: f64| L + (v.max(lo).log10() - llo) / (lhi - llo) * (W - L - R);
    let y = |p: f64| T + (1.0 - p) * (H - T - B);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{L}\" y=\"18\" font-size=\"14\">TTFT distribution (CDF)</text>\n"
    );
    // Axes, decade ticks, quartile grid.
    out.push_str(&format!(
        "<line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>\n",
        H - B,
        W - R,
        H - B,
        H - B
    ));
    let mut d = llo;
    while d <= lhi {
        let v = 10f64.powf(d);
        out.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{T}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"#ddd\"/><text x=\"{0:.1}\" y=\"{2}\" text-anchor=\"middle\">{3}</text>\n",
            x(v),
            H - B,
            H - B + 16.0,
            if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
        ));
        d += 1.0;
    }
    for q in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
        out.push_str(&format!(
            "<line x1=\"{L}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{q}</text>\n",
            y(q),
            W - R,
            L - 6.0,
            y(q) + 4.0
        ));
    }
    out.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">TTFT ms (log)</text>\n",
        (L + W - R) / 2.0,
        H - 12.0
    ));
    for (i, (name, r)) in reports.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let n = r.ttft_samples_ms.len();
        if n > 0 {
            // At most ~400 points per line.
            let step = n.div_ceil(400).max(1);
            let pts: Vec<String> = r
                .ttft_samples_ms
                .iter()
                .enumerate()
                .filter(|(k, _)| k % step == 0 || *k == n - 1)
                .map(|(k, v)| format!("{:.1},{:.1}", x(*v), y((k + 1) as f64 / n as f64)))
                .collect();
            out.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
                pts.join(" ")
            ));
        }
        let ly = T + 20.0 * i as f64 + 10.0;
        let label: String = name
            .chars()
            .filter(|c| !matches!(c, '<' | '>' | '&' | '"'))
            .collect();
        out.push_str(&format!(
            "<line x1=\"{0}\" y1=\"{ly}\" x2=\"{1}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"3\"/><text x=\"{2}\" y=\"{3}\">{label} (p50 {4:.1} ms)</text>\n",
            W - R + 10.0,
            W - R + 30.0,
            W - R + 36.0,
            ly + 4.0,
            r.ttft_p50_ms
        ));
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_seeded_and_shares_the_system_prompt() {
        let cfg = LoadConfig {
            system_prompt_words: 10,
            conversation_words: 5,
            ..LoadConfig::default()
        };
        let a = system_message(&cfg, 0);
        let b = system_message(&cfg, 1);
        assert_eq!(a, system_message(&cfg, 0));
        assert_ne!(a, b);
        let shared: Vec<&str> = a.split(' ').take(10).collect();
        assert_eq!(shared, b.split(' ').take(10).collect::<Vec<_>>());
        assert_eq!(a.split(' ').count(), 15);
        assert_ne!(user_message(&cfg, 0, 0), user_message(&cfg, 0, 1));
        let other = LoadConfig {
            seed: 7,
            ..cfg.clone()
        };
        assert_ne!(system_message(&other, 0), a);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&v, 50.0), 50.0);
        assert_eq!(percentile_ms(&v, 99.0), 99.0);
        assert_eq!(percentile_ms(&v[..1], 99.0), 1.0);
        assert_eq!(percentile_ms(&[], 50.0), 0.0);
    }

    #[test]
    fn summary_counts_errors_and_ratio() {
        let recs = vec![
            Record {
                status: Some(200),
                prompt_tokens: 100,
                cached_tokens: 50,
                ttft: Some(Duration::from_millis(3)),
                pod: Some("sim-0".into()),
                ..Record::default()
            },
            Record {
                status: Some(503),
                error: true,
                dropped: Some("shed".into()),
                ..Record::default()
            },
        ];
        let r = summarize("t", &recs, Duration::from_secs(1));
        assert_eq!((r.requests, r.errors, r.transport_errors), (2, 1, 0));
        assert_eq!(r.cached_ratio, 0.5);
        assert_eq!(r.dropped.get("shed"), Some(&1));
        assert_eq!(r.ttft_p50_ms, 3.0);
        assert_eq!(r.error_reasons.get("dropped:shed"), Some(&1));
        assert_eq!(r.tenants[DEFAULT_TENANT].requests, 2);
        let table = render_table(&[("t".into(), r)]);
        assert!(table.contains("cached ratio"));
        assert!(!table.contains("tenant "));
    }

    /// Per pod: its requests' TTFT and inter-token latency ((e2e − TTFT) / (tokens − 1)), so a
    /// pod that serves slowly stands out from the totals.
    #[test]
    fn per_pod_figures_show_a_slow_pod() {
        let rec = |pod: &str, ttft: u64, e2e: u64, tokens: u64| Record {
            status: Some(200),
            ttft: Some(Duration::from_millis(ttft)),
            e2e: Duration::from_millis(e2e),
            output_tokens: tokens,
            pod: Some(pod.into()),
            ..Record::default()
        };
        let recs = vec![
            rec("fast", 10, 160, 16),
            rec("fast", 20, 170, 16),
            rec("slow", 40, 640, 16),
            // one output token: no inter-token gap to measure
            rec("slow", 50, 50, 1),
        ];
        let r = summarize("t", &recs, Duration::from_secs(1));
        assert_eq!(r.per_pod["fast"].requests, 2);
        assert_eq!(r.per_pod["fast"].itl_p50_ms, 10.0);
        assert_eq!(r.per_pod["slow"].itl_p50_ms, 40.0);
        assert_eq!(r.per_pod["slow"].ttft_p99_ms, 50.0);
        assert_eq!((r.itl_p50_ms, r.itl_p99_ms), (10.0, 40.0));
        let table = render_table(&[("t".into(), r)]);
        assert!(
            table.contains("slow") && table.contains("2 · 40 / 50 · 40.0"),
            "{table}"
        );
    }

    #[test]
    fn poisson_schedule_is_seeded_bursty_and_has_the_rate() {
        let a = poisson_schedule(1, 2000, 5, 100.0);
        assert_eq!(a, poisson_schedule(1, 2000, 5, 100.0));
        assert_ne!(a, poisson_schedule(2, 2000, 5, 100.0));
        assert!(a[..5].iter().all(|d| d.is_zero()));
        assert!(a[5] > Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // 1995 gaps at 100/s: ~19.95 s.
        let total = a[1999].as_secs_f64();
        assert!((17.0..23.0).contains(&total), "{total}");
    }

    #[test]
    fn poisson_schedule_within_ends_inside_the_window() {
        let w = Duration::from_secs(60);
        for seed in 0..50 {
            let a = poisson_schedule_within(seed, 6, w);
            assert_eq!(a.len(), 6);
            assert!(a.windows(2).all(|p| p[0] <= p[1]));
            assert!(a.iter().all(|d| *d < w), "{a:?}");
        }
        assert_eq!(
            poisson_schedule_within(3, 100, w),
            poisson_schedule_within(3, 100, w)
        );
        // Spread over the window, not bunched at its start: the mean of uniform points is w/2.
        let many = poisson_schedule_within(9, 5000, w);
        let mean = many.iter().map(Duration::as_secs_f64).sum::<f64>() / 5000.0;
        assert!((27.0..33.0).contains(&mean), "{mean}");
        assert!(poisson_schedule_within(1, 0, w).is_empty());
    }

    #[test]
    fn tenants_get_their_own_rows_and_svg_has_a_line_per_target() {
        let rec = |tenant: Option<&str>, ms: u64, err: bool| Record {
            status: Some(if err { 429 } else { 200 }),
            error: err,
            ttft: Some(Duration::from_millis(ms)),
            e2e: Duration::from_millis(ms * 2),
            tenant: tenant.map(str::to_owned),
            ..Record::default()
        };
        let recs = vec![
            rec(Some("gold"), 5, false),
            rec(Some("gold"), 7, false),
            rec(Some("free"), 50, false),
            rec(Some("free"), 1, true),
        ];
        let r = summarize("t", &recs, Duration::from_secs(2));
        assert_eq!(r.tenants["gold"].ttft_p90_ms, 7.0);
        assert_eq!(r.tenants["free"].errors, 1);
        assert_eq!(r.tenants["free"].statuses.get(&429), Some(&1));
        assert_eq!(r.error_reasons.get("status:429"), Some(&1));
        assert_eq!(r.ttft_samples_ms, vec![5.0, 7.0, 50.0]);
        let reports = vec![("a".to_owned(), r.clone()), ("b".to_owned(), r)];
        let table = render_table(&reports);
        assert!(table.contains("tenant gold") && table.contains("tenant free"));
        let svg = render_svg(&reports);
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}

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

mod report;

use report::{Record, summarize};
pub use report::{Report, Summary, TURN_BUCKETS, render_svg, render_table};

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

#[cfg(test)]
mod tests {
    use super::report::percentile_ms;
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

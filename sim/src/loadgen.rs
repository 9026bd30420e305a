//! Multi-turn conversation load generator.
//!
//! Every conversation starts with the same system prompt (a prefix all pods can share) followed by a
//! per-conversation preamble (a long prefix only that conversation uses), then runs `turns` streaming
//! chat completions, each carrying the whole history including the assistant text actually received.
//! A router that keeps a conversation on one pod turns that history into prefix-cache hits, which shows
//! up as a high cached-token ratio and a low TTFT in the [`Report`].
//!
//! Content depends only on the seed and the (conversation, turn) position, so the same schedule can be
//! replayed against several targets and compared.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use xxhash_rust::xxh3::xxh3_64;

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
    /// Conversations in flight at once.
    pub concurrency: usize,
    pub model: String,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    pub seed: u64,
    /// Per-request timeout, in ms.
    pub request_timeout_ms: u64,
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

impl LoadConfig {
    pub fn validate(&self) -> Result<(), LoadError> {
        if self.conversations == 0 || self.turns == 0 {
            return Err(LoadError::InvalidConfig(
                "conversations and turns must be > 0".into(),
            ));
        }
        if self.concurrency == 0 {
            return Err(LoadError::InvalidConfig("concurrency must be > 0".into()));
        }
        if self.max_tokens == 0 {
            return Err(LoadError::InvalidConfig("max_tokens must be > 0".into()));
        }
        Ok(())
    }

    fn header_map(&self) -> Result<HeaderMap, LoadError> {
        let mut map = HeaderMap::new();
        for (k, v) in &self.headers {
            let bad = |reason: String| LoadError::InvalidHeader {
                name: k.clone(),
                reason,
            };
            let name =
                HeaderName::from_bytes(k.trim().as_bytes()).map_err(|e| bad(e.to_string()))?;
            let value = HeaderValue::from_str(v.trim()).map_err(|e| bad(e.to_string()))?;
            map.append(name, value);
        }
        Ok(map)
    }
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
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// Sum of cached prompt tokens / sum of prompt tokens, from the usage chunks.
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub requests_per_s: f64,
    pub duration_s: f64,
    /// Requests per serving pod (`x-inference-pod`).
    pub pods: BTreeMap<String, u64>,
    /// Requests per `x-llm-d-request-dropped-reason`.
    pub dropped: BTreeMap<String, u64>,
    /// Requests per HTTP status.
    pub statuses: BTreeMap<u16, u64>,
}

#[derive(Debug, Default)]
struct Record {
    status: Option<u16>,
    error: bool,
    transport_error: bool,
    ttft: Option<Duration>,
    e2e: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
    pod: Option<String>,
    dropped: Option<String>,
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

struct Ctx<'a> {
    cfg: &'a LoadConfig,
    client: reqwest::Client,
    url: String,
}

/// Runs the whole workload against `target` (a base URL such as `http://127.0.0.1:8080`).
pub async fn run(cfg: &LoadConfig, target: &str) -> Result<Report, LoadError> {
    cfg.validate()?;
    let client = reqwest::Client::builder()
        .default_headers(cfg.header_map()?)
        .timeout(Duration::from_millis(cfg.request_timeout_ms))
        .build()?;
    let ctx = Ctx {
        cfg,
        client,
        url: format!("{}/v1/chat/completions", target.trim_end_matches('/')),
    };
    let started = Instant::now();
    let records: Vec<Record> = futures::stream::iter(0..cfg.conversations)
        .map(|conv| conversation(&ctx, conv))
        .buffer_unordered(cfg.concurrency)
        .flat_map(futures::stream::iter)
        .collect()
        .await;
    Ok(summarize(target, &records, started.elapsed()))
}

async fn conversation(ctx: &Ctx<'_>, conv: usize) -> Vec<Record> {
    let mut messages = vec![json!({"role": "system", "content": system_message(ctx.cfg, conv)})];
    let mut records = Vec::with_capacity(ctx.cfg.turns);
    for turn in 0..ctx.cfg.turns {
        messages.push(json!({"role": "user", "content": user_message(ctx.cfg, conv, turn)}));
        let (record, text) = one_request(ctx, &messages).await;
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

async fn one_request(ctx: &Ctx<'_>, messages: &[Value]) -> (Record, String) {
    let body = json!({
        "model": ctx.cfg.model,
        "messages": messages,
        "max_tokens": ctx.cfg.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut rec = Record::default();
    let mut text = String::new();
    let resp = match ctx.client.post(&ctx.url).json(&body).send().await {
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
                    continue;
                };
                if v.get("error").is_some() {
                    rec.error = true;
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
                }
            }
        }
    }
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

fn summarize(target: &str, records: &[Record], elapsed: Duration) -> Report {
    let mut r = Report {
        target: target.to_owned(),
        requests: records.len() as u64,
        duration_s: elapsed.as_secs_f64(),
        ..Report::default()
    };
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    for rec in records {
        if rec.error {
            r.errors += 1;
        } else {
            e2e.push(rec.e2e);
            ttft.extend(rec.ttft);
        }
        if rec.transport_error {
            r.transport_errors += 1;
        }
        r.prompt_tokens += rec.prompt_tokens;
        r.cached_tokens += rec.cached_tokens;
        if let Some(p) = &rec.pod {
            *r.pods.entry(p.clone()).or_default() += 1;
        }
        if let Some(d) = &rec.dropped {
            *r.dropped.entry(d.clone()).or_default() += 1;
        }
        if let Some(s) = rec.status {
            *r.statuses.entry(s).or_default() += 1;
        }
    }
    ttft.sort();
    e2e.sort();
    r.ttft_p50_ms = percentile_ms(&ttft, 50.0);
    r.ttft_p99_ms = percentile_ms(&ttft, 99.0);
    r.e2e_p50_ms = percentile_ms(&e2e, 50.0);
    r.e2e_p99_ms = percentile_ms(&e2e, 99.0);
    if r.prompt_tokens > 0 {
        r.cached_ratio = r.cached_tokens as f64 / r.prompt_tokens as f64;
    }
    if r.duration_s > 0.0 {
        r.requests_per_s = r.requests as f64 / r.duration_s;
    }
    r
}

/// A table row: label and how to format a report's cell.
type TableRow = (&'static str, fn(&Report) -> String);

/// Side-by-side table of reports, one column per target.
pub fn render_table(reports: &[(String, Report)]) -> String {
    let fmt_rows: Vec<TableRow> = vec![
        ("requests", (|r| r.requests.to_string())),
        ("errors", (|r| r.errors.to_string())),
        ("transport errors", (|r| r.transport_errors.to_string())),
        ("ttft p50 ms", (|r| format!("{:.2}", r.ttft_p50_ms))),
        ("ttft p99 ms", (|r| format!("{:.2}", r.ttft_p99_ms))),
        ("e2e p50 ms", (|r| format!("{:.2}", r.e2e_p50_ms))),
        ("e2e p99 ms", (|r| format!("{:.2}", r.e2e_p99_ms))),
        ("cached ratio", (|r| format!("{:.3}", r.cached_ratio))),
        ("requests/s", (|r| format!("{:.1}", r.requests_per_s))),
        ("pods used", (|r| r.pods.len().to_string())),
    ];
    let mut widths: Vec<usize> = reports.iter().map(|(n, _)| n.len().max(10)).collect();
    let cells: Vec<Vec<String>> = fmt_rows
        .iter()
        .map(|(_, f)| reports.iter().map(|(_, r)| f(r)).collect())
        .collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let label_w = fmt_rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut out = format!("{:label_w$}", "");
    for ((name, _), w) in reports.iter().zip(&widths) {
        out.push_str(&format!("  {name:>w$}"));
    }
    out.push('\n');
    for ((label, _), row) in fmt_rows.iter().zip(&cells) {
        out.push_str(&format!("{label:label_w$}"));
        for (c, w) in row.iter().zip(&widths) {
            out.push_str(&format!("  {c:>w$}"));
        }
        out.push('\n');
    }
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
        let table = render_table(&[("t".into(), r)]);
        assert!(table.contains("cached ratio"));
    }
}

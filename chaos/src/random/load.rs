//! The workload of a chaos run: closed-loop streaming clients per tenant through Envoy, every
//! request's outcome recorded as the client saw it, and the pods' occupancy sampled meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;

/// Output tokens every request asks for (and a complete stream carries).
pub const MAX_TOKENS: u64 = 24;
/// The client gives up on a request after this long: past the queue TTL, so a request that hangs
/// shows up as a timeout rather than a slow answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// One tenant's clients.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: &'static str,
    /// `x-llm-d-inference-objective` (its priority comes from the objectives file).
    pub objective: &'static str,
    pub clients: usize,
}

/// How a request ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 200 and the whole stream: `[DONE]` and the usage of `MAX_TOKENS` output tokens.
    Complete,
    /// 200, but the stream ended early or broke.
    Truncated(String),
    /// 429 with its `x-llm-d-request-dropped-reason` (empty if none).
    Refused(String),
    /// 503.
    Unavailable,
    /// Any other status.
    Status(u16),
    /// No response: connection error or the client's timeout.
    Lost(String),
}

impl Outcome {
    /// The report's label for the outcome's class.
    pub fn label(&self) -> String {
        match self {
            Outcome::Complete => "200 complete".into(),
            Outcome::Truncated(_) => "200 truncated".into(),
            Outcome::Refused(r) if r.is_empty() => "429 (no reason)".into(),
            Outcome::Refused(r) => format!("429 {r}"),
            Outcome::Unavailable => "503".into(),
            Outcome::Status(s) => format!("{s}"),
            Outcome::Lost(_) => "no response".into(),
        }
    }
}

/// One request, times since the load started.
#[derive(Debug, Clone)]
pub struct Record {
    pub tenant: &'static str,
    pub start: Duration,
    /// When the response headers arrived (the request was dispatched to a pod, or refused).
    pub headers: Option<Duration>,
    pub end: Duration,
    pub outcome: Outcome,
}

/// A running load; [`Load::finish`] stops it and returns what happened.
pub struct Load {
    t0: Instant,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Record>>>,
    sampler: tokio::task::JoinHandle<(u64, Duration)>,
}

impl Load {
    /// Start `tenants` against the gateway at `url`; `occupancy` reads the requests running or
    /// waiting in the pods (sampled every 20 ms for the peak).
    pub fn start(
        url: &str,
        tenants: &[Tenant],
        occupancy: impl Fn() -> u64 + Send + 'static,
    ) -> Load {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(128)
            .build()
            .unwrap_or_default();
        let t0 = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in tenants {
            for k in 0..t.clients {
                let url = format!("{url}/v1/chat/completions");
                let (client, stop, t) = (client.clone(), stop.clone(), t.clone());
                tasks.push(tokio::spawn(async move {
                    let mut records = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let r = one(&client, &url, &t, k, i, t0).await;
                        let pause = !matches!(r.outcome, Outcome::Complete);
                        records.push(r);
                        if pause {
                            // Back off after a refusal as a real client would (and do not spin).
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    records
                }));
            }
        }
        let sampler = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let (mut peak, mut at) = (0, Duration::ZERO);
                while !stop.load(Ordering::Relaxed) {
                    let n = occupancy();
                    if n > peak {
                        (peak, at) = (n, t0.elapsed());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (peak, at)
            })
        };
        Load {
            t0,
            stop,
            tasks,
            sampler,
        }
    }

    /// Time since the load started.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Stop issuing requests, wait for the open ones; the records and the peak occupancy of the
    /// pods with when it was first reached.
    pub async fn finish(self) -> (Vec<Record>, (u64, Duration)) {
        self.stop.store(true, Ordering::Relaxed);
        let mut records = Vec::new();
        for t in self.tasks {
            records.extend(t.await.unwrap_or_default());
        }
        let peak = self.sampler.await.unwrap_or_default();
        records.sort_by_key(|r| r.start);
        (records, peak)
    }
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    t: &Tenant,
    k: usize,
    i: u64,
    t0: Instant,
) -> Record {
    // A system prompt per tenant (shared prefixes for the prefix index), then the turn.
    let system = format!("You are the assistant of tenant {}. ", t.name).repeat(24);
    let body = serde_json::json!({
        "model": "sim-model",
        "stream": true,
        "max_tokens": MAX_TOKENS,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("client {k} question {i}")},
        ],
    });
    let start = t0.elapsed();
    let sent = client
        .post(url)
        .header("x-llm-d-inference-fairness-id", t.name)
        .header("x-llm-d-inference-objective", t.objective)
        .json(&body)
        .timeout(CLIENT_TIMEOUT)
        .send()
        .await;
    let headers = Some(t0.elapsed());
    let outcome = match sent {
        Err(e) => {
            return Record {
                tenant: t.name,
                start,
                headers: None,
                end: t0.elapsed(),
                outcome: Outcome::Lost(e.to_string()),
            };
        }
        Ok(r) => match r.status().as_u16() {
            200 => read_stream(r).await,
            429 => Outcome::Refused(
                r.headers()
                    .get("x-llm-d-request-dropped-reason")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
            ),
            503 => Outcome::Unavailable,
            s => Outcome::Status(s),
        },
    };
    Record {
        tenant: t.name,
        start,
        headers,
        end: t0.elapsed(),
        outcome,
    }
}

/// Read an SSE chat stream to its end: complete only with `[DONE]` and the full usage.
async fn read_stream(r: reqwest::Response) -> Outcome {
    let mut body = r.bytes_stream();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
            Err(e) => return Outcome::Truncated(format!("{e} after {} bytes", text.len())),
        }
    }
    let tokens = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    if !text.contains("data: [DONE]") {
        return Outcome::Truncated(format!("no [DONE] in {} bytes", text.len()));
    }
    if tokens != Some(MAX_TOKENS) {
        return Outcome::Truncated(format!("usage {tokens:?} tokens"));
    }
    Outcome::Complete
}

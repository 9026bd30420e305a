//! Polls each endpoint's `/metrics` on a fixed tick (default 50 ms, llm-d's base tick).
//!
//! One task per endpoint; a scrape never overlaps the previous one (missed ticks are skipped) and is
//! bounded by a timeout, so a slow or broken pod only makes its own data stale. The request path
//! never waits for a scrape: it reads the last sample and its age.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::endpoint::Endpoint;
use super::extract::extract;
use super::shard::Shard;
use crate::metrics::Metrics;

/// Largest `/metrics` body accepted; bigger answers are treated as errors.
const MAX_METRICS_BYTES: usize = 4 << 20;

#[derive(Debug, Clone)]
pub struct ScrapeConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub path: String,
    pub scheme: String,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            path: "/metrics".into(),
            scheme: "http".into(),
        }
    }
}

/// Run the scrape loop for one endpoint until it leaves the datastore or `shutdown` fires. In
/// cluster mode only the pod's owners scrape (see [`Shard`]); they queue each sample for fan-out.
pub async fn scrape_loop(
    endpoint: Weak<Endpoint>,
    client: reqwest::Client,
    cfg: Arc<ScrapeConfig>,
    shard: Arc<Shard>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let url = match endpoint.upgrade() {
        Some(ep) => format!("{}://{}{}", cfg.scheme, ep.hostport, cfg.path),
        None => return,
    };
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some(ep) = endpoint.upgrade() else { return };
        if !shard.owns(&ep.hostport) {
            continue;
        }
        match fetch(&client, &url, cfg.timeout).await {
            Ok(text) => {
                let m = extract(ep.engine, &text);
                shard.publish(&ep.hostport, &m, unix_us());
                ep.set_metrics(m, Instant::now());
            }
            Err(err) => {
                metrics.poll_error();
                tracing::debug!(endpoint = %ep.name, %err, "metrics scrape failed");
            }
        }
    }
}

/// Microseconds since the UNIX epoch: a scrape's time as other replicas understand it.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

async fn fetch(client: &reqwest::Client, url: &str, timeout: Duration) -> Result<String, String> {
    let resp = client
        .get(url)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    if resp
        .content_length()
        .is_some_and(|l| l as usize > MAX_METRICS_BYTES)
    {
        return Err("metrics body too large".into());
    }
    let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
    if bytes.len() > MAX_METRICS_BYTES {
        return Err("metrics body too large".into());
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

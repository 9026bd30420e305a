//! Polls each endpoint's `/metrics` on a fixed tick (default 50 ms, llm-d's base tick).
//!
//! One task per endpoint; a scrape never overlaps the previous one (missed ticks are skipped) and is
//! bounded by a timeout, so a slow or broken pod only makes its own data stale. The request path
//! never waits for a scrape: it reads the last sample and its age.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::endpoint::{Endpoint, EndpointMetrics};
use super::extract::extract;
use super::store::Datastore;
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
/// cluster mode only the pod's owners scrape (see [`super::shard::Shard`]); they queue each sample
/// for fan-out.
pub async fn scrape_loop(
    endpoint: Weak<Endpoint>,
    client: reqwest::Client,
    cfg: Arc<ScrapeConfig>,
    store: Arc<Datastore>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let shard = &store.shard;
    let url = match endpoint.upgrade() {
        Some(ep) => format!("{}://{}{}", cfg.scheme, ep.hostport, cfg.path),
        None => return,
    };
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // A pod that stops answering is logged once, when it starts failing and when it answers
    // again; every failed scrape is counted (`llm_d_epp_datalayer_poll_errors_total`).
    let mut failing = false;
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
                record_scrape(&store, &ep, extract(ep.engine, &text), &metrics);
                if std::mem::take(&mut failing) {
                    tracing::info!(endpoint = %ep.name, "metrics scrapes succeed again");
                }
            }
            Err(err) => {
                metrics.poll_error();
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(endpoint = %ep.name, %err, "metrics scrape failed; the pod is scored without metrics once its last sample is stale (logged again when it answers)");
                } else {
                    tracing::debug!(endpoint = %ep.name, %err, "metrics scrape failed");
                }
            }
        }
    }
}

/// What a successful scrape of `ep` does with the pod's metrics: bound them, queue them for the
/// peers (when this replica fans out) and make them the pod's sample.
pub fn record_scrape(store: &Datastore, ep: &Endpoint, mut m: EndpointMetrics, metrics: &Metrics) {
    ep.check(&mut m, "metrics", metrics);
    store.shard.publish(&ep.hostport, &m, unix_us());
    store.set_metrics(ep, m, mono_now());
}

/// Microseconds since the UNIX epoch (with the test offset of `consensus::clock`): a scrape's
/// time, and the prefix index's clock.
pub fn unix_us() -> u64 {
    consensus::clock::now_us()
}

/// The monotonic clock of the data layer's samples and of the peers' liveness: the host's,
/// except under a runtime whose clock is simulated (tokio's paused clock — the deterministic
/// simulation's hosts), whose time it then follows.
pub fn mono_now() -> Instant {
    tokio::time::Instant::now().into_std()
}

async fn fetch(client: &reqwest::Client, url: &str, timeout: Duration) -> Result<String, String> {
    let mut resp = client
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
        .is_some_and(|l| l > MAX_METRICS_BYTES as u64)
    {
        return Err(TOO_LARGE.into());
    }
    // Read chunk by chunk: a chunked (or lying) body is cut at the bound, not buffered first.
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > MAX_METRICS_BYTES {
            return Err(TOO_LARGE.into());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

const TOO_LARGE: &str = "metrics body too large";

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A `/metrics` server answering every connection with `head` and then `body` chunks, forever
    /// when `forever`.
    async fn server(body: &'static str, forever: bool) -> std::net::SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
                                transfer-encoding: chunked\r\n\r\n";
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    let chunk = format!("{:x}\r\n{body}\r\n", body.len());
                    loop {
                        if s.write_all(chunk.as_bytes()).await.is_err() || !forever {
                            break;
                        }
                    }
                    let _ = s.write_all(b"0\r\n\r\n").await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn an_endless_chunked_body_is_cut_at_the_bound() {
        let addr = server("vllm:num_requests_waiting 1\n", true).await;
        let client = reqwest::Client::new();
        // A generous timeout: the bound, not the clock, must end the read.
        let err = fetch(
            &client,
            &format!("http://{addr}/metrics"),
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
        assert_eq!(err, TOO_LARGE);
    }

    #[tokio::test]
    async fn absurd_engine_values_are_dropped_counted_and_never_reach_the_scheduler() {
        let body = "vllm:cache_config_info{block_size=\"4611686018427387904\",\
                    num_gpu_blocks=\"1099511627776\"} 1\n\
                    vllm:num_requests_running 1e300\n\
                    vllm:num_requests_waiting -3\n\
                    process_start_time_seconds 1e15\n";
        let addr = server(body, false).await;
        let ep = Arc::new(Endpoint::new("p".into(), addr, Default::default()));
        let metrics = Arc::new(Metrics::new("pool"));
        let stop = CancellationToken::new();
        let task = tokio::spawn(scrape_loop(
            Arc::downgrade(&ep),
            reqwest::Client::new(),
            Arc::new(ScrapeConfig::default()),
            Arc::new(Datastore::new(Duration::from_secs(1))),
            metrics.clone(),
            stop.clone(),
        ));
        let sample = loop {
            if let Some(s) = ep.sample() {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        stop.cancel();
        task.await.unwrap();
        let m = &sample.metrics;
        assert_eq!(m.block_size, None);
        assert_eq!(m.num_gpu_blocks, None);
        assert_eq!(m.running_requests, Some(bounds_max()));
        assert_eq!(m.waiting_queue_size, None);
        assert_eq!(m.started_ms, None);
        let text = metrics.encode();
        for field in [
            "block_size",
            "num_gpu_blocks",
            "running_requests",
            "waiting_queue_size",
            "started_ms",
        ] {
            let line = format!(
                "llm_d_epp_untrusted_values_rejected_total{{source=\"metrics\",field=\"{field}\"}}"
            );
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }

    fn bounds_max() -> f64 {
        super::super::endpoint::bounds::MAX_REQUESTS
    }
}

//! Polls each endpoint's `/metrics` on a fixed tick (default 50 ms, llm-d's base tick).
//!
//! One task per endpoint; a scrape never overlaps the previous one (missed ticks are skipped) and is
//! bounded by a timeout, so a slow or broken pod only makes its own data stale. The request path
//! never waits for a scrape: it reads the last sample and its age.
//!
//! Each task keeps its own HTTP/1.1 keep-alive connection to its pod ([`MetricsConn`], hyper's
//! connection API, no pool): at a fleet's 8000 scrapes/s per replica a general HTTP client's pool
//! checkout, URL parsing and per-request allocations were most of an idle replica's CPU
//! (`docs/benchmarks.md`, fleet scale).

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
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
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            path: "/metrics".into(),
        }
    }
}

/// Run the scrape loop for one endpoint until it leaves the datastore or `shutdown` fires. In
/// cluster mode only the pod's owners scrape (see [`super::shard::Shard`]); they queue each sample
/// for fan-out.
pub async fn scrape_loop(
    endpoint: Weak<Endpoint>,
    cfg: Arc<ScrapeConfig>,
    store: Arc<Datastore>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let shard = &store.shard;
    let mut conn = match endpoint.upgrade() {
        Some(ep) => MetricsConn::new(ep.addr, &cfg.path),
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
            // Another replica scrapes it now: no idle connection held to it meanwhile.
            conn.close();
            continue;
        }
        match conn.fetch(cfg.timeout).await {
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

/// One pod's `/metrics` over an HTTP/1.1 keep-alive connection, opened on first use and again
/// after any failure (a timed-out or broken exchange leaves the connection in an unknown state,
/// so it is dropped).
pub struct MetricsConn {
    addr: SocketAddr,
    /// The `Host` header.
    hostport: String,
    path: String,
    sender: Option<SendRequest<Empty<Bytes>>>,
    /// The last body's length: the next body's first allocation (no buffer is kept between
    /// scrapes — a few hundred pods' expositions would stay in memory).
    last_len: usize,
}

impl MetricsConn {
    pub fn new(addr: SocketAddr, path: &str) -> MetricsConn {
        MetricsConn {
            addr,
            hostport: addr.to_string(),
            path: path.to_string(),
            sender: None,
            last_len: 0,
        }
    }

    /// Drops the connection (the next fetch opens a new one).
    pub fn close(&mut self) {
        self.sender = None;
    }

    /// The exposition text (invalid UTF-8 replaced), bounded by `timeout` and
    /// [`MAX_METRICS_BYTES`].
    pub async fn fetch(&mut self, timeout: Duration) -> Result<String, String> {
        let exchange = async {
            // A kept-alive connection the pod closed meanwhile fails without an answer: once
            // more on a new one (a GET, safe to repeat).
            let reused = self.sender.as_ref().is_some_and(|s| !s.is_closed());
            match self.exchange().await {
                Err(Failure::Unanswered(_)) if reused => {
                    self.sender = None;
                    self.exchange().await
                }
                r => r,
            }
            .map_err(|f| match f {
                Failure::Unanswered(e) | Failure::Answer(e) => e,
            })
        };
        let result = match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err("timed out".to_string()),
        };
        if result.is_err() {
            self.sender = None;
        }
        result
    }

    async fn exchange(&mut self) -> Result<String, Failure> {
        let sender = match &mut self.sender {
            Some(s) if !s.is_closed() => s,
            _ => self
                .sender
                .insert(connect(self.addr).await.map_err(Failure::Answer)?),
        };
        let unanswered = |e: hyper::Error| Failure::Unanswered(e.to_string());
        sender.ready().await.map_err(unanswered)?;
        let req = http::Request::get(self.path.as_str())
            .header(http::header::HOST, self.hostport.as_str())
            .body(Empty::new())
            .map_err(|e| Failure::Answer(e.to_string()))?;
        let mut resp = sender.send_request(req).await.map_err(unanswered)?;
        let failed = |e: String| Err(Failure::Answer(e));
        if !resp.status().is_success() {
            return failed(format!("status {}", resp.status()));
        }
        let declared = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|l| l > MAX_METRICS_BYTES as u64) {
            return failed(TOO_LARGE.into());
        }
        // Read frame by frame: a chunked (or lying) body is cut at the bound, not buffered first.
        let mut buf = Vec::with_capacity(self.last_len);
        let body = resp.body_mut();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::Answer(e.to_string()))?;
            if let Some(chunk) = frame.data_ref() {
                if buf.len() + chunk.len() > MAX_METRICS_BYTES {
                    return failed(TOO_LARGE.into());
                }
                buf.extend_from_slice(chunk);
            }
        }
        self.last_len = buf.len();
        Ok(match String::from_utf8(buf) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// Why an exchange failed: no answer at all (the request may never have left: a kept-alive
/// connection is retried once on a new one), or the answer or a new connection failed.
enum Failure {
    Unanswered(String),
    Answer(String),
}

/// A new HTTP/1.1 connection to `addr`, its driver spawned (it ends when the sender is dropped or
/// the pod closes the connection).
async fn connect(addr: SocketAddr) -> Result<SendRequest<Empty<Bytes>>, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (sender, conn) = http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
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
        let mut conn = MetricsConn::new(addr, "/metrics");
        // A generous timeout: the bound, not the clock, must end the read.
        let err = conn.fetch(Duration::from_secs(60)).await.unwrap_err();
        assert_eq!(err, TOO_LARGE);
    }

    /// A pod answering two scrapes per connection with a `content-length` body, then closing it.
    #[tokio::test]
    async fn the_connection_is_kept_alive_and_reopened_when_the_pod_closes_it() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    for i in 0..2 {
                        let mut req = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !req.ends_with(b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => req.extend_from_slice(&buf[..k]),
                            }
                        }
                        let body = format!("vllm:num_requests_running {}\n", n * 2 + i);
                        let head =
                            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                        if s.write_all((head + &body).as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let mut conn = MetricsConn::new(addr, "/metrics");
        for k in 0..5 {
            let text = conn.fetch(Duration::from_secs(5)).await.unwrap();
            assert_eq!(text, format!("vllm:num_requests_running {k}\n"));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
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

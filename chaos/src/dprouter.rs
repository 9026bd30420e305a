//! A data-parallel pod's primary port, for tests: it reads the rank the EPP chose from the
//! request's `x-data-parallel-host-port` header and hands the connection to that rank (as a DP
//! deployment's front port does). Each connection carries one request (`connection: close` is
//! forced upstream, so the proxy does not reuse it for another rank). A request without the header
//! is answered 421 and counted.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RANK_HEADER: &str = "x-data-parallel-host-port";
const MAX_HEAD: usize = 64 << 10;

#[derive(Debug)]
pub struct RankRouter {
    pub addr: SocketAddr,
    /// The rank each request was handed to, in arrival order; `None`: it named none.
    pub routed: Arc<Mutex<Vec<Option<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RankRouter {
    /// Listen on 127.0.0.1 at an OS-chosen port.
    pub async fn start() -> anyhow::Result<RankRouter> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let routed = Arc::new(Mutex::new(Vec::new()));
        let log = routed.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    if let Err(e) = forward(conn, &log).await {
                        tracing::debug!(error = %e, "rank router: connection failed");
                    }
                });
            }
        });
        Ok(RankRouter { addr, routed, task })
    }

    pub fn routed(&self) -> Vec<Option<String>> {
        self.routed.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for RankRouter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(mut client: TcpStream, log: &Mutex<Vec<Option<String>>>) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        anyhow::ensure!(buf.len() < MAX_HEAD, "request head too large");
        let mut chunk = [0u8; 4096];
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(()); // an idle connection closed
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])?;
    let mut lines = head.split("\r\n").filter(|l| !l.is_empty());
    let request_line = lines.next().unwrap_or_default();
    let mut rank = None;
    let mut out = format!("{request_line}\r\n");
    for line in lines {
        let name = line.split_once(':').map_or("", |(k, _)| k.trim());
        if name.eq_ignore_ascii_case(RANK_HEADER) {
            rank = line.split_once(':').map(|(_, v)| v.trim().to_string());
        }
        if name.eq_ignore_ascii_case("connection") || name.eq_ignore_ascii_case("keep-alive") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("connection: close\r\n\r\n");
    if let Ok(mut l) = log.lock() {
        l.push(rank.clone());
    }
    let Some(rank) = rank else {
        client
            .write_all(b"HTTP/1.1 421 Misdirected Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await?;
        return Ok(());
    };
    let mut upstream = TcpStream::connect(&rank).await?;
    upstream.write_all(out.as_bytes()).await?;
    upstream.write_all(&buf[head_end..]).await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}

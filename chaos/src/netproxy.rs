//! A controllable TCP link: put a [`LinkProxy`] between two processes and break the link on demand.
//!
//! The proxy listens on an OS-chosen loopback port and forwards every accepted connection to a target
//! that can be set after the proxy starts (so a proxy's address can be handed to a process before the
//! process it should reach exists). Each connection runs as one task with two directions; each direction
//! is a reader that stamps every chunk with the time it arrived and pushes it onto a bounded queue, and a
//! writer that releases a chunk once `arrival + latency` has passed. Latency therefore delays chunks
//! without serialising them (a chunk read while an earlier one waits is not delayed twice), and the
//! bounded queue passes back-pressure to the sender the way a TCP window would.
//!
//! All controls live in one `watch` channel that every connection observes, so they apply at once to
//! connections already open:
//! - [`LinkProxy::partition`] resets every open connection (`SO_LINGER` 0, so peers see
//!   `ECONNRESET` immediately rather than a hang) and resets new ones as soon as they are accepted,
//!   until [`LinkProxy::heal`];
//! - [`LinkProxy::set_latency`] delays every chunk, in each direction, by that much (a round trip
//!   grows by twice the latency);
//! - [`LinkProxy::set_blackhole`] keeps connections open but delivers nothing, the way TCP stalls
//!   while a network drops its packets. Bytes already read are held, not discarded: a real network loses
//!   packets, but TCP retransmits them, so the byte stream the application sees is never corrupted,
//!   only late. Once the queue fills the proxy stops reading, so the sender's writes eventually block.
//!
//! Dropping the proxy aborts its accept task, which owns every connection task (a `JoinSet`), so the
//! listener and every proxied socket close with it.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// How long a connection accepted while no target is set waits for one before it is reset.
pub const TARGET_WAIT: Duration = Duration::from_secs(3);
/// How long connecting to the target may take before the client connection is reset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest chunk read at once.
const CHUNK_BYTES: usize = 16 * 1024;
/// Chunks buffered per direction before the proxy stops reading (back-pressure to the sender).
const QUEUE_CHUNKS: usize = 64;

/// Everything a test can change; observed by every connection through one `watch` channel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Control {
    target: Option<SocketAddr>,
    partitioned: bool,
    blackhole: bool,
    latency: Duration,
    /// Set by [`LinkProxy::shutdown`]: stop accepting and close every connection.
    closing: bool,
}

#[derive(Debug, Default)]
struct Counters {
    bytes_to_upstream: AtomicU64,
    bytes_to_client: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    open: AtomicU64,
}

/// A snapshot of the proxy's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Bytes written to the target (client → upstream).
    pub bytes_to_upstream: u64,
    /// Bytes written back to clients (upstream → client).
    pub bytes_to_client: u64,
    /// Connections accepted on the listener, including those reset because of a partition.
    pub accepted: u64,
    /// Accepted connections reset at once because the link was partitioned.
    pub refused: u64,
    /// Connections currently being proxied (or waiting for a target).
    pub open: u64,
}

/// A TCP proxy on `127.0.0.1:<os-chosen>` whose link can be partitioned, slowed or blackholed.
#[derive(Debug)]
pub struct LinkProxy {
    addr: SocketAddr,
    control: watch::Sender<Control>,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

impl LinkProxy {
    /// Bind `127.0.0.1:0` and start serving in a background task (needs a tokio runtime). No target
    /// is set yet: see [`LinkProxy::set_target`].
    pub async fn start() -> anyhow::Result<LinkProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the link proxy on 127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let (control, observed) = watch::channel(Control::default());
        let counters = Arc::new(Counters::default());
        let task = tokio::spawn(serve(listener, observed, Arc::clone(&counters)));
        Ok(LinkProxy {
            addr,
            control,
            counters,
            task,
        })
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where new connections are forwarded. Connections already proxied keep their upstream;
    /// connections waiting for a target (accepted while none was set) use this one.
    pub fn set_target(&self, target: SocketAddr) {
        self.update(|c| c.target = Some(target));
    }

    /// Reset every open connection and every new one until [`LinkProxy::heal`].
    pub fn partition(&self) {
        self.update(|c| c.partitioned = true);
    }

    /// End a partition: new connections are proxied again (connections reset stay closed).
    pub fn heal(&self) {
        self.update(|c| c.partitioned = false);
    }

    /// Delay every chunk by `latency` in each direction (one-way delay); applies to chunks already
    /// queued. `Duration::ZERO` removes it.
    pub fn set_latency(&self, latency: Duration) {
        self.update(|c| c.latency = latency);
    }

    /// Stall (`true`) or resume (`false`) delivery in both directions while keeping connections open.
    pub fn set_blackhole(&self, on: bool) {
        self.update(|c| c.blackhole = on);
    }

    /// The counters right now.
    pub fn stats(&self) -> LinkStats {
        let c = &self.counters;
        LinkStats {
            bytes_to_upstream: c.bytes_to_upstream.load(Ordering::Relaxed),
            bytes_to_client: c.bytes_to_client.load(Ordering::Relaxed),
            accepted: c.accepted.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            open: c.open.load(Ordering::Relaxed),
        }
    }

    /// Stop serving and wait until the listener and every proxied socket are closed.
    pub async fn shutdown(mut self) {
        self.update(|c| c.closing = true);
        if let Err(error) = (&mut self.task).await {
            tracing::debug!(%error, "link proxy task ended abnormally");
        }
    }

    fn update(&self, change: impl FnOnce(&mut Control)) {
        self.control.send_if_modified(|c| {
            let before = *c;
            change(c);
            *c != before
        });
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        // The accept task owns the listener and the `JoinSet` of connection tasks: aborting it drops
        // them all, which aborts every connection and closes every socket.
        self.task.abort();
    }
}

/// The accept loop; runs until aborted or asked to close (then closes every connection first).
async fn serve(listener: TcpListener, control: watch::Receiver<Control>, counters: Arc<Counters>) {
    let mut connections = JoinSet::new();
    let mut closing = control.clone();
    loop {
        tokio::select! {
            _ = changed_to(&mut closing, |c| c.closing) => break,
            accepted = listener.accept() => {
                let client = match accepted {
                    Ok((client, _)) => client,
                    Err(error) => {
                        // Typically EMFILE; back off instead of spinning on the error.
                        tracing::debug!(%error, "link proxy accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                counters.accepted.fetch_add(1, Ordering::Relaxed);
                if control.borrow().partitioned {
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                    reset(&client);
                    continue;
                }
                connections.spawn(connection(client, control.clone(), Arc::clone(&counters)));
            }
            // Reap finished connections so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // Abort every connection and wait until each task (and so each socket) is gone.
    connections.shutdown().await;
}

/// Counts a connection as open for as long as its task lives (also when the task is aborted).
struct OpenGuard(Arc<Counters>);

impl OpenGuard {
    fn new(counters: Arc<Counters>) -> OpenGuard {
        counters.open.fetch_add(1, Ordering::Relaxed);
        OpenGuard(counters)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Close with RST rather than FIN, so the peer fails at once instead of reading a clean EOF.
fn reset(stream: &TcpStream) {
    if let Err(error) = stream.set_zero_linger() {
        tracing::debug!(%error, "link proxy could not set SO_LINGER 0");
    }
}

/// One proxied connection: wait for a target, connect, forward both ways; reset both sockets if the
/// link is partitioned or anything fails.
async fn connection(
    mut client: TcpStream,
    control: watch::Receiver<Control>,
    counters: Arc<Counters>,
) {
    let _open = OpenGuard::new(Arc::clone(&counters));
    let mut upstream: Option<TcpStream> = None;
    let mut partition = control.clone();
    let outcome = tokio::select! {
        outcome = link(&mut client, &mut upstream, control, &counters) => outcome,
        // Dropping the link future drops every queued chunk; the sockets are reset below.
        _ = changed_to(&mut partition, |c| c.partitioned) => {
            Err(io::Error::new(io::ErrorKind::ConnectionAborted, "link partitioned"))
        }
    };
    if let Err(error) = outcome {
        tracing::debug!(%error, "link proxy connection reset");
        reset(&client);
        if let Some(upstream) = &upstream {
            reset(upstream);
        }
    }
}

async fn link(
    client: &mut TcpStream,
    upstream_slot: &mut Option<TcpStream>,
    mut control: watch::Receiver<Control>,
    counters: &Counters,
) -> io::Result<()> {
    let waited = tokio::time::timeout(
        TARGET_WAIT,
        changed_to(&mut control, |c| c.target.is_some()),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no target set in time"))?;
    let target = control.borrow().target;
    let target = target.filter(|_| waited).ok_or_else(proxy_gone)?;
    let upstream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting to the target"))??;
    // Small writes must not wait for Nagle on top of the configured latency.
    upstream.set_nodelay(true)?;
    client.set_nodelay(true)?;
    let upstream = upstream_slot.insert(upstream);
    let (client_read, client_write) = client.split();
    let (upstream_read, upstream_write) = upstream.split();
    tokio::try_join!(
        direction(
            client_read,
            upstream_write,
            control.clone(),
            &counters.bytes_to_upstream
        ),
        direction(
            upstream_read,
            client_write,
            control,
            &counters.bytes_to_client
        ),
    )?;
    Ok(())
}

/// Wait until `holds` is true of the controls; `false` if the proxy was dropped first. Unlike
/// `watch::Receiver::wait_for` it hands back no `watch::Ref`, which is not `Send` and so must not
/// live across an await in a spawned task.
async fn changed_to(
    control: &mut watch::Receiver<Control>,
    holds: impl FnMut(&Control) -> bool,
) -> bool {
    control.wait_for(holds).await.is_ok()
}

fn proxy_gone() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "link proxy dropped")
}

/// A chunk and when it was read.
struct Chunk {
    read_at: Instant,
    bytes: Vec<u8>,
}

/// One direction: a reader feeding a timestamped queue and a writer draining it. Ends when `from`
/// reaches EOF and everything queued has been delivered (then `to` is shut down, passing the FIN on).
async fn direction<R, W>(
    from: R,
    to: W,
    control: watch::Receiver<Control>,
    forwarded: &AtomicU64,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (queue, queued) = mpsc::channel(QUEUE_CHUNKS);
    tokio::try_join!(
        read_into(from, queue),
        deliver(queued, to, control, forwarded)
    )?;
    Ok(())
}

async fn read_into<R: AsyncRead + Unpin>(
    mut from: R,
    queue: mpsc::Sender<Chunk>,
) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            // EOF: dropping `queue` lets the writer finish once it has delivered the rest.
            return Ok(());
        }
        let chunk = Chunk {
            read_at: Instant::now(),
            bytes: buf[..n].to_vec(),
        };
        if queue.send(chunk).await.is_err() {
            return Ok(());
        }
    }
}

async fn deliver<W: AsyncWrite + Unpin>(
    mut queued: mpsc::Receiver<Chunk>,
    mut to: W,
    mut control: watch::Receiver<Control>,
    forwarded: &AtomicU64,
) -> io::Result<()> {
    while let Some(chunk) = queued.recv().await {
        hold(chunk.read_at, &mut control).await?;
        to.write_all(&chunk.bytes).await?;
        forwarded.fetch_add(chunk.bytes.len() as u64, Ordering::Relaxed);
    }
    to.shutdown().await
}

/// Wait until a chunk read at `read_at` may be delivered: not blackholed and `read_at + latency`
/// passed. Re-evaluated on every control change, so new settings apply to chunks already queued.
async fn hold(read_at: Instant, control: &mut watch::Receiver<Control>) -> io::Result<()> {
    loop {
        let now = *control.borrow_and_update();
        if now.blackhole {
            control.changed().await.map_err(|_| proxy_gone())?;
            continue;
        }
        let due = read_at + now.latency;
        if due <= Instant::now() {
            return Ok(());
        }
        tokio::select! {
            () = tokio::time::sleep_until(due) => return Ok(()),
            changed = control.changed() => changed.map_err(|_| proxy_gone())?,
        }
    }
}

#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `LinkProxy` against a tiny echo server on loopback: forwarding, partition/heal, latency, blackhole,
//! late targets and shutdown. Waits use deadlines; the only sleeps space writes in a latency measurement.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chaos::netproxy::{LinkProxy, TARGET_WAIT};
use chaos::wait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(5);

/// Echoes every byte back; counts the connections it currently holds.
struct Echo {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Echo {
    async fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&open);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                stream.set_nodelay(true).unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                let counter = Arc::clone(&counter);
                connections.spawn(async move {
                    let (mut read, mut write) = stream.split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                    counter.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Echo { addr, open, task }
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect(addr: SocketAddr) -> TcpStream {
    let stream = timeout(DEADLINE, TcpStream::connect(addr))
        .await
        .unwrap()
        .unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Write `msg` and read the same number of bytes back, within the deadline.
async fn roundtrip(stream: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
    stream.write_all(msg).await.unwrap();
    let mut back = vec![0; msg.len()];
    timeout(DEADLINE, stream.read_exact(&mut back))
        .await
        .expect("echo within the deadline")
        .unwrap();
    back
}

/// True once the peer has closed or reset the stream (read gives EOF or an error) within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

async fn proxy_to(echo: &Echo) -> LinkProxy {
    let proxy = LinkProxy::start().await.unwrap();
    proxy.set_target(echo.addr);
    proxy
}

#[tokio::test]
async fn forwards_both_ways_and_counts() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut client = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut client, b"hello").await, b"hello");

    // A payload larger than one chunk, written and read concurrently so no buffer has to hold it all.
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = client.split();
    let mut back = vec![0; payload.len()];
    let (wrote, got) = tokio::join!(
        write.write_all(&payload),
        timeout(DEADLINE, read.read_exact(&mut back))
    );
    wrote.unwrap();
    got.unwrap().unwrap();
    assert!(back == payload, "payload corrupted through the proxy");

    let total = (payload.len() + 5) as u64;
    wait::until("byte counters to match the traffic", DEADLINE, || async {
        let s = proxy.stats();
        s.bytes_to_upstream == total && s.bytes_to_client == total
    })
    .await
    .unwrap();
    let stats = proxy.stats();
    assert_eq!((stats.accepted, stats.refused, stats.open), (1, 0, 1));

    // A clean close propagates: the proxied connection and the upstream one both go away.
    drop(client);
    wait::until("proxy and echo connections to close", DEADLINE, || async {
        proxy.stats().open == 0 && echo.open() == 0
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn partition_resets_open_and_new_connections_until_healed() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut before = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut before, b"ping").await, b"ping");

    proxy.partition();
    assert!(
        closed_within(&mut before, DEADLINE).await,
        "open connection survived the partition"
    );
    wait::until("upstream side to be closed too", DEADLINE, || async {
        echo.open() == 0 && proxy.stats().open == 0
    })
    .await
    .unwrap();

    // New connections are reset at once (a connect may still complete in the kernel's backlog).
    let started = Instant::now();
    if let Ok(mut during) = TcpStream::connect(proxy.addr()).await {
        assert!(
            closed_within(&mut during, DEADLINE).await,
            "connection accepted during the partition was not closed"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refusal should be immediate"
    );
    assert!(proxy.stats().refused >= 1);
    assert_eq!(echo.open(), 0, "a refused connection reached the target");

    proxy.heal();
    let mut after = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut after, b"again").await, b"again");
}

#[tokio::test]
async fn latency_delays_each_direction_of_open_connections() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut client = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut client, b"warm").await, b"warm");

    let latency = Duration::from_millis(200);
    proxy.set_latency(latency);
    let started = Instant::now();
    assert_eq!(roundtrip(&mut client, b"slow").await, b"slow");
    let rtt = started.elapsed();
    assert!(
        rtt >= 2 * latency,
        "round trip {rtt:?} shorter than twice the one-way latency {latency:?}"
    );

    proxy.set_latency(Duration::ZERO);
    let started = Instant::now();
    assert_eq!(roundtrip(&mut client, b"fast").await, b"fast");
    assert!(started.elapsed() < 2 * latency, "latency was not removed");
}

#[tokio::test]
async fn latency_pipelines_chunks_instead_of_serialising_them() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut client = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut client, b"warm").await, b"warm");

    let latency = Duration::from_millis(300);
    let gap = Duration::from_millis(50);
    proxy.set_latency(latency);
    let started = Instant::now();
    for i in 0..4u8 {
        if i > 0 {
            // Spacing, so each message is its own chunk; part of the measurement, not synchronisation.
            tokio::time::sleep(gap).await;
        }
        client.write_all(&[b'a' + i; 8]).await.unwrap();
    }
    let mut back = [0u8; 32];
    timeout(DEADLINE, client.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(&back[24..], &[b'd'; 8]);
    // Queued: the last chunk leaves ~3 gaps + 2 latencies after the start (~750ms). A proxy that
    // slept per chunk would need ~5 latencies (~1500ms).
    assert!(elapsed >= 2 * latency, "{elapsed:?}");
    assert!(
        elapsed < 3 * gap + 2 * latency + Duration::from_millis(350),
        "chunks were serialised: {elapsed:?}"
    );
}

#[tokio::test]
async fn lowering_latency_releases_chunks_already_queued() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut client = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut client, b"warm").await, b"warm");
    proxy.set_latency(Duration::from_secs(60));
    client.write_all(b"queued").await.unwrap();
    let mut back = [0u8; 6];
    assert!(
        timeout(Duration::from_millis(200), client.read_exact(&mut back))
            .await
            .is_err(),
        "a 60s latency let the chunk through"
    );
    proxy.set_latency(Duration::ZERO);
    timeout(DEADLINE, client.read_exact(&mut back))
        .await
        .expect("queued chunk released once latency was lowered")
        .unwrap();
    assert_eq!(&back, b"queued");
}

#[tokio::test]
async fn blackhole_stalls_without_closing_then_resumes() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let mut client = connect(proxy.addr()).await;
    assert_eq!(roundtrip(&mut client, b"before").await, b"before");

    proxy.set_blackhole(true);
    let sent_before = proxy.stats().bytes_to_upstream;
    client.write_all(b"lost?").await.unwrap();
    let mut back = [0u8; 5];
    assert!(
        timeout(Duration::from_millis(300), client.read_exact(&mut back))
            .await
            .is_err(),
        "a read through a blackhole should time out"
    );
    let stats = proxy.stats();
    assert_eq!(
        stats.bytes_to_upstream, sent_before,
        "bytes crossed the blackhole"
    );
    assert_eq!(stats.open, 1, "a blackhole must keep the connection open");
    assert_eq!(echo.open(), 1);

    proxy.set_blackhole(false);
    timeout(DEADLINE, client.read_exact(&mut back))
        .await
        .expect("delivery resumes after the blackhole")
        .unwrap();
    assert_eq!(
        &back, b"lost?",
        "held bytes arrive intact, like TCP retransmits"
    );
    assert_eq!(roundtrip(&mut client, b"after").await, b"after");
}

#[tokio::test]
async fn target_set_after_accept_is_used() {
    let proxy = LinkProxy::start().await.unwrap();
    let mut client = connect(proxy.addr()).await;
    client.write_all(b"early").await.unwrap();
    wait::until("the connection to be accepted", DEADLINE, || async {
        let s = proxy.stats();
        s.accepted == 1 && s.open == 1
    })
    .await
    .unwrap();

    let echo = Echo::start().await;
    proxy.set_target(echo.addr);
    let mut back = [0u8; 5];
    timeout(DEADLINE, client.read_exact(&mut back))
        .await
        .expect("echo once the target is set")
        .unwrap();
    assert_eq!(&back, b"early");
}

#[tokio::test]
async fn connection_without_target_is_dropped_after_the_wait() {
    let proxy = LinkProxy::start().await.unwrap();
    let mut client = connect(proxy.addr()).await;
    let started = Instant::now();
    assert!(
        closed_within(&mut client, TARGET_WAIT + DEADLINE).await,
        "connection without a target hung"
    );
    assert!(started.elapsed() >= TARGET_WAIT, "{:?}", started.elapsed());
    assert_eq!(proxy.stats().open, 0);
}

#[tokio::test]
async fn drop_closes_listener_and_every_proxied_socket() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let addr = proxy.addr();
    let mut client = connect(addr).await;
    assert_eq!(roundtrip(&mut client, b"hi").await, b"hi");

    drop(proxy);
    assert!(closed_within(&mut client, DEADLINE).await);
    wait::until("the upstream connection to close", DEADLINE, || async {
        echo.open() == 0
    })
    .await
    .unwrap();
    wait::until("the listener to close", DEADLINE, || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn shutdown_returns_once_everything_is_closed() {
    let echo = Echo::start().await;
    let proxy = proxy_to(&echo).await;
    let addr = proxy.addr();
    let mut client = connect(addr).await;
    assert_eq!(roundtrip(&mut client, b"hi").await, b"hi");

    proxy.shutdown().await;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "listener still open after shutdown"
    );
    // Every proxied socket is already closed: no waiting needed beyond reading the reset.
    assert!(closed_within(&mut client, Duration::from_millis(500)).await);
    wait::until("the upstream connection to close", DEADLINE, || async {
        echo.open() == 0
    })
    .await
    .unwrap();
}

//! Commit latency and batched throughput of a 3-node cluster on loopback.
//!
//! Durability: every log append is flushed with `sled::Db::flush_async` (fsync) before it is
//! acknowledged, on every node. Run with:
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-consensus cargo bench -p consensus --bench commit
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::Duration;
use std::time::Instant;

use common::Cluster;
use consensus::ConsensusConfig;
use consensus::testkit::LogCommand;
use futures::StreamExt;
use futures::stream::FuturesUnordered;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

async fn sequential(cluster: &Cluster, proposer: u64, n: usize) -> Vec<Duration> {
    let node = cluster.node(proposer);
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        node.propose(LogCommand::append(format!("seq-{proposer}-{i}")))
            .await
            .unwrap();
        lat.push(t.elapsed());
    }
    lat.sort();
    lat
}

fn report(label: &str, lat: &[Duration]) {
    let mean = lat.iter().sum::<Duration>() / lat.len() as u32;
    println!(
        "{label:<40} n={:<6} p50={:>9.3?} p99={:>9.3?} mean={:>9.3?} max={:>9.3?}",
        lat.len(),
        percentile(lat, 0.50),
        percentile(lat, 0.99),
        mean,
        lat[lat.len() - 1]
    );
}

async fn throughput(cluster: &Cluster, proposers: &[u64], total: usize, concurrency: usize) {
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    let before = cluster
        .node(leader)
        .metrics()
        .await
        .last_log_index
        .unwrap_or(0);
    let started = Instant::now();
    let mut futs = FuturesUnordered::new();
    let mut issued = 0usize;
    let mut done = 0usize;
    while done < total {
        while issued < total && futs.len() < concurrency {
            let node = cluster.node(proposers[issued % proposers.len()]);
            let i = issued;
            futs.push(async move { node.propose(LogCommand::append(format!("tp-{i}"))).await });
            issued += 1;
        }
        if let Some(r) = futs.next().await {
            r.unwrap();
            done += 1;
        }
    }
    let elapsed = started.elapsed();
    let after = cluster
        .node(leader)
        .metrics()
        .await
        .last_log_index
        .unwrap_or(0);
    println!(
        "batched: {total} proposals, {concurrency} in flight, proposers {proposers:?}: {elapsed:.3?} \
         = {:.0} commits/s, {} log entries (avg batch {:.1})",
        total as f64 / elapsed.as_secs_f64(),
        after - before,
        total as f64 / (after - before).max(1) as f64
    );
}

/// Production-like timing (the defaults: heartbeat 150 ms, election 750-1500 ms). openraft 0.9
/// uses the heartbeat interval as the AppendEntries timeout, so the tests' 50 ms heartbeat
/// would time out replication under a saturating load with an fsync per append.
fn production_timing(cfg: &mut ConsensusConfig) {
    let defaults = ConsensusConfig::default();
    cfg.heartbeat_interval = defaults.heartbeat_interval;
    cfg.election_timeout_min = defaults.election_timeout_min;
    cfg.election_timeout_max = defaults.election_timeout_max;
}

/// Certificates for [`with_tls`] (`deploy/local/make-test-certs.sh`, needs openssl).
static CERTS: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();

/// [`production_timing`] over mutual TLS, each node's certificate bound to its id (what
/// `epp serve` runs by default).
fn with_tls(cfg: &mut ConsensusConfig) {
    production_timing(cfg);
    let dir = CERTS.get().expect("certificates made").path();
    cfg.tls = Some(consensus::TlsConfig {
        identity: Some("epp-node-{id}".into()),
        ..consensus::TlsConfig::new(
            dir.join(format!("node-{}.pem", cfg.node_id)),
            dir.join(format!("node-{}.key", cfg.node_id)),
            Some(dir.join("ca.pem")),
        )
    });
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/local/make-test-certs.sh"
    );
    let made = std::process::Command::new("bash")
        .arg(script)
        .arg(dir.path())
        .arg("3")
        .status()
        .unwrap();
    assert!(made.success(), "make-test-certs.sh failed");
    CERTS.set(dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    for (transport, tweak) in [
        ("plaintext", production_timing as fn(&mut ConsensusConfig)),
        ("mutual TLS, identities bound", with_tls),
    ] {
        rt.block_on(run(transport, tweak));
    }
}

async fn run(transport: &str, tweak: fn(&mut ConsensusConfig)) {
    let cluster = Cluster::start_with(3, tweak).await;
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    let follower = cluster.follower(leader);
    println!(
        "3 nodes on 127.0.0.1 ({transport}), sled flush (fsync) on every append, heartbeat \
         150 ms, leader = {leader}"
    );
    // Warm up connections and sled.
    sequential(&cluster, leader, 50).await;
    report(
        "single proposal on leader",
        &sequential(&cluster, leader, 1000).await,
    );
    report(
        "single proposal on follower (forwarded)",
        &sequential(&cluster, follower, 1000).await,
    );
    throughput(&cluster, &[leader], 50_000, 1_000).await;
    throughput(&cluster, &[1, 2, 3], 50_000, 1_000).await;
    cluster.shutdown().await;
}

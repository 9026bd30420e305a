//! Peer RPCs over mutual TLS (certificates made at test time by `deploy/local/make-test-certs.sh`,
//! which needs the `openssl` CLI).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::Cluster;
use common::SERIAL;
use consensus::ConsensusConfig;
use consensus::TlsConfig;
use consensus::testkit::LogCommand;

static TLS_DIR: OnceLock<PathBuf> = OnceLock::new();

/// `deploy/local/make-test-certs.sh` (one script for every TLS test): ca.pem, node.pem, node.key.
fn make_certs(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/make-test-certs.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run make-test-certs.sh");
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn with_tls(cfg: &mut ConsensusConfig) {
    let dir = TLS_DIR.get().expect("certs generated");
    cfg.tls = Some(TlsConfig {
        cert_file: dir.join("node.pem"),
        key_file: dir.join("node.key"),
        ca_file: Some(dir.join("ca.pem")),
        server_name: None,
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_elects_and_forwards_over_mutual_tls() {
    let _serial = SERIAL.lock().await;
    // deploy/local/ensure-toolchain.sh installs the openssl CLI; without it this test fails.
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    TLS_DIR.set(certs.path().to_path_buf()).unwrap();

    let cluster = Cluster::start_with(3, with_tls).await;
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    let follower = cluster.follower(leader);
    let out = cluster
        .node(follower)
        .propose(LogCommand::append("over-tls"))
        .await
        .unwrap();
    assert_eq!(out, 1);
    let index = cluster.node(leader).local_read(|_| ()).await.1;
    cluster
        .wait_all_applied(index, Duration::from_secs(10))
        .await;
    for (id, log) in cluster.logs().await {
        assert_eq!(log, vec!["over-tls"], "node {id}");
    }
    cluster.shutdown().await;
}

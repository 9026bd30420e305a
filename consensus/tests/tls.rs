//! Peer RPCs over mutual TLS (certificates generated with the `openssl` CLI at test time).
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

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn make_certs(dir: &Path) {
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n\
         extendedKeyUsage=serverAuth,clientAuth\n\
         basicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            "/CN=consensus-test-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "node.key",
            "-out",
            "node.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "node.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "node.pem",
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
        ],
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

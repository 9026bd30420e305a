//! Three `epp serve` replicas in cluster mode with mutual TLS on the peer port (certificates from
//! `deploy/local/make-test-certs.sh`): they elect a leader and commit heartbeats, and the peer port
//! really speaks TLS (an `openssl s_client` handshake with the CA verifies) — and refuses a client
//! without a certificate or with one from another CA.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::raft::RaftCluster;
use chaos::wait;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_elect_and_commit_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let script = chaos::locate::workspace_root().join("deploy/local/make-test-certs.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let p = |f: &str| dir.path().join(f).display().to_string();
    let (cert, key, ca) = (p("node.pem"), p("node.key"), p("ca.pem"));
    let flags = [
        "--peer-tls-cert",
        cert.as_str(),
        "--peer-tls-key",
        key.as_str(),
        "--peer-tls-ca",
        ca.as_str(),
    ];
    let c = RaftCluster::start_with(3, &endpoints, &flags)
        .await
        .unwrap();
    wait::until(
        "a common leader over TLS",
        Duration::from_secs(15),
        || async { c.agreed_leader(&[1, 2, 3]).await.is_some() },
    )
    .await
    .unwrap();
    let leader = c.agreed_leader(&[1, 2, 3]).await.unwrap();
    let (_, before) = c.leader_and_commit(leader).await.unwrap();
    wait::until("commits continue", Duration::from_secs(10), || async {
        let mut ok = true;
        for id in [1, 2, 3] {
            ok &= c
                .leader_and_commit(id)
                .await
                .is_ok_and(|(_, n)| n > before + 5);
        }
        ok
    })
    .await
    .unwrap();
    let peer = c.replica(1).unwrap().addrs.peer.unwrap().to_string();
    let out = std::process::Command::new("openssl")
        .args([
            "s_client", "-connect", &peer, "-CAfile", &ca, "-cert", &cert, "-key", &key,
        ])
        .args(["-verify_return_error", "-alpn", "h2"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("Verify return code: 0 (ok)"),
        "TLS handshake with the peer port failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A client without a certificate, or with one another CA signed, is refused (TLS 1.2, where
    // the server's refusal ends the handshake itself).
    let other = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(other.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let q = |f: &str| other.path().join(f).display().to_string();
    let (other_cert, other_key) = (q("node.pem"), q("node.key"));
    for client in [None, Some((&other_cert, &other_key))] {
        let mut cmd = std::process::Command::new("openssl");
        cmd.args(["s_client", "-connect", &peer, "-CAfile", &ca, "-tls1_2"]);
        if let Some((cert, key)) = client {
            cmd.args(["-cert", cert, "-key", key]);
        }
        let out = cmd.stdin(std::process::Stdio::null()).output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !out.status.success() && text.contains("alert"),
            "client {:?} was not refused:\n{text}",
            client.map(|c| c.0)
        );
    }
    c.shutdown().await;
}

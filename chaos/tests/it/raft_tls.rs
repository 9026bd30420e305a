//! Three `epp serve` replicas in cluster mode with mutual TLS on the peer port (certificates from
//! `deploy/local/make-test-certs.sh`): they elect a leader and commit heartbeats, and the peer port
//! really speaks TLS (an `openssl s_client` handshake with the CA verifies) — and refuses a client
//! without a certificate or with one from another CA (counted in its metrics); each replica
//! has its own certificate, and a message naming another node than its certificate is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chaos::raft::RaftCluster;
use chaos::wait;
use node::cluster::gossip::pb;
use node::cluster::gossip::pb::prefix_gossip_client::PrefixGossipClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_elect_and_commit_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    chaos::raft::make_test_certs(dir.path(), 5).unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(&endpoints, "pods: []\n").unwrap();
    let p = |f: &str| dir.path().join(f).display().to_string();
    let ca = p("ca.pem");
    // Each replica its own certificate, bound to its id (`epp-node-ID`, the default identity).
    let own: Vec<Vec<String>> = (1..=3)
        .map(|id| {
            vec![
                "--peer-tls-cert".into(),
                p(&format!("node-{id}.pem")),
                "--peer-tls-key".into(),
                p(&format!("node-{id}.key")),
            ]
        })
        .collect();
    let own_refs: Vec<Vec<&str>> = own
        .iter()
        .map(|a| a.iter().map(String::as_str).collect())
        .collect();
    let each: Vec<(u64, &[&str])> = (1..=3)
        .map(|id| (id, own_refs[id as usize - 1].as_slice()))
        .collect();
    let c = RaftCluster::start_with_each(3, &endpoints, &["--peer-tls-ca", ca.as_str()], &each)
        .await
        .unwrap();
    let (cert, key) = (p("node-1.pem"), p("node-1.key"));
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
    chaos::raft::make_test_certs(other.path(), 1).unwrap();
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
    // The refused handshakes show in the replica's metrics.
    let metric = |id: u64, name: &'static str| {
        let c = &c;
        async move {
            let text = c.replica(id).unwrap().metrics().await.unwrap_or_default();
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        }
    };
    wait::until(
        "handshake failures counted",
        Duration::from_secs(5),
        || async { metric(1, "llm_d_epp_cluster_peer_tls_handshake_failures_total").await >= 2.0 },
    )
    .await
    .unwrap();

    // A replica cannot speak for another on the application services either: gossip naming
    // node 1 sent with node 2's certificate is refused; naming node 2, heard.
    let read = |f: &str| std::fs::read(dir.path().join(f)).unwrap();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read("ca.pem")))
        .identity(tonic::transport::Identity::from_pem(
            read("node-2.pem"),
            read("node-2.key"),
        ))
        .domain_name("epp-node-3");
    let target = c.replica(3).unwrap().addrs.peer.unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{target}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut gossip = PrefixGossipClient::new(channel);
    let from = |from: u64| pb::Deltas {
        from,
        ..pb::Deltas::default()
    };
    let refused = gossip.push(from(1)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    gossip.push(from(2)).await.unwrap();
    wait::until("the refusal counted", Duration::from_secs(5), || async {
        metric(
            3,
            "llm_d_epp_cluster_peer_refused_total{service=\"gossip\"}",
        )
        .await
            == 1.0
    })
    .await
    .unwrap();
    c.shutdown().await;
}

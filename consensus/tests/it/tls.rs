//! Peer RPCs over mutual TLS with node identities bound to certificates (certificates made at
//! test time by `deploy/local/make-test-certs.sh`, which needs the `openssl` CLI): a cluster
//! forms and forwards; an RPC acting as another node than its certificate names is refused, and
//! so is a server answering for another node; a node refuses to start with a certificate that
//! is not its own; changed files are used for new connections, invalid ones are not.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::common::Cluster;
use crate::common::Node;
use crate::common::SERIAL;
use consensus::ConsensusConfig;
use consensus::TlsConfig;
use consensus::TypeConfig;
use consensus::codec;
use consensus::network::proto::Frame;
use consensus::network::proto::raft_peer_client::RaftPeerClient;
use consensus::testkit::LogCommand;
use consensus::testkit::LogMachine;
use consensus::types::Vote;
use openraft::raft::AppendEntriesRequest;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tonic::Code;
use tonic::transport::Certificate;
use tonic::transport::Channel;
use tonic::transport::ClientTlsConfig;
use tonic::transport::Endpoint;
use tonic::transport::Identity;

const IDENTITY: &str = "epp-node-{id}";

/// `deploy/local/make-test-certs.sh DIR`: ca.pem, node-ID.pem/.key (names epp-node-ID) for
/// ID 1..5, node.pem/.key (localhost only).
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

/// One certificate set for the tests that share it (made once, by the first).
fn certs() -> &'static Path {
    static DIR: OnceLock<TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        // deploy/local/ensure-toolchain.sh installs the openssl CLI; without it this fails.
        let dir = tempfile::tempdir().unwrap();
        make_certs(dir.path());
        dir
    })
    .path()
}

fn node_tls(dir: &Path, id: u64) -> TlsConfig {
    TlsConfig {
        identity: Some(IDENTITY.into()),
        ..TlsConfig::new(
            dir.join(format!("node-{id}.pem")),
            dir.join(format!("node-{id}.key")),
            Some(dir.join("ca.pem")),
        )
    }
}

fn with_identities(cfg: &mut ConsensusConfig) {
    cfg.tls = Some(node_tls(certs(), cfg.node_id));
}

/// A raw peer client presenting `cert` (`node-2`, `node`, ...) from `dir`, expecting the
/// server's certificate to carry `server_name`.
async fn raw_client(
    dir: &Path,
    cert: &str,
    addr: &str,
    server_name: &str,
) -> Result<RaftPeerClient<Channel>, tonic::transport::Error> {
    let read = |f: String| std::fs::read(dir.join(f)).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem".into())))
        .identity(Identity::from_pem(
            read(format!("{cert}.pem")),
            read(format!("{cert}.key")),
        ))
        .domain_name(server_name);
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(RaftPeerClient::new(channel))
}

/// An AppendEntries heartbeat claiming to come from leader `leader` in term 0 (stale: a real
/// node answers it with its higher vote and changes nothing).
fn heartbeat_from(leader: u64) -> Frame {
    let rpc = AppendEntriesRequest::<TypeConfig<LogMachine>> {
        vote: Vote::new_committed(0, leader),
        prev_log_id: None,
        entries: Vec::new(),
        leader_commit: None,
    };
    Frame {
        data: codec::encode(&rpc).unwrap().into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_elects_and_forwards_over_mutual_tls() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start_with(3, with_identities).await;
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
    for id in 1..=3 {
        let tls = cluster.node(id).metrics().await.peer_tls.unwrap();
        assert_eq!(tls.refused, 0, "node {id}: {tls:?}");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpcs_must_come_from_the_node_they_name() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start_with(3, with_identities).await;
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    let follower = cluster.follower(leader);
    let other = (1..=3).find(|i| *i != leader && *i != follower).unwrap();
    let dir = certs();
    let at = |id: u64| cluster.addrs[&id].clone();
    let name = |id: u64| format!("epp-node-{id}");

    // AppendEntries naming the leader: from the leader's certificate it is heard (and answered
    // with the follower's higher vote); from another member's, refused.
    let mut own = raw_client(
        dir,
        &format!("node-{leader}"),
        &at(follower),
        &name(follower),
    )
    .await
    .unwrap();
    own.append_entries(heartbeat_from(leader)).await.unwrap();
    let mut impostor = raw_client(
        dir,
        &format!("node-{other}"),
        &at(follower),
        &name(follower),
    )
    .await
    .unwrap();
    let refused = impostor
        .append_entries(heartbeat_from(leader))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(&name(leader)), "{refused:?}");

    // Forwarded writes only from members: not from a certificate bound to no node (localhost
    // only), nor from a node that is not in the cluster (5).
    let batch = Frame {
        data: codec::encode(&consensus::Batch::new(vec![LogCommand::append("x")]))
            .unwrap()
            .into(),
    };
    for cert in ["node", "node-5"] {
        let mut c = raw_client(dir, cert, &at(leader), &name(leader))
            .await
            .unwrap();
        let e = c.client_write(batch.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{cert}: {e:?}");
        // Status is read-only: any certificate the CA signed may ask.
        c.status(Frame::default()).await.unwrap();
    }
    assert!(cluster.logs().await.values().all(Vec::is_empty));
    let refusals = |m: consensus::ConsensusMetrics| m.peer_tls.unwrap().refused;
    assert!(refusals(cluster.node(follower).metrics().await) >= 1);
    assert!(refusals(cluster.node(leader).metrics().await) >= 2);

    // A server answering for another node: node 4 holds node 5's certificate (and binds no
    // identity itself, so it starts). The leader dials 4 expecting `epp-node-4` and never
    // completes a handshake, so the learner gets no log.
    cluster.tweak = |cfg| {
        cfg.tls = Some(TlsConfig {
            identity: None,
            ..node_tls(certs(), 5)
        });
    };
    cluster.start_joiner(4).await;
    cluster
        .node(leader)
        .add_learner(4, cluster.addrs[&4].clone(), false)
        .await
        .unwrap();
    cluster
        .node(leader)
        .propose(LogCommand::append("members-only"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let logs = cluster.logs().await;
    assert_eq!(logs[&4], Vec::<String>::new(), "{logs:?}");
    assert_eq!(logs[&leader], vec!["members-only"]);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_writes_only_for_itself() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start_with(3, with_identities).await;
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    let follower = cluster.follower(leader);
    let other = (1..=3).find(|i| *i != leader && *i != follower).unwrap();
    let write = |node: u64, value: &str| Frame {
        data: codec::encode(&consensus::Batch::new(vec![
            LogCommand::append(format!("{value} (plain)")),
            LogCommand::AppendAs {
                node,
                value: value.into(),
            },
        ]))
        .unwrap()
        .into(),
    };
    let mut c = raw_client(
        certs(),
        &format!("node-{follower}"),
        &cluster.addrs[&leader],
        &format!("epp-node-{leader}"),
    )
    .await
    .unwrap();
    // A member's certificate, a command acting for another member: the whole batch is refused.
    let e = c.client_write(write(other, "forged")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message()
            .contains(&format!("ClientWrite for node {other}")),
        "{e:?}"
    );
    c.client_write(write(follower, "own")).await.unwrap();
    // The same through the node API: a follower's proposals are forwarded to the leader.
    let node = cluster.node(follower);
    node.propose(LogCommand::AppendAs {
        node: follower,
        value: "proposed".into(),
    })
    .await
    .unwrap();
    let forged = node
        .propose(LogCommand::AppendAs {
            node: other,
            value: "forged".into(),
        })
        .await;
    let refused = format!("{:?}", forged.unwrap_err());
    assert!(
        refused.contains(&format!("ClientWrite for node {other}")),
        "{refused}"
    );
    let index = cluster.node(leader).local_read(|_| ()).await.1;
    cluster
        .wait_all_applied(index, Duration::from_secs(10))
        .await;
    for (id, log) in cluster.logs().await {
        assert_eq!(log, vec!["own (plain)", "own", "proposed"], "node {id}");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_to_start_with_a_certificate_not_its_own() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = common::config(1, &dir, &Default::default());
    cfg.tls = Some(TlsConfig {
        identity: Some(IDENTITY.into()),
        ..node_tls(certs(), 2)
    });
    let e = Node::start(cfg, listener).await.err().expect("started");
    assert!(
        e.to_string()
            .contains("not valid for this node's identity `epp-node-1`"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_certificate_files_apply_to_new_connections() {
    let _serial = SERIAL.lock().await;
    static FILES: OnceLock<PathBuf> = OnceLock::new();
    let files = tempfile::tempdir().unwrap();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    make_certs(a.path());
    make_certs(b.path());
    let install = |from: &Path| {
        for (src, dst) in [("node-1.pem", "node.pem"), ("node-1.key", "node.key")] {
            std::fs::copy(from.join(src), files.path().join(dst)).unwrap();
        }
        std::fs::copy(from.join("ca.pem"), files.path().join("ca.pem")).unwrap();
    };
    install(a.path());
    FILES.set(files.path().to_path_buf()).unwrap();
    let cluster = Cluster::start_with(1, |cfg| {
        let dir = FILES.get().unwrap();
        cfg.tls = Some(TlsConfig {
            identity: Some(IDENTITY.into()),
            reload_interval: Duration::from_millis(100),
            ..TlsConfig::new(
                dir.join("node.pem"),
                dir.join("node.key"),
                Some(dir.join("ca.pem")),
            )
        });
    })
    .await;
    let addr = cluster.addrs[&1].clone();
    let works = |set: &Path| {
        let (set, addr) = (set.to_path_buf(), addr.clone());
        async move {
            match raw_client(&set, "node-1", &addr, "epp-node-1").await {
                Ok(mut c) => c.status(Frame::default()).await.is_ok(),
                Err(_) => false,
            }
        }
    };
    assert!(works(a.path()).await, "the first CA's client");
    assert!(
        !works(b.path()).await,
        "another CA's client before the change"
    );

    // Rotate to the second CA's material: new connections use it.
    install(b.path());
    common::within(Duration::from_secs(5), "the new material in use", async {
        while !works(b.path()).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        !works(a.path()).await,
        "the old CA's client after the change"
    );
    let stats = cluster.node(1).metrics().await.peer_tls.unwrap();
    assert_eq!(stats.reloads, 1, "{stats:?}");

    // A broken certificate file is not loaded: the node keeps serving with what it had.
    std::fs::write(files.path().join("node.pem"), "not a certificate").unwrap();
    common::within(Duration::from_secs(5), "the failed reload counted", async {
        while cluster
            .node(1)
            .metrics()
            .await
            .peer_tls
            .unwrap()
            .reload_failures
            == 0
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(works(b.path()).await, "still serving after a bad file");
    cluster.shutdown().await;
}

/// The peer port holds at most 256 TLS handshakes in progress: connections that never speak
/// (each would hold a task and a TLS state for the 10 s handshake timeout) past that are closed
/// at once and counted as failed handshakes; the cluster keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_past_the_handshake_limit_are_closed_at_once() {
    use tokio::io::AsyncReadExt;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start_with(1, with_identities).await;
    let addr = cluster.addrs[&1].clone();
    let mut silent = Vec::new();
    for _ in 0..300 {
        silent.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    // Those past the limit see their connection closed well before the handshake timeout.
    let mut closed = 0;
    for s in &mut silent {
        let mut b = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(20), s.read(&mut b)).await
        {
            closed += 1;
        }
    }
    assert!(closed >= 300 - 256, "{closed} of 300 closed");
    assert!(
        closed < 300,
        "the first 256 wait for their handshake: {closed} closed"
    );
    let tls = cluster.node(1).metrics().await.peer_tls.unwrap();
    assert!(tls.handshake_failures >= 44, "{tls:?}");
    drop(silent);
    // The silent ones gone, the node still commits.
    let out = cluster
        .node(1)
        .propose(LogCommand::append("after"))
        .await
        .unwrap();
    assert_eq!(out, 1);
    cluster.shutdown().await;
}

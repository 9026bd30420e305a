//! Where the rendered StatefulSet's replicas run on this machine: the pool, the peer TLS
//! material each pod's volume would hold, the peer ports; Raft as the replicas report it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use chaos::chart::container_args;
use chaos::epp::EppProcess;
use node::cluster::gossip::pb::prefix_gossip_client::PrefixGossipClient;
use serde_json::{Value, json};
use sim::kubeapi::FakeKube;
use sim::{Sim, SimConfig};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::{FULL, NS, epp_container, pod_spec};

/// Ordinals the tests may run (the certificates and peer ports are made for these).
const MAX_ORDINALS: usize = 5;

/// What the StatefulSet's replicas need around them: the pool (one simulated pod listed by the
/// fake API server), a CA (and the shared peer TLS Secret's files), a volume directory per pod,
/// a loopback port per ordinal for its peer port.
pub(super) struct Site {
    _sim: Sim,
    _kube: FakeKube,
    pub(super) dir: tempfile::TempDir,
    kubeconfig: std::path::PathBuf,
    pub(super) peer_ports: Vec<u16>,
    /// The simulated pod's address: where every replica must route.
    pub(super) pod: String,
}

impl Site {
    pub(super) async fn new() -> Site {
        let sim = Sim::start(SimConfig {
            pods: 1,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let pod_addr = sim.pods()[0].addr;
        let kube = FakeKube::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        kube.write_kubeconfig(&kubeconfig, NS).unwrap();
        kube.apply(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": pod_addr.port()}],
                     "endpointPickerRef": {"name": FULL, "port": {"number": 9002}}},
        }))
        .unwrap();
        kube.apply(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vllm-a", "namespace": NS, "labels": {"app": "vllm"}},
            "status": {"phase": "Running", "podIP": pod_addr.ip().to_string(),
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap();
        // The peer TLS Secret's files (ca.pem, node-<id>.pem/.key), as the chart documents.
        chaos::raft::make_test_certs(&dir.path().join("peer-tls"), MAX_ORDINALS as u64).unwrap();
        let peer_ports = free_ports(MAX_ORDINALS);
        Site {
            _sim: sim,
            _kube: kube,
            dir,
            kubeconfig,
            peer_ports,
            pod: pod_addr.to_string(),
        }
    }

    /// What replica `ordinal` of the rendered StatefulSet runs, on this machine: the
    /// container's arguments with Kubernetes' `$(VAR)`s, minus the fixed ports `EppProcess`
    /// chooses itself, the Secret's and the PVC's mount paths pointed at local directories, its
    /// own peer port, and the peers' DNS names routed to their loopback ports.
    pub(super) fn args(&self, container: &Value, ordinal: usize, certs: &Path) -> Vec<String> {
        let pod = format!("{FULL}-{ordinal}");
        let args = container_args(container, &[("POD_NAME", &pod), ("POD_NAMESPACE", NS)]);
        assert_eq!(args[0], "serve");
        let mut out: Vec<String> = args[1..]
            .iter()
            .filter(|a| {
                !["--grpc-port=", "--grpc-health-port=", "--metrics-port="]
                    .iter()
                    .any(|p| a.starts_with(p))
            })
            .map(|a| {
                if a.starts_with("--peer-port=") {
                    format!("--peer-port={}", self.peer_ports[ordinal])
                } else if a.starts_with("--data-dir=") {
                    format!(
                        "--data-dir={}",
                        self.dir.path().join("pvc").join(&pod).display()
                    )
                } else {
                    a.replace("/etc/epp/peer-tls/", &format!("{}/", certs.display()))
                }
            })
            .collect();
        let routes: Vec<String> = self
            .peer_ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{FULL}-{i}.{FULL}-peers.{NS}.svc:9004=127.0.0.1:{p}"))
            .collect();
        out.push(format!("--peer-routes={}", routes.join(",")));
        out
    }

    /// What replica `ordinal` finds in its `peer-tls` volume as rendered in `docs`: the shared
    /// Secret's files (every node's key), or — the csi-driver's — a key pair of its own, issued
    /// afresh by the CA for exactly the DNS names the volume's attributes ask for (with the
    /// pod's name and namespace put in, as the driver does), and nothing else.
    pub(super) fn peer_tls(&self, docs: &[Value], ordinal: usize) -> PathBuf {
        let volumes = pod_spec(docs)["volumes"].as_array().unwrap();
        let volume = volumes.iter().find(|v| v["name"] == "peer-tls").unwrap();
        let shared = self.dir.path().join("peer-tls");
        if volume["secret"].is_object() {
            return shared;
        }
        let csi = &volume["csi"];
        assert_eq!(csi["driver"], "csi.cert-manager.io", "{volume}");
        let pod = format!("{FULL}-{ordinal}");
        let names = csi["volumeAttributes"]["csi.cert-manager.io/dns-names"]
            .as_str()
            .unwrap()
            .replace("${POD_NAME}", &pod)
            .replace("${POD_NAMESPACE}", NS);
        let names: Vec<&str> = names.split(',').collect();
        let out = self.dir.path().join("csi").join(&pod);
        let _ = std::fs::remove_dir_all(&out);
        chaos::raft::issue_pod_cert(&shared, &out, &names).unwrap();
        out
    }

    /// A gossip client to pod `to`'s peer port holding pod `with`'s key pair (its `peer-tls`
    /// volume as last issued), expecting `to`'s name in the server's certificate.
    pub(super) async fn gossip_as(&self, with: usize, to: usize) -> PrefixGossipClient<Channel> {
        let dir = self.dir.path().join("csi").join(format!("{FULL}-{with}"));
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.crt")))
            .identity(Identity::from_pem(read("tls.crt"), read("tls.key")))
            .domain_name(format!("{FULL}-{to}.{FULL}-peers.{NS}.svc"));
        let target = format!("https://127.0.0.1:{}", self.peer_ports[to]);
        let channel = Endpoint::from_shared(target)
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap();
        PrefixGossipClient::new(channel)
    }

    /// Starts replica `ordinal` as rendered in `docs`.
    pub(super) async fn start(&self, docs: &[Value], ordinal: usize) -> EppProcess {
        let tls = self.peer_tls(docs, ordinal);
        let args = self.args(epp_container(docs), ordinal, &tls);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        EppProcess::start_kube(&self.kubeconfig, &a).await.unwrap()
    }

    /// Until `replica` routes to the pool's pod.
    pub(super) async fn routes(&self, replica: &EppProcess, what: &str) {
        chaos::wait::until(what, Duration::from_secs(10), || async {
            chaos::extproc::pick(replica.addrs.ext_proc, None)
                .await
                .is_ok_and(|d| d == self.pod)
        })
        .await
        .unwrap();
    }
}

/// `n` loopback ports free now, below the OS's ephemeral range (32768 and up on Linux): the
/// peer ports must be known before the replicas start, and a port the OS hands out to another
/// process's `:0` bind meanwhile would make a replica fail to bind.
fn free_ports(n: usize) -> Vec<u16> {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut out = Vec::new();
    while out.len() < n {
        let port = rng.random_range(20000..32000);
        if !out.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            out.push(port);
        }
    }
    out
}

/// Raft as replica `epp` sees it: (leader, voters, last log index, commit index).
pub(super) async fn raft(epp: &EppProcess) -> Option<(u64, Vec<u64>, u64, u64)> {
    let v = epp.cluster_view().await.ok()?;
    let m = &v["raft"]["metrics"];
    let voters = m["voters"]
        .as_array()?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    Some((
        m["leader"].as_u64()?,
        voters,
        m["last_log_index"].as_u64()?,
        m["commit_index"].as_u64()?,
    ))
}

/// How long a cluster of the rendered replicas may take to form.
pub(super) const FORM_WITHIN: Duration = Duration::from_secs(30);

/// Until every replica agrees on one leader among exactly `voters` and has committed past
/// `after` (the liveness heartbeats commit every 500 ms: the cluster is writing), within
/// `within`; the smallest commit index then. On failure, each replica's Raft metrics are shown
/// (state, term, vote, log): what a replica that never joined was doing.
pub(super) async fn formed(
    replicas: &[&EppProcess],
    voters: &[u64],
    after: u64,
    within: Duration,
    what: &str,
) -> u64 {
    let deadline = std::time::Instant::now() + within;
    loop {
        let mut views = Vec::new();
        for r in replicas {
            views.extend(raft(r).await);
        }
        if views.len() == replicas.len() {
            let leader = views[0].0;
            if views
                .iter()
                .all(|(l, v, _, c)| *l == leader && v == voters && *c > after)
            {
                return views.iter().map(|v| v.3).min().unwrap_or(0);
            }
        }
        if std::time::Instant::now() >= deadline {
            let mut raw = Vec::new();
            for r in replicas {
                raw.push(match r.cluster_view().await {
                    Ok(v) => v["raft"]["metrics"].to_string(),
                    Err(e) => format!("no view: {e}"),
                });
            }
            panic!(
                "{what}: the replicas do not agree on a leader of voters {voters:?} committing \
                 past {after}: {views:?}; their Raft metrics: {raw:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

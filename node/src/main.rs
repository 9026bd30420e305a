//! `epp`: the endpoint picker binary. A thin shell over [`node::serve`].

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use node::config::parse_duration;
use node::serve::{DiscoverySource, ServeOptions, load_config, serve};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    name = "epp",
    version,
    about = "Active-Active endpoint picker for LLM inference gateways"
)]
struct Cli {
    /// Log filter (error, warn, info, debug, trace, or a tracing directive list).
    #[arg(long, global = true, default_value = "info", env = "EPP_LOG")]
    log_level: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a replica: ext_proc gRPC, gRPC health and the admin HTTP server.
    Serve(Box<ServeArgs>),
    /// Operate a cluster through a replica's admin port.
    Cluster {
        /// Admin URL of any replica, e.g. http://127.0.0.1:9090
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// The replicas' admin token (their `--admin-token-file`), sent as a bearer token.
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
        #[command(subcommand)]
        op: ClusterCmd,
    },
    /// Print the SHA-256 of an API key as a TenantQuota's `apiKeys[].sha256` wants it (the key
    /// from the argument, else the first line of stdin).
    HashKey { key: Option<String> },
    /// The tenants' usage ledger (per tenant × model × minute) from a replica's admin port.
    Usage {
        /// Admin URL of the replica, e.g. http://127.0.0.1:9090
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// The replica's admin token (its `--admin-token-file`), sent as a bearer token.
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
        /// How far back (e.g. 1h, 30m).
        #[arg(long, default_value = "1h", value_parser = duration)]
        since: Duration,
        #[arg(long, default_value = "table", value_parser = ["table", "json", "csv"])]
        format: String,
    },
    /// "Why this pod?": run the scheduling profiles for a request on a replica as a dry run and
    /// print every candidate's state, each filter's verdict, each scorer's raw and weighted score
    /// and the pick. Nothing is recorded.
    Explain {
        /// Admin URL of the replica, e.g. http://127.0.0.1:9090
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// The replica's admin token (its `--admin-token-file`), sent as a bearer token.
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
        /// The request's path.
        #[arg(long, default_value = "/v1/chat/completions")]
        path: String,
        /// A request header as `name: value` (repeatable): objective, fairness id, tenant key.
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
        /// Print the explanation as JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// The request body: a file, or `-` for stdin.
        body: PathBuf,
    },
    /// Print the CustomResourceDefinitions the EPP reads (YAML; `deploy/crds/crds.yaml`).
    Crds,
    /// Load and validate an EndpointPickerConfig (any accepted apiVersion), print it as
    /// `llm-d.ai/v1` and what it makes the EPP do, and exit.
    ValidateConfig {
        #[arg(long)]
        config_file: Option<PathBuf>,
        #[arg(long)]
        config_text: Option<String>,
    },
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Name of the InferencePool this replica serves: without --endpoints-file its pods are
    /// discovered from it (Kubernetes); always the pool label of the metrics.
    #[arg(long, default_value = "default-pool")]
    pool_name: String,
    /// Namespace of the InferencePool (default: $NAMESPACE or $POD_NAMESPACE, else `default`).
    #[arg(long)]
    pool_namespace: Option<String>,
    /// API group of the InferencePool: `inference.networking.k8s.io` (v1) or the older
    /// `inference.networking.x-k8s.io` (v1alpha2).
    #[arg(long, default_value = "inference.networking.k8s.io")]
    pool_group: node::k8s::PoolGroup,
    /// EndpointPickerConfig YAML file; the built-in default when neither this nor --config-text.
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// EndpointPickerConfig YAML given inline.
    #[arg(long)]
    config_text: Option<String>,
    /// YAML file listing the pool's pods (standalone discovery, instead of the InferencePool);
    /// re-read when it changes.
    #[arg(long)]
    endpoints_file: Option<PathBuf>,
    /// Address every server binds to.
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// ext_proc gRPC port (0 = chosen by the OS).
    #[arg(long, default_value_t = 9002)]
    grpc_port: u16,
    /// gRPC health port.
    #[arg(long, default_value_t = 9003)]
    grpc_health_port: u16,
    /// Admin HTTP port (/metrics, /healthz, /readyz).
    #[arg(long, default_value_t = 9090)]
    metrics_port: u16,
    /// Largest request body buffered; larger requests get 413.
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Request body bytes all streams together may buffer; a chunk over it ends its request
    /// with a retryable 503 (`body-buffer-budget`). At least --max-body-bytes.
    #[arg(long, default_value_t = 1 << 30)]
    max_buffered_body_bytes: usize,
    /// Concurrent ext_proc streams per gRPC connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS);
    /// Envoy opens more connections past it.
    #[arg(long, default_value_t = 1024)]
    max_streams_per_connection: u32,
    /// Ignore the proxy's subset hint (`envoy.lb.subset_hint` request metadata).
    #[arg(long)]
    disable_endpoint_subset_filter: bool,
    /// How long a `/v1/responses` response stays bound to the pod that stored it: a follow-up
    /// naming it as `previous_response_id` goes to that pod.
    #[arg(long, default_value = "1h", value_parser = duration)]
    response_affinity_ttl: Duration,
    /// The most response bindings kept per pod (the newest; each ~130 bytes on every replica).
    #[arg(long, default_value_t = node::datalayer::responses::DEFAULT_PER_POD)]
    response_affinity_per_pod: usize,
    /// How long a pod that left the pool keeps its prefix-index entries and response bindings
    /// (one back within it is still warm); then they are dropped.
    #[arg(long, default_value = "60s", value_parser = duration)]
    forget_departed_after: Duration,
    /// Model-server metrics scrape tick.
    #[arg(long, default_value = "50ms", value_parser = duration)]
    refresh_metrics_interval: Duration,
    /// Metrics older than this are treated as missing.
    #[arg(long, default_value = "2s", value_parser = duration)]
    metrics_staleness_threshold: Duration,
    /// How long a draining replica waits for open streams before it stops.
    #[arg(long, default_value = "30s", value_parser = duration)]
    drain_timeout: Duration,
    /// How long a draining replica keeps answering new streams after turning NOT_SERVING, even
    /// when none is open, so that health checkers stop sending it any before it closes (Envoy's
    /// interval × unhealthy threshold; on Kubernetes, the endpoints' propagation). At most
    /// `--drain-timeout`.
    #[arg(long, default_value = "3s", value_parser = duration)]
    drain_delay: Duration,
    /// YAML file of `InferenceObjective` manifests (name → `spec.priority`), read at start-up.
    #[arg(long)]
    objectives_file: Option<PathBuf>,
    /// YAML file of `InferenceModelRewrite` manifests (model aliases and weighted canary
    /// splits), read at start-up.
    #[arg(long)]
    model_rewrites_file: Option<PathBuf>,
    /// Tenant mode: YAML file of `TenantQuota` resources (API-key hashes, granted fairness id
    /// and objective, per-model limits; `deploy/examples/tenants.yaml`). Client control headers
    /// are then ignored and every request needs a tenant's key (or an anonymous tenant).
    #[arg(long)]
    tenants_file: Option<PathBuf>,
    /// Tenant mode from Kubernetes: the `TenantQuota` objects (`epp.dev/v1alpha1`) of the pool's
    /// namespace, watched and applied live (instead of --tenants-file).
    #[arg(long, conflicts_with = "tenants_file")]
    watch_tenants: bool,
    /// Tenant mode: append one JSON line per settled request (tenant, model, tokens) here — the
    /// billing stream.
    #[arg(long)]
    usage_log: Option<PathBuf>,
    /// File holding the bearer token for mutating admin calls (`POST /debug/cluster/...`) and
    /// unredacted `/debug` views; re-read on every call. Without it only localhost is trusted.
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Tests only (the `test-hooks` feature): shift this replica's wall clock by this many
    /// milliseconds (clock skew).
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true, default_value_t = 0, allow_negative_numbers = true)]
    clock_offset_ms: i64,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Cluster mode: given `--peers` (bootstrap) or `--join`.
#[derive(clap::Args, Debug)]
struct ClusterArgs {
    /// Initial voters `id=host:port,...` (this replica included); the lowest id bootstraps a new
    /// cluster once. Restarted replicas reopen their data directory instead.
    #[arg(long, value_parser = node::cluster::parse_peers)]
    peers: Option<std::collections::BTreeMap<u64, String>>,
    /// Start without bootstrapping: wait to be added (`epp cluster add-learner` on a member).
    #[arg(long)]
    join: bool,
    /// Not a member 3 s after start (a new replica of a grown StatefulSet): ask the --peers to
    /// add this replica, then promote it while the cluster has fewer than 5 voters.
    #[arg(long)]
    auto_join: bool,
    /// Remove (through the leader) a member that --peers no longer names once it has been dead
    /// this long (a StatefulSet scaled down). Off by default.
    #[arg(long, value_parser = duration)]
    remove_departed_after: Option<Duration>,
    /// Tests only (the `test-hooks` feature): the cluster features this replica advertises (a
    /// bit set; default all this build speaks) — fewer stand in for an older build in a rolling
    /// upgrade.
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true, default_value_t = flowctl::cluster::FEATURES)]
    cluster_features: u32,
    /// This replica's Raft node id (stable across restarts).
    #[arg(long, default_value_t = 1)]
    node_id: u64,
    /// The node id from a StatefulSet pod name (`epp-2` → 3: the ordinal + 1), instead of
    /// --node-id.
    #[arg(long, conflicts_with = "node_id", value_parser = node_id_of_pod)]
    node_id_from_pod_name: Option<u64>,
    /// Peer gRPC port (Raft RPCs).
    #[arg(long, default_value_t = 9004)]
    peer_port: u16,
    /// Address peers use to reach this replica (default: the bound peer address).
    #[arg(long)]
    advertise_peer: Option<String>,
    /// Directory of the Raft log and snapshots.
    #[arg(long, default_value = "epp-data")]
    data_dir: PathBuf,
    /// Local dialing overrides `advertised=dialed,...` (e.g. through a proxy).
    #[arg(long, value_parser = node::cluster::parse_routes)]
    peer_routes: Option<std::collections::BTreeMap<String, String>>,
    #[arg(long, default_value = "300ms", value_parser = duration)]
    election_timeout_min: Duration,
    #[arg(long, default_value = "600ms", value_parser = duration)]
    election_timeout_max: Duration,
    /// Raft leader heartbeat (also openraft's replication RPC timeout).
    #[arg(long, default_value = "100ms", value_parser = duration)]
    raft_heartbeat: Duration,
    /// Liveness heartbeat through the log; a member's lease lasts three of them.
    #[arg(long, default_value = "500ms", value_parser = duration)]
    cluster_heartbeat: Duration,
    /// Snapshot the replicated state and compact the log every N entries (default 10000).
    #[arg(long)]
    raft_snapshot_logs: Option<u64>,
    /// Peer TLS: this replica's certificate chain (PEM; `{id}` in the path is the node id, so
    /// one Secret can hold every node's). Needs --peer-tls-key.
    #[arg(long, requires = "peer_tls_key")]
    peer_tls_cert: Option<PathBuf>,
    /// Peer TLS: this replica's private key (PEM; `{id}` as in --peer-tls-cert).
    #[arg(long, requires = "peer_tls_cert")]
    peer_tls_key: Option<PathBuf>,
    /// Peer TLS: CA bundle to verify peers; given, TLS is mutual.
    #[arg(long, requires = "peer_tls_cert")]
    peer_tls_ca: Option<PathBuf>,
    /// Peer TLS: the name expected in peer certificates (default: the peer address's host).
    #[arg(long, requires = "peer_tls_cert")]
    peer_tls_server_name: Option<String>,
    /// Peer TLS: the node identity each replica's certificate must carry, a DNS name with
    /// `{id}` for the node id or `{ordinal}` for the id minus one (certificates named after
    /// StatefulSet pods, e.g. `epp-{ordinal}`). A peer acting as node N (leader, candidate, member) must present
    /// N's certificate; a replica dialing N expects N's name. `none`: any certificate the CA
    /// signed may act as any node (logged as a warning).
    #[arg(long, default_value = "epp-node-{id}", requires = "peer_tls_cert")]
    peer_tls_identity: String,
    /// Peer TLS: how often the certificate, key and CA files are re-read (new connections use
    /// changed material; 0s: never).
    #[arg(long, default_value = "10s", value_parser = duration, requires = "peer_tls_cert")]
    peer_tls_reload: Duration,
    /// Run the peer port in plaintext, unauthenticated: anyone who reaches it can join the
    /// consensus. Cluster mode otherwise requires mutual TLS (--peer-tls-cert, --peer-tls-key,
    /// --peer-tls-ca).
    #[arg(long, conflicts_with = "peer_tls_cert")]
    peer_insecure: bool,
    /// Replicate the approximate prefix index between replicas (`off`: each replica learns only
    /// from the requests it routes, as in llm-d).
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    prefix_replication: bool,
    /// How often routing decisions are sent to the other replicas.
    #[arg(long, default_value = "5ms", value_parser = duration)]
    prefix_gossip_interval: Duration,
    /// Anti-entropy period: digests compared with each peer, differing pods exchanged.
    #[arg(long, default_value = "1s", value_parser = duration)]
    prefix_anti_entropy: Duration,
    /// Replicas that scrape each pod and fan the samples out to the others (rendezvous hashing
    /// over live members); 0 = every replica scrapes every pod.
    #[arg(long, default_value_t = 2)]
    scrape_owners: usize,
    /// Flow control (`flowControl` feature gate) for the whole cluster (one global queue and
    /// in-flight ledger through Raft) or per replica, as llm-d does.
    #[arg(long, default_value = "cluster", value_parser = ["cluster", "replica"])]
    flow_control_scope: String,
    /// Requests the cluster may admit on local credit (no consensus round trip) beyond what the
    /// replicated ledger has seen; split between replicas by demand. 0 = every admission commits.
    /// A replica reports its admissions every ~25 ms, so the credit it needs grows with its
    /// rate (256 carries ~10 000 requests/s on the fast path); with the concurrency detector it
    /// is capped at a quarter of the pool's capacity.
    #[arg(long, default_value_t = 256)]
    flow_credit_slack: u32,
    /// A replica that cannot reach a quorum: `local-share` admits within its last credit (at
    /// least one request at a time), `fail-closed` answers 429.
    #[arg(long, default_value = "local-share")]
    flow_partition: node::cluster::PartitionMode,
    /// Without quorum (`local-share`), how long a request beyond the local share waits for the
    /// cluster to recover (e.g. a leader election) before 429 `rejected-saturated`.
    #[arg(long, default_value = "3s", value_parser = duration)]
    flow_degraded_wait: Duration,
}

/// `NAME-ORDINAL` (a StatefulSet pod) → ordinal + 1.
fn node_id_of_pod(name: &str) -> Result<u64, String> {
    name.rsplit_once('-')
        .and_then(|(_, ordinal)| ordinal.parse::<u64>().ok())
        .and_then(|o| o.checked_add(1))
        .ok_or_else(|| format!("`{name}` is not a StatefulSet pod name (NAME-ORDINAL)"))
}

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        other => Err(format!("expected on or off, got `{other}`")),
    }
}

impl ClusterArgs {
    fn options(self, bind: IpAddr) -> anyhow::Result<Option<node::cluster::ClusterOptions>> {
        if self.peers.is_none() && !self.join {
            return Ok(None);
        }
        match (&self.peer_tls_cert, &self.peer_tls_ca, self.peer_insecure) {
            (_, _, true) => tracing::warn!(
                "PEER PORT IN PLAINTEXT, UNAUTHENTICATED (--peer-insecure): anyone who reaches \
                 it can join the consensus and propose entries; use mutual TLS outside a test"
            ),
            (Some(_), Some(_), false) if self.peer_tls_identity == "none" => tracing::warn!(
                "PEER IDENTITIES NOT BOUND (--peer-tls-identity none): any certificate the CA \
                 signed may act as any node"
            ),
            (Some(_), Some(_), false) => {}
            (Some(_), None, false) => anyhow::bail!(
                "cluster mode authenticates peers: --peer-tls-ca is required with \
                 --peer-tls-cert (or --peer-insecure, explicitly)"
            ),
            (None, _, false) => anyhow::bail!(
                "cluster mode needs mutual TLS on the peer port: --peer-tls-cert, \
                 --peer-tls-key and --peer-tls-ca (deploy/local/make-test-certs.sh makes a test \
                 set), or --peer-insecure to run it in plaintext, unauthenticated"
            ),
        }
        let node_id = self.node_id_from_pod_name.unwrap_or(self.node_id);
        let per_node =
            |p: PathBuf| PathBuf::from(p.to_string_lossy().replace("{id}", &node_id.to_string()));
        Ok(Some(node::cluster::ClusterOptions {
            node_id,
            peer_addr: SocketAddr::new(bind, self.peer_port),
            advertise: self.advertise_peer,
            data_dir: self.data_dir,
            peers: self.peers.unwrap_or_default(),
            peer_routes: self.peer_routes.unwrap_or_default(),
            election_timeout: (self.election_timeout_min, self.election_timeout_max),
            raft_heartbeat: self.raft_heartbeat,
            heartbeat: self.cluster_heartbeat,
            snapshot_logs: self.raft_snapshot_logs,
            tls: match (self.peer_tls_cert, self.peer_tls_key) {
                (Some(cert_file), Some(key_file)) => Some(consensus::TlsConfig {
                    server_name: self.peer_tls_server_name,
                    identity: (self.peer_tls_identity != "none").then_some(self.peer_tls_identity),
                    reload_interval: self.peer_tls_reload,
                    ..consensus::TlsConfig::new(
                        per_node(cert_file),
                        per_node(key_file),
                        self.peer_tls_ca,
                    )
                }),
                _ => None,
            },
            gossip: node::cluster::GossipOptions {
                interval: self.prefix_gossip_interval,
                anti_entropy: self.prefix_anti_entropy,
                ..node::cluster::GossipOptions::default()
            },
            prefix_replication: self.prefix_replication,
            scrape_owners: self.scrape_owners,
            global_flow: self.flow_control_scope == "cluster",
            flow_credit_slack: self.flow_credit_slack,
            flow_partition: self.flow_partition,
            flow_degraded_wait: self.flow_degraded_wait,
            auto_join: self.auto_join,
            remove_departed_after: self.remove_departed_after,
            #[cfg(feature = "test-hooks")]
            features: self.cluster_features,
            #[cfg(not(feature = "test-hooks"))]
            features: flowctl::cluster::FEATURES,
        }))
    }
}

#[derive(clap::Subcommand, Debug)]
enum ClusterCmd {
    /// Raft state and the replicated membership of the replica at --admin (JSON).
    Status,
    /// Members with their liveness (JSON lines).
    Members,
    /// Add a replica as a learner (it catches up from the log or a snapshot).
    AddLearner {
        #[arg(long)]
        id: u64,
        /// Its peer address (host:port).
        #[arg(long)]
        addr: String,
    },
    /// Turn a learner into a voter.
    Promote {
        #[arg(long)]
        id: u64,
    },
    /// Remove a member.
    Remove {
        #[arg(long)]
        id: u64,
    },
    /// Commit no-op probes through the log from the replica at --admin (forwarded to the leader
    /// from a follower) and print their commit latency and rate (JSON).
    Probe {
        #[arg(long, default_value_t = 100)]
        count: u32,
        /// Probes in flight at once (they coalesce into shared log entries).
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
    },
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `epp serve` may export traces: its runtime comes first, the OTLP client lives in it.
    let rt = match &cli.cmd {
        Cmd::Serve(_) => Some(
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?,
        ),
        _ => None,
    };
    let telemetry = {
        let _inside = rt.as_ref().map(tokio::runtime::Runtime::enter);
        node::telemetry::init(&cli.log_level, rt.is_some())?
    };
    match cli.cmd {
        Cmd::Crds => {
            print!("{}", node::k8s::crd::crds_yaml());
            Ok(())
        }
        Cmd::ValidateConfig {
            config_file,
            config_text,
        } => validate_config(config_file, config_text),
        Cmd::HashKey { key } => {
            let key = match key {
                Some(k) => k,
                None => {
                    let mut line = String::new();
                    std::io::stdin()
                        .read_line(&mut line)
                        .context("reading the key from stdin")?;
                    line.trim_end_matches(['\r', '\n']).to_string()
                }
            };
            anyhow::ensure!(!key.is_empty(), "an empty key");
            println!("{}", node::request::tenant::hash_key(&key));
            Ok(())
        }
        Cmd::Usage {
            admin,
            admin_token_file,
            since,
            format,
        } => {
            let token = admin_token(admin_token_file.as_deref())?;
            client_runtime()?.block_on(usage_cmd(&admin, token.as_deref(), since, &format))
        }
        Cmd::Explain {
            admin,
            admin_token_file,
            path,
            headers,
            json,
            body,
        } => {
            let token = admin_token(admin_token_file.as_deref())?;
            let run = explain_run(path, &headers, &body)?;
            client_runtime()?.block_on(explain_cmd(&admin, token.as_deref(), run, json))
        }
        Cmd::Cluster {
            admin,
            admin_token_file,
            op,
        } => {
            let token = admin_token(admin_token_file.as_deref())?;
            client_runtime()?.block_on(cluster_cmd(&admin, token.as_deref(), op))
        }
        Cmd::Serve(args) => {
            let opts = serve_options(*args)?;
            let rt = rt.context("no runtime")?;
            let served = rt.block_on(async move {
                let shutdown = CancellationToken::new();
                let signal = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    signal.cancel();
                });
                serve(
                    opts,
                    |bound| {
                        // One JSON line on stdout so scripts and tests learn the ports.
                        if let Ok(line) = serde_json::to_string(&bound) {
                            println!("{line}");
                        }
                    },
                    shutdown,
                )
                .await
            });
            rt.block_on(async move { telemetry.shutdown() });
            served?;
            Ok(())
        }
    }
}

/// `epp validate-config`: the file as llm-d.ai/v1 (whatever version it was written in), then
/// what it makes the EPP do.
fn validate_config(
    config_file: Option<PathBuf>,
    config_text: Option<String>,
) -> anyhow::Result<()> {
    let opts = options_for_validation(config_file, config_text);
    let cfg = load_config(&opts)?;
    let built = node::scheduling::build(&cfg)?;
    print!("{}", cfg.to_v1_yaml());
    println!("# effective: {}", built.summary);
    if let Some(c) = cfg
        .data_layer
        .as_ref()
        .and_then(|d| d.cross_replica.as_ref())
    {
        println!("# {}", c.explain());
    }
    Ok(())
}

/// The dry run `epp explain` asks for: the path, the headers (`name: value`) and the body (a
/// file, `-` for stdin; JSON when it parses).
fn explain_run(
    path: String,
    headers: &[String],
    body: &std::path::Path,
) -> anyhow::Result<serde_json::Value> {
    let body = if body.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .context("reading the body from stdin")?;
        s
    } else {
        std::fs::read_to_string(body).with_context(|| format!("reading {}", body.display()))?
    };
    let mut hdrs = serde_json::Map::new();
    for h in headers {
        let (k, v) = h
            .split_once(':')
            .with_context(|| format!("header {h:?} is not `name: value`"))?;
        hdrs.insert(k.trim().to_string(), v.trim().into());
    }
    // A body that is not JSON goes as it is: the dry run refuses it as routing would.
    let body =
        serde_json::from_str::<serde_json::Value>(&body).unwrap_or(serde_json::Value::String(body));
    Ok(serde_json::json!({ "path": path, "headers": hdrs, "body": body }))
}

/// `epp serve`'s flags, checked, as the server's options (and the test-only clock offset applied).
fn serve_options(args: ServeArgs) -> anyhow::Result<ServeOptions> {
    if args.refresh_metrics_interval < Duration::from_millis(1) {
        anyhow::bail!("--refresh-metrics-interval must be at least 1ms");
    }
    if args.drain_delay > args.drain_timeout {
        anyhow::bail!(
            "--drain-delay ({:?}) must not exceed --drain-timeout ({:?})",
            args.drain_delay,
            args.drain_timeout
        );
    }
    #[cfg(feature = "test-hooks")]
    if args.clock_offset_ms != 0 {
        tracing::warn!(
            offset_ms = args.clock_offset_ms,
            "this replica's wall clock is shifted (--clock-offset-ms: tests only)"
        );
        consensus::clock::set_offset_ms(args.clock_offset_ms);
    }
    let discovery = match args.endpoints_file {
        Some(path) => DiscoverySource::File(path),
        None => DiscoverySource::Kubernetes(node::k8s::PoolRef {
            name: args.pool_name.clone(),
            namespace: args
                .pool_namespace
                .or_else(|| std::env::var("NAMESPACE").ok())
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .unwrap_or_else(|| "default".into()),
            group: args.pool_group,
        }),
    };
    Ok(ServeOptions {
        pool_name: args.pool_name,
        config_file: args.config_file,
        config_text: args.config_text,
        discovery,
        grpc_addr: SocketAddr::new(args.bind, args.grpc_port),
        health_addr: SocketAddr::new(args.bind, args.grpc_health_port),
        admin_addr: SocketAddr::new(args.bind, args.metrics_port),
        max_body_bytes: args.max_body_bytes,
        max_buffered_body_bytes: args.max_buffered_body_bytes,
        max_streams_per_connection: args.max_streams_per_connection,
        refresh_metrics_interval: args.refresh_metrics_interval,
        metrics_staleness_threshold: args.metrics_staleness_threshold,
        drain_timeout: args.drain_timeout,
        drain_delay: args.drain_delay,
        objectives_file: args.objectives_file,
        model_rewrites_file: args.model_rewrites_file,
        cluster: args.cluster.options(args.bind)?,
        disable_subset_filter: args.disable_endpoint_subset_filter,
        response_affinity_ttl: args.response_affinity_ttl,
        response_affinity_per_pod: args.response_affinity_per_pod,
        forget_departed_after: args.forget_departed_after,
        admin_token_file: args.admin_token_file,
        tenants_file: args.tenants_file,
        watch_tenants: args.watch_tenants,
        usage_log: args.usage_log,
    })
}

/// The admin token a client command sends, from `--admin-token-file`.
fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    file.map(node::admin::read_token)
        .transpose()
        .map_err(|e| anyhow::anyhow!(e))
}

/// A runtime for the commands that call a replica's admin port.
fn client_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

fn options_for_validation(
    config_file: Option<PathBuf>,
    config_text: Option<String>,
) -> ServeOptions {
    let any: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
    ServeOptions {
        pool_name: String::new(),
        config_file,
        config_text,
        discovery: DiscoverySource::File(PathBuf::new()),
        grpc_addr: any,
        health_addr: any,
        admin_addr: any,
        max_body_bytes: 0,
        max_buffered_body_bytes: 0,
        max_streams_per_connection: 1,
        refresh_metrics_interval: Duration::from_millis(50),
        metrics_staleness_threshold: Duration::from_secs(2),
        drain_timeout: Duration::ZERO,
        drain_delay: Duration::ZERO,
        objectives_file: None,
        model_rewrites_file: None,
        cluster: None,
        disable_subset_filter: false,
        response_affinity_ttl: node::datalayer::responses::DEFAULT_TTL,
        response_affinity_per_pod: node::datalayer::responses::DEFAULT_PER_POD,
        forget_departed_after: Duration::from_secs(60),
        admin_token_file: None,
        tenants_file: None,
        watch_tenants: false,
        usage_log: None,
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

async fn cluster_cmd(admin: &str, token: Option<&str>, op: ClusterCmd) -> anyhow::Result<()> {
    let base = admin.trim_end_matches('/');
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let (path, body) = match &op {
        ClusterCmd::Status | ClusterCmd::Members => ("debug/cluster".to_string(), None),
        ClusterCmd::AddLearner { id, addr } => (
            "debug/cluster/add-learner".to_string(),
            Some(serde_json::json!({"id": id, "addr": addr})),
        ),
        ClusterCmd::Promote { id } => (
            "debug/cluster/promote".to_string(),
            Some(serde_json::json!({ "id": id })),
        ),
        ClusterCmd::Remove { id } => (
            "debug/cluster/remove".to_string(),
            Some(serde_json::json!({ "id": id })),
        ),
        ClusterCmd::Probe { count, concurrency } => (
            "debug/cluster/probe".to_string(),
            Some(serde_json::json!({ "count": count, "concurrency": concurrency })),
        ),
    };
    let url = format!("{base}/{path}");
    let req = match body {
        None => client.get(&url),
        Some(b) => client.post(&url).json(&b),
    };
    let text = admin_call(req, &url, token).await?;
    match op {
        ClusterCmd::Members => {
            let v: serde_json::Value = serde_json::from_str(&text)?;
            for m in v["members"].as_array().into_iter().flatten() {
                println!("{m}");
            }
        }
        _ => println!("{text}"),
    }
    Ok(())
}

/// `epp explain`: `POST /debug/schedule`, printed as tables (or the JSON).
async fn explain_cmd(
    admin: &str,
    token: Option<&str>,
    run: serde_json::Value,
    json: bool,
) -> anyhow::Result<()> {
    let url = format!("{}/debug/schedule", admin.trim_end_matches('/'));
    let text = admin_call(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?
            .post(&url)
            .json(&run),
        &url,
        token,
    )
    .await?;
    if json {
        println!("{text}");
    } else {
        let x: node::scheduling::explain::Explanation =
            serde_json::from_str(&text).with_context(|| format!("{url} answered {text}"))?;
        print!("{}", x.render());
    }
    Ok(())
}

/// Send an admin call (with the bearer token, if any); its body, or an error naming the URL and
/// the status.
async fn admin_call(
    mut req: reqwest::RequestBuilder,
    url: &str,
    token: Option<&str>,
) -> anyhow::Result<String> {
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("contacting {url}"))?;
    let status = resp.status();
    let text = resp.text().await?;
    if !status.is_success() {
        anyhow::bail!("{url}: {status}: {text}");
    }
    Ok(text)
}

/// `epp usage`: the ledger rows from `GET /debug/usage`, as a table, JSON lines or CSV.
async fn usage_cmd(
    admin: &str,
    token: Option<&str>,
    since: Duration,
    format: &str,
) -> anyhow::Result<()> {
    let from = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .saturating_sub(since)
        .as_secs();
    let url = format!("{}/debug/usage?since={from}", admin.trim_end_matches('/'));
    let req = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?
        .get(&url);
    let text = admin_call(req, &url, token).await?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let rows = v["rows"].as_array().cloned().unwrap_or_default();
    const COLUMNS: [&str; 11] = [
        "minute",
        "tenant",
        "model",
        "requests",
        "input",
        "output",
        "cached",
        "disconnects",
        "rejected_rpm",
        "rejected_tpm",
        "rejected_concurrency",
    ];
    let cell = |r: &serde_json::Value, c: &str| match &r[c] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    };
    match format {
        "json" => {
            for r in &rows {
                println!("{r}");
            }
        }
        "csv" => {
            println!("{}", COLUMNS.join(","));
            for r in &rows {
                let cells: Vec<String> = COLUMNS
                    .iter()
                    .map(|c| {
                        let s = cell(r, c);
                        if s.contains([',', '"', '\n']) {
                            format!("\"{}\"", s.replace('"', "\"\""))
                        } else {
                            s
                        }
                    })
                    .collect();
                println!("{}", cells.join(","));
            }
        }
        _ => {
            let table: Vec<Vec<String>> = std::iter::once(COLUMNS.map(String::from).to_vec())
                .chain(
                    rows.iter()
                        .map(|r| COLUMNS.iter().map(|c| cell(r, c)).collect()),
                )
                .collect();
            print!("{}", node::scheduling::explain::text_table(&table));
        }
    }
    Ok(())
}

//! `epp serve`: validate everything, bind every port, then run until shutdown.
//!
//! Start-up order (nothing binds before the configuration is valid): config → plugins → endpoints
//! file → listeners → servers. On SIGTERM/SIGINT the replica drains: gRPC health and `/readyz` turn
//! NOT_SERVING so Envoy stops opening streams here, open streams run to completion (bounded by
//! `drain_timeout`), then every server stops.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

use crate::admin::Admin;
use crate::cluster::gate::{GlobalGate, GlobalGateOptions};
use crate::cluster::gossip::Gossip;
use crate::cluster::settle::SettleRelay;
use crate::cluster::{ClusterMember, ClusterOptions};
use crate::config::{ConfigError, EndpointPickerConfig, parse_duration};
use crate::datalayer::Datastore;
use crate::datalayer::discovery::{FileDiscovery, Scraping};
use crate::datalayer::inflight;
use crate::datalayer::responses::ResponseBindings;
use crate::datalayer::scraper::ScrapeConfig;
use crate::dataplane::{ExtProcService, PickerContext};
use crate::k8s::{ObjectWatch, PoolDiscovery, PoolRef};
use crate::metrics::Metrics;
use crate::request::Live;
use crate::request::admission::legacy::LegacyAdmission;
use crate::request::admission::local::FlowGate;
use crate::request::admission::{AdmissionConfig, Gate};
use crate::request::meta::Objectives;
use crate::request::rewrite::ModelRewrites;
use crate::scheduling;

pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Where the pool's pods come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoverySource {
    /// A YAML file listing the pods, re-read when it changes (standalone).
    File(PathBuf),
    /// The pods the `InferencePool` selects (Kubernetes; client from the environment).
    Kubernetes(PoolRef),
}

/// A discovery source ready to run (the file loaded once, or the Kubernetes client built).
enum Discovery {
    File(FileDiscovery, Vec<crate::datalayer::discovery::PodEntry>),
    /// The pool's pods, and its objectives and rewrites unless files give them.
    Kubernetes(Box<(PoolDiscovery, ObjectWatch)>),
}

impl Discovery {
    async fn run(self, stop: CancellationToken) {
        match self {
            Discovery::File(d, initial) => d.run(initial, stop).await,
            Discovery::Kubernetes(k) => {
                let (pods, objects) = *k;
                futures::future::join(pods.run(stop.clone()), objects.run(stop)).await;
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub pool_name: String,
    pub config_file: Option<PathBuf>,
    pub config_text: Option<String>,
    /// Where the pool's pods come from.
    pub discovery: DiscoverySource,
    pub grpc_addr: SocketAddr,
    pub health_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub max_body_bytes: usize,
    /// What all streams together may buffer of request bodies (at least `max_body_bytes`).
    pub max_buffered_body_bytes: usize,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of the ext_proc server.
    pub max_streams_per_connection: u32,
    pub refresh_metrics_interval: Duration,
    pub metrics_staleness_threshold: Duration,
    pub drain_timeout: Duration,
    /// How long a draining replica keeps answering new streams after turning NOT_SERVING, even
    /// with none open: the time its health checkers (Envoy, the endpoints controller) need to
    /// stop sending it any. Part of `drain_timeout`.
    pub drain_delay: Duration,
    pub objectives_file: Option<PathBuf>,
    pub model_rewrites_file: Option<PathBuf>,
    /// Cluster mode (Raft membership with the other replicas); `None` = standalone.
    pub cluster: Option<ClusterOptions>,
    /// Ignore the proxy's subset hint (`--disable-endpoint-subset-filter`).
    pub disable_subset_filter: bool,
    /// How long a Responses-API response stays bound to the pod that stored it
    /// (`--response-affinity-ttl`).
    pub response_affinity_ttl: Duration,
    /// The most response bindings kept per pod, newest first (`--response-affinity-per-pod`).
    pub response_affinity_per_pod: usize,
    /// How long a departed pod keeps its prefix-index entries and response bindings.
    pub forget_departed_after: Duration,
    /// Bearer token for mutating admin calls and unredacted `/debug` views; `None`: only
    /// callers on localhost are authorized (see `admin`).
    pub admin_token_file: Option<PathBuf>,
    /// Tenant mode: `TenantQuota` resources (`--tenants-file`).
    pub tenants_file: Option<PathBuf>,
    /// Tenant mode from the API server's `TenantQuota` objects (`--watch-tenants`).
    pub watch_tenants: bool,
    /// Tenant mode: the per-request JSON-lines usage log (`--usage-log`).
    pub usage_log: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Server(String),
}

/// Where the servers ended up listening (ports may have been chosen by the OS).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct BoundAddrs {
    pub ext_proc: SocketAddr,
    pub health: SocketAddr,
    pub admin: SocketAddr,
    /// The peer gRPC address (cluster mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<SocketAddr>,
}

pub fn load_config(opts: &ServeOptions) -> Result<EndpointPickerConfig, ConfigError> {
    match (&opts.config_file, &opts.config_text) {
        (Some(_), Some(_)) => Err(ConfigError::invalid(
            "--config-file and --config-text are mutually exclusive",
        )),
        (Some(path), None) => EndpointPickerConfig::from_file(&path.display().to_string()),
        (None, Some(text)) => EndpointPickerConfig::from_yaml(text),
        (None, None) => EndpointPickerConfig::builtin_default(),
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { what, addr, source })
}

fn local(l: &TcpListener, what: &'static str, addr: SocketAddr) -> Result<SocketAddr, ServeError> {
    l.local_addr()
        .map_err(|source| ServeError::Bind { what, addr, source })
}

/// Run a replica. `on_bound` is called once every port is bound; `shutdown` starts the drain.
pub async fn serve(
    opts: ServeOptions,
    on_bound: impl FnOnce(BoundAddrs),
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    check_stream_limits(&opts)?;
    let cfg = load_config(&opts)?;
    let built = scheduling::build(&cfg)?;
    tracing::info!(config = %built.summary, "effective configuration");
    if let Some(c) = cfg
        .data_layer
        .as_ref()
        .and_then(|d| d.cross_replica.as_ref())
    {
        tracing::info!(cluster_mode = opts.cluster.is_some(), "{}", c.explain());
    }
    let interval = match &built.metrics_source.interval {
        Some(i) => parse_duration(i)
            .map_err(ConfigError::invalid)?
            .max(opts.refresh_metrics_interval),
        None => opts.refresh_metrics_interval,
    };
    let passthrough = cfg.request_handler.as_ref().is_some_and(|rh| {
        rh.parsers.iter().any(|p| {
            p.plugin_ref == "passthrough-parser"
                || cfg.plugins.iter().any(|s| {
                    s.type_name == "passthrough-parser" && s.instance_name() == p.plugin_ref
                })
        })
    });

    let metrics = Arc::new(Metrics::new(&opts.pool_name));
    // Tenant mode: this replica's own book standalone; the cluster's in cluster mode (its
    // writer and watcher start with the cluster member, below).
    let TenantMode {
        quotas,
        watched: mut watched_tenants,
        cluster_quota,
    } = tenant_mode(&opts, &metrics)?;
    let store = Arc::new(Datastore::new(opts.metrics_staleness_threshold));
    if let Some(tracker) = &built.inflight {
        store.set_ledger(tracker.clone());
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(2)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| ServeError::Server(format!("http client: {e}")))?;
    let renderer = built
        .render
        .clone()
        .map(|backend| crate::request::tokens::Renderer {
            backend,
            client: client.clone(),
            metrics: metrics.clone(),
        });
    let scraping = Scraping {
        store: store.clone(),
        scrape: Arc::new(ScrapeConfig {
            interval,
            timeout: Duration::from_secs(1).max(interval),
            path: built.metrics_source.path.clone(),
        }),
        metrics: metrics.clone(),
    };
    let objectives = Arc::new(Live::new(match &opts.objectives_file {
        Some(path) => Objectives::from_file(path)?,
        None => Objectives::default(),
    }));
    let rewrites = Arc::new(Live::new(match &opts.model_rewrites_file {
        Some(path) => ModelRewrites::from_file(path)?,
        None => ModelRewrites::default(),
    }));
    let discovery = match &opts.discovery {
        DiscoverySource::File(path) => {
            let d = FileDiscovery {
                path: path.clone(),
                poll: Duration::from_millis(250),
                scraping,
            };
            let initial = d.load_initial()?;
            Discovery::File(d, initial)
        }
        DiscoverySource::Kubernetes(pool) => {
            let client = crate::k8s::client().await.map_err(|e| {
                ServeError::Server(format!(
                    "Kubernetes client (KUBECONFIG, ~/.kube/config or in-cluster): {e}"
                ))
            })?;
            // A file given for a kind replaces its watch (as standalone).
            let objects = ObjectWatch {
                client: client.clone(),
                pool: pool.clone(),
                objectives: opts.objectives_file.is_none().then(|| objectives.clone()),
                tenants: watched_tenants.take(),
                rewrites: opts.model_rewrites_file.is_none().then(|| rewrites.clone()),
                metrics: metrics.clone(),
            };
            Discovery::Kubernetes(Box::new((
                PoolDiscovery {
                    pool: pool.clone(),
                    client,
                    scraping,
                },
                objects,
            )))
        }
    };
    // Admission: one gate; the flow gates' background work is started below.
    let Gates {
        gate,
        flow_gate,
        global_gate,
    } = admission_gate(&built, &opts, &store, &metrics)?;

    if let Some(path) = &opts.admin_token_file {
        crate::admin::read_token(path).map_err(ServeError::Server)?;
    }
    let grpc = bind("ext_proc gRPC", opts.grpc_addr).await?;
    let health = bind("gRPC health", opts.health_addr).await?;
    let admin = bind("admin HTTP", opts.admin_addr).await?;
    let peer = match &opts.cluster {
        Some(c) => Some(bind("peer gRPC", c.peer_addr).await?),
        None => None,
    };
    let bound = BoundAddrs {
        ext_proc: local(&grpc, "ext_proc gRPC", opts.grpc_addr)?,
        health: local(&health, "gRPC health", opts.health_addr)?,
        admin: local(&admin, "admin HTTP", opts.admin_addr)?,
        peer: match (&peer, &opts.cluster) {
            (Some(l), Some(c)) => Some(local(l, "peer gRPC", c.peer_addr)?),
            _ => None,
        },
    };
    // Where each stored Responses-API response lives (`previous_response_id` affinity).
    let responses = Arc::new(ResponseBindings::new(
        opts.response_affinity_ttl,
        opts.response_affinity_per_pod,
    ));
    // Cluster mode: the peer exchange (scrape fan-out; the response bindings; prefix-index
    // replication when on and an approximate prefix producer is configured).
    let gossip = opts.cluster.as_ref().map(|c| {
        store.shard.configure(c.node_id, c.scrape_owners);
        let producer = built
            .scheduler
            .prefix_index
            .clone()
            .filter(|_| c.prefix_replication);
        let g = Gossip::new(
            c.node_id,
            producer,
            Some(responses.clone()),
            store.clone(),
            c.gossip.clone(),
            metrics.clone(),
        );
        g.expect_members(c.peers.keys().copied());
        // Sharded KV-event subscriptions: the owners' index changes go to the other replicas.
        if c.scrape_owners > 0
            && let Some(p) = &built.scheduler.precise
        {
            g.replicate_precise(p.clone());
        }
        // Without cluster-wide flow control the replicas share their ledgers' load this way.
        if global_gate.is_none()
            && let Some(tracker) = &built.inflight
        {
            let (feed, view) = inflight::remote_load();
            tracker.connect_remote(view);
            g.share_load(tracker.clone(), feed);
        }
        g
    });
    // Cluster mode: responses observed here for requests another replica charged — its
    // in-flight charge, its replica-scope slot, or its cluster-wide credit admission — are
    // relayed to it (see `cluster::settle`).
    let relay = match &opts.cluster {
        Some(c) if global_gate.is_some() || built.inflight.is_some() || flow_gate.is_some() => {
            Some(SettleRelay::new(
                c.node_id,
                built.inflight.clone(),
                gate.clone(),
                metrics.clone(),
            ))
        }
        _ => None,
    };
    if let (Some(g), Some(r)) = (&global_gate, &relay) {
        g.set_relay(r.sender());
    }
    let cluster = match (peer, &opts.cluster) {
        (Some(listener), Some(c)) => {
            let identity = c
                .tls
                .as_ref()
                .and_then(consensus::network::tls::PeerIdentity::of);
            let mut routes = tonic::service::Routes::default();
            if let Some(g) = &gossip {
                routes = routes
                    .add_service(g.service(identity.clone()))
                    .add_service(g.sample_service(identity.clone()))
                    .add_service(g.precise_service(identity.clone()));
            }
            if let Some(r) = &relay {
                routes = routes.add_service(r.service(identity));
            }
            Some(Arc::new(
                ClusterMember::start(c.clone(), listener, routes)
                    .await
                    .map_err(|e| ServeError::Server(format!("cluster: {e}")))?,
            ))
        }
        _ => None,
    };

    // The precise prefix index's feed: a subscription per pod of the pool, or (centralized mode)
    // one socket the pods publish to.
    let kv_events = match &built.scheduler.precise {
        Some(p) => {
            let central = p.params.kv_events_config.central_endpoint();
            Some(Arc::new(
                crate::datalayer::kvevents::Subscriber::start(
                    p.clone(),
                    p.params.kv_events_config.topic_filter.clone(),
                    p.params.model_name().map(str::to_string),
                    metrics.clone(),
                    central,
                )
                .map_err(|e| ServeError::Server(format!("kv-event subscriber: {e}")))?,
            ))
        }
        None => None,
    };
    let ctx = Arc::new(PickerContext {
        store,
        agent: built.agent,
        scheduler: built.scheduler,
        inflight: built.inflight.clone(),
        metrics: metrics.clone(),
        max_body_bytes: opts.max_body_bytes,
        body_budget: Arc::new(crate::dataplane::BodyBudget::new(
            opts.max_buffered_body_bytes,
            metrics.clone(),
        )),
        passthrough,
        propagate_priority: cfg
            .request_handler
            .as_ref()
            .is_some_and(|rh| rh.propagate_priority),
        draining: AtomicBool::new(false),
        gate,
        objectives,
        subset_filter: !opts.disable_subset_filter,
        responses,
        rewrites,
        relay: relay.as_ref().map(|r| r.sender()),
        node_id: opts.cluster.as_ref().map(|c| c.node_id),
        renderer,
        quotas: quotas.clone(),
    });

    let (reporter, health_svc) = tonic_health::server::health_reporter();
    // Not ready for Envoy until the pool's pods are known (Kubernetes: the first full list),
    // with cluster-wide flow control until the replicated configuration applies, and with
    // `--auto-join` while joining (`ClusterMember::not_ready`).
    let joining = cluster.clone().filter(|m| m.not_ready().is_some());
    let gated = global_gate.is_some() || !ctx.store.synced() || joining.is_some();
    for svc in ["", "liveness", "readiness", EXT_PROC_SERVICE] {
        let status = if gated && (svc == "readiness" || svc == EXT_PROC_SERVICE) {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        reporter.set_service_status(svc, status).await;
    }

    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(discovery.run(stop.clone()).then_ok());
    tasks.spawn(
        crate::scheduling::departed::run(
            ctx.store.clone(),
            ctx.scheduler.prefix_index.clone(),
            ctx.responses.clone(),
            opts.forget_departed_after,
            stop.clone(),
        )
        .then_ok(),
    );
    {
        let svc = ExtProcService::new(ctx.clone());
        let health_svc = health_svc.clone();
        let max_streams = opts.max_streams_per_connection;
        let stop = stop.clone();
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .max_concurrent_streams(max_streams)
                .add_service(health_svc)
                .add_service(ExternalProcessorServer::new(svc))
                .serve_with_incoming_shutdown(nodelay(grpc), stop.cancelled())
                .await
                .map_err(|e| format!("ext_proc server: {e}"))
        });
    }
    {
        let stop = stop.clone();
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(health_svc)
                .serve_with_incoming_shutdown(nodelay(health), stop.cancelled())
                .await
                .map_err(|e| format!("health server: {e}"))
        });
    }
    if let (Some(sub), Some(p)) = (&kv_events, &ctx.scheduler.precise) {
        // Centralized mode in a cluster: a pod's publisher reaches whichever replica its
        // connection lands on; that replica forwards to the pod's owners.
        if let (Some(g), Some(_)) = (&gossip, sub.central_endpoint()) {
            sub.forward_to(g.forward_kv_events(sub.clone(), stop.clone()));
        }
        tasks.spawn(
            crate::datalayer::kvevents::follow(
                sub.clone(),
                p.clone(),
                ctx.store.clone(),
                p.params.kv_events_config.clone(),
                stop.clone(),
            )
            .then_ok(),
        );
    }
    tasks.spawn({
        let state = Arc::new(Admin {
            ctx: ctx.clone(),
            kv_events: kv_events.clone(),
            cluster: cluster.clone(),
            token_file: opts.admin_token_file.clone(),
        });
        let stop = stop.clone();
        async move {
            crate::admin::run(admin, state, stop)
                .await
                .map_err(|e| format!("admin server: {e}"))
        }
    });
    if let Some(tracker) = built.inflight.clone() {
        tasks.spawn(expire_inflight(tracker, stop.clone()).then_ok());
    }
    if let Some(gate) = flow_gate {
        tasks.spawn(gate.run(stop.clone()).then_ok());
    }
    if let (Some(q), Some(member)) = (cluster_quota, cluster.clone()) {
        let stop = stop.clone();
        tasks.spawn(async move {
            q.run(member, stop).await;
            Ok(())
        });
    }
    if let Some(q) = quotas {
        let upkeep = tenant_upkeep(q, opts.tenants_file.clone(), stop.clone());
        tasks.spawn(upkeep.then_ok());
    }
    if let (Some(gate), Some(member)) = (&global_gate, cluster.clone()) {
        let (g, s) = (gate.clone(), stop.clone());
        tasks.spawn(async move {
            g.run(member, s).await;
            Ok(())
        });
    }
    if gated {
        let (gate, store) = (global_gate.clone(), ctx.store.clone());
        let ready = ready_when_able(store, gate, joining, reporter.clone(), stop.clone());
        tasks.spawn(ready.then_ok());
    }
    if let (Some(r), Some(member)) = (relay, cluster.clone()) {
        let stop = stop.clone();
        tasks.spawn(async move {
            r.run(member, stop).await;
            Ok(())
        });
    }
    if let (Some(g), Some(member)) = (gossip, cluster.clone()) {
        let stop = stop.clone();
        tasks.spawn(async move {
            g.run(member, stop).await;
            Ok(())
        });
    }
    if let Some(member) = cluster.clone() {
        let (metrics, stop) = (metrics.clone(), stop.clone());
        let (ext_proc, admin) = (bound.ext_proc.to_string(), bound.admin.to_string());
        tasks.spawn(async move {
            member.run(ext_proc, admin, metrics, stop).await;
            Ok(())
        });
    }
    if let Some(member) = cluster.clone() {
        tasks.spawn(member.reconcile(stop.clone()).then_ok());
    }
    on_bound(bound);
    tracing::info!(ext_proc = %bound.ext_proc, health = %bound.health, admin = %bound.admin, "serving");

    let mut failure = None;
    tokio::select! {
        _ = shutdown.cancelled() => {}
        Some(res) = tasks.join_next() => {
            failure = Some(match res {
                Ok(Ok(())) => "a server stopped unexpectedly".to_string(),
                Ok(Err(e)) => e,
                Err(e) => format!("server task failed: {e}"),
            });
        }
    }

    // Drain: stop advertising, let open streams finish, then stop.
    drain(&ctx, &reporter, &opts, &metrics, failure.is_none()).await;
    // Whatever still waits in the queue gets 503 rejected-shutting-down; give those streams a
    // moment to send that answer (and the cluster writer a moment to report the cancels) before
    // the servers stop.
    let queued = ctx.gate.shutdown();
    if queued > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    drop(ctx);
    if let Some(member) = cluster {
        member.shutdown().await;
    }
    tracing::info!("stopped");
    match failure {
        Some(e) => Err(ServeError::Server(e)),
        None => Ok(()),
    }
}

/// Report ready (for Envoy) once the pool's pods are known, cluster flow control applies and
/// the replica is a member; then idle until shutdown (the task set's "a server stopped" check
/// stays quiet).
async fn ready_when_able(
    store: Arc<Datastore>,
    gate: Option<Arc<GlobalGate>>,
    joining: Option<Arc<ClusterMember>>,
    reporter: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    let joined = || joining.as_ref().is_none_or(|m| m.not_ready().is_none());
    while !(store.synced() && gate.as_ref().is_none_or(|g| g.is_ready()) && joined()) {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    tracing::info!("endpoints known, cluster flow control ready, a member: serving");
    for svc in ["readiness", EXT_PROC_SERVICE] {
        reporter
            .set_service_status(svc, ServingStatus::Serving)
            .await;
    }
    stop.cancelled().await;
}

/// Charges whose response was never observed (lost observe stream) expire after an hour.
async fn expire_inflight(tracker: Arc<inflight::InflightTracker>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                let n = tracker.sweep(Duration::from_secs(3600));
                if n > 0 {
                    tracing::warn!(expired = n, "in-flight charges expired without a response");
                }
            }
        }
    }
}

/// Tenant mode's upkeep: the tenants file is re-read when it changes (key rotation without a
/// restart); holds whose response was never seen go back after an hour; the ledger keeps a day.
async fn tenant_upkeep(
    q: Arc<crate::request::quota::Quotas>,
    path: Option<std::path::PathBuf>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    let mtime = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen = path.as_deref().and_then(mtime);
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        ticks += 1;
        if let Some(path) = &path {
            let now = mtime(path);
            if now != seen {
                seen = now;
                match q.reload(path) {
                    Ok(n) => {
                        tracing::info!(tenants = n, "tenants file re-read");
                        q.reloaded(true);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "tenants file refused; the tenants stay as they were");
                        q.reloaded(false);
                    }
                }
            }
        }
        if ticks.is_multiple_of(30) {
            q.sweep(Duration::from_secs(3600));
        }
    }
}

/// Tenant mode's parts, when `--tenants-file` or `--watch-tenants` turns it on.
struct TenantMode {
    quotas: Option<Arc<crate::request::quota::Quotas>>,
    /// The tenants the Kubernetes watch replaces (`--watch-tenants`).
    watched: Option<Arc<crate::request::Live<crate::request::tenant::Tenants>>>,
    /// Cluster mode: the replicated book (its writer and watcher start with the member).
    cluster_quota: Option<Arc<crate::cluster::quota::ClusterQuota>>,
}

/// Tenant mode from the flags: the tenants, their billing and their quota ledger (this
/// replica's own standalone, the cluster's in cluster mode).
fn tenant_mode(opts: &ServeOptions, metrics: &Arc<Metrics>) -> Result<TenantMode, ServeError> {
    let mut cluster_quota = None;
    let tenant_source = match (&opts.tenants_file, opts.watch_tenants) {
        (Some(path), false) => Some(crate::request::tenant::Tenants::from_file(path)?),
        (None, true) => {
            if !matches!(opts.discovery, DiscoverySource::Kubernetes(_)) {
                return Err(ServeError::Config(ConfigError::invalid(
                    "--watch-tenants reads TenantQuota objects from Kubernetes: it needs pool \
                     discovery (--pool-name without --endpoints-file); standalone, use \
                     --tenants-file",
                )));
            }
            // Every request is refused (401) until the first list arrives.
            Some(crate::request::tenant::Tenants::default())
        }
        (Some(_), true) => {
            return Err(ServeError::Config(ConfigError::invalid(
                "--tenants-file and --watch-tenants are mutually exclusive",
            )));
        }
        (None, false) => {
            if opts.usage_log.is_some() {
                return Err(ServeError::Config(ConfigError::invalid(
                    "--usage-log needs tenant mode (--tenants-file or --watch-tenants)",
                )));
            }
            None
        }
    };
    let mut watched_tenants = None;
    let quotas = match tenant_source {
        Some(t) => {
            let tenants = Arc::new(crate::request::Live::new(t));
            if opts.watch_tenants {
                watched_tenants = Some(tenants.clone());
            }
            tracing::info!(
                tenants = tenants.get().len(),
                cluster = opts.cluster.is_some(),
                "tenant mode: client control headers are ignored"
            );
            let billing = Arc::new(
                crate::request::quota::Billing::new(metrics.clone(), opts.usage_log.as_deref())
                    .map_err(|e| ServeError::Server(format!("--usage-log: {e}")))?,
            );
            let ledger: Arc<dyn crate::request::quota::QuotaLedger> = match &opts.cluster {
                Some(c) => {
                    let q = crate::cluster::quota::ClusterQuota::new(c.node_id, billing.clone());
                    cluster_quota = Some(q.clone());
                    q
                }
                None => Arc::new(crate::request::quota::LocalLedger::new(
                    tenants.clone(),
                    billing.clone(),
                )),
            };
            Some(Arc::new(crate::request::quota::Quotas::new(
                tenants,
                ledger,
                billing,
                metrics.clone(),
            )))
        }
        None => None,
    };
    Ok(TenantMode {
        quotas,
        watched: watched_tenants,
        cluster_quota,
    })
}

/// The admission gate and, when it is one, the flow gate whose background work `serve` starts.
struct Gates {
    gate: Arc<dyn Gate>,
    /// Flow control on this replica.
    flow_gate: Option<Arc<FlowGate>>,
    /// Cluster-wide flow control.
    global_gate: Option<Arc<GlobalGate>>,
}

/// The gate the configuration's admission asks for: the legacy controller, flow control on this
/// replica, or (cluster mode with `--flow-control-scope cluster`) cluster-wide flow control.
fn admission_gate(
    built: &scheduling::registry::Built,
    opts: &ServeOptions,
    store: &Arc<Datastore>,
    metrics: &Arc<Metrics>,
) -> Result<Gates, ServeError> {
    let mut flow_gate = None;
    let mut global_gate = None;
    let gate: Arc<dyn Gate> = match &built.admission {
        AdmissionConfig::Legacy(detector) => Arc::new(LegacyAdmission::new(
            detector.clone(),
            built.inflight.clone(),
            store.clone(),
        )?),
        AdmissionConfig::FlowControl(config) => match &opts.cluster {
            Some(c) if c.global_flow => {
                // The ledger's other replicas' load, published by the gate, read by the tracker.
                let load_feed = built.inflight.as_ref().map(|tracker| {
                    let (feed, view) = inflight::remote_load();
                    tracker.connect_remote(view);
                    feed
                });
                let g = Arc::new(GlobalGate::new(
                    c.node_id,
                    config.as_ref().clone(),
                    GlobalGateOptions {
                        params: flowctl::global::GlobalParams {
                            lease_ms: c.lease_ms(),
                            credit_slack: c.flow_credit_slack,
                            ..flowctl::global::GlobalParams::default()
                        },
                        partition: c.flow_partition,
                        degraded_wait: c.flow_degraded_wait,
                        ..GlobalGateOptions::default()
                    },
                    store.clone(),
                    metrics.clone(),
                    load_feed,
                )?);
                global_gate = Some(g.clone());
                g
            }
            _ => {
                let g = Arc::new(FlowGate::new(
                    config.as_ref().clone(),
                    store.clone(),
                    metrics.clone(),
                )?);
                flow_gate = Some(g.clone());
                g
            }
        },
    };
    Ok(Gates {
        gate,
        flow_gate,
        global_gate,
    })
}

/// Stop advertising (NOT_SERVING everywhere) and, unless a server failed (`settle` false), let
/// open streams finish: at least `--drain-delay`, at most `--drain-timeout`.
async fn drain(
    ctx: &PickerContext,
    reporter: &tonic_health::server::HealthReporter,
    opts: &ServeOptions,
    metrics: &Metrics,
    settle: bool,
) {
    ctx.draining.store(true, Ordering::Relaxed);
    for svc in ["", "readiness", EXT_PROC_SERVICE] {
        reporter
            .set_service_status(svc, ServingStatus::NotServing)
            .await;
    }
    if settle {
        tracing::info!(delay = ?opts.drain_delay, timeout = ?opts.drain_timeout, "draining");
        let start = tokio::time::Instant::now();
        let (settled, deadline) = (start + opts.drain_delay, start + opts.drain_timeout);
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline || (now >= settled && metrics.streams_inflight() == 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Accepted connections with Nagle off: ext_proc answers are small writes that must not wait for
/// the peer's delayed ACK (~40 ms). (tonic's own `tcp_nodelay` applies only to listeners it binds.)
fn nodelay(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|conn| {
        if let Ok(c) = &conn
            && let Err(e) = c.set_nodelay(true)
        {
            tracing::debug!(%e, "set_nodelay failed");
        }
        conn
    })
}

/// The request-body and stream bounds must leave room for the largest request allowed.
fn check_stream_limits(opts: &ServeOptions) -> Result<(), ServeError> {
    if opts.max_buffered_body_bytes < opts.max_body_bytes {
        return Err(ServeError::Config(ConfigError::invalid(format!(
            "--max-buffered-body-bytes ({}) must be at least --max-body-bytes ({}): a body of the \
             largest size allowed could never be buffered",
            opts.max_buffered_body_bytes, opts.max_body_bytes
        ))));
    }
    if opts.max_streams_per_connection == 0 {
        return Err(ServeError::Config(ConfigError::invalid(
            "--max-streams-per-connection must be at least 1",
        )));
    }
    Ok(())
}

/// Adapts a `()` future to the servers' `Result<(), String>` shape.
trait ThenOk: std::future::Future<Output = ()> + Sized {
    fn then_ok(self) -> impl std::future::Future<Output = Result<(), String>> {
        async move {
            self.await;
            Ok(())
        }
    }
}
impl<F: std::future::Future<Output = ()>> ThenOk for F {}

//! InferencePool discovery: the pool object (`--pool-name` in `--pool-namespace`, API group
//! `--pool-group`) is watched for its selector and ports, the pods it selects are watched
//! through a reflector store (kube-rs' watcher → reflector → store), and every change that
//! completes a consistent view replaces the endpoint set — the same [`EndpointSet`](crate::datalayer::discovery::EndpointSet) the file
//! discovery feeds, so endpoints, scrapers and hot-swap behave alike.
//!
//! - A pod is an endpoint while it is Ready, has an IP and is not terminating; each target port
//!   makes one endpoint (`NAME` for one port, `NAME-rank-I` for data-parallel ranks). A pod
//!   recreated under the same name is a new endpoint (its uid changed).
//! - A changed selector starts a new pod watch; the old view stays until the new one has listed.
//! - Watch errors (the API server down, a dropped stream, `410 Gone`) are retried (100 ms doubling
//!   to 500 ms) and relist as needed; meanwhile the last view stays (never an empty pool because
//!   the API server is unreachable), `llm_d_epp_discovery_stale` is 1 and every error counts in
//!   `llm_d_epp_discovery_errors_total{resource}`.
//! - The pool deleted: no endpoints. Readiness waits for the first full list of the pool's pods
//!   (a pool absent from the start keeps the replica not ready).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use futures::FutureExt;
use futures::Stream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::Client;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use super::crd::PoolError;
use super::crd::PoolSpec;
use super::crd::v1;
use super::crd::v1alpha2;
use crate::datalayer::discovery::PodEntry;
use crate::datalayer::discovery::Scraping;

/// The API group of the pool object (`--pool-group`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolGroup {
    /// `inference.networking.k8s.io` (v1).
    V1,
    /// `inference.networking.x-k8s.io` (v1alpha2).
    V1Alpha2,
}

impl PoolGroup {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "inference.networking.k8s.io",
            Self::V1Alpha2 => "inference.networking.x-k8s.io",
        }
    }
}

impl std::str::FromStr for PoolGroup {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "inference.networking.k8s.io" => Ok(Self::V1),
            "inference.networking.x-k8s.io" => Ok(Self::V1Alpha2),
            other => Err(format!(
                "unknown pool group `{other}` (inference.networking.k8s.io or \
                 inference.networking.x-k8s.io)"
            )),
        }
    }
}

/// Which pool to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    pub name: String,
    pub namespace: String,
    pub group: PoolGroup,
}

/// What the pool watch says.
#[derive(Debug)]
enum PoolEvent {
    /// The pool exists with this spec (or an unusable one).
    Spec(Result<PoolSpec, PoolError>),
    /// The pool is gone (deleted, or absent from a complete list).
    Gone,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = T> + Send>>;

/// Retry delay of a failed watch: 100 ms doubling to [`RETRY_MAX`], reset by the next event.
/// Short: a replica routes on a stale view while it retries, and one pool's watches are two per
/// replica — light even for an API server that just came back.
#[derive(Debug, Clone)]
pub(super) struct Retry(Duration);

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_millis(500);

impl Default for Retry {
    fn default() -> Self {
        Self(RETRY_MIN)
    }
}

impl Iterator for Retry {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.0;
        self.0 = (d * 2).min(RETRY_MAX);
        Some(d)
    }
}

impl kube::runtime::utils::Backoff for Retry {
    fn reset(&mut self) {
        self.0 = RETRY_MIN;
    }
}

/// The pool object's changes, whichever its API group.
fn pool_events(client: Client, pool: &PoolRef) -> BoxStream<Result<PoolEvent, watcher::Error>> {
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", pool.name));
    match pool.group {
        PoolGroup::V1 => {
            let api: Api<v1::InferencePool> = Api::namespaced(client, &pool.namespace);
            pool_stream(watcher(api, cfg), v1::InferencePool::pool_spec)
        }
        PoolGroup::V1Alpha2 => {
            let api: Api<v1alpha2::InferencePool> = Api::namespaced(client, &pool.namespace);
            pool_stream(watcher(api, cfg), v1alpha2::InferencePool::pool_spec)
        }
    }
}

/// Maps a watch of (at most) one pool object to [`PoolEvent`]s: a complete list without it is
/// [`PoolEvent::Gone`].
fn pool_stream<K: Send + 'static>(
    events: impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send + 'static,
    spec: fn(&K) -> Result<PoolSpec, PoolError>,
) -> BoxStream<Result<PoolEvent, watcher::Error>> {
    let mut listed = false;
    events
        .backoff(Retry::default())
        .filter_map(move |event| {
            let out = match event {
                Err(e) => Some(Err(e)),
                Ok(watcher::Event::Init) => {
                    listed = false;
                    None
                }
                Ok(watcher::Event::InitApply(k)) => {
                    listed = true;
                    Some(Ok(PoolEvent::Spec(spec(&k))))
                }
                Ok(watcher::Event::InitDone) => (!listed).then_some(Ok(PoolEvent::Gone)),
                Ok(watcher::Event::Apply(k)) => Some(Ok(PoolEvent::Spec(spec(&k)))),
                Ok(watcher::Event::Delete(_)) => Some(Ok(PoolEvent::Gone)),
            };
            std::future::ready(out)
        })
        .boxed()
}

/// The pods of one selector: a reflector store and the watch feeding it.
struct PodWatch {
    spec: PoolSpec,
    store: reflector::Store<Pod>,
    events: BoxStream<watcher::Result<watcher::Event<Pod>>>,
    /// The store holds a complete list (its first `InitDone` came).
    synced: bool,
}

impl PodWatch {
    fn start(client: Client, namespace: &str, spec: PoolSpec) -> PodWatch {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let selector = spec
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let (store, writer) = reflector::store();
        let events = watcher(api, watcher::Config::default().labels(&selector))
            .backoff(Retry::default())
            .reflect(writer)
            .boxed();
        PodWatch {
            spec,
            store,
            events,
            synced: false,
        }
    }

    /// The endpoints of the pods in the store.
    fn endpoints(&self) -> Vec<PodEntry> {
        endpoints_of(&self.store.state(), &self.spec.ports)
    }
}

/// Endpoints of `pods` on `ports`: Ready, with an IP, not terminating; sorted by name.
pub fn endpoints_of(pods: &[Arc<Pod>], ports: &[u16]) -> Vec<PodEntry> {
    let mut out = Vec::new();
    for pod in pods {
        let meta = &pod.metadata;
        let Some(name) = &meta.name else { continue };
        if meta.deletion_timestamp.is_some() {
            continue;
        }
        let Some(status) = &pod.status else { continue };
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let Some(ip) = status
            .pod_ip
            .as_deref()
            .and_then(|ip| ip.parse::<IpAddr>().ok())
        else {
            continue;
        };
        if !ready {
            continue;
        }
        let mut labels: BTreeMap<String, String> = meta.labels.clone().unwrap_or_default();
        // Where the pod publishes KV events: URLs cannot be label values, so annotations.
        for key in [
            crate::datalayer::kvevents::ENDPOINT_LABEL,
            crate::datalayer::kvevents::REPLAY_LABEL,
        ] {
            if let Some(v) = meta.annotations.as_ref().and_then(|a| a.get(key)) {
                labels.insert(key.to_string(), v.clone());
            }
        }
        for (rank, port) in ports.iter().enumerate() {
            out.push(PodEntry {
                name: if ports.len() == 1 {
                    name.clone()
                } else {
                    format!("{name}-rank-{rank}")
                },
                address: ip,
                port: *port,
                labels: labels.clone(),
                uid: meta.uid.clone(),
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Keeps the endpoint set in step with the pool's pods.
pub struct PoolDiscovery {
    pub pool: PoolRef,
    pub client: Client,
    pub scraping: Scraping,
}

/// Events taken at once before the endpoints are recomputed (a relist of 1000 pods is one
/// update, not 1000).
const COALESCE: usize = 4096;

impl PoolDiscovery {
    pub async fn run(self, shutdown: CancellationToken) {
        let metrics = self.scraping.metrics.clone();
        let mut set = self.scraping.endpoint_set(shutdown.clone());
        let mut pools = pool_events(self.client.clone(), &self.pool);
        let mut pods: Option<PodWatch> = None;
        let mut stale = false;
        let mark = |stale_now: bool, stale: &mut bool| {
            if stale_now != *stale {
                *stale = stale_now;
                metrics.discovery.set_stale(stale_now);
            }
        };
        tracing::info!(
            pool = %self.pool.name,
            namespace = %self.pool.namespace,
            group = ?self.pool.group,
            "watching the InferencePool"
        );
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = set.reap() => {}
                event = pools.next() => match event {
                    None => break,
                    Some(Err(e)) => {
                        metrics.discovery.error("inferencepool");
                        mark(true, &mut stale);
                        tracing::warn!(error = %e, "InferencePool watch failed; keeping the last view");
                    }
                    Some(Ok(PoolEvent::Spec(Ok(spec)))) => {
                        mark(false, &mut stale);
                        if pods.as_ref().is_none_or(|w| w.spec != spec) {
                            tracing::info!(
                                selector = ?spec.match_labels,
                                ports = ?spec.ports,
                                "InferencePool selects pods"
                            );
                            pods = Some(PodWatch::start(
                                self.client.clone(),
                                &self.pool.namespace,
                                spec,
                            ));
                        }
                    }
                    Some(Ok(PoolEvent::Spec(Err(e)))) => {
                        mark(false, &mut stale);
                        metrics.discovery.error("inferencepool");
                        tracing::error!(error = %e, "InferencePool unusable; keeping the last view");
                    }
                    Some(Ok(PoolEvent::Gone)) => {
                        mark(false, &mut stale);
                        tracing::warn!(pool = %self.pool.name, "InferencePool absent: no endpoints");
                        // Absent from the start: not ready (nothing synced). Deleted: no endpoints.
                        if pods.take().is_some() || !set.is_empty() {
                            set.apply(Vec::new());
                        }
                    }
                },
                event = async {
                    match pods.as_mut() {
                        Some(w) => w.events.next().await,
                        None => std::future::pending().await,
                    }
                } => {
                    let Some(w) = pods.as_mut() else { continue };
                    let Some(first) = event else {
                        pods = None;
                        continue;
                    };
                    let mut changed = false;
                    let mut failed = false;
                    let mut handle = |e: watcher::Result<watcher::Event<Pod>>, w: &mut PodWatch| {
                        match e {
                            Err(err) => {
                                failed = true;
                                tracing::warn!(error = %err, "pod watch failed; keeping the last view");
                            }
                            Ok(watcher::Event::InitDone) => {
                                w.synced = true;
                                changed = true;
                            }
                            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                                changed = true;
                            }
                            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                        }
                    };
                    handle(first, w);
                    for _ in 0..COALESCE {
                        match w.events.next().now_or_never() {
                            Some(Some(e)) => handle(e, w),
                            _ => break,
                        }
                    }
                    if failed {
                        metrics.discovery.error("pod");
                        mark(true, &mut stale);
                    } else {
                        mark(false, &mut stale);
                    }
                    if changed && w.synced {
                        let started = Instant::now();
                        let endpoints = w.endpoints();
                        set.apply(endpoints);
                        metrics.discovery.update(started.elapsed());
                    }
                }
            }
        }
        set.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pod(name: &str, ip: Option<&str>, ready: bool, deleting: bool) -> Arc<Pod> {
        let mut v = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "uid": format!("uid-{name}"), "labels": {"app": "vllm"}},
            "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]},
        });
        if let Some(ip) = ip {
            v["status"]["podIP"] = serde_json::json!(ip);
        }
        if deleting {
            v["metadata"]["deletionTimestamp"] = serde_json::json!("2026-12-01T00:00:00Z");
        }
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn only_ready_addressed_live_pods_are_endpoints_one_per_port() {
        let pods = [
            pod("b", Some("10.0.0.2"), true, false),
            pod("a", Some("10.0.0.1"), true, false),
            pod("unready", Some("10.0.0.3"), false, false),
            pod("no-ip", None, true, false),
            pod("terminating", Some("10.0.0.4"), true, true),
        ];
        let one = endpoints_of(&pods, &[8000]);
        let names: Vec<&str> = one.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(one[0].uid.as_deref(), Some("uid-a"));
        assert_eq!(one[0].labels["app"], "vllm");
        let ranks = endpoints_of(&pods, &[8000, 8001]);
        let names: Vec<(&str, u16)> = ranks.iter().map(|e| (e.name.as_str(), e.port)).collect();
        assert_eq!(
            names,
            [
                ("a-rank-0", 8000),
                ("a-rank-1", 8001),
                ("b-rank-0", 8000),
                ("b-rank-1", 8001)
            ]
        );
    }
}

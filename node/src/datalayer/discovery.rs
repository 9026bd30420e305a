//! Standalone discovery: a YAML file listing the pods of the pool, re-read when it changes.
//!
//! ```yaml
//! pods:
//!   - name: vllm-0
//!     address: 10.0.0.7
//!     port: 8000
//!     labels: {llm-d.ai/engine-type: vllm}
//! ```
//! A file that fails to parse is reported and the previous endpoint set is kept. [`EndpointSet`]
//! applies each list (from this file or from Kubernetes, `crate::k8s`): unchanged pods keep their
//! `Endpoint` (and its metrics); new ones get a scraper; removed ones lose theirs.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::endpoint::Endpoint;
use super::scraper::{ScrapeConfig, scrape_loop};
use super::store::Datastore;
use crate::config::{ConfigError, decode_at};
use crate::metrics::Metrics;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointsFile {
    #[serde(default)]
    pub pods: Vec<PodEntry>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PodEntry {
    pub name: String,
    pub address: IpAddr,
    pub port: u16,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The pod's identity where the source has one (Kubernetes' uid): a pod recreated under the
    /// same name and address is a new endpoint (fresh metrics and scraper).
    #[serde(skip)]
    pub uid: Option<String>,
}

pub fn parse_endpoints(text: &str) -> Result<Vec<PodEntry>, ConfigError> {
    let value: serde_json::Value =
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
    let file: EndpointsFile = decode_at(&value, "")?;
    let mut seen = std::collections::HashSet::new();
    for (i, p) in file.pods.iter().enumerate() {
        if !seen.insert(p.name.as_str()) {
            return Err(ConfigError::Field {
                path: format!("pods[{i}].name"),
                message: format!("duplicate pod name `{}`", p.name),
            });
        }
        if p.port == 0 {
            return Err(ConfigError::Field {
                path: format!("pods[{i}].port"),
                message: "port must be non-zero".into(),
            });
        }
    }
    Ok(file.pods)
}

/// Where endpoints go and how they are scraped: shared by every discovery source.
#[derive(Clone)]
pub struct Scraping {
    pub store: Arc<Datastore>,
    pub scrape: Arc<ScrapeConfig>,
    pub metrics: Arc<Metrics>,
}

impl Scraping {
    /// An empty endpoint set whose scrapers stop with `shutdown`.
    pub fn endpoint_set(&self, shutdown: CancellationToken) -> EndpointSet {
        EndpointSet {
            scraping: self.clone(),
            current: HashMap::new(),
            scrapers: JoinSet::new(),
            shutdown,
        }
    }
}

/// The pool's endpoints and their scrapers, kept in step with the latest list of pods from a
/// discovery source: unchanged pods keep their `Endpoint` (and its metrics); new ones get a
/// scraper; removed ones lose theirs.
pub struct EndpointSet {
    scraping: Scraping,
    current: HashMap<String, (PodEntry, Arc<Endpoint>)>,
    scrapers: JoinSet<()>,
    shutdown: CancellationToken,
}

impl EndpointSet {
    /// Replace the set with `pods` (and swap the datastore's snapshot).
    pub fn apply(&mut self, pods: Vec<PodEntry>) {
        let s = &self.scraping;
        let mut next = HashMap::with_capacity(pods.len());
        let mut list = Vec::with_capacity(pods.len());
        let (mut added, mut kept) = (0usize, 0usize);
        for pod in pods {
            let ep = match self.current.remove(&pod.name) {
                Some((old, ep)) if old == pod => {
                    kept += 1;
                    ep
                }
                _ => {
                    added += 1;
                    let ep = Arc::new(Endpoint::new(
                        pod.name.clone(),
                        SocketAddr::new(pod.address, pod.port),
                        pod.labels.clone(),
                    ));
                    self.scrapers.spawn(scrape_loop(
                        Arc::downgrade(&ep),
                        s.scrape.clone(),
                        s.store.clone(),
                        s.metrics.clone(),
                        self.shutdown.child_token(),
                    ));
                    ep
                }
            };
            list.push(ep.clone());
            next.insert(pod.name.clone(), (pod, ep));
        }
        let removed = self.current.len();
        self.current = next;
        s.store.replace(list);
        s.metrics.set_ready_endpoints(self.current.len());
        tracing::info!(
            added,
            kept,
            removed,
            total = self.current.len(),
            "endpoint set updated"
        );
    }

    /// Endpoints in the set.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }

    /// Waits for a scraper to finish (removed endpoints' scrapers end by themselves); pending
    /// forever when none runs. Poll it in the source's loop so the set does not grow.
    pub async fn reap(&mut self) {
        if self.scrapers.join_next().await.is_none() {
            std::future::pending::<()>().await;
        }
    }

    /// Stops every scraper.
    pub async fn shutdown(mut self) {
        self.scrapers.shutdown().await;
    }
}

/// Watches the endpoints file and keeps the endpoint set in step with it.
pub struct FileDiscovery {
    pub path: PathBuf,
    pub poll: Duration,
    pub scraping: Scraping,
}

impl FileDiscovery {
    /// Load once (an error here is fatal for start-up), then return the watcher future.
    pub fn load_initial(&self) -> Result<Vec<PodEntry>, ConfigError> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| ConfigError::Io {
            path: self.path.display().to_string(),
            source,
        })?;
        parse_endpoints(&text)
    }

    pub async fn run(self, initial: Vec<PodEntry>, shutdown: CancellationToken) {
        let mut set = self.scraping.endpoint_set(shutdown.clone());
        set.apply(initial);
        let mut last_seen = file_stamp(&self.path);
        let mut tick = tokio::time::interval(self.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {}
                () = set.reap() => continue,
            }
            let stamp = file_stamp(&self.path);
            if stamp == last_seen {
                continue;
            }
            last_seen = stamp;
            match std::fs::read_to_string(&self.path)
                .map_err(|e| e.to_string())
                .and_then(|t| parse_endpoints(&t).map_err(|e| e.to_string()))
            {
                Ok(pods) => set.apply(pods),
                Err(err) => tracing::error!(
                    path = %self.path.display(),
                    %err,
                    "endpoints file rejected; keeping the previous endpoint set"
                ),
            }
        }
        set.shutdown().await;
    }
}

fn file_stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pods() {
        let pods = parse_endpoints(
            "pods:\n- name: a\n  address: 127.0.0.1\n  port: 8000\n  labels: {llm-d.ai/engine-type: sglang}\n",
        )
        .unwrap();
        assert_eq!(pods.len(), 1);
        assert_eq!(pods[0].labels["llm-d.ai/engine-type"], "sglang");
    }

    #[test]
    fn rejects_bad_entries() {
        let e = parse_endpoints("pods:\n- name: a\n  address: nope\n  port: 1\n").unwrap_err();
        assert!(e.to_string().contains("pods[0].address"), "{e}");
        let e = parse_endpoints("pods:\n- {name: a, address: 127.0.0.1, port: 1}\n- {name: a, address: 127.0.0.1, port: 2}\n").unwrap_err();
        assert!(e.to_string().contains("duplicate"), "{e}");
        let e = parse_endpoints("pods:\n- {name: a, address: 127.0.0.1, port: 1, extra: 2}\n")
            .unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
    }
}

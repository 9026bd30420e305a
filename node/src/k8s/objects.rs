//! The pool's `InferenceObjective`s and `InferenceModelRewrite`s (`llm-d.ai/v1alpha2`), and —
//! with `--watch-tenants` — the `TenantQuota`s (`epp.dev/v1alpha1`) of the pool's namespace,
//! watched and applied live.
//!
//! Each kind has its own watcher → reflector → store. On every change the objects whose
//! `poolRef` names this pool are read in llm-d's order (oldest first, then by name) through the
//! same checks as the manifest files (`--objectives-file`, `--model-rewrites-file`), and the
//! result replaces what the streams read ([`Live`]): a request resolves against one complete
//! set. An object that fails the checks is skipped, logged and counted
//! (`llm_d_epp_discovery_objects{state="refused"}`); the others apply. A failed watch (the
//! API server away, the CRD not installed) keeps the last set and retries.

use std::sync::Arc;

use futures::StreamExt;
use kube::Api;
use kube::Client;
use kube::Resource;
use kube::ResourceExt;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector;
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use super::crd::llmd::{InferenceModelRewrite, InferenceObjective, PoolObjectReference};
use super::crd::tenancy::TenantQuota;
use super::discovery::{PoolRef, Retry};
use crate::config::ConfigError;
use crate::metrics::Metrics;
use crate::request::Live;
use crate::request::meta::Objectives;
use crate::request::rewrite::ModelRewrites;
use crate::request::tenant::Tenants;

/// What the watches feed: `None` where a file supplies the kind instead.
pub struct ObjectWatch {
    pub client: Client,
    pub pool: PoolRef,
    pub objectives: Option<Arc<Live<Objectives>>>,
    pub rewrites: Option<Arc<Live<ModelRewrites>>>,
    /// Tenant mode from the API server (`--watch-tenants`).
    pub tenants: Option<Arc<Live<Tenants>>>,
    pub metrics: Arc<Metrics>,
}

impl ObjectWatch {
    pub async fn run(self, shutdown: CancellationToken) {
        let ns = self.pool.namespace.clone();
        let objectives = self.objectives.map(|live| {
            let pool = self.pool.clone();
            watch(
                Api::<InferenceObjective>::namespaced(self.client.clone(), &ns),
                "inferenceobjective",
                self.metrics.clone(),
                shutdown.clone(),
                move |objs: &[Arc<InferenceObjective>], refused: &mut dyn FnMut(ConfigError)| {
                    let mut out = Objectives::default();
                    for o in bound(objs, &pool, |o| &o.spec.pool_ref) {
                        if let Err(e) = add(o, |doc, at| out.add(doc, at)) {
                            refused(e);
                        }
                    }
                    let n = out.len();
                    live.set(out);
                    n
                },
            )
        });
        let rewrites = self.rewrites.map(|live| {
            let pool = self.pool.clone();
            watch(
                Api::<InferenceModelRewrite>::namespaced(self.client.clone(), &ns),
                "inferencemodelrewrite",
                self.metrics.clone(),
                shutdown.clone(),
                move |objs: &[Arc<InferenceModelRewrite>], refused: &mut dyn FnMut(ConfigError)| {
                    let mut out = ModelRewrites::default();
                    let mut n = 0;
                    for o in bound(objs, &pool, |o| &o.spec.pool_ref) {
                        match add(o, |doc, at| out.add(doc, at)) {
                            Ok(()) => n += 1,
                            Err(e) => refused(e),
                        }
                    }
                    live.set(out);
                    n
                },
            )
        });
        let tenants = self.tenants.map(|live| {
            watch(
                Api::<TenantQuota>::namespaced(self.client.clone(), &ns),
                "tenantquota",
                self.metrics.clone(),
                shutdown.clone(),
                move |objs: &[Arc<TenantQuota>], refused: &mut dyn FnMut(ConfigError)| {
                    // Oldest first: when two claim one key, the older keeps it.
                    let mut out = Tenants::default();
                    let mut n = 0;
                    let mut sorted: Vec<&TenantQuota> = objs.iter().map(AsRef::as_ref).collect();
                    sorted.sort_by(|a, b| {
                        let created =
                            |o: &TenantQuota| o.meta().creation_timestamp.as_ref().map(|t| t.0);
                        created(a)
                            .cmp(&created(b))
                            .then_with(|| a.meta().name.cmp(&b.meta().name))
                    });
                    for o in sorted {
                        match add(o, |doc, at| out.add_doc(doc, at)) {
                            Ok(()) => n += 1,
                            Err(e) => refused(e),
                        }
                    }
                    live.set(out);
                    n
                },
            )
        });
        futures::future::join3(maybe(objectives), maybe(rewrites), maybe(tenants)).await;
    }
}

/// Runs the watch, if there is one.
async fn maybe(w: Option<impl std::future::Future<Output = ()>>) {
    if let Some(w) = w {
        w.await;
    }
}

/// The objects naming this pool, oldest first (then by name): llm-d's precedence when two
/// rewrite rules name one model.
fn bound<'a, K: Resource>(
    objs: &'a [Arc<K>],
    pool: &PoolRef,
    pool_ref: impl Fn(&K) -> &PoolObjectReference,
) -> Vec<&'a K> {
    let group = pool.group.as_str();
    let mut out: Vec<&K> = objs
        .iter()
        .map(AsRef::as_ref)
        .filter(|o| pool_ref(o).names(&pool.name, group))
        .collect();
    out.sort_by(|a, b| {
        let created = |o: &K| o.meta().creation_timestamp.as_ref().map(|t| t.0);
        created(a)
            .cmp(&created(b))
            .then_with(|| a.meta().name.cmp(&b.meta().name))
    });
    out
}

/// One object through the manifest checks (`add`), named `Kind namespace/name` in errors.
fn add<K: Resource<DynamicType = ()> + Serialize>(
    obj: &K,
    add: impl FnOnce(&serde_json::Value, &str) -> Result<(), ConfigError>,
) -> Result<(), ConfigError> {
    let at = format!(
        "{} {}/{}",
        K::kind(&()),
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    );
    let mut doc = serde_json::to_value(obj)
        .map_err(|e| ConfigError::invalid(format!("{at}: not serialisable: {e}")))?;
    // The API server's objects carry their type; a store's may not.
    doc["apiVersion"] = K::api_version(&()).into();
    doc["kind"] = K::kind(&()).into();
    add(&doc, &at)
}

/// Watches one kind; after every change `apply` rebuilds the live set from the store and
/// returns how many objects it applied.
async fn watch<K, F>(
    api: Api<K>,
    resource: &'static str,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    apply: F,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
    F: Fn(&[Arc<K>], &mut dyn FnMut(ConfigError)) -> usize,
{
    let (store, writer) = reflector::store();
    let mut events = watcher(api, watcher::Config::default())
        .backoff(Retry::default())
        .reflect(writer)
        .boxed();
    // Only the first failure of a run of them is a warning (a CRD not installed fails forever),
    // and a refused object is logged when it is first refused, not at every later change.
    let mut failing = false;
    let mut refused_before = std::collections::HashSet::new();
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            e = events.next() => e,
        };
        match event {
            None => return,
            Some(Err(e)) => {
                metrics.discovery.error(resource);
                if failing {
                    tracing::debug!(resource, error = %e, "watch failed again; keeping the last set");
                } else {
                    tracing::warn!(resource, error = %e, "watch failed; keeping the last set");
                }
                failing = true;
            }
            Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
            Some(Ok(
                watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_),
            )) => {
                failing = false;
                let mut refused = std::collections::HashSet::new();
                let applied = apply(&store.state(), &mut |e| {
                    let e = e.to_string();
                    if !refused_before.contains(&e) {
                        tracing::error!(resource, error = %e, "refused; the others apply");
                    }
                    refused.insert(e);
                });
                metrics
                    .discovery
                    .set_objects(resource, applied, refused.len());
                tracing::debug!(resource, applied, refused = refused.len(), "applied");
                refused_before = refused;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::k8s::PoolGroup;

    fn objective(
        name: &str,
        created: &str,
        pool: serde_json::Value,
        priority: i32,
    ) -> Arc<InferenceObjective> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
                "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
                "spec": {"priority": priority, "poolRef": pool},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn only_the_pools_objects_apply_oldest_first() {
        let pool = PoolRef {
            name: "llm".into(),
            namespace: "ns".into(),
            group: PoolGroup::V1,
        };
        let objs = [
            objective(
                "b",
                "2026-01-02T00:00:00Z",
                serde_json::json!({"name": "llm"}),
                1,
            ),
            objective(
                "a",
                "2026-01-03T00:00:00Z",
                serde_json::json!({"name": "llm", "group": "inference.networking.k8s.io"}),
                2,
            ),
            objective(
                "other",
                "2026-01-01T00:00:00Z",
                serde_json::json!({"name": "other"}),
                3,
            ),
            objective(
                "old-group",
                "2026-01-01T00:00:00Z",
                serde_json::json!({"name": "llm", "group": "inference.networking.x-k8s.io"}),
                4,
            ),
            objective(
                "svc",
                "2026-01-01T00:00:00Z",
                serde_json::json!({"name": "llm", "kind": "Service"}),
                5,
            ),
        ];
        let names: Vec<_> = bound(&objs, &pool, |o| &o.spec.pool_ref)
            .iter()
            .map(|o| o.name_any())
            .collect();
        assert_eq!(names, ["b", "a"]);
        let mut out = Objectives::default();
        for o in bound(&objs, &pool, |o| &o.spec.pool_ref) {
            add(o, |doc, at| out.add(doc, at)).unwrap();
        }
        assert_eq!(
            (out.priority("a"), out.priority("b"), out.priority("other")),
            (Some(2), Some(1), None)
        );
    }

    #[test]
    fn a_refused_rewrite_names_its_object_and_adds_nothing() {
        let bad: InferenceModelRewrite = serde_json::from_value(serde_json::json!({
            "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite",
            "metadata": {"name": "canary", "namespace": "ns"},
            "spec": {"poolRef": {"name": "llm"}, "rules": [
                {"matches": [{"model": {"value": "a"}}], "targets": [{"modelRewrite": "a-v1"}]},
                {"matches": [{"model": {"value": "b"}}], "targets": [{"modelRewrite": "b-v1", "weight": 0}]},
            ]},
        }))
        .unwrap();
        let mut out = ModelRewrites::default();
        let e = add(&bad, |doc, at| out.add(doc, at))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("InferenceModelRewrite ns/canary.spec.rules[1].targets: every weight is 0"),
            "{e}"
        );
        assert_eq!(out.rules(), 0, "a refused object adds none of its rules");
    }
}

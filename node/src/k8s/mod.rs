//! Kubernetes: the pool's pods from its `InferencePool` (kube-rs watcher → reflector → store)
//! and the custom resources' types.
//!
//! - [`crd`]: `InferencePool` (GIE v1 and the older v1alpha2 group), `InferenceObjective` and
//!   `InferenceModelRewrite` (`llm-d.ai/v1alpha2`) as Rust types; the CRD manifests in
//!   `deploy/crds/` are generated from them (`epp crds`).
//! - [`discovery`]: `--pool-name`/`--pool-namespace`/`--pool-group` discovery feeding the same
//!   endpoint set as the file discovery.
//! - [`objects`]: the pool's objectives and model rewrites, applied live.
//!
//! The client comes from the environment (`KUBECONFIG` or `~/.kube/config`, else the in-cluster
//! service account). Tests point it at `sim::kubeapi`, a fake API server speaking the real
//! list/watch protocol.

pub mod crd;
pub mod discovery;
pub mod objects;

pub use discovery::{PoolDiscovery, PoolGroup, PoolRef};
pub use objects::ObjectWatch;

/// The Kubernetes client from the environment, without kube's own retries of 429/503/504
/// answers (up to 15 over minutes): the watches retry on their own schedule, so an unavailable
/// API server shows as such (`llm_d_epp_discovery_stale`) instead of a request hanging.
pub async fn client() -> Result<kube::Client, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.default_retry = false;
    kube::Client::try_from(config)
}

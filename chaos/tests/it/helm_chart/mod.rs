//! The Helm chart (`deploy/helm/epp`): `helm lint` and `helm template` over the value sets an
//! operator would use, every rendered manifest validated offline (built-in kinds against
//! Kubernetes' schemas, the InferencePool against our CRD, Standalone mode's Envoy bootstrap by
//! Envoy itself, the EndpointPickerConfig by `epp`), values that cannot work refused at render
//! time — and the StatefulSet's replicas, started with exactly the arguments it renders
//! (ordinal identity, DNS peer names routed to loopback, each pod's own key pair as
//! cert-manager's csi-driver would issue it for the names the volume asks for — or the shared
//! peer TLS Secret's files), form a cluster with no admin call, serve, and re-form from their
//! data directories; a replica holding only its own key cannot speak as another.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod manifests;
mod site;
mod statefulset;

use chaos::chart::{Helm, documents, find};
use serde_json::Value;

pub(super) const NS: &str = "serving";
const RELEASE: &str = "t";
pub(super) const FULL: &str = "t-epp";

pub(super) fn render(helm: &Helm, values: &[&str]) -> (String, Vec<Value>) {
    let lint = helm.lint(values).unwrap();
    assert!(
        lint.ok,
        "helm lint {values:?}:\n{}{}",
        lint.stdout, lint.stderr
    );
    let out = helm.template(RELEASE, NS, values).unwrap();
    assert!(out.ok, "helm template {values:?}: {}", out.stderr);
    let docs = documents(&out.stdout).unwrap();
    (out.stdout, docs)
}

pub(super) fn pod_spec(docs: &[Value]) -> &Value {
    &find(docs, "StatefulSet", FULL).expect("the StatefulSet")["spec"]["template"]["spec"]
}

pub(super) fn epp_container(docs: &[Value]) -> &Value {
    pod_spec(docs)["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "epp")
        .unwrap()
}

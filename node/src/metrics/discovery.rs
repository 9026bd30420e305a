//! Discovery metrics (`llm_d_epp_discovery_*`): the Kubernetes watches' health and the cost of
//! recomputing the endpoint set.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

/// Which watch failed (`inferencepool`, `pod`, `inferenceobjective`, `inferencemodelrewrite`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: &'static str,
}

/// `discovery_objects` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectLabels {
    pub resource: &'static str,
    /// `applied` or `refused`.
    pub state: &'static str,
}

#[derive(Debug)]
pub struct DiscoveryMetrics {
    errors: Family<ResourceLabels, Counter>,
    objects: Family<ObjectLabels, Gauge>,
    stale: Gauge,
    update_seconds: Histogram,
}

impl DiscoveryMetrics {
    pub(super) fn register(registry: &mut super::registrar::Registrar) -> DiscoveryMetrics {
        let m = DiscoveryMetrics {
            errors: Family::default(),
            objects: Family::default(),
            stale: Gauge::default(),
            update_seconds: Histogram::new([
                1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0,
            ]),
        };
        registry.register(
            "discovery_errors",
            "Kubernetes watch errors (API server unreachable, dropped streams, relists after 410 \
             Gone, unusable pool objects), by resource",
            m.errors.clone(),
        );
        registry.register(
            "discovery_objects",
            "The pool's InferenceObjectives and InferenceModelRewrites in use (state=applied) \
             and refused as invalid (state=refused), by resource",
            m.objects.clone(),
        );
        registry.register(
            "discovery_stale",
            "1 while the last Kubernetes watch attempt failed: the endpoint set is the last one \
             seen, possibly out of date",
            m.stale.clone(),
        );
        registry.register(
            "discovery_update_duration_seconds",
            "Time to recompute the endpoint set from the pods' store after a change",
            m.update_seconds.clone(),
        );
        m
    }

    pub fn error(&self, resource: &'static str) {
        self.errors
            .get_or_create(&ResourceLabels { resource })
            .inc();
    }

    pub fn set_objects(&self, resource: &'static str, applied: usize, refused: usize) {
        for (state, n) in [("applied", applied), ("refused", refused)] {
            self.objects
                .get_or_create(&ObjectLabels { resource, state })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn set_stale(&self, stale: bool) {
        self.stale.set(i64::from(stale));
    }

    pub fn update(&self, took: std::time::Duration) {
        self.update_seconds.observe(took.as_secs_f64());
    }
}

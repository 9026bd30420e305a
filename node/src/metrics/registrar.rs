//! Building the registry: every family registered through [`Registrar`] is also entered in the
//! catalog of series names the exposition can show (`Metrics::series_names`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

/// The registry while it is built, and the series names it will expose.
pub(crate) struct Registrar {
    prefix: &'static str,
    pub(super) registry: Registry,
    pub(super) series: Vec<String>,
}

impl Registrar {
    pub(super) fn new(prefix: &'static str) -> Self {
        Registrar {
            prefix,
            registry: Registry::with_prefix(prefix),
            series: Vec::new(),
        }
    }

    pub(crate) fn register<M>(&mut self, name: &str, help: &str, metric: M)
    where
        M: prometheus_client::registry::Metric + prometheus_client::metrics::TypedMetric,
    {
        use prometheus_client::metrics::MetricType;
        let full = format!("{}_{name}", self.prefix);
        match M::TYPE {
            MetricType::Counter => self.series.push(format!("{full}_total")),
            MetricType::Histogram => {
                for s in ["_bucket", "_sum", "_count"] {
                    self.series.push(format!("{full}{s}"));
                }
            }
            MetricType::Info => self.series.push(format!("{full}_info")),
            _ => self.series.push(full),
        }
        self.registry.register(name, help, metric);
    }
}

/// Moves `counter` up to `total`, a cumulative count kept elsewhere.
pub(super) fn follow(counter: &Counter, total: u64) {
    let seen = counter.get();
    if total > seen {
        counter.inc_by(total - seen);
    }
}

//! The data layer: which endpoints exist (discovery) and what their model servers report (scraping).
//!
//! Layout:
//! - [`endpoint`]: the endpoint record and its latest metrics snapshot;
//! - [`store`]: the datastore the request path reads (a lock-free-for-readers snapshot);
//! - [`discovery`]: standalone discovery from a YAML file of pods, reloaded on change;
//! - [`promtext`] + [`extract`]: Prometheus text parsing and engine-specific metric extraction;
//! - [`scraper`]: one task per endpoint polling `/metrics`; requests never wait on it;
//! - [`shard`]: cluster mode — which replicas scrape which pod (rendezvous owners, fan-out).

pub mod discovery;
pub mod endpoint;
pub mod extract;
pub mod promtext;
pub mod scraper;
pub mod shard;
pub mod store;

pub use endpoint::{Endpoint, EndpointMetrics};
pub use store::Datastore;

//! The data layer: which endpoints exist (discovery) and what their model servers report (scraping).
//!
//! Layout:
//! - [`endpoint`]: the endpoint record and its latest metrics snapshot;
//! - [`store`]: the datastore the request path reads (a lock-free-for-readers snapshot);
//! - [`discovery`]: standalone discovery from a YAML file of pods, reloaded on change;
//! - [`promtext`] + [`extract`]: Prometheus text parsing and engine-specific metric extraction;
//! - [`scraper`]: one task per endpoint polling `/metrics`; requests never wait on it;
//! - [`shard`]: cluster mode — which replicas scrape which pod (rendezvous owners, fan-out);
//! - [`inflight`]: the in-flight ledger — requests and tokens sent to each endpoint and not yet
//!   finished (cluster-wide in cluster mode, through a read-only feed of the others' load);
//! - [`responses`]: which pod holds each stored Responses-API response (`previous_response_id`
//!   affinity), replicated like the prefix index.

pub mod discovery;
pub mod endpoint;
pub mod extract;
pub mod inflight;
pub mod kvevents;
pub mod promtext;
pub mod responses;
pub mod scraper;
pub mod shard;
pub mod store;
#[cfg(test)]
pub(crate) mod testutil;

pub use endpoint::{Endpoint, EndpointMetrics};
pub use store::Datastore;

//! Tenant-mode metrics (`llm_d_epp_tenant_*`): admissions and quota refusals, tokens billed, what
//! is in flight, unauthorized requests. Tenants are configured and the `model` label is the
//! limits' key (a configured model name or `*`), so cardinality follows the configuration.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantOutcome {
    pub tenant: String,
    pub model: String,
    /// `admitted`, `rejected-quota-rpm`, `rejected-quota-tpm`, `rejected-quota-concurrency`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantTokens {
    pub tenant: String,
    pub model: String,
    /// `input`, `output`, `cached`.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantModel {
    pub tenant: String,
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnauthorizedLabels {
    /// `missing` (no key, no anonymous tenant) or `unknown` (a key no tenant has).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: &'static str,
}

#[derive(Debug, Default)]
pub struct TenantMetrics {
    pub requests: Family<TenantOutcome, Counter>,
    pub tokens: Family<TenantTokens, Counter>,
    pub in_flight: Family<TenantModel, Gauge>,
    pub disconnects: Family<TenantModel, Counter>,
    pub unauthorized: Family<UnauthorizedLabels, Counter>,
    /// Re-reads of the tenants file by result (`ok`, `error`).
    pub reloads: Family<ReloadLabels, Counter>,
    /// Cluster mode: quota batches proposed (log entries) and the commands in them.
    pub proposals: Counter,
    pub commands: Counter,
    pub dropped: Counter,
}

impl TenantMetrics {
    pub(super) fn register(registry: &mut super::registrar::Registrar) -> TenantMetrics {
        let m = TenantMetrics::default();
        registry.register(
            "tenant_requests",
            "Requests of each tenant by quota outcome (admitted, or the rejected-quota-* reason)",
            m.requests.clone(),
        );
        registry.register(
            "tenant_tokens",
            "Tokens billed to each tenant (input, output; cached: the part of input the engine \
             had cached), as settled from the responses' usage",
            m.tokens.clone(),
        );
        registry.register(
            "tenant_in_flight_requests",
            "Requests of each tenant admitted by its quota and not yet settled",
            m.in_flight.clone(),
        );
        registry.register(
            "tenant_disconnects",
            "Responses whose client went away before the end (billed what was generated)",
            m.disconnects.clone(),
        );
        registry.register(
            "tenant_unauthorized_requests",
            "Requests refused with 401 in tenant mode, by reason",
            m.unauthorized.clone(),
        );
        registry.register(
            "tenant_config_reloads",
            "Re-reads of the tenants file after it changed, by result (an invalid file is refused \
             and the tenants stay as they were)",
            m.reloads.clone(),
        );
        registry.register(
            "tenant_quota_proposals",
            "Cluster mode: log entries this replica proposed for quotas (batches of admissions, \
             settlements, slice requests and returns)",
            m.proposals.clone(),
        );
        registry.register(
            "tenant_quota_commands",
            "Cluster mode: quota commands in those entries",
            m.commands.clone(),
        );
        registry.register(
            "tenant_quota_dropped_commands",
            "Cluster mode: quota commands dropped because proposals failed until the outbox \
             was full (100 000); their admissions and settlements are missing from the ledger",
            m.dropped.clone(),
        );
        m
    }
}

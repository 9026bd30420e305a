//! Tenant mode on this replica: identify the tenant, admit the request under its quota (before
//! flow control and scheduling: a quota 429 costs no GPU), and settle what the response used —
//! the shell around `flowctl::quota`'s pure [`QuotaBook`].
//!
//! ```text
//! headers ─► identify (API key hash → tenant, else anonymous, else 401)
//!   parsed ─► admit: pre-debit input estimate + output budget ─► 429 rejected-quota-* | go on
//!        (the output budget is written into the body when the client asked more or nothing)
//!   response end / client gone ─► settle: usage (refund / extra charge), or what was generated
//!   never reached a pod (later 429/503, client gone while queued) ─► release
//! ```
//!
//! Time is the wall clock (the usage ledger's minutes are real minutes). Quotas here are this
//! replica's: cluster mode refuses tenant mode until the quota book is replicated.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flowctl::Nanos;
use flowctl::quota::{Ask, Hold, Limits, QuotaBook, RateSide, RateView, Spent, UsageKey, UsageRow};

use super::reject::Rejection;
use super::tenant::{ANY_MODEL, Tenant, Tenants};
use crate::metrics::{Metrics, TenantModel, TenantOutcome, TenantTokens, UnauthorizedLabels};

/// What the response of an admitted request showed, for its settlement.
#[derive(Debug, Clone, Copy, Default)]
pub struct Consumed {
    /// The usage the response reported (the last seen, when it was cut).
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub cached: u64,
    /// Streamed events forwarded (a stand-in for output tokens when no usage was seen).
    pub events: u64,
    /// The response reached its end (else the client or the stream went away).
    pub ended: bool,
}

/// A request admitted under its tenant's quota.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub tenant: String,
    /// The output tokens it may generate (its maximum after the tenant's default and cap).
    pub output_budget: Option<u64>,
    /// `x-ratelimit-*` headers for the response.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug)]
pub struct Quotas {
    tenants: Tenants,
    book: Mutex<QuotaBook>,
    metrics: Arc<Metrics>,
    /// `--usage-log`: one JSON line per settled request.
    log: Option<Mutex<LineWriter<File>>>,
}

const NO_LIMITS: Limits = Limits {
    requests_per_minute: None,
    tokens_per_minute: None,
    concurrency: None,
    default_max_tokens: None,
    max_tokens_cap: None,
};

/// Unix time in nanoseconds.
fn now() -> Nanos {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as Nanos)
}

impl Quotas {
    pub fn new(
        tenants: Tenants,
        usage_log: Option<&Path>,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Quotas> {
        let log = match usage_log {
            Some(p) => Some(Mutex::new(LineWriter::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            ))),
            None => None,
        };
        Ok(Quotas {
            tenants,
            book: Mutex::new(QuotaBook::new()),
            metrics,
            log,
        })
    }

    fn book(&self) -> MutexGuard<'_, QuotaBook> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// The tenant the request's headers identify, or the 401 (counted).
    pub fn identify(
        &self,
        headers: &std::collections::HashMap<String, String>,
    ) -> Result<&Tenant, Rejection> {
        self.tenants.identify(headers).inspect_err(|r| {
            let reason = if r.message.starts_with("unknown") {
                "unknown"
            } else {
                "missing"
            };
            self.metrics
                .tenants
                .unauthorized
                .get_or_create(&UnauthorizedLabels { reason })
                .inc();
        })
    }

    fn limits<'a>(tenant: &'a Tenant, model: &str) -> (&'a str, &'a Limits) {
        tenant.limits_for(model).unwrap_or((ANY_MODEL, &NO_LIMITS))
    }

    /// Admit request `key` of `tenant` for `model`, pre-debiting `input_tokens` and its output
    /// budget, or refuse it with 429 `rejected-quota-*`.
    pub fn admit(
        &self,
        key: &str,
        tenant: &Tenant,
        model: &str,
        input_tokens: u64,
        max_output: Option<u64>,
    ) -> Result<Admitted, Rejection> {
        let (limit_key, limits) = Self::limits(tenant, model);
        let ask = Ask {
            key,
            tenant: &tenant.name,
            limit_key,
            model,
            limits,
            input_tokens,
            max_output,
        };
        let result = self.book().admit(now(), ask);
        let m = &self.metrics.tenants;
        let outcome = |outcome| TenantOutcome {
            tenant: tenant.name.clone(),
            model: limit_key.to_string(),
            outcome,
        };
        match result {
            Ok(g) => {
                m.requests.get_or_create(&outcome("admitted")).inc();
                m.in_flight
                    .get_or_create(&model_labels(tenant, limit_key))
                    .inc();
                Ok(Admitted {
                    tenant: tenant.name.clone(),
                    output_budget: g.output_budget,
                    headers: rate_headers(&g.view),
                })
            }
            Err(r) => {
                let reason = r.reason.dropped_reason();
                m.requests.get_or_create(&outcome(reason)).inc();
                let mut headers = rate_headers(&r.view);
                if let Some(wait) = r.retry_after {
                    // Whole seconds, rounded up, at least 1.
                    let secs = wait.div_ceil(1_000_000_000).max(1);
                    headers.push(("retry-after".into(), secs.to_string()));
                }
                let what = match r.reason {
                    flowctl::quota::QuotaReason::Rpm => "requests per minute",
                    flowctl::quota::QuotaReason::Tpm => "tokens per minute",
                    flowctl::quota::QuotaReason::Concurrency => "concurrent requests",
                };
                let message = if r.retry_after.is_none() {
                    format!(
                        "tenant `{}`: the request needs more tokens than the tenant's {what} \
                         limit for model `{limit_key}` ever allows",
                        tenant.name
                    )
                } else {
                    format!(
                        "tenant `{}` is over its {what} quota for model `{limit_key}`",
                        tenant.name
                    )
                };
                Err(Rejection::over_quota(reason, message, headers))
            }
        }
    }

    /// The response of `key` ended or was cut: charge what it used (once).
    pub fn settle(&self, key: &str, c: Consumed) -> bool {
        let now = now();
        let mut book = self.book();
        let Some(hold) = book.hold(key).cloned() else {
            return false;
        };
        let Some(tenant) = self.tenants.get(&hold.tenant) else {
            return false;
        };
        let (_, limits) = Self::limits(tenant, &hold.model);
        // Without a usage report: the input estimate, and the streamed events as output.
        let spent = Spent {
            input: c.input.unwrap_or(hold.input_estimate),
            output: c.output.unwrap_or(c.events),
            cached: c.cached,
            disconnected: !c.ended,
        };
        let Some(settled) = book.settle(now, key, spent, limits) else {
            return false;
        };
        drop(book);
        let m = &self.metrics.tenants;
        let labels = model_labels(tenant, &hold.limit_key);
        m.in_flight.get_or_create(&labels).dec();
        if spent.disconnected {
            m.disconnects.get_or_create(&labels).inc();
        }
        for (kind, n) in [
            ("input", spent.input),
            ("output", spent.output),
            ("cached", spent.cached),
        ] {
            m.tokens
                .get_or_create(&TenantTokens {
                    tenant: tenant.name.clone(),
                    model: hold.limit_key.clone(),
                    kind,
                })
                .inc_by(n);
        }
        self.log(now, key, &hold, &spent, &settled.model);
        true
    }

    /// `key` was admitted but will never reach a model server: its request and tokens go back.
    pub fn release(&self, key: &str) {
        let mut book = self.book();
        let Some(hold) = book.hold(key).cloned() else {
            return;
        };
        let limits = self
            .tenants
            .get(&hold.tenant)
            .map_or(&NO_LIMITS, |t| Self::limits(t, &hold.model).1);
        if book.release(now(), key, limits).is_some() {
            drop(book);
            self.metrics
                .tenants
                .in_flight
                .get_or_create(&TenantModel {
                    tenant: hold.tenant,
                    model: hold.limit_key,
                })
                .dec();
        }
    }

    /// Release holds older than `max_age` (responses never seen: a safety net, logged), and
    /// trim the usage ledger.
    pub fn sweep(&self, max_age: Duration) {
        let now = now();
        let stale = {
            let mut book = self.book();
            book.trim(now);
            book.stale(now.saturating_sub(max_age.as_nanos() as Nanos))
        };
        if !stale.is_empty() {
            tracing::warn!(
                count = stale.len(),
                "quota holds without a response released"
            );
        }
        for key in stale {
            self.release(&key);
        }
    }

    /// The usage ledger (per tenant × model × minute) from `since` (unix seconds).
    pub fn usage(&self, since: u64) -> Vec<(UsageKey, UsageRow)> {
        let first = since / 60;
        self.book()
            .usage()
            .filter(|(k, _)| k.minute >= first)
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect()
    }

    /// Each tenant's state now: limits, remaining, in flight (`/debug/tenants`).
    pub fn status(&self) -> serde_json::Value {
        let now = now();
        let mut book = self.book();
        let tenants: Vec<_> = self
            .tenants
            .iter()
            .map(|t| {
                let limits: serde_json::Map<_, _> = t
                    .limits
                    .iter()
                    .map(|(model, l)| {
                        let view = book.view(now, &t.name, model, l);
                        let side = |s: Option<RateSide>| {
                            s.map(|s| {
                                serde_json::json!({"limit": s.limit, "remaining": s.remaining, "resetMs": s.reset / 1_000_000})
                            })
                        };
                        (
                            model.clone(),
                            serde_json::json!({
                                "requests": side(view.requests),
                                "tokens": side(view.tokens),
                                "concurrency": l.concurrency,
                                "inFlight": book.in_flight(&t.name, model),
                            }),
                        )
                    })
                    .collect();
                serde_json::json!({
                    "name": t.name,
                    "fairnessId": t.fairness_id,
                    "objective": t.objective,
                    "limits": limits,
                })
            })
            .collect();
        serde_json::json!({ "tenants": tenants, "holds": book.holds().count() })
    }

    fn log(&self, now: Nanos, key: &str, hold: &Hold, spent: &Spent, model: &str) {
        let Some(log) = &self.log else { return };
        let line = serde_json::json!({
            "ts": now / 1_000_000,
            "key": key,
            "tenant": hold.tenant,
            "model": model,
            "debit": hold.debit,
            "input": spent.input,
            "output": spent.output,
            "cached": spent.cached,
            "disconnected": spent.disconnected,
        });
        let mut w = log.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = writeln!(w, "{line}") {
            tracing::warn!(error = %e, "writing the usage log");
        }
    }
}

fn model_labels(tenant: &Tenant, limit_key: &str) -> TenantModel {
    TenantModel {
        tenant: tenant.name.clone(),
        model: limit_key.to_string(),
    }
}

/// OpenAI's rate-limit headers for what is left.
pub fn rate_headers(view: &RateView) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, side) in [("requests", view.requests), ("tokens", view.tokens)] {
        if let Some(s) = side {
            out.push((format!("x-ratelimit-limit-{name}"), s.limit.to_string()));
            out.push((
                format!("x-ratelimit-remaining-{name}"),
                s.remaining.to_string(),
            ));
            out.push((format!("x-ratelimit-reset-{name}"), reset(s.reset)));
        }
    }
    out
}

/// A duration as OpenAI writes resets: `20ms`, `1.5s`, `6m0s`.
fn reset(ns: Nanos) -> String {
    let ms = ns.div_ceil(1_000_000);
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = format!("{:.3}", ms as f64 / 1000.0);
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resets_read_like_openais() {
        assert_eq!(reset(0), "0ms");
        assert_eq!(reset(20_000_000), "20ms");
        assert_eq!(reset(1_500_000_000), "1.5s");
        assert_eq!(reset(2_000_000_000), "2s");
        assert_eq!(reset(360_000_000_000), "6m0s");
    }

    fn quotas() -> Quotas {
        let yaml = format!(
            "apiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: b}}\nspec:\n  apiKeys: [{{sha256: {}}}]\n  limits: [{{model: '*', tokensPerMinute: 1000, concurrency: 1, maxTokensCap: 100}}]\n",
            super::super::tenant::hash_key("k")
        );
        let t = Tenants::from_yaml(&yaml).unwrap();
        Quotas::new(t, None, Arc::new(Metrics::new("p"))).unwrap()
    }

    #[test]
    fn admit_settle_and_release_through_the_shell() {
        let q = quotas();
        let t = q.tenants().get("b").unwrap().clone();
        let a = q.admit("k1", &t, "m", 200, Some(500)).unwrap();
        assert_eq!(a.output_budget, Some(100));
        assert!(
            a.headers
                .contains(&("x-ratelimit-remaining-tokens".into(), "700".into()))
        );
        let r = q.admit("k2", &t, "m", 1, None).unwrap_err();
        assert_eq!(r.reason, Some("rejected-quota-concurrency"));
        assert!(
            r.headers
                .iter()
                .any(|(k, v)| k == "retry-after" && v == "1")
        );
        // Cut after 7 streamed events without usage: the input estimate and 7 output tokens.
        assert!(q.settle(
            "k1",
            Consumed {
                events: 7,
                ..Consumed::default()
            }
        ));
        assert!(!q.settle("k1", Consumed::default()), "settled once");
        let rows = q.usage(0);
        assert_eq!(
            (rows[0].1.input, rows[0].1.output, rows[0].1.disconnects),
            (200, 7, 1)
        );
        q.admit("k3", &t, "m", 1, None).unwrap();
        q.release("k3");
        q.admit("k4", &t, "m", 1, None).unwrap();
        let s = q.status();
        assert_eq!(s["tenants"][0]["limits"]["*"]["inFlight"], 1);
        assert_eq!(s["tenants"][0]["limits"]["*"]["tokens"]["remaining"], 692);
    }
}

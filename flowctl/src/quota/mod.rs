//! Tenant quotas: requests per minute, tokens per minute and concurrency per tenant × model, with
//! pre-debit at admission and settlement on the engine's usage — a pure state machine (time is an
//! argument, no IO) like the rest of the crate.
//!
//! # The model
//!
//! Each (tenant, model key) has an *account*: two token buckets — requests and tokens — that hold
//! at most one minute's limit and refill continuously at limit / 60 s, and an in-flight count.
//! The arithmetic is exact: a bucket's level is kept in token·nanoseconds-per-minute units (one
//! token = 60·10⁹ units, refill = elapsed ns × limit units), so no rounding ever loses or makes a
//! token, whatever the call pattern.
//!
//! * [`QuotaBook::admit`] checks concurrency, then requests, then tokens (the first that fails is
//!   the reason), and on success *pre-debits* one request and `input estimate + output budget`
//!   tokens, where the output budget is `min(asked or default, cap)` (see [`Limits::output_budget`]).
//!   A request needs its whole debit available: a refusal says how long until it would be
//!   ([`Refusal::retry_after`]); a debit larger than the bucket can ever hold is refused for good.
//! * [`QuotaBook::settle`] ends a request with its actual usage: the tokens bucket gets back
//!   `debit − actual` — a refund, or an extra charge that may take the level below zero (the
//!   tenant then waits for the refill) — the in-flight count drops, and the usage ledger records
//!   input, output and cached tokens in the minute of the settlement. A request settles at most
//!   once: its hold is removed, a second settlement is ignored (and says so).
//! * [`QuotaBook::release`] ends an admitted request that never reached a model server (a later
//!   429 or 503, the client gone while queued): the request and its tokens go back; nothing is
//!   billed.
//!
//! [`shared`] is the cluster-wide version: the same book in the replicated state, with each
//! replica admitting within slices of the buckets granted to it.
//!
//! Refused requests are counted in the ledger by reason. The ledger keeps [`USAGE_MINUTES`]
//! minutes, and at most [`MAX_MODELS_PER_TENANT`] distinct model names per tenant and minute (the
//! rest are recorded as [`OTHER_MODEL`]): model names come from clients.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::units::{NANOS_PER_SEC, Nanos};

pub mod shared;

/// Nanoseconds in the window every per-minute limit refers to.
pub const MINUTE: Nanos = 60 * NANOS_PER_SEC;
/// Minutes of usage the ledger keeps.
pub const USAGE_MINUTES: u64 = 24 * 60;
/// Distinct model names recorded per tenant and minute; further ones go to [`OTHER_MODEL`].
pub const MAX_MODELS_PER_TENANT: usize = 32;
pub const OTHER_MODEL: &str = "(other)";

/// One tenant's limits for one model (or `"*"`, every model without its own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub concurrency: Option<u32>,
    /// Output tokens a request that names no maximum may generate (and is debited for).
    pub default_max_tokens: Option<u64>,
    /// The most output tokens any request may ask for.
    pub max_tokens_cap: Option<u64>,
}

impl Limits {
    /// The output tokens a request is debited for: what it asked (else the default), at most the
    /// cap; `None` when neither bounds it (only the input estimate is debited).
    pub fn output_budget(&self, asked: Option<u64>) -> Option<u64> {
        match (asked.or(self.default_max_tokens), self.max_tokens_cap) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (Some(a), None) => Some(a),
            (None, c) => c,
        }
    }
}

/// Why a request was refused (`x-llm-d-request-dropped-reason: rejected-quota-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum QuotaReason {
    Rpm,
    Tpm,
    Concurrency,
}

impl QuotaReason {
    pub const ALL: [QuotaReason; 3] =
        [QuotaReason::Rpm, QuotaReason::Tpm, QuotaReason::Concurrency];

    pub fn dropped_reason(self) -> &'static str {
        match self {
            QuotaReason::Rpm => "rejected-quota-rpm",
            QuotaReason::Tpm => "rejected-quota-tpm",
            QuotaReason::Concurrency => "rejected-quota-concurrency",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            QuotaReason::Rpm => "rpm",
            QuotaReason::Tpm => "tpm",
            QuotaReason::Concurrency => "concurrency",
        }
    }
}

/// A per-minute bucket, exact: `level` is in units of 1/`MINUTE` token·ns (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Bucket {
    /// May be negative after an extra charge.
    level: i128,
    at: Nanos,
}

const UNIT: i128 = MINUTE as i128;

impl Bucket {
    fn full(limit: u64, now: Nanos) -> Bucket {
        Bucket {
            level: i128::from(limit) * UNIT,
            at: now,
        }
    }

    /// Refill up to `now` (time never runs backwards here: an earlier `now` refills nothing).
    fn refill(&mut self, limit: u64, now: Nanos) {
        let cap = i128::from(limit) * UNIT;
        if now > self.at {
            let gained = i128::from(now - self.at) * i128::from(limit);
            self.level += gained;
            self.at = now;
        }
        // Never past the limit (also when the limit was lowered).
        self.level = self.level.min(cap);
    }

    /// Whole tokens available (negative after an extra charge).
    fn tokens(&self) -> i64 {
        let t = self.level.div_euclid(UNIT);
        t.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
    }

    /// Nanoseconds until `need` tokens are available; `None` when the bucket can never hold them.
    fn wait_for(&self, limit: u64, need: u64) -> Option<Nanos> {
        if need > limit {
            return None;
        }
        let missing = i128::from(need) * UNIT - self.level;
        if missing <= 0 {
            return Some(0);
        }
        if limit == 0 {
            return None;
        }
        let l = i128::from(limit);
        Some(((missing + l - 1) / l).min(i128::from(u64::MAX)) as Nanos)
    }

    /// Nanoseconds until the bucket is full again.
    fn reset_in(&self, limit: u64) -> Nanos {
        self.wait_for(limit, limit).unwrap_or(0)
    }

    fn take(&mut self, n: u64) {
        self.level -= i128::from(n) * UNIT;
    }

    /// Take up to `n` whole tokens of what is available (never below zero); how many were taken.
    fn take_up_to(&mut self, n: u64) -> u64 {
        let got = self.tokens().max(0).unsigned_abs().min(n);
        self.take(got);
        got
    }

    /// Give back `n` tokens (a refund never fills past the cap).
    fn give(&mut self, n: i128, limit: u64) {
        self.level = (self.level + n * UNIT).min(i128::from(limit) * UNIT);
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Account {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    in_flight: u32,
}

impl Account {
    fn refill(&mut self, limits: &Limits, now: Nanos) {
        sync(&mut self.requests, limits.requests_per_minute, now);
        sync(&mut self.tokens, limits.tokens_per_minute, now);
    }

    fn view(&self, limits: &Limits) -> RateView {
        let side = |b: &Option<Bucket>, limit: Option<u64>| {
            limit.zip(b.as_ref()).map(|(l, b)| RateSide {
                limit: l,
                remaining: b.tokens().max(0) as u64,
                reset: b.reset_in(l),
            })
        };
        RateView {
            requests: side(&self.requests, limits.requests_per_minute),
            tokens: side(&self.tokens, limits.tokens_per_minute),
        }
    }
}

/// A bucket exists exactly while its limit does (a limit added later starts full).
fn sync(bucket: &mut Option<Bucket>, limit: Option<u64>, now: Nanos) {
    match (bucket.as_mut(), limit) {
        (Some(b), Some(l)) => b.refill(l, now),
        (None, Some(l)) => *bucket = Some(Bucket::full(l, now)),
        (_, None) => *bucket = None,
    }
}

/// One side (requests or tokens) of the OpenAI-style `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateSide {
    pub limit: u64,
    pub remaining: u64,
    /// Nanoseconds until the bucket is full again.
    pub reset: Nanos,
}

/// What a tenant has left, for the response headers (`None`: no such limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateView {
    pub requests: Option<RateSide>,
    pub tokens: Option<RateSide>,
}

/// A request to admit.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The EPP's request key: what settles or releases it.
    pub key: &'a str,
    pub tenant: &'a str,
    /// The limits' key: the model named by the limits that apply (or `"*"`).
    pub limit_key: &'a str,
    /// The client's model, for the ledger.
    pub model: &'a str,
    pub limits: &'a Limits,
    pub input_tokens: u64,
    /// The output maximum the request names, if any.
    pub max_output: Option<u64>,
}

/// An admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Tokens pre-debited.
    pub debit: u64,
    /// The output tokens the request may generate (its maximum after the default and the cap).
    pub output_budget: Option<u64>,
    pub view: RateView,
}

/// A refused request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub reason: QuotaReason,
    /// Nanoseconds until the same request would pass; `None` when it never can (its debit is
    /// more than a minute's tokens).
    pub retry_after: Option<Nanos>,
    pub view: RateView,
}

/// What a request used, as the response reported it (or as much as is known on a disconnect).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spent {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    /// The client went away before the response ended (billed what was generated).
    pub disconnected: bool,
}

/// What a response showed: the usage it reported (the last seen, when it was cut), else what was
/// forwarded of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reported {
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub cached: u64,
    /// Streamed events forwarded (one token each, when no usage was seen).
    pub events: u64,
    /// The response reached its end (else the client or the stream went away).
    pub ended: bool,
}

impl Reported {
    /// What to bill `hold` for: the usage, else its input estimate and the events as output.
    pub fn spent(&self, hold: &Hold) -> Spent {
        Spent {
            input: self.input.unwrap_or(hold.input_estimate),
            output: self.output.unwrap_or(self.events),
            cached: self.cached,
            disconnected: !self.ended,
        }
    }
}

/// An admitted request not yet settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub tenant: String,
    pub limit_key: String,
    pub model: String,
    pub debit: u64,
    pub input_estimate: u64,
    pub at: Nanos,
}

/// One row of the usage ledger: a tenant × model × minute.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRow {
    pub requests: u64,
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    pub disconnects: u64,
    /// Refusals by reason ([`QuotaReason::label`]).
    pub rejected: BTreeMap<QuotaReason, u64>,
}

/// A ledger row's key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UsageKey {
    /// Minutes since the clock's origin.
    pub minute: u64,
    pub tenant: String,
    pub model: String,
}

/// The settlement of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub hold: Hold,
    /// Tokens charged in the end (input + output).
    pub charged: u64,
    /// The model name the ledger filed it under.
    pub model: String,
}

/// Every tenant's accounts, the open holds and the usage ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaBook {
    accounts: BTreeMap<(String, String), Account>,
    holds: BTreeMap<String, Hold>,
    usage: BTreeMap<UsageKey, UsageRow>,
}

impl QuotaBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// Admit `ask` or say why not (refusals are recorded in the ledger). A key already held is
    /// refused as over concurrency (keys are the EPP's own and never repeat).
    pub fn admit(&mut self, now: Nanos, ask: Ask<'_>) -> Result<Granted, Refusal> {
        let limits = ask.limits;
        let account = self
            .accounts
            .entry((ask.tenant.to_string(), ask.limit_key.to_string()))
            .or_default();
        account.refill(limits, now);
        let output_budget = limits.output_budget(ask.max_output);
        let debit = ask.input_tokens.saturating_add(output_budget.unwrap_or(0));
        let refused = if self.holds.contains_key(ask.key)
            || limits.concurrency.is_some_and(|c| account.in_flight >= c)
        {
            // A slot frees when a request ends: no time to promise.
            Some((QuotaReason::Concurrency, Some(0)))
        } else if let Some(wait) = wait(&account.requests, limits.requests_per_minute, 1) {
            Some((QuotaReason::Rpm, wait))
        } else {
            wait(&account.tokens, limits.tokens_per_minute, debit).map(|w| (QuotaReason::Tpm, w))
        };
        if let Some((reason, retry_after)) = refused {
            let view = account.view(limits);
            *self
                .row(now, ask.tenant, ask.model)
                .rejected
                .entry(reason)
                .or_default() += 1;
            return Err(Refusal {
                reason,
                retry_after,
                view,
            });
        }
        if let Some(b) = &mut account.requests {
            b.take(1);
        }
        if let Some(b) = &mut account.tokens {
            b.take(debit);
        }
        account.in_flight += 1;
        let view = account.view(limits);
        self.holds.insert(
            ask.key.to_string(),
            Hold {
                tenant: ask.tenant.to_string(),
                limit_key: ask.limit_key.to_string(),
                model: ask.model.to_string(),
                debit,
                input_estimate: ask.input_tokens,
                at: now,
            },
        );
        Ok(Granted {
            debit,
            output_budget,
            view,
        })
    }

    /// Settle `key` with what it spent; `None` if it is not held (never admitted, or settled or
    /// released already — nothing is charged twice). `limits` are the ones its account has now.
    pub fn settle(
        &mut self,
        now: Nanos,
        key: &str,
        spent: Spent,
        limits: &Limits,
    ) -> Option<Settled> {
        let hold = self.holds.remove(key)?;
        let charged = spent.input.saturating_add(spent.output);
        if let Some(account) = self
            .accounts
            .get_mut(&(hold.tenant.clone(), hold.limit_key.clone()))
        {
            account.refill(limits, now);
            account.in_flight = account.in_flight.saturating_sub(1);
            if let (Some(b), Some(l)) = (&mut account.tokens, limits.tokens_per_minute) {
                b.give(i128::from(hold.debit) - i128::from(charged), l);
            }
        }
        let model = {
            let (tenant, model) = (hold.tenant.clone(), hold.model.clone());
            let filed = self.model_label(now, &tenant, &model);
            let row = self.row(now, &tenant, &model);
            row.requests += 1;
            row.input += spent.input;
            row.output += spent.output;
            row.cached += spent.cached;
            row.disconnects += u64::from(spent.disconnected);
            filed
        };
        Some(Settled {
            hold,
            charged,
            model,
        })
    }

    /// An admitted request never reached a model server: its request and tokens go back.
    pub fn release(&mut self, now: Nanos, key: &str, limits: &Limits) -> Option<Hold> {
        let hold = self.holds.remove(key)?;
        if let Some(account) = self
            .accounts
            .get_mut(&(hold.tenant.clone(), hold.limit_key.clone()))
        {
            account.refill(limits, now);
            account.in_flight = account.in_flight.saturating_sub(1);
            if let (Some(b), Some(l)) = (&mut account.requests, limits.requests_per_minute) {
                b.give(1, l);
            }
            if let (Some(b), Some(l)) = (&mut account.tokens, limits.tokens_per_minute) {
                b.give(i128::from(hold.debit), l);
            }
        }
        Some(hold)
    }

    /// Take up to `tokens` and `requests` of what `tenant`'s buckets hold now (for a replica's
    /// slice, [`shared`]); without a limit, all that is asked. Returns what was taken.
    pub fn take_up_to(
        &mut self,
        now: Nanos,
        tenant: &str,
        limit_key: &str,
        limits: &Limits,
        tokens: u64,
        requests: u64,
    ) -> (u64, u64) {
        let account = self.account(now, tenant, limit_key, limits);
        let t = account
            .tokens
            .as_mut()
            .map_or(tokens, |b| b.take_up_to(tokens));
        let r = account
            .requests
            .as_mut()
            .map_or(requests, |b| b.take_up_to(requests));
        (t, r)
    }

    /// Charge `tokens` and `requests` to `tenant`'s buckets even beyond what they hold (debt).
    pub fn charge(
        &mut self,
        now: Nanos,
        tenant: &str,
        limit_key: &str,
        limits: &Limits,
        tokens: u64,
        requests: u64,
    ) {
        let account = self.account(now, tenant, limit_key, limits);
        if let Some(b) = &mut account.tokens {
            b.take(tokens);
        }
        if let Some(b) = &mut account.requests {
            b.take(requests);
        }
    }

    /// Give `tokens` and `requests` back to `tenant`'s buckets (never past the limit).
    pub fn give_back(
        &mut self,
        now: Nanos,
        tenant: &str,
        limit_key: &str,
        limits: &Limits,
        tokens: u64,
        requests: u64,
    ) {
        let account = self.account(now, tenant, limit_key, limits);
        if let (Some(b), Some(l)) = (&mut account.tokens, limits.tokens_per_minute) {
            b.give(i128::from(tokens), l);
        }
        if let (Some(b), Some(l)) = (&mut account.requests, limits.requests_per_minute) {
            b.give(i128::from(requests), l);
        }
    }

    /// Record request `key` admitted on tokens and a request already taken from the buckets (a
    /// replica's slice): a hold, one more in flight. `false` if `key` is already held.
    pub fn hold_taken(&mut self, now: Nanos, ask: Ask<'_>, debit: u64) -> bool {
        if self.holds.contains_key(ask.key) {
            return false;
        }
        self.account(now, ask.tenant, ask.limit_key, ask.limits)
            .in_flight += 1;
        self.holds.insert(
            ask.key.to_string(),
            Hold {
                tenant: ask.tenant.to_string(),
                limit_key: ask.limit_key.to_string(),
                model: ask.model.to_string(),
                debit,
                input_estimate: ask.input_tokens,
                at: now,
            },
        );
        true
    }

    /// Count a refusal in the ledger (a replica refused it from its slice).
    pub fn count_refusal(&mut self, now: Nanos, tenant: &str, model: &str, reason: QuotaReason) {
        *self
            .row(now, tenant, model)
            .rejected
            .entry(reason)
            .or_default() += 1;
    }

    fn account(
        &mut self,
        now: Nanos,
        tenant: &str,
        limit_key: &str,
        limits: &Limits,
    ) -> &mut Account {
        let account = self
            .accounts
            .entry((tenant.to_string(), limit_key.to_string()))
            .or_default();
        account.refill(limits, now);
        account
    }

    /// What a tenant has left under `limits` now.
    pub fn view(&mut self, now: Nanos, tenant: &str, limit_key: &str, limits: &Limits) -> RateView {
        let account = self
            .accounts
            .entry((tenant.to_string(), limit_key.to_string()))
            .or_default();
        account.refill(limits, now);
        account.view(limits)
    }

    /// What a tenant has left at `now`, without changing anything (a read-only view).
    pub fn peek(&self, now: Nanos, tenant: &str, limit_key: &str, limits: &Limits) -> RateView {
        let mut account = self
            .accounts
            .get(&(tenant.to_string(), limit_key.to_string()))
            .cloned()
            .unwrap_or_default();
        account.refill(limits, now);
        account.view(limits)
    }

    /// Requests of `tenant` under `limit_key` admitted and not yet ended.
    pub fn in_flight(&self, tenant: &str, limit_key: &str) -> u32 {
        self.accounts
            .get(&(tenant.to_string(), limit_key.to_string()))
            .map_or(0, |a| a.in_flight)
    }

    /// Whole tokens left in a tenant's tokens bucket as of its last update (negative after an
    /// extra charge); `None` without a token limit.
    pub fn tokens_left(&self, tenant: &str, limit_key: &str) -> Option<i64> {
        self.accounts
            .get(&(tenant.to_string(), limit_key.to_string()))?
            .tokens
            .as_ref()
            .map(Bucket::tokens)
    }

    pub fn hold(&self, key: &str) -> Option<&Hold> {
        self.holds.get(key)
    }

    pub fn holds(&self) -> impl Iterator<Item = (&str, &Hold)> {
        self.holds.iter().map(|(k, h)| (k.as_str(), h))
    }

    /// Keys held since before `before` (responses that never reported an end).
    pub fn stale(&self, before: Nanos) -> Vec<String> {
        self.holds
            .iter()
            .filter(|(_, h)| h.at < before)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The usage ledger, oldest minute first.
    pub fn usage(&self) -> impl Iterator<Item = (&UsageKey, &UsageRow)> {
        self.usage.iter()
    }

    /// The ledger rows from minute `first` on (a copy, for views and the CLI).
    pub fn usage_since(&self, first: u64) -> Vec<(UsageKey, UsageRow)> {
        let from = UsageKey {
            minute: first,
            tenant: String::new(),
            model: String::new(),
        };
        self.usage
            .range(from..)
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect()
    }

    /// Drop ledger rows older than [`USAGE_MINUTES`] before `now`.
    pub fn trim(&mut self, now: Nanos) {
        let first = (now / MINUTE).saturating_sub(USAGE_MINUTES);
        while let Some(e) = self.usage.first_entry() {
            if e.key().minute >= first {
                break;
            }
            e.remove();
        }
    }

    /// The model name a row of `tenant` in the current minute is filed under.
    fn model_label(&self, now: Nanos, tenant: &str, model: &str) -> String {
        let minute = now / MINUTE;
        let key = UsageKey {
            minute,
            tenant: tenant.to_string(),
            model: model.to_string(),
        };
        if self.usage.contains_key(&key) {
            return key.model;
        }
        let lo = UsageKey {
            minute,
            tenant: tenant.to_string(),
            model: String::new(),
        };
        let models = self
            .usage
            .range(lo..)
            .take_while(|(k, _)| k.minute == minute && k.tenant == tenant)
            .count();
        if models >= MAX_MODELS_PER_TENANT {
            OTHER_MODEL.to_string()
        } else {
            key.model
        }
    }

    fn row(&mut self, now: Nanos, tenant: &str, model: &str) -> &mut UsageRow {
        let model = self.model_label(now, tenant, model);
        self.usage
            .entry(UsageKey {
                minute: now / MINUTE,
                tenant: tenant.to_string(),
                model,
            })
            .or_default()
    }
}

/// `None` when `need` is available now (or there is no limit); else how long to wait for it.
fn wait(bucket: &Option<Bucket>, limit: Option<u64>, need: u64) -> Option<Option<Nanos>> {
    let (Some(b), Some(l)) = (bucket, limit) else {
        return None;
    };
    match b.wait_for(l, need) {
        Some(0) => None,
        w => Some(w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Nanos = NANOS_PER_SEC;

    fn limits() -> Limits {
        Limits {
            requests_per_minute: Some(4),
            tokens_per_minute: Some(1000),
            concurrency: Some(2),
            default_max_tokens: Some(100),
            max_tokens_cap: Some(300),
        }
    }

    fn ask<'a>(key: &'a str, l: &'a Limits, input: u64, max: Option<u64>) -> Ask<'a> {
        Ask {
            key,
            tenant: "b",
            limit_key: "*",
            model: "m",
            limits: l,
            input_tokens: input,
            max_output: max,
        }
    }

    fn spent(input: u64, output: u64) -> Spent {
        Spent {
            input,
            output,
            cached: 0,
            disconnected: false,
        }
    }

    /// The acceptance's scripted ledger: balances asserted after every step.
    #[test]
    fn a_scripted_ledger_balances_step_by_step() {
        let l = limits();
        let mut q = QuotaBook::new();
        // Pre-debit: 200 input + the default 100 output.
        let g = q.admit(0, ask("r1", &l, 200, None)).unwrap();
        assert_eq!((g.debit, g.output_budget), (300, Some(100)));
        assert_eq!(q.tokens_left("b", "*"), Some(700));
        assert_eq!(g.view.requests.unwrap().remaining, 3);
        assert_eq!(g.view.tokens.unwrap().remaining, 700);
        // The cap bounds an explicit maximum: 100 + min(1000, 300).
        let g = q.admit(0, ask("r2", &l, 100, Some(1000))).unwrap();
        assert_eq!(g.debit, 400);
        assert_eq!(q.tokens_left("b", "*"), Some(300));
        // Concurrency 429 with tokens left (300) and requests left (2).
        let r = q.admit(0, ask("r3", &l, 10, Some(10))).unwrap_err();
        assert_eq!(r.reason, QuotaReason::Concurrency);
        // Refund: r1 used 200 + 40 of its 300.
        let s = q.settle(0, "r1", spent(200, 40), &l).unwrap();
        assert_eq!(s.charged, 240);
        assert_eq!(q.tokens_left("b", "*"), Some(360));
        assert_eq!(q.in_flight("b", "*"), 1);
        // Nothing is charged twice.
        assert!(q.settle(0, "r1", spent(200, 40), &l).is_none());
        assert_eq!(q.tokens_left("b", "*"), Some(360));
        // Extra charge on an under-estimate: r2 was debited 400, used 100 + 290 + an input
        // the estimate missed by 60.
        q.settle(0, "r2", spent(160, 290), &l).unwrap();
        assert_eq!(q.tokens_left("b", "*"), Some(310));
        assert_eq!(q.in_flight("b", "*"), 0);
        // TPM 429 with concurrency free: 250 + 100 > 310; retry when 40 tokens have refilled
        // (1000 per minute: 2.4 s).
        let r = q.admit(0, ask("r4", &l, 250, None)).unwrap_err();
        assert_eq!(r.reason, QuotaReason::Tpm);
        assert_eq!(r.retry_after, Some(2_400_000_000));
        // ... and it passes then.
        let g = q.admit(2_400_000_000, ask("r4", &l, 250, None)).unwrap();
        assert_eq!(g.debit, 350);
        assert_eq!(q.tokens_left("b", "*"), Some(0));
        // Disconnect billing: the client left after 30 output tokens.
        q.settle(
            2_400_000_000,
            "r4",
            Spent {
                input: 250,
                output: 30,
                cached: 0,
                disconnected: true,
            },
            &l,
        )
        .unwrap();
        assert_eq!(q.tokens_left("b", "*"), Some(70));
        // Three requests so far; the fourth passes, the fifth is over the RPM (4/min): one
        // request refills in 15 s, of which 2.4 s have passed.
        q.admit(2_400_000_000, ask("r5", &l, 1, Some(1))).unwrap();
        let r = q
            .admit(2_400_000_000, ask("r6", &l, 1, Some(1)))
            .unwrap_err();
        assert_eq!(r.reason, QuotaReason::Rpm);
        assert_eq!(r.retry_after, Some(15 * S - 2_400_000_000));
        // A released request gives its request and tokens back; nothing billed.
        q.release(2_400_000_000, "r5", &l).unwrap();
        assert_eq!(q.tokens_left("b", "*"), Some(70));
        assert!(q.admit(2_400_000_000, ask("r6", &l, 1, Some(1))).is_ok());
        // The ledger: three settled requests, the refusals by reason.
        let rows: Vec<_> = q.usage().collect();
        assert_eq!(rows.len(), 1);
        let row = rows[0].1;
        assert_eq!(
            (row.requests, row.input, row.output, row.disconnects),
            (3, 610, 360, 1)
        );
        assert_eq!(row.rejected[&QuotaReason::Concurrency], 1);
        assert_eq!(row.rejected[&QuotaReason::Tpm], 1);
        assert_eq!(row.rejected[&QuotaReason::Rpm], 1);
    }

    #[test]
    fn a_debit_over_a_minutes_tokens_is_refused_for_good() {
        let l = limits();
        let mut q = QuotaBook::new();
        let r = q.admit(0, ask("r", &l, 950, None)).unwrap_err();
        assert_eq!((r.reason, r.retry_after), (QuotaReason::Tpm, None));
    }

    #[test]
    fn buckets_refill_exactly_and_never_past_the_limit() {
        let l = Limits {
            tokens_per_minute: Some(7),
            ..Limits::default()
        };
        let mut q = QuotaBook::new();
        q.admit(0, ask("a", &l, 7, None)).unwrap();
        assert_eq!(q.tokens_left("b", "*"), Some(0));
        // 7 per minute: one token every 60/7 s; many tiny steps lose nothing.
        let mut now = 0;
        for _ in 0..6000 {
            now += 10_000_000; // 10 ms, 60 s in all
            q.view(now, "b", "*", &l);
        }
        assert_eq!(q.tokens_left("b", "*"), Some(7));
        q.view(now + 600 * S, "b", "*", &l);
        assert_eq!(q.tokens_left("b", "*"), Some(7));
        let v = q.view(now + 600 * S, "b", "*", &l);
        assert_eq!(v.tokens.unwrap().reset, 0);
    }

    #[test]
    fn the_ledger_bounds_model_names_per_tenant() {
        let l = Limits::default();
        let mut q = QuotaBook::new();
        for i in 0..(MAX_MODELS_PER_TENANT + 5) {
            let key = format!("k{i}");
            let model = format!("m{i}");
            let a = Ask {
                key: &key,
                tenant: "t",
                limit_key: "*",
                model: &model,
                limits: &l,
                input_tokens: 1,
                max_output: None,
            };
            q.admit(0, a).unwrap();
            q.settle(0, &key, spent(1, 1), &l).unwrap();
        }
        assert_eq!(q.usage().count(), MAX_MODELS_PER_TENANT + 1);
        let other = q.usage().find(|(k, _)| k.model == OTHER_MODEL).unwrap().1;
        assert_eq!(other.requests, 5);
        q.trim(USAGE_MINUTES * MINUTE + MINUTE);
        assert_eq!(q.usage().count(), 0);
    }
}

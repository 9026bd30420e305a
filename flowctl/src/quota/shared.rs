//! Cluster-wide quotas: one [`QuotaBook`] in the replicated state, and each replica admitting
//! within *slices* of its buckets, so the fast path has no consensus round trip.
//!
//! # How it works
//!
//! * A replica asks for a slice of an account ([`QuotaCmd::Want`]: tokens, requests,
//!   concurrency slots). The state grants what the buckets hold (up to the ask) and takes it
//!   from them at once: a slice is spent before anything is admitted from it. Slots come from
//!   what the concurrency limit leaves after the requests in flight and the other slices.
//! * The replica admits locally while its slice (as applied, minus what it admitted since)
//!   covers the request, and reports each admission ([`QuotaCmd::Admitted`], batched): the state
//!   consumes it from the slice and records the hold — in flight, owned by that replica.
//! * Whichever replica observes the response settles it ([`QuotaCmd::Settle`]): refund or extra
//!   charge to the bucket, the slot back to the admitting replica's slice (so a replica keeps
//!   its share of the concurrency across requests), the usage in the replicated ledger — the
//!   bill is in the Raft state, durable and identical on every replica. A settlement that arrives
//!   before its admission is kept ([`EARLY_TTL`], at most [`EARLY_MAX`]) and applied with it.
//! * Idle slices go back ([`QuotaCmd::Return`]); a replica whose lease ends (dead, partitioned,
//!   restarted) has its slices returned and its requests in flight billed as reserved (their
//!   responses may never be observed) — [`SharedQuota::advance`].
//!
//! # The bound
//!
//! Tokens and requests reach a replica only through grants taken from the buckets, so while
//! every replica holds its lease the cluster admits, per tenant × model, no more than the
//! buckets hold (a minute's limit plus the refill) — exactly the single-replica book — and in
//! flight plus sliced slots never exceed the concurrency limit. The one overshoot: a replica
//! that loses its lease with admissions not yet reported (a partition) had its slice returned
//! and re-granted; when its reports arrive they are charged to the bucket, which goes into debt
//! (the tenant waits for the refill). So over any window the overshoot is at most the slices
//! such replicas held, and it is paid back; a replica admits from its slice only while its
//! lease is fresh, which bounds it to one slice per lost lease. [`SharedQuota::overdrawn`]
//! counts it. Property-tested in `flowctl/tests/it/quota_shared.rs`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::{Ask, Hold, Limits, QuotaBook, QuotaReason, RateView, Reported, Settled, Spent};
use crate::global::MemberId;
use crate::units::{NANOS_PER_SEC, Nanos};

/// How long a settlement waits for its admission to be reported.
pub const EARLY_TTL: Nanos = 60 * NANOS_PER_SEC;
/// Most settlements kept waiting for their admission.
pub const EARLY_MAX: usize = 65_536;
/// A request whose response is never observed is billed as reserved after this long.
pub const MAX_HOLD: Nanos = 3600 * NANOS_PER_SEC;
const MINUTE_NS: Nanos = 60 * NANOS_PER_SEC;

/// A replica's slice of one account.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub tokens: u64,
    pub requests: u64,
    pub slots: u32,
}

/// What a replica proposes about quotas (one batch per log entry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum QuotaCmd {
    /// Add up to this much to the replica's slice of an account (`limits`: the account's, as
    /// the replica has them configured).
    Want {
        tenant: String,
        limit_key: String,
        limits: Limits,
        tokens: u64,
        requests: u64,
        slots: u32,
    },
    /// The replica admitted `key` from its slice.
    Admitted {
        key: String,
        tenant: String,
        limit_key: String,
        model: String,
        limits: Limits,
        debit: u64,
        input_estimate: u64,
    },
    /// The response of `key` (any replica's request) ended or was cut.
    Settle { key: String, reported: Reported },
    /// The admitted request `key` never reached a model server.
    Release { key: String },
    /// Give back (part of) the replica's slice.
    Return {
        tenant: String,
        limit_key: String,
        slice: Slice,
    },
    /// The replica refused a request (counted in the ledger).
    Refused {
        tenant: String,
        model: String,
        reason: QuotaReason,
    },
}

/// A settled request, for the replica that proposed its settlement (metrics, the usage log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Billed {
    pub key: String,
    pub tenant: String,
    pub limit_key: String,
    /// The model name the ledger filed it under.
    pub model: String,
    pub debit: u64,
    pub spent: Spent,
}

/// The replicated quota state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedQuota {
    book: QuotaBook,
    /// Each account's limits, as last proposed.
    limits: BTreeMap<(String, String), Limits>,
    slices: BTreeMap<(MemberId, String, String), Slice>,
    /// Slots sliced out per account (the sum over members).
    sliced: BTreeMap<(String, String), u32>,
    /// Which replica admitted each held request.
    owners: BTreeMap<String, MemberId>,
    /// Replicas with slices or holds, and their incarnation.
    incarnations: BTreeMap<MemberId, u64>,
    early: BTreeMap<String, (Reported, Nanos)>,
    /// The last batch applied per replica (retried proposals are applied once).
    seqs: BTreeMap<MemberId, u64>,
    early_order: VecDeque<(Nanos, String)>,
    /// Tokens, requests and slots admitted beyond a slice (late reports of a replica whose
    /// lease ended): the overshoot, charged to the buckets.
    overdrawn: Slice,
    /// Requests billed as reserved because their replica's lease ended (or their response was
    /// never observed within [`MAX_HOLD`]).
    orphaned: u64,
    /// The minute of the last stale-hold sweep.
    swept: u64,
}

impl SharedQuota {
    /// Apply a replica's batch number `seq` at `now` (the log clock): what it settled. Batches
    /// of an older incarnation than the replica's latest, or already applied, are ignored; a
    /// newer incarnation ends the older's lease first.
    pub fn apply(
        &mut self,
        now: Nanos,
        member: MemberId,
        incarnation: u64,
        seq: u64,
        cmds: Vec<QuotaCmd>,
    ) -> Vec<Billed> {
        match self.incarnations.get(&member) {
            Some(&i) if incarnation < i => return Vec::new(),
            Some(&i) if incarnation > i => {
                self.member_gone(now, member);
                self.seqs.remove(&member);
            }
            _ => {}
        }
        if self.seqs.get(&member).is_some_and(|s| seq <= *s) {
            return Vec::new();
        }
        self.seqs.insert(member, seq);
        self.incarnations.insert(member, incarnation);
        let mut billed = Vec::new();
        for cmd in cmds {
            self.apply_one(now, member, cmd, &mut billed);
        }
        self.prune_early(now);
        self.book.trim(now);
        billed
    }

    /// The last batch of `member` applied.
    pub fn applied_seq(&self, member: MemberId) -> u64 {
        self.seqs.get(&member).copied().unwrap_or(0)
    }

    fn apply_one(&mut self, now: Nanos, member: MemberId, cmd: QuotaCmd, billed: &mut Vec<Billed>) {
        match cmd {
            QuotaCmd::Want {
                tenant,
                limit_key,
                limits,
                tokens,
                requests,
                slots,
            } => {
                let account = (tenant.clone(), limit_key.clone());
                let (t, r) = self
                    .book
                    .take_up_to(now, &tenant, &limit_key, &limits, tokens, requests);
                let s = match limits.concurrency {
                    Some(c) => {
                        let used = self.book.in_flight(&tenant, &limit_key)
                            + self.sliced.get(&account).copied().unwrap_or(0);
                        slots.min(c.saturating_sub(used))
                    }
                    None => slots,
                };
                *self.sliced.entry(account.clone()).or_default() += s;
                self.limits.insert(account, limits);
                let slice = self.slices.entry((member, tenant, limit_key)).or_default();
                slice.tokens += t;
                slice.requests += r;
                slice.slots += s;
            }
            QuotaCmd::Admitted {
                key,
                tenant,
                limit_key,
                model,
                limits,
                debit,
                input_estimate,
            } => {
                if self.book.hold(&key).is_some() || self.owners.contains_key(&key) {
                    return; // a retried report
                }
                self.limits
                    .insert((tenant.clone(), limit_key.clone()), limits.clone());
                let slice = self
                    .slices
                    .entry((member, tenant.clone(), limit_key.clone()))
                    .or_default();
                // Only limited dimensions come from a slice.
                let from_slice = Slice {
                    tokens: match limits.tokens_per_minute {
                        Some(_) => slice.tokens.min(debit),
                        None => debit,
                    },
                    requests: match limits.requests_per_minute {
                        Some(_) => slice.requests.min(1),
                        None => 1,
                    },
                    slots: match limits.concurrency {
                        Some(_) => slice.slots.min(1),
                        None => 1,
                    },
                };
                let taken = Slice {
                    tokens: if limits.tokens_per_minute.is_some() {
                        from_slice.tokens
                    } else {
                        0
                    },
                    requests: if limits.requests_per_minute.is_some() {
                        from_slice.requests
                    } else {
                        0
                    },
                    slots: if limits.concurrency.is_some() {
                        from_slice.slots
                    } else {
                        0
                    },
                };
                slice.tokens -= taken.tokens;
                slice.requests -= taken.requests;
                slice.slots -= taken.slots;
                if taken.slots == 1
                    && let Some(n) = self.sliced.get_mut(&(tenant.clone(), limit_key.clone()))
                {
                    *n = n.saturating_sub(1);
                }
                // Beyond the slice (a late report after the lease ended): charged to the buckets,
                // which may go into debt.
                let over = Slice {
                    tokens: debit - from_slice.tokens,
                    requests: 1 - from_slice.requests,
                    slots: 1 - from_slice.slots,
                };
                if over != Slice::default() {
                    self.book.charge(
                        now,
                        &tenant,
                        &limit_key,
                        &limits,
                        over.tokens,
                        over.requests,
                    );
                    self.overdrawn.tokens += over.tokens;
                    self.overdrawn.requests += over.requests;
                    self.overdrawn.slots += over.slots;
                }
                let ask = Ask {
                    key: &key,
                    tenant: &tenant,
                    limit_key: &limit_key,
                    model: &model,
                    limits: &limits,
                    input_tokens: input_estimate,
                    max_output: None,
                };
                self.book.hold_taken(now, ask, debit);
                self.owners.insert(key.clone(), member);
                if let Some((reported, _)) = self.early.remove(&key) {
                    billed.extend(self.settle(now, &key, reported));
                }
            }
            QuotaCmd::Settle { key, reported } => match self.settle(now, &key, reported) {
                Some(b) => billed.push(b),
                None => {
                    if !self.early.contains_key(&key) && self.early.len() < EARLY_MAX {
                        self.early.insert(key.clone(), (reported, now));
                        self.early_order.push_back((now, key));
                    }
                }
            },
            QuotaCmd::Release { key } => {
                let Some(hold) = self.book.hold(&key).cloned() else {
                    self.early.remove(&key);
                    return;
                };
                let limits = self.limits_of(&hold.tenant, &hold.limit_key);
                self.book.release(now, &key, &limits);
                self.slot_home(&key, &hold);
            }
            QuotaCmd::Return {
                tenant,
                limit_key,
                slice: back,
            } => {
                let Some(slice) = self
                    .slices
                    .get_mut(&(member, tenant.clone(), limit_key.clone()))
                else {
                    return;
                };
                let back = Slice {
                    tokens: back.tokens.min(slice.tokens),
                    requests: back.requests.min(slice.requests),
                    slots: back.slots.min(slice.slots),
                };
                slice.tokens -= back.tokens;
                slice.requests -= back.requests;
                slice.slots -= back.slots;
                self.give_back(now, &tenant, &limit_key, back);
            }
            QuotaCmd::Refused {
                tenant,
                model,
                reason,
            } => self.book.count_refusal(now, &tenant, &model, reason),
        }
    }

    fn limits_of(&self, tenant: &str, limit_key: &str) -> Limits {
        self.limits
            .get(&(tenant.to_string(), limit_key.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    fn give_back(&mut self, now: Nanos, tenant: &str, limit_key: &str, back: Slice) {
        let limits = self.limits_of(tenant, limit_key);
        self.book
            .give_back(now, tenant, limit_key, &limits, back.tokens, back.requests);
        if let Some(n) = self
            .sliced
            .get_mut(&(tenant.to_string(), limit_key.to_string()))
        {
            *n = n.saturating_sub(back.slots);
        }
    }

    fn settle(&mut self, now: Nanos, key: &str, reported: Reported) -> Option<Billed> {
        let hold = self.book.hold(key)?.clone();
        let spent = reported.spent(&hold);
        self.bill(now, key, &hold, spent)
    }

    fn bill(&mut self, now: Nanos, key: &str, hold: &Hold, spent: Spent) -> Option<Billed> {
        let limits = self.limits_of(&hold.tenant, &hold.limit_key);
        let Settled { model, .. } = self.book.settle(now, key, spent, &limits)?;
        self.slot_home(key, hold);
        Some(Billed {
            key: key.to_string(),
            tenant: hold.tenant.clone(),
            limit_key: hold.limit_key.clone(),
            model,
            debit: hold.debit,
            spent,
        })
    }

    /// A request ended: its slot goes back to the slice of the replica that admitted it (if
    /// that replica still holds its lease), else to the pool.
    fn slot_home(&mut self, key: &str, hold: &Hold) {
        let Some(owner) = self.owners.remove(key) else {
            return;
        };
        let limits = self.limits_of(&hold.tenant, &hold.limit_key);
        if limits.concurrency.is_none() || !self.incarnations.contains_key(&owner) {
            return;
        }
        self.slices
            .entry((owner, hold.tenant.clone(), hold.limit_key.clone()))
            .or_default()
            .slots += 1;
        *self
            .sliced
            .entry((hold.tenant.clone(), hold.limit_key.clone()))
            .or_default() += 1;
    }

    /// Members whose lease ended (not in `live`): their slices go back, their requests in
    /// flight are billed as reserved. Called on every applied entry.
    pub fn advance(&mut self, now: Nanos, live: &BTreeSet<MemberId>) {
        // Once a minute: requests whose response was never observed anywhere for an hour are
        // billed as reserved (their slots would otherwise stay taken).
        if now / MINUTE_NS > self.swept {
            self.swept = now / MINUTE_NS;
            for key in self.book.stale(now.saturating_sub(MAX_HOLD)) {
                self.bill_reserved(now, &key);
            }
        }
        let gone: Vec<MemberId> = self
            .incarnations
            .keys()
            .filter(|m| !live.contains(m))
            .copied()
            .collect();
        for m in gone {
            self.member_gone(now, m);
        }
    }

    fn member_gone(&mut self, now: Nanos, member: MemberId) {
        let keys: Vec<_> = self
            .slices
            .range((member, String::new(), String::new())..)
            .take_while(|((m, _, _), _)| *m == member)
            .map(|(k, s)| (k.clone(), *s))
            .collect();
        for ((m, tenant, limit_key), slice) in keys {
            self.slices.remove(&(m, tenant.clone(), limit_key.clone()));
            self.give_back(now, &tenant, &limit_key, slice);
        }
        let held: Vec<String> = self
            .owners
            .iter()
            .filter(|(_, m)| **m == member)
            .map(|(k, _)| k.clone())
            .collect();
        // Its slots go to the pool, not back to it.
        self.incarnations.remove(&member);
        for key in held {
            self.bill_reserved(now, &key);
        }
    }

    /// A request whose response will not be seen: billed what was reserved for it.
    fn bill_reserved(&mut self, now: Nanos, key: &str) {
        let Some(hold) = self.book.hold(key).cloned() else {
            return;
        };
        let spent = Spent {
            input: hold.input_estimate,
            output: hold.debit.saturating_sub(hold.input_estimate),
            cached: 0,
            disconnected: false,
        };
        self.bill(now, key, &hold, spent);
        self.orphaned += 1;
    }

    fn prune_early(&mut self, now: Nanos) {
        while let Some((at, key)) = self.early_order.front() {
            if now.saturating_sub(*at) < EARLY_TTL && self.early_order.len() <= EARLY_MAX {
                break;
            }
            if self.early.get(key).is_some_and(|(_, t)| t == at) {
                self.early.remove(key);
            }
            self.early_order.pop_front();
        }
    }

    /// `member`'s slice of an account as applied.
    pub fn slice(&self, member: MemberId, tenant: &str, limit_key: &str) -> Slice {
        self.slices
            .get(&(member, tenant.to_string(), limit_key.to_string()))
            .copied()
            .unwrap_or_default()
    }

    /// Every slice `member` holds: (tenant, limit key) → slice.
    pub fn slices_of(&self, member: MemberId) -> impl Iterator<Item = (&str, &str, Slice)> {
        self.slices
            .range((member, String::new(), String::new())..)
            .take_while(move |((m, _, _), _)| *m == member)
            .map(|((_, t, k), s)| (t.as_str(), k.as_str(), *s))
    }

    /// What the account's buckets hold beyond the slices, at `now`.
    pub fn view(&mut self, now: Nanos, tenant: &str, limit_key: &str, limits: &Limits) -> RateView {
        self.book.view(now, tenant, limit_key, limits)
    }

    /// What the cluster has left of an account at `now` — the buckets plus every replica's
    /// unused slice (read-only).
    pub fn peek(&self, now: Nanos, tenant: &str, limit_key: &str, limits: &Limits) -> RateView {
        let mut view = self.book.peek(now, tenant, limit_key, limits);
        let (mut t, mut r) = (0, 0);
        for ((_, st, sk), s) in &self.slices {
            if st == tenant && sk == limit_key {
                t += s.tokens;
                r += s.requests;
            }
        }
        if let Some(side) = &mut view.tokens {
            side.remaining = (side.remaining + t).min(side.limit);
        }
        if let Some(side) = &mut view.requests {
            side.remaining = (side.remaining + r).min(side.limit);
        }
        view
    }

    /// Concurrency slots neither in flight nor sliced out.
    pub fn free_slots(&self, tenant: &str, limit_key: &str, limits: &Limits) -> Option<u32> {
        let used = self.book.in_flight(tenant, limit_key)
            + self
                .sliced
                .get(&(tenant.to_string(), limit_key.to_string()))
                .copied()
                .unwrap_or(0);
        limits.concurrency.map(|c| c.saturating_sub(used))
    }

    pub fn book(&self) -> &QuotaBook {
        &self.book
    }

    /// Which replica admitted a held request.
    pub fn owner(&self, key: &str) -> Option<MemberId> {
        self.owners.get(key).copied()
    }

    pub fn overdrawn(&self) -> Slice {
        self.overdrawn
    }

    pub fn orphaned(&self) -> u64 {
        self.orphaned
    }

    /// Slots sliced out of an account (summed over replicas).
    pub fn sliced_slots(&self, tenant: &str, limit_key: &str) -> u32 {
        self.sliced
            .get(&(tenant.to_string(), limit_key.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

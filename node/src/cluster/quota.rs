//! Tenant quotas for the whole cluster: the shell around [`flowctl::quota::shared`].
//!
//! The replicated state holds one book for the cluster. This replica admits within its *slices*
//! of the buckets:
//!
//! * **Fast path** — its slice of the account (as applied, less what its outbox already spends)
//!   covers the request's debit, one request and one slot, and its lease is valid at the applied
//!   index read: admit at once, report [`QuotaCmd::Admitted`] in the next batch. No consensus
//!   round trip.
//! * **Top-up** — otherwise ask for more ([`QuotaCmd::Want`]: the shortfall plus one more such
//!   request) and wait for the batch to apply; the state grants what the buckets hold, so if the
//!   slice still falls short the request is over quota cluster-wide: 429 with the reason of the
//!   first dimension that lacks — except that a request short of a concurrency slot first waits
//!   up to [`CONCURRENCY_GRACE`] for a settlement to free one. No lease (a partition, an
//!   election): wait up to [`DECIDE_WITHIN`], then 503.
//! * Settlements and releases of any replica's requests go through the same outbox; the batch's
//!   output says what it billed (metrics and the usage log are written here). Slices unused for
//!   [`IDLE_RETURN`] go back, so a tenant's budget follows its traffic across replicas.
//!
//! One writer proposes the outbox, one batch per log entry, numbered (a retried proposal is
//! applied once); a watcher follows the applied state: this replica's slices, the batches
//! applied, the accounts' views and in-flight counts.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use flowctl::cluster::{ClusterCommand, ClusterOutput};
use flowctl::quota::shared::{QuotaCmd, Slice};
use flowctl::quota::{Ask, Granted, Limits, QuotaReason, RateView, Refusal, UsageKey, UsageRow};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::member::ClusterMember;
use crate::request::quota::{
    AccountView, Billing, CONCURRENCY_GRACE, NotAdmitted, QuotaLedger, Reported,
};

/// How long a request may wait for a top-up or for the lease to come back.
pub const DECIDE_WITHIN: Duration = Duration::from_secs(2);
/// A slice unused this long goes back to the buckets.
pub const IDLE_RETURN: Duration = Duration::from_secs(2);
/// How long a batch of reports only waits for more before it is proposed.
const REPORT_LINGER: Duration = Duration::from_millis(10);
/// Most commands kept while proposals fail (then the oldest are dropped and counted).
const OUTBOX_LIMIT: usize = 100_000;

type Account = (String, String);

#[derive(Default)]
struct State {
    next_seq: u64,
    /// Commands to propose, oldest first (a deque: past the bound the oldest goes in O(1)).
    outbox: VecDeque<QuotaCmd>,
    /// What the outbox spends of each slice (admissions, returns).
    outbox_spend: HashMap<Account, Slice>,
    /// Proposed batches not yet applied here: seq, what they spend.
    proposed: VecDeque<(u64, HashMap<Account, Slice>)>,
    /// This replica's slices as applied, the applied index they were read at, the last batch
    /// of this replica applied.
    slices: HashMap<Account, Slice>,
    applied_index: u64,
    applied_seq: u64,
    /// Accounts this replica has seen: limits, the cluster's view, the last local use.
    accounts: HashMap<Account, AccountState>,
    /// Commands dropped since the watcher last counted them.
    dropped: u64,
}

struct AccountState {
    limits: Limits,
    /// What the cluster has left (buckets and every slice), for the rate-limit headers.
    view: RateView,
    /// What the buckets alone hold and the slots nobody holds: what a top-up could get.
    free: RateView,
    free_slots: Option<u32>,
    in_flight: u32,
    last_use: Instant,
}

/// An account as the watcher read it.
struct Viewed {
    account: Account,
    view: RateView,
    free: RateView,
    free_slots: Option<u32>,
    in_flight: u32,
}

fn add(a: &mut Slice, b: Slice) {
    a.tokens += b.tokens;
    a.requests += b.requests;
    a.slots += b.slots;
}

impl State {
    /// The applied slice less what pending batches spend.
    fn usable(&self, account: &Account) -> Slice {
        let mut spent = self.outbox_spend.get(account).copied().unwrap_or_default();
        for (_, batch) in &self.proposed {
            if let Some(s) = batch.get(account) {
                add(&mut spent, *s);
            }
        }
        let have = self.slices.get(account).copied().unwrap_or_default();
        Slice {
            tokens: have.tokens.saturating_sub(spent.tokens),
            requests: have.requests.saturating_sub(spent.requests),
            slots: have.slots.saturating_sub(spent.slots),
        }
    }

    fn push(&mut self, cmd: QuotaCmd, spend: Option<(&Account, Slice)>) {
        if self.outbox.len() >= OUTBOX_LIMIT {
            self.outbox.pop_front();
            self.dropped += 1;
        }
        self.outbox.push_back(cmd);
        if let Some((account, s)) = spend {
            add(self.outbox_spend.entry(account.clone()).or_default(), s);
        }
    }
}

/// The cluster's quota ledger on this replica.
pub struct ClusterQuota {
    me: u64,
    member: OnceLock<Arc<ClusterMember>>,
    billing: Arc<Billing>,
    st: Mutex<State>,
    /// The writer's wake-up.
    wake: Notify,
    /// The watcher applied something (waiters re-check).
    changed: Notify,
}

impl std::fmt::Debug for ClusterQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterQuota")
            .field("node", &self.me)
            .finish_non_exhaustive()
    }
}

/// What an admission lacks in a slice.
fn lacking(s: Slice, debit: u64, limits: &Limits) -> Option<QuotaReason> {
    if limits.concurrency.is_some() && s.slots < 1 {
        Some(QuotaReason::Concurrency)
    } else if limits.requests_per_minute.is_some() && s.requests < 1 {
        Some(QuotaReason::Rpm)
    } else if limits.tokens_per_minute.is_some() && s.tokens < debit {
        Some(QuotaReason::Tpm)
    } else {
        None
    }
}

/// Nanoseconds until `need` more than what is left refills, at `limit` a minute.
fn refill_wait(limit: u64, remaining: u64, need: u64) -> Option<u64> {
    if need > limit {
        return None;
    }
    let missing = need.saturating_sub(remaining);
    Some(((u128::from(missing) * 60_000_000_000).div_ceil(u128::from(limit.max(1)))) as u64)
}

impl ClusterQuota {
    pub fn new(me: u64, billing: Arc<Billing>) -> Arc<Self> {
        Arc::new(ClusterQuota {
            me,
            member: OnceLock::new(),
            billing,
            st: Mutex::new(State {
                next_seq: 1,
                ..State::default()
            }),
            wake: Notify::new(),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this replica may admit from its slices: its lease is valid and the slices were
    /// read at or after the index from which its state reflects that lease.
    fn lease_ok(&self, st: &State) -> bool {
        self.member
            .get()
            .and_then(|m| m.lease_index())
            .is_some_and(|i| st.applied_index >= i)
    }

    async fn admit_inner(&self, ask: Ask<'_>) -> Result<Granted, NotAdmitted> {
        let account: Account = (ask.tenant.to_string(), ask.limit_key.to_string());
        let output_budget = ask.limits.output_budget(ask.max_output);
        let debit = ask.input_tokens.saturating_add(output_budget.unwrap_or(0));
        let start = tokio::time::Instant::now();
        let (grace, deadline) = (start + CONCURRENCY_GRACE, start + DECIDE_WITHIN);
        // The batch that carries this request's top-up, once asked.
        let mut asked: Option<u64> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = tokio::time::Instant::now();
            let waiting = now < grace;
            if let Some(done) =
                self.try_admit(&ask, &account, debit, output_budget, &mut asked, waiting)
            {
                self.wake.notify_one();
                return done;
            }
            // Wake at the end of the grace (to refuse) or at the deadline (no lease: 503).
            let until = if waiting { grace } else { deadline };
            if tokio::time::timeout_at(until, changed).await.is_err() && !waiting {
                return Err(NotAdmitted::Unavailable);
            }
        }
    }

    /// One look at this replica's slice: admit, refuse, or (`None`) wait — for a top-up asked
    /// here, or for the lease.
    fn try_admit(
        &self,
        ask: &Ask<'_>,
        account: &Account,
        debit: u64,
        output_budget: Option<u64>,
        asked: &mut Option<u64>,
        grace: bool,
    ) -> Option<Result<Granted, NotAdmitted>> {
        let limits = ask.limits;
        let mut st = self.lock();
        let a = st
            .accounts
            .entry(account.clone())
            .or_insert_with(|| AccountState {
                limits: limits.clone(),
                view: RateView::default(),
                free: RateView::default(),
                free_slots: None,
                in_flight: 0,
                last_use: Instant::now(),
            });
        a.limits = limits.clone();
        a.last_use = Instant::now();
        let (view, free, free_slots) = (a.view, a.free, a.free_slots);
        if !self.lease_ok(&st) {
            return None;
        }
        let usable = st.usable(account);
        let Some(reason) = lacking(usable, debit, limits) else {
            let spend = Slice {
                tokens: if limits.tokens_per_minute.is_some() {
                    debit
                } else {
                    0
                },
                requests: u64::from(limits.requests_per_minute.is_some()),
                slots: u32::from(limits.concurrency.is_some()),
            };
            let cmd = QuotaCmd::Admitted {
                key: ask.key.to_string(),
                tenant: ask.tenant.to_string(),
                limit_key: ask.limit_key.to_string(),
                model: ask.model.to_string(),
                limits: limits.clone(),
                debit,
                input_estimate: ask.input_tokens,
            };
            st.push(cmd, Some((account, spend)));
            return Some(Ok(Granted {
                debit,
                output_budget,
                view,
            }));
        };
        // What the buckets alone hold (and the slots nobody holds) plus this slice: all a
        // top-up could make of it, as of the last applied entry.
        let within_reach = match reason {
            QuotaReason::Concurrency => free_slots.is_none_or(|f| f > 0),
            QuotaReason::Rpm => free
                .requests
                .is_none_or(|s| s.remaining + usable.requests >= 1),
            QuotaReason::Tpm => free
                .tokens
                .is_none_or(|s| s.remaining + usable.tokens >= debit),
        };
        let topped_up = asked.is_some_and(|seq| st.applied_seq >= seq);
        if asked.is_none() && within_reach {
            // Ask for the shortfall and one more such request; wait for the batch to apply.
            let want = |limit: Option<u64>, have: u64, need: u64| {
                limit.map_or(0, |_| need.saturating_sub(have) + need)
            };
            let cmd = QuotaCmd::Want {
                tenant: ask.tenant.to_string(),
                limit_key: ask.limit_key.to_string(),
                limits: limits.clone(),
                tokens: want(limits.tokens_per_minute, usable.tokens, debit),
                requests: want(limits.requests_per_minute, usable.requests, 1),
                slots: want(
                    limits.concurrency.map(u64::from),
                    u64::from(usable.slots),
                    1,
                ) as u32,
            };
            *asked = Some(st.next_seq);
            st.push(cmd, None);
            self.wake.notify_one();
            return None;
        }
        if asked.is_some() && !topped_up {
            return None;
        }
        if reason == QuotaReason::Concurrency && grace {
            // Every slot of the cluster is held: wait (within the grace) for a settlement to
            // free one, then ask again.
            *asked = None;
            return None;
        }
        // Over quota cluster-wide: the top-up applied and the slice still falls short, or the
        // buckets are known not to hold it.
        let retry_after = match reason {
            QuotaReason::Concurrency => Some(0),
            QuotaReason::Rpm => free
                .requests
                .and_then(|s| refill_wait(s.limit, s.remaining + usable.requests, 1)),
            QuotaReason::Tpm => free
                .tokens
                .and_then(|s| refill_wait(s.limit, s.remaining + usable.tokens, debit)),
        };
        let cmd = QuotaCmd::Refused {
            tenant: ask.tenant.to_string(),
            model: ask.model.to_string(),
            reason,
        };
        st.push(cmd, None);
        Some(Err(NotAdmitted::Quota(Refusal {
            reason,
            retry_after,
            view,
        })))
    }

    fn push_and_wake(&self, cmd: QuotaCmd) {
        self.lock().push(cmd, None);
        self.wake.notify_one();
    }

    /// Start the writer and the watcher (once the consensus node runs).
    pub async fn run(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let _ = self.member.set(member.clone());
        let writer = tokio::spawn(self.clone().writer(member.clone(), stop.clone()));
        self.watcher(member, stop).await;
        let _ = writer.await;
    }

    async fn writer(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let lease = member.lease();
        let incarnation = member.incarnation();
        // A batch proposed and not known to be applied: retried as is (same number).
        let mut retry: Option<(u64, Vec<QuotaCmd>)> = None;
        loop {
            if retry.is_none() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            let (seq, cmds) = match retry.take() {
                Some(b) => b,
                None => {
                    let urgent = {
                        let st = self.lock();
                        if st.outbox.is_empty() {
                            continue;
                        }
                        st.outbox.iter().any(|c| matches!(c, QuotaCmd::Want { .. }))
                    };
                    // Reports (admissions, settlements, refusals) wait a moment for company;
                    // a top-up has a request waiting for it.
                    if !urgent {
                        tokio::time::sleep(REPORT_LINGER).await;
                    }
                    let mut st = self.lock();
                    let seq = st.next_seq;
                    st.next_seq += 1;
                    let spend = std::mem::take(&mut st.outbox_spend);
                    st.proposed.push_back((seq, spend));
                    (seq, Vec::from(std::mem::take(&mut st.outbox)))
                }
            };
            let res = tokio::time::timeout(
                lease,
                member.node.propose(ClusterCommand::Quota {
                    node: self.me,
                    incarnation,
                    seq,
                    now_us: consensus::clock::now_us(),
                    lease_ms: lease.as_millis() as u64,
                    cmds: cmds.clone(),
                }),
            )
            .await;
            match res {
                Ok(Ok(ClusterOutput::Quota(billed))) => {
                    self.billing.proposed(cmds.len());
                    for b in &billed {
                        self.billing.billed(b);
                    }
                }
                Ok(Ok(_)) => {}
                _ => {
                    if stop.is_cancelled() {
                        return;
                    }
                    retry = Some((seq, cmds));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// Follow the applied state: slices, applied batches, views; return idle slices.
    async fn watcher(self: Arc<Self>, member: Arc<ClusterMember>, stop: CancellationToken) {
        let me = self.me;
        let mut applied = member.node.watch();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = applied.changed() => if r.is_err() { return },
                _ = tick.tick() => {}
            }
            let accounts: Vec<(Account, Limits)> = self
                .lock()
                .accounts
                .iter()
                .map(|(k, a)| (k.clone(), a.limits.clone()))
                .collect();
            let ((slices, seq, views), index) = member
                .node
                .local_read(|s| {
                    let q = s.0.quota();
                    let now = s.0.now_ms().saturating_mul(1_000_000);
                    let slices: HashMap<Account, Slice> = q
                        .slices_of(me)
                        .map(|(t, k, s)| ((t.to_string(), k.to_string()), s))
                        .collect();
                    let views: Vec<Viewed> = accounts
                        .iter()
                        .map(|((t, k), l)| Viewed {
                            account: (t.clone(), k.clone()),
                            view: q.peek(now, t, k, l),
                            free: q.book().peek(now, t, k, l),
                            free_slots: q.free_slots(t, k, l),
                            in_flight: q.book().in_flight(t, k),
                        })
                        .collect();
                    (slices, q.applied_seq(me), views)
                })
                .await;
            let mut returns = Vec::new();
            {
                let mut st = self.lock();
                let dropped = std::mem::take(&mut st.dropped);
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "quota commands dropped: proposals have failed too long"
                    );
                    self.billing.dropped(dropped);
                }
                st.slices = slices;
                st.applied_index = index;
                st.applied_seq = seq;
                while st.proposed.front().is_some_and(|(s, _)| *s <= seq) {
                    st.proposed.pop_front();
                }
                for v in views {
                    if let Some(a) = st.accounts.get_mut(&v.account) {
                        a.view = v.view;
                        a.free = v.free;
                        a.free_slots = v.free_slots;
                        a.in_flight = v.in_flight;
                    }
                    self.billing
                        .in_flight(&v.account.0, &v.account.1, v.in_flight);
                }
                // Slices idle for a while go back to the buckets.
                let idle: Vec<Account> = st
                    .accounts
                    .iter()
                    .filter(|(_, a)| a.last_use.elapsed() >= IDLE_RETURN)
                    .map(|(k, _)| k.clone())
                    .collect();
                for account in idle {
                    let back = st.usable(&account);
                    if back != Slice::default() {
                        returns.push((account, back));
                    }
                }
                for (account, back) in &returns {
                    let cmd = QuotaCmd::Return {
                        tenant: account.0.clone(),
                        limit_key: account.1.clone(),
                        slice: *back,
                    };
                    st.push(cmd, Some((account, *back)));
                }
            }
            if !returns.is_empty() {
                self.wake.notify_one();
            }
            self.changed.notify_waiters();
        }
    }
}

impl QuotaLedger for ClusterQuota {
    fn admit<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Granted, NotAdmitted>> {
        self.admit_inner(ask).boxed()
    }

    fn settle(&self, key: &str, reported: Reported) -> Option<flowctl::quota::shared::Billed> {
        // Billed when the batch applies (the writer records it).
        self.push_and_wake(QuotaCmd::Settle {
            key: key.to_string(),
            reported,
        });
        None
    }

    fn release(&self, key: &str) {
        self.push_and_wake(QuotaCmd::Release {
            key: key.to_string(),
        });
    }

    fn usage(&self, first: u64) -> BoxFuture<'_, Vec<(UsageKey, UsageRow)>> {
        async move {
            let Some(m) = self.member.get() else {
                return Vec::new();
            };
            m.node
                .local_read(|s| s.0.quota().book().usage_since(first))
                .await
                .0
        }
        .boxed()
    }

    fn account<'a>(
        &'a self,
        tenant: &'a str,
        limit_key: &'a str,
        limits: &'a Limits,
    ) -> BoxFuture<'a, AccountView> {
        async move {
            let Some(m) = self.member.get() else {
                return AccountView::default();
            };
            m.node
                .local_read(|s| {
                    let q = s.0.quota();
                    let now = s.0.now_ms().saturating_mul(1_000_000);
                    AccountView {
                        view: q.peek(now, tenant, limit_key, limits),
                        in_flight: q.book().in_flight(tenant, limit_key),
                    }
                })
                .await
                .0
        }
        .boxed()
    }
}

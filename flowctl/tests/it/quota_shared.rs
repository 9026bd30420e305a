//! Cluster-wide quotas, model-checked: three replicas admit from their slices, report in
//! batches delivered in any order with their settlements (from any replica, before or after the
//! admission's report), return slices, lose and regain their leases. Time stands still, so the
//! arithmetic is exact:
//! * conservation — bucket + slices + open holds' debits + settled charges = the limit;
//! * the bound — tokens admitted cluster-wide never exceed the limit plus what replicas that lost
//!   their lease had in their slices when they lost it (and with no lease lost, never the limit);
//!   in flight + sliced slots never exceed the concurrency limit by more than the same;
//! * nothing is charged twice, and the ledger sums to the settled usage.

use std::collections::BTreeSet;

use flowctl::quota::shared::{QuotaCmd, SharedQuota, Slice};
use flowctl::quota::{Limits, Reported};
use proptest::prelude::*;

const LIMIT: u64 = 5_000;
const SLOTS: u32 = 6;

fn limits() -> Limits {
    Limits {
        requests_per_minute: Some(1_000),
        tokens_per_minute: Some(LIMIT),
        concurrency: Some(SLOTS),
        default_max_tokens: None,
        max_tokens_cap: None,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Member m gets a request of this debit: admit from its slice or ask for more.
    Request(usize, u16),
    /// Member m's outbox is proposed and applied.
    Deliver(usize),
    /// Member m observed the end of the n-th admitted request, which used `used` of its debit.
    Settle(usize, usize, u8),
    /// Member m releases the n-th admitted request (never reached a pod).
    Release(usize, usize),
    /// Member m returns its slice.
    Return(usize),
    /// Member m loses its lease (its outbox is held until it is back).
    Expire(usize),
    Revive(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let m = 0usize..3;
    prop_oneof![
        4 => (m.clone(), 50u16..900).prop_map(|(m, d)| Op::Request(m, d)),
        4 => m.clone().prop_map(Op::Deliver),
        3 => (m.clone(), 0usize..64, 0u8..=100).prop_map(|(m, n, u)| Op::Settle(m, n, u)),
        1 => (m.clone(), 0usize..64).prop_map(|(m, n)| Op::Release(m, n)),
        1 => m.clone().prop_map(Op::Return),
        1 => m.clone().prop_map(Op::Expire),
        1 => m.prop_map(Op::Revive),
    ]
}

#[derive(Default)]
struct Member {
    outbox: Vec<QuotaCmd>,
    /// What the outbox spends of the applied slice (admissions and returns not yet applied).
    pending: Slice,
    down: bool,
}

impl Member {
    /// The applied slice less what the outbox spends: what the member may still admit from.
    fn usable(&self, applied: Slice) -> Slice {
        Slice {
            tokens: applied.tokens.saturating_sub(self.pending.tokens),
            requests: applied.requests.saturating_sub(self.pending.requests),
            slots: applied.slots.saturating_sub(self.pending.slots),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn slices_never_let_the_cluster_overspend(ops in proptest::collection::vec(op(), 1..200)) {
        let l = limits();
        let mut q = SharedQuota::default();
        let mut members: Vec<Member> = (0..3).map(|_| Member::default()).collect();
        // Every admitted request: key, debit.
        let mut admitted: Vec<(String, u64)> = Vec::new();
        let mut slack = Slice::default();
        let mut seq = 0u64;
        let now = 0;
        for op in ops {
            match op {
                Op::Request(m, debit) => {
                    let debit = u64::from(debit);
                    let me = &mut members[m];
                    if me.down {
                        continue; // a replica without its lease admits nothing
                    }
                    let usable = me.usable(q.slice(m as u64, "t", "*"));
                    if usable.tokens >= debit && usable.requests >= 1 && usable.slots >= 1 {
                        let key = format!("k{}", admitted.len());
                        me.outbox.push(QuotaCmd::Admitted {
                            key: key.clone(), tenant: "t".into(), limit_key: "*".into(),
                            model: "m".into(), limits: l.clone(), debit, input_estimate: debit / 2,
                        });
                        me.pending.tokens += debit;
                        me.pending.requests += 1;
                        me.pending.slots += 1;
                        admitted.push((key, debit));
                    } else {
                        me.outbox.push(QuotaCmd::Want {
                            tenant: "t".into(), limit_key: "*".into(), limits: l.clone(),
                            tokens: debit * 2, requests: 2, slots: 2,
                        });
                    }
                }
                Op::Deliver(m) => {
                    if members[m].down {
                        continue;
                    }
                    let cmds = std::mem::take(&mut members[m].outbox);
                    let last = cmds.clone();
                    seq += 1;
                    q.apply(now, m as u64, 1, seq, cmds);
                    if seq.is_multiple_of(5) {
                        // A retried proposal: applied once.
                        let before = q.clone();
                        q.apply(now, m as u64, 1, seq, last.clone());
                        prop_assert_eq!(&before, &q);
                    }
                    members[m].pending = Slice::default();
                    let live: BTreeSet<u64> = (0..3).filter(|i| !members[*i as usize].down).collect();
                    q.advance(now, &live);
                }
                Op::Settle(m, n, used) => {
                    if let Some((key, debit)) = admitted.get(n).cloned() {
                        let charge = debit * u64::from(used) / 100;
                        let reported = Reported { input: Some(charge / 2), output: Some(charge - charge / 2), cached: 0, events: 0, ended: true };
                        members[m].outbox.push(QuotaCmd::Settle { key, reported });
                    }
                }
                Op::Release(m, n) => {
                    if let Some((key, _)) = admitted.get(n).cloned() {
                        members[m].outbox.push(QuotaCmd::Release { key });
                    }
                }
                Op::Return(m) => {
                    // Only what no unreported admission has spent.
                    let me = &mut members[m];
                    let back = me.usable(q.slice(m as u64, "t", "*"));
                    me.pending.tokens += back.tokens;
                    me.pending.requests += back.requests;
                    me.pending.slots += back.slots;
                    me.outbox.push(QuotaCmd::Return { tenant: "t".into(), limit_key: "*".into(), slice: back });
                }
                Op::Expire(m) => {
                    if members[m].down {
                        continue;
                    }
                    let s = q.slice(m as u64, "t", "*");
                    slack.tokens += s.tokens;
                    slack.requests += s.requests;
                    slack.slots += s.slots;
                    members[m].down = true;
                    let live: BTreeSet<u64> = (0..3).filter(|i| !members[*i as usize].down).collect();
                    q.advance(now, &live);
                    prop_assert_eq!(q.slice(m as u64, "t", "*"), Slice::default());
                }
                Op::Revive(m) => members[m].down = false,
            }
            let book = q.book();
            let tokens_left = book.tokens_left("t", "*").unwrap_or(LIMIT as i64);
            let slices: u64 = (0..3).map(|m| q.slice(m, "t", "*").tokens).sum();
            let open: u64 = book.holds().map(|(_, h)| h.debit).sum();
            let billed: u64 = book.usage().map(|(_, r)| r.input + r.output).sum();
            prop_assert_eq!(
                tokens_left + slices as i64 + open as i64 + billed as i64,
                LIMIT as i64,
                "conservation"
            );
            let in_flight = book.in_flight("t", "*");
            prop_assert!(in_flight + q.sliced_slots("t", "*") <= SLOTS + q.overdrawn().slots + slack.slots);
            prop_assert!(q.overdrawn().tokens <= slack.tokens, "overdrawn {:?} beyond the slices of lost leases {:?}", q.overdrawn(), slack);
            prop_assert!(q.overdrawn().slots <= slack.slots);
        }
    }
}

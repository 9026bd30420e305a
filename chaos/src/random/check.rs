//! The invariant checker: what a chaos run observed from outside (the clients' records, the pods'
//! counters, the replicas' views after the run) against the architecture's invariants.
//!
//! Every check reports its measured value, pass or fail. The checks, in terms of what is
//! observable:
//! - I1 bounded admission: the peak of requests running or waiting in the pods, sampled every
//!   20 ms, stays within capacity + credit slack.
//! - I2 strict priority: the critical tenant is dispatched ahead of the standard ones — its
//!   median wait for response headers is under half theirs (a backlog of standard requests
//!   waits throughout).
//! - I3 fairness: the two standard tenants share the pool equally (round-robin fairness), although
//!   one runs twice as many clients: `a`'s share of their completions within ±0.1 of 0.5.
//! - I4 no leaks: once the load is over and every fault healed, every replica's ledger returns to
//!   zero in flight and queued within the limit.
//! - I5 nothing lost: every request ends as a complete 200, a 429 with a reason, or a 503; none
//!   times out, none gets another status.
//! - I6 no double dispatch: the pods served exactly as many requests as clients got 200s; and
//!   dispatch resumes: the longest gap between successive responses stays within one fault's
//!   hold plus one failover (see [`super::stall_limit`]).
//! - I8 convergence: every replica's prefix index is the same shortly after the load stops.
//! - I9 streams survive: no 200 stream ends early.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::load::{Outcome, Record};

/// Tenant names the checks know (see the workload in [`super::run`]).
pub const STANDARD: [&str; 2] = ["a", "b"];
pub const CRITICAL: &str = "c";

/// What a run observed, for [`checks`].
#[derive(Debug)]
pub struct Observed {
    pub records: Vec<Record>,
    pub peak_in_pods: u64,
    /// When the peak was first reached.
    pub peak_at: Duration,
    /// Capacity + credit slack.
    pub admission_bound: u64,
    /// Requests the pods completed during the run.
    pub served_by_pods: u64,
    /// How long after the end the ledgers were empty, or what remained.
    pub ledger_drained: Result<Duration, String>,
    pub ledger_limit: Duration,
    /// How long after the end the prefix indexes agreed, or how they differ.
    pub indexes_converged: Result<Duration, String>,
    /// Longest tolerated gap between successive responses.
    pub stall_limit: Duration,
}

/// One invariant's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub id: &'static str,
    pub name: &'static str,
    pub measured: String,
    pub ok: bool,
}

fn check(id: &'static str, name: &'static str, ok: bool, measured: String) -> Check {
    Check {
        id,
        name,
        measured,
        ok,
    }
}

fn median(mut v: Vec<Duration>) -> Option<Duration> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn waits(records: &[Record], tenants: &[&str]) -> Vec<Duration> {
    records
        .iter()
        .filter(|r| tenants.contains(&r.tenant) && r.outcome == Outcome::Complete)
        .filter_map(|r| r.headers.map(|h| h.saturating_sub(r.start)))
        .collect()
}

/// The requests by outcome label.
pub fn outcomes(records: &[Record]) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for r in records {
        *m.entry(r.outcome.label()).or_insert(0) += 1;
    }
    m
}

/// Complete responses per second of the run (by the second their headers arrived).
pub fn per_second(records: &[Record]) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::new();
    for h in records
        .iter()
        .filter(|r| r.outcome == Outcome::Complete)
        .filter_map(|r| r.headers)
    {
        let s = h.as_secs() as usize;
        if v.len() <= s {
            v.resize(s + 1, 0);
        }
        v[s] += 1;
    }
    v
}

/// The longest gap between successive response headers of complete requests.
pub fn longest_stall(records: &[Record]) -> Duration {
    let mut t: Vec<Duration> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Complete)
        .filter_map(|r| r.headers)
        .collect();
    t.sort_unstable();
    t.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default()
}

/// Every invariant against what was observed.
pub fn checks(o: &Observed) -> Vec<Check> {
    let r = &o.records;
    let mut out = Vec::new();

    out.push(check(
        "I1",
        "bounded admission",
        o.peak_in_pods <= o.admission_bound,
        format!(
            "peak {} in the pods at {:.1} s, bound {}",
            o.peak_in_pods,
            o.peak_at.as_secs_f64(),
            o.admission_bound
        ),
    ));

    let (crit, std) = (median(waits(r, &[CRITICAL])), median(waits(r, &STANDARD)));
    out.push(check(
        "I2",
        "strict priority",
        matches!((crit, std), (Some(c), Some(s)) if c * 2 < s),
        format!("median wait: critical {crit:?}, standard {std:?}"),
    ));

    let done = |t: &str| {
        r.iter()
            .filter(|x| x.tenant == t && x.outcome == Outcome::Complete)
            .count() as f64
    };
    let (a, b) = (done(STANDARD[0]), done(STANDARD[1]));
    let share = if a + b > 0.0 { a / (a + b) } else { 0.0 };
    out.push(check(
        "I3",
        "fairness",
        (share - 0.5).abs() <= 0.1,
        format!(
            "a's share {share:.3} of {} standard completions (want 0.5 ± 0.1)",
            a + b
        ),
    ));

    out.push(match &o.ledger_drained {
        Ok(d) => check(
            "I4",
            "no leaks",
            *d <= o.ledger_limit,
            format!(
                "ledgers empty {d:?} after the end (limit {:?})",
                o.ledger_limit
            ),
        ),
        Err(e) => check("I4", "no leaks", false, e.clone()),
    });

    let lost: Vec<&Record> = r
        .iter()
        .filter(|x| match &x.outcome {
            Outcome::Complete | Outcome::Unavailable | Outcome::Truncated(_) => false,
            Outcome::Refused(reason) => reason.is_empty(),
            Outcome::Status(_) | Outcome::Lost(_) => true,
        })
        .collect();
    let longest = r.iter().map(|x| x.end - x.start).max().unwrap_or_default();
    out.push(check(
        "I5",
        "nothing lost",
        lost.is_empty(),
        format!(
            "{} of {} requests without an allowed end{}; longest request {longest:?}",
            lost.len(),
            r.len(),
            lost.first()
                .map(|x| format!(" (first: {:?} at {:?})", x.outcome, x.start))
                .unwrap_or_default()
        ),
    ));

    let answered = r
        .iter()
        .filter(|x| matches!(x.outcome, Outcome::Complete | Outcome::Truncated(_)))
        .count() as u64;
    let stall = longest_stall(r);
    out.push(check(
        "I6",
        "dispatched once, failover",
        o.served_by_pods == answered && stall <= o.stall_limit,
        format!(
            "pods served {}, clients got {answered} 200s; longest gap between responses \
             {stall:?} (limit {:?})",
            o.served_by_pods, o.stall_limit
        ),
    ));

    out.push(match &o.indexes_converged {
        Ok(d) => check(
            "I8",
            "convergence",
            true,
            format!("prefix indexes equal {d:?} after the end"),
        ),
        Err(e) => check("I8", "convergence", false, e.clone()),
    });

    let cut: Vec<&Record> = r
        .iter()
        .filter(|x| matches!(x.outcome, Outcome::Truncated(_)))
        .collect();
    out.push(check(
        "I9",
        "streams survive",
        cut.is_empty(),
        format!(
            "{} truncated streams{}",
            cut.len(),
            cut.first()
                .map(|x| format!(" (first: {:?})", x.outcome))
                .unwrap_or_default()
        ),
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: &'static str, start_ms: u64, wait_ms: u64, outcome: Outcome) -> Record {
        Record {
            tenant,
            start: Duration::from_millis(start_ms),
            headers: Some(Duration::from_millis(start_ms + wait_ms)),
            end: Duration::from_millis(start_ms + wait_ms + 100),
            outcome,
        }
    }

    fn healthy() -> Observed {
        let mut records = Vec::new();
        for i in 0..100 {
            records.push(rec("a", i * 10, 80, Outcome::Complete));
            records.push(rec("b", i * 10 + 5, 90, Outcome::Complete));
            records.push(rec("c", i * 10 + 7, 5, Outcome::Complete));
        }
        records.push(rec(
            "b",
            3,
            1,
            Outcome::Refused("rejected-saturated".into()),
        ));
        records.push(rec("a", 4, 1, Outcome::Unavailable));
        Observed {
            served_by_pods: 300,
            records,
            peak_in_pods: 24,
            peak_at: Duration::from_secs(3),
            admission_bound: 24,
            ledger_drained: Ok(Duration::from_millis(300)),
            ledger_limit: Duration::from_secs(2),
            indexes_converged: Ok(Duration::from_millis(50)),
            stall_limit: Duration::from_secs(2),
        }
    }

    fn failing(o: &Observed) -> Vec<&'static str> {
        checks(o)
            .into_iter()
            .filter(|c| !c.ok)
            .map(|c| c.id)
            .collect()
    }

    #[test]
    fn a_healthy_run_passes_every_check() {
        assert_eq!(
            failing(&healthy()),
            Vec::<&str>::new(),
            "{:#?}",
            checks(&healthy())
        );
    }

    #[test]
    fn each_violation_is_caught_by_its_check() {
        let mut o = healthy();
        o.peak_in_pods = 25;
        assert_eq!(failing(&o), ["I1"]);

        let mut o = healthy();
        for r in o.records.iter_mut().filter(|r| r.tenant == "c") {
            r.headers = Some(r.start + Duration::from_millis(60));
        }
        assert_eq!(failing(&o), ["I2"]);

        let mut o = healthy();
        o.records
            .retain(|r| !(r.tenant == "a" && r.start.as_millis() % 20 == 0));
        assert_eq!(failing(&o), ["I3", "I6"], "fewer answers than pods served");
        o.served_by_pods = 250;
        assert_eq!(failing(&o), ["I3"]);

        let mut o = healthy();
        o.ledger_drained = Err("replica 2: 3 in flight".into());
        assert_eq!(failing(&o), ["I4"]);
        o.ledger_drained = Ok(Duration::from_secs(3));
        assert_eq!(failing(&o), ["I4"]);

        for bad in [
            Outcome::Refused(String::new()),
            Outcome::Status(500),
            Outcome::Lost("timeout".into()),
        ] {
            let mut o = healthy();
            o.records.push(rec("a", 1, 1, bad));
            assert_eq!(failing(&o), ["I5"]);
        }

        let mut o = healthy();
        o.served_by_pods = 301;
        assert_eq!(failing(&o), ["I6"]);
        let mut o = healthy();
        o.records.push(rec("a", 9000, 10, Outcome::Complete));
        o.served_by_pods = 301;
        assert_eq!(failing(&o), ["I6"], "a 7.9 s gap before the last response");

        let mut o = healthy();
        o.indexes_converged = Err("pod-1 differs".into());
        assert_eq!(failing(&o), ["I8"]);

        let mut o = healthy();
        o.records[0].outcome = Outcome::Truncated("no [DONE]".into());
        assert_eq!(failing(&o), ["I9"]);
    }
}

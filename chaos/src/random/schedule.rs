//! A seeded schedule of faults: the same seed gives the same schedule, so a failing run can be
//! replayed.
//!
//! The schedule keeps a majority healthy: at most `(replicas - 1) / 2` faults at once, each
//! degrading one replica (a one-way cut degrades the replica that cannot send; both of its ends
//! are kept free of other faults meanwhile), so the invariants that need a quorum — dispatch
//! resumes, the ledger heals — are owed throughout. Faults start at random
//! gaps and last a random while; the last one ends a little before the load does, so the run
//! finishes healed and the checks after it see a cluster that has had time to converge.

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One-way latency a delayed replica's links get (milliseconds). At most a sixth of the
/// harness's minimum election timeout (300 ms), so a round trip stays well inside it: Raft needs
/// its broadcast time well below the election timeout, and beyond that (seen with 90–250 ms here)
/// followers keep timing out, leaders keep changing and nothing commits for as long as the delay
/// lasts — the operator's knob is the election timeout, not something the EPP can route around.
pub const LATENCY_MS: (u64, u64) = (10, 50);

/// Clock offsets a skewed replica gets (milliseconds), the issue's ±2 s.
pub const SKEWS_MS: [i64; 2] = [-2000, 2000];

/// One fault on the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9`, restarted from its data directory when the fault ends.
    Kill { id: u64 },
    /// SIGSTOP, SIGCONT when the fault ends (a long GC pause, a stuck VM).
    Pause { id: u64 },
    /// Every peer link to and from `id` cut.
    Isolate { id: u64 },
    /// `from` cannot reach `to`; `to` still reaches `from`.
    OneWay { from: u64, to: u64 },
    /// Every peer link of `id` delayed by `ms` in each direction.
    Latency { id: u64, ms: u64 },
    /// `kill -9`, restarted with its wall clock shifted by `offset_ms` (kept for the rest of the
    /// run: the clock stays wrong after the fault "ends").
    Skew { id: u64, offset_ms: i64 },
}

impl Fault {
    /// The replicas this fault touches (a one-way cut touches both ends; a replica is under one
    /// fault at a time).
    pub fn targets(&self) -> Vec<u64> {
        match *self {
            Fault::Kill { id }
            | Fault::Pause { id }
            | Fault::Isolate { id }
            | Fault::Latency { id, .. }
            | Fault::Skew { id, .. } => vec![id],
            Fault::OneWay { from, to } => vec![from, to],
        }
    }

    /// The report's name for the kind of fault.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Kill { .. } => "kill-9",
            Fault::Pause { .. } => "sigstop",
            Fault::Isolate { .. } => "partition",
            Fault::OneWay { .. } => "one-way-partition",
            Fault::Latency { .. } => "latency",
            Fault::Skew { .. } => "clock-skew",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Fault::Kill { id } => write!(f, "kill -9 replica {id}"),
            Fault::Pause { id } => write!(f, "SIGSTOP replica {id}"),
            Fault::Isolate { id } => write!(f, "partition replica {id} from all"),
            Fault::OneWay { from, to } => write!(f, "cut {from} -> {to} (one way)"),
            Fault::Latency { id, ms } => write!(f, "{ms} ms latency on replica {id}'s links"),
            Fault::Skew { id, offset_ms } => {
                write!(
                    f,
                    "restart replica {id} with its clock {offset_ms:+} ms off"
                )
            }
        }
    }
}

/// A fault with its start and its end, since the start of the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub at: Duration,
    pub until: Duration,
    pub fault: Fault,
}

/// Bounds for the schedule.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub replicas: u64,
    /// Length of the load; faults happen within it.
    pub run: Duration,
    /// Quiet time at the start (the cluster warms up) and before the end (it heals).
    pub margin: Duration,
    /// Gap between one fault's start and the next's, drawn uniformly from this range.
    pub gap: (Duration, Duration),
    /// How long a fault lasts, drawn uniformly from this range.
    pub hold: (Duration, Duration),
}

impl Shape {
    /// Faults that may be active at once while a majority stays healthy.
    pub fn max_concurrent(&self) -> usize {
        ((self.replicas.saturating_sub(1)) / 2) as usize
    }
}

fn between(rng: &mut StdRng, (lo, hi): (Duration, Duration)) -> Duration {
    if hi <= lo {
        return lo;
    }
    Duration::from_millis(rng.random_range(lo.as_millis() as u64..=hi.as_millis() as u64))
}

/// The faults for `seed`, in start order.
pub fn plan(seed: u64, shape: &Shape) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out: Vec<Planned> = Vec::new();
    let end = shape.run.saturating_sub(shape.margin);
    let mut at = shape.margin;
    let mut skewed: Option<u64> = None;
    let limit = shape.max_concurrent();
    while at < end && limit > 0 {
        let hold = between(&mut rng, shape.hold);
        let until = (at + hold).min(end);
        // Replicas free of any fault overlapping [at, until).
        let busy: Vec<u64> = out
            .iter()
            .filter(|p| p.at < until && at < p.until)
            .flat_map(|p| p.fault.targets())
            .collect();
        let free: Vec<u64> = (1..=shape.replicas)
            .filter(|id| !busy.contains(id))
            .collect();
        let active = out.iter().filter(|p| p.at < until && at < p.until).count();
        if active < limit && !free.is_empty() && until > at {
            let id = free[rng.random_range(0..free.len())];
            let fault = match rng.random_range(0..6u32) {
                0 => Fault::Kill { id },
                1 => Fault::Pause { id },
                2 => Fault::Isolate { id },
                3 if free.len() >= 2 => {
                    let others: Vec<u64> = free.iter().copied().filter(|o| *o != id).collect();
                    Fault::OneWay {
                        from: id,
                        to: others[rng.random_range(0..others.len())],
                    }
                }
                3 => Fault::Isolate { id },
                4 => Fault::Latency {
                    id,
                    ms: rng.random_range(LATENCY_MS.0..=LATENCY_MS.1),
                },
                // One member at a time runs on a wrong clock; choosing it again moves its clock.
                _ if skewed.is_some_and(|s| s != id) => Fault::Kill { id },
                _ => {
                    skewed = Some(id);
                    Fault::Skew {
                        id,
                        offset_ms: SKEWS_MS[rng.random_range(0..SKEWS_MS.len())],
                    }
                }
            };
            out.push(Planned { at, until, fault });
        }
        at += between(&mut rng, shape.gap);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(replicas: u64) -> Shape {
        Shape {
            replicas,
            run: Duration::from_secs(120),
            margin: Duration::from_secs(5),
            gap: (Duration::from_millis(500), Duration::from_secs(4)),
            hold: (Duration::from_secs(1), Duration::from_secs(6)),
        }
    }

    #[test]
    fn a_seed_reproduces_its_schedule_and_seeds_differ() {
        let s = shape(3);
        assert_eq!(plan(7, &s), plan(7, &s));
        assert_ne!(plan(7, &s), plan(8, &s));
        assert!(plan(7, &s).len() > 10, "{:?}", plan(7, &s));
    }

    #[test]
    fn a_majority_stays_healthy_and_faults_stay_inside_the_run() {
        for replicas in [3, 5] {
            let s = shape(replicas);
            for seed in 0..200 {
                let p = plan(seed, &s);
                for f in &p {
                    assert!(f.at >= s.margin && f.until <= s.run - s.margin && f.at < f.until);
                    let active: Vec<&Planned> = p
                        .iter()
                        .filter(|o| o.at <= f.at && f.at < o.until)
                        .collect();
                    assert!(
                        active.len() <= s.max_concurrent(),
                        "seed {seed}: {active:?}"
                    );
                    let mut touched: Vec<u64> =
                        active.iter().flat_map(|o| o.fault.targets()).collect();
                    touched.sort_unstable();
                    let n = touched.len();
                    touched.dedup();
                    assert_eq!(n, touched.len(), "a replica under two faults: {active:?}");
                }
                let skewed: std::collections::BTreeSet<u64> = p
                    .iter()
                    .filter_map(|f| match f.fault {
                        Fault::Skew { id, .. } => Some(id),
                        _ => None,
                    })
                    .collect();
                assert!(skewed.len() <= 1, "seed {seed}: {skewed:?}");
            }
        }
    }

    #[test]
    fn every_kind_of_fault_is_drawn() {
        let kinds: std::collections::BTreeSet<&str> = (0..20)
            .flat_map(|seed| plan(seed, &shape(5)))
            .map(|p| p.fault.kind())
            .collect();
        assert_eq!(kinds.len(), 6, "{kinds:?}");
    }
}

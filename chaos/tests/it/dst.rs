//! Deterministic simulation (issue 19): 3 or 5 real `ConsensusNode`s — openraft, sled, the
//! tonic peer service and client pool, the proposal batcher — on turmoil's simulated hosts,
//! network and clock, in one thread per simulation. A seed fixes the fault schedule (stalled
//! links, isolated members, latency, crashes and restarts), the network's latencies and the Raft
//! election timeouts; after the faults are healed each run is checked against invariants. Three
//! workloads:
//!
//! - `consensus_…` (this file): every member proposes values to an append log all along;
//!   - agreement: every log a member showed at any time is a prefix of the final log;
//!   - durability: every acknowledged value is in the final log, exactly once, at the position
//!     its acknowledgement named (a crash and restart keeps it);
//!   - integrity: the final log holds each proposed value at most once and nothing else;
//!   - liveness: after the heal, every member gets a proposal acknowledged;
//!   - convergence: every member ends with the same log.
//! - `global_flow_…` ([`flow`]): the replicated flow-control state (`flowctl`'s cluster state,
//!   as the EPP replicates it) under members that queue, route and settle requests on simulated
//!   pods; its invariants are listed there.
//! - `gossip_…` ([`gossip`]): the EPP's peer exchange (`node::cluster::gossip`: the prefix index
//!   and the response bindings as CRDT deltas and anti-entropy, the scrape fan-out and ownership)
//!   under members that route, bind and scrape while pods restart; its invariants are listed
//!   there.
//!
//! Without settings a test run checks CI's seeds (a few dozen per workload and the seeds that
//! once failed: [`harness::Seeds`]); `DST_SEEDS=N` runs seeds 1..=N; `DST_SEED=S` runs one seed
//! and prints its schedule. `deploy/local/dst-soak.sh` runs thousands in release. A failing seed
//! names itself.
//!
//! Turmoil seeds each simulated host's tokio runtime only under `--cfg tokio_unstable`
//! (`.cargo/config.toml`); without it, a seed reproduces the faults, latencies and elections but
//! not every interleaving of ready tasks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use consensus::testkit::LogCommand;
use consensus::testkit::LogMachine;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;

mod flow;
mod gossip;
mod harness;

use harness::Outcome;
use harness::Timeline;

const TIMELINE: Timeline = Timeline {
    faults_end: Duration::from_secs(8),
    calm_end: Duration::from_secs(11),
    end: Duration::from_secs(12),
};

/// What the members saw, shared by the hosts (one thread runs the whole simulation).
#[derive(Default)]
struct Record {
    /// Acknowledged proposals: value → position.
    acked: BTreeMap<String, u64>,
    /// Values proposed.
    proposed: HashSet<String>,
    /// Proposals without an acknowledgement (timeouts, no leader: may or may not be in the log).
    unacked: u64,
    /// Acknowledgements after the heal, by member.
    acked_after_heal: BTreeMap<u64, u64>,
    /// Logs members showed (sampled): member, length, [`chain`] hash.
    seen: Vec<(u64, usize, u64)>,
    /// The newest sample of each member.
    last: BTreeMap<u64, Vec<String>>,
    /// Starts of each member (1 + restarts).
    starts: BTreeMap<u64, u64>,
    /// Members that could not start (an error is a failure).
    start_errors: Vec<String>,
}

type Shared = Rc<RefCell<Record>>;

/// One life of a member's software: start (or restart) the node, propose until `calm_end`,
/// sample its log.
async fn member(
    id: u64,
    n: u64,
    dir: std::path::PathBuf,
    seed: u64,
    rec: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let t = TIMELINE;
    let life = {
        let mut r = rec.borrow_mut();
        let s = r.starts.entry(id).or_default();
        *s += 1;
        *s
    };
    let node = match harness::start::<LogMachine>(id, n, &dir).await {
        Ok(node) => Rc::new(node),
        Err(e) => {
            rec.borrow_mut()
                .start_errors
                .push(format!("{e} (life {life})"));
            return Ok(());
        }
    };
    let mut rng = StdRng::seed_from_u64(seed ^ (id << 32) ^ (life << 48));
    let mut k = 0u64;
    let mut sample = tokio::time::interval(Duration::from_millis(100));
    let mut next_proposal = tokio::time::Instant::now();
    loop {
        let now = harness::now();
        if now >= t.end {
            return Ok(());
        }
        tokio::select! {
            _ = sample.tick() => {
                let (log, _) = node.local_read(|s| s.log.clone()).await;
                let mut r = rec.borrow_mut();
                r.seen.push((id, log.len(), chain(&log).last().copied().unwrap_or(0)));
                r.last.insert(id, log);
            }
            () = tokio::time::sleep_until(next_proposal), if now < t.calm_end => {
                next_proposal += Duration::from_millis(rng.random_range(20..150));
                k += 1;
                let value = format!("{id}.{life}.{k}");
                rec.borrow_mut().proposed.insert(value.clone());
                let (node, rec) = (Rc::clone(&node), Rc::clone(&rec));
                tokio::task::spawn_local(async move {
                    let out = node.propose(LogCommand::append(value.clone())).await;
                    let mut r = rec.borrow_mut();
                    match out {
                        Ok(pos) => {
                            r.acked.insert(value, pos);
                            if harness::now() > t.faults_end {
                                *r.acked_after_heal.entry(id).or_default() += 1;
                            }
                        }
                        Err(_) => r.unacked += 1,
                    }
                });
            }
        }
    }
}

/// The hash of each prefix of `log` (fixed keys: the same in every run).
fn chain(log: &[String]) -> Vec<u64> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = 0u64;
    log.iter()
        .map(|v| {
            let mut s = DefaultHasher::new();
            (h, v).hash(&mut s);
            h = s.finish();
            h
        })
        .collect()
}

fn run(seed: u64, verbose: bool) -> Outcome {
    let n = harness::members(seed);
    let rec: Shared = Rc::default();
    let shared = Rc::clone(&rec);
    let faults = match harness::simulate(seed, n, &TIMELINE, verbose, move |id, dir| {
        member(id, n, dir, seed, Rc::clone(&shared))
    }) {
        Ok(faults) => faults,
        Err(e) => return Outcome::failed(e),
    };
    let r = rec.borrow();
    let mut violations: Vec<String> = r.start_errors.clone();
    let final_log = r
        .last
        .values()
        .max_by_key(|l| l.len())
        .cloned()
        .unwrap_or_default();
    // Agreement: every sample is a prefix of the final log.
    let prefixes = chain(&final_log);
    for (id, len, hash) in &r.seen {
        let expected = if *len == 0 {
            Some(&0)
        } else {
            prefixes.get(len - 1)
        };
        if expected != Some(hash) {
            violations.push(format!(
                "n{id} showed a log of {len} entries that is not a prefix of the final one"
            ));
            break;
        }
    }
    // Convergence.
    for id in 1..=n {
        match r.last.get(&id) {
            Some(log) if *log == final_log => {}
            Some(log) => violations.push(format!(
                "n{id} ended with {} entries, the longest log has {}",
                log.len(),
                final_log.len()
            )),
            None => violations.push(format!("n{id} never showed its log")),
        }
    }
    // Integrity.
    let mut positions = BTreeMap::new();
    for (i, v) in final_log.iter().enumerate() {
        if !r.proposed.contains(v) {
            violations.push(format!("`{v}` is in the log but was never proposed"));
        }
        if positions.insert(v.as_str(), i as u64 + 1).is_some() {
            violations.push(format!("`{v}` is in the log twice"));
        }
    }
    // Durability, at the acknowledged position.
    for (v, pos) in &r.acked {
        match positions.get(v.as_str()) {
            Some(p) if p == pos => {}
            Some(p) => violations.push(format!("`{v}` acknowledged at {pos}, in the log at {p}")),
            None => violations.push(format!("`{v}` acknowledged at {pos}, lost")),
        }
    }
    // Liveness after the heal.
    for id in 1..=n {
        if r.acked_after_heal.get(&id).copied().unwrap_or(0) == 0 {
            violations.push(format!("n{id} got nothing acknowledged after the heal"));
        }
    }
    violations.truncate(10);
    Outcome {
        faults,
        done: r.acked.len() as u64,
        summary: format!(
            "{} acknowledged, {} not, final log {}",
            r.acked.len(),
            r.unacked,
            final_log.len()
        ),
        violations,
        fingerprint: harness::fingerprint(&(&final_log, &r.acked, r.unacked)),
    }
}

#[test]
fn consensus_keeps_its_invariants_under_seeded_faults() {
    harness::run_seeds(
        "consensus",
        harness::Seeds {
            ci: 30,
            // Failed CI on a restarted member meeting its previous life's sled lock.
            regressions: &[155],
        },
        run,
    );
}

// Two runs of a seed produce the same log, the same acknowledgements, the same replicated flow
// states and the same gossiped indexes: the simulation is deterministic (turmoil's seeded
// runtimes, the seeded election timeouts, the simulated clock, flushes on the simulation's
// thread). One test per workload, so that a test runner can run them side by side.

#[test]
fn a_consensus_seed_replays_the_same_run() {
    let (a, b) = (run(2, false), run(2, false));
    assert!(a.done > 0 && a.violations.is_empty(), "{:?}", a.violations);
    assert_eq!(
        a.fingerprint, b.fingerprint,
        "consensus seed 2: {} / {}",
        a.summary, b.summary
    );
}

#[test]
fn a_flow_seed_replays_the_same_run() {
    let (a, b) = (flow::run(1, false, true), flow::run(1, false, true));
    assert!(a.done > 0 && a.violations.is_empty(), "{:?}", a.violations);
    assert_eq!(
        a.fingerprint, b.fingerprint,
        "flow seed 1: {} / {}",
        a.summary, b.summary
    );
}

#[test]
fn a_gossip_seed_replays_the_same_run() {
    let (a, b) = (gossip::run(3, false), gossip::run(3, false));
    assert!(a.done > 0 && a.violations.is_empty(), "{:?}", a.violations);
    assert_eq!(
        a.fingerprint, b.fingerprint,
        "gossip seed 3: {} / {}",
        a.summary, b.summary
    );
}

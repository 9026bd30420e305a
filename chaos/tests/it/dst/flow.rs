//! The global-flow workload: the replicated flow-control state (`flowctl`'s `ClusterState` in the
//! EPP's `Replicated` wrapper) driven as the EPP's cluster flow gate drives it. Every member
//! heartbeats, proposes the same flow configuration (a concurrency detector: at most
//! `MAX_CONCURRENCY` requests per pod), queues requests through its own sequential stream of
//! `Flow` batches (retried until they commit, as the gate does), routes each dispatched request
//! to the least busy of three simulated pods, and settles it when the pod is done; the leader
//! proposes the pods' samples and what they run (the ledger's reconciliation). The pods are
//! the truth: they run a request from its dispatch to its end, whoever dies meanwhile.
//!
//! Invariants:
//! - agreement: members that applied the same log index hold byte-identical states;
//! - bounded admission (I1, no credit): the pods never run more than the pool's capacity;
//! - liveness: after the heal, every member gets requests dispatched, and every request queued
//!   after the heal (plus an election's grace) gets a verdict;
//! - the ledger drains to the pods' truth: at the end every member's state holds nothing queued
//!   and nothing in flight, as the pods run nothing — including the requests of members that
//!   died holding them (released by reconciliation or by their settlements).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::hash::DefaultHasher;
use std::hash::Hash;
use std::hash::Hasher;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use flowctl::ConcurrencyDetector;
use flowctl::ControllerConfig;
use flowctl::EndpointSnapshot;
use flowctl::FlowKey;
use flowctl::SaturationDetector;
use flowctl::cluster::ClusterCommand;
use flowctl::cluster::ClusterOutput;
use flowctl::global::Ask;
use flowctl::global::FlowCmd;
use flowctl::global::GlobalParams;
use flowctl::global::Verdict;
use node::cluster::member::Replicated;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::harness;
use super::harness::Outcome;
use super::harness::Timeline;

const PODS: [&str; 3] = ["p1", "p2", "p3"];
const MAX_CONCURRENCY: u64 = 2;
const CAPACITY: u64 = MAX_CONCURRENCY * PODS.len() as u64;
const LEASE_MS: u64 = 1500;
/// Requests queued this long after the heal must get a verdict.
const GRACE: Duration = Duration::from_secs(2);

/// The drain needs a lease (a dead life's entries) plus reconciliation's persistence and age.
const TIMELINE: Timeline = Timeline {
    faults_end: Duration::from_secs(8),
    calm_end: Duration::from_secs(11),
    end: Duration::from_secs(17),
};

type Node = consensus::ConsensusNode<Replicated>;

/// The simulated pods: request id → (pod, end).
#[derive(Default)]
struct Pods {
    running: BTreeMap<String, (&'static str, Duration)>,
}

impl Pods {
    fn purge(&mut self, now: Duration) {
        self.running.retain(|_, (_, end)| *end > now);
    }

    fn counts(&mut self, now: Duration) -> BTreeMap<&'static str, u64> {
        self.purge(now);
        let mut c: BTreeMap<&'static str, u64> = PODS.iter().map(|p| (*p, 0)).collect();
        for (pod, _) in self.running.values() {
            *c.entry(pod).or_default() += 1;
        }
        c
    }
}

#[derive(Default)]
struct Record {
    pods: Pods,
    /// Applied index → (state digest, member that first showed it).
    digests: BTreeMap<u64, (u64, u64)>,
    violations: Vec<String>,
    peak: u64,
    dispatched: u64,
    rejected: u64,
    /// Requests that never got a verdict (cancelled by their owner), by whether they were queued
    /// after the heal's grace.
    undecided: u64,
    undecided_after_heal: u64,
    dispatched_after_heal: BTreeMap<u64, u64>,
    /// Each member's newest sample: applied index, queued, in flight, per-pod ledger total.
    last: BTreeMap<u64, (u64, u64, u64, u64)>,
    starts: BTreeMap<u64, u64>,
}

type Shared = Rc<RefCell<Record>>;

fn flow_config() -> ClusterCommand {
    ClusterCommand::ConfigureFlow {
        config: Box::new(ControllerConfig {
            detector: SaturationDetector::Concurrency(ConcurrencyDetector {
                max_concurrency: MAX_CONCURRENCY,
                ..ConcurrencyDetector::default()
            }),
            ..ControllerConfig::default()
        }),
        params: GlobalParams {
            lease_ms: LEASE_MS,
            // Every admission through the log: the pods' capacity is a hard bound.
            credit_slack: 0,
            rebalance_ms: 1000,
        },
    }
}

fn clock_us() -> u64 {
    consensus::clock::now_us()
}

/// One member life's flow stream: commands go out in batches, one batch at a time, each retried
/// until it commits (its sequence numbers make a retry harmless); the verdicts a batch decided
/// go to the waiting requests.
struct Stream {
    outbox: RefCell<Vec<FlowCmd>>,
    decided: RefCell<BTreeMap<u64, Verdict>>,
    /// This life's lease: when its newest committed heartbeat was proposed, and the local index
    /// at which its state showed it.
    lease: std::cell::Cell<Option<(Duration, u64)>>,
    /// Deliver verdicts read locally only from a state that knows the current lease.
    lease_rule: bool,
}

impl Stream {
    /// While the lease is valid, the index from which a local read knows it.
    fn lease_index(&self) -> Option<u64> {
        self.lease
            .get()
            .filter(|(t0, _)| harness::now() < *t0 + Duration::from_millis(LEASE_MS))
            .map(|(_, i)| i)
    }
}

async fn run_stream(node: Rc<Node>, stream: Rc<Stream>, id: u64, incarnation: u64) {
    let mut batch: Vec<FlowCmd> = Vec::new();
    loop {
        if batch.is_empty() {
            batch = std::mem::take(&mut *stream.outbox.borrow_mut());
        }
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let cmd = ClusterCommand::Flow {
            node: id,
            incarnation,
            now_us: clock_us(),
            cmds: batch.clone(),
        };
        match node.propose(cmd).await {
            Ok(ClusterOutput::Flow(r)) => {
                stream.decided.borrow_mut().extend(r.decided);
                batch.clear();
            }
            Ok(_) => batch.clear(),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// One request: queue, wait for the verdict, run on a pod, settle.
async fn request(
    node: Rc<Node>,
    stream: Rc<Stream>,
    rec: Shared,
    key: (u64, u64),
    incarnation: u64,
    service: Duration,
) {
    let t = TIMELINE;
    let (id, seq) = key;
    let request_id = format!("{id}.{incarnation}.{seq}");
    let queued_at = harness::now();
    stream.outbox.borrow_mut().push(FlowCmd::Enqueue {
        seq,
        request_id: request_id.clone(),
        ask: Ask {
            flow: FlowKey::new(format!("tenant-{}", seq % 2), 0),
            bytes: 100,
            tokens: 10,
            ttl: Some(3_000_000_000),
            slo_ttft: None,
        },
    });
    let mut verdict = None;
    let mut how = String::new();
    while verdict.is_none() && harness::now() < queued_at + Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        verdict = stream.decided.borrow_mut().remove(&seq);
        how = "decided by its batch".to_string();
        if verdict.is_none() {
            let ((v, ledger), index) = node
                .local_read(|s| {
                    let f = s.0.flow();
                    let ledger: Vec<String> = f
                        .map(|f| {
                            f.inflight_entries()
                                .map(|(_, r, _)| r.to_string())
                                .collect()
                        })
                        .unwrap_or_default();
                    (f.and_then(|f| f.verdict(key, incarnation)), ledger)
                })
                .await;
            how = format!(
                "read at index {index} (lease from {:?}), ledger {ledger:?}",
                stream.lease.get()
            );
            // A state older than this life's lease may show a verdict since revoked (the gate's
            // rule; the model without it is the checker's own test).
            if !stream.lease_rule || stream.lease_index().is_some_and(|l| index >= l) {
                verdict = v;
            }
        }
    }
    match verdict {
        Some(Verdict::Dispatched) => {
            let now = harness::now();
            let pod = {
                let mut r = rec.borrow_mut();
                let counts = r.pods.counts(now);
                let pod = *counts
                    .iter()
                    .min_by_key(|(_, c)| **c)
                    .map(|(p, _)| p)
                    .unwrap_or(&PODS[0]);
                r.pods
                    .running
                    .insert(request_id.clone(), (pod, now + service));
                let running = r.pods.running.len() as u64;
                r.peak = r.peak.max(running);
                if running > CAPACITY {
                    let v = format!(
                        "the pods ran {running} requests at {now:?} (capacity {CAPACITY}): {:?}; \
                         {request_id} dispatched: {how}",
                        r.pods.running.keys().collect::<Vec<_>>()
                    );
                    r.violations.push(v);
                }
                r.dispatched += 1;
                if queued_at > t.faults_end {
                    *r.dispatched_after_heal.entry(id).or_default() += 1;
                }
                pod
            };
            stream.outbox.borrow_mut().push(FlowCmd::Routed {
                seq,
                pod: pod.to_string(),
            });
            tokio::time::sleep(service).await;
            stream.outbox.borrow_mut().push(FlowCmd::Settle {
                request_id,
                actual_tokens: Some(10),
            });
        }
        Some(Verdict::Rejected(_)) => rec.borrow_mut().rejected += 1,
        None => {
            stream.outbox.borrow_mut().push(FlowCmd::Cancel { seq });
            let mut r = rec.borrow_mut();
            r.undecided += 1;
            if queued_at > t.faults_end + GRACE {
                r.undecided_after_heal += 1;
                r.violations.push(format!(
                    "n{id}'s request {seq}, queued at {queued_at:?}, got no verdict"
                ));
            }
        }
    }
}

fn digest(s: &Replicated) -> u64 {
    let mut h = DefaultHasher::new();
    serde_json::to_vec(&s.0).unwrap_or_default().hash(&mut h);
    h.finish()
}

async fn member(
    id: u64,
    n: u64,
    dir: PathBuf,
    seed: u64,
    lease_rule: bool,
    rec: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let t = TIMELINE;
    let life = {
        let mut r = rec.borrow_mut();
        let s = r.starts.entry(id).or_default();
        *s += 1;
        *s
    };
    let node = match harness::start::<Replicated>(id, n, &dir).await {
        Ok(node) => Rc::new(node),
        Err(e) => {
            rec.borrow_mut()
                .violations
                .push(format!("{e} (life {life})"));
            return Ok(());
        }
    };
    let incarnation = clock_us() / 1000;
    let stream = Rc::new(Stream {
        outbox: RefCell::default(),
        decided: RefCell::default(),
        lease: std::cell::Cell::new(None),
        lease_rule,
    });
    tokio::task::spawn_local(run_stream(
        Rc::clone(&node),
        Rc::clone(&stream),
        id,
        incarnation,
    ));
    // Heartbeats (the flow configuration first, until it is in), and the leader's pool samples.
    {
        let node = Rc::clone(&node);
        let rec = Rc::clone(&rec);
        let stream = Rc::clone(&stream);
        tokio::task::spawn_local(async move {
            while !matches!(
                node.propose(flow_config()).await,
                Ok(ClusterOutput::Configured(_))
            ) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let t0 = harness::now();
                let out = tokio::time::timeout(
                    Duration::from_millis(LEASE_MS),
                    node.propose(ClusterCommand::Heartbeat {
                        node: id,
                        now_ms: clock_us() / 1000,
                        ext_proc: String::new(),
                        admin: String::new(),
                        started_ms: incarnation,
                        features: flowctl::cluster::FEATURE_HELD,
                    }),
                )
                .await;
                if let Ok(Ok(ClusterOutput::Heartbeats(count))) = out {
                    // The lease runs from the proposal, once the local state shows the heartbeat.
                    while harness::now() < t0 + Duration::from_millis(LEASE_MS) {
                        let (seen, index) = node
                            .local_read(|s| {
                                s.0.members().get(&id).is_some_and(|m| {
                                    m.started_ms == incarnation && m.heartbeats >= count
                                })
                            })
                            .await;
                        if seen {
                            stream.lease.set(Some((t0, index)));
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                if node.metrics().await.leader == Some(id) {
                    let now_ns = clock_us() * 1000;
                    let observed = rec
                        .borrow_mut()
                        .pods
                        .counts(harness::now())
                        .into_iter()
                        .map(|(p, c)| (p.to_string(), c))
                        .collect();
                    let endpoints = PODS
                        .iter()
                        .map(|_| EndpointSnapshot {
                            waiting_queue: 0,
                            kv_cache_usage: 0.0,
                            sampled_at: Some(now_ns),
                            batch_capacity: None,
                        })
                        .collect();
                    let _ = tokio::time::timeout(
                        Duration::from_millis(LEASE_MS),
                        node.propose(ClusterCommand::ObservePool {
                            now_us: clock_us(),
                            endpoints,
                            observed,
                        }),
                    )
                    .await;
                }
            }
        });
    }
    let mut rng = StdRng::seed_from_u64(seed ^ (id << 32) ^ (life << 48));
    let mut seq = 0u64;
    let mut sample = tokio::time::interval(Duration::from_millis(200));
    let mut next_request = tokio::time::Instant::now();
    loop {
        let now = harness::now();
        if now >= t.end {
            return Ok(());
        }
        tokio::select! {
            _ = sample.tick() => {
                let ((d, totals, ledger), index) = node
                    .local_read(|s| {
                        let flow = s.0.flow();
                        (
                            digest(s),
                            flow.map(flowctl::global::GlobalFlow::totals).unwrap_or_default(),
                            flow.map_or(0, |f| f.pods().values().map(|l| l.requests).sum::<u64>()),
                        )
                    })
                    .await;
                let mut r = rec.borrow_mut();
                match r.digests.get(&index) {
                    Some((other, by)) if *other != d => {
                        let v = format!("n{id} and n{by} hold different states at index {index}");
                        r.violations.push(v);
                    }
                    Some(_) => {}
                    None => {
                        r.digests.insert(index, (d, id));
                    }
                }
                r.last.insert(id, (index, totals.queued_requests, totals.inflight_requests, ledger));
            }
            () = tokio::time::sleep_until(next_request), if now < t.calm_end => {
                next_request += Duration::from_millis(rng.random_range(150..650));
                seq += 1;
                let service = Duration::from_millis(rng.random_range(100..600));
                tokio::task::spawn_local(request(
                    Rc::clone(&node),
                    Rc::clone(&stream),
                    Rc::clone(&rec),
                    (id, seq),
                    incarnation,
                    service,
                ));
            }
        }
    }
}

pub fn run(seed: u64, verbose: bool, lease_rule: bool) -> Outcome {
    let n = harness::members(seed);
    let rec: Shared = Rc::default();
    let shared = Rc::clone(&rec);
    let faults = match harness::simulate(seed, n, &TIMELINE, verbose, move |id, dir| {
        member(id, n, dir, seed, lease_rule, Rc::clone(&shared))
    }) {
        Ok(f) => f,
        Err(e) => return Outcome::failed(e),
    };
    let mut r = rec.borrow_mut();
    let mut violations = std::mem::take(&mut r.violations);
    for id in 1..=n {
        if r.dispatched_after_heal.get(&id).copied().unwrap_or(0) == 0 {
            violations.push(format!("n{id} got nothing dispatched after the heal"));
        }
        match r.last.get(&id) {
            Some((index, queued, inflight, ledger))
                if (*queued, *inflight, *ledger) != (0, 0, 0) =>
            {
                violations.push(format!(
                    "n{id}'s state at index {index} holds {queued} queued, {inflight} in flight, \
                     {ledger} on pods at the end (the pods run nothing)"
                ));
            }
            Some(_) => {}
            None => violations.push(format!("n{id} never showed its state")),
        }
    }
    let running = r.pods.counts(TIMELINE.end).values().sum::<u64>();
    if running > 0 {
        violations.push(format!("the pods still run {running} requests at the end"));
    }
    violations.truncate(10);
    Outcome {
        faults,
        done: r.dispatched,
        summary: format!(
            "{} dispatched (peak {} on the pods), {} rejected, {} without a verdict",
            r.dispatched, r.peak, r.rejected, r.undecided
        ),
        violations,
        fingerprint: harness::fingerprint(&(&r.digests, r.dispatched, r.rejected)),
    }
}

#[test]
fn global_flow_keeps_its_invariants_under_seeded_faults() {
    harness::run_seeds(
        "global flow",
        harness::Seeds {
            ci: 15,
            regressions: &[],
        },
        |seed, verbose| run(seed, verbose, true),
    );
}

/// The checker sees over-admission: members that act on verdicts read from a state older than
/// their lease (as the cluster gate did before it checked) put more requests on the pods than
/// the pool's capacity after a partition heals — here in at least one of the first ten seeds.
#[test]
fn acting_on_verdicts_older_than_the_lease_over_admits() {
    // The first seed that over-admits settles it (seed 3 today); the rest need not run.
    let over = (1..=10).find(|seed| {
        run(*seed, false, false)
            .violations
            .iter()
            .any(|v| v.starts_with("the pods ran"))
    });
    println!("first seed over capacity without the lease rule: {over:?}");
    assert!(
        over.is_some(),
        "no seed of the first ten over-admitted without the lease rule"
    );
}

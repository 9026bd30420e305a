//! The gossip workload: the replicas' exchange on the peer port (`node::cluster::gossip`) — the
//! approximate prefix index and the response bindings as CRDT deltas plus digest anti-entropy,
//! the scrape fan-out, and scrape ownership by peer liveness — each member running the EPP's own
//! `Gossip` over a real `ConsensusNode`'s membership and peer channels. Every member routes the
//! requests of a dozen conversations through the prefix producer (`produce`, then `pre_request`,
//! as the scheduler calls them) onto four simulated pods, binds each answer's response id to its
//! pod, and scrapes the pods it owns (KV capacity, block size, start time) through the scraper's
//! own recording path. Pods restart now and then: a new start time, a new incarnation, which a
//! member learns only from its own scrape or a peer's fan-out. A restarted member starts empty, as
//! a restarted replica does (the index is not persisted).
//!
//! Invariants, checked on every member's state at the end (routing stops at `calm_end`; the end
//! comes 1.5 s — one and a half anti-entropy periods — later):
//! - convergence (I8): every member holds the same prefix index and the same response bindings,
//!   entry for entry, timestamps included;
//! - incarnations: every member indexes each pod at its current start time only (nothing of an
//!   earlier incarnation survives) and holds a fresh sample of it at that start time;
//! - integrity: every entry was recorded by some member for that pod and incarnation; no pod
//!   holds more than its bound;
//! - completeness: every block recorded after the heal for a pod at its current incarnation is on
//!   every member (the per-pod bound exceeds what the calm period records: checked), and every
//!   response id bound then resolves to its pod on every member;
//! - ownership: every member sees every member live and names the same `OWNERS` owners per pod.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use consensus::testkit::LogMachine;
use index::PodState;
use index::Replicated;
use node::cluster::gossip::Gossip;
use node::cluster::options::GossipOptions;
use node::datalayer::Datastore;
use node::datalayer::Endpoint;
use node::datalayer::EndpointMetrics;
use node::datalayer::responses::Binding;
use node::datalayer::responses::ResponseBindings;
use node::metrics::Metrics;
use node::request::parse::Prompt;
use node::scheduling::Producer;
use node::scheduling::RequestData;
use node::scheduling::SchedRequest;
use node::scheduling::prefix::ApproxPrefixProducer;
use node::scheduling::prefix::ProducerParams;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio_util::sync::CancellationToken;

use super::harness;
use super::harness::Outcome;
use super::harness::Timeline;

const PODS: [&str; 4] = [
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "10.0.0.4:8000",
];
/// Scrape owners per pod.
const OWNERS: usize = 2;
/// Engine KV blocks of 16 tokens: 512 × 16 / 64 = 128 index entries per pod.
const GPU_BLOCKS: u64 = 512;
const ENGINE_BLOCK: u64 = 16;
const CAPACITY: usize = (GPU_BLOCKS * ENGINE_BLOCK / 64) as usize;
/// What is recorded this long after the heal must reach everyone (a restarted member first
/// rejoins: its consensus node starts and its gossip finds the peers).
const SETTLE: Duration = Duration::from_millis(500);

const TIMELINE: Timeline = Timeline {
    faults_end: Duration::from_secs(8),
    calm_end: Duration::from_secs(11),
    end: Duration::from_millis(12_500),
};

/// The pods' start times over the run (ms since the epoch): a pod's incarnation at `t` is its
/// newest start at or before `t`. Two to four restarts during the faults, drawn from the seed.
struct PodLives {
    starts: BTreeMap<&'static str, Vec<(Duration, u64)>>,
}

impl PodLives {
    fn new(seed: u64) -> PodLives {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9d5e_ed00);
        let base = harness::EPOCH.as_millis() as u64;
        let mut starts: BTreeMap<&'static str, Vec<(Duration, u64)>> = PODS
            .iter()
            .map(|p| (*p, vec![(Duration::ZERO, base - 60_000)]))
            .collect();
        for _ in 0..rng.random_range(2..=4) {
            let pod = PODS[rng.random_range(0..PODS.len())];
            let at = Duration::from_millis(rng.random_range(1000..7000));
            starts
                .entry(pod)
                .or_default()
                .push((at, base + at.as_millis() as u64));
        }
        for s in starts.values_mut() {
            s.sort_unstable();
        }
        PodLives { starts }
    }

    fn epoch(&self, pod: &str, at: Duration) -> u64 {
        self.starts
            .get(pod)
            .and_then(|s| s.iter().rev().find(|(t, _)| *t <= at))
            .map_or(0, |(_, e)| *e)
    }

    fn restarts(&self) -> usize {
        self.starts.values().map(|s| s.len() - 1).sum()
    }
}

/// A response id bound by a member: to which pod, at which incarnation (as the member saw it),
/// when.
struct Bound {
    id: String,
    pod: String,
    epoch: u64,
    at: Duration,
}

/// What one member showed at the end.
struct Final {
    prefix: Vec<PodState>,
    bindings: Vec<PodState>,
    /// Per pod (as `PODS`): the sample's start time, and whether it is fresh.
    samples: Vec<(Option<u64>, bool)>,
    live: Vec<u64>,
    owners: Vec<Vec<u64>>,
    /// Response ids bound after the heal that this member does not resolve to their pod.
    misbound: Vec<String>,
}

#[derive(Default)]
struct Record {
    /// (pod, incarnation, block hash) → when last recorded.
    blocks: HashMap<(String, u64, u64), Duration>,
    bound: Vec<Bound>,
    routed: u64,
    finals: BTreeMap<u64, Final>,
    starts: BTreeMap<u64, u64>,
    violations: Vec<String>,
}

type Shared = Rc<RefCell<Record>>;

/// A conversation's prompt after `turns` turns: a shared system prompt, then its own turns.
fn prompt(conversation: u64, turns: u64) -> String {
    let mut text = "You are a careful assistant in a simulated cluster. ".repeat(12);
    for t in 0..turns {
        text.push_str(&format!(
            " user {conversation} turn {t}: tell me about item {} and why it matters so much here. \
             assistant {conversation} turn {t}: item {} matters because the simulation says so.",
            conversation * 31 + t,
            conversation * 17 + t
        ));
    }
    text
}

fn endpoints() -> Vec<Arc<Endpoint>> {
    PODS.iter()
        .enumerate()
        .map(|(i, p)| {
            Arc::new(Endpoint::new(
                format!("pod-{i}"),
                p.parse().expect("a pod address"),
                BTreeMap::new(),
            ))
        })
        .collect()
}

/// Entries sorted, pods by name: states compare as values.
fn normalized(mut states: Vec<PodState>) -> Vec<PodState> {
    for s in &mut states {
        s.entries.sort_unstable();
    }
    states.sort_by(|a, b| a.name.cmp(&b.name));
    states
}

/// Member state at the end.
fn snapshot(
    store: &Datastore,
    producer: &ApproxPrefixProducer,
    bindings: &ResponseBindings,
    rec: &Shared,
) -> Final {
    let pods: Vec<String> = PODS.iter().map(ToString::to_string).collect();
    let samples = store
        .candidates(tokio::time::Instant::now().into_std())
        .iter()
        .map(|c| {
            (
                c.sample.as_ref().and_then(|s| s.metrics.started_ms),
                !c.stale,
            )
        })
        .collect();
    let misbound = rec
        .borrow()
        .bound
        .iter()
        .filter(|b| b.at > TIMELINE.faults_end + SETTLE)
        .filter(|b| {
            !matches!(bindings.lookup(&b.id),
                Binding::Pod { hostport, epoch } if hostport == b.pod && epoch == b.epoch)
        })
        .map(|b| b.id.clone())
        .take(3)
        .collect();
    Final {
        prefix: normalized(producer.export(&pods)),
        bindings: normalized(bindings.export(&pods)),
        samples,
        live: store.shard.layout().1,
        owners: PODS.iter().map(|p| store.shard.owners(p)).collect(),
        misbound,
    }
}

/// One routing decision of member `id`: the prefix producer's match, the warmest pod (else, and
/// now and then anyway, any pod), the blocks recorded for it and the answer's id bound to it.
struct Router {
    id: u64,
    life: u64,
    turns: BTreeMap<u64, u64>,
    k: u64,
    headers: HashMap<String, String>,
}

impl Router {
    fn route(
        &mut self,
        rng: &mut StdRng,
        store: &Datastore,
        producer: &ApproxPrefixProducer,
        bindings: &ResponseBindings,
        rec: &Shared,
    ) {
        // A dozen conversations at a time (the members share them: a conversation's turns land
        // on any replica); one that reached eight turns starts over as a new one.
        let slot = rng.random_range(0..12u64);
        let turn = self.turns.entry(slot).or_default();
        *turn += 1;
        let prompt = Prompt::Text(prompt(slot * 1000 + *turn / 8, *turn % 8 + 1).into_bytes());
        let candidates = store.candidates(tokio::time::Instant::now().into_std());
        let req = SchedRequest {
            request_id: "r",
            model: "m",
            target_model: "m",
            prompt: &prompt,
            cache_salt: None,
            priority: 0,
            headers: &self.headers,
            tokens: None,
            media: &[],
        };
        let mut data = RequestData::default();
        producer.produce(&req, &candidates, &mut data);
        let Some(info) = data.prefix.clone() else {
            rec.borrow_mut()
                .violations
                .push("the producer gave no prefix match".into());
            return;
        };
        // The warmest pod (ties drawn), else — and now and then anyway — any pod.
        let most = info.matched.iter().copied().max().unwrap_or(0);
        let warmest: Vec<usize> = (0..candidates.len())
            .filter(|i| info.matched[*i] == most)
            .collect();
        let primary = if most > 0 && rng.random_bool(0.8) {
            warmest[rng.random_range(0..warmest.len())]
        } else {
            rng.random_range(0..candidates.len())
        };
        producer.pre_request(&req, &data, &candidates, primary, None);
        let ep = &candidates[primary].endpoint;
        self.k += 1;
        let response_id = format!("resp-{}.{}.{}", self.id, self.life, self.k);
        bindings.bind(&response_id, ep);
        // The incarnation the entries went to: the index's (newer than this member's sample when
        // a peer's state told it of a restart first — the request does reach the new server).
        let held_at = |states: Vec<index::PodDigest>| {
            states
                .into_iter()
                .find(|d| d.name == ep.hostport)
                .map_or(0, |d| d.epoch)
        };
        let epoch = held_at(producer.digests());
        let bound_epoch = held_at(bindings.digests());
        let now = harness::now();
        let mut r = rec.borrow_mut();
        r.routed += 1;
        for h in &info.hashes {
            r.blocks.insert((ep.hostport.clone(), epoch, *h), now);
        }
        r.bound.push(Bound {
            id: response_id,
            pod: ep.hostport.clone(),
            epoch: bound_epoch,
            at: now,
        });
    }
}

/// One life of member `id`: its consensus node (the membership and the peer channels), its
/// gossip of the prefix index and the bindings, scrapes of the pods it owns, routing.
async fn member(
    id: u64,
    n: u64,
    dir: PathBuf,
    seed: u64,
    rec: Shared,
    lives: Rc<PodLives>,
) -> Result<(), Box<dyn std::error::Error>> {
    let t = TIMELINE;
    let life = {
        let mut r = rec.borrow_mut();
        let s = r.starts.entry(id).or_default();
        *s += 1;
        *s
    };
    let metrics = Arc::new(Metrics::new("dst"));
    let store = Arc::new(Datastore::new(Duration::from_secs(1)));
    store.replace(endpoints());
    store.shard.configure(id, OWNERS);
    let producer = Arc::new(ApproxPrefixProducer::new(ProducerParams::default()));
    let bindings = Arc::new(ResponseBindings::new(Duration::from_secs(3600), 4096));
    let gossip = Gossip::new(
        id,
        Some(producer.clone()),
        Some(bindings.clone()),
        store.clone(),
        GossipOptions::default(),
        metrics.clone(),
    );
    let routes =
        tonic::service::Routes::new(gossip.service(None)).add_service(gossip.sample_service(None));
    let node = match harness::start_with::<LogMachine>(id, n, &dir, routes).await {
        Ok(node) => Arc::new(node),
        Err(e) => {
            rec.borrow_mut()
                .violations
                .push(format!("{e} (life {life})"));
            return Ok(());
        }
    };
    // The gossip's tasks end with this life (a crash drops the future, and the guard with it).
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    tokio::spawn(gossip.clone().run(node.clone(), stop));

    let mut rng = StdRng::seed_from_u64(seed ^ (id << 32) ^ (life << 48));
    let mut router = Router {
        id,
        life,
        turns: BTreeMap::new(),
        k: 0,
        headers: HashMap::new(),
    };
    let mut scrape = tokio::time::interval(Duration::from_millis(50));
    let mut next_route = tokio::time::Instant::now();
    loop {
        let now = harness::now();
        if now >= t.end - Duration::from_millis(50) {
            let last = snapshot(&store, &producer, &bindings, &rec);
            rec.borrow_mut().finals.insert(id, last);
            // Stay up (serving the peers) until the simulation ends.
            std::future::pending::<()>().await;
        }
        tokio::select! {
            _ = scrape.tick() => {
                for ep in store.endpoints().iter() {
                    if !store.shard.owns(&ep.hostport) {
                        continue;
                    }
                    let m = EndpointMetrics {
                        waiting_queue_size: Some(0.0),
                        running_requests: Some(0.0),
                        kv_cache_usage: Some(0.1),
                        block_size: Some(ENGINE_BLOCK),
                        num_gpu_blocks: Some(GPU_BLOCKS),
                        started_ms: Some(lives.epoch(&ep.hostport, now)),
                        ..EndpointMetrics::default()
                    };
                    node::datalayer::scraper::record_scrape(&store, ep, m, &metrics);
                }
            }
            () = tokio::time::sleep_until(next_route), if now < t.calm_end => {
                // Busy during the faults (pods evict: their bound is exceeded), quieter after the
                // heal, so that everything recorded then fits every pod's bound.
                let gap = if now < t.faults_end { 20..120 } else { 60..300 };
                next_route += Duration::from_millis(rng.random_range(gap));
                router.route(&mut rng, &store, &producer, &bindings, &rec);
            }
        }
    }
}

/// Blocks recorded after the heal for each pod at its current incarnation (what completeness
/// checks).
fn late_blocks<'a>(r: &'a Record, lives: &PodLives) -> BTreeMap<&'a str, Vec<u64>> {
    let t = TIMELINE;
    let mut late: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for ((pod, epoch, h), at) in &r.blocks {
        if *at > t.faults_end + SETTLE && *epoch == lives.epoch(pod, t.end) {
            late.entry(pod.as_str()).or_default().push(*h);
        }
    }
    late
}

fn check(r: &Record, lives: &PodLives, n: u64) -> Vec<String> {
    let t = TIMELINE;
    let mut v = Vec::new();
    let all: Vec<u64> = (1..=n).collect();
    let current = |pod: &str| lives.epoch(pod, t.end);
    let Some(first) = r.finals.values().next() else {
        return vec!["no member reached the end".into()];
    };
    for id in &all {
        let Some(f) = r.finals.get(id) else {
            v.push(format!("n{id} did not reach the end"));
            continue;
        };
        if f.prefix != first.prefix {
            v.push(format!(
                "n{id}'s prefix index differs from the first member's"
            ));
        }
        if f.bindings != first.bindings {
            v.push(format!(
                "n{id}'s response bindings differ from the first member's"
            ));
        }
        if f.live != all {
            v.push(format!("n{id} sees live members {:?}, not {all:?}", f.live));
        }
        if f.owners != first.owners || f.owners.iter().any(|o| o.len() != OWNERS.min(all.len())) {
            v.push(format!(
                "n{id} names the owners {:?} (the first member: {:?})",
                f.owners, first.owners
            ));
        }
        if !f.misbound.is_empty() {
            v.push(format!(
                "n{id} does not resolve {:?} to their pods",
                f.misbound
            ));
        }
        for (pod, (started, fresh)) in PODS.iter().zip(&f.samples) {
            if *started != Some(current(pod)) || !fresh {
                v.push(format!(
                    "n{id}'s sample of {pod}: start time {started:?} (current {}), fresh {fresh}",
                    current(pod)
                ));
            }
        }
        for s in f.prefix.iter().filter(|s| !s.entries.is_empty()) {
            if s.epoch != current(&s.name) {
                v.push(format!(
                    "n{id} indexes {} at start time {}, not its current {}",
                    s.name,
                    s.epoch,
                    current(&s.name)
                ));
            }
        }
    }
    // Integrity and the bound.
    for s in &first.prefix {
        if s.entries.len() > CAPACITY {
            v.push(format!(
                "{} holds {} entries (bound {CAPACITY})",
                s.name,
                s.entries.len()
            ));
        }
        if let Some((h, _)) = s
            .entries
            .iter()
            .find(|(h, _)| !r.blocks.contains_key(&(s.name.clone(), s.epoch, *h)))
        {
            v.push(format!(
                "{} holds block {h:x} at start time {} that no member recorded there",
                s.name, s.epoch
            ));
        }
    }
    // Completeness of what was recorded after the heal.
    for (pod, hashes) in &late_blocks(r, lives) {
        if hashes.len() > CAPACITY {
            v.push(format!(
                "the workload recorded {} blocks on {pod} after the heal, more than its bound \
                 {CAPACITY}: completeness cannot be checked",
                hashes.len()
            ));
            continue;
        }
        let held = first.prefix.iter().find(|s| s.name == *pod);
        let missing = hashes
            .iter()
            .filter(|h| !held.is_some_and(|s| s.entries.iter().any(|(x, _)| x == *h)))
            .count();
        if missing > 0 {
            v.push(format!(
                "{missing} of the {} blocks recorded on {pod} after the heal are missing",
                hashes.len()
            ));
        }
    }
    v
}

pub fn run(seed: u64, verbose: bool) -> Outcome {
    let n = harness::members(seed);
    let rec: Shared = Rc::default();
    let lives = Rc::new(PodLives::new(seed));
    let (shared, pods) = (Rc::clone(&rec), Rc::clone(&lives));
    let faults = match harness::simulate(seed, n, &TIMELINE, verbose, move |id, dir| {
        member(id, n, dir, seed, Rc::clone(&shared), Rc::clone(&pods))
    }) {
        Ok(f) => f,
        Err(e) => return Outcome::failed(e),
    };
    let r = rec.borrow();
    let mut violations = r.violations.clone();
    violations.extend(check(&r, &lives, n));
    violations.truncate(10);
    let held: Vec<usize> = r.finals.values().next().map_or_else(Vec::new, |f| {
        f.prefix.iter().map(|p| p.entries.len()).collect()
    });
    let late = late_blocks(&r, &lives)
        .values()
        .map(Vec::len)
        .max()
        .unwrap_or(0);
    let states: Vec<_> = r
        .finals
        .values()
        .flat_map(|f| f.prefix.iter().chain(&f.bindings))
        .map(|s| (&s.name, s.epoch, &s.entries))
        .collect();
    Outcome {
        faults: faults + lives.restarts(),
        done: r.routed,
        summary: format!(
            "{} routed, {} pod restarts, {} blocks recorded, entries held per pod at the end \
             {held:?} (bound {CAPACITY}), at most {late} recorded on a pod after the heal",
            r.routed,
            lives.restarts(),
            r.blocks.len()
        ),
        violations,
        fingerprint: harness::fingerprint(&states),
    }
}

#[test]
fn gossip_keeps_its_invariants_under_seeded_faults() {
    harness::run_seeds(
        "gossip",
        harness::Seeds {
            ci: 30,
            regressions: &[],
        },
        run,
    );
}

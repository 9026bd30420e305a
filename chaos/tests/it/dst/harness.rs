//! The simulation harness: members on turmoil hosts (real `ConsensusNode`s on the simulated
//! network), the seed's fault schedule, the run, and the loop over seeds.

use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use consensus::ConsensusConfig;
use consensus::ConsensusNode;
use consensus::StateMachine;
use consensus::config::SnapshotConfig;
use consensus::network::transport::Dialer;
use consensus::network::transport::PeerConn;
use consensus::network::transport::Transport;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;

const PORT: u16 = 7100;

/// When every simulation starts (since the UNIX epoch): incarnations and log stamps are the same
/// in every run of a seed.
pub const EPOCH: Duration = Duration::from_secs(1_800_000_000);

/// Faults from 1 s to `faults_end`; then every link is healed and every crashed member
/// restarted; the workload runs on until `calm_end`; the run ends at `end`.
#[derive(Debug, Clone, Copy)]
pub struct Timeline {
    pub faults_end: Duration,
    pub calm_end: Duration,
    pub end: Duration,
}

/// How many members seed `seed` runs: five for every third seed, else three.
pub fn members(seed: u64) -> u64 {
    if seed.is_multiple_of(3) { 5 } else { 3 }
}

pub fn host(i: u64) -> String {
    format!("n{i}")
}

/// Virtual time since the simulation started (on a host).
pub fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

/// The simulation's clock (µs since the epoch): log entries' leader stamps and the replicated
/// state's time come from it.
fn clock_us() -> u64 {
    turmoil::since_epoch().map_or(0, |d| d.as_micros() as u64)
}

fn config(id: u64, dir: &Path, n: u64) -> ConsensusConfig {
    ConsensusConfig {
        node_id: id,
        advertise_addr: format!("{}:{PORT}", host(id)),
        data_dir: dir.to_path_buf(),
        initial_members: (1..=n)
            .map(|i| (i, format!("{}:{PORT}", host(i))))
            .collect(),
        election_timeout_min: Duration::from_millis(300),
        election_timeout_max: Duration::from_millis(600),
        heartbeat_interval: Duration::from_millis(75),
        rpc_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(300),
        propose_timeout: Duration::from_secs(2),
        // Small snapshots and chunks: lagging members catch up by snapshot install, in chunks.
        snapshot: SnapshotConfig {
            logs_since_last: 40,
            keep_logs_after_snapshot: 5,
            chunk_bytes: 512,
            chunk_timeout: Duration::from_secs(1),
        },
        // Flushes complete in the simulation's thread, not at a real-time moment.
        inline_flush: true,
        ..ConsensusConfig::default()
    }
}

fn transport(listener: turmoil::net::TcpListener) -> Transport {
    let incoming = futures::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| PeerConn::new(s));
        Some((conn, l))
    });
    Transport {
        incoming: Box::pin(incoming),
        dialer: Dialer::new(|addr| {
            Box::pin(async move {
                turmoil::net::TcpStream::connect(addr)
                    .await
                    .map(PeerConn::new)
            })
        }),
    }
}

/// Member `id` of `n`: its consensus node on the simulated network, data in `dir`.
pub async fn start<S: StateMachine>(
    id: u64,
    n: u64,
    dir: &Path,
) -> Result<ConsensusNode<S>, String> {
    start_with(id, n, dir, tonic::service::Routes::default()).await
}

/// [`start`], with more services on the peer port (the gossip's, as `epp serve` adds them).
pub async fn start_with<S: StateMachine>(
    id: u64,
    n: u64,
    dir: &Path,
    routes: tonic::service::Routes,
) -> Result<ConsensusNode<S>, String> {
    // A restarted member reopens the directory its previous life just dropped: sled's
    // background flusher (a real thread, outside the simulation) may hold the directory's lock
    // a moment longer, which a new process never sees. Wait for it in real time (at most 5 s);
    // no simulated time passes meanwhile, so the run stays deterministic.
    let mut waited = 0;
    loop {
        let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT))
            .await
            .map_err(|e| format!("n{id} bind: {e}"))?;
        match ConsensusNode::start_on(config(id, dir, n), transport(listener), routes.clone()).await
        {
            Err(e) if e.to_string().contains("acquire lock") && waited < 250 => {
                waited += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            res => return res.map_err(|e| format!("n{id} start: {e}")),
        }
    }
}

#[derive(Debug, Clone)]
pub enum Fault {
    /// The link between two members stalls both ways (TCP segments wait; they arrive when it
    /// heals, as retransmission would deliver them).
    Stall(u64, u64),
    /// Every link of one member stalls.
    Isolate(u64),
    /// A link gets slow.
    Latency(u64, u64, Duration),
    /// The member's software dies (its tasks and connections end); it restarts on `Restart` or
    /// at the heal, from its data directory.
    Crash(u64),
    HealLinks,
    Restart,
}

/// The seed's fault schedule: a fault every 0.2–1.5 s between 1 s and `faults_end`.
fn schedule(seed: u64, n: u64, t: &Timeline) -> Vec<(Duration, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut at = Duration::from_secs(1);
    let mut out = Vec::new();
    let pair = |rng: &mut StdRng| {
        let a = rng.random_range(1..=n);
        let b = (a + rng.random_range(1..n) - 1) % n + 1;
        (a, b)
    };
    while at < t.faults_end {
        let fault = match rng.random_range(0..7) {
            0 | 1 => {
                let (a, b) = pair(&mut rng);
                Fault::Stall(a, b)
            }
            2 => Fault::Isolate(rng.random_range(1..=n)),
            3 => {
                let (a, b) = pair(&mut rng);
                Fault::Latency(a, b, Duration::from_millis(rng.random_range(20..400)))
            }
            4 => Fault::Crash(rng.random_range(1..=n)),
            5 => Fault::HealLinks,
            _ => Fault::Restart,
        };
        out.push((at, fault));
        at += Duration::from_millis(rng.random_range(200..1500));
    }
    out
}

/// Runs `n` members under the seed's faults until `t.end`; `member(id, dir)` is one life of
/// member `id`'s software (called again after each restart). Returns the number of faults, or
/// the simulation's error.
pub fn simulate<M, F>(
    seed: u64,
    n: u64,
    t: &Timeline,
    verbose: bool,
    member: M,
) -> Result<usize, String>
where
    M: Fn(u64, PathBuf) -> F + Clone + 'static,
    F: Future<Output = Result<(), Box<dyn std::error::Error>>> + 'static,
{
    consensus::runtime::seed_thread_rng(seed);
    consensus::clock::set_source(Some(clock_us));
    // The members' sled directories: in memory where the machine has a tmpfs (a simulated crash
    // drops the process's handles, not the machine's page cache, so a disk adds only time).
    let shm = Path::new("/dev/shm");
    let root = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .map_err(|e| format!("temporary directory: {e}"))?;
    let mut sim = turmoil::Builder::new()
        .epoch(std::time::UNIX_EPOCH + EPOCH)
        .simulation_duration(t.end + Duration::from_secs(5))
        .tick_duration(Duration::from_millis(10))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(10))
        // Connections waiting to be accepted, and segments waiting to be read, per socket: a
        // long stall releases every dial retried meanwhile at once (turmoil panics past this
        // bound, where a host's TCP would drop SYNs and the dialer retry).
        .tcp_capacity(4096)
        .rng_seed(seed)
        .build();
    for id in 1..=n {
        let (dir, member) = (root.path().join(host(id)), member.clone());
        sim.host(host(id), move || member(id, dir.clone()));
    }
    let plan = schedule(seed, n, t);
    if verbose {
        println!("seed {seed}: {n} members, schedule {plan:?}");
    }
    let hosts: Vec<String> = (1..=n).map(host).collect();
    let heal_links = |sim: &turmoil::Sim| {
        for a in &hosts {
            for b in &hosts {
                if a != b {
                    sim.release(a.as_str(), b.as_str());
                    sim.set_link_latency(a.as_str(), b.as_str(), Duration::ZERO);
                }
            }
        }
    };
    let mut crashed = Vec::new();
    let mut next = plan.iter().peekable();
    let mut healed = false;
    while sim.elapsed() < t.end {
        while let Some((_, fault)) = next.next_if(|(at, _)| sim.elapsed() >= *at) {
            match fault {
                Fault::Stall(a, b) => sim.hold(host(*a), host(*b)),
                Fault::Isolate(a) => {
                    for b in (1..=n).filter(|b| b != a) {
                        sim.hold(host(*a), host(b));
                    }
                }
                Fault::Latency(a, b, d) => sim.set_link_latency(host(*a), host(*b), *d),
                Fault::Crash(a) => {
                    if !crashed.contains(a) {
                        sim.crash(host(*a));
                        crashed.push(*a);
                    }
                }
                Fault::HealLinks => heal_links(&sim),
                Fault::Restart => {
                    for a in crashed.drain(..) {
                        sim.bounce(host(a));
                    }
                }
            }
        }
        if !healed && sim.elapsed() >= t.faults_end {
            healed = true;
            heal_links(&sim);
            for a in crashed.drain(..) {
                sim.bounce(host(a));
            }
        }
        sim.step().map_err(|e| format!("simulation error: {e}"))?;
    }
    Ok(plan.len())
}

/// What checking one seed found.
pub struct Outcome {
    pub faults: usize,
    /// The workload's completed operations (proposals acknowledged, requests served).
    pub done: u64,
    pub summary: String,
    pub violations: Vec<String>,
    /// A hash of what the run produced (the final log, the states' digests): equal for two runs
    /// of a seed when the simulation is deterministic.
    pub fingerprint: u64,
}

impl Outcome {
    pub fn failed(error: String) -> Outcome {
        Outcome {
            faults: 0,
            done: 0,
            summary: String::new(),
            violations: vec![error],
            fingerprint: 0,
        }
    }
}

/// A hash with fixed keys (the same in every run).
pub fn fingerprint(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut h = std::hash::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The seeds a test run checks: `DST_SEED` alone (verbose), else 1..=`DST_SEEDS` (the soak,
/// `deploy/local/dst-soak.sh`: thousands in release), else the CI set — 1..=`ci` and the
/// `regressions` (seeds that once failed, kept whatever the count). Every set checks the same
/// invariants; the soak checks them on more schedules.
pub struct Seeds {
    pub ci: u64,
    pub regressions: &'static [u64],
}

impl Seeds {
    fn chosen(&self) -> Vec<u64> {
        if let Ok(s) = std::env::var("DST_SEED") {
            return vec![s.parse().expect("DST_SEED: a number")];
        }
        let n = std::env::var("DST_SEEDS")
            .ok()
            .map_or(self.ci, |s| s.parse().expect("DST_SEEDS: a number"));
        let mut seeds: Vec<u64> = (1..=n).chain(self.regressions.iter().copied()).collect();
        seeds.sort_unstable();
        seeds.dedup();
        seeds
    }
}

/// Runs `check` on the chosen [`Seeds`], a thread per core; fails naming the seeds with
/// violations.
pub fn run_seeds(name: &str, seeds: Seeds, check: impl Fn(u64, bool) -> Outcome + Sync) {
    let seeds = seeds.chosen();
    let verbose = seeds.len() == 1;
    let started = std::time::Instant::now();
    // One simulation per thread at a time (turmoil's world is thread-local): a thread per core,
    // or `DST_THREADS` (deploy/local/test.sh sets 1: its runner runs the sweeps side by side).
    let threads = std::env::var("DST_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4)))
        .max(1);
    let check = &check;
    let outcomes: Vec<(u64, Outcome)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let mine: Vec<u64> = seeds.iter().copied().skip(t).step_by(threads).collect();
                scope.spawn(move || {
                    mine.into_iter()
                        .map(|s| {
                            // A panic (the simulator's or the code's) is that seed's failure.
                            let run = std::panic::AssertUnwindSafe(|| check(s, verbose));
                            let outcome = std::panic::catch_unwind(run).unwrap_or_else(|p| {
                                let why = p
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| p.downcast_ref::<&str>().map(ToString::to_string))
                                    .unwrap_or_default();
                                Outcome::failed(format!("panicked: {why}"))
                            });
                            (s, outcome)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a simulation thread panicked"))
            .collect()
    });
    let (mut faults, mut done) = (0, 0);
    let mut failed = Vec::new();
    for (seed, o) in &outcomes {
        faults += o.faults;
        done += o.done;
        if verbose || !o.violations.is_empty() {
            println!(
                "{name} seed {seed}: {} faults, {}: {:?}",
                o.faults, o.summary, o.violations
            );
        }
        if !o.violations.is_empty() {
            failed.push(*seed);
        }
    }
    failed.sort_unstable();
    println!(
        "{name}: {} seeds in {:.1} s, {faults} faults, {done} operations completed; seeds with \
         violations: {failed:?}",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        failed.is_empty(),
        "{name}: seeds with violations: {failed:?} (rerun one with DST_SEED=S)"
    );
    assert!(
        done > 0,
        "{name}: nothing completed: the simulation did not run"
    );
}

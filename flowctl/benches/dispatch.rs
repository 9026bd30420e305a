//! Enqueue + dispatch cost with 10k queued requests over 1k flows, per fairness/ordering policy,
//! and memory per queued request.
//!
//! Steady state: one endpoint with 64 slots (concurrency detector) is full and 10 000 requests wait
//! in 1 000 flows. One iteration = `Complete` of the oldest in-flight request (a slot frees, the
//! dispatcher picks the next request: band → fairness → ordering) + `Enqueue` of a new request into
//! the next flow (saturated, so it queues). The queue stays at 10 000.
//!
//! Run: `cargo bench -p flowctl` (memory figures are printed first).

use criterion::{BenchmarkId, Criterion, criterion_group};
use flowctl::{
    BandConfig, BandSettings, Charge, Command, ConcurrencyDetector, ControllerConfig,
    EndpointSnapshot, EnqueueRequest, FairnessPolicy, FlowController, FlowKey, OrderingPolicy,
    Outcome, SaturationDetector, WeightedFairnessParams,
};
use std::collections::VecDeque;
use std::hint::black_box;

const FLOWS: u64 = 1_000;
const QUEUED: u64 = 10_000;
const SLOTS: u64 = 64;

struct Bench {
    fc: FlowController,
    flow_names: Vec<String>,
    running: VecDeque<u64>,
    next_id: u64,
    now: u64,
    out: Vec<Outcome>,
}

impl Bench {
    fn new(fairness: FairnessPolicy, ordering: OrderingPolicy, queued: u64) -> Bench {
        let cfg = ControllerConfig {
            bands: vec![BandConfig {
                priority: 0,
                settings: BandSettings {
                    max_requests: 10_000_000,
                    max_bytes: 1 << 50,
                    fairness,
                    ordering,
                    request_ttl: None,
                },
            }],
            detector: SaturationDetector::Concurrency(ConcurrencyDetector {
                max_concurrency: SLOTS,
                ..ConcurrencyDetector::default()
            }),
            ..ControllerConfig::default()
        };
        let mut b = Bench {
            fc: match FlowController::new(cfg) {
                Ok(fc) => fc,
                Err(e) => panic!("bench config: {e}"),
            },
            flow_names: (0..FLOWS).map(|i| format!("tenant-{i:04}")).collect(),
            running: VecDeque::new(),
            next_id: 0,
            now: 0,
            out: Vec::new(),
        };
        b.fc.apply(
            0,
            Command::ObservePool {
                endpoints: vec![EndpointSnapshot::default()],
            },
        );
        for _ in 0..queued + SLOTS {
            b.enqueue();
        }
        assert_eq!(b.fc.totals().queued_requests, queued);
        b
    }

    fn enqueue(&mut self) {
        self.next_id += 1;
        let id = self.next_id;
        let flow = &self.flow_names[(id % FLOWS) as usize];
        self.out.clear();
        self.fc.apply_into(
            self.now,
            Command::Enqueue(EnqueueRequest {
                id,
                flow: FlowKey::new(flow.clone(), 0),
                bytes: 2_000,
                tokens: 500 + (id % 7) * 100,
                ttl: None,
                slo_ttft: Some(1_000_000_000 + (id % 13) * 1_000_000),
            }),
            &mut self.out,
        );
        self.collect();
    }

    fn collect(&mut self) {
        for o in &self.out {
            if let Outcome::Dispatched { id } = o {
                self.running.push_back(*id);
            }
        }
    }

    /// One slot frees (dispatching one queued request), one request arrives.
    fn step(&mut self) {
        self.now += 1_000;
        if let Some(id) = self.running.pop_front() {
            self.out.clear();
            self.fc.apply_into(
                self.now,
                Command::Complete {
                    id,
                    actual_tokens: None,
                },
                &mut self.out,
            );
            self.collect();
        }
        self.enqueue();
    }
}

fn policies() -> Vec<(&'static str, FairnessPolicy, OrderingPolicy)> {
    vec![
        (
            "global-strict+fcfs",
            FairnessPolicy::GlobalStrict,
            OrderingPolicy::Fcfs,
        ),
        (
            "round-robin+fcfs",
            FairnessPolicy::RoundRobin,
            OrderingPolicy::Fcfs,
        ),
        (
            "weighted-tokens+fcfs",
            FairnessPolicy::Weighted(WeightedFairnessParams {
                charge: Charge::Tokens,
                ..WeightedFairnessParams::default()
            }),
            OrderingPolicy::Fcfs,
        ),
        (
            "round-robin+edf",
            FairnessPolicy::RoundRobin,
            OrderingPolicy::Edf,
        ),
        (
            "weighted-requests+slo",
            FairnessPolicy::Weighted(WeightedFairnessParams::default()),
            OrderingPolicy::SloDeadline,
        ),
    ]
}

fn dispatch(c: &mut Criterion) {
    let mut group = c.benchmark_group("enqueue+dispatch, 10k queued over 1k flows");
    for (name, fairness, ordering) in policies() {
        let mut bench = Bench::new(fairness, ordering, QUEUED);
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                bench.step();
                black_box(bench.fc.totals().queued_requests)
            })
        });
        assert_eq!(bench.fc.totals().queued_requests, QUEUED);
    }
    group.finish();
}

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// utime + stime of this process, in seconds (Linux `/proc/self/stat`, 100 Hz ticks).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_comm = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn memory_report() {
    const N: u64 = 100_000;
    println!("memory per queued request (flowctl):");
    println!(
        "  index payload (size_of, all indexes): {} B",
        flowctl::machine::QUEUED_PAYLOAD_BYTES
    );
    // Keep every state alive until the end so each resident delta is fresh memory.
    let mut keep = Vec::new();
    for (name, fairness, ordering) in policies() {
        let before = resident_bytes();
        let bench = Bench::new(fairness, ordering, N);
        let after = resident_bytes();
        if let (Some(a), Some(b)) = (after, before) {
            println!(
                "  {name}: resident {:.0} B/request ({N} queued, {FLOWS} flows)",
                a.saturating_sub(b) as f64 / N as f64,
            );
        }
        keep.push((name, bench));
    }
    for (name, bench) in &keep {
        let snapshot = serde_json::to_vec(&bench.fc).map(|v| v.len()).unwrap_or(0);
        println!(
            "  {name}: JSON snapshot {:.0} B/request",
            snapshot as f64 / N as f64
        );
    }
}

/// CPU time per step (independent of other processes competing for the cores).
fn cpu_report() {
    const STEPS: u32 = 1_000_000;
    println!("CPU time per enqueue+dispatch step ({STEPS} steps, 10k queued over 1k flows):");
    for (name, fairness, ordering) in policies() {
        let mut bench = Bench::new(fairness, ordering, QUEUED);
        let start = cpu_seconds();
        for _ in 0..STEPS {
            bench.step();
        }
        black_box(bench.fc.totals());
        if let (Some(a), Some(b)) = (cpu_seconds(), start) {
            println!("  {name}: {:.3} µs", (a - b) * 1e6 / f64::from(STEPS));
        }
    }
}

criterion_group!(benches, dispatch);

fn main() {
    memory_report();
    cpu_report();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}

//! `epp-chaos`: the randomized chaos suite. Runs seeds one after another — each a fresh cluster
//! (replicas in cluster mode, Envoy, simulated pods) under load while the seed's schedule of
//! faults breaks it — prints every seed's report, and exits non-zero if any invariant failed.
//!
//! ```text
//! epp-chaos --seeds 1,2,3 --replicas 3 --run 60
//! epp-chaos --first-seed 100 --for 1800 --run 120 --json reports.jsonl   # a soak
//! ```
//! A failing seed is reproduced by running it again: `epp-chaos --seeds N` with the same
//! `--replicas` and `--run`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "epp-chaos",
    about = "Randomized chaos runs with the invariant checker"
)]
struct Args {
    /// Seeds to run (comma-separated). Without it: consecutive seeds from --first-seed.
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<u64>,
    #[arg(long, default_value_t = 1)]
    first_seed: u64,
    /// With --first-seed: keep starting seeds until this many seconds have passed (a soak).
    #[arg(long = "for")]
    soak: Option<u64>,
    /// Replicas (3 or 5 keep a majority through the schedule's faults).
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    /// Length of each seed's load, in seconds.
    #[arg(long, default_value_t = 60)]
    run: u64,
    /// Append each report as a JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EPP_CHAOS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    anyhow::ensure!(
        args.replicas >= 3,
        "--replicas must be at least 3 (faults need a majority left)"
    );
    let run = Duration::from_secs(args.run);
    let started = Instant::now();
    let mut seeds = args.seeds.clone().into_iter();
    let mut next = args.first_seed;
    let (mut runs, mut failed) = (0u32, Vec::new());
    loop {
        let seed = if args.seeds.is_empty() {
            match args.soak {
                Some(limit) if started.elapsed() + run > Duration::from_secs(limit) && runs > 0 => {
                    break;
                }
                None if runs > 0 => break,
                _ => {}
            }
            next += 1;
            next - 1
        } else {
            match seeds.next() {
                Some(s) => s,
                None => break,
            }
        };
        let spec = chaos::random::RunSpec {
            seed,
            replicas: args.replicas,
            run,
        };
        // On SIGINT/SIGTERM the run is dropped, and with it every process it started.
        let report = tokio::select! {
            r = chaos::random::run(&spec) => r.with_context(|| format!("seed {seed}"))?,
            _ = stop_signal() => anyhow::bail!("interrupted during seed {seed}"),
        };
        print!("{}", report.render());
        if let Some(path) = &args.json {
            chaos::random::append_json(path, &report)?;
        }
        if !report.violations().is_empty() {
            failed.push(seed);
        }
        runs += 1;
    }
    println!(
        "{runs} seeds in {:.0} s: {} with violations {failed:?}",
        started.elapsed().as_secs_f64(),
        failed.len()
    );
    anyhow::ensure!(
        failed.is_empty(),
        "invariants violated for seeds {failed:?}"
    );
    Ok(())
}

async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

//! Acceptance: a 200-pod simulator and the load generator run together on this machine for a
//! 60-second workload, with every pod's `/metrics` scraped every 50 ms the whole time.
//!
//! Everything runs in this test process (the pods, the scrapers, the load generator); the sim is
//! shut down at the end and aborted by its `Drop` if an assertion fails first, so nothing outlives
//! the test. The workload's arrivals are a Poisson process conditioned to end inside a 57 s window
//! ([`LoadConfig::window_ms`]); each request has a 5 s timeout and the whole workload a hard 68 s
//! deadline, so the test ends within ~70 s or fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sim::loadgen::{self, Arrival, LoadConfig};
use sim::{PodKnobs, Sim, SimConfig};

const PODS: usize = 200;
const SCRAPE_EVERY: Duration = Duration::from_millis(50);
const WINDOW: Duration = Duration::from_secs(57);
const DEADLINE: Duration = Duration::from_secs(68);
/// Conversations per pod: 1200 over the fleet, ~21 conversations/s.
const CONVERSATIONS: usize = 6;
const TURNS: usize = 3;

/// Per-pod scrape outcomes.
#[derive(Default)]
struct Scrapes {
    ok: AtomicU64,
    failed: AtomicU64,
}

/// The value of the first sample of `name` in an exposition.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_200_pods_60s() {
    let sim = Sim::start(SimConfig {
        pods: PODS,
        knobs: PodKnobs::default(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let pods: Vec<String> = sim
        .pods()
        .iter()
        .map(|p| format!("http://{}", p.addr))
        .collect();

    // Scrapers: one task per pod on one keep-alive client, like an endpoint picker. A scrape fails
    // on a transport error, a non-200, or a body that is not the pod's exposition.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let counts: Arc<Vec<Scrapes>> = Arc::new((0..PODS).map(|_| Scrapes::default()).collect());
    let mut scrapers = tokio::task::JoinSet::new();
    for (i, pod) in pods.iter().enumerate() {
        let (client, counts, mut stop) = (client.clone(), Arc::clone(&counts), stop_rx.clone());
        let url = format!("{pod}/metrics");
        scrapers.spawn(async move {
            let mut tick = tokio::time::interval(SCRAPE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.changed() => return,
                }
                let good = match client.get(&url).send().await {
                    Ok(r) if r.status() == 200 => match r.text().await {
                        Ok(t) => sample(&t, "vllm:num_requests_running").is_some(),
                        Err(_) => false,
                    },
                    _ => false,
                };
                let c = &counts[i];
                if good { &c.ok } else { &c.failed }.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    // The workload: every pod gets its own seeded Poisson conversations (shared 256-word system
    // prompt, 3 turns, 500 ms think time), all arriving within the window.
    let cfg = LoadConfig {
        conversations: CONVERSATIONS,
        turns: TURNS,
        think_time_ms: 500,
        system_prompt_words: 256,
        conversation_words: 128,
        user_words: 32,
        max_tokens: 32,
        arrival: Arrival::Poisson,
        window_ms: WINDOW.as_millis() as u64,
        request_timeout_ms: 5_000,
        ..LoadConfig::default()
    };
    let started = Instant::now();
    let runs = pods.iter().enumerate().map(|(i, p)| {
        let cfg = LoadConfig {
            seed: i as u64,
            ..cfg.clone()
        };
        async move { loadgen::run(&cfg, p).await.unwrap() }
    });
    let reports = tokio::time::timeout(DEADLINE, futures::future::join_all(runs))
        .await
        .expect("the workload overran its hard deadline");
    let workload = started.elapsed();
    let _ = stop_tx.send(true);
    while scrapers.join_next().await.is_some() {}

    let (mut requests, mut errors, mut transport) = (0, 0, 0);
    let (mut prompt, mut cached) = (0, 0);
    for (i, r) in reports.iter().enumerate() {
        requests += r.requests;
        errors += r.errors;
        transport += r.transport_errors;
        prompt += r.prompt_tokens;
        cached += r.cached_tokens;
        // Every request of pod i's run was served by pod i.
        assert_eq!(r.pods.get(&format!("sim-{i}")).copied(), Some(r.requests));
    }
    let ok: u64 = counts.iter().map(|c| c.ok.load(Ordering::Relaxed)).sum();
    let failed: u64 = counts
        .iter()
        .map(|c| c.failed.load(Ordering::Relaxed))
        .sum();
    let least = counts
        .iter()
        .map(|c| c.ok.load(Ordering::Relaxed))
        .min()
        .unwrap();
    let ideal = workload.as_secs_f64() / SCRAPE_EVERY.as_secs_f64();
    let cached_ratio = cached as f64 / prompt.max(1) as f64;
    eprintln!(
        "workload {:.1} s: {requests} requests, {errors} errors ({transport} transport), \
         cached ratio {cached_ratio:.3}; {ok} scrapes ({:.0}/s), {failed} failed, \
         fewest per pod {least} of ~{ideal:.0}",
        workload.as_secs_f64(),
        ok as f64 / workload.as_secs_f64(),
    );

    let expected = (PODS * CONVERSATIONS * TURNS) as u64;
    assert_eq!(requests, expected, "every request of the schedule was sent");
    assert_eq!(errors, 0, "no request failed");
    assert_eq!(transport, 0);
    assert_eq!(failed, 0, "no scrape failed");
    // The schedule ends inside the window; the last conversations still have two turns to go.
    assert!(
        workload >= WINDOW - Duration::from_secs(5),
        "the workload was meant to last ~60 s, took {workload:?}"
    );
    // Every pod was scraped all along (half the ideal count leaves room for a loaded machine).
    assert!(
        least as f64 >= ideal * 0.5,
        "a pod got only {least} scrapes of ~{ideal:.0}"
    );
    // Shared system prompt + multi-turn history: most prompt tokens come from the prefix cache,
    // but never all (every turn adds new text).
    assert!(
        (0.5..0.95).contains(&cached_ratio),
        "cached-token ratio {cached_ratio}"
    );

    // After the run, every pod's exposition agrees with its state and the load generator's count.
    let mut served = 0;
    for (i, pod) in pods.iter().enumerate() {
        let text = client
            .get(format!("{pod}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let stats = sim.stats(i);
        assert_eq!(stats.running, 0);
        assert_eq!(stats.waiting, 0);
        assert_eq!(
            sample(&text, "vllm:request_success_total"),
            Some(stats.served as f64)
        );
        assert_eq!(
            sample(&text, "vllm:prefix_cache_hits_total"),
            Some(stats.prefix_hits_tokens as f64)
        );
        served += stats.served;
    }
    assert_eq!(served, expected);
    sim.shutdown().await;
}

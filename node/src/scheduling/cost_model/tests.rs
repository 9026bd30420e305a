use std::time::Instant;

use super::*;
use crate::datalayer::EndpointMetrics;
use crate::scheduling::testutil::*;
use crate::scheduling::{InflightLoad, PrefixMatchInfo};

/// 1000 tokens/s prior (1 ms per token), 400 ms service time, no learning.
fn model(learn: bool) -> CostModel {
    CostModel::new(CostModelParams {
        prefill_tokens_per_second: 1000.0,
        service_time_ms: 400.0,
        stale_metrics_penalty_ms: 5000.0,
        learn,
        memory_samples: 64.0,
        prefill_interference: 0.0,
        eviction_cost: 0.5,
        load_cost: 0.25,
    })
}

fn gauges(running: f64, waiting: f64) -> Option<EndpointMetrics> {
    Some(EndpointMetrics {
        running_requests: Some(running),
        waiting_queue_size: Some(waiting),
        ..Default::default()
    })
}

/// A 1000-token prompt (16 blocks of 64 = 1024 > 1000: prompt_tokens = 1000), matched blocks per
/// candidate, and ledger loads.
fn data(matched: Vec<usize>, inflight: Vec<InflightLoad>) -> RequestData {
    RequestData {
        prompt_tokens: 1000,
        prefix: Some(PrefixMatchInfo {
            block_size: 64,
            total_blocks: 15,
            matched,
            hashes: vec![],
            weighted: Vec::new(),
        }),
        inflight,
        ..RequestData::default()
    }
}

fn load(requests: u64, tokens: u64) -> InflightLoad {
    InflightLoad {
        requests,
        tokens,
        prefilling: 0,
    }
}

#[test]
fn predictions_by_hand() {
    let m = model(false);
    let a = cand_at("a", "10.0.0.1:1", gauges(1.0, 0.0), false, &[]);
    let b = cand_at("b", "10.0.0.2:1", gauges(0.0, 0.0), false, &[]);
    // c has shown a batch of 2 with requests waiting (two samples): its batch limit is 2.
    let c = cand_at("c", "10.0.0.3:1", None, false, &[]);
    for _ in 0..2 {
        c.endpoint
            .set_metrics(gauges(2.0, 1.0).unwrap(), Instant::now(), None);
    }
    let c = Candidate {
        sample: c.endpoint.sample(),
        ..c
    };
    // d: requests waiting in two samples but no known limit; e: no metrics at all; f: one sample
    // with a request waiting (caught between its arrival and the engine's next step).
    let d = cand_at("d", "10.0.0.4:1", gauges(0.0, 2.0), false, &[]);
    d.endpoint
        .set_metrics(gauges(0.0, 2.0).unwrap(), Instant::now(), None);
    let d = Candidate {
        sample: d.endpoint.sample(),
        ..d
    };
    let e = cand_at("e", "10.0.0.5:1", None, false, &[]);
    let f = cand_at("f", "10.0.0.6:1", gauges(1.0, 0.0), false, &[]);
    f.endpoint
        .set_metrics(gauges(0.0, 1.0).unwrap(), Instant::now(), None);
    let f = Candidate {
        sample: f.endpoint.sample(),
        ..f
    };
    let cs = [a, b, c, d, e, f];
    let mut rd = data(
        vec![10, 0, 0, 0, 0, 0],
        vec![
            load(1, 200),
            load(0, 0),
            load(3, 100),
            load(0, 0),
            load(0, 0),
            load(1, 1000),
        ],
    );
    m.produce(&req(), &cs, &mut rd);
    let t: Vec<f64> = rd.predicted.iter().map(|p| p.ttft_ms).collect();
    // a: 1000 − 10·64 = 360 uncached + 200 queued tokens at 1 ms each; one running, no slot wait.
    assert_eq!(t[0], 560.0);
    assert_eq!(
        (rd.predicted[0].running, rd.predicted[0].uncached_tokens),
        (1, 360)
    );
    // b: idle, nothing cached.
    assert_eq!(t[1], 1000.0);
    // c: 3 in flight ≥ limit 2 → wait (3 − 2 + 1) · 400 / 2 = 400 ms, on top of 1100 tokens.
    assert_eq!(rd.predicted[2].queue_ms, 400.0);
    assert_eq!((t[2], rd.predicted[2].running), (1500.0, 2));
    // …and its 3 requests cost a new one a quarter of their slot time: 0.25 · 3 · 400 / 2.
    assert_eq!(rd.predicted[2].others_ms, 150.0);
    // d: 2 waiting and none running in two samples (an engine still loading): no limit
    // learned, the waiting queue says full → (2 + 1) · 400 / 1 = 1200 ms.
    assert_eq!(t[3], 1000.0 + 1200.0);
    // e: never scraped → the stale penalty.
    assert_eq!(t[4], 1000.0 + 5000.0);
    // f: one request routed there, waiting for its first step in the last sample: its 1000
    // tokens are queued prefill work, not a full batch — no slot wait.
    assert_eq!(rd.predicted[5].queue_ms, 0.0);
    assert_eq!(t[5], 2000.0);

    let s = CostModelScorer;
    let scores = score_all(&s, &rd, &cs);
    let want = [
        1.0,
        561.0 / 1001.0,
        561.0 / 1651.0,
        561.0 / 2201.0,
        561.0 / 6001.0,
        561.0 / 2001.0,
    ];
    for (got, want) in scores.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{scores:?}");
    }
}

/// An engine whose concurrent prefills do not slow each other (q = 0, as learned on such a
/// pool): a pod matched only by blocks an earlier request is still prefilling is no cheaper
/// than a cold one, so the request goes to an idle pod instead of queueing behind it.
#[test]
fn a_match_still_being_prefilled_is_not_a_cache_hit() {
    let m = model(false);
    m.state.write().unwrap().fleet.fit.ms_per_queued_token = 0.0;
    let a = cand_at("a", "10.0.0.1:1", gauges(1.0, 0.0), false, &[]);
    let b = cand_at("b", "10.0.0.2:1", gauges(0.0, 0.0), false, &[]);
    let cs = [a, b];
    let mut rd = data(vec![15, 0], vec![load(1, 1000), load(0, 0)]);
    m.produce(&req(), &cs, &mut rd);
    // Believed cached: 1000 − 15·64 = 40 uncached tokens on a, against 1000 on b.
    assert_eq!(rd.predicted[0].uncached_tokens, 40);
    assert!(rd.predicted[0].cost_ms() < rd.predicted[1].cost_ms());
    // 12 of the 15 matched blocks are still being prefilled on a: 40 + 12·64 = 808 to compute.
    rd.pending = vec![12, 0];
    m.produce(&req(), &cs, &mut rd);
    assert_eq!(rd.predicted[0].uncached_tokens, 808);
    // All of them: the whole prompt, and a is no cheaper than b (idle).
    rd.pending = vec![15, 0];
    m.produce(&req(), &cs, &mut rd);
    assert_eq!(rd.predicted[0].uncached_tokens, 1000);
    assert!(rd.predicted[0].cost_ms() >= rd.predicted[1].cost_ms());
}

/// Time per output token: nothing before samples; then `t0 + t1 · running` from streamed
/// responses — here 10 ms alone plus 2 ms per request running beside it.
#[test]
fn learns_the_time_per_output_token() {
    let m = model(true);
    assert_eq!(m.predict_tpot(3), None);
    for i in 0..200u64 {
        let running = i % 5;
        let tpot = 10.0 + 2.0 * running as f64;
        let out = 33;
        m.observed(&Observation {
            pod: "10.0.0.1:1",
            ttft_ms: Some(50.0),
            e2e_ms: 50.0 + tpot * (out - 1) as f64,
            prompt_tokens: Some(100),
            cached_tokens: Some(0),
            output_tokens: Some(out),
            predicted: Some(Prediction {
                ttft_ms: 50.0,
                running,
                ..Prediction::default()
            }),
        });
    }
    for running in [0, 4, 8] {
        let t = m.predict_tpot(running).unwrap();
        let want = 10.0 + 2.0 * running as f64;
        assert!((t - want).abs() < 0.1, "{running}: {t} vs {want}");
    }
    // Responses without a streamed first token, or with one output token, teach nothing.
    let m = model(true);
    for out in [Some(1), None] {
        m.observed(&Observation {
            pod: "10.0.0.1:1",
            ttft_ms: Some(50.0),
            e2e_ms: 500.0,
            prompt_tokens: None,
            cached_tokens: None,
            output_tokens: out,
            predicted: None,
        });
    }
    assert_eq!(m.view().tpot, None);
}

/// A pod whose KV is taken by running requests pays for what a request would push out of it:
/// half the re-prefill of those tokens.
#[test]
fn a_full_pod_pays_for_what_it_evicts() {
    let m = model(false);
    // 1000 blocks of 16 = 16000 tokens; "full" runs requests holding 90% of them.
    let kv = |usage: f64| {
        Some(EndpointMetrics {
            running_requests: Some(1.0),
            waiting_queue_size: Some(0.0),
            kv_cache_usage: Some(usage),
            num_gpu_blocks: Some(1000),
            block_size: Some(16),
            ..Default::default()
        })
    };
    let cs = [
        cand_at("full", "10.0.0.1:1", kv(0.9), false, &[]),
        cand_at("roomy", "10.0.0.2:1", kv(0.1), false, &[]),
    ];
    let mut rd = data(vec![5, 0], vec![load(0, 0), load(0, 0)]);
    m.produce(&req(), &cs, &mut rd);
    // full: 1000 − 5·64 = 680 uncached; 14400 + 680 − 16000 < 0: nothing evicted yet.
    assert_eq!(
        (rd.predicted[0].ttft_ms, rd.predicted[0].others_ms),
        (680.0, 0.0)
    );
    // With 2000 tokens queued there, 14400 + 680 + 2000 − 16000 = 1080 are pushed out.
    let mut rd = data(vec![5, 0], vec![load(1, 2000), load(0, 0)]);
    m.produce(&req(), &cs, &mut rd);
    assert_eq!(rd.predicted[0].ttft_ms, 2680.0);
    assert_eq!(rd.predicted[0].others_ms, 540.0);
    assert_eq!(
        (rd.predicted[1].ttft_ms, rd.predicted[1].others_ms),
        (1000.0, 0.0)
    );
    let scores = score_all(&CostModelScorer, &rd, &cs);
    assert_eq!(scores[1], 1.0);
    assert!((scores[0] - 1001.0 / 3221.0).abs() < 1e-12, "{scores:?}");
}

/// Observations of a pod whose TTFT is 10 ms + 0.2 ms per uncached token + 0.05 ms per queued
/// token + 3 ms per running request: the fit converges to it from a prior 5× off, and another
/// pod borrows the fleet's.
#[test]
fn learns_a_pods_speed_from_its_responses() {
    let m = model(true);
    let truth = |uncached: u64, queued: u64, running: u64| {
        10.0 + 0.2 * uncached as f64 + 0.05 * queued as f64 + 3.0 * running as f64
    };
    for k in 0..400u64 {
        let uncached = 100 + (k * 37) % 2000;
        let queued = (k * 113) % 3000;
        let running = k % 5;
        // As if routed with a prediction in the right range (a sample far above its
        // prediction is clipped: see `clip`).
        let p = Prediction {
            ttft_ms: truth(uncached, queued, running),
            uncached_tokens: uncached + 50,
            queued_tokens: queued,
            running,
            ..Prediction::default()
        };
        m.observed(&Observation {
            pod: "10.0.0.1:1",
            ttft_ms: Some(truth(uncached, queued, running)),
            e2e_ms: 2000.0,
            // the usage says 50 of the predicted uncached tokens were cached after all
            prompt_tokens: Some(uncached + 500),
            cached_tokens: Some(500),
            output_tokens: None,
            predicted: Some(p),
        });
    }
    let v = m.view();
    let (pod, learned) = &v.pods[0];
    assert_eq!(pod, "10.0.0.1:1");
    let f = learned.fit;
    assert!((f.ms_per_token - 0.2).abs() < 0.005, "{f:?}");
    assert!((f.ms_per_queued_token - 0.05).abs() < 0.01, "{f:?}");
    assert!((f.base_ms - 10.0).abs() < 2.0, "{f:?}");
    assert!((f.ms_per_running - 3.0).abs() < 0.5, "{f:?}");
    assert!((learned.service_ms.unwrap() - 2000.0).abs() < 1e-6);
    // The fleet learned the same; a pod never observed predicts with it.
    assert!(
        (v.fleet.fit.ms_per_token - 0.2).abs() < 0.01,
        "{:?}",
        v.fleet
    );
    let cs = [cand_at("new", "10.0.0.9:1", gauges(0.0, 0.0), false, &[])];
    let mut rd = data(vec![0], vec![load(0, 0)]);
    m.produce(&req(), &cs, &mut rd);
    let want = truth(1000, 0, 0);
    assert!(
        (rd.predicted[0].ttft_ms - want).abs() < 0.05 * want,
        "{:?}",
        rd.predicted
    );
}

/// Four pods, the last `slow` times slower than the others. Each sample is off by up to
/// ±30 % and the true TTFT is not linear in the queued tokens (the fleet's fit cannot match
/// it everywhere).
fn learn_pool(slow: f64) -> (CostModel, [&'static str; 4], impl Fn(u64, u64) -> f64) {
    let m = model(true);
    // Convex in the queued tokens (a misfit for the linear model), whose cost per token stays
    // near the request's own on average, as in an engine: both are prefilled in the same steps.
    let truth = |uncached: u64, queued: u64| {
        let q = queued as f64;
        20.0 + 0.07 * uncached as f64 + 0.02 * q + 0.00001 * q * q
    };
    let pods = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"];
    let mut rng = 7u64;
    for k in 0..2000u64 {
        let pod = (k % 4) as usize;
        let uncached = 50 + (k * 37) % 3000;
        let queued = (k * 113) % 4000;
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let noise = 0.7 + 0.6 * ((rng >> 33) as f64 / (1u64 << 31) as f64);
        let slow = if pod == 3 { slow } else { 1.0 };
        let y = truth(uncached, queued) * slow * noise;
        m.observed(&Observation {
            pod: pods[pod],
            ttft_ms: Some(y),
            e2e_ms: 500.0,
            prompt_tokens: Some(uncached),
            cached_tokens: Some(0),
            output_tokens: None,
            predicted: Some(Prediction {
                ttft_ms: truth(uncached, queued) * slow,
                uncached_tokens: uncached,
                queued_tokens: queued,
                ..Prediction::default()
            }),
        });
    }
    (m, pods, truth)
}

/// Identical pods keep the fleet's fit (`k` within a few percent of 1): neither noise nor the
/// fit's misfit makes one of them look faster and draw every new session.
#[test]
fn identical_pods_keep_the_fleets_fit() {
    let (m, _, _) = learn_pool(1.0);
    let speed: Vec<f64> = m.view().pods.iter().map(|(_, l)| l.speed).collect();
    assert!(
        speed.iter().all(|k| (k - 1.0).abs() < 0.03),
        "identical pods drifted apart: {speed:?}"
    );
}

/// A pod three times slower than the other three stands out of the noise: its factor is
/// three times theirs, the others' stay together, and predictions follow.
#[test]
fn a_slow_pod_gets_its_own_factor() {
    let (m, pods, truth) = learn_pool(3.0);
    let speed: Vec<f64> = m.view().pods.iter().map(|(_, l)| l.speed).collect();
    let fast = &speed[..3];
    let (lo, hi) = fast
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &s| (l.min(s), h.max(s)));
    assert!(hi / lo < 1.06, "identical pods drifted apart: {speed:?}");
    let mean = fast.iter().sum::<f64>() / 3.0;
    assert!((speed[3] / mean - 3.0).abs() < 0.3, "{speed:?}");
    // Predictions: 2000 uncached tokens on an idle pod.
    let cs = [
        cand_at("fast", pods[0], gauges(0.0, 0.0), false, &[]),
        cand_at("slow", pods[3], gauges(0.0, 0.0), false, &[]),
    ];
    let st = m.read();
    let now = Instant::now();
    let want = truth(2000, 0);
    let fast_ttft = m.predict(&st, now, &cs[0], 2000, None).ttft_ms;
    let slow_ttft = m.predict(&st, now, &cs[1], 2000, None).ttft_ms;
    assert!(
        (fast_ttft / want - 1.0).abs() < 0.15,
        "{fast_ttft} vs {want}"
    );
    assert!(
        (slow_ttft / want / 3.0 - 1.0).abs() < 0.15,
        "{slow_ttft} vs 3 × {want}"
    );
}

/// With continuous batching, every request running on a pod waits for a new request's prefill
/// too: `prefillInterference · R_i · s_i · U_i` is added to its cost, so a cold prompt goes to
/// the pod with fewer requests running even at the same TTFT, while a warm one stays home.
#[test]
fn a_prefill_costs_every_running_request() {
    let m = CostModel::new(CostModelParams {
        prefill_tokens_per_second: 1000.0,
        learn: false,
        prefill_interference: 1.0,
        ..CostModelParams::default()
    });
    let cs = [
        cand_at("busy", "10.0.0.1:1", gauges(3.0, 0.0), false, &[]),
        cand_at("quiet", "10.0.0.2:1", gauges(1.0, 0.0), false, &[]),
    ];
    // Cold everywhere: 1000 uncached tokens at 1 ms each on both; the ledger says 3 and 1
    // running (no tokens left to prefill).
    let mut rd = data(vec![0, 0], vec![load(3, 0), load(1, 0)]);
    m.produce(&req(), &cs, &mut rd);
    assert_eq!(rd.predicted[0].ttft_ms, rd.predicted[1].ttft_ms);
    assert_eq!(rd.predicted[0].others_ms, 3.0 * 1000.0);
    assert_eq!(rd.predicted[1].others_ms, 1000.0);
    let scores = score_all(&CostModelScorer, &rd, &cs);
    assert_eq!(scores[1], 1.0);
    assert!((scores[0] - 2001.0 / 4001.0).abs() < 1e-12, "{scores:?}");
    // Warm on the busy pod (14 of 15 blocks of 64: 1000 − 896 = 104 uncached): 104 + 3 · 104
    // = 416 there against 2000 on the quiet pod.
    let mut rd = data(vec![14, 0], vec![load(3, 0), load(1, 0)]);
    m.produce(&req(), &cs, &mut rd);
    assert_eq!(rd.predicted[0].cost_ms(), 416.0);
    assert_eq!(rd.predicted[1].cost_ms(), 2000.0);
}

/// A pod that looked slow and then got no traffic relaxes to the fleet's fit, so it is tried
/// again; one sample far above its prediction moves the fit only up to the clip.
#[test]
fn an_unsampled_pod_relaxes_to_the_fleet() {
    let m = model(true);
    let obs = |pod, ttft| Observation {
        pod,
        ttft_ms: Some(ttft),
        e2e_ms: ttft + 100.0,
        prompt_tokens: Some(1000),
        cached_tokens: Some(0),
        output_tokens: None,
        predicted: Some(Prediction {
            ttft_ms: 1000.0,
            uncached_tokens: 1000,
            ..Prediction::default()
        }),
    };
    for _ in 0..50 {
        m.observed(&obs("10.0.0.1:1", 1000.0));
    }
    // One stall: 60 s observed, counted as 3 × 1000 + 20 ms.
    m.observed(&obs("10.0.0.2:1", 60_000.0));
    let cs = [cand_at("slow", "10.0.0.2:1", gauges(0.0, 0.0), false, &[])];
    let st = m.read();
    let now = Instant::now();
    let at = |t: Instant| m.predict(&st, t, &cs[0], 1000, None).ttft_ms;
    let fresh = at(now);
    assert!(fresh > 1200.0 && fresh < 3020.0, "{fresh}");
    let later = at(now + Duration::from_secs(120));
    let fleet = m
        .predict(
            &st,
            now,
            &cand_at("x", "10.9.9.9:1", gauges(0.0, 0.0), false, &[]),
            1000,
            None,
        )
        .ttft_ms;
    assert!(
        (later - fleet).abs() < 1.0,
        "relaxed {later} vs fleet {fleet}"
    );
}

#[test]
fn garbage_samples_cannot_break_the_model() {
    let m = model(true);
    let p = Prediction::default();
    for (ttft, e2e) in [
        (Some(f64::NAN), 10.0),
        (Some(1e300), 10.0),
        (Some(-5.0), 10.0),
        (Some(5.0), f64::INFINITY),
        (Some(5.0), -1.0),
    ] {
        m.observed(&Observation {
            pod: "p",
            ttft_ms: ttft,
            e2e_ms: e2e,
            prompt_tokens: Some(u64::MAX),
            cached_tokens: Some(0),
            output_tokens: None,
            predicted: Some(p),
        });
    }
    let v = m.view();
    for l in std::iter::once(&v.fleet).chain(v.pods.iter().map(|(_, l)| l)) {
        let f = l.fit;
        assert!(
            f.base_ms.is_finite() && (0.0..=10_000.0).contains(&f.base_ms),
            "{f:?}"
        );
        assert!((0.01..=100.0).contains(&f.ms_per_token), "{f:?}");
        assert!(
            f.ms_per_running.is_finite() && f.ms_per_running >= 0.0,
            "{f:?}"
        );
    }
}

#[test]
fn saturated_samples_teach_service_time_not_speed() {
    let m = model(true);
    for _ in 0..50 {
        m.observed(&Observation {
            pod: "p",
            ttft_ms: Some(5_000.0),
            e2e_ms: 5_300.0,
            prompt_tokens: Some(100),
            cached_tokens: Some(0),
            output_tokens: None,
            predicted: Some(Prediction {
                queue_ms: 4_000.0,
                ..Prediction::default()
            }),
        });
    }
    let v = m.view();
    assert_eq!(
        v.fleet.fit.ms_per_token, 1.0,
        "queued samples leave the fit at the prior"
    );
    assert!((v.pods[0].1.service_ms.unwrap() - 1_300.0).abs() < 1e-6);
}

#[test]
fn prediction_codec() {
    let p = Prediction {
        ttft_ms: 1.25,
        queue_ms: 0.5,
        others_ms: 9.0,
        uncached_tokens: 7,
        queued_tokens: 0,
        running: 3,
    };
    // One decimal: 1.25 → "1.2" (round half to even) is fine for learning.
    let d = Prediction::decode(&p.encode()).unwrap();
    assert_eq!((d.uncached_tokens, d.running), (7, 3));
    assert!((d.ttft_ms - 1.25).abs() <= 0.051);
    assert_eq!(
        d.others_ms, 0.0,
        "the eviction estimate is the router's own"
    );
    assert_eq!(Prediction::decode(""), None);
    assert_eq!(Prediction::decode("1,2,3,4,x"), None);
    assert_eq!(Prediction::decode("1,2,3,4,99999999999999999"), None);
}

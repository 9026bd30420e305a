//! End to end through Envoy: premium requests that arrive *with* a best-effort burst at twice the
//! pool's capacity (`chaos::burst`, the `epp-bench burst` scenario: 10 premium requests, then 128
//! best-effort ones with a premium one after every fifth, all fired in the same instant, on 4 pods
//! × 16 slots) keep close to their latency without the burst under the shipped flow-control example
//! — the demand reserve keeps the slots they are about to need — and without flow control they
//! wait a whole service time behind the burst. Latencies are the client's, send to last byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chaos::burst::{Class, Options, Row, measure};

fn report(r: &Row) -> String {
    format!(
        "flow control {}: premium p95 {:.0} ms alone, {:.0} ms with the burst ({:.2}×); best-effort served {} of {}; errors {:?}; unanswered {}",
        r.flow_control,
        r.premium_alone.p95_ms,
        r.premium.p95_ms,
        r.ratio,
        r.best_effort.served,
        r.n,
        r.errors,
        r.unanswered
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn premium_arriving_with_a_burst_at_twice_the_capacity_keeps_its_latency() {
    let o = Options {
        n: 2 * 4 * 16,
        ..Options::default()
    };
    let with = measure(&o, true).await.unwrap();
    let without = measure(&o, false).await.unwrap();
    eprintln!("{}\n{}", report(&with), report(&without));

    for r in [&with, &without] {
        assert_eq!(r.unanswered, 0, "{}", report(r));
        let premium = r.outcomes.iter().filter(|x| x.class == Class::Premium);
        assert!(
            premium.clone().all(|x| x.status == Some(200)),
            "a premium request failed: {}",
            report(r)
        );
        // Every best-effort request was served or refused with a reason.
        for x in r.outcomes.iter().filter(|x| x.class == Class::BestEffort) {
            assert!(
                x.status == Some(200) || x.dropped_reason.is_some(),
                "best-effort request {} got {:?} without a reason",
                x.index,
                x.status
            );
        }
    }
    // The burst really stresses premium: without flow control it waits behind best-effort, a
    // whole service time (~170 ms) and more.
    assert!(without.ratio >= 1.8, "{}", report(&without));
    // With it, premium waits for no best-effort request: what remains is the time the EPP, Envoy
    // and the pods (a debug build here, on the same two cores as the client) take to get through
    // the burst's requests — 1.30× in the run that set this bound, 1.06–1.09× with a release
    // build (docs/benchmarks.md, "Burst protection").
    assert!(with.ratio <= 1.5, "{}", report(&with));
}

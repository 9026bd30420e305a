//! The tenant quota check on the request's fast path: `Quotas::admit` (identify excluded) and
//! `Quotas::settle` through the shell — the lock, the pure book, the metrics — for 1000 tenants
//! with token, request and concurrency limits, 64 requests of each in flight. Every call is timed
//! on its own, so the report is a latency distribution (p50 / p99 / max), not criterion's mean.
//!
//! `cargo bench -p node --bench quota` (goal: admit p99 ≤ 5 µs).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use node::metrics::Metrics;
use node::request::quota::{Quotas, Reported};
use node::request::tenant::{Tenants, hash_key};

const TENANTS: usize = 1000;
const IN_FLIGHT: usize = 64;
const ROUNDS: usize = 200_000;

fn tenants() -> Tenants {
    let mut yaml = String::new();
    for i in 0..TENANTS {
        yaml.push_str(&format!(
            "---\napiVersion: epp.dev/v1alpha1\nkind: TenantQuota\nmetadata: {{name: t{i}}}\nspec:\n  apiKeys: [{{sha256: {}}}]\n  limits:\n  - {{model: '*', requestsPerMinute: 100000000, tokensPerMinute: 100000000000, concurrency: 1000, defaultMaxTokens: 256, maxTokensCap: 4096}}\n",
            hash_key(&format!("key-{i}"))
        ));
    }
    Tenants::from_yaml(&yaml).expect("tenants")
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize] as f64 / 1000.0
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this once, short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = if quick { 2_000 } else { ROUNDS };
    let q = Quotas::standalone(tenants(), None, Arc::new(Metrics::new("bench"))).expect("quotas");
    let all: Vec<_> = q.tenants().iter().cloned().collect();
    let mut keys: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    let (mut admit, mut settle) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for i in 0..rounds {
        let t = &all[i.wrapping_mul(7919) % TENANTS];
        let key = format!("{:032x}", i);
        let t0 = Instant::now();
        let r = futures::executor::block_on(q.admit(&key, t, "model-a", 4096, Some(256)));
        admit.push(t0.elapsed().as_nanos() as u64);
        assert!(r.is_ok());
        keys.push_back(key);
        if keys.len() > IN_FLIGHT * 8 {
            let k = keys.pop_front().expect("a key");
            let c = Reported {
                input: Some(4096),
                output: Some(100),
                cached: 2048,
                events: 0,
                ended: true,
            };
            let t0 = Instant::now();
            q.settle(&k, c);
            settle.push(t0.elapsed().as_nanos() as u64);
        }
    }
    for (name, v) in [("admit", &mut admit), ("settle", &mut settle)] {
        v.sort_unstable();
        println!(
            "quota {name}: {} calls, p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs, max {:.2} µs",
            v.len(),
            percentile(v, 0.5),
            percentile(v, 0.99),
            percentile(v, 0.999),
            percentile(v, 1.0)
        );
    }
}

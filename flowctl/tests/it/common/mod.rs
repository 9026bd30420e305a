//! Shared builders for the integration tests.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod cluster;

use flowctl::{
    BandConfig, BandSettings, Command, ConcurrencyDetector, ControllerConfig, EndpointSnapshot,
    EnqueueRequest, FairnessPolicy, FlowKey, Nanos, OrderingPolicy, Outcome, SaturationDetector,
};

pub const MS: Nanos = 1_000_000;
pub const SEC: Nanos = 1_000_000_000;

pub fn band(priority: i32, fairness: FairnessPolicy, ordering: OrderingPolicy) -> BandConfig {
    BandConfig {
        priority,
        settings: BandSettings {
            fairness,
            ordering,
            ..BandSettings::default()
        },
    }
}

/// A concurrency-detector config: `slots` requests per endpoint.
pub fn slots_config(slots: u64, bands: Vec<BandConfig>) -> ControllerConfig {
    ControllerConfig {
        bands,
        detector: SaturationDetector::Concurrency(ConcurrencyDetector {
            max_concurrency: slots,
            ..ConcurrencyDetector::default()
        }),
        ..ControllerConfig::default()
    }
}

pub fn one_endpoint() -> Command {
    Command::ObservePool {
        endpoints: vec![EndpointSnapshot::default()],
    }
}

pub fn enq(id: u64, fairness: &str, priority: i32) -> Command {
    Command::Enqueue(EnqueueRequest {
        id,
        flow: FlowKey::new(fairness, priority),
        bytes: 100,
        tokens: 10,
        ttl: None,
        slo_ttft: None,
    })
}

pub fn enq_with(
    id: u64,
    fairness: &str,
    priority: i32,
    tokens: u64,
    ttl: Option<Nanos>,
) -> Command {
    Command::Enqueue(EnqueueRequest {
        id,
        flow: FlowKey::new(fairness, priority),
        bytes: 100,
        tokens,
        ttl,
        slo_ttft: None,
    })
}

pub fn complete(id: u64) -> Command {
    Command::Complete {
        id,
        actual_tokens: None,
    }
}

/// The ids an `apply` dispatched, in order.
pub fn dispatched(out: &[Outcome]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Outcome::Dispatched { id } => Some(*id),
            _ => None,
        })
        .collect()
}

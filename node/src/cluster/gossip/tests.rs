//! The gossip's wire format, its guards against peers, and the outbox.

use super::fanout::{sample_from_pb, sample_to_pb};
use super::wire::from_pb;
use super::*;
use crate::datalayer::EndpointMetrics;

fn state(name: &str, epoch: u64, entries: &[(u64, u64)]) -> PodState {
    PodState {
        name: name.into(),
        epoch,
        entries: entries.to_vec(),
    }
}

#[test]
fn outbox_coalesces_per_pod_and_hash_and_overflows() {
    let o = Outbox::new(4);
    o.push(state("a", 1, &[(1, 10), (2, 10)]));
    o.push(state("a", 1, &[(1, 12)]));
    o.push(state("b", 0, &[(7, 3)]));
    let (mut pods, overflowed) = o.take();
    assert!(!overflowed);
    pods.sort_by(|x, y| x.name.cmp(&y.name));
    let mut a = pods[0].entries.clone();
    a.sort();
    assert_eq!(a, vec![(1, 12), (2, 10)]);
    assert_eq!(pods[1], state("b", 0, &[(7, 3)]));
    // a newer epoch replaces the pod's queued entries; an older one is ignored
    o.push(state("a", 1, &[(1, 1), (2, 1)]));
    o.push(state("a", 2, &[(3, 5)]));
    o.push(state("a", 1, &[(4, 9)]));
    let (pods, _) = o.take();
    assert_eq!(pods, vec![state("a", 2, &[(3, 5)])]);
    // past the bound: dropped and reported once
    o.push(state("a", 0, &[(1, 1), (2, 1), (3, 1)]));
    o.push(state("a", 0, &[(4, 1), (5, 1)]));
    let (pods, overflowed) = o.take();
    assert!(overflowed);
    assert_eq!(pods[0].entries.len(), 3);
    assert!(!o.take().1);
}

#[test]
fn malformed_deltas_are_rejected() {
    let bad = pb::PodDelta {
        pod: "a".into(),
        epoch: 0,
        hashes: vec![1, 2],
        ts_deltas: vec![1],
    };
    assert_eq!(
        from_pb(bad).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let unnamed = pb::PodDelta::default();
    assert!(from_pb(unnamed).is_err());
    let overflow = pb::PodDelta {
        pod: "a".into(),
        epoch: 0,
        hashes: vec![1, 2],
        ts_deltas: vec![u64::MAX, 1],
    };
    assert!(from_pb(overflow).is_err());
    // entries travel sorted by time, times as differences
    let wire = to_pb(state("p", 3, &[(9, 7), (1, 2), (3, 7), (5, 2)]));
    assert_eq!(wire.hashes, vec![1, 5, 3, 9]);
    assert_eq!(wire.ts_deltas, vec![2, 0, 5, 0]);
    let round = from_pb(wire).unwrap();
    assert_eq!(round, state("p", 3, &[(1, 2), (5, 2), (3, 7), (9, 7)]));
}

#[test]
fn samples_round_trip_and_garbage_is_contained() {
    let m = EndpointMetrics {
        waiting_queue_size: Some(3.0),
        kv_cache_usage: Some(0.5),
        block_size: Some(16),
        active_models: vec!["a".into()],
        started_ms: Some(7),
        ..EndpointMetrics::default()
    };
    assert_eq!(sample_from_pb(sample_to_pb("p".into(), m.clone(), 1)), m);
    let bad = pb::Sample {
        waiting_queue_size: Some(f64::NAN),
        kv_cache_usage: Some(7.0),
        ..pb::Sample::default()
    };
    let got = sample_from_pb(bad);
    assert_eq!(got.waiting_queue_size, None);
    assert_eq!(got.kv_cache_usage, Some(1.0));
}

#[test]
fn peers_cannot_index_unknown_pods_or_stamp_the_future() {
    use crate::datalayer::Endpoint;
    use crate::scheduling::prefix::ProducerParams;
    let store = Arc::new(Datastore::new(Duration::from_secs(1)));
    store.replace(vec![Arc::new(Endpoint::new(
        "a".into(),
        "10.0.0.1:8000".parse().unwrap(),
        Default::default(),
    ))]);
    let producer = Arc::new(ApproxPrefixProducer::new(ProducerParams::default()));
    let metrics = Arc::new(Metrics::new("pool"));
    let g = Gossip::new(
        1,
        Some(producer.clone()),
        None,
        store,
        GossipOptions::default(),
        metrics.clone(),
    );
    let now = unix_us();
    let pod = "10.0.0.1:8000".to_string();
    let deltas = vec![
        to_pb(state(&pod, 0, &[(1, now), (2, u64::MAX - 1)])),
        to_pb(state("attacker.example:1", 0, &[(3, now)])),
    ];
    g.merge("", deltas, 0, false).unwrap();
    let held = producer.export(&[pod.clone(), "attacker.example:1".into()]);
    assert_eq!(held, vec![state(&pod, 0, &[(1, now)])]);
    // A far-future incarnation would pin the pod: refused, the pod keeps its entries.
    let pinned = vec![to_pb(state(&pod, u64::MAX, &[(4, now)]))];
    g.merge(PREFIX_SPACE, pinned, 0, false).unwrap();
    assert_eq!(producer.export(std::slice::from_ref(&pod))[0].epoch, 0);
    // The clock was not dragged along: the next local insert is stamped about now.
    let c = crate::datalayer::testutil::cand_at("a", &pod, None, false, &[]);
    producer.record(&[9], 16, std::iter::once(&c));
    let ts = producer.export(std::slice::from_ref(&pod))[0]
        .entries
        .iter()
        .map(|e| e.1)
        .max()
        .unwrap();
    assert!(ts < now + 60_000_000, "clock pinned at {ts}");
    // The digests of an unknown pod are neither wanted nor answered.
    let reply = g
        .answer(
            PREFIX_SPACE,
            vec![pb::PodDigest {
                pod: "attacker.example:1".into(),
                epoch: 0,
                len: 5,
                digest: 1,
            }],
        )
        .unwrap();
    assert!(reply.wanted.is_empty());
    let text = metrics.encode();
    for field in ["pod", "timestamp", "epoch"] {
        let line = format!(
            "llm_d_epp_untrusted_values_rejected_total{{source=\"peer\",field=\"{field}\"}} 1"
        );
        assert!(text.contains(&line), "{line} missing");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 512,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Whatever bytes arrive on the peer port decode to an error or to states that are
    /// bounded before they touch the index; samples are bounded before they are applied.
    #[test]
    fn peer_messages_of_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        if let Ok(d) = pb::Deltas::decode(bytes.as_slice())
            && let Ok(states) = from_pb_all(d.pods)
        {
            for s in states {
                let _ = s.max_ts();
            }
        }
        if let Ok(r) = pb::SyncReply::decode(bytes.as_slice()) {
            let _ = from_pb_all(r.pods);
        }
        if let Ok(b) = pb::SampleBatch::decode(bytes.as_slice()) {
            for s in b.samples {
                let mut m = sample_from_pb(s);
                m.sanitize(1_800_000_000_000);
                proptest::prop_assert!(m.kv_cache_usage.is_none_or(|v| (0.0..=1.0).contains(&v)));
            }
        }
        let _ = pb::SettleBatch::decode(bytes.as_slice());
    }

    /// Deltas survive the wire format, whatever their (time-sorted) contents.
    #[test]
    fn deltas_round_trip(
        epoch in proptest::prelude::any::<u64>(),
        entries in proptest::collection::vec((proptest::prelude::any::<u64>(), proptest::prelude::any::<u64>()), 0..64),
    ) {
        let mut st = state("p", epoch, &entries);
        st.normalize();
        let mut back = from_pb(to_pb(st.clone())).unwrap();
        back.normalize();
        proptest::prop_assert_eq!(back, st);
    }
}

#[test]
fn chunks_respect_the_entry_bound() {
    let states = vec![
        state("a", 0, &[(1, 1), (2, 1)]),
        state("b", 0, &[(1, 1), (2, 1), (3, 1)]),
        state("c", 0, &[(1, 1)]),
    ];
    let parts = chunk(states, 3);
    let names: Vec<Vec<&str>> = parts
        .iter()
        .map(|p| p.iter().map(|s| s.name.as_str()).collect())
        .collect();
    assert_eq!(names, vec![vec!["a"], vec!["b"], vec!["c"]]);
    assert!(chunk(Vec::new(), 3).is_empty());
}

/// Only members gossip: a message from a node id outside the membership is refused (counted),
/// whatever its certificate — the CA may have signed one for a node that left, or for a test
/// cluster — and accepted once that node is a member.
#[tokio::test]
async fn gossip_from_a_non_member_is_refused() {
    let store = Arc::new(Datastore::new(Duration::from_secs(1)));
    let metrics = Arc::new(Metrics::new("pool"));
    let responses = Arc::new(crate::datalayer::responses::ResponseBindings::new(
        Duration::from_secs(60),
        16,
    ));
    let g = Gossip::new(
        1,
        None,
        Some(responses),
        store,
        GossipOptions::default(),
        metrics.clone(),
    );
    let svc = GossipService(g.clone(), None);
    let push = |from: u64| {
        tonic::Request::new(pb::Deltas {
            from,
            space: RESPONSES_SPACE.into(),
            ..Default::default()
        })
    };
    let err = svc.push(push(9)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    assert!(
        metrics.encode().contains("gossip"),
        "the refusal is counted: {}",
        metrics.encode()
    );
    g.expect_members([9]);
    svc.push(push(9)).await.unwrap();
}

//! The EPP's KV-event subscriber against the simulator's publisher (its real PUB and replay
//! ROUTER sockets): a new subscription replays what came before, evictions and restarts reach
//! the index, and a pod without a replay socket is followed from where it joined.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use index::precise::chain_full_blocks;
use node::datalayer::kvevents::{Subscriber, Target};
use node::metrics::Metrics;
use node::scheduling::precise::{PreciseParams, PrecisePrefixProducer, root};
use sim::kvevents::{Command, KvEvent, Publisher};
use sim::{Encoding, KvEventsConfig};

const BS: usize = 4;

/// Batch `i`: one block of 4 tokens chained from batch `i - 1`'s (engine hash `100 + i`).
fn stored(i: u64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: vec![100 + i],
        parent_block_hash: i.checked_sub(1).map(|p| 100 + p),
        token_ids: tokens_of(i),
        block_size: BS,
        lora_id: None,
        lora_name: None,
        cache_salt: None,
    }
}

fn tokens_of(i: u64) -> Vec<u32> {
    (0..BS as u32).map(|t| i as u32 * 10 + t).collect()
}

/// Our keys of the chain of batches `0..n`.
fn keys(n: u64) -> Vec<u64> {
    let tokens: Vec<u32> = (0..n).flat_map(tokens_of).collect();
    let mut out = Vec::new();
    chain_full_blocks(root("m"), &tokens, BS, &mut out);
    out
}

fn wait(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn held(p: &PrecisePrefixProducer, pod: &str) -> Vec<u64> {
    let ix = p.read();
    ix.pod_id(pod)
        .map(|id| ix.held_keys(id))
        .unwrap_or_default()
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

fn publisher(encoding: Encoding) -> Publisher {
    let cfg = KvEventsConfig {
        encoding,
        ..KvEventsConfig::default()
    };
    Publisher::start(
        &cfg,
        "127.0.0.1".parse().unwrap(),
        vec!["kv@pod@m".to_string()],
    )
    .unwrap()
}

/// A subscriber feeding a fresh index (centralized mode: binding `central`), and its metrics.
fn subscriber(central: Option<&str>) -> (Arc<PrecisePrefixProducer>, Subscriber, Arc<Metrics>) {
    let producer = Arc::new(PrecisePrefixProducer::new(PreciseParams::default()));
    let metrics = Arc::new(Metrics::new("p"));
    let sub = Subscriber::start(
        producer.clone(),
        "kv@".into(),
        None,
        metrics.clone(),
        central,
    )
    .unwrap();
    (producer, sub, metrics)
}

/// A subscriber (per-pod sockets) following the sim publisher's pod 0, with its replay socket.
fn follow_pod0(publisher: &Publisher) -> (Arc<PrecisePrefixProducer>, Subscriber) {
    let (producer, sub, _) = subscriber(None);
    let ep = &publisher.endpoints[0];
    sub.set_targets(vec![Target {
        pod: "pod".into(),
        endpoint: ep.publisher.clone(),
        replay: Some(ep.replay.clone()),
        shared: false,
    }]);
    (producer, sub)
}

#[test]
fn a_late_subscriber_replays_the_past_then_follows_evictions_and_restarts() {
    for encoding in [Encoding::Map, Encoding::Array] {
        let publisher = publisher(encoding);
        let tx = publisher.sender().unwrap();
        let send = |events: Vec<KvEvent>| tx.send(Command::Publish { pod: 0, events }).unwrap();
        // Five batches before anyone listens.
        for i in 0..5 {
            send(vec![stored(i)]);
        }
        let (producer, sub) = follow_pod0(&publisher);
        // Keep publishing until the subscriber has the whole stream: on subscribing it replays
        // the past from 0, holding what arrives live meanwhile.
        let mut n = 5;
        wait("the subscriber to catch up", || {
            send(vec![stored(n)]);
            n += 1;
            std::thread::sleep(Duration::from_millis(20));
            held(&producer, "pod") == sorted(keys(n))
        });
        // (The status is published every 250 ms.)
        wait("the status", || sub.status()["pod"].last_seq == Some(n - 1));
        let st = sub.status()["pod"].clone();
        assert!(st.replayed >= 5, "{st:?}");
        assert_eq!(st.resyncs, 0, "{st:?}");
        // The engine evicts the first block: the prefix run is gone for every request.
        send(vec![KvEvent::BlockRemoved {
            block_hashes: vec![100],
        }]);
        wait("the eviction", || {
            held(&producer, "pod").len() as u64 == n - 1
        });
        // The engine restarts: sequence back to 0, cache empty, one new block.
        tx.send(Command::Reset { pod: 0 }).unwrap();
        send(vec![stored(0)]);
        wait("the restart", || held(&producer, "pod") == keys(1));
        wait("the restart's status", || sub.status()["pod"].restarts == 1);
        // Unsubscribed (another replica owns the pod now): what it holds stays, as a mirror the
        // owner's gossip maintains; the subscription is gone.
        sub.set_targets(vec![]);
        wait("the unsubscription", || sub.status().is_empty());
        assert_eq!(held(&producer, "pod"), keys(1));
    }
}

#[test]
fn without_a_replay_socket_a_gap_resyncs_the_pod() {
    let publisher = publisher(Encoding::Map);
    let tx = publisher.sender().unwrap();
    let send = |events: Vec<KvEvent>| tx.send(Command::Publish { pod: 0, events }).unwrap();
    send(vec![stored(0)]);
    let (producer, sub, _) = subscriber(None);
    sub.set_targets(vec![Target {
        pod: "pod".into(),
        endpoint: publisher.endpoints[0].publisher.clone(),
        replay: None,
        shared: false,
    }]);
    // Joined mid-stream without replay: what came before is unknown, so a block whose parent it
    // never saw is an orphan; a root block (no parent) is indexed.
    let mut n = 1;
    wait("the live stream", || {
        send(vec![stored(n)]);
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
        sub.status().get("pod").is_some_and(|s| s.applied > 0)
    });
    send(vec![KvEvent::BlockStored {
        block_hashes: vec![7],
        parent_block_hash: None,
        token_ids: tokens_of(0),
        block_size: BS,
        lora_id: None,
        lora_name: None,
        cache_salt: None,
    }]);
    wait("the root block", || held(&producer, "pod") == keys(1));
    wait("the status", || sub.status()["pod"].blocks == 1);
    let st = sub.status()["pod"].clone();
    assert!(st.gaps >= 1, "{st:?}");
    assert_eq!(st.replayed, 0, "{st:?}");
}

#[test]
fn garbage_and_absurd_sequence_numbers_are_counted_and_survived() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let (producer, sub, metrics) = subscriber(None);
    sub.set_targets(vec![Target {
        pod: "pod".into(),
        endpoint,
        replay: None,
        shared: false,
    }]);
    let batch = |i: u64| sim::kvevents::encode_batch(0.0, &[stored(i)], Encoding::Map);
    let topic: &[u8] = b"kv@pod@m";
    // Until the subscription is up, then the garbage, then a root block that must be indexed.
    let mut n = 0u64;
    wait("the subscription", || {
        let seq = n.to_be_bytes();
        publisher
            .send_multipart([topic, &seq[..], &batch(0)[..]], 0)
            .unwrap();
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
        sub.status().get("pod").is_some_and(|s| s.applied > 0)
    });
    let garbage: Vec<Vec<Vec<u8>>> = vec![
        vec![topic.to_vec()],                          // one frame
        vec![topic.to_vec(), vec![1, 2, 3], batch(0)], // a 3-byte sequence
        vec![
            topic.to_vec(),
            (n + 1).to_be_bytes().to_vec(),
            vec![0xc1, 0xff, 0x00],
        ], // not msgpack
        vec![topic.to_vec(), u64::MAX.to_be_bytes().to_vec(), batch(0)], // the end of time
        vec![topic.to_vec(), u64::MAX.to_be_bytes().to_vec(), batch(0)], // and again
        vec![
            topic.to_vec(),
            0u64.to_be_bytes().to_vec(),
            vec![0x93, 0xcb],
        ], // truncated
        vec![
            b"not a topic".to_vec(),
            1u64.to_be_bytes().to_vec(),
            batch(0),
        ],
    ];
    for frames in &garbage {
        publisher.send_multipart(frames, 0).unwrap();
    }
    // The thread lives on: a fresh root block is indexed.
    publisher
        .send_multipart([topic, &2u64.to_be_bytes()[..], &batch(0)[..]], 0)
        .unwrap();
    wait("the block after the garbage", || {
        held(&producer, "pod") == keys(1)
            && metrics
                .encode()
                .contains("llm_d_epp_kv_events_messages_total{pod=\"pod\",outcome=\"garbage\"}")
    });
    // One frame, a 3-byte sequence, a payload that is not msgpack, a truncated one.
    wait("the garbage counted in the status", || {
        sub.status()["pod"].garbage >= 4
    });
    let st = sub.status()["pod"].clone();
    assert!(
        st.restarts >= 1,
        "a sequence going back is a restart: {st:?}"
    );
}

/// llm-d's centralized mode: the subscriber binds one socket and the pods' publishers connect to
/// it (`discoverPods: false`); each topic's stream is followed on its own — replayed from its
/// pod's replay socket, evicted, restarted — and a pod outside the targets is counted, not indexed.
#[test]
fn centralized_mode_follows_every_pod_through_one_bound_socket() {
    let (producer, sub, metrics) = subscriber(Some("tcp://127.0.0.1:*"));
    let central = sub.central_endpoint().unwrap().to_string();
    assert!(central.starts_with("tcp://127.0.0.1:"), "{central}");
    let cfg = KvEventsConfig {
        connect: Some(central.clone()),
        ..KvEventsConfig::default()
    };
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.9:8000"];
    let publisher = Publisher::start(
        &cfg,
        "127.0.0.1".parse().unwrap(),
        pods.iter().map(|p| format!("kv@{p}@m")).collect(),
    )
    .unwrap();
    let tx = publisher.sender().unwrap();
    let send =
        |pod: usize, events: Vec<KvEvent>| tx.send(Command::Publish { pod, events }).unwrap();
    // Pod 0 published three batches before the subscriber follows it: replayed.
    for i in 0..3 {
        send(0, vec![stored(i)]);
    }
    // The third pod is not in the pool.
    sub.set_targets(
        pods[..2]
            .iter()
            .zip(&publisher.endpoints)
            .map(|(pod, ep)| Target {
                pod: pod.to_string(),
                endpoint: central.clone(),
                replay: Some(ep.replay.clone()),
                shared: true,
            })
            .collect(),
    );
    let (mut n0, mut n1) = (3, 0);
    // Until both are followed live (a connecting publisher's first messages are lost until its
    // connection is up; the replays fill that in).
    wait("both streams", || {
        send(0, vec![stored(n0)]);
        send(1, vec![stored(n1)]);
        send(2, vec![stored(0)]);
        n0 += 1;
        n1 += 1;
        std::thread::sleep(Duration::from_millis(20));
        let live = |pod: &str| sub.status().get(pod).is_some_and(|s| s.applied > 0);
        held(&producer, pods[0]) == sorted(keys(n0))
            && held(&producer, pods[1]) == sorted(keys(n1))
            && live(pods[0])
            && live(pods[1])
    });
    assert!(held(&producer, pods[2]).is_empty());
    wait("the status", || {
        let st = sub.status();
        st.len() == 2
            && st[pods[0]].last_seq == Some(n0 - 1)
            && st[pods[1]].last_seq == Some(n1 - 1)
    });
    assert!(sub.status()[pods[0]].replayed >= 3, "{:?}", sub.status());
    // Pod 1 evicts its first block; pod 0 restarts: each stream on its own.
    send(
        1,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![100],
        }],
    );
    tx.send(Command::Reset { pod: 0 }).unwrap();
    send(0, vec![stored(0)]);
    wait("the eviction", || {
        held(&producer, pods[1]).len() as u64 == n1 - 1
    });
    wait("the restart", || held(&producer, pods[0]) == keys(1));
    wait("the restart's status", || {
        sub.status()[pods[0]].restarts == 1
    });
    assert_eq!(sub.status()[pods[1]].restarts, 0);
    wait("the outside pod's messages counted", || {
        metrics
            .encode()
            .contains("llm_d_epp_kv_events_messages_total{pod=\"\",outcome=\"unknown\"}")
    });
}

/// A publisher that restarts after the subscriber replayed its past but before any live message
/// reached it: the new stream's first batches reuse sequence numbers the replay applied, and are
/// told apart from late duplicates by their content — the pod's old blocks are dropped, the new
/// ones indexed.
#[test]
fn a_restart_before_the_first_live_message_is_not_taken_for_duplicates() {
    let publisher = publisher(Encoding::Map);
    let tx = publisher.sender().unwrap();
    let send = |events: Vec<KvEvent>| tx.send(Command::Publish { pod: 0, events }).unwrap();
    for i in 0..4 {
        send(vec![stored(i)]);
    }
    let (producer, sub) = follow_pod0(&publisher);
    // The past, from the replay alone (nothing published live yet).
    wait("the replay", || held(&producer, "pod") == sorted(keys(4)));
    // The engine restarts and stores another chain (engine hashes 200.., other tokens).
    tx.send(Command::Reset { pod: 0 }).unwrap();
    let other = |i: u64| KvEvent::BlockStored {
        block_hashes: vec![200 + i],
        parent_block_hash: i.checked_sub(1).map(|p| 200 + p),
        token_ids: (0..BS as u32).map(|t| 1000 + i as u32 * 10 + t).collect(),
        block_size: BS,
        lora_id: None,
        lora_name: None,
        cache_salt: None,
    };
    let want = |n: u64| {
        let tokens: Vec<u32> = (0..n)
            .flat_map(|i| (0..BS as u32).map(move |t| 1000 + i as u32 * 10 + t))
            .collect();
        let mut out = Vec::new();
        chain_full_blocks(root("m"), &tokens, BS, &mut out);
        sorted(out)
    };
    let mut n = 0;
    wait("the new chain alone", || {
        send(vec![other(n)]);
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
        held(&producer, "pod") == want(n)
    });
    wait("the restart's status", || sub.status()["pod"].restarts == 1);
}

/// Centralized mode in a cluster, at the subscriber: replica A binds the socket both pods
/// publish to but owns only pod 0; pod 1's owner is replica B. A applies pod 0's messages and
/// hands every message to its forwarding queue (the peer exchange sends each to the pod's other
/// owners); what B is handed for pod 1 (`inject`) it follows as its own stream — replaying the
/// past from the pod, then live.
#[test]
fn centralized_mode_forwards_what_other_replicas_own() {
    let start = || {
        let (producer, sub, _) = subscriber(Some("tcp://127.0.0.1:*"));
        (producer, sub)
    };
    let ((pa, a), (pb, b)) = (start(), start());
    let central = a.central_endpoint().unwrap().to_string();
    let cfg = KvEventsConfig {
        connect: Some(central.clone()),
        ..KvEventsConfig::default()
    };
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000"];
    let publisher = Publisher::start(
        &cfg,
        "127.0.0.1".parse().unwrap(),
        pods.iter().map(|p| format!("kv@{p}@m")).collect(),
    )
    .unwrap();
    let target = |i: usize, endpoint: &str| Target {
        pod: pods[i].to_string(),
        endpoint: endpoint.to_string(),
        replay: Some(publisher.endpoints[i].replay.clone()),
        shared: true,
    };
    let (fwd_tx, mut fwd_rx) = tokio::sync::mpsc::channel(1024);
    a.forward_to(fwd_tx);
    a.set_targets(vec![target(0, &central)]);
    a.forward_foreign(vec![pods[1].to_string()]);
    b.set_targets(vec![target(1, b.central_endpoint().unwrap())]);
    let tx = publisher.sender().unwrap();
    let send =
        |pod: usize, events: Vec<KvEvent>| tx.send(Command::Publish { pod, events }).unwrap();
    send(1, vec![stored(0)]); // before anyone follows pod 1: B's replay brings it
    let (mut n0, mut n1) = (0, 1);
    let mut forwarded = [0, 0];
    wait("both streams, pod 1's through the forwarding", || {
        send(0, vec![stored(n0)]);
        send(1, vec![stored(n1)]);
        n0 += 1;
        n1 += 1;
        std::thread::sleep(Duration::from_millis(20));
        while let Ok(f) = fwd_rx.try_recv() {
            let i = pods.iter().position(|p| *p == f.pod).unwrap();
            forwarded[i] += 1;
            if i == 1 {
                assert!(b.inject(&f));
            }
        }
        held(&pa, pods[0]) == sorted(keys(n0))
            && held(&pb, pods[1]) == sorted(keys(n1))
            && b.status().get(pods[1]).is_some_and(|s| s.applied > 0)
    });
    assert!(held(&pa, pods[1]).is_empty(), "A only forwards pod 1");
    assert!(held(&pb, pods[0]).is_empty());
    assert!(
        forwarded[0] > 0 && forwarded[1] > 0,
        "every message goes to the queue: {forwarded:?}"
    );
    // A message for a pod B does not follow is not taken.
    let stray = node::datalayer::kvevents::Forwarded {
        pod: "10.0.0.7:8000".into(),
        seq: 0,
        topic: b"kv@10.0.0.7:8000@m".to_vec(),
        payload: vec![0x90],
    };
    assert!(b.inject(&stray));
    std::thread::sleep(Duration::from_millis(100));
    assert!(!pb.pods().contains(&stray.pod));
    drop(publisher);
}

/// Centralized mode's bound socket takes connections from anyone who can reach it: a message over
/// the size bound (here 9 MiB from a rogue publisher) is refused by ZMQ before it is buffered —
/// nothing of it reaches the subscriber, which goes on taking the others' messages.
#[test]
fn the_central_socket_refuses_oversize_messages() {
    let (_producer, sub, metrics) = subscriber(Some("tcp://127.0.0.1:*"));
    let central = sub.central_endpoint().unwrap().to_string();
    let ctx = zmq::Context::new();
    let publisher = |topic: &'static str| {
        let s = ctx.socket(zmq::PUB).unwrap();
        s.connect(&central).unwrap();
        move |payload: &[u8]| {
            s.send_multipart([topic.as_bytes(), &1u64.to_be_bytes(), payload], 0)
                .unwrap()
        }
    };
    let (rogue, small) = (
        publisher("kv@10.9.9.1:8000@m"),
        publisher("kv@10.9.9.2:8000@m"),
    );
    let unknown = || {
        metrics
            .encode()
            .lines()
            .find(|l| {
                l.starts_with("llm_d_epp_kv_events_messages_total{pod=\"\",outcome=\"unknown\"}")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Both connected: messages of a pod outside the targets are counted as `unknown`.
    wait("the small publisher's messages", || {
        small(b"x");
        std::thread::sleep(Duration::from_millis(20));
        unknown() > 0
    });
    std::thread::sleep(Duration::from_millis(300));
    let before = unknown();
    let huge = vec![0u8; 9 << 20];
    for _ in 0..3 {
        rogue(&huge);
    }
    small(b"x");
    wait("the small message after the huge ones", || {
        unknown() > before
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(unknown(), before + 1, "the oversize messages were taken");
    const { assert!(node::datalayer::kvevents::MAX_MESSAGE_BYTES < 9 << 20) };
}

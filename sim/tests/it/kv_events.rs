//! KV-cache events over ZMQ: a test subscriber decodes what a live pod publishes and replays what it
//! missed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sim::cache::block_hashes;
use sim::{Encoding, KvEventsConfig, PodKnobs, Sim, SimConfig};

async fn start(encoding: Encoding, knobs: PodKnobs) -> Sim {
    Sim::start(SimConfig {
        pods: 2,
        knobs,
        kv_events: Some(KvEventsConfig {
            encoding,
            ..KvEventsConfig::default()
        }),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn knobs() -> PodKnobs {
    PodKnobs {
        block_size: 4,
        kv_blocks: 8,
        time_scale: 0.0,
        ..PodKnobs::default()
    }
}

async fn complete(sim: &Sim, pod: usize, ids: &[u32]) {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", sim.pods()[pod].addr))
        .json(&json!({"prompt": ids, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

/// One received message: (topic, seq, decoded payload, raw payload).
type Msg = (String, u64, Value, Vec<u8>);

fn decode(frames: &[Vec<u8>]) -> Msg {
    assert_eq!(frames.len(), 3, "live messages have three frames");
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
    let payload: Value = rmp_serde::from_slice(&frames[2]).unwrap();
    // The EPP's decoder reads the same message.
    let m = index::kvevents::parse_live(frames).unwrap();
    assert_eq!((m.topic, m.seq), (frames[0].as_slice(), seq));
    index::kvevents::decode_batch(m.payload).unwrap();
    (
        String::from_utf8(frames[0].clone()).unwrap(),
        seq,
        payload,
        frames[2].clone(),
    )
}

fn subscriber(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"kv@").unwrap();
    sub.set_rcvtimeo(100).unwrap();
    sub.connect(endpoint).unwrap();
    sub
}

/// Receives until `want(msg)` or the deadline; returns everything received.
fn recv_until(sub: &zmq::Socket, deadline: Duration, want: impl Fn(&Msg) -> bool) -> Vec<Msg> {
    let end = Instant::now() + deadline;
    let mut out = Vec::new();
    while Instant::now() < end {
        if let Ok(frames) = sub.recv_multipart(0) {
            let m = decode(&frames);
            let done = want(&m);
            out.push(m);
            if done {
                return out;
            }
        }
    }
    panic!("condition not met; received {} messages", out.len());
}

/// Replays from `start` through a DEALER; returns the batches and checks the end marker.
fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Vec<Msg> {
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(5000).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(endpoint).unwrap();
    dealer
        .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).expect("replay reply");
        assert_eq!(frames[0], b"", "DEALER sees the empty delimiter first");
        // The EPP's decoder reads the reply as the DEALER hands it over.
        let parsed = index::kvevents::parse_replay(&frames).unwrap();
        assert_eq!(
            parsed == index::kvevents::Replay::End,
            frames[2] == [0xff; 8],
            "{frames:?}"
        );
        if let index::kvevents::Replay::Batch(m) = parsed {
            assert_eq!((m.topic, m.payload), (&frames[1][..], &frames[3][..]));
            index::kvevents::decode_batch(m.payload).unwrap();
        }
        if frames[2] == [0xff; 8] {
            assert_eq!(frames[1], b"");
            assert_eq!(frames[3], b"");
            return out;
        }
        out.push(decode(&frames[1..]));
    }
}

/// Applies a batch's events to the subscriber's model of the pod's cache.
fn apply(model: &mut BTreeSet<u64>, batch: &Value) {
    for ev in batch[1].as_array().unwrap() {
        let (kind, hashes) = if ev.is_object() {
            (ev["type"].as_str().unwrap(), &ev["block_hashes"])
        } else {
            (ev[0].as_str().unwrap(), &ev[1])
        };
        let hashes = || {
            hashes
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
        };
        match kind {
            "BlockStored" => model.extend(hashes()),
            "BlockRemoved" => {
                for h in hashes() {
                    assert!(model.remove(&h), "removed a block never stored: {h}");
                }
            }
            "AllBlocksCleared" => model.clear(),
            other => panic!("unknown event {other}"),
        }
    }
}

fn ids(base: u32, n: u32) -> Vec<u32> {
    (base..base + n).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_sees_exactly_the_stored_and_removed_blocks_and_replay_fills_the_gap() {
    let sim = start(Encoding::Map, knobs()).await;
    let kv = sim.kv_endpoints(0).unwrap();
    let addr = sim.pods()[0].addr;
    assert_eq!(kv.topic, format!("kv@127.0.0.1:{}@sim-model", addr.port()));
    assert!(kv.publisher.starts_with("tcp://127.0.0.1:"));
    assert!(sim.kv_endpoints(1).unwrap().publisher != kv.publisher);

    // Batch 0 happens before anyone subscribes: only replay can deliver it.
    let a = ids(1000, 16);
    complete(&sim, 0, &a).await;

    let ctx = zmq::Context::new();
    // The publisher sends a batch, then keeps it for replay (one thread): once replay has batch
    // 0, it went out before the subscriber below existed (the sim publishes asynchronously, so
    // a completed request alone does not say that).
    let deadline = Instant::now() + Duration::from_secs(10);
    while replay(&ctx, &kv.replay, 0).is_empty() {
        assert!(Instant::now() < deadline, "batch 0 never published");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sub = subscriber(&ctx, &kv.publisher);
    // Wait until the subscription is live: probe with fresh single-block prompts until one arrives.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut probe = 50_000;
    let mut live = loop {
        assert!(Instant::now() < deadline, "subscription never became live");
        complete(&sim, 0, &ids(probe, 5)).await;
        probe += 100;
        if let Ok(frames) = sub.recv_multipart(0) {
            break vec![decode(&frames)];
        }
    };
    // Drain probes that were still in flight.
    while let Ok(frames) = sub.recv_multipart(0) {
        live.push(decode(&frames));
    }

    let b = ids(2000, 16);
    complete(&sim, 0, &b).await;
    // Shares a's first two blocks, then diverges.
    let mut c = a[..8].to_vec();
    c.extend(ids(3000, 8));
    complete(&sim, 0, &c).await;
    sim.set_knobs(
        0,
        &sim::KnobsPatch {
            kv_blocks: Some(3),
            ..Default::default()
        },
    )
    .unwrap();

    let all = replay(&ctx, &kv.replay, 0);
    let last = all.last().unwrap().1;
    live.extend(recv_until(&sub, Duration::from_secs(5), |m| m.1 == last));
    // Replay holds every batch from 0, contiguous, identical to what went out live.
    let seqs: Vec<u64> = all.iter().map(|m| m.1).collect();
    assert_eq!(seqs, (0..=last).collect::<Vec<_>>());
    assert!(
        live[0].1 >= 1,
        "batch 0 was published before the subscription"
    );
    for m in &live {
        assert_eq!(m.0, kv.topic);
        assert_eq!(
            m.3, all[m.1 as usize].3,
            "live and replayed payloads differ"
        );
    }
    let live_seqs: Vec<u64> = live.iter().map(|m| m.1).collect();
    assert_eq!(live_seqs, (live[0].1..=last).collect::<Vec<_>>());
    // A partial replay starts where asked.
    assert_eq!(replay(&ctx, &kv.replay, last).len(), 1);

    // Envelope and the first batch, exactly.
    let first = &all[0].2;
    assert!(first[0].as_f64().unwrap() > 1.0e9);
    assert_eq!(first[2], 0);
    let ha = block_hashes(&a, 4);
    assert_eq!(
        first[1],
        json!([{"type": "BlockStored", "block_hashes": ha, "parent_block_hash": null,
                "token_ids": a, "block_size": 4, "lora_id": null, "medium": "GPU",
                "lora_name": null, "group_idx": 0}])
    );
    // c's new blocks chain from a's second block: the event storing them starts at the first
    // block c did not find cached — hc[2] while a's blocks are resident; earlier if the probes
    // above (as many as a slow machine needed) already evicted them.
    let hc = block_hashes(&c, 4);
    let stored_c = all
        .iter()
        .flat_map(|m| m.2[1].as_array().unwrap().clone())
        .find(|e| {
            e["type"] == "BlockStored"
                && e["block_hashes"].as_array().unwrap().last() == Some(&json!(hc[3]))
        })
        .unwrap();
    let k = hc
        .iter()
        .position(|h| json!(h) == stored_c["block_hashes"][0])
        .unwrap();
    assert!(
        k <= 2,
        "a's shared blocks cannot be newer than c's: {stored_c}"
    );
    let parent = if k == 0 {
        json!(null)
    } else {
        json!(hc[k - 1])
    };
    assert_eq!(stored_c["parent_block_hash"], parent);
    assert_eq!(stored_c["block_hashes"], json!(&hc[k..]));
    assert_eq!(stored_c["token_ids"], json!(&c[4 * k..]));

    // Replaying every batch reproduces the pod's cache exactly, evictions included.
    let mut model = BTreeSet::new();
    for m in &all {
        apply(&mut model, &m.2);
    }
    let removed = all
        .iter()
        .flat_map(|m| m.2[1].as_array().unwrap().clone())
        .filter(|e| e["type"] == "BlockRemoved")
        .count();
    assert!(removed >= 5, "capacity overflow must evict, saw {removed}");
    let actual: BTreeSet<u64> = sim.cached_block_hashes(0).unwrap().into_iter().collect();
    assert_eq!(model, actual);
    assert_eq!(actual.len(), 3);

    // Reset of an idle pod: AllBlocksCleared.
    sim.reset_prefix_caches();
    let got = recv_until(&sub, Duration::from_secs(5), |m| {
        m.2[1][0]["type"] == "AllBlocksCleared"
    });
    apply(&mut model, &got.last().unwrap().2);
    assert!(model.is_empty());
    assert!(sim.cached_block_hashes(0).unwrap().is_empty());
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_array_encoding_and_restart_resets_the_sequence() {
    let sim = start(Encoding::Array, knobs()).await;
    let kv = sim.kv_endpoints(1).unwrap();
    let a = ids(7, 9);
    complete(&sim, 1, &a).await;
    let ctx = zmq::Context::new();
    let all = replay(&ctx, &kv.replay, 0);
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].0, kv.topic);
    let h = block_hashes(&a, 4);
    assert_eq!(
        all[0].2[1],
        json!([[
            "BlockStored",
            h,
            null,
            &a[..8],
            4,
            null,
            "GPU",
            null,
            null,
            0
        ]])
    );
    // Pod 0 published nothing.
    assert!(replay(&ctx, &sim.kv_endpoints(0).unwrap().replay, 0).is_empty());

    sim.restart(1).await.unwrap();
    assert!(
        replay(&ctx, &kv.replay, 0).is_empty(),
        "restart empties the ring"
    );
    complete(&sim, 1, &ids(100, 4)).await;
    let after = replay(&ctx, &kv.replay, 0);
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].1, 0, "sequence restarts at 0");
    sim.shutdown().await;
}

/// The EPP's decoder (`index::kvevents`) reads both encodings the simulator publishes, field for
/// field.
#[test]
fn the_epp_decoder_reads_both_encodings() {
    use index::kvevents::{self as epp, KvEvent as Decoded};
    use sim::kvevents::{KvEvent, encode_batch};
    let events = vec![
        KvEvent::BlockStored {
            block_hashes: vec![u64::MAX, 3],
            parent_block_hash: Some(1 << 63),
            token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
            block_size: 4,
            lora_id: Some(2),
            lora_name: Some("adapter".into()),
            // In the first block's extra keys after the adapter's name.
            cache_salt: Some("tenant".into()),
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![3],
        },
        KvEvent::AllBlocksCleared,
    ];
    for encoding in [Encoding::Map, Encoding::Array] {
        let batch = epp::decode_batch(&encode_batch(12.5, &events, encoding)).unwrap();
        assert_eq!(batch.ts, 12.5);
        assert_eq!(batch.dp_rank, Some(0));
        assert_eq!(batch.unknown_events, 0);
        assert_eq!(
            batch.events,
            vec![
                Decoded::BlockStored(epp::BlockStored {
                    block_hashes: vec![u64::MAX, 3],
                    parent_block_hash: Some(1 << 63),
                    token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
                    block_size: 4,
                    lora_id: Some(2),
                    medium: Some("GPU".into()),
                    lora_name: Some("adapter".into()),
                    group_idx: Some(0),
                    kv_cache_spec_kind: None,
                    cache_salt: Some("tenant".into()),
                }),
                Decoded::BlockRemoved {
                    block_hashes: vec![3],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                },
                Decoded::AllBlocksCleared,
            ],
            "{encoding:?}"
        );
    }
}

/// The step model publishes through the same cache: after stores and evictions, the events replayed
/// from 0 rebuild exactly the blocks the pod holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_model_publishes_every_store_and_eviction() {
    let sim = start(
        Encoding::Map,
        PodKnobs {
            engine: sim::EngineModel::Step,
            ..knobs()
        },
    )
    .await;
    let kv = sim.kv_endpoints(0).unwrap();
    // 8 blocks of 4 tokens: the third prompt evicts blocks of the first two.
    for base in [100, 200, 300] {
        complete(&sim, 0, &ids(base, 13)).await;
    }
    let held: BTreeSet<u64> = sim.cached_block_hashes(0).unwrap().into_iter().collect();
    assert!(!held.is_empty());
    let ctx = zmq::Context::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut model = BTreeSet::new();
        let batches = replay(&ctx, &kv.replay, 0);
        for (_, _, batch, _) in &batches {
            apply(&mut model, batch);
        }
        let removed = batches.iter().any(|(_, _, b, _)| {
            b[1].as_array()
                .unwrap()
                .iter()
                .any(|e| e["type"] == "BlockRemoved")
        });
        if model == held && removed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "events rebuild {model:?}, the pod holds {held:?} (an eviction seen: {removed})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.shutdown().await;
}

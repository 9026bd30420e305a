//! KV-event decoding: golden frames of every shape in use (vLLM's map and legacy array events,
//! SGLang's shorter arrays and signed hashes, byte hashes, replies with and without the topic),
//! garbage, and the sequence tracker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use index::kvevents::{
    BlockStored, KvEvent, Replay, SeqTracker, SeqVerdict, Topic, decode_batch, parse_live,
    parse_replay, parse_topic,
};
use proptest::prelude::*;

/// A msgpack value, encoded the way msgspec does (smallest form for each value).
#[derive(Clone, Debug)]
enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::U(u) if *u < 128 => out.push(*u as u8),
        V::U(u) if *u < 256 => out.extend([0xcc, *u as u8]),
        V::U(u) if *u < 65536 => {
            out.push(0xcd);
            out.extend((*u as u16).to_be_bytes());
        }
        V::U(u) if *u < 1 << 32 => {
            out.push(0xce);
            out.extend((*u as u32).to_be_bytes());
        }
        V::U(u) => {
            out.push(0xcf);
            out.extend(u.to_be_bytes());
        }
        V::I(i) if *i >= -32 && *i < 0 => out.push(*i as i8 as u8),
        V::I(i) => {
            out.push(0xd3);
            out.extend(i.to_be_bytes());
        }
        V::F(f) => {
            out.push(0xcb);
            out.extend(f.to_bits().to_be_bytes());
        }
        V::S(s) if s.len() < 32 => {
            out.push(0xa0 | s.len() as u8);
            out.extend(s.as_bytes());
        }
        V::S(s) => {
            out.extend([0xd9, s.len() as u8]);
            out.extend(s.as_bytes());
        }
        V::B(b) => {
            out.extend([0xc4, b.len() as u8]);
            out.extend(b);
        }
        V::A(items) if items.len() < 16 => {
            out.push(0x90 | items.len() as u8);
            items.iter().for_each(|i| enc(i, out));
        }
        V::A(items) => {
            out.push(0xdc);
            out.extend((items.len() as u16).to_be_bytes());
            items.iter().for_each(|i| enc(i, out));
        }
        V::M(entries) => {
            out.push(0x80 | entries.len() as u8);
            for (k, v) in entries {
                enc(&V::S(k), out);
                enc(v, out);
            }
        }
    }
}

fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

fn ints(xs: &[u64]) -> V {
    V::A(xs.iter().map(|x| V::U(*x)).collect())
}

const BIG: u64 = 0xfedc_ba98_7654_3210; // ≥ 2^63: msgpack uint64
const TOKENS: [u64; 4] = [1, 200, 70_000, 128_000];

fn stored(hashes: Vec<u64>, parent: Option<u64>) -> BlockStored {
    BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: TOKENS.iter().map(|t| *t as u32).collect(),
        block_size: 2,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        group_idx: Some(0),
        kv_cache_spec_kind: None,
        cache_salt: None,
    }
}

#[test]
fn the_cache_salt_comes_from_the_first_blocks_extra_keys_or_sglangs_field() {
    let map = |extra: V, lora: V| {
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", ints(&[1, 2])),
            ("parent_block_hash", V::Nil),
            ("token_ids", ints(&TOKENS)),
            ("block_size", V::U(2)),
            ("lora_id", V::Nil),
            ("medium", V::S("GPU")),
            ("lora_name", lora),
            ("extra_keys", extra),
        ])
    };
    let salt_of = |event: V| {
        let b = decode_batch(&bytes(&V::A(vec![V::F(0.0), V::A(vec![event])]))).unwrap();
        match &b.events[..] {
            [KvEvent::BlockStored(s)] => s.cache_salt.clone(),
            other => panic!("{other:?}"),
        }
    };
    let s = |x: &str| Some(x.to_owned());
    // LoRA name, a multimodal (identifier, offset), bytes (prompt embeds), then the salt.
    let first = V::A(vec![
        V::S("sql"),
        V::A(vec![V::S("img-hash"), V::U(3)]),
        V::S("tenant-a"),
        V::B(vec![1, 2, 3]),
    ]);
    let extra = V::A(vec![first, V::A(vec![V::S("sql")])]);
    assert_eq!(salt_of(map(extra, V::S("sql"))), s("tenant-a"));
    // A multimodal pair written flat, then the salt; and the pair alone.
    let flat = V::A(vec![V::A(vec![V::S("img"), V::U(3), V::S("tenant-d")])]);
    assert_eq!(salt_of(map(flat, V::Nil)), s("tenant-d"));
    let pair = V::A(vec![V::A(vec![V::S("img"), V::U(3)])]);
    assert_eq!(salt_of(map(pair, V::Nil)), None);
    // Only the adapter: no salt. No extra keys, nil ones, a nil first block: none either.
    let lora_only = V::A(vec![V::A(vec![V::S("sql")]), V::A(vec![V::S("sql")])]);
    assert_eq!(salt_of(map(lora_only, V::S("sql"))), None);
    assert_eq!(salt_of(map(V::Nil, V::Nil)), None);
    let later = V::A(vec![V::Nil, V::A(vec![V::S("x")])]);
    assert_eq!(salt_of(map(later, V::Nil)), None);
    assert_eq!(salt_of(map(V::A(vec![V::A(vec![V::S("")])]), V::Nil)), None);
    // The legacy positional form: extra_keys is field 8.
    let positional = V::A(vec![
        V::S("BlockStored"),
        ints(&[1, 2]),
        V::Nil,
        ints(&TOKENS),
        V::U(2),
        V::Nil,
        V::S("GPU"),
        V::Nil,
        V::A(vec![V::A(vec![V::S("tenant-b")]), V::Nil]),
        V::U(0),
    ]);
    assert_eq!(salt_of(positional), s("tenant-b"));
    // SGLang's field.
    let sglang = V::M(vec![
        ("type", V::S("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("token_ids", ints(&TOKENS[..2])),
        ("block_size", V::U(2)),
        ("cache_salt", V::S("tenant-c")),
        ("session_id", V::S("s")),
    ]);
    assert_eq!(salt_of(sglang), s("tenant-c"));
    // Another shape where the extra keys should be is skipped: the event stands, unsalted.
    assert_eq!(salt_of(map(V::S("not a list"), V::Nil)), None);
    let typed = V::M(vec![("kind", V::S("salt")), ("value", V::S("x"))]);
    assert_eq!(salt_of(map(typed, V::Nil)), None);
}

#[test]
fn a_hand_assembled_legacy_batch_decodes() {
    // [1.5, [["AllBlocksCleared"]], 0], written out byte by byte.
    let mut golden = vec![0x93, 0xcb];
    golden.extend(1.5f64.to_bits().to_be_bytes());
    golden.extend([0x91, 0x91, 0xb0]);
    golden.extend(b"AllBlocksCleared");
    golden.push(0x00);
    let b = decode_batch(&golden).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.unknown_events, 0);
}

#[test]
fn current_vllm_map_events_with_omitted_defaults_and_new_fields() {
    let payload = bytes(&V::A(vec![
        V::F(1_764_000_000.25),
        V::A(vec![
            V::M(vec![
                ("type", V::S("BlockStored")),
                ("block_hashes", ints(&[BIG, 7])),
                ("parent_block_hash", V::Nil),
                ("token_ids", ints(&TOKENS)),
                ("block_size", V::U(2)),
                ("lora_id", V::Nil),
                ("medium", V::S("GPU")),
                ("lora_name", V::Nil),
                ("group_idx", V::U(0)),
                // Fields a newer vLLM sends and we do not use.
                ("locality", V::S("LOCAL")),
                (
                    "extra_keys",
                    V::A(vec![V::A(vec![V::S("mm-item"), V::U(3)])]),
                ),
            ]),
            V::M(vec![
                ("type", V::S("BlockRemoved")),
                ("block_hashes", ints(&[7])),
                ("medium", V::S("GPU")),
            ]),
            V::M(vec![("type", V::S("AllBlocksCleared"))]),
        ]),
        V::U(0),
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.ts, 1_764_000_000.25);
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockStored(stored(vec![BIG, 7], None)),
            KvEvent::BlockRemoved {
                block_hashes: vec![7],
                medium: Some("GPU".into()),
                group_idx: None,
            },
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn legacy_arrays_full_shorter_and_longer_than_ours() {
    let full = V::A(vec![
        V::S("BlockStored"),
        ints(&[BIG, 7]),
        V::U(99),
        ints(&TOKENS),
        V::U(2),
        V::Nil,
        V::S("GPU"),
        V::Nil,
        V::Nil,  // extra_keys
        V::U(0), // group_idx
        V::S("full_attention"),
        V::Nil,         // sliding window
        V::S("REMOTE"), // locality
        V::S("future"), // a field after everything we know
    ]);
    // SGLang (older): no medium, no lora_name, nothing after lora_id.
    let sglang = V::A(vec![
        V::S("BlockStored"),
        V::A(vec![V::I(-5), V::I(i64::MIN)]),
        V::Nil,
        ints(&TOKENS),
        V::U(2),
        V::Nil,
    ]);
    let removed = V::A(vec![
        V::S("BlockRemoved"),
        ints(&[BIG]),
        V::S("CPU"),
        V::U(1),
        V::Nil,
    ]);
    // A batch without the dp_rank (before vLLM added it).
    let payload = bytes(&V::A(vec![V::F(2.0), V::A(vec![full, sglang, removed])]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.dp_rank, None);
    let mut want_full = stored(vec![BIG, 7], Some(99));
    want_full.kv_cache_spec_kind = Some("full_attention".into());
    let want_sglang = BlockStored {
        block_hashes: vec![(-5i64) as u64, i64::MIN as u64],
        medium: None,
        group_idx: None,
        ..stored(vec![], None)
    };
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockStored(want_full),
            KvEvent::BlockStored(want_sglang),
            KvEvent::BlockRemoved {
                block_hashes: vec![BIG],
                medium: Some("CPU".into()),
                group_idx: Some(1),
            },
        ]
    );
}

#[test]
fn byte_hashes_are_the_last_eight_bytes_big_endian_like_the_int_form() {
    let digest32: Vec<u8> = (0u8..32).collect();
    let digest16: Vec<u8> = (100u8..116).collect();
    let payload = bytes(&V::A(vec![
        V::F(0.0),
        V::A(vec![V::M(vec![
            ("type", V::S("BlockRemoved")),
            (
                "block_hashes",
                V::A(vec![
                    V::B(digest32.clone()),
                    V::B(digest16.clone()),
                    V::B(vec![1, 2]),
                ]),
            ),
            ("medium", V::Nil),
        ])]),
        V::Nil,
    ]));
    let b = decode_batch(&payload).unwrap();
    let tail = |d: &[u8]| u64::from_be_bytes(d[d.len() - 8..].try_into().unwrap());
    assert_eq!(
        b.events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![tail(&digest32), tail(&digest16), 0x0102],
            medium: None,
            group_idx: None,
        }]
    );
    assert_eq!(b.dp_rank, None);
}

#[test]
fn unknown_event_types_are_skipped_and_counted_and_a_map_envelope_is_accepted() {
    let payload = bytes(&V::M(vec![
        ("ts", V::F(3.0)),
        (
            "events",
            V::A(vec![
                V::M(vec![
                    ("type", V::S("BlockPinned")),
                    ("block_hashes", ints(&[1])),
                    // A known name carrying something else in an event we do not know.
                    ("medium", V::M(vec![("tier", V::U(2))])),
                ]),
                V::A(vec![V::S("SomethingNew"), V::U(1), V::A(vec![])]),
                V::A(vec![V::S("AllBlocksCleared")]),
            ]),
        ),
        ("data_parallel_rank", V::U(3)),
        ("later", V::M(vec![("x", V::F(1.0))])),
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(b.unknown_events, 2);
    assert_eq!(b.dp_rank, Some(3));
}

#[test]
fn malformed_payloads_are_errors_that_say_what() {
    let valid = bytes(&V::A(vec![
        V::F(1.0),
        V::A(vec![V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", ints(&[BIG, 7])),
            ("token_ids", ints(&TOKENS)),
            ("block_size", V::U(2)),
        ])]),
        V::U(0),
    ]));
    assert!(decode_batch(&valid).is_ok());
    // Every truncation.
    for n in 0..valid.len() {
        assert!(decode_batch(&valid[..n]).is_err(), "prefix of {n} bytes");
    }
    // Trailing bytes.
    let mut long = valid.clone();
    long.push(0);
    let e = decode_batch(&long).unwrap_err();
    assert!(e.to_string().contains("after the batch"), "{e}");
    // An array that claims 4 billion events in a few bytes.
    let e = decode_batch(&[0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x00]).unwrap_err();
    assert!(e.to_string().contains("length"), "{e}");
    // Nesting without end.
    let mut deep = vec![0x93, 0x00, 0x91, 0x92, 0xa1, b'X'];
    deep.extend(std::iter::repeat_n(0x91, 10_000));
    deep.push(0x00);
    let e = decode_batch(&deep).unwrap_err();
    assert!(e.to_string().contains("nested"), "{e}");
    // Wrong types where fields are known.
    let bad = [
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", V::S("x")),
        ]),
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", ints(&[1])),
            ("token_ids", V::A(vec![V::I(-1)])),
        ]),
        V::M(vec![("type", V::S("BlockStored"))]),
        V::M(vec![("block_hashes", ints(&[1]))]),
        V::U(5),
        V::A(vec![]),
    ];
    for event in bad {
        let payload = bytes(&V::A(vec![V::F(1.0), V::A(vec![event.clone()]), V::U(0)]));
        let e = decode_batch(&payload).unwrap_err();
        assert!(e.to_string().starts_with("event 0: "), "{event:?}: {e}");
    }
    assert!(decode_batch(&bytes(&V::A(vec![V::F(1.0)]))).is_err());
    assert!(decode_batch(&bytes(&V::S("batch"))).is_err());
}

proptest! {
    /// Garbage never panics, and a valid payload with bytes flipped either decodes or errs.
    #[test]
    fn garbage_is_an_error_not_a_panic(
        noise in proptest::collection::vec(any::<u8>(), 0..256),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        let _ = decode_batch(&noise);
        let mut payload = bytes(&V::A(vec![
            V::F(1.0),
            V::A(vec![
                V::A(vec![V::S("BlockStored"), ints(&[BIG, 7]), V::Nil, ints(&TOKENS), V::U(2)]),
                V::M(vec![("type", V::S("BlockRemoved")), ("block_hashes", ints(&[7]))]),
            ]),
            V::U(0),
        ]));
        for (at, byte) in flips {
            let n = payload.len();
            payload[at % n] = byte;
        }
        let _ = decode_batch(&payload);
    }
}

#[test]
fn live_frames_and_replay_replies_with_and_without_the_topic() {
    let seq = 41u64.to_be_bytes().to_vec();
    let live = [b"kv@10.0.0.7:8000@m".to_vec(), seq.clone(), b"P".to_vec()];
    let m = parse_live(&live).unwrap();
    assert_eq!(
        (m.topic, m.seq, m.payload),
        (&b"kv@10.0.0.7:8000@m"[..], 41, &b"P"[..])
    );
    assert!(parse_live(&live[..2]).is_err());
    assert!(parse_live(&[b"t".to_vec(), vec![0; 7], vec![]]).is_err());

    let end = vec![0xff; 8];
    // vLLM ≥ 0.26: [topic, seq, payload]; with the DEALER's empty delimiter in front, too.
    for frames in [
        vec![b"kv@p@m".to_vec(), seq.clone(), b"P".to_vec()],
        vec![vec![], b"kv@p@m".to_vec(), seq.clone(), b"P".to_vec()],
    ] {
        match parse_replay(&frames).unwrap() {
            Replay::Batch(m) => {
                assert_eq!((m.topic, m.seq, m.payload), (&b"kv@p@m"[..], 41, &b"P"[..]))
            }
            Replay::End => panic!("{frames:?}"),
        }
    }
    // Older vLLM and SGLang: [seq, payload].
    match parse_replay(&[seq.clone(), b"P".to_vec()]).unwrap() {
        Replay::Batch(m) => assert_eq!((m.topic, m.seq, m.payload), (&b""[..], 41, &b"P"[..])),
        Replay::End => panic!(),
    }
    // End markers, both shapes.
    for frames in [
        vec![vec![], end.clone(), vec![]],
        vec![end.clone(), vec![]],
        vec![vec![], vec![], end.clone(), vec![]],
    ] {
        assert_eq!(parse_replay(&frames).unwrap(), Replay::End, "{frames:?}");
    }
    assert!(parse_replay(&[b"only".to_vec()]).is_err());
    assert!(parse_replay(&[vec![1, 2, 3], b"P".to_vec()]).is_err());
}

#[test]
fn topics_name_the_pod_and_the_model() {
    assert_eq!(
        parse_topic(b"kv@10.0.0.7:8000@meta-llama/Llama-3.1-8B-Instruct"),
        Some(Topic {
            pod: "10.0.0.7:8000",
            model: "meta-llama/Llama-3.1-8B-Instruct"
        })
    );
    assert_eq!(
        parse_topic(b"kv@[fd00::7]:8000@org/model@rev"),
        Some(Topic {
            pod: "[fd00::7]:8000",
            model: "org/model@rev"
        })
    );
    assert_eq!(parse_topic(b""), None);
    assert_eq!(parse_topic(b"kv@pod-only"), None);
    assert_eq!(parse_topic(b"kv@@m"), None);
    assert_eq!(parse_topic(b"metrics@p@m"), None);
    assert_eq!(parse_topic(&[b'k', b'v', b'@', 0xff, b'@', b'm']), None);
}

#[test]
fn the_sequence_tracker_finds_gaps_and_restarts() {
    let mut t = SeqTracker::default();
    assert_eq!(t.observe(0), SeqVerdict::InOrder);
    assert_eq!(t.observe(1), SeqVerdict::InOrder);
    assert_eq!(t.observe(5), SeqVerdict::Gap { from: 2, to: 5 });
    assert_eq!(t.observe(6), SeqVerdict::InOrder);
    assert_eq!(t.observe(6), SeqVerdict::Restarted);
    assert_eq!(t.observe(0), SeqVerdict::Restarted);
    assert_eq!(t.last(), Some(0));

    // Joining mid-stream: everything before the first message was missed.
    let mut late = SeqTracker::default();
    assert_eq!(late.observe(7), SeqVerdict::Gap { from: 0, to: 7 });
    // A replay that went past what the live stream has shown moves the tracker on, never back.
    late.caught_up_to(9);
    assert_eq!(late.last(), Some(9));
    late.caught_up_to(3);
    assert_eq!(late.last(), Some(9));
    assert_eq!(late.observe(10), SeqVerdict::InOrder);
}

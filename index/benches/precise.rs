//! The precise prefix index: applying engine events (blocks/s), looking up a 16k-token prompt over
//! 100 pods (key chain + match), and memory per (pod, block) entry.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use index::kvevents::{BlockStored, KvEvent};
use index::precise::{PreciseMatch, chain_full_blocks};
use index::{BlockHasher, PreciseIndex};

const BS: usize = 16;

fn root(model: &str) -> u64 {
    BlockHasher::new(model, None, 1, 0).seed
}

/// Tokens of prompt `p` (distinct prompts share nothing).
fn tokens(n: usize, p: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ p.wrapping_mul(40_503))
        .collect()
}

/// A `BlockStored` of `tokens`' full blocks as one engine step would publish it, engine hashes
/// starting at `first_hash`.
fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    let n = tokens.len() / BS;
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..n as u64).map(|i| first_hash + i).collect(),
        parent_block_hash: None,
        token_ids: tokens[..n * BS].to_vec(),
        block_size: BS as u32,
        ..BlockStored::default()
    })
}

fn bench(c: &mut Criterion) {
    // 100 pods, each holding 20 distinct 16k-token prompts (1024 blocks each): 2 048 000 entries.
    let mut ix = PreciseIndex::new();
    for p in 0..100u32 {
        let pod = ix.pod(&format!("10.0.{}.{}:8000", p / 250, p % 250));
        for k in 0..20u32 {
            let ev = stored(&tokens(16_384, p * 20 + k), u64::from(p * 20 + k) << 20);
            ix.apply(pod, "m", std::slice::from_ref(&ev), &root);
        }
    }
    let entries = ix.len();
    let bytes = ix.approx_heap_bytes();
    // The request: prompt 7 of pod 0, plus 100 new tokens.
    let mut prompt = tokens(16_384, 7);
    prompt.extend(tokens(100, 999_999));
    let mut g = c.benchmark_group("precise");
    g.throughput(Throughput::Elements(1));
    let mut keys = Vec::new();
    let mut out: Vec<PreciseMatch> = Vec::new();
    g.bench_function(
        "lookup 16k-token prompt over 100 pods (keys + match)",
        |b| {
            b.iter(|| {
                keys.clear();
                chain_full_blocks(root("m"), &prompt, BS, &mut keys);
                ix.match_prefix(&keys, &mut out);
                out.len()
            })
        },
    );
    g.bench_function("match only (1030 keys)", |b| {
        b.iter(|| {
            ix.match_prefix(&keys, &mut out);
            out.len()
        })
    });
    // Apply: a pod's engine stores a 32-block step, then evicts it (steady state: the index
    // neither grows nor shrinks), 64 blocks per iteration.
    let step = tokens(32 * BS, 123_456);
    let store = stored(&step, 1 << 50);
    let remove = KvEvent::BlockRemoved {
        block_hashes: (0..32).map(|i| (1 << 50) + i).collect(),
        medium: None,
        group_idx: None,
    };
    let pod = ix.pod_id("10.0.0.3:8000").unwrap();
    g.throughput(Throughput::Elements(64));
    g.bench_function("apply 32 stored + 32 removed blocks", |b| {
        b.iter(|| {
            ix.apply(pod, "m", std::slice::from_ref(&store), &root);
            ix.apply(pod, "m", std::slice::from_ref(&remove), &root)
        })
    });
    g.finish();
    eprintln!(
        "precise index: {entries} entries over {} keys; ~{} bytes/entry (approx_heap_bytes)",
        ix.distinct_keys(),
        bytes / entries.max(1)
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);

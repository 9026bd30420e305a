//! Insert, match and merge throughput of the approximate prefix index, and its memory per entry.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use index::{ApproxIndex, BlockHasher, PodState, block_hashes_of_text};

fn text(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| b'a' + ((i as u8).wrapping_mul(31) ^ seed) % 26)
        .collect()
}

fn bench(c: &mut Criterion) {
    let h = BlockHasher::new("model", None, 64, 2048);
    // 100 pods, each warm with 20 distinct 16k-token prompts (250 blocks each).
    let mut ix = ApproxIndex::new(31_250);
    for p in 0..100u8 {
        let pod = ix.pod(&format!("pod-{p}"));
        for k in 0..20u8 {
            let hashes =
                block_hashes_of_text(&h, &text(65_536, p.wrapping_mul(20).wrapping_add(k)));
            ix.insert(pod, &hashes, u64::from(k));
        }
    }
    let prompt = text(65_536, 7); // held by pod 0 (seed 7 = pod 0, k 7)
    let hashes = block_hashes_of_text(&h, &prompt);
    let mut g = c.benchmark_group("approx");
    g.throughput(Throughput::Elements(hashes.len() as u64));
    g.bench_function("hash 16k-token prompt (250 blocks)", |b| {
        b.iter(|| block_hashes_of_text(&h, &prompt))
    });
    let mut out = Vec::new();
    g.bench_function("match 250 blocks over 100 pods", |b| {
        b.iter(|| {
            ix.match_prefix(&hashes, &mut out);
            out.len()
        })
    });
    let pod = ix.pod("pod-1");
    let mut ts = 100;
    g.bench_function("insert 250 blocks (refresh)", |b| {
        b.iter(|| {
            ts += 1;
            ix.insert(pod, &hashes, ts);
        })
    });
    g.bench_function("insert_delta 250 blocks (refresh)", |b| {
        b.iter(|| {
            ts += 1;
            ix.insert_delta(pod, &hashes, ts).map(|d| d.entries.len())
        })
    });
    // A 16-entry delta from a peer: 16 blocks of a prompt the pod holds, newer timestamps.
    g.throughput(Throughput::Elements(16));
    let mut delta = PodState {
        name: "pod-2".into(),
        epoch: 0,
        entries: hashes[..16].iter().map(|&h| (h, 0)).collect(),
    };
    g.bench_function("merge_pod 16-entry delta (new)", |b| {
        b.iter(|| {
            ts += 1;
            for e in &mut delta.entries {
                e.1 = ts;
            }
            ix.merge_pod(&delta)
        })
    });
    g.bench_function("merge_pod 16-entry delta (known)", |b| {
        b.iter(|| ix.merge_pod(&delta))
    });
    g.finish();
    eprintln!(
        "index holds {} entries over {} distinct hashes; ~{} bytes/entry (approx_heap_bytes)",
        ix.len(),
        ix.distinct_hashes(),
        ix.approx_heap_bytes() / ix.len().max(1)
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The pod state machine's unit tests.

use std::time::Duration;

use super::*;

fn pod(knobs: PodKnobs) -> Arc<Pod> {
    let addr: SocketAddr = ([127, 0, 0, 1], 1).into();
    Arc::new(Pod::new(0, addr, "m".into(), knobs))
}

fn toks(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| i ^ (salt << 16)).collect()
}

#[tokio::test]
async fn second_identical_prompt_hits_cache_and_usage_tracks_running() {
    let knobs = PodKnobs {
        block_size: 4,
        kv_blocks: 100,
        ..PodKnobs::default()
    };
    let p = pod(knobs.clone());
    let t = toks(18, 1);
    let mut r = p.admit(&t, 2, &knobs).await.unwrap();
    assert_eq!(r.cached_tokens(), 0);
    // 18 + 2 tokens -> 5 blocks held.
    assert!((p.stats().kv_usage - 0.05).abs() < 1e-9);
    r.prefilled();
    assert!((p.stats().kv_usage - 0.05).abs() < 1e-9);
    r.finish(2);
    let s = p.stats();
    assert_eq!((s.running, s.served, s.kv_usage), (0, 1, 0.0));
    assert_eq!(s.cached_blocks, 4);

    let r = p.admit(&t, 2, &knobs).await.unwrap();
    assert_eq!(r.cached_tokens(), 16);
    assert_eq!(r.uncached_tokens(), 2);
    drop(r);
    // Exactly block-aligned prompt: the last block is recomputed.
    let r = p.admit(&t[..16], 2, &knobs).await.unwrap();
    assert_eq!(r.cached_tokens(), 12);
    drop(r);
    let s = p.stats();
    assert_eq!(s.prefix_hits_tokens, 28);
    assert_eq!(s.prefix_queries_tokens, 18 * 3 - 2);
    // Dropped without finishing: not served.
    assert_eq!(s.served, 1);
}

#[tokio::test]
async fn small_capacity_evicts_old_prompts() {
    let knobs = PodKnobs {
        block_size: 4,
        kv_blocks: 6,
        ..PodKnobs::default()
    };
    let p = pod(knobs.clone());
    for salt in 0..3 {
        let mut r = p.admit(&toks(13, salt), 1, &knobs).await.unwrap();
        r.prefilled();
        r.finish(1);
    }
    assert!(p.stats().cached_blocks <= 6);
    // The first prompt was evicted, the last one is still cached.
    let r = p.admit(&toks(13, 2), 1, &knobs).await.unwrap();
    assert_eq!(r.cached_tokens(), 12);
    drop(r);
    let r = p.admit(&toks(13, 0), 1, &knobs).await.unwrap();
    assert_eq!(r.cached_tokens(), 0);
}

/// vLLM's CPU offloading: what the GPU evicted is still in the CPU tier, loaded back (and
/// reported cached) after the GPU's own hits; the tier keeps its least recently used out.
#[tokio::test]
async fn offloaded_blocks_are_loaded_back_and_count_as_cached() {
    let knobs = PodKnobs {
        block_size: 4,
        kv_blocks: 6,
        cpu_offload_blocks: 8,
        ..PodKnobs::default()
    };
    let p = pod(knobs.clone());
    for salt in 0..3 {
        let mut r = p.admit(&toks(13, salt), 1, &knobs).await.unwrap();
        r.prefilled();
        r.finish(1);
    }
    let s = p.stats();
    assert!(s.cached_blocks <= 6);
    assert_eq!(s.offloaded_blocks, 8, "9 blocks copied, the oldest dropped");
    // The first prompt left the GPU; its last two blocks are still on the CPU, its first was
    // dropped from there: nothing leads.
    let r = p.admit(&toks(13, 0), 1, &knobs).await.unwrap();
    assert_eq!((r.cached_tokens(), r.loaded_tokens()), (0, 0));
    drop(r);
    // The second prompt: evicted from the GPU, all on the CPU: loaded back.
    let r = p.admit(&toks(13, 1), 1, &knobs).await.unwrap();
    assert_eq!((r.cached_tokens(), r.loaded_tokens()), (12, 12));
    drop(r);
    // Now on the GPU again: a plain hit.
    let r = p.admit(&toks(13, 1), 1, &knobs).await.unwrap();
    assert_eq!((r.cached_tokens(), r.loaded_tokens()), (12, 0));
    drop(r);
    assert_eq!(p.stats().offload_hits_tokens, 12);
    // Without the tier nothing is loaded back.
    let plain = PodKnobs {
        cpu_offload_blocks: 0,
        ..knobs
    };
    let p = pod(plain.clone());
    for salt in 0..3 {
        let mut r = p.admit(&toks(13, salt), 1, &plain).await.unwrap();
        r.prefilled();
        r.finish(1);
    }
    drop(p.admit(&toks(13, 0), 1, &plain).await.unwrap());
    let r = p.admit(&toks(13, 1), 1, &plain).await.unwrap();
    assert_eq!(r.cached_tokens(), 0);
    assert_eq!(p.stats().offloaded_blocks, 0);
}

#[tokio::test]
async fn shrinking_slots_takes_effect_when_requests_finish() {
    let knobs = PodKnobs {
        max_num_seqs: 2,
        ..PodKnobs::default()
    };
    let p = pod(knobs.clone());
    let a = p.admit(&toks(4, 0), 1, &knobs).await.unwrap();
    let b = p.admit(&toks(4, 1), 1, &knobs).await.unwrap();
    p.set_knobs(&KnobsPatch {
        max_num_seqs: Some(1),
        ..KnobsPatch::default()
    })
    .unwrap();
    drop(a);
    // Still one running: no slot is free.
    assert_eq!(p.slots.available_permits(), 0);
    drop(b);
    assert_eq!(p.slots.available_permits(), 1);
    p.set_knobs(&KnobsPatch {
        max_num_seqs: Some(3),
        ..KnobsPatch::default()
    })
    .unwrap();
    assert_eq!(p.slots.available_permits(), 3);
}

#[test]
fn latency_model() {
    let k = PodKnobs {
        prefill_overhead_ms: 2.0,
        prefill_us_per_token: 100.0,
        extra_latency_ms: 1.0,
        time_scale: 0.5,
        decode_ms_per_token: 4.0,
        ..PodKnobs::default()
    };
    assert_eq!(ttft(&k, 100), Duration::from_micros(6500));
    assert_eq!(inter_token(&k), Duration::from_millis(2));
}

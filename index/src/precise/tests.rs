use super::*;
use crate::BlockHasher;

#[test]
fn speculative_entries_match_until_they_expire() {
    let mut ix = PreciseIndex::new();
    let a = ix.pod("a");
    let b = ix.pod("b");
    let t = toks(12, 5);
    let k = keys("m", &t);
    // b's engine holds the first block; a was just sent the whole prompt.
    ix.apply(b, "m", &[stored(&[1], None, &t[..4])], &root);
    ix.speculate(a, &k, 100, 2100);
    let mut out = Vec::new();
    ix.match_prefix_at(&k, Some(1000), &mut out);
    out.sort_by_key(|m| m.pod);
    assert_eq!(out, vec![run(a, 3), run(b, 1)]);
    // Without speculation, or once expired: only what the engines reported.
    ix.match_prefix(&k, &mut out);
    assert_eq!(out, vec![run(b, 1)]);
    ix.match_prefix_at(&k, Some(2100), &mut out);
    assert_eq!(out, vec![run(b, 1)]);
    // A later call sweeps the expired entries; a renewed one survives its old expiry.
    ix.speculate(b, &k[..1], 2200, 4200);
    assert!(!ix.speculative.contains_key(&k[1]));
    ix.speculate(b, &k[..1], 3000, 5000);
    ix.speculate(b, &[], 4300, 6300);
    ix.match_prefix_at(&k, Some(4300), &mut out);
    assert_eq!(out, vec![run(b, 1)]);
    assert_eq!(ix.speculative.get(&k[0]).map(Vec::len), Some(1));
    // A removed pod's speculation goes with it.
    ix.remove_pod("b");
    assert!(ix.speculative.is_empty() && ix.spec_queue.is_empty());
}

#[test]
fn a_pod_claiming_more_blocks_than_any_cache_is_not_believed() {
    let mut ix = PreciseIndex::with_pod_limit(2);
    let a = ix.pod("a");
    let t = toks(16, 1);
    let r = ix.apply(a, "m", &[stored(&[1, 2, 3, 4], None, &t)], &root);
    assert_eq!((r.stored, r.skipped, ix.pod_len(a)), (2, 2, 2));
    // A removal makes room again; a peer's mirror is bounded alike.
    ix.apply(
        a,
        "m",
        &[KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium: None,
            group_idx: None,
        }],
        &root,
    );
    assert_eq!(ix.pod_len(a), 1);
    let b = ix.pod("b");
    ix.mirror(b, GPU, 4, &[10, 11, 12], &[]);
    assert_eq!(ix.pod_len(b), 2);
}

#[test]
fn holders_stay_small() {
    assert_eq!(std::mem::size_of::<(u64, Holders)>(), 16);
}

/// A run of `blocks` GPU blocks.
fn run(pod: PodId, blocks: usize) -> PreciseMatch {
    PreciseMatch {
        pod,
        blocks,
        score: blocks as f32,
    }
}

fn root(model: &str) -> u64 {
    BlockHasher::new(model, None, 16, 0).seed
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: 4,
        ..BlockStored::default()
    })
}

fn keys(model: &str, tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    chain_full_blocks(root(model), tokens, 4, &mut out);
    out
}

#[test]
fn stored_blocks_match_the_requests_tokens_and_removals_cut_the_run() {
    let mut ix = PreciseIndex::new();
    let a = ix.pod("a");
    let b = ix.pod("b");
    let t = toks(16, 1);
    // a stores 4 blocks in two events (the second chained from the first's last hash).
    let r = ix.apply(a, "m", &[stored(&[11, 12], None, &t[..8])], &root);
    assert_eq!(r.stored, 2);
    ix.apply(a, "m", &[stored(&[13, 14], Some(12), &t[8..])], &root);
    // b stores only the first block.
    ix.apply(b, "m", &[stored(&[91], None, &t[..4])], &root);
    let mut out = Vec::new();
    // A request of 18 tokens: 4 full blocks (the partial tail is never cached).
    let mut req = t.clone();
    req.extend([5, 5]);
    ix.match_prefix(&keys("m", &req), &mut out);
    out.sort_by_key(|m| m.pod);
    assert_eq!(out, vec![run(a, 4), run(b, 1)]);
    // Another model's key space does not match.
    ix.match_prefix(&keys("other", &req), &mut out);
    assert!(out.is_empty());
    // a evicts its second block: its run stops at 1.
    let r = ix.apply(
        a,
        "m",
        &[KvEvent::BlockRemoved {
            block_hashes: vec![12, 999],
            medium: None,
            group_idx: None,
        }],
        &root,
    );
    assert_eq!(r.removed, 1);
    ix.match_prefix(&keys("m", &req), &mut out);
    assert!(out.iter().all(|m| m.blocks == 1), "{out:?}");
    assert_eq!((ix.len(), ix.pod_len(a), ix.pod_len(b)), (4, 3, 1));
    // Cleared: a holds nothing.
    ix.apply(a, "m", &[KvEvent::AllBlocksCleared], &root);
    ix.match_prefix(&keys("m", &req), &mut out);
    assert_eq!(out, vec![run(b, 1)]);
    assert_eq!(ix.len(), 1);
}

#[test]
fn an_unknown_parent_is_an_orphan_and_odd_events_are_skipped() {
    let mut ix = PreciseIndex::new();
    let a = ix.pod("a");
    let t = toks(8, 3);
    let r = ix.apply(a, "m", &[stored(&[2], Some(777), &t[4..])], &root);
    assert_eq!((r.stored, r.orphaned), (0, 1));
    // A hash-only store of an engine block never mapped cannot be keyed either.
    let r = ix.apply(a, "m", &[stored(&[1], None, &[])], &root);
    assert_eq!((r.stored, r.orphaned), (0, 1));
    // Tokens that do not cover the blocks, an unnamed adapter, a sliding-window group, an
    // absurd medium: not indexed.
    let mut odd = BlockStored {
        block_hashes: vec![1],
        token_ids: t[..4].to_vec(),
        block_size: 4,
        lora_id: Some(3),
        ..BlockStored::default()
    };
    let mut events = vec![stored(&[1, 2], None, &t[..5])];
    events.push(KvEvent::BlockStored(odd.clone()));
    odd.lora_id = None;
    odd.kv_cache_spec_kind = Some("sliding_window".into());
    events.push(KvEvent::BlockStored(odd.clone()));
    odd.kv_cache_spec_kind = None;
    odd.medium = Some("x".repeat(100));
    events.push(KvEvent::BlockStored(odd.clone()));
    let r = ix.apply(a, "m", &events, &root);
    assert_eq!((r.stored, r.skipped), (0, 4));
    assert!(ix.is_empty());
    // A named adapter's blocks live in the adapter's key space.
    odd.medium = None;
    odd.kv_cache_spec_kind = Some("full_attention".into());
    odd.lora_id = Some(3);
    odd.lora_name = Some("sql".into());
    ix.apply(a, "m", &[KvEvent::BlockStored(odd)], &root);
    let mut out = Vec::new();
    ix.match_prefix(&keys("sql", &t), &mut out);
    assert_eq!(out, vec![run(a, 1)]);
    ix.match_prefix(&keys("m", &t), &mut out);
    assert!(out.is_empty());
}

fn on(medium: &str, mut ev: KvEvent) -> KvEvent {
    match &mut ev {
        KvEvent::BlockStored(s) => s.medium = Some(medium.into()),
        KvEvent::BlockRemoved { medium: m, .. } => *m = Some(medium.into()),
        KvEvent::AllBlocksCleared => {}
    }
    ev
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: None,
        group_idx: None,
    }
}

/// vLLM's offloading: blocks stored on the GPU with their tokens, then offloaded to the CPU by
/// hash only; the GPU evicts them; the CPU copy still counts, at the CPU's weight.
#[test]
fn offloaded_blocks_resolve_by_engine_hash_and_score_at_their_tier_weight() {
    let mut ix = PreciseIndex::new();
    ix.set_tier_weights(&[("GPU".into(), 1.0), ("cpu".into(), 0.8)]);
    let (a, b) = (ix.pod("a"), ix.pod("b"));
    let t = toks(16, 4);
    let k = keys("m", &t);
    // a: four blocks on the GPU, all offloaded (hash-only), then the GPU evicts the last two.
    ix.apply(a, "m", &[stored(&[1, 2, 3, 4], None, &t)], &root);
    let r = ix.apply(
        a,
        "m",
        &[on("CPU", stored(&[1, 2, 3, 4], None, &[]))],
        &root,
    );
    assert_eq!((r.stored, r.orphaned), (4, 0));
    ix.apply(a, "m", &[removed(&[3, 4])], &root);
    assert_eq!(
        (ix.tier_len(a, GPU), ix.tier_len(a, 1), ix.pod_len(a)),
        (2, 4, 6)
    );
    assert_eq!(ix.tier_name(1), Some("cpu"));
    // b: the first three on the GPU.
    ix.apply(b, "m", &[stored(&[7, 8, 9], None, &t[..12])], &root);
    let mut out = Vec::new();
    ix.match_prefix(&k, &mut out);
    out.sort_by_key(|m| m.pod);
    // a holds all four (two on the GPU, two only on the CPU): 1 + 1 + 0.8 + 0.8.
    assert_eq!(out[0].pod, a);
    assert_eq!(out[0].blocks, 4);
    assert!((out[0].score - 3.6).abs() < 1e-5, "{out:?}");
    assert_eq!(out[1], run(b, 3));
    // A CPU store with tokens chains from a parent held in another tier.
    let r = ix.apply(
        a,
        "m",
        &[on("cpu", stored(&[5], Some(4), &[9, 9, 9, 9]))],
        &root,
    );
    assert_eq!((r.stored, r.orphaned), (1, 0));
    // The CPU evicts block 4: a's run ends after block 3; removing an unknown tier is a no-op.
    let r = ix.apply(
        a,
        "m",
        &[on("CPU", removed(&[4])), on("disk", removed(&[1]))],
        &root,
    );
    assert_eq!((r.removed, r.skipped), (1, 0));
    ix.match_prefix(&k, &mut out);
    let ra = out.iter().find(|m| m.pod == a).copied();
    assert_eq!(ra.map(|m| m.blocks), Some(3), "{out:?}");
    // Cleared: every tier goes.
    ix.apply(a, "m", &[KvEvent::AllBlocksCleared], &root);
    assert_eq!(ix.pod_len(a), 0);
    // Weights default to 1 for a medium not named, and can be changed after the fact.
    ix.apply(a, "m", &[stored(&[1], None, &t[..4])], &root);
    ix.apply(
        a,
        "m",
        &[on("STORAGE", stored(&[1], None, &[])), removed(&[1])],
        &root,
    );
    ix.match_prefix(&k[..1], &mut out);
    let score = |out: &[PreciseMatch]| out.iter().find(|m| m.pod == a).map(|m| m.score);
    assert_eq!(score(&out), Some(1.0));
    ix.set_tier_weights(&[("storage".into(), 0.3)]);
    ix.match_prefix(&k[..1], &mut out);
    assert_eq!(score(&out), Some(0.3));
}

/// Engines publishing stray mediums use up the free tier slots, not the configured tiers'.
#[test]
fn configured_tiers_keep_their_slots() {
    let mut ix = PreciseIndex::new();
    let names = ["cpu", "shared_storage", "storage", "object_store"];
    ix.set_tier_weights(&names.map(|n| (n.to_string(), 0.5)));
    let strays: Vec<_> = (0..4).map(|i| ix.tier(Some(&format!("x{i}")))).collect();
    assert_eq!(strays, vec![Some(5), Some(6), None, None]);
    for n in names {
        assert!(ix.known_tier(Some(n)).is_some(), "{n}");
    }
    assert_eq!(ix.tier(Some("GPU")), Some(GPU));
}

/// The tiers a pod holds a key in are told apart in its digest, and a mirror rebuilt from the
/// per-tier state compares equal even when it numbered the tiers in another order.
#[test]
fn tiers_replicate_by_name() {
    let mut ix = PreciseIndex::new();
    ix.journal();
    let a = ix.pod("a");
    let t = toks(8, 5);
    ix.apply(a, "m", &[stored(&[1, 2], None, &t)], &root);
    ix.apply(a, "m", &[on("cpu", stored(&[1, 2], None, &[]))], &root);
    ix.apply(
        a,
        "m",
        &[on("storage", stored(&[2], None, &[])), removed(&[2])],
        &root,
    );
    let gpu_only = {
        let mut g = PreciseIndex::new();
        let a = g.pod("a");
        g.apply(a, "m", &[stored(&[1, 2], None, &t)], &root);
        g.digest(a)
    };
    assert_eq!(ix.digest(a).0, 4); // (k1, gpu), (k1, cpu), (k2, cpu), (k2, storage)
    assert_ne!(ix.digest(a).1, gpu_only.1);
    // A mirror that met "storage" first.
    let mut m = PreciseIndex::new();
    assert_eq!(m.tier(Some("STORAGE")), Some(1));
    let ma = m.pod("a");
    for c in ix.take_journal() {
        let tier = m.tier(ix.tier_name(c.tier)).unwrap();
        let (adds, removes) = if c.added {
            (vec![c.key], vec![])
        } else {
            (vec![], vec![c.key])
        };
        m.mirror(ma, tier, 4, &adds, &removes);
    }
    assert_eq!(m.digest(ma), ix.digest(a));
    assert_eq!(m.pod_state(ma), ix.pod_state(a));
    let mut fresh = PreciseIndex::new();
    let f = fresh.pod("a");
    fresh.replace_mirror(f, &ix.pod_state(a));
    assert_eq!(fresh.digest(f), ix.digest(a));
    let st = ix.pod_state(a);
    assert_eq!(st.gpu.len(), 1);
    assert_eq!(
        st.offload
            .iter()
            .map(|(n, k)| (n.as_str(), k.len()))
            .collect::<Vec<_>>(),
        vec![("cpu", 2), ("storage", 1)]
    );
}

#[test]
fn a_key_held_twice_by_one_pod_survives_one_removal() {
    let mut ix = PreciseIndex::new();
    let a = ix.pod("a");
    let t = toks(4, 9);
    ix.apply(
        a,
        "m",
        &[stored(&[1], None, &t), stored(&[2], None, &t)],
        &root,
    );
    assert_eq!(ix.len(), 2);
    ix.apply(
        a,
        "m",
        &[KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium: Some("GPU".into()),
            group_idx: None,
        }],
        &root,
    );
    let mut out = Vec::new();
    ix.match_prefix(&keys("m", &t), &mut out);
    assert_eq!(out, vec![run(a, 1)]);
    // The same engine block stored again (a replay overlapping the live stream) counts once.
    let r = ix.apply(a, "m", &[stored(&[2], None, &t)], &root);
    assert_eq!((r.stored, ix.len()), (0, 1));
}

#[test]
fn many_holders_spill_and_removed_pods_free_their_slot() {
    let mut ix = PreciseIndex::new();
    let t = toks(4, 2);
    for i in 0..6 {
        let p = ix.pod(&format!("p{i}"));
        ix.apply(p, "m", &[stored(&[i], None, &t)], &root);
    }
    let mut out = Vec::new();
    ix.match_prefix(&keys("m", &t), &mut out);
    assert_eq!(out.len(), 6);
    ix.remove_pod("p2");
    ix.match_prefix(&keys("m", &t), &mut out);
    assert_eq!(out.len(), 5);
    assert_eq!(ix.pod_id("p2"), None);
    assert_eq!(ix.pod("new"), 2, "the freed slot is reused");
    assert_eq!(ix.pod_len(2), 0);
    assert!(ix.approx_heap_bytes() > 0);
}

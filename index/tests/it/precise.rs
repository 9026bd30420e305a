//! The precise index against a plain model: any sequence of stores, offloads to the CPU tier
//! (hash-only, as vLLM's offloading connector publishes them), removals from either tier and
//! clears over two dozen pods sharing blocks leaves every pod holding exactly the keys of its
//! engine blocks, and every prefix match — run length and tier-weighted score — equal to the
//! model's (the inline/spilled holder lists are an implementation detail that must not show).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use index::kvevents::{BlockStored, KvEvent};
use index::precise::{PodKeys, PreciseMatch, chain_full_blocks};
use index::{BlockHasher, PreciseIndex};
use proptest::prelude::*;

const BS: usize = 2;

fn root(model: &str) -> u64 {
    BlockHasher::new(model, None, 1, 0).seed
}

/// Prompt `p`'s first `n` blocks: a few prompts, sharing their first block when `p` is even.
fn tokens(p: u8, n: usize) -> Vec<u32> {
    (0..n * BS)
        .map(|i| {
            if i < BS && p.is_multiple_of(2) {
                i as u32
            } else {
                u32::from(p) * 1000 + i as u32
            }
        })
        .collect()
}

fn keys(p: u8, n: usize) -> Vec<u64> {
    let mut out = Vec::new();
    chain_full_blocks(root("m"), &tokens(p, n), BS, &mut out);
    out
}

#[derive(Debug, Clone)]
enum Op {
    /// Pod stores prompt p's first n blocks (engine hashes derived from pod, prompt, block, and
    /// a generation so the same blocks can be stored again under new engine hashes).
    Store {
        pod: u8,
        p: u8,
        n: usize,
        generation: u8,
    },
    /// Pod evicts the i-th engine block it holds in a tier (by insertion order), if any.
    Remove {
        pod: u8,
        i: usize,
        cpu: bool,
    },
    /// Pod copies the i-th engine block of its GPU tier to its CPU tier (hash-only event).
    Offload {
        pod: u8,
        i: usize,
    },
    Clear {
        pod: u8,
    },
}

/// Enough pods that a block is often held by more than the index searches one by one.
const PODS: u8 = 24;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..PODS, 0..4u8, 1..5usize, 0..2u8)
            .prop_map(|(pod, p, n, generation)| Op::Store { pod, p, n, generation }),
        3 => (0..PODS, 0..40usize, any::<bool>())
            .prop_map(|(pod, i, cpu)| Op::Remove { pod, i, cpu }),
        2 => (0..PODS, 0..20usize).prop_map(|(pod, i)| Op::Offload { pod, i }),
        1 => (0..PODS).prop_map(|pod| Op::Clear { pod }),
    ]
}

fn engine_hash(pod: u8, p: u8, block: usize, generation: u8) -> u64 {
    (u64::from(pod) << 48) | (u64::from(p) << 32) | ((block as u64) << 8) | u64::from(generation)
}

proptest! {
    #[test]
    fn the_index_is_its_model(ops in prop::collection::vec(op(), 1..160)) {
        let mut ix = PreciseIndex::new();
        ix.set_tier_weights(&[("cpu".into(), 0.5)]);
        ix.journal();
        // A replica mirroring `ix` from its journal, batches delivered in order.
        let mut mirror = PreciseIndex::new();
        // The model: per pod, engine hash → key in insertion order, GPU tier.
        let mut model: BTreeMap<u8, Vec<(u64, u64)>> = BTreeMap::new();
        // The same for the CPU tier.
        let mut cpu: BTreeMap<u8, Vec<(u64, u64)>> = BTreeMap::new();
        for op in &ops {
            match *op {
                Op::Store { pod, p, n, generation } => {
                    let id = ix.pod(&format!("pod{pod}"));
                    let hashes: Vec<u64> =
                        (0..n).map(|b| engine_hash(pod, p, b, generation)).collect();
                    let ev = KvEvent::BlockStored(BlockStored {
                        block_hashes: hashes.clone(),
                        token_ids: tokens(p, n),
                        block_size: BS as u32,
                        ..BlockStored::default()
                    });
                    ix.apply(id, "m", &[ev], &root);
                    let m = model.entry(pod).or_default();
                    for (h, k) in hashes.into_iter().zip(keys(p, n)) {
                        if !m.iter().any(|(e, _)| *e == h) {
                            m.push((h, k));
                        }
                    }
                }
                Op::Remove { pod, i, cpu: on_cpu } => {
                    let tier = if on_cpu { &mut cpu } else { &mut model };
                    let Some(m) = tier.get_mut(&pod) else { continue };
                    if i < m.len() {
                        let (h, _) = m.remove(i);
                        let id = ix.pod(&format!("pod{pod}"));
                        ix.apply(id, "m", &[KvEvent::BlockRemoved {
                            block_hashes: vec![h],
                            medium: Some(if on_cpu { "CPU" } else { "GPU" }.into()),
                            group_idx: None,
                        }], &root);
                    }
                }
                Op::Offload { pod, i } => {
                    let Some(&(h, k)) = model.get(&pod).and_then(|m| m.get(i)) else { continue };
                    let id = ix.pod(&format!("pod{pod}"));
                    ix.apply(id, "m", &[KvEvent::BlockStored(BlockStored {
                        block_hashes: vec![h],
                        block_size: BS as u32,
                        medium: Some("CPU".into()),
                        ..BlockStored::default()
                    })], &root);
                    let m = cpu.entry(pod).or_default();
                    if !m.iter().any(|(e, _)| *e == h) {
                        m.push((h, k));
                    }
                }
                Op::Clear { pod } => {
                    model.remove(&pod);
                    cpu.remove(&pod);
                    let id = ix.pod(&format!("pod{pod}"));
                    ix.apply(id, "m", &[KvEvent::AllBlocksCleared], &root);
                }
            }
            for c in ix.take_journal() {
                let name = ix.pod_name(c.pod).unwrap().to_string();
                let m = mirror.pod(&name);
                let tier = mirror.tier(ix.tier_name(c.tier)).unwrap();
                if c.added {
                    mirror.mirror(m, tier, BS as u32, &[c.key], &[]);
                } else {
                    mirror.mirror(m, tier, BS as u32, &[], &[c.key]);
                }
            }
        }
        // The mirror holds each pod's distinct keys, with the same digest.
        for name in ix.pod_names() {
            let (a, b) = (ix.pod_id(&name).unwrap(), mirror.pod(&name));
            prop_assert_eq!(ix.digest(a), mirror.digest(b));
            prop_assert_eq!(ix.pod_state(a), mirror.pod_state(b));
            // A full-state transfer gives the same.
            let mut fresh = PreciseIndex::new();
            let f = fresh.pod(&name);
            fresh.replace_mirror(f, &ix.pod_state(a));
            prop_assert_eq!(fresh.digest(f), ix.digest(a));
        }
        let total: usize = model.values().chain(cpu.values()).map(Vec::len).sum();
        prop_assert_eq!(ix.len(), total);
        for (pod, m) in &model {
            let id = ix.pod_id(&format!("pod{pod}")).unwrap();
            let mut want: Vec<u64> = m.iter().map(|(_, k)| *k).collect();
            want.sort_unstable();
            prop_assert_eq!(ix.held_keys(id), want);
        }
        // Every prompt's match equals the model's: per pod, leading keys held.
        for p in 0..4u8 {
            let ks = keys(p, 4);
            let mut got = Vec::new();
            ix.match_prefix(&ks, &mut got);
            // Scores in halves (GPU 1, CPU 0.5) compare exactly.
            let got: BTreeSet<(String, usize, u32)> = got
                .iter()
                .map(|PreciseMatch { pod, blocks, score }| {
                    (ix.pod_name(*pod).unwrap().to_string(), *blocks, (score * 2.0).round() as u32)
                })
                .collect();
            let none = Vec::new();
            let want: BTreeSet<(String, usize, u32)> = (0..PODS)
                .map(|pod| {
                    let of = |t: &BTreeMap<u8, Vec<(u64, u64)>>| -> BTreeSet<u64> {
                        t.get(&pod).unwrap_or(&none).iter().map(|(_, k)| *k).collect()
                    };
                    let (g, c) = (of(&model), of(&cpu));
                    let run: Vec<u32> = ks
                        .iter()
                        .map_while(|k| if g.contains(k) { Some(2) } else if c.contains(k) { Some(1) } else { None })
                        .collect();
                    (format!("pod{pod}"), run.len(), run.iter().sum::<u32>())
                })
                .filter(|(_, n, _)| *n > 0)
                .collect();
            prop_assert_eq!(got, want);
        }
    }
}

/// One engine event for the replication law below (no model needed: removing an engine block
/// a pod does not hold changes nothing).
#[derive(Debug, Clone)]
enum Ev {
    Store {
        pod: u8,
        p: u8,
        n: usize,
        generation: u8,
    },
    Remove {
        pod: u8,
        p: u8,
        block: usize,
        generation: u8,
        cpu: bool,
    },
    Offload {
        pod: u8,
        p: u8,
        block: usize,
        generation: u8,
    },
    Clear {
        pod: u8,
    },
}

fn ev() -> impl Strategy<Value = Ev> {
    let pods = 0..6u8;
    prop_oneof![
        4 => (pods.clone(), 0..4u8, 1..5usize, 0..2u8)
            .prop_map(|(pod, p, n, generation)| Ev::Store { pod, p, n, generation }),
        3 => (pods.clone(), 0..4u8, 0..4usize, 0..2u8, any::<bool>())
            .prop_map(|(pod, p, block, generation, cpu)| Ev::Remove { pod, p, block, generation, cpu }),
        2 => (pods.clone(), 0..4u8, 0..4usize, 0..2u8)
            .prop_map(|(pod, p, block, generation)| Ev::Offload { pod, p, block, generation }),
        1 => pods.prop_map(|pod| Ev::Clear { pod }),
    ]
}

fn apply_ev(ix: &mut PreciseIndex, e: &Ev) {
    let (pod, event) = match *e {
        Ev::Store {
            pod,
            p,
            n,
            generation,
        } => (
            pod,
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..n).map(|b| engine_hash(pod, p, b, generation)).collect(),
                token_ids: tokens(p, n),
                block_size: BS as u32,
                ..BlockStored::default()
            }),
        ),
        Ev::Remove {
            pod,
            p,
            block,
            generation,
            cpu,
        } => (
            pod,
            KvEvent::BlockRemoved {
                block_hashes: vec![engine_hash(pod, p, block, generation)],
                medium: cpu.then(|| "CPU".to_string()),
                group_idx: None,
            },
        ),
        Ev::Offload {
            pod,
            p,
            block,
            generation,
        } => (
            pod,
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![engine_hash(pod, p, block, generation)],
                block_size: BS as u32,
                medium: Some("CPU".into()),
                ..BlockStored::default()
            }),
        ),
        Ev::Clear { pod } => (pod, KvEvent::AllBlocksCleared),
    };
    let id = ix.pod(&format!("pod{pod}"));
    ix.apply(id, "m", &[event], &root);
}

/// A batch of one owner's changes as the gossip sends it: per (pod, tier, key) the last change.
type Batch = BTreeMap<(String, String, u64), bool>;

/// An owner: the events applied in order, its journal cut into batches after the events
/// `flush` marks (and at the end).
fn owner(events: &[Ev], flush: &[bool]) -> (PreciseIndex, Vec<Batch>) {
    let mut ix = PreciseIndex::new();
    ix.journal();
    let (mut batches, mut cur) = (Vec::new(), Batch::new());
    for (i, e) in events.iter().enumerate() {
        apply_ev(&mut ix, e);
        for c in ix.take_journal() {
            let pod = ix.pod_name(c.pod).unwrap().to_string();
            let tier = ix.tier_name(c.tier).unwrap().to_string();
            cur.insert((pod, tier, c.key), c.added);
        }
        if flush.get(i).copied().unwrap_or(false) || i + 1 == events.len() {
            batches.push(std::mem::take(&mut cur));
        }
    }
    (ix, batches)
}

fn deliver(mirror: &mut PreciseIndex, b: &Batch) {
    for ((pod, tier, key), added) in b {
        let id = mirror.pod(pod);
        let t = mirror.tier(Some(tier)).unwrap();
        let (adds, removes) = if *added {
            (vec![*key], vec![])
        } else {
            (vec![], vec![*key])
        };
        mirror.mirror(id, t, BS as u32, &adds, &removes);
    }
}

/// Equal keys by tier; the block size too once the pod holds anything (a pod whose batches
/// were all lost and that holds nothing has not learnt it, and needs it for nothing).
fn same_state(want: &PodKeys, got: &PodKeys, pod: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        (&want.gpu, &want.offload),
        (&got.gpu, &got.offload),
        "{}",
        pod
    );
    if !want.gpu.is_empty() || !want.offload.is_empty() {
        prop_assert_eq!(want.block_size, got.block_size, "{}", pod);
    }
    Ok(())
}

proptest! {
    /// The precise index between replicas: two owners read the same stream and batch their
    /// changes differently; a mirror taking both owners' batches interleaved in any way, each
    /// owner's in order and any batch repeated at once (a push is sequential per peer), ends
    /// equal to the owners — per pod and tier, digest and keys. Reordered and lost batches
    /// leave it different, which one anti-entropy round (digest against the primary, the
    /// differing pods replaced whole) repairs.
    #[test]
    fn mirrors_converge_under_interleaving_duplication_and_anti_entropy(
        events in prop::collection::vec(ev(), 1..120),
        flush_a in prop::collection::vec(any::<bool>(), 120),
        flush_b in prop::collection::vec(any::<bool>(), 120),
        picks in prop::collection::vec(0..4u8, 600),
        order in prop::collection::vec(any::<u32>(), 300),
    ) {
        let (a, batches_a) = owner(&events, &flush_a);
        let (b, batches_b) = owner(&events, &flush_b);
        let names = a.pod_names();
        for n in &names {
            let (ia, ib) = (a.pod_id(n).unwrap(), b.pod_id(n).unwrap());
            prop_assert_eq!(a.digest(ia), b.digest(ib));
        }
        // FIFO per owner, interleaved, with immediate repeats.
        let mut mirror = PreciseIndex::new();
        let (mut i, mut j, mut k) = (0, 0, 0);
        while i < batches_a.len() || j < batches_b.len() {
            let pick = picks[k % picks.len()];
            k += 1;
            let from_a = j == batches_b.len() || (i < batches_a.len() && pick % 2 == 0);
            let batch = if from_a { i += 1; &batches_a[i - 1] } else { j += 1; &batches_b[j - 1] };
            deliver(&mut mirror, batch);
            if pick >= 2 {
                deliver(&mut mirror, batch);
            }
        }
        for n in &names {
            let (ia, im) = (a.pod_id(n).unwrap(), mirror.pod(n));
            prop_assert_eq!(a.digest(ia), mirror.digest(im), "{}", n);
            same_state(&a.pod_state(ia), &mirror.pod_state(im), n)?;
        }
        // Any order, some lost, then anti-entropy.
        let mut all: Vec<(u32, &Batch)> = batches_a
            .iter()
            .chain(&batches_b)
            .enumerate()
            .map(|(x, bt)| (order[x % order.len()], bt))
            .collect();
        all.sort_by_key(|x| x.0);
        let mut messy = PreciseIndex::new();
        for (o, bt) in &all {
            if o % 5 != 0 {
                deliver(&mut messy, bt);
            }
        }
        for n in &names {
            let (ia, im) = (a.pod_id(n).unwrap(), messy.pod(n));
            if messy.digest(im) != a.digest(ia) {
                messy.replace_mirror(im, &a.pod_state(ia));
            }
            same_state(&a.pod_state(ia), &messy.pod_state(im), n)?;
        }
    }
}

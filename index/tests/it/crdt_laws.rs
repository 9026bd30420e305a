//! The per-pod join is a join-semilattice, `ApproxIndex::merge_pod` implements it, and replicas
//! exchanging deltas (lossy, duplicated, reordered) plus digest-driven anti-entropy converge.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use crdts::CvRDT;
use index::{ApproxIndex, BoundedPodState, Hlc, PodState};
use proptest::prelude::*;

/// Small domains: hash collisions, equal timestamps (ties by hash) and evictions are frequent.
fn arb_entries(max_len: usize) -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..12, 0u64..8), 0..max_len)
}

fn arb_state(name: &'static str) -> impl Strategy<Value = PodState> {
    (0u64..3, arb_entries(10)).prop_map(move |(epoch, entries)| PodState {
        name: name.to_string(),
        epoch,
        entries,
    })
}

fn arb_delta() -> impl Strategy<Value = PodState> {
    (
        prop::sample::select(vec!["a", "b", "c"]),
        0u64..3,
        arb_entries(8),
    )
        .prop_map(|(name, epoch, entries)| PodState {
            name: name.to_string(),
            epoch,
            entries,
        })
}

fn join<T: CvRDT + Clone>(a: &T, b: &T) -> T {
    let mut x = a.clone();
    x.merge(b.clone());
    x
}

fn bounded(k: usize, s: &PodState) -> BoundedPodState {
    BoundedPodState::new(k, s.clone())
}

fn exports(ix: &ApproxIndex) -> Vec<PodState> {
    ix.pod_names()
        .iter()
        .map(|n| ix.export_pod(n).unwrap())
        .collect()
}

fn matches(ix: &ApproxIndex, hashes: &[u64]) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    ix.match_prefix(hashes, &mut out);
    let mut v: Vec<_> = out
        .iter()
        .map(|m| (ix.pod_name(m.pod).unwrap().to_string(), m.blocks))
        .collect();
    v.sort();
    v
}

/// Pairwise digest comparison; ship full states of the pods that differ, both ways. Returns
/// whether anything was shipped.
fn anti_entropy(a: &mut ApproxIndex, b: &mut ApproxIndex) -> bool {
    let da: BTreeMap<_, _> = a
        .digests()
        .into_iter()
        .map(|d| (d.name.clone(), d))
        .collect();
    let db: BTreeMap<_, _> = b
        .digests()
        .into_iter()
        .map(|d| (d.name.clone(), d))
        .collect();
    let names: BTreeSet<&String> = da.keys().chain(db.keys()).collect();
    let mut shipped = false;
    for n in names {
        if da.get(n) == db.get(n) {
            continue;
        }
        shipped = true;
        let sa = a.export_pod(n);
        let sb = b.export_pod(n);
        if let Some(s) = sa {
            b.merge_pod(&s);
        }
        if let Some(s) = sb {
            a.merge_pod(&s);
        }
    }
    shipped
}

/// Anti-entropy over all pairs until nothing differs.
fn settle(replicas: &mut [ApproxIndex]) {
    for _round in 0..=replicas.len() {
        let mut shipped = false;
        for i in 0..replicas.len() {
            for j in i + 1..replicas.len() {
                let (l, r) = replicas.split_at_mut(j);
                shipped |= anti_entropy(&mut l[i], &mut r[0]);
            }
        }
        if !shipped {
            return;
        }
    }
    panic!("anti-entropy did not settle");
}

fn assert_all_equal(replicas: &[ApproxIndex]) {
    for r in &replicas[1..] {
        assert_eq!(exports(r), exports(&replicas[0]));
        assert_eq!(r.digests(), replicas[0].digests());
    }
}

/// Per replica: how it receives each delta (sort key, dropped, duplicated).
fn arb_delivery(n: usize) -> impl Strategy<Value = Vec<(u32, u32, bool, bool)>> {
    prop::collection::vec(
        (
            any::<u32>(),
            any::<u32>(),
            (0u8..4).prop_map(|x| x == 0),
            any::<bool>(),
        ),
        n,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn bounded_join_commutes(k in 1usize..8, a in arb_state("p"), b in arb_state("p")) {
        let (a, b) = (bounded(k, &a), bounded(k, &b));
        prop_assert_eq!(join(&a, &b), join(&b, &a));
    }

    #[test]
    fn bounded_join_associates(
        k in 1usize..8, a in arb_state("p"), b in arb_state("p"), c in arb_state("p"),
    ) {
        let (a, b, c) = (bounded(k, &a), bounded(k, &b), bounded(k, &c));
        prop_assert_eq!(join(&join(&a, &b), &c), join(&a, &join(&b, &c)));
    }

    #[test]
    fn bounded_join_is_idempotent(k in 1usize..8, a in arb_state("p"), b in arb_state("p")) {
        let a = bounded(k, &a);
        prop_assert_eq!(join(&a, &a), a.clone());
        // and absorbing: joining a state already included changes nothing
        let ab = join(&a, &bounded(k, &b));
        prop_assert_eq!(join(&ab, &a), ab);
    }

    #[test]
    fn bounded_join_keeps_k_and_the_higher_epoch(
        k in 1usize..8, a in arb_state("p"), b in arb_state("p"),
    ) {
        let j = join(&bounded(k, &a), &bounded(k, &b));
        prop_assert!(j.state().entries.len() <= k);
        prop_assert_eq!(j.state().epoch, a.epoch.max(b.epoch));
        if a.epoch != b.epoch {
            let winner = if a.epoch > b.epoch { &a } else { &b };
            prop_assert_eq!(&j, &bounded(k, winner));
        }
    }

    #[test]
    fn unbounded_join_laws(a in arb_state("p"), b in arb_state("p"), c in arb_state("p")) {
        let mut a = a;
        a.normalize();
        prop_assert_eq!(join(&a, &b), join(&b, &a));
        prop_assert_eq!(join(&join(&a, &b), &c), join(&a, &join(&b, &c)));
        prop_assert_eq!(join(&a, &a), a);
    }

    /// Coalescing deltas without a bound, then bounding, equals joining them bounded.
    #[test]
    fn bounding_commutes_with_joining(k in 1usize..8, a in arb_state("p"), b in arb_state("p")) {
        prop_assert_eq!(bounded(k, &join(&a, &b)), join(&bounded(k, &a), &bounded(k, &b)));
    }

    /// `merge_pod` on an index of capacity K = the `BoundedPodState` join, delta by delta; and it
    /// returns 0 exactly when the state did not change.
    #[test]
    fn merge_pod_agrees_with_cvrdt(k in 1usize..8, deltas in prop::collection::vec(arb_state("p"), 1..12)) {
        let mut ix = ApproxIndex::new(k);
        let mut reference = BoundedPodState::new(k, PodState::default());
        for d in &deltas {
            let before = ix.export_pod("p");
            let changed = ix.merge_pod(d);
            reference.merge(bounded(k, d));
            let after = ix.export_pod("p");
            prop_assert_eq!(after.as_ref(), Some(reference.state()));
            // a pod unknown before is (epoch 0, empty)
            let before = before.unwrap_or(PodState { name: "p".into(), ..PodState::default() });
            prop_assert_eq!(changed == 0, Some(before) == after);
        }
        // a coalesced (unbounded) delta has the same effect as the deltas one by one
        let mut coalesced = PodState::default();
        for d in &deltas {
            coalesced.merge(d.clone());
        }
        let mut ix2 = ApproxIndex::new(k);
        ix2.merge_pod(&coalesced);
        prop_assert_eq!(ix2.export_pod("p"), ix.export_pod("p"));
        prop_assert_eq!(ix2.digests(), ix.digests());
    }

    /// Replicas receiving the same deltas in different orders, duplicated, some dropped, then
    /// anti-entropy: equal states and digests, equal to the join of every delta received anywhere.
    #[test]
    fn replicas_converge(
        k in 1usize..8,
        deltas in prop::collection::vec(arb_delta(), 1..30),
        deliveries in prop::collection::vec(arb_delivery(30), 3..5),
    ) {
        let mut replicas: Vec<ApproxIndex> = Vec::new();
        let mut received = vec![false; deltas.len()];
        for delivery in &deliveries {
            let mut queue: Vec<(u32, usize)> = Vec::new();
            for (i, &(key, dup_key, dropped, dup)) in delivery.iter().take(deltas.len()).enumerate() {
                if dropped {
                    continue;
                }
                received[i] = true;
                queue.push((key, i));
                if dup {
                    queue.push((dup_key, i));
                }
            }
            queue.sort_unstable();
            let mut ix = ApproxIndex::new(k);
            for (_, i) in queue {
                ix.merge_pod(&deltas[i]);
            }
            replicas.push(ix);
        }
        settle(&mut replicas);
        assert_all_equal(&replicas);
        let mut reference: BTreeMap<&str, BoundedPodState> = BTreeMap::new();
        for (d, _) in deltas.iter().zip(&received).filter(|(_, r)| **r) {
            reference
                .entry(d.name.as_str())
                .or_insert_with(|| BoundedPodState::new(k, PodState::default()))
                .merge(bounded(k, d));
        }
        let expected: Vec<PodState> = reference
            .into_iter()
            .map(|(name, s)| {
                let mut s = s.into_state();
                s.name = name.to_string(); // an empty (epoch 0) delta leaves the name unset
                s
            })
            .collect();
        prop_assert_eq!(exports(&replicas[0]), expected);
    }

    /// Replicas inserting locally (own HLC, epoch bumps), broadcasting `insert_delta` deltas that
    /// may be lost, duplicated or delayed, then anti-entropy: equal states and digests.
    #[test]
    fn replicas_inserting_concurrently_converge(
        k in 1usize..8,
        ops in prop::collection::vec(
            (0usize..3, prop::sample::select(vec!["a", "b"]), prop::collection::vec(0u64..12, 0..6),
             0u64..50, (0u8..10).prop_map(|x| x == 0)),
            1..40),
        fates in prop::collection::vec((0u8..6, any::<u32>()), 120),
    ) {
        let mut replicas: Vec<ApproxIndex> = (0..3).map(|_| ApproxIndex::new(k)).collect();
        let mut clocks = [Hlc::default(); 3];
        let mut delayed: Vec<(u32, usize, PodState)> = Vec::new();
        let mut fates = fates.into_iter().cycle();
        for (origin, name, hashes, wall, bump) in ops {
            let ix = &mut replicas[origin];
            let delta = if bump {
                let epoch = ix.pod_id(name).and_then(|id| ix.epoch(id)).unwrap_or(0) + 1;
                ix.pod_with_epoch(name, epoch);
                ix.export_pod(name)
            } else {
                let id = ix.pod(name);
                let ts = clocks[origin].now(wall);
                ix.insert_delta(id, &hashes, ts)
            };
            let Some(delta) = delta else { continue };
            for to in (0..3).filter(|&to| to != origin) {
                let (fate, key) = fates.next().unwrap();
                match fate {
                    0 => {}                                          // lost
                    1 => delayed.push((key, to, delta.clone())),     // reordered
                    2 => {                                           // duplicated
                        replicas[to].merge_pod(&delta);
                        delayed.push((key, to, delta.clone()));
                    }
                    _ => {
                        replicas[to].merge_pod(&delta);
                    }
                }
                if let Some(ts) = delta.max_ts() {
                    clocks[to].observe(ts);
                }
            }
        }
        delayed.sort_by_key(|d| d.0);
        for (_, to, delta) in delayed {
            replicas[to].merge_pod(&delta);
        }
        settle(&mut replicas);
        assert_all_equal(&replicas);
    }

    /// Digest equality ⇔ state equality (tiny domains, so equal states are common).
    #[test]
    fn digests_equal_iff_states_equal(
        a in prop::collection::vec((0u64..2, prop::collection::vec((0u64..3, 0u64..2), 0..4)), 0..4),
        b in prop::collection::vec((0u64..2, prop::collection::vec((0u64..3, 0u64..2), 0..4)), 0..4),
    ) {
        let build = |ds: &[(u64, Vec<(u64, u64)>)]| {
            let mut ix = ApproxIndex::new(2);
            ix.pod("p");
            for (epoch, entries) in ds {
                ix.merge_pod(&PodState { name: "p".into(), epoch: *epoch, entries: entries.clone() });
            }
            ix
        };
        let (ia, ib) = (build(&a), build(&b));
        prop_assert_eq!(ia.digests() == ib.digests(), ia.export_pod("p") == ib.export_pod("p"));
        // the incremental digest equals one built from scratch
        let mut fresh = ApproxIndex::new(2);
        fresh.merge_pod(&ia.export_pod("p").unwrap());
        prop_assert_eq!(fresh.digests(), ia.digests());
    }

    /// Deltas of local inserts (and the full state after an epoch bump), applied on another index
    /// in any order with duplicates, reproduce the pod.
    #[test]
    fn insert_deltas_reproduce_the_pod(
        k in 1usize..8,
        ops in prop::collection::vec(
            (prop::collection::vec(0u64..16, 0..8), 0u64..20, (0u8..12).prop_map(|x| x == 0)),
            1..30),
        order in prop::collection::vec(any::<u32>(), 60),
    ) {
        let mut a = ApproxIndex::new(k);
        let id = a.pod("p");
        let mut deltas = Vec::new();
        for (hashes, ts, bump) in ops {
            if bump {
                let e = a.epoch(id).unwrap() + 1;
                prop_assert_eq!(a.pod_with_epoch("p", e), id);
                prop_assert_eq!(a.pod_len(id), 0);
                deltas.push(a.export_pod("p").unwrap());
                continue;
            }
            let before = a.export_pod("p");
            let delta = a.insert_delta(id, &hashes, ts);
            prop_assert_eq!(delta.is_none(), a.export_pod("p") == before);
            if let Some(d) = &delta {
                prop_assert!(d.entries.iter().all(|e| e.1 == ts));
                prop_assert!(d.entries.len() <= hashes.len());
            }
            deltas.extend(delta);
        }
        // in order
        let mut b = ApproxIndex::new(k);
        b.pod("p");
        for d in &deltas {
            b.merge_pod(d);
        }
        prop_assert_eq!(b.export_pod("p"), a.export_pod("p"));
        // shuffled, each twice
        let mut shuffled: Vec<(u32, &PodState)> =
            deltas.iter().chain(&deltas).enumerate().map(|(i, d)| (order[i % order.len()], d)).collect();
        shuffled.sort_by_key(|x| x.0);
        let mut c = ApproxIndex::new(k);
        c.pod("p");
        for (_, d) in shuffled {
            c.merge_pod(d);
        }
        prop_assert_eq!(c.export_pod("p"), a.export_pod("p"));
        prop_assert_eq!(c.digests(), a.digests());
    }

    /// `match_prefix` on an index fed by deltas = on the index that inserted locally.
    #[test]
    fn match_prefix_after_merging(
        k in 4usize..40,
        ops in prop::collection::vec((0usize..4, 0u64..3, 1usize..10, 0u64..30), 1..25),
        queries in prop::collection::vec((0u64..3, 0usize..12), 1..6),
    ) {
        // chains: three base chains, requests take a prefix of one
        let chain = |base: u64, n: usize| -> Vec<u64> { (0..n as u64).map(|i| base * 100 + i).collect() };
        let names = ["p0", "p1", "p2", "p3"];
        let mut a = ApproxIndex::new(k);
        let mut b = ApproxIndex::new(k);
        for (pod, base, n, ts) in ops {
            let id = a.pod(names[pod]);
            if let Some(d) = a.insert_delta(id, &chain(base, n), ts) {
                b.merge_pod(&d);
            }
        }
        for (base, n) in queries {
            let q = chain(base, n);
            prop_assert_eq!(matches(&b, &q), matches(&a, &q));
        }
        prop_assert_eq!(b.distinct_hashes(), a.distinct_hashes());
    }
}

#[test]
fn epoch_bump_clears() {
    let mut ix = ApproxIndex::new(10);
    let p = ix.pod("p");
    ix.insert(p, &[1, 2, 3], 5);
    assert_eq!(ix.epoch(p), Some(0));
    // an older incarnation changes nothing
    assert_eq!(
        ix.merge_pod(&PodState {
            name: "p".into(),
            epoch: 0,
            entries: vec![(1, 4)]
        }),
        0
    );
    // a newer one replaces the pod's entries (and the reverse map)
    let changed = ix.merge_pod(&PodState {
        name: "p".into(),
        epoch: 2,
        entries: vec![(9, 1)],
    });
    assert_eq!(changed, 4); // 3 dropped + 1 inserted
    assert_eq!(ix.epoch(p), Some(2));
    assert_eq!(matches(&ix, &[1, 2]), vec![]);
    assert_eq!(matches(&ix, &[9]), vec![("p".into(), 1)]);
    // stale deltas of the old incarnation are ignored
    assert_eq!(
        ix.merge_pod(&PodState {
            name: "p".into(),
            epoch: 1,
            entries: vec![(1, 100)]
        }),
        0
    );
    // an empty newer incarnation still counts as a change
    assert_eq!(
        ix.merge_pod(&PodState {
            name: "p".into(),
            epoch: 3,
            entries: vec![]
        }),
        1
    );
    assert_eq!(ix.pod_len(p), 0);
    assert_eq!(ix.distinct_hashes(), 0);
}

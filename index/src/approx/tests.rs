use super::state::entry_mix;
use super::*;

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

#[test]
fn longest_leading_run_per_pod() {
    let mut ix = ApproxIndex::new(100);
    let a = ix.pod("a");
    let b = ix.pod("b");
    ix.insert(a, &[1, 2, 3, 4], 10);
    ix.insert(b, &[1, 2, 9], 11);
    assert_eq!(
        matches(&ix, &[1, 2, 3, 4, 5]),
        vec![("a".into(), 4), ("b".into(), 2)]
    );
    assert_eq!(matches(&ix, &[7, 1, 2]), vec![]);
    assert_eq!(matches(&ix, &[]), vec![]);
    // A hole ends a pod's run even if later blocks are held.
    let c = ix.pod("c");
    ix.insert(c, &[1, 3], 12);
    assert_eq!(
        matches(&ix, &[1, 2, 3]),
        vec![("a".into(), 3), ("b".into(), 2), ("c".into(), 1)]
    );
}

/// Blocks held by many pods (a shared system prompt) are matched through marks, not pod by pod:
/// the same runs either way, holes included, as the runs thin out below the marking threshold.
#[test]
fn runs_over_blocks_every_pod_holds() {
    let mut ix = ApproxIndex::new(100);
    let chain: Vec<u64> = (1..=12).collect();
    let mut want = Vec::new();
    for i in 0..40usize {
        let name = format!("p{i:02}");
        let id = ix.pod(&name);
        // Pod i holds the first i % 12 + 1 blocks; every fifth pod also the block after a hole.
        let run = i % 12 + 1;
        ix.insert(id, &chain[..run], 10);
        if i % 5 == 0 && run + 1 < chain.len() {
            ix.insert(id, &[chain[run + 1]], 11);
        }
        want.push((name, run));
    }
    // A pod holding only later blocks has no run.
    let late = ix.pod("late");
    ix.insert(late, &chain[2..], 12);
    assert_eq!(matches(&ix, &chain), want);
    // A prompt diverging after the shared blocks.
    let mut other = chain[..3].to_vec();
    other.push(99);
    let capped: Vec<(String, usize)> = want.iter().map(|(n, r)| (n.clone(), (*r).min(3))).collect();
    assert_eq!(matches(&ix, &other), capped);
}

#[test]
fn bounded_lru_evicts_oldest_then_smaller_hash() {
    let mut ix = ApproxIndex::new(3);
    let a = ix.pod("a");
    ix.insert(a, &[10, 20], 1);
    ix.insert(a, &[30], 2);
    ix.insert(a, &[10], 3); // refresh 10
    ix.insert(a, &[40], 4); // evicts the oldest: 20 (ts 1)
    assert_eq!(ix.pod_len(a), 3);
    assert_eq!(ix.timestamp(a, 20), None);
    assert_eq!(ix.timestamp(a, 10), Some(3));
    // tie at the same timestamp: the smaller hash goes first
    let mut ix = ApproxIndex::new(2);
    let a = ix.pod("a");
    ix.insert(a, &[9, 5, 7], 1);
    assert_eq!(ix.timestamp(a, 5), None);
    assert_eq!(ix.pod_len(a), 2);
    assert_eq!(ix.distinct_hashes(), 2);
}

#[test]
fn older_timestamp_does_not_regress() {
    let mut ix = ApproxIndex::new(10);
    let a = ix.pod("a");
    ix.insert(a, &[1], 5);
    ix.insert(a, &[1], 3);
    assert_eq!(ix.timestamp(a, 1), Some(5));
}

#[test]
fn capacity_and_removal() {
    let mut ix = ApproxIndex::new(10);
    let a = ix.pod("a");
    let b = ix.pod("b");
    ix.insert(a, &[1, 2, 3, 4], 1);
    ix.insert(b, &[1, 2], 1);
    ix.set_capacity(a, 2);
    assert_eq!(ix.pod_len(a), 2);
    ix.remove_pod("b");
    assert_eq!(ix.pod_id("b"), None);
    assert_eq!(ix.len(), 2);
    // the id is reused, and starts empty
    let c = ix.pod("c");
    assert_eq!(c, b);
    assert_eq!(ix.pod_len(c), 0);
    assert!(matches(&ix, &[1]).iter().all(|(n, _)| n != "c"));
}
#[test]
fn pod_with_epoch_clears_older_incarnations_only() {
    let mut ix = ApproxIndex::new(10);
    let a = ix.pod_with_epoch("a", 3);
    assert_eq!(ix.epoch(a), Some(3));
    ix.insert(a, &[1, 2], 1);
    // same or older: unchanged
    assert_eq!(ix.pod_with_epoch("a", 3), a);
    assert_eq!(ix.pod_with_epoch("a", 1), a);
    assert_eq!(ix.pod("a"), a);
    assert_eq!((ix.epoch(a), ix.pod_len(a)), (Some(3), 2));
    // newer: emptied, reverse map too
    assert_eq!(ix.pod_with_epoch("a", 4), a);
    assert_eq!((ix.epoch(a), ix.pod_len(a)), (Some(4), 0));
    assert_eq!(matches(&ix, &[1]), vec![]);
    assert_eq!(ix.distinct_hashes(), 0);
    assert_eq!(ix.digests()[0].digest, 0);
}

#[test]
fn digests_track_state_and_sort_by_name() {
    let mut ix = ApproxIndex::new(2);
    let b = ix.pod("b");
    let a = ix.pod("a");
    ix.insert(b, &[1, 2], 5);
    ix.insert(a, &[1, 2], 5);
    let d = ix.digests();
    assert_eq!(d[0].name, "a");
    assert_eq!((d[0].len, d[0].digest), (d[1].len, d[1].digest));
    // refresh then evict on a: differs from b until b follows the same steps
    ix.insert(a, &[1], 6);
    ix.insert(a, &[3], 7);
    assert_ne!(ix.digests()[0].digest, ix.digests()[1].digest);
    ix.insert(b, &[3, 1], 7);
    assert_ne!(ix.digests()[0].digest, ix.digests()[1].digest); // (1,7) vs (1,6)
    ix.insert(a, &[1], 7);
    assert_eq!(ix.digests()[0].digest, ix.digests()[1].digest);
    assert_eq!(ix.export_pod("a").unwrap().entries, vec![(1, 7), (3, 7)]);
    assert_eq!(ix.pod_names(), vec!["a".to_string(), "b".to_string()]);
}

#[test]
fn insert_delta_reports_changed_kept_entries() {
    let mut ix = ApproxIndex::new(3);
    let a = ix.pod("a");
    let d = ix.insert_delta(a, &[1, 2], 5).unwrap();
    assert_eq!(
        (d.name.as_str(), d.epoch, d.entries),
        ("a", 0, vec![(1, 5), (2, 5)])
    );
    // already held at >= ts
    assert_eq!(ix.insert_delta(a, &[1, 2], 5), None);
    assert_eq!(ix.insert_delta(a, &[2], 4), None);
    // older than everything held, evicted at once: no news
    ix.insert(a, &[3], 6);
    assert_eq!(ix.insert_delta(a, &[9], 1), None);
    assert_eq!(ix.timestamp(a, 9), None);
    // more hashes than capacity: only the kept ones (at equal ts the greater hashes stay)
    let d = ix.insert_delta(a, &[5, 6, 7, 8], 10).unwrap();
    assert_eq!(d.entries, vec![(6, 10), (7, 10), (8, 10)]);
}

#[test]
fn heap_estimate_grows_with_entries() {
    let mut ix = ApproxIndex::new(100_000);
    let empty = ix.approx_heap_bytes();
    let a = ix.pod("a");
    let b = ix.pod("b");
    let hashes: Vec<u64> = (0..10_000u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    ix.insert(a, &hashes, 1);
    let per_entry = (ix.approx_heap_bytes() - empty) / hashes.len();
    // node 24 (slab grown by eighths), reverse slot 16+1 at a load factor in (7/16, 7/8]
    assert!((40..70).contains(&per_entry), "{per_entry} bytes/entry");
    // a second holder of each hash spills both to a side vector
    ix.insert(b, &hashes, 2);
    assert!(ix.rev.spill_bytes >= 2 * hashes.len() * 8);
    ix.remove_pod("b");
    assert_eq!(ix.rev.spill_bytes, 0);
    assert_eq!(ix.distinct_hashes(), hashes.len());
    ix.remove_pod("a");
    assert_eq!((ix.rev.spill_bytes, ix.distinct_hashes()), (0, 0));
}

/// The index against a plain model (per pod: hash → ts, evict the smallest (ts, hash)) under
/// random inserts, merges with old and new timestamps, capacity changes and removals, pods
/// sharing hashes: same entries, digests and matches after every step.
#[test]
fn agrees_with_a_plain_model() {
    use std::collections::BTreeMap;
    type Model = BTreeMap<String, BTreeMap<u64, u64>>;
    fn evict(m: &mut BTreeMap<u64, u64>, k: usize) {
        while m.len() > k {
            let (&h, _) = m.iter().min_by_key(|(h, t)| (**t, **h)).unwrap();
            m.remove(&h);
        }
    }
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let names = ["a", "b", "c", "d"];
    let mut ix = ApproxIndex::new(6);
    let mut model: Model = BTreeMap::new();
    let mut caps: BTreeMap<String, usize> = BTreeMap::new();
    let mut clock = 100;
    for step in 0..4000 {
        let name = names[next(4) as usize];
        let cap = *caps.get(name).unwrap_or(&6);
        match next(10) {
            0..=4 => {
                clock += 1;
                let hashes: Vec<u64> = (0..next(8)).map(|_| next(24)).collect();
                let id = ix.pod(name);
                ix.insert(id, &hashes, clock);
                let m = model.entry(name.to_string()).or_default();
                for h in hashes {
                    let t = m.entry(h).or_insert(clock);
                    *t = (*t).max(clock);
                }
                evict(m, cap);
            }
            5..=7 => {
                // a peer's delta: timestamps around and well before the clock, duplicates
                let entries: Vec<(u64, u64)> = (0..next(10))
                    .map(|_| (next(24), clock.saturating_sub(next(40))))
                    .collect();
                let delta = PodState {
                    name: name.into(),
                    epoch: 0,
                    entries,
                };
                ix.merge_pod(&delta);
                let m = model.entry(name.to_string()).or_default();
                for (h, t) in delta.entries {
                    let e = m.entry(h).or_insert(t);
                    *e = (*e).max(t);
                }
                evict(m, cap);
            }
            8 => {
                let id = ix.pod(name);
                let k = 1 + next(8) as usize;
                ix.set_capacity(id, k);
                caps.insert(name.to_string(), k);
                evict(model.entry(name.to_string()).or_default(), k);
            }
            _ => {
                ix.remove_pod(name);
                model.remove(name);
                caps.remove(name);
            }
        }
        for (name, m) in &model {
            let got = ix.export_pod(name).unwrap();
            let want: Vec<(u64, u64)> = m.iter().map(|(h, t)| (*h, *t)).collect();
            assert_eq!(got.entries, want, "step {step}, pod {name}");
            let digest = m
                .iter()
                .fold(0u64, |d, (h, t)| d.wrapping_add(entry_mix(*h, *t)));
            let id = ix.pod_id(name).unwrap();
            assert_eq!(ix.pod_len(id), m.len());
            let got = ix.digests().into_iter().find(|d| &d.name == name).unwrap();
            assert_eq!(got.digest, digest, "step {step}, pod {name}");
        }
        let chain: Vec<u64> = (0..4).map(|_| next(24)).collect();
        let mut want: Vec<(String, usize)> = model
            .iter()
            .map(|(n, m)| {
                (
                    n.clone(),
                    chain.iter().take_while(|h| m.contains_key(h)).count(),
                )
            })
            .filter(|(_, k)| *k > 0)
            .collect();
        want.sort();
        assert_eq!(matches(&ix, &chain), want, "step {step}");
        assert_eq!(ix.len(), model.values().map(BTreeMap::len).sum::<usize>());
    }
}

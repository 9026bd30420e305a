//! `max-score-picker`: the highest total score wins; ties are broken at random (uniformly). With
//! `maxNumOfEndpoints` > 1 the next best follow as fallbacks.
//!
//! Linear in the candidates (1000 pods: a sort would cost more than the scoring): the single
//! pick is a reservoir choice among the best; fallbacks are a selection of the best `n` by score,
//! then a random key, sorted.

use std::cmp::Ordering;

use rand::Rng;

use super::Picker;

pub const TYPE: &str = "max-score-picker";

#[derive(Debug)]
pub struct MaxScorePicker {
    pub max_endpoints: usize,
}

impl Picker for MaxScorePicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(&self, scored: &mut Vec<(usize, f64)>, rng: &mut dyn rand::RngCore) -> Vec<usize> {
        let n = self.max_endpoints.max(1);
        if n == 1 {
            return best_one(scored, rng).into_iter().collect();
        }
        // Best first; equal scores in the order of independent random keys.
        let mut keyed: Vec<(f64, u64, usize)> = scored
            .iter()
            .map(|&(i, s)| (s, rng.random::<u64>(), i))
            .collect();
        let order =
            |a: &(f64, u64, usize), b: &(f64, u64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if n < keyed.len() {
            keyed.select_nth_unstable_by(n - 1, order);
            keyed.truncate(n);
        }
        keyed.sort_unstable_by(order);
        keyed.into_iter().map(|(_, _, i)| i).collect()
    }
}

/// The best-scored candidate, uniformly at random among equals (reservoir sampling).
fn best_one(scored: &[(usize, f64)], rng: &mut dyn rand::RngCore) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    // How many candidates share the best score so far: the k-th replaces the pick with odds 1/k.
    let mut ties = 0u32;
    for &(i, s) in scored {
        match best.map(|(_, b)| s.total_cmp(&b)) {
            None | Some(Ordering::Greater) => {
                best = Some((i, s));
                ties = 1;
            }
            Some(Ordering::Equal) => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((i, s));
                }
            }
            Some(Ordering::Less) => {}
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn best_first_with_fallbacks() {
        let p = MaxScorePicker { max_endpoints: 2 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut s = vec![(0, 0.1), (1, 0.9), (2, 0.5)];
        assert_eq!(p.pick(&mut s, &mut rng), vec![1, 2]);
    }

    #[test]
    fn ties_are_random() {
        let p = MaxScorePicker { max_endpoints: 1 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            let mut s = vec![(0, 1.0), (1, 1.0), (2, 0.0)];
            seen[p.pick(&mut s, &mut rng)[0]] += 1;
        }
        assert!(seen[0] > 100 && seen[1] > 100, "{seen:?}");
        assert_eq!(seen[2], 0);
    }

    #[test]
    fn fallbacks_ties_are_random_and_ordered() {
        let p = MaxScorePicker { max_endpoints: 3 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut first = [0usize; 5];
        for _ in 0..600 {
            let mut s = vec![(0, 0.5), (1, 1.0), (2, 1.0), (3, 1.0), (4, 0.9)];
            let picked = p.pick(&mut s, &mut rng);
            assert_eq!(picked.len(), 3);
            let mut top: Vec<usize> = picked.clone();
            top.sort_unstable();
            assert_eq!(top, vec![1, 2, 3], "the three best, whatever the ties");
            first[picked[0]] += 1;
        }
        assert!(first[1..4].iter().all(|&n| n > 150), "{first:?}");
        // Fewer candidates than asked: all of them, best first.
        let mut s = vec![(0, 0.1), (1, 0.9)];
        assert_eq!(p.pick(&mut s, &mut rng), vec![1, 0]);
    }

    #[test]
    fn single_pick_ties_are_uniform_among_many() {
        let p = MaxScorePicker { max_endpoints: 1 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut seen = [0usize; 6];
        for _ in 0..6000 {
            let mut s = vec![(0, 0.2), (1, 0.7), (2, 0.7), (3, 0.1), (4, 0.7), (5, 0.7)];
            seen[p.pick(&mut s, &mut rng)[0]] += 1;
        }
        for i in [1, 2, 4, 5] {
            assert!((1300..1700).contains(&seen[i]), "{seen:?}");
        }
        assert_eq!(seen[0] + seen[3], 0);
    }

    #[test]
    fn empty_input() {
        let p = MaxScorePicker { max_endpoints: 3 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert!(p.pick(&mut vec![], &mut rng).is_empty());
    }
}

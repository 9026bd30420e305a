//! `weighted-random-picker`: samples endpoints in proportion to their scores, without replacement
//! (each gets the key U^(1/score), the largest keys win). All scores 0 → uniform random.

use rand::Rng;
use rand::seq::SliceRandom;

use super::Picker;

pub const TYPE: &str = "weighted-random-picker";

#[derive(Debug)]
pub struct WeightedRandomPicker {
    pub max_endpoints: usize,
}

impl Picker for WeightedRandomPicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(&self, scored: &mut Vec<(usize, f64)>, rng: &mut dyn rand::RngCore) -> Vec<usize> {
        if scored.iter().all(|(_, s)| *s <= 0.0) {
            scored.shuffle(rng);
            return super::first_n(scored, self.max_endpoints);
        }
        let mut keyed: Vec<(usize, f64)> = scored
            .iter()
            .map(|&(i, s)| {
                let key = if s > 0.0 {
                    let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
                    u.powf(1.0 / s)
                } else {
                    -1.0 // zero-score endpoints only after every positive one
                };
                (i, key)
            })
            .collect();
        keyed.sort_by(|a, b| b.1.total_cmp(&a.1));
        super::first_n(&keyed, self.max_endpoints)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn proportional_to_score() {
        let p = WeightedRandomPicker { max_endpoints: 1 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut seen = [0usize; 3];
        for _ in 0..6000 {
            let mut s = vec![(0, 3.0), (1, 1.0), (2, 0.0)];
            seen[p.pick(&mut s, &mut rng)[0]] += 1;
        }
        // expected 4500 / 1500 / 0
        assert!((4200..4800).contains(&seen[0]), "{seen:?}");
        assert!((1200..1800).contains(&seen[1]), "{seen:?}");
        assert_eq!(seen[2], 0);
    }

    #[test]
    fn all_zero_is_uniform_and_n_distinct() {
        let p = WeightedRandomPicker { max_endpoints: 2 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut s = vec![(0, 0.0), (1, 0.0), (2, 0.0)];
        let got = p.pick(&mut s, &mut rng);
        assert_eq!(got.len(), 2);
        assert_ne!(got[0], got[1]);
        let mut s = vec![(0, 0.0), (1, 2.0)];
        assert_eq!(p.pick(&mut s, &mut rng), vec![1, 0]);
    }
}

//! `random-picker`: a uniformly random order, ignoring scores.

use rand::seq::SliceRandom;

use super::Picker;

pub const TYPE: &str = "random-picker";

#[derive(Debug)]
pub struct RandomPicker {
    pub max_endpoints: usize,
}

impl Picker for RandomPicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(&self, scored: &mut Vec<(usize, f64)>, rng: &mut dyn rand::RngCore) -> Vec<usize> {
        scored.shuffle(rng);
        super::first_n(scored, self.max_endpoints)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn spreads_over_all() {
        let p = RandomPicker { max_endpoints: 1 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            let mut s = vec![(0, 1.0), (1, 0.0), (2, 0.5)];
            seen[p.pick(&mut s, &mut rng)[0]] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }

    #[test]
    fn n_distinct() {
        let p = RandomPicker { max_endpoints: 3 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut s = vec![(0, 1.0), (1, 0.0)];
        let mut got = p.pick(&mut s, &mut rng);
        got.sort();
        assert_eq!(got, vec![0, 1]);
    }
}

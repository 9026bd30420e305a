//! `max-score-picker`: the highest total score wins; ties are broken at random (shuffle, then a
//! stable sort). With `maxNumOfEndpoints` > 1 the next best follow as fallbacks.

use rand::seq::SliceRandom;

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
        scored.shuffle(rng);
        scored.sort_by(|a, b| b.1.total_cmp(&a.1));
        super::first_n(scored, self.max_endpoints)
    }
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
    fn empty_input() {
        let p = MaxScorePicker { max_endpoints: 3 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert!(p.pick(&mut vec![], &mut rng).is_empty());
    }
}

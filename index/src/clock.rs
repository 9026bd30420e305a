//! A hybrid logical clock for replicated timestamps.
//!
//! Timestamps are microseconds since the UNIX epoch packed in a `u64`. The wall time is an input
//! (no clock is read here). [`Hlc::now`] never goes backwards and never repeats, even if the wall
//! clock does; [`Hlc::observe`] folds in timestamps received from other replicas, so a later local
//! timestamp is above every one seen (a refresh here supersedes what a peer recorded).

/// The last timestamp issued or observed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Hlc {
    last: u64,
}

impl Hlc {
    /// A timestamp for a local event at wall time `wall_us`: `max(wall_us, last + 1)`, stored.
    pub fn now(&mut self, wall_us: u64) -> u64 {
        let t = wall_us.max(self.last.saturating_add(1));
        self.last = t;
        t
    }

    /// Fold in a timestamp from another replica.
    pub fn observe(&mut self, remote: u64) {
        self.last = self.last.max(remote);
    }

    /// The last timestamp issued or observed.
    pub fn last(&self) -> u64 {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_above_observed() {
        let mut c = Hlc::default();
        assert_eq!(c.now(100), 100);
        // wall clock stalls or steps back: still strictly increasing
        assert_eq!(c.now(100), 101);
        assert_eq!(c.now(50), 102);
        // a peer ahead of us
        c.observe(1_000);
        assert_eq!(c.now(200), 1_001);
        // observing the past changes nothing
        c.observe(10);
        assert_eq!(c.now(2_000), 2_000);
        assert_eq!(c.last(), 2_000);
    }
}

//! One budget for the request bodies every stream buffers at once (`--max-buffered-body-bytes`).
//!
//! Each stream may buffer up to `--max-body-bytes` before it can route (the body must be whole to
//! be parsed), and nothing else bounds the sum: 300 clients each sending 60 MiB would ask for
//! 18 GiB. A stream reserves each chunk before keeping it; a chunk that does not fit ends the
//! request with a retryable 503 (`body-buffer-budget`) instead of the replica being OOM-killed
//! with every stream it holds. The reservation is returned when the body leaves (routed, refused
//! or the stream gone).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::metrics::Metrics;

#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl BodyBudget {
    pub fn new(limit: usize, metrics: Arc<Metrics>) -> Self {
        BodyBudget {
            limit,
            used: AtomicUsize::new(0),
            metrics,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Take `n` more bytes of the budget, if they fit.
    fn take(&self, n: usize) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= self.limit)
            });
        match taken {
            Ok(before) => {
                self.metrics.set_buffered_body_bytes(before + n);
                true
            }
            Err(_) => false,
        }
    }

    fn give_back(&self, n: usize) {
        let before = self.used.fetch_sub(n, Ordering::AcqRel);
        self.metrics
            .set_buffered_body_bytes(before.saturating_sub(n));
    }
}

/// What one stream holds of the budget; returned when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl Reservation {
    pub fn new(budget: Arc<BodyBudget>) -> Self {
        Reservation { budget, bytes: 0 }
    }

    /// Reserve `n` more bytes: false (nothing reserved) when the budget cannot hold them.
    pub fn grow(&mut self, n: usize) -> bool {
        if n == 0 || self.budget.take(n) {
            self.bytes += n;
            true
        } else {
            false
        }
    }

    /// Return everything reserved so far.
    pub fn release(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
            self.bytes = 0;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_budget_and_return_it() {
        let m = Arc::new(Metrics::new("pool"));
        let b = Arc::new(BodyBudget::new(100, m.clone()));
        let mut a = Reservation::new(b.clone());
        let mut c = Reservation::new(b.clone());
        assert!(a.grow(60));
        assert!(!c.grow(41), "over the budget: refused, nothing taken");
        assert!(c.grow(40));
        assert!(!a.grow(1));
        assert!(
            m.encode().contains("llm_d_epp_buffered_body_bytes 100"),
            "{}",
            m.encode()
        );
        a.release();
        assert!(c.grow(60));
        drop(c);
        assert!(a.grow(100), "a dropped reservation gives its bytes back");
    }
}

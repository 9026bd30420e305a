//! The wall clock replicas read, with an offset tests can inject (`--clock-offset-ms`), so a
//! member's skew can be simulated on one machine. Nothing replicated depends on members' clocks
//! agreeing: each log entry is stamped with its leader's clock as the leader appends it
//! ([`crate::Batch::stamp_us`]), and the replicated state takes its time from those stamps.

use std::sync::RwLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Where time comes from instead of the system clock (µs since the epoch), when set.
static SOURCE: RwLock<Option<fn() -> u64>> = RwLock::new(None);

/// Read the time from `source` (µs since the UNIX epoch) instead of the system clock — a
/// simulation's virtual clock; `None` restores the system clock.
pub fn set_source(source: Option<fn() -> u64>) {
    *SOURCE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = source;
}

/// Shift this process's wall clock by `ms` (tests of clock skew).
pub fn set_offset_ms(ms: i64) {
    OFFSET_MS.store(ms, Ordering::Relaxed);
}

/// The injected offset.
pub fn offset_ms() -> i64 {
    OFFSET_MS.load(Ordering::Relaxed)
}

/// Microseconds since the UNIX epoch, offset applied.
pub fn now_us() -> u64 {
    let source = *SOURCE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let real = match source {
        Some(source) => source() as i64,
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64),
    };
    real.saturating_add(offset_ms().saturating_mul(1000)).max(0) as u64
}

/// Milliseconds since the UNIX epoch, offset applied.
pub fn now_ms() -> u64 {
    now_us() / 1000
}

//! The simple model's latencies, and sleeping them.

use std::time::Duration;

use crate::knobs::PodKnobs;

pub(super) fn ms(v: f64) -> Duration {
    Duration::try_from_secs_f64(v / 1000.0).unwrap_or(Duration::ZERO)
}

/// Time from getting a slot to the first output token.
/// Sleep for `d`; a zero duration returns at once (tokio's timer would round it up to its 1 ms
/// tick, which matters when `time_scale` is 0 and the simulator stands in for an instant backend).
pub async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Sleep until `due` unless it has passed already.
pub async fn pause_until(due: tokio::time::Instant) {
    if due > tokio::time::Instant::now() {
        tokio::time::sleep_until(due).await;
    }
}

pub fn ttft(knobs: &PodKnobs, uncached_tokens: usize) -> Duration {
    let base = knobs.prefill_overhead_ms
        + uncached_tokens as f64 * knobs.prefill_us_per_token / 1000.0
        + knobs.extra_latency_ms;
    ms(base * knobs.time_scale)
}

/// Swap-in cost of a LoRA adapter that was not resident.
pub fn lora_load(knobs: &PodKnobs) -> Duration {
    ms(knobs.lora_load_ms * knobs.time_scale)
}

/// Time between two output tokens.
pub fn inter_token(knobs: &PodKnobs) -> Duration {
    ms(knobs.decode_ms_per_token * knobs.time_scale)
}

/// Whether this request should get an injected failure.
pub fn inject_failure(knobs: &PodKnobs) -> bool {
    knobs.error_rate > 0.0 && rand::random::<f64>() < knobs.error_rate
}

/// Wall-clock seconds since the UNIX epoch, millisecond resolution (as Prometheus' process
/// collector reports `process_start_time_seconds`).
pub(super) fn unix_now_s() -> f64 {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    ms as f64 / 1000.0
}

//! One simulated engine: knobs, the running-slot semaphore with its FIFO queue, the prefix cache and
//! the counters behind `/metrics`. Request handlers drive a request through [`Pod::admit`] (queue, then
//! cache lookup), [`Running::prefilled`] (blocks enter the cache) and [`Running::finish`]; the RAII
//! guards keep the gauges truthful even when a client disconnects half-way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::SimError;
use crate::cache::{PrefixCache, block_hashes};
use crate::knobs::{KnobsPatch, PodKnobs};

/// A snapshot of one pod's gauges and counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PodStats {
    /// Completed generation requests.
    pub served: u64,
    pub running: u64,
    pub waiting: u64,
    /// Blocks held by running requests / capacity, clamped to 1.
    pub kv_usage: f64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits_tokens: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries_tokens: u64,
    /// Requests answered with an error (injected 500s and rejected requests).
    pub errors: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Output tokens of completed requests.
    pub generation_tokens: u64,
    /// Blocks currently in the prefix cache (pinned or free).
    pub cached_blocks: u64,
}

#[derive(Debug, Default)]
struct Counters {
    served: u64,
    errors: u64,
    prefix_hits_tokens: u64,
    prefix_queries_tokens: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
}

#[derive(Debug)]
struct PodState {
    knobs: PodKnobs,
    cache: PrefixCache,
    /// Blocks held by running requests that are not (yet) in the cache: uncached prompt blocks during
    /// prefill, the partial last block and the decode blocks.
    extra_held: usize,
    running: usize,
    waiting: usize,
    /// Permits still to be withdrawn after `max_num_seqs` shrank while they were in use.
    permit_debt: usize,
    counters: Counters,
}

impl PodState {
    fn kv_usage(&self) -> f64 {
        let held = self.cache.pinned() + self.extra_held;
        (held as f64 / self.knobs.kv_blocks.max(1) as f64).min(1.0)
    }

    fn evict(&mut self) {
        let budget = self.knobs.kv_blocks.saturating_sub(self.extra_held);
        self.cache.evict_to(budget);
    }
}

/// The engine was stopped while the request waited.
#[derive(Debug, thiserror::Error)]
#[error("engine is shutting down")]
pub struct EngineClosed;

/// A simulated vLLM engine.
#[derive(Debug)]
pub struct Pod {
    pub index: usize,
    pub name: String,
    pub addr: SocketAddr,
    pub model: String,
    slots: Arc<Semaphore>,
    state: Mutex<PodState>,
    next_id: AtomicU64,
}

impl Pod {
    pub fn new(index: usize, addr: SocketAddr, model: String, knobs: PodKnobs) -> Pod {
        Pod {
            index,
            name: format!("sim-{index}"),
            addr,
            model,
            slots: Arc::new(Semaphore::new(knobs.max_num_seqs)),
            state: Mutex::new(PodState {
                knobs,
                cache: PrefixCache::new(),
                extra_held: 0,
                running: 0,
                waiting: 0,
                permit_debt: 0,
                counters: Counters::default(),
            }),
            next_id: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PodState> {
        // A panic while holding the lock cannot leave the state half-updated in a way that matters
        // more than losing the simulator, so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn knobs(&self) -> PodKnobs {
        self.lock().knobs.clone()
    }

    /// Applies `patch` after validating the result. A smaller `max_num_seqs` takes effect as running
    /// requests finish.
    pub fn set_knobs(&self, patch: &KnobsPatch) -> Result<(), SimError> {
        let mut st = self.lock();
        let new = st.knobs.patched(patch);
        new.validate()?;
        let old = st.knobs.max_num_seqs;
        if new.max_num_seqs > old {
            let mut add = new.max_num_seqs - old;
            let repay = add.min(st.permit_debt);
            st.permit_debt -= repay;
            add -= repay;
            self.slots.add_permits(add);
        } else if new.max_num_seqs < old {
            let remove = old - new.max_num_seqs;
            let forgotten = self.slots.forget_permits(remove);
            st.permit_debt += remove - forgotten;
        }
        st.knobs = new;
        st.evict();
        Ok(())
    }

    pub fn stats(&self) -> PodStats {
        let st = self.lock();
        PodStats {
            served: st.counters.served,
            running: st.running as u64,
            waiting: st.waiting as u64,
            kv_usage: st.kv_usage(),
            prefix_hits_tokens: st.counters.prefix_hits_tokens,
            prefix_queries_tokens: st.counters.prefix_queries_tokens,
            errors: st.counters.errors,
            prompt_tokens: st.counters.prompt_tokens,
            generation_tokens: st.counters.generation_tokens,
            cached_blocks: st.cache.len() as u64,
        }
    }

    pub fn record_error(&self) {
        self.lock().counters.errors += 1;
    }

    /// A per-pod unique request number.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Drops every cached block that no running request holds (vLLM's `/reset_prefix_cache`), so a
    /// comparison run starts cold. Returns how many blocks were dropped.
    pub fn reset_prefix_cache(&self) -> usize {
        self.lock().cache.evict_to(0)
    }

    /// Wakes every queued request with [`EngineClosed`].
    pub fn close(&self) {
        self.slots.close();
    }

    /// Waits for a running slot (FIFO), then looks the prompt up in the prefix cache and pins the hit
    /// blocks. `output_tokens` sizes the blocks the request will hold.
    pub async fn admit(
        self: &Arc<Self>,
        tokens: &[u32],
        output_tokens: u32,
        knobs: &PodKnobs,
    ) -> Result<Running, EngineClosed> {
        let bs = knobs.block_size.max(1);
        let hashes = block_hashes(tokens, bs);
        let mut queued = Queued::new(self);
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| EngineClosed)?;
        let mut st = self.lock();
        queued.disarm(&mut st);
        st.running += 1;
        // Like vLLM, the last prompt token is always recomputed, so a full hit still prefills one token.
        let max_hit = tokens.len().saturating_sub(1) / bs;
        let hits = st
            .cache
            .longest_prefix(&hashes[..max_hit.min(hashes.len())]);
        st.cache.acquire(&hashes[..hits]);
        let total = tokens.len() + output_tokens as usize;
        let extra = total.div_ceil(bs).saturating_sub(hits);
        st.extra_held += extra;
        st.counters.prefix_queries_tokens += tokens.len() as u64;
        st.counters.prefix_hits_tokens += (hits * bs) as u64;
        st.evict();
        drop(st);
        Ok(Running {
            pod: Arc::clone(self),
            hashes,
            pinned: hits,
            extra,
            prompt_tokens: tokens.len(),
            cached_tokens: hits * bs,
            permit: Some(permit),
        })
    }
}

/// Counts a request in `waiting` until it gets a slot or is dropped.
struct Queued<'a> {
    pod: &'a Pod,
    armed: bool,
}

impl<'a> Queued<'a> {
    fn new(pod: &'a Pod) -> Self {
        pod.lock().waiting += 1;
        Queued { pod, armed: true }
    }

    fn disarm(&mut self, st: &mut PodState) {
        if self.armed {
            st.waiting -= 1;
            self.armed = false;
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.pod.lock().waiting -= 1;
        }
    }
}

/// A request holding a running slot and KV blocks; releases both when dropped.
#[derive(Debug)]
pub struct Running {
    pod: Arc<Pod>,
    hashes: Vec<u64>,
    /// Leading entries of `hashes` pinned in the cache.
    pinned: usize,
    /// This request's share of `PodState::extra_held`.
    extra: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    permit: Option<OwnedSemaphorePermit>,
}

impl Running {
    /// Prompt tokens served from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// Prompt tokens that must be computed.
    pub fn uncached_tokens(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }

    /// The prompt has been computed: its full blocks enter the cache, pinned until the request ends.
    pub fn prefilled(&mut self) {
        let mut st = self.pod.lock();
        st.cache.acquire(&self.hashes[self.pinned..]);
        let moved = (self.hashes.len() - self.pinned).min(self.extra);
        self.extra -= moved;
        st.extra_held -= moved;
        self.pinned = self.hashes.len();
        st.counters.prompt_tokens += self.prompt_tokens as u64;
        st.evict();
    }

    /// The request completed after producing `output_tokens`.
    pub fn finish(self, output_tokens: u32) {
        let mut st = self.pod.lock();
        st.counters.served += 1;
        st.counters.generation_tokens += u64::from(output_tokens);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut st = self.pod.lock();
        st.cache.release(&self.hashes[..self.pinned]);
        st.extra_held -= self.extra;
        st.running -= 1;
        // Otherwise the permit goes back to the semaphore when dropped here.
        if let Some(permit) = self.permit.take()
            && st.permit_debt > 0
        {
            st.permit_debt -= 1;
            permit.forget();
        }
        st.evict();
    }
}

fn ms(v: f64) -> Duration {
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

/// Time between two output tokens.
pub fn inter_token(knobs: &PodKnobs) -> Duration {
    ms(knobs.decode_ms_per_token * knobs.time_scale)
}

/// Whether this request should get an injected failure.
pub fn inject_failure(knobs: &PodKnobs) -> bool {
    knobs.error_rate > 0.0 && rand::random::<f64>() < knobs.error_rate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(knobs: PodKnobs) -> Arc<Pod> {
        let addr: SocketAddr = ([127, 0, 0, 1], 1).into();
        Arc::new(Pod::new(0, addr, "m".into(), knobs))
    }

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i ^ (salt << 16)).collect()
    }

    #[tokio::test]
    async fn second_identical_prompt_hits_cache_and_usage_tracks_running() {
        let knobs = PodKnobs {
            block_size: 4,
            kv_blocks: 100,
            ..PodKnobs::default()
        };
        let p = pod(knobs.clone());
        let t = toks(18, 1);
        let mut r = p.admit(&t, 2, &knobs).await.unwrap();
        assert_eq!(r.cached_tokens(), 0);
        // 18 + 2 tokens -> 5 blocks held.
        assert!((p.stats().kv_usage - 0.05).abs() < 1e-9);
        r.prefilled();
        assert!((p.stats().kv_usage - 0.05).abs() < 1e-9);
        r.finish(2);
        let s = p.stats();
        assert_eq!((s.running, s.served, s.kv_usage), (0, 1, 0.0));
        assert_eq!(s.cached_blocks, 4);

        let r = p.admit(&t, 2, &knobs).await.unwrap();
        assert_eq!(r.cached_tokens(), 16);
        assert_eq!(r.uncached_tokens(), 2);
        drop(r);
        // Exactly block-aligned prompt: the last block is recomputed.
        let r = p.admit(&t[..16], 2, &knobs).await.unwrap();
        assert_eq!(r.cached_tokens(), 12);
        drop(r);
        let s = p.stats();
        assert_eq!(s.prefix_hits_tokens, 28);
        assert_eq!(s.prefix_queries_tokens, 18 * 3 - 2);
        // Dropped without finishing: not served.
        assert_eq!(s.served, 1);
    }

    #[tokio::test]
    async fn small_capacity_evicts_old_prompts() {
        let knobs = PodKnobs {
            block_size: 4,
            kv_blocks: 6,
            ..PodKnobs::default()
        };
        let p = pod(knobs.clone());
        for salt in 0..3 {
            let mut r = p.admit(&toks(13, salt), 1, &knobs).await.unwrap();
            r.prefilled();
            r.finish(1);
        }
        assert!(p.stats().cached_blocks <= 6);
        // The first prompt was evicted, the last one is still cached.
        let r = p.admit(&toks(13, 2), 1, &knobs).await.unwrap();
        assert_eq!(r.cached_tokens(), 12);
        drop(r);
        let r = p.admit(&toks(13, 0), 1, &knobs).await.unwrap();
        assert_eq!(r.cached_tokens(), 0);
    }

    #[tokio::test]
    async fn shrinking_slots_takes_effect_when_requests_finish() {
        let knobs = PodKnobs {
            max_num_seqs: 2,
            ..PodKnobs::default()
        };
        let p = pod(knobs.clone());
        let a = p.admit(&toks(4, 0), 1, &knobs).await.unwrap();
        let b = p.admit(&toks(4, 1), 1, &knobs).await.unwrap();
        p.set_knobs(&KnobsPatch {
            max_num_seqs: Some(1),
            ..KnobsPatch::default()
        })
        .unwrap();
        drop(a);
        // Still one running: no slot is free.
        assert_eq!(p.slots.available_permits(), 0);
        drop(b);
        assert_eq!(p.slots.available_permits(), 1);
        p.set_knobs(&KnobsPatch {
            max_num_seqs: Some(3),
            ..KnobsPatch::default()
        })
        .unwrap();
        assert_eq!(p.slots.available_permits(), 3);
    }

    #[test]
    fn latency_model() {
        let k = PodKnobs {
            prefill_overhead_ms: 2.0,
            prefill_us_per_token: 100.0,
            extra_latency_ms: 1.0,
            time_scale: 0.5,
            decode_ms_per_token: 4.0,
            ..PodKnobs::default()
        };
        assert_eq!(ttft(&k, 100), Duration::from_micros(6500));
        assert_eq!(inter_token(&k), Duration::from_millis(2));
    }
}

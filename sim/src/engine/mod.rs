//! One simulated engine: knobs, the running-slot semaphore with its FIFO queue, the prefix cache and
//! the counters behind `/metrics`. Request handlers drive a request through [`Pod::admit`] (queue, then
//! cache lookup), [`Running::prefilled`] (blocks enter the cache) and [`Running::finish`]; the RAII
//! guards keep the gauges truthful even when a client disconnects half-way.
//!
//! Rooms: `stats` (what a pod reports), `timing` (the simple model's latencies), `stepped`
//! (the step model: a request's life in [`crate::step`]'s batches and the driver task), `kv`
//! (the cache's events and the CPU offload tier), `lora` (adapters and their slots).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, mpsc};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use xxhash_rust::xxh3::xxh3_64;

use crate::SimError;
use crate::cache::{PrefixCache, block_hashes_seeded};
use crate::knobs::EngineModel;
use crate::knobs::{KnobsPatch, PodKnobs};
use crate::kvevents::{Command, KvEvent};
use crate::step::{Event, StepEngine};
use crate::tokenizer::{ChatMessage, Tokenizer, Vocab};

mod kv;
mod lora;
mod stats;
mod stepped;
#[cfg(test)]
mod tests;
mod timing;

pub use lora::{Adapter, LoraError, LoraInfoSeries};
use lora::{LoraState, bump};
pub use stats::PodStats;
pub use timing::{inject_failure, inter_token, lora_load, pause, pause_until, ttft};
use timing::{ms, unix_now_s};

#[derive(Debug, Default)]
struct Counters {
    served: u64,
    errors: u64,
    prefix_hits_tokens: u64,
    prefix_queries_tokens: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    kv_event_blocks: u64,
    /// Prompt tokens loaded back from the CPU offload tier.
    offload_hits_tokens: u64,
}

#[derive(Debug)]
struct PodState {
    knobs: PodKnobs,
    cache: PrefixCache,
    /// The CPU offload tier (`knobs.cpu_offload_blocks`; empty when 0): an LRU of block
    /// hashes, nothing pinned.
    offload: PrefixCache,
    /// Blocks held by running requests that are not (yet) in the cache: uncached prompt blocks during
    /// prefill, the partial last block and the decode blocks.
    extra_held: usize,
    running: usize,
    waiting: usize,
    /// Permits still to be withdrawn after `max_num_seqs` shrank while they were in use.
    permit_debt: usize,
    counters: Counters,
    lora: LoraState,
    restarts: u64,
    started_s: f64,
    /// Events of the current engine step, published when the step's lock is released.
    pending: Vec<KvEvent>,
    events_on: bool,
    /// The step model's scheduler (requests admitted under [`EngineModel::Step`]) and where each
    /// of its sequences' outputs go. `running`/`waiting` above count the others.
    steps: StepEngine,
    tickets: HashMap<u64, tokio::sync::mpsc::UnboundedSender<Event>>,
    /// Of the blocks the cache pins, those the step model's sequences hold as their own too
    /// (their prompts' blocks once computed).
    step_overlap: usize,
    latencies: crate::metrics::Latencies,
}

impl PodState {
    /// Blocks the step model's sequences hold outside the cache.
    fn step_outside(&self) -> usize {
        self.steps.used_blocks().saturating_sub(self.step_overlap)
    }

    fn kv_usage(&self) -> f64 {
        let held = self.cache.pinned() + self.extra_held + self.step_outside();
        (held as f64 / self.knobs.kv_blocks.max(1) as f64).min(1.0)
    }

    /// Requests running and waiting, in either model.
    fn gauges(&self) -> (u64, u64) {
        (
            (self.running + self.steps.running()) as u64,
            (self.waiting + self.steps.waiting()) as u64,
        )
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
    stall: watch::Sender<bool>,
    lora_slot_freed: Notify,
    /// Wakes the step model's driver ([`drive`]), started by the first request that needs it.
    work: Arc<Notify>,
    driver: Once,
    next_seq: AtomicU64,
    /// Adapters registered at start (and again after a restart): (name, path).
    initial_adapters: Vec<(String, String)>,
    kv: Option<mpsc::Sender<Command>>,
    /// Label for prefill/decode disaggregation (`prefill` or `decode`), if any.
    pub role: Option<String>,
    /// Last rendered `/metrics` text and what it was rendered from (see `server::metrics`).
    pub(crate) metrics_cache: Mutex<Option<crate::metrics::Cached>>,
    /// `/v1/responses` objects kept for `previous_response_id` and retrieval: per process and in
    /// memory as in vLLM, so a follow-up must reach the same pod, and a crash forgets them.
    responses: Mutex<ResponseStore>,
    /// What `/detokenize` knows, shared by the pods of one sim (one model, one tokenizer).
    pub(crate) vocab: Arc<Mutex<Vocab>>,
    /// How prompts become token ids (the built-in hashing tokenizer or a Hugging Face one).
    pub tokenizer: Tokenizer,
}

/// Responses a pod keeps at most; the oldest go first.
pub const RESPONSE_STORE_CAPACITY: usize = 10_000;

/// A stored `/v1/responses` result.
#[derive(Clone, Debug)]
pub struct StoredResponse {
    /// The conversation so far (inputs, then the answer), without the instructions: what a
    /// follow-up naming this response continues.
    pub history: Vec<ChatMessage>,
    /// The response object as returned.
    pub body: serde_json::Value,
}

#[derive(Debug, Default)]
struct ResponseStore {
    by_id: HashMap<String, StoredResponse>,
    order: VecDeque<String>,
}

/// Optional parts of a pod.
#[derive(Debug, Default)]
pub struct PodOptions {
    /// LoRA adapters loaded at start: (name, path).
    pub adapters: Vec<(String, String)>,
    /// Where this pod's KV events go; `None` disables them.
    pub kv_events: Option<mpsc::Sender<Command>>,
    pub role: Option<String>,
    /// The `/detokenize` vocabulary to share with other pods; `None` gives the pod its own.
    pub vocab: Option<Arc<Mutex<Vocab>>>,
    /// How prompts become token ids.
    pub tokenizer: Tokenizer,
}

impl Pod {
    pub fn new(index: usize, addr: SocketAddr, model: String, knobs: PodKnobs) -> Pod {
        Pod::with_options(index, addr, model, knobs, PodOptions::default())
    }

    pub fn with_options(
        index: usize,
        addr: SocketAddr,
        model: String,
        knobs: PodKnobs,
        opts: PodOptions,
    ) -> Pod {
        let stall = watch::Sender::new(knobs.stall);
        let steps = StepEngine::new(knobs.step_config());
        let mut lora = LoraState::default();
        for (name, path) in &opts.adapters {
            lora.register(name, path);
        }
        lora.touch();
        Pod {
            index,
            name: format!("sim-{index}"),
            addr,
            model,
            slots: Arc::new(Semaphore::new(knobs.max_num_seqs)),
            state: Mutex::new(PodState {
                knobs,
                cache: PrefixCache::new(),
                offload: PrefixCache::new(),
                extra_held: 0,
                running: 0,
                waiting: 0,
                permit_debt: 0,
                counters: Counters::default(),
                lora,
                restarts: 0,
                started_s: unix_now_s(),
                pending: Vec::new(),
                events_on: opts.kv_events.is_some(),
                steps,
                tickets: HashMap::new(),
                step_overlap: 0,
                latencies: Default::default(),
            }),
            next_id: AtomicU64::new(0),
            stall,
            lora_slot_freed: Notify::new(),
            work: Arc::new(Notify::new()),
            driver: Once::new(),
            next_seq: AtomicU64::new(0),
            initial_adapters: opts.adapters,
            kv: opts.kv_events,
            role: opts.role,
            metrics_cache: Mutex::new(None),
            responses: Mutex::new(ResponseStore::default()),
            vocab: opts.vocab.unwrap_or_default(),
            tokenizer: opts.tokenizer,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PodState> {
        // A panic while holding the lock cannot leave the state half-updated in a way that matters
        // more than losing the simulator, so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one engine step under the lock and publishes the KV events it produced. Sending while
    /// still holding the lock keeps batches in the order the cache changed.
    fn step<R>(&self, f: impl FnOnce(&mut PodState) -> R) -> R {
        let mut st = self.lock();
        let r = f(&mut st);
        if !st.pending.is_empty() {
            let events = std::mem::take(&mut st.pending);
            if let Some(tx) = &self.kv {
                let _ = tx.send(Command::Publish {
                    pod: self.index,
                    events,
                });
            }
        }
        r
    }

    pub fn knobs(&self) -> PodKnobs {
        self.lock().knobs.clone()
    }

    /// Applies `patch` after validating the result. A smaller `max_num_seqs` takes effect as running
    /// requests finish.
    pub fn set_knobs(&self, patch: &KnobsPatch) -> Result<(), SimError> {
        let stall = self.step(|st| {
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
            // Requests that no longer fit even alone end (their clients see the engine close).
            for id in st.steps.reconfigure(new.step_config()) {
                st.tickets.remove(&id);
            }
            st.knobs = new;
            st.evict();
            Ok::<_, SimError>(st.knobs.stall)
        })?;
        self.stall.send_replace(stall);
        // More LoRA slots may let waiting adapters in.
        self.lora_slot_freed.notify_waiters();
        Ok(())
    }

    pub fn stats(&self) -> PodStats {
        let st = self.lock();
        let (running, waiting) = st.gauges();
        PodStats {
            served: st.counters.served,
            running,
            waiting,
            kv_usage: st.kv_usage(),
            prefix_hits_tokens: st.counters.prefix_hits_tokens,
            prefix_queries_tokens: st.counters.prefix_queries_tokens,
            errors: st.counters.errors,
            prompt_tokens: st.counters.prompt_tokens,
            generation_tokens: st.counters.generation_tokens,
            cached_blocks: st.cache.len() as u64,
            offloaded_blocks: st.offload.len() as u64,
            offload_hits_tokens: st.counters.offload_hits_tokens,
            kv_event_blocks: st.counters.kv_event_blocks,
            lora_resident: st.lora.resident.clone(),
            lora_running: st.lora.running.keys().cloned().collect(),
            lora_waiting: st.lora.waiting.keys().cloned().collect(),
            lora_loads: st.lora.loads,
            restarts: st.restarts,
            started_s: st.started_s,
            preemptions: st.steps.preemptions(),
            latencies: st.latencies.clone(),
        }
    }

    /// What `/metrics` shows, read under one lock: the knobs (faults included) and the key of the
    /// exposition — only the fields the text renders, so unrelated changes keep the cached bytes.
    pub(crate) fn metrics_inputs(&self) -> (PodKnobs, crate::metrics::CacheKey) {
        let st = self.lock();
        let (running, waiting) = st.gauges();
        let key = crate::metrics::CacheKey {
            stats: PodStats {
                served: st.counters.served,
                running,
                waiting,
                kv_usage: st.kv_usage(),
                prefix_hits_tokens: st.counters.prefix_hits_tokens,
                prefix_queries_tokens: st.counters.prefix_queries_tokens,
                prompt_tokens: st.counters.prompt_tokens,
                generation_tokens: st.counters.generation_tokens,
                started_s: st.started_s,
                preemptions: st.steps.preemptions(),
                latencies: st.latencies.clone(),
                ..PodStats::default()
            },
            block_size: st.knobs.block_size,
            kv_blocks: st.knobs.kv_blocks,
            max_loras: st.knobs.max_loras,
            lora_stamp: (st.lora.info.len(), st.lora.last_ts),
        };
        (st.knobs.clone(), key)
    }

    /// Keeps a `/v1/responses` result under `id`, dropping the oldest past
    /// [`RESPONSE_STORE_CAPACITY`].
    pub fn store_response(&self, id: String, stored: StoredResponse) {
        let mut st = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        if st.by_id.insert(id.clone(), stored).is_none() {
            st.order.push_back(id);
        }
        while st.order.len() > RESPONSE_STORE_CAPACITY {
            if let Some(old) = st.order.pop_front() {
                st.by_id.remove(&old);
            }
        }
    }

    /// A stored `/v1/responses` result.
    pub fn stored_response(&self, id: &str) -> Option<StoredResponse> {
        let st = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        st.by_id.get(id).cloned()
    }

    /// Keys of every block in the prefix cache, sorted.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut v = self.lock().cache.hashes();
        v.sort_unstable();
        v
    }

    /// Cheap fingerprint of the `vllm:lora_requests_info` series: (count, newest stamp).
    pub fn lora_info_stamp(&self) -> (usize, f64) {
        let st = self.lock();
        (st.lora.info.len(), st.lora.last_ts)
    }

    /// Every `vllm:lora_requests_info` series, oldest first.
    pub fn lora_info(&self) -> Vec<LoraInfoSeries> {
        let st = self.lock();
        let mut v: Vec<LoraInfoSeries> = st
            .lora
            .info
            .iter()
            .map(|((running, waiting), ts)| LoraInfoSeries {
                running: running.clone(),
                waiting: waiting.clone(),
                updated: *ts,
            })
            .collect();
        v.sort_by(|a, b| a.updated.total_cmp(&b.updated));
        v
    }

    /// Registered adapters, by name.
    pub fn adapters(&self) -> Vec<Adapter> {
        self.lock().lora.adapters.values().cloned().collect()
    }

    /// The adapter named `model`, if `model` names one.
    pub fn adapter(&self, model: &str) -> Option<Adapter> {
        self.lock().lora.adapters.get(model).cloned()
    }

    /// `/v1/load_lora_adapter`.
    pub fn load_adapter(&self, name: &str, path: &str) -> Result<(), LoraError> {
        if name.is_empty() || path.is_empty() {
            return Err(LoraError::Invalid(
                "Both 'lora_name' and 'lora_path' must be provided.".into(),
            ));
        }
        let mut st = self.lock();
        if st.knobs.max_loras == 0 {
            return Err(LoraError::Disabled);
        }
        if st.lora.adapters.contains_key(name) || name == self.model {
            return Err(LoraError::AlreadyLoaded(name.to_owned()));
        }
        st.lora.register(name, path);
        Ok(())
    }

    /// `/v1/unload_lora_adapter`: the adapter leaves the registry and its slot; requests already
    /// running with it finish.
    pub fn unload_adapter(&self, name: &str) -> Result<(), LoraError> {
        let mut st = self.lock();
        if st.lora.adapters.remove(name).is_none() {
            return Err(LoraError::NotFound(name.to_owned()));
        }
        if st.lora.active.get(name).copied().unwrap_or(0) == 0 {
            st.lora.resident.retain(|r| r != name);
        }
        drop(st);
        self.lora_slot_freed.notify_waiters();
        Ok(())
    }

    pub fn record_error(&self) {
        self.lock().counters.errors += 1;
    }

    /// A per-pod unique request number.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Drops every cached block that no running request holds (vLLM's `/reset_prefix_cache`), so a
    /// comparison run starts cold. Returns how many blocks were dropped. Publishes AllBlocksCleared
    /// when the cache ends up empty, BlockRemoved per block otherwise.
    pub fn reset_prefix_cache(&self) -> usize {
        self.step(|st| {
            let n = st.evict_to(0);
            // The offload tier goes too (llm-d reads AllBlocksCleared as every tier cleared).
            let offloaded = st.offload.hashes();
            st.offload.clear();
            if st.events_on && n > 0 && st.cache.is_empty() {
                st.pending.clear();
                st.pending.push(KvEvent::AllBlocksCleared);
            } else if st.events_on && !offloaded.is_empty() {
                st.counters.kv_event_blocks += offloaded.len() as u64;
                st.pending.push(KvEvent::OffloadRemoved {
                    block_hashes: offloaded,
                });
            }
            n
        })
    }

    /// Back to a freshly started engine after a simulated crash: empty cache, zeroed counters, the
    /// start-up adapters, KV-event sequence from 0. Call only once no request holds this pod's
    /// state (the crashed server's connections are gone).
    pub fn restart(&self) {
        let mut st = self.lock();
        st.cache.clear();
        st.offload.clear();
        st.extra_held = 0;
        st.running = 0;
        st.waiting = 0;
        st.counters = Counters::default();
        st.pending.clear();
        st.steps = StepEngine::new(st.knobs.step_config());
        st.tickets.clear();
        st.step_overlap = 0;
        st.latencies = Default::default();
        st.restarts += 1;
        // A new process: a new start time, even within the same millisecond as the last one.
        st.started_s = unix_now_s().max(st.started_s + 0.001);
        let mut lora = LoraState::default();
        for (name, path) in &self.initial_adapters {
            lora.register(name, path);
        }
        lora.touch();
        st.lora = lora;
        if let Some(tx) = &self.kv {
            let _ = tx.send(Command::Reset { pod: self.index });
        }
        drop(st);
        *self.responses.lock().unwrap_or_else(|e| e.into_inner()) = ResponseStore::default();
    }

    /// Wakes every queued request with [`EngineClosed`].
    pub fn close(&self) {
        self.slots.close();
        let mut st = self.lock();
        for id in st.steps.drain_waiting() {
            st.tickets.remove(&id);
        }
    }

    /// Returns once the engine is not stalled.
    pub async fn unstalled(&self) {
        let mut rx = self.stall.subscribe();
        let _ = rx.wait_for(|s| !*s).await;
    }

    /// Waits for a running slot (FIFO) — and, for a LoRA request, for a LoRA slot first — then looks
    /// the prompt up in the prefix cache and pins the hit blocks. `output_tokens` sizes the blocks
    /// the request will hold.
    pub async fn admit(
        self: &Arc<Self>,
        tokens: &[u32],
        output_tokens: u32,
        knobs: &PodKnobs,
    ) -> Result<Running, EngineClosed> {
        self.admit_lora(tokens, output_tokens, knobs, None, None)
            .await
    }

    /// [`Pod::admit`] for a request that uses `lora` (when `Some`).
    pub async fn admit_lora(
        self: &Arc<Self>,
        tokens: &[u32],
        output_tokens: u32,
        knobs: &PodKnobs,
        lora: Option<Adapter>,
        salt: Option<String>,
    ) -> Result<Running, EngineClosed> {
        let bs = knobs.block_size.max(1);
        // The adapter's name and the salt are the first block's extra keys in vLLM: a LoRA
        // request's or a salted prompt's blocks are their own.
        let seed = match (&lora, &salt) {
            (None, None) => 0,
            (l, s) => {
                let name = l.as_ref().map_or("", |l| l.name.as_str());
                xxh3_64(format!("{name}\0{}", s.as_deref().unwrap_or("")).as_bytes())
            }
        };
        let hashes = block_hashes_seeded(tokens, bs, seed);
        let arrived = tokio::time::Instant::now();
        let mut queued = Queued::new(self, lora.as_ref().map(|l| l.name.clone()));
        self.unstalled().await;
        let mut swapped = false;
        if let Some(l) = &lora {
            loop {
                let notified = self.lora_slot_freed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let got = {
                    let mut st = self.lock();
                    let max = st.knobs.max_loras;
                    st.lora.reserve(&l.name, max)
                };
                if let Some(s) = got {
                    swapped = s;
                    queued.reserved = true;
                    break;
                }
                if self.slots.is_closed() {
                    return Err(EngineClosed);
                }
                notified.await;
            }
        }
        // The step model queues in its scheduler (pooling requests, without output, keep the
        // simple model).
        let stepped = knobs.engine == EngineModel::Step && output_tokens > 0;
        let permit = if stepped {
            if self.slots.is_closed() {
                return Err(EngineClosed);
            }
            None
        } else {
            Some(
                self.slots
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| EngineClosed)?,
            )
        };
        self.unstalled().await;
        let running = self.step(|st| {
            queued.disarm(st);
            if !stepped {
                st.running += 1;
                // (The step model's wait ends when its scheduler admits it.)
                st.latencies.queue.observe(arrived.elapsed().as_secs_f64());
            }
            if let Some(l) = &lora {
                bump(&mut st.lora.running, &l.name, true);
                st.lora.touch();
            }
            // Like vLLM, the last prompt token is always recomputed, so a full hit still prefills one token.
            let max_hit = tokens.len().saturating_sub(1) / bs;
            let hittable = &hashes[..max_hit.min(hashes.len())];
            let gpu_hits = st.cache.longest_prefix(hittable);
            st.cache.acquire(&hashes[..gpu_hits]);
            // The blocks after those the CPU tier holds are loaded back into the GPU cache (and
            // published as stored there, as vLLM caches them once loaded).
            let loaded = st.offload_prefix(&hittable[gpu_hits..]);
            let hits = gpu_hits + loaded;
            if loaded > 0 {
                st.store(
                    &hashes[..hits],
                    gpu_hits,
                    tokens,
                    bs,
                    lora.as_ref(),
                    salt.as_deref(),
                );
                st.counters.offload_hits_tokens += (loaded * bs) as u64;
            }
            // The step model allocates the request's own blocks as its steps need them.
            let total = tokens.len() + output_tokens as usize;
            let extra = if stepped {
                0
            } else {
                total.div_ceil(bs).saturating_sub(hits)
            };
            st.extra_held += extra;
            st.counters.prefix_queries_tokens += tokens.len() as u64;
            st.counters.prefix_hits_tokens += (gpu_hits * bs) as u64;
            st.evict();
            (hits, extra, loaded)
        });
        let (hits, extra, loaded) = running;
        Ok(Running {
            pod: Arc::clone(self),
            hashes,
            tokens: tokens.to_vec(),
            block_size: bs,
            pinned: hits,
            extra,
            prompt_tokens: tokens.len(),
            cached_tokens: hits * bs,
            loaded_tokens: loaded * bs,
            permit,
            lora,
            salt,
            lora_swapped: swapped,
            stepped,
            output_tokens,
            seq: None,
            arrived,
            last_token: arrived,
            overlap: 0,
        })
    }
}

/// Counts a request in `waiting` until it gets a slot or is dropped; holds its LoRA reservation.
struct Queued<'a> {
    pod: &'a Pod,
    armed: bool,
    lora: Option<String>,
    reserved: bool,
}

impl<'a> Queued<'a> {
    fn new(pod: &'a Pod, lora: Option<String>) -> Self {
        let mut st = pod.lock();
        st.waiting += 1;
        if let Some(l) = &lora {
            bump(&mut st.lora.waiting, l, true);
            st.lora.touch();
        }
        Queued {
            pod,
            armed: true,
            lora,
            reserved: false,
        }
    }

    /// Admitted: out of the waiting counts; the reservation passes to [`Running`].
    fn disarm(&mut self, st: &mut PodState) {
        if self.armed {
            st.waiting -= 1;
            if let Some(l) = &self.lora {
                bump(&mut st.lora.waiting, l, false);
            }
            self.armed = false;
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut st = self.pod.lock();
            st.waiting = st.waiting.saturating_sub(1);
            if let Some(l) = &self.lora {
                bump(&mut st.lora.waiting, l, false);
                if self.reserved {
                    st.lora.unreserve(l);
                }
                st.lora.touch();
            }
            drop(st);
            if self.reserved {
                self.pod.lora_slot_freed.notify_waiters();
            }
        }
    }
}

/// A request holding a running slot and KV blocks; releases both when dropped.
#[derive(Debug)]
pub struct Running {
    pod: Arc<Pod>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    block_size: usize,
    /// Leading entries of `hashes` pinned in the cache.
    pinned: usize,
    /// This request's share of `PodState::extra_held`.
    extra: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// Of `cached_tokens`, those loaded back from the CPU offload tier.
    loaded_tokens: usize,
    permit: Option<OwnedSemaphorePermit>,
    lora: Option<Adapter>,
    salt: Option<String>,
    lora_swapped: bool,
    /// Admitted under the step model: its time comes from the engine's steps.
    stepped: bool,
    output_tokens: u32,
    /// Its sequence in the step model, once submitted, and where its outputs arrive.
    seq: Option<(u64, tokio::sync::mpsc::UnboundedReceiver<Event>)>,
    arrived: tokio::time::Instant,
    /// When its last output token came (its first: the time to first token).
    last_token: tokio::time::Instant,
    /// Its share of `PodState::step_overlap`.
    overlap: usize,
}

impl Running {
    /// Prompt tokens served from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// Of the cached prompt tokens, those loaded back from the CPU offload tier.
    pub fn loaded_tokens(&self) -> usize {
        self.loaded_tokens
    }

    /// Prompt tokens that must be computed.
    pub fn uncached_tokens(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }

    /// Whether this request's adapter had to be loaded into a slot.
    pub fn lora_swapped(&self) -> bool {
        self.lora_swapped
    }

    /// The prompt's block hashes (the KV blocks a P/D transfer would move).
    pub fn block_hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// The prompt has been computed: its full blocks enter the cache, pinned until the request ends.
    pub fn prefilled(&mut self) {
        self.pod.step(|st| {
            if self.stepped {
                // The step model's sequence holds these blocks, now the cache's too: counted
                // once (`PodState::step_overlap`).
                self.overlap = self.hashes.len() - self.pinned;
                st.step_overlap += self.overlap;
            }
            st.store(
                &self.hashes,
                self.pinned,
                &self.tokens,
                self.block_size,
                self.lora.as_ref(),
                self.salt.as_deref(),
            );
            let moved = (self.hashes.len() - self.pinned).min(self.extra);
            self.extra -= moved;
            st.extra_held -= moved;
            self.pinned = self.hashes.len();
            st.counters.prompt_tokens += self.prompt_tokens as u64;
            st.evict();
        });
    }

    /// The request completed after producing `output_tokens`.
    pub fn finish(self, output_tokens: u32) {
        let mut st = self.pod.lock();
        st.counters.served += 1;
        st.counters.generation_tokens += u64::from(output_tokens);
        let l = &mut st.latencies;
        l.e2e.observe(self.arrived.elapsed().as_secs_f64());
        l.prompt_tokens.observe(self.prompt_tokens as f64);
        l.generation_tokens.observe(f64::from(output_tokens));
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let lora = self.lora.take();
        let seq = self.seq.take().map(|(id, _)| id);
        self.pod.step(|st| {
            st.cache.release(&self.hashes[..self.pinned]);
            st.extra_held = st.extra_held.saturating_sub(self.extra);
            if let Some(id) = seq {
                // Gone before its last token (the client left): out of the batch.
                st.steps.cancel(id);
                st.tickets.remove(&id);
            }
            st.step_overlap = st.step_overlap.saturating_sub(self.overlap);
            if !self.stepped {
                st.running = st.running.saturating_sub(1);
            }
            if let Some(l) = &lora {
                bump(&mut st.lora.running, &l.name, false);
                st.lora.unreserve(&l.name);
                // An adapter unloaded while this request ran leaves its slot now.
                if !st.lora.adapters.contains_key(&l.name) && !st.lora.active.contains_key(&l.name)
                {
                    st.lora.resident.retain(|r| r != &l.name);
                }
                st.lora.touch();
            }
            // Otherwise the permit goes back to the semaphore when dropped here.
            if let Some(permit) = self.permit.take()
                && st.permit_debt > 0
            {
                st.permit_debt -= 1;
                permit.forget();
            }
            st.evict();
        });
        if lora.is_some() {
            self.pod.lora_slot_freed.notify_waiters();
        }
    }
}

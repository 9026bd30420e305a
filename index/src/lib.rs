//! `index`: prefix indexes — pure data structures, no IO, no clocks (time is an input).
//!
//! Today: the **approximate prefix index** llm-d calls `approx-prefix-cache-producer`. The router
//! never sees the engine's KV cache; it remembers which pod it sent each prompt prefix to and
//! assumes the pod still caches it, bounded per pod like an LRU.
//!
//! # Layout
//! - [`hashing`]: tokenizer-free estimate tokens (4-byte little-endian pseudo-tokens of the
//!   serialized prompt) and the chained 64-bit block hashes (seed = model name [+ cache salt]);
//! - [`approx`]: the index: per pod, block hash → timestamp of the last time a request carrying that
//!   block was routed there, bounded to the K newest entries (ties broken by hash), plus a reverse
//!   map hash → pods for matching; per pod also an epoch (incarnation) and an incremental digest.
//!   Replication: [`approx::PodState`] deltas/full states, [`ApproxIndex::merge_pod`];
//! - [`crdt`]: the same per-pod join as `crdts::CvRDT` values ([`PodState`] unbounded, for
//!   coalescing deltas; [`BoundedPodState`] with K) — the reference `merge_pod` is tested against;
//! - [`kvevents`]: the engines' KV-cache events (vLLM, SGLang) as they arrive over ZMQ — frames,
//!   topics, msgpack batches in every encoding in use, sequence gaps and restarts — for the precise
//!   index;
//! - [`precise`]: the precise index — which blocks each pod's engine holds, rebuilt from those
//!   events, keyed by our own chain over token ids (engine hashes mapped to our keys);
//! - [`clock`]: [`Hlc`], the hybrid logical clock (µs since the UNIX epoch) that stamps entries so
//!   timestamps from different replicas compare.
//!
//! # Data flow
//! prompt text → [`hashing::block_hashes_of_text`] → hashes; at scoring time
//! [`approx::ApproxIndex::match_prefix`] gives each pod its longest run of leading blocks; once a pod
//! is chosen, [`approx::ApproxIndex::insert_delta`] (or `insert`) records the hashes for it with the
//! routing timestamp ([`Hlc::now`]) and returns the entries that changed.
//!
//! Between replicas the per-pod state (epoch, ≤ K (hash, ts)) is a state-based CRDT: join = the
//! higher epoch wins entirely (a pod recreated under the same address starts empty), equal epochs
//! take the per-hash max timestamp and keep the K greatest (ts, hash) — the eviction order. Each
//! replica sends its insert deltas to the others, which [`ApproxIndex::merge_pod`] them (a return of
//! 0 = already known: don't forward) and [`Hlc::observe`] their timestamps; lost deltas are repaired
//! by anti-entropy: compare [`ApproxIndex::digests`], exchange [`ApproxIndex::export_pod`] for the
//! pods that differ. Joins commute, associate and are idempotent, so replicas that saw the same
//! deltas in any order, with duplicates, hold equal states (for equal K).

pub mod approx;
pub mod clock;
pub mod crdt;
pub mod hashing;
mod idhash;
pub mod kvevents;
pub mod precise;
pub mod replica;
mod slots;

pub use approx::{ApproxIndex, PodDigest, PodId, PodMatch, PodState};
pub use clock::Hlc;
pub use crdt::{BoundedPodState, NameMismatch};
pub use hashing::{BlockHasher, block_hashes_of_text, block_hashes_of_tokens};
pub use precise::{PreciseIndex, PreciseMatch};
pub use replica::{DeltaSink, Replicated};

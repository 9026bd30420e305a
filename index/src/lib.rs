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
//!   map hash → pods for matching.
//!
//! # Data flow
//! prompt text → [`hashing::block_hashes_of_text`] → hashes; at scoring time
//! [`approx::ApproxIndex::match_prefix`] gives each pod its longest run of leading blocks; once a pod
//! is chosen, [`approx::ApproxIndex::insert`] records the hashes for it with the routing timestamp.
//!
//! The per-pod state (hash → max timestamp, keep the K newest) is a join-semilattice by design, so
//! the Active-Active issue can turn it into a CRDT without changing what is stored.

pub mod approx;
pub mod hashing;
mod idhash;

pub use approx::{ApproxIndex, PodMatch};
pub use hashing::{BlockHasher, block_hashes_of_text, block_hashes_of_tokens};

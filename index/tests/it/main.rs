//! The prefix indexes' integration tests: CRDT laws, KV-event decoding, the precise index.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p index --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^index::it <module>::'`.

mod crdt_laws;
mod kvevents;
mod precise;

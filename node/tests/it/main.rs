//! The `epp` binary's integration tests: its command line, input fuzzing, the module graph.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p node --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^node::it <module>::'`.

mod cli;
mod fuzz;
mod llmd_v1_corpus;
mod rooms;

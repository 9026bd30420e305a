//! The flow-control machine's integration tests: models, properties and the replicated state.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p flowctl --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^flowctl::it <module>::'`.

mod bulk;
mod common;
mod determinism;
mod global;
mod global_held;
mod global_lives;
mod holdback;
mod model;
mod program_aware;
mod quota;
mod quota_shared;
mod reserve;
mod soft_reflective;
mod timeline;
mod turn_priority;
mod weighted;

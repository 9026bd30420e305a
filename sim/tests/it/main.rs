//! The simulator's integration tests: its API, pods, engines, endpoints file, KV events and
//! the load generator.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p sim --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^sim::it <module>::'`.

mod api;
mod endpoints;
mod fleet_200_pods_60s;
mod kv_events;
mod loadgen;
mod pods;
mod step_engine;

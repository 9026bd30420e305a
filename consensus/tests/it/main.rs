//! The consensus crate's integration tests: clusters of real nodes on loopback, the storage,
//! peer TLS.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p consensus --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^consensus::it <module>::'`.

mod cluster;
mod common;
mod storage;
mod tls;

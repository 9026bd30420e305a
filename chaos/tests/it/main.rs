//! The end-to-end suite (real Envoy, EPP replicas and simulated pods on loopback), the Raft and
//! chaos checks over real processes, the deterministic simulation (`dst`) and the chart and
//! asset checks.
//!
//! One test binary per crate: each module here was a binary of its own, and every binary is
//! a full link of the dependency graph (issue 48). Run one module with
//! `cargo test -p chaos --test it -- <module>::`, or each of its tests in a process of its own with
//! `deploy/local/test.sh '^chaos::it <module>::'`.

mod admin_auth;
mod attacks;
mod chaos_random;
mod clock_skew;
mod cluster_inflight;
mod demo;
mod dst;
mod e2e_admitter;
mod e2e_burst;
mod e2e_cost_model;
mod e2e_data_parallel;
mod e2e_envoy;
mod e2e_flowctl;
mod e2e_global_flow;
mod e2e_llmd_v1;
mod e2e_pd;
mod e2e_precise;
mod e2e_precise_cluster;
mod e2e_prefix;
mod e2e_prefix_replicated;
mod e2e_responses;
mod e2e_sharded_scrape;
mod e2e_tenants;
mod e2e_tenants_cluster;
mod e2e_traces;
mod explain;
mod extproc_subset;
mod helm_chart;
mod k8s_discovery;
mod kv_subscriber;
mod netproxy;
mod observability_assets;
mod raft_cluster;
mod raft_tls;
mod request_keys;

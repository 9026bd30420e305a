//! `chaos`: the multi-process harness that starts real clusters on loopback and breaks them.
//!
//! It starts simulated model-server pods (in-process, from the `sim` crate), `epp` replicas (child
//! processes of the real binary, every port chosen by the OS and reported on stdout), and Envoy
//! (rendered from `deploy/local/envoy.template.yaml`, its listener port read back from its admin API).
//! Every process is killed when its handle drops, so a failing test leaves nothing behind. The end-to-end
//! tests, the benchmarks and the local demo all use it.
//!
//! # Layout
//! - [`locate`]: where the `epp` and `envoy` binaries are;
//! - [`epp`]: an `epp serve` child process (start, SIGTERM, SIGKILL);
//! - [`envoy`]: render the bootstrap and run Envoy;
//! - [`extproc`]: the ext_proc messages Envoy sends, for tests and benchmarks without Envoy;
//! - [`chart`]: the Helm chart rendered and validated, its StatefulSet's arguments;
//! - [`cluster`]: sim + EPP replicas + Envoy together;
//! - [`wait`]: waiting on observable conditions with a deadline (never fixed sleeps).
//! - [`raft`]: EPP replicas in cluster mode with a controllable proxy on every peer link;
//! - [`netproxy`]: a controllable TCP link (partition, latency, blackhole) to put between processes;
//! - [`workloads`]: pod fleets and load shapes shared by tests, benchmarks and the demo;
//! - [`discoverybench`]: Kubernetes discovery of a large pool against `sim::kubeapi`;
//! - [`noregret`]: the no-regret admission benchmark (premium latency under a best-effort burst);
//! - [`random`]: the randomized chaos suite (seeded faults under load, invariants checked after);
//! - [`peers`]: `sglang-router` and `vllm-router` (from PyPI) as child processes;
//! - [`peerbench`]: the peer benchmark (EPP vs round robin vs those routers), with [`plot`] for
//!   its SVG.

pub mod burst;
pub mod chart;
pub mod cluster;
pub mod discoverybench;
pub mod dprouter;
pub mod envoy;
pub mod epp;
pub mod extproc;
pub mod fleet;
pub mod kvfleet;
pub mod locate;
pub mod netproxy;
pub mod noregret;
pub mod otlp;
pub mod peerbench;
pub mod peers;
pub mod plot;
pub mod ports;
pub mod raft;
pub mod random;
pub mod turnbench;
pub mod wait;
pub mod workloads;

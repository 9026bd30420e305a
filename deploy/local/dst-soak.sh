#!/usr/bin/env bash
# The deterministic simulation's long run (chaos/tests/it/dst.rs): seeds 1..N of the three workloads —
# the consensus log, the replicated global flow state and the gossip — each a few simulated members on
# turmoil's network under the seed's stalls, latency, crashes and restarts, every invariant
# checked after each seed. A release build, a thread per core. Default: 5000 seeds each.
#   deploy/local/dst-soak.sh [SEEDS]
# Reproduce one seed (prints its schedule): DST_SEED=S cargo test -p chaos --test it -- dst:: --nocapture
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/ensure-toolchain.sh
DST_SEEDS="${1:-5000}" exec cargo test --release --locked -p chaos --test it -- dst:: --nocapture \
  --test-threads 1

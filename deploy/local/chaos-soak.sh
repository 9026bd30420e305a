#!/usr/bin/env bash
# The randomized chaos soak: consecutive seeds, each a fresh three-replica cluster (Envoy,
# simulated pods, cluster flow control) under load while the seed's schedule of kill -9, SIGSTOP,
# partitions, one-way cuts, latency and clock skew breaks it; every invariant checked after each
# seed. Prints every report, appends them as JSON lines to target/chaos-soak.jsonl, exits non-zero
# if any seed violated an invariant. Defaults: 15 seeds of 120 s (30 minutes of load) from seed 1000.
#   deploy/local/chaos-soak.sh [--for SECONDS] [--run SECONDS] [--first-seed N] [--replicas 3|5]
# Reproduce one seed: target/release/epp-chaos --seeds N --run SECONDS
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
# The soak skews replicas' clocks: `epp`'s test-only flags (the `test-hooks` feature).
cargo build --release --locked --bins -p node -p chaos --features node/test-hooks
rm -f target/chaos-soak.jsonl
exec target/release/epp-chaos \
  --first-seed 1000 --for 1850 --run 120 --json target/chaos-soak.jsonl "$@"

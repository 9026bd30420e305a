#!/usr/bin/env bash
# The main job: a local standalone cluster (simulated vLLM pods + EPP + Envoy) driving a multi-turn
# workload through the EPP route and a round-robin route, then printing both side by side.
# Extra arguments go to `epp-demo` (see `epp-demo --help`). Exits non-zero if any step fails.
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
echo "building (release) ..."
cargo build --release --locked --bins -p node -p chaos
exec target/release/epp-demo "$@"

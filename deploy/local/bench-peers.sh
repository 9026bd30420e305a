#!/usr/bin/env bash
# The peer benchmark: one simulated pool, the same seeded workloads (shared system prompt, long
# per-conversation prefixes, an agentic loop, bursty open-loop arrivals) through Envoy → EPP,
# Envoy round robin, sglang-router and vllm-router (cache_aware). Prints Markdown tables (per run
# and medians with the EPP's verdict), writes target/peer-bench.json and target/peer-bench.svg.
# Extra arguments go to `epp-bench peers` (--runs N, --only a,b, --no-peers).
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
deploy/local/install-peers.sh
cargo build --release --locked --bins -p node -p chaos
exec target/release/epp-bench peers "$@"

#!/usr/bin/env bash
# Benchmarks of the request path (release build). Results go to stdout as Markdown tables; record
# them in docs/benchmarks.md with the machine and the date.
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
cargo build --release --locked --bins -p node -p chaos
echo "## added latency (Envoy+EPP vs Envoy direct, zero-latency pod)"
target/release/epp-bench added-latency "$@"
echo
echo "## decisions per second (synthetic ext_proc client, 4k-token prompts)"
target/release/epp-bench decisions

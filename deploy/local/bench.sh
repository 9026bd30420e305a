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
echo
echo "## fleet scale (1000 pods, 5 replicas in cluster mode, R = 2 scraping at 50 ms, 200 decisions/s)"
target/release/epp-bench fleet
echo
echo "## cluster flow control: CPU per request against per-replica scope, slot hand-off across replicas"
target/release/epp-bench global-flow --requests 20000 --concurrency 32 --handoffs 200

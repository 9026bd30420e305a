#!/usr/bin/env bash
# The test command: formatting, lints, then every test in the workspace — including the end-to-end
# tests that start Envoy, EPP replicas and simulated pods (Envoy, Helm and the manifest validators
# and the PromQL grammar are installed into .venv if missing).
#
# One compilation serves the lints and the tests: every workspace crate is compiled by
# clippy-driver (rustc with Clippy's lints, as `cargo clippy` runs it) with `-D warnings`, for
# every target (`--all-targets`: libraries, binaries, tests, benches, examples), with code
# generation, and the tests run from that build. `cargo clippy` followed by `cargo test` compiled
# the workspace twice. The timings of each phase are printed at the end (docs/benchmarks.md,
# "Test suite").
#   deploy/local/test.sh [PATTERN...]   (run-tests.py's: e.g. '^flowctl' or 'chaos::it e2e_prefix::')
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
started=$SECONDS
phases=()
phase() { phases+=("$(printf '%-8s %4ds' "$1" $((SECONDS - mark)))"); mark=$SECONDS; }
mark=$SECONDS
# The chart tests render with Helm (npm) and validate with kubernetes-validate (PyPI), the
# dashboard and alert rules are parsed with Prometheus' PromQL grammar (npm); the tests install
# them too, this only fails early, with the installer's message.
deploy/local/install-helm.sh >/dev/null
deploy/local/install-kube-validate.sh >/dev/null
deploy/local/install-promql.sh >/dev/null
phase install
cargo fmt --all -- --check
phase fmt
# Clippy's own protocol (what `cargo clippy -- -D warnings` sets): the driver wraps rustc for the
# workspace's crates only, its arguments separated by `__CLIPPY_HACKERY__`.
export RUSTC_WORKSPACE_WRAPPER
RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings"
deploy/local/check-lint-wrapper.sh
# Cargo's messages (which test binaries it built) to a file for the runner, its diagnostics as
# always to the terminal.
mkdir -p target/testrun
cargo test --locked --workspace --all-targets --no-run --message-format=json-render-diagnostics \
  >target/testrun/artifacts.json
phase build
# Every test in a process of its own, a few side by side (deploy/local/test-groups.toml: how many
# at once, which may not overlap, when a hung one is killed); the simulation's seed sweeps a thread
# each.
# Documentation tests first (run-tests.py runs the test binaries only), their report to a file:
# the runner's closing line ('tests: N passed, N failed') must be the only count CI reads (cargo's
# 'test result: ok. 0 passed' of crates without doc tests was read as a run of no test).
if ! cargo test --locked --workspace --doc >target/testrun/doc-tests.log 2>&1; then
  cat target/testrun/doc-tests.log
  exit 1
fi
echo "test.sh: doc tests: $(grep -c '^test .* ok$' target/testrun/doc-tests.log || true) ok" \
  "(target/testrun/doc-tests.log)"
deploy/local/check-test-runner.sh
DST_THREADS=1 deploy/local/run-tests.py target/testrun/artifacts.json "$@"
phase run
echo "test.sh: ${phases[*]} — total $((SECONDS - started))s"
cat target/testrun/result

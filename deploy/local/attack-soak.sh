#!/usr/bin/env bash
# The attack suite's body-budget attack at production sizes (chaos/tests/it/attacks.rs, run in CI
# at 24 bodies of 6 MiB against a 32 MiB budget): 300 clients each stream a 60 MiB body at one
# release-built replica with the default 1 GiB `--max-buffered-body-bytes`; every stream must be
# answered (served or a 503 `body-buffer-budget`) and the replica's RSS stay within baseline +
# 4 × budget. Prints the outcome counts and the RSS peak.
#   deploy/local/attack-soak.sh [CLIENTS] [BODY_MIB] [BUDGET_MIB]
set -euo pipefail
source "$(dirname "$0")/prepare.sh"
cargo build --release --locked -p node --bin epp
EPP_BIN="$PWD/target/release/epp" \
  EPP_ATTACK_CLIENTS="${1:-300}" EPP_ATTACK_BODY_MIB="${2:-60}" EPP_ATTACK_BUDGET_MIB="${3:-1024}" \
  exec cargo test --locked -p chaos --test it -- \
  attacks::concurrent_large_bodies_stay_within_the_body_budget --exact --nocapture

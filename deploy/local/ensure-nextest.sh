#!/usr/bin/env bash
# Makes sure cargo-nextest (the test runner of deploy/local/test.sh) is installed, at least the
# version .config/nextest.toml asks for: installs it from crates.io when missing or older.
set -euo pipefail
cd "$(dirname "$0")/../.."
want=$(sed -n 's/^nextest-version = "\(.*\)"/\1/p' .config/nextest.toml)
have=$(cargo nextest --version 2>/dev/null | sed -n 's/^cargo-nextest \([0-9.]*\).*/\1/p' | head -n 1)
if [ -z "$have" ] || [ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -n 1)" != "$want" ]; then
  echo "installing cargo-nextest (have: ${have:-none}, need: $want)" >&2
  cargo install --locked cargo-nextest
fi

#!/usr/bin/env bash
# Checks that the lint set-up deploy/local/test.sh exports (RUSTC_WORKSPACE_WRAPPER=clippy-driver,
# CLIPPY_ARGS=-D warnings) really refuses a Clippy warning, so that a change in Clippy's protocol
# fails the test command instead of silently building without lints. Compiles a two-line crate.
set -euo pipefail
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
printf '[package]\nname = "lint-check"\nversion = "0.0.0"\nedition = "2024"\n\n[workspace]\n' \
  > "$work/Cargo.toml"
printf 'fn main() {\n    println!("{}", Vec::<u8>::new().len() == 0);\n}\n' > "$work/src/main.rs"
if cargo build --quiet --offline --manifest-path "$work/Cargo.toml" --target-dir "$work/target" \
  2> "$work/err"; then
  echo "check-lint-wrapper: a crate with a Clippy warning compiled: the lints are not running" >&2
  exit 1
fi
if ! grep -q 'clippy::len.zero' "$work/err"; then
  echo "check-lint-wrapper: the crate failed, but not on the Clippy lint:" >&2
  cat "$work/err" >&2
  exit 1
fi

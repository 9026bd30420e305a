#!/usr/bin/env bash
# Makes sure a fresh machine can build the workspace: a Rust toolchain (cargo) and a C/C++ compiler
# (bundled C dependencies), python3 (Envoy's venv), openssl (test certificates). Installs Debian packages only when something is missing.
set -euo pipefail
missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-venv)
# The consensus TLS test makes its certificates with the openssl CLI.
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing build tools: ${missing[*]} (and no apt-get to install them)" >&2
    exit 1
  fi
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain (rustup) first" >&2
  exit 1
fi

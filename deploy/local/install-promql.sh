#!/usr/bin/env bash
# Installs Prometheus' PromQL grammar (@prometheus-io/lezer-promql, the parser of Prometheus' web
# UI) into the workspace's .venv/promql when it is not there yet; check-promql.cjs parses the
# dashboard's and the alert rules' expressions with it. Idempotent; prints the node_modules path.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dir="$root/.venv/promql"
if [ ! -f "$dir/node_modules/@prometheus-io/lezer-promql/package.json" ]; then
  source "$root/deploy/local/ensure-npm.sh"
  mkdir -p "$dir"
  npm install --silent --no-audit --no-fund --prefix "$dir" \
    @prometheus-io/lezer-promql@0.315.0 @lezer/lr@1.4 @lezer/highlight@1.2 >&2
fi
echo '[]' | node "$root/deploy/local/check-promql.cjs" "$dir/node_modules" >/dev/null
echo "$dir/node_modules"

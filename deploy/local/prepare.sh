# Sourced by demo.sh, test.sh and bench.sh: go to the workspace root, make sure the build tools are
# there, install Envoy into .venv if missing and export ENVOY_BIN.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
deploy/local/ensure-toolchain.sh
ENVOY_BIN="$(deploy/local/install-envoy.sh)"
export ENVOY_BIN

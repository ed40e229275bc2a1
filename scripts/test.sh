#!/usr/bin/env bash
# The test command: sets up the environment, the Kubernetes tools, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-k8s-tools.sh
# The real control plane the operator, devcluster and demo tests run on (built once, cached).
SPECPAIR_CONTROL_PLANE_BIN="$(bash scripts/build-control-plane.sh)"
export SPECPAIR_CONTROL_PLANE_BIN
VENV="${SPECPAIR_VENV:-.venv}"
export PATH="$PWD/.tools/bin:$PATH"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "$@"

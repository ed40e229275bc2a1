#!/usr/bin/env bash
# The test command: sets up the environment, the Kubernetes tools, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f scripts/install-k8s-tools.sh ]; then
  bash scripts/install-k8s-tools.sh
fi
VENV="${SPECPAIR_VENV:-.venv}"
export PATH="$PWD/.tools/bin:$PATH"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "$@"

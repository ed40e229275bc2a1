#!/usr/bin/env bash
# The whole specpair loop on this machine, no cluster: MLflow, a Kubernetes API emulator, the
# operator, and engine "pods" as local processes. Sets up .venv on first use (idempotent), then
# runs demo/run_demo.py; arguments are passed through (e.g. --keep to leave the MLflow UI up).
#   bash scripts/demo.sh            # first run ~15 min on 2 CPU cores, later runs ~5
#   bash scripts/demo.sh --keep     # then browse the releases in MLflow until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECPAIR_VENV:-.venv}"
bash scripts/setup.sh
exec "$VENV/bin/python" -m demo.run_demo "$@"

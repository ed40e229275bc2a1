#!/usr/bin/env bash
# The whole specpair loop on this machine: MLflow, a real Kubernetes control plane (devcluster:
# etcd, kube-apiserver, controller-manager, scheduler, built once from the pinned Go modules),
# the chart installed by helm, the operator, and engine pods run as local processes by the
# devcluster node. Sets up .venv and the tools on first use (idempotent), then runs
# demo/run_demo.py; arguments are passed through (e.g. --keep to leave the MLflow UI up).
#   bash scripts/demo.sh            # 19.5 min measured on 2 busy CPU cores (docs/demo.md); a first run adds setup and the build
#   bash scripts/demo.sh --keep     # then browse the releases in MLflow until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECPAIR_VENV:-.venv}"
bash scripts/setup.sh
bash scripts/install-k8s-tools.sh
SPECPAIR_CONTROL_PLANE_BIN="$(bash scripts/build-control-plane.sh)"
export SPECPAIR_CONTROL_PLANE_BIN
export PATH="$PWD/.tools/bin:$PATH"
exec "$VENV/bin/python" -m demo.run_demo "$@"

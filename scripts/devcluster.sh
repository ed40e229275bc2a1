#!/usr/bin/env bash
# A real Kubernetes control plane on this machine, for people:
#   scripts/devcluster.sh up      builds (once) and starts it; prints the kubeconfig path
#   scripts/devcluster.sh down    stops it
#   scripts/devcluster.sh status  JSON description of the running cluster
# Then: export KUBECONFIG=$(scripts/devcluster.sh up); kubectl get nodes
# Options after the command: --nodes N, --gpus N (nvidia.com/gpu per node), --pods-per-node N
# (each node's pods capacity, default 30), --dir FOLDER.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
bash scripts/install-k8s-tools.sh >&2
bash scripts/build-control-plane.sh >/dev/null
VENV="${SPECPAIR_VENV:-.venv}"
export PATH="$PWD/.tools/bin:$PATH"
exec "$VENV/bin/python" -m specpair_devcluster "$@"

#!/usr/bin/env bash
# The test command: sets up the environment, the Kubernetes tools, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-k8s-tools.sh
# vLLM in its own virtualenv (cold ~2.5 min, warm ~7 s): the tests marked `vllm` run against it,
# and fail rather than skip here (SPECPAIR_REQUIRE_VLLM). Locally, `-m "not vllm"` leaves them out.
bash scripts/setup-vllm.sh >&2
# PyPI's speculators in a virtualenv of its own (cold ~80 s on a quiet machine): the independent
# producer of the EAGLE-3 head tests/engine/test_engine_eagle3.py loads in our engine and vLLM.
bash scripts/setup-speculators.sh >&2
export SPECPAIR_REQUIRE_VLLM=1
# Tests that need a tool or a kernel feature fail rather than skip here too (tests/ci_skips.py).
export SPECPAIR_CI=1
# The real control plane the operator, devcluster and demo tests run on (built once, cached).
SPECPAIR_CONTROL_PLANE_BIN="$(bash scripts/build-control-plane.sh)"
export SPECPAIR_CONTROL_PLANE_BIN
# A real Prometheus for the observability tests (built once, cached; after the control plane: they share the Go build cache).
SPECPAIR_PROMETHEUS_BIN="$(bash scripts/build-prometheus.sh)"
export SPECPAIR_PROMETHEUS_BIN
# Real KEDA (operator and metrics API server) for the autoscaling test (built once, cached; cold it
# is the longest build here: docs/devcluster.md).
SPECPAIR_KEDA_BIN="$(bash scripts/build-keda.sh)"
export SPECPAIR_KEDA_BIN
# Traefik, a real Gateway API gateway, and the Gateway API CRDs for the gateway canary test (built
# once, cached; cold about 1,700 packages: docs/devcluster.md#gateway).
SPECPAIR_GATEWAY_BIN="$(bash scripts/build-gateway.sh)"
export SPECPAIR_GATEWAY_BIN
# Flux's source-controller and kustomize-controller for the GitOps test (built once, cached; cold
# about 2,500 packages, 15.6 CPU-min: docs/devcluster.md#flux).
SPECPAIR_FLUX_BIN="$(bash scripts/build-flux.sh)"
export SPECPAIR_FLUX_BIN
VENV="${SPECPAIR_VENV:-.venv}"
export PATH="$PWD/.tools/bin:$PATH"
# Three workers on the two cores (SPECPAIR_TEST_WORKERS): the long end-to-end files mostly wait
# on pods, gates and the operator's passes (test_operator_gate_retry.py alone: 64 CPU-s in 137 s,
# test_operator_e2e.py: 145 CPU-s in 229 s, pods and servers included), so two such files side
# by side kept about one of the two cores busy. A file's tests stay on one worker (--dist
# loadfile), so module fixtures are built once. Each worker starts its own control plane; their
# pod networks and ports never collide. Files are handed out in the order tests/conftest.py
# collects them, longest first (--no-loadscope-reorder: xdist's own order, most tests first,
# left the one-test files that take minutes for the end).
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${SPECPAIR_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"

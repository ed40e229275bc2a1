#!/usr/bin/env bash
# Creates (or reuses) a separate virtualenv holding PyPI's `speculators` 0.9.0 (vLLM's project
# for training and writing EAGLE-3 heads): the independent producer of the EAGLE-3 heads the
# tests load in our engine and in vLLM (tests/engine/test_engine_eagle3.py). It pins
# transformers <= 5.19 and other versions ours need not share, hence a venv of its own.
#
#   PY=$(bash scripts/setup-speculators.sh | tail -1)   # the venv's python is the last stdout line
#
# Where: ${SPECPAIR_SPECULATORS_VENV:-$HOME/.cache/specpair/speculators-venv-0.9.0}. Progress goes
# to stderr. Warm (the venv imports speculators 0.9.0 on torch 2.13.0, and not specpair): only
# that check, a few seconds. Cold: ~80 s on a quiet machine (16 min measured beside six other
# engineers' jobs on 2 cores, 2026-12-06; ~5 GB, torch's CUDA wheels included).
#
# The venv holds nothing of ours: the tests run its python with -P from outside the repository,
# on a script that writes a head into a folder, and read that folder back.
set -euo pipefail
unset PYTHONPATH PYTHONHOME
SPECULATORS_VERSION=0.9.0
TORCH_VERSION=2.13.0
VENV="${SPECPAIR_SPECULATORS_VENV:-$HOME/.cache/specpair/speculators-venv-$SPECULATORS_VERSION}"
PY="$VENV/bin/python"
say() { echo "==> $*" >&2; }

# Checked from / with -P so nothing of the caller's directory can be imported by accident.
venv_ok() {
  [ -x "$PY" ] || return 1
  local out
  if out=$(cd / && "$PY" -P - 2>&1 <<CHECK
import sys, torch
from importlib.metadata import version
problems = []
try:
    from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    from speculators.train.cli import create_transformer_layer_config  # noqa: F401
except Exception as exc:
    problems.append(f"cannot import speculators: {exc!r}")
else:
    if version("speculators") != "$SPECULATORS_VERSION":
        problems.append(f"speculators is {version('speculators')}, not $SPECULATORS_VERSION")
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    problems.append(f"torch is {torch.__version__}, not $TORCH_VERSION")
try:
    import specpair  # noqa: F401  (nothing of ours belongs there)
    problems.append(f"specpair is importable there ({specpair.__file__})")
except ImportError:
    pass
print("; ".join(problems))
sys.exit(1 if problems else 0)
CHECK
  ); then
    return 0
  fi
  if [ "${1:-}" = say ]; then echo "$out" | tail -5 >&2; fi
  return 1
}

if venv_ok; then
  say "speculators $SPECULATORS_VERSION ready in $VENV"
  echo "$PY"
  exit 0
fi

start=$SECONDS
if [ ! -x "$PY" ]; then
  say "creating virtualenv $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" >&2
fi
"$PY" -m pip install -q --upgrade pip >&2

# Downloads (torch is 2.7 GB): a failed attempt (a dropped connection) is retried twice.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    if "$PY" -m pip install -q "$@" >&2; then
      return 0
    fi
    say "pip install $* failed (attempt $attempt of 3)"
    sleep $((attempt * 5))
  done
  say "pip install $* failed 3 times; see the pip output above"
  return 1
}

# torch held at the vLLM venv's version (setup-vllm.sh): pip's cache serves both.
echo "torch==$TORCH_VERSION" >"$VENV/constraints.txt"
say "installing speculators $SPECULATORS_VERSION (torch held at $TORCH_VERSION)"
pip_install "torch==$TORCH_VERSION" "speculators==$SPECULATORS_VERSION" -c "$VENV/constraints.txt"

if ! venv_ok; then
  say "the speculators venv at $VENV is not usable (speculators $SPECULATORS_VERSION on torch $TORCH_VERSION, no specpair):"
  venv_ok say || true
  exit 1
fi
say "speculators $SPECULATORS_VERSION ready in $VENV ($((SECONDS - start)) s)"
echo "$PY"

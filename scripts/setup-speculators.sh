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
WHAT="speculators $SPECULATORS_VERSION on torch $TORCH_VERSION"
CHECK=$(cat <<EOF
from importlib.metadata import version
try:
    from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    from speculators.train.cli import create_transformer_layer_config  # noqa: F401
except Exception as exc:
    problems.append(f"cannot import speculators: {exc!r}")
else:
    if version("speculators") != "$SPECULATORS_VERSION":
        problems.append(f"speculators is {version('speculators')}, not $SPECULATORS_VERSION")
EOF
)
source "$(dirname "${BASH_SOURCE[0]}")/lib/side-venv.sh"

side_venv_ready_or_continue
side_venv_create

# torch held at the vLLM venv's version (setup-vllm.sh): pip's cache serves both.
echo "torch==$TORCH_VERSION" >"$VENV/constraints.txt"
say "installing speculators $SPECULATORS_VERSION (torch held at $TORCH_VERSION)"
pip_install "torch==$TORCH_VERSION" "speculators==$SPECULATORS_VERSION" -c "$VENV/constraints.txt"

side_venv_verified

